"""Before/after ratios from a compare.py run: one tree's variants against another's.

compare.py runs the systems interleaved (run 1: every system, run 2: every system in
reverse order, ...). Given the raw CSV of a run with variants named ``<new>-<plane>``
and ``<old>-<plane>`` (for example ``new-shm`` and ``old-shm``, the old one importing
an older tree through PYTHONPATH), this prints, per collective, world size, plane and
size: the ratio of the medians over the runs (new / old, below 1 is faster), both
medians, the run-by-run ratios (each run's pair ran minutes apart at most) and how
many runs the new tree won. Usage::

    .venv/bin/python benchmarks/pairs.py benchmarks/out/compare-<stamp>-raw.csv \
        [--new new --old old]
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> dict[tuple[str, int, str, int], dict[int, float]]:
    """{(system, n, collective, size): {run: median seconds}} of a raw CSV."""
    out: dict[tuple[str, int, str, int], dict[int, float]] = defaultdict(dict)
    with path.open() as f:
        for row in csv.DictReader(f):
            key = (row["system"], int(row["n"]), row["collective"], int(row["size"]))
            out[key][int(row["run"])] = float(row["median_s"])
    return out


def size_label(size: int) -> str:
    """4096 -> '4 KiB'."""
    for unit, name in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"


def table(data: dict[tuple[str, int, str, int], dict[int, float]], new: str,
          old: str) -> list[str]:
    """The markdown rows comparing every ``new-X`` system with its ``old-X``."""
    lines = ["| collective | N | plane | size | new/old | new us | old us | runs | won |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (system, n, coll, size), runs in sorted(data.items(),
                                                 key=lambda kv: (kv[0][2], kv[0][1],
                                                                 kv[0][0], kv[0][3])):
        if not system.startswith(new + "-"):
            continue
        plane = system[len(new) + 1:]
        before = data.get((f"{old}-{plane}", n, coll, size))
        if not before:
            continue
        common = sorted(set(runs) & set(before))
        if not common:
            continue
        a = statistics.median(runs[r] for r in common)
        b = statistics.median(before[r] for r in common)
        per_run = [runs[r] / before[r] for r in common]
        won = sum(x < 1 for x in per_run)
        lines.append(f"| {coll} | {n} | {plane} | {size_label(size)} | {a / b:.2f} | "
                     f"{a * 1e6:.1f} | {b * 1e6:.1f} | "
                     f"{' '.join(f'{x:.2f}' for x in per_run)} | {won}/{len(common)} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="a compare-<stamp>-raw.csv")
    p.add_argument("--new", default="new", help="the prefix of the new tree's variants")
    p.add_argument("--old", default="old", help="the prefix of the old tree's variants")
    args = p.parse_args()
    print("\n".join(table(load(args.raw), args.new, args.old)))


if __name__ == "__main__":
    main()
