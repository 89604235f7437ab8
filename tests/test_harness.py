"""The test harness's own promises (tests/support/harness.py): ranks never outlive their test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: A test process that starts two ranks which never return, reports their pids, and dies
#: without reaping them (as a pytest worker that libzmq or a signal killed).
_DYING_TEST = """
import json, os, sys, time
from tests.support import harness
from tests.test_harness import _forever
harness._CTX.set_forkserver_preload(["tests.support.harness"])  # (no torch: seconds of CPU)
ranks = harness.Ranks(_forever, 2, init=False)
ranks.__enter__()
ranks.wait("up")
print(json.dumps([p.pid for p in ranks.procs]), flush=True)
os._exit(1)
"""


def _forever(ctx: Any) -> None:
    """A rank that never returns (a job waiting for a ``go`` nobody will give)."""
    ctx.report("up", os.getpid())
    while True:
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not reaped yet) has ended
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_ranks_end_when_their_test_process_dies(tmp_path: Path) -> None:
    """Ranks are forked by the fork server, not by the test: when a test process dies
    without reaping them, each rank ends by itself within seconds (harness._die_with),
    instead of running on beside the rest of the suite."""
    # Output to a file, not a pipe: ranks write to the test's stdout, and a pipe that
    # ranks outliving the test hold open would never end.
    out = tmp_path / "out"
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, "-c", _DYING_TEST], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, timeout=60)
    text = out.read_text()
    assert proc.returncode == 1, text
    # (Other lines may follow: the resource tracker's warnings, written when it sees the
    # test process gone.)
    pids = next(json.loads(line) for line in text.splitlines() if line.startswith("["))
    assert len(pids) == 2
    deadline = time.monotonic() + 10.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:  # (the test fails below; do not leave them running)
        os.kill(p, 9)
    assert not left, f"ranks {left} outlived their dead test process by 10 s"
