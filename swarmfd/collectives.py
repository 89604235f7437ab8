"""The collectives: each one a template over the call layer.

Each normalises its input (:mod:`swarmfd.inputs`), resolves the group, looks up (or
works out once) the call's :class:`~swarmfd.call.Schedule`, and runs it, or returns its
:class:`Work` with ``async_op=True``. Every function takes ``group=None`` (the world) or a
:class:`swarmfd.Group`; ``src`` and ``dst`` are world ranks, as in torch, ``group_src``
and ``group_dst`` group ranks. all_reduce, all_reduce_mean and broadcast also take a list
of arrays (one fused call per dtype). Integer sums wrap as numpy's do; float results are
bitwise identical on every rank.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import group as _group
from . import inputs as _in
from . import objects as _objects
from .algorithms import p2p as _p2p_algo
from .algorithms import select
from .algorithms.base import Op, Parts
from .call import Schedule, run_call, run_message, schedule
from .comm import wire
from .comm.wire import Collective, ReduceOp, Signature
from .engine import Work, completed, joined
from .errors import MismatchError, ProtocolError
from .objects import MAX_OBJECT_BYTES

__all__ = ["MAX_OBJECT_BYTES", "all_gather", "all_gather_object", "all_reduce", "all_reduce_mean",
           "all_to_all", "barrier", "broadcast", "broadcast_object", "gather", "irecv",
           "isend", "recv", "reduce", "reduce_scatter", "scatter", "send"]

T = TypeVar("T")
_UFUNCS = _in.UFUNCS
_root = _in.root
_ALL_REDUCE = Collective.ALL_REDUCE
#: The first item of a list call's key (a single array's key starts with its shape).
_LIST = "list"


def _returns(x: Any, write_back: Callable[[], None] | None) -> Callable[[Any], Any]:
    """The ``finish`` of an in-place call: write back (a non-contiguous array), give ``x``."""
    def finish(_: Any) -> Any:
        if write_back is not None:
            write_back()
        return x
    return finish


def _planned(g: _group.Group, key: Any, sig: Signature,
             choose: Callable[[Any], select.Choice], args: Sequence[Any] = ()) -> Schedule:
    """``g``'s schedule of ``key`` (None: this call's only): ``choose(plane)`` the
    selection's choice, ``args`` the algorithm's arguments before the choice's."""
    def make() -> Schedule:
        plane = g.plane()
        if plane is None or g.size == 1:
            return Schedule(g, sig, None)
        return Schedule(g, sig, choose(plane), args)
    return schedule(g, key, make)


# -- all_reduce -------------------------------------------------------------------------


def all_reduce(x: T, op: str = "sum", *, group: Any = None, async_op: bool = False) -> T:
    """Reduce ``x`` across the group's ranks, in place, and return it.

    ``op`` is ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"`` (alias
    ``"avg"``). ``x`` is a numpy array, a CPU torch tensor, or a list of them (fused
    into one buffer per dtype). Every rank ends with bitwise identical values. With
    ``async_op=True`` returns a :class:`swarmfd.Work` whose ``wait()`` returns ``x``.
    """
    g = _group.resolve_group(group, "all_reduce()")
    if type(x) is np.ndarray and type(op) is str and not async_op:
        s = g.schedules.get((x.shape, x.dtype, op))  # a repeated call: its schedule
        if s is not None:
            flags = x.flags
            if flags.c_contiguous and flags.writeable:
                s.run(x if x.ndim == 1 else x.reshape(-1))
                return x
    rop, mean = _in.parse_op(op, "all_reduce")
    if isinstance(x, (list, tuple)):
        return _fused_result(x, _all_reduce_list(g, x, op, rop, mean, async_op),
                             "all_reduce", async_op)
    arr = _in.to_numpy(x, "all_reduce")
    code = _in.check_array(arr, "all_reduce")
    _in.check_op_dtype(rop, mean, arr.dtype, "all_reduce")
    flat, write_back = _in.flat(arr)
    sig = _in.signature(_ALL_REDUCE, [arr], code, ReduceOp.MEAN if mean else rop)
    key = (arr.shape, arr.dtype, op) if isinstance(op, (str, ReduceOp)) else None
    s = _all_reduce_schedule(g, key, sig, flat.nbytes, flat.size, rop, mean)
    return run_call(s, (flat,), _returns(x, write_back), async_op)


def _all_reduce_schedule(g: _group.Group, key: Any, sig: Signature, nbytes: int, count: int,
                         rop: ReduceOp, mean: bool, arrays: int = 1) -> Schedule:
    """The schedule of an all_reduce of ``count`` items (``nbytes``; ``arrays`` arrays
    of one dtype), kept under ``key``."""
    return _planned(g, key, sig, lambda plane: select.all_reduce(
        plane, nbytes, g.size, count, g.two_level(), arrays),
        (_UFUNCS[rop], g.size if mean else 0))


def _all_reduce_list(g: _group.Group, items: Sequence[Any], op: Any, rop: ReduceOp,
                     mean: bool, async_op: bool) -> list[Any]:
    """all_reduce of a list: one call per dtype (:func:`_run_fused`)."""
    wire_op = ReduceOp.MEAN if mean else rop
    out = []
    for dtype, members in _by_dtype(items, "all_reduce", lambda a: _in.check_op_dtype(
            rop, mean, a.dtype, "all_reduce")).items():
        total = sum(a.size for a in members)
        key = (_LIST, tuple(a.shape for a in members), dtype, op) \
            if isinstance(op, (str, ReduceOp)) else None
        sig = _in.signature(_ALL_REDUCE, members, wire.dtype_code(dtype), wire_op)
        s = _all_reduce_schedule(g, key, sig, total * dtype.itemsize, total, rop, mean,
                                 len(members))
        out.append(_run_fused(g, s, members, dtype, total, async_op))
    return out


def _by_dtype(items: Sequence[Any], name: str,
              check: Callable[[np.ndarray], None] | None = None,
              ) -> dict[np.dtype, list[np.ndarray]]:
    """The arrays of a list (numpy views of its elements), checked, by dtype."""
    groups: dict[np.dtype, list[np.ndarray]] = {}
    for i, x in enumerate(items):
        try:
            arr = _in.to_numpy(x, name)
        except TypeError as exc:
            raise TypeError(f"{exc} (element {i} of the list)") from None
        _in.check_array(arr, name)
        if check is not None:
            check(arr)
        groups.setdefault(arr.dtype, []).append(arr)
    return groups


def _run_fused(g: _group.Group, s: Schedule, members: list[np.ndarray], dtype: np.dtype,
               total: int, async_op: bool) -> Any:
    """Run ``s`` over ``members``: as Parts where it takes them and they are contiguous,
    writable and disjoint, else through one buffer (the group's scratch; a new one for an
    async call) copied back."""
    if s.parts and total and _in.disjoint(members) and all(
            a.flags.c_contiguous and a.flags.writeable for a in members):
        return run_call(s, (Parts([a.reshape(-1) for a in members if a.size]),), None,
                        async_op)
    flat = np.empty(total, dtype) if async_op else g.scratch(dtype, total)
    at = 0
    for a in members:
        flat[at:at + a.size] = a.reshape(-1)
        at += a.size

    def finish(_: Any) -> None:
        at = 0
        for a in members:
            np.copyto(a, flat[at:at + a.size].reshape(a.shape))
            at += a.size

    return run_call(s, (flat,), finish, async_op)


def _fused_result(x: Any, parts: list[Any], name: str, async_op: bool) -> Any:
    """What a call on a list returns: the list, or a Work that gives it."""
    if not async_op:
        return x
    return joined(parts, name, lambda: x) if parts else completed(x, name)


def all_reduce_mean(x: T, *, group: Any = None, async_op: bool = False) -> T:
    """Average ``x`` across the group's ranks, in place, and return it (floating dtypes)."""
    return all_reduce(x, op="mean", group=group, async_op=async_op)


# -- broadcast and reduce ----------------------------------------------------------------


def broadcast(x: T, src: int = 0, *, group: Any = None, group_src: int | None = None,
              async_op: bool = False) -> T:
    """Copy ``src``'s ``x`` into every rank's ``x`` (in place) and return it.

    ``src`` is a world rank (``group_src``: a rank of ``group``).
    """
    g = _group.resolve_group(group, "broadcast()")
    root = _root(g, src, group_src, "src", "broadcast")
    items = _in.items(x)
    if items is not None:
        parts = []
        for dtype, members in _by_dtype(items, "broadcast").items():
            total = sum(a.size for a in members)
            sig = _in.signature(Collective.BROADCAST, members, wire.dtype_code(dtype),
                                ReduceOp.NONE, root)
            s = _broadcast_schedule(g, None, sig, total * dtype.itemsize, root)
            parts.append(_run_fused(g, s, members, dtype, total, async_op))
        return _fused_result(x, parts, "broadcast", async_op)
    arr = _in.to_numpy(x, "broadcast")
    code = _in.check_array(arr, "broadcast")
    flat, write_back = _in.flat(arr)
    sig = _in.signature(Collective.BROADCAST, [arr], code, ReduceOp.NONE, root)
    s = _broadcast_schedule(g, (Collective.BROADCAST, arr.shape, arr.dtype, root), sig,
                            flat.nbytes, root)
    return run_call(s, (flat,), _returns(x, write_back), async_op)


def _broadcast_schedule(g: _group.Group, key: Any, sig: Signature, nbytes: int,
                        root: int) -> Schedule:
    return _planned(g, key, sig, lambda plane: select.broadcast(
        plane, nbytes, g.size, root, g.two_level()), (root,))


def reduce(x: T, dst: int = 0, op: str = "sum", *, group: Any = None,
           group_dst: int | None = None, async_op: bool = False) -> T:
    """Reduce ``x`` across the group's ranks into ``dst``'s ``x`` (in place) and return it.

    ``dst`` is a world rank (``group_dst``: a rank of ``group``). Other ranks' arrays
    are left unchanged.
    """
    g = _group.resolve_group(group, "reduce()")
    root = _root(g, dst, group_dst, "dst", "reduce")
    rop, mean = _in.parse_op(op, "reduce")
    arr = _in.to_numpy(x, "reduce")
    code = _in.check_array(arr, "reduce")
    _in.check_op_dtype(rop, mean, arr.dtype, "reduce")
    flat, write_back = _in.flat(arr)
    sig = _in.signature(Collective.REDUCE, [arr], code, ReduceOp.MEAN if mean else rop, root)
    key = (Collective.REDUCE, arr.shape, arr.dtype, op, root) \
        if isinstance(op, (str, ReduceOp)) else None
    s = _planned(g, key, sig, lambda plane: select.reduce(
        plane, flat.nbytes, g.size, root, g.two_level()),
        (root, _UFUNCS[rop], g.size if mean else 0))
    return run_call(s, (flat,), _returns(x, write_back if g.rank == root else None),
                    async_op)


# -- all_gather -------------------------------------------------------------------------


def all_gather(x: Any, out: Any = None, *, group: Any = None,
               async_op: bool = False) -> list[np.ndarray]:
    """Every rank's ``x``, as a list of arrays in group-rank order.

    The dtype and every dimension but the first must agree; the first may differ
    between ranks (the ranks exchange it first, inside the call), and the list holds
    each rank's own shape. With ``out``, every rank's ``x`` must have the same shape:
    ``out`` is a writable C-contiguous numpy array (or CPU tensor) of shape
    ``(size, *x.shape)`` and ``x``'s dtype, reused every call; it is filled in place
    and the list holds views of its rows (no allocation, and no fresh pages to fault
    in for large results).
    """
    g = _group.resolve_group(group, "all_gather()")
    arr = _in.to_numpy(x, "all_gather")
    code = _in.check_array(arr, "all_gather", writable=False)
    flat = np.ascontiguousarray(arr).reshape(-1)
    n = g.size
    if out is None and arr.ndim > 0:
        return _all_gather_v(g, arr, flat, code, async_op)
    if out is None:
        rows = np.empty((n, flat.size), dtype=arr.dtype)
    else:
        rows = _in.gather_out(_in.to_numpy(out, "all_gather"), arr, n,
                              "world_size" if g.gid == _group.WORLD_GID else "group size"
                              ).reshape(n, flat.size)
    rows[g.rank] = flat
    sig = _in.signature(Collective.ALL_GATHER, [arr], code, ReduceOp.NONE)
    s = _planned(g, (Collective.ALL_GATHER, arr.shape, arr.dtype), sig,
                 lambda plane: select.all_gather(plane, flat.nbytes, n, g.two_level()))
    return run_call(s, (rows,), lambda _: [rows[r].reshape(arr.shape) for r in range(n)],
                    async_op)


def _all_gather_v(g: _group.Group, arr: np.ndarray, flat: np.ndarray, code: int,
                  async_op: bool) -> Any:
    """all_gather of first dimensions that may differ (:func:`_gather_v`)."""
    trailing = arr.shape[1:]
    sig = _in.cached((Collective.ALL_GATHER_V, code, trailing), lambda: Signature(
        Collective.ALL_GATHER_V, ReduceOp.NONE, code, wire.NO_ROOT,
        int(np.prod(trailing, dtype=np.int64)), wire.shape_hash(trailing),
        wire.rows_repr(str(trailing))))
    state: dict[str, Any] = {}
    s = _planned(g, (Collective.ALL_GATHER_V, arr.dtype, trailing), sig,
                 lambda plane: select.Choice("all_gather_v", _gather_v))

    def finish(_: Any) -> Any:
        if "parts" in state:  # every part came in one message
            return [p.reshape(c, *trailing)
                    for p, c in zip(state["parts"], state["counts"], strict=True)]
        if "res" not in state:  # a group of one
            return [arr.copy()]
        res, out, start, row = state["res"], [], 0, sig.count
        for c in state["counts"]:
            out.append(res[start * row:(start + c) * row].reshape(c, *trailing))
            start += c
        return out

    return run_call(s, (arr.shape[0], flat, sig.count, state, g.two_level()), finish,
                    async_op)


def _gather_v(op: Op, count: int, flat: np.ndarray, row: int, state: dict[str, Any],
              two: Any) -> Any:
    """The counts travel with the rows that fit (select.all_gather_counts); larger parts
    follow in a second phase, by the table."""
    n, plane = op.size, op.plane
    first = select.all_gather_counts(plane, n)
    counts, parts = yield from first.algo(op, count, flat, row * flat.itemsize, *first.args)
    if all(p is not None for p in parts):
        parts[op.me] = flat.copy()  # the result never aliases the input
        state["parts"], state["counts"] = parts, counts
        return
    bounds = _in.bounds(counts, row)
    res = np.empty(bounds[-1][1], flat.dtype)
    state["res"], state["counts"] = res, counts
    largest = max(b - a for a, b in bounds) * flat.itemsize
    second = select.all_gather_parts(plane, largest, n, len(set(counts)) == 1, two)
    yield from second.algo(op.phase(_SECOND_PHASE_TAGS), flat, res, bounds, *second.args)


# -- barrier ----------------------------------------------------------------------------


def barrier(*, group: Any = None, async_op: bool = False) -> Work | None:
    """Block until every rank of the group has called barrier() (``async_op``: a Work
    that completes then)."""
    g = _group.resolve_group(group, "barrier()")
    s = g.schedules.get(_BARRIER_KEY)
    if s is None:
        s = _planned(g, _BARRIER_KEY, _BARRIER, select.barrier)
    if async_op:
        return s.start()
    s.run()
    return None


_BARRIER = Signature(Collective.BARRIER)
_BARRIER_KEY = (Collective.BARRIER,)


# -- reduce_scatter ---------------------------------------------------------------------


def reduce_scatter(x: Any, out: Any = None, *, op: str = "sum", group: Any = None,
                   async_op: bool = False) -> Any:
    """Reduce ``x`` across the group and give rank r part r of the result.

    ``x`` is split along its first dimension as ``np.array_split`` would split it into
    group-size parts (uneven parts allowed; a first dimension smaller than the group
    gives some ranks empty parts). Returns ``out`` (a new array when None: part r's
    shape), or a Work that gives it. ``x`` itself is left unchanged.
    """
    g = _group.resolve_group(group, "reduce_scatter()")
    rop, mean = _in.parse_op(op, "reduce_scatter")
    arr = _in.to_numpy(x, "reduce_scatter")
    code = _in.check_array(arr, "reduce_scatter", writable=False)
    _in.check_op_dtype(rop, mean, arr.dtype, "reduce_scatter")
    rows, row = _in.dim0_parts(arr, g.size, "reduce_scatter")
    parts = [(a * row, b * row) for a, b in rows]
    a, b = rows[g.rank]
    res = _in.out_array(out, (b - a, *arr.shape[1:]), arr.dtype, "reduce_scatter", arr)
    flat = np.ascontiguousarray(arr).reshape(-1)
    sig = _in.signature(Collective.REDUCE_SCATTER, [arr], code,
                        ReduceOp.MEAN if mean else rop)
    key = (Collective.REDUCE_SCATTER, arr.shape, arr.dtype, op) \
        if isinstance(op, (str, ReduceOp)) else None
    return reduce_scatter_run(g, flat, parts, res.reshape(-1), res, rop, mean, sig, key,
                              async_op)


def reduce_scatter_run(g: _group.Group, src: np.ndarray | Parts, parts: list[tuple[int, int]],
                       res_flat: np.ndarray, result: Any, rop: ReduceOp, mean: bool,
                       sig: Signature, key: Any, async_op: bool) -> Any:
    """The reduce_scatter of ``src`` (flat: an array, or Parts read where they are) into
    ``res_flat`` (this rank's part of ``parts``); gives ``result``."""
    s = _planned(g, key, sig, lambda plane: select.reduce_scatter(
        plane, src.nbytes, g.size, g.two_level(),
        len(src.arrays) if isinstance(src, Parts) else 1),
        (parts, _UFUNCS[rop], g.size if mean else 0))
    if isinstance(src, Parts) and not s.parts:
        src = np.concatenate(src.arrays)

    def finish(_: Any) -> Any:
        if g.size == 1:
            np.copyto(res_flat, src if isinstance(src, np.ndarray)
                      else np.concatenate(src.arrays))
        return result

    return run_call(s, (src, res_flat), finish, async_op)


# -- all_to_all -------------------------------------------------------------------------


def _splits(value: Any, n: int, what: str) -> list[int] | None:
    """``value`` as ``n`` row counts: ints (numpy's too), never a bool, a float or a
    string read as one; None stays None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"swarmfd.all_to_all: {what} must be a list of {n} row counts, got "
                        f"{value!r}")
    splits = []
    for i, v in enumerate(value):
        try:
            if isinstance(v, (bool, np.bool_)):
                raise TypeError
            splits.append(operator.index(v))
        except TypeError:
            raise TypeError(f"swarmfd.all_to_all: {what}[{i}] is {v!r} ({type(v).__name__}): "
                            "expected a whole number of rows, an int") from None
        if splits[-1] < 0:
            raise ValueError(f"swarmfd.all_to_all: {what}[{i}] is {v!r}: expected a "
                             "non-negative number of rows")
    if len(splits) != n:
        raise ValueError(f"swarmfd.all_to_all: {what} must be {n} non-negative row counts "
                         f"(one per rank of the group), got {len(splits)}: {splits}")
    return splits


def all_to_all(x: Any, out: Any = None, *, in_splits: Any = None, out_splits: Any = None,
               group: Any = None, async_op: bool = False) -> Any:
    """Rank r sends part j of ``x`` to rank j and receives part r of every rank's ``x``,
    concatenated in rank order into ``out`` (torch's ``all_to_all_single``).

    Parts run along the first dimension: equal by default (the first dimension must
    divide by the group size), or ``in_splits`` rows each. The receiving rows,
    ``out_splits``: equal by default; with uneven ``in_splits`` and no ``out_splits``
    the ranks exchange their splits first (one small all_gather inside the call).
    Returns ``out`` (a new array when None), or a Work that gives it.
    """
    g = _group.resolve_group(group, "all_to_all()")
    arr = _in.to_numpy(x, "all_to_all")
    code = _in.check_array(arr, "all_to_all", writable=False)
    if arr.ndim == 0:
        raise ValueError("swarmfd.all_to_all splits its input along the first dimension, and "
                         "a 0-d array has none: pass an array of at least one dimension")
    rows_in, rows_out = _all_to_all_rows(g, arr, in_splits, out_splits)
    equal = in_splits is None and out_splits is None
    trailing = tuple(arr.shape[1:])
    sig = (_in.signature(Collective.ALL_TO_ALL, [arr], code, ReduceOp.NONE) if equal else
           Signature(Collective.ALL_TO_ALL, ReduceOp.NONE, code, wire.NO_ROOT, 0,
                     wire.shape_hash(("splits", *trailing)), f"(uneven splits, *{trailing})"))
    state: dict[str, Any] = {"out": out, "arr": arr}
    if rows_out is not None:
        state["res"] = _in.out_array(out, (sum(rows_out), *trailing), arr.dtype,
                                     "all_to_all", arr)
    known = rows_out is not None

    def choose(plane: Any) -> select.Choice:
        return select.Choice("all_to_all", _all_to_all, (
            select.all_to_all_splits(plane, g.size, equal, known), select.all_to_all(plane)))

    s = _planned(g, (Collective.ALL_TO_ALL, equal, known, arr.dtype, trailing), sig, choose)
    flat = np.ascontiguousarray(arr).reshape(-1)

    def finish(_: Any) -> Any:
        if "res" not in state:  # a group of one
            state["res"] = _in.out_array(out, arr.shape, arr.dtype, "all_to_all", arr)
        if g.size == 1:
            state["res"][...] = arr
        return state["res"]

    return run_call(s, (flat, rows_in, rows_out, state), finish, async_op)


def _all_to_all_rows(g: _group.Group, arr: np.ndarray, in_splits: Any,
                     out_splits: Any) -> tuple[list[int], list[int] | None]:
    """The rows this rank sends to each rank, and those it receives from each (None:
    to be learned from the others' in_splits, inside the call), checked."""
    n = g.size
    rows_in = _splits(in_splits, n, "in_splits")
    rows_out = _splits(out_splits, n, "out_splits")
    if rows_in is None:
        if arr.shape[0] % n:
            raise ValueError(f"swarmfd.all_to_all: the first dimension {arr.shape[0]} does not "
                             f"divide by the group size {n}: pass in_splits for uneven parts")
        rows_in = [arr.shape[0] // n] * n
    elif sum(rows_in) != arr.shape[0]:
        raise ValueError(f"swarmfd.all_to_all: in_splits {rows_in} add up to {sum(rows_in)}, "
                         f"but the first dimension is {arr.shape[0]}")
    if rows_out is not None and rows_in[g.rank] != rows_out[g.rank]:
        raise ValueError(f"swarmfd.all_to_all: this rank (group rank {g.rank}) sends itself "
                         f"{rows_in[g.rank]} rows (in_splits[{g.rank}]) but expects "
                         f"{rows_out[g.rank]} from itself (out_splits[{g.rank}]); they must "
                         "be equal")
    if rows_out is None and in_splits is None:
        rows_out = list(rows_in)
    return rows_in, rows_out


def _all_to_all(op: Op, flat: np.ndarray, rows_in: list[int], rows_out: list[int] | None,
                state: dict[str, Any], exchange: select.Choice | None,
                parts: select.Choice) -> Any:
    """The all_to_all of ``flat``: everyone's splits first where ``exchange`` (tags of
    their own), then ``parts`` moves the rows."""
    n, arr = op.size, state["arr"]
    matrix = None
    if exchange is not None:
        every = np.empty((n, n), np.int64)  # rank p's row: what p sends to each rank
        every[op.me] = rows_in
        yield from exchange.algo(op.phase(_SECOND_PHASE_TAGS), every, *exchange.args)
        matrix = every
        theirs = [int(every[p, op.me]) for p in range(n)]
        if rows_out is None:
            rows_out = theirs
        elif rows_out != theirs:
            raise MismatchError(
                f"swarmfd.all_to_all: out_splits {rows_out} of rank {op.ranks[op.me]} differ "
                f"from what the ranks send it ({theirs}): every rank's in_splits[r] must "
                "equal rank r's out_splits for it")
    assert rows_out is not None
    if "res" not in state:
        state["res"] = _in.out_array(state["out"], (sum(rows_out), *arr.shape[1:]), arr.dtype,
                                     "all_to_all", arr)
    if matrix is None:
        matrix = np.full((n, n), rows_in[0], np.int64)
    row = int(np.prod(arr.shape[1:], dtype=np.int64))
    yield from parts.algo(op, flat, state["res"].reshape(-1), matrix, rows_in, rows_out, row)


#: Where the tags of a call's second phase start (sizes, then data: Op.phase).
_SECOND_PHASE_TAGS = 1 << 30


# -- gather and scatter -----------------------------------------------------------------


def gather(x: Any, dst: int = 0, out: Any = None, *, group: Any = None,
           group_dst: int | None = None, async_op: bool = False) -> Any:
    """Every rank's ``x`` (same shape and dtype), as a list in group-rank order on ``dst``
    (a world rank; ``group_dst`` a group rank); None on the other ranks.

    ``out`` (used on ``dst`` only, ignored elsewhere) is a writable C-contiguous array
    of shape ``(size, *x.shape)`` and ``x``'s dtype, filled in place and reused every
    call: the list then holds views of its rows, as all_gather's ``out``.
    """
    g = _group.resolve_group(group, "gather()")
    root = _root(g, dst, group_dst, "dst", "gather")
    arr = _in.to_numpy(x, "gather")
    code = _in.check_array(arr, "gather", writable=False)
    flat = np.ascontiguousarray(arr).reshape(-1)
    rows = None
    if g.rank == root:
        if out is None:
            rows = np.empty((g.size, flat.size), arr.dtype)
        else:
            rows = _in.gather_out(_in.to_numpy(out, "gather"), arr, g.size,
                                  "world_size" if g.gid == _group.WORLD_GID else "group size",
                                  "gather").reshape(g.size, flat.size)
        rows[g.rank] = flat
    sig = _in.signature(Collective.GATHER, [arr], code, ReduceOp.NONE, root)
    s = _planned(g, (Collective.GATHER, arr.shape, arr.dtype, root), sig, select.gather,
                 ())

    def finish(_: Any) -> Any:
        if rows is None:
            return None
        return [rows[r].reshape(arr.shape) for r in range(g.size)]

    return run_call(s, (flat, rows, root), finish, async_op)


def scatter(out: Any, chunks: Any = None, src: int = 0, *, group: Any = None,
            group_src: int | None = None, async_op: bool = False) -> Any:
    """Fill every rank's ``out`` with its chunk of ``src``'s ``chunks`` (a list of one
    array per group rank, each of ``out``'s shape and dtype, given on ``src`` only; or
    one array of shape ``(size, *out.shape)``, sent from without a copy when it is
    C-contiguous). ``src`` is a world rank (``group_src``: a group rank). Returns ``out``."""
    g = _group.resolve_group(group, "scatter()")
    root = _root(g, src, group_src, "src", "scatter")
    o_arr = _in.to_numpy(out, "scatter")
    code = _in.check_array(o_arr, "scatter")
    stacked = _scatter_chunks(g, chunks, o_arr) if g.rank == root else None
    flat, write_back = _in.flat(o_arr)
    sig = _in.signature(Collective.SCATTER, [o_arr], code, ReduceOp.NONE, root)
    s = _planned(g, (Collective.SCATTER, o_arr.shape, o_arr.dtype, root), sig,
                 select.scatter)

    def finish(_: Any) -> Any:
        if g.size == 1 and stacked is not None:
            flat[...] = stacked[0]
        if write_back is not None:
            write_back()
        return out

    return run_call(s, (stacked, flat, root), finish, async_op)


def _scatter_chunks(g: _group.Group, chunks: Any, o_arr: np.ndarray) -> np.ndarray:
    """The root's ``chunks`` as one (size, out.size) array, checked."""
    if isinstance(chunks, np.ndarray) or hasattr(chunks, "detach"):
        whole = _in.to_numpy(chunks, "scatter")
        want = (g.size, *o_arr.shape)
        if whole.shape != want or whole.dtype != o_arr.dtype:
            raise ValueError(f"swarmfd.scatter: chunks as one array must have shape {want} "
                             f"and out's dtype {o_arr.dtype}, got shape {whole.shape} and "
                             f"dtype {whole.dtype}")
        if np.shares_memory(whole, o_arr):
            raise ValueError("swarmfd.scatter: out overlaps chunks; pass a separate buffer")
        return np.ascontiguousarray(whole).reshape(g.size, o_arr.size)
    items = _in.items(chunks)
    if items is None or len(items) != g.size:
        raise ValueError(f"swarmfd.scatter: on src, chunks must be a list of {g.size} "
                         f"arrays (one per rank of the group) or one array of shape "
                         f"({g.size}, *out.shape), got {type(chunks).__name__}"
                         + (f" of {len(items)}" if items is not None else ""))
    stacked = np.empty((g.size, o_arr.size), o_arr.dtype)
    for i, c in enumerate(items):
        a = _in.to_numpy(c, "scatter")
        if a.shape != o_arr.shape or a.dtype != o_arr.dtype:
            raise ValueError(f"swarmfd.scatter: chunk {i} has shape {a.shape} and dtype "
                             f"{a.dtype}, expected out's {o_arr.shape} and {o_arr.dtype}")
        stacked[i] = a.reshape(-1)
    return stacked


# -- point to point -----------------------------------------------------------------------


def _p2p(g: _group.Group, x: Any, peer: int, tag: Any, sending: bool,
         async_op: bool) -> Any:
    name = "send" if sending else "recv"
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not (
            0 <= int(tag) < 1 << 32):
        raise ValueError(f"swarmfd.{name}: tag must be an integer 0 <= tag < 2**32, got "
                         f"{tag!r}")
    tag = int(tag)
    if peer == g.world_rank:
        raise ValueError(f"swarmfd.{name}: rank {peer} cannot {name} to itself")
    arr = _in.to_numpy(x, name)
    code = _in.check_array(arr, name, writable=not sending)
    flat, write_back = (np.ascontiguousarray(arr).reshape(-1), None) if sending else \
        _in.flat(arr)
    sig = _in.signature(Collective.P2P, [arr], code, ReduceOp.NONE)
    label = f"{name} (tag {tag} {'to' if sending else 'from'} rank {peer} on rank " \
            f"{g.world_rank})"
    if g.broken is not None:
        if async_op:
            return completed(None, label, g.failure())
        raise g.failure()
    counters = g.p2p_sent if sending else g.p2p_received
    seq = counters.get((peer, tag), 0) + 1
    counters[(peer, tag)] = seq
    op = Op(g.channel, g.tcp, list(g.ranks), g.rank, g.gid, -1, sig)
    gen = (_p2p_algo.send if sending else _p2p_algo.recv)(op, flat, peer, seq, tag)
    return run_message(g, op, gen, label, _returns(None if sending else x, write_back),
                       async_op)


def _peer(g: _group.Group, rank: Any, group_rank: Any, what: str, name: str) -> int:
    """The world rank of a peer given as a world rank or (``group_rank``) a group rank."""
    return g.ranks[_root(g, rank, group_rank, what, name)]


def send(x: Any, dst: int, tag: int = 0, *, group: Any = None,
         group_dst: int | None = None) -> None:
    """Send ``x`` to rank ``dst`` (a world rank; ``group_dst``: a group rank) with ``tag``.

    Matching, order and flow control: see :mod:`swarmfd.algorithms.p2p`. A message of up
    to 16 KiB is copied and the call returns at once; a larger one returns once ``dst``'s
    recv took it.
    """
    g = _group.resolve_group(group, "send()")
    _p2p(g, x, _peer(g, dst, group_dst, "dst", "send"), tag, True, False)


def recv(x: Any, src: int, tag: int = 0, *, group: Any = None,
         group_src: int | None = None) -> Any:
    """Receive the next message of (``src``, ``tag``) into ``x`` (in place; its dtype and
    shape must be the sender's) and return ``x``."""
    g = _group.resolve_group(group, "recv()")
    return _p2p(g, x, _peer(g, src, group_src, "src", "recv"), tag, False, False)


def isend(x: Any, dst: int, tag: int = 0, *, group: Any = None,
          group_dst: int | None = None) -> Work:
    """:func:`send`, as a Work (``x`` belongs to it until ``wait()`` returns)."""
    g = _group.resolve_group(group, "isend()")
    return _p2p(g, x, _peer(g, dst, group_dst, "dst", "isend"), tag, True, True)


def irecv(x: Any, src: int, tag: int = 0, *, group: Any = None,
          group_src: int | None = None) -> Work:
    """:func:`recv`, as a Work whose ``wait()`` returns ``x``."""
    g = _group.resolve_group(group, "irecv()")
    return _p2p(g, x, _peer(g, src, group_src, "src", "irecv"), tag, False, True)


# -- objects ------------------------------------------------------------------------------


def broadcast_object(obj: Any, src: int = 0, *, group: Any = None,
                     group_src: int | None = None) -> Any:
    """``src``'s ``obj`` on every rank, ``src`` included, as :mod:`swarmfd.objects`
    encodes it (plain values, tuples, sets, bytes; never pickled), at most
    MAX_OBJECT_BYTES encoded. Other ranks' ``obj`` is ignored. An object that cannot be
    sent raises the same TypeError or ValueError on every rank."""
    g = _group.resolve_group(group, "broadcast_object()")
    root = _root(g, src, group_src, "src", "broadcast_object")
    data = _objects.encode(obj) if g.rank == root else None
    length = np.array([0 if data is None else data.size], np.int64)
    broadcast(length, group=g, group_src=root)
    n = int(length[0])
    if not 0 <= n <= MAX_OBJECT_BYTES:
        raise ProtocolError(f"swarmfd.broadcast_object: rank {g.ranks[root]} announced an "
                            f"object of {n} bytes (at most {MAX_OBJECT_BYTES})")
    buf = data.copy() if data is not None else np.empty(n, np.uint8)
    broadcast(buf, group=g, group_src=root)
    return _objects.decode(buf, "broadcast_object", g.ranks[root])


def all_gather_object(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (see :func:`broadcast_object`), as a list in group-rank
    order, decoded alike on every rank (this rank's own entry included)."""
    g = _group.resolve_group(group, "all_gather_object()")
    parts = all_gather(_objects.encode(obj), group=g)
    return _objects.decode_all(parts, "all_gather_object", g.ranks)
