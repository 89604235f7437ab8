"""Point-to-point messages: send and recv, matched by (group, peer, tag) and order.

The n-th message rank A sends to rank B in a group with a tag is received by B's n-th
recv from A in that group with that tag: messages between two ranks with one tag
never overtake each other; different tags, peers and groups are independent. A
point-to-point message never meets a collective's (their keys differ), so p2p
traffic never disturbs a collective, and both may be in flight at once.

Protocol. A message of up to EAGER_BYTES goes at once, in one piece (the receiver
keeps it until its recv asks). A larger one sends a request to send (its signature,
no data); the receiver answers *ready* once its recv is posted, and only then do the
pieces go, straight into the receiver's array. So pending sends never pile up in a
receiver's memory: what waits there is small messages and requests (flow control).
A blocking send of a large message therefore returns once the receiver took it; use
isend and irecv to exchange in both directions at once.

Every piece carries the sender's signature (dtype, count, shape): a recv whose array
differs raises :class:`MismatchError` naming both sides.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..comm import wire
from .base import Algorithm, Op, num_pieces, split

__all__ = ["EAGER_BYTES", "recv", "send"]

#: Messages up to this size are sent at once (copied: the sender's array is free when the
#: send returns); larger ones wait for the receiver (see the module docstring). Small
#: enough that hundreds of unanswered sends keep the receiver's memory bounded (1000 of
#: them: 16 MiB), large enough that typical small messages take one trip.
EAGER_BYTES = 16 << 10


@functools.lru_cache(maxsize=4096)
def _piece_sig(sig: wire.Signature, piece: int) -> wire.Signature:
    """``sig`` for one piece of a message (the piece travels in the root field). Cached:
    dataclasses.replace costs as much as the rest of a small send's Python."""
    return dataclasses.replace(sig, root=piece)


def send(op: Op, buf: np.ndarray, dst: int, seq: int, tag: int) -> Algorithm:
    """Send ``buf`` (flat) to world rank ``dst`` as message ``seq`` of (dst, tag)."""
    ch, sig = op.channel, op.sig
    if buf.nbytes <= EAGER_BYTES:
        ch.send(op.plane, dst, _piece_sig(sig, 0), op.gid, seq, tag, buf, copy=True,
                kind=wire.Kind.P2P)
        return
    ch.send(op.plane, dst, _piece_sig(sig, wire.RTS_PIECE), op.gid, seq, tag, b"",
            kind=wire.Kind.P2P)
    ready = _piece_sig(sig, wire.READY_PIECE)
    yield op.recv_key(wire.p2p_key(op.gid, dst, seq, tag, wire.READY_PIECE), ready, 0)
    for j, (a, b) in enumerate(split(buf.size, num_pieces(buf.size, buf.itemsize))):
        ch.send(op.plane, dst, _piece_sig(sig, j), op.gid, seq, tag, buf[a:b],
                kind=wire.Kind.P2P)
    yield op.flush()  # the pieces left zero-copy: the op owns buf until they are out


def recv(op: Op, buf: np.ndarray, src: int, seq: int, tag: int) -> Algorithm:
    """Receive message ``seq`` of (src, tag) from world rank ``src`` into ``buf`` (flat)."""
    ch, sig = op.channel, op.sig
    if buf.nbytes <= EAGER_BYTES:
        yield op.recv_key(wire.p2p_key(op.gid, src, seq, tag, 0), _piece_sig(sig, 0),
                          buf.nbytes, buf if buf.nbytes else None)
        return
    yield op.recv_key(wire.p2p_key(op.gid, src, seq, tag, wire.RTS_PIECE),
                      _piece_sig(sig, wire.RTS_PIECE), 0)
    ch.send(op.plane, src, _piece_sig(sig, wire.READY_PIECE), op.gid, seq, tag, b"",
            kind=wire.Kind.P2P_READY)
    for j, (a, b) in enumerate(split(buf.size, num_pieces(buf.size, buf.itemsize))):
        yield op.recv_key(wire.p2p_key(op.gid, src, seq, tag, j), _piece_sig(sig, j),
                          (b - a) * buf.itemsize, buf[a:b])
