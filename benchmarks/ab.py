"""Interleaved A/B of swarmfd tuning constants inside one job: iteration i runs variant i % k.

Run it inside a group; every rank must get the same arguments::

    SWARMFD_TRANSPORT=tcp swarmfd run -n 2 -- python benchmarks/ab.py \\
        --sizes 64K,256K,1M --variant base \\
        --variant inline16k:comm.planes.zmq.INLINE_MAX_BYTES=16384 \\
        --variant nospin:comm.spin.ENABLED=0

A variant is a name and overrides of module constants (``MODULE.NAME=V``, MODULE a
module of swarmfd such as ``comm.planes.socket`` or ``algorithms.tcp``; integer or
float values) applied before its iterations and undone after. Because the variants
alternate iteration by iteration in the same processes, they see the same machine
load: on a shared machine this is far steadier than comparing separate jobs. Per
iteration: reset the input (untimed), barrier, time one collective; after the loop an
``all_reduce(max)`` of the times (the slowest rank's). Rank 0 prints one JSON line per
size: the median time of every variant, its ratio to the first, and the mean CPU time
per call of a rank (every thread of the process; summed over ranks, divided by N). Run
it several times and look at the spread of the ratios.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import swarmfd as fd
from swarmfd.bench import default_iters, parse_sizes


def parse_variant(text: str) -> tuple[str, dict[tuple[Any, str], float]]:
    """``name[:module.ATTR=NUMBER,...]`` -> (name, {(module, attr): value})."""
    name, _, spec = text.partition(":")
    overrides: dict[tuple[Any, str], float] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        mod_name, _, attr = key.rpartition(".")
        try:
            module = importlib.import_module(f"swarmfd.{mod_name}")
        except ImportError:
            module = None
        if module is None or not hasattr(module, attr):
            raise SystemExit(f"ab.py: unknown setting {key!r}: expected MODULE.NAME of an "
                             "existing constant of a swarmfd module (e.g. comm.planes.zmq."
                             "INLINE_MAX_BYTES)")
        try:
            overrides[(module, attr)] = int(value)
        except ValueError:
            overrides[(module, attr)] = float(value)
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
        cpu = np.zeros(iters)  # CPU seconds of this process (every thread) per call
        for i in range(iters + args.warmup * k):
            for key, value in {**defaults, **variants[i % k][1]}.items():
                setattr(*key, value)
            x[:] = rank + 1
            fd.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            if args.op == "all_reduce":
                fd.all_reduce(x)
            elif args.op == "broadcast":
                fd.broadcast(x, src=0)
            else:
                fd.all_gather(x, out=out)
            if i >= args.warmup * k:
                times[i - args.warmup * k] = time.perf_counter() - t0
                cpu[i - args.warmup * k] = time.process_time() - c0
        for key, value in defaults.items():
            setattr(*key, value)
        fd.all_reduce(times, op="max")
        fd.all_reduce(cpu, op="sum")
        medians = {name: float(np.median(times[j::k])) for j, (name, _) in enumerate(variants)}
        cpus = {name: float(np.mean(cpu[j::k])) / world for j, (name, _) in enumerate(variants)}
        first = medians[variants[0][0]]
        if rank == 0:
            print(json.dumps({"op": args.op, "size": size, "world_size": world,
                              "median_us": {n: round(m * 1e6, 1) for n, m in medians.items()},
                              "ratio": {n: round(m / first, 3) for n, m in medians.items()},
                              "cpu_us_per_rank": {n: round(c * 1e6, 1)
                                                  for n, c in cpus.items()}}),
                  flush=True)
    fd.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
