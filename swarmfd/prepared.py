"""Prepared calls: a group's repeated blocking calls, worked out once, then run in a few
steps.

A training loop repeats the same small calls thousands of times (a loss's all_reduce, a
metric's, a barrier), and on shared memory such a call's time is the ranks' own Python:
at N=2 a 4 KiB all_reduce took 20-23 us back to back (2026-12-05) where the steps it
needs (copy in, publish, wait for the peer, add) take 4.3-4.8 us in a bare two-process
loop. The rest was working out, call after call, what the previous call had worked out
(the op, the signature, the plane, the slot's views, the records' headers) and the
layers that pass it on: 69 Python function calls a call, 19 prepared.

A prepared call is made when such a call first ran by the general path, and the group
keeps it under the call's key (the array's shape and dtype and the op as given). It
holds the call's signature, its ufunc, the views of every member's slots, and its
records' headers packed but for the call's number. :meth:`Prepared.run` checks that it
still applies (the group whole, nothing pending on the progress engine, the array
contiguous and writable), and then does the steps. Where:

* shared memory, all_reduce up to SMALL_BYTES (one barrier: :class:`ShmCall`) and up
  to one round of the large path (two barriers, each rank reducing its chunk:
  :class:`SplitCall`), and barrier: the records go straight into the rings
  (``ShmPlane.put_header``, ``take_header``);
* the socket plane, all_reduce up to 256 KiB: of two ranks (:class:`PairCall`), the
  packed header and the array go out in one ``sendmsg``, and the peer's payload is
  reduced where it arrived in the connection's buffer (``SocketPlane.take_message``);
  of a power-of-two group from 4, recursive doubling (:class:`DoublingCall`); of
  other groups, the direct exchange (:class:`DirectCall`);
* the zmq plane, all_reduce of two ranks up to its inline size (64 KiB): the packed
  header and the array go out in one frame, and the peer's payload is reduced where it
  arrived in its frame (``ZmqPlane.take_inline``; :class:`ZmqPairCall`);
* the zmq plane's two-rank all_reduce above that, and barriers over TCP
  (:class:`NowCall`): the general path's function, without the preparation;
* shared memory, broadcast up to one slot (:class:`BroadcastCall`, keyed also by the
  root): the root's copy in, one barrier, the others' copy out;
* an all_reduce of a list (or tuple) of arrays of one dtype (or CPU tensors, through
  their numpy views), fused into one buffer by the general path: the same call through
  a buffer kept for it (:class:`ListCall`, keyed by the arrays' shapes, their dtype
  and the op), run by the prepared call of that buffer's algorithm, where there is one.

The messages are the general path's byte for byte (the same records, tags, slots and
bits): a member that runs a prepared call meets one that runs the generators, call by
call. Anything unusual goes the general way, which reports it as always:

* a record or message that is not the one expected (another call's, a signature that
  differs, an abort) stays where it is for the channel's receive (on the zmq plane,
  whose frames are read whole, it is put back, and read first), which raises the
  mismatch or the abort, or keeps another call's message for later;
* a full ring, or records already queued, and the record goes through ``plane.send``
  (and the call flushes);
* a rank that looked in vain for a few microseconds (a message not yet here, or not
  whole) waits in the channel's receive: it polls, then sleeps, with the call's
  timeout and the peers' liveness checked as for any call. (On the zmq plane the
  prepared call's own look is the plane's first wait slice, as the channel's first
  would be: its liveness checks follow that slice, as they do in the channel.)

Measured (compare.py, interleaved runs, medians of the per-run time ratios; see
benchmarks/results/session-20261205-c.md): shared memory N=2 0.30x the time at 4 KiB,
0.40x at 64 KiB, 0.70x at 256 KiB, N=4 0.75-0.81x; one round of the large path 0.71-0.75x
at 512 KiB and 1 MiB, N=2 and N=4; the socket plane N=2 at 4 and 64 KiB 0.80x and
0.87x for the preparation skipped (NowCall), then 0.81x and 0.88x of that for
PairCall's exchange; at N=4 (DoublingCall) 0.79x at 4 KiB, 0.74x at 64 KiB and 0.56x
at 256 KiB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .algorithms import select as _select
from .algorithms import shm as _shm_algo
from .algorithms import tcp as _tcp
from .algorithms.base import divide_by, reduce_in_order, split
from .comm import spin as _spin
from .comm import wire
from .comm.planes.shm import SEGMENT_BYTES, SLOTS

if TYPE_CHECKING:
    from .group import Group

__all__ = ["MAX_PREPARED", "POLLS", "TCP_POLLS", "BroadcastCall", "DirectCall", "DoublingCall",
           "ListCall", "NowCall", "PairCall", "Prepared", "ShmCall", "SplitCall", "ZmqPairCall",
           "for_all_reduce", "for_barrier", "for_broadcast", "keep"]

#: Prepared calls a group keeps (then it forgets them all): a training loop's small calls
#: take a few shapes; a loop over many shapes gains little from them anyway.
MAX_PREPARED = 64
#: Reads of a peer's connection that found nothing, before the call waits in the
#: channel's receive (a read that finds nothing costs about 1.5 us here, an exception:
#: these are 15-25 us, what a 4 KiB message over loopback takes to come).
TCP_POLLS = 16
#: Looks at a peer's ring for its record before the call waits in the channel's receive
#: (which polls on, then sleeps). A look costs about 0.07 us here: these are 10-20 us,
#: what a peer that runs the same call a step behind needs to catch up.
POLLS = 200
_DATA = wire.Kind.DATA
#: Where a header carries the call's number (wire.HEADER: magic, version, kind, coll,
#: op, dtype, flags, src, root, then seq).
_SEQ_AT = 14
_SEQ_END = _SEQ_AT + 4


def _packed(sig: wire.Signature, src: int, tag: int, nbytes: int, gid: int,
            flags: int = 0) -> tuple[bytes, bytes]:
    """The header of a message of the call (``src``'s, ``tag``, ``nbytes`` of payload,
    ``flags``), cut around the call's number: what comes before it and after it."""
    header = wire.pack_header(_DATA, sig, src, 0, tag, nbytes, flags, gid)
    return header[:_SEQ_AT], header[_SEQ_END:]


def _polls(plane: Any, most: int) -> int:
    """How many more looks a prepared call's wait may take before it waits in the
    channel's receive: ``most`` where the plane's waits poll now (swarmfd.comm.spin:
    polling on, not yielding, the spinner not blocking at once after misses), else 0."""
    return most if (_spin.ENABLED and not _spin.YIELD
                    and plane.spinner.misses < _spin.MAX_MISSES) else 0


class Prepared:
    """A prepared blocking call of one group on one plane (see module docstring): the
    group's call count, the channel's state and failures as
    ``swarmfd.collectives._blocking``'s; the call itself is :meth:`body`."""

    __slots__ = ("channel", "engine", "group", "label", "others", "plane", "sig")

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any) -> None:
        self.group = group
        self.plane = plane
        self.sig = sig
        self.engine = group._state.engine
        self.channel = group.channel
        #: Whether aborts may come on another plane (read now and then, as every call).
        self.others = len(self.channel.planes) > 1
        #: What the call is for error messages (a swarmfd.collectives._Label, its seq
        #: set by each run: it is formatted only while the call runs).
        self.label = label

    def run(self, x: np.ndarray | None) -> bool:
        """Run the call on ``x`` (None: a barrier); False, having done nothing, when the
        prepared call does not apply now: the caller runs the call the general way."""
        g, engine = self.group, self.engine
        if g.broken is not None or engine.queues or engine.p2p or g._plane[2] is not self.plane:
            return False
        if x is not None:
            flags = x.flags
            if not (flags.c_contiguous and flags.writeable):
                return False
        g.seq = seq = g.seq + 1
        ch, gid = self.channel, g.gid
        self.label.seq = seq
        with engine.lock:  # the progress thread may be finishing its last step
            ch.calls[gid] = seq  # (swarmfd.collectives._blocking, written out)
            ch._group = gid
            ch.activity = self.label
            ch.p2p = False
            try:
                if self.others:
                    ch.service_others(self.plane)
                self.body(x, seq)
            except BaseException as exc:
                g.broken, g.broken_from = exc, 0
                ch.abort(exc, gid, seq - 1)
                raise
            finally:
                ch.activity = "idle"
        return True

    def body(self, x: np.ndarray | None, seq: int) -> None:
        """The call number ``seq`` on ``x``."""
        raise NotImplementedError


class ShmCall(Prepared):
    """all_reduce (``x`` of the shape and dtype it was made for) or barrier
    (``x`` None) on the shared-memory plane's record rings: the one-barrier path of
    :func:`swarmfd.algorithms.shm.all_reduce_now`, whose slots, records and bits these
    are."""

    __slots__ = ("divide", "me", "regions", "rounds", "ufunc")

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 like: np.ndarray | None = None, ufunc: np.ufunc | None = None,
                 divide: int = 0, shape: tuple[int, ...] | None = None) -> None:
        super().__init__(group, plane, sig, label)
        self.me, self.ufunc, self.divide = group.rank, ufunc, divide
        #: Every member's view of each slot of the group's area, shaped like ``like``
        #: (or ``shape``) (slot k: the rounds r with r % SLOTS == k, as Group.next_slot).
        self.regions: list[list[np.ndarray]] = [] if like is None else [
            [plane.region(r, group.slot_offset(k), like.dtype, like.size).reshape(
                like.shape if shape is None else shape) for r in group.ranks]
            for k in range(SLOTS)]
        #: The barrier's rounds (see _barrier_rounds).
        self.rounds = _barrier_rounds(group, sig, 0)

    def body(self, x: np.ndarray | None, seq: int) -> None:
        if x is None:
            self._barrier(self.rounds, seq)
            return
        g = self.group
        r = g.shm_round  # (Group.next_slot, written out)
        g.shm_round = r + 1
        regions = self.regions[r % SLOTS]
        regions[self.me][...] = x
        self._barrier(self.rounds, seq)
        reduce_in_order(x, regions, self.ufunc)  # type: ignore[arg-type]
        if self.divide:
            divide_by(x, self.divide)

    def _barrier(self, rounds: list[tuple[int, int, int, bytes, bytes, bytes, bytes]],
                 seq: int) -> None:
        """The dissemination barrier of the call ``seq`` (algorithms.tcp.barrier_now's
        records, through the rings where they can go at once)."""
        plane, gid = self.plane, self.group.gid
        number = (seq & 0xFFFFFFFF).to_bytes(4, "little")
        polls = _polls(plane, POLLS)
        queued = False
        for dst, src, tag, out_head, out_tail, in_head, in_tail in rounds:
            if not plane.put_header(dst, out_head + number + out_tail):
                plane.send(dst, _DATA, self.sig, seq, tag, b"", 0, False, gid)
                queued = True
            if not plane.take_header(src, in_head + number + in_tail, polls):
                self.channel.recv_key(plane, (gid, src, seq & 0xFFFFFFFF, tag), self.sig,
                                      0, None)
        if queued:
            self.channel.flush()


class BroadcastCall(ShmCall):
    """broadcast from ``root`` (group rank) on the shared-memory plane's record rings, up
    to one slot (``x`` of the shape and dtype it was made for): the one-round path of
    :func:`swarmfd.algorithms.shm.broadcast`, whose slot, records and bytes these are.
    The root copies ``x`` into its slot, one barrier, the others copy it out."""

    __slots__ = ("root",)

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 like: np.ndarray, root: int) -> None:
        super().__init__(group, plane, sig, label, like)
        self.root = root

    def body(self, x: np.ndarray | None, seq: int) -> None:
        assert x is not None
        g = self.group
        r = g.shm_round  # (Group.next_slot, written out)
        g.shm_round = r + 1
        region = self.regions[r % SLOTS][self.root]
        if self.me == self.root:
            region[...] = x
            self._barrier(self.rounds, seq)
        else:
            self._barrier(self.rounds, seq)
            x[...] = region


class SplitCall(ShmCall):
    """all_reduce on shared memory of more than SMALL_BYTES in one round (up to
    SEGMENT_BYTES, below the cross-memory-attach size): the one-round case of
    :func:`swarmfd.algorithms.shm.all_reduce`, whose slots, records and bits these are.
    Copy in all but this rank's chunk, barrier, reduce this rank's chunk (its own operand
    first, then the others in rank order) into its slot and its array, barrier, copy
    the others' reduced chunks out."""

    __slots__ = ("chunks", "last", "others")

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 like: np.ndarray, ufunc: np.ufunc, divide: int = 0) -> None:
        super().__init__(group, plane, sig, label, like, ufunc, divide, (like.size,))
        self.chunks = split(like.size, group.size)
        self.others = [p for p in range(group.size) if p != group.rank]
        #: The barrier after the round (the general path's barrier(op, len(parts))).
        self.last = _barrier_rounds(group, sig, 1)

    def body(self, x: np.ndarray | None, seq: int) -> None:
        assert x is not None
        g, me = self.group, self.me
        r = g.shm_round  # (Group.next_slot, written out)
        g.shm_round = r + 1
        regions = self.regions[r % SLOTS]
        flat = x.reshape(-1)
        ca, cb = self.chunks[me]
        slot = regions[me]
        slot[:ca] = flat[:ca]
        slot[cb:] = flat[cb:]
        self._barrier(self.rounds, seq)
        mine, others, ufunc = slot[ca:cb], self.others, self.ufunc
        ufunc(flat[ca:cb], regions[others[0]][ca:cb], out=mine)
        for p in others[1:]:
            ufunc(mine, regions[p][ca:cb], out=mine)
        if self.divide:
            divide_by(mine, self.divide)
        flat[ca:cb] = mine
        self._barrier(self.last, seq)
        for p in others:
            pa, pb = self.chunks[p]
            flat[pa:pb] = regions[p][pa:pb]


def _barrier_rounds(group: Group, sig: wire.Signature,
                    tag: int) -> list[tuple[int, int, int, bytes, bytes, bytes, bytes]]:
    """The rounds of the dissemination barrier ``tag`` (algorithms.tcp.barrier): peer to
    send to, peer to hear from, the records' tag, and the two records' headers cut
    around the call's number."""
    rounds = []
    world, n, me, gid = group.ranks, group.size, group.rank, group.gid
    d, step = 1, 0
    while d < n:
        t = (tag << 8) | step
        dst, src = world[(me + d) % n], world[(me - d) % n]
        rounds.append((dst, src, t, *_packed(sig, world[me], t, 0, gid),
                       *_packed(sig, src, t, 0, gid)))
        d, step = d * 2, step + 1
    return rounds


class NowCall(Prepared):
    """all_reduce of two ranks over TCP (``x`` as it was made for), or a barrier
    on a plane without record rings (``ufunc`` None): the general path's functions
    (:func:`swarmfd.algorithms.tcp.all_reduce_pair_now`, ``barrier_now``), without the
    preparation."""

    __slots__ = ("divide", "ufunc")

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 ufunc: np.ufunc | None = None, divide: int = 0) -> None:
        super().__init__(group, plane, sig, label)
        self.ufunc, self.divide = ufunc, divide

    def body(self, x: np.ndarray | None, seq: int) -> None:
        g, ch = self.group, self.channel
        if x is None:
            _tcp.barrier_now(ch, self.plane, g.ranks, g.rank, g.gid, seq, self.sig)
        else:
            _tcp.all_reduce_pair_now(ch, self.plane, g.ranks, g.rank, g.gid, seq, self.sig,
                                     x.reshape(-1), self.ufunc, self.divide)
        ch.flush()


class PairCall(Prepared):
    """all_reduce of two ranks on the socket plane (``x`` as it was made for): the pair
    exchange of :func:`swarmfd.algorithms.tcp.all_reduce_pair_now`, whose message and
    bits these are, with the headers packed but for the call's number, and the peer's
    payload reduced where it arrived (:meth:`SocketPlane.take_message`) when it is
    there whole; otherwise the channel's receive."""

    __slots__ = ("divide", "in_head", "in_tail", "nbytes", "one_d", "out_head", "out_tail",
                 "peer", "ufunc")
    #: The headers' flags (the message's layout on the plane).
    FLAGS = 0

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 like: np.ndarray, ufunc: np.ufunc, divide: int = 0) -> None:
        super().__init__(group, plane, sig, label)
        self.ufunc, self.divide, self.nbytes = ufunc, divide, like.nbytes
        self.one_d = like.ndim == 1  # (x itself then, not a view of it: the key's shape)
        me = group.ranks[group.rank]
        self.peer = group.ranks[1 - group.rank]
        n, gid, flags = like.nbytes, group.gid, self.FLAGS
        self.out_head, self.out_tail = _packed(sig, me, 0, n, gid, flags)
        self.in_head, self.in_tail = _packed(sig, self.peer, 0, n, gid, flags)

    def body(self, x: np.ndarray | None, seq: int) -> None:
        assert x is not None
        plane, peer, n = self.plane, self.peer, self.nbytes
        number = (seq & 0xFFFFFFFF).to_bytes(4, "little")
        flat = x if self.one_d else x.reshape(-1)
        # Copied when the kernel does not take it all (copy=True): the peer may read it
        # after this rank has written its result into x.
        queued = plane.send_packed(peer, self.out_head + number + self.out_tail, flat, n,
                                   True)
        polls = _polls(plane, TCP_POLLS)
        theirs: Any = plane.take_message(peer, self.in_head + number + self.in_tail, n, polls)
        self._reduce(flat, theirs, seq)
        if queued:
            self.channel.flush()

    def _reduce(self, flat: np.ndarray, theirs: Any, seq: int) -> None:
        """Reduce the peer's payload (``theirs``; None: not taken, the channel's receive
        gets it) into ``flat`` in rank order (the same bits on both), and divide."""
        if theirs is None:
            g = self.group
            theirs = self.channel.recv_key(self.plane, (g.gid, self.peer, seq & 0xFFFFFFFF, 0),
                                           self.sig, self.nbytes, None)
        other = np.frombuffer(theirs, flat.dtype, flat.size)
        if self.group.rank == 0:
            self.ufunc(flat, other, out=flat)
        else:
            self.ufunc(other, flat, out=flat)
        if self.divide:
            divide_by(flat, self.divide)


class ZmqPairCall(PairCall):
    """all_reduce of two ranks on the zmq plane, up to its inline size (``x`` as it was
    made for): :class:`PairCall`'s exchange with the zmq plane's message (one frame:
    header and payload), and the peer's payload reduced where it arrived in its frame
    (:meth:`ZmqPlane.take_inline`) when it is the next frame; otherwise the channel's
    receive."""

    __slots__ = ()
    FLAGS = wire.FLAG_INLINE

    def body(self, x: np.ndarray | None, seq: int) -> None:
        assert x is not None
        plane, peer = self.plane, self.peer
        number = (seq & 0xFFFFFFFF).to_bytes(4, "little")
        flat = x if self.one_d else x.reshape(-1)
        plane.send_inline(peer, self.out_head + number + self.out_tail, flat)  # (a copy)
        self._reduce(flat, plane.take_inline(peer, self.in_head + number + self.in_tail,
                                             self.nbytes), seq)


class DoublingCall(Prepared):
    """all_reduce of a small array in a power-of-two group of 4 or more on the socket
    plane: the recursive doubling of :func:`swarmfd.algorithms.tcp.all_reduce_doubling`,
    whose messages, ring order and bits these are. Each round's headers are packed but
    for the call's number and its rows are views of one buffer kept for the calls; each
    peer's rows are copied from where they arrived in the connection's buffer when they
    are there whole (:meth:`SocketPlane.take_message`), else received into place."""

    __slots__ = ("divide", "held", "pos", "rounds", "rows", "ufunc")

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 like: np.ndarray, ufunc: np.ufunc, divide: int = 0) -> None:
        super().__init__(group, plane, sig, label)
        self.ufunc, self.divide = ufunc, divide
        n, order = group.size, list(group.ring)
        self.pos = pos = order.index(group.rank)
        #: Row i: the array of group rank order[i] (this rank's at pos).
        self.held = held = np.empty((n, like.size), like.dtype)
        row = {r: i for i, r in enumerate(order)}
        #: The rows in group rank order (the reduction's).
        self.rows = [held[row[r]] for r in range(n)]
        me = group.ranks[group.rank]
        #: Each round: peer (world rank), tag, bytes, the rows sent and received, the
        #: headers out and in cut around the call's number.
        self.rounds: list[tuple[Any, ...]] = []
        bit = 0
        while (1 << bit) < n:
            width = 1 << bit
            mine = pos & ~(width - 1)
            theirs = mine ^ width
            peer = group.ranks[order[pos ^ width]]
            size = width * like.nbytes
            self.rounds.append((peer, bit, size, held[mine:mine + width],
                                held[theirs:theirs + width],
                                *_packed(sig, me, bit, size, group.gid),
                                *_packed(sig, peer, bit, size, group.gid)))
            bit += 1

    def body(self, x: np.ndarray | None, seq: int) -> None:
        assert x is not None
        plane, ch, gid = self.plane, self.channel, self.group.gid
        flat = x.reshape(-1)
        self.held[self.pos] = flat
        number = (seq & 0xFFFFFFFF).to_bytes(4, "little")
        polls = _polls(plane, TCP_POLLS)
        queued = False
        for peer, tag, size, sent, into, out_head, out_tail, in_head, in_tail in self.rounds:
            queued |= plane.send_packed(peer, out_head + number + out_tail, sent, size, False)
            got = plane.take_message(peer, in_head + number + in_tail, size, polls)
            if got is None:
                ch.recv_key(plane, (gid, peer, seq & 0xFFFFFFFF, tag), self.sig, size, into)
            else:
                memoryview(into).cast("B")[:] = got
        if queued:
            ch.flush()  # rows still on their way out (zero-copy) before they are rewritten
        rows, ufunc = self.rows, self.ufunc
        ufunc(rows[0], rows[1], out=flat)  # rank order: the same bits on every rank
        for other in rows[2:]:
            ufunc(flat, other, out=flat)
        if self.divide:
            divide_by(flat, self.divide)


class DirectCall(Prepared):
    """all_reduce of a small array on the socket plane where the direct exchange runs (a
    group of 3 or more that is not a power of two): every rank sends its array to every
    other and reduces all of them in rank order, as
    :func:`swarmfd.algorithms.tcp.all_reduce_direct` does (its messages and bits), with
    the headers packed but for the call's number and the peers' arrays copied from where
    they arrived when they are there whole."""

    __slots__ = ("divide", "held", "ins", "me", "out_head", "out_tail", "peers", "ufunc")

    def __init__(self, group: Group, plane: Any, sig: wire.Signature, label: Any,
                 like: np.ndarray, ufunc: np.ufunc, divide: int = 0) -> None:
        super().__init__(group, plane, sig, label)
        self.ufunc, self.divide, self.me = ufunc, divide, group.rank
        #: Row p: group rank p's array (this rank's copied in: the result overwrites it).
        self.held = np.empty((group.size, like.size), like.dtype)
        me = group.ranks[group.rank]
        self.out_head, self.out_tail = _packed(sig, me, 0, like.nbytes, group.gid)
        self.peers = [r for r in group.ranks if r != me]
        #: Per peer, in group rank order: its world rank, row, and header cut around
        #: the call's number.
        self.ins: list[tuple[int, np.ndarray, bytes, bytes]] = []
        for p, r in enumerate(group.ranks):
            if r != me:
                self.ins.append((r, self.held[p], *_packed(sig, r, 0, like.nbytes,
                                                           group.gid)))

    def body(self, x: np.ndarray | None, seq: int) -> None:
        assert x is not None
        plane, ch, gid = self.plane, self.channel, self.group.gid
        flat, n = x.reshape(-1), x.nbytes
        number = (seq & 0xFFFFFFFF).to_bytes(4, "little")
        header = self.out_head + number + self.out_tail
        queued = False
        for peer in self.peers:
            queued |= plane.send_packed(peer, header, flat, n, False)
        held = self.held
        held[self.me] = flat
        polls = _polls(plane, TCP_POLLS)
        for peer, row, in_head, in_tail in self.ins:
            got = plane.take_message(peer, in_head + number + in_tail, n, polls)
            if got is None:
                ch.recv_key(plane, (gid, peer, seq & 0xFFFFFFFF, 0), self.sig, n, row)
            else:
                memoryview(row).cast("B")[:] = got
        if queued:
            ch.flush()  # x may still be on its way out (zero-copy) before it is rewritten
        ufunc = self.ufunc
        ufunc(held[0], held[1], out=flat)  # rank order: the same bits on every rank
        for p in range(2, len(held)):
            ufunc(flat, held[p], out=flat)
        if self.divide:
            divide_by(flat, self.divide)


class ListCall:
    """A prepared blocking all_reduce of a list (or tuple) of arrays of one dtype: the
    general path's fused call (``swarmfd.collectives._fused``: the list's signature, its
    arrays end to end in one buffer), staged through a buffer kept for the calls and run
    by ``inner``, the prepared call of that buffer's algorithm. The messages and bits
    are the general path's, which reduces the arrays where they are on shared memory
    and stages them in a buffer over TCP: the same slots and records, the same
    messages. A training loop's fused gradient mean each step is this call."""

    __slots__ = ("buf", "inner", "parts")

    def __init__(self, inner: Prepared, buf: np.ndarray,
                 shapes: tuple[tuple[int, ...], ...]) -> None:
        self.inner, self.buf = inner, buf
        #: Each array's place in the buffer, shaped like it.
        self.parts: list[np.ndarray] = []
        at = 0
        for shape in shapes:
            size = math.prod(shape)
            self.parts.append(buf[at:at + size].reshape(shape))
            at += size

    def run(self, items: Sequence[np.ndarray]) -> bool:
        """Run the call on ``items`` (arrays of the shapes and dtype it was made for);
        False, having changed none of them, when it does not apply now (a read-only
        array, which the general path reports, or ``inner`` not applying)."""
        for a in items:
            if not a.flags.writeable:
                return False
        parts = self.parts
        for part, a in zip(parts, items, strict=True):
            np.copyto(part, a)
        if not self.inner.run(self.buf):
            return False
        for part, a in zip(parts, items, strict=True):
            np.copyto(a, part)
        return True


def for_all_reduce(group: Group, plane: Any, sig: wire.Signature, label: Any,
                   like: np.ndarray, ufunc: np.ufunc, divide: int) -> Prepared | None:
    """The prepared call for a blocking all_reduce of arrays like ``like`` on ``plane``,
    one the general path just ran: the same algorithm, or None where none is prepared
    (the TCP ring, the zmq plane's direct exchange and doubling, the two-level
    algorithms, more than one round of shared memory)."""
    if plane.kind == "shm":
        if not plane.ring_slots:
            return None
        if like.nbytes <= _shm_algo.SMALL_BYTES:
            return ShmCall(group, plane, sig, label, like, ufunc, divide)
        if like.nbytes <= SEGMENT_BYTES and (plane.cma_pids is None
                                             or like.nbytes < _shm_algo.CMA_MIN_BYTES):
            return SplitCall(group, plane, sig, label, like, ufunc, divide)
        return None
    if like.nbytes > _select.SMALL_BYTES:
        return None
    two = group.two_level()
    if two and _select.all_reduce_two_level(like.nbytes, two[0], plane.name):
        return None
    algo = _select.all_reduce(plane.kind, like.nbytes, group.size, like.size, plane.name)
    if algo is _tcp.all_reduce_pair:
        if plane.name == "socket":
            return PairCall(group, plane, sig, label, like, ufunc, divide)
        if plane.name == "zmq" and like.nbytes <= plane.inline_max:
            return ZmqPairCall(group, plane, sig, label, like, ufunc, divide)
        return NowCall(group, plane, sig, label, ufunc, divide)
    if algo is _tcp.all_reduce_doubling and plane.name == "socket":
        return DoublingCall(group, plane, sig, label, like, ufunc, divide)
    if algo is _tcp.all_reduce_direct and plane.name == "socket":
        return DirectCall(group, plane, sig, label, like, ufunc, divide)
    return None


def for_broadcast(group: Group, plane: Any, sig: wire.Signature, label: Any,
                  like: np.ndarray, root: int) -> Prepared | None:
    """The prepared call for a blocking broadcast of arrays like ``like`` from ``root``
    on ``plane``, one the general path just ran: shared memory's one-round path (the
    record rings, up to one slot), else None."""
    if plane.kind != "shm" or not plane.ring_slots or like.nbytes > SEGMENT_BYTES:
        return None
    return BroadcastCall(group, plane, sig, label, like, root)


def for_barrier(group: Group, plane: Any, sig: wire.Signature, label: Any) -> Prepared:
    """The prepared call for a blocking barrier on ``plane``."""
    if plane.kind == "shm" and plane.ring_slots:
        return ShmCall(group, plane, sig, label)
    return NowCall(group, plane, sig, label)


def keep(group: Group, key: Any, call: Prepared | None) -> None:
    """Keep ``call`` for the group's calls of ``key`` (at most MAX_PREPARED)."""
    if call is None:
        return
    prepared = group.prepared
    if len(prepared) >= MAX_PREPARED:
        prepared.clear()
    prepared[key] = call
