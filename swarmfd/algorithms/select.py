"""The selection table: one place decides which algorithm a call runs.

Each function takes what the choice depends on (the plane's capabilities, the bytes,
the group's size and shape, the root) and returns a :class:`Choice`; a call's schedule
(:mod:`swarmfd.call`) asks once and keeps it. Planes are chosen by capability, never by
name. A group spanning hosts passes ``two`` (layout, shared-memory plane) where
:func:`two_level_layout` allows the two-level algorithms (:mod:`.hier`). The table, its
thresholds and their measurements: docs/algorithms.md ("How select.py chooses").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..comm import wire
from ..comm.planes.shm import SEGMENT_BYTES
from . import hier, shm, tcp
from .base import split

__all__ = ["ALL_GATHER_V_INLINE_BYTES", "DIRECT_MAX_BYTES", "DIRECT_MAX_WORLD",
           "HIER_FAN_FLAT_MAX_BYTES", "HIER_GATHER_FLAT_MAX_BYTES", "HIER_GATHER_SAVES_BYTES",
           "HIER_REDUCE_ALONE_MAX_BYTES", "HIER_SCATTER_MIN_BYTES", "HIER_SMALL_BYTES",
           "PAIR_MAX_BYTES", "SHM_CMA_MIN_BYTES", "SHM_ONE_ROUND_MAX_BYTES",
           "SHM_SCATTER_CMA_MIN_BYTES", "Choice", "all_gather",
           "all_gather_counts", "all_gather_parts", "all_reduce", "all_to_all", "all_to_all_splits",
           "barrier", "broadcast", "flat_gather_rows_in", "gather", "reduce", "reduce_scatter",
           "scatter", "small_fan", "split_rows", "two_level_layout"]

#: Two ranks all-reduce up to this many bytes as one message each way (the pair exchange).
PAIR_MAX_BYTES = wire.PIECE_BYTES
#: Up to this many bytes, in groups up to DIRECT_MAX_WORLD, collectives over messages use
#: a direct exchange (one hop; N-1 copies).
DIRECT_MAX_BYTES = 256 << 10
DIRECT_MAX_WORLD = 8
#: Up to this many bytes a shared-memory all_reduce runs in one round (one barrier).
SHM_ONE_ROUND_MAX_BYTES = shm.SMALL_BYTES
#: From this many bytes a shared-memory all_reduce uses cross-memory attach where allowed.
SHM_CMA_MIN_BYTES = shm.CMA_MIN_BYTES
#: From this many bytes (the whole input) a shared-memory reduce_scatter reads the
#: peers' buffers directly (no copy into the slots) where the host allows it.
SHM_SCATTER_CMA_MIN_BYTES = 1 << 20

Algo = Callable[..., Any]


@dataclass(frozen=True)
class Choice:
    """What the table picked: ``algo(op, buf, ..., *args)`` runs the call; ``parts``:
    it takes :class:`~.base.Parts` too."""

    name: str
    algo: Algo
    args: tuple[Any, ...] = ()
    parts: bool = False


def _direct(nbytes: int, size: int) -> bool:
    return nbytes <= DIRECT_MAX_BYTES and size <= DIRECT_MAX_WORLD


def _doubling(nbytes: int, size: int, plane: Any) -> bool:
    """Recursive doubling instead of the direct exchange: N a power of two from 4, no
    I/O thread (a hop costs more than a message saves), its last message within
    MAX_PAYLOAD."""
    return (not plane.io_thread and size >= 4 and size & (size - 1) == 0
            and size // 2 * nbytes <= wire.MAX_PAYLOAD)


def all_reduce(plane: Any, nbytes: int, size: int, count: int, two: Any = None,
               arrays: int = 1) -> Choice:
    """The all_reduce of ``count`` items (``nbytes``) among ``size`` ranks (``arrays``:
    in a Parts buffer). Algorithms take ``(op, buf, ufunc, divide, *args)``."""
    if plane.shares_memory:
        if nbytes <= SHM_ONE_ROUND_MAX_BYTES or count < size:
            return Choice("shm.one_round", shm.all_reduce_one_round, parts=True)
        if (plane.reads_peers and nbytes >= SHM_CMA_MIN_BYTES
                and arrays <= shm.CMA_MAX_ARRAYS):
            return Choice("shm.cma", shm.all_reduce_cma, parts=True)
        return Choice("shm.rounds", shm.all_reduce_rounds, parts=True)
    if two is not None:
        two_level = _all_reduce_two_level(nbytes, two, plane)
        if two_level is not None:
            return two_level
    if size == 2 and nbytes <= PAIR_MAX_BYTES:
        return Choice("tcp.pair", tcp.all_reduce_pair)
    if count < size or _direct(nbytes, size):
        if count >= size and _doubling(nbytes, size, plane):
            return Choice("tcp.doubling", tcp.all_reduce_doubling)
        return Choice("tcp.direct", tcp.all_reduce_direct)
    return Choice("tcp.ring", tcp.all_reduce_ring, parts=True)


def broadcast(plane: Any, nbytes: int, size: int, root: int, two: Any = None) -> Choice:
    """Algorithms take ``(op, buf, root, *args)``."""
    if plane.shares_memory:
        return Choice("shm.broadcast", shm.broadcast)
    if two is not None and _broadcast_two_level(nbytes, two[0], root):
        return Choice("hier.broadcast", hier.broadcast, two)
    if _direct(nbytes, size):
        return Choice("tcp.broadcast_direct", tcp.broadcast_direct)
    return Choice("tcp.broadcast_chain", tcp.broadcast_chain)


def reduce(plane: Any, nbytes: int, size: int, root: int, two: Any = None) -> Choice:
    """Algorithms take ``(op, buf, root, ufunc, divide, *args)``."""
    if plane.shares_memory:
        return Choice("shm.reduce", shm.reduce)
    if two is not None and _reduce_two_level(nbytes, two[0], root):
        return Choice("hier.reduce", hier.reduce, two)
    if _direct(nbytes, size):
        return Choice("tcp.reduce_direct", tcp.reduce_direct)
    return Choice("tcp.reduce_chain", tcp.reduce_chain)


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row bounds of ``parts`` parts of ``rows`` rows, as np.array_split cuts them."""
    return split(rows, parts)


def reduce_scatter(plane: Any, nbytes: int, size: int, two: Any = None,
                   arrays: int = 1) -> Choice:
    """``nbytes``: the whole input (``arrays`` arrays of Parts). Algorithms take ``(op,
    buf, out, parts, ufunc, divide, *args)``; every flat one reads Parts. Shared memory
    reads the peers' buffers directly from SHM_SCATTER_CMA_MIN_BYTES where it can."""
    if plane.shares_memory:
        if (plane.reads_peers and nbytes >= SHM_SCATTER_CMA_MIN_BYTES
                and arrays <= shm.CMA_MAX_ARRAYS):
            return Choice("shm.reduce_scatter_cma", shm.reduce_scatter_cma, parts=True)
        return Choice("shm.reduce_scatter", shm.reduce_scatter, parts=True)
    if two is not None and len(two[0].hosts) == 2 and nbytes >= HIER_SCATTER_MIN_BYTES:
        return Choice("hier.reduce_scatter", hier.reduce_scatter, two)
    if _direct(nbytes, size):
        return Choice("tcp.reduce_scatter_direct", tcp.reduce_scatter_direct, parts=True)
    return Choice("tcp.reduce_scatter_ring", tcp.reduce_scatter_ring, parts=True)


def gather(plane: Any) -> Choice:
    """Algorithms take ``(op, flat, out, root)``."""
    if plane.shares_memory:
        return Choice("shm.gather", shm.gather)
    return Choice("tcp.gather_direct", tcp.gather_direct)


def scatter(plane: Any) -> Choice:
    """Algorithms take ``(op, chunks, out, root)``."""
    if plane.shares_memory:
        return Choice("shm.scatter", shm.scatter)
    return Choice("tcp.scatter_direct", tcp.scatter_direct)


def all_to_all(plane: Any) -> Choice:
    """The exchange of an all_to_all's parts: algorithms take ``(op, flat, out, matrix,
    rows_in, rows_out, row)`` (``matrix[p][q]``: the rows rank p sends rank q)."""
    if plane.shares_memory:
        return Choice("shm.all_to_all", shm.all_to_all_rows)
    return Choice("tcp.all_to_all_pairwise", tcp.all_to_all_rows)


def all_to_all_splits(plane: Any, size: int, equal: bool, out_known: bool) -> Choice | None:
    """The all_gather of every rank's splits an uneven all_to_all runs first, or None:
    needed where the receiving rows are not given, or on shared memory (its windows)."""
    if equal or (out_known and not plane.shares_memory):
        return None
    return all_gather(plane, 8 * size, size)


def barrier(plane: Any) -> Choice:
    """Dissemination on every plane (records on shared memory): ``(op, tag)``."""
    return Choice("barrier", tcp.barrier, (0,))


#: An uneven all_gather's part of at most this many bytes travels with its row count in
#: one round; otherwise all parts move in a second (:func:`.tcp.all_gather_counts`).
ALL_GATHER_V_INLINE_BYTES = 64 << 10


def all_gather_counts(plane: Any, size: int) -> Choice:
    """The one-round exchange of an uneven all_gather's counts (with the rows that fit).
    Algorithms take ``(op, count, flat, row_nbytes, *args)``, return (counts, parts)."""
    if plane.shares_memory:
        return Choice("shm.all_gather_counts", shm.all_gather_counts)
    if _doubling(ALL_GATHER_V_INLINE_BYTES + 8, size, plane):
        return Choice("tcp.all_gather_counts_doubling", tcp.all_gather_counts_doubling,
                      (ALL_GATHER_V_INLINE_BYTES,))
    return Choice("tcp.all_gather_counts", tcp.all_gather_counts,
                  (ALL_GATHER_V_INLINE_BYTES,))


def all_gather(plane: Any, nbytes: int, size: int, two: Any = None) -> Choice:
    """The all_gather of parts of ``nbytes`` (one rank's) into rows: algorithms take
    ``(op, rows, *args)``."""
    if plane.shares_memory:
        return Choice("shm.all_gather", shm.all_gather)
    if two is not None and _all_gather_two_level(nbytes, two[0], plane):
        return Choice("hier.all_gather", hier.all_gather, two)
    if _direct(nbytes, size):
        if _doubling(nbytes, size, plane):
            return Choice("tcp.all_gather_doubling", tcp.all_gather_doubling)
        return Choice("tcp.all_gather_direct", tcp.all_gather_direct)
    return Choice("tcp.all_gather_ring", tcp.all_gather_ring)


def all_gather_parts(plane: Any, largest: int, size: int, equal: bool,
                     two: Any = None) -> Choice:
    """The second round of an uneven all_gather (``largest``: the largest part's bytes).
    Algorithms take ``(op, flat, out, bounds, *args)``."""
    if plane.shares_memory:
        return Choice("shm.all_gather_v", shm.all_gather_v)
    if equal and two is not None and _all_gather_two_level(largest, two[0], plane):
        return Choice("hier.all_gather_v", hier.all_gather_v, two)
    direct = _direct(largest, size) and largest <= wire.PIECE_BYTES
    return Choice("tcp.all_gather_v", tcp.all_gather_v, (None, direct))


# -- two-level (hier.py) ------------------------------------------------------------------

#: Up to this many bytes (and a slot) the two-level all_reduce sends whole host partials
#: between hosts (L copies of S on each link); above it the sharded pipeline (S).
HIER_SMALL_BYTES = 64 << 10


def two_level_layout(hosts: Sequence[str], domains: Sequence[int], me: int,
                     mode: str) -> hier.Layout | None:
    """The layout of a group whose group rank g runs on ``hosts[g]`` in shared-memory
    plane ``domains[g]`` (-1: none), as ``me`` sees it, where its calls may run two-level
    (``mode`` "auto", spanning hosts, some host holding several ranks that all share one
    plane); else None. Every member gets the same answer."""
    if mode != "auto":
        return None
    lay = hier.layout_of(hosts, me)
    if not lay.two_level():
        return None
    for ranks in lay.hosts:
        if len(ranks) > 1 and (domains[ranks[0]] < 0
                               or any(domains[g] != domains[ranks[0]] for g in ranks)):
            return None
    return lay


#: Up to this many bytes an all_reduce stays flat where that is recursive doubling and
#: the two-level small one makes some rank exchange with more than log2 N peers
#: (:func:`small_fan`).
HIER_FAN_FLAT_MAX_BYTES = 16 << 10


def small_fan(lay: hier.Layout) -> int:
    """The most peers any rank sends its host partial to in the two-level small
    all_reduce (local index i of a host of L sends to k = i, i + L, ... of each other)."""
    return _small_fan(lay.hosts)


@functools.lru_cache(maxsize=64)
def _small_fan(hosts: tuple[tuple[int, ...], ...]) -> int:  # asked by every small call
    sizes = [len(rs) for rs in hosts]
    return max(sum(-(-other // size) for y, other in enumerate(sizes) if y != x)
               for x, size in enumerate(sizes))


def _all_reduce_two_level(nbytes: int, two: Any, plane: Any) -> Choice | None:
    """The two-level all_reduce of ``nbytes``, or None for the flat one."""
    lay = two[0]
    if nbytes <= HIER_FAN_FLAT_MAX_BYTES:
        n = lay.size
        if _doubling(nbytes, n, plane) and small_fan(lay) > n.bit_length() - 1:
            return None
    if nbytes <= min(HIER_SMALL_BYTES, SEGMENT_BYTES):
        return Choice("hier.all_reduce_small", hier.all_reduce_small, tuple(two))
    return Choice("hier.all_reduce_large", hier.all_reduce_large,
                  (*two, functools.partial(all_reduce, plane)))


def _broadcast_two_level(nbytes: int, lay: hier.Layout, root: int) -> bool:
    """Whether a broadcast from group rank ``root`` runs two-level: not a direct-sized
    one where no other host than the root's holds several ranks (the direct send puts
    one copy on each link anyway)."""
    others_full = any(len(h) > 1 for h in lay.hosts if root not in h)
    return others_full or not _direct(nbytes, lay.size)


#: Up to this many bytes a reduce whose root's host alone holds several ranks stays flat
#: (each other host sends one copy either way; two-level only adds a barrier).
HIER_REDUCE_ALONE_MAX_BYTES = 16 << 10


def _reduce_two_level(nbytes: int, lay: hier.Layout, root: int) -> bool:
    """Whether a reduce to group rank ``root`` runs two-level."""
    others_full = any(len(h) > 1 for h in lay.hosts if root not in h)
    return others_full or nbytes > HIER_REDUCE_ALONE_MAX_BYTES


#: From this many bytes (the whole buffer) a group on two hosts reduce-scatters two-level.
HIER_SCATTER_MIN_BYTES = 1 << 20


#: An all_gather of rows up to HIER_GATHER_FLAT_MAX_BYTES runs two-level only where that
#: keeps more than HIER_GATHER_SAVES_BYTES off the busiest host's link than the flat one
#: (:func:`flat_gather_rows_in`); larger rows always do.
HIER_GATHER_FLAT_MAX_BYTES = 32 << 10
HIER_GATHER_SAVES_BYTES = 48 << 10


def flat_gather_rows_in(lay: hier.Layout, doubling: bool) -> int:
    """Rows the flat small all_gather carries into the busiest host: the direct
    exchange's every row to every rank, or what doubling's rounds (r ^ k) cross."""
    return _flat_gather_rows_in(lay.hosts, doubling)


@functools.lru_cache(maxsize=64)
def _flat_gather_rows_in(hosts: tuple[tuple[int, ...], ...], doubling: bool) -> int:
    host_of = {r: x for x, rs in enumerate(hosts) for r in rs}
    n = len(host_of)
    into = [0] * len(hosts)
    if doubling:
        k = 1
        while k < n:
            for r in range(n):
                if host_of[r ^ k] != host_of[r]:
                    into[host_of[r]] += k
            k <<= 1
    else:
        for r in range(n):
            into[host_of[r]] += n - len(hosts[host_of[r]])
    return max(into)


def _all_gather_two_level(nbytes: int, lay: hier.Layout, plane: Any) -> bool:
    """Whether an all_gather of parts of ``nbytes`` runs two-level."""
    n = lay.size
    if nbytes <= HIER_GATHER_FLAT_MAX_BYTES and _direct(nbytes, n):
        flat_in = flat_gather_rows_in(lay, _doubling(nbytes, n, plane))
        two_in = n - min(len(h) for h in lay.hosts)  # each other host's rows, once
        if (flat_in - two_in) * nbytes <= HIER_GATHER_SAVES_BYTES:
            return False
    return True
