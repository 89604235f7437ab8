"""Point-to-point messages: send and recv, matched by (group, peer, tag) and order.

The n-th message A sends B in a group with a tag is B's n-th recv from A there with
that tag; other tags, peers and groups are independent, and never meet a collective's
messages. A message up to EAGER_BYTES goes at once; a larger one sends a request to
send, and its pieces go, straight into the receiver's array, once the receiver answers
that its recv is posted: only small messages and requests wait in a receiver's memory,
and a blocking large send returns once received (isend/irecv exchange both ways).
Every piece carries the signature: a recv whose array differs raises MismatchError.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..comm import wire
from .base import Algorithm, Op, num_pieces, split

__all__ = ["EAGER_BYTES", "recv", "send"]

#: Messages up to this size are sent at once (copied); 1000 unanswered cost a receiver
#: 16 MiB, and typical small messages take one trip.
EAGER_BYTES = 16 << 10


@functools.lru_cache(maxsize=4096)
def _piece_sig(sig: wire.Signature, piece: int) -> wire.Signature:
    """``sig`` for one piece (in the root field); cached, as replace is slow."""
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
