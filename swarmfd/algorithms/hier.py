"""Two-level algorithms: shared memory inside each host, TCP between hosts.

A group that spans hosts with several ranks on some host moves most bytes inside the
hosts, at a memory copy's cost. A host's ranks of the group are its *locals* (a rank's
*local index*: its place among them); hosts are in :class:`Layout` order, the same on
every rank. Phases inside a host run over its shared-memory plane (a sub-op,
:meth:`swarmfd.algorithms.base.Op.sub`), phases between hosts over the call's TCP plane;
a host of one rank has no phase inside. Every element's operands combine in one order
(inside its host, then between hosts, in host order), computed once and copied or alike
on every rank: the same bits everywhere.

Each algorithm's steps, barriers and bytes on a host's link: docs/algorithms.md ("Two
levels"). Phases between hosts use the call's own tags (round-major, < 2^30, plus ACK
and SIG of :mod:`.tcp`), phases inside a host a sub-op's from LOCAL_TAGS.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm.planes.shm import SEGMENT_BYTES, SLOTS
from .base import Algorithm, Op, divide_by, mean, num_pieces, reduce_in_order, split
from .tcp import ACK, SIG, barrier

__all__ = ["LOCAL_TAGS", "ROUND_BYTES", "SMALL_GATHER_BYTES", "STREAMS", "Layout", "all_gather",
           "all_reduce_large", "all_reduce_small", "broadcast", "reduce", "reduce_scatter"]

#: Bytes one rank moves through its slot per round of a large call (at most a slot).
ROUND_BYTES = SEGMENT_BYTES
#: TCP streams each way between two hosts (large all_reduce, all_gather): more spread
#: the kernel's work where CPU is the limit, but three overflowed a shaped link's queue
#: (docs/algorithms.md).
STREAMS = 2
#: An all_gather of rows up to this size sends every rank's row itself in one round (a
#: stream per rank, one barrier) instead of through STREAMS carriers (docs/algorithms.md).
SMALL_GATHER_BYTES = 64 << 10
#: Rounds of an all_gather sent ahead of the one being received (more would sit in the
#: send queue, which moves only while the rank waits on TCP).
GATHER_AHEAD = 2
#: Tag base of the phases inside a host: above the phases between hosts, below ACK, SIG.
LOCAL_TAGS = 1 << 31
#: Tag base of the shard rings among their owners (more than two hosts), SHARD_TAGS a
#: shard (a 1 GiB shard's ring uses about 2000), apart from a call's second phase (2^30).
RING_TAGS = 3 << 29
SHARD_TAGS = 1 << 20


@dataclass(frozen=True)
class Layout:
    """How a group's ranks sit on hosts: ``hosts``, the group ranks of each host in
    host order (group rank 0's first, then by first appearance), the same on every
    member; ``me``, this rank's group rank."""

    hosts: tuple[tuple[int, ...], ...]
    me: int

    def __post_init__(self) -> None:
        flat = sorted(r for h in self.hosts for r in h)
        if flat != list(range(len(flat))) or self.me not in flat or not all(self.hosts):
            raise ValueError(f"bad layout {self.hosts} for group rank {self.me}")

    @property
    def host(self) -> int:
        """This rank's host (index into ``hosts``)."""
        return next(h for h, rs in enumerate(self.hosts) if self.me in rs)

    @property
    def local(self) -> int:
        """This rank's local index (its place among its host's ranks)."""
        return self.hosts[self.host].index(self.me)

    @property
    def locals(self) -> list[int]:
        """This host's ranks of the group (group ranks)."""
        return list(self.hosts[self.host])

    @functools.cached_property
    def size(self) -> int:
        """The group's size: its ranks on every host."""
        return sum(len(h) for h in self.hosts)

    @property
    def shards(self) -> int:
        """K: the most ranks any host holds."""
        return max(len(h) for h in self.hosts)

    def two_level(self) -> bool:
        """True when the group spans hosts and some host holds several of its ranks."""
        return len(self.hosts) > 1 and self.shards > 1


def layout_of(hosts: Sequence[str], me: int) -> Layout:
    """The layout of a group whose group rank g runs on host ``hosts[g]``."""
    order: dict[str, list[int]] = {}
    for g, h in enumerate(hosts):
        order.setdefault(h, []).append(g)
    return Layout(tuple(tuple(rs) for rs in order.values()), me)


def _local_op(op: Op, lay: Layout, shm: Any) -> Op | None:
    """The call among this host's ranks, on shared memory (None on a host of one)."""
    if len(lay.hosts[lay.host]) < 2:
        return None
    return op.sub(shm, lay.locals, LOCAL_TAGS, shm, op.next_slot)


# -- all_reduce -------------------------------------------------------------------------


def all_reduce_small(op: Op, buf: np.ndarray, ufunc: np.ufunc, divide: int, lay: Layout,
                     shm: Any) -> Algorithm:
    """Host partials through one slot (``buf`` fits it), exchanged between hosts;
    ``divide``: a mean's divisor (0: none)."""
    hosts, h, i = lay.hosts, lay.host, lay.local
    L = len(hosts[h])
    local = _local_op(op, lay, shm)
    if local is not None:
        slot = op.next_slot()
        regions = local.regions(slot, buf.dtype, buf.size)
        regions[i][...] = buf
        yield from barrier(local, 0)
        reduce_in_order(buf, regions, ufunc)
    H = len(hosts)
    # Local index j sends to local indices k = j mod L of host g, receives from j mod L_g.
    for g in range(H):
        if g != h:
            for k in range(i, len(hosts[g]), L):
                op.send(hosts[g][k], 0, buf, copy=True)  # copied: buf becomes the result
    parts: list[np.ndarray | None] = [None] * H
    for g in range(H):
        if g != h:
            parts[g] = yield from op.recv_array(hosts[g][i % len(hosts[g])], 0, buf)
    parts[h] = buf if h == 0 else buf.copy()
    first, second = parts[0], parts[1]
    assert first is not None and second is not None
    ufunc(first, second, out=buf)
    for g in range(2, H):
        part = parts[g]
        assert part is not None
        ufunc(buf, part, out=buf)
    yield from mean(op, buf, divide)


def all_reduce_large(op: Op, buf: np.ndarray, ufunc: np.ufunc, divide: int, lay: Layout,
                     shm: Any, flat: Callable[..., Any] | None = None,
                     round_bytes: int = ROUND_BYTES) -> Algorithm:
    """Reduce-scatter inside each host, each shard's partials between its owners,
    all-gather inside each host, in rounds; ``flat(nbytes, size, count)``: the
    selection's flat all_reduce among the shards' owners (more than two hosts)."""
    yield from _all_reduce_large(op, buf, ufunc, lay, shm, flat, round_bytes)
    yield from mean(op, buf, divide)


def _all_reduce_large(op: Op, buf: np.ndarray, ufunc: np.ufunc, lay: Layout, shm: Any,
                      flat: Callable[..., Any] | None, round_bytes: int) -> Algorithm:
    local = _local_op(op, lay, shm)
    if len(lay.hosts) == 2:
        yield from _all_reduce_two_hosts(op, buf, ufunc, lay, local, round_bytes)
        return
    # More hosts, the phases one after the other; owners take their shards in order, so
    # the rings never wait on each other in a cycle.
    assert flat is not None, "the flat all_reduce of more than two hosts' shards"
    p = _Shards(op, buf, lay, local, round_bytes)
    if local is not None:
        for t in range(p.R):
            slot = p.scatter_in(t)
            yield from barrier(local, t)
            p.reduce_mine(t, slot, ufunc)
    hosts, H = lay.hosts, len(lay.hosts)
    for q in p.mine:
        a, b = p.shards[q]
        members = [hosts[x][q % len(hosts[x])] for x in range(H)]
        sub = op.sub(op.plane, members, RING_TAGS + q * SHARD_TAGS)
        seg = buf[a:b]
        yield from flat(seg.nbytes, H, seg.size).algo(sub, seg, ufunc, 0)
    if local is not None:  # (the rings may still send the owned shards: only read here)
        for t in range(p.R):
            slot = op.next_slot()
            p.publish(t, slot)
            yield from barrier(local, p.R + t)
            p.gather_out(t, slot)


class _Shards:
    """The rounds inside a host over more than two hosts: shard q at position q * per
    of each slot; its owner is local index q mod L."""

    def __init__(self, op: Op, buf: np.ndarray, lay: Layout, local: Op | None,
                 round_bytes: int) -> None:
        self.op, self.buf, self.local, self.i = op, buf, local, lay.local
        self.L, self.K = L, K = len(lay.hosts[lay.host]), lay.shards
        self.shards = shards = split(buf.size, K)
        self.per = per = max(1, min(round_bytes, SEGMENT_BYTES) // buf.itemsize // K)
        self.R = R = max(1, -(-max(b - a for a, b in shards) // per))
        # pieces[q][t]: [start, stop) in buf of piece t of shard q.
        self.pieces = [[(a + x, a + y) for x, y in split(b - a, R)] for a, b in shards]
        self.mine = [q for q in range(K) if q % L == self.i]
        self.owner = [q % L for q in range(K)]  # local index of each shard's owner here

    def _views(self, slot: int) -> list[np.ndarray]:
        assert self.local is not None
        return self.local.regions(slot, self.buf.dtype, self.K * self.per)

    def scatter_in(self, t: int) -> int:
        """Copy this rank's pieces of the shards others own into its slot (round t)."""
        slot = self.op.next_slot()
        region, per = self._views(slot)[self.i], self.per
        for q in range(self.K):
            if self.owner[q] != self.i:
                a, b = self.pieces[q][t]
                region[q * per:q * per + b - a] = self.buf[a:b]
        return slot

    def reduce_mine(self, t: int, slot: int, ufunc: np.ufunc) -> None:
        """This rank's pieces of round t, reduced over the host into ``buf``."""
        regions, per = self._views(slot), self.per
        for q in self.mine:
            a, b = self.pieces[q][t]
            seg = self.buf[a:b]
            for p in range(self.L):
                if p != self.i:
                    ufunc(seg, regions[p][q * per:q * per + b - a], out=seg)

    def publish(self, t: int, slot: int) -> None:
        """Put this rank's results of round t where its locals copy them from."""
        region, per = self._views(slot)[self.i], self.per
        for q in self.mine:
            a, b = self.pieces[q][t]
            region[q * per:q * per + b - a] = self.buf[a:b]

    def gather_out(self, t: int, slot: int) -> None:
        """Copy the locals' results of round t into ``buf``."""
        regions, per = self._views(slot), self.per
        for q in range(self.K):
            if self.owner[q] != self.i:
                a, b = self.pieces[q][t]
                self.buf[a:b] = regions[self.owner[q]][q * per:q * per + b - a]


def _all_reduce_two_hosts(op: Op, buf: np.ndarray, ufunc: np.ufunc, lay: Layout,
                          local: Op | None, round_bytes: int,
                          streams: int | None = None) -> Algorithm:
    """Two hosts, pipelined over at most ``streams`` (STREAMS) TCP streams each way:
    shard q on stream q mod C, carried on each host by local index (q mod C) mod L.

    Round t's slot positions (``per`` items each): position q holds this rank's piece
    of a shard it does not own, or the host partial of one it owns; a carrier's
    positions K, K + 1, ... the other host's partials it receives. A carrier sends a
    partial from its owner's slot (no copy): its own at once, the others' after the next
    barrier; it receives round t's two rounds later (LAG), when every local combines
    ``ufunc(first host's, second's)`` into its array. A position is rewritten SLOTS
    rounds later: a carrier first waits until the kernel took what it sent from it. A
    host of one rank carries every stream and sends from its array.
    """
    p = _TwoHosts(op, buf, lay, local, round_bytes, streams)
    if local is None:
        yield from p.alone(ufunc)
        return
    for t in range(p.R + LAG):
        yield from p.round(t, ufunc)


#: Round t's partials of the two-host all_reduce are received, and combined, in round
#: t + LAG: they stay in their positions until then, and are rewritten in round t + SLOTS.
LAG = SLOTS - 1


class _TwoHosts:
    """The plan of :func:`_all_reduce_two_hosts` on one rank, and its rounds."""

    def __init__(self, op: Op, buf: np.ndarray, lay: Layout, local: Op | None,
                 round_bytes: int, streams: int | None) -> None:
        hosts, h, i = lay.hosts, lay.host, lay.local
        self.op, self.buf, self.local, self.i = op, buf, local, i
        self.L, self.K = L, K = len(hosts[h]), lay.shards
        C = max(1, min(STREAMS if streams is None else streams, K))
        other = hosts[1 - h]
        self.first = h == 0
        # Each shard's carrier here (local index) and there (group rank).
        self.carrier = [(q % C) % L for q in range(K)]
        self.partner = [other[(q % C) % len(other)] for q in range(K)]
        self.carried = [q for q in range(K) if self.carrier[q] == i]
        self.mine = [q for q in range(K) if q % L == i]
        # Where a carrier receives the other host's partial of each shard it carries.
        self.at_pos = _places([(q, self.carrier[q]) for q in range(K)], K)
        # The same rounds on both hosts: K positions, and M for the busiest carrier.
        M = max(_busiest_carrier(K, C, len(rs)) for rs in hosts if len(rs) > 1)
        self.per = per = max(1, min(round_bytes, SEGMENT_BYTES) // buf.itemsize // (K + M))
        shards = split(buf.size, K)
        self.R = R = max(1, -(-max(b - a for a, b in shards) // per))
        self.pieces = [[(a + x, a + y) for x, y in split(b - a, R)] for a, b in shards]
        # Each piece crosses in J messages of at most PIECE_BYTES (wire.MAX_PAYLOAD).
        self.J = num_pieces(per, buf.itemsize)
        self.slots: dict[int, int] = {}
        self.regions_at = _slot_views(local, buf.dtype, (K + M) * per)

    def tag(self, t: int, q: int) -> int:
        return (t * self.K + q) * self.J

    def alone(self, ufunc: np.ufunc) -> Algorithm:
        """A host of one rank: its array is the host partial of every shard."""
        op, buf, K = self.op, self.buf, self.K
        tmp = np.empty(self.per, buf.dtype)
        for t in range(self.R + LAG):
            fin = t - LAG
            for q in range(K) if t < self.R else ():
                a, b = self.pieces[q][t]
                if b > a:
                    _send_split(op, self.partner[q], self.tag(t, q), buf[a:b], self.J)
            for q in range(K) if fin >= 0 else ():
                a, b = self.pieces[q][fin]
                if b == a:
                    continue
                theirs = tmp[:b - a]
                yield from _recv_split(op, self.partner[q], self.tag(fin, q), theirs, self.J)
                yield from _drained(op, self.partner[q])  # buf[a:b] went out without a copy
                _combine(ufunc, buf[a:b], theirs, self.first, buf[a:b])

    def round(self, t: int, ufunc: np.ufunc) -> Algorithm:
        """Round t of a rank with locals (see :func:`_all_reduce_two_hosts`)."""
        fin = t - LAG
        if t < self.R:
            self._copy_in(t)
        if self.carried:
            yield from self._receive(t, fin)
        # Everyone copied round t in; the carriers have the partials of round fin.
        yield from barrier(self.local, t)  # type: ignore[arg-type]
        if fin >= 0:
            self._finish(fin, ufunc)
        if 0 < t <= self.R:
            # The other owners reduced round t - 1 before this barrier.
            regions = self.regions_at(self.slots[t - 1])
            for q in self.carried:
                if q % self.L != self.i:
                    self._send_partial(t - 1, q, regions)
        if t < self.R:
            yield from self._reduce_mine(t, ufunc)

    def _copy_in(self, t: int) -> None:
        """This rank's pieces of round t of the shards others own, into its slot."""
        self.slots[t] = slot = self.op.next_slot()
        region = self.regions_at(slot)[self.i]
        per, buf = self.per, self.buf
        for q in range(self.K):
            if q % self.L != self.i:
                a, b = self.pieces[q][t]
                region[q * per:q * per + b - a] = buf[a:b]

    def _receive(self, t: int, fin: int) -> Algorithm:
        """A carrier's part of round t: the other host's partials of round fin; then what
        it sent from the owners' slots must be out before they overwrite it."""
        op, per = self.op, self.per
        if fin >= 0:
            into = self.regions_at(self.slots[fin])[self.i]
            for q in self.carried:
                a, b = self.pieces[q][fin]
                if b > a:
                    at = self.at_pos[q] * per
                    yield from _recv_split(op, self.partner[q], self.tag(fin, q),
                                           into[at:at + b - a], self.J)
        if t >= SLOTS:
            for p in sorted({self.partner[q] for q in self.carried if q % self.L != self.i}):
                yield from _drained(op, p)

    def _finish(self, fin: int, ufunc: np.ufunc) -> None:
        """Every shard's result of round fin into this rank's array."""
        regions, per = self.regions_at(self.slots.pop(fin)), self.per
        for q in range(self.K):
            a, b = self.pieces[q][fin]
            ours = regions[q % self.L][q * per:q * per + b - a]
            at = self.at_pos[q] * per
            theirs = regions[self.carrier[q]][at:at + b - a]
            _combine(ufunc, ours, theirs, self.first, self.buf[a:b])

    def _send_partial(self, t: int, q: int, regions: list[np.ndarray]) -> None:
        a, b = self.pieces[q][t]
        if b > a:
            per = self.per
            _send_split(self.op, self.partner[q], self.tag(t, q),
                        regions[q % self.L][q * per:q * per + b - a], self.J)

    def _reduce_mine(self, t: int, ufunc: np.ufunc) -> Algorithm:
        """The host partials of this rank's shards of round t, into its slot; those it
        carries go out at once."""
        regions, per, i = self.regions_at(self.slots[t]), self.per, self.i
        if t >= SLOTS:  # its partials of round t - SLOTS went out from here
            for p in sorted({self.partner[q] for q in self.mine if self.carrier[q] == i}):
                yield from _drained(self.op, p)
        for q in self.mine:
            a, b = self.pieces[q][t]
            _host_partial(ufunc, self.buf[a:b], regions, i, q * per,
                          regions[i][q * per:q * per + b - a])
            if self.carrier[q] == i:
                self._send_partial(t, q, regions)


def _slot_views(local: Op | None, dtype: np.dtype, n: int) -> Any:
    """``at(slot)``: every local's region of ``n`` items of ``dtype`` at ``slot``, built
    once per slot (a call's rounds rotate over SLOTS slots)."""
    views: dict[int, list[np.ndarray]] = {}

    def at(slot: int) -> list[np.ndarray]:
        got = views.get(slot)
        if got is None:
            assert local is not None
            got = views[slot] = local.regions(slot, dtype, n)
        return got

    return at


def _busiest_carrier(items: int, streams: int, L: int) -> int:
    """How many of ``items`` (item j on stream j mod ``streams``, carried by local index
    (j mod streams) mod L) the busiest carrier of a host of L ranks takes."""
    return max(Counter((j % streams) % L for j in range(items)).values())


def _places(carried: Sequence[tuple[int, int]], base: int) -> dict[int, int]:
    """Slot positions of received items, given (item, carrier) in item order: each
    carrier's items at base, base + 1, ... of its slot."""
    taken: Counter[int] = Counter()
    places = {}
    for item, carrier in carried:
        places[item] = base + taken[carrier]
        taken[carrier] += 1
    return places


def _host_partial(ufunc: np.ufunc, own: np.ndarray, regions: list[np.ndarray], me: int,
                  at: int, out: np.ndarray) -> None:
    """``out`` = the host partial of a piece: this rank's operand ``own`` first, then the
    other locals' (``regions[p][at:]``, local order)."""
    src = own
    for p, region in enumerate(regions):
        if p != me:
            ufunc(src, region[at:at + out.size], out=out)
            src = out


def _combine(ufunc: np.ufunc, ours: np.ndarray, theirs: np.ndarray, first: bool,
             out: np.ndarray) -> None:
    """``ufunc(first host's, second's)`` into ``out``: the same bits on both hosts."""
    if first:
        ufunc(ours, theirs, out=out)
    else:
        ufunc(theirs, ours, out=out)


def _send_split(op: Op, to: int, tag: int, seg: np.ndarray, parts: int) -> None:
    """``seg`` in ``parts`` messages (tags ``tag``...), none above PIECE_BYTES."""
    for j, (x, y) in enumerate(split(seg.size, parts)):
        if y > x:
            op.send(to, tag + j, seg[x:y])


def _recv_split(op: Op, frm: int, tag: int, out: np.ndarray, parts: int) -> Algorithm:
    """Receive what :func:`_send_split` sent into ``out``."""
    for j, (x, y) in enumerate(split(out.size, parts)):
        if y > x:
            yield op.recv_into(frm, tag + j, out[x:y])


def _drained(op: Op, peer: int) -> Algorithm:
    """Wait until nothing is queued to ``peer`` (a flush, when needed). Also keeps the
    link busy: a rank waiting on shared memory drives no TCP sends."""
    if op.ranks[peer] in op.plane.unsent():
        yield op.flush()


# -- broadcast and reduce ---------------------------------------------------------------


def _rounds(count: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, stop) bounds of the rounds of ``count`` items (one round when empty)."""
    per = max(1, min(ROUND_BYTES, SEGMENT_BYTES) // itemsize)
    if count == 0:
        return [(0, 0)]
    return [(a, min(a + per, count)) for a in range(0, count, per)]


def _leaders(lay: Layout, root: int) -> list[int]:
    """Each host's leader for ``root``: the root on its host, local index (the root's
    mod L) elsewhere, so that different roots spread the work."""
    hr = next(g for g, rs in enumerate(lay.hosts) if root in rs)
    ir = lay.hosts[hr].index(root)
    return [root if g == hr else rs[ir % len(rs)] for g, rs in enumerate(lay.hosts)]


def broadcast(op: Op, buf: np.ndarray, root: int, lay: Layout, shm: Any) -> Algorithm:
    """A chain of host leaders from the root's host; locals copy from their leader's
    slot, round by round."""
    hosts, h = lay.hosts, lay.host
    H = len(hosts)
    leaders = _leaders(lay, root)
    hr = next(g for g, rs in enumerate(hosts) if root in rs)
    chain = [(hr + k) % H for k in range(H)]
    pos = chain.index(h)
    lead = op.me == leaders[h]
    nxt, prv = leaders[chain[(pos + 1) % H]], leaders[chain[(pos - 1) % H]]
    local = _local_op(op, lay, shm)
    li = lay.hosts[h].index(leaders[h])
    if lead:
        op.send(nxt, SIG, b"")
    for t, (a, b) in enumerate(_rounds(buf.size, buf.itemsize)):
        seg = buf[a:b]
        if lead:
            if pos > 0:
                yield op.recv_into(prv, t, seg)
            if pos < H - 1:
                op.send(nxt, t, seg)
                yield from _drained(op, nxt)  # (see _drained)
        if local is not None:
            slot = op.next_slot()
            region = local.region(li, slot, buf.dtype, b - a)
            if lead:
                region[...] = seg
            yield from barrier(local, t)
            if not lead:
                seg[...] = region
    if lead:
        if pos == H - 1:
            op.send(root, ACK, b"")
        if op.me == root:
            yield op.recv(leaders[chain[H - 1]], ACK, 0)
        yield op.recv(prv, SIG, 0)


def reduce(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc, divide: int, lay: Layout,
           shm: Any) -> Algorithm:
    """Each host's locals reduced by their leader, the chain of leaders ending at the
    root; only the root's buffer changes (``divide``: a mean's divisor)."""
    yield from _reduce(op, buf, root, ufunc, lay, shm)
    if op.me == root:
        yield from mean(op, buf, divide)


def _reduce(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc, lay: Layout,
            shm: Any) -> Algorithm:
    hosts, h, i = lay.hosts, lay.host, lay.local
    H, L = len(hosts), len(hosts[h])
    leaders = _leaders(lay, root)
    hr = next(g for g, rs in enumerate(hosts) if root in rs)
    chain = [(hr + 1 + k) % H for k in range(H)]  # ends at the root's host
    pos = chain.index(h)
    lead = op.me == leaders[h]
    nxt, prv = leaders[chain[(pos + 1) % H]], leaders[chain[(pos - 1) % H]]
    local = _local_op(op, lay, shm)
    is_root = op.me == root
    rounds = _rounds(buf.size, buf.itemsize)
    # A non-root leader combines into a scratch buffer: its own array stays as it was.
    scratch = (np.empty(max(b - a for a, b in rounds), buf.dtype)
               if lead and not is_root and (local is not None or pos > 0) else None)
    if lead:
        op.send(nxt, SIG, b"")
    for t, (a, b) in enumerate(rounds):
        seg = buf[a:b]
        part = seg if scratch is None else scratch[:b - a]
        if local is not None:
            slot = op.next_slot()
            regions = local.regions(slot, buf.dtype, b - a)
            if not lead:
                regions[i][...] = seg
            yield from barrier(local, t)
            if lead:
                if part is not seg:
                    np.copyto(part, seg)
                for p in range(L):
                    if p != i:
                        ufunc(part, regions[p], out=part)
        elif part is not seg:
            np.copyto(part, seg)
        if lead:
            if pos > 0:
                incoming = yield from op.recv_array(prv, t, part)
                ufunc(incoming, part, out=part)
            if pos < H - 1:
                op.send(nxt, t, part, copy=part is not seg)
                yield from _drained(op, nxt)
    if lead:
        if is_root:
            op.send(leaders[chain[0]], ACK, b"")
        elif pos == 0:
            yield op.recv(root, ACK, 0)
        yield op.recv(prv, SIG, 0)


# -- all_gather -------------------------------------------------------------------------


def all_gather_v(op: Op, flat: np.ndarray, out: np.ndarray,
                 bounds: Sequence[tuple[int, int]], lay: Layout, shm: Any) -> Algorithm:
    """The second round of an uneven all_gather whose parts have one size: the
    two-level :func:`all_gather` of the rows of ``out`` (flat; part r at ``bounds[r]``,
    every part ``flat``'s size)."""
    rows = out.reshape(op.size, -1)
    rows[op.me] = flat
    yield from all_gather(op, rows, lay, shm)


def all_gather(op: Op, out: np.ndarray, lay: Layout, shm: Any,
               streams: int | None = None) -> Algorithm:
    """Each host's rows to every other host over at most ``streams`` (STREAMS) TCP
    streams each way, then through the slots; ``out``: N x count, this rank's row filled.
    Stream c carries the rows of locals j = c mod C, from local c to local c mod L_g of
    each other host g; rows of round t are received GATHER_AHEAD rounds later."""
    p = _Gather(op, out, lay, _local_op(op, lay, shm), streams)
    for t in range(p.R + p.ahead):
        yield from p.round(t)


class _Gather:
    """The plan of :func:`all_gather` on one rank, and its rounds."""

    def __init__(self, op: Op, out: np.ndarray, lay: Layout, local: Op | None,
                 streams: int | None) -> None:
        hosts, h, i = lay.hosts, lay.host, lay.local
        self.op, self.out, self.local, self.hosts, self.h, self.i = op, out, local, hosts, h, i
        H, L = len(hosts), len(hosts[h])
        count = out.shape[1]
        K = max(len(rs) for rs in hosts)
        if streams is None:  # small: every rank sends its own row
            streams = K if count * out.itemsize <= SMALL_GATHER_BYTES else STREAMS
        self.C = C = max(1, streams)
        self.rows_in = rows_in = self._inbound(h)
        # The carrier each row of another host comes from (group rank).
        self.source = {row: hosts[x][j % C] for x in range(H) if x != h
                       for j, row in enumerate(hosts[x])}
        # Where each row of another host lands here: (receiving local, position).
        self.landing = {row: (k, 1 + p) for k, rows in enumerate(rows_in)
                        for p, row in enumerate(rows)}
        # The rows this rank sends: its own (and, as a carrier, its stream's locals').
        self.carried = [j for j in range(L) if j % C == i]
        self.dests = {x: [hosts[x][self._receiver(x, j)] for j in range(L)]
                      for x in range(H) if x != h}
        # The same rounds on every host: as wide as the fullest slot (own row + received).
        width = 1 + max(len(rows) for g in range(H) for rows in self._inbound(g))
        self.per = per = max(1, min(ROUND_BYTES, SEGMENT_BYTES) // out.itemsize // width)
        self.cols = split(count, max(1, -(-count // per)))
        self.R = R = len(self.cols)
        # Rounds received this many after they were sent: other locals' rows leave after
        # the barrier; a single round where every rank sends its own needs none.
        self.ahead = 0 if R == 1 and K <= C else min(GATHER_AHEAD, R)
        self.slots: dict[int, int] = {}
        self.regions_at = _slot_views(local, out.dtype, width * per)

    def _receiver(self, g: int, j: int) -> int:
        """The local index on host g receiving the row of another host's local j."""
        return (j % self.C) % len(self.hosts[g])

    def _inbound(self, g: int) -> list[list[int]]:
        """The rows each local of host g receives, in a fixed order."""
        got: list[list[int]] = [[] for _ in self.hosts[g]]
        for x, rs in enumerate(self.hosts):
            if x != g:
                for j, row in enumerate(rs):
                    got[self._receiver(g, j)].append(row)
        return got

    def _send_row(self, t: int, j: int, piece: np.ndarray) -> None:
        row = self.hosts[self.h][j]
        for to in self.dests.values():
            self.op.send(to[j], t * self.op.size + row, piece)

    def round(self, t: int) -> Algorithm:
        op, out, i, fin = self.op, self.out, self.i, t - self.ahead
        if t < self.R:
            a, b = self.cols[t]
            if self.local is not None:
                self.slots[t] = slot = op.next_slot()
                self.regions_at(slot)[i][:b - a] = out[op.me, a:b]
            if i in self.carried:
                self._send_row(t, i, out[op.me, a:b])  # out[me] is never written: no copy
        if fin >= 0:
            yield from self._receive(fin)
        if self.local is None:
            return
        if t >= 2 and len(self.carried) > 1:  # owners overwrite round t - 2's rows next
            for to in sorted({d[j] for d in self.dests.values() for j in self.carried
                              if j != i}):
                yield from _drained(op, to)
        yield from barrier(self.local, t)
        if t < self.R:
            self._forward_and_copy(t)
        if fin >= 0:
            a, b = self.cols[fin]
            regions, per = self.regions_at(self.slots.pop(fin)), self.per
            for row, (k, p) in self.landing.items():
                out[row, a:b] = regions[k][p * per:p * per + b - a]

    def _receive(self, fin: int) -> Algorithm:
        """The rows of round fin this rank receives: into its slot, or (a host of one
        rank) into ``out``."""
        a, b = self.cols[fin]
        w, per = b - a, self.per
        mine = self.regions_at(self.slots[fin])[self.i] if self.local is not None else None
        for p, row in enumerate(self.rows_in[self.i]):
            into = (self.out[row, a:b] if mine is None
                    else mine[(1 + p) * per:(1 + p) * per + w])
            yield self.op.recv_into(self.source[row], fin * self.op.size + row, into)

    def _forward_and_copy(self, t: int) -> None:
        """After round t's barrier: a carrier sends its stream's rows; every rank copies
        its host's rows from the owners' slots."""
        a, b = self.cols[t]
        regions = self.regions_at(self.slots[t])
        for j in self.carried:
            if j != self.i:
                self._send_row(t, j, regions[j][:b - a])
        for j, row in enumerate(self.hosts[self.h]):
            if j != self.i:
                self.out[row, a:b] = regions[j][:b - a]


# -- reduce_scatter ---------------------------------------------------------------------


def reduce_scatter(op: Op, buf: np.ndarray, out: np.ndarray, parts: Sequence[tuple[int, int]],
                   ufunc: np.ufunc, divide: int, lay: Layout, shm: Any,
                   streams: int | None = None) -> Algorithm:
    """:func:`_reduce_scatter`, then this rank's block divided by ``divide`` (a mean)."""
    yield from _reduce_scatter(op, buf, out, parts, ufunc, lay, shm, streams)
    if divide:
        divide_by(out, divide)


def _reduce_scatter(op: Op, buf: np.ndarray, out: np.ndarray,
                    parts: Sequence[tuple[int, int]], ufunc: np.ufunc, lay: Layout, shm: Any,
                    streams: int | None = None) -> Algorithm:
    """Two hosts: block g of ``buf`` (``parts[g]``) reduced into group rank g's ``out``;
    ``buf`` unchanged. Each round every local copies its pieces of the blocks it does
    not compute into its slot, a barrier, and each computes the host partials of its own
    block and of the other host's blocks its stream carries, sending the latter to that
    host's carrier; LAG rounds later each rank combines its block's two partials."""
    p = _Scatter(op, buf, out, parts, lay, _local_op(op, lay, shm), streams)
    for t in range(p.R + LAG):
        if p.local is None:
            yield from p.alone(t, ufunc)
        else:
            yield from p.round(t, ufunc)


class _Scatter:
    """The plan of :func:`_reduce_scatter` on one rank, and its rounds."""

    def __init__(self, op: Op, buf: np.ndarray, out: np.ndarray,
                 parts: Sequence[tuple[int, int]], lay: Layout, local: Op | None,
                 streams: int | None) -> None:
        hosts, h, i = lay.hosts, lay.host, lay.local
        assert len(hosts) == 2
        self.op, self.buf, self.out, self.local, self.i = op, buf, out, local, i
        L, N, me = len(hosts[h]), op.size, op.me
        self.N, self.me = N, me
        self.mine_rs, self.other = mine_rs, other = hosts[h], hosts[1 - h]
        Lo = len(other)
        C = max(1, STREAMS if streams is None else streams)
        self.first = h == 0
        # Who computes each block here: its owner, or the carrier of the other host's.
        computes = {g: j for j, g in enumerate(mine_rs)}
        computes.update({g: (j % C) % L for j, g in enumerate(other)})
        self.computes = computes
        self.ours = [g for g in range(N) if computes[g] == i]
        # This host's blocks arrive at the carrier of their stream, from the other host's.
        self.sender = {g: other[(j % C) % Lo] for j, g in enumerate(mine_rs)}
        self.arrives = {g: (j % C) % L for j, g in enumerate(mine_rs)}
        self.slot_of = _places([(g, self.arrives[g]) for g in mine_rs], N)
        # Where the other host's blocks go: its carrier of their stream.
        self.dest = {g: other[(j % C) % Lo] for j, g in enumerate(other)}
        M = max(_busiest_carrier(len(rs), C, len(rs)) for rs in hosts)
        self.per = per = max(1, min(ROUND_BYTES, SEGMENT_BYTES) // buf.itemsize // (N + M))
        self.R = R = max(1, -(-max(b - a for a, b in parts) // per))
        self.pieces = [[(a + x, a + y) for x, y in split(b - a, R)] for a, b in parts]
        self.J = num_pieces(per, buf.itemsize)
        self.base = parts[me][0]
        self.slots: dict[int, int] = {}
        self.regions_at = _slot_views(local, buf.dtype, (N + M) * per)

    def tag(self, t: int, g: int) -> int:
        return (t * self.N + g) * self.J

    def alone(self, t: int, ufunc: np.ufunc) -> Algorithm:
        """Round t of a host of one rank: its buffer is the host partial of every block."""
        op, buf, fin = self.op, self.buf, t - LAG
        if t < self.R:
            for g in self.other:
                a, b = self.pieces[g][t]
                if b > a:
                    _send_split(op, self.dest[g], self.tag(t, g), buf[a:b], self.J)
        if fin >= 0:
            a, b = self.pieces[self.me][fin]
            if b > a:
                theirs = np.empty(b - a, buf.dtype)
                yield from _recv_split(op, self.sender[self.me], self.tag(fin, self.me),
                                       theirs, self.J)
                _combine(ufunc, buf[a:b], theirs, self.first,
                         self.out[a - self.base:b - self.base])

    def round(self, t: int, ufunc: np.ufunc) -> Algorithm:
        """Round t of a rank with locals (see :func:`_reduce_scatter`)."""
        op, buf, i, per, fin = self.op, self.buf, self.i, self.per, t - LAG
        if t < self.R:
            self.slots[t] = slot = op.next_slot()
            region = self.regions_at(slot)[i]
            for g in range(self.N):
                if self.computes[g] != i:
                    a, b = self.pieces[g][t]
                    region[g * per:g * per + b - a] = buf[a:b]
        if fin >= 0:  # the other host's partials of round fin whose stream ends here
            into = self.regions_at(self.slots[fin])[i]
            for g in self.mine_rs:
                a, b = self.pieces[g][fin]
                if self.arrives[g] == i and b > a:
                    at = self.slot_of[g] * per
                    yield from _recv_split(op, self.sender[g], self.tag(fin, g),
                                           into[at:at + b - a], self.J)
        yield from barrier(self.local, t)  # type: ignore[arg-type]
        if fin >= 0:
            self._finish(fin, ufunc)
        if t < self.R:
            yield from self._partials(t, ufunc)

    def _finish(self, fin: int, ufunc: np.ufunc) -> None:
        """This rank's block of round fin: its two host partials combined into ``out``."""
        regions, me, per = self.regions_at(self.slots.pop(fin)), self.me, self.per
        a, b = self.pieces[me][fin]
        if b > a:
            at = self.slot_of[me] * per
            partial = regions[self.i][me * per:me * per + b - a]
            theirs = regions[self.arrives[me]][at:at + b - a]
            _combine(ufunc, partial, theirs, self.first, self.out[a - self.base:b - self.base])

    def _partials(self, t: int, ufunc: np.ufunc) -> Algorithm:
        """The host partials of the blocks this rank computes in round t; those of the
        other host's blocks go to it at once."""
        regions, i, per = self.regions_at(self.slots[t]), self.i, self.per
        if t >= SLOTS:  # partials of round t - SLOTS were sent from here
            for p in sorted({self.dest[g] for g in self.ours if g in self.dest}):
                yield from _drained(self.op, p)
        for g in self.ours:
            a, b = self.pieces[g][t]
            if b == a:
                continue
            acc = regions[i][g * per:g * per + b - a]
            _host_partial(ufunc, self.buf[a:b], regions, i, g * per, acc)
            if g in self.dest:
                _send_split(self.op, self.dest[g], self.tag(t, g), acc, self.J)
