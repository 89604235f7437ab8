"""The environment contract, turned into a frozen, validated :class:`Config`.

A swarmfd process learns its place in the job from these variables (the names
torch.distributed uses, so launchers and scripts carry over unchanged):

``WORLD_SIZE``        number of ranks in the job (default 1)
``RANK``              this process's rank, 0..WORLD_SIZE-1 (default 0)
``LOCAL_RANK``        rank among the processes on this host (default: RANK when
                      the world is one host, else derived at rendezvous)
``LOCAL_WORLD_SIZE``  number of ranks on this host
``MASTER_ADDR``       host name or address of rank 0 (required when WORLD_SIZE > 1)
``MASTER_PORT``       the port torch.distributed's store uses (default 29500, as
                      torch's); swarmfd binds none of it, it derives its own below
``SWARMFD_PORT``      the port of swarmfd's rendezvous, served by rank 0 (default:
                      MASTER_PORT + 1, so 29501), so that a script can call
                      ``torch.distributed.init_process_group`` beside swarmfd, before
                      or after it, without the two binding the same port
``SWARMFD_TIMEOUT``   seconds any collective may wait for a peer (default 300)
``SWARMFD_INIT_TIMEOUT`` seconds ``init`` waits for every rank to join (default: the
                      timeout above). Ranks of a Swarm job can start minutes apart
                      (an image pull on one node); a job that wants a collective
                      stuck for 30 s to fail can still give its ranks 10 minutes to
                      arrive.

and, for the job's security (see :func:`load_secret`):

``SWARMFD_SECRET_FILE``  path of the file holding the job secret (default
                      ``/run/secrets/swarmfd_secret``, where ``swarmfd deploy``
                      mounts it); the secret itself never goes in the environment
``SWARMFD_AUTH``      ``off`` to run without authentication (trusted networks only)
``SWARMFD_ENCRYPT``   ``1`` to encrypt the data plane too, ``0`` not to (default
                      :data:`DEFAULT_ENCRYPT`)
``SWARMFD_DATA_PLANE`` ``socket`` (plain TCP sockets, the default) or ``zmq``
                      (ZeroMQ; the default and the only choice with
                      ``SWARMFD_ENCRYPT=1``); see :func:`data_plane`
``SWARMFD_STASH_MB``  the MiB a peer may have waiting in this rank's memory before a
                      receive asks for them (default :data:`DEFAULT_STASH_MB`); see
                      :func:`stash_limit`
``SWARMFD_JOB_ID``    the launch this rank belongs to (``swarmfd run`` and ``swarmfd
                      deploy`` draw one): ranks of another launch are refused at
                      rendezvous, even with the same secret; see :func:`job_id`

and, for elastic jobs (see :func:`elastic_options` and :mod:`swarmfd.elastic`):

``SWARMFD_ELASTIC``   ``1``: a lost rank costs a re-formation of the world, not the job
``SWARMFD_ELASTIC_MIN_N`` the fewest ranks the job goes on with (default 1)
``SWARMFD_ELASTIC_TIMEOUT`` seconds the job may stay below the minimum (default 60)
``SWARMFD_ELASTIC_JOIN`` ``1``: this process replaces a lost rank and joins the running
                      job; ``auto``: it joins when a formed job answers, else it starts
                      with the others (a Swarm task, which cannot tell a restart)
``SWARMFD_ELASTIC_PEERS`` where the ranks' elastic agents listen: ``host:port`` items,
                      one per starting rank (``swarmfd run``), or a name whose every
                      address is one (``tasks.<service>`` on a Swarm)
``SWARMFD_ELASTIC_PORT`` the agents' port where PEERS gives none (default: the
                      rendezvous port + 1)
``SWARMFD_ELASTIC_DONE`` a file ``swarmfd run`` writes once the job has finished: a
                      replacement that finds no member then exits 0

and, for where the ranks are (see :func:`transport_mode`, :func:`node_name`):

``SWARMFD_TRANSPORT`` ``auto`` (the default: shared memory between the ranks of one
                      host) or ``tcp`` (TCP only)
``SWARMFD_NODE``      the name of this rank's host (default: its host name); ranks
                      are grouped by it for LOCAL_RANK and host_group()
``SWARMFD_SHM_DIR``   a directory every rank of a host mounts (a per-node volume on
                      a Swarm): the host's ranks meet there to share memory when they
                      do not share a network namespace (containers)
``SWARMFD_HIERARCHY`` ``auto`` (two-level collectives where they are faster) or
                      ``off`` (the flat algorithms, for comparison)

and, for what a running job tells of itself (see :mod:`swarmfd.observe`):

``SWARMFD_STALL_WARN`` seconds a collective may wait before the waiting rank logs
                      which ranks have not entered it (default 60; 0: never); its
                      timeout is unchanged
``SWARMFD_STATUS``    seconds between the status lines each rank writes to stderr for
                      ``swarmfd top`` (unset or 0: none); ``swarmfd run`` and ``swarmfd
                      deploy`` set it

Every value is validated here, once; bad input raises :class:`ConfigError`
(a ``ValueError``) naming the variable, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = [
    "DATA_PLANES",
    "DEFAULT_ELASTIC_TIMEOUT",
    "DEFAULT_ENCRYPT",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_RENDEZVOUS_PORT_OFFSET",
    "DEFAULT_SECRET_FILE",
    "DEFAULT_STALL_WARN",
    "DEFAULT_STASH_MB",
    "DEFAULT_TIMEOUT",
    "DOCKER_SECRETS_DIR",
    "ENV_AUTH",
    "ENV_CMA",
    "ENV_DATA_PLANE",
    "ENV_ELASTIC",
    "ENV_ELASTIC_DONE",
    "ENV_ELASTIC_JOIN",
    "ENV_ELASTIC_MIN_N",
    "ENV_ELASTIC_PEERS",
    "ENV_ELASTIC_PORT",
    "ENV_ELASTIC_TIMEOUT",
    "ENV_ENCRYPT",
    "ENV_HIERARCHY",
    "ENV_INIT_TIMEOUT",
    "ENV_JOB_ID",
    "ENV_LOCAL_RANK",
    "ENV_LOCAL_WORLD_SIZE",
    "ENV_MALLOC",
    "ENV_MASTER_ADDR",
    "ENV_MASTER_PORT",
    "ENV_NODE",
    "ENV_OMP_THREADS",
    "ENV_PORT",
    "ENV_RANK",
    "ENV_RESTART_COUNT",
    "ENV_SECRET_FILE",
    "ENV_SHM_DIR",
    "ENV_SPIN",
    "ENV_STALL_WARN",
    "ENV_STASH_MB",
    "ENV_STATUS",
    "ENV_TIMEOUT",
    "ENV_TRANSPORT",
    "ENV_WORLD_SIZE",
    "GLIBC_SETTINGS",
    "HIERARCHIES",
    "MALLOCS",
    "MAX_SECRET_BYTES",
    "MIN_SECRET_CHARS",
    "SPIN_MODES",
    "TRANSPORTS",
    "Config",
    "ElasticOptions",
    "Options",
    "auth_enabled",
    "check_secret",
    "cma_enabled",
    "config_from_env",
    "data_plane",
    "elastic_options",
    "encrypt_enabled",
    "hierarchy_mode",
    "job_id",
    "load_secret",
    "malloc_mode",
    "master_port",
    "node_name",
    "options_from_env",
    "parse_env_float",
    "parse_env_int",
    "parse_env_port",
    "parse_env_seconds",
    "rendezvous_port",
    "require_secret",
    "shm_dir",
    "spin_mode",
    "stash_limit",
    "transport_mode",
    "usable_cores",
]

#: MASTER_PORT when unset: torch.distributed's default, so both read the same port.
DEFAULT_MASTER_PORT = 29500
#: swarmfd's rendezvous port when SWARMFD_PORT is unset: MASTER_PORT + this. MASTER_PORT
#: itself is torch's (its TCPStore binds it on rank 0 for as long as the group lives), so
#: swarmfd takes the next port: predictable for firewalls and Swarm networks, and free of
#: torch whichever of the two initialises first.
DEFAULT_RENDEZVOUS_PORT_OFFSET = 1
DEFAULT_TIMEOUT = 300.0
#: SWARMFD_STALL_WARN when unset: a collective waiting this long is reported.
DEFAULT_STALL_WARN = 60.0

ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
#: swarmfd's own rendezvous port (see :func:`rendezvous_port`).
ENV_PORT = "SWARMFD_PORT"
ENV_TIMEOUT = "SWARMFD_TIMEOUT"
ENV_INIT_TIMEOUT = "SWARMFD_INIT_TIMEOUT"
ENV_RESTART_COUNT = "SWARMFD_RESTART_COUNT"
ENV_SECRET_FILE = "SWARMFD_SECRET_FILE"
ENV_AUTH = "SWARMFD_AUTH"
ENV_ENCRYPT = "SWARMFD_ENCRYPT"
ENV_DATA_PLANE = "SWARMFD_DATA_PLANE"
ENV_TRANSPORT = "SWARMFD_TRANSPORT"
ENV_NODE = "SWARMFD_NODE"
ENV_SHM_DIR = "SWARMFD_SHM_DIR"
ENV_HIERARCHY = "SWARMFD_HIERARCHY"
#: Whether waits poll before they block (see swarmfd.comm.spin).
ENV_SPIN = "SWARMFD_SPIN"
#: Whether init tunes glibc's malloc for message buffers (see swarmfd.comm.malloc).
ENV_MALLOC = "SWARMFD_MALLOC"
#: Whether the ranks of a host may read each other's memory (see swarmfd.comm.cma).
ENV_CMA = "SWARMFD_CMA"
#: How much a peer may have waiting in this rank's stash (see :func:`stash_limit`).
ENV_STASH_MB = "SWARMFD_STASH_MB"
#: The launch a rank belongs to (see :func:`job_id`).
ENV_JOB_ID = "SWARMFD_JOB_ID"
#: Elastic jobs (see :func:`elastic_options`).
ENV_ELASTIC = "SWARMFD_ELASTIC"
ENV_ELASTIC_MIN_N = "SWARMFD_ELASTIC_MIN_N"
ENV_ELASTIC_TIMEOUT = "SWARMFD_ELASTIC_TIMEOUT"
ENV_ELASTIC_JOIN = "SWARMFD_ELASTIC_JOIN"
ENV_ELASTIC_PEERS = "SWARMFD_ELASTIC_PEERS"
ENV_ELASTIC_PORT = "SWARMFD_ELASTIC_PORT"
ENV_ELASTIC_DONE = "SWARMFD_ELASTIC_DONE"
#: Seconds an elastic job may stay below its minimum of ranks (SWARMFD_ELASTIC_TIMEOUT).
DEFAULT_ELASTIC_TIMEOUT = 60.0
#: Seconds before a waiting collective is reported (see swarmfd.comm.status).
ENV_STALL_WARN = "SWARMFD_STALL_WARN"
#: Seconds between a rank's status lines (see swarmfd.statusline).
ENV_STATUS = "SWARMFD_STATUS"
#: Set by a Swarm service for each task (``{{.Task.Slot}}``, 1-based): see swarmfd.entrypoint.
ENV_TASK_SLOT = "SWARMFD_TASK_SLOT"
#: How long the container entrypoint waits for MASTER_ADDR to resolve.
ENV_RESOLVE_TIMEOUT = "SWARMFD_RESOLVE_TIMEOUT"
#: OpenMP's thread count: torch's intra-op threads, and OpenBLAS's (numpy's) and MKL's
#: when their own variables are unset. Not swarmfd's, but ``swarmfd run`` sets it for the
#: ranks when it is unset (see swarmfd.launch.rank_threads).
ENV_OMP_THREADS = "OMP_NUM_THREADS"
#: SWARMFD_TRANSPORT: shared memory between the ranks of one host where possible, or TCP.
TRANSPORTS = ("auto", "tcp")
#: SWARMFD_HIERARCHY: two-level algorithms where they are faster, or the flat ones.
HIERARCHIES = ("auto", "off")
#: SWARMFD_MALLOC: init tunes glibc's malloc thresholds, or leaves them to the system.
MALLOCS = ("tuned", "system")
#: SWARMFD_SPIN: poll where the host's busy threads have cores enough (yielding the core
#: where two share one), always, or never.
SPIN_MODES = ("auto", "on", "off")
#: The data planes of the TCP path: plain sockets (the default, see swarmfd/lanes.py) or
#: ZeroMQ (required for SWARMFD_ENCRYPT=1: CURVE).
DATA_PLANES = ("socket", "zmq")

#: Where ``swarmfd deploy`` mounts the job secret (a Docker secret) in every rank.
DEFAULT_SECRET_FILE = "/run/secrets/swarmfd_secret"
#: Shortest job secret accepted (``swarmfd run``/``deploy`` write 64 hex characters).
MIN_SECRET_CHARS = 32
#: A secret file larger than this is not a secret file (refused before reading it all).
MAX_SECRET_BYTES = 4096
#: MiB a peer may have waiting in a rank's stash (messages no receive asked for yet) when
#: SWARMFD_STASH_MB is unset. A correct peer's stash holds what it sent for the calls
#: this rank has not reached yet, mostly a piece or a chunk of each; the most is a
#: gather's or a reduce's root, which holds every other rank's whole buffer until it
#: reads it: a job whose rank sends more than this in one such call raises the variable.
DEFAULT_STASH_MB = 256
#: Data-plane encryption when SWARMFD_ENCRYPT is unset. Chosen by measurement
#: (docs/security.md): CURVE costs 2-3x the time of an all_reduce at 1 MiB and at 64 MiB, while
#: authentication alone (rendezvous always encrypted, data plane authenticated) already
#: keeps strangers from joining, injecting data or aborting a job.
DEFAULT_ENCRYPT = False


@dataclass(frozen=True)
class Options:
    """The job-wide settings the environment gives (the ``SWARMFD_*`` variables of the
    module docstring), read once, at init, by :func:`options_from_env`: the rest of
    the core takes them from here, never from the environment."""

    #: SWARMFD_DATA_PLANE: the TCP data plane, "socket" or "zmq".
    data_plane: str = "socket"
    #: SWARMFD_ENCRYPT: the data plane is encrypted (zmq's CURVE).
    encrypt: bool = DEFAULT_ENCRYPT
    #: SWARMFD_TRANSPORT: "auto" (shared memory inside a host) or "tcp".
    transport: str = "auto"
    #: SWARMFD_HIERARCHY: "auto" (two-level collectives where faster) or "off".
    hierarchy: str = "auto"
    #: SWARMFD_SPIN: "auto", "on" or "off" (see swarmfd.comm.spin).
    spin: str = "auto"
    #: SWARMFD_MALLOC: "tuned" or "system" ("system" too where the user set glibc's own).
    malloc: str = "tuned"
    #: SWARMFD_CMA: shared memory may read and write peers' memory directly.
    cma: bool = True
    #: SWARMFD_NODE, else the host name: what groups ranks by host.
    node: str = ""
    #: SWARMFD_SHM_DIR: where a host's ranks meet to share memory ("": their namespace).
    shm_dir: str = ""
    #: SWARMFD_TASK_SLOT is set: a Swarm task (errors name the slot too).
    swarm_task: bool = False
    #: MASTER_PORT when it is a valid port (torch's store: the data planes keep off it).
    torch_port: int | None = None
    #: SWARMFD_STASH_MB, in bytes: what a peer may have waiting in this rank's stash.
    stash_limit: int = DEFAULT_STASH_MB << 20
    #: SWARMFD_JOB_ID: the launch this rank belongs to ("": ranks started by hand).
    job: str = ""
    #: SWARMFD_STALL_WARN: seconds before a waiting collective is reported (0: never).
    stall_warn: float = DEFAULT_STALL_WARN
    #: SWARMFD_STATUS: seconds between status lines on stderr (0: none).
    status: float = 0.0
    #: SWARMFD_ELASTIC and its companions; None: not an elastic job.
    elastic: ElasticOptions | None = None


@dataclass(frozen=True)
class ElasticOptions:
    """An elastic job's settings (the ``SWARMFD_ELASTIC_*`` variables, see
    :func:`elastic_options`)."""

    #: SWARMFD_ELASTIC_MIN_N: the fewest ranks the job goes on with.
    min_n: int = 1
    #: SWARMFD_ELASTIC_TIMEOUT: seconds the job may stay below ``min_n``.
    timeout: float = DEFAULT_ELASTIC_TIMEOUT
    #: SWARMFD_ELASTIC_JOIN: "" (a starting rank), "1" (a replacement) or "auto".
    join: str = ""
    #: SWARMFD_ELASTIC_PEERS: (host, port or None) of every starting rank's agent, or
    #: names each of whose addresses is one.
    peers: tuple[tuple[str, int | None], ...] = ()
    #: SWARMFD_ELASTIC_PORT: the agents' port where ``peers`` gives none.
    port: int = DEFAULT_MASTER_PORT + DEFAULT_RENDEZVOUS_PORT_OFFSET + 1
    #: SWARMFD_ELASTIC_DONE: the file ``swarmfd run`` writes once the job finished.
    done_file: str = ""


#: glibc's own malloc settings in the environment, which SWARMFD_MALLOC=tuned respects.
GLIBC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def options_from_env(environ: Mapping[str, str] | None = None) -> Options:
    """The :class:`Options` of the environment, every value checked (ConfigError naming
    the variable, the value and what was expected)."""
    env = os.environ if environ is None else environ
    malloc = malloc_mode(env)
    return Options(
        data_plane=data_plane(env), encrypt=encrypt_enabled(env),
        transport=transport_mode(env), hierarchy=hierarchy_mode(env), spin=spin_mode(env),
        malloc="system" if any(name in env for name in GLIBC_SETTINGS) else malloc,
        cma=cma_enabled(env), node=node_name(env), shm_dir=shm_dir(env),
        swarm_task=bool((env.get(ENV_TASK_SLOT) or "").strip()),
        torch_port=master_port(env), stash_limit=stash_limit(env), job=job_id(env),
        stall_warn=parse_env_seconds(env, ENV_STALL_WARN, DEFAULT_STALL_WARN,
                                     "seconds a collective may wait before it is "
                                     "reported, 0 to never report"),
        status=parse_env_seconds(env, ENV_STATUS, 0.0, "seconds between status lines "
                                 "(swarmfd run and deploy set it), 0 for none"),
        elastic=elastic_options(env))


@dataclass(frozen=True)
class Config:
    """Where this process sits in the job. Immutable; validated on creation.

    ``local_rank``/``local_world_size`` of ``None`` mean "not given": the
    process group fills them in at rendezvous by grouping ranks per host.
    ``rendezvous_port`` is the port rank 0's rendezvous binds on ``master_addr``
    (swarmfd's own: ``SWARMFD_PORT``, else ``MASTER_PORT + 1``, or ``fd.init``'s
    ``master_port=`` argument), not ``MASTER_PORT``, which is torch.distributed's.
    """

    world_size: int
    rank: int
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    rendezvous_port: int = DEFAULT_MASTER_PORT + DEFAULT_RENDEZVOUS_PORT_OFFSET
    timeout: float = DEFAULT_TIMEOUT
    restart_count: int = 0
    #: Seconds init may wait for every rank to join; None: ``timeout``.
    init_timeout: float | None = None
    #: The job-wide settings of the environment (read once, with the rest).
    options: Options = field(default_factory=Options)
    is_main: bool = field(init=False)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, minimum=1)
        check_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ConfigError(
                f"rank {self.rank} is out of range: expected 0 <= rank < world_size "
                f"({self.world_size})"
            )
        if self.local_world_size is not None:
            check_int("local_world_size", self.local_world_size, minimum=1)
            if self.local_world_size > self.world_size:
                raise ConfigError(
                    f"local_world_size {self.local_world_size} exceeds world_size "
                    f"{self.world_size}"
                )
        if self.local_rank is not None:
            check_int("local_rank", self.local_rank, minimum=0)
            limit = self.local_world_size if self.local_world_size is not None else self.world_size
            if self.local_rank >= limit:
                raise ConfigError(
                    f"local_rank {self.local_rank} is out of range: expected 0 <= local_rank < "
                    f"{'local_world_size' if self.local_world_size is not None else 'world_size'}"
                    f" ({limit})"
                )
        check_int("rendezvous_port", self.rendezvous_port, minimum=1, what="a TCP port")
        if self.rendezvous_port > 65535:
            raise ConfigError(f"rendezvous_port {self.rendezvous_port} is out of range: "
                              "expected a TCP port 1..65535")
        if self.master_addr is not None and (
            not isinstance(self.master_addr, str) or not self.master_addr.strip()
        ):
            raise ConfigError(
                f"master_addr must be a non-empty host name, got {self.master_addr!r}"
            )
        if self.world_size > 1 and self.master_addr is None:
            raise ConfigError(
                f"a world of {self.world_size} ranks needs MASTER_ADDR (the address of rank 0); "
                "set the environment variable MASTER_ADDR or pass master_addr="
            )
        check_seconds("timeout", self.timeout)
        if self.init_timeout is not None:
            check_seconds("init_timeout", self.init_timeout)
        check_int("restart_count", self.restart_count, minimum=0)
        object.__setattr__(self, "is_main", self.rank == 0)

    @property
    def join_timeout(self) -> float:
        """Seconds init waits for every rank to join: ``init_timeout``, else ``timeout``."""
        return self.timeout if self.init_timeout is None else float(self.init_timeout)


def check_seconds(name: str, value: object, *, allow_zero: bool = False,
                  type_error: type[Exception] = ConfigError,
                  value_error: type[Exception] = ConfigError) -> None:
    """``value`` must be a finite number of seconds, > 0 (or >= 0 with ``allow_zero``).

    The one check of every timeout and grace period (the Config, the launcher, the
    Swarm spec); the callers choose the exception types (a Config raises ConfigError,
    the launcher's LaunchConfig TypeError and ValueError).
    """
    expected = "a finite number of seconds >= 0" if allow_zero else (
        "a positive number of seconds")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(f"{name} must be {expected}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise value_error(f"{name} must be {expected}, got {value!r}")


def check_int(name: str, value: object, *, minimum: int, what: str = "",
              type_error: type[Exception] = ConfigError,
              value_error: type[Exception] = ConfigError) -> None:
    """``value`` must be an integer >= ``minimum`` (``what`` says what it counts)."""
    about = f" ({what})" if what else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(f"{name} must be an integer{about}, got {value!r} "
                         f"({type(value).__name__})")
    if value < minimum:
        raise value_error(f"{name} must be an integer >= {minimum}{about}, got {value}")


def parse_env_int(environ: Mapping[str, str], name: str, *, minimum: int = 0,
                  hint: str = "") -> int | None:
    """Read an integer environment variable; ``None`` when unset or empty.

    ``hint`` is appended to the error message (where the value should come from).
    """
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer: "
            f"expected an integer >= {minimum}{hint}"
        ) from None
    if value < minimum:
        raise ConfigError(
            f"environment variable {name}={raw!r} is invalid: expected an integer >= {minimum}"
            f"{hint}"
        )
    return value


def parse_env_port(environ: Mapping[str, str], name: str) -> int | None:
    """Read a TCP port (1..65535) from the environment; ``None`` when unset or empty."""
    value = parse_env_int(environ, name, minimum=1, hint=" (a TCP port, 1..65535)")
    if value is not None and value > 65535:
        raise ConfigError(f"environment variable {name}={environ[name]!r} is invalid: "
                          "expected a TCP port, 1..65535")
    return value


def master_port(environ: Mapping[str, str] | None = None) -> int | None:
    """``MASTER_PORT`` (torch.distributed's), or None when unset or not a port (swarmfd
    only keeps its data planes off it: see :func:`rendezvous_port` for where it is
    checked strictly)."""
    env = os.environ if environ is None else environ
    try:
        return parse_env_port(env, ENV_MASTER_PORT)
    except ConfigError:
        return None


def rendezvous_port(environ: Mapping[str, str] | None = None) -> int:
    """The port swarmfd's rendezvous binds on rank 0: ``SWARMFD_PORT``, else
    ``MASTER_PORT + 1`` (MASTER_PORT defaulting to 29500, as torch's, so 29501).

    MASTER_PORT stays torch.distributed's: its TCPStore holds it on rank 0 for the life
    of its group, so swarmfd serving there too would make one of the two fail to bind
    (whichever came second). ConfigError on a value that is not a port, when
    MASTER_PORT is 65535 (no port follows it) with SWARMFD_PORT unset, and when both
    name the same port.
    """
    env = os.environ if environ is None else environ
    master = parse_env_port(env, ENV_MASTER_PORT)
    own = parse_env_port(env, ENV_PORT)
    if own is not None:
        if own == master:
            raise ConfigError(
                f"{ENV_PORT}={own} is {ENV_MASTER_PORT} too: {ENV_MASTER_PORT} is "
                f"torch.distributed's (its store binds it), swarmfd's rendezvous needs a port "
                f"of its own; choose another {ENV_PORT}, or unset it ({ENV_MASTER_PORT} + "
                f"{DEFAULT_RENDEZVOUS_PORT_OFFSET})")
        return own
    base = master if master is not None else DEFAULT_MASTER_PORT
    port = base + DEFAULT_RENDEZVOUS_PORT_OFFSET
    if port > 65535:
        raise ConfigError(
            f"{ENV_MASTER_PORT}={base} leaves no port for swarmfd's rendezvous, which is "
            f"{ENV_MASTER_PORT} + {DEFAULT_RENDEZVOUS_PORT_OFFSET} unless {ENV_PORT} is set: "
            f"set {ENV_PORT} to a free port, or choose a lower {ENV_MASTER_PORT}")
    return port


def parse_env_float(environ: Mapping[str, str], name: str) -> float | None:
    """Read a positive float environment variable; ``None`` when unset or empty."""
    return parse_env_seconds(environ, name, None, "a positive number of seconds",
                             allow_zero=False)


def parse_env_seconds(environ: Mapping[str, str], name: str, default: Any, expected: str,
                      allow_zero: bool = True) -> Any:
    """A number of seconds >= 0 (> 0 unless ``allow_zero``) from the environment;
    ``default`` when unset or empty; ConfigError naming the variable, its value and
    ``expected`` otherwise."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"environment variable {name}={raw!r} is invalid: expected "
                          f"{expected}")
    return value


def config_from_env(environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
    """Build a :class:`Config` from the environment contract (see module docstring).

    With none of the variables set this is a world of one. ``overrides``
    (``timeout=...`` and friends) win over the environment; ``rendezvous_port=`` makes
    SWARMFD_PORT and MASTER_PORT irrelevant (they are then not read).
    """
    env = os.environ if environ is None else environ
    world_size = parse_env_int(env, ENV_WORLD_SIZE, minimum=1)
    rank = parse_env_int(env, ENV_RANK, minimum=0)
    if world_size is None and rank not in (None, 0):
        raise ConfigError(f"{ENV_RANK}={rank} is set but {ENV_WORLD_SIZE} is not: set both")
    if world_size is not None and world_size > 1 and rank is None:
        raise ConfigError(f"{ENV_WORLD_SIZE}={world_size} is set but {ENV_RANK} is not: set both")
    port = overrides.get("rendezvous_port")
    values: dict[str, object] = {
        "world_size": world_size if world_size is not None else 1,
        "rank": rank if rank is not None else 0,
        "local_rank": parse_env_int(env, ENV_LOCAL_RANK, minimum=0),
        "local_world_size": parse_env_int(env, ENV_LOCAL_WORLD_SIZE, minimum=1),
        "master_addr": (env.get(ENV_MASTER_ADDR) or "").strip() or None,
        "rendezvous_port": port if port is not None else rendezvous_port(env),
        "timeout": parse_env_float(env, ENV_TIMEOUT) or DEFAULT_TIMEOUT,
        "restart_count": parse_env_int(env, ENV_RESTART_COUNT, minimum=0) or 0,
        "init_timeout": parse_env_float(env, ENV_INIT_TIMEOUT),
    }
    values["options"] = options = options_from_env(env)
    elastic = options.elastic
    if elastic is not None and elastic.join and values["rank"] >= values["world_size"]:  # type: ignore[operator]
        # A task beyond the starting world (a Swarm service scaled up) can only be a
        # replacement: its init waits to be let in, and the world it gets decides.
        values["options"] = dataclasses.replace(
            options, elastic=dataclasses.replace(elastic, join="1"))
        values["world_size"] = int(values["rank"]) + 1  # type: ignore[call-overload]
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values["world_size"] == 1 and values["master_addr"] is None:
        values["local_rank"] = values["local_rank"] if values["local_rank"] is not None else 0
        values["local_world_size"] = values["local_world_size"] or 1
    try:
        return Config(**values)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from the environment: {_describe(env)})") from None


def _describe(env: Mapping[str, str]) -> str:
    names = (ENV_WORLD_SIZE, ENV_RANK, ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE, ENV_MASTER_ADDR,
             ENV_MASTER_PORT, ENV_PORT)
    shown = [f"{n}={env[n]}" for n in names if n in env]
    return ", ".join(shown) if shown else "none of the variables set"


_SECRET_HINT = (
    "`swarmfd run` and `swarmfd deploy` provide one; otherwise write at least "
    f"{MIN_SECRET_CHARS} random characters to a file only the job can read (e.g. "
    "python -c 'import secrets; print(secrets.token_hex(32))' > secret; chmod 600 secret) "
    f"and set {ENV_SECRET_FILE} to its path, or pass secret= to swarmfd.init; on a trusted "
    f"network only, {ENV_AUTH}=off turns authentication off"
)


def _parse_env_switch(env: Mapping[str, str], name: str, default: bool, expected: str) -> bool:
    """An on/off environment variable: 1/on/true/yes or 0/off/false/no; ``default`` when
    unset or empty; ConfigError naming ``expected`` otherwise."""
    raw = (env.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise ConfigError(f"environment variable {name}={env.get(name)!r} is invalid: "
                      f"expected {expected}")


def auth_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``SWARMFD_AUTH=off`` (or 0/false/no): no secret, no authentication."""
    return _parse_env_switch(os.environ if environ is None else environ, ENV_AUTH, True,
                             "'on' (the default) or 'off'")


def cma_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``SWARMFD_CMA=0`` (or off/false/no): the shared-memory plane copies
    through its segments only, even where the ranks of a host could read each other's
    memory (see swarmfd.comm.cma)."""
    return _parse_env_switch(os.environ if environ is None else environ, ENV_CMA, True,
                             "1 (read peers' memory where the kernel allows it, the "
                             "default) or 0 (copy through shared segments only)")


def encrypt_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the data plane is encrypted (``SWARMFD_ENCRYPT``, default DEFAULT_ENCRYPT)."""
    return _parse_env_switch(os.environ if environ is None else environ, ENV_ENCRYPT,
                             DEFAULT_ENCRYPT, "1 (encrypt the data plane) or 0 (do not)")


def data_plane(environ: Mapping[str, str] | None = None) -> str:
    """The TCP data plane (``SWARMFD_DATA_PLANE``): 'socket' by default, 'zmq' when the
    data plane is encrypted (``SWARMFD_ENCRYPT=1``: only ZeroMQ CURVE encrypts)."""
    env = os.environ if environ is None else environ
    encrypt = encrypt_enabled(env)
    raw = (env.get(ENV_DATA_PLANE) or "").strip().lower()
    if raw == "":
        return "zmq" if encrypt else "socket"
    if raw not in DATA_PLANES:
        raise ConfigError(f"environment variable {ENV_DATA_PLANE}={env.get(ENV_DATA_PLANE)!r} is "
                          "invalid: expected 'socket' (plain TCP sockets, the default) or 'zmq' "
                          "(ZeroMQ)")
    if raw == "socket" and encrypt:
        raise ConfigError(f"{ENV_DATA_PLANE}=socket cannot be combined with {ENV_ENCRYPT}=1: the "
                          "socket data plane does not encrypt (only the zmq data plane does, "
                          f"with CURVE); unset {ENV_DATA_PLANE} or set {ENV_DATA_PLANE}=zmq to "
                          f"encrypt, or set {ENV_ENCRYPT}=0")
    return raw


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], what: str) -> str:
    raw = (env.get(name) or "").strip().lower()
    if raw == "":
        return choices[0]
    if raw not in choices:
        raise ConfigError(f"environment variable {name}={env.get(name)!r} is invalid: expected "
                          f"{what}")
    return raw


def transport_mode(environ: Mapping[str, str] | None = None) -> str:
    """``SWARMFD_TRANSPORT``: 'auto' (shared memory inside a host, the default) or 'tcp'."""
    return _choice(os.environ if environ is None else environ, ENV_TRANSPORT, TRANSPORTS,
                   "'auto' (shared memory between the ranks of one host) or 'tcp'")


def hierarchy_mode(environ: Mapping[str, str] | None = None) -> str:
    """``SWARMFD_HIERARCHY``: 'auto' (two-level collectives where faster) or 'off'."""
    return _choice(os.environ if environ is None else environ, ENV_HIERARCHY, HIERARCHIES,
                   "'auto' (two-level collectives across hosts) or 'off' (flat ones)")


def malloc_mode(environ: Mapping[str, str] | None = None) -> str:
    """``SWARMFD_MALLOC``: 'tuned' (the default: on the zmq data plane init sets glibc's
    trim and mmap thresholds, see swarmfd.comm.malloc) or 'system' (glibc's own,
    adaptive ones)."""
    return _choice(os.environ if environ is None else environ, ENV_MALLOC, MALLOCS,
                   "'tuned' (init fixes glibc's malloc thresholds for message buffers, the "
                   "default) or 'system' (glibc's own)")


def spin_mode(environ: Mapping[str, str] | None = None) -> str:
    """``SWARMFD_SPIN``: 'auto' (poll before blocking when every busy thread of the host's
    ranks has its own core, and poll yielding the core when at most two share one; the
    default: :mod:`swarmfd.comm.spin`), 'on' (1/on/true/yes: always) or 'off'
    (0/off/false/no: never poll, every wait blocks at once, the least CPU time)."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV_SPIN) or "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    try:
        return "on" if _parse_env_switch(env, ENV_SPIN, True, "") else "off"
    except ConfigError:
        raise ConfigError(f"environment variable {ENV_SPIN}={env.get(ENV_SPIN)!r} is invalid: "
                          "expected 'auto' (poll before blocking where the host's ranks "
                          "have cores enough, the default), 1 (always) or 0 (never: every wait "
                          "blocks at once)") from None


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This rank's host as the rendezvous reports it: ``SWARMFD_NODE``, else the host name."""
    import socket

    env = os.environ if environ is None else environ
    return (env.get(ENV_NODE) or "").strip() or socket.gethostname()


def shm_dir(environ: Mapping[str, str] | None = None) -> str:
    """``SWARMFD_SHM_DIR`` (where a host's ranks meet to share memory), or ""."""
    env = os.environ if environ is None else environ
    return (env.get(ENV_SHM_DIR) or "").strip()


def stash_limit(environ: Mapping[str, str] | None = None) -> int:
    """The bytes a peer may have waiting in this rank's stash: ``SWARMFD_STASH_MB`` MiB
    (default DEFAULT_STASH_MB; see swarmfd.comm.channel). A peer that sends more than
    that which no receive asked for yet fails the call, naming it."""
    env = os.environ if environ is None else environ
    mib = parse_env_int(env, ENV_STASH_MB, minimum=1,
                        hint=f" (MiB a peer may have waiting in a rank's memory; default "
                             f"{DEFAULT_STASH_MB})")
    return (mib if mib is not None else DEFAULT_STASH_MB) << 20


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """``SWARMFD_JOB_ID``: the launch this rank belongs to ("" when unset: ranks started
    by hand, which then all have none). At most 64 letters, digits, '-', '_' or '.'."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV_JOB_ID) or "").strip()
    if len(raw) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in raw):
        raise ConfigError(f"environment variable {ENV_JOB_ID}={raw[:80]!r} is invalid: "
                          "expected at most 64 letters, digits, '-', '_' or '.' (swarmfd "
                          "run and swarmfd deploy set it; unset it to start ranks by hand)")
    return raw


def elastic_options(environ: Mapping[str, str] | None = None) -> ElasticOptions | None:
    """The elastic settings of the environment (module docstring), or None when
    ``SWARMFD_ELASTIC`` is unset or 0; every value checked."""
    env = os.environ if environ is None else environ
    if not _parse_env_switch(env, ENV_ELASTIC, False, "1 (an elastic job) or 0"):
        return None
    join = (env.get(ENV_ELASTIC_JOIN) or "").strip().lower()
    if join not in ("", "0", "1", "auto"):
        raise ConfigError(f"environment variable {ENV_ELASTIC_JOIN}={env.get(ENV_ELASTIC_JOIN)!r} "
                          "is invalid: expected 1 (this process replaces a lost rank), auto "
                          "(it joins when a formed job answers) or 0")
    timeout = parse_env_float(env, ENV_ELASTIC_TIMEOUT)
    own = parse_env_port(env, ENV_ELASTIC_PORT)
    return ElasticOptions(
        min_n=parse_env_int(env, ENV_ELASTIC_MIN_N, minimum=1) or 1,
        timeout=DEFAULT_ELASTIC_TIMEOUT if timeout is None else timeout,
        join="" if join == "0" else join, peers=_peers(env.get(ENV_ELASTIC_PEERS) or ""),
        port=own if own is not None else _next_port(rendezvous_port(env)),
        done_file=(env.get(ENV_ELASTIC_DONE) or "").strip())


def _next_port(port: int) -> int:
    return port + 1 if port < 65535 else port - 1


def _peers(raw: str) -> tuple[tuple[str, int | None], ...]:
    """SWARMFD_ELASTIC_PEERS: ``host[:port]`` items, comma-separated."""
    out = []
    for item in (i.strip() for i in raw.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, ""
        if not host or any(c.isspace() for c in host) or (
                sep and not (port.isdigit() and 1 <= int(port) <= 65535)):
            raise ConfigError(f"environment variable {ENV_ELASTIC_PEERS}: {item[:80]!r} is not "
                              "host[:port] (a host name or address, a TCP port 1..65535)")
        out.append((host, int(port) if sep else None))
    return tuple(out)


def check_secret(secret: str | bytes, origin: str) -> bytes:
    """The secret as bytes, stripped; :class:`ConfigError` when it is too short.

    ``origin`` says where it came from; the message never contains the secret.
    """
    if isinstance(secret, str):
        data = secret.strip().encode("utf-8")
    elif isinstance(secret, (bytes, bytearray)):
        data = bytes(secret).strip()
    else:
        raise ConfigError(f"the job secret ({origin}) must be a str or bytes, got "
                          f"{type(secret).__name__}")
    if len(data) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"the job secret ({origin}) is {len(data)} characters long: expected at least "
            f"{MIN_SECRET_CHARS} (swarmfd run/deploy write 64 hex characters)"
        )
    if len(set(data)) == 1:
        raise ConfigError(
            f"the job secret ({origin}) is made of one repeated character: expected random "
            "characters (e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return data


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """Read the job secret from ``SWARMFD_SECRET_FILE`` or the default path.

    Returns ``None`` when the variable is unset and the default file does not
    exist (the caller decides whether that is an error); raises
    :class:`ConfigError` when a file is named but missing, unreadable, not a
    regular file, too large or too short, or when another user could have written
    it (:func:`_check_secret_file`). Error messages name the path, never the content.
    """
    env = os.environ if environ is None else environ
    named = (env.get(ENV_SECRET_FILE) or "").strip()
    path = named or DEFAULT_SECRET_FILE
    origin = f"{ENV_SECRET_FILE}={path}" if named else f"default secret file {path}"
    if not named and not os.path.lexists(path):
        return None
    try:
        st = os.stat(path)  # follows a symlink: the file it names is checked
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block open()
            raise ConfigError(f"the job secret file ({origin}) is not a regular file")
        _check_secret_file(path, origin, st)
        with open(path, "rb") as f:
            opened = os.fstat(f.fileno())
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise ConfigError(f"the job secret file ({origin}) was replaced while it was "
                                  "checked: check who else writes there")
            data = f.read(MAX_SECRET_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"the job secret file ({origin}) does not exist; {_SECRET_HINT}"
                          ) from None
    except PermissionError:
        raise ConfigError(f"the job secret file ({origin}) is not readable by uid "
                          f"{os.getuid()}: give this process read access") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the job secret file ({origin}): {exc.strerror}"
                          ) from None
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"the job secret file ({origin}) is larger than {MAX_SECRET_BYTES} "
                          "bytes: expected a short text secret")
    return check_secret(data, origin)


#: Where Docker mounts secrets: world-readable (0444) by default there, inside a container
#: whose other users are the job's own; elsewhere a world-readable secret file is warned of.
DOCKER_SECRETS_DIR = "/run/secrets"
#: Symbolic links followed at most on the way to a secret file (as the kernel's ELOOP).
MAX_SYMLINKS = 40
_LOG = logging.getLogger("swarmfd")


def _check_secret_file(path: str, origin: str, st: os.stat_result) -> None:
    """Refuse a secret file another user could have written, as OpenSSH refuses such key
    files (whoever can write it can make this job trust their secret): one not owned by
    this process's user or root, one its group or other users can write, and one in a
    directory (or reached through a symbolic link in one) another user can write (they
    could rename it away and put their own in its place). Warn of one every user can
    read, outside Docker's secrets directory."""
    perms = stat.S_IMODE(st.st_mode)
    if st.st_uid not in _trusted_uids():
        raise ConfigError(
            f"the job secret file ({origin}) is owned by uid {st.st_uid}, not by this "
            f"process's uid {os.geteuid()} or root: that user could replace the secret with "
            f"their own; write a fresh secret to a file of your own (chmod 600) and point "
            f"{ENV_SECRET_FILE} at it"
        )
    if perms & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002))
                           if perms & bit)
        raise ConfigError(
            f"the job secret file ({origin}) is writable by {who} (mode {perms:04o}): whoever "
            f"can write it can make this job trust their secret; make it private (chmod 600 "
            f"{path})"
        )
    hazard = _path_hazard(path)
    if hazard:
        raise ConfigError(
            f"the job secret file ({origin}) {hazard}: they could put a file of their own in "
            "its place; keep the secret in a directory only you (or root) can write (e.g. "
            f"chmod go-w that directory), and {ENV_SECRET_FILE} pointing there"
        )
    real = os.path.realpath(path)
    if perms & 0o004 and not real.startswith(DOCKER_SECRETS_DIR + os.sep):
        _LOG.warning(
            "the job secret file (%s) is readable by every user (mode %04o): other users of "
            "this host can read the job secret; make it private (chmod 600 %s)",
            origin, perms, path)


def _trusted_uids() -> set[int]:
    """Who may own a secret file and the directories on its way: this process's user
    (real and effective) and root."""
    return {0, os.getuid(), os.geteuid()}


def _path_hazard(path: str) -> str:
    """Why another user could replace what ``path`` names ("" when nobody can): a
    directory on the way (every one the name is looked up in, symbolic links followed
    one by one, as the kernel resolves it) that such a user owns, or may write into
    without the sticky bit protecting this entry (as /tmp protects the files of others).
    """
    trusted = _trusted_uids()
    parts = os.path.abspath(path).split(os.sep)[1:]
    current, hops = os.sep, 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        entry = os.path.join(current, name)
        where = os.lstat(current)
        st = os.lstat(entry)
        if where.st_uid not in trusted:
            return f"is reached through the directory {current}, owned by uid {where.st_uid}"
        if stat.S_IMODE(where.st_mode) & 0o022 and not (
                where.st_mode & stat.S_ISVTX and st.st_uid in trusted):
            return (f"is reached through the directory {current}, which other users can write "
                    f"(mode {stat.S_IMODE(where.st_mode):04o})")
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, "too many levels of symbolic links")
            target = os.readlink(entry)
            if os.path.isabs(target):
                current = os.sep
            parts[:0] = target.split(os.sep)
            continue
        current = entry
    return ""


def require_secret(world_size: int, secret: str | bytes | None = None,
                   environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job secret a group of ``world_size`` needs, or ``None`` when it needs none.

    A world of one needs none; ``SWARMFD_AUTH=off`` needs none; otherwise the
    explicit ``secret`` or the secret file must provide one (ConfigError saying
    how to provide it).
    """
    if world_size <= 1 or not auth_enabled(environ):
        return None
    if secret is not None:
        return check_secret(secret, "secret= argument")
    loaded = load_secret(environ)
    if loaded is None:
        raise ConfigError(
            f"a world of {world_size} ranks needs a job secret (so that no other process "
            f"can join or inject data), but {ENV_SECRET_FILE} is not set and "
            f"{DEFAULT_SECRET_FILE} does not exist; {_SECRET_HINT}"
        )
    return loaded


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (which a container's cpuset
    narrows), else the machine's count. What the spin policy, ``swarmfd run``'s threads
    per rank and DDP's overlap rule divide among the ranks of a host."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
