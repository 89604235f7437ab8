"""Shared pieces of the benchmark workers (gloo, MPI): timing loop, plan parsing, output.

Every worker measures the same way as ``swarmfd bench`` (docs/performance.md, "The method"):
per iteration reset the input (untimed), the system's own barrier, time the
collective; after the loop the per-iteration times are reduced with MAX over
ranks (an iteration takes as long as its slowest rank), and rank 0 prints one
JSON line per size with the median, min and p90 of those times, and the CPU time per
call of a rank (its process, every thread; mean over iterations and ranks).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import numpy as np


def parse_plan(spec: str) -> list[tuple[int, int]]:
    """``"4096:300,1048576:300"`` -> ``[(4096, 300), (1048576, 300)]`` (bytes, iterations)."""
    plan = []
    for item in spec.split(","):
        size, _, iters = item.partition(":")
        if not iters:
            raise ValueError(f"bad plan item {item!r}: expected BYTES:ITERS")
        plan.append((int(size), int(iters)))
    return plan


def time_loop(
    reset: Callable[[], object],
    barrier: Callable[[], object],
    op: Callable[[], object],
    iters: int,
    warmup: int,
) -> tuple[np.ndarray, float]:
    """Run ``warmup`` untimed and ``iters`` timed iterations; return this rank's times (s)
    and its process's CPU seconds per timed call (every thread, as swarmfd bench)."""
    for _ in range(warmup):
        reset()
        barrier()
        op()
    times = np.empty(iters, dtype=np.float64)
    cpu = 0.0
    for i in range(iters):
        reset()
        barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        op()
        times[i] = time.perf_counter() - t0
        cpu += time.process_time() - c0
    return times, cpu / iters


def summary(slowest: np.ndarray) -> dict[str, float]:
    """Median, min and p90 of the per-iteration slowest-rank times, in seconds."""
    return {
        "median_s": float(np.median(slowest)),
        "min_s": float(np.min(slowest)),
        "p90_s": float(np.percentile(slowest, 90)),
    }


def vm_hwm_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def emit(record: dict[str, object]) -> None:
    """Print one result as a JSON line on stdout (the driver parses lines starting with '{')."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
