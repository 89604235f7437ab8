"""Data-parallel torch training with swarmfd: the project of docs/swarm.md, "Your own code".

Every rank builds the same regression data set from one seed, trains on its own share
of each epoch, averages the gradients across the ranks after every backward pass, and
checkpoints into $SWARMFD_CHECKPOINT_DIR when that is set (swarmfd deploy
--checkpoint-volume sets it), resuming there after a restart.
"""

import os
import sys
from pathlib import Path

import torch

import swarmfd as fd

EPOCHS = int(os.environ.get("EPOCHS", "10"))
FAIL_AT_EPOCH = int(os.environ.get("FAIL_AT_EPOCH", "0"))  # testing aid: see the end of an epoch

torch.set_num_threads(1)  # one thread per rank, torchrun's default: ranks share the cores
cfg = fd.init_from_env()
torch.manual_seed(0)  # the same data on every rank
x = torch.randn(2048, 16)
y = x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1)

torch.manual_seed(fd.get_seed(1))  # another start on every rank: the broadcast makes them equal
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
params = [p.detach() for p in model.parameters()]
fd.broadcast(params, src=0)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

ckpt_dir = os.environ.get("SWARMFD_CHECKPOINT_DIR")
ckpt = Path(ckpt_dir) / "torch_checkpoint.pt" if ckpt_dir else None
start = torch.zeros(1, dtype=torch.int64)  # the epoch to begin with: rank 0 decides
if ckpt is not None and cfg.restart_count > 0 and fd.should_save() and ckpt.is_file():
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    start[0] = state["epoch"]
fd.broadcast(start, src=0)
fd.broadcast(params, src=0)  # rank 0's (possibly restored) weights everywhere
if start.item():
    fd.print(f"resumed from {ckpt} at epoch {start.item()} (restart {cfg.restart_count})")

for epoch in range(start.item(), EPOCHS):
    order = torch.as_tensor(fd.shard_indices(len(x), shuffle=True, seed=0, epoch=epoch))
    for batch in order.split(64):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        fd.all_reduce_mean([p.grad for p in model.parameters()])  # one fused collective
        opt.step()
    fd.print(f"epoch {epoch + 1}/{EPOCHS}  loss {loss.item():.4f}")
    if ckpt is not None and fd.should_save():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"epoch": epoch + 1, "model": model.state_dict()}, ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
    fd.checkpoint_barrier()  # the checkpoint is complete before anyone goes on (or fails)
    if epoch + 1 == FAIL_AT_EPOCH and cfg.restart_count == 0 and cfg.rank == cfg.world_size - 1:
        sys.exit(f"rank {cfg.rank}: simulated failure after epoch {epoch + 1}")

flat = torch.cat([p.detach().ravel() for p in model.parameters()]).numpy()
same = all((other == flat).all() for other in fd.all_gather(flat))
fd.print(f"params identical on all {cfg.world_size} ranks: {'OK' if same else 'FAIL'}")
fd.cleanup()
sys.exit(0 if same else 1)
