"""End-to-end tests of examples/train.py: real processes, real training, real collectives.

The example is run as a subprocess (a world of one with plain ``python``, and
worlds of 2 and 3 under ``swarmfd run``). Each run has a timeout; on timeout the
whole process group (launcher and ranks) is killed and the output shown.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
TIMEOUT = 120.0
CONTRACT_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SWARMFD_PORT", "SWARMFD_TIMEOUT", "SWARMFD_RESTART_COUNT",
                 "SWARMFD_CHECKPOINT_DIR")

ACCURACY = re.compile(r"final test accuracy: (\d\.\d+)")
IDENTICAL = re.compile(r"params identical on all (\d+) ranks: OK \(checksum ([0-9a-f]{16})\)")


def clean_env() -> dict[str, str]:
    """This process's environment without the swarmfd contract (so a child is a world of one)."""
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(args: list[str], timeout: float = TIMEOUT, cwd: Path = ROOT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in its own session; on timeout kill the whole group and fail with its output."""
    proc = subprocess.Popen(args, cwd=cwd, env={**clean_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def train_cmd(tmp_path: Path, *extra: str, world: int | None = None,
              launcher_opts: tuple[str, ...] = ()) -> list[str]:
    script = [str(TRAIN), "--checkpoint-dir", str(tmp_path / "ckpt"), *extra]
    if world is None:
        return [sys.executable, *script]
    return [sys.executable, "-m", "swarmfd", "run", "-n", str(world), *launcher_opts, "--",
            sys.executable, *script]


def check_success(result: subprocess.CompletedProcess[str], world: int,
                  min_accuracy: float | None = 0.9) -> str:
    """Assert a successful run of ``world`` ranks; return the final parameter checksum."""
    assert result.returncode == 0, explain(result)
    identical = IDENTICAL.findall(result.stdout)
    assert len(identical) == 1, explain(result)
    assert int(identical[0][0]) == world
    for rank in range(world):
        assert re.search(rf"rank {rank}: trained on \d+ samples", result.stdout), explain(result)
    if min_accuracy is not None:
        accuracy = ACCURACY.findall(result.stdout)
        assert len(accuracy) == 1, explain(result)
        assert float(accuracy[0]) >= min_accuracy, explain(result)
    return identical[0][1]


def test_world_of_one_learns(tmp_path):
    """`python examples/train.py` alone trains to > 90% test accuracy and saves a checkpoint."""
    result = run(train_cmd(tmp_path, "--epochs", "30", "--min-accuracy", "0.9"))
    check_success(result, world=1)
    assert "epoch  30/30" in result.stdout
    assert (tmp_path / "ckpt" / "train_checkpoint.npz").is_file()


def test_resume_continues_exactly(tmp_path):
    """3 epochs, then --resume to 6, ends with the same parameters as 6 epochs in one go."""
    straight = run(train_cmd(tmp_path / "a", "--epochs", "6"))
    first = run(train_cmd(tmp_path / "b", "--epochs", "3"))
    resumed = run(train_cmd(tmp_path / "b", "--epochs", "6", "--resume"))
    check_success(first, world=1, min_accuracy=None)
    assert "resumed from" in resumed.stdout and "at epoch 3/6" in resumed.stdout, explain(resumed)
    assert "epoch   1/6" not in resumed.stdout
    assert check_success(resumed, world=1, min_accuracy=None) == check_success(
        straight, world=1, min_accuracy=None)


def test_resume_without_checkpoint_starts_fresh(tmp_path):
    """--resume with no checkpoint says so and trains from epoch 1."""
    result = run(train_cmd(tmp_path, "--epochs", "2", "--resume", "--checkpoint-every", "0"))
    check_success(result, world=1, min_accuracy=None)
    assert "no usable checkpoint" in result.stdout
    assert "epoch   1/2" in result.stdout
    assert not (tmp_path / "ckpt").exists()


def test_without_a_checkpoint_dir_nothing_is_written_and_it_says_so(tmp_path):
    """No --checkpoint-dir, no SWARMFD_CHECKPOINT_DIR: no checkpoints, none in the current
    directory (it used to create ./checkpoints silently), and the output says so."""
    result = run([sys.executable, str(TRAIN), "--epochs", "2"], cwd=tmp_path)
    check_success(result, world=1, min_accuracy=None)
    assert "checkpoints: off (--checkpoint-dir DIR or SWARMFD_CHECKPOINT_DIR" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_dir_comes_from_the_environment(tmp_path):
    """SWARMFD_CHECKPOINT_DIR (what deploy --checkpoint-volume sets) is where it saves, and
    where a restart (SWARMFD_RESTART_COUNT=1) resumes from."""
    env = {"SWARMFD_CHECKPOINT_DIR": str(tmp_path / "vol")}
    first = run([sys.executable, str(TRAIN), "--epochs", "2"], cwd=tmp_path, env=env)
    check_success(first, world=1, min_accuracy=None)
    ckpt = tmp_path / "vol" / "train_checkpoint.npz"
    assert f"checkpoints: {ckpt} every 1 epoch(s)" in first.stdout
    assert ckpt.is_file()
    again = run([sys.executable, str(TRAIN), "--epochs", "3"], cwd=tmp_path,
                env={**env, "SWARMFD_RESTART_COUNT": "1"})
    assert f"resumed from {ckpt} at epoch 2/3 (restart 1; rank 0's copy)" in again.stdout, \
        explain(again)


def _load_train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("swarmfd_example_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _restore_on_rank(rank: int, world: int, base: str) -> tuple[int, int, str]:
    import numpy as np

    train = _load_train_module()
    params = train.init_params(np.random.default_rng(rank), 8)
    velocity = [np.zeros_like(p) for p in params]
    path = Path(base) / f"node{rank}" / train.CHECKPOINT_NAME  # each rank its own disk
    if rank == 1:  # the failed attempt's rank 0 ran where this rank runs now
        saved = train.init_params(np.random.default_rng(99), 8)
        train.save_checkpoint(path, saved, [np.ones_like(p) for p in saved], 2)
    epoch, holder = train.restore(path, params, velocity)
    flat = np.concatenate([p.ravel() for p in params + velocity])
    return epoch, holder, train.checksum(flat)


def test_restore_takes_the_checkpoint_from_whichever_rank_has_it(ranks, tmp_path):
    """Ranks on separate disks (a volume per node): only rank 1 finds a checkpoint; every
    rank resumes from it (epoch 2, rank 1's copy), with its parameters and velocities."""
    import numpy as np

    train = _load_train_module()
    saved = train.init_params(np.random.default_rng(99), 8)
    expected = train.checksum(np.concatenate([p.ravel() for p in saved]
                                             + [np.ones_like(p).ravel() for p in saved]))
    results = ranks(_restore_on_rank, 3, str(tmp_path))
    assert results == [(2, 1, expected)] * 3


def test_bad_arguments_are_rejected(tmp_path):
    """Nonsense options exit 2 with a message naming the option."""
    result = run(train_cmd(tmp_path, "--epochs", "0"))
    assert result.returncode == 2, explain(result)
    assert "--epochs must be >= 1" in result.stderr


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_run(tmp_path, world):
    """`swarmfd run -n N examples/train.py`: every rank trains, > 90% accuracy, identical params."""
    result = run(train_cmd(tmp_path, "--min-accuracy", "0.9", world=world))
    check_success(result, world=world)
    # Every rank saw an equal share: ceil(2400 / world) samples per epoch, 40 epochs.
    for rank in range(world):
        assert f"rank {rank}: trained on {40 * -(-2400 // world)} samples" in result.stdout
    # fd.print reports from rank 0 only: one line per epoch, not one per rank.
    assert result.stdout.count("epoch  40/40") == 1, explain(result)


def test_shared_memory_and_tcp_end_with_the_same_parameters(tmp_path):
    """The same run on shared memory (swarmfd run's default) and over TCP (what crosses
    hosts on a Swarm) ends with bit-identical parameters: the same checksum."""
    checksums = {}
    for transport in ("auto", "tcp"):
        cmd = train_cmd(tmp_path / transport, "--epochs", "3", world=2,
                        launcher_opts=("-e", f"SWARMFD_TRANSPORT={transport}"))
        checksums[transport] = check_success(run(cmd), world=2, min_accuracy=None)
    assert checksums["auto"] == checksums["tcp"], checksums


def test_restart_resumes_from_checkpoint(tmp_path):
    """A rank dies after epoch 3; --max-restarts 1 restarts the group, which resumes at epoch 3
    and ends with exactly the parameters of an uninterrupted run."""
    straight = run(train_cmd(tmp_path / "a", "--epochs", "6", world=2))
    crashed = run(train_cmd(tmp_path / "b", "--epochs", "6", "--fail-at-epoch", "3", world=2,
                            launcher_opts=("--max-restarts", "1")))
    assert "simulated failure after epoch 3" in crashed.stderr, explain(crashed)
    assert "at epoch 3/6 (restart 1; rank 0's copy)" in crashed.stdout, explain(crashed)
    assert check_success(crashed, world=2, min_accuracy=None) == check_success(
        straight, world=2, min_accuracy=None)


def test_failure_without_restart_fails_the_run(tmp_path):
    """Without --max-restarts the simulated failure makes `swarmfd run` exit non-zero."""
    result = run(train_cmd(tmp_path, "--epochs", "4", "--fail-at-epoch", "2", world=2))
    assert result.returncode != 0, explain(result)
    assert "simulated failure after epoch 2" in result.stderr, explain(result)
    assert "params identical" not in result.stdout
