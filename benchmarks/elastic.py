#!/usr/bin/env python3
"""What a lost rank costs an elastic job, beside torchrun's whole-group restart.

The job: benchmarks/train.py's MLP (3.4 M parameters), batch 64 per rank, SGD with
momentum, one thread per rank, N ranks on loopback (shared memory), a commit every
``--commit-every`` steps. Figures:

``recovery``  at step ``--kill-step`` the rank at one position (first, middle, last)
              kills itself (SIGKILL, its time taken just before). Measured from that
              instant (CLOCK_MONOTONIC, the same in every process): when every survivor
              completed its first step after the loss (``survivors``), and when the
              restarted rank completed its first step in the re-formed world
              (``restarted``). Elastic: ``swarmfd run --elastic``. Baseline
              (``--baseline``): the same job restarted as a whole group, from a
              checkpoint file written every ``--commit-every`` steps and loaded on the
              restart, so both figures are the restarted group's first step:
              ``max-restarts`` (the default), swarmfd's DDP under ``swarmfd run
              --max-restarts 1``; ``torchrun``, torch's DDP over gloo under ``torchrun
              --standalone --max-restarts 1`` (with torch 2.13.0 here, its restarted
              group failed every time in gloo's connectFullMesh: "Connection refused").
``commit``    the cost of the commits: in each job, blocks of ``--block`` steps take
              turns: with a commit every ``--commit-every`` steps, and without (twice:
              the A/A control shows the noise), so the variants share the processes and
              the machine's moment (separate jobs differ more than the commits cost); a
              job's figure is its slowest rank's mean step (commits included), a
              variant's the median over ``--rounds`` jobs.
``accuracy``  ``examples/train_torch.py --elastic`` on N ranks, undisturbed and with two
              kills (``--kill-at-step``), final test accuracy.

    python benchmarks/elastic.py                  # everything, N=4, 5 rounds
    python benchmarks/elastic.py --only recovery --rounds 3

Prints a Markdown report and writes it to ``benchmarks/out/elastic-<time>.md``. The
machine's load is printed beside it: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
POSITIONS = ("first", "middle", "last")
#: The commit figure's variants: with commits, and twice without (the A/A control).
VARIANTS = ("commit", "plain-a", "plain-b")


# -- a rank -----------------------------------------------------------------------------------


def _event(args: argparse.Namespace, **what: Any) -> None:
    with open(Path(args.events) / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"t": time.monotonic(), **what}) + "\n")


def _victim(args: argparse.Namespace, rank: int, world: int, step: int) -> bool:
    """The rank at ``--position`` at ``--kill-step``, the first time the job gets there."""
    if args.kill_step <= 0 or step != args.kill_step:
        return False
    where = {"first": 0, "last": world - 1, "middle": world // 2}[args.position]
    marker = Path(args.events) / "killed"
    if rank != where or marker.exists():
        return False
    marker.touch()
    return True


def elastic_worker(args: argparse.Namespace) -> None:
    """One rank of the elastic job (``swarmfd run --elastic``)."""
    import torch
    from train import BATCH, IN, OUT, _model

    import swarmfd as fd
    import swarmfd.torch as sft

    torch.set_num_threads(1)
    fd.init_from_env()
    torch.manual_seed(0)
    model = sft.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,))
    state = sft.elastic.TorchState(model, opt, step=0)
    times: list[float] = []
    blocks: dict[str, list[float]] = {v: [] for v in VARIANTS}

    @fd.elastic.run
    def train(state: Any) -> None:
        first = True
        while state.step < args.steps:
            variant = VARIANTS[(state.step // args.block) % len(VARIANTS)] if args.block \
                else "commit"
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            if variant == "commit" and args.commit_every and \
                    state.step % args.commit_every == 0:
                state.commit()
            times.append(time.perf_counter() - t0)
            if state.step > args.warmup:
                blocks[variant].append(times[-1])
            if first:
                _event(args, kind="step", gen=fd.session.elastic_state().world.gen,
                       join=bool(os.environ.get("SWARMFD_ELASTIC_JOIN")))
                first = False
            if _victim(args, fd.get_rank(), fd.get_world_size(), state.step):
                _event(args, kind="kill")
                os.kill(os.getpid(), signal.SIGKILL)

    train(state)
    timed = times[args.warmup:]
    if args.block:
        print(json.dumps({v: 1e3 * statistics.fmean(t) for v, t in blocks.items()}),
              flush=True)
    elif timed:
        print(json.dumps({"mean_ms": 1e3 * statistics.fmean(timed)}), flush=True)
    fd.cleanup()


def restart_worker(args: argparse.Namespace) -> None:
    """One rank of the baseline: DDP (torch's over gloo under torchrun, swarmfd's under
    ``swarmfd run --max-restarts``), a checkpoint every ``--commit-every`` steps, resumed
    after the whole group was restarted."""
    import torch
    from train import BATCH, IN, OUT, _model

    torch.set_num_threads(1)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model: Any = torch.nn.parallel.DistributedDataParallel(_model())
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    else:
        import swarmfd as fd
        import swarmfd.torch as sft

        cfg = fd.init_from_env()
        rank, world, attempt = cfg.rank, cfg.world_size, cfg.restart_count
        model = sft.DistributedDataParallel(_model())
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    ckpt = Path(args.events) / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    x, y = torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,))
    first = True
    while step < args.steps:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step % args.commit_every == 0 and rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, ckpt)
        if first:
            _event(args, kind="step", gen=attempt, join=False)
            first = False
        if _victim(args, rank, world, step):
            _event(args, kind="kill")
            os.kill(os.getpid(), signal.SIGKILL)


# -- the measurements ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("SWARMFD_SECRET_FILE", None)
    return env


def _job(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... exit {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def _me(args: argparse.Namespace, worker: str, **extra: Any) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), worker, "--steps", str(args.steps),
            "--commit-every", str(args.commit_every), "--warmup", str(args.warmup)]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def recovery(args: argparse.Namespace, system: str, position: str) -> dict[str, float]:
    """One kill: (survivors, restarted) seconds after it (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="swarmfd-elastic-bench-") as events:
        extra = {"kill_step": args.kill_step, "position": position, "events": events}
        if system == "elastic":
            _job([sys.executable, "-m", "swarmfd", "run", "-n", str(args.n), "--elastic",
                  "--", *_me(args, "elastic-worker", **extra)], args.job_timeout)
        elif system == "torchrun":
            _job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(args.n), "--max-restarts", "1",
                  "--monitor-interval", "0.1", *_me(args, "restart-worker", **extra)[1:]],
                 args.job_timeout)
        else:
            _job([sys.executable, "-m", "swarmfd", "run", "-n", str(args.n), "--max-restarts",
                  "1", "--", *_me(args, "restart-worker", **extra)], args.job_timeout)
        per_process = [[json.loads(line) for line in p.read_text().splitlines()]
                       for p in Path(events).glob("*.jsonl")]
    kill = next(r["t"] for rs in per_process for r in rs if r["kind"] == "kill")
    # Each process's first step after the kill (later ones follow a replacement's join).
    first = [next((r for r in rs if r["kind"] == "step" and r["t"] > kill), None)
             for rs in per_process]
    after = [r for r in first if r is not None]
    survivors = [r["t"] for r in after if not r["join"]]
    joined = [r["t"] for r in after if r["join"]] or survivors
    return {"survivors": max(survivors) - kill if survivors else float("nan"),
            "restarted": min(joined) - kill if joined else float("nan")}


def commit_cost(args: argparse.Namespace) -> dict[str, list[float]]:
    """Jobs whose steps run in blocks of ``--block`` steps that take turns: with commits
    every ``--commit-every`` steps, and twice without (the A/A control), so the three
    share the processes, their placement and the machine's moment; a job's figure per
    variant is its slowest rank's mean step (commits included), a variant's the median
    over the jobs."""
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    block = args.block or 2 * args.commit_every
    steps = args.warmup + 3 * block * max(1, args.steps // (3 * block))
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as events:
            argv = _me(args, "elastic-worker", events=events, block=block)
            argv[argv.index("--steps") + 1] = str(steps)
            proc = _job([sys.executable, "-m", "swarmfd", "run", "-n", str(args.n),
                         "--elastic", "--", *argv], args.job_timeout)
        ranks = [json.loads(m) for m in re.findall(r"\{.*\}", proc.stdout)]
        for v in VARIANTS:
            out[v].append(max(r[v] for r in ranks))
    return out


def accuracy(args: argparse.Namespace, kills: list[int]) -> float:
    argv = [sys.executable, "-m", "swarmfd", "run", "-n", str(args.n), "--elastic", "--",
            sys.executable, "examples/train_torch.py", "--elastic"]
    for k in kills:
        argv += ["--kill-at-step", str(k)]
    proc = _job(argv, args.job_timeout)
    found = re.findall(r"final test accuracy: ([0-9.]+)", proc.stdout)
    return float(found[-1])


def report(args: argparse.Namespace, rec: dict[str, Any], cost: dict[str, list[float]],
           acc: dict[str, float]) -> str:
    lines = [f"# Elastic: N={args.n}, loopback, commit every {args.commit_every} steps",
             "", f"load average at the start: {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} cores (a shared machine moves these figures)", ""]
    if rec:
        lines += ["| kill of | system | survivors' first step (s) | restarted rank's first "
                  "step (s) |", "| --- | --- | --- | --- |"]
        for (system, position), runs in sorted(rec.items()):
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            spread = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}
            lines.append(f"| {position} | {system} | {med['survivors']:.2f} "
                         f"({spread['survivors'][0]:.2f}-{spread['survivors'][1]:.2f}) | "
                         f"{med['restarted']:.2f} ({spread['restarted'][0]:.2f}-"
                         f"{spread['restarted'][1]:.2f}) |")
        lines.append("")
    if cost:
        med = {v: statistics.median(x) for v, x in cost.items()}
        lines += [f"commits: mean step {med['commit']:.1f} ms with, {med['plain-a']:.1f} / "
                  f"{med['plain-b']:.1f} ms without (A/A); cost "
                  f"{100 * (med['commit'] / med['plain-a'] - 1):+.1f} %, A/A "
                  f"{100 * (med['plain-b'] / med['plain-a'] - 1):+.1f} % "
                  f"(blocks of each interleaved in {args.rounds} jobs, medians)", ""]
    if acc:
        lines += [f"accuracy (examples/train_torch.py --elastic): undisturbed "
                  f"{acc['undisturbed']:.4f}, two kills {acc['two kills']:.4f}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="measure",
                   choices=("measure", "elastic-worker", "restart-worker"))
    p.add_argument("--baseline", choices=("max-restarts", "torchrun"),
                   default="max-restarts")
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--block", type=int, default=0,
                   help="commit figure: steps per block of a variant (default 2 commits)")
    p.add_argument("--kill-step", type=int, default=45)
    p.add_argument("--position", choices=POSITIONS, default="last")
    p.add_argument("--events", default="")
    p.add_argument("--only", choices=("recovery", "commit", "accuracy"), action="append")
    p.add_argument("--job-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.mode == "elastic-worker":
        elastic_worker(args)
        return 0
    if args.mode == "restart-worker":
        restart_worker(args)
        return 0
    only = set(args.only or ("recovery", "commit", "accuracy"))
    rec: dict[tuple[str, str], list[dict[str, float]]] = {}
    if "recovery" in only:
        for _ in range(args.rounds):
            for position in POSITIONS:
                for system in ("elastic", args.baseline):
                    rec.setdefault((system, position), []).append(
                        recovery(args, system, position))
    cost = commit_cost(args) if "commit" in only else {}
    acc = {"undisturbed": accuracy(args, []), "two kills": accuracy(args, [40, 120])} \
        if "accuracy" in only else {}
    text = report(args, rec, cost, acc)
    print(text)
    out = HERE / "out" / time.strftime("elastic-%Y%m%d-%H%M%S.md")
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
