"""fully_shard and the checkpoints in one process: a world of one, the errors, the files.

What N ranks do (the mean of the gradients, ZeRO-2, accumulation, resharding a
checkpoint to another world size, a lost rank) is in test_fsdp_ranks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import swarmfd as fd

from .support.harness import require

torch = require("torch", "pip install torch==2.13.0, the CPU wheel")

import swarmfd.torch as sft  # noqa: E402 (swarmfd.torch imports torch)
from swarmfd.torch import fsdp  # noqa: E402 (swarmfd.torch imports torch)

from .test_torch import world1  # noqa: E402, F401 (the fixture: a world of one)

pytestmark = pytest.mark.usefixtures("world1")
F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def mlp(seed: int = 0, dtype: torch.dtype = F64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(dtype)


def shard(model: torch.nn.Module, units: tuple[int, ...] = (0, 2, 4),
          **kw: object) -> torch.nn.Module:
    for i in units:
        sft.fully_shard(model[i], **kw)
    return sft.fully_shard(model, **kw)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g, dtype=F64), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd, _ = sft.get_state_dict(model)
    return sd


def test_one_rank_trains_as_the_plain_module() -> None:
    """N=1: the same steps as the plain module, with the root holding parameters of its
    own or none; the module is the one given, its parameters flat pieces of the shards
    under their own names, nothing gathered between steps."""
    for units, reshard, (cls, kw) in [
            ((0, 2, 4), True, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})),
            ((0, 2), True, (torch.optim.Adam, {"lr": 0.01})),
            ((0, 2, 4), False, (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}))]:
        ref, model = mlp(), mlp()
        assert shard(model, units, reshard_after_forward=reshard) is model
        assert isinstance(model, sft.FSDPModule) and isinstance(model, torch.nn.Sequential)
        assert [n for n, _ in model.named_parameters()] == \
            [n for n, _ in ref.named_parameters()]
        assert all(p.dim() == 1 for p in model.parameters())
        opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
        for s in range(3):
            step(model, opt, s)
            step(ref, ref_opt, s)
        got = full_params(model)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, **TIGHT)
        units_ = [m.__dict__[fsdp.UNIT] for m in model.modules() if fsdp.UNIT in m.__dict__]
        assert not any(u.gathered for u in units_)
        assert all(u.full.untyped_storage().nbytes() == 0 for u in units_)


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32() -> None:
    model = shard(mlp(dtype=torch.float32), mp_policy=sft.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    seen = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append((m.weight.dtype, a[0].dtype)))
    out = model(torch.randn(4, 6))
    assert out.dtype == torch.float32 and seen == [(torch.bfloat16, torch.bfloat16)]
    out.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())


def test_glibc_keeps_freed_units_unless_told_to_leave_it_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_freed raises glibc's thresholds (only ever raising them), and leaves glibc
    alone under SWARMFD_MALLOC=system or glibc's own settings (as the job's init read
    them: each case initialises the world of one again under its environment)."""
    import platform

    from swarmfd.comm import malloc
    from swarmfd.torch import _tensors

    def keep_under(env: dict[str, str], nbytes: int, working: int) -> bool:
        fd.cleanup()
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            fd.init()
        return _tensors.keep_freed(nbytes, working)

    monkeypatch.setattr(malloc, "_kept", {"mmap": 0, "trim": 0})
    assert not keep_under({"SWARMFD_MALLOC": "system"}, 8 << 20, 40 << 20)
    assert not keep_under({"MALLOC_TRIM_THRESHOLD_": str(64 << 20)}, 8 << 20, 40 << 20)
    if platform.libc_ver()[0] != "glibc":
        return
    assert keep_under({}, 8 << 20, 40 << 20)
    assert malloc._kept == {"mmap": 8 << 20, "trim": 40 << 20}
    assert keep_under({}, 1 << 30, 1)  # the mmap threshold stops at glibc's limit
    assert malloc._kept == {"mmap": 32 << 20, "trim": 40 << 20}


def test_the_errors_name_what_is_wrong() -> None:
    x = torch.randn(2, 6, dtype=F64)
    # The root not sharded: its forward runs the units inside a module holding more.
    model = shard(mlp(), (0, 2))
    model.__class__ = torch.nn.Sequential  # (as if fully_shard(model) was forgotten)
    model.__dict__.pop(fsdp.UNIT)
    plain = mlp()
    for i in (0, 2):
        plain[i] = model[i]
    with pytest.raises(RuntimeError, match=r"ran inside a Sequential whose parameter "
                                           r"'4\.weight' is not sharded"):
        plain(x)
    # The root sharded after a block ran as a root of its own.
    model = mlp()
    sft.fully_shard(model[0])
    model[0](x)
    with pytest.raises(RuntimeError, match="has run forward already"):
        sft.fully_shard(model)
    # An optimizer built before fully_shard: its step names the parameter.
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    shard(model)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"Adam holds parameter 'weight' of a sharded "
                                           "Linear.*build the optimizer after fully_shard"):
        opt.step()
    # A parameter tied across two units.
    head = torch.nn.Linear(16, 16).double()
    both = torch.nn.Sequential(head, torch.nn.Linear(16, 16).double())
    both[1].weight = head.weight
    sft.fully_shard(both[0])
    with pytest.raises(ValueError, match=r"parameter '1\.weight' of this Sequential is tied "
                                         r"to 'weight' of a sharded Linear"):
        sft.fully_shard(both)
    # A tensor not on the CPU (meta stands in for CUDA here).
    with pytest.raises(TypeError, match=r"parameter '0\.weight' is on meta.*CPU tensors only"):
        sft.fully_shard(mlp().to("meta"))
    with pytest.raises(TypeError, match="one dtype"):
        sft.fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double()))
    with pytest.raises(RuntimeError, match="sharded already"):
        sft.fully_shard(shard(mlp()))
    with pytest.raises(TypeError, match="sharded by fully_shard"):
        sft.DistributedDataParallel(shard(mlp()))
    with pytest.raises(TypeError, match="use a plain Adam"):
        sft.ZeroRedundancyOptimizer(shard(mlp()).parameters(), torch.optim.Adam)


def test_a_checkpoint_that_does_not_fit_names_the_parameter(tmp_path: Path) -> None:
    model = shard(mlp())
    sft.checkpoint.save(tmp_path / "ck", model)
    other = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3)).double()
    with pytest.raises(ValueError, match=r"parameter '2\.weight' has shape \[16, 16\] in the "
                                         r"checkpoint, the model's is \[8, 16\]"):
        sft.checkpoint.load(tmp_path / "ck", other)
    with pytest.raises(ValueError, match=r"'2\.weight' has shape \[8, 16\] in the state dict"):
        sft.set_state_dict(model, None, other.state_dict())
    fewer = torch.nn.Sequential(torch.nn.Linear(6, 16)).double()
    with pytest.raises(ValueError, match=r"missing nothing, unexpected '2\.bias'"):
        sft.checkpoint.load(tmp_path / "ck", fewer)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        sft.checkpoint.load(tmp_path / "nothing", model)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        sft.checkpoint.load(tmp_path / "ck", model, torch.optim.SGD(model.parameters(), lr=1))


def test_checkpoint_files_are_safetensors_and_json(tmp_path: Path) -> None:
    """The folder: one safetensors file per rank and the index; a tied parameter once;
    a plain safetensors state dict and torch's DDP keys load too."""
    from safetensors.torch import load_file, save_file

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(model, opt, 0)
    sft.checkpoint.save(tmp_path / "ck", model, opt)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["index.json", "rank-00000-of-00001.safetensors"]
    index = json.loads((tmp_path / "ck" / "index.json").read_text())
    assert index["world_size"] == 1 and index["model"] == list(model.state_dict())
    assert index["optimizer"]["class"] == "SGD"
    assert index["optimizer"]["param_groups"][0]["params"] == list(model.state_dict())
    stored = load_file(tmp_path / "ck" / "rank-00000-of-00001.safetensors")
    assert set(stored) == {f"model/{k}" for k in model.state_dict()} | {
        f"optim/{k}/momentum_buffer" for k in model.state_dict()}
    # A plain state dict file (and torch DDP's module. keys) loads into a sharded module.
    save_file({f"module.{k}": v.contiguous() for k, v in model.state_dict().items()},
              tmp_path / "plain.safetensors")
    sharded = shard(mlp(seed=3))
    sft.checkpoint.load(tmp_path / "plain.safetensors", sharded)
    for k, v in full_params(sharded).items():
        assert torch.equal(v, model.state_dict()[k])
    # Tied parameters: one tensor in the files, both keys in the index and the dicts.
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).double()
    tied[1].weight = tied[0].weight
    sft.fully_shard(tied)
    sft.checkpoint.save(tmp_path / "tied", tied)
    index = json.loads((tmp_path / "tied" / "index.json").read_text())
    assert index["aliases"] == {"model/1.weight": "model/0.weight"}
    back = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).double()
    back[1].weight = back[0].weight
    sft.checkpoint.load(tmp_path / "tied", back)
    assert torch.equal(back[0].weight, full_params(tied)["0.weight"])
    assert list(full_params(tied)) == ["0.weight", "0.bias", "1.weight", "1.bias"]
