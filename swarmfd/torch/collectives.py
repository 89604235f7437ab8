"""Collectives over tensors: what torch code passes, moved by the core's collectives.

``swarmfd.all_reduce`` and friends already take CPU tensors (zero-copy numpy views).
These wrappers add what the core leaves to the torch integration (see
:mod:`swarmfd.torch._tensors`): bfloat16 (reduced in float32), generators and dicts of
tensors, a clear error for a None element or a CUDA tensor, and
:func:`all_reduce_gradients` for a module's or an iterable's parameters.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

import swarmfd as fd

from ._tensors import Staged, Work, bits, check_cpu, flatten, reducible

T = TypeVar("T")


def all_reduce(tensors: T, op: str = "sum", *, group: Any = None,
               async_op: bool = False) -> T | Work:
    """Reduce ``tensors`` across the group, in place, and return them (or a :class:`Work`).

    ``tensors``: a tensor, a list/tuple/generator of tensors or a dict of them (a
    generator is consumed; the list of its tensors is returned). All tensors of one
    dtype travel as one fused buffer. bfloat16 is reduced in float32 and rounded once.
    ``op``: ``"sum"``, ``"mean"`` (``"avg"``), ``"prod"``, ``"min"``, ``"max"``.
    """
    items = flatten(tensors, "all_reduce")
    for what, t in items:
        reducible(t, what, "all_reduce")
    result: Any = tensors if isinstance(tensors, (torch.Tensor, list, tuple, dict)) \
        else [t for _, t in items]
    staged = Staged([t for _, t in items])
    arrays = staged.arrays[0] if isinstance(tensors, torch.Tensor) else staged.arrays
    core_op = "mean" if op in ("avg", "average") else op
    if not items:
        return Work(None, result=result) if async_op else result
    if not async_op:
        fd.all_reduce(arrays, op=core_op, group=group)
        staged.finish()
        return result
    return Work(fd.all_reduce(arrays, op=core_op, group=group, async_op=True),
                staged.finish, result)


def broadcast(tensors: T, src: int = 0, *, group: Any = None,
              async_op: bool = False) -> T | Work:
    """Copy rank ``src``'s ``tensors`` into every rank's (in place) and return them.

    Accepts what :func:`all_reduce` accepts, and any dtype (bfloat16 and bool move as
    their bits). A dict's keys must be the same on every rank (a ``state_dict`` of the
    same model is).
    """
    items = flatten(tensors, "broadcast")
    result: Any = tensors if isinstance(tensors, (torch.Tensor, list, tuple, dict)) \
        else [t for _, t in items]
    if not items:
        return Work(None, result=result) if async_op else result
    arrays = [bits(t) for _, t in items]
    x: Any = arrays[0] if isinstance(tensors, torch.Tensor) else arrays
    if not async_op:
        fd.broadcast(x, src=src, group=group)
        return result
    return Work(fd.broadcast(x, src=src, group=group, async_op=True), None, result)


def _named_parameters(params: Any, fn: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        return [(f"parameter {n!r}", p) for n, p in params.named_parameters()]
    if isinstance(params, torch.Tensor):
        return [("the parameter", params)]
    out = []
    for i, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):  # named_parameters()
            out.append((f"parameter {p[0]!r}", p[1]))
        else:
            out.append((f"parameter {i}", p))
    for what, p in out:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"swarmfd.torch.{fn}: {what} is a {type(p).__name__}, expected a "
                            "tensor (pass module.parameters() or a module)")
    return out


def all_reduce_gradients(params: Any, op: str = "mean", *, group: Any = None,
                         skip_missing: bool = False) -> None:
    """Average (``op``) the ``.grad`` of ``params`` across the group, in place, fused.

    ``params``: a module, ``module.parameters()``, ``module.named_parameters()`` or a
    list of tensors. A parameter whose grad is None is an error naming it (a rank
    would otherwise reduce fewer tensors than its peers), unless ``skip_missing``,
    where parameters without a gradient are left out (they must then be the same
    parameters on every rank: the fused buffers must agree).
    """
    grads = []
    for what, p in _named_parameters(params, "all_reduce_gradients"):
        if not p.requires_grad:
            continue
        if p.grad is None:
            if skip_missing:
                continue
            raise TypeError(f"swarmfd.torch.all_reduce_gradients: {what} "
                            f"({str(p.dtype).removeprefix('torch.')}{list(p.shape)}) has no "
                            "gradient (grad is None): it took no part in the loss, or "
                            "backward() has not run; pass skip_missing=True to leave such "
                            "parameters out on every rank")
        grads.append(check_cpu(p.grad, f"the gradient of {what}", "all_reduce_gradients"))
    all_reduce(grads, op=op, group=group)
