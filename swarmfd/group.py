"""The process group: one per process, created by :func:`init`, ended by :func:`cleanup`.

``init`` validates the configuration, resolves ``MASTER_ADDR``, binds this
rank's data socket on a free port of the interface that routes to rank 0,
runs the rendezvous and connects to every peer. A world of one needs no
sockets at all.

After a collective fails (a peer lost, a timeout, a mismatch), the group is
*broken*: every later collective raises at once with the original reason,
because the ranks can no longer agree on where they are. ``cleanup()`` and a
new ``init()`` start over.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import threading
import time
from collections import Counter

import numpy as np

from . import shm as _shm
from . import transport as _transport
from .config import (
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    Config,
    config_from_env,
    data_plane,
    encrypt_enabled,
    require_secret,
)
from .errors import (
    AlreadyInitializedError,
    ConfigError,
    NotInitializedError,
    SwarmfdError,
)

ENV_NODE = "SWARMFD_NODE"
#: Seconds a failed group's sockets may take at cleanup to deliver the abort messages.
ABORT_LINGER = 0.5
#: ``auto`` (default): shared memory between ranks of one host, TCP otherwise; ``tcp``: TCP only.
ENV_TRANSPORT = "SWARMFD_TRANSPORT"


class Group:
    """State of the active process group."""

    def __init__(self, config: Config, transport: _transport.Transport | None) -> None:
        self.config = config
        self.transport = transport
        self.seq = 0
        self.shm: _shm.ShmChannel | None = None
        #: The shared-memory setup while it runs (cleanup() closes it if init fails).
        self.shm_setup: _shm.Setup | None = None
        self.broken: BaseException | None = None
        self._scratch: dict[np.dtype, np.ndarray] = {}

    def scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable flat buffer (for fusing lists of arrays) of at least ``count`` items."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:count]


_group: Group | None = None
_lock = threading.Lock()
#: Environment variables init set (see _export_local_ranks); cleanup removes them.
_exported: list[str] = []


def current(what: str = "this call") -> Group:
    """The active group, or :class:`NotInitializedError` naming ``what`` was called."""
    g = _group
    if g is None:
        raise NotInitializedError(
            f"swarmfd.{what} called before the process group was initialised: call "
            "swarmfd.init(world_size, rank) or swarmfd.init_from_env() first"
        )
    return g


def init(
    world_size: int = 1,
    rank: int = 0,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float | None = None,
    secret: str | bytes | None = None,
    init_timeout: float | None = None,
) -> Config:
    """Join a process group of ``world_size`` ranks as ``rank`` and return its :class:`Config`.

    Transport details not given as arguments come from the environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``SWARMFD_TIMEOUT``, ``SWARMFD_INIT_TIMEOUT``).
    ``timeout`` is how long any collective may wait for a peer; ``init_timeout``
    how long this call waits for every rank to join (default: ``timeout``), so
    ranks that start far apart can meet while a stuck collective still fails
    fast.

    A world of more than one rank needs the job secret (at least 32 characters,
    the same on every rank): ``secret``, or else the file named by
    ``SWARMFD_SECRET_FILE`` (default ``/run/secrets/swarmfd_secret``), unless
    ``SWARMFD_AUTH=off``. Only processes holding it can join, send data or abort.
    """
    env = config_from_env({k: v for k, v in os.environ.items()
                           if k in ("MASTER_ADDR", "MASTER_PORT", "SWARMFD_TIMEOUT",
                                    "SWARMFD_INIT_TIMEOUT", "SWARMFD_RESTART_COUNT")})
    config = Config(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr if master_addr is not None else env.master_addr,
        master_port=master_port if master_port is not None else env.master_port,
        timeout=timeout if timeout is not None else env.timeout,
        restart_count=env.restart_count,
        init_timeout=init_timeout if init_timeout is not None else env.init_timeout,
    )
    return _start(config, secret)


def init_from_env(*, timeout: float | None = None, secret: str | bytes | None = None,
                  init_timeout: float | None = None) -> Config:
    """Join the group the environment describes (``WORLD_SIZE``, ``RANK``, ...).

    With none of the variables set this is a world of one. The job secret is
    found as :func:`init` finds it; ``timeout`` and ``init_timeout`` override
    ``SWARMFD_TIMEOUT`` and ``SWARMFD_INIT_TIMEOUT`` (see :func:`init`).
    """
    return _start(config_from_env(timeout=timeout, init_timeout=init_timeout), secret)


def _security(config: Config, secret: str | bytes | None) -> _transport.Security | None:
    """The group's keys (derived from the job secret), or None without authentication."""
    job_secret = require_secret(config.world_size, secret)
    if job_secret is None:
        return None
    return _transport.Security.from_secret(job_secret, encrypt_enabled())


def _start(config: Config, secret: str | bytes | None = None) -> Config:
    global _group
    with _lock:
        if _group is not None:
            raise AlreadyInitializedError(
                f"swarmfd.init called twice: this process is already rank {_group.config.rank} "
                f"of {_group.config.world_size}; call swarmfd.cleanup() first"
            )
        if config.world_size == 1:
            config = dataclasses.replace(
                config,
                local_rank=config.local_rank or 0,
                local_world_size=config.local_world_size or 1,
            )
            _group = Group(config, None)
            _export_local_ranks(config)
            return config
        assert config.master_addr is not None  # Config guarantees it for world_size > 1
        security = _security(config, secret)
        plane = data_plane()
        deadline = time.monotonic() + config.join_timeout
        master_ip = _transport.resolve(config.master_addr, deadline)
        bind_ip = _transport.local_address_toward(master_ip)
        t = _transport.Transport(config.rank, config.world_size, config.timeout, bind_ip,
                                 security, plane, config.join_timeout)
        try:
            host = os.environ.get(ENV_NODE) or socket.gethostname()
            mode = (os.environ.get(ENV_TRANSPORT) or "auto").strip().lower()
            if mode not in ("auto", "tcp"):
                raise ConfigError(f"{ENV_TRANSPORT}={mode!r} is invalid: expected 'auto' or 'tcp'")
            hostkey = _shm.host_key() if mode == "auto" else ""
            peers, token = _transport.rendezvous(t, master_ip, config.master_port, deadline,
                                                 host, hostkey)
            t.connect(peers, deadline)
            config = _with_local_ranks(config, [p.host for p in peers])
        except BaseException:
            t.close()
            raise
        t.activity = "idle"
        g = Group(config, t)
        _group = g
        _export_local_ranks(config)
    if hostkey and all(p.hostkey == hostkey for p in peers):
        try:
            _setup_shm(g, token, hostkey, deadline)
        except BaseException:
            cleanup()
            raise
    return config


def _setup_shm(g: Group, token: str, hostkey: str, deadline: float) -> None:
    """Move the group's data to shared memory (every rank is on this host).

    The ranks agree after each step with an all_gather over TCP of every rank's
    result, so one rank that cannot take part makes all of them stay on TCP (with
    a warning naming it and why) instead of hanging, and a lost rank raises
    PeerLostError here as in any collective. Waits on the setup socket end at the
    init deadline, or one collective timeout from now if that is later (a join that
    took nearly all of init_timeout must not leave the setup without time).
    """
    from . import collectives

    t = g.transport
    assert t is not None
    cfg = g.config
    g.shm_setup = setup = _shm.Setup(
        cfg.rank, cfg.world_size, range(cfg.world_size), token, hostkey, cfg.timeout,
        max(deadline, time.monotonic() + cfg.timeout), t.check_peer)
    try:
        channel = setup.run(lambda reason: _shm.decode_reasons(
            collectives.all_gather(_shm.encode_reason(reason))))
    except SwarmfdError as exc:
        # Say what init was doing: the user called no all_gather.
        raise type(exc)(f"init, while the ranks set up shared memory: {exc}").with_traceback(
            exc.__traceback__) from None
    g.shm_setup = None
    if channel is not None:
        g.shm = channel
        t.data_via_shm = True


def _with_local_ranks(config: Config, hosts: list[str]) -> Config:
    """Fill in local_rank/local_world_size from the hosts the ranks reported."""
    mine = hosts[config.rank]
    derived_rank = hosts[: config.rank].count(mine)
    derived_size = Counter(hosts)[mine]
    local_rank = config.local_rank if config.local_rank is not None else derived_rank
    local_size = (config.local_world_size if config.local_world_size is not None
                  else derived_size)
    try:
        return dataclasses.replace(config, local_rank=local_rank, local_world_size=local_size)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (after grouping ranks by host)") from None


def _export_local_ranks(config: Config) -> None:
    """Put derived LOCAL_RANK/LOCAL_WORLD_SIZE in the environment where they were unset.

    torchrun sets both before a script starts; under ``swarmfd deploy --local-ranks
    node`` they are only known after the rendezvous groups ranks by node, so code
    that reads ``os.environ["LOCAL_RANK"]`` after ``init`` (to pick a GPU, say)
    finds them there, as it would under torchrun. Values already set are left alone
    (they were what the config was built from); :func:`cleanup` removes the ones
    set here, so a later group (or a child process) does not inherit stale values.
    """
    for name, value in ((ENV_LOCAL_RANK, config.local_rank),
                        (ENV_LOCAL_WORLD_SIZE, config.local_world_size)):
        if value is not None and not os.environ.get(name, "").strip():
            os.environ[name] = str(value)
            _exported.append(name)


def is_initialized() -> bool:
    """True between a successful :func:`init` and :func:`cleanup`."""
    return _group is not None


def get_config() -> Config:
    """The active group's :class:`Config`."""
    return current("get_config()").config


def get_rank() -> int:
    """This process's rank in the active group."""
    return current("get_rank()").config.rank


def get_world_size() -> int:
    """Number of ranks in the active group."""
    return current("get_world_size()").config.world_size


def cleanup() -> None:
    """Leave the group and close every socket. Idempotent; a later :func:`init` works again."""
    global _group
    with _lock:
        g, _group = _group, None
        while _exported:
            os.environ.pop(_exported.pop(), None)
    if g is not None and g.shm_setup is not None:
        g.shm_setup.close()
    if g is not None and g.shm is not None:
        g.shm.close()
    if g is not None and g.transport is not None:
        if g.broken is not None:
            # A failed group: give the abort messages queued behind unsent data a
            # moment to leave (peers learn the reason), but do not wait for data a lost
            # peer will never take.
            g.transport.close(linger=int(ABORT_LINGER * 1000))
            return
        try:
            g.transport.flush()
        except SwarmfdError:
            pass
        finally:
            g.transport.close()


atexit.register(cleanup)
