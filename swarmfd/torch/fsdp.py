"""fully_shard: FSDP2's API over swarmfd, parameters, gradients and optimizer state sharded.

::

    for block in model.blocks:
        fully_shard(block)          # a unit per block
    fully_shard(model)              # then the root: what no block holds
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's shards
    loss_fn(model(x), y).backward() # each shard's .grad: its part of the mean gradient
    opt.step()

What a unit holds, and when:

* **Between steps** 1/N of its parameters: the unit's parameters, flattened in
  registration order into one buffer padded to a multiple of N, split into N equal
  parts; rank r keeps part r (DeepSpeed's even flat partition, as
  :class:`~swarmfd.torch.ZeroRedundancyOptimizer` splits its buckets). The module's
  parameters are replaced, under their own names, by 1-D ``nn.Parameter`` pieces of
  that part (a piece may be empty), so ``model.parameters()`` hands an optimizer
  this rank's shards and the gradients it steps on are this rank's part of the mean.
* **In forward** the unit's part is all-gathered into a full buffer before its
  forward (with ``overlap``, the next unit's all-gather is issued asynchronously
  before this one computes), the module computes with full-shape parameters that are
  views of it, and after its forward the buffer's storage is released
  (``reshard_after_forward``; the root and the forward's last unit keep theirs, which
  backward needs first).
* **In backward** a hook on the unit's outputs gathers it again (with ``overlap``,
  and issues the previous unit's all-gather); each parameter's gradient is kept where
  autograd made it, and once all are in the gathered buffer is released and the
  unit's gradient is reduce-scattered (mean) into the shards' ``.grad``, read from
  those tensors in place (no copy into a flat buffer). No rank keeps the whole model
  or its whole gradient: at most about two units' full parameters (or one's
  parameters and its gradient) at a time.
* ``reshard_after_forward=False`` is ZeRO-2: parameters kept from forward to
  backward, gradients and optimizer state sharded.

Mixed precision (``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``): the shards stay float32 (the master weights the
optimizer steps); each rank casts its part to bfloat16 before the all-gather (half the
bytes move), forward and backward compute in bfloat16, gradients are reduced in
float32. numpy has no bfloat16, so a bfloat16 gradient is always reduced in float32.

Accumulation: ``model.no_sync()`` or ``model.set_requires_gradient_sync(False)`` keep
each unit's unreduced gradient (in the reduce dtype) across backward passes; the next
backward with synchronisation reduces the sum once.

Not supported: parameters of more than one dtype in a unit, a parameter shared by two
units (fully_shard the module that holds both), activation checkpointing that reruns a
unit's forward in backward, CUDA tensors. Checkpoints: :mod:`swarmfd.torch.checkpoint`
and :func:`swarmfd.torch.get_state_dict`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

import swarmfd as fd
from swarmfd import _internal
from swarmfd.config import usable_cores

from . import _buckets
from ._tensors import FLOAT_DTYPES, bits, check_cpu, keep_freed, memory

#: The attribute of a wrapped module holding its unit.
UNIT = "_swarmfd_fsdp_unit"
#: The attribute of a sharded parameter (a piece): (weak reference to its unit, index).
PIECE = "_swarmfd_fsdp_piece"
#: The attribute of an original parameter that fully_shard replaced by its piece: its
#: name and unit, for messages. Its data is freed; an optimizer still holding it is an
#: error at its step.
MOVED = "_swarmfd_fsdp_moved"
#: Units' worth of memory a backward frees and allocates again from one unit to the next
#: (the gathered parameters, their gradients, the reduced part, the next unit's): what
#: the C allocator keeps rather than return to the kernel (:func:`_tensors.keep_freed`).
_WORKING_UNITS = 4


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: ``param_dtype`` the dtype of the gathered parameters
    (forward and backward compute in it), ``reduce_dtype`` that of the gradient
    reduction (float32 for a bfloat16 one: numpy has no bfloat16), ``output_dtype``
    the dtype the root's floating outputs are cast to, ``cast_forward_inputs`` casts
    floating inputs of every unit to ``param_dtype``. None: the parameters' own."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class _Param:
    """One distinct parameter of a unit: its place in the flat buffer, this rank's piece,
    its full-shape view of the gathered buffer, where the module holds it."""

    __slots__ = ("hi", "index", "lo", "name", "numel", "offset", "ready", "requires_grad",
                 "shape", "sharded", "start", "unsharded", "where")

    def __init__(self, index: int, name: str, p: torch.Tensor,
                 where: list[tuple[torch.nn.Module, str]]) -> None:
        self.index, self.name, self.where = index, name, where
        self.shape = p.shape
        self.numel = p.numel()
        self.requires_grad = p.requires_grad
        self.offset = 0  # in the unit's flat buffer
        self.lo = self.hi = 0  # this rank's elements of it: [lo, hi) of the flattened param
        self.start = 0  # where they are in this rank's shard
        self.sharded: torch.nn.Parameter = None  # type: ignore[assignment]
        self.unsharded: torch.nn.Parameter = None  # type: ignore[assignment]
        self.ready = False


class _Context:
    """What the units of one root share: their order, the forward and backward passes."""

    def __init__(self) -> None:
        self.units: list[_Unit] = []  # tree pre-order, the root first
        self.initialized = False
        self.order: list[_Unit] = []  # the last forward's order: the next one's prefetches
        self.ran: list[_Unit] = []  # this forward's units, in order
        self.depth = 0
        self.in_backward = False
        self.reductions: list[tuple[_Unit, Any, torch.Tensor]] = []  # issued, unfinished
        self.overlap = False
        self.live = 0  # bytes of gathered parameters and unsharded gradients now
        self.peak = 0

    def hold(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


class FSDPModule:
    """What ``fully_shard`` adds to a module's class (as FSDP2's ``FSDPModule``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Whether backward reduces the gradients (False: they accumulate, unreduced, in
        each unit until a backward with synchronisation)."""
        for unit in _units_under(self, recurse):
            unit.sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients unreduced (as DDP's)."""
        units = _units_under(self, True)
        old = [u.sync for u in units]
        for u in units:
            u.sync = False
        try:
            yield
        finally:
            for u, s in zip(units, old, strict=True):
                u.sync = s

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        for unit in _units_under(self, recurse):
            unit.reshard_after_forward = _check_bool(reshard_after_forward,
                                                     "reshard_after_forward")

    def unshard(self) -> None:
        """Gather this unit's parameters now (they stay until :meth:`reshard`)."""
        unit = _unit_of(self)
        unit.unshard(async_op=False)

    def reshard(self) -> None:
        """Free this unit's gathered parameters."""
        _unit_of(self).reshard()


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def _unit_of(module: Any) -> _Unit:
    return module.__dict__[UNIT]


def _units_under(module: Any, recurse: bool) -> list[_Unit]:
    if not recurse:
        return [_unit_of(module)]
    return [m.__dict__[UNIT] for m in module.modules() if UNIT in m.__dict__]


def _check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fully_shard: {what} must be True or False, got {value!r}")
    return value


def _child_units(module: torch.nn.Module) -> list[_Unit]:
    """The units directly below ``module`` (not those inside them)."""
    out: list[_Unit] = []

    def walk(m: torch.nn.Module) -> None:
        for c in m._modules.values():
            if c is None:
                continue
            if UNIT in c.__dict__:
                out.append(c.__dict__[UNIT])
            else:
                walk(c)

    walk(module)
    return out


def _own_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor,
                                                           list[tuple[torch.nn.Module, str]]]]:
    """(name, parameter, where it is held) of every distinct parameter under ``module``
    but not under a unit below it, in registration order."""
    found: dict[int, tuple[str, torch.Tensor, list[tuple[torch.nn.Module, str]]]] = {}
    seen: set[tuple[int, str]] = set()

    def walk(m: torch.nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if p is None or (id(m), name) in seen:
                continue
            seen.add((id(m), name))
            found.setdefault(id(p), (prefix + name, p, []))[2].append((m, name))
        for cname, c in m._modules.items():
            if c is not None and UNIT not in c.__dict__:
                walk(c, f"{prefix}{cname}.")

    walk(module, "")
    return list(found.values())


def fully_shard(module: torch.nn.Module, *, group: Any = None,
                reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None,
                overlap: bool | None = None) -> torch.nn.Module:
    """Shard ``module``'s parameters (those no unit below it holds) over ``group``, in
    place; returns ``module``, whose class is now also an :class:`FSDPModule`.

    Apply it to each block first, then to the root. Build the optimizer afterwards, on
    ``model.parameters()`` (this rank's shards). Group rank 0's values are every
    rank's starting point. See the module docstring for what is sharded when.
    ``overlap`` (the root's counts, as DDP's): whether the all-gather of the unit that
    runs next is issued asynchronously before this one computes and each unit's
    reduce-scatter runs asynchronously while backward goes on (else each collective
    blocks when its result is needed: where the ranks outnumber the cores an async
    collective only takes turns with the compute, at the cost of a progress thread's
    wake-ups); None: where every rank of the host has a core for its progress thread.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fully_shard expects a torch.nn.Module, got {type(module).__name__}")
    if UNIT in module.__dict__:
        raise RuntimeError(f"fully_shard: this {type(module).__name__} is sharded already; "
                           "apply fully_shard once per module")
    _check_bool(reshard_after_forward, "reshard_after_forward")
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise TypeError("fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    for what in ("param_dtype", "reduce_dtype", "output_dtype"):
        d = getattr(mp, what)
        if d is not None and d not in FLOAT_DTYPES:
            raise TypeError(f"fully_shard: mp_policy.{what}={d} is not one of {FLOAT_DTYPES}")
    children = _child_units(module)
    for child in children:
        if child.ctx.initialized:
            raise RuntimeError(
                f"fully_shard: {child.describe()} below this {type(module).__name__} has "
                "run forward already, as a root of its own; apply fully_shard to every "
                "block and then to the root before the model's first forward")
    if overlap is not None:
        _check_bool(overlap, "overlap")
    unit = _Unit(module, group, reshard_after_forward, mp)
    unit.overlap = overlap
    for child in children:
        child.parent = unit
    module.__class__ = _fsdp_class(type(module))
    module.__dict__[UNIT] = unit
    _install_step_check()
    return module


class _Unit:
    """One fully_shard'ed module: its layout, its shard, its gathered buffer, its hooks."""

    def __init__(self, module: torch.nn.Module, group: Any, reshard_after_forward: bool,
                 mp: MixedPrecisionPolicy) -> None:
        self.module_ref = weakref.ref(module)
        self.kind = type(module).__name__
        self.group = group
        self.size = fd.get_world_size(group)
        self.rank = fd.get_rank(group)
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.sync = True
        self.overlap: bool | None = None
        self.parent: _Unit | None = None
        self.ctx = _Context()
        self.ctx.units = [self]
        self.params: list[_Param] = []
        self._layout(module)
        self.dtype = self.bucket.dtype
        self.compute = mp.param_dtype or self.dtype
        self.reduce = mp.reduce_dtype or _buckets.comm_dtype(self.compute)
        if self.reduce is torch.bfloat16:
            self.reduce = torch.float32
        self.part = self.bucket.part
        self.padded = self.bucket.padded
        self._shard_from_rank0()
        self._views()
        self.gathered = False
        self.version = -1  # the shard's version counter when it was gathered
        self.work: Any = None  # an all-gather in flight
        self._send: torch.Tensor | None = None  # its input, when cast to the compute dtype
        self._reset_backward()
        self.acc: torch.Tensor | None = None  # the unreduced gradient of no_sync passes
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)  # this pass's
        self.kept = 0  # their bytes
        self.pad = torch.zeros(self.padded - self.bucket.numel, dtype=self.reduce).numpy()
        self.awaiting_backward = False
        self.handles = [module.register_forward_pre_hook(self._pre_forward, prepend=True,
                                                         with_kwargs=True),
                        module.register_forward_hook(self._post_forward)]

    def describe(self) -> str:
        return f"the unit of a {self.kind}"

    # -- construction -------------------------------------------------------------------

    def _layout(self, module: torch.nn.Module) -> None:
        own = _own_parameters(module)
        dtypes: dict[torch.dtype, str] = {}
        for name, p, _ in own:
            moved = getattr(p, MOVED, None)
            if moved is not None or hasattr(p, PIECE):
                held = moved if moved is not None else "another unit's shard"
                raise ValueError(
                    f"fully_shard: parameter {name!r} of this {type(module).__name__} is "
                    f"tied to {held}, which an earlier fully_shard put in another unit; a "
                    "parameter belongs to one unit: apply fully_shard to a module that "
                    "holds both uses (or untie them)")
            check_cpu(p, f"parameter {name!r}", "fully_shard")
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"fully_shard: parameter {name!r} has dtype {p.dtype}; "
                                f"expected one of {FLOAT_DTYPES}")
            dtypes.setdefault(p.dtype, name)
        if len(dtypes) > 1:
            (d1, n1), (d2, n2) = list(dtypes.items())[:2]
            raise TypeError(f"fully_shard: parameters of one unit must have one dtype: "
                            f"{n1!r} is {d1}, {n2!r} is {d2}; convert the module, or shard "
                            "the parts apart")
        dtype = next(iter(dtypes), torch.float32)
        self.bucket = _buckets.Bucket(0, dtype, self.size)
        for i, (name, p, where) in enumerate(own):
            slot = _buckets.Slot(p, name, i)
            self.bucket.add(slot)
            prm = _Param(i, name, p, where)
            prm.offset = slot.offset
            self.params.append(prm)

    def _shard_from_rank0(self) -> None:
        """This rank's part of group rank 0's parameters (scattered: every rank starts
        from the same values, as under DDP)."""
        b = self.bucket
        lo, hi = self.rank * b.part, (self.rank + 1) * b.part
        self.shard = torch.zeros(b.part, dtype=b.dtype)
        if self.size == 1 or b.numel == 0:
            with torch.no_grad():
                for s in b.slots:
                    a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                    if a < z:
                        self.shard[a - lo:z - lo].copy_(
                            s.param.detach().reshape(-1)[a - s.offset:z - s.offset])
            return
        chunks = None
        if self.rank == 0:
            flat = torch.zeros(b.padded, dtype=b.dtype)
            with torch.no_grad():
                for s in b.slots:
                    flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            chunks = bits(flat).reshape(self.size, b.part)
        fd.scatter(bits(self.shard), chunks, group=self.group, group_src=0)

    def _views(self) -> None:
        """The pieces (the module's parameters from now on) and the full-shape views of
        the gathered buffer; the original parameters' data is freed."""
        lo, hi = self.rank * self.part, (self.rank + 1) * self.part
        self.full = torch.empty(self.padded, dtype=self.compute)
        me = weakref.ref(self)
        for prm, s in zip(self.params, self.bucket.slots, strict=True):
            a, z = max(lo, prm.offset), min(hi, prm.offset + prm.numel)
            if a < z:
                prm.lo, prm.hi, prm.start = a - prm.offset, z - prm.offset, a - lo
            piece = torch.nn.Parameter(self.shard[prm.start:prm.start + prm.hi - prm.lo],
                                       requires_grad=prm.requires_grad)
            setattr(piece, PIECE, (me, prm.index))
            prm.sharded = piece
            full = torch.nn.Parameter(
                self.full[prm.offset:prm.offset + prm.numel].view(prm.shape),
                requires_grad=prm.requires_grad)
            prm.unsharded = full
            if prm.requires_grad:
                full.register_post_accumulate_grad_hook(_grad_hook(me, prm.index))
            original = s.param
            with torch.no_grad():
                original.data = torch.empty(0, dtype=original.dtype)
            setattr(original, MOVED, f"{prm.name!r} of a sharded {self.kind}")
            s.param = piece
        self._free_full()
        self._use(sharded=True)
        self.pending = sum(p.requires_grad for p in self.params)

    # -- gathering ----------------------------------------------------------------------

    def unshard(self, async_op: bool) -> None:
        """Issue (or run) the all-gather of the unit's parameters, unless they are here
        (and the shard did not change since: an optimizer step bumps its version)."""
        if self.gathered and self.shard._version != self.version:
            self.reshard()
        if self.gathered or self.work is not None or not self.params:
            return
        self.version = self.shard._version
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        self.ctx.hold(self.full.untyped_storage().nbytes())
        src = self.shard
        if self.compute != self.dtype:
            src = self._send = self.shard.to(self.compute)
        out = memory(self.full).reshape(self.size, self.part)
        work = fd.all_gather(bits(src), out=out, group=self.group, async_op=async_op)
        if async_op:
            self.work = work
        else:
            self._send = None
            self.gathered = True

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            try:
                work.wait()
            finally:
                self._send = None
            self.gathered = True

    def reshard(self) -> None:
        """Free the gathered parameters (waiting for an all-gather still writing them)."""
        try:
            self.wait()
        finally:
            if self.gathered:
                self.gathered = False
                self.ctx.live -= self.full.untyped_storage().nbytes()
                self._free_full()

    def _free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    def _use(self, sharded: bool) -> None:
        """Put the pieces (or the full-shape views) in the module."""
        for prm in self.params:
            p = prm.sharded if sharded else prm.unsharded
            for m, name in prm.where:
                m._parameters[name] = p

    # -- forward ------------------------------------------------------------------------

    def _pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = self.ctx
        if not ctx.initialized:
            _top(self)._lazy_init()
            ctx = self.ctx
        if ctx.depth == 0 or self is ctx.units[0]:  # (a forward that raised left depth)
            self._begin_forward()
        ctx.depth += 1
        ctx.ran.append(self)
        self.unshard(async_op=False)
        self.wait()
        self._use(sharded=False)
        nxt = len(ctx.ran)
        if ctx.overlap and nxt < len(ctx.order) and ctx.order[nxt] is not self:
            ctx.order[nxt].unshard(async_op=True)
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            cast = _caster(self.mp.param_dtype)
            args, kwargs = _apply(cast, args), _apply(cast, kwargs)
        return args, kwargs

    def _begin_forward(self) -> None:
        """The first unit of a forward pass: what an earlier pass left is cleared."""
        ctx = self.ctx
        if ctx.in_backward:  # a backward pass raised part-way: start afresh
            _recover(ctx)
        ctx.depth = 0
        ctx.ran = []

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        ctx = self.ctx
        self._use(sharded=True)
        ctx.depth -= 1
        training = torch.is_grad_enabled()
        if training:  # (a unit without parameters of its own still prefetches)
            self.awaiting_backward = self.pending > 0
            me = weakref.ref(self)
            for t in _tensors_in(output):
                if t.requires_grad:
                    t.register_hook(_pre_backward_hook(me))
        if ctx.depth == 0:
            self._end_forward(training)
        elif not training or (self.reshard_after_forward and ctx.order[-1] is not self):
            # (the forward's last unit is backward's first: it keeps its parameters)
            self.reshard()
        if self.mp.output_dtype is not None and ctx.depth == 0:
            output = _apply(_caster(self.mp.output_dtype), output)
        return output

    def _end_forward(self, training: bool) -> None:
        """The last unit of a forward: free what backward will not use first."""
        ctx = self.ctx
        if ctx.ran:
            ctx.order = list(ctx.ran)
        last = ctx.ran[-1] if ctx.ran else None
        for u in ctx.units:
            if not training or (u is not self and u is not last and (
                    u.reshard_after_forward or u not in ctx.ran)):
                u.reshard()

    def _lazy_init(self) -> None:
        """The root's first forward: its units in order, the check that it is the root."""
        _check_enclosing(self)
        ctx = self.ctx
        units: list[_Unit] = []
        module = self.module_ref()
        assert module is not None
        for m in module.modules():
            u = m.__dict__.get(UNIT)
            if u is not None and u not in units:
                units.append(u)
        for u in units:
            u.ctx = ctx
        ctx.units = units
        ctx.order = list(units)
        ctx.overlap = self.overlap if self.overlap is not None else \
            2 * fd.host_group().size <= usable_cores()
        largest = max((u.padded * max(u.full.element_size(), u.reduce.itemsize)
                       for u in units), default=0)
        keep_freed(largest, _WORKING_UNITS * largest)
        buffers = [bits(b) for b in module.buffers()]
        if buffers and self.size > 1:
            fd.broadcast(buffers, group=self.group, group_src=0)
        ctx.initialized = True

    # -- backward -----------------------------------------------------------------------

    def _reset_backward(self) -> None:
        self.backward_started = False
        self.reduced = False
        for prm in self.params:
            prm.ready = False
        self.pending = sum(p.requires_grad for p in self.params)

    def _pre_backward(self) -> None:
        ctx = self.ctx
        _begin_backward(ctx)
        if self.backward_started:
            return
        self.backward_started = True
        self.unshard(async_op=False)
        self.wait()
        if not ctx.overlap:
            return
        # The unit that ran before this one is the next to need its parameters (after
        # the forward's first unit, whose output is the last: the last one).
        i = len(ctx.ran) if ctx.ran and ctx.ran[0] is self else \
            max((k for k, u in enumerate(ctx.ran) if u is self), default=0)
        for u in reversed(ctx.ran[:i]):
            if u.awaiting_backward and not u.reduced:
                u.unshard(async_op=True)
                break

    def _on_grad(self, index: int) -> None:
        ctx = self.ctx
        _begin_backward(ctx)
        prm = self.params[index]
        p = prm.unsharded
        grad, p.grad = p.grad, None
        if prm.ready:
            raise RuntimeError(f"fully_shard: parameter {prm.name!r} received its gradient "
                               "twice in one backward pass (backward through the same graph "
                               "twice?)")
        if grad is not None:
            self._keep(index, grad)
        prm.ready = True
        self.pending -= 1
        if self.pending == 0:
            self.finish_gradients()

    def _keep(self, index: int, grad: torch.Tensor) -> None:
        """Keep a parameter's gradient where autograd made it (in the reduce dtype): the
        reduce-scatter reads it there, no copy into a flat buffer."""
        flat = grad.detach().reshape(-1)
        if flat.dtype != self.reduce:
            flat = flat.to(self.reduce)
        self.grads[index] = flat
        nbytes = flat.numel() * flat.element_size()
        self.kept += nbytes
        self.ctx.hold(nbytes)

    def finish_gradients(self) -> None:
        """Every gradient of the unit is in (or the backward ended): the gathered
        parameters go, and the gradient is reduce-scattered, or with synchronisation off
        kept."""
        ctx = self.ctx
        self.reduced = True
        self.awaiting_backward = False
        self.reshard()  # the parameters are not needed any more
        if not self.sync or self.acc is not None:  # add it to the unreduced gradient
            self._accumulate()
            if not self.sync:
                return
        out = torch.empty(self.part, dtype=self.reduce)
        if self.acc is not None:
            work = fd.reduce_scatter(self.acc.numpy(), out=out.numpy(), op="mean",
                                     group=self.group, async_op=ctx.overlap)
        else:
            work = _internal.reduce_scatter_parts(
                self._operands(), out.numpy(), op="mean", group=self.group,
                async_op=ctx.overlap)
        ctx.reductions.append((self, work, out))
        # At most one reduction in flight: the previous one's memory goes now.
        while len(ctx.reductions) > (1 if ctx.overlap else 0):
            _finish_reduction(*ctx.reductions.pop(0))

    def _accumulate(self) -> None:
        """Add the kept gradients into the unreduced gradient of the passes without
        synchronisation (made, zeros, by the first)."""
        if self.acc is None:
            self.acc = torch.zeros(self.padded, dtype=self.reduce)
            self.ctx.hold(self.acc.numel() * self.acc.element_size())
        with torch.no_grad():
            for prm, g in zip(self.params, self.grads, strict=True):
                if g is not None:
                    self.acc[prm.offset:prm.offset + prm.numel].add_(g)
        self._drop_kept()

    def _operands(self) -> list[np.ndarray]:
        """The unit's flat gradient as the arrays it is made of, in flat order: each
        parameter's gradient where autograd put it (zeros for one without), then the
        padding."""
        arrays = []
        for prm, g in zip(self.params, self.grads, strict=True):
            if prm.numel:
                arrays.append((g if g is not None else
                               torch.zeros(prm.numel, dtype=self.reduce)).numpy())
        if self.padded > self.bucket.numel:
            arrays.append(self.pad)
        return arrays

    def after_reduction(self, out: torch.Tensor) -> None:
        """The reduced part arrived: the shards' gradients, and the buffers go."""
        with torch.no_grad():
            for prm in self.params:
                if not prm.requires_grad:
                    continue
                view = out[prm.start:prm.start + prm.hi - prm.lo]
                if view.dtype != self.dtype:
                    view = view.to(self.dtype)
                piece = prm.sharded
                if piece.grad is None:
                    piece.grad = view
                else:
                    piece.grad.add_(view)
        self.reshard()
        self._drop_grads()

    def _drop_kept(self) -> None:
        """Release the kept gradients."""
        self.grads = [None] * len(self.params)
        self.ctx.live -= self.kept
        self.kept = 0

    def _drop_grads(self) -> None:
        """Release the kept gradients and the unreduced one."""
        self._drop_kept()
        if self.acc is not None:
            self.ctx.live -= self.acc.numel() * self.acc.element_size()
            self.acc = None


def _finish_reduction(unit: _Unit, work: Any, out: torch.Tensor) -> None:
    if work is not None and hasattr(work, "wait"):
        work.wait()
    unit.after_reduction(out)


def _begin_backward(ctx: _Context) -> None:
    if not ctx.in_backward:
        ctx.in_backward = True
        Variable._execution_engine.queue_callback(lambda: _end_backward(ctx))


def _end_backward(ctx: _Context) -> None:
    """The end of backward: what did not complete is reduced (missing gradients as
    zeros), every reduction waited for, every unit resharded."""
    try:
        for u in ctx.units:
            if u.awaiting_backward and not u.reduced:
                u.finish_gradients()
        while ctx.reductions:
            _finish_reduction(*ctx.reductions.pop(0))
    finally:
        ctx.in_backward = False
        for u in ctx.units:
            u.awaiting_backward = False
            u._reset_backward()
        for u in ctx.units:
            u.reshard()


def _recover(ctx: _Context) -> None:
    """After a backward that raised: wait for what is in flight, drop its state."""
    reductions, ctx.reductions = ctx.reductions, []
    for _, work, _ in reductions:
        with contextlib.suppress(Exception):
            if hasattr(work, "wait"):
                work.wait()
    for u in ctx.units:
        with contextlib.suppress(Exception):
            u.reshard()
        u._drop_kept()
        u.awaiting_backward = False
        u._reset_backward()
    ctx.in_backward = False
    ctx.depth = 0


def _grad_hook(me: weakref.ref[_Unit], index: int) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        unit = me()
        if unit is not None:
            unit._on_grad(index)

    return hook


def _pre_backward_hook(me: weakref.ref[_Unit]) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        unit = me()
        if unit is not None:
            unit._pre_backward()

    return hook


def _top(unit: _Unit) -> _Unit:
    while unit.parent is not None:
        unit = unit.parent
    return unit


def _check_enclosing(root: _Unit) -> None:
    """A root's first forward must not run inside a module whose own parameters are not
    sharded: that module is the real root, and fully_shard was not applied to it."""
    module = root.module_ref()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_call_impl" and code.co_filename.endswith("module.py"):
            outer = frame.f_locals.get("self")
            if isinstance(outer, torch.nn.Module) and outer is not module:
                plain = next((n for n, p in outer.named_parameters()
                              if not hasattr(p, PIECE)), None)
                if plain is not None:
                    raise RuntimeError(
                        f"fully_shard: a sharded {root.kind} ran inside a "
                        f"{type(outer).__name__} whose parameter {plain!r} is not sharded: "
                        "apply fully_shard to that root module too (after its blocks), "
                        "before its first forward")
        frame = frame.f_back


def _tensors_in(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors_in(v)


def _caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast


def _apply(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_apply(fn, v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_apply(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _apply(fn, v) for k, v in x.items()}
    return x


# -- an optimizer over the parameters fully_shard replaced ---------------------------------

_STEP_CHECK: list[Any] = []
_CHECKED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _install_step_check() -> None:
    """Once: a step of any optimizer holding a parameter fully_shard replaced raises
    (it would otherwise skip it silently: such a parameter never gets a gradient)."""
    if not _STEP_CHECK:
        _STEP_CHECK.append(register_optimizer_step_pre_hook(
            _check_optimizer))


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            moved = getattr(p, MOVED, None)
            if moved is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {moved} as it was before "
                    "fully_shard replaced it by this rank's shard; build the optimizer "
                    "after fully_shard, on model.parameters()")
    _CHECKED[optimizer] = count


def memory_stats(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of a sharded root's tensors on this rank: ``params`` (the shards),
    ``grads`` (their gradients), ``peak_unsharded`` (the most gathered parameters and
    unsharded gradients held at once since the last reset), ``unsharded_total`` (the
    model's full parameters, for comparison). ``reset=True`` in :func:`reset_peak`."""
    units = _units_under(module, True)
    if not units:
        raise ValueError("memory_stats: the module is not sharded (fully_shard it first)")
    params = sum(u.shard.numel() * u.shard.element_size() for u in units)
    grads = 0
    for u in units:
        for prm in u.params:
            g = prm.sharded.grad
            if g is not None:
                grads += g.numel() * g.element_size()
    full = sum(u.bucket.numel * u.shard.element_size() for u in units)
    return {"params": params, "grads": grads, "peak_unsharded": units[0].ctx.peak,
            "unsharded_total": full, "largest_unit": max(
                (u.padded * u.full.element_size() for u in units), default=0)}


def reset_peak(module: torch.nn.Module) -> None:
    """Start :func:`memory_stats`'s ``peak_unsharded`` afresh."""
    ctx = _units_under(module, True)[0].ctx
    ctx.peak = ctx.live


__all__ = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard", "memory_stats",
           "reset_peak"]
