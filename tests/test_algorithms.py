"""Every algorithm, in-process: thread-ranks over an in-memory plane and real shared memory.

Each algorithm of :mod:`swarmfd.algorithms` runs for group sizes 1-5 (where it applies),
sizes around its pieces and rounds, every dtype group, against numpy's own answer:
exact for integers, and bitwise identical on every rank for floats. No process is
spawned: these are the algorithms' logic; tests/test_collectives.py runs the public
calls on real planes between real processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from swarmfd.algorithms import select, shm, tcp
from swarmfd.algorithms.base import Op
from swarmfd.comm import wire

from .memplane import run_algorithm

DTYPES = [np.int8, np.int64, np.uint32, np.float16, np.float32, np.float64, np.complex128]
#: Element counts around the edges: empty, fewer than ranks, a piece, several pieces and
#: rounds (1 MiB pieces and shared-memory rounds; float64: 131072 per MiB).
COUNTS = [0, 1, 3, 1000, 131072, 131072 * 2 + 5]
SIZES = [2, 3, 4, 5]


def _data(rank: int, count: int, dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(0, 50, count).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dt)
    return (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dt)


def _tcp_all_reduce(op: Op, buf: np.ndarray) -> Any:
    algo = select.all_reduce("tcp", buf.nbytes, op.size, buf.size)
    return algo(op, buf, np.add)


ALL_REDUCE = {
    "pair": lambda op, buf: tcp.all_reduce_pair(op, buf, np.add),
    "direct": lambda op, buf: tcp.all_reduce_direct(op, buf, np.add),
    "ring": lambda op, buf: tcp.all_reduce_ring(op, buf, np.add),
    "ring-by-host": lambda op, buf: tcp.all_reduce_ring(op, buf, np.add,
                                                        list(reversed(range(op.size)))),
    "selected": _tcp_all_reduce,
    "shm": lambda op, buf: shm.all_reduce(op, buf, np.add),
}


@pytest.mark.parametrize("algo", list(ALL_REDUCE))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce(algo: str, n: int, count: int) -> None:
    if algo == "pair" and n != 2:
        pytest.skip("the pair exchange is for two ranks")
    for dtype in DTYPES if count < 1000 else [np.int64, np.float32]:
        if algo in ("pair", "direct") and count * np.dtype(dtype).itemsize > wire.MAX_PAYLOAD:
            continue  # one message each way: the selection table never picks them here
        inputs = [_data(r, count, dtype) for r in range(n)]
        want = sum(inputs[1:], start=inputs[0].copy()) if n else None

        def make(op: Op, inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return ALL_REDUCE[algo](op, buf), lambda: buf

        got = run_algorithm(n, make, plane="shm" if algo == "shm" else "memory")
        for r in range(1, n):
            assert got[r].tobytes() == got[0].tobytes(), f"rank {r} differs ({dtype})"
        if np.dtype(dtype).kind in "iu":
            assert np.array_equal(got[0], want), dtype
        else:
            assert np.allclose(got[0], want, rtol=1e-2, atol=1e-2), dtype


@pytest.mark.parametrize("plane", ["memory", "shm"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_broadcast_and_reduce(plane: str, n: int, count: int) -> None:
    inputs = [_data(r, count, np.int64) for r in range(n)]
    for root in {0, n - 1, n // 2}:
        def make_b(op: Op, root: int = root) -> Any:
            buf = inputs[op.me].copy()
            algo = (shm.broadcast(op, buf, root) if plane == "shm" else
                    select.broadcast("tcp", buf.nbytes, op.size)(op, buf, root))
            return algo, lambda: buf

        for got in run_algorithm(n, make_b, plane=plane):
            assert np.array_equal(got, inputs[root])

        def make_r(op: Op, root: int = root) -> Any:
            buf = inputs[op.me].copy()
            algo = (shm.reduce(op, buf, root, np.add) if plane == "shm" else
                    select.reduce("tcp", buf.nbytes, op.size)(op, buf, root, np.add))
            return algo, lambda: buf

        got = run_algorithm(n, make_r, plane=plane)
        assert np.array_equal(got[root], sum(inputs[1:], start=inputs[0].copy()))
        for r in range(n):
            if r != root:
                assert np.array_equal(got[r], inputs[r]), "a non-root's array changed"


@pytest.mark.parametrize("algo", ["direct", "ring", "ring-by-host", "shm"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_all_gather(algo: str, n: int, count: int) -> None:
    inputs = [_data(r, count, np.float32) for r in range(n)]

    def make(op: Op) -> Any:
        out = np.empty((n, count), np.float32)
        out[op.me] = inputs[op.me]
        if algo == "shm":
            gen = shm.all_gather(op, out)
        elif algo == "direct":
            gen = tcp.all_gather_direct(op, out)
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
