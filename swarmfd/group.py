"""Process groups: the world (created by :func:`init`), sub-groups, and each host's group.

``init`` validates the configuration, resolves ``MASTER_ADDR``, binds this rank's TCP
data plane on the interface that routes to rank 0, runs the rendezvous, connects to
every peer and sets up shared memory among each host's ranks. A world of one needs
no sockets at all. It creates:

* the **world** group (every rank; ``group=None`` in every call);
* this host's group (:func:`host_group`: the ranks whose ``SWARMFD_NODE``, else host
  name, is this rank's), like torch's intra-node group or mpi4py's
  ``Split_type(COMM_TYPE_SHARED)``.

:func:`new_group` makes more, with torch's semantics: every rank of the world calls it
with the same list, in the same order; members get a :class:`Group`, the others
:data:`NON_GROUP_MEMBER`. Group ranks follow the sorted world ranks. Groups reuse the
world's connections (the listeners closed after init) and carry a group id in every
message header, so the traffic of different groups never mixes.

A group whose ranks all share a host (and its shared memory) runs over shared
memory; any other over TCP, its ring ordered by host so that it crosses each host's
link as few times as possible, or, when some host holds several of its ranks and
shares memory among them, with the two-level algorithms (:mod:`swarmfd.algorithms.hier`;
``SWARMFD_HIERARCHY=off`` keeps the flat ones). Which hosts share memory is known to
every rank: when the job spans hosts, init ends with an exchange of every rank's
shared-memory plane (a host whose setup fell back to TCP has none), so all ranks of a
group pick the same algorithms.

Failure. A collective that fails (a peer lost, a timeout, a mismatch, an abort)
*breaks its group*: every later call on it raises at once with the original reason,
because its ranks can no longer agree on where they are. Other groups, the world
included, keep working, except where the cause is a lost rank: every group that
contains it then fails as soon as it waits on it. ``cleanup()`` and a new ``init()``
start over.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .comm import malloc as _malloc
from .comm import spin as _spin
from .comm import transport as _transport
from .comm.plane import PeerInfo, Plane
from .comm.planes import shm as _shm
from .comm.security import Security
from .config import (
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    Config,
    cma_enabled,
    config_from_env,
    data_plane,
    encrypt_enabled,
    hierarchy_mode,
    malloc_mode,
    master_port,
    node_name,
    require_secret,
    spin_mode,
    transport_mode,
)
from .errors import (
    AlreadyInitializedError,
    ConfigError,
    NotInitializedError,
    SwarmfdError,
)

__all__ = [
    "NON_GROUP_MEMBER",
    "Group",
    "cleanup",
    "get_config",
    "get_rank",
    "get_world_size",
    "host_group",
    "init",
    "init_from_env",
    "is_initialized",
    "new_group",
]

_SLOTS = _shm.SLOTS
_SEGMENT_BYTES = _shm.SEGMENT_BYTES

#: Seconds a failed group's sockets may take at cleanup to deliver the abort messages.
ABORT_LINGER = 0.5
#: Group ids: the world, every host's group (hosts' groups have no member in common, so
#: they share one id), the calls init makes itself, and the first of new_group's.
WORLD_GID = 0
HOST_GID = 1
SETUP_GID = 0xFFFF
#: The exchange of shared-memory planes that ends init (see _share_domains).
DOMAINS_GID = 0xFFFE
FIRST_USER_GID = 2
#: new_group's ids end here; the ids above, up to MEMBERS_MAX_GID, are for groups that
#: only their members make (members_group: torch's new_group through the c10d backend).
MAX_GID = 0x7FFF
MEMBERS_FIRST_GID = 0x8000
MEMBERS_MAX_GID = 0xFFFD


class _NonMember:
    """What :func:`new_group` returns on a rank that is not in the group."""

    _instance: _NonMember | None = None

    def __new__(cls) -> _NonMember:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "swarmfd.NON_GROUP_MEMBER"

    def __reduce__(self) -> str:
        return "NON_GROUP_MEMBER"


#: The value :func:`new_group` returns on ranks outside the group; passing it to a
#: collective is an error that says so.
NON_GROUP_MEMBER: Any = _NonMember()


class Group:
    """A process group: the ranks that run collectives together (see module docstring).

    ``rank`` is this process's rank in the group, ``size`` the number of ranks,
    ``ranks`` their world ranks in group-rank order.
    """

    def __init__(self, state: _State, gid: int, ranks: Sequence[int], name: str,
                 area: int | None = -1) -> None:
        self._state = state
        self.gid = gid
        #: The area of the members' shared-memory segments this group's rounds use (see
        #: choose_area); None: the group never uses shared memory. By default the one its
        #: id picks (the world's 0, the host groups' 1, init's own groups').
        self.area: int | None = gid % _shm.AREAS if area == -1 else area
        #: Byte offset of the area in every member's segment (next_slot's start).
        self._area_at = 0 if self.area is None else _shm.area_of(self.area)
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(state.config.rank)
        self.name = name
        #: Sequence number of this group's latest call (the first call is #1).
        self.seq = 0
        #: The error that broke the group, if one did, and the group's first call it
        #: fails (0: every call; a peer's abort of a later call than the current one
        #: lets the calls before it finish, see swarmfd.comm.channel).
        self.broken: BaseException | None = None
        self.broken_from = 0
        #: Rounds done over shared memory (every member counts the same).
        self.shm_round = 0
        #: plane()'s answer, and the (transport, shm plane) it was computed for.
        self._plane: tuple[Any, Any, Plane | None] = (None, None, None)
        #: Point-to-point messages sent to / received from (peer world rank, tag) so far.
        self.p2p_sent: dict[tuple[int, int], int] = {}
        self.p2p_received: dict[tuple[int, int], int] = {}
        self._scratch: dict[np.dtype, np.ndarray] = {}
        hosts = state.hosts
        first: dict[str, int] = {}
        for r in self.ranks:
            first.setdefault(hosts[r], len(first))
        #: Group ranks in ring order: by host (in order of first appearance), then rank.
        self.ring = sorted(range(self.size), key=lambda g: (first[hosts[self.ranks[g]]], g))
        #: The hosts the group spans, and its members on each (group ranks).
        self.by_host: dict[str, list[int]] = {}
        for g in range(self.size):
            self.by_host.setdefault(hosts[self.ranks[g]], []).append(g)
        self._two_level: Any = None  # (layout, shm plane) or False, once known
        #: The group's prepared small calls (swarmfd.prepared), by the call's key.
        self.prepared: dict[Any, Any] = {}

    def __repr__(self) -> str:
        return (f"swarmfd.Group({self.name}, rank {self.rank} of {self.size}, "
                f"ranks {list(self.ranks)})")

    # -- what the collectives need -----------------------------------------------------

    @property
    def world_rank(self) -> int:
        return self._state.config.rank

    @property
    def channel(self) -> Any:
        t = self._state.transport
        return None if t is None else t.channel

    def plane(self) -> Plane | None:
        """The plane this group's calls run on: shared memory when every member is on
        this host's shared memory, else TCP; None in a world of one."""
        t = self._state.transport
        if t is None:
            return None
        shm = t.shm
        cached_t, cached_shm, plane = self._plane
        if cached_t is t and cached_shm is shm:
            return plane
        plane = shm if shm is not None and self.area is not None and all(
            r in shm.segments for r in self.ranks) else t.tcp
        self._plane = (t, shm, plane)
        return plane

    def two_level(self) -> tuple[Any, Plane] | None:
        """(its :class:`~swarmfd.algorithms.hier.Layout`, this host's shared-memory
        plane) when the group's calls may take the two-level algorithms, else None
        (see :func:`swarmfd.algorithms.select.two_level_layout`; the same answer on
        every member)."""
        if self._two_level is None:
            from .algorithms.select import two_level_layout

            s = self._state
            t = s.transport
            lay = None
            if t is not None and s.shm_domains is not None and self.area is not None:
                lay = two_level_layout([s.hosts[r] for r in self.ranks],
                                       [s.shm_domains[r] for r in self.ranks], self.rank,
                                       s.hierarchy)
            # (A rank alone on its host has no shared-memory plane, and needs none.)
            self._two_level = (lay, t.shm) if lay is not None and t is not None else False
        return self._two_level or None

    def next_slot(self) -> int:
        """Byte offset of the shared-memory slot of the next round (the same on every
        member: each group rotates over the slots of its own area)."""
        assert self.area is not None, "a group without a shared-memory area (a bug)"
        r = self.shm_round
        self.shm_round = r + 1
        return self._area_at + (r % _SLOTS) * _SEGMENT_BYTES

    def slot_offset(self, k: int) -> int:
        """Byte offset of slot ``k`` (modulo the slots) of the group's shared-memory area:
        round r's is slot r (see :meth:`next_slot`)."""
        assert self.area is not None, "a group without a shared-memory area (a bug)"
        return self._area_at + (k % _SLOTS) * _SEGMENT_BYTES

    def scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A reusable flat buffer (for fusing lists of arrays) of at least ``count`` items."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:count]

    def world_to_group(self, rank: int, what: str, name: str) -> int:
        """The group rank of world rank ``rank`` (a ValueError naming ``what``)."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"swarmfd.{name}: {what}={rank} is not a rank of {self!r}") from None


@dataclasses.dataclass
class _State:
    """This process's membership of the job: what init created, cleanup ends."""

    config: Config
    transport: _transport.Transport | None
    hosts: list[str]
    world: Group | None = None
    host: Group | None = None
    groups: dict[int, Group] = dataclasses.field(default_factory=dict)
    next_gid: int = FIRST_USER_GID
    #: Every new_group call's members and shared-memory area, members or not (the same
    #: list on every rank: choose_area decides from it).
    made: list[tuple[frozenset[int], int | None]] = dataclasses.field(default_factory=list)
    engine: Any = None
    #: Per world rank, its shared-memory plane's lowest rank (-1: none); None until init
    #: exchanged them (or when no rank offers shared memory).
    shm_domains: list[int] | None = None
    #: SWARMFD_HIERARCHY of this process (init checks that every rank has the same).
    hierarchy: str = "auto"
    #: Failures of groups this rank has not made yet (group id -> error, first failed
    #: call), applied when it makes them: see _group_error.
    early_errors: dict[int, tuple[BaseException, int]] = dataclasses.field(
        default_factory=dict)
    #: The new_group ids of groups this rank is not a member of.
    outside: set[int] = dataclasses.field(default_factory=set)


_state: _State | None = None
_lock = threading.Lock()
#: Guards a group's making against its failure arriving at the same time (_group_error).
_early_lock = threading.Lock()
#: Environment variables init set (see _export_local_ranks); cleanup removes them.
_exported: list[str] = []


def current(what: str = "this call") -> _State:
    """The active process state, or :class:`NotInitializedError` naming ``what``."""
    s = _state
    if s is None:
        raise NotInitializedError(
            f"swarmfd.{what} called before the process group was initialised: call "
            "swarmfd.init(world_size, rank) or swarmfd.init_from_env() first"
        )
    return s


def resolve_group(group: Any, what: str) -> Group:
    """``group`` (None: the world) as a Group of this process, or a clear error."""
    s = current(what)
    if group is None:
        assert s.world is not None
        return s.world
    if group is NON_GROUP_MEMBER:
        raise ValueError(f"swarmfd.{what}: this rank is not a member of the group "
                         "(new_group returned NON_GROUP_MEMBER here); only members call its "
                         "collectives")
    if not isinstance(group, Group):
        raise TypeError(f"swarmfd.{what}: group must be a swarmfd.Group (from new_group or "
                        f"host_group) or None for the world, got {type(group).__name__}")
    if group._state is not s:
        raise ValueError(f"swarmfd.{what}: {group!r} belongs to an earlier process group "
                         "(before cleanup); create it again after init")
    return group


# -- init and cleanup -------------------------------------------------------------------


def init(
    world_size: int | None = None,
    rank: int | None = None,
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
    (``MASTER_ADDR``, ``SWARMFD_PORT`` or ``MASTER_PORT``, ``SWARMFD_TIMEOUT``,
    ``SWARMFD_INIT_TIMEOUT``). ``master_port`` is the port of swarmfd's rendezvous on
    ``master_addr`` (:attr:`Config.rendezvous_port`), used as given; without it,
    ``SWARMFD_PORT``, else ``MASTER_PORT + 1`` (29501 when neither is set): MASTER_PORT
    itself is left to torch.distributed, so ``init_process_group`` can run beside
    swarmfd, before or after ``init``.
    ``timeout`` is how long any collective may wait for a peer; ``init_timeout``
    how long this call waits for every rank to join (default: ``timeout``), so
    ranks that start far apart can meet while a stuck collective still fails
    fast.

    Without ``world_size`` and ``rank`` (give both or neither) the group is the one
    the environment describes, as :func:`init_from_env` finds it (``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``, ...; a world of one when nothing is set), and the other
    arguments override it: so a bare ``fd.init()`` under ``swarmfd run`` or on a
    Swarm joins the job instead of silently training alone.

    A world of more than one rank needs the job secret (at least 32 characters,
    the same on every rank): ``secret``, or else the file named by
    ``SWARMFD_SECRET_FILE`` (default ``/run/secrets/swarmfd_secret``), unless
    ``SWARMFD_AUTH=off``. Only processes holding it can join, send data or abort.
    """
    import os

    if (world_size is None) != (rank is None):
        raise TypeError("swarmfd.init: give both world_size and rank, or neither (then both "
                        f"come from the environment, WORLD_SIZE and RANK); got world_size="
                        f"{world_size!r}, rank={rank!r}")
    if world_size is None:
        return _start(config_from_env(
            local_rank=local_rank, local_world_size=local_world_size, master_addr=master_addr,
            rendezvous_port=master_port, timeout=timeout, init_timeout=init_timeout), secret)
    env = config_from_env({k: v for k, v in os.environ.items()
                           if k in ("MASTER_ADDR", "MASTER_PORT", "SWARMFD_PORT",
                                    "SWARMFD_TIMEOUT", "SWARMFD_INIT_TIMEOUT",
                                    "SWARMFD_RESTART_COUNT")}, rendezvous_port=master_port)
    config = Config(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr if master_addr is not None else env.master_addr,
        rendezvous_port=env.rendezvous_port,
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


def _security(config: Config, secret: str | bytes | None) -> Security | None:
    """The group's keys (derived from the job secret), or None without authentication."""
    job_secret = require_secret(config.world_size, secret)
    if job_secret is None:
        return None
    return Security.from_secret(job_secret, encrypt_enabled())


def _reserved_ports(config: Config) -> set[int]:
    """Ports this rank's data plane must not listen on (see ``avoid`` of
    :class:`swarmfd.comm.transport.Transport`): the rendezvous port, and MASTER_PORT when
    the environment has a valid one (torch.distributed's, beside swarmfd)."""
    torch_port = master_port()
    return {config.rendezvous_port} | ({torch_port} if torch_port is not None else set())


def _start(config: Config, secret: str | bytes | None = None) -> Config:
    global _state
    with _lock:
        if _state is not None:
            raise AlreadyInitializedError(
                f"swarmfd.init called twice: this process is already rank {_state.config.rank} "
                f"of {_state.config.world_size}; call swarmfd.cleanup() first"
            )
        if config.world_size == 1:
            config = dataclasses.replace(
                config,
                local_rank=config.local_rank or 0,
                local_world_size=config.local_world_size or 1,
            )
            state = _State(config, None, [node_name()])
            _make_groups(state)
            _state = state
            _export_local_ranks(config)
            return config
        assert config.master_addr is not None  # Config guarantees it for world_size > 1
        security = _security(config, secret)
        plane = data_plane()
        mode = transport_mode()
        spinning = spin_mode()
        cma = cma_enabled()  # read (and checked) before anything starts
        if plane == "zmq":  # buffers allocated and freed on two threads (swarmfd.comm.malloc)
            _malloc.tune(malloc_mode())
        deadline = time.monotonic() + config.join_timeout
        master_ip = _transport.resolve(config.master_addr, deadline)
        bind_ip = _transport.local_address_toward(master_ip)
        t = _transport.Transport(config.rank, config.world_size, config.timeout, bind_ip,
                                 security, plane, config.join_timeout,
                                 avoid=_reserved_ports(config))
        try:
            from .comm import shm_setup

            hostkey = shm_setup.host_key() if mode == "auto" else ""
            me = t.me(node_name(), hostkey)
            peers = t.rendezvous(me, master_ip, config.rendezvous_port, deadline)
            t.connect(None, deadline)
            hosts = [p.host for p in peers]
            # On the zmq plane libzmq's I/O thread moves the bytes of every peer over TCP
            # (all of them with SWARMFD_TRANSPORT=tcp, those of other hosts otherwise).
            zmq_io = plane == "zmq" and (mode == "tcp" or len(set(hosts)) > 1)
            _spin.configure(spinning, hosts.count(hosts[config.rank]),
                            threads_per_rank=2 if zmq_io else 1)
            config = _with_local_ranks(config, hosts)
            state = _State(config, t, hosts, hierarchy=hierarchy_mode())
            _make_groups(state)
            state.engine = _engine(state)
            _state = state
            _export_local_ranks(config)
        except BaseException:
            t.close()
            raise
    if any(p.hostkey for p in peers):
        try:
            if hostkey:
                _setup_shm(state, peers, hostkey, deadline, cma)
            if len(set(state.hosts)) > 1:  # (on one host no group is two-level)
                _share_domains(state)
        except BaseException:
            cleanup()
            raise
    return config


def _make_groups(state: _State) -> None:
    """The world group and this host's group."""
    n, me = state.config.world_size, state.config.rank
    state.world = Group(state, WORLD_GID, range(n), "world")
    state.groups[WORLD_GID] = state.world
    mine = state.hosts[me]
    state.host = Group(state, HOST_GID, [r for r in range(n) if state.hosts[r] == mine],
                       f"host {mine}")
    state.groups[HOST_GID] = state.host


def _group_error(state: _State, gid: int, exc: BaseException, first: int) -> None:
    """Another group's abort or mismatch, seen while this rank waited elsewhere, or an
    abort of a later call of this group: the group fails from its call ``first`` on.

    The group may not be made here yet: making one needs no message, so a peer may make
    it, fail its first call and abort it while this rank is still busy before its own
    new_group. The failure is then kept until this rank makes the group (dropped, this
    rank would wait in that call for the peer that left it, until the timeout: 1 run in
    about 15 of a mismatch test under load, 2026-12-04)."""
    g = state.groups.get(gid)
    if g is None:
        # Not _lock: init holds it while its transport may read messages.
        with _early_lock:
            g = state.groups.get(gid)
            if g is None:
                if _made_later(state, gid):
                    early = state.early_errors.get(gid)
                    state.early_errors[gid] = (
                        (exc, first) if early is None else (early[0], min(early[1], first)))
                return
    _break(g, exc, first)


def _break(g: Group, exc: BaseException, first: int) -> None:
    """``g`` fails with ``exc`` from its call ``first`` on (the earliest such call wins)."""
    if g.broken is None:
        g.broken, g.broken_from = exc, first
    else:
        g.broken_from = min(g.broken_from, first)


def _made_later(state: _State, gid: int) -> bool:
    """Whether this rank may still make group ``gid`` (it has not, see _group_error): a
    new_group id but of a group it is not a member of, or a members_group id (made by its
    members alone, whenever they agree)."""
    if FIRST_USER_GID <= gid <= MAX_GID:
        return gid not in state.outside
    return MEMBERS_FIRST_GID <= gid <= MEMBERS_MAX_GID


def _made(state: _State, g: Group) -> Group:
    """Record the group ``g`` this rank just made (under _lock), with a failure its peers
    announced before (see _group_error)."""
    with _early_lock:
        state.groups[g.gid] = g
        early = state.early_errors.pop(g.gid, None)
    if early is not None:
        _break(g, *early)
    return g


def _engine(state: _State) -> Any:
    """The progress engine of ``state``'s groups (see swarmfd.engine)."""
    from .engine import Engine

    t = state.transport
    assert t is not None

    def failed(g: Group, exc: BaseException, finished: int) -> None:
        if g.broken is None:
            g.broken = exc
        g.broken_from = 0
        t.channel.abort(exc, g.gid, finished)

    engine = Engine(t.channel, state.config.timeout, failed)
    t.channel.on_group_error = lambda gid, exc, first: _group_error(state, gid, exc, first)
    t.channel.on_report = engine.report
    return engine


def _setup_shm(state: _State, peers: list[PeerInfo], hostkey: str, deadline: float,
               cma: bool) -> None:
    """Share memory among the ranks of this host (those with this rank's host key).

    The host's ranks agree after each step over TCP, in calls of their own (not the
    user's: the user's first collective is call #1), so one rank that cannot take part
    makes all of them stay on TCP (with a warning naming it and why) instead of
    hanging, and a lost rank raises PeerLostError here as in any collective.
    """
    from .comm import shm_setup

    t = state.transport
    assert t is not None
    local = [p.rank for p in peers if p.hostkey == hostkey]
    if len(local) < 2:
        return
    setup_group = Group(state, SETUP_GID, local, "shared-memory setup")
    plane = shm_setup.setup(t, local, hostkey, max(deadline, time.monotonic()
                                                    + state.config.timeout),
                            lambda reason: _agree(setup_group, reason))
    if plane is None:
        return
    try:
        _setup_cma(plane, setup_group, cma)
    except BaseException:
        plane.close()
        raise
    t.add_shm(plane)


def _setup_cma(plane: Any, group: Group, wanted: bool) -> None:
    """Whether the host's ranks read each other's memory directly (swarmfd.comm.cma):
    only if every one of them can read every other's and none turned it off
    (``wanted``: SWARMFD_CMA); else they all copy through the segments. Two agreements:
    every rank published its probe, then every rank's verdict."""
    from .config import ENV_CMA

    plane.publish_probe()
    _agree(group, "")
    verdict = plane.check_probes() if wanted else f"{ENV_CMA}=0"
    failed = _agree(group, verdict)
    plane.enable_cma(not failed)
    if failed:
        logging.getLogger("swarmfd").debug(
            "swarmfd rank %d: shared memory copies through segments, without reading "
            "peers' memory: %s", group.world_rank,
            "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))


def _share_domains(state: _State) -> None:
    """Tell every rank which ranks share memory with which (and each rank's
    SWARMFD_HIERARCHY), so that every member of a group picks the same algorithms
    (see :meth:`Group.two_level`): one all_gather of the world, in a group of its own.
    Ranks whose SWARMFD_HIERARCHY differs would pick different algorithms: a
    ConfigError naming them."""
    from . import collectives

    t = state.transport
    assert t is not None
    n = state.config.world_size
    shm = t.shm
    domain = min(shm.segments) if shm is not None else -1  # type: ignore[attr-defined]
    mine = np.array([domain, 1 if state.hierarchy == "auto" else 0], dtype=np.int64)
    group = Group(state, DOMAINS_GID, range(n), "shared-memory planes")
    try:
        rows = collectives.all_gather(mine, group=group)
    except SwarmfdError as exc:
        raise type(exc)(f"init, while the ranks shared their shared-memory planes: {exc}"
                        ).with_traceback(exc.__traceback__) from None
    modes = [int(r[1]) for r in rows]
    if len(set(modes)) > 1:
        off = [r for r in range(n) if not modes[r]]
        raise ConfigError(f"SWARMFD_HIERARCHY differs between ranks: 'off' on rank(s) {off}, "
                          "'auto' on the others; every rank of a job must use the same")
    state.shm_domains = [int(r[0]) for r in rows]


def _agree(group: Group, reason: str) -> dict[int, str]:
    """Every member's failure reason ("" for none): {rank: reason} of those that failed."""
    from . import collectives
    from .comm import shm_setup

    try:
        rows = collectives.all_gather(shm_setup.encode_reason(reason), group=group)
    except SwarmfdError as exc:
        # Say what init was doing: the user called no all_gather.
        raise type(exc)(f"init, while the ranks set up shared memory: {exc}").with_traceback(
            exc.__traceback__) from None
    return {group.ranks[i]: why for i, why in shm_setup.decode_reasons(rows).items()}


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
    import os

    for name, value in ((ENV_LOCAL_RANK, config.local_rank),
                        (ENV_LOCAL_WORLD_SIZE, config.local_world_size)):
        if value is not None and not os.environ.get(name, "").strip():
            os.environ[name] = str(value)
            _exported.append(name)


# -- groups -------------------------------------------------------------------------------


def new_group(ranks: Iterable[int] | None = None) -> Any:
    """A sub-group of the world: every rank calls it, with the same ``ranks``, in the same
    order (as torch's ``new_group``). Members get a :class:`Group` (group ranks follow the
    sorted world ranks), the others :data:`NON_GROUP_MEMBER`. ``None``: every rank."""
    s = current("new_group()")
    n = s.config.world_size
    members = list(range(n)) if ranks is None else _check_ranks(ranks, n)
    with _lock:
        gid = s.next_gid
        if gid > MAX_GID:
            raise ValueError(f"swarmfd.new_group: at most {MAX_GID - FIRST_USER_GID + 1} "
                             "groups can be made in one process group")
        s.next_gid += 1
        area = choose_area(s.made, members)
        s.made.append((frozenset(members), area))
        if s.config.rank not in members:
            with _early_lock:
                s.outside.add(gid)
                s.early_errors.pop(gid, None)
            return NON_GROUP_MEMBER
        if area is None and s.transport is not None and s.transport.shm is not None:
            logging.getLogger("swarmfd").warning(
                "swarmfd.new_group(%s): each of the %d shared-memory areas for groups is in "
                "use by a group with a member in common; this group's calls go over TCP",
                members, len(USER_AREAS))
        return _made(s, Group(s, gid, members, f"group {gid}", area))


#: The areas of the shared-memory segments new_group's groups take: the world's (0) and the
#: host groups' (1) are shared by every group with a member on the host.
USER_AREAS = tuple(range(2, 8))
#: The areas of groups made by their members alone (members_group), apart from
#: new_group's: each kind agrees on its own areas (new_group's from the calls every
#: rank makes, members_group's through the store of torch's c10d backend).
MEMBER_AREAS = tuple(range(8, _shm.AREAS))


def choose_area(made: Sequence[tuple[frozenset[int], int | None]],
                members: Sequence[int], areas: Sequence[int] = USER_AREAS) -> int | None:
    """The shared-memory area of a new group of ``members``, given the groups ``made``
    before it (members, area): the first of ``areas`` that no group with a member in
    common uses, else None (the group goes over TCP).

    A rank writes its rounds of every group into its own segment, in the group's area,
    and its peers read them there after the rank may have moved on: two groups with a
    member in common must not share an area, or one's rounds overwrite the other's
    still being read (a wrong result, not an error: 7 groups of 2 ranks, the 7th in
    the world's area when areas followed the group id, gave 39-102 wrong all_reduces
    in 20000). Groups without a common member may share one: each reads only its own
    members' segments. Every rank decides the same from the same calls."""
    mine = set(members)
    used = {area for ranks, area in made if area is not None and ranks & mine}
    return next((a for a in areas if a not in used), None)


def members_group(gid: int, ranks: Iterable[int], area: int | None = None) -> Group:
    """A sub-group made by its members alone, under an id and a shared-memory area they
    agreed on elsewhere: the id from MEMBERS_FIRST_GID to MEMBERS_MAX_GID, the area one
    of MEMBER_AREAS or None (no shared memory). torch calls a backend on a new group's
    members only, and its c10d backend agrees on both through torch's store, where every
    such group's members and area are recorded (:func:`choose_area` over them). Every
    member calls it with the same arguments; the other ranks never hear of the group.
    Ids and areas are apart from new_group's, so the two kinds may be made in any
    order."""
    s = current("members_group()")
    members = _check_ranks(ranks, s.config.world_size)
    if not MEMBERS_FIRST_GID <= gid <= MEMBERS_MAX_GID:
        raise ValueError(f"swarmfd.members_group: group id {gid} is out of range: expected "
                         f"{MEMBERS_FIRST_GID} <= id <= {MEMBERS_MAX_GID}")
    if area is not None and area not in MEMBER_AREAS:
        raise ValueError(f"swarmfd.members_group: area {area} is not one of the areas of "
                         f"such groups ({MEMBER_AREAS[0]}-{MEMBER_AREAS[-1]}, or None)")
    if s.config.rank not in members:
        raise ValueError(f"swarmfd.members_group: this rank ({s.config.rank}) is not one of "
                         f"the members {members}; only members make the group")
    with _lock:
        if gid in s.groups:
            raise ValueError(f"swarmfd.members_group: group id {gid} is taken already (by "
                             f"{s.groups[gid].name})")
        return _made(s, Group(s, gid, members, f"group {gid}", area))


def _check_ranks(ranks: Iterable[int], world: int) -> list[int]:
    if isinstance(ranks, (str, bytes)):
        raise TypeError(f"swarmfd.new_group: ranks must be a list of integers, got {ranks!r}")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"swarmfd.new_group: ranks must be integers, got {r!r}")
        if not 0 <= int(r) < world:
            raise ValueError(f"swarmfd.new_group: rank {r} is out of range: expected 0 <= rank "
                             f"< world_size ({world})")
        out.append(int(r))
    if not out:
        raise ValueError("swarmfd.new_group: ranks is empty: expected at least one rank")
    if len(set(out)) != len(out):
        dup = sorted(r for r, c in Counter(out).items() if c > 1)
        raise ValueError(f"swarmfd.new_group: ranks {dup} appear more than once")
    return sorted(out)


def host_group() -> Group:
    """The group of this host's ranks (see the module docstring)."""
    s = current("host_group()")
    assert s.host is not None
    return s.host


def world_group() -> Group:
    """The world group (every rank); what ``group=None`` means."""
    s = current("world_group()")
    assert s.world is not None
    return s.world


# -- state ----------------------------------------------------------------------------------


def is_initialized() -> bool:
    """True between a successful :func:`init` and :func:`cleanup`."""
    return _state is not None


def get_config() -> Config:
    """The active group's :class:`Config`."""
    return current("get_config()").config


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 on a non-member."""
    if group is NON_GROUP_MEMBER:
        current("get_rank()")
        return -1
    return resolve_group(group, "get_rank()").rank


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 on a non-member."""
    if group is NON_GROUP_MEMBER:
        current("get_world_size()")
        return -1
    return resolve_group(group, "get_world_size()").size


def cleanup() -> None:
    """Leave the group and close every socket. Idempotent; a later :func:`init` works again."""
    import os

    global _state
    with _lock:
        s, _state = _state, None
        while _exported:
            os.environ.pop(_exported.pop(), None)
    if s is None or s.transport is None:
        return
    if s.engine is not None:
        s.engine.close()
    for g in s.groups.values():
        g.prepared.clear()  # their views of the segments, which close now
    t = s.transport
    if any(g.broken is not None for g in s.groups.values()):
        # A failed group: give the abort messages queued behind unsent data a moment to
        # leave (peers learn the reason), but do not wait for data a lost peer will never
        # take.
        t.close(linger=int(ABORT_LINGER * 1000))
        return
    try:
        t.channel.flush()
    except SwarmfdError:
        pass
    finally:
        t.close()


atexit.register(cleanup)
