"""The Python steps a collective call takes, tree against tree: bytecodes and calls.

At N=4 on 2 cores a small call's time is the CPU its ranks spend, and most of that is
the interpreter's: each rank's microsecond costs about two of the call. Timings of
such calls spread by 10-30 % from run to run here; the number of bytecodes a call
executes does not. This counts them (``sys.settrace`` with opcode events, in every
rank, over ``--calls`` calls after ``--warmup``), per function, for several swarmfd
trees (another checkout, a ``git worktree`` of an older commit), and prints each
tree's total a call and the functions that differ most::

    python benchmarks/steps.py --tree old=/tmp/tree-8ec62ae --tree new=. -n 4 \\
        --plane zmq --call all_reduce --bytes 4096

Tracing slows a call down many times, so waits poll longer and take more steps than
untraced; the figures are for comparing trees, and a wait loop's count varies a
little from run to run. Found with it (zmq plane, N=4, 4 KiB all_reduce): 8ec62ae
2276 bytecodes and 80 Python calls a call, d2ab7cd 2727 and 85, whose main thread
spent 10-15 us more CPU a call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from calls import CALL_TABLE, CALLS, plane_env  # this script's folder is first on sys.path

#: Every rank: warm up, trace ``traced`` calls, write its counts to a JSON file.
WORKER = r"""
import collections, json, os, sys
import numpy as np
import swarmfd as fd
getattr(fd, "init_from_env", fd.init)()
rank, n = fd.get_rank(), fd.get_world_size()
call_name, nbytes, warmup, traced, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
x = np.zeros(max(1, nbytes // 4), np.float32)
out = np.empty((n, x.size), np.float32)
""" + CALL_TABLE + r"""
call = calls[call_name]
for _ in range(warmup):
    call()
fd.barrier()
ops, fns = collections.Counter(), collections.Counter()


def trace(frame, event, arg):
    code = frame.f_code
    key = os.path.basename(code.co_filename) + ":" + code.co_name
    if event == "call":
        fns[key] += 1
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
    elif event == "opcode":
        ops[key] += 1
    return trace


sys.settrace(trace)
for _ in range(traced):
    call()
sys.settrace(None)
fd.barrier()
with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
    json.dump({"ops": {k: v / traced for k, v in ops.items()},
               "calls": {k: v / traced for k, v in fns.items()}}, f)
fd.cleanup()
"""


def count(tree: Path, plane: str, n: int, call: str, nbytes: int, warmup: int,
          calls: int, timeout: float) -> dict[str, dict[str, float]]:
    """One job of ``n`` ranks importing swarmfd from ``tree``: the ranks' mean bytecodes
    and Python calls a call, per function (``file:function``)."""
    with tempfile.TemporaryDirectory(prefix="swarmfd-steps-") as out_dir:
        env = dict(os.environ, **plane_env(plane))
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "swarmfd", "run", "-n", str(n), "--", sys.executable,
               "-c", WORKER, call, str(nbytes), str(warmup), str(calls), out_dir]
        # Not from the repository root: its swarmfd package would shadow the tree's.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd="/", check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the job of {tree} failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        total: dict[str, dict[str, float]] = {"ops": {}, "calls": {}}
        for r in range(n):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                got = json.load(f)
            for what in total:
                for k, v in got[what].items():
                    total[what][k] = total[what].get(k, 0.0) + v / n
        return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True,
                    help="NAME=PATH of a swarmfd checkout (the first is the reference)")
    ap.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--plane", choices=("shm", "socket", "zmq"), default="zmq")
    ap.add_argument("--call", choices=CALLS, default="all_reduce")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes of each rank's array")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--calls", type=int, default=200, help="calls traced")
    ap.add_argument("--top", type=int, default=15, help="functions shown per tree")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    got = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        got[name] = count(Path(path).resolve(), args.plane, args.n, args.call, args.bytes,
                          args.warmup, args.calls, args.timeout)
    print(f"{args.call} of {args.bytes} bytes, N={args.n}, {args.plane} plane: per call, "
          "the ranks' mean")
    for name, c in got.items():
        print(f"  {name}: {sum(c['ops'].values()):.0f} bytecodes, "
              f"{sum(c['calls'].values()):.1f} Python calls")
    for name, c in got.items():
        print(f"\n{name}, the functions with the most bytecodes a call (calls a call):")
        for k, v in sorted(c["ops"].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {v:8.1f}  ({c['calls'].get(k, 0.0):4.1f})  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
