"""What an algorithm sees of a collective call: :class:`Op`.

An algorithm is a generator function ``algo(op, ...)``. It sends with
:meth:`Op.send` (never blocks) and waits for a message with
``data = yield op.recv(peer, tag, nbytes, into)``; whoever drives it (the caller's
thread for a blocking call, the progress engine for an async one) completes the
receive and sends the payload back in (``None`` when it landed ``into``).
``yield op.flush()`` waits until no plane still reads a buffer it was handed (before
the algorithm overwrites one it sent without a copy). Peers are
*group ranks*: the op maps them to world ranks, and to the plane the algorithm runs
on. Algorithms never see a socket, a plane's internals or another group's traffic.

Shared-memory algorithms also address the members' segments directly
(:meth:`Op.region`), one slot per round (:meth:`Op.next_slot`), rotating over
SLOTS slots of the group's area, so a slot is rewritten only after every member
passed a later barrier.

Hierarchical algorithms (:mod:`swarmfd.algorithms.hier`) run phases among some of
the members, each on its own plane: :meth:`Op.sub` gives such a phase its own
``Op`` (its own group ranks, plane and tags), and the phase's algorithm is any of
the others, unchanged. Whoever drives the call still drives only the *root* op: a
sub-op's receives come out in the root's terms (the root's group rank of the
sender, the full tag), and the root knows which plane reaches each peer
(:meth:`Op.plane_of`), so the blocking driver and the progress engine wait on the
right plane without knowing about phases.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from ..comm import wire
from ..comm.channel import Channel
from ..comm.plane import Plane

__all__ = ["FLUSH", "TAG_MASK", "Algorithm", "Op", "Recv", "num_pieces", "run", "split"]

#: A receive an algorithm waits for: (group rank, tag, nbytes, into).
Recv = tuple[int, int, int, Any]
#: What an algorithm yields to wait until its sends no longer read its buffers.
FLUSH: Any = ("flush",)
#: The generator an algorithm is.
Algorithm = Generator[Recv, Any, Any]

#: Target size of one wire message (see wire.PIECE_BYTES).
PIECE_BYTES = wire.PIECE_BYTES
#: Tags are 32-bit on the wire; a sub-op's tags wrap around within them (its phase's
#: tag base plus ACK or SIG, say).
TAG_MASK = 0xFFFFFFFF


class Op:
    """One collective call of one group, on one plane (see module docstring)."""

    __slots__ = ("channel", "gid", "me", "next_slot", "plane", "ranks", "routes", "seq",
                 "shm", "sig", "size", "tag_base")

    def __init__(self, channel: Channel, plane: Plane, ranks: list[int], me: int, gid: int,
                 seq: int, sig: wire.Signature, shm: Any = None,
                 next_slot: Callable[[], int] | None = None, tag_base: int = 0) -> None:
        self.channel = channel
        self.plane = plane
        self.ranks = ranks  # world rank of each group rank
        self.me = me  # this rank's group rank
        self.size = len(ranks)
        self.gid = gid
        self.seq = seq
        self.sig = sig
        self.shm = shm
        self.next_slot = next_slot
        self.tag_base = tag_base
        #: {group rank: plane} for the peers a sub-op reaches on another plane than
        #: ``plane`` (see :meth:`sub`); None while there are none.
        self.routes: dict[int, Plane] | None = None

    def sub(self, plane: Plane, members: list[int], tag_base: int, shm: Any = None,
            next_slot: Callable[[], int] | None = None) -> Op:
        """The same call among some of its members (group ranks ``members``, this rank
        among them), on ``plane``, with tags from ``tag_base`` (hierarchical algorithms'
        phases; see the module docstring). Within one call a peer is reached on one
        plane only: a second sub-op that reaches it on another is a bug (ValueError)."""
        root = self
        index = list(members)
        if isinstance(self, SubOp):
            root = self.root
            index = [self.index[m] for m in members]
        if root.tag_base:
            raise ValueError("swarmfd bug: sub-ops of an op with a tag base")
        if plane is not root.plane:
            routes = root.routes if root.routes is not None else {}
            for g in index:
                if g != root.me and routes.setdefault(g, plane) is not plane:
                    raise ValueError(f"swarmfd bug: group rank {g} reached on two planes "
                                     "in one call")
            root.routes = routes
        elif root.routes is not None and any(root.routes.get(g, plane) is not plane
                                             for g in index if g != root.me):
            raise ValueError("swarmfd bug: a peer reached on two planes in one call")
        return SubOp(root, index, plane, [root.ranks[g] for g in index],
                     index.index(root.me), shm, next_slot, tag_base & TAG_MASK)

    def plane_of(self, frm: int) -> Plane:
        """The plane a message from group rank ``frm`` comes on (routes of sub-ops)."""
        routes = self.routes
        return self.plane if routes is None else routes.get(frm, self.plane)

    def send(self, to: int, tag: int, payload: Any = b"", *, copy: bool = False) -> None:
        """Queue a message to group rank ``to``; never blocks."""
        self.channel.send(self.plane, self.ranks[to], self.sig, self.gid, self.seq,
                          self.tag_base + tag, payload, copy=copy)

    def recv(self, frm: int, tag: int, nbytes: int, into: Any = None) -> Recv:
        """The receive to ``yield``: returns the payload, or None when it landed ``into``."""
        return (frm, tag, nbytes, into)

    def recv_array(self, frm: int, tag: int, like: np.ndarray) -> Generator[Recv, Any,
                                                                            np.ndarray]:
        """``yield from`` this: the message as an array of ``like``'s dtype and size."""
        data = yield (frm, tag, like.nbytes, None)
        return np.frombuffer(data, dtype=like.dtype, count=like.size)

    def flush(self) -> Any:
        """The request to ``yield``: wait until every buffer sent so far is out."""
        return FLUSH

    def recv_into(self, frm: int, tag: int, out: np.ndarray) -> Recv:
        """The receive to ``yield``, straight into ``out`` (contiguous)."""
        return (frm, tag, out.nbytes, out if out.nbytes else None)

    def complete(self, req: Recv) -> Any:
        """Block until ``req`` arrives (the caller's thread drives the channel)."""
        if req is FLUSH:
            self.channel.flush()
            return None
        frm, tag, nbytes, into = req
        return self.channel.recv(self.plane_of(frm), self.ranks[frm], self.sig, self.gid,
                                 self.seq, self.tag_base + tag, nbytes, into)

    # -- shared memory ------------------------------------------------------------------

    def region(self, member: int, slot: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at ``slot`` of group rank ``member``'s segment."""
        return self.shm.region(self.ranks[member], slot, dtype, count)


class SubOp(Op):
    """A phase of a call among some of its members (see :meth:`Op.sub`).

    Sends go out on the phase's plane; receives are yielded in the root op's terms
    (``index`` maps this op's group ranks to the root's), which is what the driver runs.
    """

    __slots__ = ("index", "root")

    def __init__(self, root: Op, index: list[int], plane: Plane, ranks: list[int], me: int,
                 shm: Any, next_slot: Callable[[], int] | None, tag_base: int) -> None:
        super().__init__(root.channel, plane, ranks, me, root.gid, root.seq, root.sig, shm,
                         next_slot, tag_base)
        self.root = root
        self.index = index

    def send(self, to: int, tag: int, payload: Any = b"", *, copy: bool = False) -> None:
        self.channel.send(self.plane, self.ranks[to], self.sig, self.gid, self.seq,
                          (self.tag_base + tag) & TAG_MASK, payload, copy=copy)

    def recv(self, frm: int, tag: int, nbytes: int, into: Any = None) -> Recv:
        return (self.index[frm], (self.tag_base + tag) & TAG_MASK, nbytes, into)

    def recv_into(self, frm: int, tag: int, out: np.ndarray) -> Recv:
        return (self.index[frm], (self.tag_base + tag) & TAG_MASK, out.nbytes,
                out if out.nbytes else None)

    def recv_array(self, frm: int, tag: int, like: np.ndarray) -> Generator[Recv, Any,
                                                                            np.ndarray]:
        data = yield (self.index[frm], (self.tag_base + tag) & TAG_MASK, like.nbytes, None)
        return np.frombuffer(data, dtype=like.dtype, count=like.size)

    def complete(self, req: Recv) -> Any:
        raise RuntimeError("swarmfd bug: a sub-op is driven through its root op")


def run(op: Op, algo: Algorithm) -> Any:
    """Drive ``algo`` to its end on the caller's thread; its return value."""
    complete = op.complete
    try:
        req = algo.send(None)
        while True:
            req = algo.send(complete(req))
    except StopIteration as stop:
        return stop.value


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
