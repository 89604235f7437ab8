"""What an algorithm sees of a collective call: :class:`Op`.

An algorithm is a generator function ``algo(op, ...)``: it sends with :meth:`Op.send`
(never blocks) and waits with ``data = yield op.recv(peer, tag, nbytes, into)``; its
driver (:func:`run` on the caller's thread, or the progress engine) sends the payload
back in (``None`` when it landed ``into``). ``yield op.flush()`` waits until no plane
still reads a buffer sent without a copy. Peers are *group ranks*; algorithms never see
a socket or another group's traffic. Shared-memory algorithms also address the
members' segments (:meth:`Op.region`), one slot per round (:meth:`Op.next_slot`),
rotating over SLOTS slots, so a slot is rewritten only after every member passed a
later barrier.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from ..comm import wire
from ..comm.channel import Channel
from ..comm.plane import Plane

__all__ = ["FLUSH", "MAX_HEADS", "SMALL_SPAN_BYTES", "VIEW", "Algorithm", "Op", "Parts", "Recv",
           "bounds", "divide_by", "even_pieces", "mean", "num_pieces", "put",
           "reduce_in_order", "reduce_into", "ring_pieces", "run", "spans", "split", "take"]

#: A receive an algorithm waits for: (op, group rank, tag, nbytes, into), or for a
#: point-to-point piece ("key", op, key, signature, nbytes, into). A request names its op,
#: so the phases of one algorithm may run on sub-ops (other members, planes and tags).
Recv = tuple[Any, ...]
#: What an algorithm yields to wait until its sends no longer read its buffers.
FLUSH: Any = ("flush",)
#: The ``into`` of a receive whose payload the algorithm reads at once (:meth:`Op.view`).
VIEW: Any = ("view",)
#: Packed headers (and shared-memory views) an op keeps, then forgets all at once.
MAX_HEADS = 4096
#: The generator an algorithm is.
Algorithm = Generator[Recv, Any, Any]

#: Target size of one wire message (see wire.PIECE_BYTES).
PIECE_BYTES = wire.PIECE_BYTES
_MAX_PAYLOAD = wire.MAX_PAYLOAD
_DATA = int(wire.Kind.DATA)


class Op:
    """One collective call of one group, on one plane: made once per kind of call and
    reused (:mod:`swarmfd.call`), :meth:`at` setting the call's number; its headers are
    packed once and joined around that number."""

    __slots__ = ("channel", "gid", "heads", "me", "next_slot", "out", "plane", "ranks", "ring",
                 "seq", "seqb", "shm", "sig", "size", "tag_base", "views")

    def __init__(self, channel: Channel, plane: Plane, ranks: Sequence[int], me: int, gid: int,
                 seq: int, sig: wire.Signature, shm: Any = None,
                 next_slot: Callable[[], int] | None = None, tag_base: int = 0,
                 ring: Sequence[int] | None = None, out: list[bool] | None = None) -> None:
        self.channel = channel
        self.plane = plane
        self.ranks = ranks  # world rank of each group rank
        self.me = me  # this rank's group rank
        self.size = len(ranks)
        self.gid = gid
        self.sig = sig
        self.shm = shm
        self.next_slot = next_slot
        self.tag_base = tag_base
        self.ring = ring  # group ranks in ring and chain order (by host); None: rank order
        #: Packed headers by (source world rank, tag, bytes): see :meth:`header`.
        self.heads: dict[tuple[int, int, int], tuple[bytes, bytes]] = {}
        #: Whether a send left bytes queued (flushed before the call returns); shared by
        #: the ops of one call's phases.
        self.out = [False] if out is None else out
        #: Shared-memory views the algorithm asked for, by (member, slot, dtype, count).
        self.views: dict[tuple[Any, ...], Any] = {}
        self.seq = seq
        self.seqb = wire.seq_bytes(seq)

    def at(self, seq: int) -> Op:
        """This op for the call numbered ``seq`` (its messages' headers carry it)."""
        self.seq = seq
        self.seqb = wire.seq_bytes(seq)
        self.out[0] = False
        return self

    def copy(self) -> Op:
        """A fresh op of the same call (an async call owns its own while it runs)."""
        return Op(self.channel, self.plane, self.ranks, self.me, self.gid, self.seq,
                  self.sig, self.shm, self.next_slot, self.tag_base, self.ring)

    def header(self, src: int, tag: int, nbytes: int) -> tuple[bytes, bytes]:
        """The cut header of this call's message from world rank ``src`` with ``tag``
        (tag base included) and ``nbytes``, packed once per op (Plane.header)."""
        key = (src, tag, nbytes)
        head = self.heads.get(key)
        if head is None:
            if len(self.heads) >= MAX_HEADS:
                self.heads.clear()
            head = self.heads[key] = self.plane.header(_DATA, self.sig, src, tag, nbytes,
                                                       self.gid)
        return head

    def phase(self, tag_base: int) -> Op:
        """The same call with tags from ``tag_base``: a later phase (sizes, then data)."""
        return Op(self.channel, self.plane, self.ranks, self.me, self.gid, self.seq,
                  self.sig, self.shm, self.next_slot, tag_base, self.ring, self.out)

    def sub(self, plane: Plane, members: list[int], tag_base: int, shm: Any = None,
            next_slot: Callable[[], int] | None = None) -> Op:
        """The same call among group ranks ``members`` on ``plane``, tags from
        ``tag_base``, rings in rank order (the two-level algorithms' phases)."""
        ranks = [self.ranks[m] for m in members]
        return Op(self.channel, plane, ranks, members.index(self.me), self.gid, self.seq,
                  self.sig, shm, next_slot, tag_base, None, self.out)

    def send(self, to: int, tag: int, payload: Any = b"", *, copy: bool = False) -> None:
        """Queue a message to group rank ``to``; never blocks. Without ``copy`` a large
        payload may be read until the call flushes."""
        size = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
        if size > _MAX_PAYLOAD:
            raise wire.too_large(size)
        ranks = self.ranks
        src, tag = ranks[self.me], self.tag_base + tag
        head = self.heads.get((src, tag, size)) or self.header(src, tag, size)
        if self.plane.send_packed(ranks[to], head[0] + self.seqb + head[1], payload, size,
                                  copy):
            self.out[0] = True

    def recv(self, frm: int, tag: int, nbytes: int, into: Any = None) -> Recv:
        """The receive to ``yield``: returns the payload, or None when it landed ``into``."""
        return (self, frm, tag, nbytes, into)

    def view(self, frm: int, tag: int, nbytes: int) -> Recv:
        """The receive to ``yield`` of a payload read at once (maybe the plane's buffer,
        valid until the next receive)."""
        return (self, frm, tag, nbytes, VIEW)

    def recv_key(self, key: tuple[int, int, int, int], sig: wire.Signature, nbytes: int,
                 into: Any = None) -> Recv:
        """The receive to ``yield`` of a message named by its key (point to point)."""
        return ("key", self, key, sig, nbytes, into)

    def recv_array(self, frm: int, tag: int, like: np.ndarray) -> Generator[Recv, Any,
                                                                            np.ndarray]:
        """``yield from`` this: the message as an array of ``like``'s dtype and size."""
        data = yield (self, frm, tag, like.nbytes, None)
        return np.frombuffer(data, dtype=like.dtype, count=like.size)

    def scratch(self, pieces: Sequence[Sequence[tuple[int, int]]],
                dtype: np.dtype) -> np.ndarray | None:
        """The reused buffer :meth:`recv_operand` takes for any of ``pieces``, or None
        where the plane hands payloads over (zero_copy_recv)."""
        if self.plane.zero_copy_recv:
            return None
        return np.empty(max((b - a for part in pieces for a, b in part), default=0), dtype)

    def recv_operand(self, frm: int, tag: int, dtype: np.dtype, count: int,
                     scratch: np.ndarray | None) -> Generator[Recv, Any, np.ndarray]:
        """``yield from`` this: the message as ``count`` items of ``dtype``, valid until
        the next receive into ``scratch`` (a buffer per piece otherwise; on zmq, the
        frame itself: docs/algorithms.md)."""
        if scratch is None:
            data = yield (self, frm, tag, count * dtype.itemsize, None)
            return np.frombuffer(data, dtype=dtype, count=count)
        into = scratch[:count]
        yield (self, frm, tag, into.nbytes, into if count else None)
        return into

    def flush(self) -> Any:
        """The request to ``yield``: wait until every buffer sent so far is out."""
        return FLUSH

    def recv_into(self, frm: int, tag: int, out: np.ndarray) -> Recv:
        """The receive to ``yield``, straight into ``out`` (contiguous)."""
        return (self, frm, tag, out.nbytes, out if out.nbytes else None)

    def key(self, frm: int, tag: int) -> tuple[int, int, int, int]:
        """The key of the message of group rank ``frm`` with ``tag`` in this call."""
        return (self.gid, self.ranks[frm], self.seq & 0xFFFFFFFF, self.tag_base + tag)

    # -- shared memory ------------------------------------------------------------------

    def region(self, member: int, slot: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at ``slot`` of group rank ``member``'s segment."""
        return self.shm.region(self.ranks[member], slot, dtype, count)

    def regions(self, slot: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Every member's region at ``slot``, in group-rank order; kept by the op."""
        key = (slot, dtype, count)
        views = self.views.get(key)
        if views is None:
            if len(self.views) >= MAX_HEADS:
                self.views.clear()
            region = self.shm.region
            views = self.views[key] = [region(r, slot, dtype, count) for r in self.ranks]
        return views


def request(req: Recv) -> tuple[Op, tuple[int, int, int, int], wire.Signature, int, Any]:
    """(op, key, signature, nbytes, into) of a receive request."""
    if req[0] == "key":
        return req[1], req[2], req[3], req[4], req[5]
    op, frm, tag, nbytes, into = req
    return op, op.key(frm, tag), op.sig, nbytes, None if into is VIEW else into


def complete(req: Recv) -> Any:
    """Block until ``req`` arrives (the caller's thread drives the channel)."""
    if req is FLUSH:
        return None
    op, key, sig, nbytes, into = request(req)
    return op.channel.recv_key(op.plane, key, sig, nbytes, into)


def run(op: Op, algo: Algorithm) -> Any:
    """Drive ``algo`` to its end on the caller's thread; its return value. A receive
    first asks the plane for exactly its message (:meth:`Plane.take`), else goes to the
    channel's receive, which waits, matches, stashes and reports; the bits are the same."""
    send = algo.send
    stash = op.channel.stash
    try:
        req = send(None)
        while True:
            if len(req) == 5:  # a group rank's message: the common request first
                o, frm, tag, nbytes, into = req
                src, tag = o.ranks[frm], o.tag_base + tag
                got = None
                if not stash and nbytes >= 0:
                    head = o.heads.get((src, tag, nbytes)) or o.header(src, tag, nbytes)
                    plane = o.plane
                    got = plane.take(src, head[0] + o.seqb + head[1], nbytes)
                    if got is not None:
                        if into is None:
                            if not plane.zero_copy_recv:
                                got = bytes(got)  # the plane's buffer is reused
                        elif into is not VIEW:
                            memoryview(into).cast("B")[:] = got
                            got = None
                        req = send(got)
                        continue
                req = send(o.channel.recv_key(
                    o.plane, (o.gid, src, o.seq & 0xFFFFFFFF, tag), o.sig, nbytes,
                    None if into is VIEW else into))
            elif req is FLUSH:
                op.channel.flush()
                req = send(None)
            else:
                o = req[1]
                req = send(o.channel.recv_key(o.plane, req[2], req[3], req[4], req[5]))
    except StopIteration as stop:
        return stop.value


class Parts:
    """Several flat, contiguous, writable, non-empty arrays of one dtype, reduced as one
    buffer without a copy into one: element ``i`` of the whole is element ``i - start``
    of the array it falls in."""

    __slots__ = ("arrays", "dtype", "itemsize", "nbytes", "size", "starts")

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = list(arrays)
        self.dtype = self.arrays[0].dtype
        self.itemsize = self.dtype.itemsize
        self.starts = [0]
        for arr in self.arrays:
            self.starts.append(self.starts[-1] + arr.size)
        self.size = self.starts[-1]
        self.nbytes = self.size * self.itemsize


def spans(buf: np.ndarray | Parts, a: int, b: int) -> Sequence[tuple[np.ndarray, int, int]]:
    """The pieces of elements [a, b) of ``buf``: (view, u, v), the view holding elements
    [a + u, a + v). One piece for an array; one per array met for :class:`Parts`. A
    sequence, not a generator: the shared-memory algorithms take it several times a
    call, and a generator's frame costs more than the one piece of an array."""
    if type(buf) is np.ndarray:
        return ((buf[a:b], 0, b - a),)
    assert isinstance(buf, Parts)
    i = bisect.bisect_right(buf.starts, a) - 1
    at = a
    out = []
    while at < b:
        start = buf.starts[i]
        stop = min(b, buf.starts[i + 1])
        out.append((buf.arrays[i][at - start:stop - start], at - a, stop - a))
        i += 1
        at = stop
    return out


#: In a ring over :class:`Parts`, consecutive shares smaller than this travel copied into
#: one message, larger ones as views (docs/algorithms.md).
SMALL_SPAN_BYTES = 64 << 10


def ring_pieces(buf: np.ndarray | Parts,
                bounds: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The pieces (element bounds) each of ``bounds`` travels in around a ring: an
    array's :func:`even_pieces`; for :class:`Parts`, each array's share in pieces of at
    most PIECE_BYTES (views, sent without a copy), small shares joined (SMALL_SPAN_BYTES).
    Every rank cuts alike: the arrays' sizes are in the call's signature."""
    if type(buf) is np.ndarray:
        return even_pieces(bounds, buf.itemsize)
    assert isinstance(buf, Parts)
    small = max(1, SMALL_SPAN_BYTES // buf.itemsize)
    most = max(1, PIECE_BYTES // buf.itemsize)
    out = []
    for a, b in bounds:
        pieces: list[tuple[int, int]] = []
        run: list[int] | None = None  # [start, stop) of small shares gathered
        for _, u, v in spans(buf, a, b):
            x, y = a + u, a + v
            if y - x < small:
                if run is None:
                    run = [x, y]
                else:
                    run[1] = y
                if run[1] - run[0] >= small:
                    pieces.append((run[0], run[1]))
                    run = None
                continue
            if run is not None:
                pieces.append((run[0], run[1]))
                run = None
            pieces += [(x + s, x + t) for s, t in split(y - x, -(-(y - x) // most))]
        if run is not None:
            pieces.append((run[0], run[1]))
        out.append(pieces)
    return out


def even_pieces(bounds: Sequence[tuple[int, int]],
                itemsize: int) -> list[list[tuple[int, int]]]:
    """P near-equal pieces of each of ``bounds``, P for about PIECE_BYTES in the largest
    (a ring's tags are step * P + piece)."""
    P = num_pieces(max((b - a for a, b in bounds), default=0), itemsize)
    return [[(a + x, a + y) for x, y in split(b - a, P)] for a, b in bounds]


def take(buf: np.ndarray | Parts, a: int, b: int) -> np.ndarray:
    """Elements [a, b) of ``buf`` as one flat array: a view where they lie in one array,
    else a copy."""
    if type(buf) is np.ndarray:
        return buf[a:b]
    views = [v for v, _, _ in spans(buf, a, b)]
    if len(views) == 1:
        return views[0]
    return np.concatenate(views) if views else np.empty(0, buf.dtype)


def divide_by(x: np.ndarray, n: int) -> None:
    """``x`` /= ``n`` in place, bit for bit as ``np.divide(x, n, out=x)`` but faster:
    floats divide by ``n`` as their own type, or multiply by 1 / ``n`` where that is
    exact (a power of two up to 1024; docs/algorithms.md)."""
    kind = x.dtype.kind
    if kind != "f" or n <= 0:
        np.divide(x, n, out=x)
    elif n & (n - 1) == 0 and n <= 1 << 10:
        np.multiply(x, x.dtype.type(1.0 / n), out=x)
    else:
        np.divide(x, x.dtype.type(n), out=x)


def mean(op: Op, buf: np.ndarray, divide: int) -> Algorithm:
    """``yield from`` this at the end of an all_reduce: ``buf`` divided by ``divide``
    (not 0: a mean), once no send still reads it."""
    if divide:
        yield op.flush()
        divide_by(buf, divide)


def reduce_in_order(out: np.ndarray, operands: Sequence[np.ndarray], ufunc: np.ufunc) -> None:
    """``out`` = ((operands[0] op operands[1]) op operands[2]) ... in the order given (rank
    order: every rank gets the same bits); the first two straight into ``out``."""
    if len(operands) == 1:
        np.copyto(out, operands[0])
        return
    ufunc(operands[0], operands[1], out=out)
    for x in operands[2:]:
        ufunc(out, x, out=out)


def reduce_into(buf: np.ndarray | Parts, a: int, b: int, theirs: np.ndarray,
                ufunc: np.ufunc, divide: int = 0) -> None:
    """Elements [a, b) of ``buf`` = ufunc(them, ``theirs``), then divided by ``divide``
    (when not 0), where they are."""
    if type(buf) is np.ndarray:
        seg = buf[a:b]
        ufunc(seg, theirs, out=seg)
        if divide:
            divide_by(seg, divide)
        return
    for view, u, v in spans(buf, a, b):
        ufunc(view, theirs[u:v], out=view)
        if divide:
            divide_by(view, divide)


def put(buf: np.ndarray | Parts, a: int, b: int, data: np.ndarray) -> None:
    """Elements [a, b) of ``buf`` = ``data``."""
    for view, u, v in spans(buf, a, b):
        view[...] = data[u:v]


def bounds(rows: Sequence[int], row: int) -> list[tuple[int, int]]:
    """[start, stop) element bounds of consecutive parts of ``rows[i]`` rows of ``row``
    elements each."""
    out, start = [], 0
    for r in rows:
        out.append((start * row, (start + r) * row))
        start += r
    return out


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) bounds of ``parts`` near-equal parts of ``n`` (as np.array_split)."""
    q, r = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def num_pieces(count: int, itemsize: int) -> int:
    """How many pieces of about PIECE_BYTES ``count`` items of ``itemsize`` bytes make."""
    return max(1, -(-count * itemsize // PIECE_BYTES))
