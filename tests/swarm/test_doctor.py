"""``swarmfd doctor`` on the one-node Swarm: ``--json`` exits 0 with the figures measured
inside a task, and its probe job leaves nothing behind, also when Ctrl-C stops it.

The real command line in a subprocess, bounded; the probe job is found by the name
doctor prints, and checked gone through the engine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from swarmfd.swarm.spec import LABEL_JOB
from tests.support.swarm_jobs import wait_until

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT = 180.0
CHECKS = ["engine", "nodes", "image", "overlay", "ports", "mtu", "links", "clocks", "tasks",
          "placement"]


def doctor_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmfd", "doctor", *args]


def leftovers(client: Any, name: str) -> dict[str, list[Any]]:
    """Whatever of the probe job ``name`` the engine still has."""
    label = {"label": f"{LABEL_JOB}={name}"}
    return {k: v for k, v in {
        "services": client.api.services(filters=label),
        "networks": client.api.networks(filters=label),
        "secrets": client.api.secrets(filters=label),
        "containers": client.api.containers(all=True, filters=label),
    }.items() if v}


def probe_names(stderr: str) -> list[str]:
    return re.findall(r"with job (swarmfd-doctor-[0-9a-f]{6}) ", stderr)


def test_doctor_json_on_one_node_exits_0_with_the_tasks_figures(
        swarm: Any, swarmfd_image: str) -> None:
    """Every check ok; stdout is the JSON document alone; the node-pair checks say "one
    node"; the task's /dev/shm is deploy's default tmpfs; -n 2 puts both ranks here."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(doctor_argv("--json", "--image", swarmfd_image, "-n", "2"),
                          capture_output=True, text=True, timeout=CLI_TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"ok", "checks"} and doc["ok"] is True
    assert [c["name"] for c in doc["checks"]] == CHECKS
    by = {c["name"]: c for c in doc["checks"]}
    assert all(c["status"] == "ok" for c in doc["checks"]), doc
    assert all(set(c) == {"name", "status", "detail", "fix", "figures"} for c in doc["checks"])
    for name in ("ports", "mtu", "links", "clocks"):
        assert "one node" in by[name]["detail"], by[name]
    (task,) = by["tasks"]["figures"].values()
    assert task["shm_bytes"] == 1 << 30 and task["memory_available"] > 0 and task["cores"] >= 1
    (ranks,) = by["placement"]["figures"]["per_node"].values()
    assert ranks["ranks"] == 2 and ranks["memory_needed"] < ranks["memory_free"]
    name = by["overlay"]["figures"]["job"]
    assert name.startswith("swarmfd-doctor-") and leftovers(swarm, name) == {}
    print(f"\nswarmfd doctor --json on one node: {by['overlay']['detail']}; tasks: "
          f"{by['tasks']['detail']}")


def test_ctrl_c_during_the_probe_removes_it(swarm: Any, swarmfd_image: str) -> None:
    """SIGINT while the probe's task runs: doctor removes the probe job, then exits 130."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(doctor_argv("--image", swarmfd_image), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        name = wait_until(lambda: probe_names("".join(lines)), 60, "the probe's name")[0]
        wait_until(lambda: swarm.api.services(filters={"name": name}), 60, "the probe job")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=CLI_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    reader.join(10)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert "interrupted (the probe job was removed)" in stderr
    assert leftovers(swarm, name) == {}


SHM_REPORT = ("import os, stat; s = os.statvfs('/dev/shm'); "
              "mode = oct(stat.S_IMODE(os.stat('/dev/shm').st_mode)); "
              "print('shm', s.f_blocks * s.f_frsize, mode)")


def test_deploy_shm_size_mounts_that_tmpfs_at_dev_shm(swarm: Any, swarmfd_image: str) -> None:
    """deploy --shm-size 256M: the rank's /dev/shm is a tmpfs of 256 MiB, mode 1777 (a
    container's own is 64 MiB)."""
    name = f"swarmfd-test-shm-{os.urandom(3).hex()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "swarmfd", "deploy", swarmfd_image, "-n", "1", "--name", name,
         "--shm-size", "256M", "--rm", "--", "python", "-c", SHM_REPORT],
        capture_output=True, text=True, timeout=CLI_TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[rank 0] shm {256 << 20} 0o1777" in proc.stdout.splitlines(), proc.stdout
    assert leftovers(swarm, name) == {}
