"""DistributedDataParallel: torch's DDP, with swarmfd's collectives underneath.

A drop-in for ``torch.nn.parallel.DistributedDataParallel`` on CPU::

    model = swarmfd.torch.DistributedDataParallel(model)      # after fd.init_from_env()
    loss_fn(model(x), y).backward()     # gradients averaged over the ranks on return
    opt.step()

How it works:

* **At wrap time** group rank 0 broadcasts the parameters and buffers, so every
  replica starts equal, and the gradients are assigned to buckets: reverse
  registration order (the order backward produces them), one dtype per bucket, the
  first bucket 1 MiB (it starts communicating early), the others ``bucket_cap_mb``.
* **During backward** a post-accumulate-grad hook on every parameter copies its
  gradient into its bucket, pre-scaled by 1/N (the copy does the division of the
  mean for free). When a bucket is complete it is all-reduced asynchronously
  (buckets are issued in index order on every rank), while autograd goes on with
  the earlier layers.
* **Where the algorithm takes arrays as they are** a bucket is not copied at all: its
  parameters' gradients are all-reduced in place as one call (a list all_reduce).
  On shared memory (a group of one host) its algorithm copies straight from and to
  the arrays, and divides the mean chunk by chunk; the TCP ring sends each piece as
  a view of its gradient and divides the mean in the owner's chunk (buckets over
  1 MiB at N=2, over 256 KiB in larger groups: smaller ones take an algorithm of
  one message each way, sent from a bucket). The copy into a bucket is the 13.6 MB
  the benchmark MLP's step copied for nothing (docs/performance.md has what it cost).
  Under ZeRO they are reduce-scattered where they are, on every plane. Not with
  ``find_unused_parameters``, a comm hook or a bfloat16 parameter (their buckets are
  needed).
* **Overlap only where a core is free for it.** An async bucket runs on swarmfd's
  progress thread, whose Python steps and autograd take turns at the GIL (a busy
  Python thread made the benchmark MLP's backward 4.5x slower here), and whose copies
  and sums (shared memory; the kernel's copies on loopback TCP) need a core. So when
  the host's ranks have no spare core for their progress threads (two cores for each
  rank), the buckets are reduced at the end of backward instead, blocking, on the
  caller's thread, which was the faster of the two where ranks share cores
  (docs/performance.md, "Figures behind the defaults"); a real host with a core to
  spare overlaps, as torch does. ``overlap=True``/``False`` overrides the choice.
  Where no rank of the group overlaps, and every bucket is reduced in place, the end of
  backward reduces all the buckets in one call (one call's barriers and ring fill
  instead of one a bucket).
* **Before backward() returns** (a callback queued on the autograd engine) every
  bucket has been issued and waited for and ``param.grad`` holds the mean. With
  ``gradient_as_bucket_view`` (the default here; torch's is False) ``param.grad`` *is*
  a view of the bucket, so no copy back is needed (a 13.6 MB copy is 5-10 % of the
  benchmark MLP's step). bfloat16 gradients are reduced in float32
  and copied back.
* **Under** :class:`~swarmfd.torch.ZeroRedundancyOptimizer` the buckets are
  reduce-scattered instead: each rank receives the mean of the part it owns, and the
  optimizer steps on that (gradients are reduced once, never twice). ``param.grad``
  then holds this rank's own (unreduced) gradient.

Differences from torch: CPU tensors only; one module replica per process; parameters
that get no gradient are reported by name at the end of the backward pass (with
``find_unused_parameters=False``), not as a hang or a confusing error at the next
forward; ``state_dict()`` has the inner module's keys (no ``module.`` prefix).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import Variable

import swarmfd as fd
from swarmfd import _internal
from swarmfd.config import usable_cores

from . import _buckets
from ._tensors import FLOAT_DTYPES, bits, check_cpu
from .fsdp import PIECE

#: Attributes naming, on a parameter, the DistributedDataParallel or
#: ZeroRedundancyOptimizer that owns it (a weak reference: dropping the owner frees
#: it); how the two find each other. Tensors compare elementwise, so no dict of them.
DDP_OWNERS = "_swarmfd_ddp"
ZERO_OWNERS = "_swarmfd_zero"


def set_owner(kind: str, params: list[torch.Tensor], owner: Any) -> None:
    """Record ``owner`` (weakly) on each of ``params`` under ``kind``."""
    ref = weakref.ref(owner)
    for p in params:
        setattr(p, kind, ref)


def live_owner(kind: str, params: list[torch.Tensor]) -> Any:
    """The live owner of kind ``kind`` of any of ``params``, or None."""
    for p in params:
        ref = getattr(p, kind, None)
        owner = ref() if ref is not None else None
        if owner is not None:
            return owner
    return None


def group_src(group: Any) -> int:
    """The world rank of ``group``'s rank 0 (the root of its broadcasts)."""
    return 0 if group is None else int(group.ranks[0])


def broadcast_module_state(module: torch.nn.Module, group: Any) -> None:
    """Every rank gets group rank 0's parameters and buffers (fused per dtype)."""
    seen: set[int] = set()
    tensors = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append(bits(t))
    if tensors and fd.get_world_size(group) > 1:
        fd.broadcast(tensors, src=group_src(group), group=group)


class GradBucket:
    """What a comm hook gets: one bucket's flat gradient buffer and its parameters.

    The methods have the names of ``torch.distributed.GradBucket``.
    """

    def __init__(self, bucket: _buckets.Bucket, buffer: torch.Tensor, last: bool) -> None:
        self._bucket, self._buffer, self._last = bucket, buffer, last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradients (padded; the padding is zero), this rank's, unscaled."""
        return self._buffer

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return [s.param for s in self._bucket.slots]

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer[s.offset:s.offset + s.numel].view(s.param.shape)
                for s in self._bucket.slots]


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism over swarmfd: gradients averaged over the group in backward.

    Arguments as torch's DDP: ``bucket_cap_mb`` (bucket size in MB, default 25),
    ``group`` (a swarmfd group; ``process_group`` is accepted as its torch name),
    ``find_unused_parameters`` (parameters may get no gradient in a step; those that
    got none on every rank keep their ``.grad``), ``broadcast_buffers`` (group rank
    0's buffers, e.g. BatchNorm statistics, are broadcast before every forward),
    ``gradient_as_bucket_view`` (default True: ``param.grad`` is a view of its bucket),
    ``overlap`` (reduce buckets during backward; None: where a core is free for it,
    see the module docstring).
    ``device_ids``/``output_device`` exist for scripts that pass them: None or CPU only.
    """

    def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                 output_device: Any = None, *, bucket_cap_mb: float | None = 25,
                 group: Any = None, process_group: Any = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = True,
                 first_bucket_mb: float | None = None, overlap: bool | None = None) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError("swarmfd.torch.DistributedDataParallel wraps a torch.nn.Module, "
                            f"got {type(module).__name__}")
        for what, value in (("device_ids", device_ids), ("output_device", output_device)):
            if value is not None and not (
                    value == "cpu" or value == ["cpu"] or
                    getattr(value, "type", None) == "cpu"):
                raise ValueError(f"swarmfd.torch.DistributedDataParallel: {what}={value!r}: "
                                 "swarmfd supports CPU modules only (leave it None)")
        if group is not None and process_group is not None and group is not process_group:
            raise ValueError("swarmfd.torch.DistributedDataParallel: pass group or "
                             "process_group, not both")
        group = group if group is not None else process_group
        cap = 25.0 if bucket_cap_mb is None else float(bucket_cap_mb)
        if not cap > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        first = (_buckets.FIRST_BUCKET_BYTES / 1e6 if first_bucket_mb is None
                 else float(first_bucket_mb))
        self.module = module
        self.find_unused_parameters = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.require_backward_grad_sync = True
        self.bucket_bytes_cap = int(cap * 1e6)
        self._group = group
        self._first_bucket_bytes = int(first * 1e6)
        self._overlap_option = overlap
        self._hook: tuple[Any, Callable[..., Any]] | None = None
        self._handles: list[Any] = []
        weakref.finalize(self, _remove_handles, self._handles)
        self._setup()

    def _setup(self) -> None:
        """What depends on the group: rank 0's parameters, the buckets, the hooks (made
        again by :meth:`_reset_world`)."""
        module, group = self.module, self._group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            check_cpu(p, f"parameter {n!r}", "DistributedDataParallel")
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"swarmfd.torch.DistributedDataParallel: parameter {n!r} has "
                                f"dtype {p.dtype}; expected one of {FLOAT_DTYPES}")
        for n, b in module.named_buffers():
            check_cpu(b, f"buffer {n!r}", "DistributedDataParallel")
        params = [p for _, p in named]
        if any(hasattr(p, PIECE) for p in params):
            raise TypeError("swarmfd.torch.DistributedDataParallel: this module is sharded "
                            "by fully_shard, which averages its gradients itself; use it "
                            "without DDP")
        other = live_owner(DDP_OWNERS, params)
        if other is not None and other is not self:
            raise RuntimeError("swarmfd.torch.DistributedDataParallel: this module's "
                               "parameters are already wrapped by another live "
                               "DistributedDataParallel; wrap a module once")

        self._size = fd.get_world_size(group)
        self._rank = fd.get_rank(group)
        self._names = {id(p): n for n, p in named}

        broadcast_module_state(module, group)

        zero = live_owner(ZERO_OWNERS, params)
        if zero is not None:
            buckets = zero._adopt_by_ddp(self, params)
            for b in buckets:
                for s in b.slots:
                    s.name = self._names.get(id(s.param), s.name)
        else:
            buckets = _buckets.assign(named, self._size, self.bucket_bytes_cap,
                                      self._first_bucket_bytes)
        self._buckets = buckets
        self._slots = [s for b in buckets for s in b.slots]
        self._slot_index = {id(s): i for i, s in enumerate(self._slots)}
        self._grads = [torch.zeros(b.padded, dtype=b.comm_dtype) for b in buckets]
        # Buckets whose gradients may be reduced in place (see the module docstring):
        # one dtype, reduced in it, by an algorithm that takes arrays as they are (the
        # all_reduce's where it can; under ZeRO the reduce_scatter's, which always can).
        one = [all(s.param.dtype == b.comm_dtype for s in b.slots) for b in buckets]
        self._in_place = [ok and _internal.all_reduce_in_place(
            group, b.numel * b.comm_dtype.itemsize, b.numel, len(b.slots))
            for ok, b in zip(one, buckets, strict=True)]
        self._in_place_zero = one
        overlap = self._overlap_option
        if overlap is None:
            overlap = 2 * fd.host_group().size <= usable_cores()
        self._overlap = bool(overlap)
        # Whether no rank of the group overlaps (each decides for its own host): then
        # the end of backward may reduce every bucket in one call (_issue_rest), since
        # every rank does so; where some rank issues its buckets during backward, every
        # rank issues them one by one, so that all issue the same calls.
        self._one_call = False
        if self._size > 1:
            anyone = torch.tensor([int(self._overlap)], dtype=torch.int64)
            fd.all_reduce(anyone, op="max", group=group)
            self._one_call = not int(anyone[0])
        # Under ZeRO the buckets' parts are equal: the padding takes part as zeros.
        self._pads = [torch.zeros(b.padded - b.numel, dtype=b.comm_dtype) for b in buckets]
        self._zero: weakref.ref[Any] | None = weakref.ref(zero) if zero is not None else None
        self._reset_backward()
        self._armed = False

        if self._size > 1:
            me = weakref.ref(self)
            for slot in self._slots:
                self._handles.append(slot.param.register_post_accumulate_grad_hook(
                    _make_hook(me, slot)))
        set_owner(DDP_OWNERS, params, self)

    def _reset_world(self) -> None:
        """Build again for a new world (an elastic job re-formed it: see
        swarmfd.torch.elastic.TorchState): what the constructor does with the same
        module and options, its collectives included, so that a replacement that wraps
        its model at the same time runs the same ones. Its ZeroRedundancyOptimizer (if
        any) is built again after it, and takes its buckets, as when made after it."""
        if self._group is not None:
            raise fd.ElasticError(
                "swarmfd.torch.DistributedDataParallel: its group was made with new_group, "
                "which an elastic job cannot carry into a new world: wrap the model over "
                "the world (group=None)")
        _remove_handles(self._handles)
        params = [s.param for s in self._slots]
        for p in params:
            for kind in (DDP_OWNERS, ZERO_OWNERS):
                if hasattr(p, kind):
                    delattr(p, kind)
        self._setup()

    # -- what torch's DDP offers ------------------------------------------------------

    @property
    def process_group(self) -> Any:
        return self._group

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._before_forward()
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this block accumulate locally, unsynced.

        The first backward after it (of a forward outside it) averages the accumulated
        gradients, so k micro-batches cost one collective per bucket.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
        """Replace the mean all-reduce of each bucket by ``hook(state, bucket)``.

        ``bucket`` is a :class:`GradBucket` holding this rank's unscaled gradients;
        the hook issues its communication (asynchronously, ideally) and returns an
        object whose ``wait()`` gives the averaged flat gradients (a tensor of the
        buffer's shape; the buffer itself is fine), e.g. a Work of
        :func:`swarmfd.torch.all_reduce` with ``async_op=True``, or a torch Future.
        :mod:`swarmfd.torch.comm_hooks` has ``allreduce_hook`` and
        ``fp16_compress_hook``. Register it once, before the first backward.
        """
        if self._hook is not None:
            raise RuntimeError("register_comm_hook: a comm hook is registered already "
                               "(one per DistributedDataParallel, as in torch)")
        if self._zero_opt() is not None:
            raise RuntimeError("register_comm_hook: this module's gradients are "
                               "reduce-scattered for its ZeroRedundancyOptimizer; a comm "
                               "hook cannot replace that")
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {hook!r}")
        self._hook = (state, hook)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The inner module's state_dict (its keys, without a ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:  # type: ignore[override]
        """Load into the inner module; keys of torch's DDP (``module.``...) work too."""
        keys = list(state_dict)
        if keys and all(k.startswith("module.") for k in keys):
            state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        return (f"size={self._size}, {_buckets.describe(self._buckets)}, "
                f"find_unused_parameters={self.find_unused_parameters}")

    # -- the machinery ------------------------------------------------------------------

    def _zero_opt(self) -> Any:
        return self._zero() if self._zero is not None else None

    def _attach_zero(self, zero: Any) -> None:
        if self._hook is not None:
            raise RuntimeError("ZeroRedundancyOptimizer: the DistributedDataParallel of "
                               "these parameters has a comm hook; ZeRO needs its buckets "
                               "reduce-scattered instead")
        self._zero = weakref.ref(zero)

    def _reset_backward(self) -> None:
        self._in_backward = False
        self._next = 0  # the next bucket to issue
        self._pending = [len(b.slots) for b in self._buckets]
        self._ready = [False] * len(self._slots)
        self._works: list[Any] = []

    def _before_forward(self) -> None:
        if self._in_backward:
            # A backward pass raised part-way (a hook or the loss); what it issued is
            # waited for so no op holds a bucket, and the state starts afresh.
            works, self._works = self._works, []
            self._reset_backward()
            for w in works:
                with contextlib.suppress(Exception):
                    w.wait()
        zero = self._zero_opt()
        if zero is not None:
            zero._wait_params()
        if self.broadcast_buffers and self._size > 1:
            buffers = [bits(b) for b in self.module.buffers()]
            if buffers:
                fd.broadcast(buffers, src=group_src(self._group), group=self._group)
        self._armed = torch.is_grad_enabled() and self.require_backward_grad_sync

    def _on_ready(self, slot: Any, index: int) -> None:
        if not self._armed:
            return
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._finalize)
        if self._ready[index]:
            raise RuntimeError(
                f"swarmfd.torch.DistributedDataParallel: parameter {slot.name!r} received "
                "its gradient twice in one backward pass (reentrant checkpointing, or "
                "backward through the same graph twice?); DDP reduces each gradient once")
        self._ready[index] = True
        p = slot.param
        grad = p.grad
        if self._direct(slot.bucket):
            if grad is None:  # possible when a hook set it to None: zeros, in step
                p.grad = torch.zeros_like(p)
            self._pending[slot.bucket] -= 1
            if self._pending[slot.bucket] == 0 and (self._overlap or self._hook is not None):
                self._issue_ready()
            return
        view = self._grads[slot.bucket][slot.offset:slot.offset + slot.numel]
        with torch.no_grad():
            scale = self._scale()
            if grad is None:  # possible when a hook set it to None
                view.zero_()
            elif grad.data_ptr() == view.data_ptr() and grad.dtype == view.dtype:
                if scale != 1.0:
                    view.mul_(scale)
            elif scale != 1.0 and grad.dtype == view.dtype:
                torch.mul(grad.reshape(-1), scale, out=view)
            else:
                view.copy_(grad.reshape(-1))
                if scale != 1.0:
                    view.mul_(scale)
        self._pending[slot.bucket] -= 1
        if self._pending[slot.bucket] == 0 and (self._overlap or self._hook is not None):
            self._issue_ready()

    def _direct(self, index: int) -> bool:
        """Whether bucket ``index``'s gradients are all-reduced in place, in their
        parameters' ``.grad`` (see the module docstring), in this backward pass."""
        in_place = self._in_place if self._zero_opt() is None else self._in_place_zero
        return in_place[index] and self._hook is None and not self.find_unused_parameters

    def _scale(self) -> float:
        """The factor applied on the way into the bucket: 1/N for the plain mean."""
        if self._hook is not None or self._zero_opt() is not None:
            return 1.0
        return 1.0 / self._size

    def _issue_ready(self) -> None:
        """Issue every complete bucket whose predecessors are issued (index order)."""
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            b = self._buckets[self._next]
            self._works.append(self._issue(b))
            self._next += 1

    def _issue_rest(self) -> None:
        """End of backward: issue every bucket not issued yet. Where no rank of the group
        overlaps none was, and when every bucket's gradients are reduced in place (no
        comm hook, no ZeroRedundancyOptimizer) they all go as one blocking all_reduce of
        every gradient: one call's fixed costs (its barriers, a ring's fill and drain) instead
        of one a bucket: 0.95x the step at N=4 on shared memory, the same within the
        noise at N=2 and over TCP (benchmarks/train.py, alternated rounds)."""
        buckets = self._buckets
        if (not self._one_call or self._hook is not None or self._zero_opt() is not None
                or self._next or len(buckets) < 2
                or not all(self._direct(b.index) for b in buckets)):
            self._issue_ready()
            return
        grads = [g for b in buckets for g in self._bucket_grads(b)]
        done = _Done(fd.all_reduce(grads, op="mean", group=self._group))
        self._works.extend(done for _ in buckets)
        self._next = len(buckets)

    def _issue(self, b: _buckets.Bucket) -> Any:
        """Start bucket ``b``'s collective: async when overlapping, else blocking (at
        the end of backward; the result then stands in for a finished Work)."""
        zero = self._zero_opt()
        if self._hook is None and not self._overlap:
            return _Done(self._collective(b, zero, async_op=False))
        return self._collective(b, zero, async_op=True)

    def _bucket_grads(self, b: _buckets.Bucket) -> list[torch.Tensor]:
        """The gradients of bucket ``b``, reduced where they are. A parameter without a
        gradient (an error at the end of this backward) takes part with zeros, so this
        rank issues what its peers do."""
        return [s.param.grad if self._ready[self._slot_index[id(s)]]
                else torch.zeros_like(s.param) for s in b.slots]

    def _collective(self, b: _buckets.Bucket, zero: Any, async_op: bool) -> Any:
        if self._direct(b.index):
            grads = self._bucket_grads(b)
            if zero is not None:
                out = zero._shard_grad(b.index)
                return _internal.reduce_scatter_parts(
                    [*grads, self._pads[b.index]], out.numpy(), op="mean",
                    group=self._group, async_op=async_op)
            return fd.all_reduce(grads, op="mean", group=self._group, async_op=async_op)
        buf = self._grads[b.index]
        if zero is not None:
            out = zero._shard_grad(b.index)
            return fd.reduce_scatter(buf.numpy(), out=out.numpy(), op="mean",
                                     group=self._group, async_op=async_op)
        if self._hook is not None:
            state, hook = self._hook
            return hook(state, GradBucket(b, buf, b.index == len(self._buckets) - 1))
        return fd.all_reduce(buf.numpy(), op="sum", group=self._group, async_op=async_op)

    def _finalize(self) -> None:
        """End of backward: issue what is left, wait for everything, write gradients back."""
        error: BaseException | None = None
        try:
            missing = [s for s, ok in zip(self._slots, self._ready, strict=True) if not ok]
            if missing and not self.find_unused_parameters:
                names = ", ".join(repr(s.name) for s in missing[:10])
                more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
                error = RuntimeError(
                    f"swarmfd.torch.DistributedDataParallel: {len(missing)} parameter(s) "
                    f"received no gradient in this backward pass: {names}{more}. Every "
                    "parameter must take part in the loss; if some legitimately do not "
                    "(branches, frozen parts), pass find_unused_parameters=True, or set "
                    "requires_grad=False on them before wrapping")
            used = None
            if self.find_unused_parameters:
                used = torch.tensor(self._ready, dtype=torch.uint8)
            for s in missing:
                # Zeros in their place keep this rank in step with its peers (it issues
                # the same collectives as they do), whether it raises below or not.
                self._grads[s.bucket][s.offset:s.offset + s.numel].zero_()
                self._pending[s.bucket] -= 1
            self._issue_rest()
            used_work = None
            if used is not None:
                used_work = fd.all_reduce(used.numpy(), op="max", group=self._group,
                                          async_op=True)
            results = [w.wait() for w in self._works]
            if used_work is not None:
                used_work.wait()
            if error is None:
                self._write_back(results, used)
        finally:
            self._reset_backward()
        if error is not None:
            raise error

    def _write_back(self, results: list[Any], used: torch.Tensor | None) -> None:
        zero = self._zero_opt()
        if zero is not None:  # the reduced part is in the optimizer; .grad: this rank's
            zero._grads_reduced_by_ddp()
            if self.gradient_as_bucket_view:
                with torch.no_grad():
                    for s in self._slots:
                        if not self._direct(s.bucket):  # else .grad holds them already
                            self._set_grad(s, self._grads[s.bucket])
            return
        i = 0
        with torch.no_grad():
            for b, result in zip(self._buckets, results, strict=True):
                if self._direct(b.index):  # reduced where they are
                    i += len(b.slots)
                    continue
                buf = self._grads[b.index]
                if self._hook is not None:
                    out = _hook_result(result, buf)
                    if out.data_ptr() != buf.data_ptr():
                        buf.copy_(out.reshape(-1))
                for s in b.slots:
                    if used is None or used[i]:  # unused on every rank: .grad stays
                        self._set_grad(s, buf)
                    i += 1

    def _set_grad(self, s: Any, buf: torch.Tensor) -> None:
        p = s.param
        view = buf[s.offset:s.offset + s.numel].view(p.shape)
        if self.gradient_as_bucket_view and view.dtype == p.dtype:
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        elif p.grad is None:
            p.grad = view.to(p.dtype, copy=True)
        else:
            p.grad.copy_(view)


class _Done:
    """A blocking collective's result where a Work is expected (``completed_at``: the
    ``time.monotonic()`` it completed at, as :attr:`swarmfd.Work.completed_at`)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.completed_at = time.monotonic()

    def wait(self) -> Any:
        return self.value


def _hook_result(result: Any, buf: torch.Tensor) -> torch.Tensor:
    if isinstance(result, (list, tuple)) and result:
        result = result[0]
    if not isinstance(result, torch.Tensor) or result.numel() != buf.numel():
        raise TypeError("swarmfd.torch.DistributedDataParallel: the comm hook's wait() "
                        f"returned {type(result).__name__}, expected a tensor of the bucket's "
                        f"{buf.numel()} elements")
    return result


def _make_hook(me: weakref.ref[DistributedDataParallel], slot: Any) -> Callable[..., None]:
    def hook(param: torch.Tensor) -> None:
        ddp = me()
        if ddp is not None:
            ddp._on_ready(slot, ddp._slot_index[id(slot)])

    return hook


__all__ = ["DistributedDataParallel", "GradBucket"]
