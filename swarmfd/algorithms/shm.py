"""Algorithms over shared memory (the ranks of one host, :mod:`swarmfd.comm.planes.shm`).

Each round moves up to SEGMENT_BYTES: every rank copies its part into its own slot
of its segment, a barrier (records through the members' inboxes) tells that all
did, then each reads the others' slots. Slots rotate (SLOTS of them in the group's
area), so a rank rewrites a slot only after every member passed a later barrier,
that is, after everyone finished reading it.

* **all_reduce**, small (S <= SMALL_BYTES): one barrier; every rank reduces all of it
  in rank order (identical everywhere).
* **all_reduce**, large: pipelined rounds, one barrier each: copy in round r, barrier,
  copy out the reduced round r-1, reduce this rank's 1/N chunk of round r in place in
  its own segment. The barrier after copy-in r also tells that everyone finished
  reducing r-1. Each chunk is reduced once (its owner's operand first, then the
  others in rank order), so every rank copies out the same bits.
* **broadcast**: the root copies in, barrier, everyone copies out.
* **reduce**: everyone copies in, barrier, the root reduces in rank order.
* **all_gather**: everyone copies in, barrier, everyone copies the others' out.
"""

from __future__ import annotations

import numpy as np

from ..comm.planes.shm import SEGMENT_BYTES
from .base import Algorithm, Op, split
from .tcp import barrier

__all__ = ["SMALL_BYTES", "all_gather", "all_reduce", "broadcast", "reduce", "rounds"]

#: Up to this many bytes every rank reduces the whole round itself (one barrier); above
#: it each rank reduces its 1/N and copies the rest (two barriers' worth of rounds).
SMALL_BYTES = 1 << 18


def rounds(nbytes: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, stop) element bounds of the rounds an array of ``nbytes`` needs."""
    per = SEGMENT_BYTES // itemsize
    count = nbytes // itemsize
    if count == 0:
        return [(0, 0)]
    return [(a, min(a + per, count)) for a in range(0, count, per)]


def _regions(op: Op, slot: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
    return [op.region(p, slot, dtype, count) for p in range(op.size)]


def all_reduce(op: Op, buf: np.ndarray, ufunc: np.ufunc) -> Algorithm:
    """See the module docstring."""
    N, me = op.size, op.me
    if buf.nbytes <= SMALL_BYTES or buf.size < N:
        # One round; every rank reduces all of it in rank order: identical everywhere.
        slot = op.next_slot()
        regions = _regions(op, slot, buf.dtype, buf.size)
        regions[me][...] = buf
        yield from barrier(op, 0)
        np.copyto(buf, regions[0])
        for p in range(1, N):
            ufunc(buf, regions[p], out=buf)
        return
    pending: tuple[np.ndarray, list[np.ndarray], list[tuple[int, int]]] | None = None
    parts = rounds(buf.nbytes, buf.itemsize)
    for r, (a, b) in enumerate(parts):
        slot = op.next_slot()
        regions = _regions(op, slot, buf.dtype, b - a)
        regions[me][...] = buf[a:b]
        yield from barrier(op, r)
        if pending is not None:
            _copy_out(*pending)
        chunks = split(b - a, N)
        ca, cb = chunks[me]
        mine = regions[me][ca:cb]
        for p in range(N):
            if p != me:
                ufunc(mine, regions[p][ca:cb], out=mine)
        pending = (buf[a:b], regions, chunks)
    yield from barrier(op, len(parts))
    assert pending is not None
    _copy_out(*pending)


def _copy_out(seg: np.ndarray, regions: list[np.ndarray], chunks: list[tuple[int, int]]) -> None:
    for p, (pa, pb) in enumerate(chunks):
        seg[pa:pb] = regions[p][pa:pb]


def broadcast(op: Op, buf: np.ndarray, root: int) -> Algorithm:
    """See the module docstring."""
    for r, (a, b) in enumerate(rounds(buf.nbytes, buf.itemsize)):
        slot = op.next_slot()
        region = op.region(root, slot, buf.dtype, b - a)
        if op.me == root:
            region[...] = buf[a:b]
        yield from barrier(op, r)
        if op.me != root:
            buf[a:b] = region


def reduce(op: Op, buf: np.ndarray, root: int, ufunc: np.ufunc) -> Algorithm:
    """See the module docstring."""
    for r, (a, b) in enumerate(rounds(buf.nbytes, buf.itemsize)):
        slot = op.next_slot()
        regions = _regions(op, slot, buf.dtype, b - a)
        regions[op.me][...] = buf[a:b]
        yield from barrier(op, r)
        if op.me == root:
            seg = buf[a:b]
            np.copyto(seg, regions[0])
            for p in range(1, op.size):
                ufunc(seg, regions[p], out=seg)


def all_gather(op: Op, out: np.ndarray) -> Algorithm:
    """See the module docstring (``out``: N x count, this rank's row filled)."""
    flat = out[op.me]
    for r, (a, b) in enumerate(rounds(flat.nbytes, flat.itemsize)):
        slot = op.next_slot()
        regions = _regions(op, slot, flat.dtype, b - a)
        regions[op.me][...] = flat[a:b]
        yield from barrier(op, r)
        for p in range(op.size):
            if p != op.me:
                out[p, a:b] = regions[p]
