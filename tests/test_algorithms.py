"""Every algorithm, in-process: thread-ranks over an in-memory plane and real shared memory.

Each algorithm of :mod:`swarmfd.algorithms` (all_reduce, broadcast, reduce, all_gather and
its uneven form, barrier, reduce_scatter, all_to_all, gather, scatter) runs for group
sizes 1-5 (where it applies),
sizes around its pieces and rounds, every dtype group, against the sum of the inputs:
exact for integers; for floats to float precision (tests/support/reference.py) and bitwise
identical on every rank. No process is
spawned: these are the algorithms' logic; tests/test_collectives.py runs the public
calls on real planes between real processes.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from swarmfd.algorithms import select, shm, tcp
from swarmfd.algorithms.base import FLUSH, Op, Parts, complete, divide_by, run
from swarmfd.comm import wire
from swarmfd.comm.channel import Channel
from swarmfd.comm.planes.shm import SEGMENT_BYTES

from .support.memplane import Fabric, run_algorithm, run_threads, sample_data
from .support.reference import assert_sum

DTYPES = [np.int8, np.int64, np.uint32, np.float16, np.float32, np.float64, np.complex128]
#: Element counts around the edges: empty, fewer than ranks, a piece, several pieces and
#: rounds (1 MiB pieces and shared-memory rounds; float64: 131072 per MiB).
COUNTS = [0, 1, 3, 1000, 131072, 131072 * 2 + 5]
SIZES = [2, 3, 4, 5]


def selected_all_reduce(op: Op, buf: np.ndarray | Parts, ufunc: np.ufunc = np.add,
                        divide: int = 0) -> Any:
    """The all_reduce the selection table picks for ``buf`` on ``op``'s plane (on shared
    memory one round, rounds or cross-memory attach, by size and by what the plane can
    do), with ``divide`` (a mean)."""
    arrays = len(buf.arrays) if isinstance(buf, Parts) else 1
    choice = select.all_reduce(op.plane, buf.nbytes, op.size, buf.size, arrays=arrays)
    return choice.algo(op, buf, ufunc, divide, *choice.args)


@pytest.fixture(autouse=True)
def _cross_memory_from_256_kib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planes that read each other's memory do it from 256 KiB here (4 MiB in a job):
    the sizes of these tests (up to 2 MiB a rank) then take that path too."""
    monkeypatch.setattr(shm, "CMA_MIN_BYTES", 1 << 18)
    monkeypatch.setattr(select, "SHM_CMA_MIN_BYTES", 1 << 18)


ALL_REDUCE = {
    "pair": lambda op, buf: tcp.all_reduce_pair(op, buf, np.add),
    "direct": lambda op, buf: tcp.all_reduce_direct(op, buf, np.add),
    "doubling": lambda op, buf: tcp.all_reduce_doubling(op, buf, np.add),
    "doubling-by-host": lambda op, buf: tcp.all_reduce_doubling(
        op, buf, np.add, ring=[(2 * i + 1) % op.size for i in range(op.size // 2)]
        + [(2 * i) % op.size for i in range(op.size // 2)] if op.size > 2 else None),
    "ring": lambda op, buf: tcp.all_reduce_ring(op, buf, np.add),
    "ring-by-host": lambda op, buf: tcp.all_reduce_ring(op, buf, np.add,
                                                        ring=list(reversed(range(op.size)))),
    "selected": selected_all_reduce,
    "shm": selected_all_reduce,
    "shm-cma": selected_all_reduce,
}


@pytest.mark.parametrize(("algo", "n"), [(a, n) for a in ALL_REDUCE for n in SIZES
                                         if (a != "pair" or n == 2)  # pair: two ranks only
                                         and (not a.startswith("doubling")
                                              or n & (n - 1) == 0)])  # powers of two
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce(algo: str, n: int, count: int) -> None:
    for dtype in DTYPES if count < 1000 else [np.int64, np.float32]:
        biggest = count * np.dtype(dtype).itemsize * (n // 2 if "doubling" in algo else 1)
        if algo in ("pair", "direct", "doubling", "doubling-by-host") and \
                biggest > wire.MAX_PAYLOAD:
            continue  # one message each way: the selection table never picks them here
        inputs = [sample_data(r, count, dtype) for r in range(n)]

        def make(op: Op, inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return ALL_REDUCE[algo](op, buf), lambda: buf

        got = run_algorithm(n, make, plane=algo if algo.startswith("shm") else "memory")
        for r in range(1, n):
            assert got[r].tobytes() == got[0].tobytes(), f"rank {r} differs ({dtype})"
        assert_sum(got[0], inputs, what=dtype)


def _parts_inputs(n: int, counts: list[int]) -> list[list[np.ndarray]]:
    """Each rank's arrays (float64) of ``counts`` items."""
    return [[sample_data(r * 10 + i, c, np.float64) for i, c in enumerate(counts)]
            for r in range(n)]


def _all_reduce_makers(inputs: list[list[np.ndarray]], divide: bool,
                       call: Callable[[Op, Any, int], Any]) -> tuple[Any, Any, Any]:
    """Makers (for run_algorithm) of one all_reduce of each rank's arrays by
    ``call(op, buf, divide)``: fused into one buffer, divided after; fused, divided by
    the algorithm; and as Parts, divided by the algorithm. Each gives the whole."""
    n = len(inputs)

    def fused(op: Op) -> Any:
        buf = np.concatenate(inputs[op.me])
        algo = call(op, buf, 0)

        def result() -> np.ndarray:
            if divide:
                np.divide(buf, n, out=buf)
            return buf
        return algo, result

    def fused_divided(op: Op) -> Any:
        buf = np.concatenate(inputs[op.me])
        return call(op, buf, n if divide else 0), lambda: buf

    def parts(op: Op) -> Any:
        arrays = [a.copy() for a in inputs[op.me]]
        return call(op, Parts(arrays), n if divide else 0), lambda: np.concatenate(arrays)

    return fused, fused_divided, parts


def _reduce_scatter_case(n: int, counts: list[int], divide: bool, plane: str,
                         call: Callable[[Op, Any, Any, np.ndarray, int], Any]) -> None:
    """One reduce_scatter by ``call(op, buf, bounds, out, divide)`` of each rank's
    arrays (padded to split in equal parts), as Parts and as their fused buffer
    (divided by the algorithm), has each rank's part of the fused buffer's
    reduce_scatter divided after, bit for bit; the inputs are left unchanged."""
    counts = [*counts, -sum(counts) % n] if sum(counts) % n else counts
    inputs = _parts_inputs(n, [c for c in counts if c])
    total = sum(counts)
    bounds = [(r * total // n, (r + 1) * total // n) for r in range(n)]

    def make(op: Op, as_parts: bool, algo_divides: bool) -> Any:
        arrays = inputs[op.me]
        buf = Parts(arrays) if as_parts else np.concatenate(arrays)
        a, b = bounds[op.me]
        out = np.empty(b - a)
        algo = call(op, buf, bounds, out, n if divide and algo_divides else 0)

        def result() -> np.ndarray:
            if divide and not algo_divides:
                np.divide(out, n, out=out)
            return out
        return algo, result

    want = run_algorithm(n, lambda op: make(op, False, False), plane=plane)
    before = [np.concatenate(x).tobytes() for x in inputs]
    for as_parts in (True, False):
        got = run_algorithm(n, lambda op, p=as_parts: make(op, p, True), plane=plane)
        for r in range(n):
            assert got[r].tobytes() == want[r].tobytes(), f"rank {r}"
            assert np.concatenate(inputs[r]).tobytes() == before[r], "an input changed"
    whole = [np.concatenate(x) for x in inputs]
    for r, (a, b) in enumerate(bounds):
        assert_sum(want[r], [x[a:b] for x in whole], n if divide else 0, what=f"rank {r}")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("counts", [[1], [3, 1], [700, 1, 299], [40000, 3, 90000],
                                    [131072, 131072, 5], [300000, 17, 200000]])
@pytest.mark.parametrize("divide", [False, True])
def test_shm_all_reduce_of_parts_is_that_of_the_fused_buffer(n: int, counts: list[int],
                                                             divide: bool) -> None:
    """Several arrays reduced as one (Parts: no staging copy; a mean divided in the
    algorithm) give the bits of their fused buffer reduced, then divided, on every rank:
    parts across the boundaries of chunks and of rounds (a round is 131072 float64s),
    small and large paths; the arrays hold the result, in place."""
    inputs = _parts_inputs(n, counts)
    fused, _, parts = _all_reduce_makers(
        inputs, divide, lambda op, buf, d: selected_all_reduce(op, buf, np.add, d))

    want = run_algorithm(n, fused, plane="shm")
    got = run_algorithm(n, parts, plane="shm")
    # Reading the peers' memory (from 256 KiB): the arrays as they are give the bits of
    # their fused buffer too (the same chunks and order; at N=2 the segment algorithm's
    # bits, whose chunks follow its rounds: N=3 adds in another order there).
    got_cma = run_algorithm(n, parts, plane="shm-cma")
    fused_cma = run_algorithm(n, fused, plane="shm-cma")
    for r in range(n):
        assert got[r].tobytes() == want[0].tobytes(), f"rank {r}"
        assert got_cma[r].tobytes() == fused_cma[0].tobytes(), f"rank {r} (cma, parts)"
        assert fused_cma[r].tobytes() == fused_cma[0].tobytes(), f"rank {r} (cma)"
        if n == 2:
            assert got_cma[r].tobytes() == want[0].tobytes(), f"rank {r} (cma, N=2)"
    whole = [np.concatenate(x) for x in inputs]
    assert_sum(got[0], whole, n if divide else 0)
    assert_sum(got_cma[0], whole, n if divide else 0, what="cma")


def _drive(op: Op, algo: Any, on_plane: bool) -> Any:
    """Drive ``algo`` to its end as a blocking call does (:func:`run`: a receive looks for
    its message on the plane first) or (``on_plane`` False) with every receive the
    channel's own, as the progress engine completes them (:func:`complete`)."""
    if on_plane:
        return run(op, algo)
    try:
        req = algo.send(None)
        while True:
            if req is FLUSH:
                op.channel.flush()
            req = algo.send(complete(req))
    except StopIteration as stop:
        return stop.value


def _rank_order(inputs: list[np.ndarray], divide: int) -> np.ndarray:
    """The inputs reduced in rank order (((x0 + x1) + x2) ...), then divided by
    ``divide`` as the algorithms divide (when not 0): the bits of every plane's small
    all_reduce."""
    acc = np.add(inputs[0], inputs[1]) if len(inputs) > 1 else inputs[0].copy()
    for x in inputs[2:]:
        np.add(acc, x, out=acc)
    if divide:
        divide_by(acc, divide)
    return acc


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_the_pair_exchange_meets_itself_driven_either_way_with_the_same_bits(
        dtype: Any) -> None:
    """Two ranks whose pair exchange is driven, call by call, one on the caller's thread
    (the plane's message taken where it is) and the other through the channel's
    receive (the engine's way) meet, and both get the bits of the rank-order sum, then
    of a mean divided by the algorithm as divide_by divides it."""
    sizes = [2, 1000, 70000]
    inputs = [[sample_data(r, count, dtype, seed=i) for i, count in enumerate(sizes)]
              for r in range(2)]
    sig = wire.Signature(wire.Collective.ALL_REDUCE)

    def fn(r: int, channel: Channel, plane: Any, mixed: bool) -> list[np.ndarray]:
        out = []
        for call, x in enumerate(inputs[r] * 2):
            buf = x.copy()
            divide = 2 if call >= len(sizes) and buf.dtype.kind == "f" else 0
            op = Op(channel, plane, [0, 1], r, 0, call + 1, sig)
            _drive(op, tcp.all_reduce_pair(op, buf, np.add, divide),
                   not (mixed and (r + call) % 2))
            channel.flush()
            out.append(buf)
        return out

    for mixed in (False, True):
        got = run_threads(fn, 2, mixed)
        for call in range(2 * len(sizes)):
            i = call % len(sizes)
            divide = 2 if call >= len(sizes) and np.dtype(dtype).kind == "f" else 0
            want = _rank_order([inputs[0][i], inputs[1][i]], divide)
            for r in range(2):
                assert got[r][call].tobytes() == want.tobytes(), f"rank {r}, call {call}"


@pytest.mark.parametrize("plane", ["memory", "shm"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_barrier_driven_either_way_meets_itself(plane: str, n: int) -> None:
    """Ranks whose barrier is driven, call by call, on the caller's thread or through
    the channel's receive meet on every plane; and neither lets a rank through before
    every member arrived (the last rank sets a flag before its barrier that every rank
    reads after its own)."""
    sig = wire.Signature(wire.Collective.BARRIER)
    arrived = [0] * 6

    def fn(r: int, channel: Channel, pl: Any) -> list[bool]:
        seen = []
        for call in range(6):
            if r == n - 1:
                time.sleep(0.01)
                arrived[call] = 1
            op = Op(channel, pl, list(range(n)), r, 0, call + 1, sig)
            _drive(op, tcp.barrier(op, 0), not (r + call) % 2)
            channel.flush()
            seen.append(bool(arrived[call]))
        return seen

    assert run_threads(fn, n, plane=plane) == [[True] * 6] * n


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_the_one_round_shm_all_reduce_meets_itself_driven_either_way_with_the_same_bits(
        n: int, dtype: Any) -> None:
    """The small shared-memory all_reduce (one round: the selection's choice up to
    SHM_ONE_ROUND_MAX_BYTES), driven call by call on the caller's thread or through the
    channel's receive on each rank: the ranks meet, and every rank gets the bits of
    the rank-order reduction (sum and mean; barriers of 1 to 3 rounds)."""
    sizes = [n, 1000, select.SHM_ONE_ROUND_MAX_BYTES // np.dtype(dtype).itemsize]
    inputs = [[sample_data(r, count, dtype, seed=i) for i, count in enumerate(sizes)]
              for r in range(n)]
    sig = wire.Signature(wire.Collective.ALL_REDUCE)

    def fn(r: int, channel: Channel, plane: Any, mixed: bool) -> list[np.ndarray]:
        rounds = [0]

        def next_slot() -> int:
            rounds[0] += 1
            return (rounds[0] % 3) * SEGMENT_BYTES

        out = []
        for call, x in enumerate(inputs[r] * 2):
            buf = x.copy()
            divide = n if call >= len(sizes) and buf.dtype.kind == "f" else 0
            op = Op(channel, plane, list(range(n)), r, 0, call + 1, sig, plane, next_slot)
            choice = select.all_reduce(plane, buf.nbytes, n, buf.size)
            assert choice.name == "shm.one_round", (buf.nbytes, choice)
            _drive(op, choice.algo(op, buf, np.add, divide), not (mixed and (r + call) % 2))
            channel.flush()
            out.append(buf)
        return out

    for mixed in (False, True):
        got = run_threads(fn, n, mixed, plane="shm")
        for call in range(2 * len(sizes)):
            i = call % len(sizes)
            divide = n if call >= len(sizes) and np.dtype(dtype).kind == "f" else 0
            want = _rank_order([inputs[r][i] for r in range(n)], divide)
            for r in range(n):
                assert got[r][call].tobytes() == want.tobytes(), f"rank {r}, call {call}"


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("counts", [[3, 3], [700, 1, 299, 1],
                                    [300000, 17, 3, 200000, 9000, 1, 131072]])
@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("handed_over", [False, True])
def test_tcp_ring_all_reduce_of_parts_is_that_of_the_fused_buffer(
        n: int, counts: list[int], divide: bool, handed_over: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The TCP ring reduces Parts where they are (pieces cut at the arrays' edges, small
    arrays travelling together), with the bits of their fused buffer reduced, then
    divided, on every rank; the owner's divide of a mean gives the bits of dividing
    the whole result; on a plane that copies payloads (a reused buffer) and on one that
    hands them over (zmq's frames)."""
    from .support.memplane import MemoryPlane

    monkeypatch.setattr(MemoryPlane, "zero_copy_recv", handed_over)
    inputs = _parts_inputs(n, counts)
    fused, fused_divided, parts = _all_reduce_makers(
        inputs, divide, lambda op, buf, d: tcp.all_reduce_ring(op, buf, np.add, divide=d))

    want = run_algorithm(n, fused)
    for got in (run_algorithm(n, parts), run_algorithm(n, fused_divided)):
        for r in range(n):
            assert got[r].tobytes() == want[0].tobytes(), f"rank {r}"
    assert_sum(want[0], [np.concatenate(x) for x in inputs], n if divide else 0)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize(("algo", "counts"), [
    (algo, counts) for algo in ("ring", "direct")
    for counts in ([3, 3], [700, 1, 299, 1], [300000, 17, 200000, 2])
    if algo == "ring" or sum(counts) < 1000])  # direct: small (one message a part)
def test_tcp_reduce_scatter_of_parts_is_that_of_the_fused_buffer(
        n: int, counts: list[int], divide: bool, algo: str) -> None:
    """The TCP reduce_scatters read their input where it is, an array or Parts, and
    never write it (no copy of the input per call): each rank's part has the bits of
    the fused buffer's reduce_scatter, then divided; pieces across arrays too."""
    fn = tcp.reduce_scatter_ring if algo == "ring" else tcp.reduce_scatter_direct
    _reduce_scatter_case(n, counts, divide, "memory",
                         lambda op, buf, bounds, out, d: fn(op, buf, out, bounds, np.add,
                                                            divide=d))


@pytest.mark.parametrize("counts", [[5], [3, 3], [700, 1, 299, 1], [200000, 17, 3, 9000, 1,
                                                                     131072, 8191, 8192]])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_pieces_of_parts_are_views_but_for_small_arrays(counts: list[int], n: int) -> None:
    """A ring's pieces of Parts cover each chunk in order, at most PIECE_BYTES each; a
    piece lies in one array (sent as its view) unless it gathers consecutive shares
    smaller than SMALL_SPAN_BYTES (copied); an array is its own view."""
    from swarmfd.algorithms import base

    arrays = [np.zeros(c) for c in counts]
    buf = Parts(arrays)
    chunks = base.split(buf.size, n)
    small = base.SMALL_SPAN_BYTES // 8
    for (a, b), pieces in zip(chunks, base.ring_pieces(buf, chunks), strict=True):
        assert [x for x, _ in pieces] == [a] + [y for _, y in pieces[:-1]]
        assert pieces[-1][1] == b
        for x, y in pieces:
            assert 0 < (y - x) * 8 <= base.PIECE_BYTES
            shares = [v - u for _, u, v in base.spans(buf, x, y)]
            if len(shares) > 1:
                assert all(s < small for s in shares), (x, y, shares)
            else:
                assert np.shares_memory(base.take(buf, x, y), arrays[
                    np.searchsorted(buf.starts, x, side="right") - 1])
    whole = np.arange(10.0)
    assert base.ring_pieces(whole, [(0, 5), (5, 10)]) == [[(0, 5)], [(5, 10)]]
    assert base.take(whole, 2, 4).base is whole


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("counts", [[3, 3], [700, 1, 299, 1], [300000, 17, 200000, 2]])
@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("algo", ["slots", "cma"])
def test_shm_reduce_scatter_of_parts_is_that_of_the_fused_buffer(n: int, counts: list[int],
                                                                 divide: bool,
                                                                 algo: str) -> None:
    """reduce_scatter reads Parts where they are: each rank's part has the bits of the
    fused buffer's reduce_scatter (then divided), across arrays, chunks and rounds; the
    input is left unchanged. Through the slots, and reading the peers' buffers directly
    (cross-memory attach, whose blocks cut the parts differently: the same bits)."""
    fn = shm.reduce_scatter if algo == "slots" else shm.reduce_scatter_cma
    _reduce_scatter_case(n, counts, divide, "shm" if algo == "slots" else "shm-cma",
                         lambda op, buf, bounds, out, d: fn(op, buf, out, bounds, np.add, d))


def _list_all_reduce(rank: int, world: int) -> list[np.ndarray]:
    import swarmfd as fd

    base = np.arange(300_000, dtype=np.float64) * (rank + 1)
    a, b = base[:200_000].copy(), base[200_000:].copy()
    c = np.full(7, rank, np.float32)
    strided = np.arange(40, dtype=np.float64)[::2] * (rank + 1)  # not contiguous
    fd.all_reduce([a, b, c, strided])
    d = base[:200_000].copy()
    fd.all_reduce([d, d], op="mean")  # the same array twice: reduced once, as staged
    e = [np.full(5, float(rank)), np.zeros(0), np.full(3, 2.0 * rank)]
    fd.all_reduce(e, op="mean")
    # reduce_scatter of arrays read where they are (DDP's buckets under ZeRO).
    from swarmfd._internal import reduce_scatter_parts

    part = reduce_scatter_parts([np.arange(4.0) + rank, np.zeros(0), np.full(2, 1.0)],
                                np.empty(2), op="mean")
    return [a, b, c, strided, d, *e, part]


@pytest.mark.parametrize("plane", ["shm", "memory"])
def test_a_list_all_reduce_in_place_and_staged(plane: str) -> None:
    """fd.all_reduce of a list: on shared memory the arrays are reduced where they are
    (Parts), over TCP through a staging buffer; the same answers either way, in place:
    several dtypes, a non-contiguous array, the same array twice, an empty one, means;
    and the reduce_scatter of arrays read where they are (reduce_scatter_parts)."""
    from .support.threadranks import run_api

    world = 3
    out = run_api(_list_all_reduce, world, plane=plane)
    ranks_sum = sum(range(1, world + 1))
    base = np.arange(300_000, dtype=np.float64)
    want = [base[:200_000] * ranks_sum, base[200_000:] * ranks_sum,
            np.full(7, sum(range(world)), np.float32), np.arange(40.0)[::2] * ranks_sum,
            base[:200_000] * ranks_sum / world, np.full(5, 1.0), np.zeros(0), np.full(3, 2.0)]
    whole = np.concatenate([np.arange(4.0) + 1.0, np.full(2, 1.0)])  # the mean of ranks
    for r in range(world):
        for i, (got, w) in enumerate(zip(out[r], [*want, whole[2 * r:2 * r + 2]],
                                         strict=True)):
            assert got.dtype == w.dtype and np.allclose(got, w), (r, i)
            if i < len(want):  # the same everywhere (the reduce_scatter: parts differ)
                assert got.tobytes() == out[0][i].tobytes(), (r, i)


@pytest.mark.parametrize("plane", ["memory", "shm"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_broadcast_and_reduce(plane: str, n: int, count: int) -> None:
    inputs = [sample_data(r, count, np.int64) for r in range(n)]
    for root in {0, n - 1, n // 2}:
        def make_b(op: Op, root: int = root) -> Any:
            buf = inputs[op.me].copy()
            choice = select.broadcast(op.plane, buf.nbytes, op.size, root)
            assert choice.name.startswith("shm." if plane == "shm" else "tcp.")
            algo = choice.algo(op, buf, root, *choice.args)
            return algo, lambda: buf

        for got in run_algorithm(n, make_b, plane=plane):
            assert np.array_equal(got, inputs[root])

        def make_r(op: Op, root: int = root) -> Any:
            buf = inputs[op.me].copy()
            choice = select.reduce(op.plane, buf.nbytes, op.size, root)
            assert choice.name.startswith("shm." if plane == "shm" else "tcp.")
            algo = choice.algo(op, buf, root, np.add, 0, *choice.args)
            return algo, lambda: buf

        got = run_algorithm(n, make_r, plane=plane)
        assert np.array_equal(got[root], sum(inputs[1:], start=inputs[0].copy()))
        for r in range(n):
            if r != root:
                assert np.array_equal(got[r], inputs[r]), "a non-root's array changed"


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("count", [1000, 65536])
def test_doubling_adds_in_rank_order_like_every_plane(count: int, n: int) -> None:
    """The recursive doubling all_reduce gives the bits of the direct exchange and of
    shared memory (float sums depend on their order: the planes must agree, so a job's
    results do not depend on where it runs)."""
    inputs = [sample_data(r, count, np.float32, seed=7) * np.float32(1 + r / 3) for r in range(n)]
    got = {}
    for algo in ("direct", "doubling", "doubling-by-host", "shm"):
        def make(op: Op, algo: str = algo) -> Any:
            buf = inputs[op.me].copy()
            return ALL_REDUCE[algo](op, buf), lambda: buf

        got[algo] = run_algorithm(n, make, plane="shm" if algo == "shm" else "memory")[0]
    for algo, arr in got.items():
        assert arr.tobytes() == got["direct"].tobytes(), algo


def _direct_with_views(algo: str, roots: tuple[int, ...]) -> tuple[list[str], int]:
    """The direct broadcast or reduce on thread-ranks where rank r takes ``roots[r]`` for
    the root (its signature says so): each rank's outcome ('ok' or the error's name),
    and the messages sent. A failing rank aborts to the others, as a blocking call does."""
    n = len(roots)
    fabric = Fabric(n)

    def fn(r: int, channel: Channel, pl: Any) -> str:
        sig = wire.Signature(wire.Collective.BROADCAST if algo == "broadcast" else
                             wire.Collective.REDUCE, wire.ReduceOp.SUM, 5, roots[r], 4, 0)
        op = Op(channel, pl, list(range(n)), r, 0, 1, sig)
        channel.begin(0, 1)  # as a collective does
        buf = np.arange(4, dtype=np.float64)
        gen = (tcp.broadcast_direct(op, buf, roots[r]) if algo == "broadcast" else
               tcp.reduce_direct(op, buf, roots[r], np.add))
        try:
            run(op, gen)
            channel.flush()
        except Exception as exc:
            channel.abort(exc, 0, 0)
            return type(exc).__name__
        return "ok"

    return run_threads(fn, n, group_timeout=20.0, fabric=fabric), fabric.sent


@pytest.mark.parametrize("algo", ["broadcast", "reduce"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_direct_broadcast_and_reduce_catch_every_root_disagreement(algo: str, n: int) -> None:
    """Every edge of the signature ring carries a message sent before its sender waits
    (a SIG, or a data message standing for it), so any disagreement over the root is a
    MismatchError on some rank at once, never a wait for the timeout (20 s here); the
    others are told (AbortedMismatchError), or had already finished their part (as with
    the SIG every rank sent before: in one run each, 38 of the 2168 ranks' outcomes of
    disagreeing calls were 'ok' with it and without). Agreeing ranks send 3(N-1) messages: the
    data, the acknowledgements and N-1 SIGs, the root's data to the next rank (broadcast)
    or the data of the rank before it (reduce) standing for the N-th."""
    for roots in itertools.product(range(n), repeat=n):
        t0 = time.monotonic()
        outcomes, sent = _direct_with_views(algo, roots)
        elapsed = time.monotonic() - t0
        if len(set(roots)) == 1:
            assert outcomes == ["ok"] * n and sent == 3 * (n - 1), (roots, outcomes, sent)
            continue
        assert "MismatchError" in outcomes, (roots, outcomes)
        assert set(outcomes) <= {"MismatchError", "AbortedMismatchError", "ok"}, (roots,
                                                                                outcomes)
        assert elapsed < 10, f"views {roots}: {elapsed:.1f} s, the timeout's work"


def _rings(n: int) -> list[list[int]]:
    """Ring orders of n ranks: rank order, reversed, and evens then odds (two hosts under
    Swarm's spread placement, ordered by host)."""
    return [list(range(n)), list(reversed(range(n))),
            list(range(0, n, 2)) + list(range(1, n, 2))]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 131072 * 2 + 5])
def test_chains_follow_the_ring_order(n: int, count: int) -> None:
    """The pipelined broadcast and reduce chains along any ring order, from every root:
    the root's array everywhere, the sum at the root, the others' arrays untouched."""
    inputs = [sample_data(r, count, np.int64) for r in range(n)]
    for ring in _rings(n):
        for root in range(n):
            def make_b(op: Op, root: int = root, ring: list[int] = ring) -> Any:
                buf = inputs[op.me].copy()
                return tcp.broadcast_chain(op, buf, root, ring), lambda: buf

            for got in run_algorithm(n, make_b):
                assert np.array_equal(got, inputs[root]), (ring, root)

            def make_r(op: Op, root: int = root, ring: list[int] = ring) -> Any:
                buf = inputs[op.me].copy()
                return tcp.reduce_chain(op, buf, root, np.add, ring=ring), lambda: buf

            got = run_algorithm(n, make_r)
            assert np.array_equal(got[root], sum(inputs[1:], start=inputs[0].copy())), (
                ring, root)
            for r in range(n):
                if r != root:
                    assert np.array_equal(got[r], inputs[r]), (ring, root, r)


@pytest.mark.parametrize(("algo", "n"), [(a, n) for a in ["direct", "doubling", "ring",
                                                              "ring-by-host", "shm"]
                                         for n in [*SIZES, 8]
                                         if a != "doubling" or n & (n - 1) == 0])
@pytest.mark.parametrize("count", COUNTS)
def test_all_gather(algo: str, n: int, count: int) -> None:
    if algo == "doubling":  # its last round is one message of N/2 rows: at most this
        count = min(count, wire.MAX_PAYLOAD // (4 * (n // 2)))
    inputs = [sample_data(r, count, np.float32) for r in range(n)]

    def make(op: Op) -> Any:
        out = np.empty((n, count), np.float32)
        out[op.me] = inputs[op.me]
        if algo == "shm":
            gen = shm.all_gather(op, out)
        elif algo == "direct":
            gen = tcp.all_gather_direct(op, out)
        elif algo == "doubling":
            gen = tcp.all_gather_doubling(op, out)
        else:
            gen = tcp.all_gather_ring(op, out, None if algo == "ring" else [1, 0, *range(2, n)])
        return gen, lambda: out

    for got in run_algorithm(n, make, plane="shm" if algo == "shm" else "memory"):
        assert np.array_equal(got, np.stack(inputs)), "rows out of place"


@pytest.mark.parametrize("plane", ["memory", "shm"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_barrier(plane: str, n: int) -> None:
    got = run_algorithm(n, lambda op: (tcp.barrier(op, 0), lambda: op.me), plane=plane)
    assert got == list(range(n))


# -- the rest of the collective set: reduce_scatter, all_to_all, gather, scatter, uneven
# all_gather, point to point -------------------------------------------------------------

#: Counts for the split collectives: empty, fewer than ranks, uneven parts, several
#: pieces (1 MiB) and shared-memory rounds per part.
SPLIT_COUNTS = [0, 1, 7, 1000, 131072 * 2 + 5]


REDUCE_SCATTER = {
    "direct": lambda op, buf, parts, out: tcp.reduce_scatter_direct(op, buf, out, parts,
                                                                    np.add),
    "ring": lambda op, buf, parts, out: tcp.reduce_scatter_ring(op, buf, out, parts, np.add),
    "ring-by-host": lambda op, buf, parts, out: tcp.reduce_scatter_ring(
        op, buf, out, parts, np.add, ring=list(reversed(range(op.size)))),
    "shm": lambda op, buf, parts, out: shm.reduce_scatter(op, buf, out, parts, np.add),
}


@pytest.mark.parametrize("algo", list(REDUCE_SCATTER))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", SPLIT_COUNTS)
def test_reduce_scatter(algo: str, n: int, count: int) -> None:
    """Rank r ends with the sum of part r (np.array_split's parts) of every rank's input."""
    for dtype in DTYPES if count < 1000 else [np.int64, np.float32]:
        if algo == "direct" and count * np.dtype(dtype).itemsize > wire.MAX_PAYLOAD:
            continue  # one message per part: the selection table never picks it here
        inputs = [sample_data(r, count, dtype) for r in range(n)]
        parts = select.split_rows(count, n)

        def make(op: Op, inputs: list[np.ndarray] = inputs, parts: Any = parts,
                 dtype: Any = dtype) -> Any:
            buf = inputs[op.me].copy()
            a, b = parts[op.me]
            out = np.full(b - a, 99, dtype)
            return REDUCE_SCATTER[algo](op, buf, parts, out), lambda: out

        got = run_algorithm(n, make, plane="shm" if algo == "shm" else "memory")
        for r, (a, b) in enumerate(parts):
            assert_sum(got[r], [x[a:b] for x in inputs], what=(r, dtype))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rings_give_the_same_bits_whether_pieces_land_in_a_reused_buffer_or_not(
        n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TCP rings receive each incoming piece into one reused buffer on a plane that
    would copy it into a new one (the socket plane), and take it as handed over on one
    that does not (zmq's frames): Op.recv_operand. Both give the right sums, bit for bit
    the same, over several pieces a step (and a shorter last one)."""
    from .support.memplane import MemoryPlane

    count = 3 * wire.PIECE_BYTES // 4 * n + 7  # float32: 3 pieces a part, uneven parts
    inputs = [sample_data(r, count, np.float32, seed=5) * np.float32(1 + r / 7)
              for r in range(n)]
    parts = select.split_rows(count, n)
    got: dict[bool, Any] = {}
    for handed_over in (False, True):
        monkeypatch.setattr(MemoryPlane, "zero_copy_recv", handed_over)

        def make_ar(op: Op, handed_over: bool = handed_over) -> Any:
            assert (op.scratch([[(0, 4)]], np.dtype(np.float32)) is None) is handed_over
            buf = inputs[op.me].copy()
            return tcp.all_reduce_ring(op, buf, np.add), lambda: buf

        def make_rs(op: Op) -> Any:
            buf = inputs[op.me].copy()
            a, b = parts[op.me]
            out = np.empty(b - a, np.float32)
            return tcp.reduce_scatter_ring(op, buf, out, parts, np.add), lambda: out

        got[handed_over] = (run_algorithm(n, make_ar), run_algorithm(n, make_rs))
    for handed_over, (ar, rs) in got.items():
        for r in range(n):
            assert_sum(ar[r], inputs, what=(handed_over, r))
            assert ar[r].tobytes() == ar[0].tobytes(), (handed_over, r)
            a, b = parts[r]
            assert_sum(rs[r], [x[a:b] for x in inputs], what=(handed_over, r))
    for r in range(n):
        assert got[False][0][r].tobytes() == got[True][0][r].tobytes()
        assert got[False][1][r].tobytes() == got[True][1][r].tobytes()


def _all_to_all_ranges(n: int, me: int, sends: list[list[int]]) -> tuple[Any, Any, Any]:
    """(send ranges in my buffer, recv ranges in my out, [start, stop) for me of each
    member's buffer) for send counts ``sends[src][dst]``."""
    def bounds(counts: list[int]) -> list[tuple[int, int]]:
        out, at = [], 0
        for c in counts:
            out.append((at, at + c))
            at += c
        return out

    mine_send = bounds(sends[me])
    mine_recv = bounds([sends[src][me] for src in range(n)])
    for_me = [bounds(sends[src])[me] for src in range(n)]
    return mine_send, mine_recv, for_me


@pytest.mark.parametrize(("plane", "n"), [
    *((plane, n) for plane in ("memory", "shm") for n in SIZES), ("memory", 8),
    *(("memory-doubling", n) for n in (2, 4, 8))])
@pytest.mark.parametrize("layout", ["small", "mixed", "large", "no-rows", "empty-rows"])
def test_all_gather_counts(plane: str, n: int, layout: str) -> None:
    """The counts of an uneven all_gather reach every rank in one round, with the rows
    of every part within the limit (a message's on TCP, a slot's on shared memory); a
    part over it comes as None (its rows follow later), on every rank alike. Over
    messages by the direct exchange and by recursive doubling (power-of-two groups);
    the rows returned are writable arrays of their own."""
    counts_algo = tcp.all_gather_counts_doubling if plane == "memory-doubling" else \
        tcp.all_gather_counts
    plane = "memory" if plane == "memory-doubling" else plane
    trailing = 0 if layout == "empty-rows" else 3
    # bytes: on TCP 5 rows of 3 float32 fit, 6 do not
    limit = 64 if plane == "memory" else SEGMENT_BYTES - shm.COUNT_BYTES
    fit = limit // 12
    counts = {"small": [fit - r % 5 for r in range(n)],
              "mixed": [2 if r % 2 else fit + 1 for r in range(n)],
              "large": [fit + 1 + r for r in range(n)],
              "no-rows": [0] * n,
              "empty-rows": [r + fit + 7 for r in range(n)]}[layout]
    inputs = [sample_data(r, counts[r] * trailing, np.float32, seed=9) for r in range(n)]

    def make(op: Op) -> Any:
        got: dict[str, Any] = {}

        def algo() -> Any:
            if plane == "shm":
                got["v"] = yield from shm.all_gather_counts(
                    op, counts[op.me], inputs[op.me], trailing * 4)
            else:
                got["v"] = yield from counts_algo(
                    op, counts[op.me], inputs[op.me], trailing * 4, limit)
        return algo(), lambda: got["v"]

    for r, (got_counts, parts) in enumerate(run_algorithm(n, make, plane=plane)):
        assert got_counts == counts, f"rank {r}"
        for p in range(n):
            if counts[p] * trailing * 4 <= limit:
                assert parts[p] is not None and parts[p].dtype == np.float32
                assert np.array_equal(parts[p], inputs[p]), f"rank {r}, part {p}"
                assert p == r or parts[p].flags.writeable, f"rank {r}, part {p}"
            else:
                assert parts[p] is None, f"rank {r}, part {p}"


@pytest.mark.parametrize("payload", [b"", b"\x01", (2).to_bytes(8, "little") + bytes(8),
                                     (-1).to_bytes(8, "little", signed=True),
                                     (1).to_bytes(8, "little")])
def test_all_gather_counts_refuses_a_message_of_the_wrong_length(payload: bytes) -> None:
    """A peer's message that is neither a count with exactly that many rows nor the
    count alone of rows over the limit (too short, rows missing, a negative count, a
    small part's count without its rows) is a ProtocolError naming the peer."""
    from swarmfd.errors import ProtocolError

    from .support.memplane import ThreadFailure

    def make(op: Op) -> Any:
        if op.me == 1:
            def liar() -> Any:
                op.send(0, 0, payload)
                yield from ()
            return liar(), lambda: None
        return tcp.all_gather_counts(op, 1, np.zeros(2, np.float32), 8, 64), lambda: None

    with pytest.raises(ThreadFailure) as info:
        run_algorithm(2, make, timeout=20)
    assert set(info.value.failures) == {0}
    assert ProtocolError.__name__ in info.value.failures[0]
    assert "rank 1 sent" in info.value.failures[0]


@pytest.mark.parametrize("payload", [
    pytest.param(b"", id="nothing"),
    pytest.param((0).to_bytes(8, "little"), id="one-part-of-two"),
    pytest.param((0).to_bytes(8, "little") * 3, id="three-parts-of-two"),
    pytest.param((0).to_bytes(8, "little") + (1).to_bytes(8, "little"), id="rows-missing"),
    pytest.param((0).to_bytes(8, "little") + (-3).to_bytes(8, "little", signed=True),
                 id="negative-count")])
def test_all_gather_counts_by_doubling_refuses_a_message_of_the_wrong_shape(
        payload: bytes) -> None:
    """In recursive doubling's second round at N=4 a message carries two parts, each a
    count and the rows that fit: one that holds fewer or more, or a part that breaks
    the rule, is a ProtocolError naming its sender (rank 3, rank 1's partner there)."""
    from swarmfd.errors import ProtocolError

    from .support.memplane import ThreadFailure

    def make(op: Op) -> Any:
        if op.me == 3:
            def liar() -> Any:
                op.send(2, 0, (0).to_bytes(8, "little"))  # round 1: a valid part
                yield op.recv(2, 0, wire.ANY_SIZE)
                op.send(1, 1, payload)
        return (liar() if op.me == 3 else
                tcp.all_gather_counts_doubling(op, 0, np.zeros(0, np.float32), 8, 64),
                lambda: None)

    with pytest.raises(ThreadFailure) as info:
        run_algorithm(4, make, timeout=20)
    assert 1 in info.value.failures, info.value.failures
    assert ProtocolError.__name__ in info.value.failures[1]
    assert "rank 3 sent" in info.value.failures[1]


def test_a_receive_of_any_size_takes_what_came() -> None:
    """Channel.recv with wire.ANY_SIZE returns a message of whatever size it has, live
    or from the stash; a fixed size still refuses another one."""
    from swarmfd.errors import ProtocolError

    sig = wire.Signature(wire.Collective.ALL_GATHER_V)

    def fn(r: int, ch: Channel, pl: Any) -> Any:
        if r == 1:
            for tag, body in ((0, b"abc"), (1, bytes(70000)), (2, b"xy")):
                ch.send(pl, 0, sig, 0, 1, tag, body)
            return None
        got = [bytes(ch.recv(pl, 1, sig, 0, 1, 1, wire.ANY_SIZE)),  # tag 0 is stashed
               bytes(ch.recv(pl, 1, sig, 0, 1, 0, wire.ANY_SIZE))]
        with pytest.raises(ProtocolError, match="announced 2 bytes"):
            ch.recv(pl, 1, sig, 0, 1, 2, 5)
        return got

    got = run_threads(fn, 2)[0]
    assert got == [bytes(70000), b"abc"]


@pytest.mark.parametrize("algo", ["pairwise", "shm"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", ["equal", "uneven", "some-empty", "large"])
def test_all_to_all(algo: str, n: int, layout: str) -> None:
    """Part j of rank i's buffer lands at part i of rank j's output, for equal parts,
    uneven ones, empty ones, and parts of several pieces and shared-memory windows."""
    rng = np.random.default_rng(n)
    if layout == "equal":
        sends = [[5] * n for _ in range(n)]
    elif layout == "uneven":
        sends = [[int(c) for c in rng.integers(1, 40, n)] for _ in range(n)]
    elif layout == "some-empty":
        sends = [[0 if (i + j) % 2 else 3 for j in range(n)] for i in range(n)]
    else:
        sends = [[131072 + 3 * i + j for j in range(n)] for i in range(n)]
    dtype = np.float64 if layout == "large" else np.int32
    inputs = [sample_data(i, sum(sends[i]), dtype, seed=3) for i in range(n)]

    def make(op: Op) -> Any:
        me = op.me
        send_r, recv_r, for_me = _all_to_all_ranges(n, me, sends)
        out = np.full(sum(sends[src][me] for src in range(n)), -1, dtype)
        buf = inputs[me].copy()
        if algo == "shm":
            gen = shm.all_to_all(op, buf, [sum(s) for s in sends], for_me, out, recv_r)
        else:
            gen = tcp.all_to_all_pairwise(op, buf, send_r, out, recv_r)
        return gen, lambda: out

    got = run_algorithm(n, make, plane="shm" if algo == "shm" else "memory")
    for j in range(n):
        want = np.concatenate([inputs[i][_all_to_all_ranges(n, i, sends)[0][j][0]:
                                         _all_to_all_ranges(n, i, sends)[0][j][1]]
                               for i in range(n)])
        assert np.array_equal(got[j], want), f"rank {j}"


@pytest.mark.parametrize("plane", ["memory", "shm"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 1000, 131072 * 2 + 5])
def test_gather_and_scatter(plane: str, n: int, count: int) -> None:
    """gather: the root holds every rank's row; scatter: every rank gets the root's row
    for it; other ranks' inputs are untouched, for every root."""
    inputs = [sample_data(r, count, np.float32, seed=5) for r in range(n)]
    chunks = np.stack([sample_data(r, count, np.float32, seed=6) for r in range(n)])
    for root in sorted({0, n - 1, n // 2}):
        def make_g(op: Op, root: int = root) -> Any:
            flat = inputs[op.me].copy()
            out = np.full((n, count), np.nan, np.float32) if op.me == root else None
            if out is not None:
                out[root] = flat
            gen = (shm.gather if plane == "shm" else tcp.gather_direct)(op, flat, out, root)
            return gen, lambda: (flat, out)

        for r, (flat, out) in enumerate(run_algorithm(n, make_g, plane=plane)):
            assert np.array_equal(flat, inputs[r])
            if r == root:
                assert np.array_equal(out, np.stack(inputs))

        def make_s(op: Op, root: int = root) -> Any:
            out = np.full(count, np.nan, np.float32)
            mine = chunks.copy() if op.me == root else None
            gen = (shm.scatter if plane == "shm" else tcp.scatter_direct)(op, mine, out, root)
            return gen, lambda: out

        for r, out in enumerate(run_algorithm(n, make_s, plane=plane)):
            assert np.array_equal(out, chunks[r]), f"rank {r}, root {root}"


@pytest.mark.parametrize(("algo", "rows"), [
    (a, r) for a in ("direct", "ring", "shm") for r in ("mixed", "one-empty", "large")
    if not (a == "direct" and r == "large")])  # direct: small parts only, one message each
@pytest.mark.parametrize("n", SIZES)
def test_all_gather_of_uneven_parts(algo: str, n: int, rows: str) -> None:
    """Every rank ends with every rank's part at its offset, whatever the part sizes."""
    if rows == "mixed":
        counts = [3 * r + 1 for r in range(n)]
    elif rows == "one-empty":
        counts = [0 if r == 1 else 4 for r in range(n)]
    else:
        counts = [131072 + 1000 * r for r in range(n)]
    assert algo != "direct" or max(counts) * 8 <= wire.PIECE_BYTES
    inputs = [sample_data(r, c, np.float64, seed=7) for r, c in enumerate(counts)]
    at, offsets = 0, []
    for c in counts:
        offsets.append((at, at + c))
        at += c

    def make(op: Op) -> Any:
        out = np.full(at, np.nan)
        flat = inputs[op.me]
        if algo == "shm":
            gen = shm.all_gather_v(op, flat, out, offsets)
        else:
            gen = tcp.all_gather_v(op, flat, out, offsets, None, algo == "direct")
        return gen, lambda: out

    want = np.concatenate(inputs)
    for r, got in enumerate(run_algorithm(n, make, plane="shm" if algo == "shm" else "memory")):
        assert np.array_equal(got, want), f"rank {r}"


def test_point_to_point_eager_and_rendezvous_in_order_per_tag() -> None:
    """Rank 0 sends eager messages on tags 1 and 2, then one of every size class
    (empty, eager, just above the eager limit, several pieces) on tag 3; rank 1 takes
    tag 2's before tag 1's: each (source, tag) is its own ordered stream, eager sends
    never wait for the receiver, and rendezvous sends complete once it receives."""
    from swarmfd.algorithms import p2p
    from swarmfd.algorithms.base import run

    big = [0, 5, p2p.EAGER_BYTES // 8 + 1, (3 << 20) // 8 + 3]
    msgs = {1: [sample_data(1, c, np.float64, seed=10 + i) for i, c in enumerate([3, 0, 7])],
            2: [sample_data(2, c, np.float64, seed=20 + i) for i, c in enumerate([4, 1])],
            3: [sample_data(3, c, np.float64, seed=30 + i) for i, c in enumerate(big)]}
    sig = wire.Signature(wire.Collective.P2P, dtype=wire.dtype_code(np.dtype(np.float64)))

    def fn(r: int, channel: Any, pl: Any) -> Any:
        got: dict[int, list[np.ndarray]] = {}
        for tag in (1, 2, 3) if r == 0 else (2, 1, 3):
            for seq, m in enumerate(msgs[tag]):
                op = Op(channel, pl, [0, 1], r, 0, 1, sig)
                if r == 0:
                    run(op, p2p.send(op, m, 1, seq, tag))
                else:
                    buf = np.full(m.size, np.nan)
                    run(op, p2p.recv(op, buf, 0, seq, tag))
                    got.setdefault(tag, []).append(buf)
        channel.flush()
        return got

    got = run_threads(fn, 2)[1]
    for tag, sent in msgs.items():
        assert len(got[tag]) == len(sent)
        for want, have in zip(sent, got[tag], strict=True):
            assert np.array_equal(want, have), f"tag {tag}"


# cross-memory attach ----------------------------------------------------------------------


def test_shm_all_reduce_reads_the_peers_memory_where_the_planes_agreed_it_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With cross-memory attach on, a large all_reduce reads the peers' buffers and
    writes its reduced chunk into them (and gives the sum); a small one, and planes
    without it, never do."""
    from swarmfd.comm import cma

    reads: list[int] = []
    writes: list[int] = []

    def counting(real: Any, into: list[int]) -> Any:
        def copy(pid: int, local: Any, remote: Any) -> None:
            if sum(n for _, n in local) > 16:  # not a probe (16 bytes, when planes start)
                into.append(pid)
            real(pid, local, remote)
        return copy

    monkeypatch.setattr(cma, "read", counting(cma.read, reads))
    monkeypatch.setattr(cma, "write", counting(cma.write, writes))
    n = 3
    for plane, count, want_reads in (("shm-cma", 1 << 17, True), ("shm-cma", 1000, False),
                                     ("shm", 1 << 17, False)):
        reads.clear()
        writes.clear()
        inputs = [sample_data(r, count, np.int64) for r in range(n)]

        def make(op: Op, inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return selected_all_reduce(op, buf), lambda: buf

        got = run_algorithm(n, make, plane=plane)
        for r in range(n):
            assert np.array_equal(got[r], sum(inputs)), (plane, count, r)
        assert bool(reads) is want_reads, (plane, count, len(reads))
        assert bool(writes) is want_reads, (plane, count, len(writes))
        if want_reads:
            assert set(reads) == set(writes) == {os.getpid()}  # thread-ranks: one process


@pytest.mark.parametrize("which", ["read", "write"])
def test_a_failed_read_of_a_peers_memory_names_the_peer(monkeypatch: pytest.MonkeyPatch,
                                                        which: str) -> None:
    """A peer whose memory cannot be read or written any more (it exited): PeerLostError
    naming it, not a bare OSError."""
    from swarmfd.comm import cma

    from .support.memplane import ThreadFailure

    real = getattr(cma, which)

    def gone(pid: int, local: Any, remote: Any) -> None:
        if sum(n for _, n in local) <= 16:
            real(pid, local, remote)  # the planes' probes, when they start
        else:
            raise OSError(errno.ESRCH, os.strerror(errno.ESRCH))

    monkeypatch.setattr(cma, which, gone)

    def make(op: Op) -> Any:
        buf = np.ones(1 << 17, np.float32)
        return selected_all_reduce(op, buf), lambda: buf

    with pytest.raises(ThreadFailure) as info:
        run_algorithm(2, make, plane="shm-cma", timeout=20)
    text = str(info.value)
    doing = {"read": "reading", "write": "writing"}[which]
    assert "PeerLostError" in text and f"{doing} rank" in text and "No such process" in text


def test_the_probe_refuses_a_pid_that_is_not_the_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_probes: a peer's published pid that names another process (another pid
    namespace) is refused, and so is one the kernel will not let this rank read, or
    write (the all_reduce writes its peers' buffers)."""
    from swarmfd.comm import cma
    from swarmfd.comm.channel import Channel

    from .support.memplane import shm_planes

    channels = [Channel(r, 2, 5.0) for r in range(2)]
    planes = shm_planes(2, channels)
    try:
        for pl in planes:
            pl.publish_probe()
        assert [pl.check_probes() for pl in planes] == ["", ""]
        with monkeypatch.context() as m:
            def refused(pid: int, local: Any, remote: Any) -> None:
                raise OSError(errno.EPERM, os.strerror(errno.EPERM))

            m.setattr(cma, "write", refused)
            assert "writing rank 1's memory failed" in planes[0].check_probes()
        assert planes[0].check_probes() == ""
        row = planes[1]._probe_row(1)
        row[0] = os.getppid()  # the same address in another process: other bytes
        verdict = planes[0].check_probes()
        assert "rank 1" in verdict and verdict, verdict
        row[0] = 0x7FFFFFF0  # no such process
        assert "rank 1's memory failed" in planes[0].check_probes()
        planes[0].enable_cma(False)
        assert planes[0].cma_pids is None
    finally:
        for pl in planes:
            pl.close()


def test_cross_memory_spans_and_reads_cut_at_every_boundary() -> None:
    """cma.spans gives the pieces of a byte range of buffers laid end to end (also
    across several and inside one); cma.read copies between sides cut differently, in
    batches of at most IOV_MAX pieces (this process reading itself)."""
    from swarmfd.comm import cma

    src = np.arange(3000, dtype=np.uint8)
    remote = [(src.ctypes.data + 2 * i, 2) for i in range(1500)]  # 1500 pieces of 2 bytes
    starts = cma.offsets(remote)
    assert starts[-1] == 3000
    assert cma.spans(remote, starts, 3, 8) == [(src.ctypes.data + 3, 1),
                                               (src.ctypes.data + 4, 2),
                                               (src.ctypes.data + 6, 2)]
    assert cma.spans(remote, starts, 4, 5) == [(src.ctypes.data + 4, 1)]
    assert cma.spans(remote, starts, 7, 7) == []
    dst = np.zeros(2999, np.uint8)
    local = [(dst.ctypes.data, 1000), (dst.ctypes.data + 1000, 1999)]
    cma.read(os.getpid(), local, cma.spans(remote, starts, 1, 3000))
    assert np.array_equal(dst, src[1:])
    with pytest.raises(ValueError, match="unequal"):
        cma.read(os.getpid(), local, remote)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_means_division_is_bit_for_bit_numpys(dtype: Any) -> None:
    """divide_by (every mean's last step) gives exactly np.divide(x, n)'s bits, for powers
    of two (where it multiplies by 1 / n) and other n, normal and subnormal values,
    zeros, infinities and NaNs alike."""
    from swarmfd.algorithms.base import divide_by

    rng = np.random.default_rng(7)
    info = np.finfo(dtype)
    x = np.concatenate([
        rng.standard_normal(4000) * rng.choice([1e-3, 1.0, 1e3], 4000),
        rng.uniform(0, 1, 500) * float(info.tiny) * 4,  # subnormal quotients
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max),
                  float(info.tiny), float(info.smallest_subnormal)]),
    ]).astype(dtype)
    for n in [*range(1, 18), 24, 32, 64, 100, 128, 1024, 2048, 3000, 4096]:
        want = np.divide(x, n)
        got = x.copy()
        divide_by(got, n)
        assert got.dtype == x.dtype
        assert np.array_equal(got.view(f"u{x.itemsize}"), want.view(f"u{x.itemsize}")), n
    ints = np.arange(10, dtype=np.float64)
    divide_by(ints, 4)
    assert list(ints) == [k / 4 for k in range(10)]


@pytest.mark.parametrize("ufunc", [np.add, np.multiply, np.minimum, np.maximum])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.bool_])
def test_reduce_in_order_gives_the_bits_of_copying_the_first_in(ufunc: Any, dtype: Any) -> None:
    """reduce_in_order (shared memory's reductions) combines operands 0 and 1 straight
    into ``out``: the same bits as copying operand 0 in and reducing the others into it,
    in order, for 1 to 5 operands, NaNs and infinities included; ``out`` shares no
    memory with them and they are left as they were."""
    from swarmfd.algorithms.base import reduce_in_order

    rng = np.random.default_rng(11)
    for n in range(1, 6):
        ops = [(rng.standard_normal(1000) * 100).astype(dtype) for _ in range(n)]
        if np.dtype(dtype).kind == "f":
            for k, special in enumerate([np.nan, np.inf, -np.inf, -0.0]):
                ops[k % n][k] = special
        before = [o.copy() for o in ops]
        want = ops[0].copy()
        out = np.empty_like(ops[0])
        with np.errstate(all="ignore"):  # float16 products overflow, as they may in a call
            for o in ops[1:]:
                ufunc(want, o, out=want)
            reduce_in_order(out, ops, ufunc)
        u = f"u{np.dtype(dtype).itemsize}"
        assert np.array_equal(out.view(u), want.view(u)), n
        assert all(np.array_equal(a.view(u), b.view(u)) for a, b in zip(ops, before, strict=True))
