"""Pure spec building for ``swarmfd deploy``: validated options -> Engine API documents.

Nothing here talks to Docker (nor imports it): the functions turn the command
line's strings into a validated :class:`JobSpec` and then into the JSON
documents of the Docker Engine API (``ServiceSpec`` and a network create
request), so every rule can be unit tested with plain data. :mod:`.engine`
sends them.

The job is one *replicated* service of N replicas (slots 1..N) with restart
condition ``none`` (one-shot tasks), ``endpoint_mode`` ``dnsrr`` (no virtual IP:
hosts without IPVS cannot route one), ``init`` (so SIGTERM reaches the command),
hostname ``{{.Service.Name}}-{{.Task.Slot}}`` (Swarm makes it a DNS alias, so
``<job>-1`` names rank 0) and the environment contract the container entrypoint
(:mod:`swarmfd.entrypoint`) turns into ``RANK``, plus one attachable overlay
network of the same name. Everything carries the label ``org.swarmfd.job=<job>``.

Every rank knows its node (``SWARMFD_NODE={{.Node.Hostname}}``): the ranks of one
node are one host for swarmfd (its host group, and the two-level collectives that
keep a node's traffic in shared memory). Two tasks on one node are two containers,
with no IPC namespace or /dev/shm in common, so when a job may place several ranks
on a node each rank also mounts a volume of that job's own (:meth:`JobSpec.shm_volume`,
``swarmfd-shm-<job>-<launch id>``) at SHM_TARGET (``SWARMFD_SHM_DIR``): there they meet
to hand each other their shared-memory segments (see :mod:`swarmfd.comm.shm_setup`;
the socket file is gone once they have). No other job's task mounts it, so no other
job's rank can watch that directory, take the socket's name or sit between the ranks
(with one volume for every job on a node, one could). It is a tmpfs of the local
driver, created on each node where a rank starts, labelled with the job: its contents
vanish when the job's last container there ends, and ``swarmfd rm`` (and the end of a
followed job) removes the volume itself on the node it runs on.

An elastic job (``deploy --elastic``, :mod:`swarmfd.elastic`) differs in three things:
its tasks restart on failure, at once (condition ``on-failure``, delay 0: Swarm's default
5 s delay would spend most of the time a loss may cost), up to ``--max-restarts`` times
per slot; every task may be a replacement (``SWARMFD_ELASTIC_JOIN=auto``: it joins when
a formed job answers at ``tasks.<service>``, the DNS name of every task, else it forms
the first world with the others); and a task stopped (``swarmfd scale`` down) gets
ELASTIC_STOP_GRACE to leave at a commit before SIGKILL. Nothing outside the Swarm
supervises it: it works with ``--detach``.

``/dev/shm`` is another matter: swarmfd's segments do not use it, but torch's
DataLoader workers hand their batches over there, and a container's is 64 MiB. Swarm
services have no ``--shm-size`` (moby/moby#26714), so with ``shm_size`` (``deploy
--shm-size``, default DEFAULT_SHM_SIZE) each rank mounts a tmpfs of that size at
``/dev/shm`` instead: its pages count against the task's memory once written, not before.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import ENV_PORT, check_seconds, rendezvous_port

__all__ = [
    "CHECKPOINT_TARGET",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_SHM_SIZE",
    "ELASTIC_STOP_GRACE",
    "ENV_CHECKPOINT_DIR",
    "ENV_SHM_DIR",
    "LABEL_ELASTIC",
    "LABEL_FAILURE",
    "LABEL_IMAGE",
    "LABEL_JOB",
    "LABEL_STOPPED",
    "LABEL_VERSION",
    "LABEL_WORLD_SIZE",
    "LOCAL_RANK_MODES",
    "RESERVED_ENV",
    "SECRET_MODE",
    "SECRET_TARGET",
    "SHM_DEV",
    "SHM_TARGET",
    "SHM_VOLUME_PREFIX",
    "JobSpec",
    "build_network_spec",
    "build_service_spec",
    "generate_job_name",
    "parse_checkpoint_volume",
    "parse_constraint",
    "parse_cpus",
    "parse_generic_resource",
    "parse_labels",
    "parse_memory",
    "parse_mount",
    "secret_name",
    "validate_job_name",
]

LABEL_PREFIX = "org.swarmfd."
LABEL_JOB = "org.swarmfd.job"
LABEL_WORLD_SIZE = "org.swarmfd.world-size"
LABEL_IMAGE = "org.swarmfd.image"
LABEL_VERSION = "org.swarmfd.version"
#: Set on the service of an elastic job ("1"): ``swarmfd scale`` takes only those.
LABEL_ELASTIC = "org.swarmfd.elastic"
#: Seconds a task of an elastic job has from SIGTERM to SIGKILL: it leaves at its next
#: commit (a rank that does not commit that soon is lost instead, and the others roll
#: back to their last commit).
ELASTIC_STOP_GRACE = 30
#: Set on the service when a rank failed: which rank, its exit code and node.
LABEL_FAILURE = "org.swarmfd.failure"
#: Set with it: the ranks swarmfd stopped because of that failure ("0,2").
LABEL_STOPPED = "org.swarmfd.stopped"

DEFAULT_MASTER_PORT = 29500
#: swarmfd's rendezvous port (``SWARMFD_PORT``, swarmfd.config.ENV_PORT) is not set by
#: deploy: each rank derives MASTER_PORT + 1 inside the job's overlay network, unless
#: ``-e SWARMFD_PORT=P`` chooses it. Neither port is published on the nodes.
#: Longest job name: the hostname ``<job>-<slot>`` must stay a valid DNS label (<= 63).
MAX_JOB_NAME = 50

#: How LOCAL_RANK/LOCAL_WORLD_SIZE are defined: per container (0 of 1, the entrypoint's
#: default) or per node (derived by swarmfd at rendezvous from SWARMFD_NODE).
LOCAL_RANK_MODES = ("container", "node")

#: Variables the job sets for every rank; ``-e`` may not set them (use the options).
RESERVED_ENV = {
    "WORLD_SIZE": "-n",
    "RANK": "-n (RANK comes from the task slot)",
    "SWARMFD_TASK_SLOT": "-n (Swarm sets the task slot)",
    "MASTER_ADDR": "(rank 0 is <job>-1)",
    "MASTER_PORT": "--master-port",
    "SWARMFD_TIMEOUT": "--timeout",
    "SWARMFD_INIT_TIMEOUT": "--init-timeout",
    "SWARMFD_JOB": "--name",
    "SWARMFD_RESTART_COUNT": "--max-restarts (deploy counts the restarts)",
    "SWARMFD_JOB_ID": "(deploy draws one per job)",
    "SWARMFD_ELASTIC": "--elastic",
    "SWARMFD_ELASTIC_JOIN": "--elastic (every task may be a replacement)",
    "SWARMFD_ELASTIC_PEERS": "--elastic (tasks.<job> names every task)",
}

#: ``--checkpoint-volume NAME``: the named volume is mounted here in every rank, and
#: ``SWARMFD_CHECKPOINT_DIR`` names it (examples/train.py saves and resumes there).
CHECKPOINT_TARGET = "/checkpoints"
ENV_CHECKPOINT_DIR = "SWARMFD_CHECKPOINT_DIR"
_VOLUME_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

#: Where a job's ranks on one node meet to share memory: a volume of the job's own (see
#: the module docstring and JobSpec.shm_volume), mounted at SHM_TARGET and named by
#: SWARMFD_SHM_DIR (the name swarmfd.config reads; not imported: this package stays apart
#: from the core).
SHM_VOLUME_PREFIX = "swarmfd-shm-"
SHM_TARGET = "/run/swarmfd-shm"
ENV_SHM_DIR = "SWARMFD_SHM_DIR"
#: The volume's driver options: a tmpfs (nothing reaches a disk, and nothing outlives the
#: job's containers on a node); its sockets need no room.
SHM_VOLUME_DRIVER = {"Name": "local",
                     "Options": {"type": "tmpfs", "device": "tmpfs", "o": "size=1m"}}
#: The launch a rank belongs to (swarmfd.config.ENV_JOB_ID): rank 0 refuses ranks of
#: another launch.
ENV_JOB_ID = "SWARMFD_JOB_ID"

#: ``deploy --shm-size``: a tmpfs of this size at SHM_DEV in every rank (the module
#: docstring). The default fits torch DataLoader workers whose prefetched batches
#: (num_workers x prefetch_factor x bytes of a batch) stay within 1 GiB, e.g. 4 workers
#: of 2 batches of 128 MiB; docs/doctor.md says how to size it.
DEFAULT_SHM_SIZE = 1 << 30
SHM_DEV = "/dev/shm"

#: The job secret in every rank: ``/run/secrets/<SECRET_TARGET>``, owned by root, readable
#: by the container's users (the ranks run as the image's unprivileged user, see
#: swarmfd.entrypoint; nobody else runs in a rank's container), writable by none.
SECRET_TARGET = "swarmfd_secret"
SECRET_MODE = 0o444

_JOB_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]*[a-z0-9])?$")
_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$")
_WORDS = (
    "amber", "brisk", "calm", "dusty", "eager", "fuzzy", "gentle", "hazy", "icy", "jolly",
    "keen", "lucid", "mellow", "nimble", "olive", "proud", "quiet", "rapid", "sunny", "tidy",
    "umber", "vivid", "witty", "young", "zesty",
)


# --- names ---------------------------------------------------------------------------


def validate_job_name(name: str) -> str:
    """Return ``name`` if it is a usable job name, else raise ``ValueError`` saying why.

    A job name becomes the service name, the network name and (with ``-<slot>``) each
    task's DNS name, so it must be a DNS label: lowercase letters, digits and hyphens,
    starting with a letter, not ending with a hyphen, at most 50 characters.
    """
    if not isinstance(name, str):
        raise TypeError(f"job name must be a string, got {name!r}")
    if not name:
        raise ValueError("job name is empty: expected e.g. 'mnist-run-1'")
    if len(name) > MAX_JOB_NAME:
        raise ValueError(
            f"job name {name!r} is {len(name)} characters long: at most {MAX_JOB_NAME} "
            "(the task host names <job>-<slot> must be valid DNS labels)"
        )
    if not _JOB_NAME_RE.match(name):
        raise ValueError(
            f"job name {name!r} is not DNS-safe: expected lowercase letters, digits and "
            "hyphens, starting with a letter and not ending with a hyphen (e.g. 'mnist-run-1')"
        )
    return name


def generate_job_name() -> str:
    """A fresh job name ``swarmfd-<word>-<4 hex digits>``, e.g. ``swarmfd-keen-3fa9``."""
    return f"swarmfd-{secrets.choice(_WORDS)}-{secrets.token_hex(2)}"


# --- option parsers --------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_memory(text: str, what: str = "memory") -> int:
    """Parse a memory size like Docker does: ``512M``, ``2G``, ``1.5g``, ``64MiB``, ``1048576``.

    Units are binary (``1K`` = 1024 bytes); a bare number is bytes. Returns bytes (> 0).
    """
    match = _SIZE_RE.match(str(text))
    if match is None or (match.group(3) and match.group(3).lower() == "ib" and
                         not match.group(2)):
        raise ValueError(
            f"bad {what} size {text!r}: expected a number with an optional unit K, M, G or T "
            "(binary, 1K = 1024 bytes), e.g. 512M or 2G"
        )
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"bad {what} size {text!r}: expected at least 1 byte")
    return int(value)


def parse_cpus(text: str | float, what: str = "cpu") -> int:
    """Parse a CPU count (``0.5``, ``2``) into Swarm's NanoCPUs (``0.5`` -> 500000000)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bad {what} count {text!r}: expected a positive number, e.g. 0.5 or 2")
    nano = round(value * 1e9)
    if nano < 1:
        raise ValueError(f"bad {what} count {text!r}: too small (the unit is 1e-9 CPU)")
    return nano


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """Parse ``--label KEY=VALUE`` (or bare ``KEY``, an empty value); ``org.swarmfd.*`` is
    reserved for swarmfd's own labels."""
    labels: dict[str, str] = {}
    for item in items:
        key, _sep, value = item.partition("=")
        if not _LABEL_KEY_RE.match(key):
            raise ValueError(
                f"bad label {item!r}: expected KEY=VALUE with a key of letters, digits, "
                "'.', '-', '_' or '/', e.g. --label team=vision"
            )
        if key.startswith(LABEL_PREFIX):
            raise ValueError(
                f"label {key!r} is reserved: swarmfd sets the {LABEL_PREFIX}* labels itself"
            )
        labels[key] = value
    return labels


_CONSTRAINT_RE = re.compile(r"^\s*([A-Za-z0-9_.\-/]+)\s*(==|!=)\s*(\S.*?)\s*$")


def parse_constraint(text: str) -> str:
    """Validate a placement constraint (``node.role==worker``, ``node.labels.gpu!=none``)."""
    match = _CONSTRAINT_RE.match(text)
    if match is None:
        raise ValueError(
            f"bad constraint {text!r}: expected ATTRIBUTE==VALUE or ATTRIBUTE!=VALUE, e.g. "
            "node.role==worker or node.labels.gpu==true"
        )
    attribute, op, value = match.groups()
    return f"{attribute}{op}{value}"


def parse_generic_resource(text: str) -> dict[str, Any]:
    """Parse ``--generic-resource KIND=VALUE`` like ``docker service create`` does.

    An integer value is a count (``gpu=1`` -> a DiscreteResourceSpec: one unit of a
    resource the nodes advertise, e.g. GPUs), anything else names a resource
    (``gpu=GPU-1a2b`` -> a NamedResourceSpec).
    """
    kind, sep, value = text.partition("=")
    kind, value = kind.strip(), value.strip()
    if not sep or not kind or not value or not re.match(r"^[A-Za-z0-9_.\-]+$", kind):
        raise ValueError(
            f"bad generic resource {text!r}: expected KIND=COUNT or KIND=NAME, e.g. gpu=1"
        )
    if re.fullmatch(r"\d+", value):
        count = int(value)
        if count < 1:
            raise ValueError(f"bad generic resource {text!r}: the count must be >= 1")
        return {"DiscreteResourceSpec": {"Kind": kind, "Value": count}}
    return {"NamedResourceSpec": {"Kind": kind, "Value": value}}


_MOUNT_TYPES = ("bind", "volume", "tmpfs")
_TRUE = ("", "1", "true", "yes")
_FALSE = ("0", "false", "no")


def _bool_field(key: str, value: str, text: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"bad mount {text!r}: {key}={value!r} is not true or false")


def parse_mount(text: str) -> dict[str, Any]:
    """Parse a ``--mount`` item (Docker's syntax) into an Engine API ``Mount`` object.

    ``type=bind,src=/data,dst=/data,readonly``, ``type=volume,src=cache,dst=/cache``,
    ``type=tmpfs,dst=/scratch,tmpfs-size=1G``. Keys: type (default volume),
    source|src, target|destination|dst, readonly|ro, bind-propagation,
    volume-driver, volume-opt=K=V (repeatable), volume-label=K=V, volume-nocopy,
    tmpfs-size, tmpfs-mode. A bind source must be an absolute path that exists on
    every node a rank may run on.
    """
    fields: dict[str, str] = {}
    volume_opts: dict[str, str] = {}
    volume_labels: dict[str, str] = {}
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if key == "volume-opt" or key == "volume-label":
            okey, osep, ovalue = value.partition("=")
            if not osep or not okey:
                raise ValueError(f"bad mount {text!r}: {key} needs KEY=VALUE, got {value!r}")
            (volume_opts if key == "volume-opt" else volume_labels)[okey] = ovalue
            continue
        if key in ("readonly", "ro", "volume-nocopy") and not sep:
            value = "true"
        elif not sep:
            raise ValueError(f"bad mount {text!r}: {part!r} is not KEY=VALUE")
        aliases = {"src": "source", "dst": "target", "destination": "target", "ro": "readonly"}
        key = aliases.get(key, key)
        known = ("type", "source", "target", "readonly", "bind-propagation", "volume-driver",
                 "volume-nocopy", "tmpfs-size", "tmpfs-mode", "consistency")
        if key not in known:
            raise ValueError(
                f"bad mount {text!r}: unknown key {key!r} (expected type, source/src, "
                "target/dst, readonly, bind-propagation, volume-driver, volume-opt, "
                "volume-label, volume-nocopy, tmpfs-size, tmpfs-mode)"
            )
        if key in fields:
            raise ValueError(f"bad mount {text!r}: {key} given twice")
        fields[key] = value.strip()
    mount_type = fields.get("type", "volume").lower()
    if mount_type not in _MOUNT_TYPES:
        raise ValueError(
            f"bad mount {text!r}: type={mount_type!r} is not one of {', '.join(_MOUNT_TYPES)}"
        )
    target = fields.get("target", "")
    if not target.startswith("/"):
        raise ValueError(
            f"bad mount {text!r}: expected an absolute target path (dst=/path in the container)"
        )
    source = fields.get("source", "")
    mount: dict[str, Any] = {"Type": mount_type, "Target": target}
    if mount_type == "bind":
        if not source.startswith("/"):
            raise ValueError(
                f"bad mount {text!r}: a bind mount needs an absolute source path "
                "(src=/path on the node)"
            )
        mount["Source"] = source
    elif mount_type == "volume":
        if source:
            mount["Source"] = source
    elif source:
        raise ValueError(f"bad mount {text!r}: a tmpfs mount takes no source")
    if "readonly" in fields:
        mount["ReadOnly"] = _bool_field("readonly", fields["readonly"], text)
    for key in ("bind-propagation",):
        if key in fields and mount_type != "bind":
            raise ValueError(f"bad mount {text!r}: {key} applies to type=bind only")
    if mount_type != "volume" and (
        volume_opts or volume_labels or "volume-driver" in fields or "volume-nocopy" in fields
    ):
        raise ValueError(f"bad mount {text!r}: volume-* options apply to type=volume only")
    if mount_type != "tmpfs" and ("tmpfs-size" in fields or "tmpfs-mode" in fields):
        raise ValueError(f"bad mount {text!r}: tmpfs-* options apply to type=tmpfs only")
    if "bind-propagation" in fields:
        propagation = fields["bind-propagation"]
        allowed = ("private", "rprivate", "shared", "rshared", "slave", "rslave")
        if propagation not in allowed:
            raise ValueError(
                f"bad mount {text!r}: bind-propagation={propagation!r} is not one of "
                f"{', '.join(allowed)}"
            )
        mount["BindOptions"] = {"Propagation": propagation}
    if mount_type == "volume":
        options: dict[str, Any] = {}
        if "volume-nocopy" in fields:
            options["NoCopy"] = _bool_field("volume-nocopy", fields["volume-nocopy"], text)
        if volume_labels:
            options["Labels"] = volume_labels
        if "volume-driver" in fields or volume_opts:
            driver: dict[str, Any] = {"Name": fields.get("volume-driver", "local")}
            if volume_opts:
                driver["Options"] = volume_opts
            options["DriverConfig"] = driver
        if options:
            mount["VolumeOptions"] = options
    if mount_type == "tmpfs":
        options = {}
        if "tmpfs-size" in fields:
            options["SizeBytes"] = parse_memory(fields["tmpfs-size"], "tmpfs")
        if "tmpfs-mode" in fields:
            try:
                options["Mode"] = int(fields["tmpfs-mode"], 8)
            except ValueError:
                raise ValueError(
                    f"bad mount {text!r}: tmpfs-mode={fields['tmpfs-mode']!r} is not an "
                    "octal mode like 1777"
                ) from None
        if options:
            mount["TmpfsOptions"] = options
    return mount


def parse_checkpoint_volume(text: str) -> str:
    """Check a ``--checkpoint-volume`` name (Docker's volume names: letters, digits and
    ``_ . -``, starting with a letter or digit)."""
    name = text.strip()
    if not _VOLUME_NAME_RE.match(name):
        raise ValueError(
            f"--checkpoint-volume {text!r}: expected a volume name (letters, digits, '_', "
            "'.', '-'; e.g. mnist-ckpt); for a volume with driver options (NFS) use "
            f"--mount type=volume,src=NAME,dst=/ckpt,volume-driver=... -e "
            f"{ENV_CHECKPOINT_DIR}=/ckpt"
        )
    return name


# --- the job ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """Everything ``swarmfd deploy`` needs to create a job, validated on construction.

    ``image_ref`` is what the service runs: the image ID (``sha256:...``) when the image
    exists locally, so no task start consults a registry. ``image`` is the name the
    user gave (kept as a label, shown by ``swarmfd ls``).
    """

    name: str
    image: str
    image_ref: str
    world_size: int
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mapping[str, Any], ...] = ()
    workdir: str | None = None
    networks: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    reserve_cpu: int | None = None  # NanoCPUs
    limit_cpu: int | None = None
    reserve_memory: int | None = None  # bytes
    limit_memory: int | None = None
    generic_resources: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    master_port: int = DEFAULT_MASTER_PORT
    timeout: float | None = None
    init_timeout: float | None = None
    max_per_node: int | None = None
    local_ranks: str = "container"
    encrypt_network: bool = False
    checkpoint_volume: str | None = None
    shm_size: int | None = None  # bytes of the tmpfs at /dev/shm; None: the engine's
    restart_count: int = 0
    #: An elastic job (module docstring), whose slots restart up to this many times each.
    elastic: bool = False
    elastic_restarts: int = 0
    version: str = ""
    #: This deploy's launch id (SWARMFD_JOB_ID in every rank; names its shm volume).
    launch_id: str = field(default_factory=lambda: secrets.token_hex(6))

    def __post_init__(self) -> None:
        validate_job_name(self.name)
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError("image is empty: expected an image name like swarmfd:latest")
        if not isinstance(self.image_ref, str) or not self.image_ref.strip():
            raise ValueError("image_ref is empty: expected an image ID or reference")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise TypeError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"the number of ranks must be >= 1, got -n {self.world_size}")
        if not self.command:
            raise ValueError(
                "missing COMMAND: give the program every rank runs after '--', "
                "e.g. -- python train.py --epochs 3"
            )
        if not all(isinstance(a, str) for a in self.command):
            raise TypeError(f"command must be a sequence of strings, got {self.command!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) or not (
            1 <= self.master_port <= 65535
        ):
            raise ValueError(f"--master-port must be in 1..65535, got {self.master_port!r}")
        self._check_rendezvous_port()
        for option, seconds in (("--timeout", self.timeout),
                                 ("--init-timeout", self.init_timeout)):
            if seconds is not None:
                check_seconds(option, seconds, type_error=ValueError, value_error=ValueError)
        if self.max_per_node is not None and (
            isinstance(self.max_per_node, bool) or not isinstance(self.max_per_node, int)
            or self.max_per_node < 1
        ):
            raise ValueError(f"--max-per-node must be an integer >= 1, got {self.max_per_node!r}")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise ValueError(f"--workdir must be an absolute path, got {self.workdir!r}")
        if isinstance(self.restart_count, bool) or not isinstance(self.restart_count, int) \
                or self.restart_count < 0:
            raise ValueError(f"restart_count must be an integer >= 0, got {self.restart_count!r}")
        if self.local_ranks not in LOCAL_RANK_MODES:
            raise ValueError(
                f"--local-ranks must be one of {', '.join(LOCAL_RANK_MODES)}, "
                f"got {self.local_ranks!r}"
            )
        for key in self.env:
            if key in RESERVED_ENV:
                raise ValueError(f"env {key} is set by swarmfd; use {RESERVED_ENV[key]}")
        if self.checkpoint_volume is not None:
            parse_checkpoint_volume(self.checkpoint_volume)
            if ENV_CHECKPOINT_DIR in self.env:
                raise ValueError(
                    f"env {ENV_CHECKPOINT_DIR} is set by --checkpoint-volume (to "
                    f"{CHECKPOINT_TARGET}): give one of them"
                )
        for reserve, limit, what in (
            (self.reserve_cpu, self.limit_cpu, "cpu"),
            (self.reserve_memory, self.limit_memory, "memory"),
        ):
            if reserve is not None and limit is not None and reserve > limit:
                raise ValueError(
                    f"--reserve-{what} is larger than --limit-{what}: a task could never get "
                    "what it reserves"
                )
        for net in self.networks:
            if net == self.name:
                raise ValueError(
                    f"--network {net}: the job's own network has the job's name already"
                )
        if self.shm_size is not None and (isinstance(self.shm_size, bool) or not isinstance(
                self.shm_size, int) or self.shm_size < 1):
            raise ValueError(f"--shm-size must be a size of at least 1 byte, got "
                             f"{self.shm_size!r}")
        for m in self.mounts:
            if str(m.get("Source", "")).startswith(SHM_VOLUME_PREFIX):
                raise ValueError(
                    f"--mount: {m.get('Source')} is a volume where a job's ranks share memory "
                    f"(swarmfd's own, {SHM_VOLUME_PREFIX}<job>-<id>): a job mounts only its "
                    "own, which deploy adds")
        targets = [m.get("Target") for m in self.all_mounts()]
        duplicates = sorted({t for t in targets if targets.count(t) > 1})
        if duplicates:
            if duplicates[0] == CHECKPOINT_TARGET and self.checkpoint_volume:
                raise ValueError(f"--mount: {CHECKPOINT_TARGET} is where --checkpoint-volume "
                                 "mounts its volume: mount something else elsewhere")
            if duplicates[0] == SHM_DEV and self.shm_size:
                raise ValueError(f"--mount: {SHM_DEV} is where --shm-size mounts its tmpfs: "
                                 "size it with --shm-size instead")
            raise ValueError(f"--mount: the target {duplicates[0]} is mounted twice")

    def _check_rendezvous_port(self) -> None:
        """What every rank would refuse, refused at deploy (swarmfd.config's rule, a
        ConfigError, so a ValueError): a SWARMFD_PORT that is no port or is MASTER_PORT
        (torch.distributed's), or none at all to derive (--master-port 65535)."""
        env = {"MASTER_PORT": str(self.master_port)}
        if ENV_PORT in self.env:
            env[ENV_PORT] = self.env[ENV_PORT]
        try:
            rendezvous_port(env)
        except ValueError as exc:
            raise ValueError(f"{exc} (MASTER_PORT is --master-port, {ENV_PORT} -e "
                             f"{ENV_PORT}=PORT)") from None

    def all_mounts(self) -> list[dict[str, Any]]:
        """The ``--mount``s plus the ``--checkpoint-volume`` (a named volume of the
        local driver: Swarm creates it on each node where a rank starts, and keeps it
        after the job; ``docker volume rm NAME`` deletes it), the node's
        shared-memory volume (:meth:`shares_nodes`) and the tmpfs at ``/dev/shm``
        (``shm_size``)."""
        mounts = [dict(m) for m in self.mounts]
        if self.checkpoint_volume:
            mounts.append({"Type": "volume", "Source": self.checkpoint_volume,
                           "Target": CHECKPOINT_TARGET})
        if self.shares_nodes():
            mounts.append({"Type": "volume", "Source": self.shm_volume(), "Target": SHM_TARGET,
                           "VolumeOptions": {"NoCopy": True, "Labels": self.job_labels(),
                                             "DriverConfig": dict(SHM_VOLUME_DRIVER)}})
        if self.shm_size:
            mounts.append({"Type": "tmpfs", "Target": SHM_DEV,
                           "TmpfsOptions": {"SizeBytes": self.shm_size, "Mode": 0o1777}})
        return mounts

    def shm_volume(self) -> str:
        """The volume of this job's own where its ranks on a node meet to share memory
        (see the module docstring): one name per deploy, never another job's."""
        return f"{SHM_VOLUME_PREFIX}{self.name}-{self.launch_id}"

    def shares_nodes(self) -> bool:
        """True when ranks may share a node (more than one rank, not --max-per-node 1):
        they then mount the job's shared-memory volume, unless ``-e SWARMFD_SHM_DIR``
        names a directory of the user's own."""
        return (self.world_size > 1 and self.max_per_node != 1
                and ENV_SHM_DIR not in self.env)

    def job_labels(self) -> dict[str, str]:
        """The labels on every object of the job (service, network, containers)."""
        return {**self.labels, LABEL_JOB: self.name}

    def restart_policy(self) -> dict[str, Any]:
        """The tasks' restart policy. One-shot ranks: a task that ends is never restarted
        (a restarted rank could not rejoin a running group; ``swarmfd deploy`` stops the
        job when a rank fails). An elastic job's failed task is, at once: the new one
        joins the running job."""
        if self.elastic and self.elastic_restarts:
            return {"Condition": "on-failure", "Delay": 0, "Window": 0,
                    "MaxAttempts": self.elastic_restarts}
        return {"Condition": "none", "MaxAttempts": 0}

    def task_env(self) -> list[str]:
        """The service's environment, ``KEY=VALUE`` strings (templates expanded by Swarm)."""
        contract = {
            "WORLD_SIZE": str(self.world_size),
            "SWARMFD_TASK_SLOT": "{{.Task.Slot}}",
            "MASTER_ADDR": "{{.Service.Name}}-1",
            "MASTER_PORT": str(self.master_port),
            "SWARMFD_JOB": self.name,
            ENV_JOB_ID: self.launch_id,
            "SWARMFD_RESTART_COUNT": str(self.restart_count),
        }
        if self.timeout is not None:
            contract["SWARMFD_TIMEOUT"] = f"{self.timeout:g}"
        if self.init_timeout is not None:
            contract["SWARMFD_INIT_TIMEOUT"] = f"{self.init_timeout:g}"
        if self.checkpoint_volume:
            contract[ENV_CHECKPOINT_DIR] = CHECKPOINT_TARGET
        # A status line every STATUS_INTERVAL s on each rank's stderr: what `swarmfd top`
        # reads from the service log (deploy and logs hide the lines).
        defaults = {"PYTHONUNBUFFERED": "1", "SWARMFD_STATUS": STATUS_INTERVAL}
        if self.local_ranks == "node":
            # The entrypoint then leaves LOCAL_RANK/LOCAL_WORLD_SIZE unset, and swarmfd
            # derives them at rendezvous by grouping the ranks on SWARMFD_NODE.
            contract["SWARMFD_NODE"] = "{{.Node.Hostname}}"
        else:
            # The node is still the rank's host (module docstring); its local ranks stay
            # per container, 0 of 1, unless the user sets them.
            defaults.update(SWARMFD_NODE="{{.Node.Hostname}}", LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="1")
        if self.shares_nodes():
            contract[ENV_SHM_DIR] = SHM_TARGET
        if self.elastic:
            contract.update(SWARMFD_ELASTIC="1", SWARMFD_ELASTIC_JOIN="auto",
                            SWARMFD_ELASTIC_PEERS="tasks.{{.Service.Name}}")
        # Defaults first (the user may override them), the contract last (it may not).
        merged = {**defaults, **self.env, **contract}
        return [f"{k}={v}" for k, v in merged.items()]


#: SWARMFD_STATUS of a Swarm job's ranks (seconds): each line goes to the service log,
#: which keeps it, so less often than ``swarmfd run``'s.
STATUS_INTERVAL = "2"


def secret_name(job_name: str) -> str:
    """The name of a job's Docker secret: ``<job>-secret``."""
    return f"{job_name}-secret"


def build_service_spec(job: JobSpec, secret_id: str | None = None) -> dict[str, Any]:
    """The Engine API ``ServiceSpec`` of the job (``POST /services/create`` body).

    ``secret_id``: the job's Docker secret (``<job>-secret``), mounted in every rank at
    ``/run/secrets/swarmfd_secret``, owned by root, mode 0444 (SECRET_MODE). Only its ID
    and name are in the spec; its content never is (nor in the environment or command
    line).
    """
    container: dict[str, Any] = {
        "Image": job.image_ref,
        # Args, not Command: Command would replace the image's ENTRYPOINT (the swarmfd
        # entrypoint that turns the task slot into RANK).
        "Args": list(job.command),
        "Env": job.task_env(),
        "Hostname": "{{.Service.Name}}-{{.Task.Slot}}",
        "Init": True,
        "Labels": job.job_labels(),
    }
    if job.workdir:
        container["Dir"] = job.workdir
    mounts = job.all_mounts()
    if mounts:
        container["Mounts"] = mounts
    if secret_id:
        container["Secrets"] = [{
            "SecretID": secret_id,
            "SecretName": secret_name(job.name),
            "File": {"Name": SECRET_TARGET, "UID": "0", "GID": "0", "Mode": SECRET_MODE},
        }]
    resources: dict[str, Any] = {}
    limits = {k: v for k, v in (("NanoCPUs", job.limit_cpu),
                                ("MemoryBytes", job.limit_memory)) if v is not None}
    reservations: dict[str, Any] = {
        k: v for k, v in (("NanoCPUs", job.reserve_cpu), ("MemoryBytes", job.reserve_memory))
        if v is not None
    }
    if job.generic_resources:
        reservations["GenericResources"] = [dict(r) for r in job.generic_resources]
    if limits:
        resources["Limits"] = limits
    if reservations:
        resources["Reservations"] = reservations
    placement: dict[str, Any] = {}
    if job.constraints:
        placement["Constraints"] = list(job.constraints)
    if job.max_per_node is not None:
        placement["MaxReplicas"] = job.max_per_node
    if job.elastic:
        container["StopGracePeriod"] = ELASTIC_STOP_GRACE * 10**9
    task: dict[str, Any] = {
        "ContainerSpec": container,
        "RestartPolicy": job.restart_policy(),
        "Networks": [{"Target": job.name}] + [{"Target": n} for n in job.networks],
    }
    if resources:
        task["Resources"] = resources
    if placement:
        task["Placement"] = placement
    labels = {
        **job.job_labels(),
        LABEL_WORLD_SIZE: str(job.world_size),
        LABEL_IMAGE: job.image,
    }
    if job.version:
        labels[LABEL_VERSION] = job.version
    if job.elastic:
        labels[LABEL_ELASTIC] = "1"
    return {
        "Name": job.name,
        "Labels": labels,
        "TaskTemplate": task,
        # replicated, not replicated-job: a job-mode task's {{.Task.Slot}} is not 1..N,
        # and job mode runs one task at a time unless MaxConcurrent is set.
        "Mode": {"Replicated": {"Replicas": job.world_size}},
        # No virtual IP: it needs IPVS, which not every host has; ranks use task names.
        "EndpointSpec": {"Mode": "dnsrr"},
    }


def build_network_spec(job: JobSpec) -> dict[str, Any]:
    """Keyword arguments of the job's network: attachable overlay, labelled.

    With ``encrypt_network`` the overlay's VXLAN traffic between nodes is IPsec
    (ESP, AES-GCM) encrypted by Docker (driver option ``encrypted``). Every node's
    kernel needs ESP and GCM support (``esp4``/``CONFIG_INET_ESP``, ``gcm``): where it
    is missing Docker still creates the network, but drops the traffic between nodes.
    Ranks on one node do not cross the VXLAN and are unaffected either way.
    """
    spec: dict[str, Any] = {
        "name": job.name,
        "driver": "overlay",
        "attachable": True,
        "labels": job.job_labels(),
    }
    if job.encrypt_network:
        spec["options"] = {"encrypted": ""}
    return spec
