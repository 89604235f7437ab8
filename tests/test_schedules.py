"""Repeated calls on real ranks: a group works a kind of call out once, as a Schedule
(swarmfd/call.py), and runs it again for every later call of that kind. The tests count
the Schedules made and check that a group keeps the very same one; a repeated call
meets a member's first call of its kind (its schedule being made), an async one and
one on a non-contiguous array call by call, byte for byte; results are bitwise the
reference's; a mismatch between repeated calls, and a peer killed under one, are
reported as for any call. Every plane: shared memory, the socket plane, the zmq plane.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import swarmfd as fd
from swarmfd.comm import wire

from .support.harness import (
    LOST_PEER_LIMIT,
    allowed,
    count_runs,
    error_info,
    free_port,
    run_ranks,
    run_ranks_raw,
    stall_meter,
    transport_env,
)

#: (dtype, shape, op): the dtype groups, 0-d to 2-d, every op; the last two above a
#: small call's size (shared memory's rounds; over TCP the pair, the ring at N=3).
CASES = [
    (np.float32, (1000,), "sum"),
    (np.float64, (3, 5), "mean"),
    (np.float16, (7,), "max"),
    (np.int64, (), "sum"),
    (np.int32, (64, 64), "prod"),
    (np.uint8, (33,), "min"),
    (np.complex64, (4,), "sum"),
    (np.float32, (512, 512), "sum"),
    (np.float64, (40_001,), "mean"),
]
#: Repetitions of each call: the first makes its schedule, the others run it.
REPEATS = 4
#: A mismatch is reported when its messages meet: well before the group's timeout.
MISMATCH_SECONDS = 5.0
#: The group timeout of the ranks that check a report's time: far above both bounds.
GROUP_TIMEOUT = 60.0


def _value(rank: int, rep: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers (1-3) in ``dtype``: their sums, products and means are the same
    bits in any order of reduction, so every algorithm's result is the reference's."""
    rng = np.random.default_rng([rank, rep, len(shape)])
    x = rng.integers(1, 4, size=shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.integers(1, 4, size=shape)
    return np.asarray(x).astype(dtype)


def _expected(world: int, rep: int, dtype: Any, shape: tuple[int, ...], op: str) -> np.ndarray:
    """Every rank's value reduced, then (a mean) divided as the algorithms divide."""
    from swarmfd.algorithms.base import divide_by

    ufunc = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum,
             "min": np.minimum}[op]
    acc = np.array(_value(0, rep, dtype, shape))
    for r in range(1, world):
        acc = ufunc(acc, _value(r, rep, dtype, shape)).astype(dtype)
    acc = np.array(acc)
    if op == "mean":
        divide_by(acc.reshape(-1), world)
    return acc


def _schedules_made() -> dict[str, int]:
    """The live count of Schedules made in this rank from now on."""
    from swarmfd.call import Schedule

    return count_runs(Schedule, "__init__")


def _world() -> Any:
    from swarmfd import group as _group

    return _group.resolve_group(None, "test")


def _mismatch(rank: int) -> dict[str, Any]:
    """Both ops of a call run repeatedly on every rank; then rank 0 sums where the
    others take the max, each running its own cached schedule."""
    x = np.ones(16, np.float32)
    for _ in range(3):
        fd.all_reduce(x, op="sum")
        fd.all_reduce(x, op="max")
    start = time.monotonic()
    try:
        fd.all_reduce(x, op="sum" if rank == 0 else "max")
    except fd.MismatchError as exc:
        return {"message": str(exc), "elapsed": time.monotonic() - start}
    raise AssertionError("a mismatched repeated call returned")


def _paths(rank: int, world: int) -> dict[str, Any]:
    """Each case REPEATS times, blocking and async (a copy): the same bytes, the
    reference's bits; the Schedules made by each repetition, and whether the group kept
    the first one; barriers alike; then a mismatch between repeated calls."""
    g = _world()
    made = _schedules_made()
    out: dict[str, Any] = {"made": [], "kept": []}
    for dtype, shape, op in CASES:
        first = None
        per_rep = []
        for rep in range(REPEATS):
            before = made["Schedule"]
            x = _value(rank, rep, dtype, shape)
            other = x.copy()
            assert fd.all_reduce(x, op=op) is x
            fd.all_reduce(other, op=op, async_op=True).wait()
            per_rep.append(made["Schedule"] - before)
            assert x.tobytes() == other.tobytes(), (dtype, shape, op, rep)
            want = _expected(world, rep, dtype, shape, op)
            assert x.tobytes() == want.tobytes(), (dtype, shape, op, rep)
            s = g.schedules[(shape, np.dtype(dtype), op)]
            if first is None:
                first = s
            out["kept"].append(s is first)
        out["made"].append(per_rep)
    before = made["Schedule"]
    for i in range(REPEATS):
        if i % 2:
            fd.barrier(async_op=True).wait()
        else:
            fd.barrier()
    out["barriers"] = made["Schedule"] - before
    out["mismatch"] = _mismatch(rank)
    return out


def _check_paths(got: list[dict[str, Any]]) -> None:
    for g in got:
        # One schedule made by a kind's first call, none by the later ones (blocking or
        # async), and the group kept the first one.
        assert g["made"] == [[1] + [0] * (REPEATS - 1)] * len(CASES), g["made"]
        assert all(g["kept"]), g["kept"]
        assert g["barriers"] == 1, g
        m = g["mismatch"]
        assert "op=sum" in m["message"] and "op=max" in m["message"], m
        assert m["elapsed"] < MISMATCH_SECONDS, m


@pytest.mark.parametrize(("world", "transport"),
                         [(2, "shm"), (4, "shm"), (2, "tcp"), (3, "tcp"), (4, "tcp"),
                          (2, "zmq"), (4, "zmq")])
def test_a_repeated_call_runs_its_schedule_with_the_references_bits(world: int,
                                                                    transport: str) -> None:
    """A repeated blocking all_reduce runs the schedule its first call made (no other is
    made, blocking or async): the reference's bits on every rank, every dtype group
    and op, small and large; barriers alike. A mismatch between two kinds of call that
    both run cached is reported at once on every rank, naming both sides."""
    _check_paths(run_ranks(_paths, world, timeout=180, group_timeout=GROUP_TIMEOUT,
                           env=transport_env(transport)))


def test_without_polling_a_repeated_call_waits_as_any_call() -> None:
    """SWARMFD_SPIN=0: a plane's take does not look again for a message not there yet;
    the call waits in the channel's receive, which blocks at once; results as ever."""
    _check_paths(run_ranks(_paths, 3, timeout=180, group_timeout=GROUP_TIMEOUT,
                           env={**transport_env("shm"), "SWARMFD_SPIN": "0"}))


def _mixed(rank: int, world: int, n: int) -> dict[str, Any]:
    """Call by call, one member takes another path than the others, who run their cached
    schedule: its first call of the kind (its schedules dropped: a schedule being made),
    an async call (driven by the progress engine), or a non-contiguous array (reduced
    in a copy, written back). The same messages, so they meet; every result the
    reference's bits; the Schedules each path made."""
    g = _world()
    made = _schedules_made()
    base = np.arange(n, dtype=np.float32)
    key = ((n,), np.dtype(np.float32), "sum")
    out: dict[str, list[int]] = {"cached": [], "first": [], "async": [], "strided": []}
    fd.all_reduce(base.copy())  # every member's first call: its schedule
    for i in range(40):
        path = ("first", "async", "strided")[i // world % 3] if i % world == rank else \
            "cached"
        x = base * (rank + 1) + i
        before = made["Schedule"]
        if path == "first":
            g.schedules.clear()
            got = fd.all_reduce(x)
        elif path == "async":
            got = fd.all_reduce(x, async_op=True).wait()
        elif path == "strided":
            grid = np.zeros((n, 2), np.float32)
            grid[:, 0] = x
            fd.all_reduce(grid[:, 0])  # not contiguous
            got = grid[:, 0]
            assert not grid[:, 1].any(), "the write-back went beyond the view"
        else:
            s = g.schedules[key]
            got = fd.all_reduce(x)
            assert g.schedules[key] is s
        out[path].append(made["Schedule"] - before)
        want = base * sum(range(1, world + 1)) + world * i
        assert got.tobytes() == want.tobytes(), (i, path)
        if i % 5 == 0:
            if path in ("async", "first"):
                fd.barrier(async_op=True).wait()
            else:
                fd.barrier()
    return out


@pytest.mark.parametrize(("world", "transport", "n"),
                         [(2, "shm", 300), (4, "shm", 300), (2, "shm", 1 << 18),
                          (2, "tcp", 300), (4, "tcp", 300), (3, "tcp", 20_000),
                          (4, "tcp", 20_000), (2, "zmq", 300), (2, "zmq", 20_000)])
def test_members_on_other_paths_meet_members_on_cached_schedules(world: int,
                                                                 transport: str,
                                                                 n: int) -> None:
    """(n = 2**18: 1 MiB, shared memory's rounds; n = 20,000 over TCP: 80 KiB arrays,
    sent without a copy, and at N=4 160 KiB in the doubling's last round, more than a
    connection's buffer, received into place; on the zmq plane above its inline size,
    a header frame and a payload frame.) A first call makes one schedule; the others,
    none."""
    got = run_ranks(_mixed, world, n, timeout=180, env=transport_env(transport))
    for g in got:
        assert g["first"] and set(g["first"]) == {1}, g
        assert g["async"] and set(g["async"]) == {0}, g
        assert g["strided"] and set(g["strided"]) == {0}, g
        assert len(g["cached"]) >= 20 and set(g["cached"]) == {0}, g


#: A small MLP's gradients (the README example's: 2 -> 64 -> 64 -> 3).
GRADS = [(2, 64), (64,), (64, 64), (64,), (64, 3), (3,)]


def _read_only(world: int) -> list[str]:
    """A list with a read-only array, and a read-only array of a kind of call that runs
    cached: both refused before anything is sent, on every rank; the group goes on."""
    refused = []
    frozen = [np.ones(s, np.float32) for s in GRADS]
    frozen[2].flags.writeable = False
    x = np.ones(5, np.float32)
    fd.all_reduce(x)
    fd.all_reduce(x)  # cached now
    y = np.ones(5, np.float32)
    y.flags.writeable = False
    for arg in (frozen, y):
        try:
            fd.all_reduce(arg)
        except ValueError as exc:
            refused.append(str(exc))
        else:
            raise AssertionError("a read-only array was reduced")
    fd.all_reduce(x)
    assert (x == world ** 3).all(), x
    return refused


def _list_mismatch(rank: int) -> dict[str, Any]:
    """Two lists of the same dtype and total size, both cached on every rank; then rank 0
    passes one where the others pass the other: their signatures (the lists' shapes)
    differ, though their fused buffers are alike."""
    a = [np.ones(3, np.float32), np.ones(4, np.float32)]
    b = [np.ones(4, np.float32), np.ones(3, np.float32)]
    for _ in range(3):
        fd.all_reduce(a)
        fd.all_reduce(b)
    start = time.monotonic()
    try:
        fd.all_reduce(a if rank == 0 else b)
    except fd.MismatchError as exc:
        return {"message": str(exc), "elapsed": time.monotonic() - start}
    raise AssertionError("a mismatched repeated list call returned")


def _lists(rank: int, world: int) -> dict[str, Any]:
    """Lists of arrays of one dtype, repeated (a training loop's fused gradient mean):
    blocking and async (copies) alike, the reference's bits; then, call by call, one
    member async and the others cached (a tuple with a 0-d array); a list of two dtypes
    (two calls) and one with a non-contiguous array (staged), repeated; read-only
    arrays refused; last, a mismatch between two cached lists. The Schedules made."""
    made = _schedules_made()
    out: dict[str, Any] = {"made": []}
    for op in ("mean", "sum", "max"):
        for rep in range(REPEATS):
            before = made["Schedule"]
            xs = [_value(rank, rep, np.float32, s) for s in GRADS]
            other = [a.copy() for a in xs]
            assert fd.all_reduce(xs, op=op) is xs
            fd.all_reduce(other, op=op, async_op=True).wait()
            out["made"].append(made["Schedule"] - before)
            for a, b, shape in zip(xs, other, GRADS, strict=True):
                assert a.shape == shape and a.tobytes() == b.tobytes(), (op, rep, shape)
                want = _expected(world, rep, np.float32, shape, op)
                assert a.tobytes() == want.tobytes(), (op, rep, shape)
    before = made["Schedule"]
    for i in range(12):
        xs = (np.full((), rank + i, np.int64), np.arange(5, dtype=np.int64) * (rank + 1))
        if i % world == rank:
            fd.all_reduce(xs, async_op=True).wait()
        else:
            fd.all_reduce(xs)
        assert int(xs[0]) == sum(range(world)) + world * i
        np.testing.assert_array_equal(xs[1], np.arange(5) * (world * (world + 1) // 2))
    out["mixed"] = made["Schedule"] - before
    before = made["Schedule"]
    for _ in range(3):
        pair = [np.ones(4, np.float32), np.ones(3, np.float64)]
        grid = np.ones((6, 2), np.float32)
        strided = [np.ones(5, np.float32), grid[:, 0]]
        fd.all_reduce(pair)
        fd.all_reduce(strided)
        assert all((a == world).all() for a in pair)
        assert (grid[:, 0] == world).all() and (grid[:, 1] == 1).all()
        assert (strided[0] == world).all()
    out["other_lists"] = made["Schedule"] - before
    out["read_only"] = _read_only(world)
    out["mismatch"] = _list_mismatch(rank)
    return out


@pytest.mark.parametrize(("world", "transport"),
                         [(2, "shm"), (3, "shm"), (2, "tcp"), (4, "tcp"), (2, "zmq")])
def test_list_calls_run_their_schedule_with_the_references_bits(world: int,
                                                                transport: str) -> None:
    """A repeated all_reduce of a list of arrays of one dtype runs the schedule its first
    call made (one a dtype: three ops, one each; a tuple, one; two dtypes, two; a list
    with a non-contiguous array, one): the reference's bits, meeting an async member
    call by call. Read-only arrays are refused as ever, and a mismatch between cached
    lists is reported at once on every rank."""
    got = run_ranks(_lists, world, timeout=180, group_timeout=GROUP_TIMEOUT,
                    env=transport_env(transport))
    for g in got:
        assert g["made"] == ([1] + [0] * (REPEATS - 1)) * 3, g["made"]
        assert g["mixed"] == 1 and g["other_lists"] == 3, g
        assert len(g["read_only"]) == 2 and all("read-only" in m for m in g["read_only"]), g
        m = g["mismatch"]
        assert "all_reduce" in m["message"] and "list" in m["message"], m
        assert m["elapsed"] < MISMATCH_SECONDS, m


def _broadcasts(rank: int, world: int) -> dict[str, Any]:
    """Broadcasts from every root, repeated, blocking and async (a copy): the root's
    bytes; then, call by call, one member async and the others cached, a 0-d array and
    one of a whole slot (1 MiB); last, roots that differ between the ranks, each cached:
    a mismatch on every rank. The Schedules made."""
    made = _schedules_made()
    out: dict[str, Any] = {"made": []}
    for root in range(world):
        for rep in range(REPEATS):
            before = made["Schedule"]
            x = _value(rank, rep, np.float32, (5, 7))
            other = x.copy()
            assert fd.broadcast(x, src=root) is x
            fd.broadcast(other, src=root, async_op=True).wait()
            out["made"].append(made["Schedule"] - before)
            want = _value(root, rep, np.float32, (5, 7))
            assert x.tobytes() == want.tobytes() and other.tobytes() == want.tobytes()
    before = made["Schedule"]
    for i in range(12):
        for x, like in ((np.array(rank * 10 + i, np.int64), np.array(i, np.int64)),
                        (np.full(1 << 18, rank + i, np.float32),
                         np.full(1 << 18, i, np.float32))):
            if i % world == rank:
                fd.broadcast(x, src=0, async_op=True).wait()
            else:
                fd.broadcast(x, src=0)
            assert x.tobytes() == like.tobytes(), (i, x.shape)
    out["mixed"] = made["Schedule"] - before
    start = time.monotonic()
    try:
        fd.broadcast(np.ones((5, 7), np.float32), src=rank % 2)
    except fd.MismatchError as exc:
        out["mismatch"] = {"message": str(exc), "elapsed": time.monotonic() - start}
        return out
    raise AssertionError("broadcasts from different roots returned")


@pytest.mark.parametrize(("world", "transport"), [(2, "shm"), (3, "tcp"), (2, "zmq")])
def test_repeated_broadcasts_run_their_schedule(world: int, transport: str) -> None:
    """A repeated broadcast runs the schedule of its first call (one a root; one a shape
    of the mixed calls): the root's bytes, meeting an async member call by call; a
    root that differs between ranks, each running its cached schedule, is a mismatch
    on every rank, at once."""
    got = run_ranks(_broadcasts, world, timeout=180, group_timeout=GROUP_TIMEOUT,
                    env=transport_env(transport))
    for g in got:
        assert g["made"] == ([1] + [0] * (REPEATS - 1)) * world, g["made"]
        assert g["mixed"] == 2, g
        m = g["mismatch"]
        assert "broadcast" in m["message"] and "root" in m["message"], m
        assert m["elapsed"] < MISMATCH_SECONDS, m


def _sub_broadcasts(rank: int, world: int) -> dict[str, Any]:
    """In a sub-group of world ranks 0 and 2 (group ranks 0 and 1), broadcasts from world
    rank 2 (``src``) and from group rank 0 (``group_src``), repeated, while world rank 1
    runs world all_reduces: each root's value arrives; the sub-group's schedules (one
    a root) made by the first round."""
    sub = fd.new_group([0, 2])
    kept: list[bool] = []
    first: list[Any] = []
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
            now = list(sub.schedules.values())
            first = first or now
            kept.append(len(now) == 2 and all(a is b for a, b in zip(now, first, strict=True)))
        z = np.ones(4, np.float32)
        fd.all_reduce(z)
        assert (z == world).all()
    return {"kept": kept}


def test_repeated_broadcasts_in_a_sub_group_take_its_roots() -> None:
    """(Roots are group ranks in a schedule: world rank 2 is group rank 1.)"""
    got = run_ranks(_sub_broadcasts, 3, timeout=120, env=transport_env("shm"))
    assert [g["kept"] for g in got] == [[True] * 5, [], [True] * 5], got


def _put_back(rank: int, world: int) -> dict[str, Any]:
    """Cached on both ranks; then rank 1 sends rank 0 a point-to-point message just
    before its next all_reduce, on the same connection: rank 0's call takes that frame
    first, puts it back for the channel's receive, which keeps it for the recv that
    follows, and then takes the all_reduce's own frame. Repeated."""
    from swarmfd.comm.planes.zmq import ZmqPlane

    taken: list[bool] = []
    put_back: list[bool] = []
    take = ZmqPlane.take

    def spying(self: Any, *args: Any) -> Any:
        got = take(self, *args)
        taken.append(got is not None)
        put_back.append(got is None and self.back is not None)
        return got

    ZmqPlane.take = spying  # type: ignore[method-assign]
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
    return {"put_back": sum(put_back), "taken": sum(taken), "received": received}


def test_a_zmq_call_puts_back_a_frame_that_is_not_its_own() -> None:
    """(The zmq plane reads frames whole: a call that finds another message first hands
    it on, unread, to the channel's receive.)"""
    got = run_ranks(_put_back, 2, timeout=120, env=transport_env("zmq"))
    assert got[0]["received"] == [100, 101, 102, 103, 104], got[0]
    assert got[0]["put_back"] >= 3, got[0]  # (most of the 5: the send goes first)
    assert all(g["taken"] >= 2 for g in got), got


def _lost(rank: int, world: int) -> dict[str, Any]:
    """Cached on both ranks; then rank 1 dies and rank 0 calls again."""
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
def test_a_peer_killed_under_a_repeated_call_is_reported_fast(transport: str) -> None:
    """A repeated all_reduce whose peer is killed raises a PeerLostError naming it within
    2 s (the group timeout is 60 s), as a first call does."""
    stall_meter()
    out = run_ranks_raw(_lost, 2, timeout=120, group_timeout=GROUP_TIMEOUT,
                        env=transport_env(transport))
    ok, info = out[0]
    assert ok, info
    assert "PeerLostError" in info["mro"] and "rank 1" in info["message"], info
    limit, stalled = allowed(LOST_PEER_LIMIT, info["start"], info["t"])
    assert info["elapsed"] < limit, f"{info['elapsed']:.2f} s{stalled}: {info['message']}"


def _bounded(rank: int, world: int, port: int) -> dict[str, Any]:
    """More kinds of call than a group keeps schedules for; then cleanup and a new init:
    the new world makes its own, results as ever."""
    from swarmfd.call import MAX_SCHEDULES

    world_group = _world()
    most = 0
    for n in range(world, world + MAX_SCHEDULES + 6):
        for _ in range(2):
            x = np.full(n, rank + 1, np.int64)
            fd.all_reduce(x)
            assert (x == world * (world + 1) // 2).all()
        most = max(most, len(world_group.schedules))
    fd.cleanup()
    kept_after_cleanup = len(world_group.schedules)
    fd.init(world, rank, master_addr="127.0.0.1", master_port=port, timeout=20)
    made = _schedules_made()
    for _ in range(3):
        x = np.full(8, rank + 1, np.float32)
        fd.all_reduce(x)
        assert (x == world * (world + 1) // 2).all()
    return {"most": most, "after_cleanup": kept_after_cleanup, "made": made["Schedule"],
            "new": len(_world().schedules)}


def test_a_group_keeps_a_bounded_number_and_cleanup_lets_them_go() -> None:
    got = run_ranks(_bounded, 2, free_port(), timeout=120, env=transport_env("shm"))
    from swarmfd.call import MAX_SCHEDULES

    for g in got:
        assert 0 < g["most"] <= MAX_SCHEDULES, g
        assert g["after_cleanup"] == 0, g  # (their views of the closed segments let go)
        assert g["made"] == 1 and g["new"] == 1, g  # a new world makes its own


def test_the_call_number_is_where_a_schedules_headers_join_it() -> None:
    """A schedule's op packs each header once, cut around the call's number
    (wire.cut_header), and joins the parts around each call's number (wire.seq_bytes):
    exactly where, and only where, wire.pack_header puts it, up to its 32 bits."""
    sig = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 1, count=4)
    head, tail = wire.cut_header(int(wire.Kind.DATA), sig, 3, 7, 16, 0, 5)
    for seq in (1, 0x01020304, 0xFFFFFFFF, 0x1_0000_0002):
        real = wire.pack_header(int(wire.Kind.DATA), sig, 3, seq & 0xFFFFFFFF, 7, 16, 0, 5)
        assert head + wire.seq_bytes(seq) + tail == real, hex(seq)
    assert len(head) + 4 + len(tail) == wire.HEADER_SIZE


def test_an_op_packs_each_header_once_and_joins_each_calls_number(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: an op asks its plane for a header once per (source, tag, bytes) and
    then only joins call numbers (Op.header); every call's messages carry its own number
    and meet the peer's, call after call (thread-ranks on the in-memory plane)."""
    from swarmfd.algorithms import tcp
    from swarmfd.algorithms.base import Op, run

    from .support.memplane import MemoryPlane, run_threads

    asked: dict[int, int] = {}
    real = MemoryPlane.header
    lock = threading.Lock()

    def counting(self: Any, *args: Any) -> Any:
        with lock:
            asked[self.rank] = asked.get(self.rank, 0) + 1
        return real(self, *args)

    monkeypatch.setattr(MemoryPlane, "header", counting)
    sig = wire.Signature(wire.Collective.ALL_REDUCE)

    def fn(r: int, channel: Any, plane: Any) -> list[bytes]:
        op = Op(channel, plane, [0, 1], r, 0, 0, sig)
        out = []
        for call in range(1, 6):
            buf = np.full(4, r + call, np.float32)
            run(op.at(call), tcp.all_reduce_pair(op, buf, np.add))
            out.append(buf.tobytes())
        return out

    got = run_threads(fn, 2)
    want = [np.full(4, 2 * call + 1, np.float32).tobytes() for call in range(1, 6)]
    assert got == [want, want]
    # One header a rank sends (its own) and one it takes (its peer's), for 5 calls.
    assert asked == {0: 2, 1: 2}, asked
