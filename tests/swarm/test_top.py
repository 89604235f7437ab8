"""``swarmfd top`` against a job on the real Swarm: 3 ranks, rank 1 slowed on every
step. The figures come from the ranks' status lines in the service log, read through
the manager (what works on a Swarm of several nodes, where ``docker exec`` cannot reach
other nodes' tasks); ``swarmfd logs`` hides those lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarmfd.statusline import MARK
from tests.support.swarm_jobs import SLOWED_JOB, job_names, top_rows

pytestmark = pytest.mark.swarm
ROOT = Path(__file__).resolve().parents[2]

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
                    "python", "-c", SLOWED_JOB)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = top_rows(_swarmfd, name, 3)
    assert [r["rank"] for r in table] == [0, 1, 2], table
    assert [r["straggler"] for r in table] == [False, True, False], table
    assert all(r["node"] != "-" for r in table), table
    assert table[0]["wait_share"] > 0.5 > table[1]["wait_share"], table
    logs = _swarmfd("logs", name, timeout=60)
    assert logs.returncode == 0 and MARK.decode() not in logs.stdout + logs.stderr
