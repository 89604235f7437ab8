"""Overlap of an async all_reduce with compute: the ratio that issue 14 asks for.

Run under ``swarmfd run -n 2 -- python benchmarks/overlap.py`` (add
``-e SWARMFD_TRANSPORT=tcp`` for the TCP plane). Each round times, on every rank, the
all_reduce alone, a numpy computation of about its length alone (single-threaded BLAS),
and the two with the all_reduce issued async before the computation and waited for
after it. Prints the median of the slowest rank's times over the rounds, and
``both / (comm + compute)``: 1.0 is no overlap, 0.5 perfect overlap of equal halves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

import swarmfd as fd


def _slowest(t: float) -> float:
    v = np.array([t])
    fd.all_reduce(v, op="max")
    return float(v[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=16.0, help="all_reduce size (MiB, float32)")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    fd.init_from_env()
    x = np.ones(int(args.mib * (1 << 20)) // 4, np.float32)
    a = np.random.default_rng(fd.get_rank()).random((256, 256))
    fd.all_reduce(x)
    t0 = time.monotonic()
    fd.all_reduce(x)
    comm0 = time.monotonic() - t0
    reps = 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < comm0:
        a @ a
        reps += 1
    reps = int(fd.all_reduce(np.array([reps]), op="max")[0])
    rows = []
    for _ in range(args.rounds):
        fd.barrier()
        t0 = time.monotonic()
        fd.all_reduce(x)
        comm = _slowest(time.monotonic() - t0)
        fd.barrier()
        t0 = time.monotonic()
        for _ in range(reps):
            a @ a
        compute = _slowest(time.monotonic() - t0)
        fd.barrier()
        t0 = time.monotonic()
        w = fd.all_reduce(x, async_op=True)
        for _ in range(reps):
            a @ a
        w.wait()
        both = _slowest(time.monotonic() - t0)
        rows.append((comm, compute, both))
    comm, compute, both = (statistics.median(r[i] for r in rows) for i in range(3))
    fd.print(f"overlap of a {args.mib:g} MiB all_reduce with compute, {fd.get_world_size()} "
             f"ranks, median of {args.rounds} rounds (slowest rank):")
    fd.print(f"  all_reduce alone {comm * 1e3:.1f} ms, compute alone {compute * 1e3:.1f} ms, "
             f"both {both * 1e3:.1f} ms: ratio {both / (comm + compute):.2f} "
             "(1.0: no overlap)")
    fd.cleanup()


if __name__ == "__main__":
    main()
