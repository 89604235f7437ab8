"""The collectives: validation, then one call of a group, run by the algorithm the
selection table picks (:mod:`swarmfd.algorithms`).

Every function takes ``group=None`` (the world) or a :class:`swarmfd.Group`. Inside a
group, ``src`` and ``dst`` are world ranks, as in torch; ``group_src`` and
``group_dst`` take group ranks instead.

Inputs: numpy arrays of any dtype in :data:`swarmfd.comm.wire.DTYPES`, any shape (0-d
and empty included), C-contiguous or not (a non-contiguous array is worked on as a
contiguous copy and written back, so in-place semantics hold), ndarray subclasses
(through a plain view; masked arrays are refused), CPU torch tensors (through a
zero-copy numpy view), and for all_reduce, all_reduce_mean and broadcast a list of
arrays, moved as one fused buffer per dtype. Integer sums wrap around as numpy's do.
Float results are bitwise identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import group as _group
from .algorithms import select
from .algorithms.base import Op, run
from .comm import wire
from .comm.wire import Collective, ReduceOp, Signature
from .engine import Work, completed, joined
from .errors import SwarmfdError

__all__ = ["all_gather", "all_reduce", "all_reduce_mean", "barrier", "broadcast", "reduce"]

T = TypeVar("T")

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_OP_NAMES = {"sum": ReduceOp.SUM, "prod": ReduceOp.PROD, "product": ReduceOp.PROD,
             "min": ReduceOp.MIN, "max": ReduceOp.MAX}


# -- inputs ---------------------------------------------------------------------------


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """A numpy view of ``x`` (an ndarray or a CPU torch tensor), or a TypeError.

    An ndarray subclass (np.matrix, np.memmap, ...) is worked on through a plain ndarray
    view of the same memory, so in-place results land in it; a masked array is refused,
    since its mask would be silently ignored.
    """
    if isinstance(x, np.ndarray):
        if type(x) is np.ndarray:
            return x
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"swarmfd.{name}: a masked array cannot be reduced (its mask would "
                            "be ignored); pass np.ma.filled(x, fill_value) or x.data")
        return x.view(np.ndarray)
    if hasattr(x, "detach") and hasattr(x, "numpy") and hasattr(x, "device"):
        if getattr(x.device, "type", "cpu") != "cpu":
            raise TypeError(f"swarmfd.{name}: only CPU tensors are supported, got a tensor on "
                            f"{x.device} (this build has no GPU path); move it with .cpu() "
                            "first")
        try:
            return x.detach().numpy()
        except (TypeError, RuntimeError) as exc:
            raise TypeError(f"swarmfd.{name}: cannot view tensor of dtype {x.dtype} as a numpy "
                            f"array ({exc}); expected one of {wire.SUPPORTED_DTYPE_NAMES} "
                            "(bfloat16 tensors: use swarmfd.torch)") from None
    raise TypeError(_not_an_array(x, name))


def _not_an_array(x: Any, name: str) -> str:
    """The refusal of ``x``, with a hint that fits what it is."""
    kind = type(x).__name__
    if x is None:
        hint = "a None where an array belongs (a parameter without a gradient?)"
    elif isinstance(x, dict):
        hint = ("a mapping (a state_dict?): pass list(d.values()), or use "
                "swarmfd.torch.broadcast_parameters for a module")
    elif hasattr(x, "__next__") or (hasattr(x, "__iter__") and not hasattr(x, "__len__")):
        hint = ("an iterator or generator (model.parameters()?): pass a list, e.g. "
                "list(model.parameters())")
    else:
        hint = "wrap scalars and Python lists with np.asarray(...)"
    return (f"swarmfd.{name} expects a numpy array, a CPU torch tensor or a list of them, "
            f"got {kind}: {hint}")


def _check_array(arr: np.ndarray, name: str, *, writable: bool = True) -> int:
    try:
        code = wire.dtype_code(arr.dtype)
    except TypeError as exc:
        raise TypeError(f"swarmfd.{name}: {exc}") from None
    if writable and not arr.flags.writeable:
        raise ValueError(f"swarmfd.{name} works in place but the array is read-only; pass a "
                         "writable array (e.g. arr.copy())")
    return code


def _parse_op(op: Any, name: str) -> tuple[ReduceOp, bool]:
    """(reduce op, is_mean) from a string like "sum" or a ReduceOp."""
    if isinstance(op, ReduceOp) and op != ReduceOp.NONE:
        return (ReduceOp.SUM, True) if op == ReduceOp.MEAN else (op, False)
    if isinstance(op, str):
        key = op.lower()
        if key in ("mean", "avg", "average"):
            return ReduceOp.SUM, True
        if key in _OP_NAMES:
            return _OP_NAMES[key], False
    raise ValueError(f"swarmfd.{name}: unsupported op {op!r}: expected one of "
                     "'sum', 'prod', 'min', 'max', 'mean' (or its alias 'avg')")


def _check_op_dtype(op: ReduceOp, mean: bool, dtype: np.dtype, name: str) -> None:
    if mean and dtype.kind not in "fc":
        raise TypeError(f"swarmfd.{name}: the mean of {dtype} values cannot be stored in place; "
                        "expected a floating-point array (or use op='sum' and divide)")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
        raise TypeError(f"swarmfd.{name}: op {op.label} is not defined for complex dtype {dtype}")


def _check_rank(value: Any, size: int, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"swarmfd.{name}: {what} must be an integer rank, got {value!r}")
    if not 0 <= int(value) < size:
        raise ValueError(f"swarmfd.{name}: {what}={value} is out of range: expected "
                         f"0 <= {what} < {'world_size' if what in ('src', 'dst') else 'size'} "
                         f"({size})")
    return int(value)


def _root(g: _group.Group, world_rank: Any, group_rank: Any, what: str, name: str) -> int:
    """The group rank of a root given as a world rank (``what``) or a group rank."""
    if group_rank is not None:
        return _check_rank(group_rank, g.size, f"group_{what}", name)
    r = _check_rank(world_rank, g._state.config.world_size, what, name)
    return g.world_to_group(r, what, name)


def _flat(arr: np.ndarray) -> tuple[np.ndarray, Callable[[], None] | None]:
    """A flat contiguous view of ``arr`` (or a copy plus the function that writes it back)."""
    if arr.flags.c_contiguous:
        return arr.reshape(-1), None
    tmp = np.ascontiguousarray(arr).reshape(-1)

    def write_back() -> None:
        np.copyto(arr, tmp.reshape(arr.shape))

    return tmp, write_back


# -- running a call ---------------------------------------------------------------------


def _label(g: _group.Group, sig: Signature) -> str:
    return (f"{sig.coll.label} (call #{g.seq} on rank {g.world_rank}"
            + ("" if g.gid == _group.WORLD_GID else f", {g.name}") + ")")


def _run(g: _group.Group, sig: Signature, make: Callable[[Op], Any] | None,
         finish: Callable[[Any], Any] | None = None, async_op: bool = False) -> Any:
    """Run, or with ``async_op`` issue, the group's next call: ``make(op)`` gives the
    algorithm to drive (None: nothing to send), ``finish(result)`` runs once it
    completed (write-backs) and gives the call's result. A failure breaks the group
    (see swarmfd.group). Returns the result, or a :class:`Work` with ``async_op``."""
    if g.broken is not None:
        if async_op:
            return completed(None, f"{sig.coll.label} on rank {g.world_rank}", _broken(g))
        raise _broken(g)
    g.seq += 1
    label = _label(g, sig)
    plane = g.plane()
    if plane is None or g.size == 1 or make is None:
        result = finish(None) if finish is not None else None
        return completed(result, label) if async_op else result
    ch = g.channel
    op = Op(ch, plane, list(g.ranks), g.rank, g.gid, g.seq, sig,
            plane if plane.kind == "shm" else None, g.next_slot)
    engine = g._state.engine
    if not async_op and engine.idle():
        with engine.lock:  # the progress thread may be finishing its last step
            return _inline(g, op, make, finish, label)
    work = engine.submit(g, op, make(op), label, finish)
    return work if async_op else work.wait()


def _inline(g: _group.Group, op: Op, make: Callable[[Op], Any],
            finish: Callable[[Any], Any] | None, label: str) -> Any:
    """A blocking call on the caller's thread (nothing else pending)."""
    ch = op.channel
    ch.begin(g.gid, g.seq)
    ch.set_group(g.gid)
    ch.activity = label
    try:
        if len(ch.planes) > 1:
            # Aborts may come on another plane than this call's: read what waits there.
            ch.service([p for p in ch.planes if p is not op.plane])
        result = run(op, make(op))
        ch.flush()
        return finish(result) if finish is not None else result
    except BaseException as exc:
        g.broken = exc
        ch.abort(exc, g.gid)
        raise
    finally:
        ch.activity = "idle"


def _broken(g: _group.Group) -> BaseException:
    b = g.broken
    where = "" if g.gid == _group.WORLD_GID else f" ({g.name})"
    if isinstance(b, SwarmfdError):
        return type(b)(f"the process group{where} is unusable after an earlier failure ({b}); "
                       "call swarmfd.cleanup() and swarmfd.init() to start again")
    return RuntimeError(f"the process group{where} is unusable after an earlier failure: "
                        f"{b!r}")


_SIGNATURES: dict[tuple[Any, ...], Signature] = {}


def _signature(coll: Collective, arrays: Sequence[np.ndarray], code: int, op: ReduceOp,
               root: int = wire.NO_ROOT) -> Signature:
    """The call's signature (cached: training loops repeat the same calls)."""
    key = (coll, op, code, root, *(a.shape for a in arrays))
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) > 4096:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = _make_signature(coll, arrays, code, op, root)
    return sig


def _make_signature(coll: Collective, arrays: Sequence[np.ndarray], code: int, op: ReduceOp,
                    root: int) -> Signature:
    if len(arrays) == 1:
        shape = tuple(arrays[0].shape)
        shape_key: Any = shape
        shape_repr = str(shape)
    else:
        shape_key = tuple(tuple(a.shape) for a in arrays)
        shape_repr = wire.list_repr(len(arrays), sum(a.size for a in arrays))
    return Signature(coll, op, code, root, sum(a.size for a in arrays),
                     wire.shape_hash(shape_key), shape_repr, len(arrays) > 1)


def _fused(g: _group.Group, items: Sequence[Any], name: str, coll: Collective, op: ReduceOp,
           root: int, body: Callable[[Op, np.ndarray], Any],
           check: Callable[[np.ndarray], None] | None = None,
           async_op: bool = False) -> list[Any]:
    """Run ``body`` once per dtype over the arrays of ``items`` fused into one buffer
    (a reused scratch buffer, or a new one for an async call, which owns it until it
    completes); every part is copied back when its call completes. Returns each call's
    result (a Work each with ``async_op``)."""
    arrays = []
    for i, x in enumerate(items):
        try:
            arrays.append(_to_numpy(x, name))
        except TypeError as exc:
            raise TypeError(f"{exc} (element {i} of the list)") from None
    groups: dict[np.dtype, list[np.ndarray]] = {}
    for arr in arrays:
        _check_array(arr, name)
        if check is not None:
            check(arr)
        groups.setdefault(arr.dtype, []).append(arr)
    out = []
    for dtype, members in groups.items():
        sig = _signature(coll, members, wire.dtype_code(dtype), op, root)
        total = sum(a.size for a in members)
        flat = np.empty(total, dtype) if async_op else g.scratch(dtype, total)
        off = 0
        for a in members:
            flat[off:off + a.size] = a.reshape(-1)
            off += a.size

        def finish(_: Any, flat: np.ndarray = flat, members: list[np.ndarray] = members) -> None:
            off = 0
            for a in members:
                np.copyto(a, flat[off:off + a.size].reshape(a.shape))
                off += a.size

        out.append(_run(g, sig, lambda o, flat=flat: body(o, flat), finish, async_op))
    return out


def _fused_result(x: Any, parts: list[Any], name: str, async_op: bool) -> Any:
    """What a call on a list returns: the list, or a Work that gives it."""
    if not async_op:
        return x
    return joined(parts, name, lambda: x) if parts else completed(x, name)


def _items(x: Any) -> Sequence[Any] | None:
    """The elements of ``x`` when it is a list (or tuple) of arrays to fuse, else None."""
    return x if isinstance(x, (list, tuple)) else None


# -- all_reduce -------------------------------------------------------------------------


def _all_reduce_algo(o: Op, flat: np.ndarray, rop: ReduceOp, mean: bool, ring: list[int],
                     two: Any = None) -> Any:
    ufunc = _UFUNCS[rop]
    hier = two and select.all_reduce_two_level(flat.nbytes, two[0])
    if hier:
        yield from hier(o, flat, ufunc, *two)
        if mean:
            yield o.flush()  # pieces of flat may still be on their way to a peer
            np.divide(flat, o.size, out=flat)
        return
    algo = select.all_reduce(o.plane.kind, flat.nbytes, o.size, flat.size)
    if algo is select.tcp.all_reduce_ring:
        yield from algo(o, flat, ufunc, ring)
    else:
        yield from algo(o, flat, ufunc)
    if mean:
        yield o.flush()  # pieces of flat may still be on their way to a peer
        np.divide(flat, o.size, out=flat)


def all_reduce(x: T, op: str = "sum", *, group: Any = None, async_op: bool = False) -> T:
    """Reduce ``x`` across the group's ranks, in place, and return it.

    ``op`` is ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"`` (alias
    ``"avg"``). ``x`` is a numpy array, a CPU torch tensor, or a list of them (fused
    into one buffer per dtype). Every rank ends with bitwise identical values. With
    ``async_op=True`` returns a :class:`swarmfd.Work` whose ``wait()`` returns ``x``.
    """
    g = _group.resolve_group(group, "all_reduce()")
    rop, mean = _parse_op(op, "all_reduce")
    wire_op = ReduceOp.MEAN if mean else rop

    def body(o: Op, flat: np.ndarray) -> Any:
        return _all_reduce_algo(o, flat, rop, mean, g.ring, g.two_level())

    items = _items(x)
    if items is not None:
        parts = _fused(g, items, "all_reduce", Collective.ALL_REDUCE, wire_op, wire.NO_ROOT,
                       body, lambda a: _check_op_dtype(rop, mean, a.dtype, "all_reduce"),
                       async_op)
        return _fused_result(x, parts, "all_reduce", async_op)
    arr = _to_numpy(x, "all_reduce")
    code = _check_array(arr, "all_reduce")
    _check_op_dtype(rop, mean, arr.dtype, "all_reduce")
    flat, write_back = _flat(arr)
    return _run(g, _signature(Collective.ALL_REDUCE, [arr], code, wire_op),
                lambda o: body(o, flat), _returns(x, write_back), async_op)


def _returns(x: Any, write_back: Callable[[], None] | None) -> Callable[[Any], Any]:
    """The ``finish`` of an in-place call: write back (a non-contiguous array), give ``x``."""
    def finish(_: Any) -> Any:
        if write_back is not None:
            write_back()
        return x
    return finish


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

    def body(o: Op, flat: np.ndarray) -> Any:
        two = g.two_level()
        hier = two and select.broadcast_two_level(flat.nbytes, two[0])
        if hier:
            return hier(o, flat, root, *two)
        return select.broadcast(o.plane.kind, flat.nbytes, o.size)(o, flat, root)

    items = _items(x)
    if items is not None:
        parts = _fused(g, items, "broadcast", Collective.BROADCAST, ReduceOp.NONE, root, body,
                       async_op=async_op)
        return _fused_result(x, parts, "broadcast", async_op)
    arr = _to_numpy(x, "broadcast")
    code = _check_array(arr, "broadcast")
    flat, write_back = _flat(arr)
    return _run(g, _signature(Collective.BROADCAST, [arr], code, ReduceOp.NONE, root),
                lambda o: body(o, flat), _returns(x, write_back), async_op)


def reduce(x: T, dst: int = 0, op: str = "sum", *, group: Any = None,
           group_dst: int | None = None, async_op: bool = False) -> T:
    """Reduce ``x`` across the group's ranks into ``dst``'s ``x`` (in place) and return it.

    ``dst`` is a world rank (``group_dst``: a rank of ``group``). Other ranks' arrays
    are left unchanged.
    """
    g = _group.resolve_group(group, "reduce()")
    root = _root(g, dst, group_dst, "dst", "reduce")
    rop, mean = _parse_op(op, "reduce")
    arr = _to_numpy(x, "reduce")
    code = _check_array(arr, "reduce")
    _check_op_dtype(rop, mean, arr.dtype, "reduce")
    flat, write_back = _flat(arr)

    def body(o: Op) -> Any:
        two = g.two_level()
        hier = two and select.reduce_two_level(flat.nbytes, two[0])
        if hier:
            yield from hier(o, flat, root, _UFUNCS[rop], *two)
        else:
            yield from select.reduce(o.plane.kind, flat.nbytes, o.size)(o, flat, root,
                                                                        _UFUNCS[rop])
        if mean and o.me == root:
            yield o.flush()
            np.divide(flat, o.size, out=flat)

    return _run(g, _signature(Collective.REDUCE, [arr], code, ReduceOp.MEAN if mean else rop,
                              root),
                body, _returns(x, write_back if g.rank == root else None), async_op)


# -- all_gather -------------------------------------------------------------------------


def all_gather(x: Any, out: Any = None, *, group: Any = None,
               async_op: bool = False) -> list[np.ndarray]:
    """Every rank's ``x``, as a list of arrays in group-rank order (same shape and dtype).

    Without ``out`` the result is a new array of N times ``x``'s size, allocated
    every call. In a loop, pass ``out``: a writable C-contiguous numpy array (or
    CPU tensor) of shape ``(size, *x.shape)`` and ``x``'s dtype, reused every call;
    it is filled in place and the list holds views of its rows (no allocation, and
    no fresh pages to fault in for large results).
    """
    g = _group.resolve_group(group, "all_gather()")
    arr = _to_numpy(x, "all_gather")
    code = _check_array(arr, "all_gather", writable=False)
    flat = np.ascontiguousarray(arr).reshape(-1)
    n = g.size
    if out is None:
        rows = np.empty((n, flat.size), dtype=arr.dtype)
    else:
        rows = _gather_out(_to_numpy(out, "all_gather"), arr, n,
                           "world_size" if g.gid == _group.WORLD_GID else "group size"
                           ).reshape(n, flat.size)
    rows[g.rank] = flat

    def body(o: Op) -> Any:
        two = g.two_level()
        hier = two and select.all_gather_two_level(flat.nbytes, two[0])
        if hier:
            return hier(o, rows, *two)
        algo = select.all_gather(o.plane.kind, flat.nbytes, o.size)
        if algo is select.tcp.all_gather_ring:
            return algo(o, rows, g.ring)
        return algo(o, rows)

    return _run(g, _signature(Collective.ALL_GATHER, [arr], code, ReduceOp.NONE), body,
                lambda _: [rows[r].reshape(arr.shape) for r in range(n)], async_op)


def _gather_out(out: np.ndarray, arr: np.ndarray, size: int, what: str) -> np.ndarray:
    """``out`` checked as all_gather's result buffer for ``arr`` (ValueError/TypeError)."""
    want = (size, *arr.shape)
    if out.dtype != arr.dtype:
        raise TypeError(f"swarmfd.all_gather: out has dtype {out.dtype}, expected x's dtype "
                        f"{arr.dtype}")
    if out.shape != want:
        raise ValueError(f"swarmfd.all_gather: out has shape {out.shape}, expected "
                         f"({what}, *x.shape) = {want}")
    if not out.flags.c_contiguous:
        raise ValueError("swarmfd.all_gather: out must be C-contiguous (e.g. from np.empty)")
    if not out.flags.writeable:
        raise ValueError("swarmfd.all_gather: out is read-only; pass a writable array")
    if np.shares_memory(out, arr):
        raise ValueError("swarmfd.all_gather: out overlaps x; pass a separate buffer")
    return out


# -- barrier ----------------------------------------------------------------------------


def barrier(*, group: Any = None, async_op: bool = False) -> Work | None:
    """Block until every rank of the group has called barrier() (``async_op``: a Work
    that completes then)."""
    g = _group.resolve_group(group, "barrier()")
    return _run(g, Signature(Collective.BARRIER), lambda o: select.tcp.barrier(o, 0),
                None, async_op)
