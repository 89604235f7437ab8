#!/usr/bin/env python
"""Data-parallel training of a small numpy MLP with swarmfd: every layer, end to end.

Run it as a world of one, on N local processes, or on a Docker Swarm::

    python examples/train.py
    swarmfd run -n 2 examples/train.py --epochs 40
    swarmfd run -n 2 --max-restarts 1 examples/train.py --fail-at-epoch 5 \
        --checkpoint-dir /tmp/swarmfd-train-ckpt

What happens, and which swarmfd call does it:

1. ``fd.init_from_env()`` joins the group the launcher describes (none: a world of one).
2. Every rank generates the same dataset from ``--seed`` (a noisy 3-class spiral in 2-D,
   split 80/20 into train and test), so no data has to be shipped around.
3. Each rank initialises the weights from its own seed (``fd.get_seed``), then
   ``fd.broadcast`` overwrites them with rank 0's: all ranks start from the same model.
   (Or, on a restart, rank 0 loads the last checkpoint and broadcasts that.)
4. Each epoch, ``fd.shard_indices(..., shuffle=True, epoch=epoch)`` gives every rank a
   disjoint share of the training set, of equal length on every rank, so all ranks run
   the same number of steps.
5. Each micro-batch's gradients go into ``fd.GradAccum``; every ``--accum-steps``
   micro-steps their mean is averaged across ranks with one fused ``fd.all_reduce_mean``
   over the list of gradient arrays, and every rank applies the same momentum-SGD update.
6. Loss and accuracy are summed across ranks with ``fd.all_reduce``; the test set is
   split with ``fd.shard_batch``; ``fd.print`` reports once, from rank 0.
7. After each epoch rank 0 saves a checkpoint between two ``fd.checkpoint_barrier()``
   calls, written to a temporary file and renamed, so a crash never leaves half a file,
   into ``--checkpoint-dir`` or ``$SWARMFD_CHECKPOINT_DIR`` (``swarmfd deploy
   --checkpoint-volume`` sets it); with neither, nothing is saved (and it says so).
   On a restart, each rank looks for the checkpoint on its own disk and the one with
   the newest sends it to all: with a volume per node, the ranks that landed on rank
   0's former node have it.
8. At the end ``fd.all_gather`` collects every rank's parameters and checks they are
   bit-identical: data parallelism must never let the replicas drift apart.

Exit code 0 on success; 1 when the replicas differ or the test accuracy is below
``--min-accuracy``; 3 for the simulated failure of ``--fail-at-epoch``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

import swarmfd as fd

CLASSES = 3
CHECKPOINT_NAME = "train_checkpoint.npz"
ENV_CHECKPOINT_DIR = "SWARMFD_CHECKPOINT_DIR"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Data-parallel training of a numpy MLP on a 3-class spiral with swarmfd.",
    )
    p.add_argument("--epochs", type=int, default=40, help="epochs to train (default 40)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="micro-batch size per rank (default 32); the effective batch is "
                        "batch-size x accum-steps x world size")
    p.add_argument("--accum-steps", type=int, default=2,
                   help="micro-batches accumulated per update (default 2)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units per layer (default 64)")
    p.add_argument("--samples", type=int, default=3000,
                   help="dataset size, split 80/20 train/test (default 3000)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, init and shuffling")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help=f"where rank 0 keeps {CHECKPOINT_NAME} (default ${ENV_CHECKPOINT_DIR}; "
                        "with neither, no checkpoints are written)")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="save every N epochs; 0 disables checkpoints (default 1)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the checkpoint (implied on a restart, when "
                        "SWARMFD_RESTART_COUNT > 0)")
    p.add_argument("--fail-at-epoch", type=int, default=0,
                   help="testing aid: after saving epoch N, rank --fail-rank exits with code 3, "
                        "on the first attempt only (SWARMFD_RESTART_COUNT=0)")
    p.add_argument("--fail-rank", type=int, default=-1,
                   help="rank that fails for --fail-at-epoch (default: the last rank)")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit 1 if the final test accuracy is below this (default 0: no check)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "accum_steps", "hidden", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("seed", "checkpoint_every", "fail_at_epoch"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.checkpoint_dir is None and os.environ.get(ENV_CHECKPOINT_DIR):
        args.checkpoint_dir = Path(os.environ[ENV_CHECKPOINT_DIR])
    if args.samples < 10:
        p.error(f"--samples must be >= 10 (a train and a test set), got {args.samples}")
    if not args.lr > 0 or not 0 <= args.momentum < 1:
        p.error("--lr must be > 0 and --momentum in [0, 1)")
    return args


# --- data and model -------------------------------------------------------------------


def make_spiral(n_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A noisy 3-arm spiral: points (float32, shape (n, 2)) and labels (int64, shape (n,)).

    Arms of 1.25 turns with Gaussian angular noise: not linearly separable, so the
    MLP has something to learn, yet nearly separable, so a good run scores > 95%.
    Deterministic in ``seed``: every rank builds the identical dataset.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n_samples)
    radius = rng.uniform(0.05, 1.0, n_samples)
    angle = (radius * 1.25 * 2 * np.pi + 2 * np.pi * labels / CLASSES
             + rng.normal(0.0, 0.3, n_samples))
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return points.astype(np.float32), labels.astype(np.int64)


def init_params(rng: np.random.Generator, hidden: int) -> list[np.ndarray]:
    """He-initialised weights of a 2 -> hidden -> hidden -> 3 ReLU MLP: [W1, b1, W2, b2, W3, b3]."""
    shapes = [(2, hidden), (hidden, hidden), (hidden, CLASSES)]
    params = []
    for fan_in, fan_out in shapes:
        params.append(rng.normal(0.0, np.sqrt(2.0 / fan_in), (fan_in, fan_out)).astype(np.float32))
        params.append(np.zeros(fan_out, dtype=np.float32))
    return params


def forward(params: list[np.ndarray], x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Logits of the MLP and the hidden activations the backward pass needs."""
    w1, b1, w2, b2, w3, b3 = params
    h1 = np.maximum(x @ w1 + b1, 0.0)
    h2 = np.maximum(h1 @ w2 + b2, 0.0)
    return [h1, h2], h2 @ w3 + b3


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample cross-entropy losses and the softmax probabilities."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    probs = exp / exp.sum(axis=1, keepdims=True)
    losses = np.log(exp.sum(axis=1)) - shifted[np.arange(len(y)), y]
    return losses, probs


def loss_and_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                   grads: list[np.ndarray]) -> tuple[float, int]:
    """Backpropagate the mean loss of a micro-batch into ``grads`` (in place).

    Returns the summed loss and the number of correct predictions (for reporting).
    """
    _, _, w2, _, w3, _ = params
    (h1, h2), logits = forward(params, x)
    losses, probs = softmax_xent(logits, y)
    d = probs
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    np.matmul(h2.T, d, out=grads[4])
    np.sum(d, axis=0, out=grads[5])
    dh2 = (d @ w3.T) * (h2 > 0)
    np.matmul(h1.T, dh2, out=grads[2])
    np.sum(dh2, axis=0, out=grads[3])
    dh1 = (dh2 @ w2.T) * (h1 > 0)
    np.matmul(x.T, dh1, out=grads[0])
    np.sum(dh1, axis=0, out=grads[1])
    return float(losses.sum()), int((logits.argmax(axis=1) == y).sum())


def evaluate(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """Summed loss and number of correct predictions on (x, y)."""
    if len(y) == 0:
        return 0.0, 0
    _, logits = forward(params, x)
    losses, _ = softmax_xent(logits, y)
    return float(losses.sum()), int((logits.argmax(axis=1) == y).sum())


# --- checkpoints ------------------------------------------------------------------------


def save_checkpoint(path: Path, params: list[np.ndarray], velocity: list[np.ndarray],
                    next_epoch: int) -> None:
    """Write the training state atomically: a temporary file, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    arrays = {f"param{i}": p for i, p in enumerate(params)}
    arrays.update({f"velocity{i}": v for i, v in enumerate(velocity)})
    np.savez(tmp, next_epoch=np.int64(next_epoch), **arrays)
    os.replace(tmp, path)


def restore(path: Path, params: list[np.ndarray],
            velocity: list[np.ndarray]) -> tuple[int, int]:
    """Load the newest checkpoint any rank can see; every rank gets it.

    Each rank looks at ``path`` on its own disk (on a Swarm the ranks may not share one:
    a volume per node holds what the rank 0 of the failed attempt wrote on its node).
    The rank with the newest usable checkpoint (the lowest such rank on a tie)
    broadcasts the state. Returns (the epoch to continue from, the rank that had it);
    (0, -1) to start fresh when no rank has a usable checkpoint.
    """
    next_epoch = -1
    if path.is_file():
        try:
            with np.load(path) as ckpt:
                loaded = [ckpt[f"param{i}"] for i in range(len(params))]
                loaded += [ckpt[f"velocity{i}"] for i in range(len(velocity))]
                next_epoch = int(ckpt["next_epoch"])
            if all(a.shape == b.shape for a, b in zip(loaded, params + velocity, strict=True)):
                for dst, src in zip(params + velocity, loaded, strict=True):
                    dst[...] = src
            else:
                print(f"checkpoint {path} has other shapes (another --hidden?): ignored",
                      file=sys.stderr, flush=True)
                next_epoch = -1
        except (OSError, KeyError, ValueError) as exc:
            print(f"checkpoint {path} is unreadable ({exc}): ignored",
                  file=sys.stderr, flush=True)
            next_epoch = -1
    rank, world = fd.get_rank(), fd.get_world_size()
    newest = np.array([next_epoch], dtype=np.int64)
    fd.all_reduce(newest, op="max")
    if newest[0] < 0:
        return 0, -1
    holder = np.array([rank if next_epoch == newest[0] else world], dtype=np.int64)
    fd.all_reduce(holder, op="min")
    src = int(holder[0])
    fd.broadcast(params + velocity, src=src)
    return int(newest[0]), src


def checksum(flat: np.ndarray) -> str:
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


# --- training ---------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    cfg = fd.get_config()
    rank, world = cfg.rank, cfg.world_size
    fd.print_config()

    x, y = make_spiral(args.samples, args.seed)
    n_train = int(0.8 * len(y))
    x_train, y_train, x_test, y_test = x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    # Different on every rank on purpose: the broadcast below is what makes them equal.
    params = init_params(np.random.default_rng(fd.get_seed(args.seed)), args.hidden)
    fd.broadcast(params, src=0)
    velocity = [np.zeros_like(p) for p in params]
    grads = [np.zeros_like(p) for p in params]
    accum = fd.GradAccum(grads, args.accum_steps)

    ckpt_path = args.checkpoint_dir / CHECKPOINT_NAME if args.checkpoint_dir else None
    saving = ckpt_path is not None and args.checkpoint_every > 0
    if saving:
        fd.print(f"checkpoints: {ckpt_path} every {args.checkpoint_every} epoch(s), by rank 0")
    else:
        fd.print("checkpoints: off (--checkpoint-dir DIR or SWARMFD_CHECKPOINT_DIR to save and "
                 "resume)" if ckpt_path is None else "checkpoints: off (--checkpoint-every 0)")
    start_epoch = 0
    if args.resume or cfg.restart_count > 0:
        if ckpt_path is None:
            fd.print("no checkpoint directory (--checkpoint-dir or SWARMFD_CHECKPOINT_DIR): "
                     "starting from scratch")
        else:
            start_epoch, holder = restore(ckpt_path, params, velocity)
            if start_epoch:
                fd.print(f"resumed from {ckpt_path} at epoch {start_epoch}/{args.epochs} "
                         f"(restart {cfg.restart_count}; rank {holder}'s copy)")
            else:
                fd.print(f"no usable checkpoint at {ckpt_path}: starting from scratch")

    def update() -> None:
        fd.all_reduce_mean(accum.finish(grads))  # one fused collective for all gradients
        for p, v, g in zip(params, velocity, grads, strict=True):
            v *= args.momentum
            v += g
            p -= args.lr * v

    # The test set is split without padding, so every test point is counted exactly once.
    x_test_part = fd.shard_batch(x_test)
    y_test_part = fd.shard_batch(y_test)
    fail_rank = args.fail_rank if args.fail_rank >= 0 else world - 1
    samples_seen = 0
    test_acc = 0.0
    for epoch in range(start_epoch, args.epochs):
        order = fd.shard_indices(n_train, shuffle=True, seed=args.seed, epoch=epoch)
        train_loss = train_correct = 0.0
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            loss, correct = loss_and_grads(params, x_train[batch], y_train[batch], grads)
            train_loss += loss
            train_correct += correct
            accum.step(grads)
            if accum.should_step():
                update()
        if accum.count:  # a last, shorter cycle; same on every rank (equal shard lengths)
            update()
        samples_seen += len(order)

        test_loss, test_correct = evaluate(params, x_test_part, y_test_part)
        stats = np.array([train_loss, train_correct, len(order),
                          test_loss, test_correct, len(y_test_part)], dtype=np.float64)
        fd.all_reduce(stats)  # sums over ranks
        test_acc = stats[4] / stats[5]
        fd.print(f"epoch {epoch + 1:3d}/{args.epochs}  train loss {stats[0] / stats[2]:.4f} "
                 f"acc {stats[1] / stats[2]:.4f}  test loss {stats[3] / stats[5]:.4f} "
                 f"acc {test_acc:.4f}")

        if saving and (epoch + 1) % args.checkpoint_every == 0:
            fd.checkpoint_barrier()  # every rank is done with this epoch's updates
            if fd.should_save():
                assert ckpt_path is not None
                save_checkpoint(ckpt_path, params, velocity, epoch + 1)
            fd.checkpoint_barrier()  # the file is complete before anyone goes on (or fails)

        if (epoch + 1 == args.fail_at_epoch and cfg.restart_count == 0
                and rank == fail_rank):
            print(f"rank {rank}: simulated failure after epoch {epoch + 1}",
                  file=sys.stderr, flush=True)
            return 3

    if start_epoch >= args.epochs:  # resumed after the last epoch: evaluate only
        test_loss, test_correct = evaluate(params, x_test_part, y_test_part)
        stats = np.array([test_correct, len(y_test_part)], dtype=np.float64)
        fd.all_reduce(stats)
        test_acc = stats[0] / stats[1]

    print(f"rank {rank}: trained on {samples_seen} samples", flush=True)

    flat = np.concatenate([p.ravel() for p in params])
    gathered = fd.all_gather(flat)
    differing = [r for r, other in enumerate(gathered) if not np.array_equal(other, flat)]
    fd.print(f"final test accuracy: {test_acc:.4f} ({len(y_test)} test samples)")
    if differing:
        print(f"rank {rank}: params differ from rank(s) {differing}: FAIL "
              f"(checksum {checksum(flat)})", file=sys.stderr, flush=True)
        return 1
    fd.print(f"params identical on all {world} ranks: OK (checksum {checksum(flat)})")
    if test_acc < args.min_accuracy:
        fd.print(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fd.init_from_env()
    try:
        return train(args)
    finally:
        fd.cleanup()


if __name__ == "__main__":
    sys.exit(main())
