"""``swarmfd top`` against a job on the real Swarm: 3 ranks, rank 1 slowed on every
step. The figures come from the ranks' status lines in the service log, read through
the manager (what works on a Swarm of several nodes, where ``docker exec`` cannot reach
other nodes' tasks); ``swarmfd logs`` hides those lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarmfd.statusline import MARK
from tests.swarm_jobs import job_names

pytestmark = pytest.mark.swarm
ROOT = Path(__file__).resolve().parents[2]

SLOWED = (
    "import time\n"
    "import numpy as np\n"
    "import swarmfd as fd\n"
    "fd.init()\n"
    "x = np.ones(256, np.float32)\n"
    "end = time.monotonic() + 90\n"
    "while time.monotonic() < end:\n"
    "    if fd.get_rank() == 1:\n"
    "        time.sleep(0.05)\n"
    "    fd.all_reduce(x)\n"
)


def _swarmfd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmfd", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture
def job_name(swarm: Any) -> Any:
    with job_names(swarm, "sfdt") as make:
        yield make


def test_top_shows_every_rank_of_a_swarm_job_and_flags_the_slowed_one(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    name = job_name("top")
    proc = _swarmfd("deploy", "-d", swarmfd_image, "-n", "3", "--name", name, "--",
                    "python", "-c", SLOWED)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table: list[dict[str, Any]] = []
    end = time.monotonic() + 90
    while time.monotonic() < end:
        out = _swarmfd("top", "--once", "--json", name, timeout=60)
        assert out.returncode == 0, out.stderr
        table = json.loads(out.stdout)
        if len(table) == 3 and all(r["calls_per_s"] > 0 for r in table) and any(
                r["straggler"] for r in table):
            break
        time.sleep(1)
    assert [r["rank"] for r in table] == [0, 1, 2], table
    assert [r["straggler"] for r in table] == [False, True, False], table
    assert all(r["node"] != "-" for r in table), table
    assert table[0]["wait_share"] > 0.5 > table[1]["wait_share"], table
    logs = _swarmfd("logs", name, timeout=60)
    assert logs.returncode == 0 and MARK.decode() not in logs.stdout + logs.stderr
