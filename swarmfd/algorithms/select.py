"""The selection table: one place decides which algorithm a call runs.

Each function takes what the choice depends on (the plane's capabilities, the buffer's
bytes, the group's size and shape, the root) and returns a :class:`Choice`: the
algorithm, the extra arguments it takes, and whether it reduces :class:`~.base.Parts`
(several arrays where they are). A call's schedule (:mod:`swarmfd.call`) asks once and
keeps the answer. Planes are chosen by capability (:class:`swarmfd.comm.plane.Plane`:
``shares_memory``, ``io_thread``, ``reads_peers``), never by name. Thresholds and the
measurements behind them: docs/algorithms.md.

A group that spans hosts may take the two-level algorithms (:mod:`.hier`) instead of
the flat TCP ones: :func:`two_level_layout` says whether it can (the same answer on
every member); the functions below take its ``two`` (layout, shared-memory plane) and
pick the two-level algorithm where it wins.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..comm import wire
from ..comm.planes.shm import SEGMENT_BYTES
from . import hier, shm, tcp

__all__ = [
    "ALL_GATHER_V_INLINE_BYTES",
    "DIRECT_MAX_BYTES",
    "DIRECT_MAX_WORLD",
    "HIER_FAN_FLAT_MAX_BYTES",
    "HIER_GATHER_FLAT_MAX_BYTES",
    "HIER_GATHER_SAVES_BYTES",
    "HIER_REDUCE_ALONE_MAX_BYTES",
    "HIER_SCATTER_MIN_BYTES",
    "HIER_SMALL_BYTES",
    "PAIR_MAX_BYTES",
    "SHM_CMA_MIN_BYTES",
    "SHM_ONE_ROUND_MAX_BYTES",
    "Choice",
    "all_gather",
    "all_gather_counts",
    "all_gather_parts",
    "all_reduce",
    "all_to_all",
    "all_to_all_splits",
    "barrier",
    "broadcast",
    "flat_gather_rows_in",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "small_fan",
    "split_rows",
    "two_level_layout",
]

#: Two ranks all-reduce up to this many bytes as one message each way (the pair
#: exchange); above it the ring's pipelined pieces win (docs/algorithms.md).
PAIR_MAX_BYTES = wire.PIECE_BYTES
#: Up to this many bytes, all_reduce, reduce, broadcast, all_gather and reduce_scatter
#: over messages use a direct exchange (one hop instead of 2(N-1) for the ring) ...
DIRECT_MAX_BYTES = 256 << 10
#: ... in groups up to this size (the direct exchange sends N-1 copies).
DIRECT_MAX_WORLD = 8
#: Up to this many bytes a shared-memory all_reduce runs in one round, every rank
#: reducing all of it (one barrier); above it each rank reduces its 1/N.
SHM_ONE_ROUND_MAX_BYTES = shm.SMALL_BYTES
#: From this many bytes a shared-memory all_reduce reads and writes the peers' buffers
#: directly (cross-memory attach) where the host allows it.
SHM_CMA_MIN_BYTES = shm.CMA_MIN_BYTES

Algo = Callable[..., Any]


@dataclass(frozen=True)
class Choice:
    """What the table picked: ``algo(op, buf, ..., *args)`` runs the call; ``parts``:
    it takes :class:`~.base.Parts` too (reduces several arrays where they are)."""

    name: str
    algo: Algo
    args: tuple[Any, ...] = ()
    parts: bool = False


def _direct(nbytes: int, size: int) -> bool:
    return nbytes <= DIRECT_MAX_BYTES and size <= DIRECT_MAX_WORLD


def _doubling(nbytes: int, size: int, plane: Any) -> bool:
    """Recursive doubling instead of the direct exchange: a power-of-two group from 4,
    not where an I/O thread makes each hop cost more than a message saves
    (docs/algorithms.md), and its last round's message (N/2 buffers) within a
    message's limit."""
    return (not plane.io_thread and size >= 4 and size & (size - 1) == 0
            and size // 2 * nbytes <= wire.MAX_PAYLOAD)


def all_reduce(plane: Any, nbytes: int, size: int, count: int, two: Any = None,
               arrays: int = 1) -> Choice:
    """The all_reduce of ``count`` items (``nbytes``) among ``size`` ranks on ``plane``
    (``arrays``: how many arrays a Parts buffer holds). Algorithms take
    ``(op, buf, ufunc, divide, *args)``.

    Shared memory: one round up to SHM_ONE_ROUND_MAX_BYTES; cross-memory attach from
    SHM_CMA_MIN_BYTES where the peers' memory can be read; rounds of chunks otherwise.
    Messages: two-level where the group's shape makes it win, else the pair exchange
    (two ranks), recursive doubling or the direct exchange (small), the ring (large)."""
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
    from .base import split

    return split(rows, parts)


def reduce_scatter(plane: Any, nbytes: int, size: int, two: Any = None) -> Choice:
    """``nbytes``: the whole input (every rank's part of it together). Algorithms take
    ``(op, buf, out, parts, ufunc, divide, *args)``; every flat one reads Parts."""
    if plane.shares_memory:
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
    """The all_gather of every rank's splits an uneven all_to_all runs first (None:
    none): where the receiving rows are not given, or where the exchange of the parts
    reads every rank's splits (shared memory's windows)."""
    if equal or (out_known and not plane.shares_memory):
        return None
    return all_gather(plane, 8 * size, size)


def barrier(plane: Any) -> Choice:
    """Dissemination on every plane (records on shared memory): ``(op, tag)``."""
    return Choice("barrier", tcp.barrier, (0,))


#: An uneven all_gather's part (one rank's rows) of at most this many bytes travels with
#: its row count, in one round (:func:`.tcp.all_gather_counts`); a larger one is announced
#: by its count, then all parts move by the table (two rounds).
ALL_GATHER_V_INLINE_BYTES = 64 << 10


def all_gather_counts(plane: Any, size: int) -> Choice:
    """The one-round exchange of an uneven all_gather's counts (with the rows that fit):
    shared memory's through one slot; over messages recursive doubling where the even
    all_gather takes it (its last round's messages within a message's limit), else the
    direct exchange. Algorithms take ``(op, count, flat, row_nbytes, *args)`` and
    return (counts, parts)."""
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
    """The second round of an uneven all_gather (the parts that did not travel with
    their counts; ``largest``: the largest part's bytes). Algorithms take ``(op, flat,
    out, bounds, *args)``. Parts of one size go two-level where the even all_gather
    would; else shared memory's through the slots, or over messages the direct exchange
    where the even table picks a small all_gather, the ring otherwise."""
    if plane.shares_memory:
        return Choice("shm.all_gather_v", shm.all_gather_v)
    if equal and two is not None and _all_gather_two_level(largest, two[0], plane):
        return Choice("hier.all_gather_v", hier.all_gather_v, two)
    direct = _direct(largest, size) and largest <= wire.PIECE_BYTES
    return Choice("tcp.all_gather_v", tcp.all_gather_v, (None, direct))


# -- two-level (hier.py) ------------------------------------------------------------------

#: Up to this many bytes the two-level all_reduce sends whole host partials between
#: hosts (one barrier, one network hop; at most a slot); above it the sharded pipeline.
#: The small path puts L copies of S on each link, the pipeline S: above this the
#: pipeline was as fast or faster (docs/algorithms.md).
HIER_SMALL_BYTES = 64 << 10


def two_level_layout(hosts: Sequence[str], domains: Sequence[int], me: int,
                     mode: str) -> hier.Layout | None:
    """The layout of a group whose group rank g runs on ``hosts[g]`` in shared-memory
    plane ``domains[g]`` (its lowest world rank, -1 for none), as group rank ``me``
    sees it, when its calls may run two-level; else None.

    Two-level when ``mode`` is "auto", the group spans hosts, some host holds several
    of its ranks, and on every such host they all share one shared-memory plane.
    Everything here is known alike to every member (init shares the planes).
    """
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


#: Up to this many bytes an all_reduce runs flat where the flat one is recursive doubling
#: (log2 N messages a rank) and the two-level small one would make some rank exchange
#: host partials with more peers than that (:func:`small_fan`: a host of one rank
#: beside a host of three exchanges with all three, and waits for them behind their
#: barrier; docs/algorithms.md).
HIER_FAN_FLAT_MAX_BYTES = 16 << 10


def small_fan(lay: hier.Layout) -> int:
    """The most peers any rank sends its host partial to in the two-level small
    all_reduce: local index i of a host of L ranks sends to the ranks k = i, i + L, ...
    of every other host (local index 0 the most)."""
    return _small_fan(lay.hosts)


@functools.lru_cache(maxsize=64)
def _small_fan(hosts: tuple[tuple[int, ...], ...]) -> int:
    # (Cached, as _flat_gather_rows_in: asked again by every small call of a group.)
    sizes = [len(rs) for rs in hosts]
    return max(sum(-(-other // size) for y, other in enumerate(sizes) if y != x)
               for x, size in enumerate(sizes))


def _all_reduce_two_level(nbytes: int, two: Any, plane: Any) -> Choice | None:
    """The two-level all_reduce of ``nbytes`` on the TCP ``plane`` (``two``: the
    group's layout and shared-memory plane), or None for the flat one (see
    HIER_FAN_FLAT_MAX_BYTES)."""
    lay = two[0]
    if nbytes <= HIER_FAN_FLAT_MAX_BYTES:
        n = lay.size
        if _doubling(nbytes, n, plane) and small_fan(lay) > n.bit_length() - 1:
            return None
    if nbytes <= min(HIER_SMALL_BYTES, SEGMENT_BYTES):
        return Choice("hier.all_reduce_small", hier.all_reduce_small, tuple(two))
    # More than two hosts: each shard among its owners by the flat table.
    return Choice("hier.all_reduce_large", hier.all_reduce_large,
                  (*two, functools.partial(all_reduce, plane)))


def _broadcast_two_level(nbytes: int, lay: hier.Layout, root: int) -> bool:
    """Whether a broadcast of ``nbytes`` from group rank ``root`` runs two-level.

    A small broadcast (the flat one is then the direct send: one hop from the root to
    every rank) stays flat when no other host than the root's holds several of the
    group's ranks: the direct send then puts one copy on each other host's link anyway,
    and the two-level one only adds its shared-memory stage (docs/algorithms.md).
    """
    others_full = any(len(h) > 1 for h in lay.hosts if root not in h)
    return others_full or not _direct(nbytes, lay.size)


#: Up to this many bytes a reduce whose root's host is the only one holding several of
#: the group's ranks stays flat (the direct send: every other host's single rank sends
#: one copy over its link either way, and the two-level reduce only adds the barrier
#: inside the root's host); above it the placements disagree (docs/algorithms.md).
HIER_REDUCE_ALONE_MAX_BYTES = 16 << 10


def _reduce_two_level(nbytes: int, lay: hier.Layout, root: int) -> bool:
    """Whether a reduce of ``nbytes`` to group rank ``root`` runs two-level (see
    HIER_REDUCE_ALONE_MAX_BYTES)."""
    others_full = any(len(h) > 1 for h in lay.hosts if root not in h)
    return others_full or nbytes > HIER_REDUCE_ALONE_MAX_BYTES


#: From this many bytes (the whole buffer) a group on two hosts reduce-scatters
#: two-level (:func:`hier.reduce_scatter`); below it, and on more hosts, flat
#: (docs/algorithms.md).
HIER_SCATTER_MIN_BYTES = 1 << 20


#: An all_gather of rows up to HIER_GATHER_FLAT_MAX_BYTES runs two-level only when that
#: keeps more than HIER_GATHER_SAVES_BYTES off the busiest host's link (into it, one
#: way) than the flat one (:func:`flat_gather_rows_in`): below that the flat one's
#: network round beats the two-level one's round plus its barrier inside the host,
#: above it the link decides. Larger rows always run two-level (docs/algorithms.md).
HIER_GATHER_FLAT_MAX_BYTES = 32 << 10
HIER_GATHER_SAVES_BYTES = 48 << 10


def flat_gather_rows_in(lay: hier.Layout, doubling: bool) -> int:
    """Rows the flat small all_gather carries into the busiest host over its link: the
    direct exchange sends every row to every rank; recursive doubling (rank r swaps its
    block of k rows with rank r ^ k, k = 1, 2, 4, ...) only what its rounds cross."""
    return _flat_gather_rows_in(lay.hosts, doubling)


@functools.lru_cache(maxsize=64)
def _flat_gather_rows_in(hosts: tuple[tuple[int, ...], ...], doubling: bool) -> int:
    # (Cached: a group's calls ask again for the same hosts; the loops cost about as much
    # as a small call's selection otherwise.)
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
    """Whether an all_gather of parts of ``nbytes`` (one rank's) on the TCP ``plane``
    runs two-level (see HIER_GATHER_FLAT_MAX_BYTES)."""
    n = lay.size
    if nbytes <= HIER_GATHER_FLAT_MAX_BYTES and _direct(nbytes, n):
        flat_in = flat_gather_rows_in(lay, _doubling(nbytes, n, plane))
        two_in = n - min(len(h) for h in lay.hosts)  # each other host's rows, once
        if (flat_in - two_in) * nbytes <= HIER_GATHER_SAVES_BYTES:
            return False
    return True
