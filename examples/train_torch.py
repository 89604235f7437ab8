#!/usr/bin/env python
"""Data-parallel PyTorch training with swarmfd.torch: handwritten digits, DDP or ZeRO.

A torch MLP (64 -> 128 -> 128 -> 10) learns scikit-learn's 8x8 handwritten digits
(``load_digits``: 1797 images that ship with the package, so nothing is downloaded)::

    pip install scikit-learn                  # or: pip install -e ".[examples]"
    python examples/train_torch.py            # a world of one
    swarmfd run -n 2 examples/train_torch.py  # two ranks, swarmfd DDP
    swarmfd run -n 2 examples/train_torch.py --zero   # + ZeroRedundancyOptimizer (Adam)
    swarmfd run -n 2 --max-restarts 1 examples/train_torch.py --fail-at-epoch 5 \\
        --checkpoint-dir /tmp/swarmfd-digits-ckpt     # crash, restart, resume
    swarmfd run -n 3 examples/train_torch.py --fsdp --epochs 10 --checkpoint-dir /tmp/ck
    swarmfd run -n 2 examples/train_torch.py --fsdp --resume --checkpoint-dir /tmp/ck

What it shows:

1. ``swarmfd.torch.DistributedDataParallel(model)``: the gradients are averaged over
   the ranks during ``backward()``, bucket by bucket.
2. ``--zero``: ``ZeroRedundancyOptimizer(params, torch.optim.Adam)``, each rank holding
   1/N of Adam's state; under DDP the gradients are reduce-scattered instead.
3. ``--batch-size`` is the *global* batch: each rank takes 1/N of every batch
   (``fd.shard_indices`` strides like torch's ``DistributedSampler``, so the N shards
   of step s together are exactly the batch one process would use), so N ranks
   follow the trajectory of one process up to float rounding and reach its accuracy.
   It must be a multiple of the number of ranks; the default, 96, divides by 1, 2, 3,
   4, 6 and 8.
4. Checkpoints (``--checkpoint-dir`` or ``$SWARMFD_CHECKPOINT_DIR``): rank 0 writes
   model and optimizer state (with ``--zero`` consolidated first) after every epoch;
   on a restart the rank with the newest file on its disk sends it to all
   (``broadcast_parameters``/``broadcast_optimizer_state``), and training goes on
   from the next epoch, ending where an uninterrupted run ends.

5. ``--fsdp``: ``fully_shard`` on each layer, then on the model: parameters, gradients
   and Adam's state sharded (``--bf16``: bfloat16 compute, float32 master weights);
   the checkpoints are sharded folders (``swarmfd.torch.checkpoint``), every rank
   writing its part, and a run at another world size resumes from them.

6. ``--elastic`` (under ``swarmfd run --elastic``): an elastic job (``fd.elastic``):
   the model and optimizer in a ``TorchState``, the data split by an
   ``ElasticSampler``, a commit every ``--commit-every`` steps. A rank lost (try
   ``--kill-at-step 40 --kill-at-step 120``: the last rank kills itself there) costs the
   others a re-formation and the steps since their last commit; its replacement joins
   at their next commit; the run ends at the accuracy of an undisturbed one::

       swarmfd run -n 4 --elastic examples/train_torch.py --elastic --kill-at-step 40

Exit code 0; 1 if the replicas differ or the accuracy is below ``--min-accuracy``;
3 for the simulated failure of ``--fail-at-epoch``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch

import swarmfd as fd
import swarmfd.torch as sft

CHECKPOINT_NAME = "digits_checkpoint.pt"
SHARDED_NAME = "digits_sharded"  # --fsdp: a folder of sharded checkpoints, one per epoch
#: The default global batch: a multiple of every world size up to 4 (and of 6 and 8).
BATCH = 96
ENV_CHECKPOINT_DIR = "SWARMFD_CHECKPOINT_DIR"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Digits with swarmfd.torch DDP (and ZeRO).")
    p.add_argument("--epochs", type=int, default=30, help="epochs (default 30)")
    p.add_argument("--batch-size", type=int, default=BATCH,
                   help=f"global batch (default {BATCH}), split evenly over the ranks: a "
                        "multiple of their number")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (1e-3)")
    p.add_argument("--hidden", type=int, default=128, help="hidden units (default 128)")
    p.add_argument("--zero", action="store_true",
                   help="shard Adam's state over the ranks (ZeroRedundancyOptimizer)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and Adam's state (fully_shard)")
    p.add_argument("--bf16", action="store_true",
                   help="with --fsdp: compute in bfloat16 (float32 master weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of split, init and shuffling")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help=f"where rank 0 keeps {CHECKPOINT_NAME} (default ${ENV_CHECKPOINT_DIR}; "
                        "neither: no checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the checkpoint (implied on a restart)")
    p.add_argument("--fail-at-epoch", type=int, default=0,
                   help="testing aid: the last rank exits with code 3 after saving epoch N, "
                        "on the first attempt only")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit 1 below this final test accuracy (default 0)")
    p.add_argument("--elastic", action="store_true",
                   help="an elastic job (run it with swarmfd run --elastic): lost ranks "
                        "cost a re-formation, replacements join at a commit")
    p.add_argument("--commit-every", type=int, default=10,
                   help="with --elastic: steps between commits (default 10)")
    p.add_argument("--kill-at-step", type=int, action="append", default=[],
                   help="testing aid, with --elastic: the last rank kills itself (SIGKILL) "
                        "right after the commit of this global step (a multiple of "
                        "--commit-every); repeatable")
    args = p.parse_args(argv)
    if args.checkpoint_dir is None and os.environ.get(ENV_CHECKPOINT_DIR):
        args.checkpoint_dir = Path(os.environ[ENV_CHECKPOINT_DIR])
    for name in ("epochs", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.elastic and args.fsdp:
        p.error("--elastic does not take --fsdp: sharded parameters are not carried across "
                "a re-formation (a loss under fully_shard ends the job)")
    return args


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    """The digits, scaled to [0, 1], split 80/20 by a seeded permutation (every rank alike)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("examples/train_torch.py needs scikit-learn: pip install scikit-learn "
                 "(or pip install -e '.[examples]')")
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.as_tensor(np.random.default_rng(seed).permutation(len(y)))
    n_train = int(0.8 * len(y))
    train, test = order[:n_train], order[n_train:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def make_sharded(hidden: int, bf16: bool) -> torch.nn.Module:
    """The model under fully_shard: a unit per layer, then the root (rank 0's values)."""
    policy = sft.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32) if bf16 else None
    model = make_model(hidden)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            sft.fully_shard(layer, mp_policy=policy)
    return sft.fully_shard(model, mp_policy=policy)


def save_sharded(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 next_epoch: int) -> None:
    """Every rank writes its part into folder/epoch-NNNN; rank 0 then drops older ones."""
    sft.checkpoint.save(folder / f"epoch-{next_epoch:04d}", model, opt)
    if fd.get_rank() == 0:
        for old in folder.glob("epoch-*"):
            if old.name < f"epoch-{next_epoch:04d}":
                shutil.rmtree(old, ignore_errors=True)


def restore_sharded(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """The newest complete folder (rank 0's choice), at whatever N it was saved; the
    next epoch."""
    done = sorted(p.name for p in folder.glob("epoch-*") if (p / "index.json").is_file())
    newest = fd.broadcast_object(done[-1] if done else "", src=0)
    if not newest:
        return 0
    sft.checkpoint.load(folder / newest, model, opt)
    return int(newest.split("-")[1])


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy over all ranks: each scores its share (no padding), summed."""
    xs, ys = fd.shard_batch(x), fd.shard_batch(y)
    with torch.no_grad():
        correct = float((model(xs).argmax(1) == ys).sum()) if len(ys) else 0.0
    counts = np.array([correct, len(ys)], dtype=np.float64)
    fd.all_reduce(counts)
    return counts[0] / counts[1]


def save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, zero: bool,
         next_epoch: int) -> None:
    """Rank 0 writes model + optimizer state atomically (ZeRO: consolidated first)."""
    if zero:
        opt.consolidate_state_dict(to=0)  # on every rank
    if fd.should_save():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"epoch": next_epoch, "model": model.state_dict(),
                    "optimizer": opt.state_dict()}, tmp)
        os.replace(tmp, path)
    fd.checkpoint_barrier()  # complete before anyone goes on (or fails)


def restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
            zero: bool) -> int:
    """The newest checkpoint any rank has on its disk, on every rank; the next epoch."""
    state = None
    if path.is_file():
        try:
            state = torch.load(path, weights_only=True)  # tensors and plain data only
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"checkpoint {path} unreadable ({exc}): ignored", file=sys.stderr)
    epoch = np.array([state["epoch"] if state else -1], dtype=np.int64)
    fd.all_reduce(epoch, op="max")
    if epoch[0] < 0:
        return 0
    holder = np.array([fd.get_rank() if state and state["epoch"] == epoch[0]
                       else fd.get_world_size()], dtype=np.int64)
    fd.all_reduce(holder, op="min")
    src = int(holder[0])
    if fd.get_rank() == src:
        model.load_state_dict(state["model"])
    sft.broadcast_parameters(model, src=src)
    # The full optimizer state, via a plain Adam on every rank (ZeRO then takes its part).
    full = torch.optim.Adam(model.parameters()) if zero else opt
    if fd.get_rank() == src:
        full.load_state_dict(state["optimizer"])
    sft.broadcast_optimizer_state(full, src=src)
    if zero:
        opt.load_state_dict(full.state_dict())
    return int(epoch[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank: the ranks share the cores
    cfg = fd.init_from_env()
    rank, world = cfg.rank, cfg.world_size
    if args.batch_size % world:
        lower = args.batch_size - args.batch_size % world
        upper = lower + world
        fd.print(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks "
                 f"(the global batch is split evenly over them): use "
                 f"{f'{lower} or ' if lower else ''}{upper}")
        return 2
    x_train, y_train, x_test, y_test = load_data(args.seed)
    torch.manual_seed(args.seed + 1 + rank)  # different on purpose: DDP broadcasts rank 0's
    if args.fsdp:
        model = make_sharded(args.hidden, args.bf16)
    else:
        model = sft.DistributedDataParallel(make_model(args.hidden))
    if args.zero and not args.fsdp:
        opt: torch.optim.Optimizer = sft.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, lr=args.lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    how = "fully_shard, Adam" if args.fsdp else \
        "ZeroRedundancyOptimizer(Adam)" if args.zero else "Adam"
    fd.print(f"{world} rank(s), {how}, "
             f"global batch {args.batch_size} ({args.batch_size // world} per rank), "
             f"{len(y_train)} train / {len(y_test)} test digits")

    if args.elastic:
        acc = train_elastic(args, model, opt, x_train, y_train, x_test, y_test)
        return report(args, model, acc, len(y_test))
    ckpt = args.checkpoint_dir / (SHARDED_NAME if args.fsdp else CHECKPOINT_NAME) \
        if args.checkpoint_dir else None
    fd.print(f"checkpoints: {ckpt}" if ckpt else
             "checkpoints: off (--checkpoint-dir or SWARMFD_CHECKPOINT_DIR)")
    start = 0
    if ckpt is not None and (args.resume or cfg.restart_count > 0):
        start = restore_sharded(ckpt, model, opt) if args.fsdp else \
            restore(ckpt, model, opt, args.zero)
        fd.print(f"resumed at epoch {start}/{args.epochs}" if start else "no checkpoint found")

    per_rank = args.batch_size // world
    steps = len(y_train) // args.batch_size  # full global batches only, at every N alike
    acc = 0.0
    for epoch in range(start, args.epochs):
        model.train()
        order = torch.as_tensor(fd.shard_indices(len(y_train), shuffle=True, seed=args.seed,
                                                 epoch=epoch))
        total = torch.zeros(2, dtype=torch.float64)
        for s in range(steps):
            batch = order[s * per_rank:(s + 1) * per_rank]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()  # averaged over the ranks when this returns
            opt.step()
            total += torch.tensor([loss.item() * len(batch), len(batch)], dtype=torch.float64)
        sft.all_reduce(total)
        model.eval()
        acc = accuracy(model, x_test, y_test)
        fd.print(f"epoch {epoch + 1:3d}/{args.epochs}  train loss {total[0] / total[1]:.4f}  "
                 f"test acc {acc:.4f}")
        if ckpt is not None and args.fsdp:
            save_sharded(ckpt, model, opt, epoch + 1)
        elif ckpt is not None:
            save(ckpt, model, opt, args.zero, epoch + 1)
        if (epoch + 1 == args.fail_at_epoch and cfg.restart_count == 0
                and rank == world - 1):
            print(f"rank {rank}: simulated failure after epoch {epoch + 1}", file=sys.stderr,
                  flush=True)
            return 3
    if start >= args.epochs:
        acc = accuracy(model, x_test, y_test)
    return report(args, model, acc, len(y_test))


def report(args: argparse.Namespace, model: torch.nn.Module, acc: float, tested: int) -> int:
    """Print the accuracy and whether every replica is the same; the exit code."""
    world = fd.get_world_size()
    if args.fsdp:  # each rank holds its shards: the whole model, gathered on rank 0
        whole, _ = sft.get_state_dict(model)
        flat = torch.cat([v.reshape(-1) for v in whole.values()]) if whole else \
            torch.zeros(0)
        same = True
    else:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = fd.all_gather(flat.numpy())
        same = all((r == rows[0]).all() for r in rows)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    fd.print(f"final test accuracy: {acc:.4f} ({tested} test digits)")
    fd.print(f"params sharded over {world} rank(s) (checksum of the whole {digest})"
             if args.fsdp else f"params identical on all {world} ranks: "
             f"{'OK' if same else 'NO'} (checksum {digest})")
    if not same or acc < args.min_accuracy:
        return 1
    return 0


def train_elastic(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
                  x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor,
                  y_test: torch.Tensor) -> float:
    """The epochs as an elastic job (6. in the module docstring); the final accuracy."""
    sampler = sft.elastic.ElasticSampler(len(y_train), shuffle=True, seed=args.seed)
    state = sft.elastic.TorchState(model, opt, sampler=sampler, epoch=0, steps=0, killed=[])

    @fd.elastic.run
    def train(state: sft.elastic.TorchState) -> float:
        for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 (kept in the state)
            model.train()
            per_rank = -(-args.batch_size // fd.get_world_size())  # the world may change
            for batch in state.sampler.batches(per_rank):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x_train[batch]),
                                                  y_train[batch]).backward()
                opt.step()
                state.sampler.record_batch(state.steps, per_rank)
                state.steps += 1
                if state.steps % args.commit_every == 0:
                    kill = state.steps in args.kill_at_step and state.steps not in state.killed
                    if kill:
                        state.killed.append(state.steps)  # (committed: never twice)
                    state.commit()
                    if kill and fd.get_rank() == fd.get_world_size() - 1:
                        print(f"rank {fd.get_rank()}: killed at step {state.steps} (testing "
                              "aid)", file=sys.stderr, flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)
            model.eval()
            acc = accuracy(model, x_test, y_test)
            fd.print(f"epoch {state.epoch + 1:3d}/{args.epochs}  test acc {acc:.4f}  "
                     f"({fd.get_world_size()} ranks)")
            state.sampler.set_epoch(state.epoch + 1)
        return accuracy(model, x_test, y_test)

    return train(state)


if __name__ == "__main__":
    code = main()
    fd.cleanup()
    sys.exit(code)
