#!/usr/bin/env python3
"""The baseline of the hierarchical-collectives work: all_reduce across simulated hosts.

For each shape (``HxL@RATE``: H simulated hosts of L ranks each, links shaped at RATE in
both directions, see ``benchmarks/netsim.py``) and each placement of the ranks on the
hosts (``host``: host by host, ``[0, 0, 1, 1]``; ``spread``: round robin, ``[0, 1, 0,
1]``, as Swarm places a service's tasks), one swarmfd job times ``all_reduce`` (float32,
sum, in place) at each size, as ``swarmfd bench`` does: per iteration reset the input
(untimed), ``barrier()``, time the call; after the loop one ``all_reduce(max)`` of the
times (an iteration takes as long as its slowest rank); the median of those. Beside it:

* ``busbw`` = S / time * 2(N-1)/N (nccl-tests' all_reduce factor), GB/s = 1e9 B/s;
* CPU time per call per rank: ``time.process_time()`` (every thread of the rank, so the
  socket plane's I/O thread too) around each call; the median over iterations of each
  rank, then the mean and the max over ranks;
* the kernel's share of that CPU time (``getrusage`` system time around each call,
  summed over ranks and iterations);
* the CPU floor: the CPU time per call of all ranks over the machine's cores; a call
  cannot take less wall time on this machine (when the floor reaches the link bound,
  the ranks are CPU-bound, not link-bound);
* the bounds on the shaped links, where the network is the limit (issue 17, "Bounds"),
  as times at the nominal rate:

  - this ring: the flat ring in rank order moves 2(N-1)/N * S over every ring edge;
    a host's link carries that once per edge that leaves the host (and per edge that
    enters it), so host by host 1x, spread over 2 hosts L times;
  - best flat: the flat ring ordered by host, 2(N-1)/N * S per link (1.5 S for 2x2,
    1.75 S for 2x4);
  - two-level: reduce-scatter inside each host, an all-reduce of each shard across the
    hosts, all-gather inside: 2(H-1)/H * S per link (S for 2 hosts).

  ``of best`` is best-flat-bound / time: 1.0 would be the flat ring's physical limit.
  TCP/IP over MTU 1500 carries at most 1448/1514 = 0.956 of the nominal rate
  as payload, which is in these ratios.

Variants (``--variant NAME:KEY=VALUE,...``, repeatable) run the same jobs with extra
environment, interleaved: ``for run: for shape: for placement: for variant``, so a
variant and its baseline see the same machine load. Default: one variant, ``today``.

    python benchmarks/hierarchy.py                          # 2x2@5gbit and 2x4@2gbit
    python benchmarks/hierarchy.py --shape 2x2@5gbit --placement spread --sizes 1M,16M
    python benchmarks/hierarchy.py --variant flat:SWARMFD_HIERARCHY=off --variant two-level:
    python benchmarks/hierarchy.py --runs 3 --json results/hierarchy.json

Needs root (network namespaces). ``--worker`` is the rank side (started by the harness).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netsim

MIB = 1 << 20
DEFAULT_SHAPES = ("2x2@5gbit", "2x4@2gbit")
DEFAULT_SIZES = "1M,4M,16M,64M"
PLACEMENTS = ("host", "spread")
#: Seconds of timed iterations aimed at per point (the iteration count is this over the
#: bound of this ring, between MIN_ITERS and MAX_ITERS).
DEFAULT_BUDGET = 2.0
MIN_ITERS = 5
MAX_ITERS = 100
DEFAULT_WARMUP = 2
RESULT_PREFIX = "HIERARCHY-RESULT "
#: The machine's cores: all ranks' CPU time per call over this is the CPU floor of a call.
CORES = os.cpu_count() or 1
#: Issue 17, "Measured today" (2 hosts x 2 ranks at 5gbit, ms): placement -> size -> ms.
ISSUE_17_TODAY = {"host": {16 * MIB: 44.9, 64 * MIB: 177.0},
                  "spread": {16 * MIB: 87.5, 64 * MIB: 343.0}}


# --- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    hosts: int
    per_host: int
    rate: int | None  # bits per second

    @property
    def label(self) -> str:
        return f"{self.hosts}x{self.per_host}@{netsim.format_rate(self.rate)}"


def parse_shape(text: str) -> Shape:
    """``"2x4@2gbit"`` -> 2 hosts of 4 ranks, links at 2 Gbit/s (``@none``: unshaped)."""
    spec, _, rate = text.partition("@")
    h, _, l_ = spec.lower().partition("x")
    try:
        hosts, per_host = int(h), int(l_)
    except ValueError:
        raise ValueError(f"bad shape {text!r}: expected HOSTSxRANKS@RATE, e.g. 2x4@2gbit") from None
    if hosts < 1 or per_host < 1:
        raise ValueError(f"bad shape {text!r}: hosts and ranks per host must be >= 1")
    return Shape(hosts, per_host, netsim.parse_rate(rate or None))


def ring_crossings(placement: Sequence[int]) -> int:
    """The most ring edges (rank r -> r+1 mod N) that leave, or enter, any one host."""
    n = len(placement)
    out: dict[int, int] = {}
    into: dict[int, int] = {}
    for r in range(n):
        a, b = placement[r], placement[(r + 1) % n]
        if a != b:
            out[a] = out.get(a, 0) + 1
            into[b] = into.get(b, 0) + 1
    return max([0, *out.values(), *into.values()])


def bounds(placement: Sequence[int], size: int, rate: int | None) -> dict[str, float]:
    """Link-bound times (seconds) of the all_reduce of ``size`` bytes per rank."""
    n, h = len(placement), len(set(placement))
    if rate is None or h < 2:
        return {"ring": math.nan, "best_flat": math.nan, "two_level": math.nan}
    per_second = rate / 8
    flat = 2 * (n - 1) / n * size
    return {"ring": ring_crossings(placement) * flat / per_second,
            "best_flat": flat / per_second,
            "two_level": 2 * (h - 1) / h * size / per_second}


def _expected(placement: Sequence[int], size: int, rate: int | None) -> float:
    """A guess of one call's time: this ring's bound (unshaped: 0.5 GB/s per link)."""
    ring = bounds(placement, size, rate)["ring"]
    return max(1e-4, size / 0.5e9 if math.isnan(ring) else ring)


def plan_iters(placement: Sequence[int], size: int, rate: int | None, budget: float) -> int:
    """Timed iterations for about ``budget`` seconds, MIN_ITERS..MAX_ITERS."""
    return max(MIN_ITERS, min(MAX_ITERS, math.ceil(budget / _expected(placement, size, rate))))


# --- the rank side ------------------------------------------------------------------------


def worker(plan: list[tuple[int, int]], warmup: int) -> int:
    """Time all_reduce at each (bytes, iterations); rank 0 prints one JSON line per size."""
    import numpy as np

    import swarmfd as fd

    cfg = fd.init_from_env()
    rank, n = cfg.rank, cfg.world_size
    try:
        for size, iters in plan:
            count = size // 4
            pattern = (np.arange(count, dtype=np.int64) % 7 + 1).astype(np.float32)
            source = pattern * np.float32(rank + 1)
            x = np.empty_like(source)
            for _ in range(warmup):
                np.copyto(x, source)
                fd.barrier()
                fd.all_reduce(x)
            times = np.empty(iters)
            cpu = np.empty(iters)
            kernel = 0.0
            for i in range(iters):
                np.copyto(x, source)
                fd.barrier()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                c0 = time.process_time()
                t0 = time.perf_counter()
                fd.all_reduce(x)
                times[i] = time.perf_counter() - t0
                cpu[i] = time.process_time() - c0
                kernel += resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime
            expected = pattern * np.float32(n * (n + 1) / 2)  # small integers: exact
            wrong = np.array([np.count_nonzero(x != expected)], dtype=np.int64)
            mine = np.zeros(n)
            mine[rank] = float(np.median(cpu))
            split = np.array([kernel, float(np.sum(cpu))])  # system time, all CPU time
            fd.all_reduce(times, op="max")
            fd.all_reduce(wrong)
            fd.all_reduce(mine)
            fd.all_reduce(split)
            if rank == 0:
                print(RESULT_PREFIX + json.dumps({
                    "size": size, "iters": iters, "median_s": float(np.median(times)),
                    "min_s": float(np.min(times)), "p90_s": float(np.percentile(times, 90)),
                    "cpu_s": mine.tolist(), "sys_share": float(split[0] / max(split[1], 1e-9)),
                    "wrong": int(wrong[0])}), flush=True)
    finally:
        fd.cleanup()
    return 0


# --- the orchestrator ---------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    shape: str
    placement: str
    variant: str
    run: int
    world_size: int
    size: int
    iters: int
    median_ms: float
    min_ms: float
    p90_ms: float
    busbw: float
    cpu_ms_mean: float
    cpu_ms_max: float
    cpu_floor_ms: float
    sys_share: float
    ring_bound_ms: float
    best_flat_bound_ms: float
    two_level_bound_ms: float
    wrong: int
    load1: float


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``"flat:SWARMFD_HIERARCHY=off,X=1"`` -> ("flat", {...}); ``"name:"`` no extra env."""
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise ValueError(f"bad variant {text!r}: expected NAME:KEY=VALUE,... (or NAME:)")
    env = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise ValueError(f"bad variant {text!r}: {item!r} is not KEY=VALUE")
        env[key] = value
    return name, env


def run_job(net: netsim.SimulatedHosts, shape: Shape, placement_kind: str, variant: str,
            env: dict[str, str], sizes: list[int], args: argparse.Namespace,
            run: int) -> list[Row]:
    placement = netsim.make_placement(placement_kind, shape.hosts, shape.per_host)
    plan = [(s, args.iters or plan_iters(placement, s, shape.rate, args.budget)) for s in sizes]
    worst = sum((i + args.warmup) * _expected(placement, s, shape.rate) for s, i in plan)
    timeout = args.timeout or 120 + 4 * worst
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--warmup",
            str(args.warmup), "--plan", ",".join(f"{s}:{i}" for s, i in plan)]
    job_env = {"SWARMFD_TIMEOUT": str(max(60, int(timeout))), **env}
    result = net.run_job(argv, placement, env=job_env, timeout=timeout)
    if not result.ok:
        raise netsim.NetsimError(f"{shape.label} {placement_kind} {variant}: "
                                 + result.describe())
    n = len(placement)
    load1 = float(_loadavg().split()[0])
    rows = []
    for line in result.stdout(0).splitlines():
        if not line.startswith(RESULT_PREFIX):
            continue
        d = json.loads(line[len(RESULT_PREFIX):])
        b = bounds(placement, d["size"], shape.rate)
        rows.append(Row(
            shape=shape.label, placement=placement_kind, variant=variant, run=run,
            world_size=n, size=d["size"], iters=d["iters"], median_ms=d["median_s"] * 1e3,
            min_ms=d["min_s"] * 1e3, p90_ms=d["p90_s"] * 1e3,
            busbw=d["size"] / d["median_s"] * 2 * (n - 1) / n / 1e9,
            cpu_ms_mean=statistics.fmean(d["cpu_s"]) * 1e3, cpu_ms_max=max(d["cpu_s"]) * 1e3,
            cpu_floor_ms=sum(d["cpu_s"]) / CORES * 1e3, sys_share=d["sys_share"],
            ring_bound_ms=b["ring"] * 1e3, best_flat_bound_ms=b["best_flat"] * 1e3,
            two_level_bound_ms=b["two_level"] * 1e3, wrong=d["wrong"], load1=load1))
    if len(rows) != len(sizes):
        raise netsim.NetsimError(f"{shape.label} {placement_kind} {variant}: rank 0 reported "
                                 f"{len(rows)} of {len(sizes)} sizes\n" + result.describe())
    return rows


def _fmt_size(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB and size % MIB == 0 else f"{size // 1024} KiB"


def table(rows: list[Row]) -> str:
    """Medians over runs, one line per (shape, placement, variant, size)."""
    keys: dict[tuple[str, str, str, int], list[Row]] = {}
    for r in rows:
        keys.setdefault((r.shape, r.placement, r.variant, r.size), []).append(r)
    lines = ["| shape | placement | variant | size | time ms (median) | busbw GB/s | "
             f"CPU ms/call/rank mean / max | kernel share | CPU floor ms ({CORES} cores) | "
             "this ring bound ms | best flat bound ms | two-level bound ms | of best flat bound | "
             "runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, placement, variant, size), group in keys.items():
        t = statistics.median(r.median_ms for r in group)
        bus = statistics.median(r.busbw for r in group)
        cpu = statistics.median(r.cpu_ms_mean for r in group)
        cpu_max = statistics.median(r.cpu_ms_max for r in group)
        floor = statistics.median(r.cpu_floor_ms for r in group)
        ksh = statistics.median(r.sys_share for r in group)
        g = group[0]
        frac = g.best_flat_bound_ms / t if not math.isnan(g.best_flat_bound_ms) else math.nan
        runs = " ".join(f"{r.median_ms:.1f}" for r in group) if len(group) > 1 else "1"
        wrong = sum(r.wrong for r in group)
        lines.append(
            f"| {shape} | {placement} | {variant} | {_fmt_size(size)} | {t:.2f} | {bus:.3f} | "
            f"{cpu:.2f} / {cpu_max:.2f} | {ksh:.0%} | {floor:.1f} | {g.ring_bound_ms:.1f} | "
            f"{g.best_flat_bound_ms:.1f} | {g.two_level_bound_ms:.1f} | {frac:.2f} | {runs} |"
            + ("  WRONG RESULTS" if wrong else ""))
    return "\n".join(lines)


def issue_comparison(rows: list[Row]) -> str:
    """Today's 2x2@5gbit figures beside issue 17's "Measured today"."""
    lines = []
    for placement, points in ISSUE_17_TODAY.items():
        for size, ms in points.items():
            got = [r.median_ms for r in rows if r.shape == "2x2@5gbit" and
                   r.placement == placement and r.size == size and r.variant == rows[0].variant]
            if got:
                t = statistics.median(got)
                lines.append(f"- 2x2@5gbit {placement} {_fmt_size(size)}: {t:.1f} ms here, "
                             f"{ms:.1f} ms in issue 17 ({t / ms:.2f}x)")
    return "\n".join(lines)


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", default=None,
                        help=f"HOSTSxRANKS@RATE, repeatable (default {', '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--placement", action="append", choices=PLACEMENTS, default=None,
                        help="repeatable (default both)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME:KEY=VALUE,... extra rank environment, repeatable")
    parser.add_argument("--runs", type=int, default=1, help="interleaved runs (median shown)")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed iterations per size (default: --budget over the bound, "
                             f"{MIN_ITERS}..{MAX_ITERS})")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help="seconds of timed iterations per point")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per job")
    parser.add_argument("--json", default=None, help="write every run's rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        plan = [(int(s), int(i)) for s, i in (p.split(":") for p in args.plan.split(","))]
        return worker(plan, args.warmup)

    from swarmfd.bench import parse_sizes

    sizes = parse_sizes(args.sizes)
    for s in sizes:
        if s % 4:
            parser.error(f"size {s} is not a whole number of float32 elements")
    shapes = [parse_shape(s) for s in (args.shape or DEFAULT_SHAPES)]
    placements = args.placement or list(PLACEMENTS)
    variants = [parse_variant(v) for v in (args.variant or ["today:"])]
    if args.runs < 1:
        parser.error("--runs must be >= 1")

    print(f"# hierarchy baseline: all_reduce float32 sum, sizes {args.sizes}, "
          f"{args.runs} run(s); load average at start {_loadavg()}", flush=True)
    rows: list[Row] = []
    started = time.monotonic()
    for shape in shapes:  # one network per shape; runs interleave inside it
        with netsim.SimulatedHosts(hosts=shape.hosts, rate=shape.rate) as net:
            for run in range(args.runs):
                for placement in placements:
                    for name, env in variants:
                        t0 = time.monotonic()
                        got = run_job(net, shape, placement, name, env, sizes, args, run)
                        rows += got
                        print(f"# {shape.label} {placement} {name} run {run + 1}: "
                              + ", ".join(f"{_fmt_size(r.size)} {r.median_ms:.2f} ms"
                                          for r in got)
                              + f" ({time.monotonic() - t0:.0f} s, load {_loadavg()})",
                              file=sys.stderr, flush=True)
    print(table(rows))
    comparison = issue_comparison(rows)
    if comparison:
        print("\nAgainst issue 17's \"Measured today\":\n" + comparison)
    print(f"\n# {time.monotonic() - started:.0f} s; load average at the end {_loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "hierarchy", "sizes": sizes,
                       "shapes": [s.label for s in shapes], "rows": [asdict(r) for r in rows]},
                      f, indent=2)
    return 1 if any(r.wrong for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
