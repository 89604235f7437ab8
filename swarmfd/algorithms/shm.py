"""Algorithms over shared memory (the ranks of one host, :mod:`swarmfd.comm.planes.shm`).

Each round moves up to SEGMENT_BYTES: every rank copies its part into its own slot, a
barrier (records through the plane) tells that all did, then each reads the others'
slots. Slots rotate (SLOTS in the group's area), so a rank rewrites a slot only after
every member passed a later barrier, that is, finished reading it. Each element is
reduced in one order (rank order, or its chunk's owner first, then rank order), so
every rank gets the same bits. Barriers, copies and cost of each: docs/algorithms.md
("Shared memory").
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..comm import cma
from ..comm.planes.shm import SEGMENT_BYTES
from ..errors import PeerLostError, ProtocolError
from .base import Algorithm, Op, Parts, bounds, divide_by, reduce_in_order, spans, split
from .tcp import barrier

__all__ = [
    "CMA_MAX_ARRAYS",
    "CMA_MIN_BYTES",
    "COUNT_BYTES",
    "SMALL_BYTES",
    "all_gather",
    "all_gather_counts",
    "all_gather_v",
    "all_reduce_cma",
    "all_reduce_one_round",
    "all_reduce_rounds",
    "all_to_all",
    "all_to_all_rows",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_cma",
    "rounds",
    "scatter",
]

#: Up to this many bytes every rank reduces the whole round itself (one barrier).
SMALL_BYTES = 1 << 18
#: From this many bytes an all_reduce uses cross-memory attach where allowed: below it
#: pinning the peers' pages costs more than the copy saved (docs/algorithms.md).
CMA_MIN_BYTES = 4 << 20
#: A peer's block read into scratch and reduced at once, in cache (docs/algorithms.md).
CMA_BLOCK_BYTES = 1 << 19
#: The most arrays whose addresses (a count, then address and length, int64) a slot holds.
CMA_MAX_ARRAYS = (SEGMENT_BYTES // 8 - 1) // 2


def rounds(nbytes: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, stop) element bounds of the rounds an array of ``nbytes`` needs."""
    per = SEGMENT_BYTES // itemsize
    count = nbytes // itemsize
    if count == 0:
        return [(0, 0)]
    return [(a, min(a + per, count)) for a in range(0, count, per)]


def all_reduce_one_round(op: Op, buf: np.ndarray | Parts, ufunc: np.ufunc,
                         divide: int = 0) -> Algorithm:
    """One round, one barrier; every rank reduces all of it in rank order (``divide``:
    a mean's divisor, 0 for none)."""
    me = op.me
    regions = op.regions(op.next_slot(), buf.dtype, buf.size)
    if type(buf) is np.ndarray:  # no views of the regions to make: the latency path
        regions[me][...] = buf
        yield from barrier(op, 0)
        reduce_in_order(buf, regions, ufunc)
        if divide:
            divide_by(buf, divide)
        return
    for piece, u, v in spans(buf, 0, buf.size):
        regions[me][u:v] = piece
    yield from barrier(op, 0)
    for piece, u, v in spans(buf, 0, buf.size):
        _reduce_all(piece, [r[u:v] for r in regions], ufunc, divide)


def all_reduce_rounds(op: Op, buf: np.ndarray | Parts, ufunc: np.ufunc,
                      divide: int = 0) -> Algorithm:
    """Pipelined rounds, one barrier each: copy in round r (all but this rank's own
    chunk), barrier (which also says r-1 is reduced), copy out the others' chunks of
    r-1, reduce this rank's chunk of r (its operand first) into its slot and its buffer.
    The owner divides a mean while the chunk is in cache; ``buf`` may be Parts."""
    N, me = op.size, op.me
    pending: tuple[np.ndarray | Parts, int, list[np.ndarray], list[tuple[int, int]]] | None = \
        None
    parts = rounds(buf.nbytes, buf.itemsize)
    others = [p for p in range(N) if p != me]
    for r, (a, b) in enumerate(parts):
        slot = op.next_slot()
        regions = op.regions(slot, buf.dtype, b - a)
        chunks = split(b - a, N)
        ca, cb = chunks[me]
        for piece, u, v in spans(buf, a, a + ca):
            regions[me][u:v] = piece
        for piece, u, v in spans(buf, a + cb, b):
            regions[me][cb + u:cb + v] = piece
        yield from barrier(op, r)
        if pending is not None:
            _copy_out(*pending, me)
        mine = regions[me][ca:cb]
        for piece, u, v in spans(buf, a + ca, a + cb):
            ufunc(piece, regions[others[0]][ca + u:ca + v], out=mine[u:v])
        for p in others[1:]:
            ufunc(mine, regions[p][ca:cb], out=mine)
        if divide:
            divide_by(mine, divide)
        for piece, u, v in spans(buf, a + ca, a + cb):
            piece[...] = mine[u:v]
        pending = (buf, a, regions, chunks)
    yield from barrier(op, len(parts))
    assert pending is not None
    _copy_out(*pending, me)


def _layout(buf: np.ndarray | Parts) -> list[tuple[int, int]]:
    """(address, bytes) of the arrays ``buf`` is made of, in order."""
    arrays = [buf] if type(buf) is np.ndarray else buf.arrays  # type: ignore[union-attr]
    return [(a.ctypes.data, a.nbytes) for a in arrays if a.nbytes]


class _Peers:
    """The members' buffers of a call through cross-memory attach: every rank published
    its arrays' addresses in its slot (:func:`_published`); this reads and writes
    element ranges of them (a failed read or write is the peer's loss)."""

    def __init__(self, op: Op, layouts: list[list[tuple[int, int]]], itemsize: int) -> None:
        self.op, self.layouts, self.itemsize = op, layouts, itemsize
        self.starts = [cma.offsets(layout) for layout in layouts]
        self.pids = op.shm.cma_pids

    def local(self, p: int, a: int, b: int) -> list[tuple[int, int]]:
        """(address, bytes) spans of elements [a, b) of group rank ``p``'s buffer."""
        n = self.itemsize
        return cma.spans(self.layouts[p], self.starts[p], a * n, b * n)

    def copy(self, p: int, local: list[tuple[int, int]], a: int, b: int, out: bool) -> None:
        """Elements [a, b) of group rank ``p``'s buffer into ``local``, or (``out``)
        ``local`` into them."""
        world = self.op.ranks[p]
        try:
            (cma.write if out else cma.read)(self.pids[world], local, self.local(p, a, b))
        except OSError as exc:
            raise PeerLostError(
                f"{self.op.channel.activity}: {'writing' if out else 'reading'} rank "
                f"{world}'s memory failed ({exc.strerror or exc}): it exited or failed"
            ) from None


def _published(op: Op, buf: np.ndarray | Parts) -> Algorithm:
    """``yield from`` this: every member's buffer layout, after each published its own
    in its slot and a barrier (:class:`_Peers` over them)."""
    me = op.me
    mine = _layout(buf)
    slot = op.next_slot()
    table = op.region(me, slot, np.dtype(np.int64), 1 + 2 * len(mine))
    table[0] = len(mine)
    table[1:] = np.asarray(mine, dtype=np.int64).reshape(-1)
    yield from barrier(op, 0)
    layouts: list[list[tuple[int, int]]] = []
    for p in range(op.size):
        if p == me:
            layouts.append(mine)
            continue
        count = int(op.region(p, slot, np.dtype(np.int64), 1)[0])
        row = op.region(p, slot, np.dtype(np.int64), 1 + 2 * count)[1:].reshape(count, 2)
        layouts.append([(int(a), int(n)) for a, n in row])
    return _Peers(op, layouts, buf.itemsize)


def all_reduce_cma(op: Op, buf: np.ndarray | Parts, ufunc: np.ufunc,
                   divide: int = 0) -> Algorithm:
    """all_reduce through the peers' buffers (cross-memory attach): each rank publishes
    its arrays' addresses, barrier, then reduces its 1/N chunk block by block (its
    operand first, the peers' read into scratch) and writes each block, in cache, into
    every peer's buffer; a last barrier. Chunk c is touched by rank c only: no race."""
    N, me = op.size, op.me
    peers = yield from _published(op, buf)
    ca, cb = split(buf.size, N)[me]
    others = [p for p in range(N) if p != me]
    per = max(1, CMA_BLOCK_BYTES // buf.itemsize)
    scratch = np.empty(min(per, max(cb - ca, 1)), buf.dtype)
    for a in range(ca, cb, per):
        b = min(a + per, cb)
        block = scratch[:b - a]
        for p in others:
            peers.copy(p, [(block.ctypes.data, block.nbytes)], a, b, False)
            for piece, u, v in spans(buf, a, b):
                ufunc(piece, block[u:v], out=piece)
        if divide:
            for piece, _, _ in spans(buf, a, b):
                divide_by(piece, divide)
        result = peers.local(me, a, b)
        for p in others:
            peers.copy(p, result, a, b, True)
    yield from barrier(op, 1)


def reduce_scatter_cma(op: Op, buf: np.ndarray | Parts, out: np.ndarray,
                       parts: list[tuple[int, int]], ufunc: np.ufunc,
                       divide: int = 0) -> Algorithm:
    """reduce_scatter through the peers' buffers (cross-memory attach): each rank
    publishes its arrays' addresses, barrier, then reduces its own part block by block
    in rank order (each peer's operand read into scratch, its own read where it is) into
    ``out``; a last barrier, after which the buffers may change. Nothing is copied into
    the slots: the ranks move (N-1)/N of the buffer less than :func:`reduce_scatter`."""
    peers = yield from _published(op, buf)
    pa, pb = parts[op.me]
    per = max(1, CMA_BLOCK_BYTES // buf.itemsize)
    scratch = np.empty(min(per, max(pb - pa, 1)), buf.dtype)
    for a in range(pa, pb, per):
        b = min(a + per, pb)
        dst = out[a - pa:b - pa]
        for p in range(op.size):
            if p == op.me:
                operand = spans(buf, a, b)
            else:
                block = scratch[:b - a]
                peers.copy(p, [(block.ctypes.data, block.nbytes)], a, b, False)
                operand = ((block, 0, b - a),)
            _fold(dst, operand, ufunc, p == 0)
        if divide:
            divide_by(dst, divide)
    yield from barrier(op, 1)


def _reduce_all(buf: np.ndarray, regions: list[np.ndarray], ufunc: np.ufunc,
                divide: int) -> None:
    """``buf`` = every member's region reduced in rank order (divided by ``divide``)."""
    reduce_in_order(buf, regions, ufunc)
    if divide:
        divide_by(buf, divide)


def _copy_out(buf: np.ndarray | Parts, a: int, regions: list[np.ndarray],
              chunks: list[tuple[int, int]], mine: int) -> None:
    """The others' reduced chunks of the round at ``a`` into ``buf`` (its own is there
    already)."""
    for p, (pa, pb) in enumerate(chunks):
        if p != mine:
            for piece, u, v in spans(buf, a + pa, a + pb):
                piece[...] = regions[p][pa + u:pa + v]


def broadcast(op: Op, buf: np.ndarray, root: int) -> Algorithm:
    """The root copies in, a barrier, everyone copies out."""
    if buf.nbytes <= SEGMENT_BYTES:  # one round (the latency path: no bounds to make)
        region = op.region(root, op.next_slot(), buf.dtype, buf.size)
        if op.me == root:
            region[...] = buf
            yield from barrier(op, 0)
        else:
            yield from barrier(op, 0)
            buf[...] = region
        return
    for r, (a, b) in enumerate(rounds(buf.nbytes, buf.itemsize)):
        slot = op.next_slot()
        region = op.region(root, slot, buf.dtype, b - a)
        if op.me == root:
            region[...] = buf[a:b]
        yield from barrier(op, r)
        if op.me != root:
            buf[a:b] = region


def reduce(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc,
           divide: int = 0) -> Algorithm:
    """Everyone copies in, a barrier, the root reduces in rank order (and divides)."""
    for r, (a, b) in enumerate(rounds(buf.nbytes, buf.itemsize)):
        slot = op.next_slot()
        regions = op.regions(slot, buf.dtype, b - a)
        regions[op.me][...] = buf[a:b]
        yield from barrier(op, r)
        if op.me == root:
            reduce_in_order(buf[a:b], regions, ufunc)
    if divide and op.me == root:
        divide_by(buf, divide)


def all_gather(op: Op, out: np.ndarray) -> Algorithm:
    """Everyone copies in, a barrier, everyone copies the others' rows out (``out``:
    N x count, this rank's row filled)."""
    flat = out[op.me]
    if flat.nbytes <= SEGMENT_BYTES:  # one round (the latency path: no bounds to make)
        regions = op.regions(op.next_slot(), flat.dtype, flat.size)
        regions[op.me][...] = flat
        yield from barrier(op, 0)
        for p in range(op.size):
            if p != op.me:
                out[p] = regions[p]
        return
    for r, (a, b) in enumerate(rounds(flat.nbytes, flat.itemsize)):
        slot = op.next_slot()
        regions = op.regions(slot, flat.dtype, b - a)
        regions[op.me][...] = flat[a:b]
        yield from barrier(op, r)
        for p in range(op.size):
            if p != op.me:
                out[p, a:b] = regions[p]


def _window(t: int, per: int, lo: int, hi: int) -> tuple[int, int]:
    """[lo, hi) cut to round t's window [t*per, (t+1)*per)."""
    return max(lo, t * per), min(hi, (t + 1) * per)


def reduce_scatter(op: Op, buf: np.ndarray | Parts, out: np.ndarray,
                   parts: list[tuple[int, int]], ufunc: np.ufunc, divide: int = 0) -> Algorithm:
    """Every rank copies its buffer in, round by round (but its own part); each reduces
    its part in rank order into ``out`` (flat), divided by ``divide``. ``buf`` may be
    :class:`Parts` (only read)."""
    pa, pb = parts[op.me]
    me = op.me
    for r, (a, b) in enumerate(rounds(buf.nbytes, buf.itemsize)):
        slot = op.next_slot()
        regions = op.regions(slot, buf.dtype, b - a)
        x, y = max(pa, a), min(pb, b)  # its own part is read from buf, never copied in
        for lo, hi in ((a, x), (y, b)) if x < y else ((a, b),):
            for piece, u, v in spans(buf, lo, hi):
                regions[me][lo - a + u:lo - a + v] = piece
        yield from barrier(op, r)
        if x < y:
            dst = out[x - pa:y - pa]
            for p in range(op.size):
                operand = spans(buf, x, y) if p == me else ((regions[p][x - a:y - a], 0,
                                                              y - x),)
                _fold(dst, operand, ufunc, p == 0)
            if divide:
                divide_by(dst, divide)


def _fold(dst: np.ndarray, operand: Iterable[tuple[np.ndarray, int, int]], ufunc: np.ufunc,
          first: bool) -> None:
    """Reduce one rank's operand (``(piece, u, v)`` spans of ``dst``) into ``dst``: the
    first rank's is copied, each later one's reduced in, so every rank reduces in rank
    order (the same bits everywhere)."""
    for piece, u, v in operand:
        if first:
            np.copyto(dst[u:v], piece)
        else:
            ufunc(dst[u:v], piece, out=dst[u:v])


def all_to_all(op: Op, buf: np.ndarray, totals: list[int], mine_in: list[tuple[int, int]],
               out: np.ndarray, recv: list[tuple[int, int]]) -> Algorithm:
    """Every rank copies its buffer in by windows; each copies out the parts for it.
    ``totals``: each member's size; ``mine_in[p]``: member p's range for this rank;
    ``recv[p]``: where it goes in ``out``."""
    per = SEGMENT_BYTES // buf.itemsize
    count = max(1, max(-(-t // per) for t in totals))
    for t in range(count):
        slot = op.next_slot()
        a, b = _window(t, per, 0, buf.size)
        if a < b:
            op.region(op.me, slot, buf.dtype, b - a)[...] = buf[a:b]
        yield from barrier(op, t)
        for p in range(op.size):
            x, y = _window(t, per, *mine_in[p])
            if x < y:
                src = op.region(p, slot, buf.dtype, y - t * per)[x - t * per:]
                oa = recv[p][0] + (x - mine_in[p][0])
                out[oa:oa + (y - x)] = src


def all_to_all_rows(op: Op, flat: np.ndarray, out: np.ndarray, matrix: np.ndarray,
                    rows_in: list[int], rows_out: list[int], row: int) -> Algorithm:
    """:func:`all_to_all` from everyone's splits (``matrix[p][q]``: the rows rank p
    sends rank q, of ``row`` elements each)."""
    n, me = op.size, op.me
    totals = [int(matrix[p].sum()) * row for p in range(n)]
    mine_in = [(int(matrix[p, :me].sum()) * row, int(matrix[p, :me + 1].sum()) * row)
               for p in range(n)]
    yield from all_to_all(op, flat, totals, mine_in, out, bounds(rows_out, row))


def gather(op: Op, flat: np.ndarray, out: np.ndarray | None, root: int) -> Algorithm:
    """Everyone copies in; the root copies every member's rows out (``out``: N x count)."""
    for r, (a, b) in enumerate(rounds(flat.nbytes, flat.itemsize)):
        slot = op.next_slot()
        regions = op.regions(slot, flat.dtype, b - a)
        regions[op.me][...] = flat[a:b]
        yield from barrier(op, r)
        if op.me == root:
            assert out is not None
            for p in range(op.size):
                out[p, a:b] = regions[p]


def scatter(op: Op, chunks: np.ndarray | None, out: np.ndarray, root: int) -> Algorithm:
    """The root copies a window of every member's chunk in; each copies its own out."""
    per = max(1, SEGMENT_BYTES // (op.size * out.itemsize))
    n = out.size
    for t in range(max(1, -(-n // per))):
        slot = op.next_slot()
        a, b = t * per, min(n, (t + 1) * per)
        region = op.region(root, slot, out.dtype, op.size * (b - a)).reshape(op.size, b - a)
        if op.me == root:
            assert chunks is not None
            region[...] = chunks[:, a:b]
        yield from barrier(op, t)
        out[a:b] = region[op.me]


#: Where the rows of :func:`all_gather_counts` start in a slot, after the count (16:
#: aligned for every dtype).
COUNT_BYTES = 16
_INT64 = np.dtype(np.int64)


def all_gather_counts(op: Op, count: int, flat: np.ndarray,
                      row_nbytes: int) -> Algorithm:
    """:func:`swarmfd.algorithms.tcp.all_gather_counts` in one round: each rank's count
    at its slot's start, its rows after it where they fit (which the count tells)."""
    slot = op.next_slot()
    room = SEGMENT_BYTES - COUNT_BYTES
    fits = flat.nbytes <= room
    op.region(op.me, slot, _INT64, 1)[0] = count
    if fits:
        op.region(op.me, slot + COUNT_BYTES, flat.dtype, flat.size)[...] = flat
    yield from barrier(op, 0)
    N = op.size
    counts = [0] * N
    parts: list[np.ndarray | None] = [None] * N
    counts[op.me], parts[op.me] = count, (flat if fits else None)
    per_row = row_nbytes // flat.itemsize
    for p in range(N):
        if p == op.me:
            continue
        n = int(op.region(p, slot, _INT64, 1)[0])
        if n < 0:
            raise ProtocolError(f"{op.channel.activity}: rank {op.ranks[p]} announced {n} "
                                "rows for its part of an all_gather")
        counts[p] = n
        if n * row_nbytes <= room:
            parts[p] = op.region(p, slot + COUNT_BYTES, flat.dtype, n * per_row).copy()
    return counts, parts


def all_gather_v(op: Op, flat: np.ndarray, out: np.ndarray,
                 rows: list[tuple[int, int]]) -> Algorithm:
    """Every rank's part into ``out`` at ``rows[r]``: an all_to_all of whole buffers."""
    sizes = [b - a for a, b in rows]
    yield from all_to_all(op, flat, sizes, [(0, s) for s in sizes], out, list(rows))
