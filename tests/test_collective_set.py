"""The public calls of the full collective set: reduce_scatter, all_to_all,
gather, scatter, uneven all_gather, send/recv, broadcast_object/all_gather_object.

* In this process, a world of one: every argument check names what is wrong and what
  was expected, before anything is sent.
* On real ranks, one job per plane (shared memory, the socket plane, the zmq plane):
  every call against numpy's answer over dtypes, 0-d and empty arrays, first
  dimensions smaller than the group, every root, ``out=`` and async forms; and the
  mismatches only the ranks together can see (different splits, trailing dimensions,
  a recv of the wrong shape), each in a group of its own so the job goes on.
  (Algorithms for every size and group size: tests/test_algorithms.py; random mixes of
  everything, async and blocking: tests/test_async.py.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import swarmfd as fd

from .conftest import run_ranks, transport_env

CONTRACT_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SWARMFD_PORT")


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in CONTRACT_VARS:
        monkeypatch.delenv(name, raising=False)
    fd.init(1, 0)
    yield
    fd.cleanup()


BAD_CALLS: list[tuple[str, Callable[[], Any], type, str]] = [
    ("reduce_scatter of a 0-d array",
     lambda: fd.reduce_scatter(np.array(1.0, np.float32)), ValueError, "0-d"),
    ("reduce_scatter with a wrong out",
     lambda: fd.reduce_scatter(np.zeros(4), np.zeros(3)), ValueError, "shape"),
    ("integer mean", lambda: fd.reduce_scatter(np.zeros(4, np.int32), op="mean"), TypeError,
     "floating-point"),
    ("all_to_all of a 0-d array", lambda: fd.all_to_all(np.array(1.0, np.float32)),
     ValueError, "0-d"),
    ("in_splits of the wrong sum",
     lambda: fd.all_to_all(np.zeros(5), in_splits=[4]), ValueError, "add up to 4"),
    ("in_splits of the wrong length",
     lambda: fd.all_to_all(np.zeros(5), in_splits=[2, 3]), ValueError, "in_splits"),
    ("a rank's own splits that disagree",
     lambda: fd.all_to_all(np.zeros(3), in_splits=[3], out_splits=[2]), ValueError,
     "sends itself 3 rows"),
    ("gather with out of the wrong shape",
     lambda: fd.gather(np.zeros(3), out=np.zeros((1, 4))), ValueError, "(1, 3)"),
    ("scatter of too few chunks",
     lambda: fd.scatter(np.zeros(3), []), ValueError, "list of 1"),
    ("scatter of a chunk of another shape",
     lambda: fd.scatter(np.zeros(3), [np.zeros(4)]), ValueError, "chunk 0"),
    ("scatter from one array of the wrong shape",
     lambda: fd.scatter(np.zeros(3), np.zeros((2, 3))), ValueError, "(1, 3)"),
    ("send to oneself", lambda: fd.send(np.zeros(3), 0), ValueError, "itself"),
    ("a tag out of range", lambda: fd.isend(np.zeros(3), 0, tag=-1), ValueError, "tag"),
    ("a destination out of range", lambda: fd.send(np.zeros(3), 4), ValueError, "dst=4"),
    ("an object that is not JSON",
     lambda: fd.broadcast_object({1, 2}), TypeError, "never pickled"),
    ("all_gather with out of another dtype",
     lambda: fd.all_gather(np.zeros(3), out=np.zeros((1, 3), np.float32)), TypeError,
     "dtype"),
]


@pytest.mark.usefixtures("alone")
@pytest.mark.parametrize(("what", "call", "exc", "needle"), BAD_CALLS,
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_are_refused_naming_what_was_expected(
        what: str, call: Callable[[], Any], exc: type, needle: str) -> None:
    with pytest.raises(exc) as info:
        call()
    assert needle in str(info.value), str(info.value)
    assert "swarmfd." in str(info.value)


@pytest.mark.usefixtures("alone")
def test_a_group_made_by_its_members_checks_its_id_and_members() -> None:
    """swarmfd.group.members_group (torch's new_group through the c10d backend) takes ids
    of its own range, apart from new_group's; an id outside it, one already taken, or a
    rank that is not a member is refused, naming what is wrong."""
    from swarmfd import group as _group

    g = _group.members_group(_group.MEMBERS_FIRST_GID, [0])
    assert (g.gid, g.rank, g.size, g.ranks) == (_group.MEMBERS_FIRST_GID, 0, 1, (0,))
    assert fd.new_group([0]).gid < _group.MEMBERS_FIRST_GID  # new_group's own ids
    assert np.array_equal(fd.all_reduce(np.ones(3), group=g), np.ones(3))
    with pytest.raises(ValueError, match="taken already"):
        _group.members_group(_group.MEMBERS_FIRST_GID, [0])
    with pytest.raises(ValueError, match="out of range"):
        _group.members_group(_group.MAX_GID, [0])
    with pytest.raises(ValueError, match="out of range"):
        _group.members_group(_group.MEMBERS_MAX_GID + 1, [0])
    with pytest.raises(ValueError, match="out of range: expected 0 <= rank"):
        _group.members_group(_group.MEMBERS_FIRST_GID + 1, [1])
    with pytest.raises(ValueError, match="area 2 is not one of the areas of such groups"):
        _group.members_group(_group.MEMBERS_FIRST_GID + 1, [0], 2)
    h = _group.members_group(_group.MEMBERS_FIRST_GID + 1, [0], _group.MEMBER_AREAS[0])
    assert (g.area, h.area) == (None, _group.MEMBER_AREAS[0])


@pytest.mark.usefixtures("alone")
def test_a_world_of_one_returns_each_calls_own_answer() -> None:
    x = np.arange(6.0).reshape(3, 2)
    assert np.array_equal(fd.reduce_scatter(x), x)
    assert np.array_equal(fd.all_to_all(x), x)
    assert [a.tolist() for a in fd.gather(x)] == [x.tolist()]
    out = np.zeros_like(x)
    assert fd.scatter(out, [x]) is out and np.array_equal(out, x)
    assert fd.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert fd.all_gather_object(b"\x00\xff") == [b"\x00\xff"]
    assert fd.all_reduce(np.ones(2), op="avg").tolist() == [1.0, 1.0]


# -- on real ranks -------------------------------------------------------------------------

DTYPES = ["int8", "int32", "int64", "uint16", "float16", "float32", "float64", "complex64"]


def _battery(rank: int, world: int) -> list[str]:
    """Every check on this rank; returns what went wrong (empty: all right)."""
    problems: list[str] = []

    def check(what: str, got: Any, want: Any) -> None:
        g, w = np.asarray(got), np.asarray(want)
        if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(g, w):
            problems.append(f"rank {rank}: {what}: got {g.dtype}{g.shape} {g.ravel()[:6]}, "
                            f"want {w.dtype}{w.shape} {w.ravel()[:6]}")

    def pattern(r: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        count = int(np.prod(shape))
        return ((np.arange(count) % 11) + 3 * r + 1).astype(dtype).reshape(shape)

    # reduce_scatter: dtypes, uneven parts, fewer rows than ranks, out=, mean/avg/max.
    for dtype in DTYPES:
        for shape in [(7, 3), (1, 2), (0, 4), (world * 2,)]:
            total = sum(pattern(r, shape, dtype) for r in range(world)).astype(dtype)
            want = np.array_split(total, world)[rank]
            check(f"reduce_scatter {dtype}{shape}", fd.reduce_scatter(pattern(rank, shape, dtype)),
                  want)
    x = pattern(rank, (5, 2), "float64")
    out = np.empty_like(np.array_split(x, world)[rank])
    got = fd.reduce_scatter(x, out, op="avg", async_op=True).wait()
    check("reduce_scatter avg out= async", got,
          np.array_split(sum(pattern(r, (5, 2), "float64") for r in range(world)) / world,
                         world)[rank])
    if got is not out:
        problems.append(f"rank {rank}: reduce_scatter(out=) did not return out")
    check("reduce_scatter max", fd.reduce_scatter(x, op="max"),
          np.array_split(pattern(world - 1, (5, 2), "float64"), world)[rank])

    # all_to_all: equal parts, uneven in/out splits, splits exchanged, empty parts.
    for dtype in ("int16", "float32", "complex128"):
        x = (np.arange(world * 2 * 3).reshape(world * 2, 3) + 100 * rank).astype(dtype)
        want = np.concatenate([(np.arange(world * 2 * 3).reshape(world * 2, 3) + 100 * p)
                               .astype(dtype)[2 * rank:2 * rank + 2] for p in range(world)])
        check(f"all_to_all {dtype}", fd.all_to_all(x), want)
    sends = [[(i + j) % 3 for j in range(world)] for i in range(world)]  # some empty
    x = np.concatenate([np.full((sends[rank][j], 2), 10 * rank + j, np.int64)
                        for j in range(world)])
    want = np.concatenate([np.full((sends[i][rank], 2), 10 * i + rank, np.int64)
                           for i in range(world)])
    check("all_to_all uneven, splits exchanged", fd.all_to_all(x, in_splits=sends[rank]), want)
    out = np.empty_like(want)
    got = fd.all_to_all(x, out, in_splits=sends[rank],
                        out_splits=[sends[i][rank] for i in range(world)], async_op=True).wait()
    check("all_to_all uneven out_splits out= async", got, want)

    # gather and scatter: every root, out=, one array or a list, group_dst.
    for root in range(world):
        x = pattern(rank, (2, 3), "int32")
        got = fd.gather(x, dst=root)
        if rank == root:
            check(f"gather to {root}", np.stack(got), np.stack([pattern(r, (2, 3), "int32")
                                                               for r in range(world)]))
        elif got is not None:
            problems.append(f"rank {rank}: gather to {root} returned {type(got)} off the root")
        buf = np.empty((world, 2, 3), np.int32) if rank == root else None
        got = fd.gather(x, root, out=buf, async_op=True).wait()
        if rank == root:
            check(f"gather to {root} out=", buf, np.stack([pattern(r, (2, 3), "int32")
                                                           for r in range(world)]))
        chunks = np.stack([pattern(r + 5, (4,), "float32") for r in range(world)])
        for form in ("list", "array"):
            src_chunks = (list(chunks) if form == "list" else chunks) if rank == root else None
            out = np.zeros(4, np.float32)
            fd.scatter(out, src_chunks, src=root)
            check(f"scatter from {root} ({form})", out, chunks[rank])
    out = np.zeros(0, np.float64)
    fd.scatter(out, [np.zeros(0)] * world if rank == 0 else None)
    got = fd.gather(np.array(rank, np.float64), group_dst=world - 1)
    if rank == world - 1:
        check("gather of 0-d arrays", np.array(got), np.arange(world, dtype=np.float64))

    # all_gather of first dimensions that differ, 0 rows included, and out= when equal.
    x = np.full((rank % 2 * 3, 2, 2), rank, np.uint8)  # ranks 0, 2, ... send no rows
    got = fd.all_gather(x)
    for p in range(world):
        check(f"uneven all_gather part {p}", got[p], np.full((p % 2 * 3, 2, 2), p, np.uint8))
    # Parts over the limit of one round (their rows follow their counts), mixed with
    # small ones, and all of them over it; blocking and async.
    for rows_of in (lambda p: p % 2 * 40_000, lambda p: 20_000 + p):
        x = np.arange(rows_of(rank), dtype=np.float32) + rank
        for form, got in (("blocking", fd.all_gather(x)),
                          ("async", fd.all_gather(x, async_op=True).wait())):
            for p in range(world):
                check(f"large uneven all_gather part {p} ({form})", got[p],
                      np.arange(rows_of(p), dtype=np.float32) + p)
    buf = np.empty((world, 3), np.int64)
    got = fd.all_gather(np.full(3, rank, np.int64), out=buf)
    check("all_gather out=", buf, np.repeat(np.arange(world, dtype=np.int64), 3).reshape(
        world, 3))
    check("all_gather of 0-d", np.array(fd.all_gather(np.array(rank, np.int16))),
          np.arange(world, dtype=np.int16))

    # send/recv around the ring, several tags at once, eager and large.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for count in (0, 3, 300_000):
        works = [fd.isend(np.full(count, rank * 10 + tag, np.float64), nxt, tag=tag)
                 for tag in (1, 2)]
        bufs = {tag: np.empty(count) for tag in (2, 1)}
        for tag, b in bufs.items():
            fd.recv(b, prv, tag=tag)
            check(f"recv {count} tag {tag}", b, np.full(count, prv * 10 + tag, np.float64))
        for w in works:
            w.wait()

    # objects.
    obj = {"rank": rank, "name": "é", "v": [1.5, None, True]}
    for root in (0, world - 1):
        got = fd.broadcast_object(obj if rank == root else None, src=root)
        if got != {"rank": root, "name": "é", "v": [1.5, None, True]}:
            problems.append(f"rank {rank}: broadcast_object from {root}: {got}")
    got = fd.all_gather_object(bytes([rank]) * rank if rank % 2 else {"r": rank})
    want = [bytes([p]) * p if p % 2 else {"r": p} for p in range(world)]
    if got != want:
        problems.append(f"rank {rank}: all_gather_object: {got}")

    # Mismatches only the ranks together see, each in a group of its own.
    odd = rank == world - 1
    for what, call, needle in [
        # The odd rank sends rank 0 two rows; rank 0 expects one from it.
        ("different splits", lambda g: fd.all_to_all(
            np.zeros(world + (1 if odd else 0)), in_splits=[2 if odd else 1] + [1] * (world - 1),
            out_splits=[1] * world, group=g), "split"),
        ("different trailing dimensions", lambda g: fd.all_gather(
            np.zeros((2, 3 if odd else 4)), group=g), "(rows, 3)"),
        ("different root", lambda g: fd.gather(np.zeros(2), dst=0 if odd else 1, group=g),
         "root"),
    ]:
        # A rank whose own part of the call was consistent may finish it; the group is
        # broken all the same, and its next call says so.
        g = fd.new_group(list(range(world)))
        try:
            call(g)
            fd.barrier(group=g)
            problems.append(f"rank {rank}: {what}: no error")
        except fd.CollectiveError as exc:
            if needle not in str(exc) and not isinstance(exc, fd.AbortedError):
                problems.append(f"rank {rank}: {what}: {type(exc).__name__}: {exc}")
    g = fd.new_group([0, 1])
    if rank in (0, 1):
        try:
            if rank == 0:
                fd.send(np.zeros(5, np.float32), 1, group=g)
            else:
                fd.recv(np.zeros(6, np.float32), 0, group=g)
            if rank == 1:
                problems.append("rank 1: recv of the wrong size: no error")
        except fd.CollectiveError as exc:
            if rank == 1 and "5" not in str(exc):
                problems.append(f"rank 1: recv of the wrong size: {exc}")
    fd.barrier()
    return problems


def _abort_before_the_group(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 waits in group h for rank 0 while ranks 0 and 2 make group g and fail its
    first call (rank 2 gathers to another root, which rank 0 finds in g's next call and
    aborts g); only then does rank 1 make g and call the gather, whose part from rank 2
    will never come."""
    h = fd.new_group([0, 1])
    if rank == 1:
        fd.barrier(group=h)  # rank 0 comes after g failed; g's abort arrives meanwhile
    g = fd.new_group([0, 1, 2])
    t0 = time.monotonic()
    error = ""
    try:
        fd.gather(np.zeros(2), dst=0 if rank == 2 else 1, group=g)
        fd.barrier(group=g)
    except fd.CollectiveError as exc:
        error = type(exc).__name__
    took = time.monotonic() - t0
    if rank == 0:
        fd.barrier(group=h)
    fd.barrier()
    return {"error": error, "took": took}


@pytest.mark.parametrize("transport", ["tcp", "zmq", "shm"])
def test_an_abort_of_a_group_not_made_yet_reaches_its_first_call(transport: str) -> None:
    """Making a group needs no message, so a peer may make it, fail its first call and
    abort it before this rank made it: the abort, read while this rank waits in another
    group, fails the group's first call here at once (it was dropped, and the call waited
    for the timeout: 1 run in about 15 of the mismatch battery under load)."""
    out = run_ranks(_abort_before_the_group, 3, env=transport_env(transport), timeout=60,
                    group_timeout=20.0)
    assert all(o["error"] for o in out), out
    assert out[1]["error"] == "AbortedMismatchError" and out[1]["took"] < 5, out


@pytest.mark.parametrize(("transport", "world"),
                         [("shm", 3), ("tcp", 3), ("zmq", 3),
                          # recursive doubling on the socket plane (a power-of-two group)
                          ("tcp", 4)])
def test_every_new_collective_on_real_ranks(transport: str, world: int) -> None:
    out = run_ranks(_battery, world, env=transport_env(transport), timeout=120)
    problems = [p for rank_problems in out for p in rank_problems]
    assert not problems, "\n".join(problems)
