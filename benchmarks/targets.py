"""The performance targets of the TCP planes and shared memory, met or not, from a
compare.py summary CSV.

    python benchmarks/targets.py benchmarks/out/compare-STAMP.csv [--zmq NAME] ...

A target is a ratio: the other system's time / swarmfd's (above 1: swarmfd faster), at
one N and size, all_reduce. Each is judged twice: by the median of the runs of each
system, and by the best run of each (disturbances only add time). Prints a markdown
table. The systems are compare.py's names: ``swarmfd`` (shared memory),
``swarmfd-tcp`` (the socket plane), and the zmq plane's variant (``--zmq``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence

KIB, MIB = 1 << 10, 1 << 20


def targets(sock: str, zmq: str, shm: str) -> list[tuple[str, int, int, str, str, float]]:
    """(what, N, size, swarmfd system, other system, at least this ratio)."""
    t = []
    for size, goal in ((4 * KIB, 1.0), (64 * KIB, 0.8), (MIB, 0.8), (16 * MIB, 1.0),
                       (64 * MIB, 1.3)):
        t.append(("socket plane vs Open MPI TCP", 2, size, sock, "mpi-tcp", goal))
    t.append(("socket plane vs gloo", 2, MIB, sock, "gloo", 2.0))
    for size in (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB):
        t.append(("socket plane vs gloo", 4, size, sock, "gloo", 1.0))
    for size in (16 * MIB, 64 * MIB):
        t.append(("socket plane vs Open MPI TCP", 4, size, sock, "mpi-tcp", 1.0))
    for size, goal in ((4 * KIB, 0.5), (64 * KIB, 0.5), (MIB, 0.9), (16 * MIB, 0.9),
                       (64 * MIB, 0.9)):
        t.append(("zmq plane vs socket plane", 2, size, zmq, sock, goal))
    for size, goal in ((4 * KIB, 0.25), (64 * KIB, 0.6), (MIB, 1.0), (16 * MIB, 1.0),
                       (64 * MIB, 2.0)):
        t.append(("shared memory vs Open MPI shm", 2, size, shm, "mpi-shm", goal))
    for size, goal in ((MIB, 1.0), (16 * MIB, 1.0), (64 * MIB, 1.5)):
        t.append(("shared memory vs Open MPI shm", 4, size, shm, "mpi-shm", goal))
    return t


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="compare-STAMP.csv (the summary, not -raw)")
    p.add_argument("--socket", default="swarmfd-tcp", help="the socket plane's system name")
    p.add_argument("--zmq", default="swarmfd-zmq", help="the zmq plane's system name")
    p.add_argument("--shm", default="swarmfd", help="the shared-memory system name")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        reader = csv.DictReader(f)
        need = {"system", "n", "collective", "size", "median_s", "best_s"}
        missing = need - set(reader.fieldnames or ())
        if missing:
            p.error(f"{args.csv} has no column {', '.join(sorted(missing))}: expected "
                    "compare.py's summary CSV (compare-STAMP.csv, not compare-STAMP-raw.csv)")
        rows = {(r["system"], int(r["n"]), r["collective"], int(r["size"])): r
                for r in reader}
    print("| target | N | size | at least | median of runs | best runs | met |")
    print("|---|---|---|---|---|---|---|")
    met = total = 0
    for what, n, size, mine, other, goal in targets(args.socket, args.zmq, args.shm):
        a = rows.get((mine, n, "all_reduce", size))
        b = rows.get((other, n, "all_reduce", size))
        if a is None or b is None:
            print(f"| {what} | {n} | {human(size)} | {goal:g}x | - | - | not measured |")
            continue
        med = float(b["median_s"]) / float(a["median_s"])
        best = float(b["best_s"]) / float(a["best_s"])
        ok = "yes" if med >= goal and best >= goal else (
            "by the best runs" if best >= goal else ("by the median" if med >= goal else "no"))
        total += 1
        met += ok == "yes"
        print(f"| {what} | {n} | {human(size)} | {goal:g}x | {med:.2f}x | {best:.2f}x | {ok} |")
    print(f"\n{met} of {total} measured targets met by both statistics.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
