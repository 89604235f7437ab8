"""examples/train_torch.py under swarmfd run: plain DDP at N=2 and N=3 with the default
batch, and ZeRO through a crash and a resume, ending where an uninterrupted run ends.

The example needs scikit-learn (the examples extra: ``pip install -e ".[examples]"``,
which scripts/test.sh installs) and torch: without either these tests skip, or fail
under CI=true.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .support.harness import require_installed, require_torch

# Both are imported by the example's processes only.
require_torch(load=False)
require_installed("sklearn", "the example's data: pip install -e '.[examples]'")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_torch.py"
EPOCHS = "8"


def _run(tmp_path: Path, *args: str, n: int, run_args: tuple[str, ...] = ()) -> str:
    """The example's output under ``swarmfd run -n N`` (rank 0's lines, unprefixed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SWARMFD_SECRET_FILE", None)
    env.pop("SWARMFD_CHECKPOINT_DIR", None)
    cmd = [sys.executable, "-m", "swarmfd", "run", "-n", str(n), *run_args, str(EXAMPLE),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.replace("[rank 0] ", "")


def _final(out: str, n: int) -> tuple[float, str]:
    """The final accuracy and checksum; the replicas must be identical."""
    acc = float(re.search(r"final test accuracy: ([0-9.]+)", out).group(1))
    assert f"params identical on all {n} ranks: OK" in out, out[-3000:]
    return acc, re.search(r"checksum ([0-9a-f]{16})", out).group(1)


def test_plain_ddp_on_two_and_three_ranks_with_the_default_batch(tmp_path: Path) -> None:
    """Plain DDP at N=2 and N=3 with the default global batch (a multiple of both): each
    learns, and both reach the same accuracy within one percentage point (N ranks follow
    one process's trajectory up to float rounding)."""
    two, _ = _final(_run(tmp_path, "--epochs", EPOCHS, n=2), 2)
    out = _run(tmp_path, "--epochs", EPOCHS, n=3)
    assert "3 rank(s), Adam, global batch 96 (32 per rank)" in out, out[-3000:]
    three, _ = _final(out, 3)
    assert two > 0.9 and three > 0.9, (two, three)
    assert abs(two - three) <= 0.01, (two, three)


def test_zero_through_a_crash_and_resume_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    """N=2 --zero crashing after epoch 3 and restarted from its checkpoint (model and
    consolidated optimizer state) resumes at epoch 3 and ends with exactly the
    parameters of the same run without the crash: the same checksum."""
    straight = _final(_run(tmp_path, "--epochs", EPOCHS, "--zero", n=2), 2)
    out = _run(tmp_path, "--epochs", EPOCHS, "--zero", "--fail-at-epoch", "3",
               "--checkpoint-dir", str(tmp_path / "ckpt"), n=2, run_args=("--max-restarts", "1"))
    assert f"resumed at epoch 3/{EPOCHS}" in out, out[-3000:]
    resumed = out[out.index("resumed at epoch"):]
    assert f"epoch   3/{EPOCHS}" not in resumed and f"epoch   4/{EPOCHS}" in resumed, resumed
    assert _final(out, 2) == straight, (out[-3000:], straight)
