#!/usr/bin/env python3
"""Two-level collectives against flat ones, across simulated hosts.

For each shape (``HxL@RATE``: H simulated hosts of L ranks each, or ``3+1@RATE``: hosts
of 3 and 1 ranks; links shaped at RATE in both directions, see ``benchmarks/netsim.py``)
and each placement of the ranks on the hosts (``host``: host by host, ``[0, 0, 1, 1]``;
``spread``: round robin, ``[0, 1, 0, 1]``, as Swarm places a service's tasks), one
swarmfd job per variant times each collective (float32; all_reduce and reduce sum, in
place; broadcast and reduce rooted at rank 0; all_gather into a reused ``out``) at each
size, as ``swarmfd bench`` does: per iteration reset the input (untimed),
``barrier()``, time the call; after the loop one ``all_reduce(max)`` of the times (an
iteration takes as long as its slowest rank); the median of those. Beside it:

* ``busbw`` = S / time * factor (nccl-tests: all_reduce 2(N-1)/N, broadcast and reduce
  1, all_gather N-1 with S each rank's part), GB/s = 1e9 B/s;
* CPU time per call per rank: ``time.process_time()`` (every thread of the rank)
  around each call; the median over iterations of each rank, then the mean and the max
  over ranks; and the kernel's share of it (``getrusage`` system time);
* the CPU floor: the CPU time per call of all ranks over the machine's cores; a call
  cannot take less wall time on this machine (when the floor reaches the link bound,
  the ranks are CPU-bound, not link-bound);
* the bounds on the shaped links, where the network is the limit (the cost model of
  docs/performance.md, "Across hosts"),
  as times at the nominal rate. all_reduce:

  - this ring: the flat ring in rank order moves 2(N-1)/N * S over every ring edge; a
    host's link carries that once per edge that leaves the host (and per edge that
    enters it), so host by host 1x, spread over 2 hosts L times;
  - best flat: the flat ring ordered by host, 2(N-1)/N * S per link (1.5 S for 2x2,
    1.75 S for 2x4);
  - two-level: reduce-scatter inside each host, an all-reduce of each shard across the
    hosts, all-gather inside: 2(H-1)/H * S per link (S for 2 hosts, even or not).

  broadcast and reduce: S per link, flat (a chain in host order) or two-level; all_gather:
  what a host's ranks receive from the others, (N - L) * S on the link of a host of L,
  either way. ``of bound`` is the variant's bound over its time: two-level variants
  against the two-level bound, flat ones against this ring's (rank order) or the best
  flat's. TCP/IP over MTU 1500 carries at most 1448/1514 = 0.956 of the nominal rate
  as payload, which is in these ratios.

Variants (``--variant NAME:KEY=VALUE,...``, repeatable) run the same jobs with extra
environment, interleaved: ``for run: for shape: for placement: for variant``, so a
variant and its baseline see the same machine load; the ratio columns compare each
variant with the first. ``HIER_BENCH_RING=rank`` (with ``SWARMFD_HIERARCHY=off``) makes
the flat ring follow the rank order instead of the hosts (the ring as it was before the
two-level collectives: under spread placement it crosses the link on every hop);
``HIER_BENCH_SET=MODULE.NAME=INT;...`` sets constants of ``swarmfd.algorithms`` in the
ranks (``select.HIER_SMALL_BYTES=0``, ``hier.GATHER_AHEAD=1``) for measuring them (in a
variant's environment: separate the items with ``;``, since ``,`` separates variables).
Default variants:
``flat:SWARMFD_HIERARCHY=off`` and ``two-level:``.

    python benchmarks/hierarchy.py                          # 2x2@5gbit and 2x4@2gbit
    python benchmarks/hierarchy.py --shape 3+1@5gbit --placement host --sizes 4K,1M,16M
    python benchmarks/hierarchy.py --op all_reduce --op broadcast --op reduce --op all_gather
    python benchmarks/hierarchy.py --variant rank-ring:SWARMFD_HIERARCHY=off,HIER_BENCH_RING=rank \
        --variant flat:SWARMFD_HIERARCHY=off --variant two-level:
    python benchmarks/hierarchy.py --runs 3 --json benchmarks/out/hierarchy.json

Only time on a quiet machine (the load average is printed at the start and per job).
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
DEFAULT_VARIANTS = ("flat:SWARMFD_HIERARCHY=off", "two-level:")
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather")
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
#: The flat all_reduce before the two-level collectives existed (2 hosts x 2 ranks at
#: 5gbit, ms): placement -> size -> ms.
BASELINE_2X2 = {"host": {16 * MIB: 44.9, 64 * MIB: 177.0},
                  "spread": {16 * MIB: 87.5, 64 * MIB: 343.0}}
#: The worker's switch to the rank-order flat ring (see the module docstring).
ENV_RING = "HIER_BENCH_RING"
#: Constants under test in the workers: ``hier.GATHER_AHEAD=1;select.HIER_SMALL_BYTES=0``.
ENV_SET = "HIER_BENCH_SET"


# --- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    hosts: int
    per_host: int
    rate: int | None  # bits per second
    #: Ranks on each host when they differ (``3+1``); None: ``per_host`` on every host.
    counts: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        spec = ("+".join(map(str, self.counts)) if self.counts
                else f"{self.hosts}x{self.per_host}")
        return f"{spec}@{netsim.format_rate(self.rate)}"

    def ranks_per_host(self) -> list[int]:
        return list(self.counts) if self.counts else [self.per_host] * self.hosts


def parse_shape(text: str) -> Shape:
    """``"2x4@2gbit"`` -> 2 hosts of 4 ranks, links at 2 Gbit/s (``@none``: unshaped);
    ``"3+1@5gbit"``: a host of 3 ranks and one of 1."""
    spec, _, rate = text.partition("@")
    try:
        if "+" in spec:
            counts = tuple(int(c) for c in spec.split("+"))
            if any(c < 1 for c in counts):
                raise ValueError
            return Shape(len(counts), max(counts), netsim.parse_rate(rate or None), counts)
        h, _, l_ = spec.lower().partition("x")
        hosts, per_host = int(h), int(l_)
    except ValueError:
        raise ValueError(f"bad shape {text!r}: expected HOSTSxRANKS@RATE (2x4@2gbit) or "
                         "RANKS+RANKS+...@RATE (3+1@5gbit)") from None
    if hosts < 1 or per_host < 1:
        raise ValueError(f"bad shape {text!r}: hosts and ranks per host must be >= 1")
    return Shape(hosts, per_host, netsim.parse_rate(rate or None))


def placement_of(kind: str, shape: Shape) -> list[int]:
    """The host of each rank: host by host, or round robin over the hosts with room."""
    counts = shape.ranks_per_host()
    if kind == "host":
        return [h for h, c in enumerate(counts) for _ in range(c)]
    if kind != "spread":
        raise ValueError(f"unknown placement {kind!r}: expected one of {PLACEMENTS}")
    left, out = list(counts), []
    while any(left):
        for h in range(len(left)):
            if left[h]:
                out.append(h)
                left[h] -= 1
    return out


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


def bounds(placement: Sequence[int], size: int, rate: int | None,
           collective: str = "all_reduce") -> dict[str, float]:
    """Link-bound times (seconds) of ``collective`` of ``size`` bytes per rank (see the
    module docstring): this ring (rank order), the best flat, the two-level."""
    n, h = len(placement), len(set(placement))
    if rate is None or h < 2:
        return {"ring": math.nan, "best_flat": math.nan, "two_level": math.nan}
    per_second = rate / 8
    if collective == "all_reduce":
        flat = 2 * (n - 1) / n * size
        return {"ring": ring_crossings(placement) * flat / per_second,
                "best_flat": flat / per_second,
                "two_level": 2 * (h - 1) / h * size / per_second}
    if collective == "all_gather":
        t = max(n - placement.count(x) for x in set(placement)) * size / per_second
        return {"ring": ring_crossings(placement) * t, "best_flat": t, "two_level": t}
    t = size / per_second  # broadcast, reduce: a chain carries S over each link once
    return {"ring": _chain_crossings(placement) * t, "best_flat": t, "two_level": t}


def _chain_crossings(placement: Sequence[int]) -> int:
    """The most edges of the chain 0 -> 1 -> ... -> N-1 that leave, or enter, one host
    (each direction of a link is shaped on its own)."""
    out: dict[int, int] = {}
    into: dict[int, int] = {}
    for r in range(len(placement) - 1):
        a, b = placement[r], placement[r + 1]
        if a != b:
            out[a] = out.get(a, 0) + 1
            into[b] = into.get(b, 0) + 1
    return max([1, *out.values(), *into.values()])


def bus_factor(collective: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": float(n - 1)}.get(collective, 1.0)


def _expected(placement: Sequence[int], size: int, rate: int | None,
              collective: str = "all_reduce") -> float:
    """A guess of one call's time: this ring's bound (unshaped: 0.5 GB/s per link)."""
    ring = bounds(placement, size, rate, collective)["ring"]
    return max(2e-4, size / 0.5e9 if math.isnan(ring) else ring)


def plan_iters(placement: Sequence[int], size: int, rate: int | None, budget: float,
               collective: str = "all_reduce") -> int:
    """Timed iterations for about ``budget`` seconds, MIN_ITERS..MAX_ITERS."""
    return max(MIN_ITERS, min(MAX_ITERS, math.ceil(
        budget / _expected(placement, size, rate, collective))))


# --- the rank side ------------------------------------------------------------------------


def worker(plan: list[tuple[str, int, int]], warmup: int) -> int:
    """Time each (collective, bytes, iterations); rank 0 prints one JSON line each."""
    import numpy as np

    import swarmfd as fd
    from swarmfd import group

    cfg = fd.init_from_env()
    rank, n = cfg.rank, cfg.world_size
    world = group.world_group()
    if os.environ.get(ENV_RING, "") == "rank":
        world.ring = list(range(n))  # the flat ring in rank order (the benchmark's switch)
    for item in filter(None, os.environ.get(ENV_SET, "").split(";")):
        # a constant under test: MODULE.NAME=NUMBER, MODULE of swarmfd.algorithms (or
        # a full path under swarmfd: comm.planes.shm.SPIN_SECONDS=0)
        import importlib

        key, _, value = item.partition("=")
        mod, _, name = key.rpartition(".")
        path = f"swarmfd.{mod}" if "." in mod else f"swarmfd.algorithms.{mod}"
        module = importlib.import_module(path)
        if not hasattr(module, name):
            raise SystemExit(f"{ENV_SET}: {path} has no {name}")
        setattr(module, name, type(getattr(module, name))(float(value)))
    two = world.two_level() is not None
    try:
        for coll, size, iters in plan:
            count = size // 4
            pattern = (np.arange(count, dtype=np.int64) % 7 + 1).astype(np.float32)
            source = pattern * np.float32(rank + 1)
            x = np.empty_like(source)
            out = np.empty((n, count), np.float32)
            call = {"all_reduce": lambda x=x: fd.all_reduce(x),
                    "broadcast": lambda x=x: fd.broadcast(x, src=0),
                    "reduce": lambda x=x: fd.reduce(x, dst=0),
                    "all_gather": lambda x=x, out=out: fd.all_gather(x, out=out)}[coll]
            for _ in range(warmup):
                np.copyto(x, source)
                fd.barrier()
                call()
            times = np.empty(iters)
            cpu = np.empty(iters)
            kernel = 0.0
            for i in range(iters):
                np.copyto(x, source)
                fd.barrier()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                c0 = time.process_time()
                t0 = time.perf_counter()
                call()
                times[i] = time.perf_counter() - t0
                cpu[i] = time.process_time() - c0
                kernel += resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime
            if coll == "all_reduce" or (coll == "reduce" and rank == 0):
                expected = pattern * np.float32(n * (n + 1) / 2)  # small integers: exact
                bad = np.count_nonzero(x != expected)
            elif coll == "broadcast":
                bad = np.count_nonzero(x != pattern)
            elif coll == "all_gather":
                bad = sum(np.count_nonzero(out[r] != pattern * np.float32(r + 1))
                          for r in range(n))
            else:
                bad = np.count_nonzero(x != source)  # a reduce's non-root keeps its input
            wrong = np.array([bad], dtype=np.int64)
            mine = np.zeros(n)
            mine[rank] = float(np.median(cpu))
            split_ = np.array([kernel, float(np.sum(cpu))])  # system time, all CPU time
            fd.all_reduce(times, op="max")
            fd.all_reduce(wrong)
            fd.all_reduce(mine)
            fd.all_reduce(split_)
            if rank == 0:
                print(RESULT_PREFIX + json.dumps({
                    "collective": coll, "size": size, "iters": iters,
                    "median_s": float(np.median(times)), "min_s": float(np.min(times)),
                    "p90_s": float(np.percentile(times, 90)), "cpu_s": mine.tolist(),
                    "sys_share": float(split_[0] / max(split_[1], 1e-9)),
                    "wrong": int(wrong[0]), "two_level": two}), flush=True)
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
    collective: str
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
    two_level: bool
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
            env: dict[str, str], sizes: list[int], collectives: list[str],
            args: argparse.Namespace, run: int) -> list[Row]:
    placement = placement_of(placement_kind, shape)
    plan = [(c, s, args.iters or plan_iters(placement, s, shape.rate, args.budget, c))
            for c in collectives for s in sizes]
    worst = sum((i + args.warmup) * _expected(placement, s, shape.rate, c) for c, s, i in plan)
    timeout = args.timeout or 120 + 4 * worst
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--warmup",
            str(args.warmup), "--plan", ",".join(f"{c}:{s}:{i}" for c, s, i in plan)]
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
        b = bounds(placement, d["size"], shape.rate, d["collective"])
        rows.append(Row(
            shape=shape.label, placement=placement_kind, variant=variant, run=run,
            world_size=n, collective=d["collective"], size=d["size"], iters=d["iters"],
            median_ms=d["median_s"] * 1e3, min_ms=d["min_s"] * 1e3, p90_ms=d["p90_s"] * 1e3,
            busbw=d["size"] / d["median_s"] * bus_factor(d["collective"], n) / 1e9,
            cpu_ms_mean=statistics.fmean(d["cpu_s"]) * 1e3, cpu_ms_max=max(d["cpu_s"]) * 1e3,
            cpu_floor_ms=sum(d["cpu_s"]) / CORES * 1e3, sys_share=d["sys_share"],
            ring_bound_ms=b["ring"] * 1e3, best_flat_bound_ms=b["best_flat"] * 1e3,
            two_level_bound_ms=b["two_level"] * 1e3, two_level=d["two_level"],
            wrong=d["wrong"], load1=load1))
    if len(rows) != len(plan):
        raise netsim.NetsimError(f"{shape.label} {placement_kind} {variant}: rank 0 reported "
                                 f"{len(rows)} of {len(plan)} points\n" + result.describe())
    return rows


def _fmt_size(size: int) -> str:
    if size >= MIB and size % MIB == 0:
        return f"{size // MIB} MiB"
    return f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} B"


def _bound_of(r: Row) -> float:
    """The bound a row's variant is held to (see the module docstring)."""
    if r.two_level:
        return r.two_level_bound_ms
    return r.ring_bound_ms if r.variant.startswith("rank") else r.best_flat_bound_ms


def table(rows: list[Row]) -> str:
    """Medians over runs, one line per (shape, placement, collective, size, variant), with
    the time ratio to the first variant of the same point (> 1: faster than it)."""
    keys: dict[tuple[str, str, str, int, str], list[Row]] = {}
    for r in rows:
        keys.setdefault((r.shape, r.placement, r.collective, r.size, r.variant), []).append(r)
    first: dict[tuple[str, str, str, int], float] = {}
    lines = ["| shape | placement | collective | size | variant | time ms (median) | "
             "x first | busbw GB/s | CPU ms/call/rank mean / max | kernel share | "
             f"CPU floor ms ({CORES} cores) | bound ms | of bound | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, placement, coll, size, variant), group in keys.items():
        t = statistics.median(r.median_ms for r in group)
        point = (shape, placement, coll, size)
        base = first.setdefault(point, t)
        bus = statistics.median(r.busbw for r in group)
        cpu = statistics.median(r.cpu_ms_mean for r in group)
        cpu_max = statistics.median(r.cpu_ms_max for r in group)
        floor = statistics.median(r.cpu_floor_ms for r in group)
        ksh = statistics.median(r.sys_share for r in group)
        bound = _bound_of(group[0])
        frac = bound / t if not math.isnan(bound) else math.nan
        runs = " ".join(f"{r.median_ms:.2f}" for r in group) if len(group) > 1 else "1"
        wrong = sum(r.wrong for r in group)
        path = "" if group[0].two_level or variant.startswith(("flat", "rank")) else " (flat!)"
        lines.append(
            f"| {shape} | {placement} | {coll} | {_fmt_size(size)} | {variant}{path} | "
            f"{t:.2f} | {base / t:.2f} | {bus:.3f} | {cpu:.2f} / {cpu_max:.2f} | {ksh:.0%} | "
            f"{floor:.1f} | {bound:.1f} | {frac:.2f} | {runs} |"
            + ("  WRONG RESULTS" if wrong else ""))
    return "\n".join(lines)


def baseline_comparison(rows: list[Row]) -> str:
    """The 2x2@5gbit all_reduce figures beside :data:`BASELINE_2X2`."""
    lines = []
    for variant in dict.fromkeys(r.variant for r in rows):
        for placement, points in BASELINE_2X2.items():
            for size, ms in points.items():
                got = [r.median_ms for r in rows if r.shape == "2x2@5gbit" and
                       r.placement == placement and r.size == size and r.variant == variant
                       and r.collective == "all_reduce"]
                if got:
                    t = statistics.median(got)
                    lines.append(f"- {variant}, 2x2@5gbit {placement} {_fmt_size(size)}: "
                                 f"{t:.1f} ms here, {ms:.1f} ms flat before ({ms / t:.2f}x)")
    return "\n".join(lines)


#: The speed-up targets of the two-level all_reduce over the best flat ring, from
#: 1 MiB (shape label -> factor); other shapes have no speed-up target.
SPEEDUP_TARGETS = {"2x2@5gbit": 1.35, "2x4@2gbit": 1.5}
#: The target: from 1 MiB the two-level all_reduce reaches this fraction of its bound.
OF_BOUND_TARGET = 0.85
#: Where the targets start ("from 1 MiB up"; below it "nothing slower").
LARGE = MIB


def _medians(rows: list[Row]) -> dict[tuple[str, str, str, int, str], Row]:
    """One row per (shape, placement, collective, size, variant): the run whose time is
    the median (the lower middle of an even count)."""
    groups: dict[tuple[str, str, str, int, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.shape, r.placement, r.collective, r.size, r.variant), []).append(r)
    return {k: sorted(g, key=lambda r: r.median_ms)[(len(g) - 1) // 2]
            for k, g in groups.items()}


def busbw_table(rows: list[Row], base: str = "flat", two: str = "two-level") -> str:
    """busbw of every variant side by side, the two-level speed-up over ``base`` (time
    ratio of the medians over runs) and the two-level's fraction of its bound, with the
    CPU time per call per rank (mean over ranks) of ``base`` and of the two-level."""
    med = _medians(rows)
    variants = list(dict.fromkeys(r.variant for r in rows))
    points = list(dict.fromkeys(k[:4] for k in med))
    lines = ["| shape | placement | collective | size | "
             + " | ".join(f"{v} GB/s" for v in variants)
             + f" | {two} / {base} speed-up | {two} of bound | CPU ms/call/rank "
             f"{base} / {two} |",
             "|---|---|---|---|" + "---|" * (len(variants) + 3)]
    for p in points:
        cells = [f"{med[(*p, v)].busbw:.3f}" if (*p, v) in med else "-" for v in variants]
        b, t = med.get((*p, base)), med.get((*p, two))
        speed = f"{b.median_ms / t.median_ms:.2f}x" if b and t else "-"
        frac = (f"{t.two_level_bound_ms / t.median_ms:.2f}"
                if t and not math.isnan(t.two_level_bound_ms) else "-")
        cpu = f"{b.cpu_ms_mean:.2f} / {t.cpu_ms_mean:.2f}" if b and t else "-"
        lines.append(f"| {p[0]} | {p[1]} | {p[2]} | {_fmt_size(p[3])} | "
                     + " | ".join(cells) + f" | {speed} | {frac} | {cpu} |")
    return "\n".join(lines)


def targets(rows: list[Row], base: str = "flat", two: str = "two-level"
            ) -> list[tuple[str, str, bool]]:
    """The targets checked on the medians over runs: (target, measured, met).

    * the all_reduce of 1 MiB and up at least SPEEDUP_TARGETS[shape] times as fast as
      the best flat ring (``base``), per placement (its slowest size is shown);
    * from 1 MiB the all_reduce at least OF_BOUND_TARGET of the two-level bound;
    * from 1 MiB every other collective faster than flat;
    * below 1 MiB no collective slower than flat;
    * uneven hosts (shapes with ``+``): no collective, no size slower than flat.
    """
    med = _medians(rows)
    pairs: dict[tuple[str, str, str], list[tuple[int, Row, Row]]] = {}
    for (shape, placement, coll, size, variant), t in med.items():
        b = med.get((shape, placement, coll, size, base))
        if variant == two and b is not None:
            pairs.setdefault((shape, placement, coll), []).append((size, b, t))
    out: list[tuple[str, str, bool]] = []

    def worst(items: list[tuple[int, Row, Row]]) -> tuple[float, int]:
        return min((b.median_ms / t.median_ms, size) for size, b, t in items)

    for (shape, placement, coll), items in sorted(pairs.items()):
        items.sort(key=lambda i: i[0])
        large = [i for i in items if i[0] >= LARGE]
        small = [i for i in items if i[0] < LARGE]
        where = f"{shape} {placement} {coll}"
        if coll == "all_reduce" and large and shape in SPEEDUP_TARGETS:
            goal = SPEEDUP_TARGETS[shape]
            ratio, size = worst(large)
            out.append((f"{where} >= 1 MiB: {two} >= {goal}x {base}",
                        "; ".join(f"{_fmt_size(s)} {b.median_ms / t.median_ms:.2f}x"
                                  for s, b, t in large), ratio >= goal))
        if coll == "all_reduce" and large:
            fracs = [(t.two_level_bound_ms / t.median_ms, s) for s, _, t in large]
            out.append((f"{where} >= 1 MiB: {two} >= {OF_BOUND_TARGET} of its bound",
                        "; ".join(f"{_fmt_size(s)} {f:.2f}" for f, s in fracs),
                        min(fracs)[0] >= OF_BOUND_TARGET))
        if coll != "all_reduce" and large:
            ratio, size = worst(large)
            out.append((f"{where} >= 1 MiB: {two} faster than {base}",
                        "; ".join(f"{_fmt_size(s)} {b.median_ms / t.median_ms:.2f}x"
                                  for s, b, t in large), ratio > 1.0))
        if small:
            ratio, size = worst(small)
            out.append((f"{where} < 1 MiB: {two} not slower than {base}",
                        "; ".join(f"{_fmt_size(s)} {b.median_ms / t.median_ms:.2f}x"
                                  for s, b, t in small), ratio >= 1.0))
        if "+" in shape:
            ratio, size = worst(items)
            out.append((f"{where} (uneven hosts): {two} never slower than {base}",
                        f"slowest {ratio:.2f}x at {_fmt_size(size)}", ratio >= 1.0))
    return out


#: TCP/IP over MTU 1500: the payload share of what tbf counts (1448 of 1514 bytes).
PAYLOAD_SHARE = 1448 / 1514


def _link_bytes(r: Row) -> float:
    """Bytes the busiest link carries one way in one call of row ``r``'s variant."""
    shape = parse_shape(r.shape)
    if shape.rate is None:
        return math.nan
    return _bound_of(r) / 1e3 * shape.rate / 8


def model_table(rows: list[Row], collective: str = "all_reduce") -> str:
    """The alpha-beta(-gamma) model beside the measured medians (README, "cost model").

    T(S) = alpha + max(B(S) * beta, N * gamma * S / CORES): alpha, the call's fixed
    cost, is the measured time at the smallest size; beta is the link's time per byte
    of payload at the nominal rate (PAYLOAD_SHARE of it); B(S) the bytes on the busiest
    link (the bounds); gamma, the CPU time per byte per rank, is measured at the
    largest size. The points in between are predictions.
    """
    med = _medians(rows)
    sizes = sorted({k[3] for k in med})
    small, big = sizes[0], sizes[-1]
    shown = [s for s in sizes if s >= LARGE]
    lines = ["| shape | placement | variant | link bytes / S | alpha ms | gamma ns/B/rank | "
             + " | ".join(f"{_fmt_size(s)} model / measured ms" for s in shown) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(shown)]
    for shape, placement, coll, variant in dict.fromkeys(
            (k[0], k[1], k[2], k[4]) for k in med):
        if coll != collective or (shape, placement, coll, small, variant) not in med \
                or (shape, placement, coll, big, variant) not in med:
            continue
        rate = parse_shape(shape).rate
        if rate is None:
            continue
        beta = 8 / (rate * PAYLOAD_SHARE)
        alpha = med[(shape, placement, coll, small, variant)].median_ms / 1e3
        gamma = med[(shape, placement, coll, big, variant)].cpu_ms_mean / 1e3 / big
        cells = []
        per_s = math.nan
        for s in shown:
            r = med.get((shape, placement, coll, s, variant))
            if r is None:
                cells.append("-")
                continue
            per_s = _link_bytes(r) / s
            t = alpha + max(_link_bytes(r) * beta, r.world_size * gamma * s / CORES)
            cells.append(f"{t * 1e3:.1f} / {r.median_ms:.1f}")
        lines.append(f"| {shape} | {placement} | {variant} | {per_s:.2f} | {alpha * 1e3:.2f} | "
                     f"{gamma * 1e9:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_text(rows: list[Row]) -> str:
    return "\n".join(f"- {'MET' if ok else 'NOT MET'}: {what} ({got})"
                      for what, got, ok in targets(rows))


def load_rows(paths: Sequence[str]) -> list[Row]:
    """Every row of ``--json`` files of earlier runs."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [Row(**r) for r in json.load(f)["rows"]]
    return rows


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--shape", action="append", default=None,
                        help=f"HOSTSxRANKS@RATE or R+R+...@RATE, repeatable (default "
                             f"{', '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--placement", action="append", choices=PLACEMENTS, default=None,
                        help="repeatable (default both)")
    parser.add_argument("--op", "--collective", dest="collectives", action="append",
                        choices=COLLECTIVES, default=None,
                        help="repeatable (default all_reduce)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME:KEY=VALUE,... extra rank environment, repeatable "
                             f"(default {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--runs", type=int, default=1, help="interleaved runs (median shown)")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed iterations per size (default: --budget over the bound, "
                             f"{MIN_ITERS}..{MAX_ITERS})")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help="seconds of timed iterations per point")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per job")
    parser.add_argument("--json", default=None, help="write every run's rows to this file")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="print the tables and the targets of earlier --json files")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        plan = [(c, int(s), int(i)) for c, s, i in (p.split(":") for p in args.plan.split(","))]
        return worker(plan, args.warmup)

    if args.report:
        rows = load_rows(args.report)
        print(table(rows) + "\n\n" + busbw_table(rows) + "\n\nTargets:\n"
              + targets_text(rows) + "\n\nCost model (all_reduce):\n\n" + model_table(rows))
        return 1 if any(r.wrong for r in rows) else 0

    from swarmfd.bench import parse_sizes

    sizes = parse_sizes(args.sizes)
    for s in sizes:
        if s % 4:
            parser.error(f"size {s} is not a whole number of float32 elements")
    shapes = [parse_shape(s) for s in (args.shape or DEFAULT_SHAPES)]
    placements = args.placement or list(PLACEMENTS)
    collectives = args.collectives or ["all_reduce"]
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    if args.runs < 1:
        parser.error("--runs must be >= 1")

    print(f"# hierarchy: {', '.join(collectives)} float32, sizes {args.sizes}, "
          f"{args.runs} run(s); load average at start {_loadavg()}", flush=True)
    rows: list[Row] = []
    started = time.monotonic()
    for shape in shapes:  # one network per shape; runs interleave inside it
        with netsim.SimulatedHosts(hosts=shape.hosts, rate=shape.rate) as net:
            for run in range(args.runs):
                for placement in placements:
                    for name, env in variants:
                        t0 = time.monotonic()
                        got = run_job(net, shape, placement, name, env, sizes, collectives,
                                      args, run)
                        rows += got
                        print(f"# {shape.label} {placement} {name} run {run + 1}: "
                              + ", ".join(f"{r.collective} {_fmt_size(r.size)} "
                                          f"{r.median_ms:.2f} ms" for r in got)
                              + f" ({time.monotonic() - t0:.0f} s, load {_loadavg()})",
                              file=sys.stderr, flush=True)
    print(table(rows))
    print("\n" + busbw_table(rows))
    print("\nTargets:\n" + targets_text(rows))
    print("\nCost model (all_reduce):\n\n" + model_table(rows))
    comparison = baseline_comparison(rows)
    if comparison:
        print("\nAgainst the flat all_reduce before the two-level collectives "
              "(all_reduce; > 1x: faster):\n"
              + comparison)
    print(f"\n# {time.monotonic() - started:.0f} s; load average at the end {_loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "hierarchy", "sizes": sizes, "collectives": collectives,
                       "shapes": [s.label for s in shapes], "rows": [asdict(r) for r in rows]},
                      f, indent=2)
    return 1 if any(r.wrong for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
