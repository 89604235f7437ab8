"""TorchState under losses: DDP built again on the new world, a ZeroRedundancyOptimizer's
shards back from the ranks' neighbours (or the error when both copies are gone), a
replacement that wraps its model while the survivors rebuild theirs
(tests/launch_scripts/elastic_torch.py checks the optimizer's whole state after every
change of the world against what the last commit recorded).
"""

from __future__ import annotations

import re
from pathlib import Path

from .support.harness import require
from .test_elastic import run_elastic_job

torch = require("torch", "pip install torch==2.13.0, the CPU wheel")

import swarmfd.torch as sft  # noqa: E402

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "elastic_torch.py")
RESULT = re.compile(rb"RESULT rank=(\d+) world=(\d+) same=(\w+) min=(\d+) max=(\d+)")


def test_a_torch_state_restores_the_model_and_the_optimizer_in_place() -> None:
    """A world of one: commit, two steps, restore: parameters and momentum as committed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()

    step()
    state = sft.elastic.TorchState(model, opt, epoch=0)
    state.commit()
    weight = model.weight.detach().clone()
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    step()
    step()
    state.restore()
    assert torch.equal(model.weight.detach(), weight)
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)


def test_zero_shards_come_back_from_the_neighbour_and_both_copies_lost_is_an_error(
        tmp_path: Path) -> None:
    """N=4, Adam sharded (ZeRO), no replacements: the last rank dies (its shard comes
    back from the rank before it); then the first two die at once, and with them both
    copies of a shard: the survivor says so."""
    code, out = run_elastic_job(tmp_path, "-n", "4", "--elastic", "--max-restarts", "0",
                                env={"ZERO": "1", "KILLS": "5:last,12:first,12:middle",
                                     "EPOCHS": "3"}, script=SCRIPT, timeout=240)
    text = out.decode(errors="replace")
    assert code == 1, text
    assert text.count("VERIFIED") >= 3, text  # every survivor had the committed state back
    assert re.search(r"both copies of the optimizer state's shard\(s\) \[1\] were lost \(rank "
                     r"1 and rank 0 of the world of 3", text), text


def test_a_replacement_joins_a_zero_job_while_the_survivors_rebuild_ddp(
        tmp_path: Path) -> None:
    """N=3, --min-n 3: the survivors wait for the replacement, which builds DDP and ZeRO
    while they build theirs again; the state is put together across the three, and the
    job ends with identical replicas and every sample seen as often as without a loss."""
    code, out = run_elastic_job(tmp_path, "-n", "3", "--elastic", "--min-n", "3",
                                env={"ZERO": "1", "KILLS": "5:middle", "EPOCHS": "2"},
                                script=SCRIPT, timeout=240)
    text = out.decode(errors="replace")
    assert code == 0, text
    assert text.count("VERIFIED") == 3 and "this replacement joined the job" in text, text
    results = [m.groups() for m in RESULT.finditer(out)]
    assert len(results) == 3, text
    assert all(r[1:] == (b"3", b"True", b"2", b"2") for r in results), text


def test_a_loss_under_fully_shard_ends_the_job_saying_it_is_out_of_scope() -> None:
    """A model with a unit of fully_shard (an FSDPModule in its classes): TorchState's
    verdict on a loss is an ElasticError that says so (fully_shard's own class is
    recognised by name: swarmfd.torch.elastic does not import it)."""
    import swarmfd as fd

    class FSDPModule(torch.nn.Module):  # the name fully_shard's units carry
        pass

    class FSDPLinear(torch.nn.Linear, FSDPModule):
        pass

    state = sft.elastic.TorchState(torch.nn.Sequential(FSDPLinear(2, 2)))
    lost = fd.PeerLostError("lost rank 1")
    try:
        state._check_elastic_loss(lost)
    except fd.ElasticError as exc:
        assert "fully_shard" in str(exc) and "lost rank 1" in str(exc)
    else:
        raise AssertionError("no ElasticError")
    sft.elastic.TorchState(torch.nn.Linear(2, 2))._check_elastic_loss(lost)  # DDP: goes on
