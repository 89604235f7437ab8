"""Collectives on real ranks over loopback: every op, dtype group, shape, root, world size."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import swarmfd as fd
from swarmfd.algorithms import select
from swarmfd.comm import wire
from swarmfd.comm.planes import zmq as zmq_transport

from .support.harness import (
    RankFailure,
    free_port,
    require_torch,
    run_ranks,
    run_ranks_raw,
    transport_env,
)
from .support.reference import assert_sum

INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64]
COMPLEX = [np.complex64, np.complex128]
SHAPES = [(), (0,), (1,), (3,), (5, 7), (2, 3, 4), (1001,)]
#: Shapes past the direct-exchange threshold (ring / chain paths), run for one dtype per group.
LARGE_SHAPES = [(40_000,), (70_001,), (3, 50_001), (300_001,)]
LARGE_DTYPES = {np.dtype(t) for t in (np.int64, np.uint8, np.float16, np.float32, np.complex64)}


def _value(rank: int, shape: tuple[int, ...], dtype: type, salt: int = 0) -> np.ndarray:
    """Deterministic per-rank test data, small enough that sums and products stay exact."""
    n = int(np.prod(shape)) if shape else 1
    # (i * 7 + rank * 3 + salt) % 5 + 1 for i < n: the pattern repeats every 5 elements,
    # so it is made for 5 and tiled (the battery makes thousands of these).
    base = (np.arange(5, dtype=np.int64) * 7 + rank * 3 + salt) % 5 + 1
    if np.dtype(dtype).kind == "c":
        return np.tile((base + 1j * (base % 3)).astype(dtype), n // 5 + 1)[:n].reshape(shape)
    return np.tile(base.astype(dtype), n // 5 + 1)[:n].reshape(shape)


def _reference(
    op: str, world: int, shape: tuple[int, ...], dtype: type, salt: int = 0
) -> np.ndarray:
    vals = [_value(r, shape, dtype, salt) for r in range(world)]
    out = vals[0].copy()
    for v in vals[1:]:
        if op == "sum":
            out = out + v
        elif op == "prod":
            out = out * v
        elif op == "min":
            out = np.minimum(out, v)
        elif op == "max":
            out = np.maximum(out, v)
    return out.astype(dtype)


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """np.testing.assert_array_equal, with numpy's cheap comparison first (the battery
    makes thousands: the full assertion only runs to describe a difference)."""
    if not (got.shape == want.shape and np.array_equal(got, want)):
        np.testing.assert_array_equal(got, want, err_msg=what)


class _Values:
    """Every rank's :func:`_value` for one dtype and shape (salts 0-3), and the references
    the battery compares with, each computed once: the battery asks for them ~30-70
    times per dtype and shape, and making them took half of its time."""

    def __init__(self, world: int, shape: tuple[int, ...], dtype: type) -> None:
        self.world = world
        self.vals = [[_value(r, shape, dtype, salt) for r in range(world)] for salt in range(4)]
        self._refs: dict[tuple[str, int], np.ndarray] = {}

    def mine(self, rank: int, salt: int = 0) -> np.ndarray:
        return self.vals[salt][rank].copy()

    def reference(self, op: str, salt: int = 0) -> np.ndarray:
        """:func:`_reference` of these values."""
        key = (op, salt)
        if key not in self._refs:
            vals = self.vals[salt]
            out = vals[0].copy()
            for v in vals[1:]:
                out = {"sum": np.add, "prod": np.multiply, "min": np.minimum,
                       "max": np.maximum}[op](out, v)
            self._refs[key] = out.astype(vals[0].dtype)
        return self._refs[key]


def _battery(rank: int, world: int) -> list[str]:
    """Every collective, dtype and shape; asserts locally, returns digests of float results."""
    digests = []
    for dtype in INTS + FLOATS + COMPLEX:
        ops = ["sum", "prod"] if np.dtype(dtype).kind == "c" else ["sum", "prod", "min", "max"]
        for shape in SHAPES + (LARGE_SHAPES if np.dtype(dtype) in LARGE_DTYPES else []):
            v = _Values(world, shape, dtype)
            for op in ops:
                x = v.mine(rank)
                ret = fd.all_reduce(x, op=op)
                assert ret is x
                # Values are small integers: exact for every dtype (float16 included).
                _equal(x, v.reference(op), f"all_reduce {op} {dtype} {shape}")
                digests.append(_digest(x))
            if np.dtype(dtype).kind in "fc":
                x = v.mine(rank)
                fd.all_reduce_mean(x)
                np.testing.assert_allclose(
                    x, v.reference("sum") / world, rtol=1e-3, err_msg=f"mean {dtype} {shape}")
                digests.append(_digest(x))
            for src in range(world):
                y = v.mine(rank, 1)
                assert fd.broadcast(y, src=src) is y
                _equal(y, v.vals[1][src], f"broadcast src={src} {dtype} {shape}")
            for dst in range(world):
                z = v.mine(rank, 2)
                assert fd.reduce(z, dst=dst) is z
                if rank == dst:
                    _equal(z, v.reference("sum", 2), f"reduce dst={dst} {dtype} {shape}")
                else:
                    _equal(z, v.vals[2][rank], f"reduce dst={dst} {dtype} {shape} (non-root)")
            g = fd.all_gather(v.mine(rank, 3))
            assert isinstance(g, list) and len(g) == world
            for r, part in enumerate(g):
                assert part.shape == shape and part.dtype == np.dtype(dtype)
                _equal(part, v.vals[3][r], f"all_gather part {r} {dtype} {shape}")
    fd.barrier()
    return digests


TRANSPORTS = ["auto", "tcp"]  # auto: shared memory between ranks of one host; tcp: sockets
#: The ZeroMQ data plane (SWARMFD_DATA_PLANE=zmq) runs a representative subset.
ZMQ = "zmq"


def _worlds_and_transports(*worlds: int) -> list[tuple[int, str]]:
    """(world, transport) pairs; a world of one uses no transport, so it runs once."""
    return [(w, t) for w in worlds for t in TRANSPORTS if w > 1 or t == "auto"]


@pytest.mark.parametrize(("world", "transport"),
                         [*_worlds_and_transports(1, 2, 3, 4), (3, ZMQ)])
def test_every_collective_dtype_shape_and_root(world: int, transport: str) -> None:
    """All collectives, every dtype group and shape, all roots; floats identical on all ranks."""
    results = run_ranks(_battery, world, timeout=240, env=transport_env(transport))
    for r in range(1, world):
        assert results[r] == results[0], f"rank {r} ended with different bytes than rank 0"


def _schedule_paths(rank: int, world: int) -> dict[str, str]:
    """Small blocking calls, async ones and a large one through the public API (each
    result checked): the algorithm each kind of call runs, by the schedule its group
    keeps for it (the selection's choice), and whether its async call ran the blocking
    call's schedule."""
    from swarmfd import group as _group

    g = _group.resolve_group(None, "test")
    total = sum(range(1, world + 1))
    x = np.arange(10, dtype=np.float32) * (rank + 1)
    np.testing.assert_array_equal(fd.all_reduce(x), np.arange(10) * total)
    m = np.full(6, float(rank), np.float64)
    np.testing.assert_array_equal(fd.all_reduce(m, op="mean"), np.full(6, (world - 1) / 2))
    grid = np.ones((4, 6), np.int64) * (rank + 1)
    view = grid[:, ::2]  # not contiguous: reduced in a copy, written back
    fd.all_reduce(view)
    assert (grid[:, ::2] == total).all() and (grid[:, 1::2] == rank + 1).all()
    fd.barrier()
    kept = dict(g.schedules)
    y = np.arange(10, dtype=np.float32) * (rank + 1)
    np.testing.assert_array_equal(fd.all_reduce(y, async_op=True).wait(), np.arange(10) * total)
    fd.barrier(async_op=True).wait()
    big = np.ones((1 << 20) // 8)  # 1 MiB
    np.testing.assert_array_equal(fd.all_reduce(big), np.full(big.size, float(world)))
    names = {what: g.schedules[key].choice.name for what, key in (
        ("small", ((10,), np.dtype(np.float32), "sum")),
        ("mean", ((6,), np.dtype(np.float64), "mean")),
        ("strided", ((4, 3), np.dtype(np.int64), "sum")),
        ("barrier", (wire.Collective.BARRIER,)),
        ("large", ((big.size,), np.dtype(np.float64), "sum")))}
    # The async calls found the blocking calls' schedules: no new one was made.
    assert all(g.schedules[k] is s for k, s in kept.items()), "an async call made its own"
    assert len(g.schedules) == len(kept) + 1, list(g.schedules)
    return names


@pytest.mark.parametrize(("world", "transport"), _worlds_and_transports(2, 3))
def test_each_kind_of_call_runs_the_selections_choice_from_its_schedule(
        world: int, transport: str) -> None:
    """Small all_reduces run shared memory's one round on one host, the pair exchange
    between two ranks over TCP, the direct exchange among three; a 1 MiB one shared
    memory's rounds, the pair exchange (one message each way, up to a piece) or the
    ring; a barrier the dissemination barrier. An async call of a kind runs the
    blocking call's schedule. Every result is checked (sum, mean, a non-contiguous
    array written back)."""
    got = run_ranks(_schedule_paths, world, timeout=120, env=transport_env(transport))
    if transport == "auto":
        small, large = "shm.one_round", "shm.rounds"
    elif world == 2:
        small = large = "tcp.pair"
    else:
        small, large = "tcp.direct", "tcp.ring"
    want = {"small": small, "mean": small, "strided": small, "barrier": "barrier",
            "large": large}
    assert got == [want] * world


def _big(rank: int, world: int, mib: int) -> list[str]:
    n = (mib << 20) // 4
    rng = np.random.default_rng(1234 + rank)
    x = rng.standard_normal(n).astype(np.float32)
    parts = [rng.standard_normal(n).astype(np.float32) for _ in range(0)]
    del parts
    ints = (np.arange(n, dtype=np.int64) * (rank + 1)) % 1_000_003
    fd.all_reduce(ints)
    expected = sum((np.arange(n, dtype=np.int64) * (r + 1)) % 1_000_003 for r in range(world))
    np.testing.assert_array_equal(ints, expected)
    ref = sum(np.random.default_rng(1234 + r).standard_normal(n).astype(np.float64)
              for r in range(world))
    fd.all_reduce(x)
    np.testing.assert_allclose(x, ref, rtol=1e-4, atol=1e-4)
    b = np.full(n, rank, np.float32)
    fd.broadcast(b, src=world - 1)
    assert (b == world - 1).all()
    g = fd.all_gather(np.full(n // world, rank, np.int32))
    assert all((g[r] == r).all() for r in range(world))
    red = np.full(n, rank + 1, np.int64)
    fd.reduce(red, dst=world - 1)
    if rank == world - 1:
        assert (red == world * (world + 1) // 2).all()
    else:
        assert (red == rank + 1).all()
    return [_digest(x)]


@pytest.mark.parametrize(("world", "transport"),
                         [(w, t) for w in (2, 3, 4) for t in TRANSPORTS] + [(2, ZMQ), (3, ZMQ)])
def test_16_mib_arrays(world: int, transport: str) -> None:
    """16 MiB arrays take the pipelined ring/chain paths; float results identical everywhere."""
    results = run_ranks(_big, world, 16, timeout=180, env=transport_env(transport))
    assert all(r == results[0] for r in results)


def _lists(rank: int, world: int) -> None:
    grads = [
        np.full((3, 4), rank, np.float32),
        np.arange(5, dtype=np.float64) + rank,
        np.full(7, rank + 1, np.int32),
        np.full((), rank, np.float32),
        np.zeros(0, np.float32),
        np.full(100_000, rank, np.float32),
    ]
    assert fd.all_reduce(grads) is grads
    total = world * (world - 1) / 2
    assert (grads[0] == total).all() and grads[0].shape == (3, 4)
    np.testing.assert_array_equal(grads[1], np.arange(5) * world + total)
    assert (grads[2] == world * (world + 1) // 2).all()
    assert grads[3] == total and grads[4].size == 0 and (grads[5] == total).all()
    means = [np.full(4, float(rank)), np.full((2, 2), float(rank), np.float32)]
    fd.all_reduce_mean(means)
    assert (means[0] == total / world).all() and (means[1] == np.float32(total / world)).all()
    params = [np.full(3, rank, np.float64), np.full(2, rank, np.int16)]
    fd.broadcast(params, src=world - 1)
    assert (params[0] == world - 1).all() and (params[1] == world - 1).all()
    tup = (np.full(2, 1.0),)
    fd.all_reduce(tup)
    assert (tup[0] == world).all()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lists_of_arrays_are_fused(world: int) -> None:
    """all_reduce, all_reduce_mean and broadcast take lists (mixed dtypes and shapes)."""
    run_ranks(_lists, world)


def _non_contiguous(rank: int, world: int) -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6) + rank
    view = base[:, ::2]  # not contiguous
    fd.all_reduce(view)
    want = (np.arange(24, dtype=np.float64).reshape(4, 6) * world + world * (world - 1) / 2)
    np.testing.assert_array_equal(base[:, ::2], want[:, ::2])
    np.testing.assert_array_equal(base[:, 1::2], (np.arange(24).reshape(4, 6) + rank)[:, 1::2])
    t = np.asfortranarray(np.full((3, 5), rank, np.int32))
    fd.broadcast(t, src=0)
    assert (t == 0).all()
    g = fd.all_gather(np.arange(12, dtype=np.int16).reshape(3, 4).T + rank)
    assert all((g[r] == np.arange(12).reshape(3, 4).T + r).all() for r in range(world))


def test_non_contiguous_arrays_are_handled_in_place() -> None:
    """Non-contiguous inputs work, and only the viewed elements change."""
    run_ranks(_non_contiguous, 2)


def _wide_floats(rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s inputs: random floats with exponents over nine orders of magnitude."""
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(n).astype(np.float32) * 10.0 ** rng.integers(-5, 5, n)
            for n in (1, 7, 1000, 16_384, 300_001)]


def _identical_floats(rank: int, world: int) -> str:
    inputs = [_wide_floats(r) for r in range(world)]
    out = []
    for k, mine in enumerate(inputs[rank]):
        x = mine.copy()
        fd.all_reduce(x)
        assert_sum(x, [each[k] for each in inputs], what=f"all_reduce of {x.size}")
        out.append(_digest(x))
        total = x.copy()
        fd.all_reduce_mean(x)
        assert_sum(x, [total] * world, world, what=f"all_reduce_mean of {x.size}")
        out.append(_digest(x))
    return ":".join(out)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_float_results_are_bitwise_identical_on_every_rank(world: int, transport: str) -> None:
    """Random floats with wide exponents: every rank ends with the same bytes, the sum
    (and the mean of the sums) to float precision (tests/support/reference.py)."""
    results = run_ranks(_identical_floats, world, env=transport_env(transport))
    assert len(set(results)) == 1


#: Sizes (bytes) around the transport's inline / copied / zero-copy limits and the
#: two-rank single-message limit, so every path and its edges run.
BOUNDARY_BYTES = sorted({
    zmq_transport.INLINE_MAX_BYTES, zmq_transport.INLINE_MAX_BYTES + 4,
    zmq_transport.COPY_MAX_BYTES, zmq_transport.COPY_MAX_BYTES + 4,
    select.PAIR_MAX_BYTES - 4, select.PAIR_MAX_BYTES, select.PAIR_MAX_BYTES + 4,
})


def _boundaries(rank: int, world: int) -> list[str]:
    out = []
    for nbytes in BOUNDARY_BYTES:
        n = nbytes // 4
        x = ((np.arange(n, dtype=np.int64) + rank) % 11).astype(np.float32)
        fd.all_reduce(x)
        want = sum(((np.arange(n, dtype=np.int64) + r) % 11) for r in range(world))
        np.testing.assert_array_equal(x, want.astype(np.float32), err_msg=f"{nbytes} B")
        rng = np.random.default_rng(rank)
        y = rng.standard_normal(n).astype(np.float32) * 10.0 ** rng.integers(-5, 5, n)
        fd.all_reduce(y)
        out.append(_digest(y))
        # Signed zeros and NaNs: min/max must pick the same bits on every rank.
        z = np.where(np.arange(n) % 3 == 0, 0.0, -0.0).astype(np.float32)
        if rank % 2:
            z = -z
        z[::7] = np.nan if rank == 0 else z[::7]
        fd.all_reduce(z, op="max")
        out.append(_digest(z))
        b = np.full(n, rank, np.float32)
        fd.broadcast(b, src=world - 1)
        assert (b == world - 1).all(), f"broadcast {nbytes} B"
        g = fd.all_gather(np.full(n, rank, np.int32))
        assert all((g[r] == r).all() for r in range(world)), f"all_gather {nbytes} B"
    return out


@pytest.mark.parametrize("transport", [*TRANSPORTS, ZMQ])
@pytest.mark.parametrize("world", [2, 3])
def test_sizes_at_the_message_path_limits(world: int, transport: str) -> None:
    """Sizes at the inline/copy/zero-copy and two-rank limits: right, identical bits."""
    results = run_ranks(_boundaries, world, timeout=120, env=transport_env(transport))
    assert all(r == results[0] for r in results)


def _gather_into(rank: int, world: int) -> None:
    for shape, dtype in [((3, 5), np.float64), ((100_003,), np.int32), ((0,), np.float32),
                         ((), np.int16), ((1 << 20,), np.float32)]:
        out = np.full((world, *shape), -1, dtype)
        for salt in range(2):  # the same out twice: filled again, not stale
            x = np.full(shape, rank * 10 + salt, dtype)
            parts = fd.all_gather(x, out=out)
            assert len(parts) == world
            for r, part in enumerate(parts):
                assert part.shape == shape and part.dtype == np.dtype(dtype)
                assert np.shares_memory(part, out) or part.size == 0
                assert (part == r * 10 + salt).all()
            assert (out == np.arange(world).reshape((world,) + (1,) * len(shape)) * 10
                    + salt).all()
    x = np.zeros(4, np.float32)
    bad = [
        (np.empty((world, 4), np.float64), TypeError, "dtype float64"),
        (np.empty((world + 1, 4), np.float32), ValueError, "expected (world_size, *x.shape)"),
        (np.empty((world, 8), np.float32)[:, ::2], ValueError, "C-contiguous"),
        ([[0.0] * 4] * world, TypeError, "numpy array"),
    ]
    ro = np.empty((world, 4), np.float32)
    ro.flags.writeable = False
    bad.append((ro, ValueError, "read-only"))
    for out, exc, text in bad:
        with pytest.raises(exc, match=re.escape(text)):
            fd.all_gather(x, out=out)
    whole = np.zeros((world, 4), np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        fd.all_gather(whole[0], out=whole)
    fd.barrier()


@pytest.mark.parametrize(("world", "transport"), _worlds_and_transports(1, 2, 3))
def test_all_gather_into_a_reused_out_array(world: int, transport: str) -> None:
    """all_gather(x, out=...) fills the caller's (N, *shape) array; bad outs are refused."""
    run_ranks(_gather_into, world, timeout=120, env=transport_env(transport))


def test_world_of_one_without_sockets() -> None:
    """A world of one runs every collective locally, with no transport at all."""
    cfg = fd.init(1, 0)
    try:
        from swarmfd import group

        assert group.current().transport is None
        assert cfg.is_main and cfg.local_rank == 0 and cfg.local_world_size == 1
        x = np.arange(5, dtype=np.float32)
        assert fd.all_reduce(x) is x and (x == np.arange(5)).all()
        fd.all_reduce_mean(x)
        assert (x == np.arange(5)).all()
        assert [a.tolist() for a in fd.all_gather(x)] == [list(range(5))]
        fd.broadcast(x, src=0)
        fd.reduce(x, dst=0)
        fd.barrier()
        with pytest.raises(ValueError, match="src=1 is out of range"):
            fd.broadcast(x, src=1)
    finally:
        fd.cleanup()


# -- bad input ----------------------------------------------------------------------------


def test_collective_before_init_names_the_call() -> None:
    """Every collective before init raises NotInitializedError (a RuntimeError)."""
    assert not fd.is_initialized()
    for call in (lambda: fd.all_reduce(np.zeros(2)), lambda: fd.broadcast(np.zeros(2)),
                 lambda: fd.reduce(np.zeros(2)), lambda: fd.all_gather(np.zeros(2)),
                 fd.barrier, fd.get_config):
        with pytest.raises(RuntimeError, match="before the process group was initialised"):
            call()


def test_bad_inputs_get_clear_errors() -> None:
    """Unsupported dtypes, read-only arrays, bad ops and non-arrays are refused clearly."""
    fd.init(1, 0)
    try:
        with pytest.raises(TypeError, match="unsupported dtype bool"):
            fd.all_reduce(np.zeros(3, bool))
        with pytest.raises(TypeError, match="unsupported dtype object"):
            fd.all_reduce(np.zeros(3, object))
        with pytest.raises(TypeError, match="non-native byte order"):
            fd.all_reduce(np.zeros(3, ">f4"))
        ro = np.zeros(3)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            fd.all_reduce(ro)
        with pytest.raises(ValueError, match="unsupported op 'avg2'"):
            fd.all_reduce(np.zeros(3), op="avg2")
        with pytest.raises(TypeError, match="mean of int32"):
            fd.all_reduce_mean(np.zeros(3, np.int32))
        with pytest.raises(TypeError, match="not defined for complex"):
            fd.all_reduce(np.zeros(3, np.complex64), op="max")
        with pytest.raises(TypeError, match="expects a numpy array"):
            fd.all_reduce([1.0, 2.0])
        with pytest.raises(TypeError, match="expects a numpy array"):
            fd.broadcast(3.0)
        with pytest.raises(ValueError, match="dst=-1 is out of range"):
            fd.reduce(np.zeros(2), dst=-1)
        with pytest.raises(TypeError, match="src must be an integer"):
            fd.broadcast(np.zeros(2), src=0.5)
    finally:
        fd.cleanup()


def test_init_twice_and_cleanup_is_idempotent() -> None:
    """init twice raises; cleanup twice is fine; init works again after cleanup."""
    fd.init(1, 0)
    with pytest.raises(RuntimeError, match="init called twice"):
        fd.init(1, 0)
    fd.cleanup()
    fd.cleanup()
    assert not fd.is_initialized()
    cfg = fd.init(1, 0)
    assert fd.get_config() == cfg
    fd.cleanup()


def _reinit(rank: int, world: int, port: int) -> float:
    x = np.full(4, rank + 1.0)
    fd.all_reduce(x)
    fd.cleanup()
    fd.init(world, rank, master_addr="127.0.0.1", master_port=port, timeout=20)
    y = np.full(4, 2.0 * (rank + 1))
    fd.all_reduce(y)
    return float(x[0] + y[0])


def test_a_group_can_be_formed_again_after_cleanup() -> None:
    """cleanup() then init() forms a new working group in the same processes."""
    out = run_ranks(_reinit, 3, free_port())
    assert out == [18.0, 18.0, 18.0]


def _mismatch(rank: int, world: int, kind: str) -> None:
    if kind == "dtype":
        fd.all_reduce(np.zeros(10, np.float32 if rank == 0 else np.float64))
    elif kind == "shape":
        fd.all_reduce(np.zeros((2, 3) if rank == 0 else (3, 2)))
    elif kind == "collective":
        if rank == 0:
            fd.broadcast(np.zeros(4), src=0)
        else:
            fd.all_reduce(np.zeros(4))
    elif kind == "root":
        fd.broadcast(np.zeros(4), src=rank)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["dtype", "shape", "collective", "root"])
def test_mismatched_calls_raise_on_every_rank(kind: str, transport: str) -> None:
    """Ranks that disagree on a collective all raise a MismatchError naming both sides."""
    out = run_ranks_raw(_mismatch, 2, kind, timeout=30, group_timeout=20,
                        env=transport_env(transport))
    assert sorted(out) == [0, 1]
    for rank, (ok, tb) in out.items():
        assert not ok, f"rank {rank} did not fail"
        assert "MismatchError" in tb or "Mismatch" in tb, tb
        assert "rank 0 called" in tb or "rank 1 called" in tb, tb


def _victim(rank: int, world: int) -> None:
    import os

    x = np.ones(1000)
    fd.all_reduce(x)
    if rank == 1:
        os._exit(17)  # dies without a word, mid-job
    fd.all_reduce(x)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_rank_is_named_by_the_others(transport: str) -> None:
    """When a rank dies, the others raise PeerLostError naming it, well before the timeout."""
    import time

    t0 = time.monotonic()
    out = run_ranks_raw(_victim, 3, timeout=40, group_timeout=30,
                        env=transport_env(transport))
    elapsed = time.monotonic() - t0
    assert 1 not in out
    for rank in (0, 2):
        ok, tb = out[rank]
        assert not ok and "rank 1" in tb and ("PeerLost" in tb or "Lost" in tb), tb
    assert elapsed < 20, f"took {elapsed:.1f} s: loss was not detected before the 30 s timeout"


def _stuck(rank: int, world: int) -> None:
    import time

    if rank == 0:
        fd.all_reduce(np.ones(8))  # rank 1 never joins this collective
    else:
        time.sleep(6)  # alive but silent


@pytest.mark.waits  # the silent rank's peers wait for the timeout
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_silent_rank_times_out_naming_the_peer(transport: str) -> None:
    """A live rank that never calls the collective makes the other time out, naming it."""
    out = run_ranks_raw(_stuck, 2, timeout=30, group_timeout=2,
                        env=transport_env(transport))
    ok, tb = out[0]
    assert not ok and "CollectiveTimeout" in tb and "waiting for rank 1" in tb, tb
    assert "timed out after 2 s" in tb, tb


@pytest.mark.parametrize(("kind", "name", "base"), [
    ("timeout", "AbortedTimeout", fd.CollectiveTimeout),
    ("lost", "AbortedPeerLostError", fd.PeerLostError),
    ("mismatch", "AbortedMismatchError", fd.MismatchError),
])
def test_relayed_aborts_are_public_errors_of_their_kind(kind: str, name: str,
                                                        base: type) -> None:
    """An abort of each kind becomes a public swarmfd error: AbortedError and the kind's."""
    payload = json.dumps({"kind": kind, "rank": 1, "message": "why"}).encode()
    err = fd.errors.error_from_abort("barrier (call #3 on rank 0)", 1, payload)
    assert type(err) is getattr(fd, name) and name in fd.__all__
    assert isinstance(err, fd.AbortedError) and isinstance(err, base)
    assert str(err) == "barrier (call #3 on rank 0): rank 1 failed and aborted the group: why"


def _wait_for_file(path: str, timeout: float) -> bool:
    """Poll for ``path`` (another rank's signal); False after ``timeout`` seconds."""
    import os
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _relayed_timeout(rank: int, world: int, sync: str) -> dict[str, Any]:
    """Rank 0 times out waiting for rank 1, which then learns of it from rank 0's abort.

    The ranks order these steps through files in ``sync``, not sleeps: rank 1 enters
    only once rank 0 has timed out (a rank 0 slowed down by a loaded machine must not
    see rank 1 arrive in time), and rank 0 stays up, its inbox open, until rank 1 has
    read the abort.
    """
    import os
    import traceback

    timed_out, done = os.path.join(sync, "timed-out"), os.path.join(sync, "done")
    if rank == 0:
        try:
            with pytest.raises(fd.CollectiveTimeout) as caught:
                fd.barrier()
        finally:
            open(timed_out, "w").close()
        _wait_for_file(done, 20.0)
        return {"name": type(caught.value).__name__}
    try:
        assert _wait_for_file(timed_out, 20.0), "rank 0 never timed out"
        for _ in range(5):
            fd.barrier()
    except fd.CollectiveError as exc:
        return {"name": type(exc).__name__, "traceback": traceback.format_exc(),
                "aborted": isinstance(exc, fd.AbortedError),
                "timeout": isinstance(exc, fd.CollectiveTimeout)}
    finally:
        open(done, "w").close()
    return {"name": None}


def test_a_relayed_abort_has_a_public_type(tmp_path: Path) -> None:
    """Rank 1, late, raises rank 0's timeout as fd.AbortedTimeout, public in its traceback
    (shared memory: there a timeout is relayed as an abort, not re-detected)."""
    out = run_ranks(_relayed_timeout, 2, str(tmp_path), timeout=60, group_timeout=1,
                    env={"SWARMFD_TRANSPORT": "auto"})
    assert out[0]["name"] == "CollectiveTimeout", out[0]
    relayed = out[1]
    assert relayed["name"] == "AbortedTimeout", relayed
    assert relayed["aborted"] and relayed["timeout"], relayed
    assert re.search(r"\nswarmfd\.errors\.AbortedTimeout: barrier \(call #\d+ on rank 1\): rank 0 "
                     r"failed and aborted the group: .* timed out after 1 s waiting for rank 1",
                     relayed["traceback"]), relayed["traceback"]
    assert "swarmfd.errors._" not in relayed["traceback"], relayed["traceback"]


def test_rank_failure_reports_tracebacks() -> None:
    """The harness itself surfaces a child's traceback (guards the tests above)."""
    with pytest.raises(RankFailure, match="ZeroDivisionError"):
        run_ranks(_divide_by_zero, 2)


def _divide_by_zero(rank: int, world: int) -> None:
    if rank == 1:
        1 / 0  # noqa: B018


def test_piece_and_threshold_constants_are_sane() -> None:
    """Wire messages stay well under glibc's 32 MiB mmap threshold."""
    assert wire.PIECE_BYTES <= 8 << 20
    assert select.DIRECT_MAX_BYTES <= wire.PIECE_BYTES


def _which_transport(rank: int, world: int) -> tuple[bool, list[str]]:
    from swarmfd import group

    channel = group.current().transport.shm
    fd.barrier()
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split(None, 5)[5].strip() for line in f
                         if len(line.split(None, 5)) == 6 and "swarmfd" in line})
    return channel is not None, mapped


def test_ranks_of_one_host_use_shared_memory_and_leave_no_files() -> None:
    """auto picks shared memory on one host, tcp forces TCP; the segments have no name
    (memfds: nothing in /dev/shm; see tests/test_shm_plane.py for the full checks)."""
    auto = run_ranks(_which_transport, 3)
    tcp = run_ranks(_which_transport, 3, env={"SWARMFD_TRANSPORT": "tcp"})
    assert [used for used, _ in auto] == [True] * 3
    assert [used for used, _ in tcp] == [False] * 3
    assert [mapped for _, mapped in auto] == [["/memfd:swarmfd-segment (deleted)"]] * 3
    assert [mapped for _, mapped in tcp] == [[], [], []]


def test_bad_transport_setting_is_refused() -> None:
    """SWARMFD_TRANSPORT accepts auto or tcp only."""
    out = run_ranks_raw(_which_transport, 2, env={"SWARMFD_TRANSPORT": "carrier-pigeon"},
                        timeout=30, group_timeout=5)
    assert all(not ok and "SWARMFD_TRANSPORT='carrier-pigeon' is invalid" in tb
               for ok, tb in out.values())


def _torch_tensors(rank: int, world: int) -> list[float]:
    import torch

    t = torch.full((3, 4), float(rank + 1))
    assert fd.all_reduce(t) is t  # in place through a zero-copy numpy view
    p = torch.nn.Parameter(torch.full((5,), float(rank)))
    fd.broadcast(p, src=world - 1)  # a parameter that requires grad works too
    grads = [torch.full((2,), float(rank)), torch.full((3,), float(2 * rank))]
    fd.all_reduce_mean(grads)
    g = fd.all_gather(torch.tensor([rank], dtype=torch.int64))
    return [float(t[0, 0]), float(p[0]), float(grads[0][0]), float(grads[1][0]),
            *[float(x[0]) for x in g]]


def test_cpu_torch_tensors_are_accepted_in_place() -> None:
    """CPU torch tensors (and parameters) go through collectives in place, zero-copy."""
    require_torch(load=False)
    out = run_ranks(_torch_tensors, 2)
    assert out == [[3.0, 1.0, 0.5, 1.0, 0.0, 1.0]] * 2


def _local_ranks_by_node(rank: int, world: int, port: int) -> tuple[str, ...]:
    import os

    os.environ["SWARMFD_NODE"] = f"node-{rank % 2}"  # ranks 0, 2 on one node; 1, 3 on the other
    before = os.environ.get("LOCAL_RANK", "unset")
    cfg = fd.init(world, rank, master_addr="127.0.0.1", master_port=port, timeout=30)
    during = (os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", ""))
    assert (str(cfg.local_rank), str(cfg.local_world_size)) == during
    fd.cleanup()
    return (before, *during, os.environ.get("LOCAL_RANK", "gone"),
            os.environ.get("LOCAL_WORLD_SIZE", "gone"))


def test_local_ranks_grouped_by_node_reach_the_environment() -> None:
    """Ranks grouped by SWARMFD_NODE get their per-node LOCAL_RANK/LOCAL_WORLD_SIZE in
    os.environ after init (as under torchrun); cleanup takes them away again."""
    got = run_ranks(_local_ranks_by_node, 4, free_port(), timeout=120, init=False)
    assert got == [("unset", str(r // 2), "2", "gone", "gone") for r in range(4)]
