"""Which part of each tensor of a model and its optimizer this rank holds.

The checkpoints (:mod:`swarmfd.torch.checkpoint`) and the state dicts
(:func:`swarmfd.torch.get_state_dict`) see a model and its optimizer as logical
tensors, named ``model/<name>`` (the module's ``state_dict`` key) and
``optim/<name>/<state>`` (``exp_avg``, ``step``...), each held by this rank as either

* a :class:`Whole`: every rank holds all of it (a parameter of a replicated model, a
  buffer, an optimizer's step count), or
* pieces of a :class:`Flat`: tensors laid out one after the other in one flat buffer
  of N equal parts, rank r holding part r: a unit of
  :func:`~swarmfd.torch.fully_shard` (its parameters, and per elementwise state an
  optimizer's state of its pieces), a bucket of
  :class:`~swarmfd.torch.ZeroRedundancyOptimizer` (its optimizer state; its parameters,
  which every rank also holds whole).

What holds what is decided here once, for every wrapper swarmfd has: a module
sharded by fully_shard, a plain module or a DistributedDataParallel (swarmfd's or
torch's), a plain torch optimizer, a ZeroRedundancyOptimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import swarmfd as fd

from . import fsdp
from .ddp import ZERO_OWNERS, DistributedDataParallel, live_owner
from .state import _encode
from .zero import ZeroRedundancyOptimizer, _state_kinds


@dataclass
class Item:
    """One logical tensor of a :class:`Flat`: elements [offset, offset + numel) of it."""

    key: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass
class Flat:
    """Logical tensors in one flat buffer of ``size`` parts of ``part`` elements, part r
    on group rank r. ``pieces``: this rank's data, (flat offset, 1-D tensor) pairs inside
    its part; ``whole``: the whole flat buffer when this rank holds it (ZeRO's params)."""

    group: Any
    size: int
    rank: int
    part: int
    dtype: torch.dtype
    items: list[Item]
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    whole: torch.Tensor | None = None

    def packed(self) -> torch.Tensor:
        """This rank's part as one tensor of ``part`` elements (zeros where no piece is)."""
        lo = self.rank * self.part
        if len(self.pieces) == 1 and self.pieces[0][0] == lo and \
                self.pieces[0][1].numel() == self.part:
            return self.pieces[0][1].detach()
        out = torch.zeros(self.part, dtype=self.dtype)
        for start, t in self.pieces:
            out[start - lo:start - lo + t.numel()].copy_(t.detach().reshape(-1))
        return out


@dataclass
class Whole:
    key: str
    tensor: torch.Tensor


@dataclass
class Layout:
    """A model (and maybe its optimizer) as logical tensors: see the module docstring.

    ``aliases``: every ``model/`` key of a tied parameter to the one its data is kept
    under. ``targets``: per kept model key, the tensor of this rank's data and what it
    is (``whole``; ``piece`` with its [lo, hi) of the flattened parameter and its
    unit). ``optimizer``: the optimizer's structure (see :func:`optimizer_layout`).
    """

    group: Any
    flats: list[Flat]
    wholes: list[Whole]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    keys: list[str]  # the module's state_dict keys, in order
    aliases: dict[str, str]
    targets: dict[str, tuple[str, torch.Tensor, int, int, Any]]
    names: dict[int, str]  # id(parameter or piece) -> its kept model key's name
    optimizer: dict[str, Any] | None = None


def unwrap(model: Any) -> torch.nn.Module:
    """The module whose ``state_dict`` keys name the tensors (DDP's inner module)."""
    if isinstance(model, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)):
        return model.module
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    return model


def model_layout(model: Any, what: str) -> Layout:
    """The layout of ``model``'s parameters and persistent buffers on this rank."""
    module = unwrap(model)
    sd = module.state_dict(keep_vars=True)
    keys, aliases, kept = list(sd), {}, {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"swarmfd.torch.{what}: state_dict entry {k!r} is a "
                            f"{type(v).__name__}, not a tensor (extra state is not supported)")
        if id(v) in kept:
            aliases[f"model/{k}"] = f"model/{kept[id(v)]}"
        else:
            kept[id(v)] = k
    layout = Layout(None, [], [], {}, {}, keys, aliases, {}, dict(kept))
    in_flat: set[int] = set()
    for u in [m.__dict__[fsdp.UNIT] for m in module.modules() if fsdp.UNIT in m.__dict__]:
        layout.group = u.group if layout.group is None else layout.group
        u.reshard()
        items = []
        for prm in u.params:
            key = f"model/{kept[id(prm.sharded)]}"
            items.append(Item(key, tuple(prm.shape), prm.offset, prm.numel))
            layout.targets[key] = ("piece", prm.sharded, prm.lo, prm.hi, u)
            layout.shapes[key], layout.dtypes[key] = tuple(prm.shape), u.dtype
            in_flat.add(id(prm.sharded))
        layout.flats.append(Flat(u.group, u.size, u.rank, u.part, u.dtype, items,
                                 [(u.rank * u.part, u.shard)]))
    params = [v for v in sd.values() if isinstance(v, torch.nn.Parameter)]
    zero = live_owner(ZERO_OWNERS, params)
    if zero is not None:  # its buckets: each rank saves the part whose state it owns
        zero._wait_params()
        layout.group = zero._sg
        for b, flat in zip(zero._buckets, zero._flat, strict=True):
            lo = zero._rank * b.part
            items = []
            for s in b.slots:
                key = f"model/{kept[id(s.param)]}"
                items.append(Item(key, tuple(s.param.shape), s.offset, s.numel))
                layout.targets[key] = ("whole", s.param, 0, s.numel, None)
                layout.shapes[key], layout.dtypes[key] = tuple(s.param.shape), b.dtype
                in_flat.add(id(s.param))
            layout.flats.append(Flat(zero._sg, zero._size, zero._rank, b.part, b.dtype, items,
                                     [(lo, flat[lo:lo + b.part])], whole=flat))
    for k, v in sd.items():
        key = f"model/{k}"
        if key in aliases or id(v) in in_flat:
            continue
        layout.shapes[key], layout.dtypes[key] = tuple(v.shape), v.dtype
        layout.wholes.append(Whole(key, v.detach()))
        layout.targets[key] = ("whole", v, 0, v.numel(), None)
    return layout


def _piece_index(piece: torch.Tensor) -> int:
    return getattr(piece, fsdp.PIECE)[1]


def optimizer_layout(layout: Layout, optimizer: Any, what: str) -> None:
    """Add ``optimizer``'s tensors to ``layout`` (flats and wholes) and its structure:
    ``layout.optimizer`` = {"class", "param_groups" (hyperparameters JSON-encoded, and
    "params": names), "params": every name in order, "values": {name: {key: encoded}}
    (non-tensor state)}; "class" is the class whose state format it is (ZeRO's
    optimizer class)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"swarmfd.torch.{what}: optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    order = []
    for i, p in enumerate(params):
        name = layout.names.get(id(p))
        if name is None:
            moved = getattr(p, fsdp.MOVED, None)
            raise ValueError(
                f"swarmfd.torch.{what}: parameter {i} of the optimizer is not a parameter "
                "of the model" + (f" (it is {moved} as it was before fully_shard replaced "
                                  "it: build the optimizer after fully_shard)" if moved else ""))
        order.append(name)
    groups, start = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: _encode(v, f"hyperparameter {k!r}", what)
                          for k, v in g.items() if k != "params"},
                       "params": order[start:start + n]})
        start += n
    cls = optimizer._optimizer_class if isinstance(optimizer, ZeroRedundancyOptimizer) \
        else type(optimizer)  # (ZeRO's state is its optimizer class's)
    info: dict[str, Any] = {"class": cls.__name__, "param_groups": groups,
                            "params": order, "values": {}}
    layout.optimizer = info
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        _zero_layout(layout, optimizer, order, what)
    else:
        _plain_layout(layout, optimizer, params, order, what)


def _plain_layout(layout: Layout, optimizer: torch.optim.Optimizer, params: list[Any],
                  order: list[str], what: str) -> None:
    """A torch optimizer over pieces (their state in the units' flats) or whole
    parameters (their state whole)."""
    info = layout.optimizer
    assert info is not None
    per_unit: dict[tuple[int, str], Flat] = {}
    for p, name in zip(params, order, strict=True):
        target = layout.targets[f"model/{name}"]
        for key, v in optimizer.state.get(p, {}).items():
            okey = f"optim/{name}/{key}"
            if not isinstance(v, torch.Tensor):
                info["values"].setdefault(name, {})[key] = _encode(
                    v, f"state {key!r} of {name!r}", what)
                continue
            if target[0] == "piece" and v.shape == p.shape and v.dim() == 1:
                unit = target[4]
                flat = per_unit.get((id(unit), key))
                if flat is None:
                    flat = per_unit[(id(unit), key)] = Flat(
                        unit.group, unit.size, unit.rank, unit.part, v.dtype,
                        [Item(f"optim/{layout.names[id(q.sharded)]}/{key}", tuple(q.shape),
                              q.offset, q.numel) for q in unit.params])
                    layout.flats.append(flat)
                prm = unit.params[_piece_index(p)]
                if v.numel():
                    flat.pieces.append((prm.offset + prm.lo, v.detach()))
                layout.shapes[okey] = tuple(prm.shape)
            else:
                layout.wholes.append(Whole(okey, v.detach()))
                layout.shapes[okey] = tuple(v.shape)
            layout.dtypes[okey] = v.dtype


def _zero_layout(layout: Layout, zero: ZeroRedundancyOptimizer, order: list[str],
                 what: str) -> None:
    """ZeRO: its elementwise state per bucket (a flat each), its scalars whole."""
    info = layout.optimizer
    assert info is not None
    zero._wait_params()
    index = {id(p): i for i, p in enumerate(zero._params)}
    scalars = zero._local_scalars() if zero._has_state else {}
    for b, runs, local in zip(zero._buckets, zero._runs, zero._local, strict=True):
        groups = sorted({zero._group_of[id(s.param)] for s in b.slots})
        keys = sorted({k for gi in groups for k, kind in zero._kinds[gi].items()
                       if kind == "elementwise"}) if zero._has_state else []
        for key in keys:
            items = [Item(f"optim/{order[index[id(s.param)]]}/{key}", tuple(s.param.shape),
                          s.offset, s.numel) for s in b.slots]
            pieces = []
            for run in runs if local is not None else []:
                v = local.state.get(run.tensor, {}).get(key)
                if isinstance(v, torch.Tensor):
                    pieces.append((run.start, v.detach()))
            layout.flats.append(Flat(zero._sg, zero._size, zero._rank, b.part, b.dtype,
                                     items, pieces))
            for s in b.slots:
                name = order[index[id(s.param)]]
                layout.shapes[f"optim/{name}/{key}"] = tuple(s.param.shape)
                layout.dtypes[f"optim/{name}/{key}"] = b.dtype
        for s in b.slots:
            name = order[index[id(s.param)]]
            for key, v in scalars.get(zero._group_of[id(s.param)], {}).items():
                okey = f"optim/{name}/{key}"
                if isinstance(v, torch.Tensor):
                    layout.wholes.append(Whole(okey, v.detach()))
                    layout.shapes[okey], layout.dtypes[okey] = tuple(v.shape), v.dtype
                else:
                    info["values"].setdefault(name, {})[key] = _encode(
                    v, f"state {key!r} of {name!r}", what)


def elementwise_keys(optimizer: torch.optim.Optimizer) -> list[set[str]]:
    """Per parameter group, the state keys ``optimizer``'s class keeps per element
    (found by stepping a probe, as ZeroRedundancyOptimizer does)."""
    cls = optimizer._optimizer_class if isinstance(optimizer, ZeroRedundancyOptimizer) \
        else type(optimizer)
    out = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        try:
            kinds = _state_kinds(cls, hyper)
        except Exception:  # an optimizer the probe cannot step: judge by shapes later
            kinds = {}
        out.append({k for k, kind in kinds.items() if kind == "elementwise"})
    return out


def world(layout: Layout) -> tuple[int, int]:
    """(rank, size) in the layout's group."""
    return fd.get_rank(layout.group), fd.get_world_size(layout.group)


__all__ = ["Flat", "Item", "Layout", "Whole", "elementwise_keys", "model_layout",
           "optimizer_layout", "unwrap", "world"]
