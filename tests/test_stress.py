"""Stress: 1000 consecutive collectives of random kind, size (0 to 4M elements) and dtype.

Every rank draws the same seeded plan (collective, dtype, size, op, root) and
generates every rank's input from ``(seed, step, rank)``, so it can check its
own result against numpy: integers exactly (wrap-around included: integer
sum/prod modulo 2^k do not depend on order), floats closely. Each rank also
returns a digest of every result, and the test compares them across ranks:
float results must be bitwise identical everywhere. Sizes are log-uniform
(mostly small, now and then millions of elements).
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import numpy as np
import pytest

import swarmfd as fd

from .conftest import run_ranks, transport_env
from .robust_harness import record

STEPS = 1000
MAX_ELEMENTS = 4 << 20
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


def _digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr).tobytes(), digest_size=8).hexdigest()


def _reduced(seed: int, step: int, world: int, dtype: np.dtype, n: int, op: str) -> np.ndarray:
    """Reference reduction of every rank's input: in dtype for integers, float64/complex128
    for floats (compared with a tolerance)."""
    mean = op == "mean"
    ufunc = _UFUNC["sum" if mean else op]
    work = dtype if dtype.kind in "iu" else np.dtype(np.complex128 if dtype.kind == "c"
                                                      else np.float64)
    acc = _input(seed, step, 0, dtype, n).astype(work)
    for r in range(1, world):
        ufunc(acc, _input(seed, step, r, dtype, n).astype(work), out=acc)
    if mean:
        acc /= world
    return acc


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


def _stress(rank: int, world: int, seed: int, steps: int) -> dict[str, Any]:
    digests: list[str] = []
    t0 = time.monotonic()
    moved = 0
    for step, (coll, dtype, n, op, root) in enumerate(_plan(seed, steps, world)):
        what = f"step {step} {coll} {dtype} n={n} op={op} root={root} on rank {rank}"
        mine = _input(seed, step, rank, dtype, n)
        if coll == "all_reduce":
            x = mine.copy()
            assert fd.all_reduce(x, op=op) is x
            _check(x, _reduced(seed, step, world, dtype, n, op), what)
            digests.append(_digest(x))
        elif coll == "broadcast":
            x = mine.copy()
            fd.broadcast(x, src=root)
            _check(x, _input(seed, step, root, dtype, n), what)
            digests.append(_digest(x))
        elif coll == "reduce":
            x = mine.copy()
            fd.reduce(x, dst=root, op=op)
            if rank == root:
                _check(x, _reduced(seed, step, world, dtype, n, op), what)
            elif not np.array_equal(x, mine):
                raise AssertionError(f"{what}: a non-destination rank's array changed")
            digests.append(_digest(x) if rank == root else "")
        elif coll == "all_gather":
            parts = fd.all_gather(mine)
            assert len(parts) == world, what
            for r, part in enumerate(parts):
                _check(part, _input(seed, step, r, dtype, n), f"{what} part {r}")
            digests.append(_digest(np.concatenate(parts)) if n else "")
        else:
            fd.barrier()
            digests.append("")
        moved += n * dtype.itemsize
    return {"digests": digests, "seconds": time.monotonic() - t0, "mib": moved >> 20}


@pytest.mark.parametrize(("world", "transport"), [
    (3, "tcp"), (3, "zmq"), (3, "shm"), (4, "shm"),
    pytest.param(4, "tcp", marks=pytest.mark.slow),  # about 60 s on 2 cores
])
def test_1000_random_collectives(world: int, transport: str) -> None:
    """1000 random collectives: integers exact, float results identical on every rank."""
    seed = 20240 + world
    env = transport_env(transport)
    t0 = time.monotonic()
    out = run_ranks(_stress, world, seed, STEPS, timeout=600, group_timeout=60, env=env)
    elapsed = time.monotonic() - t0
    plan = _plan(seed, STEPS, world)
    for step, (coll, dtype, n, op, root) in enumerate(plan):
        seen = {r: out[r]["digests"][step] for r in range(world)}
        if coll == "reduce":
            continue  # only the destination holds the result
        assert len(set(seen.values())) == 1, (
            f"step {step} ({coll} {dtype} n={n} op={op} root={root}): ranks ended with "
            f"different bytes: {seen}")
    record(f"stress[{transport},N={world}]", seconds=round(elapsed, 1),
           rank_seconds=[round(o["seconds"], 1) for o in out], mib_per_rank=out[0]["mib"],
           largest=max(n for _, _, n, _, _ in plan))
