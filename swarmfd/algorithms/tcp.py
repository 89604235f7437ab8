"""Algorithms over point-to-point messages (the TCP planes; any message plane works).

Each element's operands combine in one fixed order, whichever rank computes it, so
float results are the same bits on every rank. Steps, messages and bytes of each:
docs/algorithms.md ("Over messages").

Broadcast, reduce, gather and scatter have ranks that only send, so every rank first
shows its signature to the next (tag SIG) and the call ends with an acknowledgement
(tag ACK) to them: a rank that called something else, or disagrees on the root, is
caught in this call on every rank. Where a data message already travels that ring
edge before its sender waits, it is the signature and no SIG is sent.

Rings and chains follow the op's ring order (``Op.ring``: by host; or a ``ring`` given;
else rank order), crossing each host's link as few times as possible.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..comm import wire
from ..errors import ProtocolError
from . import base
from .base import Algorithm, Op, Parts, num_pieces, ring_pieces, split

__all__ = ["ACK", "SIG", "all_gather_counts", "all_gather_counts_doubling", "all_gather_direct",
           "all_gather_doubling", "all_gather_ring", "all_gather_v", "all_reduce_direct",
           "all_reduce_doubling", "all_reduce_pair", "all_reduce_ring", "all_to_all_pairwise",
           "all_to_all_rows", "barrier", "broadcast_chain", "broadcast_direct", "gather_direct",
           "reduce_chain", "reduce_direct", "reduce_scatter_direct", "reduce_scatter_ring",
           "scatter_direct", "signature_ring"]

_DATA = int(wire.Kind.DATA)

#: Tags of the acknowledgement that ends broadcast and reduce, and of the signature every
#: rank shows its successor in them (message tags count up from 0).
ACK = 0xFFFFFFFF
SIG = 0xFFFFFFFE


def _ring(op: Op, ring: Sequence[int] | None) -> tuple[list[int], int]:
    """The ring order (``ring``, else the op's, else rank order) and this rank's place."""
    ring = ring if ring is not None else op.ring
    order = list(range(op.size)) if ring is None else list(ring)
    return order, order.index(op.me)


# -- all_reduce -------------------------------------------------------------------------


def all_reduce_pair(op: Op, buf: np.ndarray, ufunc: np.ufunc, divide: int = 0) -> Algorithm:
    """Two ranks, one message each way, rank 0's operand first on both. One message,
    not pieces: more cost more Python steps than the overlap saves (docs/algorithms.md)."""
    peer = 1 - op.me
    op.send(peer, 0, buf, copy=True)  # copied: buf is overwritten below
    theirs = np.frombuffer((yield op.view(peer, 0, buf.nbytes)), buf.dtype, buf.size)
    if op.me == 0:
        ufunc(buf, theirs, out=buf)
    else:
        ufunc(theirs, buf, out=buf)
    if divide:
        base.divide_by(buf, divide)


def reduce_in_rank_order(op: Op, buf: np.ndarray, ufunc: np.ufunc) -> Algorithm:
    """Every rank's buffer (tag 0; this rank's is ``buf``) reduced in rank order into a
    new array; ``buf`` is left as it was."""
    acc: np.ndarray | None = None
    nbytes, dtype, count = buf.nbytes, buf.dtype, buf.size
    me = op.me
    for p in range(op.size):  # (Op.recv_array, inline: a small call's steps count)
        arr = buf if p == me else np.frombuffer((yield op.view(p, 0, nbytes)), dtype, count)
        if acc is None:
            acc = arr.copy()
        else:
            ufunc(acc, arr, out=acc)
    assert acc is not None
    return acc


def all_reduce_doubling(op: Op, buf: np.ndarray, ufunc: np.ufunc, divide: int = 0,
                        ring: Sequence[int] | None = None) -> Algorithm:
    """Recursive doubling (N a power of two): gather all N buffers in log2 N swaps, then
    reduce them in rank order as the direct exchange does (the same bits)."""
    order, pos = _ring(op, ring)
    N = op.size
    held = np.empty((N, buf.size), dtype=buf.dtype)  # row i: the buffer of order[i]
    held[pos] = buf
    yield from _gather_doubling(op, held, order, pos)
    row = {g: i for i, g in enumerate(order)}
    acc = held[row[0]].copy()
    for g in range(1, N):
        ufunc(acc, held[row[g]], out=acc)
    yield op.flush()  # rows of held may still be on their way out (zero-copy)
    buf[...] = acc
    if divide:
        base.divide_by(buf, divide)


def _gather_doubling(op: Op, rows: np.ndarray, order: Sequence[int], pos: int) -> Algorithm:
    """Recursive doubling over ``rows`` (row i: group rank ``order[i]``'s; this rank's at
    ``pos`` filled): in round k swap the 2^k rows held with the rank 2^k places away."""
    bit = 0
    while (1 << bit) < op.size:
        width = 1 << bit
        mine = pos & ~(width - 1)  # the rows this rank holds: [mine, mine + width)
        theirs = mine ^ width
        peer = order[pos ^ width]
        op.send(peer, bit, rows[mine:mine + width])
        yield op.recv_into(peer, bit, rows[theirs:theirs + width])
        bit += 1


def all_reduce_direct(op: Op, buf: np.ndarray, ufunc: np.ufunc, divide: int = 0) -> Algorithm:
    """Every rank sends its buffer to every other; each reduces all N in rank order."""
    me = op.me
    for p in range(op.size):
        if p != me:
            op.send(p, 0, buf)
    acc = yield from reduce_in_rank_order(op, buf, ufunc)
    yield op.flush()  # buf may still be on its way out (zero-copy) before it is overwritten
    buf[...] = acc
    if divide:
        base.divide_by(buf, divide)


def all_reduce_ring(op: Op, buf: np.ndarray | Parts, ufunc: np.ufunc, divide: int = 0,
                    ring: Sequence[int] | None = None) -> Algorithm:
    """Pipelined ring reduce-scatter, then all-gather. ``buf`` may be :class:`Parts`
    (the bits of their concatenation); ``divide``: each chunk's owner divides it once
    reduced, before it goes around (a mean without another pass)."""
    order, pos = _ring(op, ring)
    N = op.size
    pieces = ring_pieces(buf, split(buf.size, N))
    P = max(len(p) for p in pieces)
    nxt, prv = order[(pos + 1) % N], order[(pos - 1) % N]
    dtype = buf.dtype
    # Reduce-scatter. Tag = step * P + piece; steps 0..N-2 reduce, N-1..2N-3 gather.
    for j, (a, b) in enumerate(pieces[pos]):
        op.send(nxt, j, base.take(buf, a, b))
    scratch = op.scratch(pieces, dtype)
    for k in range(N - 1):
        div = divide if k == N - 2 else 0
        for j, (a, b) in enumerate(pieces[(pos - k - 1) % N]):
            theirs = yield from op.recv_operand(prv, k * P + j, dtype, b - a, scratch)
            base.reduce_into(buf, a, b, theirs, ufunc, div)
            op.send(nxt, (k + 1) * P + j, base.take(buf, a, b))
    # All-gather: each fully reduced piece travels once around the ring.
    last = 2 * N - 3
    whole = type(buf) is np.ndarray
    for k in range(N - 1, 2 * N - 2):
        for j, (a, b) in enumerate(pieces[(pos - (k - N + 1)) % N]):
            tag = k * P + j
            views = [buf[a:b]] if whole else [v for v, _, _ in base.spans(buf, a, b)]
            if len(views) == 1:
                seg = views[0]
                yield op.recv_into(prv, tag, seg)
            else:  # small arrays' piece: through the scratch buffer
                data = yield from op.recv_operand(prv, tag, dtype, b - a, scratch)
                base.put(buf, a, b, data)
                seg = base.take(buf, a, b)  # a copy: the scratch buffer is reused
            if k < last:
                op.send(nxt, tag + P, seg)


# -- broadcast --------------------------------------------------------------------------


def signature_ring(op: Op) -> None:
    """Show this call's signature to the next rank (see the module docstring)."""
    op.send((op.me + 1) % op.size, SIG, b"")


def signature_ring_end(op: Op) -> Algorithm:
    """Take the previous rank's signature (the end of :func:`signature_ring`)."""
    yield op.recv((op.me - 1) % op.size, SIG, 0)


def broadcast_direct(op: Op, buf: np.ndarray, root: int) -> Algorithm:
    """The root sends to everyone; everyone acknowledges. The root's data is its
    signature to the next rank (no SIG)."""
    if op.me == root:
        for p in range(op.size):
            if p != root:
                op.send(p, 0, buf)
        for p in range(op.size):
            if p != root:
                yield op.recv(p, ACK, 0)
    else:
        signature_ring(op)
        yield op.recv_into(root, 0, buf)
        op.send(root, ACK, b"")
    if (op.me - 1) % op.size != root:
        yield from signature_ring_end(op)


def _chain(order: list[int], me: int, first: int) -> tuple[int, int, int]:
    """(position, previous, next) of group rank ``me`` in the chain that follows
    ``order`` (group ranks in ring order) from group rank ``first``."""
    at = order.index(first)
    chain = order[at:] + order[:at]
    pos = chain.index(me)
    return pos, chain[pos - 1], chain[(pos + 1) % len(chain)]


def broadcast_chain(op: Op, buf: np.ndarray, root: int,
                    ring: Sequence[int] | None = None) -> Algorithm:
    """Pipelined chain from the root along ``ring`` (by default root -> root+1 -> ...);
    the last rank acknowledges to the root."""
    signature_ring(op)
    N = op.size
    pos, prv, nxt = _chain(_ring(op, ring)[0], op.me, root)
    for j, (a, b) in enumerate(split(buf.size, num_pieces(buf.size, buf.itemsize))):
        seg = buf[a:b]
        if pos > 0:
            yield op.recv_into(prv, j, seg)
        if pos < N - 1:
            op.send(nxt, j, seg)
    if pos == N - 1:
        op.send(root, ACK, b"")
    elif pos == 0:
        yield op.recv(prv, ACK, 0)
    yield from signature_ring_end(op)


# -- reduce -----------------------------------------------------------------------------


def reduce_direct(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc,
                  divide: int = 0) -> Algorithm:
    """Everyone sends to the root, which reduces in rank order and acknowledges. The
    data of the rank before the root is its signature (no SIG)."""
    if op.me != root:
        if (op.me + 1) % op.size != root:
            signature_ring(op)
        op.send(root, 0, buf)
        yield op.recv(root, ACK, 0)
    else:
        signature_ring(op)
        acc = yield from reduce_in_rank_order(op, buf, ufunc)
        for p in range(op.size):
            if p != root:
                op.send(p, ACK, b"")
        buf[...] = acc
        if divide:
            base.divide_by(buf, divide)
        return
    yield from signature_ring_end(op)


def reduce_chain(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc, divide: int = 0,
                 ring: Sequence[int] | None = None) -> Algorithm:
    """Pipelined chain along ``ring`` (by default root+1 -> ... -> root), ending at the
    root, which alone is written and acknowledges to the first; chain order throughout."""
    signature_ring(op)
    order, _ = _ring(op, ring)
    first = order[(order.index(root) + 1) % op.size]
    pos, prv, nxt = _chain(order, op.me, first)
    for j, (a, b) in enumerate(split(buf.size, num_pieces(buf.size, buf.itemsize))):
        seg = buf[a:b]
        if pos == 0:
            op.send(nxt, j, seg)
            continue
        incoming = yield from op.recv_array(prv, j, seg)
        if op.me == root:
            ufunc(incoming, seg, out=seg)
        else:
            op.send(nxt, j, ufunc(incoming, seg))
    if op.me == root:
        op.send(first, ACK, b"")
    elif op.me == first:
        yield op.recv(root, ACK, 0)
    yield from signature_ring_end(op)
    if divide and op.me == root:
        yield op.flush()
        base.divide_by(buf, divide)


# -- all_gather -------------------------------------------------------------------------


def all_gather_direct(op: Op, out: np.ndarray) -> Algorithm:
    """Every rank sends its row of ``out`` (N x count, its own filled) to every other."""
    me = op.me
    mine = out[me]
    nbytes = mine.nbytes
    for p in range(op.size):
        if p != me:
            op.send(p, 0, mine)
    for p in range(op.size):
        if p != me:
            yield (op, p, 0, nbytes, out[p] if nbytes else None)  # (Op.recv_into)


def all_gather_doubling(op: Op, out: np.ndarray) -> Algorithm:
    """Recursive doubling (N a power of two), in rank order."""
    yield from _gather_doubling(op, out, range(op.size), op.me)
    yield op.flush()  # rows of out may still be on their way out (zero-copy)


def all_gather_ring(op: Op, out: np.ndarray, ring: Sequence[int] | None = None) -> Algorithm:
    """Pipelined ring: each row travels once around, in pieces."""
    order, pos = _ring(op, ring)
    N = op.size
    count = out.shape[1]
    pieces = split(count, num_pieces(count, out.itemsize))
    P = len(pieces)
    nxt, prv = order[(pos + 1) % N], order[(pos - 1) % N]
    for j, (a, b) in enumerate(pieces):
        op.send(nxt, j, out[op.me, a:b])
    for k in range(N - 1):
        row = order[(pos - k - 1) % N]
        for j, (a, b) in enumerate(pieces):
            seg = out[row, a:b]
            yield op.recv_into(prv, k * P + j, seg)
            if k < N - 2:
                op.send(nxt, (k + 1) * P + j, seg)


# -- barrier ----------------------------------------------------------------------------


def barrier(op: Op, tag: int = 0) -> Algorithm:
    """Dissemination: ceil(log2 N) rounds of empty messages (tags tag<<8 | round)."""
    d, step = 1, 0
    me, size = op.me, op.size
    while d < size:
        op.send((me + d) % size, (tag << 8) | step, b"")
        yield (op, (me - d) % size, (tag << 8) | step, 0, None)  # (Op.recv)
        d, step = d * 2, step + 1


# -- reduce_scatter ---------------------------------------------------------------------


def reduce_scatter_direct(op: Op, buf: np.ndarray | Parts, out: np.ndarray,
                          parts: Sequence[tuple[int, int]], ufunc: np.ufunc,
                          divide: int = 0) -> Algorithm:
    """Every rank sends part r of its buffer (an array or Parts, read only) to rank r,
    which reduces the N parts in rank order into ``out`` (flat), then divides it by
    ``divide`` (when not 0)."""
    for p in range(op.size):
        if p != op.me:
            a, b = parts[p]
            op.send(p, 0, base.take(buf, a, b))
    a, b = parts[op.me]
    mine = base.take(buf, a, b)
    for p in range(op.size):
        arr = mine if p == op.me else (yield from op.recv_array(p, 0, mine))
        if p == 0:
            out[...] = arr
        else:
            ufunc(out, arr, out=out)
    if divide:
        base.divide_by(out, divide)


def reduce_scatter_ring(op: Op, buf: np.ndarray | Parts, out: np.ndarray,
                        parts: Sequence[tuple[int, int]], ufunc: np.ufunc, divide: int = 0,
                        ring: Sequence[int] | None = None) -> Algorithm:
    """Pipelined ring reduce-scatter: position q first sends position q-1's part, so
    after N-1 steps every rank holds its own in ``out``. ``buf`` (an array or Parts) is
    read, never written: partial sums travel in buffers of their own. Pieces are cut as
    an array's, independent of how Parts split it (not in the signature)."""
    order, pos = _ring(op, ring)
    N = op.size
    pieces = base.even_pieces(parts, buf.itemsize)
    P = len(pieces[0])
    nxt, prv = order[(pos + 1) % N], order[(pos - 1) % N]
    dtype = buf.dtype

    def part_at(step_pos: int) -> int:
        return order[(step_pos - 1) % N]

    for j, (a, b) in enumerate(pieces[part_at(pos)]):
        op.send(nxt, j, base.take(buf, a, b))
    scratch = op.scratch(pieces, dtype)
    for k in range(N - 1):
        part = part_at(pos - k - 1)
        last = k == N - 2
        for j, (a, b) in enumerate(pieces[part]):
            theirs = yield from op.recv_operand(prv, k * P + j, dtype, b - a, scratch)
            acc = out[a - parts[part][0]:b - parts[part][0]] if last else \
                np.empty(b - a, dtype)
            for view, u, v in base.spans(buf, a, b):
                ufunc(view, theirs[u:v], out=acc[u:v])
            if not last:
                op.send(nxt, (k + 1) * P + j, acc)
            elif divide:
                base.divide_by(acc, divide)
    if N == 1:
        out[...] = base.take(buf, parts[0][0], parts[0][1])


# -- all_to_all -------------------------------------------------------------------------


def all_to_all_pairwise(op: Op, buf: np.ndarray, send: Sequence[tuple[int, int]],
                        out: np.ndarray, recv: Sequence[tuple[int, int]]) -> Algorithm:
    """Pairwise exchange: at step k rank r sends its part for r+k and receives the part of
    r-k, in pieces (each link carries each part once). ``send``/``recv``: [start, stop)
    element ranges of each rank's part in ``buf`` and in ``out``."""
    N, me = op.size, op.me
    a, b = send[me]
    ra, rb = recv[me]
    out[ra:rb] = buf[a:b]
    for k in range(1, N):
        dst, src = (me + k) % N, (me - k) % N
        a, b = send[dst]
        for j, (x, y) in enumerate(split(b - a, num_pieces(b - a, buf.itemsize))):
            op.send(dst, (k << 20) | j, buf[a + x:a + y])
        ra, rb = recv[src]
        for j, (x, y) in enumerate(split(rb - ra, num_pieces(rb - ra, out.itemsize))):
            yield op.recv_into(src, (k << 20) | j, out[ra + x:ra + y])


def all_to_all_rows(op: Op, flat: np.ndarray, out: np.ndarray, matrix: np.ndarray,
                    rows_in: Sequence[int], rows_out: Sequence[int], row: int) -> Algorithm:
    """:func:`all_to_all_pairwise` of parts of ``rows_in[r]`` rows (of ``row`` elements)
    to rank r, ``rows_out[r]`` from it (``matrix``: everyone's splits, unused here)."""
    yield from all_to_all_pairwise(op, flat, base.bounds(rows_in, row), out,
                                   base.bounds(rows_out, row))


# -- gather and scatter -----------------------------------------------------------------


def gather_direct(op: Op, flat: np.ndarray, out: np.ndarray | None, root: int) -> Algorithm:
    """Everyone sends its buffer to the root in pieces (the root's link carries each once);
    the root acknowledges. ``out``: the root's (N x count) result."""
    signature_ring(op)
    pieces = split(flat.size, num_pieces(flat.size, flat.itemsize))
    if op.me == root:
        assert out is not None
        out[root] = flat
        for p in range(op.size):
            if p != root:
                for j, (a, b) in enumerate(pieces):
                    yield op.recv_into(p, j, out[p, a:b])
        for p in range(op.size):
            if p != root:
                op.send(p, ACK, b"")
    else:
        for j, (a, b) in enumerate(pieces):
            op.send(root, j, flat[a:b])
        yield op.recv(root, ACK, 0)
    yield from signature_ring_end(op)


def scatter_direct(op: Op, chunks: np.ndarray | None, out: np.ndarray, root: int) -> Algorithm:
    """The root sends chunk r to rank r in pieces; every rank acknowledges.
    ``chunks``: the root's (N x count) input; ``out``: every rank's flat result."""
    signature_ring(op)
    pieces = split(out.size, num_pieces(out.size, out.itemsize))
    if op.me == root:
        assert chunks is not None
        for p in range(op.size):
            if p != root:
                for j, (a, b) in enumerate(pieces):
                    op.send(p, j, chunks[p, a:b])
        out[...] = chunks[root]
        for p in range(op.size):
            if p != root:
                yield op.recv(p, ACK, 0)
    else:
        for j, (a, b) in enumerate(pieces):
            yield op.recv_into(root, j, out[a:b])
        op.send(root, ACK, b"")
    yield from signature_ring_end(op)


# -- all_gather of uneven parts -----------------------------------------------------------


#: The row count that leads every message of :func:`all_gather_counts`.
_COUNT = struct.Struct("<q")
_ANY_SIZE = wire.ANY_SIZE


def _read_part(data: Any, at: int, row_nbytes: int, limit: int) -> tuple[int, int]:
    """(row count, the byte after the part) of the uneven all_gather's part at byte
    ``at`` (an int64 count, then the rows where they take at most ``limit`` bytes), or
    (-1, at) when the bytes there are not one."""
    if len(data) - at < _COUNT.size:
        return -1, at
    n = _COUNT.unpack_from(data, at)[0]
    if n < 0:
        return -1, at
    size = n * row_nbytes
    end = at + _COUNT.size + (size if size <= limit else 0)
    return (n, end) if end <= len(data) else (-1, at)


def _encode_part(count: int, flat: np.ndarray, limit: int) -> bytes:
    """This rank's part as :func:`_read_part` reads it."""
    return _COUNT.pack(count) + (flat.tobytes() if flat.nbytes <= limit else b"")


def _part_error(op: Op, peer: int, got: int, limit: int,
                parts: str = "its part") -> ProtocolError:
    """The error for a message that breaks :func:`_read_part`'s rule."""
    return ProtocolError(f"{op.channel.activity}: rank {op.ranks[peer]} sent {got} bytes "
                         f"for {parts} of an all_gather (expected {_COUNT.size} bytes of "
                         "row count for each part, then its rows when they take at most "
                         f"{limit} bytes)")


def all_gather_counts(op: Op, count: int, flat: np.ndarray, row_nbytes: int,
                      limit: int) -> Algorithm:
    """Every rank's row count, with its rows where they fit ``limit``, in one message to
    every peer (a small uneven all_gather in one round). Returns (counts, parts):
    parts[r], rank r's rows, or None where they did not fit (still to come). A message
    that breaks the rule is a protocol error."""
    N, me = op.size, op.me
    mine = _encode_part(count, flat, limit)
    for p in range(N):
        if p != me:
            op.send(p, 0, mine)
    counts = [0] * N
    parts: list[np.ndarray | None] = [None] * N
    counts[me], parts[me] = count, (flat if flat.nbytes <= limit else None)
    for p in range(N):
        if p == me:
            continue
        data = yield (op, p, 0, _ANY_SIZE, None)  # (Op.recv)
        n, end = _read_part(data, 0, row_nbytes, limit)
        if n < 0 or end != len(data):
            raise _part_error(op, p, len(data), limit)
        counts[p] = n
        if n * row_nbytes <= limit:  # a copy: a view dies with the next receive
            parts[p] = np.frombuffer(data, flat.dtype, offset=_COUNT.size).copy()
    return counts, parts


def all_gather_counts_doubling(op: Op, count: int, flat: np.ndarray, row_nbytes: int,
                               limit: int) -> Algorithm:
    """:func:`all_gather_counts` by recursive doubling (N a power of two): round k swaps
    the 2^k parts held, one after another in one message; another count of parts, or a
    part that breaks the rule, is a protocol error."""
    N, me = op.size, op.me
    held: list[Any] = [b""] * N  # every rank's part as it travels (count, rows)
    held[me] = _encode_part(count, flat, limit)
    counts = [count] * N
    bit = 0
    while (1 << bit) < N:
        width = 1 << bit
        mine = me & ~(width - 1)  # the parts this rank holds: [mine, mine + width)
        peer = me ^ width
        op.send(peer, bit, b"".join(held[mine:mine + width]))
        data = yield op.recv(peer, bit, wire.ANY_SIZE)
        at = 0
        for r in range(mine ^ width, (mine ^ width) + width):
            n, end = _read_part(data, at, row_nbytes, limit)
            if n < 0:
                raise _part_error(op, peer, len(data), limit, f"the {width} parts")
            # A copy kept and sent on; a bytearray, so the rows returned are writable.
            held[r] = bytearray(data[at:end])
            counts[r] = n
            at = end
        if at != len(data):
            raise _part_error(op, peer, len(data), limit, f"the {width} parts")
        bit += 1
    dtype = flat.dtype
    parts = [np.frombuffer(blob, dtype, offset=_COUNT.size) if n * row_nbytes <= limit
             else None for blob, n in zip(held, counts, strict=True)]
    parts[me] = flat if flat.nbytes <= limit else None
    return counts, parts


def all_gather_v(op: Op, flat: np.ndarray, out: np.ndarray,
                 rows: Sequence[tuple[int, int]], ring: Sequence[int] | None = None,
                 direct: bool = False) -> Algorithm:
    """All-gather of parts of different sizes into ``out`` (flat): part r of rank r at
    ``rows[r]``. Direct for small totals, else a pipelined ring (each part once around)."""
    N, me = op.size, op.me
    a, b = rows[me]
    out[a:b] = flat
    if direct:
        for p in range(N):
            if p != me:
                op.send(p, 0, flat)
        for p in range(N):
            if p != me:
                pa, pb = rows[p]
                yield op.recv_into(p, 0, out[pa:pb])  # direct: every part is one message
        return
    order, pos = _ring(op, ring)
    nxt, prv = order[(pos + 1) % N], order[(pos - 1) % N]

    def pieces_of(r: int) -> list[tuple[int, int]]:
        ra, rb = rows[r]
        return [(ra + x, ra + y) for x, y in split(rb - ra, num_pieces(rb - ra, out.itemsize))]

    for j, (x, y) in enumerate(pieces_of(me)):
        op.send(nxt, j, out[x:y])
    for k in range(N - 1):
        owner = order[(pos - k - 1) % N]
        for j, (x, y) in enumerate(pieces_of(owner)):
            seg = out[x:y]
            yield op.recv_into(prv, (k << 20) | j, seg)
            if k < N - 2:
                op.send(nxt, ((k + 1) << 20) | j, seg)
