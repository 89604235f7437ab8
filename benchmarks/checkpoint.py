#!/usr/bin/env python3
"""Sharded checkpoints against safetensors' own files, and a full state dict's peak.

The model: ``--blocks`` Linear(``--width``, ``--width``) layers (default 8 x 2048: 33.6 M
parameters, 134 MB of float32), each a unit of ``fully_shard``. Per round, interleaved:

``baseline``  one process: ``safetensors.torch.save_file`` of the model's whole state
              dict (the same tensors), then ``load_file`` of it into a fresh model
              (``load_state_dict``: load_file maps the file and reads nothing until
              the tensors are used, so a load is the two)
``save``      ``--save-n`` ranks (``swarmfd run``): ``swarmfd.torch.checkpoint.save``,
              timed from a barrier to its return (it returns once the index is written);
              then rank 0's ``get_state_dict(full=True)`` and ``save_file`` of it, with
              the extra peak RSS of rank 0 during the two (VmHWM, reset first)
``load``      ``--load-n`` ranks: ``checkpoint.load`` of that folder into a fresh sharded
              model, timed from a barrier to the last rank's return; the loaded model is
              checked against the saved one

A figure is the median over rounds; the verdicts are the ratios of the same run
(a sharded save and a load at another N at most 1.2x safetensors' own; the full state
dict's extra peak below one copy of the parameters plus one unit). Files go to
``--dir`` (a temporary folder by default, removed after); the page cache serves both.

    python benchmarks/checkpoint.py                           # N=4 saves, N=2 loads
    python benchmarks/checkpoint.py --save-n 2 --load-n 3 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _model(args: argparse.Namespace) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                 for _ in range(args.blocks)])


def _sharded(args: argparse.Namespace) -> Any:
    import swarmfd.torch as sft

    model = _model(args)
    for block in model:
        sft.fully_shard(block)
    return sft.fully_shard(model)


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """safetensors' own save_file and load_file of the whole state dict, one process."""
    import torch
    from safetensors.torch import load_file, save_file

    state = {k: v.contiguous() for k, v in _model(args).state_dict().items()}
    fresh = _model(args)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    path = Path(args.dir) / "baseline.safetensors"
    t0 = time.perf_counter()
    save_file(state, str(path))
    t1 = time.perf_counter()
    back = load_file(str(path))
    t2 = time.perf_counter()
    fresh.load_state_dict(back)
    t3 = time.perf_counter()
    assert all(fresh.state_dict()[k].equal(v) for k, v in state.items())
    return {"save_s": t1 - t0, "load_s": t3 - t1, "load_file_s": t2 - t1,
            "param_bytes": sum(v.numel() * v.element_size() for v in state.values())}


def _timed(fn: Any) -> float:
    """Seconds from a barrier to the last rank's return of ``fn()``."""
    import numpy as np

    import swarmfd as fd

    fd.barrier()
    t0 = time.perf_counter()
    fn()
    took = np.array([time.perf_counter() - t0])
    fd.all_reduce(took, op="max")
    return float(took[0])


def save_job(args: argparse.Namespace) -> dict[str, Any] | None:
    from safetensors.torch import save_file

    import swarmfd as fd
    import swarmfd.torch as sft
    from swarmfd.torch import fsdp

    fd.init_from_env()
    model = _sharded(args)
    folder = Path(args.dir) / "sharded"
    took = _timed(lambda: sft.checkpoint.save(folder, model))
    # The full state dict on rank 0, then one file of it: the extra peak RSS of rank 0.
    rss, _ = _rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    full, _ = sft.get_state_dict(model)
    if fd.get_rank() == 0:
        save_file(full, str(Path(args.dir) / "full.safetensors"))
    _, hwm = _rss()
    del full
    stats = fsdp.memory_stats(model)
    out = None
    if fd.get_rank() == 0:
        out = {"save_s": took, "full_extra_bytes": hwm - rss, "unit_bytes": stats["largest_unit"],
               "param_bytes": stats["unsharded_total"]}
    fd.cleanup()
    return out


def load_job(args: argparse.Namespace) -> dict[str, Any] | None:
    import torch

    import swarmfd as fd
    import swarmfd.torch as sft

    fd.init_from_env()
    torch.manual_seed(1)
    model = _sharded(args)  # (the same seed: its values are overwritten below)
    for p in model.parameters():
        with torch.no_grad():
            p.zero_()
    took = _timed(lambda: sft.checkpoint.load(Path(args.dir) / "sharded", model))
    got, _ = sft.get_state_dict(model)
    out = None
    if fd.get_rank() == 0:
        want = _model(args).state_dict()
        assert all(got[k].equal(v) for k, v in want.items()), "the load differs from the save"
        out = {"load_s": took}
    fd.cleanup()
    return out


def _job(args: argparse.Namespace, kind: str, n: int | None) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), kind, "--dir", args.dir,
            "--blocks", str(args.blocks), "--width", str(args.width)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if n is not None:
        env.pop("SWARMFD_SECRET_FILE", None)
        argv = [sys.executable, "-m", "swarmfd", "run", "-n", str(n), "--", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=args.job_timeout)
    for line in proc.stdout.splitlines():
        start = line.find("{")
        if start >= 0:
            try:
                return json.loads(line[start:])
            except ValueError:
                continue
    raise RuntimeError(f"{kind} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", nargs="?", default="drive",
                   choices=("drive", "baseline", "save", "load"))
    p.add_argument("--save-n", type=int, default=4)
    p.add_argument("--load-n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary one)")
    p.add_argument("--job-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.kind != "drive":
        import torch

        torch.set_num_threads(1)
        rec = {"baseline": baseline, "save": save_job, "load": load_job}[args.kind](args)
        if rec is not None:
            print(json.dumps(rec), flush=True)
        return 0
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="swarmfd-ckpt-bench-")
    try:
        return _drive(args)
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


def _drive(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "save": [], "load": []}
    for rnd in range(args.rounds):
        order = [("baseline", None), ("save", args.save_n), ("load", args.load_n)]
        if rnd % 2:  # (the load needs the save before it: the baseline moves)
            order = order[1:] + order[:1]
        for kind, n in order:
            rec = _job(args, kind, n)
            runs[kind].append(rec)
            print(f"round {rnd + 1}/{args.rounds} {kind:8s} {json.dumps(rec)} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    med = {f"{k}_{f}": statistics.median(r[f] for r in runs[k])
           for k, f in (("baseline", "save_s"), ("baseline", "load_s"), ("save", "save_s"),
                        ("load", "load_s"), ("save", "full_extra_bytes"))}
    save = runs["save"][0]
    bound = save["param_bytes"] + save["unit_bytes"]
    mb = save["param_bytes"] / 1e6
    verdicts = [
        (f"sharded save at N={args.save_n} / safetensors save_file", med["save_save_s"] /
         med["baseline_save_s"], 1.2),
        (f"sharded load at N={args.load_n} / safetensors load_file + load_state_dict",
         med["load_load_s"] /
         med["baseline_load_s"], 1.2),
        (f"full state dict + save_file on rank 0, extra peak RSS / (parameters {mb:.0f} MB + "
         f"one unit {save['unit_bytes'] / 1e6:.0f} MB)", med["save_full_extra_bytes"] / bound,
         1.0)]
    print(f"\n{args.blocks} x Linear({args.width}, {args.width}): {mb:.0f} MB of parameters; "
          f"medians of {args.rounds} rounds (s): save_file {med['baseline_save_s']:.3f}, "
          f"load_file {med['baseline_load_s']:.3f}, sharded save {med['save_save_s']:.3f}, "
          f"sharded load {med['load_load_s']:.3f}; full state dict extra peak "
          f"{med['save_full_extra_bytes'] / 1e6:.0f} MB")
    for what, ratio, limit in verdicts:
        print(f"- {'PASS' if ratio <= limit else 'MISS'}: {what} = {ratio:.2f} (<= {limit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
