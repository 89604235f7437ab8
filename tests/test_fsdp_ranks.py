"""fully_shard on real ranks: one process on the global batch, DDP, checkpoints at N=3, 2, 1.

Two jobs and a load in this process check everything (a rank pays for its start):
N=3 on shared memory trains, accumulates, saves and loses a rank mid-backward; N=2
over TCP trains and loads what N=3 saved; then a world of one loads it too. The
references are computed in every rank from the same seeds: one process on the
concatenated global batch with the plain optimizer. Models are float64, so "equal"
means to 1e-10.
"""

from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path
from typing import Any

from .support.harness import require, run_ranks, run_ranks_raw, transport_env

torch = require("torch", "pip install torch==2.13.0, the CPU wheel")

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
ROWS = 12  # the global batch: 4 rows a rank at N=3, 6 at N=2, all at N=1
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


def mlp(seed: int, dtype: torch.dtype = F64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(dtype)


def shard(model: torch.nn.Module, units: tuple[int, ...] = (0, 2), **kw: Any
          ) -> torch.nn.Module:
    import swarmfd.torch as sft

    for i in units:  # by default the root keeps the head
        sft.fully_shard(model[i], **kw)
    return sft.fully_shard(model, **kw)


def batch(step: int, dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(ROWS, 6, generator=g).to(dtype),
            torch.randint(0, 3, (ROWS,), generator=g))


def train(model: Any, opt: Any, steps: range, rank: int = 0, world: int = 1,
          dtype: torch.dtype = F64) -> None:
    """``steps`` steps on this rank's rows of each global batch."""
    rows = ROWS // world
    for s in steps:
        x, y = batch(s, dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rank * rows:(rank + 1) * rows]),
                                          y[rank * rows:(rank + 1) * rows]).backward()
        opt.step()


def reference(name: str, steps: range) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cls, kw = OPTIMIZERS[name]
    ref = mlp(0)
    opt = cls(ref.parameters(), **kw)
    train(ref, opt, steps)
    return ref, opt


def assert_equal_to(model: Any, ref: torch.nn.Module, what: str, **tol: float) -> None:
    """The full state (gathered on rank 0) equals ``ref``'s."""
    import swarmfd as fd
    import swarmfd.torch as sft

    got, _ = sft.get_state_dict(model)
    if fd.get_rank() == 0:
        assert list(got) == list(ref.state_dict()), f"{what}: {list(got)}"
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, **(tol or TIGHT), msg=f"{what}: {k}")


def _equal_training(rank: int, world: int, cases: list[tuple[str, bool]]) -> None:
    """fully_shard (and ZeRO-2: reshard_after_forward=False) == one process, its
    reduce-scatters blocking and (every other case) asynchronous; the first case also
    == swarmfd DDP."""
    import swarmfd.torch as sft

    for i, (name, reshard) in enumerate(cases):
        cls, kw = OPTIMIZERS[name]
        model = shard(mlp(seed=rank), reshard_after_forward=reshard, overlap=i % 2 == 1)
        opt = cls(model.parameters(), **kw)
        train(model, opt, range(3), rank, world)
        ref, _ = reference(name, range(3))
        assert_equal_to(model, ref, f"{name}, reshard_after_forward={reshard}")
    cls, kw = OPTIMIZERS[cases[0][0]]
    ddp = sft.DistributedDataParallel(mlp(seed=rank))
    opt = cls(ddp.parameters(), **kw)
    train(ddp, opt, range(3), rank, world)
    model = shard(mlp(seed=rank), reshard_after_forward=cases[0][1])
    opt = cls(model.parameters(), **kw)
    train(model, opt, range(3), rank, world)
    assert_equal_to(model, ddp.module, "against DDP")


def _accumulation(rank: int, world: int) -> None:
    """k micro-batches under no_sync (or set_requires_gradient_sync(False)) and one
    synchronised == one batch k times larger, twice in a row."""
    k, rows = 3, ROWS // world
    for how, reshard in (("no_sync", True), ("flag", False)):
        model = shard(mlp(seed=rank), reshard_after_forward=reshard)
        ref = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for rep in range(2):
            xs = [batch(10 * rep + j) for j in range(k)]
            opt.zero_grad()

            def micro(j: int, xs: list[Any] = xs, model: Any = model) -> None:
                x, y = xs[j]
                mine = slice(rank * rows, (rank + 1) * rows)
                (torch.nn.functional.cross_entropy(model(x[mine]), y[mine]) / k).backward()

            if how == "no_sync":
                with model.no_sync():
                    for j in range(k - 1):
                        micro(j)
            else:
                model.set_requires_gradient_sync(False)
                for j in range(k - 1):
                    micro(j)
                model.set_requires_gradient_sync(True)
            assert all(p.grad is None for p in model.parameters()), "reduced without sync"
            micro(k - 1)
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(torch.cat([x for x, _ in xs])),
                                              torch.cat([y for _, y in xs])).backward()
            ref_opt.step()
        assert_equal_to(model, ref, f"accumulation by {how}")


def _memory(rank: int, world: int) -> dict[str, Any]:
    """The gathered parameters of a model whose root holds none: at most two units."""
    from swarmfd.torch import fsdp

    model = shard(mlp(seed=rank), units=(0, 2, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, range(2), rank, world)
    return fsdp.memory_stats(model)


def _mixed_precision(rank: int, world: int) -> None:
    """bfloat16 compute, float32 master weights and reduction: close to float32."""
    import swarmfd.torch as sft
    from swarmfd.torch import fsdp

    policy = sft.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32)
    model = shard(mlp(seed=rank, dtype=torch.float32), mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sent = []
    real = fsdp.fd.all_gather

    def spy(x: Any, *args: Any, **kw: Any) -> Any:
        sent.append(x.dtype.itemsize)
        return real(x, *args, **kw)

    fsdp.fd.all_gather = spy
    try:
        train(model, opt, range(3), rank, world, torch.float32)
    finally:
        fsdp.fd.all_gather = real
    assert sent and set(sent) == {2}, f"the all-gathers moved {set(sent)}-byte elements"
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())
    ref = mlp(0, torch.float32)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train(ref, ref_opt, range(3), dtype=torch.float32)
    assert_equal_to(model, ref, "bfloat16 compute", rtol=0.05, atol=0.02)


def _save(rank: int, world: int, folder: str) -> None:
    """A fully_shard model with Adam and a DDP model with ZeRO(AdamW) save after 3 steps;
    get_state_dict gives rank 0 the optimizer state of the plain optimizer."""
    import swarmfd as fd
    import swarmfd.torch as sft

    model = shard(mlp(seed=rank))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, range(3), rank, world)
    sft.checkpoint.save(Path(folder) / "fsdp", model, opt)
    _, got = sft.get_state_dict(model, opt)
    ref, ref_opt = reference("adam", range(3))
    if fd.get_rank() == 0:
        want = ref_opt.state_dict()
        for i, (name, _) in enumerate(ref.named_parameters()):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][name][key], want["state"][i][key],
                                           **TIGHT)
        assert got["param_groups"][0]["params"] == [n for n, _ in ref.named_parameters()]
    ddp = sft.DistributedDataParallel(mlp(seed=rank), bucket_cap_mb=0.0005,
                                      first_bucket_mb=0.0002)
    zero = sft.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=0.01,
                                       weight_decay=0.1)
    assert len(zero.buckets) > 1
    train(ddp, zero, range(3), rank, world)
    sft.checkpoint.save(Path(folder) / "zero", ddp, zero)


def _killed_mid_backward(rank: int, world: int, victim: int) -> str:
    """The victim dies between two units' backward; every survivor's backward raises."""
    model = shard(mlp(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, range(1), rank, world)
    if rank == victim:  # dies when backward reaches the middle block's output
        def arm(module: Any, args: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))

        model[2].register_forward_hook(arm)
    try:
        train(model, opt, range(1, 2), rank, world)
    except Exception:
        return traceback.format_exc()
    return "backward returned"


def _job_n3(rank: int, world: int, folder: str) -> dict[str, Any]:
    import swarmfd as fd

    torch.set_num_threads(1)
    _equal_training(rank, world, [("sgd", True), ("adam", True), ("adamw", True),
                                  ("sgd", False), ("adam", False)])
    _accumulation(rank, world)
    _mixed_precision(rank, world)
    stats = _memory(rank, world)
    _save(rank, world, folder)
    fd.barrier()
    return {"stats": stats, "lost": _killed_mid_backward(rank, world, victim=1)}


def _load_and_continue(rank: int, world: int, folder: str) -> None:
    """What N=3 saved, loaded into fresh optimizers (of other hyperparameters, which the
    checkpoint's replace) here, continues as the one process does; also across wrappers
    (ZeRO's checkpoint into fully_shard) and through get/set_state_dict."""
    import swarmfd.torch as sft

    for saved, name, wrap in (("fsdp", "adam", "fsdp"), ("zero", "adamw", "zero"),
                              ("zero", "adamw", "fsdp")):
        cls, kw = OPTIMIZERS[name]
        if wrap == "fsdp":
            model = shard(mlp(seed=7))
            opt = cls(model.parameters(), lr=0.5)
        else:
            model = sft.DistributedDataParallel(mlp(seed=7))
            opt = sft.ZeroRedundancyOptimizer(model.parameters(), cls, lr=0.5)
        sft.checkpoint.load(Path(folder) / saved, model, opt)
        assert opt.param_groups[0]["lr"] == kw["lr"]
        train(model, opt, range(3, 5), rank, world)
        ref, _ = reference(name, range(5))
        assert_equal_to(model, ref, f"{saved} checkpoint into {wrap} at N={world}")
    fresh = shard(mlp(seed=9))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    ref, ref_opt = reference("adam", range(3))
    sft.set_state_dict(fresh, fresh_opt, ref.state_dict(), ref_opt.state_dict())
    train(fresh, fresh_opt, range(3, 5), rank, world)
    train(ref, ref_opt, range(3, 5))
    assert_equal_to(fresh, ref, f"set_state_dict of torch's own dicts at N={world}")


def _job_n2(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    _equal_training(rank, world, [("adam", True), ("sgd", False), ("adamw", True),
                                  ("adamw", False)])
    _load_and_continue(rank, world, folder)


def test_fsdp_trains_as_one_process_and_resumes_at_any_size(tmp_path: Path) -> None:
    """N=3 on shared memory, N=2 over TCP, then N=1 in this process (see the module
    docstring); at N=3 the gathered parameters never exceed two units, and a rank
    killed mid-backward is named by every survivor."""
    folder = str(tmp_path)
    out = run_ranks_raw(_job_n3, 3, folder, timeout=150, group_timeout=20,
                        env=transport_env("shm"))
    assert 1 not in out, "the victim reported back: it was not killed"
    for r in (0, 2):
        assert r in out, f"rank {r} did not finish (hung?):\n{out.stacks}"
        ok, res = out[r]
        assert ok, res
        lost = res["lost"]
        assert "PeerLostError" in lost and "rank 1" in lost and "backward" in lost, lost
        stats = res["stats"]
        assert stats["peak_unsharded"] <= 2 * stats["largest_unit"], stats
        assert stats["params"] <= stats["unsharded_total"] / 3 + 3 * 8 * 2, stats
    run_ranks(_job_n2, 2, folder, timeout=150, env=transport_env("tcp"))
    import swarmfd as fd

    fd.init()
    try:
        _load_and_continue(0, 1, folder)
    finally:
        fd.cleanup()
