"""An elastic torch job for tests/test_elastic_torch.py: DDP over a small MLP, with SGD
(momentum) or, ``ZERO=1``, a ZeroRedundancyOptimizer of Adam, a TorchState, and the
torch ElasticSampler in a DataLoader.

The function checks what a change of the world must keep: each time it starts, the
optimizer's whole state (consolidated) must be the one the last commit recorded
(``state.opt_sum``): prints ``VERIFIED`` when it was. At the end every rank prints
whether its parameters equal every other rank's, and the count of samples processed.

Faults: ``KILLS`` and ``KILL_DIR``, see elastic_kills.py.
"""

import os

import torch
from elastic_kills import maybe_kill

import swarmfd as fd
import swarmfd.torch as sft

EPOCHS = int(os.environ.get("EPOCHS", "2"))
SAMPLES = int(os.environ.get("SAMPLES", "96"))
BATCH = int(os.environ.get("BATCH", "4"))
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "3"))
ZERO = os.environ.get("ZERO") == "1"


def opt_sum(opt) -> float:
    """The sum of every tensor of the optimizer's whole state (a collective)."""
    if isinstance(opt, sft.ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        sd = opt.state_dict() if fd.get_rank() == 0 else {"state": {}}
    else:
        sd = opt.state_dict()
    total = sum(float(v.double().sum()) for st in sd["state"].values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return fd.broadcast_object(total)


fd.init_from_env()
torch.manual_seed(0)
data = torch.randn(SAMPLES, 8)
target = (data.sum(dim=1, keepdim=True) > 0).float()
dataset = torch.utils.data.TensorDataset(data, target, torch.arange(SAMPLES))
torch.manual_seed(fd.get_rank() + 10)  # replicas start apart: DDP takes rank 0's
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = sft.DistributedDataParallel(net)
if ZERO:
    opt = sft.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = sft.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = sft.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, steps=0,
                               opt_sum=None, seen=[0] * SAMPLES)


@fd.elastic.run
def train(state):
    if state.opt_sum is not None:
        now = opt_sum(opt)
        assert abs(now - state.opt_sum) <= 1e-6 * max(1.0, abs(now)), (now, state.opt_sum)
        print(f"VERIFIED {now:.6f}", flush=True)
    for state.epoch in range(state.epoch, EPOCHS):  # noqa: B020 (the epoch lives in the state)
        for x, y, idx in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            counts = torch.zeros(SAMPLES)
            counts.index_add_(0, idx, torch.ones(len(idx)))
            sft.all_reduce(counts)
            state.seen = [a + int(b) for a, b in zip(state.seen, counts.tolist(), strict=True)]
            state.sampler.record_batch(state.batch, BATCH)
            state.batch += 1
            state.steps += 1
            maybe_kill(state.steps)
            if state.batch % COMMIT_EVERY == 0:
                state.opt_sum = opt_sum(opt)
                state.commit()
        state.batch = 0
        state.sampler.set_epoch(state.epoch + 1)


train(state)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
same = all(torch.equal(flat, torch.from_numpy(o)) for o in fd.all_gather(flat.numpy()))
print(f"RESULT rank={fd.get_rank()} world={fd.get_world_size()} same={same} "
      f"min={min(state.seen)} max={max(state.seen)} steps={state.steps}", flush=True)
fd.cleanup()
