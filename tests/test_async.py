"""Async operations (fd.Work) and the full collective set, on real ranks.

* Progress without the caller: an async 16 MiB all_reduce, of an array or of a list,
  completes while the caller sleeps without calling into swarmfd (its Work records
  when), on shared memory and on TCP.
* (Overlap with compute is a benchmark, not a timed test: benchmarks/overlap.py.)
* A stress run of random mixes of async and blocking ops (every collective, p2p,
  several groups) at N=2..4: exact integers and bitwise-identical floats everywhere.
* A rank killed while 10 async ops are pending: every survivor's pending Work raises
  PeerLostError naming it.
* wait(timeout) raises TimeoutError and leaves the op running; many pending isends and
  broadcasts need no protocol window.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import numpy as np
import pytest

import swarmfd as fd

from .conftest import run_ranks, transport_env
from .support.robust_harness import RankCtx, Ranks, error_info

TRANSPORTS = ["shm", "tcp", "zmq"]


def _progress(rank: int, world: int, kind: str = "array") -> dict[str, Any]:
    x = np.full(4 << 20, rank + 1.0, np.float32)  # 16 MiB
    fd.barrier()
    # A list is one Work joined from its calls (one a dtype; two halves reduced where
    # they are, as DDP's buckets are): it completes when they do, not when asked.
    w = fd.all_reduce(x if kind == "array" else [x[:1 << 21], x[1 << 21:]], async_op=True)
    # The caller sleeps and never calls into swarmfd until the Work has completed (it
    # reads ``completed_at``, which the progress engine sets, for a list on each of its
    # parts; reading it drives nothing) or a generous
    # deadline passes: the op must finish without the caller's help. Not a race against
    # a fixed sleep, which a loaded machine can lose however well progress works.
    deadline = time.monotonic() + 30.0
    while w.completed_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    end_of_sleep = time.monotonic()
    w.wait()
    return {"done_at": w.completed_at, "end_of_sleep": end_of_sleep,
            "ok": bool((x == world * (world + 1) / 2).all())}


@pytest.mark.parametrize("kind", ["array", "list"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_async_all_reduce_progresses_while_the_caller_sleeps(transport: str,
                                                                kind: str) -> None:
    for r in run_ranks(_progress, 2, kind, env=transport_env(transport)):
        assert r["ok"]
        assert r["done_at"] is not None and r["done_at"] <= r["end_of_sleep"], r


def _timeouts(rank: int, world: int) -> dict[str, Any]:
    buf = np.empty(1000)
    out: dict[str, Any] = {}
    if rank == 0:
        w = fd.irecv(buf, 1, tag=3)
        try:
            w.wait(timeout=0.2)
            out["timed"] = False
        except TimeoutError:
            out["timed"] = not w.is_completed()
        fd.barrier()  # now rank 1 sends
        w.wait()
        out["got"] = float(buf[0])
    else:
        fd.barrier()
        fd.send(np.full(1000, 7.0), 0, tag=3)
    # Hundreds of pending ops: broadcasts and isends, no protocol window in the way.
    works = [fd.broadcast(np.full(10, float(i if rank == 0 else -1)), src=0, async_op=True)
             for i in range(300)]
    out["bcast"] = all(float(w.wait()[0]) == i for i, w in enumerate(works))
    peer = 1 - rank
    sends = [fd.isend(np.full(100_000, float(i)), peer, tag=1) for i in range(100)]
    bufs = [np.empty(100_000) for _ in range(100)]
    recvs = [fd.irecv(b, peer, tag=1) for b in bufs]
    for w in sends + recvs:
        w.wait()
    out["isend"] = all(float(b[0]) == i and float(b[-1]) == i for i, b in enumerate(bufs))
    return out


def test_wait_timeout_and_many_pending_ops() -> None:
    out = run_ranks(_timeouts, 2, env=transport_env("tcp"))
    assert out[0]["timed"] and out[0]["got"] == 7.0, out
    assert all(o["bcast"] and o["isend"] for o in out), out


# -- the stress run -----------------------------------------------------------------------


def _mix(rank: int, world: int, seed: int, steps: int) -> list[str]:
    """The same random program on every rank (one seed): each rank records a digest of
    every result; the test compares the digests across ranks and with the exact value."""
    rng = random.Random(seed)
    groups = [None, fd.new_group(list(range(world))[: max(2, world - 1)]),
              fd.new_group(list(range(1, world)) if world > 2 else [0, 1])]
    digests: list[tuple[int, str]] = []
    pending: list[tuple[int, Any, Any]] = []

    def done(step: int, w: Any, check: Any) -> None:
        digests.append((step, check(w.wait() if hasattr(w, "wait") else w)))

    for step in range(steps):
        g = rng.choice(groups)
        member = g is None or g is not fd.NON_GROUP_MEMBER
        kind = rng.choice(["all_reduce", "all_reduce_f", "broadcast", "all_gather",
                           "reduce_scatter", "all_to_all", "p2p", "barrier"])
        n_elems = rng.choice([1, 7, 1000, 70_000, 300_000])
        is_async = rng.random() < 0.5
        pick = rng.random()  # the root, as a fraction of the group (every rank draws it)
        flush = rng.random() < 0.3
        if not member:
            continue
        size = fd.get_world_size(g)
        me = fd.get_rank(g)
        ranks = list(range(world)) if g is None else list(g.ranks)
        if kind == "all_reduce":
            x = np.full(n_elems, me + step, np.int64)
            want = sum(range(size)) + size * step
            w = fd.all_reduce(x, group=g, async_op=is_async)
            pending.append((w, lambda v, want=want: f"ar:{bool((v == want).all())}"))
        elif kind == "all_reduce_f":
            x = np.random.default_rng(seed * 1000 + step * 10 + me).standard_normal(n_elems)
            w = fd.all_reduce(x, group=g, async_op=is_async)
            pending.append((w, lambda v: f"arf:{hashlib.sha256(v.tobytes()).hexdigest()}"))
        elif kind == "broadcast":
            root = int(pick * size)
            x = np.full(n_elems, step if me == root else -1, np.int32)
            w = fd.broadcast(x, group=g, group_src=root, async_op=is_async)
            pending.append((w, lambda v, s=step: f"bc:{bool((v == s).all())}"))
        elif kind == "all_gather":
            x = np.full((n_elems % 17 + me, 2), me, np.int16)
            w = fd.all_gather(x, group=g, async_op=is_async)
            pending.append((w, lambda v: "ag:" + ",".join(
                f"{a.shape[0]}:{bool((a == i).all())}" for i, a in enumerate(v))))
        elif kind == "reduce_scatter":
            x = np.arange(n_elems, dtype=np.int64) + me
            w = fd.reduce_scatter(x, group=g, async_op=is_async)
            full = np.arange(n_elems, dtype=np.int64) * size + sum(range(size))
            want = np.array_split(full, size)[me]
            pending.append((w, lambda v, want=want: f"rs:{bool(np.array_equal(v, want))}"))
        elif kind == "all_to_all":
            rows = n_elems % 5 + 1
            x = np.repeat(np.arange(size, dtype=np.int64) * 100 + me, rows)
            w = fd.all_to_all(x, group=g, async_op=is_async)
            want = np.repeat(np.arange(size, dtype=np.int64) + me * 100, rows)
            pending.append((w, lambda v, want=want: f"a2a:{bool(np.array_equal(v, want))}"))
        elif kind == "p2p":
            # Ring in the group: irecv from the previous, isend to the next.
            nxt, prv = ranks[(me + 1) % size], ranks[(me - 1) % size]
            buf = np.empty(n_elems, np.float64)
            wr = fd.irecv(buf, prv, tag=step, group=g)
            ws = fd.isend(np.full(n_elems, float(ranks[me] + step)), nxt, tag=step, group=g)
            want = float(prv + step)
            pending.append((ws, lambda v: "sent"))
            pending.append((wr, lambda v, want=want: f"p2p:{bool((v == want).all())}"))
            pending[-2:] = [(step, *pending[-2]), (step, *pending[-1])]
        else:
            w = fd.barrier(group=g, async_op=is_async)
            pending.append((w, lambda v: "barrier"))
        if len(pending) and len(pending[-1]) == 2:
            pending[-1] = (step, *pending[-1])
        if not is_async or flush:
            for entry in pending:
                done(*entry)
            pending = []
    for entry in pending:
        done(*entry)
    fd.barrier()
    return digests


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_mixes_of_async_and_blocking_ops(world: int, transport: str) -> None:
    out = run_ranks(_mix, world, 11 * world, 120, env=transport_env(transport), timeout=120)
    floats: dict[int, set[str]] = {}
    for r, digests in enumerate(out):
        bad = [d for d in digests if "False" in d[1]]
        assert not bad, (r, bad)
        for step, d in digests:
            if d.startswith("arf:"):
                floats.setdefault(step, set()).add(d)
    # Float results are bitwise identical on every rank of the group that reduced them.
    assert floats and all(len(ds) == 1 for ds in floats.values()), floats
    assert sum(len(d) for d in out) > 100


# -- a rank killed with ops pending ---------------------------------------------------------


def _pending_when_killed(ctx: RankCtx) -> Any:
    if ctx.rank == 1:
        ctx.report("issued")
        time.sleep(60)  # never joins the calls; killed
    works = [fd.all_reduce(np.full(500_000, float(i)), async_op=True) for i in range(10)]
    assert not any(w.is_completed() for w in works)
    ctx.report("issued")
    errors = []
    for w in works:
        try:
            w.wait()
            errors.append(None)
        except Exception as exc:
            errors.append(error_info(exc, ctx.mark.value))
    return errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_killed_with_ten_ops_pending_fails_every_pending_work(transport: str) -> None:
    with Ranks(_pending_when_killed, 3, group_timeout=30.0, transport=transport) as ranks:
        ranks.wait("issued")
        time.sleep(0.2)
        ranks.kill(1)
        out = ranks.results([0, 2], timeout=30)
    for r, errors in out.items():
        failed = [e for e in errors if e is not None]
        assert failed, (r, errors)
        for e in failed:
            assert "PeerLostError" in e["mro"], (r, e)
        assert any("rank 1" in e["message"] for e in failed), (r, failed)
        assert min(e["elapsed"] for e in failed) < 5.0, (r, failed)
