"""Elastic training with torch: :class:`TorchState` and :class:`ElasticSampler`.

::

    model = sft.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = sft.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
    state = sft.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)

    @fd.elastic.run
    def train(state): ...

:class:`TorchState` is :class:`swarmfd.elastic.State` with a model and its optimizer:

* ``commit()`` copies the parameters and buffers and the optimizer's state (one copy,
  in memory); ``restore()`` puts them back in place; ``sync()`` sends rank 0's to
  every rank (a replacement gets the state the others resumed from).
* After a change of the world, a :class:`~swarmfd.torch.DistributedDataParallel` is
  built again on the new world (buckets, hooks; its constructor's collectives, which
  a replacement's own constructor matches), and so is a
  :class:`~swarmfd.torch.ZeroRedundancyOptimizer` (its shards laid out for the new
  size, after the DDP, whose buckets it takes, as when made after it).
* A ZeroRedundancyOptimizer's state is split over the ranks, so each commit also sends a
  copy of this rank's shard to the rank before it (a ring: every rank holds the next
  one's): the shard of a lost rank comes back from its neighbour, and every rank
  rebuilds the whole state, then keeps its new part. If both copies of a shard were
  lost between two commits (a rank and the one before it), every survivor raises
  :class:`~swarmfd.ElasticError` saying so.
* Sharded parameters (``fully_shard``) are out of scope: a loss there ends the job with
  an error that says so.

:class:`ElasticSampler` is :class:`swarmfd.elastic.ElasticSampler` as a torch
``Sampler``, for a ``DataLoader``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.data import Sampler

import swarmfd as fd
from swarmfd import elastic as _core

from ._tensors import bits
from .ddp import DDP_OWNERS, ZERO_OWNERS, DistributedDataParallel, live_owner
from .state import _decode, _encode, broadcast_optimizer_state
from .zero import ZeroRedundancyOptimizer

__all__ = ["ElasticSampler", "TorchState"]

#: The tag of the commits' shard copies (point to point, to the rank before).
SHARD_TAG = 0x5E1A


class ElasticSampler(_core.ElasticSampler, Sampler[int]):
    """:class:`swarmfd.elastic.ElasticSampler` as a torch Sampler (``DataLoader(dataset,
    batch_size=B, sampler=sampler)``; ``record_batch(batch, B)`` after each step)."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        _core.ElasticSampler.__init__(self, dataset, shuffle=shuffle, seed=seed,
                                      drop_last=drop_last)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _keep(value: Any, previous: Any) -> Any:
    """A copy of ``value`` (tensors, and dicts, lists and tuples of them and of plain
    values: a state_dict), written into ``previous``'s tensors where they fit: a commit
    then allocates nothing (fresh pages for a new copy each time cost 3-4x the copy
    itself, benchmarks/elastic.py's MLP: docs/elastic.md)."""
    if isinstance(value, torch.Tensor):
        if (isinstance(previous, torch.Tensor) and previous is not value
                and previous.shape == value.shape and previous.dtype == value.dtype):
            return previous.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        before = previous if isinstance(previous, dict) else {}
        return {k: _keep(v, before.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        before = previous if isinstance(previous, (list, tuple)) and \
            len(previous) == len(value) else [None] * len(value)
        kept = [_keep(v, b) for v, b in zip(value, before, strict=True)]
        return tuple(kept) if isinstance(value, tuple) else kept
    return copy.deepcopy(value)


class TorchState(_core.State):
    """An elastic state with a torch ``model`` and its ``optimizer`` (module docstring);
    ``**values`` as :class:`swarmfd.elastic.State`'s."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **values: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchState: model must be a torch.nn.Module, got "
                            f"{type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TorchState: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        super().__init__(**values)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_torch_saved", {})

    def _ddp(self) -> DistributedDataParallel | None:
        m = self.model
        if isinstance(m, DistributedDataParallel) or m is None:
            return m
        return live_owner(DDP_OWNERS, list(m.parameters()))

    def _zero(self) -> ZeroRedundancyOptimizer | None:
        opt = self.optimizer
        if isinstance(opt, ZeroRedundancyOptimizer):
            return opt
        if self.model is None:
            return None
        return live_owner(ZERO_OWNERS, list(self.model.parameters()))

    def save(self) -> None:
        super().save()
        old = self._torch_saved
        saved: dict[str, Any] = {}
        if self.model is not None:
            saved["model"] = _keep(_tensors(self.model), old.get("model"))
        zero = self._zero()
        if zero is not None:
            saved["zero"] = _save_shards(zero)
        elif self.optimizer is not None:
            saved["optimizer"] = _keep(self.optimizer.state_dict(), old.get("optimizer"))
        object.__setattr__(self, "_torch_saved", saved)

    def restore(self) -> None:
        super().restore()
        saved = self._torch_saved
        if self.model is not None and "model" in saved:
            with torch.no_grad():
                for t, c in zip(_tensors(self.model), saved["model"], strict=True):
                    t.copy_(c)
        if "optimizer" in saved and self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        # A ZeroRedundancyOptimizer's shards come back in sync(), once the new world's
        # layout is known (reset() lays it out).

    def reset(self) -> None:
        """Build the DDP, then the ZeroRedundancyOptimizer, again for the new world."""
        ddp = self._ddp()
        if ddp is not None:
            ddp._reset_world()
        zero = self._zero()
        if zero is not None:
            zero._reset_world()

    def sync(self) -> None:
        self._sync_values()
        if fd.is_initialized():
            if self.model is not None and fd.get_world_size() > 1:
                tensors = [bits(t.detach()) for t in _tensors(self.model)]
                if tensors:
                    fd.broadcast(tensors, src=0)
            zero = self._zero()
            if zero is not None:  # (a world of one too: its layout changed)
                _restore_shards(zero, self._torch_saved.get("zero"))
            elif self.optimizer is not None and fd.get_world_size() > 1:
                broadcast_optimizer_state(self.optimizer, src=0)
        self.save()

    def _check_elastic_loss(self, exc: BaseException) -> None:
        """fully_shard is out of scope under elastic: a loss there ends the job."""
        if self.model is None:
            return
        for m in self.model.modules():
            if any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
                raise fd.ElasticError(
                    "a rank was lost, and this model's parameters are sharded (fully_shard): "
                    "an elastic job cannot re-form a world of sharded parameters; use "
                    "DistributedDataParallel (with ZeroRedundancyOptimizer to shard the "
                    f"optimizer state), or checkpoints and --max-restarts. The loss: {exc}"
                ) from exc


# -- a ZeroRedundancyOptimizer's shards ---------------------------------------------------------


def _save_shards(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's shard of the state, and a copy of the next rank's (a ring exchange:
    a collective of every commit)."""
    parts, scalars = zero._shards()
    own = _as_bytes(parts)
    n, r = zero._size, zero._rank
    nxt = None
    if n > 1:
        nxt = torch.empty_like(own)
        works = [fd.irecv(nxt.numpy(), src=(r + 1) % n, tag=SHARD_TAG),
                 fd.isend(own.numpy(), dst=(r - 1) % n, tag=SHARD_TAG)]
        for w in works:
            w.wait()
    return {"own": own, "next": nxt, "size": n, "rank": r, "has_state": zero._has_state,
            "steps": zero._steps,
            "scalars": {gi: {k: _encode(v, f"state {k!r}") for k, v in entries.items()}
                        for gi, entries in scalars.items()}}


def _as_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    flat = [p.contiguous().view(torch.uint8) for p in parts if p.numel()]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _restore_shards(zero: ZeroRedundancyOptimizer, saved: dict[str, Any] | None) -> None:
    """After a change of the world: every rank gets the whole state from the shards the
    survivors saved (each from its owner, else from the copy the rank before it kept),
    and keeps its new part (a collective; a replacement takes part with nothing)."""
    mine = None if saved is None else {k: saved[k] for k in ("size", "rank", "has_state",
                                                             "steps", "scalars")}
    rows = fd.all_gather_object(mine)
    held = [row for row in rows if row is not None]
    if not held:
        return  # the first sync: nothing was committed yet
    sizes = {row["size"] for row in held}
    if len(sizes) != 1:
        raise fd.ElasticError(f"ZeroRedundancyOptimizer: the survivors' commits are of worlds "
                              f"of {sorted(sizes)} ranks: they cannot be put together")
    old = sizes.pop()
    if old == len(rows) and all(row is not None and row["rank"] == i
                                for i, row in enumerate(rows)):
        return  # the same world: every rank holds its own shard already
    providers = _providers(rows, old)
    if not any(row["has_state"] for row in held):
        return
    shard_bytes = saved["own"].numel() if saved is not None else None
    shards = _exchange(providers, saved, _shard_bytes(zero, old, shard_bytes))
    wholes = _wholes(zero, shards, old)
    row = held[0]
    zero._load_wholes(wholes, {int(gi): {k: _decode(v) for k, v in entries.items()}
                               for gi, entries in row["scalars"].items()})
    zero._steps = max(zero._steps, int(row["steps"]))


def _providers(rows: list[Any], old: int) -> dict[int, tuple[int, str]]:
    """Where each shard of the old world comes from: (new rank, "own" or "next")."""
    own = {row["rank"]: i for i, row in enumerate(rows) if row is not None}
    providers, missing = {}, []
    for s in range(old):
        if s in own:
            providers[s] = (own[s], "own")
        elif old > 1 and (s - 1) % old in own:
            providers[s] = (own[(s - 1) % old], "next")
        else:
            missing.append(s)
    if missing:
        pairs = ", ".join(f"rank {s} and rank {(s - 1) % old}" for s in missing)
        raise fd.ElasticError(
            f"ZeroRedundancyOptimizer: both copies of the optimizer state's shard(s) "
            f"{missing} were lost ({pairs} of the world of {old} were lost between two "
            "commits: each shard lives on its rank and on the rank before it): the "
            "optimizer state cannot be put together again; restart from a checkpoint")
    return providers


def _shard_bytes(zero: ZeroRedundancyOptimizer, old: int, known: int | None) -> int:
    """The bytes of one shard of a world of ``old`` ranks (every shard has as many)."""
    total = 0
    for b in zero._buckets:
        part = -(-b.numel // old)
        itemsize = torch.empty((), dtype=b.dtype).element_size()
        total += part * itemsize * len(zero._bucket_keys(b))
    if known is not None and known != total:
        raise fd.ElasticError(f"ZeroRedundancyOptimizer: a saved shard of {known} bytes, "
                              f"expected {total} (another model or optimizer?)")
    return total


def _exchange(providers: dict[int, tuple[int, str]], saved: dict[str, Any] | None,
              size: int) -> dict[int, torch.Tensor]:
    """Every shard of the old world on every rank: each provider broadcasts the shards it
    holds (its own, or the copy of the next rank's), in one buffer."""
    me = fd.get_rank()
    shards: dict[int, torch.Tensor] = {}
    for p in sorted({i for i, _ in providers.values()}):
        mine = sorted(s for s, (i, _) in providers.items() if i == p)
        if p == me:
            assert saved is not None
            buf = torch.cat([saved[providers[s][1]] for s in mine])
        else:
            buf = torch.empty(size * len(mine), dtype=torch.uint8)
        fd.broadcast(buf.numpy(), src=p)
        for k, s in enumerate(mine):
            shards[s] = buf[k * size:(k + 1) * size]
    return shards


def _wholes(zero: ZeroRedundancyOptimizer, shards: dict[int, torch.Tensor], old: int
            ) -> list[torch.Tensor]:
    """The whole flat state of each bucket and entry (as ZeroRedundancyOptimizer._shards
    orders them), from the old world's shards."""
    pieces: list[list[torch.Tensor]] = []
    for s in range(old):
        at, mine = 0, []
        raw = shards[s]
        for b in zero._buckets:
            part = -(-b.numel // old)
            nbytes = part * torch.empty((), dtype=b.dtype).element_size()
            for _key in zero._bucket_keys(b):
                mine.append(raw[at:at + nbytes].view(b.dtype))
                at += nbytes
        pieces.append(mine)
    return [torch.cat([pieces[s][j] for s in range(old)]) for j in range(len(pieces[0]))]

