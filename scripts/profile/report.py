"""Summarise what scripts/profile/cpuprof.py recorded: each lane's end, wall and CPU,
then the costliest test files (or tests), by CPU.

    python3 scripts/profile/report.py PREFIX [--by file|test] [--top N]

PREFIX is the plugin's ``CPUPROF_OUT``; every ``PREFIX.<worker>`` file is read. The
Docker CPU of a test counts only in the lanes that ran Docker tests (elsewhere it is
another lane's); it is every container's, so where the two Docker lanes run side by
side each one's figure holds the other's too (the sum counts that time twice).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections import defaultdict
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prefix")
    parser.add_argument("--by", choices=("file", "test"), default="file")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for path in sorted(glob.glob(f"{args.prefix}.*")):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    if not rows:
        parser.error(f"no records in {args.prefix}.*")
    docker_lanes = {r["worker"] for r in rows
                    if r["id"].startswith(("tests/swarm/", "tests/multinode/"))}
    print("lane     first test  end (s)  wall (s)  CPU (s)  Docker CPU (s)  tests  e.g.")
    lanes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        lanes[r["worker"]].append(r)
    for worker, rs in sorted(lanes.items()):
        rs.sort(key=lambda r: r["t"])
        docker = sum(r["docker"] for r in rs) if worker in docker_lanes else 0.0
        print(f"{worker:8} {rs[0]['t']:10.0f} {max(r['t'] + r['wall'] for r in rs):8.0f} "
              f"{sum(r['wall'] for r in rs):9.0f} {sum(r['cpu'] for r in rs):8.0f} "
              f"{docker:15.0f} {len(rs):6}  {rs[0]['id'].split('::')[0]}")
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])
    for r in rows:
        key = r["id"].split("::")[0] if args.by == "file" else r["id"]
        acc = total[key]
        acc[0] += r["cpu"]
        acc[1] += r["sys"]
        acc[2] += r["docker"] if r["worker"] in docker_lanes else 0.0
        acc[3] += r["wall"]
        acc[4] += 1
    print(f"\nall tests: {sum(r['cpu'] for r in rows):.0f} CPU-s in the lanes' cgroups "
          f"({sum(r['sys'] for r in rows):.0f} of it system), Docker "
          f"{sum(a[2] for a in total.values()):.0f} CPU-s, {len(rows)} tests\n")
    print("    CPU     sys  Docker    wall     n  " + args.by)
    for key, (cpu, sys_, docker, wall, n) in sorted(
            total.items(), key=lambda kv: -(kv[1][0] + kv[1][2]))[:args.top]:
        print(f"{cpu:7.1f} {sys_:7.1f} {docker:7.1f} {wall:7.1f} {int(n):5}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
