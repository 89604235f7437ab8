"""Collectives over the process group: all_reduce, broadcast, reduce, all_gather, barrier.

Algorithms (N ranks, S bytes):

* **Ranks on one host** (``swarmfd run``): shared memory (:mod:`swarmfd.shm`).
  Each rank copies its round of data into its own segment; after a barrier each
  reduces its 1/N chunk from all segments, and after the next barrier copies
  the reduced chunks out. Small buffers: one barrier, every rank reduces all in
  rank order. The TCP algorithms below run between hosts, or with
  ``SWARMFD_TRANSPORT=tcp``.
* **all_reduce**, large: the ring. Reduce-scatter then all-gather over N
  chunks of the flat buffer, each chunk cut into pieces of about
  ``PIECE_BYTES``; a piece is forwarded as soon as it is reduced, so the
  reduction of one piece overlaps the transfer of the next. Each rank sends
  2(N-1)/N * S bytes: bandwidth-optimal. Every chunk is reduced once, on one
  rank, then copied around, so float results are bitwise identical on every
  rank.
* **all_reduce**, small (S <= ``SMALL_BYTES``): a direct exchange, every rank
  sends its buffer to every other one and reduces all N in rank order: one
  network hop instead of 2(N-1), and again identical on every rank. Two ranks
  do this up to ``PAIR_MAX_BYTES`` (1 MiB), in place, with one message each way.
* **broadcast**: small, the root sends to everyone; large, a pipelined chain
  from the root (every link carries S once).
* **reduce**: small, everyone sends to ``dst``; large, a pipelined chain that
  ends at ``dst``. Only ``dst``'s array changes.
* **all_gather**: small, direct; large, a pipelined ring (each rank sends
  (N-1)/N of the result); into a new result, or a caller's reused one (``out=``).
* **barrier**: dissemination, ceil(log2 N) rounds of empty messages.

Inputs: numpy arrays of any dtype in :data:`swarmfd.wire.DTYPES`, any shape
(0-d and empty included), C-contiguous or not (a non-contiguous array is
worked on as a contiguous copy and written back, so in-place semantics hold),
CPU torch tensors (through a zero-copy numpy view), and for all_reduce,
all_reduce_mean and broadcast a list of arrays, moved as one fused buffer
per dtype. Integer sums wrap around as numpy's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from . import group as _group
from . import shm as _shm
from . import wire
from .errors import SwarmfdError
from .wire import Collective, ReduceOp, Signature

#: Target size of one wire message (see wire.PIECE_BYTES: every send is at most a piece,
#: well below glibc's 32 MiB mmap cliff).
PIECE_BYTES = wire.PIECE_BYTES
#: Two ranks all-reduce up to this many bytes as one message each way (see _pair_all_reduce);
#: above it the ring's pipelined pieces win (interleaved A/B over TCP: 0.78-0.86x the ring's
#: time at 1 MiB, even at 2 MiB with two pieces).
PAIR_MAX_BYTES = PIECE_BYTES
#: Up to this many bytes, all_reduce/reduce/broadcast/all_gather use a direct exchange.
SMALL_BYTES = 256 << 10
#: The direct exchange sends (N-1) copies: use it only for groups up to this size.
SMALL_MAX_WORLD = 8

#: Over shared memory, up to this many bytes every rank reduces the whole round itself
#: (one barrier); above it each rank reduces its 1/N and copies the rest (two barriers).
SHM_SMALL_BYTES = 1 << 18
#: Tags of the acknowledgement that ends broadcast and reduce, and of the signature every
#: rank shows its successor in them (message tags count up from 0).
ACK = 0xFFFFFFFF
SIG = 0xFFFFFFFE

T = TypeVar("T")

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_OP_NAMES = {"sum": ReduceOp.SUM, "prod": ReduceOp.PROD, "product": ReduceOp.PROD,
             "min": ReduceOp.MIN, "max": ReduceOp.MAX}


# -- inputs ---------------------------------------------------------------------------


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """A numpy view of ``x`` (an ndarray or a CPU torch tensor), or a TypeError.

    An ndarray subclass (np.matrix, np.memmap, ...) is worked on through a plain ndarray
    view of the same memory, so in-place results land in it; a masked array is refused,
    since its mask would be silently ignored.
    """
    if isinstance(x, np.ndarray):
        if type(x) is np.ndarray:
            return x
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"swarmfd.{name}: a masked array cannot be reduced (its mask would "
                            "be ignored); pass np.ma.filled(x, fill_value) or x.data")
        return x.view(np.ndarray)
    if hasattr(x, "detach") and hasattr(x, "numpy") and hasattr(x, "device"):
        if getattr(x.device, "type", "cpu") != "cpu":
            raise TypeError(f"swarmfd.{name}: only CPU tensors are supported, got a tensor on "
                            f"{x.device}; move it with .cpu() first")
        try:
            return x.detach().numpy()
        except (TypeError, RuntimeError) as exc:
            raise TypeError(f"swarmfd.{name}: cannot view tensor of dtype {x.dtype} as a numpy "
                            f"array ({exc}); expected one of {wire.SUPPORTED_DTYPE_NAMES}"
                            ) from None
    raise TypeError(
        f"swarmfd.{name} expects a numpy array, a CPU torch tensor or a list of them, got "
        f"{type(x).__name__}; wrap scalars and lists with np.asarray(...)"
    )


def _check_array(arr: np.ndarray, name: str, *, writable: bool = True) -> int:
    code = wire.dtype_code(arr.dtype)
    if writable and not arr.flags.writeable:
        raise ValueError(f"swarmfd.{name} works in place but the array is read-only; pass a "
                         "writable array (e.g. arr.copy())")
    return code


def _parse_op(op: Any, name: str) -> tuple[ReduceOp, bool]:
    """(reduce op, is_mean) from a string like "sum" or a ReduceOp."""
    if isinstance(op, ReduceOp) and op != ReduceOp.NONE:
        return op, False
    if isinstance(op, str):
        key = op.lower()
        if key in ("mean", "avg", "average"):
            return ReduceOp.SUM, True
        if key in _OP_NAMES:
            return _OP_NAMES[key], False
    raise ValueError(f"swarmfd.{name}: unsupported op {op!r}: expected one of "
                     "'sum', 'prod', 'min', 'max', 'mean'")


def _check_op_dtype(op: ReduceOp, mean: bool, dtype: np.dtype, name: str) -> None:
    if mean and dtype.kind not in "fc":
        raise TypeError(f"swarmfd.{name}: the mean of {dtype} values cannot be stored in place; "
                        "expected a floating-point array (or use op='sum' and divide)")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
        raise TypeError(f"swarmfd.{name}: op {op.label} is not defined for complex dtype {dtype}")


def _check_rank(value: Any, world: int, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"swarmfd.{name}: {what} must be an integer rank, got {value!r}")
    if not 0 <= int(value) < world:
        raise ValueError(f"swarmfd.{name}: {what}={value} is out of range: expected "
                         f"0 <= {what} < world_size ({world})")
    return int(value)


def _flat(arr: np.ndarray) -> tuple[np.ndarray, Callable[[], None] | None]:
    """A flat contiguous view of ``arr`` (or a copy plus the function that writes it back)."""
    if arr.flags.c_contiguous:
        return arr.reshape(-1), None
    tmp = np.ascontiguousarray(arr).reshape(-1)

    def write_back() -> None:
        np.copyto(arr, tmp.reshape(arr.shape))

    return tmp, write_back


# -- running a collective ---------------------------------------------------------------


class _Call:
    """One collective call: its group, transport, sequence number and signature."""

    __slots__ = ("N", "g", "rank", "s", "seq", "sig", "t")

    def __init__(self, g: _group.Group, sig: Signature) -> None:
        self.g = g
        self.t = g.transport
        self.s = g.shm
        self.rank = g.config.rank
        self.N = g.config.world_size
        self.seq = g.seq
        self.sig = sig


def _run(g: _group.Group, sig: Signature, body: Callable[[_Call], T]) -> T:
    """Run ``body`` as the group's next collective; a failure breaks the group."""
    if g.broken is not None:
        raise type(g.broken)(
            f"the process group is unusable after an earlier failure ({g.broken}); call "
            "swarmfd.cleanup() and swarmfd.init() to start again"
        ) if isinstance(g.broken, SwarmfdError) else RuntimeError(
            f"the process group is unusable after an earlier failure: {g.broken!r}")
    g.seq += 1
    call = _Call(g, sig)
    t = call.t
    if t is None:
        return body(call)
    t.activity = f"{sig.coll.label} (call #{g.seq} on rank {call.rank})"
    if call.s is not None:
        call.s.activity = t.activity
    try:
        if t.data_via_shm:
            t.drain_unused()
        result = body(call)
        t.flush()
        return result
    except BaseException as exc:
        g.broken = exc
        if call.s is not None:
            call.s.abort(exc)
        t.abort(exc)
        raise
    finally:
        t.activity = "idle"


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) bounds of ``parts`` near-equal parts of ``n`` (as np.array_split)."""
    q, r = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _num_pieces(count: int, itemsize: int) -> int:
    return max(1, -(-count * itemsize // PIECE_BYTES))


def _recv_array(c: _Call, src: int, tag: int, like: np.ndarray) -> np.ndarray:
    data = c.t.recv(src, c.sig, c.seq, tag, like.nbytes)  # type: ignore[union-attr]
    return np.frombuffer(data, dtype=like.dtype, count=like.size)


def _recv_into(c: _Call, src: int, tag: int, out: np.ndarray) -> None:
    if out.nbytes == 0:
        c.t.recv(src, c.sig, c.seq, tag, 0)  # type: ignore[union-attr]
    else:
        c.t.recv(src, c.sig, c.seq, tag, out.nbytes, into=out)  # type: ignore[union-attr]


@contextlib.contextmanager
def _signature_ring(c: _Call, t: Any) -> Iterator[None]:
    """Send this call's signature to the next rank first; take the previous one's last."""
    N = c.N
    t.send((c.rank + 1) % N, c.sig, c.seq, SIG, b"")
    yield
    t.recv((c.rank - 1) % N, c.sig, c.seq, SIG, 0)


def _use_direct(nbytes: int, world: int) -> bool:
    return nbytes <= SMALL_BYTES and world <= SMALL_MAX_WORLD


# -- all_reduce -------------------------------------------------------------------------


def _all_reduce_flat(c: _Call, buf: np.ndarray, op: ReduceOp) -> None:
    if c.N == 1:
        return
    ufunc = _UFUNCS[op]
    if c.s is not None:
        _shm_all_reduce(c, c.s, buf, ufunc)
        return
    if c.N == 2 and buf.nbytes <= PAIR_MAX_BYTES:
        _pair_all_reduce(c, buf, ufunc)
    elif _use_direct(buf.nbytes, c.N) or buf.size < c.N:
        _direct_all_reduce(c, buf, ufunc)
    else:
        _ring_all_reduce(c, buf, ufunc)


def _direct_all_reduce(c: _Call, buf: np.ndarray, ufunc: np.ufunc) -> None:
    t = c.t
    assert t is not None
    for p in range(c.N):
        if p != c.rank:
            t.send(p, c.sig, c.seq, 0, buf)
    acc = _reduce_in_rank_order(c, buf, ufunc)
    t.flush()  # buf may still be on its way out (zero-copy) before it is overwritten
    buf[...] = acc


def _reduce_in_rank_order(c: _Call, buf: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
    """Every rank's buffer (tag 0; this rank's own is ``buf``) reduced in rank order.

    The operands are always combined as ((x0 op x1) op x2) ..., whichever rank
    computes it, so every rank that reduces gets the same bits (a contract: floating
    point sums depend on the order). Returns a new array; ``buf`` is left as it was.
    """
    acc: np.ndarray | None = None
    for p in range(c.N):
        arr = buf if p == c.rank else _recv_array(c, p, 0, buf)
        if acc is None:
            acc = arr.copy()
        else:
            ufunc(acc, arr, out=acc)
    assert acc is not None  # c.N >= 1
    return acc


def _pair_all_reduce(c: _Call, buf: np.ndarray, ufunc: np.ufunc) -> None:
    """Two ranks, one message each way: send the whole buffer, reduce the peer's into it.

    One hop instead of the ring's two, and no copy of the result. Operands are
    taken in rank order (rank 0's first), so both ranks compute the same bits.
    """
    t = c.t
    assert t is not None
    peer = 1 - c.rank
    t.send(peer, c.sig, c.seq, 0, buf, copy=True)  # copied: buf is overwritten below
    theirs = _recv_array(c, peer, 0, buf)
    if c.rank == 0:
        ufunc(buf, theirs, out=buf)
    else:
        ufunc(theirs, buf, out=buf)


def _ring_all_reduce(c: _Call, buf: np.ndarray, ufunc: np.ufunc) -> None:
    t = c.t
    assert t is not None
    N, rank, sig, seq = c.N, c.rank, c.sig, c.seq
    chunks = _split(buf.size, N)
    P = _num_pieces(max(b - a for a, b in chunks), buf.itemsize)
    pieces = [[(a + x, a + y) for x, y in _split(b - a, P)] for a, b in chunks]
    nxt, prv = (rank + 1) % N, (rank - 1) % N
    # Reduce-scatter. Tag = step * P + piece; steps 0..N-2 reduce, N-1..2N-3 gather.
    for j, (a, b) in enumerate(pieces[rank]):
        t.send(nxt, sig, seq, j, buf[a:b])
    for k in range(N - 1):
        for j, (a, b) in enumerate(pieces[(rank - k - 1) % N]):
            seg = buf[a:b]
            ufunc(seg, _recv_array(c, prv, k * P + j, seg), out=seg)
            # The reduced piece goes on at once: to the next reduce step, or, after the
            # last one, as the first all-gather step.
            t.send(nxt, sig, seq, (k + 1) * P + j, seg)
    # All-gather: each fully reduced piece travels once around the ring.
    last = 2 * N - 3
    for k in range(N - 1, 2 * N - 2):
        for j, (a, b) in enumerate(pieces[(rank - (k - N + 1)) % N]):
            seg = buf[a:b]
            _recv_into(c, prv, k * P + j, seg)
            if k < last:
                t.send(nxt, sig, seq, (k + 1) * P + j, seg)


# -- broadcast --------------------------------------------------------------------------


def _broadcast_flat(c: _Call, buf: np.ndarray, src: int) -> None:
    if c.N == 1:
        return
    if c.s is not None:
        _shm_broadcast(c, c.s, buf, src)
        return
    t = c.t
    assert t is not None
    # Senders only send, so each collective that has them ends with an acknowledgement
    # (tag ACK) to them: a rank that called something else is then caught in this call,
    # on every rank, instead of leaving its data unread. And every rank shows its
    # signature to the next one (tag SIG): if the ranks disagree on the root so that
    # all of them wait to receive, the waits end at once in a MismatchError.
    with _signature_ring(c, t):
        _broadcast_tcp(c, t, buf, src)


def _broadcast_tcp(c: _Call, t: Any, buf: np.ndarray, src: int) -> None:
    if _use_direct(buf.nbytes, c.N):
        if c.rank == src:
            for p in range(c.N):
                if p != src:
                    t.send(p, c.sig, c.seq, 0, buf)
            for p in range(c.N):
                if p != src:
                    t.recv(p, c.sig, c.seq, ACK, 0)
        else:
            _recv_into(c, src, 0, buf)
            t.send(src, c.sig, c.seq, ACK, b"")
        return
    # Pipelined chain src -> src+1 -> ... -> src-1 (at N=2: the direct send, in pieces).
    pos = (c.rank - src) % c.N
    nxt, prv = (c.rank + 1) % c.N, (c.rank - 1) % c.N
    for j, (a, b) in enumerate(_split(buf.size, _num_pieces(buf.size, buf.itemsize))):
        seg = buf[a:b]
        if pos > 0:
            _recv_into(c, prv, j, seg)
        if pos < c.N - 1:
            t.send(nxt, c.sig, c.seq, j, seg)
    if pos == c.N - 1:
        t.send(src, c.sig, c.seq, ACK, b"")
    elif pos == 0:
        t.recv(prv, c.sig, c.seq, ACK, 0)


# -- reduce -----------------------------------------------------------------------------


def _reduce_flat(c: _Call, buf: np.ndarray, dst: int, op: ReduceOp) -> None:
    if c.N == 1:
        return
    t = c.t
    assert t is not None
    ufunc = _UFUNCS[op]
    if c.s is not None:
        _shm_reduce(c, c.s, buf, dst, ufunc)
        return
    with _signature_ring(c, t):  # see _broadcast_flat
        _reduce_tcp(c, t, buf, dst, ufunc)


def _reduce_tcp(c: _Call, t: Any, buf: np.ndarray, dst: int, ufunc: np.ufunc) -> None:
    if _use_direct(buf.nbytes, c.N):
        if c.rank != dst:
            t.send(dst, c.sig, c.seq, 0, buf)
            t.recv(dst, c.sig, c.seq, ACK, 0)  # see _broadcast_flat
            return
        acc = _reduce_in_rank_order(c, buf, ufunc)  # this rank is dst
        for p in range(c.N):
            if p != dst:
                t.send(p, c.sig, c.seq, ACK, b"")
        buf[...] = acc
        return
    # Pipelined chain dst+1 -> dst+2 -> ... -> dst; only dst's buffer is written.
    pos = (c.rank - dst - 1) % c.N
    nxt, prv = (c.rank + 1) % c.N, (c.rank - 1) % c.N
    for j, (a, b) in enumerate(_split(buf.size, _num_pieces(buf.size, buf.itemsize))):
        seg = buf[a:b]
        if pos == 0:
            t.send(nxt, c.sig, c.seq, j, seg)
            continue
        incoming = _recv_array(c, prv, j, seg)
        if c.rank == dst:
            ufunc(incoming, seg, out=seg)
        else:
            t.send(nxt, c.sig, c.seq, j, ufunc(incoming, seg))
    first = (dst + 1) % c.N
    if c.rank == dst:
        t.send(first, c.sig, c.seq, ACK, b"")
    elif c.rank == first:
        t.recv(dst, c.sig, c.seq, ACK, 0)


# -- all_gather -------------------------------------------------------------------------


def _all_gather_flat(c: _Call, flat: np.ndarray, out: np.ndarray) -> None:
    """Fill ``out`` (N x count) with every rank's ``flat``, row r from rank r."""
    out[c.rank] = flat
    if c.N == 1:
        return
    if c.s is not None:
        _shm_all_gather(c, c.s, flat, out)
        return
    t = c.t
    assert t is not None
    N, rank = c.N, c.rank
    if _use_direct(flat.nbytes, N):
        for p in range(N):
            if p != rank:
                t.send(p, c.sig, c.seq, 0, out[rank])
        for p in range(N):
            if p != rank:
                _recv_into(c, p, 0, out[p])
        return
    pieces = _split(flat.size, _num_pieces(flat.size, flat.itemsize))
    P = len(pieces)
    nxt, prv = (rank + 1) % N, (rank - 1) % N
    for j, (a, b) in enumerate(pieces):
        t.send(nxt, c.sig, c.seq, j, out[rank, a:b])
    for k in range(N - 1):
        row = (rank - k - 1) % N
        for j, (a, b) in enumerate(pieces):
            seg = out[row, a:b]
            _recv_into(c, prv, k * P + j, seg)
            if k < N - 2:
                t.send(nxt, c.sig, c.seq, (k + 1) * P + j, seg)


# -- barrier ----------------------------------------------------------------------------


def _barrier(c: _Call) -> None:
    t = c.t
    if t is None:
        return
    if c.s is not None:
        c.s.barrier(c.sig, c.seq, 0)
        return
    d, step = 1, 0
    while d < c.N:
        t.send((c.rank + d) % c.N, c.sig, c.seq, step, b"")
        t.recv((c.rank - d) % c.N, c.sig, c.seq, step, 0)
        d, step = d * 2, step + 1


# -- shared memory (ranks on one host) -------------------------------------------------
#
# Each round moves up to SEGMENT_BYTES: copy in to this rank's slot, barrier, read the
# peers' slots. Slots rotate (three of them), so a rank rewrites a slot only after every
# rank passed a later barrier, that is, after everyone finished reading it.


def _shm_all_reduce(c: _Call, s: _shm.ShmChannel, buf: np.ndarray, ufunc: np.ufunc) -> None:
    N, rank = c.N, c.rank
    rounds = _shm.split_rounds(buf.nbytes, buf.itemsize)
    if buf.nbytes <= SHM_SMALL_BYTES or buf.size < N:
        # One round; every rank reduces all of it in rank order: identical everywhere.
        slot = s.next_slot()
        regions = [s.region(p, slot, buf.dtype, buf.size) for p in range(N)]
        regions[rank][...] = buf
        s.barrier(c.sig, c.seq, 0)
        np.copyto(buf, regions[0])
        for p in range(1, N):
            ufunc(buf, regions[p], out=buf)
        return
    # Pipelined rounds, one barrier each: copy in round r, barrier, copy out the reduced
    # round r-1, reduce this rank's chunk of round r in place in its own segment. The
    # barrier after copy-in r also tells that everyone finished reducing r-1. Three slots
    # rotate, so a slot is rewritten only after every rank is done reading it.
    pending: tuple[np.ndarray, list[np.ndarray], list[tuple[int, int]]] | None = None
    for r, (a, b) in enumerate(rounds):
        slot = s.next_slot()
        regions = [s.region(p, slot, buf.dtype, b - a) for p in range(N)]
        regions[rank][...] = buf[a:b]
        s.barrier(c.sig, c.seq, r)
        if pending is not None:
            _copy_out(*pending)
        chunks = _split(b - a, N)
        ca, cb = chunks[rank]
        mine = regions[rank][ca:cb]
        for p in range(N):
            if p != rank:
                ufunc(mine, regions[p][ca:cb], out=mine)
        pending = (buf[a:b], regions, chunks)
    s.barrier(c.sig, c.seq, len(rounds))
    assert pending is not None
    _copy_out(*pending)


def _copy_out(seg: np.ndarray, regions: list[np.ndarray], chunks: list[tuple[int, int]]) -> None:
    for p, (pa, pb) in enumerate(chunks):
        seg[pa:pb] = regions[p][pa:pb]


def _shm_broadcast(c: _Call, s: _shm.ShmChannel, buf: np.ndarray, src: int) -> None:
    for r, (a, b) in enumerate(_shm.split_rounds(buf.nbytes, buf.itemsize)):
        slot = s.next_slot()
        region = s.region(src, slot, buf.dtype, b - a)
        if c.rank == src:
            region[...] = buf[a:b]
        s.barrier(c.sig, c.seq, r)
        if c.rank != src:
            buf[a:b] = region


def _shm_reduce(c: _Call, s: _shm.ShmChannel, buf: np.ndarray, dst: int,
                ufunc: np.ufunc) -> None:
    for r, (a, b) in enumerate(_shm.split_rounds(buf.nbytes, buf.itemsize)):
        slot = s.next_slot()
        regions = [s.region(p, slot, buf.dtype, b - a) for p in range(c.N)]
        regions[c.rank][...] = buf[a:b]
        s.barrier(c.sig, c.seq, r)
        if c.rank == dst:
            seg = buf[a:b]
            np.copyto(seg, regions[0])
            for p in range(1, c.N):
                ufunc(seg, regions[p], out=seg)


def _shm_all_gather(c: _Call, s: _shm.ShmChannel, flat: np.ndarray, out: np.ndarray) -> None:
    for r, (a, b) in enumerate(_shm.split_rounds(flat.nbytes, flat.itemsize)):
        slot = s.next_slot()
        regions = [s.region(p, slot, flat.dtype, b - a) for p in range(c.N)]
        regions[c.rank][...] = flat[a:b]
        s.barrier(c.sig, c.seq, r)
        for p in range(c.N):
            if p != c.rank:
                out[p, a:b] = regions[p]


# -- public functions -------------------------------------------------------------------


_SIGNATURES: dict[tuple[Any, ...], Signature] = {}


def _signature(coll: Collective, arrays: Sequence[np.ndarray], code: int, op: ReduceOp,
               root: int = wire.NO_ROOT) -> Signature:
    """The call's signature (cached: training loops repeat the same calls)."""
    key = (coll, op, code, root, *(a.shape for a in arrays))
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) > 4096:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = _make_signature(coll, arrays, code, op, root)
    return sig


def _make_signature(coll: Collective, arrays: Sequence[np.ndarray], code: int, op: ReduceOp,
                    root: int) -> Signature:
    if len(arrays) == 1:
        shape = tuple(arrays[0].shape)
        shape_key: Any = shape
        shape_repr = str(shape)
    else:
        shape_key = tuple(tuple(a.shape) for a in arrays)
        shape_repr = f"{len(arrays)} arrays, {sum(a.size for a in arrays)} elements"
    return Signature(coll, op, code, root, sum(a.size for a in arrays),
                     wire.shape_hash(shape_key), shape_repr)


def _fused(
    g: _group.Group,
    items: Sequence[Any],
    name: str,
    coll: Collective,
    op: ReduceOp,
    root: int,
    body: Callable[[_Call, np.ndarray], None],
    check: Callable[[np.ndarray], None] | None = None,
) -> None:
    """Run ``body`` once per dtype over the arrays of ``items`` fused into one buffer."""
    arrays = [_to_numpy(x, name) for x in items]
    groups: dict[np.dtype, list[np.ndarray]] = {}
    for arr in arrays:
        _check_array(arr, name)
        if check is not None:
            check(arr)
        groups.setdefault(arr.dtype, []).append(arr)
    for dtype, members in groups.items():
        sig = _signature(coll, members, wire.dtype_code(dtype), op, root)
        total = sum(a.size for a in members)
        flat = g.scratch(dtype, total)
        off = 0
        for a in members:
            flat[off:off + a.size] = a.reshape(-1)
            off += a.size

        def run(c: _Call, flat: np.ndarray = flat) -> None:
            body(c, flat)

        _run(g, sig, run)
        off = 0
        for a in members:
            np.copyto(a, flat[off:off + a.size].reshape(a.shape))
            off += a.size


def all_reduce(x: T, op: str = "sum") -> T:
    """Reduce ``x`` across all ranks, in place, and return it.

    ``op`` is ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"``. ``x`` is
    a numpy array, a CPU torch tensor, or a list of them (fused into one
    buffer per dtype). Every rank ends with bitwise identical values.
    """
    g = _group.current("all_reduce()")
    rop, mean = _parse_op(op, "all_reduce")
    wire_op = ReduceOp.MEAN if mean else rop
    world = g.config.world_size

    def body(c: _Call, flat: np.ndarray) -> None:
        _all_reduce_flat(c, flat, rop)
        if mean:
            if c.t is not None:
                c.t.flush()  # pieces of flat may still be on their way to a peer
            np.divide(flat, world, out=flat)

    if isinstance(x, (list, tuple)):
        _fused(g, x, "all_reduce", Collective.ALL_REDUCE, wire_op, wire.NO_ROOT, body,
               lambda a: _check_op_dtype(rop, mean, a.dtype, "all_reduce"))
        return x
    arr = _to_numpy(x, "all_reduce")
    code = _check_array(arr, "all_reduce")
    _check_op_dtype(rop, mean, arr.dtype, "all_reduce")
    flat, write_back = _flat(arr)
    _run(g, _signature(Collective.ALL_REDUCE, [arr], code, wire_op), lambda c: body(c, flat))
    if write_back is not None:
        write_back()
    return x


def all_reduce_mean(x: T) -> T:
    """Average ``x`` across all ranks, in place, and return it (floating dtypes only)."""
    return all_reduce(x, op="mean")


def broadcast(x: T, src: int = 0) -> T:
    """Copy ``src``'s ``x`` into every rank's ``x`` (in place) and return it."""
    g = _group.current("broadcast()")
    src = _check_rank(src, g.config.world_size, "src", "broadcast")

    def body(c: _Call, flat: np.ndarray) -> None:
        _broadcast_flat(c, flat, src)

    if isinstance(x, (list, tuple)):
        _fused(g, x, "broadcast", Collective.BROADCAST, ReduceOp.NONE, src, body)
        return x
    arr = _to_numpy(x, "broadcast")
    code = _check_array(arr, "broadcast")
    flat, write_back = _flat(arr)
    _run(g, _signature(Collective.BROADCAST, [arr], code, ReduceOp.NONE, src),
         lambda c: body(c, flat))
    if write_back is not None:
        write_back()
    return x


def reduce(x: T, dst: int = 0, op: str = "sum") -> T:
    """Reduce ``x`` across all ranks into ``dst``'s ``x`` (in place) and return it.

    Other ranks' arrays are left unchanged.
    """
    g = _group.current("reduce()")
    dst = _check_rank(dst, g.config.world_size, "dst", "reduce")
    rop, mean = _parse_op(op, "reduce")
    arr = _to_numpy(x, "reduce")
    code = _check_array(arr, "reduce")
    _check_op_dtype(rop, mean, arr.dtype, "reduce")
    flat, write_back = _flat(arr)
    world = g.config.world_size

    def body(c: _Call) -> None:
        _reduce_flat(c, flat, dst, rop)
        if mean and c.rank == dst:
            if c.t is not None:
                c.t.flush()
            np.divide(flat, world, out=flat)

    _run(g, _signature(Collective.REDUCE, [arr], code, ReduceOp.MEAN if mean else rop, dst),
         body)
    if write_back is not None and g.config.rank == dst:
        write_back()
    return x


def all_gather(x: Any, out: Any = None) -> list[np.ndarray]:
    """Every rank's ``x``, as a list of arrays in rank order (same shape and dtype).

    Without ``out`` the result is a new array of N times ``x``'s size, allocated
    every call. In a loop, pass ``out``: a writable C-contiguous numpy array (or
    CPU tensor) of shape ``(world_size, *x.shape)`` and ``x``'s dtype, reused
    every call; it is filled in place and the list holds views of its rows
    (no allocation, and no fresh pages to fault in for large results).
    """
    g = _group.current("all_gather()")
    arr = _to_numpy(x, "all_gather")
    code = _check_array(arr, "all_gather", writable=False)
    flat = np.ascontiguousarray(arr).reshape(-1)
    world = g.config.world_size
    if out is None:
        rows = np.empty((world, flat.size), dtype=arr.dtype)
    else:
        rows = _gather_out(_to_numpy(out, "all_gather"), arr, world).reshape(world, flat.size)
    _run(g, _signature(Collective.ALL_GATHER, [arr], code, ReduceOp.NONE),
         lambda c: _all_gather_flat(c, flat, rows))
    return [rows[r].reshape(arr.shape) for r in range(world)]


def _gather_out(out: np.ndarray, arr: np.ndarray, world: int) -> np.ndarray:
    """``out`` checked as all_gather's result buffer for ``arr`` (ValueError/TypeError)."""
    want = (world, *arr.shape)
    if out.dtype != arr.dtype:
        raise TypeError(f"swarmfd.all_gather: out has dtype {out.dtype}, expected x's dtype "
                        f"{arr.dtype}")
    if out.shape != want:
        raise ValueError(f"swarmfd.all_gather: out has shape {out.shape}, expected "
                         f"(world_size, *x.shape) = {want}")
    if not out.flags.c_contiguous:
        raise ValueError("swarmfd.all_gather: out must be C-contiguous (e.g. from np.empty)")
    if not out.flags.writeable:
        raise ValueError("swarmfd.all_gather: out is read-only; pass a writable array")
    if np.shares_memory(out, arr):
        raise ValueError("swarmfd.all_gather: out overlaps x; pass a separate buffer")
    return out


def barrier() -> None:
    """Block until every rank has called barrier()."""
    g = _group.current("barrier()")
    _run(g, Signature(Collective.BARRIER), _barrier)
