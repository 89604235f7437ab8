"""An elastic job on a real Swarm: ``deploy --elastic``, a rank's container killed with
``docker kill``, Swarm's replacement joins the running job, which finishes (deploy exits
0), and ``swarmfd ps`` shows the replacement in the killed rank's slot.

The job is tests/launch_scripts/elastic_job.py, bind-mounted read-only: its result
counts how many times each sample was processed in the committed history.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmfd.swarm.spec import LABEL_JOB
from tests.support.swarm_jobs import job_names, rank_lines, wait_until

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "launch_scripts"
RESULT = re.compile(r"RESULT rank=(\d+) world=(\d+) gen=(\d+) min=(\d+) max=(\d+)")


@pytest.fixture
def job_name(swarm: Any) -> Iterator[Callable[[str], str]]:
    with job_names(swarm, "sfde") as make:
        yield make


def _tasks(swarm: Any, name: str) -> list[dict[str, Any]]:
    """The job's tasks ([] until deploy created its service)."""
    services = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})
    return swarm.api.tasks(filters={"service": services[0]["ID"]}) if services else []


@contextlib.contextmanager
def _deploy(image: str, name: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``deploy --elastic --keep`` of tests/launch_scripts/elastic_job.py (240 samples),
    with ``args`` (ranks, environment); killed and reaped on exit if still running."""
    deploy = subprocess.Popen(
        [sys.executable, "-m", "swarmfd", "deploy", image, "--elastic", "--keep", "--name",
         name, "--mount", f"type=bind,src={SCRIPTS},dst=/scripts,readonly", "-e",
         "SAMPLES=240", *args, "--", "python", "/scripts/elastic_job.py"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        yield deploy
    finally:
        if deploy.poll() is None:
            deploy.kill()
            deploy.communicate()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``swarmfd ARGS`` from the repository, output captured."""
    return subprocess.run([sys.executable, "-m", "swarmfd", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_a_killed_container_is_replaced_and_the_job_finishes(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    name = job_name("kill")
    with _deploy(swarmfd_image, name, "-n", "3", "--min-n", "2", "-e", "EPOCHS=3",
                 "-e", "STEP_SLEEP=0.25", "-e", "KILL_DIR=/tmp") as deploy:
        wait_until(lambda: deploy.poll() is not None or len(
            [t for t in _tasks(swarm, name) if t["Status"]["State"] == "running"]) == 3, 120,
                   "three running ranks")
        assert deploy.poll() is None, deploy.communicate()
        first = next(t for t in _tasks(swarm, name) if t["Slot"] == 1)
        wait_until(lambda: b"first commit" in swarm.api.logs(
            first["Status"]["ContainerStatus"]["ContainerID"]), 120, "the first commit")
        victim = next(t for t in _tasks(swarm, name) if t["Slot"] == 2)
        swarm.api.kill(victim["Status"]["ContainerStatus"]["ContainerID"])
        out, err = deploy.communicate(timeout=240)
    assert deploy.returncode == 0, out + err
    assert "rank 1 exited with code 137" in err, err
    results = [tuple(int(g) for g in m.groups()) for m in RESULT.finditer(out)]
    assert results and all(r[3] == 3 for r in results), out  # no sample skipped
    assert any("swarmfd: generation" in line for line in rank_lines(err).get(0, [])), err
    assert any("this replacement joined the job" in line
               for line in rank_lines(err).get(1, [])), err
    assert all(r[1] == 3 for r in results), out  # the replacement is in the final world
    slot2 = sorted((t for t in _tasks(swarm, name) if t["Slot"] == 2),
                   key=lambda t: t["CreatedAt"])
    assert len(slot2) >= 2 and slot2[-1]["ID"] != victim["ID"], slot2
    ps = _cli("ps", name)
    assert ps.returncode == 0, ps.stderr
    row = next(line for line in ps.stdout.splitlines()[2:] if line.startswith("1 "))
    assert row.split()[1] == "complete" and slot2[-1]["ID"][:12] in row.split(), ps.stdout


def test_scale_grows_and_shrinks_a_running_elastic_job(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """`swarmfd scale` to 3: the new task joins at a commit (world of 3); back to 2: the
    task taken away leaves at its next commit (SIGTERM), without a rollback; the job
    finishes with every sample processed as often as without the changes."""
    name = job_name("scale")

    def logs() -> bytes:
        return b"".join(swarm.api.logs(t["Status"]["ContainerStatus"]["ContainerID"])
                        for t in _tasks(swarm, name)
                        if t["Status"].get("ContainerStatus", {}).get("ContainerID"))

    def scale(n: int) -> None:
        out = _cli("scale", name, str(n))
        assert out.returncode == 0, out.stdout + out.stderr

    with _deploy(swarmfd_image, name, "-n", "2", "-e", "EPOCHS=4", "-e",
                 "STEP_SLEEP=0.15") as deploy:
        wait_until(lambda: deploy.poll() is not None or b"first commit" in logs(), 120,
                   "the first commit")
        assert deploy.poll() is None, deploy.communicate()
        scale(3)
        wait_until(lambda: deploy.poll() is not None
                   or b"this replacement joined the job" in logs(), 120, "the new rank joined")
        scale(2)
        out, err = deploy.communicate(timeout=240)
    assert deploy.returncode == 0, out + err
    text = out + err
    assert "left the job at a commit, as asked" in text, text
    assert "lost rank(s) [" not in text.replace("lost rank(s) []", ""), text  # no rollback
    results = [tuple(int(g) for g in m.groups()) for m in RESULT.finditer(out)]
    assert len(results) == 2 and all(r[1] == 2 and r[3] == 4 for r in results), out
    assert any("1 joined; world of 3" in line for lines in rank_lines(err).values()
               for line in lines), err
