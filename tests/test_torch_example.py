"""examples/train_torch.py under swarmfd run: N=2 reaches N=1's accuracy through a crash.

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

from .harness import require_installed

# Both are imported by the example's processes only.
require_installed("torch", "pip install torch==2.13.0, the CPU wheel")
require_installed("sklearn", "the example's data: pip install -e '.[examples]'")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_torch.py"
EPOCHS = "6"



def _run(tmp_path: Path, *args: str, n: int | None = None,
         run_args: tuple[str, ...] = ()) -> str:
    """The example's output (rank 0's lines, unprefixed): alone, or under swarmfd run -n."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SWARMFD_SECRET_FILE", None)
    env.pop("SWARMFD_CHECKPOINT_DIR", None)
    cmd = [sys.executable, str(EXAMPLE), *args]
    if n is not None:
        cmd = [sys.executable, "-m", "swarmfd", "run", "-n", str(n), *run_args, *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.replace("[rank 0] ", "")


def _final(out: str) -> tuple[float, str]:
    acc = float(re.search(r"final test accuracy: ([0-9.]+)", out).group(1))
    assert re.search(r"params identical on all \d+ ranks: OK", out), out
    return acc, re.search(r"checksum ([0-9a-f]{16})", out).group(1)


def test_two_ranks_with_zero_reach_one_rank_through_a_crash_and_resume(tmp_path: Path) -> None:
    """N=1, and N=2 --zero crashing after epoch 3 and restarted from its checkpoint
    (model and consolidated optimizer state): the same final accuracy within one
    percentage point, and the replicas identical."""
    one, _ = _final(_run(tmp_path, "--epochs", EPOCHS))
    out = _run(tmp_path, "--epochs", EPOCHS, "--zero", "--fail-at-epoch", "3",
               "--checkpoint-dir", str(tmp_path / "ckpt"), n=2, run_args=("--max-restarts", "1"))
    assert "resumed at epoch 3/6" in out, out[-3000:]
    resumed = out[out.index("resumed at epoch"):]
    assert "epoch   3/6" not in resumed and "epoch   4/6" in resumed, resumed
    two, _ = _final(out)
    assert abs(one - two) <= 0.01, (one, two)
    assert two > 0.9, two
