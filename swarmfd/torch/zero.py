"""ZeroRedundancyOptimizer: ZeRO stage 1, the optimizer state split over the ranks.

Partitioning follows DeepSpeed's ZeRO-1, not torch's per-parameter one (which cannot
balance a model whose largest weight is 30 % of it): the parameters are flattened
into buckets (the same ones DDP uses), each bucket is padded to a multiple of N and
split into N equal parts, and rank r owns part r of every bucket: the optimizer
state of those elements, and their update. So every rank holds 1/N of the state,
to within N-1 padding elements per bucket, whatever the shapes.

A step:

1. **reduce-scatter** each bucket's gradients: rank r receives the mean over the
   ranks of part r. Wrapped in :class:`~swarmfd.torch.DistributedDataParallel`,
   DDP does this during backward instead of its all-reduce, so the gradients are
   reduced once; standalone, ``step()`` packs ``param.grad`` and does it.
2. **local step**: an instance of ``optimizer_class`` per bucket runs on flat views
   of the owned parts (the update of SGD, Adam, AdamW... is elementwise, so a flat
   view of a slice of several parameters updates exactly like the parameters).
3. **all-gather** the updated parts into every rank's parameters. The parameters
   are views into one flat buffer per bucket, so the all-gather writes them in place,
   and every rank ends with bitwise the same values.

The optimizer state a rank holds is 1/N of the unsharded optimizer's (the
benchmark counts it). The reduced gradient of the owned part (1/N of the gradients)
lives between backward and step: under DDP in a buffer per bucket, standalone only
during ``step()``.

Checkpoints: ``consolidate_state_dict(to=r)`` (on every rank) gathers the state on
rank r, whose ``state_dict()`` is then the unsharded optimizer's own format: it loads
into a plain ``optimizer_class`` or into a ZeroRedundancyOptimizer of any group size.
``load_state_dict`` (on every rank, with the full dict) takes each rank's part.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

import swarmfd as fd
from swarmfd import _internal

from . import _buckets
from ._tensors import FLOAT_DTYPES, bits, check_cpu
from .ddp import DDP_OWNERS, ZERO_OWNERS, live_owner, set_owner
from .fsdp import PIECE

#: torch.optim classes whose update is not elementwise: a flat shard would change it.
_NOT_ELEMENTWISE = {"LBFGS", "SparseAdam", "Adafactor", "LAMB", "LARS"}


class _Run:
    """A contiguous piece of one bucket's owned part, all of one parameter group.

    ``start``/``stop`` are bucket element offsets; ``tensor`` the flat view of the
    parameters there, which the local optimizer updates.
    """

    __slots__ = ("group", "start", "stop", "tensor")

    def __init__(self, group: int, start: int, stop: int, tensor: torch.Tensor) -> None:
        self.group, self.start, self.stop, self.tensor = group, start, stop, tensor


def _full_defaults(optimizer_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_class``'s own defaults with ``defaults`` over them (as it would fill)."""
    probe = torch.zeros(2, requires_grad=True)
    return dict(optimizer_class([probe], **defaults).defaults)


def _state_kinds(optimizer_class: type, hyper: dict[str, Any]) -> dict[str, str]:
    """Which state entries the optimizer keeps per element ("elementwise") or once
    ("scalar": step counters, shapes of their own), found by stepping it on a probe."""
    probe = torch.zeros(3, requires_grad=True)
    probe.grad = torch.full((3,), 0.5)
    opt = optimizer_class([{**hyper, "params": [probe]}])
    opt.step()
    kinds = {}
    for key, value in opt.state[probe].items():
        if isinstance(value, torch.Tensor) and value.shape == probe.shape:
            kinds[key] = "elementwise"
        elif isinstance(value, torch.Tensor):
            kinds[key] = "scalar"
        else:
            kinds[key] = "other"
    return kinds


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, its state sharded over the group (ZeRO-1).

    ``params``: tensors (a generator is fine) or parameter groups (dicts), as for any
    torch optimizer; ``**defaults`` go to ``optimizer_class`` (e.g. ``lr=1e-3``).
    ``group`` (``process_group``: torch's name) is the swarmfd group to shard over;
    ``bucket_cap_mb`` sizes the flat buckets when no DDP provides them.
    ``parameters_as_bucket_view`` and ``overlap_with_ddp`` (torch's names) are accepted
    and change nothing: the parameters are always views of the flat buckets, and under
    DDP the reduce-scatter always runs during backward.

    Construct it before or after wrapping the model in
    :class:`~swarmfd.torch.DistributedDataParallel`; either way the two share
    buckets and DDP reduce-scatters. Every parameter must get a gradient on every step
    (standalone, a None gradient is an error naming it; under DDP with
    ``find_unused_parameters`` a missing gradient counts as zero, so the optimizer
    still updates those elements, e.g. Adam's momentum keeps moving them).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, *, group: Any = None,
                 process_group: Any = None, bucket_cap_mb: float = 25,
                 parameters_as_bucket_view: bool = True, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("ZeroRedundancyOptimizer: optimizer_class must be a torch.optim."
                            f"Optimizer subclass (e.g. torch.optim.Adam), got {optimizer_class!r}")
        if optimizer_class.__name__ in _NOT_ELEMENTWISE:
            raise ValueError(f"ZeroRedundancyOptimizer: {optimizer_class.__name__}'s update is "
                             "not elementwise, so flat shards would change it; use SGD, Adam, "
                             "AdamW or another elementwise optimizer")
        if group is not None and process_group is not None and group is not process_group:
            raise ValueError("ZeroRedundancyOptimizer: pass group or process_group, not both")
        self._optimizer_class = optimizer_class
        self._sg = group if group is not None else process_group
        self._bucket_cap = int(float(bucket_cap_mb) * 1e6)
        self._size = fd.get_world_size(self._sg)
        self._rank = fd.get_rank(self._sg)
        self._constructing = True
        super().__init__(list(params), _full_defaults(optimizer_class, defaults))
        self._constructing = False

        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = {id(p): gi for gi, g in enumerate(self.param_groups)
                          for p in g["params"]}
        for i, p in enumerate(self._params):
            check_cpu(p, f"parameter {i}", "ZeroRedundancyOptimizer")
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"ZeroRedundancyOptimizer: parameter {i} has dtype {p.dtype}; "
                                f"expected one of {FLOAT_DTYPES}")
        if any(hasattr(p, PIECE) for p in self._params):
            raise TypeError("ZeroRedundancyOptimizer: these parameters are fully_shard's "
                            "shards, whose optimizer state is sharded already; use a plain "
                            f"{optimizer_class.__name__} on them")
        if live_owner(ZERO_OWNERS, self._params) is not None:
            raise RuntimeError("ZeroRedundancyOptimizer: these parameters belong to another "
                               "live ZeroRedundancyOptimizer")
        self._kinds = [_state_kinds(optimizer_class, {k: v for k, v in g.items()
                                                      if k != "params"})
                       for g in self.param_groups]
        self._ddp: weakref.ref[Any] | None = None
        ddp = live_owner(DDP_OWNERS, self._params)
        if ddp is not None:
            self._check_same_params(ddp._slots, "its DistributedDataParallel")
            if ddp._group is not self._sg:
                raise ValueError("ZeroRedundancyOptimizer: its group differs from that of the "
                                 "DistributedDataParallel of these parameters")
        self._lay_out(ddp)
        self._reduced = False  # DDP left the reduced gradients in _shard_grads
        self._gathers: list[Any] = []
        self._consolidated: dict[str, Any] | None = None
        self._steps = 0
        self._has_state = False  # the same on every rank: a step or a load happened

    # -- layout ---------------------------------------------------------------------------

    def _check_same_params(self, slots: list[Any], what: str) -> None:
        mine = {id(p) for p in self._params}
        theirs = {id(s.param) for s in slots}
        if mine != theirs:
            raise ValueError(
                f"ZeroRedundancyOptimizer: its parameters must be exactly those of {what} "
                f"({len(mine & theirs)} shared, {len(mine - theirs)} only in the optimizer, "
                f"{len(theirs - mine)} only in the module): ZeRO splits DDP's buckets, so "
                "one optimizer must own all of them")

    def _build(self, buckets: list[_buckets.Bucket]) -> None:
        """Flat parameter buffers (the parameters become views), runs and local optimizers."""
        self._buckets = buckets
        self._flat: list[torch.Tensor] = []
        self._runs: list[list[_Run]] = []
        self._local: list[torch.optim.Optimizer | None] = []
        self._shard_grads: list[torch.Tensor | None] = [None] * len(buckets)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        with torch.no_grad():
            for b in buckets:
                flat = torch.zeros(b.padded, dtype=b.dtype)
                for s in b.slots:
                    flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                    s.param.data = flat[s.offset:s.offset + s.numel].view(s.param.shape)
                self._flat.append(flat)
                lo, hi = self._rank * b.part, (self._rank + 1) * b.part
                runs: list[_Run] = []
                for s in b.slots:
                    a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                    if a >= z:
                        continue
                    gi = self._group_of[id(s.param)]
                    if runs and runs[-1].group == gi and runs[-1].stop == a:
                        runs[-1].stop = z
                    else:
                        runs.append(_Run(gi, a, z, flat))
                for run in runs:
                    run.tensor = flat[run.start:run.stop]
                self._runs.append(runs)
                if runs:
                    groups = [{**h, "params": [r.tensor for r in runs if r.group == gi]}
                              for gi, h in enumerate(hyper)]
                    self._local.append(self._optimizer_class(groups))
                else:
                    self._local.append(None)

    def _adopt_by_ddp(self, ddp: Any, params: list[torch.Tensor]) -> list[_buckets.Bucket]:
        """A DDP is being built over these parameters: it uses this optimizer's buckets."""
        self._check_same_params([_buckets.Slot(p, "", 0) for p in params],
                                "the DistributedDataParallel being built")
        if ddp._group is not self._sg:
            raise ValueError("DistributedDataParallel: its group differs from that of the "
                             "ZeroRedundancyOptimizer of these parameters")
        self._ddp = weakref.ref(ddp)
        # The wrap-time broadcast happened before: the flat buffers (and so the
        # parameters, their views) already hold rank 0's values.
        return self._buckets

    def _shard_grad(self, index: int) -> torch.Tensor:
        """The buffer DDP reduce-scatters bucket ``index`` into (allocated once)."""
        g = self._shard_grads[index]
        if g is None:
            b = self._buckets[index]
            g = self._shard_grads[index] = torch.zeros(b.part, dtype=b.comm_dtype)
        return g

    def _grads_reduced_by_ddp(self) -> None:
        self._reduced = True

    def _wait_params(self) -> None:
        gathers, self._gathers = self._gathers, []
        for w in gathers:
            w.wait()

    # -- torch.optim.Optimizer ------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_constructing", True):
            raise NotImplementedError("ZeroRedundancyOptimizer: add_param_group after "
                                      "construction is not supported (the shards are laid "
                                      "out once): pass every group to the constructor")
        super().add_param_group(param_group)

    def _sync_hyperparameters(self) -> None:
        """Copy hyperparameters (a scheduler's lr, ...) into the local optimizers."""
        for local in self._local:
            if local is None:
                continue
            for mine, theirs in zip(local.param_groups, self.param_groups, strict=True):
                for k, v in theirs.items():
                    if k != "params":
                        mine[k] = v

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduce-scatter the gradients (unless DDP did), step the owned part, all-gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_params()
        self._sync_hyperparameters()
        if self._reduced:
            self._reduced = False
            grads = [self._shard_grad(b.index) for b in self._buckets]
            scatters: list[Any] = [None] * len(self._buckets)
        else:
            grads, scatters = self._reduce_scatter()
        gathers = []
        for b, runs, local, work in zip(self._buckets, self._runs, self._local, scatters,
                                        strict=True):
            if work is not None:
                work.wait()
            shard = grads[b.index]
            lo = self._rank * b.part
            if local is not None:
                for run in runs:
                    g = shard[run.start - lo:run.stop - lo]
                    run.tensor.grad = g if g.dtype == b.dtype else g.to(b.dtype)
                local.step()
                for run in runs:
                    run.tensor.grad = None
            gathers.append(self._all_gather(b, shard))
        self._gathers = gathers
        self._wait_params()
        self._steps += 1
        self._has_state = True
        self._consolidated = None
        return loss

    def _reduce_scatter(self) -> tuple[list[torch.Tensor], list[Any]]:
        """Standalone: reduce-scatter each bucket's ``param.grad`` (mean): read where they
        are when they have the bucket's dtype (no copy into a bucket on shared memory:
        :func:`swarmfd._internal.reduce_scatter_parts`), else packed."""
        outs, works = [], []
        for b in self._buckets:
            for s in b.slots:
                if s.param.grad is None:
                    raise TypeError(
                        f"ZeroRedundancyOptimizer.step: {s.name} "
                        f"({str(s.param.dtype).removeprefix('torch.')}{list(s.param.shape)}) "
                        "has no gradient (grad is None). Its shard is updated on one rank "
                        "for all, so every parameter needs a gradient on every rank: make it "
                        "take part in the loss, or leave it out of the optimizer")
            out = torch.empty(b.part, dtype=b.comm_dtype)
            if all(s.param.grad.dtype == b.comm_dtype for s in b.slots):
                pad = torch.zeros(b.padded - b.numel, dtype=b.comm_dtype)
                works.append(_internal.reduce_scatter_parts(
                    [*(s.param.grad for s in b.slots), pad], out.numpy(), op="mean",
                    group=self._sg, async_op=True))
            else:
                flat = torch.zeros(b.padded, dtype=b.comm_dtype)
                for s in b.slots:
                    flat[s.offset:s.offset + s.numel].copy_(s.param.grad.reshape(-1))
                works.append(fd.reduce_scatter(flat.numpy(), out=out.numpy(), op="mean",
                                               group=self._sg, async_op=True))
            outs.append(out)
        return outs, works

    def _all_gather(self, b: _buckets.Bucket, scratch: torch.Tensor) -> Any:
        """Issue the all-gather of bucket ``b``'s owned part into every rank's buffer.

        The input is a copy of the owned part in ``scratch``, the reduced gradient just
        consumed (the core refuses an input inside the output, and this costs no memory).
        """
        flat = self._flat[b.index]
        lo = self._rank * b.part
        # bfloat16 parameters have float32 gradients: their first half of the bytes.
        src = scratch if scratch.dtype == b.dtype else scratch.view(b.dtype)[:b.part]
        src.copy_(flat[lo:lo + b.part])
        return fd.all_gather(bits(src), out=bits(flat).reshape(self._size, b.part),
                             group=self._sg, async_op=True)

    # -- checkpoints ----------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on group rank ``to`` (call on every rank).

        Rank ``to``'s :meth:`state_dict` then returns it in ``optimizer_class``'s own
        format; the other ranks keep nothing.
        """
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self._size:
            raise ValueError(f"consolidate_state_dict: to={to!r} must be a rank of the group "
                             f"(0..{self._size - 1})")
        self._wait_params()
        state: dict[int, dict[str, Any]] = {}
        if self._has_state:
            index = {id(p): i for i, p in enumerate(self._params)}
            for b, runs, local in zip(self._buckets, self._runs, self._local, strict=True):
                self._consolidate_bucket(b, runs, local, to, index, state)
        if self._rank == to:
            self._consolidated = {"state": dict(sorted(state.items())),
                                  "param_groups": self._groups_for_dict()}
        else:
            self._consolidated = None

    def _consolidate_bucket(self, b: _buckets.Bucket, runs: list[_Run], local: Any, to: int,
                            index: dict[int, int], state: dict[int, dict[str, Any]]) -> None:
        # The same keys on every rank (from the probe), gathered flat, one at a time.
        for key in self._bucket_keys(b):
            mine = self._part(b, runs, local, key)  # torch keeps state in the param's dtype
            full = np.empty((self._size, b.part), dtype=bits(mine).dtype)
            fd.all_gather(bits(mine), out=full, group=self._sg)
            if self._rank != to:
                continue
            whole = torch.from_numpy(full.reshape(-1))
            if mine.dtype in (torch.bfloat16, torch.bool):
                whole = whole.view(mine.dtype)
            self._fill(b, key, whole, index, state)
        if self._rank == to:
            self._fill_scalars(b, self._local_scalars(), index, state)

    def _bucket_keys(self, b: _buckets.Bucket) -> list[str]:
        """The elementwise state entries of bucket ``b``'s parameter groups (sorted)."""
        groups = sorted({self._group_of[id(s.param)] for s in b.slots})
        return sorted({k for gi in groups for k, kind in self._kinds[gi].items()
                       if kind == "elementwise"})

    def _part(self, b: _buckets.Bucket, runs: list[_Run], local: Any, key: str) -> torch.Tensor:
        """This rank's part of bucket ``b``'s state entry ``key``, flat (``b.part``
        elements; zeros where it has none)."""
        lo = self._rank * b.part
        mine = torch.zeros(b.part, dtype=b.dtype)
        if local is not None:
            for run in runs:
                value = local.state.get(run.tensor, {}).get(key)
                if isinstance(value, torch.Tensor):
                    mine[run.start - lo:run.stop - lo].copy_(value.reshape(-1))
        return mine

    def _fill(self, b: _buckets.Bucket, key: str, whole: torch.Tensor, index: dict[int, int],
              state: dict[int, dict[str, Any]]) -> None:
        """Entry ``key`` of each parameter of bucket ``b`` in ``state`` (the plain
        optimizer's format), from the bucket's ``whole`` flat state."""
        for s in b.slots:
            if s.param.numel() == 0:
                continue
            entry = state.setdefault(index[id(s.param)], {})
            entry[key] = whole[s.offset:s.offset + s.numel].clone().view(s.param.shape)

    def _fill_scalars(self, b: _buckets.Bucket, scalars: dict[int, dict[str, Any]],
                      index: dict[int, int], state: dict[int, dict[str, Any]]) -> None:
        """The scalar entries (step counts: equal on every rank) of bucket ``b``'s
        parameters in ``state``, from ``scalars`` (per parameter group)."""
        for s in b.slots:
            gi = self._group_of[id(s.param)]
            entry = state.setdefault(index[id(s.param)], {})
            for key, kind in self._kinds[gi].items():
                if kind != "elementwise" and key in scalars.get(gi, {}):
                    v = scalars[gi][key]
                    entry[key] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)

    # -- elastic jobs (swarmfd.torch.elastic.TorchState) ----------------------------------

    def _shards(self) -> tuple[list[torch.Tensor], dict[int, dict[str, Any]]]:
        """This rank's part of the state: for each bucket, each elementwise entry (as
        :meth:`_bucket_keys` orders them), its ``b.part`` elements; and the scalar entries
        per parameter group."""
        self._wait_params()
        parts = [self._part(b, runs, local, key)
                 for b, runs, local in zip(self._buckets, self._runs, self._local, strict=True)
                 for key in self._bucket_keys(b)]
        return parts, self._local_scalars()

    def _load_wholes(self, wholes: list[torch.Tensor], scalars: dict[int, dict[str, Any]]
                     ) -> None:
        """Load the whole state (for each bucket and entry, as :meth:`_shards` orders
        them, the flat state of the bucket's ``numel`` elements, or more): each rank keeps
        its part, as load_state_dict does."""
        index = {id(p): i for i, p in enumerate(self._params)}
        state: dict[int, dict[str, Any]] = {}
        at = 0
        for b in self._buckets:
            for key in self._bucket_keys(b):
                self._fill(b, key, wholes[at], index, state)
                at += 1
            self._fill_scalars(b, scalars, index, state)
        self.load_state_dict({"state": state, "param_groups": self._groups_for_dict()})

    def _reset_world(self) -> None:
        """Lay the shards out again for a new world (an elastic job re-formed it: see
        swarmfd.torch.elastic.TorchState), over the buckets of its DistributedDataParallel
        (built again first) if any: the parameters keep their values, the local
        optimizers start empty (:meth:`_load_wholes` brings the state back)."""
        if self._sg is not None:
            raise fd.ElasticError(
                "ZeroRedundancyOptimizer: its group was made with new_group, which an "
                "elastic job cannot carry into a new world: shard over the world "
                "(group=None)")
        self._gathers = []  # (of the old world, whose engine is closed)
        self._size, self._rank = fd.get_world_size(), fd.get_rank()
        for p in self._params:
            if hasattr(p, ZERO_OWNERS):
                delattr(p, ZERO_OWNERS)
        self._lay_out(live_owner(DDP_OWNERS, self._params))
        self._reduced = False
        self._consolidated = None

    def _lay_out(self, ddp: Any) -> None:
        """The shards over ``ddp``'s buckets (None: buckets of this optimizer's own)."""
        if ddp is not None:
            buckets = ddp._buckets
        else:
            named = [(f"parameter {i}", p) for i, p in enumerate(self._params)]
            buckets = _buckets.assign(named, self._size, self._bucket_cap)
        self._build(buckets)
        if ddp is not None:
            ddp._attach_zero(self)
            self._ddp = weakref.ref(ddp)
        set_owner(ZERO_OWNERS, self._params, self)

    def _local_scalars(self) -> dict[int, dict[str, Any]]:
        """Per parameter group, the non-elementwise state entries of any owned run."""
        out: dict[int, dict[str, Any]] = {}
        for runs, local in zip(self._runs, self._local, strict=True):
            if local is None:
                continue
            for run in runs:
                st = local.state.get(run.tensor)
                if not st:
                    continue
                got = out.setdefault(run.group, {})
                for k, v in st.items():
                    if self._kinds[run.group].get(k) != "elementwise":
                        got.setdefault(k, v)
        # A rank may own nothing of a group: then the step count must come from a peer.
        return self._share_scalars(out)

    def _share_scalars(self, out: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Fill the groups this rank owns nothing of (step counts are equal everywhere:
        every owning rank steps every time), from the number of steps taken."""
        for gi, kinds in enumerate(self._kinds):
            if gi in out:
                continue
            got = out.setdefault(gi, {})
            for k, kind in kinds.items():
                if kind == "scalar" and k == "step":
                    got[k] = torch.tensor(float(self._steps))
        return out

    def _groups_for_dict(self) -> list[dict[str, Any]]:
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return groups

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The consolidated state, in ``optimizer_class``'s format (see the class doc)."""
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.state_dict: the state is sharded; call "
                "consolidate_state_dict(to=r) on every rank first, then state_dict() on "
                f"rank r (this is rank {self._rank})")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a full state dict (``optimizer_class``'s format) on every rank: each
        keeps its part."""
        groups = state_dict.get("param_groups")
        states = state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(states, dict):
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict: expected a dict with "
                             "'state' and 'param_groups', as state_dict() returns")
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"])
                for a, b in zip(groups, self.param_groups, strict=True)):
            raise ValueError(
                "ZeroRedundancyOptimizer.load_state_dict: the state dict has "
                f"{[len(g['params']) for g in groups]} parameters per group, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}")
        self._wait_params()
        for mine, theirs in zip(self.param_groups, groups, strict=True):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = copy.deepcopy(v)

        def entries(i: int) -> dict[str, Any]:
            st = states.get(i, states.get(str(i))) or {}
            kinds = self._kinds[self._group_of[id(self._params[i])]]
            return {k: None if kinds.get(k) == "elementwise" else v for k, v in st.items()}

        def read(i: int, key: str, start: int, stop: int) -> torch.Tensor:
            st = states.get(i, states.get(str(i)))
            return st[key].detach().reshape(-1)[start:stop]

        for i, p in enumerate(self._params):
            st = states.get(i, states.get(str(i))) or {}
            for k, v in st.items():
                if (self._kinds[self._group_of[id(p)]].get(k) == "elementwise"
                        and (not isinstance(v, torch.Tensor) or v.numel() != p.numel())):
                    raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: state "
                                     f"{k!r} of parameter {i} does not match its shape "
                                     f"{list(p.shape)}")
        self._load(entries, read)

    def _load(self, entries: Callable[[int], dict[str, Any]],
              read: Callable[[int, str, int, int], torch.Tensor]) -> None:
        """Fill every owned run's state from a source that gives ranges (the one load of
        a full state dict and of a sharded checkpoint): ``entries(i)`` is parameter i's
        state, {key: None for an elementwise key, else its value} (empty: no state);
        ``read(i, key, start, stop)`` elements [start, stop) of its flattened
        elementwise state ``key``. The same source on every rank."""
        self._wait_params()
        self._sync_hyperparameters()
        index = {id(p): i for i, p in enumerate(self._params)}
        count = 0
        for i in range(len(self._params)):
            step = entries(i).get("step")
            if step is not None and not count:
                value = float(step)
                count = int(value) if math.isfinite(value) else 0
        anything = any(entries(i) for i in range(len(self._params)))
        for b, runs, local in zip(self._buckets, self._runs, self._local, strict=True):
            if local is None:
                continue
            local.state.clear()
            for run in runs:
                entry = self._run_state(b, run, entries, read, index)
                if entry:
                    local.state[run.tensor] = entry
        self._steps = max(self._steps, count)
        self._has_state = self._has_state or anything
        self._consolidated = None

    def _run_state(self, b: _buckets.Bucket, run: _Run,
                   entries: Callable[[int], dict[str, Any]],
                   read: Callable[[int, str, int, int], torch.Tensor],
                   index: dict[int, int]) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        pieces: dict[str, list[torch.Tensor]] = {}
        complete = True
        for s in b.slots:
            a, z = max(run.start, s.offset), min(run.stop, s.offset + s.numel)
            if a >= z:
                continue
            i = index[id(s.param)]
            st = entries(i)
            if not st:
                complete = False
                continue
            for k, v in st.items():
                if v is None:
                    flat = read(i, k, a - s.offset, z - s.offset)
                    pieces.setdefault(k, []).append(flat.to(b.dtype))
                elif k not in entry:
                    entry[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        if not complete and pieces:
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict: some parameters of a "
                             "shard have state and others none; a state dict of a partly "
                             "stepped optimizer cannot be sharded")
        for k, parts in pieces.items():
            entry[k] = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        return entry

    # -- introspection ------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of every tensor of this rank's optimizer state (the local optimizers')."""
        total = 0
        for local in self._local:
            if local is None:
                continue
            for st in local.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        total += v.numel() * v.element_size()
        return total

    @property
    def buckets(self) -> list[_buckets.Bucket]:
        return list(self._buckets)
