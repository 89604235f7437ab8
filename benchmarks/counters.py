"""What the call counters cost (swarmfd.counters): a timeit of the code every blocking
call runs for them, and the 4 KiB all_reduce with and without them, in one run.

1. ``timeit`` of the statements ``Schedule.run`` adds per call (two
   ``time.perf_counter()`` readings, the counts, the wait of the call by its number,
   the rank waited for), on a real :class:`~swarmfd.counters.CallStats`, for a call
   that did not wait and one that did.
2. ``benchmarks/calls.py`` on three trees run alternately: this one twice (the A/A
   spread of the same interleaved run) and ``--without`` (a tree or git ref without
   the counters, checked out as a worktree in a temporary directory), all_reduce of
   4 KiB on each plane::

       python benchmarks/counters.py --without core --runs 5 -n 2 [--loop]

   ``--loop`` times the calls back to back (the CPU they take, steadier on a loaded
   machine than a call timed after a barrier, whose time is then mostly the
   scheduler's).

Prints figures; asserts nothing (docs/observability.md has a sample).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SETUP = """
from time import perf_counter
from types import SimpleNamespace
from swarmfd.counters import WINDOW, CallStats
MASK = WINDOW - 1
st = CallStats(0, 4)
ch = SimpleNamespace(waited=WAITED, waited_most=0.0, waited_on=1)
nbytes, seq = 4096, 7
"""
#: The statements Schedule.run (swarmfd/call.py) runs for the counters, around the call.
COUNTERS = """
st.since = t0 = perf_counter()
st.time_s += perf_counter() - t0
st.calls += 1
st.bytes += nbytes
waited = ch.waited
st.waits[seq & MASK] = waited
if waited:
    st.wait_s += waited
    st.last[ch.waited_on] += 1
    ch.waited = WAITED
"""


def time_counters(number: int = 1_000_000, repeat: int = 7) -> dict[str, float]:
    """The counters' cost per call in us (best of ``repeat``), without and with a wait."""
    out = {}
    for name, waited in (("no wait", "0.0"), ("waited", "0.001")):
        setup = SETUP.replace("WAITED", waited)
        times = timeit.repeat(COUNTERS.replace("WAITED", waited), setup, number=number,
                              repeat=repeat)
        empty = timeit.repeat("pass", setup, number=number, repeat=repeat)
        out[name] = (min(times) - min(empty)) / number * 1e6
    return out


def worktree(ref: str, where: str) -> str:
    """``ref`` checked out (detached) under ``where``; a directory is used as it is."""
    if Path(ref).is_dir():
        return ref
    path = str(Path(where) / "without")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", path, ref],
                   check=True, capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--without", required=True,
                    help="a tree or git ref without the counters (the A/B baseline)")
    ap.add_argument("-n", type=int, default=2, help="ranks")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--plane", action="append", choices=("shm", "socket", "zmq"))
    ap.add_argument("--loop", action="store_true",
                    help="time calls back to back (calls.py --loop: also each rank's CPU a "
                         "call), steadier than after a barrier on a loaded machine")
    args = ap.parse_args()
    for name, us in time_counters().items():
        print(f"counter code per call ({name}): {us:.3f} us")
    with tempfile.TemporaryDirectory(prefix="swarmfd-counters-") as tmp:
        base = worktree(args.without, tmp)
        try:
            cmd = [sys.executable, str(HERE / "calls.py"), "--tree", f"with={ROOT}",
                   "--tree", f"with-again={ROOT}", "--tree", f"without={base}",
                   "-n", str(args.n), "--call", "all_reduce", "--bytes", "4096",
                   "--iters", str(args.iters), "--runs", str(args.runs)]
            for plane in args.plane or ("shm", "socket", "zmq"):
                cmd += ["--plane", plane]
            if args.loop:
                cmd.append("--loop")
            subprocess.run(cmd, check=True)
        finally:
            if base != args.without:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", base],
                               capture_output=True)


if __name__ == "__main__":
    main()
