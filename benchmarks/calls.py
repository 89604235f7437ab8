"""The latency of small public calls as a script writes them, tree against tree.

``benchmarks/compare.py`` times the collectives the way nccl-tests does: all_gather
into a preallocated ``out=``. A script more often writes ``fd.all_gather(x)``, whose
ranks may hold first dimensions that differ (the counts travel with the rows), and
that path is timed here, next to the others, for several swarmfd trees (another
checkout, a ``git worktree`` of an older commit) run alternately, so they see the
same machine::

    python benchmarks/calls.py --tree new=. --tree old=/tmp/tree-8ec62ae -n 4 --runs 5

Each job runs ``swarmfd run -n N`` with the tree's package first on ``PYTHONPATH``;
every rank times each call ``--iters`` times after a barrier, and the figure of a run
is the slowest rank's median. Printed: each run's figures, then per call the median
over runs and the ratio of every tree to the first, run by run.

``--loop`` times ``--iters`` calls back to back instead (no barrier between them; the
figure is the slowest rank's mean time a call) and also prints each rank's CPU time a
call, its main thread's and its other threads' (libzmq's I/O thread), read from
/proc. When ranks outnumber cores (N=4 here) a call's latency after a barrier is
mostly the scheduler's (per-run ratios of one tree against itself spread by 30 %);
back to back the ranks keep every core busy, so the time a call takes is the CPU the
ranks spend on it, and the runs agree within a few percent. Each call then runs in a
job of its own: after 2200 all_reduces and broadcasts, 4 KiB all_gathers on the socket
plane at N=4 took 1.1-1.2x the time they took first in a job, with the ranks' CPU a
call unchanged and the cores idle more often (not understood).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_out")

#: Each call of CALLS as a rank's code writes it, on ``x`` (``out``: N rows of x's size).
#: Also benchmarks/steps.py's.
CALL_TABLE = r"""
calls = {
    "all_reduce": lambda: fd.all_reduce(x),
    "broadcast": lambda: fd.broadcast(x, src=0),
    "all_gather": lambda: fd.all_gather(x),
    "all_gather_out": lambda: fd.all_gather(x, out=out),
}
"""

#: The rank's side: times every call and prints one JSON line on rank 0.
WORKER = r"""
import json, os, sys, time
import numpy as np
import swarmfd as fd
getattr(fd, "init_from_env", fd.init)()
rank, n = fd.get_rank(), fd.get_world_size()
nbytes, iters = int(sys.argv[1]), int(sys.argv[2])
x = np.ones(nbytes // 4, np.float32)
out = np.empty((n, x.size), np.float32)
""" + CALL_TABLE + r"""
loop = sys.argv[4] == "loop"


def cpu() -> tuple[float, float]:
    # CPU seconds of this process's main thread and of its other threads.
    main = other = 0.0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if tid == str(os.getpid()):
            main += used
        else:
            other += used
    return main, other


result = {}
for name in sys.argv[3].split(","):
    call = calls[name]
    for _ in range(max(20, iters // 10)):
        fd.barrier()
        call()
    if loop:
        fd.barrier()
        c0, t0 = cpu(), time.perf_counter()
        for _ in range(iters):
            call()
        t1, c1 = time.perf_counter(), cpu()
        mine = np.array([(t1 - t0) / iters, (c1[0] - c0[0]) / iters, (c1[1] - c0[1]) / iters])
        every = np.empty((n, 3))
        fd.all_gather(mine, out=every)
        result[name] = float(np.max(every[:, 0])) * 1e6
        result[name + ":cpu"] = [float(v) * 1e6 for v in every[:, 1]]
        result[name + ":threads"] = [float(v) * 1e6 for v in every[:, 2]]
        continue
    times = np.empty(iters)
    for i in range(iters):
        fd.barrier()
        t0 = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t0
    medians = fd.all_gather(np.array([np.median(times)]), out=np.empty((n, 1)))
    result[name] = float(np.max(medians)) * 1e6
if rank == 0:
    print("CALLS " + json.dumps(result), flush=True)
fd.cleanup()
"""


def run_job(tree: Path, env_extra: dict[str, str], n: int, nbytes: int, iters: int,
            calls: list[str], timeout: float, loop: bool = False) -> dict[str, Any]:
    """One job of ``n`` ranks importing swarmfd from ``tree``: each call's slowest-rank
    median in microseconds (``loop``: the slowest rank's mean back to back, and every
    rank's CPU time a call under ``call:cpu`` and ``call:threads``)."""
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "swarmfd", "run", "-n", str(n), "--", sys.executable, "-c",
           WORKER, str(nbytes), str(iters), ",".join(calls), "loop" if loop else "latency"]
    # Not from the repository root: its swarmfd package would shadow the tree's.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd="/", check=False)
    for line in proc.stdout.splitlines():
        if "CALLS " in line:
            return json.loads(line.split("CALLS ", 1)[1])
    raise RuntimeError(f"the job of {tree} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def plane_env(plane: str) -> dict[str, str]:
    """The environment of a plane: shared memory (one host's default) or a TCP plane."""
    if plane == "shm":
        return {"SWARMFD_TRANSPORT": "auto"}
    return {"SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": plane}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True,
                    help="NAME=PATH of a swarmfd checkout (the first is the reference)")
    ap.add_argument("-n", type=int, action="append", help="ranks (repeatable; default 2, 4)")
    ap.add_argument("--plane", action="append", choices=("shm", "socket", "zmq"),
                    help="repeatable; default all three")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes of each rank's array")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--call", action="append", choices=CALLS, help="repeatable; default all")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--loop", action="store_true",
                    help="time calls back to back and report CPU a call (see above)")
    args = ap.parse_args(argv)
    trees = []
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees.append((name, Path(path).resolve()))
    calls = args.call or list(CALLS)
    figures: dict[tuple[str, int, str, str], list[float]] = {}
    for run in range(args.runs):
        # Alternate the order run by run, so that a tree's place in a round cancels out.
        order = trees if run % 2 == 0 else trees[::-1]
        for n in args.n or [2, 4]:
            for plane in args.plane or ["shm", "socket", "zmq"]:
                for name, path in order:
                    if args.loop:  # a job for each call: see the module docstring
                        got = {}
                        for c in calls:
                            got.update(run_job(path, plane_env(plane), n, args.bytes,
                                               args.iters, [c], args.timeout, True))
                    else:
                        got = run_job(path, plane_env(plane), n, args.bytes, args.iters,
                                      calls, args.timeout)
                    print(f"run {run} N={n} {plane:6s} {name:8s} "
                          + " ".join(f"{c}={got[c]:.1f}" for c in calls), flush=True)
                    if args.loop:
                        for c in calls:
                            print(f"    {c} CPU a call per rank (us): main "
                                  + " ".join(f"{v:.0f}" for v in got[c + ":cpu"])
                                  + ", other threads "
                                  + " ".join(f"{v:.0f}" for v in got[c + ":threads"]),
                                  flush=True)
                    for c in calls:
                        figures.setdefault((c, n, plane, name), []).append(got[c])
    ref = trees[0][0]
    print(f"\n| call | N | plane | {' | '.join(n for n, _ in trees)} | "
          + " | ".join(f"{n}/{ref} (runs)" for n, _ in trees[1:]) + " |")
    print("|---|---|---|" + "---|" * (2 * len(trees) - 1))
    for c in calls:
        for n in args.n or [2, 4]:
            for plane in args.plane or ["shm", "socket", "zmq"]:
                base = figures[(c, n, plane, ref)]
                cells = [f"{statistics.median(figures[(c, n, plane, t)]):.1f} us"
                         for t, _ in trees]
                for t, _ in trees[1:]:
                    mine = figures[(c, n, plane, t)]
                    runs = " ".join(f"{a / b:.2f}" for a, b in zip(mine, base, strict=True))
                    cells.append(f"{statistics.median(mine) / statistics.median(base):.2f} "
                                 f"({runs})")
                print(f"| {c} | {n} | {plane} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
