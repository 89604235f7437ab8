"""The two-level collectives end to end: real ranks on simulated hosts (benchmarks/netsim.py).

Each simulated host is a network namespace, so its ranks share memory (the setup's
abstract unix socket is per namespace) and reach the other hosts over TCP. A job runs
tests/support/hier_job.py: every collective at sizes around the paths, lists of several
dtypes, a group that crosses hosts; each rank checks its results and reports the path
it took. Then a host is lost in the middle of a loop of large calls: its ranks killed,
or its link cut (no FIN: the keepalive finds it), and every survivor must name a rank
of that host and its host name within the suite's bounds (tests/support/harness.py
LOST_PEER_LIMIT, VANISHED_PEER_LIMIT). Needs root: skips without it, fails under CI=true.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import netsim  # noqa: E402

from .support.harness import LOST_PEER_LIMIT, VANISHED_PEER_LIMIT, unavailable  # noqa: E402

JOB = str(ROOT / "tests" / "support" / "hier_job.py")
PREFIX = "HIER-RESULT "


@pytest.fixture(scope="module")
def net() -> Iterator[netsim.SimulatedHosts]:
    """Three unshaped simulated hosts for the whole module (jobs use some of them)."""
    try:
        netsim.check_requirements()
    except netsim.NetsimUnavailable as exc:
        unavailable(str(exc), what="the simulated-host tests", fix="run them as root")
    with netsim.SimulatedHosts(hosts=3) as hosts:
        yield hosts


def _results(res: netsim.JobResult) -> list[dict[str, Any]]:
    out = []
    for r in range(len(res.ranks)):
        lines = [ln for ln in res.stdout(r).splitlines() if ln.startswith(PREFIX)]
        assert lines, f"rank {r} reported nothing\n{res.describe()}"
        out.append(json.loads(lines[-1][len(PREFIX):]))
    return out


@pytest.mark.parametrize("placement", [[0, 1, 0, 1], [0, 0, 0, 1], [0, 1, 2, 0, 1]],
                         ids=["2x2-spread", "3+1", "3-hosts-2+2+1"])
def test_every_collective_two_level(net: netsim.SimulatedHosts, placement: list[int]) -> None:
    """Correct results on every rank, through the two-level algorithms (never a silent
    fall-back to flat TCP), with the ranks of each simulated host on shared memory."""
    res = net.run_job([sys.executable, JOB, "--expect-two-level"], placement, timeout=120,
                      env={"SWARMFD_TIMEOUT": "30"})
    got = _results(res)
    assert res.ok, res.describe()
    hosts = {r["host"] for r in got}
    assert len(hosts) == len(set(placement))
    for r in got:
        assert r["failures"] == [], r
        # the layout groups the ranks by their simulated host
        assert r["layout"] is not None
        by_host = {tuple(g for g in range(len(got)) if got[g]["host"] == h) for h in hosts}
        assert set(map(tuple, r["layout"])) == by_host, r
        alone = placement.count(placement[r["rank"]]) == 1
        assert r["shm"] is not alone, r  # shared memory exactly where a host has company


def _wait_ready(job: netsim.Job, ranks: list[int], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all("HIER-READY" in _read(job, r) for r in ranks):
            return
        if any(c is not None for c in job.poll()):
            break
        time.sleep(0.05)
    res = job.wait(timeout=10)
    raise AssertionError(f"the ranks did not get ready\n{res.describe()}")


def _read(job: netsim.Job, rank: int) -> str:
    try:
        with open(job._log(rank, "out")) as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.parametrize("how", ["killed", "link-cut"])
def test_host_lost_mid_call(net: netsim.SimulatedHosts, how: str) -> None:
    """Host 1 is lost while every rank loops on large two-level calls: its ranks
    SIGKILLed, or its link cut (no FIN). Every rank of host 0 raises a PeerLostError
    naming a rank of host 1 and that host, within today's bound of each case."""
    placement = [0, 1, 0, 1]
    lost = [r for r, h in enumerate(placement) if h == 1]
    survivors = [r for r, h in enumerate(placement) if h == 0]
    job = net.start_job([sys.executable, JOB, "--until-error"], placement,
                        env={"SWARMFD_TIMEOUT": "60"})
    try:
        with job:
            _wait_ready(job, list(range(len(placement))))
            time.sleep(0.3)  # well inside the loop
            mark = time.monotonic()
            if how == "killed":
                job.kill_host(1)
            else:
                net.set_link(1, False)
            end = time.monotonic() + 30
            while time.monotonic() < end and any(PREFIX not in _read(job, r)
                                                 for r in survivors):
                time.sleep(0.05)
            if how != "killed":
                job.kill_host(1)
            res = job.wait(timeout=60)
    finally:
        if how != "killed":
            net.set_link(1, True)
    limit = LOST_PEER_LIMIT if how == "killed" else VANISHED_PEER_LIMIT
    name = net.name(1)
    for r in survivors:
        lines = [ln for ln in res.stdout(r).splitlines() if ln.startswith(PREFIX)]
        assert lines, f"rank {r} reported nothing\n{res.describe()}"
        info = json.loads(lines[-1][len(PREFIX):])
        assert info["two_level"], info
        assert "PeerLostError" in info["mro"], info
        named = [v for v in lost if f"rank {v} (host {name}," in info["message"]]
        assert named, f"rank {r} does not name a rank of {name}: {info['message']}"
        elapsed = info["t"] - mark
        assert 0 <= elapsed < limit, (r, elapsed, limit, info["message"])
