"""Process groups: the world (made by ``init``, :mod:`swarmfd.session`), sub-groups,
and each host's group. Init makes:

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

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .comm import transport as _transport
from .comm.plane import Plane
from .comm.planes import shm as _shm
from .config import (
    Config,
)
from .counters import CallStats
from .errors import (
    NotInitializedError,
    SwarmfdError,
)

__all__ = [
    "NON_GROUP_MEMBER",
    "Group",
    "get_config",
    "get_rank",
    "get_world_size",
    "host_group",
    "is_initialized",
    "new_group",
]

_SLOTS = _shm.SLOTS
_SEGMENT_BYTES = _shm.SEGMENT_BYTES

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
        #: The group's calls worked out once (swarmfd.call.Schedule), by the call's key.
        self.schedules: dict[Any, Any] = {}
        #: This rank's counters of the group's calls (swarmfd.counters).
        self.stats = CallStats(state.config.rank, state.config.world_size)

    def __repr__(self) -> str:
        return (f"swarmfd.Group({self.name}, rank {self.rank} of {self.size}, "
                f"ranks {list(self.ranks)})")

    # -- what the collectives need -----------------------------------------------------

    @property
    def world_rank(self) -> int:
        return self._state.config.rank

    @property
    def world_size(self) -> int:
        return self._state.config.world_size

    @property
    def channel(self) -> Any:
        t = self._state.transport
        return None if t is None else t.channel

    @property
    def engine(self) -> Any:
        """The progress engine of the process (None in a world of one)."""
        return self._state.engine

    @property
    def tcp(self) -> Plane | None:
        """The TCP plane (point-to-point messages take it), None in a world of one."""
        t = self._state.transport
        return None if t is None else t.tcp

    def failure(self) -> BaseException:
        """The error of a call of this broken group (not yet counted in ``seq``): a peer's
        abort as it came for the very call the peer failed, else the earlier failure's."""
        b = self.broken
        if self.broken_from == self.seq + 1 and isinstance(b, SwarmfdError):
            return type(b)(str(b))
        where = "" if self.gid == WORLD_GID else f" ({self.name})"
        if isinstance(b, SwarmfdError):
            return type(b)(f"the process group{where} is unusable after an earlier failure "
                           f"({b}); call swarmfd.cleanup() and swarmfd.init() to start again")
        return RuntimeError(f"the process group{where} is unusable after an earlier failure: "
                            f"{b!r}")

    def forget(self) -> None:
        """Drop the calls worked out so far: the planes changed (init added shared memory),
        or they close."""
        self.schedules.clear()
        self._plane = (None, None, None)
        self._two_level = None

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
    #: call), applied when it makes them: see group_error.
    early_errors: dict[int, tuple[BaseException, int]] = dataclasses.field(
        default_factory=dict)
    #: The new_group ids of groups this rank is not a member of.
    outside: set[int] = dataclasses.field(default_factory=set)
    #: ``time.monotonic()`` at init, or at the last ``stats(reset=True)``: the start of
    #: the counters' window (its wall time).
    since: float = dataclasses.field(default_factory=time.monotonic)
    #: The straggler summary cleanup found (rank 0), for the last status line.
    summary: str = ""
    #: The thread writing this rank's status lines (swarmfd.observe), if any.
    status: Any = None
    #: The generation of an elastic job this world is (0: the first; see
    #: swarmfd.membership); every world of a job that is not elastic is its first.
    generation: int = 0


_state: _State | None = None
#: Guards the process state (init, cleanup, new_group).
STATE_LOCK = threading.Lock()
#: Guards a group's making against its failure arriving at the same time (group_error).
_early_lock = threading.Lock()


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
    s = _state
    if s is None:
        s = current(what)  # raises
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
        if group._state.generation < s.generation:
            raise ValueError(
                f"swarmfd.{what}: {group!r} was made in generation {group._state.generation} "
                f"of this elastic job, and the world was re-formed since (generation "
                f"{s.generation}, {s.config.world_size} ranks): make it again in a reset "
                "callback (state.register_reset_callbacks)")
        raise ValueError(f"swarmfd.{what}: {group!r} belongs to an earlier process group "
                         "(before cleanup); create it again after init")
    return group


def make_groups(state: _State) -> None:
    """The world group and this host's group."""
    n, me = state.config.world_size, state.config.rank
    state.world = Group(state, WORLD_GID, range(n), "world")
    state.groups[WORLD_GID] = state.world
    mine = state.hosts[me]
    state.host = Group(state, HOST_GID, [r for r in range(n) if state.hosts[r] == mine],
                       f"host {mine}")
    state.groups[HOST_GID] = state.host


def group_error(state: _State, gid: int, exc: BaseException, first: int) -> None:
    """Another group's abort or mismatch, seen while this rank waited elsewhere, or an
    abort of a later call of this group: the group fails from its call ``first`` on.

    The group may not be made here yet: making one needs no message, so a peer may make
    it, fail its first call and abort it while this rank is still busy before its own
    new_group. The failure is then kept until this rank makes the group (dropped, this
    rank would wait in that call for the peer that left it, until the timeout)."""
    g = state.groups.get(gid)
    if g is None:
        # Not STATE_LOCK: init holds it while its transport may read messages.
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
    """Whether this rank may still make group ``gid`` (it has not, see group_error): a
    new_group id but of a group it is not a member of, or a members_group id (made by its
    members alone, whenever they agree)."""
    if FIRST_USER_GID <= gid <= MAX_GID:
        return gid not in state.outside
    return MEMBERS_FIRST_GID <= gid <= MEMBERS_MAX_GID


def _made(state: _State, g: Group) -> Group:
    """Record the group ``g`` this rank just made (under STATE_LOCK), with a failure its peers
    announced before (see group_error)."""
    with _early_lock:
        state.groups[g.gid] = g
        early = state.early_errors.pop(g.gid, None)
    if early is not None:
        _break(g, *early)
    return g


# -- groups -------------------------------------------------------------------------------


def new_group(ranks: Iterable[int] | None = None) -> Any:
    """A sub-group of the world: every rank calls it, with the same ``ranks``, in the same
    order (as torch's ``new_group``). Members get a :class:`Group` (group ranks follow the
    sorted world ranks), the others :data:`NON_GROUP_MEMBER`. ``None``: every rank."""
    s = current("new_group()")
    n = s.config.world_size
    members = list(range(n)) if ranks is None else _check_ranks(ranks, n)
    with STATE_LOCK:
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
    with STATE_LOCK:
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


def active() -> _State | None:
    """This process's membership, or None before init and after cleanup."""
    return _state


def activate(state: _State) -> None:
    """Make ``state`` this process's membership (init, :mod:`swarmfd.session`)."""
    global _state
    _state = state


def release() -> _State | None:
    """End this process's membership; the state it had (cleanup)."""
    global _state
    s, _state = _state, None
    return s
