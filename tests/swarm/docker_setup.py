"""Docker set-up on first need, for the Swarm and multi-node fixtures.

``scripts/test.sh`` does not set up Docker itself: it exports ``SWARMFD_SETUP_DOCKER=1``
and the first fixture that needs the engine calls :func:`ensure_engine`, which runs
``scripts/setup-docker.sh engine`` (install docker.io if missing, start dockerd, a
one-node Swarm; about 0.2 s when all is there). So ``scripts/test.sh -m "not swarm"``
never touches Docker, and a run that selects Swarm tests sets it up exactly once.
Without the variable (plain ``pytest``) nothing is installed or started: the tests use
the engine that answers, or skip (fail under ``CI=true``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup-docker.sh"
#: Installing docker.io from the Debian mirror and starting it took 40-70 s here.
ENGINE_SETUP_TIMEOUT = 600.0

_engine_ready = False


def setup_requested() -> bool:
    """True when the runner (scripts/test.sh) asked the fixtures to set Docker up."""
    return os.environ.get("SWARMFD_SETUP_DOCKER", "").strip() == "1"


def run_setup(*steps: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``scripts/setup-docker.sh STEPS...`` to completion (raises TimeoutExpired)."""
    return subprocess.run(["bash", str(SETUP_SCRIPT), *steps], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def ensure_engine() -> str:
    """Run ``setup-docker.sh engine`` once per session when asked to; return "" when
    the engine is (or may be) there, else why the set-up failed."""
    global _engine_ready
    if _engine_ready or not setup_requested():
        return ""
    try:
        proc = run_setup("engine", timeout=ENGINE_SETUP_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"{SETUP_SCRIPT} engine did not finish within {ENGINE_SETUP_TIMEOUT:.0f} s"
    if proc.returncode != 0:
        return (f"{SETUP_SCRIPT} engine failed (exit {proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}")
    _engine_ready = True
    return ""
