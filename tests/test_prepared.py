"""Prepared small calls (swarmfd/prepared.py) on real ranks: taken where they apply and
only there, the general path's bits, members on different paths in one call, a
mismatch and a lost peer reported as on the general path."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import swarmfd as fd

from .harness import (
    allowed,
    count_runs,
    error_info,
    free_port,
    run_ranks,
    run_ranks_raw,
    stall_meter,
    transport_env,
)

#: Planes: shared memory (one host), the socket plane, the zmq plane.
TRANSPORTS = ["shm", "tcp", "zmq"]
#: (dtype, shape, op): the dtype groups, 0-d to 2-d, every op.
CASES = [
    (np.float32, (1000,), "sum"),
    (np.float64, (3, 5), "mean"),
    (np.float16, (7,), "max"),
    (np.int64, (), "sum"),
    (np.int32, (64, 64), "prod"),
    (np.uint8, (33,), "min"),
    (np.complex64, (4,), "sum"),
    # Above the one-barrier size: one round of shared memory's large path (SplitCall).
    (np.float32, (512, 512), "sum"),
    (np.float64, (40_001,), "mean"),
]
#: Repetitions of each call: the first runs the general path and prepares the rest.
REPEATS = 4


def _count_prepared() -> dict[str, int]:
    """Count the prepared calls' runs in this rank (by class)."""
    from swarmfd import prepared

    counts = {"ShmCall": 0, "PairCall": 0, "DoublingCall": 0, "DirectCall": 0, "NowCall": 0,
              "ZmqPairCall": 0}
    for cls in (prepared.ShmCall, prepared.SplitCall, prepared.PairCall,
                prepared.DoublingCall, prepared.DirectCall, prepared.NowCall,
                prepared.ZmqPairCall):
        def counting(self: Any, x: Any, seq: int, _body: Any = cls.body,
                     _name: str = cls.__name__) -> None:
            counts["ShmCall" if _name == "SplitCall" else _name] += 1
            _body(self, x, seq)
        cls.body = counting  # type: ignore[method-assign]
    return counts


def _value(rank: int, rep: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([rank, rep, len(shape)])
    if np.dtype(dtype).kind in "fc":
        x = rng.standard_normal(shape) * 3
        if np.dtype(dtype).kind == "c":
            x = x + 1j * rng.standard_normal(shape)
    else:
        x = rng.integers(1, 4, size=shape)
    return np.asarray(x).astype(dtype)


def _expected(world: int, rep: int, dtype: Any, shape: tuple[int, ...], op: str) -> np.ndarray:
    """Every rank's value reduced in rank order (as every plane's all_reduce does)."""
    ufunc = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum,
             "min": np.minimum}[op]
    acc = _value(0, rep, dtype, shape).copy()
    for r in range(1, world):
        acc = ufunc(acc, _value(r, rep, dtype, shape)).astype(dtype)
    if op == "mean":
        acc = (acc / np.asarray(world, dtype)).astype(dtype)
    return acc


def _paths(rank: int, world: int) -> dict[str, Any]:
    """Each case REPEATS times, then barriers: every result checked against the rank-order
    reduction and against the general path's (an async call takes it)."""
    counts = _count_prepared()
    digest = hashlib.sha256()
    for dtype, shape, op in CASES:
        for rep in range(REPEATS):
            x = _value(rank, rep, dtype, shape)
            general = x.copy()
            assert fd.all_reduce(x, op=op) is x
            fd.all_reduce(general, op=op, async_op=True).wait()
            assert x.tobytes() == general.tobytes(), (dtype, shape, op, rep)
            want = _expected(world, rep, dtype, shape, op)
            if op == "mean" or x.nbytes > 1 << 18:
                # (A large call's chunks are reduced owner first: other float bits than
                # the rank order's, the same on every rank and path.)
                np.testing.assert_allclose(x, want, rtol=1e-3, atol=1e-4)
            else:
                np.testing.assert_array_equal(x, want)
            digest.update(x.tobytes())
    for _ in range(REPEATS):
        fd.barrier()
    return {**counts, "digest": digest.hexdigest()}


@pytest.mark.parametrize(("world", "transport"),
                         [(2, "shm"), (3, "shm"), (4, "shm"), (2, "tcp"), (3, "tcp"),
                          (4, "tcp"), (2, "zmq")])
def test_prepared_calls_run_where_they_apply_with_the_general_paths_bits(
        world: int, transport: str) -> None:
    """After its first call, a repeated small blocking all_reduce runs prepared on shared
    memory (ShmCall, SplitCall), between two ranks over TCP (PairCall on the socket
    plane; on the zmq plane ZmqPairCall up to its inline size, NowCall above it, and
    for barriers), and on the socket plane by recursive doubling in
    a power-of-two group (DoublingCall) and by the direct exchange in others
    (DirectCall); a barrier on every plane. The results are the general path's, bit
    for bit, identical on every rank."""
    got = run_ranks(_paths, world, timeout=180, env=transport_env(transport))
    assert len({g["digest"] for g in got}) == 1
    # (An array of fewer items than ranks is not a small call: the general path only;
    # over TCP, only calls up to 256 KiB are.)
    repeated = sum(REPEATS - 1 for _, shape, _ in CASES if int(np.prod(shape)) >= world)
    small = sum(REPEATS - 1 for dtype, shape, _ in CASES
                if world <= int(np.prod(shape)) and np.dtype(dtype).itemsize
                * int(np.prod(shape)) <= 1 << 18)
    inline = sum(REPEATS - 1 for dtype, shape, _ in CASES
                 if world <= int(np.prod(shape)) and np.dtype(dtype).itemsize
                 * int(np.prod(shape)) <= 64 << 10)
    barriers = REPEATS - 1
    pair = small if world == 2 else 0
    doubling = small if world == 4 else 0
    direct = small if world == 3 else 0
    want = {"shm": {"ShmCall": repeated + barriers, "PairCall": 0, "DoublingCall": 0,
                    "DirectCall": 0, "NowCall": 0, "ZmqPairCall": 0},
            "tcp": {"ShmCall": 0, "PairCall": pair, "DoublingCall": doubling,
                    "DirectCall": direct, "NowCall": barriers, "ZmqPairCall": 0},
            "zmq": {"ShmCall": 0, "PairCall": 0, "DoublingCall": 0, "DirectCall": 0,
                    "NowCall": pair - inline + barriers, "ZmqPairCall": inline}}[transport]
    assert [{k: g[k] for k in want} for g in got] == [want] * world


def test_without_polling_prepared_calls_wait_as_any_call() -> None:
    """SWARMFD_SPIN=0: a prepared call that finds no record at once waits in the channel's
    receive, which blocks at once; results as ever."""
    got = run_ranks(_paths, 3, timeout=180, env={**transport_env("shm"), "SWARMFD_SPIN": "0"})
    assert len({g["digest"] for g in got}) == 1 and got[0]["ShmCall"] > 0


def _mixed(rank: int, world: int, n: int) -> dict[str, Any]:
    """Call by call, one member takes the general path (a non-contiguous array, written
    back; or an async call, driven by the progress engine), the others a prepared call:
    the same messages, so they meet; every result checked."""
    counts = _count_prepared()
    base = np.arange(n, dtype=np.float32)
    for i in range(60):
        odd = i % world == rank
        x = base * (rank + 1) + i
        if odd and i % 2:
            grid = np.zeros((n, 2), np.float32)
            grid[:, 0] = x
            view = grid[:, 0]  # not contiguous: the general path, written back
            fd.all_reduce(view)
            got = grid[:, 0]
        elif odd:
            got = fd.all_reduce(x, async_op=True).wait()
        else:
            got = fd.all_reduce(x)
        want = base * sum(range(1, world + 1)) + world * i
        np.testing.assert_array_equal(got, want)
        if i % 5 == 0:
            if odd:
                fd.barrier(async_op=True).wait()
            else:
                fd.barrier()
    return counts


@pytest.mark.parametrize(("world", "transport", "n"),
                         [(2, "shm", 300), (4, "shm", 300), (2, "shm", 1 << 18),
                          (3, "shm", 1 << 18), (2, "tcp", 300), (3, "tcp", 300),
                          (3, "tcp", 20_000), (4, "tcp", 300), (4, "tcp", 20_000),
                          (2, "zmq", 300), (2, "zmq", 20_000)])
def test_members_on_the_general_path_meet_members_on_prepared_calls(world: int,
                                                                    transport: str,
                                                                    n: int) -> None:
    """(n = 2**18: 1 MiB, shared memory's large path in one round, SplitCall; n = 20,000
    over TCP: 80 KiB arrays, sent without a copy, and at N=4 160 KiB in the doubling's
    last round, more than a connection's buffer, received into place; on the zmq plane
    above its inline size, NowCall.)"""
    got = run_ranks(_mixed, world, n, timeout=180, env=transport_env(transport))
    key = {"shm": "ShmCall", "tcp": {2: "PairCall", 3: "DirectCall", 4: "DoublingCall"}[world],
           "zmq": "ZmqPairCall" if n * 4 <= 64 << 10 else "NowCall"}[transport]
    assert all(g[key] > 20 for g in got), got


#: A small MLP's gradients (the README example's: 2 -> 64 -> 64 -> 3).
GRADS = [(2, 64), (64,), (64, 64), (64,), (64, 3), (3,)]


def _lists(rank: int, world: int) -> dict[str, Any]:
    """Lists of arrays of one dtype, repeated (a training loop's fused gradient mean):
    each result checked against the rank-order reduction and against the general path's
    (an async call of a copy); then, call by call, one member on the general path and
    the others prepared; a tuple with a 0-d array; lists the general path keeps (mixed
    dtypes, a read-only array, which it reports)."""
    from swarmfd import prepared

    counts = _count_prepared()
    lists = count_runs(prepared.ListCall, "run")
    digest = hashlib.sha256()
    for op in ("mean", "sum", "max"):
        for rep in range(REPEATS):
            xs = [_value(rank, rep, np.float32, s) for s in GRADS]
            general = [a.copy() for a in xs]
            assert fd.all_reduce(xs, op=op) is xs
            fd.all_reduce(general, op=op, async_op=True).wait()
            for a, b, shape in zip(xs, general, GRADS, strict=True):
                assert a.shape == shape and a.tobytes() == b.tobytes(), (op, rep, shape)
                want = _expected(world, rep, np.float32, shape, op)
                if op == "mean":
                    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
                else:
                    np.testing.assert_array_equal(a, want)
                digest.update(a.tobytes())
    prepared_runs = lists["ListCall"]
    for i in range(12):
        xs = (np.full((), rank + i, np.int64), np.arange(5, dtype=np.int64) * (rank + 1))
        if i % world == rank:
            fd.all_reduce(xs, async_op=True).wait()
        else:
            fd.all_reduce(xs)
        assert int(xs[0]) == sum(range(world)) + world * i
        np.testing.assert_array_equal(xs[1], np.arange(5) * (world * (world + 1) // 2))
    mixed_runs = lists["ListCall"] - prepared_runs
    before = lists["ListCall"]
    for _ in range(3):
        pair = [np.ones(4, np.float32), np.ones(3, np.float64)]
        fd.all_reduce(pair)
        assert all((a == world).all() for a in pair)
    mixed_dtypes_runs = lists["ListCall"] - before
    frozen = [np.ones(s, np.float32) for s in GRADS]
    frozen[2].flags.writeable = False
    try:
        fd.all_reduce(frozen)
    except ValueError as exc:
        read_only = str(exc)
    else:
        raise AssertionError("a list with a read-only array was reduced")
    return {**counts, "digest": digest.hexdigest(), "prepared": prepared_runs,
            "mixed": mixed_runs, "mixed_dtypes": mixed_dtypes_runs, "read_only": read_only}


@pytest.mark.parametrize(("world", "transport"),
                         [(2, "shm"), (3, "shm"), (2, "tcp"), (3, "tcp"), (4, "tcp"),
                          (2, "zmq")])
def test_list_calls_run_prepared_with_the_general_paths_bits(world: int,
                                                             transport: str) -> None:
    """A repeated blocking all_reduce of a list of arrays of one dtype runs prepared
    after its first call (ListCall, through the prepared call of the fused buffer's
    algorithm): bit for bit the general path's, identical on every rank, and meeting
    members on the general path call by call. Lists of mixed dtypes stay on the general
    path, and a read-only array is reported as before."""
    got = run_ranks(_lists, world, timeout=180, env=transport_env(transport))
    assert len({g["digest"] for g in got}) == 1
    inner = {"shm": "ShmCall", "zmq": "ZmqPairCall",
             "tcp": {2: "PairCall", 3: "DirectCall", 4: "DoublingCall"}[world]}[transport]
    for rank, g in enumerate(got):
        # 3 ops x (REPEATS - 1) repeats; of the 12 mixed calls the rank's own async
        # ones took the general path, and so did its first blocking one.
        assert g["prepared"] == 3 * (REPEATS - 1), g
        own = sum(1 for i in range(12) if i % world == rank)
        assert g["mixed"] == 12 - own - 1, g
        assert g["mixed_dtypes"] == 0, g
        assert g[inner] == g["prepared"] + g["mixed"], g
        assert "read-only" in g["read_only"], g


def _broadcasts(rank: int, world: int) -> dict[str, Any]:
    """Broadcasts from every root, repeated: each result checked against the root's value
    and the general path's (an async call); then, call by call, one member on the general
    path; a 0-d array and one of a whole slot (1 MiB); last, roots that differ between
    the ranks, both prepared: a mismatch on every rank."""
    from swarmfd import prepared

    runs = count_runs(prepared.BroadcastCall, "body")
    for root in range(world):
        for rep in range(REPEATS):
            x = _value(rank, rep, np.float32, (5, 7))
            general = x.copy()
            assert fd.broadcast(x, src=root) is x
            fd.broadcast(general, src=root, async_op=True).wait()
            want = _value(root, rep, np.float32, (5, 7))
            assert x.tobytes() == want.tobytes() and general.tobytes() == want.tobytes()
    repeated = runs["BroadcastCall"]
    for i in range(12):
        for x, like in ((np.array(rank * 10 + i, np.int64), np.array(i, np.int64)),
                        (np.full(1 << 18, rank + i, np.float32),
                         np.full(1 << 18, i, np.float32))):
            if i % world == rank:
                fd.broadcast(x, src=0, async_op=True).wait()
            else:
                fd.broadcast(x, src=0)
            assert x.tobytes() == like.tobytes(), (i, x.shape)
    mixed = runs["BroadcastCall"] - repeated
    try:
        fd.broadcast(np.ones((5, 7), np.float32), src=rank % 2)
    except fd.MismatchError as exc:
        mismatch = str(exc)
    else:
        raise AssertionError("broadcasts from different roots returned")
    return {**runs, "repeated": repeated, "mixed": mixed, "mismatch": mismatch}


@pytest.mark.parametrize(("world", "transport"), [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_broadcasts_on_shared_memory_run_prepared_with_the_general_paths_bytes(
        world: int, transport: str) -> None:
    """A repeated blocking broadcast up to one slot runs prepared on shared memory
    (BroadcastCall), meeting members on the general path call by call; over TCP it is
    not prepared; a root that differs between ranks is a mismatch on every rank."""
    got = run_ranks(_broadcasts, world, timeout=180, env=transport_env(transport))
    for rank, g in enumerate(got):
        own = sum(1 for i in range(12) if i % world == rank)
        if transport == "shm":
            assert g["repeated"] == world * (REPEATS - 1), g
            # 2 shapes; each rank's own async calls and its first blocking one general.
            assert g["mixed"] == 2 * (12 - own - 1), g
        else:
            assert g["BroadcastCall"] == 0, g
        assert "broadcast" in g["mismatch"] and "root" in g["mismatch"], g


def _sub_broadcasts(rank: int, world: int) -> dict[str, Any]:
    """In a sub-group of world ranks 0 and 2 (group ranks 0 and 1), broadcasts from world
    rank 2 (``src``) and from group rank 0 (``group_src``), repeated, while world rank 1
    runs world all_reduces: each root's value arrives, prepared after the first call."""
    from swarmfd import prepared

    runs = count_runs(prepared.BroadcastCall, "body")
    sub = fd.new_group([0, 2])
    for i in range(5):
        if rank == 1:
            assert sub is fd.NON_GROUP_MEMBER
        else:
            x = np.full(6, rank * 100 + i, np.float64)
            fd.broadcast(x, src=2, group=sub)
            assert (x == 200 + i).all(), (i, x)
            y = np.full((2, 3), rank + i, np.int32)
            fd.broadcast(y, group=sub, group_src=0)
            assert (y == i).all(), (i, y)
        z = np.ones(4, np.float32)
        fd.all_reduce(z)
        assert (z == world).all()
    return runs


def test_prepared_broadcasts_in_a_sub_group_take_its_roots() -> None:
    """(Roots are group ranks in a prepared call's slots: world rank 2 is group rank 1.)"""
    got = run_ranks(_sub_broadcasts, 3, timeout=120, env=transport_env("shm"))
    assert [g["BroadcastCall"] for g in got] == [8, 0, 8], got


def _list_mismatch(rank: int, world: int) -> str:
    """Two lists of the same dtype and total size, both prepared on every rank; then
    rank 0 passes one where the others pass the other: their signatures (the lists'
    shapes) differ, as on the general path, though their fused buffers are alike."""
    a = [np.ones(3, np.float32), np.ones(4, np.float32)]
    b = [np.ones(4, np.float32), np.ones(3, np.float32)]
    for _ in range(3):
        fd.all_reduce(a)
        fd.all_reduce(b)
    try:
        fd.all_reduce(a if rank == 0 else b)
    except fd.MismatchError as exc:
        return str(exc)
    raise AssertionError("a mismatched prepared list call returned")


@pytest.mark.parametrize(("world", "transport"), [(2, "shm"), (2, "tcp"), (3, "tcp"),
                                                  (2, "zmq")])
def test_a_mismatch_between_prepared_list_calls_is_reported_on_every_rank(
        world: int, transport: str) -> None:
    got = run_ranks(_list_mismatch, world, timeout=120, env=transport_env(transport))
    for message in got:
        assert "all_reduce" in message and "list" in message, message


def _mismatch(rank: int, world: int) -> str:
    """Both ops prepared on every rank, then rank 0 sums where the others take the max."""
    x = np.ones(16, np.float32)
    for _ in range(3):
        fd.all_reduce(x, op="sum")
        fd.all_reduce(x, op="max")
    try:
        fd.all_reduce(x, op="sum" if rank == 0 else "max")
    except fd.MismatchError as exc:
        return str(exc)
    raise AssertionError("a mismatched prepared call returned")


@pytest.mark.parametrize(("world", "transport"), [(2, "shm"), (3, "shm"), (2, "tcp"),
                                                  (3, "tcp"), (4, "tcp"), (2, "zmq")])
def test_a_mismatch_between_prepared_calls_is_reported_on_every_rank(world: int,
                                                                     transport: str) -> None:
    got = run_ranks(_mismatch, world, timeout=120, env=transport_env(transport))
    for message in got:
        assert "op=sum" in message and "op=max" in message, message


def _put_back(rank: int, world: int) -> dict[str, Any]:
    """Prepared on both ranks; then rank 1 sends rank 0 a point-to-point message just
    before its next all_reduce, on the same connection: rank 0's prepared call reads
    that frame first, puts it back for the channel's receive, which keeps it for the
    recv that follows, and then takes the all_reduce's own frame. Repeated."""
    from swarmfd.comm.planes.zmq import ZmqPlane

    counts = _count_prepared()
    put_back = []
    take = ZmqPlane.take_inline

    def spying(self: Any, *args: Any) -> Any:
        got = take(self, *args)
        put_back.append(got is None and self.back is not None)
        return got

    ZmqPlane.take_inline = spying  # type: ignore[method-assign]
    x = np.ones(64, np.float32)
    for _ in range(3):
        fd.all_reduce(x)
    received = []
    for i in range(5):
        if rank == 1:
            fd.send(np.full(8, 100 + i, np.int64), dst=0)
        x[...] = rank + i
        fd.all_reduce(x)
        assert (x == 1 + 2 * i).all(), (i, x)
        if rank == 0:
            got = np.empty(8, np.int64)
            fd.recv(got, src=1)
            received.append(int(got[0]))
        fd.barrier()
    return {**counts, "put_back": sum(put_back), "received": received}


def test_a_zmq_prepared_call_puts_back_a_frame_that_is_not_its_own() -> None:
    """(The zmq plane reads frames whole: a prepared call that finds another message
    first hands it on, unread, to the channel's receive.)"""
    got = run_ranks(_put_back, 2, timeout=120, env=transport_env("zmq"))
    assert got[0]["received"] == [100, 101, 102, 103, 104], got[0]
    assert got[0]["put_back"] >= 3, got[0]  # (most of the 5: the send goes first)
    assert all(g["ZmqPairCall"] >= 2 for g in got), got


def _lost(rank: int, world: int) -> dict[str, Any]:
    """Prepared on both ranks; then rank 1 dies and rank 0 calls again."""
    x = np.ones(256, np.float32)
    for _ in range(5):
        fd.all_reduce(x)
    fd.barrier()
    if rank == 1:
        # (On the zmq plane a send is handed to libzmq's I/O thread: killed at once, this
        # rank could take its last barrier message with it, and rank 0 would see the loss
        # in the barrier, before the call this test times.)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # (the kill lands while rank 0 waits, or before)
    start = time.monotonic()
    try:
        fd.all_reduce(x)
        fd.all_reduce(x)
    except Exception as exc:
        return {**error_info(exc, start), "start": start}
    raise AssertionError("all_reduce with a killed peer returned")


@pytest.mark.waits  # bounds how long the loss takes to show
@pytest.mark.parametrize("transport", ["shm", "tcp", "zmq"])
def test_a_peer_killed_under_a_prepared_call_is_reported_fast(transport: str) -> None:
    """A prepared all_reduce whose peer is killed raises a PeerLostError naming it within
    2 s (the group timeout is 60 s), as the general path does."""
    stall_meter()
    out = run_ranks_raw(_lost, 2, timeout=120, group_timeout=60.0,
                        env=transport_env(transport))
    ok, info = out[0]
    assert ok, info
    assert "PeerLostError" in info["mro"] and "rank 1" in info["message"], info
    limit, stalled = allowed(2.0, info["start"], info["t"])
    assert info["elapsed"] < limit, f"{info['elapsed']:.2f} s{stalled}: {info['message']}"


def _bounded(rank: int, world: int, port: int) -> dict[str, Any]:
    """More shapes than a group keeps prepared calls for; then cleanup and a new init:
    the new world prepares its own calls, results as ever."""
    from swarmfd import group as _group
    from swarmfd import prepared

    world_group = _group.resolve_group(None, "test")
    most = 0
    for n in range(world, world + prepared.MAX_PREPARED + 6):
        for _ in range(2):
            x = np.full(n, rank + 1, np.int64)
            fd.all_reduce(x)
            assert (x == world * (world + 1) // 2).all()
        most = max(most, len(world_group.prepared))
    fd.cleanup()
    kept_after_cleanup = len(world_group.prepared)
    fd.init(world, rank, master_addr="127.0.0.1", master_port=port, timeout=20)
    counts = _count_prepared()
    for _ in range(3):
        x = np.full(8, rank + 1, np.float32)
        fd.all_reduce(x)
        assert (x == world * (world + 1) // 2).all()
    return {"most": most, "after_cleanup": kept_after_cleanup, "counts": counts}


def test_a_group_keeps_a_bounded_number_and_cleanup_lets_them_go() -> None:
    got = run_ranks(_bounded, 2, free_port(), timeout=120, env=transport_env("shm"))
    from swarmfd import prepared

    for g in got:
        assert 0 < g["most"] <= prepared.MAX_PREPARED, g
        assert g["after_cleanup"] == 0, g  # (their views of the closed segments let go)
        assert g["counts"]["ShmCall"] == 2, g  # a new world prepares its own


def test_the_call_number_is_where_prepared_headers_splice_it() -> None:
    """Prepared calls pack their headers once and splice each call's number into bytes
    _SEQ_AT.._SEQ_END: exactly where, and only where, wire.pack_header puts it."""
    from swarmfd import prepared
    from swarmfd.comm import wire

    sig = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 1, count=4)
    for seq in (1, 0x01020304, 0xFFFFFFFF):
        zero = wire.pack_header(int(wire.Kind.DATA), sig, 3, 0, 7, 16, 0, 5)
        real = wire.pack_header(int(wire.Kind.DATA), sig, 3, seq, 7, 16, 0, 5)
        spliced = (zero[:prepared._SEQ_AT] + seq.to_bytes(4, "little")
                   + zero[prepared._SEQ_END:])
        assert spliced == real
