"""The two-level algorithms (swarmfd/algorithms/hier.py), in-process on simulated hosts.

Thread-ranks with a memory plane to every rank (the "TCP" between hosts) and real
shared memory among the ranks of each simulated host (tests/memplane.py run_hosts):
every collective, even and uneven hosts, two and three hosts, spread placements,
sizes around the rounds and shards, every dtype group, against numpy's answer (exact
for integers; floats bitwise identical on every rank). tests/test_hier_netsim.py runs
the public calls between real processes on simulated hosts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from swarmfd.algorithms import hier
from swarmfd.algorithms.base import Op
from swarmfd.comm import wire

from .memplane import run_hier_algorithm

#: Simulated hosts of each rank: even, spread (hosts interleaved in rank order), uneven
#: (3 + 1, 1 + 3, 4 + 2 where K=4 does not divide evenly), three hosts, 2 x 4.
HOSTS = {
    "2x2": [0, 0, 1, 1],
    "2x2-spread": [0, 1, 0, 1],
    "3+1": [0, 0, 0, 1],
    "1+3": [0, 1, 1, 1],
    "4+2-spread": [0, 1, 0, 0, 1, 0],
    "3+2+1": [0, 0, 1, 1, 2, 0],
    "3x2": [0, 0, 1, 1, 2, 2],
    "2x4": [0, 0, 0, 0, 1, 1, 1, 1],
}
DTYPES = [np.int8, np.int64, np.uint32, np.float16, np.float32, np.float64, np.complex128]
#: Element counts: empty, fewer than the shards, odd, and several rounds (float64: a
#: round is 131072 items per rank; with K shards each gets 131072 / K of them).
COUNTS = [0, 1, 3, 1001, 131072 * 2 + 5]


def _data(rank: int, count: int, dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(0, 50, count).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dt)
    return (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dt)


def _check_reduced(got: list[np.ndarray], inputs: list[np.ndarray], dtype: Any) -> None:
    for r in range(1, len(got)):
        assert got[r].tobytes() == got[0].tobytes(), f"rank {r} differs from rank 0 ({dtype})"
    want = sum(inputs[1:], start=inputs[0].copy())
    if np.dtype(dtype).kind in "iu":
        assert np.array_equal(got[0], want), dtype
    else:
        assert np.allclose(got[0], want, rtol=1e-2, atol=1e-2), dtype


def _all_reduce(kind: str, inputs: list[np.ndarray], hosts: list[int], **kw: Any) -> list[Any]:
    algo = hier.all_reduce_small if kind == "small" else hier.all_reduce_large

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        buf = inputs[op.me].copy()
        return algo(op, buf, np.add, lay, shm, **kw), lambda: buf

    return [r[0] for r in run_hier_algorithm(hosts, make)]


def test_layout() -> None:
    lay = hier.layout_of(["b", "a", "b", "c", "a"], 4)
    assert lay.hosts == ((0, 2), (1, 4), (3,))
    assert (lay.host, lay.local, lay.locals, lay.shards) == (1, 1, [1, 4], 2)
    assert lay.two_level()
    assert not hier.layout_of(["a", "b", "c"], 0).two_level()  # one rank per host
    assert not hier.layout_of(["a", "a"], 1).two_level()  # one host
    with pytest.raises(ValueError, match="bad layout"):
        hier.Layout(((0, 1), (1,)), 0)


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce_large(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    for dtype in DTYPES if count < 1000 else [np.int64, np.float32]:
        inputs = [_data(r, count, dtype) for r in range(len(hosts))]
        _check_reduced(_all_reduce("large", inputs, hosts), inputs, dtype)


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 1, 5, 1001, 32768])
def test_all_reduce_small(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    for dtype in DTYPES if count < 1000 else [np.uint32, np.float64]:
        inputs = [_data(r, count, dtype) for r in range(len(hosts))]
        _check_reduced(_all_reduce("small", inputs, hosts), inputs, dtype)


@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("round_bytes", [4096, 1 << 20])
def test_all_reduce_large_depth_and_rounds(depth: int, round_bytes: int) -> None:
    """The pipeline holds for any depth and round size (many small rounds: slots are
    reused while earlier rounds' results are still being copied out)."""
    for shape in ("2x2-spread", "3+1", "4+2-spread"):
        hosts = HOSTS[shape]
        inputs = [_data(r, 50_001, np.float32, seed=depth) for r in range(len(hosts))]
        got = _all_reduce("large", inputs, hosts, depth=depth, round_bytes=round_bytes)
        _check_reduced(got, inputs, np.float32)


def test_all_reduce_calls_in_a_row() -> None:
    """Consecutive calls of both paths rotate through the slots without a rank
    overwriting what a slower one still reads."""
    hosts = HOSTS["4+2-spread"]
    sizes = [10, 70_000, 3, 300_000, 7, 40_000]
    inputs = [[_data(r, n, np.float64, seed=c) for c, n in enumerate(sizes)]
              for r in range(len(hosts))]

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        buf = inputs[op.me][call].copy()
        if buf.size < 50_000:
            return hier.all_reduce_small(op, buf, np.add, lay, shm), lambda: buf
        return hier.all_reduce_large(op, buf, np.add, lay, shm, round_bytes=65536), lambda: buf

    got = run_hier_algorithm(hosts, make, calls=len(sizes))
    for c in range(len(sizes)):
        _check_reduced([g[c] for g in got], [inp[c] for inp in inputs], np.float64)


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 3, 1001, 131072 * 2 + 5])
def test_broadcast(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    n = len(hosts)
    sig_for = {}
    for root in sorted({0, n - 1, n // 2}):
        inputs = [_data(r, count, np.int64, seed=root) for r in range(n)]
        sig_for[root] = wire.Signature(wire.Collective.BROADCAST, root=root)

        def make(op: Op, lay: hier.Layout, shm: Any, call: int, root: int = root,
                 inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return hier.broadcast(op, buf, root, lay, shm), lambda: buf

        for got in run_hier_algorithm(hosts, make, sig=sig_for[root]):
            assert np.array_equal(got[0], inputs[root])


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 3, 1001, 131072 * 2 + 5])
def test_reduce(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    n = len(hosts)
    for root in sorted({0, n - 1, n // 2}):
        inputs = [_data(r, count, np.int64, seed=root) for r in range(n)]

        def make(op: Op, lay: hier.Layout, shm: Any, call: int, root: int = root,
                 inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return hier.reduce(op, buf, root, np.add, lay, shm), lambda: buf

        got = run_hier_algorithm(hosts, make, sig=wire.Signature(wire.Collective.REDUCE,
                                                                 root=root))
        assert np.array_equal(got[root][0], sum(inputs[1:], start=inputs[0].copy()))
        for r in range(n):
            if r != root:
                assert np.array_equal(got[r][0], inputs[r]), f"rank {r}'s array changed"


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 1, 1001, 131072 + 3])
def test_all_gather(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    n = len(hosts)
    inputs = [_data(r, count, np.float32) for r in range(n)]

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        out = np.full((n, count), np.nan, np.float32)
        out[op.me] = inputs[op.me]
        return hier.all_gather(op, out, lay, shm), lambda: out

    for got in run_hier_algorithm(hosts, make, sig=wire.Signature(wire.Collective.ALL_GATHER)):
        assert np.array_equal(got[0], np.stack(inputs)), "rows out of place"


def test_progress_engine_drives_the_phases() -> None:
    """The same algorithms issued as async ops (swarmfd.engine): the engine waits on the
    plane of each receive (shared memory inside a host, TCP between), two calls of one
    group queued behind each other."""
    from types import SimpleNamespace

    from swarmfd.engine import Engine

    from .memplane import run_hosts

    hosts = HOSTS["3+1"]
    n = len(hosts)
    names = [f"host{h}" for h in hosts]
    inputs = [[_data(r, c, np.float32, seed=c) for r in range(n)] for c in (5, 300_001)]

    def fn(r: int, channel: Any, tcp: Any, shm: Any) -> Any:
        rounds = [0]

        def next_slot() -> int:
            from swarmfd.comm.planes import shm as shm_plane

            slot = (rounds[0] % shm_plane.SLOTS) * shm_plane.SEGMENT_BYTES
            rounds[0] += 1
            return slot

        lay = hier.layout_of(names, r)
        engine = Engine(channel, 10.0, lambda g, exc: None)
        group = SimpleNamespace(gid=0, broken=None)
        works, bufs = [], []
        sig = wire.Signature(wire.Collective.ALL_REDUCE)
        for call, algo in enumerate((hier.all_reduce_small, hier.all_reduce_large)):
            buf = inputs[call][r].copy()
            op = Op(channel, tcp, list(range(n)), r, 0, call + 1, sig, None, next_slot)
            works.append(engine.submit(group, op, algo(op, buf, np.add, lay, shm), f"#{call}"))
            bufs.append(buf)
        for w in works:
            w.wait(20)
        engine.close()
        return bufs

    got = run_hosts(fn, hosts)
    for call in range(2):
        _check_reduced([g[call] for g in got], inputs[call], np.float32)
