"""``swarmfd top`` and what ``swarmfd run`` does with the ranks' status lines: a real
job of 3 ranks under ``swarmfd run`` (rank 1 slowed on every step), read by ``swarmfd
top --once --json`` and by the live view in a real terminal (tmux); the launcher hides
the status lines and ends with the job's line. The table's rules on plain data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from swarmfd import jobs
from swarmfd.observe import RECENT
from swarmfd.statusline import MARK
from swarmfd.top import TopError, pick_job, rows

from .support.harness import unavailable

SLOWED = """
import os, sys, time
import numpy as np
import swarmfd as fd

fd.init()
x = np.ones(256, np.float32)
stop = time.monotonic() + 60
go = np.zeros(1, np.int32)
while True:
    if fd.get_rank() == 1:
        time.sleep(0.05)
    go[0] = time.monotonic() < stop and not os.path.exists(sys.argv[1])
    fd.all_reduce(go, op="min")
    fd.all_reduce(x)
    if not go[0]:
        break
print("done", flush=True)
fd.cleanup()
"""


def test_rows_mark_the_straggler_and_stalled_ranks() -> None:
    waits = [0.05] * 20
    job = {"name": "j", "kind": "local", "world": 4, "ranks": {
        "0": {"node": "a", "state": "all_reduce", "in_s": 0.5, "calls_per_s": 10.0,
              "wait_share": 0.9, "seq": 20, "waits": waits},
        "1": {"node": "a", "state": "computing", "wait_share": 0.01, "seq": 20,
              "waits": [0.0] * 20},
        "2": {"node": "b", "state": "all_reduce", "in_s": 0.5, "wait_share": 0.9, "seq": 20,
              "waits": waits}}}
    table = rows(job)
    assert [r["rank"] for r in table] == [0, 1, 2, 3]
    assert [r["straggler"] for r in table] == [False, True, False, False]
    assert table[0]["state"] == "all_reduce for 0.5 s" and table[3]["state"] == "starting"
    assert set(table[0]) == {"rank", "node", "state", "calls_per_s", "mb_per_s",
                             "wait_share", "straggler", "stalled"}
    # A rank inside one call past its stall threshold is stalled; the rank the stalled
    # ranks' reports name is the straggler.
    job["ranks"]["0"].update(in_s=12.0, stall_s=10.0, blamed=[2])
    table = rows(job)
    assert table[0]["stalled"] and not table[2]["stalled"]
    assert [r["straggler"] for r in table] == [False, False, True, False]


def test_top_picks_the_only_job_or_lists_them() -> None:
    a = {"name": "run-1", "kind": "local", "world": 2, "command": "python a.py"}
    b = {"name": "swarmfd-keen-3fa9", "kind": "swarm", "world": 3, "command": "img"}
    assert pick_job(None, [a]) is a
    assert pick_job("swarmfd-keen-3fa9", [a, b]) is b
    with pytest.raises(TopError, match=r"several jobs are running(.|\n)*run-1(.|\n)*keen"):
        pick_job(None, [a, b])
    with pytest.raises(TopError, match="no running swarmfd job"):
        pick_job(None, [])
    with pytest.raises(TopError, match="no running job named 'x'"):
        pick_job("x", [a])


def _swarmfd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarmfd", *args]


def _wait_for_job(proc: subprocess.Popen[bytes], world: int, timeout: float) -> dict[str, Any]:
    """The job this test started (its status file) once every rank's line carries only
    calls of the steady state: the ranks write their lines up to a second apart (40
    calls here), each with the waits of its last RECENT calls, and top compares the
    calls they share; in the first calls the ranks' start, not the sleep, decides who
    is last."""
    name = f"run-{proc.pid}"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "the job ended before top could see it"
        found = [j for j in jobs.local_jobs() if j["name"] == name]
        if found and len(found[0]["ranks"]) == world and all(
                r["calls"] > 2 * RECENT for r in found[0]["ranks"].values()):
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"job {name} did not show all its ranks within {timeout} s")


def test_top_shows_every_rank_of_a_local_job_and_flags_the_slowed_one(
        tmp_path: Path) -> None:
    """Under `swarmfd run -n 3`, rank 1 sleeps 50 ms per step: `swarmfd top --once
    --json` shows the three ranks and flags rank 1 (only), the live view in tmux draws
    the same; the run hides the status lines and ends with the job's line."""
    tmux = _tmux()
    script = tmp_path / "slowed.py"
    script.write_text(SLOWED)
    stop = tmp_path / "stop"
    proc = subprocess.Popen(_swarmfd("run", "-n", "3", str(script), str(stop)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        job = _wait_for_job(proc, 3, 30)
        out = subprocess.run(_swarmfd("top", "--once", "--json", job["name"]),
                             capture_output=True, timeout=30, check=True)
        table = json.loads(out.stdout)
        assert [r["rank"] for r in table] == [0, 1, 2], table
        assert [r["straggler"] for r in table] == [False, True, False], table
        assert all(r["node"] and r["calls_per_s"] > 0 for r in table), table
        assert table[0]["wait_share"] > 0.5 > table[1]["wait_share"], table
        # A snapshot compares the calls the ranks' last lines share (written up to a
        # second apart): as the live view, look again for a few seconds.
        for _ in range(10):
            text = subprocess.run(_swarmfd("top", "--once", job["name"]),
                                  capture_output=True, timeout=30, check=True).stdout.decode()
            if "straggler" in text:
                break
            time.sleep(0.5)
        assert "RANK" in text and "straggler" in text and job["name"] in text, text
        _live_view_in_tmux(tmux, job["name"])
        stop.touch()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr.decode()
    assert MARK not in stdout + stderr
    assert stdout.decode().count("done") == 3
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("swarmfd run: 3 rank(s), ") and "straggler: rank 1 " in last, last
    assert not os.path.exists(os.path.join(jobs.status_dir() or "/nonexistent",
                                           f"{job['name']}.json"))


def _tmux() -> str:
    """tmux, installed with apt-get where it is missing and this is root (a fresh CI
    machine: as scripts/setup-docker.sh installs Docker; dpkg's lock is waited for, the
    Docker set-up may hold it); else the test skips, or fails under CI=true."""
    found = shutil.which("tmux")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        lock = ["-o", "DPkg::Lock::Timeout=300"]
        for cmd in (["apt-get", *lock, "install", "-y", "-qq", "tmux"],
                    ["apt-get", *lock, "update", "-qq"],
                    ["apt-get", *lock, "install", "-y", "-qq", "tmux"]):
            subprocess.run(cmd, capture_output=True, timeout=600, env=env)
            found = shutil.which("tmux")
            if found is not None:
                break
    if found is None:
        unavailable("tmux is not installed", what="the live view's test of swarmfd top",
                    fix="apt-get install tmux")
    assert found is not None
    return found


def _live_view_in_tmux(tmux: str, name: str) -> None:
    """`swarmfd top JOB` in a real terminal: the table is drawn and refreshed."""
    session = f"swarmfd-top-{uuid.uuid4().hex[:8]}"
    cmd = " ".join([sys.executable, "-m", "swarmfd", "top", name])
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "30", cmd],
                   check=True, env={**os.environ, "TERM": "xterm-256color"})
    try:
        screens = []
        end = time.monotonic() + 15
        while time.monotonic() < end and len(set(screens)) < 2:
            time.sleep(0.5)
            screen = subprocess.run([tmux, "capture-pane", "-p", "-t", session],
                                    capture_output=True, check=True).stdout.decode()
            if "RANK" in screen:
                screens.append(screen)
        assert screens, "the live view drew no table"
        last = screens[-1]
        assert name in last and "straggler" in last, last
        shown = [line.split()[0] for line in last.splitlines() if line.split()]
        assert {"0", "1", "2"} <= set(shown), last
        assert len(set(screens)) >= 2, "the live view was not refreshed"
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)


def test_status_files_are_private_and_stale_ones_go(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The status directory is the user's alone (else none is used); a job whose
    launcher is gone, or whose file was not rewritten for a minute, is removed."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    job = jobs.JobStatus(2, ["python", "train.py"])
    base = jobs.status_dir()
    assert base == str(tmp_path / "swarmfd") and job.path is not None
    assert os.stat(base).st_mode & 0o777 == 0o700
    job.add({"rank": 1, "calls": 3, "final": True})
    assert [j["name"] for j in jobs.local_jobs()] == [job.name]
    assert jobs.local_jobs()[0]["ranks"]["1"]["calls"] == 3
    dead = Path(base) / "run-1.json"
    dead.write_text(json.dumps({"name": "run-x", "pid": 2**22 + 7, "ranks": {}}))
    old = time.time() - 2 * jobs.STALE_AFTER
    os.utime(job.path, (old, old))
    assert jobs.local_jobs() == []
    assert sorted(os.listdir(base)) == []
    os.chmod(base, 0o755)  # readable by others: not used
    assert jobs.status_dir() is None
