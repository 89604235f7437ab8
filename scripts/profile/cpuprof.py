"""A pytest plugin that records what each test costs: wall time and CPU time, its
child processes included, for finding where the CI budget goes (CONTRIBUTING.md).

Each worker (each xdist lane, or the single pytest process) moves itself into a cgroup
of its own (cgroup v1 ``cpuacct``, root only) before collection, so every process it
starts (fork-server ranks, CLIs, pip) is counted in that cgroup, reaped or not. Per
test it writes one JSON line: ``id``, ``worker``, ``t`` (start, seconds since the
plugin loaded), ``wall``, ``cpu`` and ``sys`` (the cgroup's CPU seconds during the
test), ``docker`` (the CPU seconds of Docker's containers meanwhile: the engines of the
multi-node Swarm, the ranks of a deploy, image builds; only meaningful in the Docker
lanes) and ``busy`` (the machine's busy CPU seconds meanwhile). Not loaded by default::

    PYTHONPATH=scripts/profile CPUPROF_OUT=/tmp/prof bash .ci/run -p cpuprof
    python3 scripts/profile/report.py /tmp/prof

Output: ``$CPUPROF_OUT.<worker>`` (default ``/tmp/cpuprof.jsonl.<worker>``). Without
root or without a cgroup v1 ``cpuacct`` hierarchy, ``cpu`` and ``sys`` stay 0 and the
plugin says so once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from typing import Any

import pytest

CGROUP_ROOT = "/sys/fs/cgroup/cpuacct"
_T0 = time.time()


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def _cgroup() -> str:
    return f"{CGROUP_ROOT}/swarmfd-cpuprof-{_worker()}"


def _seconds(path: str) -> float:
    """A cpuacct counter (nanoseconds) in seconds; 0 where it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _busy() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat, all but idle and
    iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pytest_configure(config: pytest.Config) -> None:
    """Move this process into its cgroup, before collection starts any child."""
    try:
        os.makedirs(_cgroup(), exist_ok=True)
        with open(f"{_cgroup()}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        print(f"cpuprof: no cgroup of its own ({exc}): cpu and sys are not recorded")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave the cgroup and remove it (it stays while a child still runs in it)."""
    try:
        with open(f"{CGROUP_ROOT}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(_cgroup())
    except OSError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
    """Measure one test, its set-up and tear-down included."""
    group = _cgroup()
    cpu, sys_, docker = (_seconds(f"{group}/cpuacct.usage"),
                         _seconds(f"{group}/cpuacct.usage_sys"),
                         _seconds(f"{CGROUP_ROOT}/docker/cpuacct.usage"))
    busy, started = _busy(), time.time()
    yield
    record = json.dumps({
        "id": item.nodeid, "worker": _worker(), "t": started - _T0,
        "wall": time.time() - started,
        "cpu": _seconds(f"{group}/cpuacct.usage") - cpu,
        "sys": _seconds(f"{group}/cpuacct.usage_sys") - sys_,
        "docker": _seconds(f"{CGROUP_ROOT}/docker/cpuacct.usage") - docker,
        "busy": _busy() - busy,
    })
    with open(f"{os.environ.get('CPUPROF_OUT', '/tmp/cpuprof.jsonl')}.{_worker()}", "a") as f:
        f.write(record + "\n")
