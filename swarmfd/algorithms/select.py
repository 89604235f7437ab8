"""The selection table: (collective, plane kind, bytes, group size) -> algorithm.

One place decides which algorithm runs; each threshold carries the measurement
behind it. ``kind`` is the plane's (``"shm"`` or ``"tcp"``); ``nbytes`` the flat
buffer's size; ``size`` the group's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..comm import wire
from . import shm, tcp

__all__ = ["PAIR_MAX_BYTES", "SMALL_BYTES", "SMALL_MAX_WORLD", "all_gather", "all_reduce",
           "broadcast", "gather", "reduce", "reduce_scatter", "scatter", "split_rows"]

#: Two ranks all-reduce up to this many bytes as one message each way (the pair
#: exchange); above it the ring's pipelined pieces win (interleaved A/B over TCP:
#: 0.78-0.86x the ring's time at 1 MiB, even at 2 MiB with two pieces).
PAIR_MAX_BYTES = wire.PIECE_BYTES
#: Up to this many bytes, all_reduce / reduce / broadcast / all_gather over TCP use a
#: direct exchange (one network hop instead of 2(N-1) for the ring).
SMALL_BYTES = 256 << 10
#: The direct exchange sends N-1 copies: only for groups up to this size.
SMALL_MAX_WORLD = 8

Algo = Callable[..., Any]


def _direct(nbytes: int, size: int) -> bool:
    return nbytes <= SMALL_BYTES and size <= SMALL_MAX_WORLD


def all_reduce(kind: str, nbytes: int, size: int, count: int) -> Algo:
    """The all_reduce of ``count`` items (``nbytes``) among ``size`` ranks."""
    if kind == "shm":
        return shm.all_reduce
    if size == 2 and nbytes <= PAIR_MAX_BYTES:
        return tcp.all_reduce_pair
    if _direct(nbytes, size) or count < size:
        return tcp.all_reduce_direct
    return tcp.all_reduce_ring


def broadcast(kind: str, nbytes: int, size: int) -> Algo:
    if kind == "shm":
        return shm.broadcast
    return tcp.broadcast_direct if _direct(nbytes, size) else tcp.broadcast_chain


def reduce(kind: str, nbytes: int, size: int) -> Algo:
    if kind == "shm":
        return shm.reduce
    return tcp.reduce_direct if _direct(nbytes, size) else tcp.reduce_chain


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row bounds of ``parts`` parts of ``rows`` rows, as np.array_split cuts them."""
    from .base import split

    return split(rows, parts)


def reduce_scatter(kind: str, nbytes: int, size: int) -> Algo:
    """``nbytes``: the whole input (every rank's part of it together)."""
    if kind == "shm":
        return shm.reduce_scatter
    return tcp.reduce_scatter_direct if _direct(nbytes, size) else tcp.reduce_scatter_ring


def gather(kind: str) -> Algo:
    return shm.gather if kind == "shm" else tcp.gather_direct


def scatter(kind: str) -> Algo:
    return shm.scatter if kind == "shm" else tcp.scatter_direct


def all_gather(kind: str, nbytes: int, size: int) -> Algo:
    """``nbytes``: one rank's part."""
    if kind == "shm":
        return shm.all_gather
    return tcp.all_gather_direct if _direct(nbytes, size) else tcp.all_gather_ring
