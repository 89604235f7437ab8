"""swarmfd.torch in one process: buckets, tensor handling, DDP/ZeRO at N=1, errors.

The multi-rank behaviour (averaging, ZeRO against the plain optimizer, a lost rank,
the c10d backend) is in test_torch_ranks.py. Without torch these tests skip, and
under CI=true they fail: a CI without torch must not pass unnoticed.
"""

from __future__ import annotations

import gc

import pytest

from .support.harness import require_torch

torch = require_torch()

import swarmfd as fd  # noqa: E402 (swarmfd.torch imports torch)
import swarmfd.torch as sft  # noqa: E402 (swarmfd.torch imports torch)
from swarmfd.torch import _buckets  # noqa: E402 (swarmfd.torch imports torch)


@pytest.fixture
def world1():
    """A world of one."""
    fd.init()
    try:
        yield
    finally:
        fd.cleanup()


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(dtype)


# -- buckets (plain data) ------------------------------------------------------------------


def _named(*specs: tuple[str, int, torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(k, dtype=d)) for n, k, d in specs]


def test_buckets_reverse_order_caps_and_dtypes() -> None:
    """Reverse registration order, one dtype per bucket, first bucket capped apart."""
    f32, f64 = torch.float32, torch.float64
    params = _named(("a", 100, f32), ("b", 300, f32), ("c", 50, f64), ("d", 200, f32),
                    ("e", 10, f32))
    # caps in bytes: first 400 (100 float32), later 1000 (250 float32)
    buckets = _buckets.assign(params, size=3, cap_bytes=1000, first_cap_bytes=400)
    got = [(b.dtype, [s.name for s in b.slots]) for b in buckets]
    assert got == [(f32, ["e", "d"]), (f64, ["c"]), (f32, ["b"]), (f32, ["a"])]
    e, d = buckets[0].slots
    assert (e.offset, d.offset, buckets[0].numel) == (0, 10, 210)
    assert buckets[0].padded == 210 and buckets[0].part == 70
    assert buckets[3].numel == 100 and buckets[3].padded == 102 and buckets[3].part == 34
    assert buckets[1].comm_dtype == f64


def test_bfloat16_buckets_reduce_in_float32() -> None:
    buckets = _buckets.assign(_named(("w", 8, torch.bfloat16)), size=2, cap_bytes=1 << 20)
    assert buckets[0].dtype == torch.bfloat16 and buckets[0].comm_dtype == torch.float32
    assert buckets[0].nbytes == 32  # measured in the float32 that travels


# -- tensors --------------------------------------------------------------------------------


def test_none_gradient_is_named(world1) -> None:
    model = mlp()
    model(torch.randn(4, 6))[:, 0].sum().backward()
    model[4].bias.grad = None
    with pytest.raises(TypeError, match=r"parameter '4\.bias' \(float32\[3\]\) has no gradient"):
        sft.all_reduce_gradients(model)
    with pytest.raises(TypeError, match=r"element 1 is None"):
        sft.all_reduce([torch.ones(2), None])
    sft.all_reduce_gradients(model.parameters(), skip_missing=True)


def test_generators_dicts_and_bfloat16_at_one_rank(world1) -> None:
    model = mlp()
    out = sft.all_reduce((p.detach() for p in model.parameters()), op="avg")
    assert isinstance(out, list) and len(out) == 6
    sd = model.state_dict()
    assert sft.broadcast(sd) is sd
    x = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    assert torch.equal(sft.all_reduce(x, op="sum"), torch.tensor([1.5, -2.25],
                                                                 dtype=torch.bfloat16))
    w = sft.all_reduce([x], async_op=True)
    assert w.wait() == [x] and w.is_completed()


def test_non_cpu_tensors_are_refused_plainly(world1) -> None:
    meta = torch.empty(3, device="meta")
    with pytest.raises(TypeError, match=r"element 0 is on meta.*CPU tensors only"):
        sft.all_reduce([meta])
    with pytest.raises(TypeError, match=r"CPU tensors only"):
        sft.broadcast({"w": meta})
    with pytest.raises(TypeError, match=r"parameter '0\.weight' is on meta"):
        sft.DistributedDataParallel(mlp().to("meta"))
    with pytest.raises(ValueError, match="CPU modules only"):
        sft.DistributedDataParallel(mlp(), device_ids=[0])


# -- DDP and ZeRO at N=1 ------------------------------------------------------------------


def test_ddp_passes_module_forward_and_state_dict_through(world1) -> None:
    inner = mlp()
    ddp = sft.DistributedDataParallel(inner)
    assert ddp.module is inner
    x = torch.randn(5, 6)
    assert torch.equal(ddp(x), inner(x))
    assert list(ddp.state_dict()) == list(inner.state_dict())
    torch_style = {f"module.{k}": v.clone() + 1 for k, v in inner.state_dict().items()}
    ddp.load_state_dict(torch_style)
    assert torch.equal(inner[0].bias, torch_style["module.0.bias"])
    with pytest.raises(RuntimeError, match="already wrapped"):
        sft.DistributedDataParallel(inner)


def test_zero_at_one_rank_is_the_plain_optimizer(world1) -> None:
    a, b = mlp(1), mlp(1)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    zero = sft.ZeroRedundancyOptimizer(a.parameters(), torch.optim.AdamW, lr=0.01,
                                       weight_decay=0.1)
    plain = torch.optim.AdamW(b.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(4):
        for m, opt in ((a, zero), (b, plain)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    zero.consolidate_state_dict(to=0)
    sd, ref = zero.state_dict(), plain.state_dict()
    assert sd["param_groups"] == ref["param_groups"]
    assert sorted(sd["state"]) == sorted(ref["state"])
    for i, st in ref["state"].items():
        assert set(sd["state"][i]) == set(st)
        for k, v in st.items():
            torch.testing.assert_close(sd["state"][i][k], v, rtol=1e-5, atol=1e-7)


def test_zero_refuses_what_it_cannot_shard(world1) -> None:
    with pytest.raises(ValueError, match="LBFGS's update is not elementwise"):
        sft.ZeroRedundancyOptimizer(mlp().parameters(), torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer_class must be"):
        sft.ZeroRedundancyOptimizer(mlp().parameters(), "adam")
    zero = sft.ZeroRedundancyOptimizer(mlp().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="call consolidate_state_dict"):
        zero.state_dict()
    with pytest.raises(NotImplementedError, match="add_param_group after construction"):
        zero.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(TypeError, match=r"parameter 5 \(float32\[3\]\) has no gradient"):
        zero.step()


def test_lr_scheduler_drives_the_local_optimizers(world1) -> None:
    model = mlp()
    zero = sft.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)
    model(torch.randn(3, 6)).sum().backward()
    zero.step()
    sched.step()
    zero.step()
    assert zero.param_groups[0]["lr"] == 0.5
    assert all(g["lr"] == 0.5 for opt in zero._local if opt for g in opt.param_groups)


def test_dropped_wrapper_is_freed(world1) -> None:
    inner = mlp()
    ddp = sft.DistributedDataParallel(inner)
    ref = __import__("weakref").ref(ddp)
    del ddp
    gc.collect()
    assert ref() is None
    sft.DistributedDataParallel(inner)  # the parameters are free to wrap again


def test_broadcast_state_at_one_rank_is_a_no_op(world1) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    before = [p.clone() for p in model.parameters()]
    sft.broadcast_parameters(model)
    sft.broadcast_optimizer_state(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
