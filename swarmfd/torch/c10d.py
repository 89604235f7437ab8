"""swarmfd as a torch.distributed backend: ``init_process_group("swarmfd")``.

Importing :mod:`swarmfd.torch` registers the backend, so a torch script runs its
``dist.all_reduce``, ``dist.broadcast``, ... and torch's own
``DistributedDataParallel`` over swarmfd by naming it::

    import swarmfd.torch                      # registers "swarmfd"
    dist.init_process_group("swarmfd")        # under swarmfd run / swarmfd deploy

The process group is written in Python (a subclass of ``dist.ProcessGroup``, which
torch calls from C++ for every collective). If swarmfd is not initialised yet, the
backend initialises it: rank 0 picks a free port for swarmfd's rendezvous and
publishes it, with its address, through the store torch's rendezvous just built
(which holds ``MASTER_PORT``), so the two never compete for a port, and passes it to
``fd.init(master_port=...)``, which binds it as given (SWARMFD_PORT is not read on
this path). A script that calls ``fd.init()`` and ``init_process_group("gloo")``
itself, in either order, is as safe: swarmfd's rendezvous then binds SWARMFD_PORT,
else MASTER_PORT + 1, never MASTER_PORT (see :func:`swarmfd.config.rendezvous_port`).

Supported: ``all_reduce`` (sum, avg, product, min, max), ``broadcast``,
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``,
``reduce_scatter_tensor``, ``reduce``, ``gather``, ``scatter``, ``all_to_all_single``
(equal or uneven splits), ``all_to_all`` (lists of tensors of any shapes),
``send``/``recv`` and ``isend``/``irecv`` (swarmfd's point-to-point messages: matched
by source and tag, in order), ``barrier``, their ``async_op`` forms and coalesced
variants; bfloat16 is reduced in float32. Sub-groups (``dist.new_group``) are swarmfd
groups made by their members alone (:func:`swarmfd.group.members_group`; torch calls a
backend on a new group's members only), under an id and a shared-memory area the
group's rank 0 chooses through the job's store. Not yet: a receive from any source
(``recv`` without ``src``; it raises saying so). CPU tensors only.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

import swarmfd as fd
from swarmfd import _internal as _group

from . import collectives
from ._tensors import bits, check_cpu

BACKEND = "swarmfd"
#: Store keys of the rendezvous address rank 0 publishes (under torch's group prefix).
_KEY_ADDR, _KEY_PORT = "swarmfd/master_addr", "swarmfd/master_port"
#: The count of sub-groups made and each one's record (members, area) in the job's store;
#: a sub-group's id and area in its own.
_KEY_GROUPS, _KEY_RECORD, _KEY_GID = "swarmfd/subgroups", "swarmfd/subgroup", "swarmfd/gid"

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.PRODUCT: "prod",
        dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}


def _op(reduce_op: Any) -> str:
    for key, name in _OPS.items():
        if reduce_op == key:
            return name
    raise ValueError(f"swarmfd backend: reduce op {reduce_op} is not supported (supported: "
                     "SUM, AVG, PRODUCT, MIN, MAX)")


#: How long the completer drives swarmfd's engine on the oldest pending op before it looks
#: at the others again (the most a later op's completion goes unnoticed meanwhile).
COMPLETER_SLICE = 0.002


class _Completer:
    """Completes torch Futures from swarmfd Works, each as soon as its own op ends.

    torch's C++ side (its DDP, ``work.wait()``) waits on a Future; swarmfd's async ops
    progress on their own and only need someone to notice the end. An op already
    complete when issued is completed at once, without the thread. Ops may end in
    another order than they were issued (a send to one rank before an earlier receive
    from another), so no Future waits for an older op's: the thread drives swarmfd's
    engine on the oldest pending op a slice at a time and completes every op that ended.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Any, Future, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: Any, value: Any) -> Any:
        fut: Future = Future()
        if work is None:
            fut.set_result(value)
        elif work.is_completed():
            self._finish(work, fut, value)
        else:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="swarmfd-c10d-completer")
                    self._thread.start()
            self._q.put((work, fut, value))
        return _create_work_from_future(fut)

    @staticmethod
    def _finish(work: Any, fut: Future, value: Any) -> None:
        try:
            work.wait()
        except BaseException as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def _run(self) -> None:
        pending: list[tuple[Any, Future, Any]] = []
        while True:
            if not pending:
                pending.append(self._q.get())
            while True:
                try:
                    pending.append(self._q.get_nowait())
                except queue.Empty:
                    break
            still = []
            for item in pending:
                if item[0].is_completed():
                    self._finish(*item)
                else:
                    still.append(item)
            pending = still
            if pending:
                _drive(pending[0][0], COMPLETER_SLICE)


def _drive(work: Any, seconds: float) -> None:
    """Drive swarmfd's engine for at most ``seconds`` on the swarmfd Work under ``work``
    (a Work, or a wrapper of ours around some); its end, or failure, is seen later by
    ``is_completed``."""
    while isinstance(work, (_Then, _All)):
        work = work.pending()
        if work is None:
            return
    if isinstance(work, dist.Work):
        # One of our own torch Works (a coalesced call's part): this thread completes it.
        time.sleep(seconds)
        return
    with contextlib.suppress(BaseException):
        work.wait(seconds)


class ProcessGroupSwarmfd(dist.ProcessGroup):
    """torch's ProcessGroup interface over a swarmfd group (the world)."""

    def __init__(self, rank: int, size: int, group: Any = None) -> None:
        super().__init__(rank, size)
        self._group = group
        self._done = _Completer()

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def swarmfd_group(self) -> Any:
        return self._group

    def _check(self, tensors: list[torch.Tensor], fn: str) -> list[torch.Tensor]:
        for i, t in enumerate(tensors):
            check_cpu(t, f"tensor {i}", fn)
        return tensors

    def _world_rank(self, group_rank: int) -> int:
        return group_rank if self._group is None else int(self._group.ranks[group_rank])

    # -- collectives ----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = "sum" if opts is None else _op(opts.reduceOp)
        ts = self._check(list(tensors), "all_reduce")
        w = collectives.all_reduce(ts, op, group=self._group, async_op=True)
        return self._done.submit(w, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = 0 if opts is None else int(opts.rootRank)
        ts = self._check(list(tensors), "broadcast")
        w = collectives.broadcast(ts, src=self._world_rank(root), group=self._group,
                                  async_op=True)
        return self._done.submit(w, tensors)

    def _gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """all_gather of ``inp`` into ``out`` (size x inp, contiguous), async."""
        if out.dtype != inp.dtype:
            raise TypeError(f"all_gather: output dtype {out.dtype} differs from the input's "
                            f"{inp.dtype}")
        x = bits(inp.contiguous())
        rows = bits(out).reshape(self.size(), *x.shape)
        return fd.all_gather(x, out=rows, group=self._group, async_op=True)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        outs, inp = output_tensors[0], check_cpu(input_tensors[0], "input", "all_gather")
        if len(outs) != self.size():
            raise ValueError(f"all_gather: {len(outs)} output tensors, expected {self.size()}")
        staging = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
        w = self._gather_into(staging, inp)

        def copy_out() -> None:
            for o, row in zip(outs, staging, strict=True):
                o.copy_(row)

        return self._done.submit(_Then(w, copy_out), output_tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        check_cpu(output, "output", "all_gather_into_tensor")
        check_cpu(input, "input", "all_gather_into_tensor")
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, "
                             f"expected {self.size()} x {input.numel()}")
        return self._contiguous_out(output, lambda target: self._gather_into(target, input),
                                    [output])

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs,
                                                                     strict=True)]
        return _last(works, outputs, self._done)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _scatter_reduce(self, output: torch.Tensor, flat: torch.Tensor, op: str) -> Any:
        """Reduce ``flat`` (size x output's elements) and give this rank its part."""
        wide = flat.dtype is torch.bfloat16
        x = flat.to(torch.float32) if wide else flat.contiguous()
        res = torch.empty(output.numel(), dtype=x.dtype)
        w = fd.reduce_scatter(x.reshape(self.size(), -1).numpy(),
                              out=res.reshape(1, -1).numpy(), op=op, group=self._group,
                              async_op=True)
        return _Then(w, lambda: output.copy_(res.view(output.shape)))

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        out, ins = output_tensors[0], input_tensors[0]
        if len(ins) != self.size():
            raise ValueError(f"reduce_scatter: {len(ins)} input tensors, expected {self.size()}")
        flat = torch.stack([check_cpu(t, f"input {i}", "reduce_scatter").reshape(-1)
                            for i, t in enumerate(ins)])
        op = "sum" if opts is None else _op(opts.reduceOp)
        return self._done.submit(self._scatter_reduce(out, flat, op), output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        check_cpu(output, "output", "reduce_scatter_tensor")
        check_cpu(input, "input", "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"expected {self.size()} x {output.numel()}")
        op = "sum" if opts is None else _op(opts.reduceOp)
        return self._done.submit(self._scatter_reduce(output, input, op), [output])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        works = [self.reduce_scatter_single(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return _last(works, outputs, self._done)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = 0 if opts is None else int(opts.rootRank)
        t = check_cpu(tensors[0], "tensor", "reduce")
        op = "sum" if opts is None else _op(opts.reduceOp)
        # An all-reduce of a copy; only the root keeps the result (its peers' tensors
        # stay as they were, as torch documents for reduce).
        tmp = t.detach().clone()
        w = collectives.all_reduce(tmp, op, group=self._group, async_op=True)

        def keep() -> None:
            if self.rank() == root:
                t.copy_(tmp)

        return self._done.submit(_Then(w, keep), tensors)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = 0 if opts is None else int(opts.rootRank)
        inp = check_cpu(input_tensors[0], "input", "gather")
        staging = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
        w = self._gather_into(staging, inp)

        def keep() -> None:
            if self.rank() == root:
                for o, row in zip(output_tensors[0], staging, strict=True):
                    o.copy_(row)

        return self._done.submit(_Then(w, keep), output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = 0 if opts is None else int(opts.rootRank)
        out = check_cpu(output_tensors[0], "output", "scatter")
        staging = torch.empty((self.size(), *out.shape), dtype=out.dtype)
        if self.rank() == root:
            for row, t in zip(staging, input_tensors[0], strict=True):
                row.copy_(t)
        w = fd.broadcast(bits(staging), src=self._world_rank(root), group=self._group,
                         async_op=True)
        return self._done.submit(_Then(w, lambda: out.copy_(staging[self.rank()])),
                                 output_tensors)

    def barrier(self, opts: Any = None) -> Any:
        fd.barrier(group=self._group)
        return self._done.submit(None, [])

    def _contiguous_out(self, out: torch.Tensor, w_of: Any, outputs: Any) -> Any:
        """Run ``w_of(target)`` (an async swarmfd call writing ``target``) into ``out``
        itself when it is contiguous, else into a contiguous staging tensor copied into
        ``out`` once the call completed."""
        if out.is_contiguous():
            return self._done.submit(w_of(out), outputs)
        staging = torch.empty(out.shape, dtype=out.dtype)
        return self._done.submit(_Then(w_of(staging), lambda: out.copy_(staging)), outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Any:
        """``dist.all_to_all_single``: :func:`swarmfd.all_to_all` (the same semantics; empty
        split lists mean equal parts of the first dimension)."""
        check_cpu(output, "output", "all_to_all_single")
        check_cpu(input, "input", "all_to_all_single")
        if output.dtype != input.dtype:
            raise TypeError(f"all_to_all_single: output dtype {output.dtype} differs from the "
                            f"input's {input.dtype}")
        x = bits(input.contiguous())
        in_splits = [int(v) for v in input_split_sizes] or None
        out_splits = [int(v) for v in output_split_sizes] or None
        return self._contiguous_out(output, lambda target: fd.all_to_all(
            x, out=bits(target), in_splits=in_splits, out_splits=out_splits,
            group=self._group, async_op=True), [output])

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        """``dist.all_to_all``: input j goes to rank j, output j comes from rank j (any
        shapes, one dtype), as one :func:`swarmfd.all_to_all` of the flattened tensors."""
        n = self.size()
        if len(input_tensors) != n or len(output_tensors) != n:
            raise ValueError(f"all_to_all: {len(input_tensors)} input and "
                             f"{len(output_tensors)} output tensors, expected {n} of each")
        ins = [check_cpu(t, f"input {j}", "all_to_all") for j, t in enumerate(input_tensors)]
        outs = [check_cpu(t, f"output {j}", "all_to_all") for j, t in enumerate(output_tensors)]
        dtype = ins[0].dtype
        for what, t in [*((f"input {j}", t) for j, t in enumerate(ins)),
                        *((f"output {j}", t) for j, t in enumerate(outs))]:
            if t.dtype != dtype:
                raise TypeError(f"all_to_all: {what} has dtype {t.dtype}, expected input 0's "
                                f"{dtype} (every tensor of the call has one dtype)")
        flat = torch.cat([t.reshape(-1) for t in ins])
        staging = torch.empty(sum(t.numel() for t in outs), dtype=dtype)
        w = fd.all_to_all(bits(flat), out=bits(staging), in_splits=[t.numel() for t in ins],
                          out_splits=[t.numel() for t in outs], group=self._group,
                          async_op=True)

        def copy_out() -> None:
            at = 0
            for t in outs:
                t.copy_(staging[at:at + t.numel()].view(t.shape))
                at += t.numel()

        return self._done.submit(_Then(w, copy_out), output_tensors)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        """``dist.send``/``isend`` to group rank ``dst``: :func:`swarmfd.isend` (the
        tensor, or a contiguous copy of it, belongs to the call until it completed)."""
        t = check_cpu(tensors[0], "tensor", "send")
        w = fd.isend(bits(t.contiguous()), self._world_rank(dst), tag, group=self._group)
        return self._done.submit(w, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        """``dist.recv``/``irecv`` from group rank ``src`` into the tensor (its dtype and
        shape must be the sender's): :func:`swarmfd.irecv`."""
        t = check_cpu(tensors[0], "tensor", "recv")
        peer = self._world_rank(src)
        return self._contiguous_out(t, lambda target: fd.irecv(
            bits(target), peer, tag, group=self._group), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        raise NotImplementedError(
            "the swarmfd torch.distributed backend receives from a named rank only: "
            "dist.recv/irecv without src (from any source) is not supported; pass src=")


class _Then:
    """A swarmfd Work followed by a local step (copy-out) when it completes."""

    def __init__(self, work: Any, then: Any) -> None:
        self._work, self._then = work, then

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def pending(self) -> Any:
        """The Work to drive while this one has not completed (None: it has)."""
        return None if self._work.is_completed() else self._work

    def wait(self, timeout: float | None = None) -> Any:
        result = self._work.wait()
        self._then()
        return result


class _All:
    """One Work for several (coalesced calls): complete when all of them are."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def pending(self) -> Any:
        """The first of the Works that has not completed (None: all have)."""
        return next((w for w in self._works if not w.is_completed()), None)

    def wait(self, timeout: float | None = None) -> Any:
        for w in self._works:
            w.wait()


def _last(works: list[Any], outputs: Any, done: _Completer) -> Any:
    """One torch Work for several: it completes when all of them have."""
    return done.submit(_All(works), outputs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _join_swarmfd(store: Any, rank: int, size: int) -> None:
    """Initialise swarmfd's world: rank 0 publishes a rendezvous port via the store."""
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store.set(_KEY_ADDR, addr)
        store.set(_KEY_PORT, str(_free_port()))
    addr = store.get(_KEY_ADDR).decode()
    port = int(store.get(_KEY_PORT).decode())
    fd.init(size, rank, master_addr=addr, master_port=port)


def _root_store(store: Any) -> Any:
    """The store under torch's prefixes: the one every group of the job shares."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _subgroup(opts: Any, rank: int, ranks: list[int]) -> Any:
    """The swarmfd group of a torch sub-group, made by its members (torch calls the
    backend on them only). The group's rank 0 takes the next number from a counter in
    the job's store, reads the members and shared-memory areas of the sub-groups made
    before (each recorded there under its number, by its own rank 0, before it is
    usable), picks an area no sub-group with a member in common uses
    (:func:`swarmfd.group.choose_area`), records its own, and publishes its id and area
    in the group's own (prefixed) store, where the others read them."""
    if rank == 0:
        root = _root_store(opts.store)
        taken = int(root.add(_KEY_GROUPS, 1))
        gid = _group.MEMBERS_FIRST_GID + taken - 1
        if gid > _group.MEMBERS_MAX_GID:
            raise ValueError("the swarmfd torch.distributed backend has made "
                             f"{taken - 1} sub-groups, the most one job can")
        made = []
        for k in range(1, taken):
            record = json.loads(root.get(f"{_KEY_RECORD}/{k}").decode())
            made.append((frozenset(record["ranks"]), record["area"]))
        area = _group.choose_area(made, ranks, _group.MEMBER_AREAS)
        root.set(f"{_KEY_RECORD}/{taken}", json.dumps({"ranks": ranks, "area": area}))
        opts.store.set(_KEY_GID, json.dumps({"gid": gid, "area": area}))
    else:
        agreed = json.loads(opts.store.get(_KEY_GID).decode())
        gid, area = int(agreed["gid"]), agreed["area"]
    return _group.members_group(gid, ranks, area)


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupSwarmfd:
    """torch's backend creator (extended API): the world group over swarmfd, or a
    sub-group (``dist.new_group``) of it."""
    rank, size = int(opts.group_rank), int(opts.group_size)
    ranks = list(opts.global_ranks_in_group or range(size))
    if not fd.is_initialized():
        _join_swarmfd(opts.store, rank, size)
        return ProcessGroupSwarmfd(rank, size)
    world = fd.get_world_size()
    if ranks == list(range(world)):
        if fd.get_rank() != rank:
            raise RuntimeError(f"torch.distributed says this is rank {rank} of {size}, "
                               f"swarmfd says rank {fd.get_rank()} of {world}")
        return ProcessGroupSwarmfd(rank, size)
    if sorted(ranks) != ranks or ranks[rank] != fd.get_rank():
        raise RuntimeError(f"torch.distributed's group of ranks {ranks} says this is its rank "
                           f"{rank}; swarmfd is world rank {fd.get_rank()} (expected the "
                           "members in increasing order)")
    return ProcessGroupSwarmfd(rank, size, _subgroup(opts, rank, ranks))


def register() -> None:
    """Register ``"swarmfd"`` as a torch.distributed backend (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


__all__ = ["BACKEND", "ProcessGroupSwarmfd", "register"]
