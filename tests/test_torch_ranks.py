"""swarmfd.torch on real ranks: DDP and ZeRO against one process, a lost rank, c10d.

Each test spawns its ranks once and checks several behaviours in them (a rank pays
for importing torch). The references are computed inside every rank from the same
seeds: one process trained on the concatenated global batch, with the plain
optimizer. Models are float64, so "equal" means to 1e-10 and not to float32 noise.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .support.harness import (
    count_runs,
    free_port,
    require_torch,
    run_ranks,
    run_ranks_raw,
    transport_env,
)

torch = require_torch()

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


# -- in every rank ----------------------------------------------------------------------


def _setup() -> None:
    torch.set_num_threads(1)


def mlp(seed: int, dtype: torch.dtype = F64, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 3)).to(dtype)


def data(steps: int, rows: int, seed: int = 100,
         dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(steps, rows, 6, generator=g, dtype=dtype),
            torch.randint(0, 3, (steps, rows), generator=g))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_same_everywhere(t: torch.Tensor, what: str) -> None:
    """Bitwise the same on every rank (gathered)."""
    import swarmfd as fd

    rows = fd.all_gather(t.detach().contiguous().numpy())
    for r, row in enumerate(rows):
        assert (row == rows[0]).all(), f"{what}: rank {r} differs from rank 0"


def differs_somewhere(t: torch.Tensor) -> bool:
    import swarmfd as fd

    rows = fd.all_gather(t.detach().contiguous().numpy())
    return any((row != rows[0]).any() for row in rows)


def local_grads(model: torch.nn.Module, batches: list[tuple[Any, ...]]) -> list[Any]:
    """Each batch's gradients on ``model`` (a reference replica), summed."""
    total: list[Any] = [None] * len(list(model.parameters()))
    for args in batches:
        model.zero_grad(set_to_none=True)
        x, y, *rest = args
        loss_fn(model(x, *rest), y).backward()
        for i, p in enumerate(model.parameters()):
            if p.grad is not None:
                total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad
    return total


class Branchy(torch.nn.Module):
    """A trunk and three heads: rank-dependent head a or b; head c is never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.trunk = torch.nn.Linear(6, 8).double()
        self.a = torch.nn.Linear(8, 3).double()
        self.b = torch.nn.Linear(8, 3).double()
        self.c = torch.nn.Linear(8, 3).double()

    def forward(self, x: torch.Tensor, which: int = 0) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.a(h) if which == 0 else self.b(h)



# -- DDP --------------------------------------------------------------------------------


def _train_like_one_process(ddp: Any, ref: torch.nn.Module, X: torch.Tensor,
                            Y: torch.Tensor, mine: slice, steps: int, what: str,
                            momentum: float = 0.0) -> None:
    """``steps`` SGD steps of ``ddp`` on this rank's rows ``mine`` and of ``ref`` on the
    whole batch: after every step the parameters are the same on every rank and equal
    ``ref``'s. ``.grad`` is set to None before every other step (fresh gradients), else
    zeroed (gradients as bucket views)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=momentum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss_fn(ddp(X[step, mine]), Y[step, mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref(X[step]), Y[step]).backward()
        ref_opt.step()
        assert_same_everywhere(flat_params(ddp.module), f"{what} after step {step}")
        torch.testing.assert_close(flat_params(ddp.module), flat_params(ref), **TIGHT)


def _ddp_rank(rank: int, world: int, overlap: bool | None = None) -> dict[str, Any]:
    import copy

    import swarmfd as fd
    import swarmfd.torch as sft

    _setup()
    B, steps = 4, 5
    X, Y = data(steps, B * world)
    mine = slice(rank * B, (rank + 1) * B)

    # Wrap-time broadcast: every rank starts from group rank 0's initialisation.
    model = mlp(seed=rank)
    ddp = sft.DistributedDataParallel(model, bucket_cap_mb=0.0006, first_bucket_mb=0.0001,
                                      overlap=overlap)
    assert len(ddp._buckets) >= 3, ddp._buckets
    assert ddp._buckets[0].slots[0].name == "4.bias"  # reverse registration order
    ref = mlp(seed=0)
    assert torch.equal(flat_params(model), flat_params(ref))
    _train_like_one_process(ddp, ref, X, Y, mine, steps, "parameters", momentum=0.9)
    # The calls one backward issues: where no rank overlaps and every bucket is reduced
    # in place, one all_reduce for every bucket; else one a bucket.
    from swarmfd import group as _grp

    world_group = _grp.resolve_group(None, "the test")
    before = world_group.seq
    loss_fn(ddp(X[0, mine]), Y[0, mine]).backward()
    calls = world_group.seq - before

    # A bucket big enough for the TCP ring (337 KB, 3 ranks): its gradients are
    # reduced where they are there too (pieces of one gradient, and small ones together).
    ddpw = sft.DistributedDataParallel(mlp(seed=rank, width=200), overlap=overlap)
    _train_like_one_process(ddpw, mlp(seed=0, width=200), X, Y, mine, 2, "wide parameters")

    # no_sync over k micro-batches == one batch k times larger (copy back into .grad).
    k = 3
    Xk, Yk = data(k, B * world, seed=7)
    m2 = mlp(seed=11)
    ddp2 = sft.DistributedDataParallel(m2, gradient_as_bucket_view=False)
    ref2 = copy.deepcopy(m2)
    with ddp2.no_sync():
        for j in range(k - 1):
            (loss_fn(ddp2(Xk[j, mine]), Yk[j, mine]) / k).backward()
    assert differs_somewhere(m2[0].weight.grad), "no_sync must not synchronise"
    (loss_fn(ddp2(Xk[k - 1, mine]), Yk[k - 1, mine]) / k).backward()
    loss_fn(ref2(Xk.reshape(-1, 6)), Yk.reshape(-1)).backward()
    for p, q in zip(m2.parameters(), ref2.parameters(), strict=True):
        assert_same_everywhere(p.grad, "no_sync gradients")
        torch.testing.assert_close(p.grad, q.grad, **TIGHT)

    # Dropping the wrapper removes its hooks: the module trains alone again.
    m3 = mlp(seed=12)
    ddp3 = sft.DistributedDataParallel(m3)
    assert all(p._post_accumulate_grad_hooks for p in m3.parameters())
    del ddp3
    gc.collect()
    assert not any(p._post_accumulate_grad_hooks for p in m3.parameters())
    loss_fn(m3(X[0, mine]), Y[0, mine]).backward()
    assert differs_somewhere(m3[0].weight.grad), "a dropped wrapper still synchronised"

    # find_unused_parameters: head a only on even ranks, b only on odd, c nowhere.
    m4 = Branchy()
    ddp4 = sft.DistributedDataParallel(m4, find_unused_parameters=True)
    ref4 = copy.deepcopy(m4)
    loss_fn(ddp4(X[1, mine], rank % 2), Y[1, mine]).backward()
    want = local_grads(ref4, [(X[1, r * B:(r + 1) * B], Y[1, r * B:(r + 1) * B], r % 2)
                              for r in range(world)])
    for (name, p), w in zip(m4.named_parameters(), want, strict=True):
        if name.startswith("c."):
            assert p.grad is None, f"{name}: unused on every rank, its grad must stay None"
        else:
            torch.testing.assert_close(p.grad, w / world, **TIGHT)

    # Without find_unused_parameters: a clear error naming them, peers left in step.
    m5 = Branchy()
    ddp5 = sft.DistributedDataParallel(m5)
    try:
        loss_fn(ddp5(X[2, mine], 0), Y[2, mine]).backward()
    except RuntimeError as exc:
        text = str(exc)
        assert "'b.weight'" in text and "'c.bias'" in text and "find_unused_parameters" in text
    else:
        raise AssertionError("a parameter without a gradient was not reported")
    import numpy as np

    probe = np.full(3, float(rank))
    fd.all_reduce(probe)
    assert (probe == sum(range(world))).all()
    return {"buckets": len(ddp._buckets), "overlap": ddp._overlap, "calls": calls,
            "in_place": [ddp._direct(b.index) for b in ddp._buckets],
            "wide_in_place": [ddpw._direct(b.index) for b in ddpw._buckets]}


@pytest.mark.parametrize(("transport", "overlap"), [("shm", None), ("shm", True),
                                                    ("tcp", False), ("tcp", True)])
def test_ddp_equals_one_process_on_the_global_batch(ranks, transport: str,
                                                    overlap: bool | None) -> None:
    """Parameters identical on every rank after every step and equal to one process on
    the concatenated batch; no_sync, dropped wrappers, unused parameters, the error. On
    shared memory the gradients are reduced in place, over TCP through buckets below
    the ring's sizes and in place from them; on
    a host with fewer than two cores a rank they are reduced at the end of backward
    (unless told to overlap), else during it; at the end, in place, in one call for every
    bucket."""
    # 3 ranks: the mean's 1/3 is inexact, and the buckets need padding.
    out = ranks(_ddp_rank, 3, overlap, timeout=120, env=transport_env(transport))
    assert all(o["buckets"] >= 3 for o in out)
    assert all(o["in_place"] == [transport == "shm"] * o["buckets"] for o in out), out
    assert all(o["wide_in_place"] == [True] for o in out), out
    spare = len(os.sched_getaffinity(0)) >= 2 * 3
    want = overlap if overlap is not None else spare
    assert all(o["overlap"] == want for o in out), out
    one_call = not want and transport == "shm"
    assert all(o["calls"] == (1 if one_call else o["buckets"]) for o in out), out


def _hooks_rank(rank: int, world: int) -> None:
    import copy

    import swarmfd.torch as sft
    from swarmfd.torch import comm_hooks

    _setup()
    B = 4
    X, Y = data(1, B * world, dtype=torch.float32)
    mine = slice(rank * B, (rank + 1) * B)
    m = mlp(seed=rank, dtype=torch.float32)
    ddp = sft.DistributedDataParallel(m, bucket_cap_mb=0.0006, first_bucket_mb=0.0001)
    ref = copy.deepcopy(m)
    ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    loss_fn(ddp(X[0, mine]), Y[0, mine]).backward()
    want = local_grads(ref, [(X[0, r * B:(r + 1) * B], Y[0, r * B:(r + 1) * B])
                             for r in range(world)])
    for p, w in zip(m.parameters(), want, strict=True):
        assert_same_everywhere(p.grad, "fp16-compressed gradients")
        torch.testing.assert_close(p.grad, w / world, rtol=2e-3, atol=2e-4)

    # bfloat16 parameters: reduced in float32 and rounded once.
    mb = mlp(seed=rank, dtype=torch.bfloat16)
    ddpb = sft.DistributedDataParallel(mb)
    refb = copy.deepcopy(mb)
    loss_fn(ddpb(X[0, mine].bfloat16()), Y[0, mine]).backward()
    wantb = local_grads(refb, [(X[0, r * B:(r + 1) * B].bfloat16(), Y[0, r * B:(r + 1) * B])
                               for r in range(world)])
    for p, w in zip(mb.parameters(), wantb, strict=True):
        assert p.grad.dtype == torch.bfloat16
        assert_same_everywhere(p.grad.view(torch.int16), "bfloat16 gradients")
        torch.testing.assert_close(p.grad.float(), w.float() / world, rtol=2e-2, atol=2e-3)

    # Buffers: group rank 0's before every forward.
    bn = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    bn[1].running_mean.fill_(float(rank + 1))
    ddp_bn = sft.DistributedDataParallel(bn)
    bn[1].running_mean.fill_(float(rank + 5))
    bn.eval()
    with torch.no_grad():
        ddp_bn(X[0, mine])
    assert torch.equal(bn[1].running_mean, torch.full((4,), 5.0))


def _bucket_paths_rank(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """DDP's three ways to reduce its buckets, each on a small model of several buckets
    trained two steps like one process on the whole batch: every bucket in one call
    (no rank overlaps), each bucket during backward (overlap), and each at the end of
    backward on the rank that does not overlap while its peer does. Returns each way's
    (calls in one backward, buckets)."""
    import swarmfd.torch as sft
    from swarmfd import group as _grp

    B = 4
    X, Y = data(2, B * world, seed=3)
    mine = slice(rank * B, (rank + 1) * B)
    world_group = _grp.resolve_group(None, "the test")
    out = {}
    for way, overlap in (("one call", False), ("overlap", True), ("mixed", rank == 0)):
        ddp = sft.DistributedDataParallel(mlp(seed=rank), bucket_cap_mb=0.0006,
                                          first_bucket_mb=0.0001, overlap=overlap)
        _train_like_one_process(ddp, mlp(seed=0), X, Y, mine, 2, way)
        before = world_group.seq
        loss_fn(ddp(X[0, mine]), Y[0, mine]).backward()
        out[way] = (world_group.seq - before, len(ddp._buckets))
    return out


def _hooks_and_state_rank(rank: int, world: int) -> dict[str, tuple[int, int]]:
    _hooks_rank(rank, world)
    _state_rank(rank, world)
    return _bucket_paths_rank(rank, world)


def test_comm_hook_bfloat16_buffers_bucket_paths_and_broadcast_state(ranks) -> None:
    """fp16 compression, bfloat16 reduced in float32, buffers from rank 0; every way
    DDP reduces its buckets (the last bucket holds the first layer: one dropped shows);
    one rank's model and optimizer state (the others never stepped) broadcast to all."""
    got = ranks(_hooks_and_state_rank, 2, timeout=120)
    for out in got:
        assert all(buckets >= 3 for _, buckets in out.values()), got
        assert out["one call"][0] == 1, got
        assert out["overlap"][0] == out["overlap"][1], got
        assert out["mixed"][0] == out["mixed"][1], got


def _seed_api_lists_rank(rank: int, world: int) -> dict[str, Any]:
    """The seed API's gradient mean on a torch model, ``fd.all_reduce_mean([p.grad ...])``,
    step after step: its schedule made on the first step and run by the later ones (no
    Schedule made after the first), the mean in every gradient; then a list of a tensor
    and an array, repeated."""
    import numpy as np

    import swarmfd as fd
    from swarmfd.call import Schedule

    _setup()
    model = mlp(3, torch.float32)
    made = count_runs(Schedule, "__init__")
    per_step = []
    for step in range(4):
        before = made["Schedule"]
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, float((rank + 1) * (i + 1) + step))
        grads = [p.grad for p in model.parameters()]
        assert fd.all_reduce_mean(grads) is grads
        mean = sum(r + 1 for r in range(world)) / world
        for i, p in enumerate(model.parameters()):
            assert torch.equal(p.grad, torch.full_like(p, mean * (i + 1) + step)), (step, i)
        per_step.append(made["Schedule"] - before)
    mixed = [torch.full((3,), float(rank)), np.full(2, float(rank), np.float32)]
    per_mixed = []
    for _ in range(3):
        before = made["Schedule"]
        mixed[0].fill_(float(rank))
        mixed[1].fill(float(rank))
        fd.all_reduce(mixed)
        assert torch.equal(mixed[0], torch.full((3,), float(sum(range(world)))))
        assert (mixed[1] == sum(range(world))).all()
        per_mixed.append(made["Schedule"] - before)
    return {"steps": per_step, "mixed": per_mixed}


def test_the_seed_apis_gradient_mean_of_tensors_reuses_its_schedule(ranks) -> None:
    """(One schedule made by the first step, one by the first mixed call: the gradients
    are one dtype, one call each.)"""
    got = ranks(_seed_api_lists_rank, 2, timeout=120)
    assert got == [{"steps": [1, 0, 0, 0], "mixed": [1, 0, 0]}] * 2, got


# -- ZeRO -------------------------------------------------------------------------------


OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _zero_rank(rank: int, world: int) -> dict[str, Any]:
    import swarmfd as fd
    import swarmfd.torch as sft

    _setup()
    calls: dict[str, int] = {}
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        real = getattr(fd, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **k)

        setattr(fd, name, counted)
    # DDP's buckets under ZeRO on shared memory: a reduce_scatter of the gradients
    # where they are (swarmfd._internal.reduce_scatter_parts), counted as one.
    import swarmfd._internal as fdc

    real_parts = fdc.reduce_scatter_parts

    def counted_parts(*a, **k):
        calls["reduce_scatter"] = calls.get("reduce_scatter", 0) + 1
        return real_parts(*a, **k)

    fdc.reduce_scatter_parts = counted_parts

    B, steps = 4, 4
    X, Y = data(steps + 2, B * world)
    mine = slice(rank * B, (rank + 1) * B)
    report: dict[str, Any] = {}
    for opt_name, (cls, kw) in OPTIMIZERS.items():
        for mode in ("standalone", "ddp-first", "zero-first"):
            # A model whose largest weight is most of it: flat shards still balance.
            model, ref = mlp(seed=0, width=24), mlp(seed=0, width=24)
            if mode == "ddp-first":
                wrapped = sft.DistributedDataParallel(model, bucket_cap_mb=0.002,
                                                      first_bucket_mb=0.0005)
                zero = sft.ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
            elif mode == "zero-first":
                zero = sft.ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
                wrapped = sft.DistributedDataParallel(model)
            else:
                wrapped = model
                zero = sft.ZeroRedundancyOptimizer(model.parameters(), cls,
                                                   bucket_cap_mb=0.002, **kw)
            plain = cls(ref.parameters(), **kw)
            for step in range(steps):
                calls.clear()
                zero.zero_grad()
                loss_fn(wrapped(X[step, mine]), Y[step, mine]).backward()
                after_backward = dict(calls)
                zero.step()
                plain.zero_grad()
                loss_fn(ref(X[step]), Y[step]).backward()
                plain.step()
                nb = len(zero.buckets)
                if mode == "standalone":
                    assert after_backward == {}, after_backward
                    assert calls == {"reduce_scatter": nb, "all_gather": nb}, calls
                else:  # reduced once, in backward, by reduce-scatter; never all-reduced
                    assert after_backward == {"reduce_scatter": nb}, after_backward
                    assert calls == {"reduce_scatter": nb, "all_gather": nb}, calls
                assert_same_everywhere(flat_params(model), f"{opt_name}/{mode} step {step}")
                torch.testing.assert_close(flat_params(model), flat_params(ref), **TIGHT)

            # Checkpoint: the consolidated state is the plain optimizer's own.
            to = world - 1
            calls.clear()
            zero.consolidate_state_dict(to=to)
            if rank == to:
                sd, want = zero.state_dict(), plain.state_dict()
                assert sd["param_groups"] == want["param_groups"]
                assert list(sd["state"]) == list(want["state"])
                for i, st in want["state"].items():
                    assert set(sd["state"][i]) == set(st), (i, set(sd["state"][i]), set(st))
                    for key, value in st.items():
                        got = sd["state"][i][key]
                        if isinstance(value, torch.Tensor):
                            torch.testing.assert_close(got, value, **TIGHT)
                        else:
                            assert got == value
            else:
                try:
                    zero.state_dict()
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("state_dict() on a rank that holds no state")
            # Resume: a fresh optimizer loads the full state and goes on like the plain one.
            fresh_model = mlp(seed=3, width=24)
            fresh_model.load_state_dict(model.state_dict())
            fresh = sft.ZeroRedundancyOptimizer(fresh_model.parameters(), cls, **kw)
            fresh.load_state_dict(plain.state_dict())
            for step in range(steps, steps + 2):
                fresh.zero_grad()
                loss_fn(fresh_model(X[step, mine]), Y[step, mine]).backward()
                fresh.step()
                plain.zero_grad()
                loss_fn(ref(X[step]), Y[step]).backward()
                plain.step()
                torch.testing.assert_close(flat_params(fresh_model), flat_params(ref), **TIGHT)
            if opt_name == "adam" and mode == "standalone":
                full = sum(v.numel() * v.element_size() for st in plain.state.values()
                           for v in st.values() if isinstance(v, torch.Tensor))
                report["adam_state_fraction"] = zero.state_bytes() / full
            del wrapped, zero, fresh
            gc.collect()
    return report


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_zero_equals_the_plain_optimizer(ranks, transport: str) -> None:
    """SGD momentum, Adam, AdamW; alone, and under DDP built before or after it: the
    same parameters as the plain optimizer on the global batch, gradients reduced once,
    consolidated state equal to the plain optimizer's, resumed state too, and 1/N of
    Adam's state per rank."""
    world = 3
    out = ranks(_zero_rank, world, timeout=180, env=transport_env(transport))
    for rep in out:
        assert rep["adam_state_fraction"] <= 1 / world + 0.05, rep


# -- broadcast of model and optimizer state ---------------------------------------------


def _state_rank(rank: int, world: int) -> None:
    import swarmfd.torch as sft

    _setup()
    model = mlp(seed=rank, dtype=torch.bfloat16)
    sft.broadcast_parameters(model, src=1)
    assert torch.equal(flat_params(model).float(), flat_params(mlp(1, torch.bfloat16)).float())
    other = mlp(seed=rank)
    sft.broadcast_parameters(other.state_dict(), src=0)
    assert torch.equal(flat_params(other), flat_params(mlp(0)))

    m = mlp(seed=0)
    opt = torch.optim.Adam(m.parameters(), lr=0.01 if rank == 1 else 0.5, betas=(0.8, 0.9))
    if rank == 1:  # the others never stepped: they have no state yet
        X, Y = data(3, 8)
        for s in range(3):
            opt.zero_grad()
            loss_fn(m(X[s]), Y[s]).backward()
            opt.step()
    sft.broadcast_parameters(m, src=1)
    sft.broadcast_optimizer_state(opt, src=1)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    for p in m.parameters():
        st = opt.state[p]
        assert float(st["step"]) == 3.0
        assert_same_everywhere(st["exp_avg"], "exp_avg")
        assert_same_everywhere(st["exp_avg_sq"], "exp_avg_sq")
    X, Y = data(1, 8, seed=9)
    opt.zero_grad()
    loss_fn(m(X[0]), Y[0]).backward()
    opt.step()
    assert_same_everywhere(flat_params(m), "parameters after a step from broadcast state")


# -- a rank lost in the middle of backward ----------------------------------------------


def _killed_rank(rank: int, world: int, victim: int) -> None:
    import signal

    import swarmfd.torch as sft

    _setup()
    model = mlp(seed=0, width=64)
    ddp = sft.DistributedDataParallel(model, bucket_cap_mb=0.01, first_bucket_mb=0.001)
    X, Y = data(3, 4)
    for step in range(3):
        x = X[step].clone().requires_grad_(step == 2 and rank == victim)
        if x.requires_grad:  # fires when backward reaches the input: after the buckets
            x.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        loss_fn(ddp(x), Y[step]).backward()


def test_rank_killed_mid_backward_is_named_by_every_survivor() -> None:
    world, victim = 3, 1
    out = run_ranks_raw(_killed_rank, world, victim, timeout=90, group_timeout=20)
    assert victim not in out, "the victim reported back: it was not killed"
    for r in range(world):
        if r == victim:
            continue
        assert r in out, f"rank {r} did not finish (hung?):\n{out.stacks}"
        ok, tb = out[r]
        assert not ok, f"rank {r} finished without noticing the lost rank"
        assert "PeerLostError" in tb and f"rank {victim}" in tb, tb
        assert "backward" in tb, tb


# -- torch.distributed over swarmfd (the c10d backend) ------------------------------------


def _c10d_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    import swarmfd as fd
    import swarmfd.torch  # registers the backend

    _setup()
    dist.init_process_group("swarmfd", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    assert fd.is_initialized() and fd.get_rank() == rank
    assert dist.get_backend() == "swarmfd"
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(sum(range(1, world + 1)))))
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(t, torch.full((3,), (world + 1) / 2))
    t = torch.tensor([float(rank)], dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.item() == world - 1
    b = torch.arange(4.0) * (rank + 1)
    dist.broadcast(b, src=1)
    assert torch.equal(b, torch.arange(4.0) * 2)
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    assert [o[0].item() for o in outs] == list(range(world))
    big = torch.empty(world * 2)
    w = dist.all_gather_into_tensor(big, torch.full((2,), float(rank)), async_op=True)
    w.wait()
    assert big.tolist() == [float(r) for r in range(world) for _ in range(2)]
    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(world * 2.0))
    assert part.tolist() == [world * (2.0 * rank), world * (2.0 * rank + 1)]
    part2 = torch.empty(2)
    dist.reduce_scatter(part2, [torch.full((2,), float(r)) for r in range(world)])
    assert part2.tolist() == [world * float(rank)] * 2
    r = torch.tensor([float(rank + 1)])
    dist.reduce(r, dst=0)
    assert r.item() == (sum(range(1, world + 1)) if rank == 0 else rank + 1)
    g = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), g, dst=0)
    if rank == 0:
        assert [x.item() for x in g] == list(range(world))
    s = torch.empty(1)
    dist.scatter(s, [torch.tensor([10.0 + i]) for i in range(world)] if rank == 0 else None,
                 src=0)
    assert s.item() == 10.0 + rank
    dist.barrier()

    # torch's own DDP over this backend equals one process on the global batch.
    B = 4
    X, Y = data(3, B * world, dtype=torch.float32)
    model = mlp(seed=rank, dtype=torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    ref = mlp(seed=0, dtype=torch.float32)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss_fn(ddp(X[step, rank * B:(rank + 1) * B]), Y[step, rank * B:(rank + 1) * B]
                ).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref(X[step]), Y[step]).backward()
        ref_opt.step()
        assert_same_everywhere(flat_params(model), "torch DDP parameters")
        torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()


def test_torch_distributed_backend_runs_torch_ddp() -> None:
    """init_process_group("swarmfd") brings swarmfd up through torch's store; the
    collectives and torch's own DDP work over it."""
    run_ranks(_c10d_rank, 2, free_port(), init=False, timeout=120)


def _c10d_exchange_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    import swarmfd.torch  # noqa: F401  (registers the backend)

    _setup()
    dist.init_process_group("swarmfd", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    peer = 1 - rank
    # all_to_all_single: equal parts of the first dimension.
    out = torch.empty(world * 3)
    dist.all_to_all_single(out, torch.arange(world * 3.0) + 100 * rank)
    assert out.tolist() == [100.0 * p + 3 * rank + i for p in range(world) for i in range(3)]
    # Uneven splits, rows of 2, bfloat16 (moved as its bits).
    ins = [rank + p + 1 for p in range(world)]
    x = torch.cat([torch.full((ins[p], 2), 10.0 * rank + p) for p in range(world)])
    y = torch.empty((sum(ins), 2), dtype=torch.bfloat16)
    dist.all_to_all_single(y, x.to(torch.bfloat16), ins, ins)
    assert torch.equal(y.float(), torch.cat([torch.full((ins[p], 2), 10.0 * p + rank)
                                             for p in range(world)]))
    # Into a tensor that is not contiguous (a transposed view), asynchronously.
    z = torch.empty(2, world * 2).t()
    dist.all_to_all_single(z, torch.full((world * 2, 2), float(rank)), async_op=True).wait()
    assert torch.equal(z, torch.cat([torch.full((2, 2), float(p)) for p in range(world)]))
    # all_to_all of lists: tensor p goes to rank p, of any shape.
    outs = [torch.empty((rank + 1, p + 1)) for p in range(world)]
    dist.all_to_all(outs, [torch.full((p + 1, rank + 1), 10.0 * rank + p) for p in range(world)])
    for p in range(world):
        assert torch.equal(outs[p], torch.full((rank + 1, p + 1), 10.0 * p + rank)), p
    # send / recv: a small message each way, in order.
    got = torch.empty(5)
    if rank == 0:
        dist.send(torch.full((5,), 0.0), dst=1)
        dist.recv(got, src=1)
    else:
        dist.recv(got, src=0)
        dist.send(torch.full((5,), 1.0), dst=0)
    assert torch.equal(got, torch.full((5,), float(peer)))
    # isend / irecv of 1 MiB each way, with a tag, into a tensor that is not contiguous.
    big = torch.arange(2.0 ** 18).reshape(512, 512)
    into = torch.empty(512, 512).t()
    for req in [dist.isend(big + rank, dst=peer, tag=7), dist.irecv(into, src=peer, tag=7)]:
        req.wait()
    assert torch.equal(into, big + peer)
    # A Work completes when its own op ends: rank 0's send (256 KiB: it waits for rank 1's
    # recv) completes while its earlier irecv still waits for a message rank 1 sends
    # only after the barrier that follows the send.
    late = torch.empty(3)
    if rank == 0:
        req = dist.irecv(late, src=1, tag=9)
        dist.send(torch.ones(2 ** 16), dst=1, tag=8)
        dist.barrier()
        req.wait()
        assert late.tolist() == [9.0, 9.0, 9.0]
    else:
        dist.recv(torch.empty(2 ** 16), src=0, tag=8)
        dist.barrier()
        dist.send(torch.full((3,), 9.0), dst=0, tag=9)
    try:
        dist.recv(torch.empty(1))
    except NotImplementedError as exc:
        assert "any source" in str(exc) and "src=" in str(exc), exc
    else:
        raise AssertionError("a receive from any source should say it is not supported")
    dist.destroy_process_group()


def _c10d_subgroups_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    import swarmfd as fd
    import swarmfd.group
    import swarmfd.torch  # registers the backend

    _setup()
    dist.init_process_group("swarmfd", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    # Every rank calls new_group; torch makes the group on its members only.
    ends = dist.new_group([0, 2])
    low = dist.new_group([0, 1])
    if rank in (0, 2):
        assert dist.get_rank(ends) == rank // 2 and dist.get_world_size(ends) == 2
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=ends)
        assert t.tolist() == [4.0] * 4  # 1 + 3
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=2, group=ends)  # src is a world rank, as in torch
        assert b.tolist() == [2.0, 2.0]
        outs = [torch.empty(1) for _ in range(2)]
        dist.all_gather(outs, torch.tensor([float(rank)]), group=ends)
        assert [o.item() for o in outs] == [0.0, 2.0]
        got = torch.empty(3)
        if rank == 0:
            dist.send(torch.full((3,), 5.0), dst=2, group=ends)
        else:
            dist.recv(got, src=0, group=ends)
            assert got.tolist() == [5.0] * 3
        dist.barrier(group=ends)
    else:
        assert dist.get_rank(ends) == -1
    if rank in (0, 1):
        t = torch.full((2,), float(rank + 10))
        dist.all_reduce(t, group=low)
        assert t.tolist() == [21.0, 21.0]
    # The world's calls go on beside the groups', their traffic apart.
    w = torch.full((2,), 1.0)
    dist.all_reduce(w)
    assert w.tolist() == [float(world)] * 2
    # On one host the sub-groups run over shared memory, in areas of their own (they
    # share rank 0), their rounds interleaved with the world's without a wrong result.
    mine = [g for g in (ends, low) if rank in dist.get_process_group_ranks(g)]
    for g in mine:
        sg = g.swarmfd_group  # torch's group is the backend's ProcessGroupSwarmfd
        assert sg.plane().shares_memory and sg.area in swarmfd.group.MEMBER_AREAS, sg.area
    if rank == 0:
        areas = [g.swarmfd_group.area for g in mine]
        assert len(set(areas)) == 2, areas
    wrong = 0
    for _ in range(1500):
        a = torch.full((256,), float(rank + 1))
        dist.all_reduce(a)
        wrong += int(not bool((a == 6.0).all()))
        for g, want in ((ends, 4.0), (low, 3.0)):
            if g in mine:
                b = torch.full((256,), float(rank + 1))
                dist.all_reduce(b, group=g)
                wrong += int(not bool((b == want).all()))
    assert wrong == 0, wrong
    made = sorted(fd.group.current("test").groups)
    assert made[0] == 0 and all(g >= fd.group.MEMBERS_FIRST_GID for g in made[2:]), made
    dist.destroy_process_group()


def test_torch_distributed_backend_sub_groups() -> None:
    """dist.new_group over swarmfd: torch makes a sub-group on its members only, and
    they run collectives and point-to-point messages in it (src/dst are world ranks)
    while the others do not take part; two sub-groups and the world keep their
    traffic apart, and on one host the sub-groups run over shared memory in areas of
    their own, interleaved with the world's calls without a wrong result."""
    run_ranks(_c10d_subgroups_rank, 3, free_port(), init=False, timeout=60)


def test_torch_distributed_backend_all_to_all_send_recv() -> None:
    """dist.all_to_all_single (equal, uneven, bfloat16, a non-contiguous output),
    dist.all_to_all of lists, send/recv and isend/irecv over swarmfd; Works complete in
    the order their ops end, not the order they were issued; a receive from any source
    is refused, saying so."""
    run_ranks(_c10d_exchange_rank, 2, free_port(), init=False, timeout=60)


# -- beside torch.distributed under swarmfd run -------------------------------------------


COEXIST = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    import swarmfd as fd
    import swarmfd.torch as sft
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=30)
    if sys.argv[1] == "swarmfd-first":
        fd.init_from_env()
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        fd.init_from_env()
    t = torch.ones(2)
    dist.all_reduce(t)
    torch.manual_seed(fd.get_rank())
    model = sft.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    g = model.module.weight.grad.clone()
    dist.broadcast(g, src=0)  # gloo compares swarmfd's averaged gradients
    assert torch.equal(g, model.module.weight.grad), "gradients differ between ranks"
    print(f"ok {t.tolist()}", flush=True)
    # As torch asks: without it gloo's threads may abort the process as the interpreter
    # exits ("terminate called without an active exception", pytorch#190489; seen once
    # in CI here, after both ranks printed ok).
    dist.destroy_process_group()
""")


def _run_coexist(tmp_path: Path, order: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "coexist.py"
    script.write_text(COEXIST)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SWARMFD_SECRET_FILE", None)  # swarmfd run gives the run its own secret
    return subprocess.run([sys.executable, "-m", "swarmfd", "run", "-n", "2", "--timeout",
                           "30", str(script), order], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


def test_beside_gloo_when_swarmfd_initialises_first(tmp_path: Path) -> None:
    proc = _run_coexist(tmp_path, "swarmfd-first")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok [2.0, 2.0]") == 2, proc.stdout


def test_beside_gloo_when_torch_initialises_first(tmp_path: Path) -> None:
    """torch's TCPStore holds MASTER_PORT for the life of its group; swarmfd's rendezvous,
    on SWARMFD_PORT, does not compete for it."""
    proc = _run_coexist(tmp_path, "torch-first")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok [2.0, 2.0]") == 2, proc.stdout
