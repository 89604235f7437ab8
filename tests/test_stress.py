"""Stress: 1000 consecutive collectives of random kind, size (0 to 1M elements) and dtype.

Every rank draws the same seeded plan (collective, dtype, size, op, root) and
generates every rank's input from ``(seed, step, rank)``, so a rank can check a
result against numpy: integers exactly (wrap-around included: integer sum/prod
modulo 2^k do not depend on order), floats closely. Each rank returns a digest of
every result, and the test compares them across ranks: results must be bitwise
identical everywhere. So one rank per step checks against numpy (the root of a
broadcast or reduce, else rank ``step % world``): with equal digests, every rank's
result is what it checked (making every rank's inputs on every rank was most of the
run's time). Sizes are log-uniform (mostly small, now and then a million elements:
up to 8 MiB of float64, 16 MiB of complex128, so several shared-memory rounds and TCP
pieces; the 16 MiB calls of every plane are tests/test_collectives.py's).

One run per real plane between processes (N=3: the socket and zmq planes, shared
memory), and N=4 (the plan's first THREAD_STEPS steps) on thread-ranks over the
socket plane and shared memory (tests/support/threadranks.py: the same public calls and
planes, without spawning).
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from typing import Any

import numpy as np
import pytest

import swarmfd as fd

from .support.harness import record, run_ranks, transport_env
from .support.threadranks import run_api

STEPS = 1000
#: Steps of the N=4 runs on thread-ranks (their GIL-bound Python makes a step 2-3x
#: dearer than a process's): 500 of the same plan, ~10 s each.
THREAD_STEPS = 500
#: The largest size drawn. It was 4M until 2026-12-02: the five runs took 62 s of wall
#: time alone on a quiet machine (80 CPU-s of a CI run's 1300), 27 s with 1M, and the
#: large sizes they drew are what tests/test_collectives.py's 16 MiB tests cover.
MAX_ELEMENTS = 1 << 20
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]
COLLECTIVES = ["all_reduce", "all_reduce", "all_reduce", "broadcast", "reduce", "all_gather",
               "barrier"]
_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
#: Float tolerance against a float64 reference computed in another order.
_TOL = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12,
        np.dtype(np.complex64): 1e-5, np.dtype(np.complex128): 1e-12}


def _plan(seed: int, steps: int, world: int) -> list[tuple[str, np.dtype, int, str, int]]:
    """The same list of (collective, dtype, size, op, root) on every rank."""
    rng = np.random.default_rng(seed)
    plan = []
    for _ in range(steps):
        coll = str(rng.choice(COLLECTIVES))
        dtype = np.dtype(DTYPES[int(rng.integers(len(DTYPES)))])
        if rng.random() < 0.03:
            n = 0
        else:
            n = min(MAX_ELEMENTS, int(math.exp(rng.uniform(0, math.log(MAX_ELEMENTS)))))
        ops = ["sum", "prod"] if dtype.kind == "c" else ["sum", "prod", "min", "max"]
        if dtype.kind in "fc" and coll == "all_reduce":
            ops.append("mean")
        plan.append((coll, dtype, n, str(rng.choice(ops)), int(rng.integers(world))))
    return plan


def _input(seed: int, step: int, rank: int, dtype: np.dtype, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, step, rank])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    real = rng.uniform(-2.0, 2.0, size=n)
    if dtype.kind == "c":
        return (real + 1j * rng.uniform(-2.0, 2.0, size=n)).astype(dtype)
    return real.astype(dtype)


def _digest(*arrays: np.ndarray) -> str:
    """A CRC-32 of the arrays' bytes: it only has to tell two ranks' results apart (blake2b
    took a fifth of a rank's time; zlib.crc32 reads 5-8x faster, and needs no copy)."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
    return f"{crc:08x}"


class _Inputs:
    """Every rank's input of a step and their reduction, each made once per step and
    kept read-only for a few steps: a rank needs every rank's input to check its result,
    and the random numbers were most of the run's time. Thread-ranks (tests/support/threadranks.py)
    share one; each process has its own."""

    KEEP = 4  # steps kept: a rank may be a call or two ahead of another

    def __init__(self, seed: int, world: int) -> None:
        self.seed = seed
        self.world = world
        self.made: dict[tuple[Any, ...], np.ndarray] = {}
        self.lock = threading.Lock()

    def _get(self, key: tuple[Any, ...], make: Any) -> np.ndarray:
        with self.lock:
            got = self.made.get(key)
        if got is None:
            got = make()
            got.flags.writeable = False
            with self.lock:
                self.made[key] = got
                for old in [k for k in self.made if k[0] < key[0] - self.KEEP]:
                    del self.made[old]
        return got

    def of(self, step: int, rank: int, dtype: np.dtype, n: int) -> np.ndarray:
        return self._get((step, rank), lambda: _input(self.seed, step, rank, dtype, n))

    def reduced(self, step: int, dtype: np.dtype, n: int, op: str) -> np.ndarray:
        """Reference reduction of every rank's input: in dtype for integers,
        float64/complex128 for floats (compared with a tolerance)."""
        def make() -> np.ndarray:
            mean = op == "mean"
            ufunc = _UFUNC["sum" if mean else op]
            work = dtype if dtype.kind in "iu" else np.dtype(
                np.complex128 if dtype.kind == "c" else np.float64)
            acc = self.of(step, 0, dtype, n).astype(work)
            for r in range(1, self.world):
                ufunc(acc, self.of(step, r, dtype, n).astype(work), out=acc)
            if mean:
                acc /= self.world
            return acc
        return self._get((step, "reduced", op), make)


def _check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype.kind in "iu":
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise AssertionError(f"{what}: {bad.size} wrong elements, first at {bad[0]}: "
                                 f"got {got[bad[0]]}, want {want[bad[0]]}")
        return
    tol = _TOL[got.dtype]
    scale = np.maximum(1.0, np.abs(want))
    err = np.abs(got.astype(want.dtype) - want) / scale
    if err.size and not (err <= tol * 4).all():
        i = int(np.argmax(err))
        raise AssertionError(f"{what}: relative error {err[i]:.3g} at {i}: got {got[i]}, "
                             f"want {want[i]}")


def _stress(rank: int, world: int, seed: int, steps: int,
            inputs: _Inputs | None = None) -> dict[str, Any]:
    """Run the plan; one rank per step (the root, else a rotating one) checks the result
    against numpy, every rank returns its digest of it (see the module docstring)."""
    digests: list[str] = []
    t0 = time.monotonic()
    moved = 0
    inputs = inputs or _Inputs(seed, world)
    for step, (coll, dtype, n, op, root) in enumerate(_plan(seed, steps, world)):
        what = f"step {step} {coll} {dtype} n={n} op={op} root={root} on rank {rank}"
        mine = inputs.of(step, rank, dtype, n)
        checks = rank == (root if coll in ("broadcast", "reduce") else step % world)
        if coll == "all_reduce":
            x = mine.copy()
            assert fd.all_reduce(x, op=op) is x
            if checks:
                _check(x, inputs.reduced(step, dtype, n, op), what)
            digests.append(_digest(x))
        elif coll == "broadcast":
            x = mine.copy()
            fd.broadcast(x, src=root)
            if rank == root:
                _check(x, mine, what)  # the others' digests must then equal the root's
            digests.append(_digest(x))
        elif coll == "reduce":
            x = mine.copy()
            fd.reduce(x, dst=root, op=op)
            if rank == root:
                _check(x, inputs.reduced(step, dtype, n, op), what)
            elif not np.array_equal(x, mine):
                raise AssertionError(f"{what}: a non-destination rank's array changed")
            digests.append(_digest(x) if rank == root else "")
        elif coll == "all_gather":
            parts = fd.all_gather(mine.copy())
            assert len(parts) == world, what
            if checks:
                for r, part in enumerate(parts):
                    _check(part, inputs.of(step, r, dtype, n), f"{what} part {r}")
            else:
                _check(parts[rank], mine, f"{what} part {rank}")
            digests.append(_digest(*parts) if n else "")
        else:
            fd.barrier()
            digests.append("")
        moved += n * dtype.itemsize
    return {"digests": digests, "seconds": time.monotonic() - t0, "mib": moved >> 20}


def _compare(out: list[dict[str, Any]], seed: int, world: int, name: str,
             elapsed: float, steps: int = STEPS) -> None:
    """Every step's digests agree across ranks (the reduce's root alone holds a result)."""
    plan = _plan(seed, steps, world)
    for step, (coll, dtype, n, op, root) in enumerate(plan):
        seen = {r: out[r]["digests"][step] for r in range(world)}
        if coll == "reduce":
            continue  # only the destination holds the result (checked there)
        assert len(set(seen.values())) == 1, (
            f"step {step} ({coll} {dtype} n={n} op={op} root={root}): ranks ended with "
            f"different bytes: {seen}")
    record(name, seconds=round(elapsed, 1), rank_seconds=[round(o["seconds"], 1) for o in out],
           mib_per_rank=out[0]["mib"], largest=max(n for _, _, n, _, _ in plan))


@pytest.mark.parametrize(("world", "transport"), [(3, "tcp"), (3, "zmq"), (3, "shm")])
def test_1000_random_collectives(world: int, transport: str) -> None:
    """1000 random collectives between processes: integers exact, floats close, every
    result identical on every rank."""
    seed = 20240 + world
    t0 = time.monotonic()
    out = run_ranks(_stress, world, seed, STEPS, timeout=600, group_timeout=60,
                    env=transport_env(transport))
    _compare(out, seed, world, f"stress[{transport},N={world}]", time.monotonic() - t0)


@pytest.mark.parametrize("plane", ["socket", "shm"])
def test_random_collectives_of_4_thread_ranks(plane: str) -> None:
    """The same plan's first THREAD_STEPS steps at N=4, on thread-ranks over the socket
    plane and shared memory (these ran as processes: 4 ranks on 2 cores took 190-290 s
    there)."""
    world = 4
    seed = 20240 + world
    t0 = time.monotonic()
    out = run_api(_stress, world, seed, THREAD_STEPS, _Inputs(seed, world), plane=plane,
                  timeout=600, group_timeout=60)
    _compare(out, seed, world, f"stress[threads,{plane},N={world}]", time.monotonic() - t0,
             THREAD_STEPS)
