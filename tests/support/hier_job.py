"""A rank of a job that spans hosts: every collective, checked, and the path it took.

Run as a script by the end-to-end tests (simulated hosts: tests/test_hier_netsim.py;
the multi-node Swarm: tests/multinode/). Each rank checks every result itself (exact
values from rank-dependent inputs; float results also bitwise identical on every
rank, compared through a checksum all_gather) and prints one JSON line (prefix
``HIER-RESULT ``) with what it saw: its host, the two-level layout of the world (None:
flat), whether it has shared memory, how many calls each two-level algorithm served,
and the failures. ``--expect-two-level`` makes a flat world or a call that did not
take the two-level path a failure (the job must not fall back to TCP silently).
Exit code 0 when every check passed.

``--until-error`` is the failure probe instead: after a warm-up it prints
``HIER-READY`` and loops on large two-level calls until one raises, then prints what
it raised and when (``time.monotonic()``, one clock for every simulated host).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from collections import Counter
from typing import Any

import numpy as np

import swarmfd as fd
from swarmfd import group as _group
from swarmfd.algorithms import hier

PREFIX = "HIER-RESULT "
SPIED = ("all_reduce_small", "all_reduce_large", "broadcast", "reduce", "all_gather",
         "reduce_scatter")


def _spy(counts: Counter[str]) -> None:
    """Count the calls of each two-level algorithm (collectives look them up per call)."""
    for name in SPIED:
        real = getattr(hier, name)

        def spy(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            counts[_name] += 1
            return _real(*a, **k)

        setattr(hier, name, spy)


def _data(rank: int, count: int, dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(0, 50, count).astype(dt)
    return rng.standard_normal(count).astype(dt)


def _same_everywhere(x: np.ndarray, g: Any = None) -> bool:
    """True when ``x`` is bitwise the same on every rank of ``g``."""
    crc = np.array([zlib.crc32(np.ascontiguousarray(x).tobytes())], np.int64)
    rows = fd.all_gather(crc, group=g)
    return all(int(r[0]) == int(crc[0]) for r in rows)


def run(expect_two_level: bool, sizes: list[int]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    _spy(counts)
    cfg = fd.init_from_env()
    rank, n = cfg.rank, cfg.world_size
    world = _group.world_group()
    two = world.two_level()
    t = _group.current().transport
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    ranks = range(n)
    for count in sizes:
        # all_reduce: integers exact, floats identical everywhere and close
        xi = _data(rank, count, np.int64, 1)
        fd.all_reduce(xi)
        check(np.array_equal(xi, sum(_data(r, count, np.int64, 1) for r in ranks)),
              f"all_reduce int64 {count}")
        xf = _data(rank, count, np.float32, 2)
        fd.all_reduce(xf, op="mean")
        want = np.mean([_data(r, count, np.float32, 2) for r in ranks], axis=0)
        check(np.allclose(xf, want, atol=1e-5) and _same_everywhere(xf),
              f"all_reduce mean float32 {count}")
        for src in sorted({0, n - 1}):
            b = _data(rank, count, np.float64, 3 + src)
            fd.broadcast(b, src=src)
            check(np.array_equal(b, _data(src, count, np.float64, 3 + src)),
                  f"broadcast {count} from {src}")
            r_ = _data(rank, count, np.int32, 5 + src)
            fd.reduce(r_, dst=src)
            want_r = (sum(_data(q, count, np.int32, 5 + src) for q in ranks) if rank == src
                      else _data(rank, count, np.int32, 5 + src))
            check(np.array_equal(r_, want_r), f"reduce {count} to {src}")
        mine = _data(rank, count, np.float32, 7)
        out = np.empty((n, count), np.float32)
        fd.all_gather(mine, out=out)
        check(np.array_equal(out, np.stack([_data(r, count, np.float32, 7) for r in ranks])),
              f"all_gather {count}")
        # reduce_scatter: rank r gets block r of the sum (np.array_split's blocks)
        z = _data(rank, count, np.int64, 13)
        got_z = fd.reduce_scatter(z)
        block = np.array_split(sum(_data(r, count, np.int64, 13) for r in ranks), n)[rank]
        check(np.array_equal(got_z, block) and np.array_equal(z, _data(rank, count, np.int64, 13)),
              f"reduce_scatter {count}")
    # lists of several dtypes (one fused call per dtype group)
    parts = [_data(rank, 1000, np.float64, 8), _data(rank, 300_000, np.int16, 9),
             _data(rank, 5, np.float64, 10), _data(rank, 77, np.uint8, 11)]
    fd.all_reduce(parts)
    for k, (c, dt, seed) in enumerate([(1000, np.float64, 8), (300_000, np.int16, 9),
                                       (5, np.float64, 10), (77, np.uint8, 11)]):
        want = sum(_data(r, c, dt, seed) for r in ranks)
        check(np.allclose(parts[k], want) and _same_everywhere(parts[k]), f"list part {k}")
    # a group that crosses hosts: every rank but the last
    sub = fd.new_group(list(range(n - 1)))
    if rank < n - 1:
        y = _data(rank, 200_000, np.float32, 12)
        fd.all_reduce(y, group=sub)
        want = sum(_data(r, 200_000, np.float32, 12) for r in range(n - 1))
        check(np.allclose(y, want, atol=1e-3) and _same_everywhere(y, sub), "sub-group")
    fd.barrier()
    if expect_two_level:
        check(two is not None, "the world is not two-level")
        check(t is None or t.shm is not None or _alone_on_host(world), "no shared memory")
        calls = sum(counts.values())
        wanted = ("broadcast", "reduce", "all_gather") + (
            ("reduce_scatter",) if two is not None and len(two[0].hosts) == 2 else ())
        check(calls > 0 and all(counts[name] > 0 for name in wanted),
              f"two-level algorithms not taken: {dict(counts)}")
    result = {"rank": rank, "host": os.environ.get("SWARMFD_NODE", ""),
              "layout": two[0].hosts if two else None,
              "shm": t is not None and t.shm is not None, "calls": dict(counts),
              "failures": failures}
    fd.cleanup()
    return result


def until_error() -> dict[str, Any]:
    """Loop on large calls (all_reduce, broadcast from the last rank, all_gather) until
    one raises; what it raised, and when."""
    import time

    cfg = fd.init_from_env()
    rank, n = cfg.rank, cfg.world_size
    x = np.ones(4 << 20, np.float32)  # 16 MiB: many rounds
    part = np.ones(1 << 18, np.float32)
    out = np.empty((n, 1 << 18), np.float32)
    calls = [lambda: fd.all_reduce(x), lambda: fd.broadcast(x, src=n - 1),
             lambda: fd.all_gather(part, out=out)]
    two = _group.world_group().two_level() is not None
    for c in calls:
        c()
    print("HIER-READY", flush=True)
    i = 0
    try:
        while True:
            calls[i % len(calls)]()
            i += 1
    except Exception as exc:
        return {"rank": rank, "t": time.monotonic(), "type": type(exc).__name__,
                "mro": [k.__name__ for k in type(exc).__mro__], "message": str(exc),
                "calls": i, "two_level": two}


def _alone_on_host(world: Any) -> bool:
    return any(len(ranks) == 1 and world.rank in ranks for ranks in world.by_host.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--expect-two-level", action="store_true")
    parser.add_argument("--sizes", default="0,3,70000,600000",
                        help="element counts of each collective (comma-separated)")
    parser.add_argument("--until-error", action="store_true")
    args = parser.parse_args(argv)
    if args.until_error:
        print(PREFIX + json.dumps(until_error()), flush=True)
        os._exit(0)  # the group is broken: leave without waiting for lost peers
    result = run(args.expect_two_level, [int(s) for s in args.sizes.split(",")])
    print(PREFIX + json.dumps(result), flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
