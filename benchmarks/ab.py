"""Interleaved A/B of swarmfd tuning constants inside one job: iteration i runs variant i % k.

Run it inside a group; every rank must get the same arguments::

    SWARMFD_TRANSPORT=tcp swarmfd run -n 2 -- python benchmarks/ab.py \\
        --sizes 64K,256K,1M --variant base \\
        --variant inline16k:transport.INLINE_MAX_BYTES=16384 \\
        --variant piece2m:collectives.PIECE_BYTES=2097152

A variant is a name and module attribute overrides (``collectives.X=V``,
``transport.X=V``, ``lanes.X=V``; integer values) applied before its iterations and undone
after. Because the variants alternate iteration by iteration in the same
processes, they see the same machine load: on a shared machine this is far
steadier than comparing separate jobs. Per iteration: reset the input
(untimed), barrier, time one collective; after the loop an ``all_reduce(max)``
of the times (the slowest rank's). Rank 0 prints one JSON line per size:
the median time of every variant and its ratio to the first. Run it several
times and look at the spread of the ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import swarmfd as fd
from swarmfd import collectives, lanes, transport
from swarmfd.bench import default_iters, parse_sizes

MODULES = {"collectives": collectives, "lanes": lanes, "transport": transport}


def parse_variant(text: str) -> tuple[str, dict[tuple[Any, str], int]]:
    """``name[:module.ATTR=INT,...]`` -> (name, {(module, attr): value})."""
    name, _, spec = text.partition(":")
    overrides: dict[tuple[Any, str], int] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        mod_name, _, attr = key.partition(".")
        module = MODULES.get(mod_name)
        if module is None or not hasattr(module, attr):
            raise SystemExit(f"ab.py: unknown setting {key!r}: expected collectives.NAME or "
                             "transport.NAME of an existing constant")
        overrides[(module, attr)] = int(value)
    return name, overrides


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,64K,256K,1M,16M", help="bytes per rank, e.g. 1M,16M")
    p.add_argument("--variant", action="append", required=True, help="name[:module.ATTR=INT,...]")
    p.add_argument("--op", default="all_reduce", choices=["all_reduce", "broadcast", "all_gather"])
    p.add_argument("--iters", type=int, default=0, help="per variant (default: as swarmfd bench)")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    defaults = {key: getattr(*key) for _, kv in variants for key in kv}
    fd.init_from_env()
    rank, world = fd.get_rank(), fd.get_world_size()
    k = len(variants)
    for size in parse_sizes(args.sizes):
        count = max(1, size // 4)
        x = np.empty(count, np.float32)
        out = np.empty((world, count), np.float32)
        iters = (args.iters or default_iters(size)) * k
        times = np.zeros(iters)
        for i in range(iters + args.warmup * k):
            for key, value in {**defaults, **variants[i % k][1]}.items():
                setattr(*key, value)
            x[:] = rank + 1
            fd.barrier()
            t0 = time.perf_counter()
            if args.op == "all_reduce":
                fd.all_reduce(x)
            elif args.op == "broadcast":
                fd.broadcast(x, src=0)
            else:
                fd.all_gather(x, out=out)
            if i >= args.warmup * k:
                times[i - args.warmup * k] = time.perf_counter() - t0
        for key, value in defaults.items():
            setattr(*key, value)
        fd.all_reduce(times, op="max")
        medians = {name: float(np.median(times[j::k])) for j, (name, _) in enumerate(variants)}
        first = medians[variants[0][0]]
        if rank == 0:
            print(json.dumps({"op": args.op, "size": size, "world_size": world,
                              "median_us": {n: round(m * 1e6, 1) for n, m in medians.items()},
                              "ratio": {n: round(m / first, 3) for n, m in medians.items()}}),
                  flush=True)
    fd.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
