"""Broadcast a model's or an optimizer's state from one rank: JSON structure, array data.

``broadcast_parameters(module, src)`` makes every replica equal to ``src``'s (what a
restore from a checkpoint that only one rank read needs); ``broadcast_optimizer_state``
does the same for an optimizer, including ranks whose optimizer has no state yet
(it never stepped): the structure (parameter groups, which state entries each
parameter has, their dtypes and shapes, the non-tensor values) travels as one JSON
object, the tensors as arrays, fused per dtype. Nothing is ever pickled: a rank
builds tensors only of the dtypes and shapes the JSON names.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

import swarmfd as fd

from . import collectives

#: The largest JSON description accepted (an optimizer of 100 000 parameters with a few
#: entries each is ~10 MB of JSON; beyond that something is wrong).
MAX_JSON_BYTES = 64 << 20

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def broadcast_parameters(params: Any, src: int = 0, *, group: Any = None) -> None:
    """Copy rank ``src``'s parameters (and buffers) into every rank's, in place.

    ``params``: a module (its parameters and buffers), a ``state_dict`` or other dict
    of tensors, or an iterable of tensors such as ``module.parameters()``. Every rank
    must pass the same structure (the same model). Any dtype, bfloat16 included.
    """
    if isinstance(params, torch.nn.Module):
        seen: set[int] = set()
        tensors = []
        for t in [*params.parameters(), *params.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
        collectives.broadcast(tensors, src=src, group=group)
    else:
        collectives.broadcast(params, src=src, group=group)


def _encode(value: Any, where: str, fn: str = "broadcast_optimizer_state") -> Any:
    """A JSON-able form of a hyperparameter or a non-tensor state value (``fn``: the
    function to name in the error)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list":
                [_encode(v, where, fn) for v in value]}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"scalar_tensor": value.item(),
                "dtype": str(value.dtype).removeprefix("torch.")}
    raise TypeError(f"swarmfd.torch.{fn}: {where} is a "
                    f"{type(value).__name__}, which has no JSON form; supported: numbers, "
                    "strings, bools, None, tuples and lists of them")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "float" in value:
            return float(value["float"])
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        if "list" in value:
            return [_decode(v) for v in value["list"]]
        if "scalar_tensor" in value:
            return torch.tensor(value["scalar_tensor"], dtype=_dtype(value["dtype"]))
        raise ValueError(f"unknown encoded value {value!r}")
    return value


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"swarmfd.torch.broadcast_optimizer_state: dtype {name!r} is not one "
                         f"of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _describe(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The optimizer's state as (JSON-able structure, the tensors in order)."""
    sd = opt.state_dict()
    tensors: list[torch.Tensor] = []
    state: dict[str, Any] = {}
    for index, entry in sd["state"].items():
        items = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                items[key] = {"tensor": len(tensors),
                              "dtype": str(value.dtype).removeprefix("torch."),
                              "shape": list(value.shape)}
                tensors.append(value.detach())
            else:
                items[key] = {"value": _encode(value, f"state {key!r} of parameter {index}")}
        state[str(index)] = items
    groups = [{k: [int(x) for x in v] if k == "params" else
               _encode(v, f"param_groups[{i}][{k!r}]") for k, v in g.items()}
              for i, g in enumerate(sd["param_groups"])]
    return {"state": state, "param_groups": groups}, tensors


def _send_json(obj: dict[str, Any] | None, src: int, group: Any) -> dict[str, Any]:
    me = fd.get_rank() == src
    data = json.dumps(obj, allow_nan=False).encode() if me else b""
    length = np.array([len(data)], dtype=np.int64)
    fd.broadcast(length, src=src, group=group)
    n = int(length[0])
    if not 0 < n <= MAX_JSON_BYTES:
        raise ValueError(f"swarmfd.torch.broadcast_optimizer_state: a description of {n} "
                         f"bytes (at most {MAX_JSON_BYTES})")
    buf = np.frombuffer(data, dtype=np.uint8).copy() if me else np.empty(n, dtype=np.uint8)
    fd.broadcast(buf, src=src, group=group)
    out = json.loads(buf.tobytes().decode())
    if not isinstance(out, dict):
        raise ValueError("swarmfd.torch.broadcast_optimizer_state: the description is not "
                         "a JSON object")
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, src: int = 0, *,
                              group: Any = None) -> None:
    """Make every rank's ``optimizer`` state (and hyperparameters) equal to ``src``'s.

    ``src`` is a world rank (default 0). The optimizers must be of the same class over
    the same parameters (the same model), with the same number of parameter groups
    and parameters per group; a rank whose optimizer never stepped gets the state
    created. ``ZeroRedundancyOptimizer`` shards its state instead: use its
    ``consolidate_state_dict``/``load_state_dict``.
    """
    from .zero import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError("swarmfd.torch.broadcast_optimizer_state: a ZeroRedundancyOptimizer "
                        "holds a different part on each rank; use consolidate_state_dict() "
                        "and load_state_dict()")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("swarmfd.torch.broadcast_optimizer_state expects a torch.optim."
                        f"Optimizer, got {type(optimizer).__name__}")
    if fd.get_world_size(group) == 1:
        return
    if group is not None and src not in tuple(group.ranks):
        raise ValueError(f"swarmfd.torch.broadcast_optimizer_state: src={src} is not a rank "
                         f"of the group (world ranks {tuple(group.ranks)})")
    root = src
    me = fd.get_rank() == root
    structure, tensors = _describe(optimizer) if me else ({}, [])
    desc = _send_json({"optimizer": type(optimizer).__name__, **structure} if me else None,
                      root, group)
    mine = optimizer.state_dict()
    if desc.get("optimizer") != type(optimizer).__name__:
        raise TypeError(f"swarmfd.torch.broadcast_optimizer_state: rank {root} has a "
                        f"{desc.get('optimizer')}, this rank a {type(optimizer).__name__}")
    groups = desc["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine["param_groups"]]:
        raise ValueError("swarmfd.torch.broadcast_optimizer_state: the parameter groups "
                         f"differ: rank {root} has "
                         f"{[len(g['params']) for g in groups]} parameters per group, this "
                         f"rank {[len(g['params']) for g in mine['param_groups']]}")
    if not me:
        count = sum(1 for e in desc["state"].values() for v in e.values() if "tensor" in v)
        tensors = [torch.empty(0)] * count
        for entry in desc["state"].values():
            for v in entry.values():
                if "tensor" in v:
                    shape = [int(d) for d in v["shape"]]
                    tensors[v["tensor"]] = torch.empty(shape, dtype=_dtype(v["dtype"]))
    collectives.broadcast(tensors, src=root, group=group)
    if me:
        return
    state: dict[int, dict[str, Any]] = {}
    for index, entry in desc["state"].items():
        state[int(index)] = {k: tensors[v["tensor"]] if "tensor" in v else _decode(v["value"])
                             for k, v in entry.items()}
    param_groups = []
    for theirs, ours in zip(groups, mine["param_groups"], strict=True):
        g = {k: _decode(v) for k, v in theirs.items() if k != "params"}
        g["params"] = ours["params"]
        param_groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
