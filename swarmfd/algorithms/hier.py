"""Two-level algorithms: shared memory inside each host, TCP between hosts.

A group that spans hosts, with several of its ranks on some host, moves most of its
bytes inside the hosts, where they cost a memory copy instead of a trip through the
kernel's TCP stack and the host's link. The group's ranks on one host are its
*locals* (group ranks in order; a rank's *local index* is its place among them);
hosts are in :class:`Layout` order (the host of group rank 0 first), the same on
every rank. Every phase inside a host runs over that host's shared-memory plane (a
sub-op of the call, :meth:`swarmfd.algorithms.base.Op.sub`), every phase between
hosts over the call's TCP plane. Hosts may hold different numbers of ranks: a host
of one rank has no phase inside.

**all_reduce** (S bytes, H hosts, K = the most ranks any host holds). The buffer is
cut into K *shards*; on a host of L ranks shard q belongs to local index q mod L
(so on the fullest host every rank owns one, elsewhere some own several).

* *small* (:func:`all_reduce_small`, up to one segment): every local copies its
  buffer into its slot, one barrier, every local reduces the host's buffers in
  local order (the *host partial*, bitwise the same on all of them); then local
  index j exchanges host partials with local index j mod L_g of every other host g
  and everyone reduces the H partials in host order. One barrier and one network
  hop; each link carries L copies of S, which only small buffers can afford.
* *large* (:func:`all_reduce_large`): rounds of at most ROUND_BYTES per rank; round
  t holds piece t of every shard. In each round every local copies the pieces of
  the shards it does not own into its slot (a reduce-scatter inside the host), a
  barrier, and each owner reduces its pieces from the others' slots into its own
  buffer (its own operand first, then local order): the host partial of that
  piece, computed once. Between two hosts the owners of a shard exchange partials
  and both compute ``ufunc(first host's, second's)``: the same bits on both. The
  owner publishes the result in its slot, where its locals copy it from after a
  later barrier (the all-gather inside the host). Partials of round t leave as soon
  as they are reduced and are awaited DEPTH rounds later, so the link carries round
  t while the host works on the next ones. Each host's link carries S each way:
  the two-level bound 2(H-1)/H S for H = 2, against 2(N-1)/N S for the best flat
  ring. With more than two hosts the phases run one after the other: the
  reduce-scatter of every round, then a flat all-reduce (ring, in host order) of
  each shard among its H owners, then the all-gather.

Every element is reduced once inside its host and once between hosts (a ring
reduces it once as well), then copied: float results are bitwise identical on
every rank.

**broadcast**: the root's host is the first of a chain of host *leaders* (the root;
elsewhere local index i_root mod L), in host order from the root's host, over TCP;
each leader forwards every round as soon as it has it and publishes it in its slot,
where its locals copy it from after the round's barrier. **reduce**: the mirror
image: each host's locals copy into their slots, the leader reduces them (its own
operand first, then local order) and the chain of leaders ends at the root, each
combining ``ufunc(incoming, own)`` as the flat chain does. Both show their
signature around the ring of leaders and end with an acknowledgement to the root
(broadcast) or from it (reduce), as the flat chains do; inside a host every rank
both sends and receives barrier records, which carry the signature.

**all_gather** (:func:`all_gather`): every rank sends its row to one rank of each
other host (local index i mod L_g), all at once; each rank publishes its own row
and those it received in its slot, round by round, and copies the rest from its
locals' slots. Each link carries what the other hosts need once: as much as the
flat ring in host order, without the TCP hops inside the hosts.

**reduce_scatter** (not a collective yet) takes the same road as the large
all_reduce with the last phase cut short: the rounds reduce-scatter inside the
host, the owners exchange partials of the shards, and each rank then keeps only its
own block (copied from its owner's slot), so a link carries (H-1)/H S.

Tags: the phases between hosts use the call's own tags (round-major, < 2^30, plus
ACK and SIG of :mod:`.tcp`); those inside a host a sub-op's from LOCAL_TAGS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm.planes.shm import SEGMENT_BYTES, SLOTS
from .base import Algorithm, Op, num_pieces, split
from .tcp import ACK, SIG, barrier

__all__ = [
    "DEPTH",
    "LOCAL_TAGS",
    "ROUND_BYTES",
    "Layout",
    "all_gather",
    "all_reduce_large",
    "all_reduce_small",
    "broadcast",
    "reduce",
]

#: Bytes one rank moves through its slot per round of a large call (at most a slot).
ROUND_BYTES = SEGMENT_BYTES
#: Rounds of a large all_reduce in flight between two hosts: a round's partials are
#: awaited this many rounds after they were sent, so the link is never idle while the
#: host copies and reduces (at most SLOTS - 1: see _all_reduce_two_hosts).
DEPTH = 2
#: Rounds of an all_gather sent ahead of the one being received (more would sit in
#: the send queue, which only moves while the rank waits on TCP).
GATHER_AHEAD = 2
#: Tag base of the phases inside a host (a sub-op's barriers): above every tag the
#: phases between hosts use, below ACK and SIG.
LOCAL_TAGS = 1 << 31
#: Tag base of the rings of the shards among their owners (more than two hosts), one
#: block of SHARD_TAGS tags per shard (a ring of a 1 GiB shard uses about 2000), apart
#: from a call's size exchange (from 2^30, collectives._exchange).
RING_TAGS = 3 << 29
SHARD_TAGS = 1 << 20


@dataclass(frozen=True)
class Layout:
    """How a group's ranks sit on hosts, as one member sees it.

    ``hosts``: the group ranks on each host, in host order (the host of group rank 0
    first, then by first appearance), each in group-rank order; ``me``: this rank's
    group rank. The same ``hosts`` on every member.
    """

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


def all_reduce_small(op: Op, buf: np.ndarray, ufunc: np.ufunc, lay: Layout,
                     shm: Any) -> Algorithm:
    """Host partials through one slot, then exchanged between hosts (module docstring).

    ``buf`` must fit one slot (at most SEGMENT_BYTES).
    """
    hosts, h, i = lay.hosts, lay.host, lay.local
    L = len(hosts[h])
    local = _local_op(op, lay, shm)
    if local is not None:
        slot = op.next_slot()
        regions = [local.region(p, slot, buf.dtype, buf.size) for p in range(L)]
        regions[i][...] = buf
        yield from barrier(local, 0)
        np.copyto(buf, regions[0])
        for p in range(1, L):
            ufunc(buf, regions[p], out=buf)
    H = len(hosts)
    # Local index j sends to the ranks k of host g with k mod L == j, and receives
    # from local index j mod L_g of host g.
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


def all_reduce_large(op: Op, buf: np.ndarray, ufunc: np.ufunc, lay: Layout, shm: Any,
                     depth: int = DEPTH, round_bytes: int = ROUND_BYTES) -> Algorithm:
    """Reduce-scatter inside each host, partials of each shard between its owners,
    all-gather inside each host, in rounds (see the module docstring)."""
    hosts, h, i = lay.hosts, lay.host, lay.local
    H, L, K = len(hosts), len(hosts[h]), lay.shards
    local = _local_op(op, lay, shm)
    shards = split(buf.size, K)
    per = max(1, min(round_bytes, SEGMENT_BYTES) // buf.itemsize // K)
    R = max(1, -(-max(b - a for a, b in shards) // per))
    # pieces[q][t]: [start, stop) in buf of piece t of shard q.
    pieces = [[(a + x, a + y) for x, y in split(b - a, R)] for a, b in shards]
    mine = [q for q in range(K) if q % L == i]
    owner = [q % L for q in range(K)]  # local index of each shard's owner here

    def offsets(t: int) -> tuple[list[int], int]:
        """Where each shard's piece sits in a slot, and the slot's length in items.

        Fixed places (shard q at q * per, whatever the round): an owner's results of
        round t stay in its slot for DEPTH rounds, next to the pieces it copies in for
        the rounds after, and must never overlap them."""
        return [q * per for q in range(K)], K * per

    def scatter_in(t: int) -> tuple[int, list[int], int]:
        """Copy this rank's pieces of the shards others own into its slot (round t)."""
        assert local is not None
        slot = op.next_slot()
        offs, n = offsets(t)
        region = local.region(i, slot, buf.dtype, n)
        for q in range(K):
            if owner[q] != i:
                a, b = pieces[q][t]
                region[offs[q]:offs[q] + b - a] = buf[a:b]
        return slot, offs, n

    def reduce_mine(t: int, slot: int, offs: list[int], n: int) -> None:
        """This rank's pieces of round t, reduced over the host into ``buf``."""
        assert local is not None
        regions = [local.region(p, slot, buf.dtype, n) for p in range(L)]
        for q in mine:
            a, b = pieces[q][t]
            seg = buf[a:b]
            for p in range(L):
                if p != i:
                    ufunc(seg, regions[p][offs[q]:offs[q] + b - a], out=seg)

    def publish(t: int, slot: int, offs: list[int], n: int) -> None:
        """Put this rank's results of round t where its locals copy them from."""
        assert local is not None
        region = local.region(i, slot, buf.dtype, n)
        for q in mine:
            a, b = pieces[q][t]
            region[offs[q]:offs[q] + b - a] = buf[a:b]

    def gather_out(t: int, slot: int, offs: list[int], n: int) -> None:
        """Copy the locals' results of round t into ``buf``."""
        assert local is not None
        regions = [local.region(p, slot, buf.dtype, n) for p in range(L)]
        for q in range(K):
            if owner[q] != i:
                a, b = pieces[q][t]
                buf[a:b] = regions[owner[q]][offs[q]:offs[q] + b - a]

    if H > 2:
        # The phases one after the other: every round's reduce-scatter, a flat
        # all-reduce of each owned shard among its owners (one per host, in host
        # order; owners take their shards in order, so the rings never wait on each
        # other in a cycle), every round's all-gather.
        from . import select

        if local is not None:
            for t in range(R):
                slot = scatter_in(t)
                yield from barrier(local, t)
                reduce_mine(t, *slot)
        for q in mine:
            a, b = shards[q]
            members = [hosts[x][q % len(hosts[x])] for x in range(H)]
            sub = op.sub(op.plane, members, RING_TAGS + q * SHARD_TAGS)
            seg = buf[a:b]
            yield from select.all_reduce("tcp", seg.nbytes, H, seg.size,
                                         sub.plane.name)(sub, seg, ufunc)
        if local is not None:
            # (The rings may still be sending pieces of the owned shards: the
            # all-gather only reads them.)
            for t in range(R):
                slot_t = (op.next_slot(), *offsets(t))
                publish(t, *slot_t)
                yield from barrier(local, R + t)
                gather_out(t, *slot_t)
        return
    yield from _all_reduce_two_hosts(op, buf, ufunc, lay, local, depth, round_bytes)


def _all_reduce_two_hosts(op: Op, buf: np.ndarray, ufunc: np.ufunc, lay: Layout,
                          local: Op | None, depth: int, round_bytes: int) -> Algorithm:
    """Two hosts, pipelined (see the module docstring). Round t, this rank, in its slot:

    * position q (fixed, q * per) of a shard q it does not own: its piece, for the
      owner to reduce; of a shard it owns: the host partial, reduced straight there
      from its own array and the locals' pieces, and sent to the partner from there
      (no copy);
    * position K + q // L of an owned shard: the partner's partial, received there.

    After the barrier DEPTH rounds later every local computes every shard's result
    from the owner's two positions, ``ufunc(first host's, second's)``, into its own
    array: the same bits everywhere, the partner's host included.

    A slot's positions are rewritten SLOTS rounds later; the barriers in between tell
    that the locals read them, and before a partial is reduced into a position that
    held one sent SLOTS rounds ago, any bytes still queued to the partner are flushed
    (there normally are none: the kernel took them long before).
    """
    hosts, h, i = lay.hosts, lay.host, lay.local
    L, K = len(hosts[h]), lay.shards
    other = hosts[1 - h]
    partner = [other[q % len(other)] for q in range(K)]
    first = h == 0
    # The same rounds on both hosts: as many positions as the fullest slot needs.
    M = max(-(-K // len(rs)) for rs in hosts if len(rs) > 1)
    per = max(1, min(round_bytes, SEGMENT_BYTES) // buf.itemsize // (K + M))
    n = (K + M) * per
    shards = split(buf.size, K)
    R = max(1, -(-max(b - a for a, b in shards) // per))
    pieces = [[(a + x, a + y) for x, y in split(b - a, R)] for a, b in shards]
    mine = [q for q in range(K) if q % L == i]
    # Each piece crosses in J messages of at most PIECE_BYTES (wire.MAX_PAYLOAD).
    J = num_pieces(per, buf.itemsize)
    # A partial is read by the locals d rounds after it was reduced, and its position
    # rewritten SLOTS rounds after: at most SLOTS - 1 rounds in flight.
    d = max(1, min(depth, R, SLOTS - 1))
    tmp = np.empty(per, buf.dtype) if local is None else None
    # Every local computes every shard's result (an add of two operands where a copy of
    # the owner's result would do, but no add by the owner before the barrier). The
    # owner computing it once and every local copying it was no faster in an
    # interleaved A/B (benchmarks/results/hierarchy-20261201-1714-owner-final-ab.json:
    # at 2x4@2gbit, 16 / 64 MiB, 162 / 594 ms against 142 / 504 ms), and was removed.
    slots: dict[int, int] = {}
    dt = buf.dtype
    views: dict[int, list[np.ndarray]] = {}  # slot -> every local's region (reused)

    def regions_at(slot: int) -> list[np.ndarray]:
        got = views.get(slot)
        if got is None:
            assert local is not None
            got = views[slot] = [local.region(p, slot, dt, n) for p in range(L)]
        return got

    for t in range(R + d):
        fin = t - d
        if t < R and local is not None:
            slots[t] = slot = op.next_slot()
            region = regions_at(slot)[i]
            for q in range(K):
                if q % L != i:
                    a, b = pieces[q][t]
                    region[q * per:q * per + b - a] = buf[a:b]
        if fin >= 0:
            # The partner's partials of round fin, sent d rounds ago.
            into = None if local is None else regions_at(slots[fin])[i]
            for q in mine:
                a, b = pieces[q][fin]
                if b == a:
                    continue
                if into is not None:
                    at = (K + q // L) * per
                    theirs = into[at:at + b - a]
                    yield from _recv_split(op, partner[q], (fin * K + q) * J, theirs, J)
                    continue
                assert tmp is not None
                theirs = tmp[:b - a]
                yield from _recv_split(op, partner[q], (fin * K + q) * J, theirs, J)
                yield from _drained(op, partner[q])  # buf[a:b] went out without a copy
                seg = buf[a:b]
                if first:
                    ufunc(seg, theirs, out=seg)
                else:
                    ufunc(theirs, seg, out=seg)
        if local is not None:
            # Everyone copied round t in and received its partials of round fin.
            yield from barrier(local, t)
            if fin >= 0:
                regions = regions_at(slots.pop(fin))
                for q in range(K):
                    a, b = pieces[q][fin]
                    reg = regions[q % L]
                    at = (K + q // L) * per
                    theirs = reg[at:at + b - a]
                    ours = reg[q * per:q * per + b - a]
                    if first:
                        ufunc(ours, theirs, out=buf[a:b])
                    else:
                        ufunc(theirs, ours, out=buf[a:b])
        if t < R:
            if local is None:
                for q in mine:
                    a, b = pieces[q][t]
                    if b > a:
                        _send_split(op, partner[q], (t * K + q) * J, buf[a:b], J)
                continue
            if t >= SLOTS:
                for q in mine:
                    yield from _drained(op, partner[q])
            regions = regions_at(slots[t])
            for q in mine:
                a, b = pieces[q][t]
                ours = regions[i][q * per:q * per + b - a]
                first_op = True
                for p in range(L):
                    if p != i:
                        theirs = regions[p][q * per:q * per + b - a]
                        if first_op:
                            ufunc(buf[a:b], theirs, out=ours)
                            first_op = False
                        else:
                            ufunc(ours, theirs, out=ours)
                if b > a:
                    _send_split(op, partner[q], (t * K + q) * J, ours, J)


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
    """Wait until nothing is queued to ``peer`` any more (a flush, when needed).

    Also what keeps the link busy: a rank that waits on shared memory drives no TCP
    sends (the message layer looks at the other planes once per wait slice, 50 ms), so
    before a phase inside the host whatever the kernel did not take yet is pushed out
    (normally nothing, or the tail of the last piece: the kernel holds several).
    """
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
    """Each host's leader for a call rooted at ``root``: the root on its host, local
    index (the root's local index mod L) elsewhere, so that calls with different
    roots spread the work over the ranks."""
    hr = next(g for g, rs in enumerate(lay.hosts) if root in rs)
    ir = lay.hosts[hr].index(root)
    return [root if g == hr else rs[ir % len(rs)] for g, rs in enumerate(lay.hosts)]


def broadcast(op: Op, buf: np.ndarray, root: int, lay: Layout, shm: Any) -> Algorithm:
    """Chain of host leaders from the root's host, each host's locals from their
    leader's slot, round by round (see the module docstring)."""
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


def reduce(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc, lay: Layout,
           shm: Any) -> Algorithm:
    """Each host's locals reduced by their leader, the leaders' chain ending at the
    root, round by round (see the module docstring). Only the root's buffer changes."""
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
            regions = [local.region(p, slot, buf.dtype, b - a) for p in range(L)]
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


def _published(hosts: tuple[tuple[int, ...], ...], x: int) -> list[list[int]]:
    """The rows each local of host ``x`` publishes: its own, then those it receives
    (local index j gets the rows of local indices k = j mod L_x of the other hosts)."""
    L = len(hosts[x])
    return [[hosts[x][j]] + [hosts[g][k] for g in range(len(hosts)) if g != x
                             for k in range(j, len(hosts[g]), L)] for j in range(L)]


def all_gather(op: Op, out: np.ndarray, lay: Layout, shm: Any) -> Algorithm:
    """Rows to one rank of every other host, then each host's rows through the slots
    (see the module docstring). ``out``: N x count, this rank's row filled."""
    hosts, h, i = lay.hosts, lay.host, lay.local
    H, L = len(hosts), len(hosts[h])
    me = op.me
    count = out.shape[1]
    pub = _published(hosts, h)
    dests = [hosts[g][i % len(hosts[g])] for g in range(H) if g != h]
    # The same rounds on every host: as wide as the most rows any rank publishes.
    width = max(len(p) for x in range(H) for p in _published(hosts, x))
    per = max(1, min(ROUND_BYTES, SEGMENT_BYTES) // out.itemsize // width)
    cols = split(count, max(1, -(-count // per)))

    def send(t: int) -> None:
        if t < len(cols):
            a, b = cols[t]
            for dst in dests:
                op.send(dst, t, out[me, a:b])  # out[me] is never written: no copy

    for t in range(GATHER_AHEAD):
        send(t)
    local = _local_op(op, lay, shm)
    for t, (a, b) in enumerate(cols):
        w = b - a
        send(t + GATHER_AHEAD)
        for row in pub[i][1:]:
            yield op.recv_into(row, t, out[row, a:b])
        if local is None:
            continue
        for dst in dests:
            yield from _drained(op, dst)
        slot = op.next_slot()
        regions = [local.region(j, slot, out.dtype, len(pub[j]) * w) for j in range(L)]
        for k, row in enumerate(pub[i]):
            regions[i][k * w:(k + 1) * w] = out[row, a:b]
        yield from barrier(local, t)
        for j in range(L):
            if j != i:
                for k, row in enumerate(pub[j]):
                    out[row, a:b] = regions[j][k * w:(k + 1) * w]

