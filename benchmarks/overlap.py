#!/usr/bin/env python3
"""Overlap of an async all_reduce with compute: how much of it hides behind the compute.

Each round times, on every rank, the all_reduce alone, a numpy computation of about its
length alone (single-threaded BLAS: ``a @ a`` on 256 x 256 float64, repeated), and the
two with the all_reduce issued async before the computation and waited for after it.
It reports the median over rounds of the slowest rank's times and
``both / (comm + compute)``: 1.0 is no overlap, 0.5 perfect overlap of equal halves.
Beside them, per rank (medians over rounds, mean over ranks): the CPU time of the
all_reduce alone (``time.process_time()``, every thread), and in the combined run when
the Work completed (``Work.completed_at``) and when the computation ended, both from
the issue, so a ratio can be read as "the communication finished under the compute" or
"it waited for the compute".

Modes (``--mode``, repeatable, run interleaved: ``for round: for mode``):

``shm``     N ranks on loopback under ``swarmfd run``, shared memory;
``tcp``     the same over the TCP plane (``SWARMFD_TRANSPORT=tcp``);
``netsim``  one rank per simulated host (``benchmarks/netsim.py``, root), links shaped
            with tbf at ``--rate`` (default 5gbit): the all_reduce waits on the link,
            not only on the CPU, which is where an async op can hide behind compute.

On loopback the all_reduce is itself CPU work (copies, adds, the kernel's TCP path) on
cores that the compute of the same ranks already keeps busy, so with as many ranks as
cores nothing can hide it: 1.0 is the floor there, and a ratio above it is the cost of
the ranks' two threads time-sharing a core.

    python benchmarks/overlap.py                               # shm, tcp, netsim (root)
    python benchmarks/overlap.py --mode netsim --rate 2gbit --mib 16 --runs 3
    swarmfd run -n 2 -- python benchmarks/overlap.py --worker  # one loopback job by hand

Only time on a quiet machine (the load average is printed with every job).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("shm", "tcp", "netsim")
RESULT_PREFIX = "OVERLAP-RESULT "
#: Default link rate of the simulated hosts: the rate of benchmarks/train.py's.
DEFAULT_RATE = "5gbit"


# --- a rank ------------------------------------------------------------------------------


def _slowest(t: float) -> float:
    import numpy as np

    import swarmfd as fd

    v = np.array([t])
    fd.all_reduce(v, op="max")
    return float(v[0])


def _mean_over_ranks(t: float) -> float:
    import numpy as np

    import swarmfd as fd

    v = np.array([t])
    fd.all_reduce(v, op="mean")
    return float(v[0])


def worker(mib: float, rounds: int) -> int:
    """One rank: calibrate the compute to the all_reduce, then time ``rounds`` rounds;
    rank 0 prints one JSON line."""
    import numpy as np

    import swarmfd as fd

    fd.init_from_env()
    x = np.ones(int(mib * (1 << 20)) // 4, np.float32)
    a = np.random.default_rng(fd.get_rank()).random((256, 256))
    fd.all_reduce(x)
    fd.barrier()
    t0 = time.monotonic()
    fd.all_reduce(x)
    comm0 = _slowest(time.monotonic() - t0)
    reps = 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < comm0:
        a @ a
        reps += 1
    reps = int(fd.all_reduce(np.array([reps]), op="max")[0])
    rows = []
    for _ in range(rounds):
        fd.barrier()
        c0 = time.process_time()
        t0 = time.monotonic()
        fd.all_reduce(x)
        comm = time.monotonic() - t0
        comm_cpu = time.process_time() - c0
        fd.barrier()
        t0 = time.monotonic()
        for _ in range(reps):
            a @ a
        compute = time.monotonic() - t0
        fd.barrier()
        t0 = time.monotonic()
        w = fd.all_reduce(x, async_op=True)
        for _ in range(reps):
            a @ a
        compute_end = time.monotonic() - t0
        w.wait()
        both = time.monotonic() - t0
        assert w.completed_at is not None
        done = w.completed_at - t0
        rows.append((_slowest(comm), _slowest(compute), _slowest(both),
                     _mean_over_ranks(comm_cpu), _mean_over_ranks(done),
                     _mean_over_ranks(compute_end)))
    med = [statistics.median(r[i] for r in rows) for i in range(6)]
    per_round = [r[2] / (r[0] + r[1]) for r in rows]
    if fd.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps({
            "world_size": fd.get_world_size(), "mib": mib, "rounds": rounds, "reps": reps,
            "comm_s": med[0], "compute_s": med[1], "both_s": med[2], "comm_cpu_s": med[3],
            "done_s": med[4], "compute_end_s": med[5],
            "ratio": med[2] / (med[0] + med[1]),
            "ratio_rounds": per_round}), flush=True)
    fd.cleanup()
    return 0


# --- the driver --------------------------------------------------------------------------


def _result(text: str, what: str) -> dict:
    for line in text.splitlines():  # ``swarmfd run`` prefixes each line with its rank
        at = line.find(RESULT_PREFIX)
        if at >= 0:
            return json.loads(line[at + len(RESULT_PREFIX):])
    raise RuntimeError(f"{what}: no result line in rank 0's output:\n{text[-3000:]}")


def _worker_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--mib", str(args.mib),
            "--rounds", str(args.rounds)]


def run_loopback(args: argparse.Namespace, plane: str) -> dict:
    """One job of ``args.ranks`` ranks on loopback under ``swarmfd run``."""
    env = {**os.environ, "SWARMFD_TRANSPORT": "tcp" if plane == "tcp" else "auto",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("SWARMFD_SECRET_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "swarmfd", "run", "-n", str(args.ranks), "--",
                           *_worker_argv(args)], capture_output=True, text=True, env=env,
                          timeout=args.timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{plane} job failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return _result(proc.stdout, plane)


def run_netsim(args: argparse.Namespace, net: object) -> dict:
    """One job, one rank on each simulated host."""
    env = {"SWARMFD_TRANSPORT": "auto", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = net.run_job(_worker_argv(args), placement=list(range(args.ranks)),  # type: ignore[attr-defined]
                         env=env, timeout=args.timeout)
    result.check()
    return _result(result.stdout(0), "netsim")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def table(rows: list[dict]) -> str:
    """Medians over runs per mode."""
    lines = ["| mode | N | all_reduce alone ms | its CPU ms/rank | compute alone ms | both ms "
             "| both / sum | Work done at ms | compute ended at ms | runs (ratio) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        g = [r for r in rows if r["mode"] == mode]

        def med(key: str, g: list[dict] = g) -> float:
            return statistics.median(r[key] for r in g)

        label = mode if mode != "netsim" else f"netsim {g[0]['rate']}"
        lines.append(
            f"| {label} | {g[0]['world_size']} | {med('comm_s') * 1e3:.1f} | "
            f"{med('comm_cpu_s') * 1e3:.1f} | {med('compute_s') * 1e3:.1f} | "
            f"{med('both_s') * 1e3:.1f} | {med('ratio'):.2f} | {med('done_s') * 1e3:.1f} | "
            f"{med('compute_end_s') * 1e3:.1f} | "
            + " ".join(f"{r['ratio']:.2f}" for r in g)
            + f" | {g[0]['load']} .. {g[-1]['load']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=16.0, help="all_reduce size (MiB, float32)")
    p.add_argument("--rounds", type=int, default=9, help="rounds per job (median)")
    p.add_argument("--mode", action="append", choices=MODES, default=None,
                   help="repeatable (default: all three)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (netsim: one per host)")
    p.add_argument("--rate", default=DEFAULT_RATE, help="netsim link rate (e.g. 5gbit)")
    p.add_argument("--runs", type=int, default=1, help="jobs per mode, interleaved")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--json", default=None, help="write every job's result to this file")
    p.add_argument("--worker", action="store_true",
                   help="be one rank (under swarmfd run, or started by the driver)")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.mib, args.rounds)
    modes = args.mode or list(MODES)
    print(f"# overlap: {args.mib:g} MiB all_reduce, {args.ranks} ranks, {args.rounds} rounds "
          f"per job, {args.runs} run(s) of {', '.join(modes)}; load {_load()}", flush=True)
    rows: list[dict] = []
    net = None
    try:
        if "netsim" in modes:
            sys.path.insert(0, str(HERE))
            import netsim

            net = netsim.SimulatedHosts(hosts=args.ranks, rate=args.rate).up()
        for run in range(args.runs):
            for mode in modes:
                t0 = time.monotonic()
                res = run_netsim(args, net) if mode == "netsim" else run_loopback(args, mode)
                res.update(mode=mode, run=run, load=_load(), rate=args.rate)
                rows.append(res)
                print(f"# {mode} run {run + 1}: alone {res['comm_s'] * 1e3:.1f} + "
                      f"{res['compute_s'] * 1e3:.1f} ms, both {res['both_s'] * 1e3:.1f} ms, "
                      f"ratio {res['ratio']:.2f} ({time.monotonic() - t0:.0f} s, load "
                      f"{res['load']})", file=sys.stderr, flush=True)
    finally:
        if net is not None:
            net.close()
    print(table(rows))
    print(f"# load at the end {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "overlap", "mib": args.mib, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
