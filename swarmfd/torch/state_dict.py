"""get_state_dict / set_state_dict: a model's and its optimizer's state, whole or sharded.

torch's names (``torch.distributed.checkpoint.state_dict``), for every model swarmfd
trains: sharded by :func:`~swarmfd.torch.fully_shard`, a plain module or a
DistributedDataParallel, with a plain torch optimizer or a
:class:`~swarmfd.torch.ZeroRedundancyOptimizer`::

    model_sd, optim_sd = get_state_dict(model, optimizer)      # collective; on rank 0
    if fd.get_rank() == 0:
        safetensors.torch.save_file(model_sd, "model.safetensors")
    set_state_dict(model, optimizer, model_sd, optim_sd)        # every rank, full dicts

``get_state_dict(full=True)`` gives rank 0 (of the model's group) the keys of the
unsharded module's ``state_dict()``, every tensor whole, and the optimizer's state
keyed by those names (``{"state": {name: {...}}, "param_groups": [{..., "params":
[names]}]}``, as torch's); the other ranks get empty dicts. It streams: the sharded
tensors are gathered to rank 0 one unit (or bucket) at a time, and the largest tensor
of each unit keeps the buffer it was gathered into (a view: ``torch.save`` would write
the buffer's other elements too; safetensors writes the view), so rank 0 holds at most
the result plus the other tensors of one unit. ``full=False`` gives every rank what it holds (a
sharded parameter as its 1-D piece).

``set_state_dict`` loads on every rank: a full dict (what get_state_dict gave, a plain
``model.state_dict()``, keys of torch's DDP with ``module.``), this rank's own
``full=False`` dict, and an optimizer state dict keyed by names or torch's own format
(parameter numbers: ``optimizer.state_dict()``, a ZeroRedundancyOptimizer's consolidated
one). Each rank keeps its part.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

import swarmfd as fd

from . import _layout
from ._layout import Flat, Layout
from ._tensors import bits
from .state import _decode
from .zero import ZeroRedundancyOptimizer


def get_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   full: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state, optimizer_state)``: see the module docstring. Collective: call it
    on every rank of the model's group. Without an optimizer its dict is empty."""
    layout = _layout.model_layout(model, "get_state_dict")
    if optimizer is not None:
        _layout.optimizer_layout(layout, optimizer, "get_state_dict")
    if not full:
        return _local_state(layout, optimizer)
    rank, _ = _layout.world(layout)
    tensors = gather_full(layout)
    if rank != 0:
        return {}, {}
    model_state = {k: tensors[layout.aliases.get(f"model/{k}", f"model/{k}")]
                   for k in layout.keys}
    return model_state, _optimizer_dict(layout, optimizer, tensors)


def gather_full(layout: Layout) -> dict[str, torch.Tensor]:
    """Every logical tensor of ``layout`` whole, on group rank 0 (empty elsewhere): the
    flats one at a time (a gather of equal parts each), the wholes from rank 0's own."""
    rank, _ = _layout.world(layout)
    check_same_flats(layout, "get_state_dict")
    out: dict[str, torch.Tensor] = {}
    for flat in layout.flats:
        data = _gather_flat(flat)
        if data is None:
            continue
        # The largest tensor keeps the gathered buffer itself (a view of it; no copy),
        # the others are copied out: rank 0 peaks at the result plus the small ones.
        keep = max(flat.items, key=lambda i: i.numel, default=None) \
            if flat.whole is None else None
        for item in flat.items:
            t = data[item.offset:item.offset + item.numel]
            out[item.key] = (t if item is keep else t.clone()).view(item.shape)
        del data
    if rank == 0:
        for w in layout.wholes:
            out[w.key] = w.tensor.clone()
    return out


def _gather_flat(flat: Flat) -> torch.Tensor | None:
    """The whole flat buffer on group rank 0 (None elsewhere)."""
    if flat.whole is not None:
        return flat.whole if flat.rank == 0 else None
    mine = flat.packed()
    out = torch.empty((flat.size, flat.part), dtype=flat.dtype) if flat.rank == 0 else None
    fd.gather(bits(mine), out=bits(out) if out is not None else None, group=flat.group,
              group_dst=0)
    return out.reshape(-1) if out is not None else None


def check_same_flats(layout: Layout, what: str) -> None:
    """Every rank must lay out the same flats (their collectives pair up): a clear error
    when an optimizer has state on some ranks only."""
    if fd.get_world_size(layout.group) == 1:
        return
    mine = [f.items[0].key if f.items else "" for f in layout.flats]
    every = fd.all_gather_object(mine, group=layout.group)
    for r, theirs in enumerate(every):
        if theirs != mine:
            raise RuntimeError(f"swarmfd.torch.{what}: rank {r} holds other sharded tensors "
                               f"than this rank ({len(theirs)} against {len(mine)}: an "
                               "optimizer that stepped on some ranks only?)")


def _optimizer_dict(layout: Layout, optimizer: torch.optim.Optimizer | None,
                    tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if optimizer is None or layout.optimizer is None:
        return {}
    info = layout.optimizer
    state: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("optim/"):
            name, _, skey = key[len("optim/"):].rpartition("/")
            state.setdefault(name, {})[skey] = t
    for name, values in info["values"].items():
        state.setdefault(name, {}).update({k: _decode(v) for k, v in values.items()})
    groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
               "params": list(names)}
              for g, names in zip(optimizer.param_groups, _group_names(info), strict=True)]
    return {"state": {n: state[n] for n in info["params"] if n in state},
            "param_groups": groups}


def _group_names(info: dict[str, Any]) -> list[list[str]]:
    return [g["params"] for g in info["param_groups"]]


def _local_state(layout: Layout, optimizer: torch.optim.Optimizer | None
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``full=False``: what this rank holds, under the module's keys."""
    model_state = {}
    for k in layout.keys:
        key = layout.aliases.get(f"model/{k}", f"model/{k}")
        model_state[k] = layout.targets[key][1].detach()
    if optimizer is None:
        return model_state, {}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ValueError("get_state_dict(full=False): a ZeroRedundancyOptimizer's shards "
                         "span parameters; save them with swarmfd.torch.checkpoint.save, or "
                         "take full=True")
    info = layout.optimizer
    assert info is not None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {name: {k: v.detach() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                    for k, v in optimizer.state.get(p, {}).items()}
             for p, name in zip(params, info["params"], strict=True)
             if optimizer.state.get(p)}
    groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
               "params": list(names)}
              for g, names in zip(optimizer.param_groups, _group_names(info), strict=True)]
    return model_state, {"state": state, "param_groups": groups}


# -- loading -------------------------------------------------------------------------------


class Source:
    """Where a load reads from: the logical tensors (``model/<name>``,
    ``optim/<name>/<state>``) by ranges, and the optimizer's structure.

    ``names()``: every key there; ``shape(key)``: the tensor's shape (None: not
    there); ``read(key, start, stop, out=None)``: elements [start, stop) of it
    flattened (written into ``out``, a 1-D tensor of as many, when given);
    ``optimizer``: None or {"class",
    "param_groups": [hyperparameters with "params": names], "state": {name: {key:
    None for a tensor, else the value}}}.
    """

    optimizer: dict[str, Any] | None = None

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...] | None:
        raise NotImplementedError

    def read(self, key: str, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def read_all(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        assert shape is not None
        return self.read(key, 0, math.prod(shape)).view(shape)


class DictSource(Source):
    """Full (or this rank's ``full=False``) state dicts in memory."""

    def __init__(self, model_state: Any, optimizer_state: Any,
                 layout: Layout) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        if model_state is not None:
            if not isinstance(model_state, dict):
                raise TypeError("set_state_dict: model_state must be a dict (a state_dict), "
                                f"got {type(model_state).__name__}")
            keys = list(model_state)
            if keys and all(k.startswith("module.") for k in keys):  # torch's DDP's keys
                model_state = {k[len("module."):]: v for k, v in model_state.items()}
            for k, v in model_state.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"set_state_dict: model_state[{k!r}] is a "
                                    f"{type(v).__name__}, expected a tensor")
                self.tensors[f"model/{k}"] = v
        if optimizer_state:
            self.optimizer = self._optimizer(optimizer_state, layout)

    def _optimizer(self, sd: Any, layout: Layout) -> dict[str, Any]:
        if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list) or \
                not isinstance(sd.get("state"), dict):
            raise ValueError("set_state_dict: optimizer_state must be a dict with 'state' "
                             "and 'param_groups', as get_state_dict or optimizer.state_dict() "
                             "give")
        ours = layout.optimizer
        if ours is None:
            raise ValueError("set_state_dict: optimizer_state given without an optimizer")
        groups = sd["param_groups"]
        by_number = any(not isinstance(n, str) for g in groups for n in g.get("params", []))
        names: dict[Any, str] = {}
        if by_number:  # torch's format: parameters numbered in our optimizer's order
            theirs = [n for g in groups for n in g["params"]]
            if len(theirs) != len(ours["params"]):
                raise ValueError(f"set_state_dict: the optimizer state has {len(theirs)} "
                                 f"parameters, this optimizer {len(ours['params'])}")
            names = dict(zip(theirs, ours["params"], strict=True))
        state: dict[str, dict[str, Any]] = {}
        for k, entry in sd["state"].items():
            name = k
            if by_number:
                number = int(k) if isinstance(k, str) and k.isdigit() else k
                if number not in names:
                    raise ValueError(f"set_state_dict: the optimizer state has state for "
                                     f"parameter {k!r}, which its param_groups do not list")
                name = names[number]
            state[name] = {}
            for key, v in entry.items():
                if isinstance(v, torch.Tensor):
                    self.tensors[f"optim/{name}/{key}"] = v
                    state[name][key] = None
                else:
                    state[name][key] = v
        out_groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [names.get(n, n) if by_number else n for n in g["params"]]}
                      for g in groups]
        return {"class": None, "param_groups": out_groups, "state": state, "encoded": False}

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...] | None:
        t = self.tensors.get(key)
        return None if t is None else tuple(t.shape)

    def read(self, key: str, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        data = self.tensors[key].detach().reshape(-1)[start:stop]
        return data if out is None else out.copy_(data)


def set_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   model_state: dict[str, Any] | None,
                   optimizer_state: dict[str, Any] | None = None) -> None:
    """Load ``model_state`` into ``model`` and ``optimizer_state`` into ``optimizer``, on
    every rank (see the module docstring for what they may be); each rank keeps its
    part. Either dict may be None (not loaded)."""
    layout = _layout.model_layout(model, "set_state_dict")
    if optimizer is not None:
        _layout.optimizer_layout(layout, optimizer, "set_state_dict")
    source = DictSource(model_state, optimizer_state, layout)
    if model_state is not None:
        load_model(layout, source, "set_state_dict", local_ok=True)
    if optimizer is not None and source.optimizer is not None:
        load_optimizer(layout, optimizer, source, "set_state_dict", local_ok=True)


def _read_range(source: Source, key: str, full: tuple[int, ...], lo: int, hi: int,
                local_ok: bool, what: str, name: str,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [lo, hi) of ``key`` (flattened), whose whole shape is ``full`` (into
    ``out`` when given); a dict of this rank's own (``full=False``) holds just them."""
    shape = source.shape(key)
    assert shape is not None
    if shape == full:
        return source.read(key, lo, hi, out)
    if local_ok and shape == (hi - lo,):
        return source.read(key, 0, hi - lo, out)
    where = "checkpoint" if what.startswith("checkpoint") else "state dict"
    raise ValueError(f"swarmfd.torch.{what}: {name} has shape {list(shape)} in the "
                     f"{where}, the model's is {list(full)}")


def load_model(layout: Layout, source: Source, what: str, local_ok: bool = False) -> None:
    """Every model tensor of this rank from ``source`` (all of them must be there, and
    nothing else)."""
    kept = set(layout.targets)
    present = {k for k in source.names() if k.startswith("model/")}
    missing = sorted(k for k in kept if k not in present and not any(
        a in present for a, c in layout.aliases.items() if c == k))
    unexpected = sorted(k for k in present if k not in kept and k not in layout.aliases)
    if missing or unexpected:
        raise ValueError(f"swarmfd.torch.{what}: the state does not fit the model: missing "
                         f"{_names(missing)}, unexpected {_names(unexpected)}")
    with torch.no_grad():
        for key, (kind, tensor, lo, hi, _) in layout.targets.items():
            src = key if key in present else next(
                a for a, c in layout.aliases.items() if c == key and a in present)
            name = key[len("model/"):]
            # Read straight into the tensor (a piece bumps its shard's version: the unit
            # gathers it again before its next forward).
            into = tensor.view(-1) if tensor.is_contiguous() else None
            data = _read_range(source, src, layout.shapes[key], lo, hi, local_ok and
                               kind == "piece", what, f"parameter {name!r}", into)
            if into is None:
                tensor.copy_(data.view(tensor.shape))


def _names(keys: list[str]) -> str:
    if not keys:
        return "nothing"
    shown = ", ".join(repr(k.split("/", 1)[1]) for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def load_optimizer(layout: Layout, optimizer: torch.optim.Optimizer, source: Source,
                   what: str, local_ok: bool = False) -> None:
    """The optimizer's state from ``source`` (a freshly built optimizer, or one whose
    state is replaced): its hyperparameters, and each rank's part of its state."""
    ours, theirs = layout.optimizer, source.optimizer
    assert ours is not None and theirs is not None
    if theirs.get("class") and theirs["class"] != ours["class"]:
        raise TypeError(f"swarmfd.torch.{what}: the checkpoint holds {theirs['class']} "
                        f"state, the optimizer is a {ours['class']}")
    mine = [g["params"] for g in ours["param_groups"]]
    got = [g["params"] for g in theirs["param_groups"]]
    if mine != got:
        raise ValueError(f"swarmfd.torch.{what}: the optimizer's parameter groups differ "
                         f"from the checkpoint's ({[len(g) for g in got]} parameters per "
                         f"group there, {[len(g) for g in mine]} here)"
                         + ("" if [len(g) for g in got] != [len(g) for g in mine] else
                            ": other parameters, or another order"))
    for g, tg in zip(optimizer.param_groups, theirs["param_groups"], strict=True):
        for k, v in tg.items():
            if k != "params":
                g[k] = _decode(v) if theirs.get("encoded", True) else copy.deepcopy(v)
    elementwise = _layout.elementwise_keys(optimizer)
    group_of = {n: gi for gi, names in enumerate(mine) for n in names}
    order = ours["params"]
    state = theirs["state"]

    def entries(i: int) -> dict[str, Any]:
        name = order[i]
        out = {}
        for k, v in state.get(name, {}).items():
            if v is not None:
                out[k] = _decode(v) if theirs.get("encoded", True) else v
            elif _elementwise(source.shape(f"optim/{name}/{k}"),
                              layout.shapes[f"model/{name}"], k in elementwise[group_of[name]]):
                out[k] = None
            else:
                out[k] = source.read_all(f"optim/{name}/{k}").clone()
        return out

    def read(i: int, key: str, start: int, stop: int) -> torch.Tensor:
        name = order[i]
        return _read_range(source, f"optim/{name}/{key}", layout.shapes[f"model/{name}"],
                           start, stop, local_ok, what, f"state {key!r} of {name!r}")

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer._load(entries, read)
        return
    _load_plain(layout, optimizer, entries, read)


def _elementwise(shape: tuple[int, ...] | None, param: tuple[int, ...], probe: bool) -> bool:
    """Whether an optimizer state of ``shape`` is kept per element of a parameter of
    shape ``param``: as the optimizer class's probe says, else by its shape (never a
    0-d one: a step count)."""
    return shape not in (None, ()) and (probe or shape == param)


def _load_plain(layout: Layout, optimizer: torch.optim.Optimizer,
                entries: Callable[[int], dict[str, Any]],
                read: Callable[[int, str, int, int], torch.Tensor]) -> None:
    """A torch optimizer over whole parameters or fully_shard's pieces: its own
    load_state_dict with this rank's part of each elementwise state."""
    info = layout.optimizer
    assert info is not None
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(info["params"]):
        _, _, lo, hi, _ = layout.targets[f"model/{name}"]
        entry = {}
        for k, v in entries(i).items():
            entry[k] = read(i, k, lo, hi).clone() if v is None else v
        if entry:
            state[i] = entry
    groups, start = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    targets = [layout.targets[f"model/{n}"] for n in info["params"]]
    for i, entry in state.items():
        kind, tensor, lo, hi, _ = targets[i]
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() and kind == "whole" and \
                    v.numel() == tensor.numel():
                entry[k] = v.view(tensor.shape)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


__all__ = ["DictSource", "Source", "gather_full", "get_state_dict", "load_model",
           "load_optimizer", "set_state_dict"]
