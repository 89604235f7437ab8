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

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import group as _group
from . import objects as _objects
from . import prepared as _prepared
from .algorithms import p2p as _p2p_algo
from .algorithms import select
from .algorithms.base import Op, Parts, divide_by, run
from .comm import wire
from .comm.wire import Collective, ReduceOp, Signature
from .engine import Work, completed, joined
from .errors import MismatchError, ProtocolError, SwarmfdError
from .objects import MAX_OBJECT_BYTES

__all__ = ["MAX_OBJECT_BYTES", "all_gather", "all_gather_object", "all_reduce", "all_reduce_mean",
           "all_to_all", "barrier", "broadcast", "broadcast_object", "gather", "irecv",
           "isend", "recv", "reduce", "reduce_scatter", "scatter", "send"]

T = TypeVar("T")

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_OP_NAMES = {"sum": ReduceOp.SUM, "prod": ReduceOp.PROD, "product": ReduceOp.PROD,
             "min": ReduceOp.MIN, "max": ReduceOp.MAX}
#: The op strings of every call (a training loop repeats them): (op, is_mean).
_PARSED_OPS: dict[str, tuple[ReduceOp, bool]] = {
    **{k: (v, False) for k, v in _OP_NAMES.items()},
    **{k: (ReduceOp.SUM, True) for k in ("mean", "avg", "average")},
}


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
    known = _PARSED_OPS.get(op) if type(op) is str else None
    if known is not None:
        return known
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


class _Label:
    """What a call is, for error messages ("all_reduce (call #7 on rank 2)"): built
    only when a message needs it, since every call names itself but few fail."""

    __slots__ = ("coll", "group", "seq")

    def __init__(self, coll: Collective, group: _group.Group, seq: int) -> None:
        self.coll, self.group, self.seq = coll, group, seq

    def __str__(self) -> str:
        g = self.group
        return (f"{self.coll.label} (call #{self.seq} on rank {g.world_rank}"
                + ("" if g.gid == _group.WORLD_GID else f", {g.name}") + ")")

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _label(g: _group.Group, sig: Signature) -> str:
    return str(_Label(sig.coll, g, g.seq))


def _run(g: _group.Group, sig: Signature, make: Callable[[Op], Any] | None,
         finish: Callable[[Any], Any] | None = None, async_op: bool = False) -> Any:
    """Run, or with ``async_op`` issue, the group's next call: ``make(op)`` gives the
    algorithm to drive (None: nothing to send), ``finish(result)`` runs once it
    completed (write-backs) and gives the call's result. A failure breaks the group
    (see swarmfd.group). Returns the result, or a :class:`Work` with ``async_op``."""
    if g.broken is not None and g.seq + 1 >= g.broken_from:
        if async_op:
            return completed(None, f"{sig.coll.label} on rank {g.world_rank}", _broken(g))
        raise _broken(g)
    g.seq += 1
    plane = g.plane()
    if plane is None or g.size == 1 or make is None:
        result = finish(None) if finish is not None else None
        return completed(result, _label(g, sig)) if async_op else result
    ch = g.channel
    op = Op(ch, plane, g.ranks, g.rank, g.gid, g.seq, sig,
            plane if plane.kind == "shm" else None, g.next_slot, 0, g.ring)
    engine = g._state.engine
    if not async_op and not engine.queues and not engine.p2p:  # (engine.idle())
        with engine.lock:  # the progress thread may be finishing its last step
            return _blocking(g, ch, plane, _Label(sig.coll, g, g.seq), True, finish, _drive,
                             op, make)
    work = engine.submit(g, op, make(op), _label(g, sig), finish)
    return work if async_op else work.wait()


def _blocking(g: _group.Group, ch: Any, plane: Any, label: Any, collective: bool,
              finish: Callable[[Any], Any] | None, body: Callable[..., Any],
              *args: Any) -> Any:
    """A blocking call on the caller's thread (nothing else pending): ``body(*args)``
    runs the call on ``plane``, then ``finish`` of its result gives the call's result;
    ``collective``: the group's next call (a point-to-point message is not one). A
    failure breaks the group, and the peers hear of it. Both the algorithms driven here
    (:func:`_drive`) and the calls run without generators (:func:`_run_now`) pass."""
    if collective:
        ch.calls[g.gid] = g.seq  # ch.begin(g.gid, g.seq), without the call
    ch._group = g.gid  # ch.set_group(g.gid)
    ch.activity = label
    ch.p2p = not collective
    try:
        if len(ch.planes) > 1:
            # Aborts may come on another plane than this call's: now and then read what
            # waits there (a wait reads every plane between its slices anyway).
            ch.service_others(plane)
        result = body(*args)
        ch.flush()
        return finish(result) if finish is not None else result
    except BaseException as exc:
        g.broken, g.broken_from = exc, 0
        # The last call this rank finished: the one before a failed collective, the
        # latest one before a failed point-to-point message.
        ch.abort(exc, g.gid, g.seq - 1 if collective else g.seq)
        raise
    finally:
        ch.activity = "idle"
        ch.p2p = False


def _drive(op: Op, make: Callable[[Op], Any]) -> Any:
    """Drive the algorithm ``make(op)`` gives on the caller's thread; its result."""
    return run(op, make(op))


def _plane_now(g: _group.Group) -> Any:
    """The group's plane when its next call, blocking, may run straight on the caller's
    thread (:func:`_run_now`), else None: the group is whole and has peers, and nothing
    else is pending (the progress engine runs no call and no point-to-point message)."""
    if g.size == 1 or (g.broken is not None and g.seq + 1 >= g.broken_from):
        return None
    plane = g.plane()
    if plane is None:
        return None
    engine = g._state.engine
    return plane if not engine.queues and not engine.p2p else None


def _run_now(g: _group.Group, plane: Any, sig: Signature, body: Callable[..., None],
             *args: Any) -> None:
    """The group's next call on ``plane`` (from :func:`_plane_now`) as ``body(channel,
    plane, ranks, me, gid, seq, sig, *args)``, a function that sends and waits for its
    messages at once; the rest (the group's call count, the channel's state, failures)
    as :func:`_run`'s blocking call (:func:`_blocking`). For the small calls whose time
    is mostly Python steps: those of the generic path (the call's Op, its algorithm's
    generators and the loop that drives them, a function each) were a fifth of a 4 KiB
    all_reduce on shared memory at N=2: back to back 20.0-22.9 us a call against 27.5-29.9 us (5
    alternated jobs, 2026-12-05); compare.py, 6 interleaved runs, medians of the
    per-run time ratios: shared memory N=2 0.84, 0.77 and 0.86 at 4, 64 and 256 KiB,
    N=4 0.69 at 64 KiB; two ranks over TCP 0.95, 0.93 and 0.76
    (benchmarks/results/session-20261205-b.md)."""
    g.seq += 1
    ch = g.channel
    with g._state.engine.lock:  # the progress thread may be finishing its last step
        _blocking(g, ch, plane, _Label(sig.coll, g, g.seq), True, None, body, ch, plane,
                  g.ranks, g.rank, g.gid, g.seq, sig, *args)


def _broken(g: _group.Group) -> BaseException:
    """The error of a call of the broken group ``g`` (not yet counted in ``g.seq``):
    a peer's abort as it came for the very call the peer failed, else the earlier
    failure's."""
    b = g.broken
    if g.broken_from == g.seq + 1 and isinstance(b, SwarmfdError):
        return type(b)(str(b))
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
    key = (coll, op, code, root, arrays[0].shape) if len(arrays) == 1 else \
        (coll, op, code, root, *(a.shape for a in arrays))
    sig = _SIGNATURES.get(key)  # (_cached, written out: every call passes here)
    return sig if sig is not None else \
        _cached(key, lambda: _make_signature(coll, arrays, code, op, root))


def _cached(key: tuple[Any, ...], make: Callable[[], Signature]) -> Signature:
    """The signature cached under ``key``, made (and kept) on its first call."""
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) > 4096:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = make()
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
           async_op: bool = False,
           in_place: Callable[[Op, int, int], bool] | None = None) -> list[Any]:
    """Run ``body`` once per dtype over the arrays of ``items`` fused into one buffer
    (a reused scratch buffer, or a new one for an async call, which owns it until it
    completes); every part is copied back when its call completes. Where
    ``in_place(op, nbytes, count)`` says the call's algorithm takes :class:`Parts`, and
    the arrays are contiguous and writable, ``body`` gets them as Parts instead: no
    copy in or out. Returns each call's result (a Work each with ``async_op``)."""
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
        direct = in_place is not None and _disjoint(members) and all(
            a.flags.c_contiguous and a.flags.writeable for a in members)
        staged: list[np.ndarray] = []  # the fused buffer, once made

        def make(o: Op, members: list[np.ndarray] = members, total: int = total,
                 dtype: np.dtype = dtype, direct: bool = direct,
                 staged: list[np.ndarray] = staged) -> Any:
            if direct and total and in_place is not None and \
                    in_place(o, total * dtype.itemsize, total):
                return body(o, Parts([a.reshape(-1) for a in members if a.size]))
            flat = np.empty(total, dtype) if async_op else g.scratch(dtype, total)
            off = 0
            for a in members:
                flat[off:off + a.size] = a.reshape(-1)
                off += a.size
            staged.append(flat)
            return body(o, flat)

        def finish(_: Any, members: list[np.ndarray] = members,
                   staged: list[np.ndarray] = staged) -> None:
            if not staged:
                return
            flat, off = staged.pop(), 0
            for a in members:
                np.copyto(a, flat[off:off + a.size].reshape(a.shape))
                off += a.size

        out.append(_run(g, sig, make, finish, async_op))
    return out


def _disjoint(arrays: list[np.ndarray]) -> bool:
    """No two of ``arrays`` share memory (by address ranges: a list may hold the same
    array twice, or overlapping views, which only a staging copy reduces right)."""
    ranges = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.size)
    return all(ranges[i][1] <= ranges[i + 1][0] for i in range(len(ranges) - 1))


def _fused_result(x: Any, parts: list[Any], name: str, async_op: bool) -> Any:
    """What a call on a list returns: the list, or a Work that gives it."""
    if not async_op:
        return x
    return joined(parts, name, lambda: x) if parts else completed(x, name)


def _items(x: Any) -> Sequence[Any] | None:
    """The elements of ``x`` when it is a list (or tuple) of arrays to fuse, else None."""
    return x if isinstance(x, (list, tuple)) else None


# -- all_reduce -------------------------------------------------------------------------


def _all_reduce_algo(o: Op, flat: np.ndarray | Parts, rop: ReduceOp, mean: bool,
                     two: Any = None) -> Any:
    """The algorithm (a generator) of one all_reduce call: the selection table's, itself
    where no mean follows (a small call's every receive passes one generator less).
    ``flat`` is Parts only where :func:`_takes_parts` said so."""
    ufunc = _UFUNCS[rop]
    kind = o.plane.kind
    if kind == "shm":
        # Takes Parts, and divides a mean chunk by chunk while it is in cache.
        return select.shm.all_reduce(o, flat, ufunc, o.size if mean else 0)
    hier = two and select.all_reduce_two_level(flat.nbytes, two[0], o.plane.name)
    if hier:
        assert isinstance(flat, np.ndarray)
        algo = hier(o, flat, ufunc, *two)
        return _divided(o, algo, flat) if mean else algo
    algo = select.all_reduce(kind, flat.nbytes, o.size, flat.size, o.plane.name)
    if algo is select.tcp.all_reduce_ring:
        # Takes Parts, and the owner of each chunk divides a mean before it goes round.
        return algo(o, flat, ufunc, divide=o.size if mean else 0)
    assert isinstance(flat, np.ndarray)
    return _divided(o, algo(o, flat, ufunc), flat) if mean else algo(o, flat, ufunc)


def _takes_parts(g: _group.Group, plane: Any, nbytes: int, count: int) -> bool:
    """Whether the all_reduce of ``count`` items (``nbytes``) in ``g`` on ``plane``
    takes :class:`Parts` (see :func:`all_reduce_in_place`)."""
    if plane.kind != "shm":
        two = g.two_level()
        if two and select.all_reduce_two_level(nbytes, two[0], plane.name):
            return False
    return select.all_reduce_in_place(plane.kind, nbytes, g.size, count, plane.name)


def all_reduce_in_place(group: Any, nbytes: int, count: int) -> bool:
    """Whether an all_reduce of a list of arrays of one dtype (contiguous, writable, not
    sharing memory), ``count`` items of ``nbytes`` in all, in ``group`` reduces them
    where they are, without a staging copy. Not public: DDP asks, to all-reduce a
    bucket's gradients in place where it can, instead of copying them into the bucket."""
    g = _group.resolve_group(group, "all_reduce()")
    plane = g.plane()
    return plane is not None and g.size > 1 and _takes_parts(g, plane, nbytes, count)


def _divided(o: Op, algo: Any, flat: np.ndarray) -> Any:
    """``algo``, then ``flat`` divided by the group's size (a mean)."""
    yield from algo
    yield o.flush()  # pieces of flat may still be on their way to a peer
    divide_by(flat, o.size)


def all_reduce(x: T, op: str = "sum", *, group: Any = None, async_op: bool = False) -> T:
    """Reduce ``x`` across the group's ranks, in place, and return it.

    ``op`` is ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"mean"`` (alias
    ``"avg"``). ``x`` is a numpy array, a CPU torch tensor, or a list of them (fused
    into one buffer per dtype). Every rank ends with bitwise identical values. With
    ``async_op=True`` returns a :class:`swarmfd.Work` whose ``wait()`` returns ``x``.
    """
    g = _group.resolve_group(group, "all_reduce()")
    if not async_op and type(x) is np.ndarray and type(op) in _PREPARED_OPS:
        call = g.prepared.get((x.shape, x.dtype, op))  # (see swarmfd.prepared)
        if call is not None and call.run(x):
            return x
    rop, mean = _parse_op(op, "all_reduce")
    wire_op = ReduceOp.MEAN if mean else rop

    if isinstance(x, (list, tuple)):  # (_items)
        arrays = _list_arrays(x) if not async_op and type(op) in _PREPARED_OPS else None
        key = _list_key(arrays, op) if arrays is not None else None
        if key is not None:
            listed = g.prepared.get(key)  # (see swarmfd.prepared.ListCall)
            if listed is not None and listed.run(arrays):
                return x

        def body(o: Op, flat: np.ndarray) -> Any:
            return _all_reduce_algo(o, flat, rop, mean, g.two_level())

        # (The arrays _list_arrays made, where it did: tensors are not viewed twice.)
        parts = _fused(g, x if arrays is None else arrays, "all_reduce", Collective.ALL_REDUCE,
                       wire_op, wire.NO_ROOT, body,
                       lambda a: _check_op_dtype(rop, mean, a.dtype, "all_reduce"),
                       async_op, lambda o, nbytes, count: _takes_parts(g, o.plane, nbytes, count))
        if key is not None:
            _prepare_list(g, key, arrays, rop, wire_op, mean)
        return _fused_result(x, parts, "all_reduce", async_op)
    arr = _to_numpy(x, "all_reduce")
    code = _check_array(arr, "all_reduce")
    _check_op_dtype(rop, mean, arr.dtype, "all_reduce")
    flat, write_back = _flat(arr)
    sig = _signature(Collective.ALL_REDUCE, [arr], code, wire_op)
    if not async_op and flat.nbytes <= _SMALL_NOW and flat.size >= g.size:
        plane = _plane_now(g)
        if plane is not None and (plane.kind == "shm" or g.size == 2):
            if plane.kind == "shm":
                _run_now(g, plane, sig, select.shm.all_reduce_now, g.next_slot, flat,
                         _UFUNCS[rop], g.size if mean else 0)
            else:  # two ranks, each on its host (no hierarchy): the pair exchange
                _run_now(g, plane, sig, select.tcp.all_reduce_pair_now, flat, _UFUNCS[rop],
                         2 if mean else 0)
            if write_back is not None:
                write_back()
            else:
                _prepare_all_reduce(g, plane, sig, x, op, rop, mean)
            return x
    result = _run(g, sig, lambda o: _all_reduce_algo(o, flat, rop, mean, g.two_level()),
                  _returns(x, write_back), async_op)
    if not async_op and write_back is None and flat.size >= g.size:
        # (shared memory's large path, recursive doubling, the direct exchange)
        _prepare_all_reduce(g, None, sig, x, op, rop, mean)
    return result


def _prepare_all_reduce(g: _group.Group, plane: Any, sig: Signature, x: Any, op: Any,
                        rop: ReduceOp, mean: bool) -> None:
    """After a blocking all_reduce of the contiguous ``x`` ran on ``plane`` (None: the
    plane the group's next call would run on now, if any): keep the prepared call for
    the group's next ones like it, where one applies (see swarmfd.prepared; ``x`` an
    ndarray, ``op`` a string or a ReduceOp, the key's)."""
    if type(x) is not np.ndarray or type(op) not in _PREPARED_OPS:
        return
    if plane is None:
        plane = _plane_now(g)
        if plane is None:
            return
    _prepared.keep(g, (x.shape, x.dtype, op), _prepared.for_all_reduce(
        g, plane, sig, _Label(sig.coll, g, 0), x, _UFUNCS[rop], g.size if mean else 0))


#: The types of op a prepared call is kept for (the op is part of its key; see
#: swarmfd.prepared).
_PREPARED_OPS = frozenset((str, ReduceOp))
#: The first item of a list call's key (a single array's key starts with its shape).
_LIST = "list"
#: The first item of a prepared broadcast's key (swarmfd.prepared.BroadcastCall).
_BROADCAST = "broadcast"


def _list_arrays(items: Sequence[Any]) -> Sequence[np.ndarray] | None:
    """``items`` as numpy arrays (the arrays themselves, or views of CPU tensors, as the
    general path takes them), or None where one is neither: the general path then
    reports it."""
    for a in items:
        if type(a) is not np.ndarray:
            break
    else:
        return items
    try:
        return [_to_numpy(a, "all_reduce") for a in items]
    except TypeError:
        return None


def _list_key(items: Sequence[np.ndarray], op: Any) -> tuple[Any, ...] | None:
    """The key of a prepared all_reduce of the arrays ``items`` (see
    swarmfd.prepared.ListCall): their shapes, their dtype and ``op``, when they are of
    one dtype; else None (the general path only)."""
    if not items:
        return None
    dtype = items[0].dtype
    shapes = []
    for a in items:
        if a.dtype != dtype:
            return None
        shapes.append(a.shape)
    return (_LIST, tuple(shapes), dtype, op)


def _prepare_list(g: _group.Group, key: tuple[Any, ...], items: Sequence[np.ndarray],
                  rop: ReduceOp, wire_op: ReduceOp, mean: bool) -> None:
    """After a blocking all_reduce of the list ``items`` (of one dtype, ``key`` its
    :func:`_list_key`) ran the general path: keep the prepared call for the group's next
    ones like it, where the fused buffer's algorithm has one."""
    dtype = key[2]
    total = sum(a.size for a in items)
    # (Small lists only: a list call keeps its buffer, at most _SMALL_NOW bytes.)
    plane = _plane_now(g) if g.size <= total and total * dtype.itemsize <= _SMALL_NOW \
        else None
    if plane is None:
        return
    sig = _signature(Collective.ALL_REDUCE, list(items), wire.dtype_code(dtype), wire_op)
    buf = np.empty(total, dtype)
    inner = _prepared.for_all_reduce(g, plane, sig, _Label(sig.coll, g, 0), buf,
                                     _UFUNCS[rop], g.size if mean else 0)
    if inner is not None:
        _prepared.keep(g, key, _prepared.ListCall(inner, buf, key[1]))

#: Up to this many bytes a blocking all_reduce runs without generators (:func:`_run_now`)
#: on shared memory (one round after one barrier, as the algorithm's) and between two
#: ranks over TCP (the pair exchange, which the selection table takes up to
#: select.PAIR_MAX_BYTES): the calls whose time is mostly Python steps.
_SMALL_NOW = min(select.shm.SMALL_BYTES, select.PAIR_MAX_BYTES)


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
    if not async_op and type(x) is np.ndarray:
        call = g.prepared.get((_BROADCAST, x.shape, x.dtype, root))  # (swarmfd.prepared)
        if call is not None and call.run(x):
            return x

    def body(o: Op, flat: np.ndarray) -> Any:
        two = g.two_level()
        hier = two and select.broadcast_two_level(flat.nbytes, two[0], root)
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
    sig = _signature(Collective.BROADCAST, [arr], code, ReduceOp.NONE, root)
    result = _run(g, sig, lambda o: body(o, flat), _returns(x, write_back), async_op)
    if not async_op and write_back is None and type(x) is np.ndarray:
        plane = _plane_now(g)
        if plane is not None:
            _prepared.keep(g, (_BROADCAST, x.shape, x.dtype, root), _prepared.for_broadcast(
                g, plane, sig, _Label(sig.coll, g, 0), x, root))
    return result


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
        hier = two and select.reduce_two_level(flat.nbytes, two[0], root)
        if hier:
            yield from hier(o, flat, root, _UFUNCS[rop], *two)
        else:
            yield from select.reduce(o.plane.kind, flat.nbytes, o.size)(o, flat, root,
                                                                        _UFUNCS[rop])
        if mean and o.me == root:
            yield o.flush()
            divide_by(flat, o.size)

    return _run(g, _signature(Collective.REDUCE, [arr], code, ReduceOp.MEAN if mean else rop,
                              root),
                body, _returns(x, write_back if g.rank == root else None), async_op)


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
    arr = _to_numpy(x, "all_gather")
    code = _check_array(arr, "all_gather", writable=False)
    flat = np.ascontiguousarray(arr).reshape(-1)
    n = g.size
    if out is None and arr.ndim > 0:
        return _all_gather_v(g, arr, flat, code, async_op)
    if out is None:
        rows = np.empty((n, flat.size), dtype=arr.dtype)
    else:
        rows = _gather_out(_to_numpy(out, "all_gather"), arr, n,
                           "world_size" if g.gid == _group.WORLD_GID else "group size"
                           ).reshape(n, flat.size)
    rows[g.rank] = flat

    def body(o: Op) -> Any:
        two = g.two_level()
        hier = two and select.all_gather_two_level(flat.nbytes, two[0], o.plane.name)
        if hier:
            return hier(o, rows, *two)
        return select.all_gather(o.plane.kind, flat.nbytes, o.size, o.plane.name)(o, rows)

    return _run(g, _signature(Collective.ALL_GATHER, [arr], code, ReduceOp.NONE), body,
                lambda _: [rows[r].reshape(arr.shape) for r in range(n)], async_op)


def _all_gather_v(g: _group.Group, arr: np.ndarray, flat: np.ndarray, code: int,
                  async_op: bool) -> Any:
    """all_gather of first dimensions that may differ: the counts with the rows that fit
    one message (or slot), in one round; larger parts after their counts."""
    n, trailing = g.size, arr.shape[1:]
    sig = _cached((Collective.ALL_GATHER_V, code, trailing), lambda: Signature(
        Collective.ALL_GATHER_V, ReduceOp.NONE, code, wire.NO_ROOT,
        int(np.prod(trailing, dtype=np.int64)), wire.shape_hash(trailing),
        wire.rows_repr(str(trailing))))
    row = sig.count
    state: dict[str, Any] = {}

    def body(o: Op) -> Any:
        # The counts travel with the rows that fit a small message (a slot on shared
        # memory): one round. Larger parts follow by the table, once all counts are known,
        # with tags of their own (made only then: the small call's path makes no second
        # Op).
        if o.plane.kind == "shm":
            counts, parts = yield from select.shm.all_gather_counts(
                o, arr.shape[0], flat, row * arr.itemsize)
        else:
            counts, parts = yield from select.all_gather_counts(o.size, o.plane.name)(
                o, arr.shape[0], flat, row * arr.itemsize, select.ALL_GATHER_V_INLINE_BYTES)
        if all(p is not None for p in parts):
            parts[o.me] = flat.copy()  # the result never aliases the input
            state["parts"], state["counts"] = parts, counts
            return
        o = o.phase(_SECOND_PHASE_TAGS)
        bounds = _bounds(counts, row)
        res = np.empty(bounds[-1][1], arr.dtype)
        state["res"], state["counts"] = res, counts
        two = g.two_level()
        hier = (two and len(set(counts)) == 1
                and select.all_gather_two_level(flat.nbytes, two[0], o.plane.name))
        if hier:  # every rank's part has the same size: the two-level all_gather
            rows = res.reshape(n, -1)
            rows[o.me] = flat
            yield from hier(o, rows, *two)
        elif o.plane.kind == "shm":
            yield from select.shm.all_gather_v(o, flat, res, bounds)
        else:
            largest = max(b - a for a, b in bounds) * arr.itemsize
            # (Parts of different sizes: the direct exchange where the table picks a
            # small all_gather, whichever small one it picks.)
            direct = select.all_gather("tcp", largest, n) is not select.tcp.all_gather_ring \
                and largest <= wire.PIECE_BYTES
            yield from select.tcp.all_gather_v(o, flat, res, bounds, direct=direct)

    def finish(_: Any) -> Any:
        if "parts" in state:  # every part came in one message
            return [p.reshape(c, *trailing)
                    for p, c in zip(state["parts"], state["counts"], strict=True)]
        if "res" not in state:  # a group of one
            return [arr.copy()]
        res, counts = state["res"], state["counts"]
        out, start = [], 0
        for c in counts:
            out.append(res[start * row:(start + c) * row].reshape(c, *trailing))
            start += c
        return out

    return _run(g, sig, body, finish, async_op)


def _gather_out(out: np.ndarray, arr: np.ndarray, size: int, what: str,
                name: str = "all_gather") -> np.ndarray:
    """``out`` checked as all_gather's (or gather's) result buffer for ``arr``
    (ValueError/TypeError)."""
    want = (size, *arr.shape)
    if out.dtype != arr.dtype:
        raise TypeError(f"swarmfd.{name}: out has dtype {out.dtype}, expected x's dtype "
                        f"{arr.dtype}")
    if out.shape != want:
        raise ValueError(f"swarmfd.{name}: out has shape {out.shape}, expected "
                         f"({what}, *x.shape) = {want}")
    if not out.flags.c_contiguous:
        raise ValueError(f"swarmfd.{name}: out must be C-contiguous (e.g. from np.empty)")
    if not out.flags.writeable:
        raise ValueError(f"swarmfd.{name}: out is read-only; pass a writable array")
    if np.shares_memory(out, arr):
        raise ValueError(f"swarmfd.{name}: out overlaps x; pass a separate buffer")
    return out


# -- barrier ----------------------------------------------------------------------------


def barrier(*, group: Any = None, async_op: bool = False) -> Work | None:
    """Block until every rank of the group has called barrier() (``async_op``: a Work
    that completes then)."""
    g = _group.resolve_group(group, "barrier()")
    if not async_op:
        call = g.prepared.get(_BARRIER)  # (see swarmfd.prepared)
        if call is not None and call.run(None):
            return None
        plane = _plane_now(g)
        if plane is not None:
            _run_now(g, plane, _BARRIER, select.tcp.barrier_now)
            _prepared.keep(g, _BARRIER, _prepared.for_barrier(g, plane, _BARRIER,
                                                        _Label(_BARRIER.coll, g, 0)))
            return None
    return _run(g, _BARRIER, lambda o: select.tcp.barrier(o, 0), None, async_op)


_BARRIER = Signature(Collective.BARRIER)


# -- reduce_scatter ---------------------------------------------------------------------


def _dim0_parts(arr: np.ndarray, n: int, name: str) -> tuple[list[tuple[int, int]], int]:
    """Row bounds of ``n`` parts of ``arr`` along its first dimension (as np.array_split
    splits), and the elements of one row."""
    if arr.ndim == 0:
        raise ValueError(f"swarmfd.{name} splits its input along the first dimension, and a "
                         "0-d array has none: pass an array of at least one dimension")
    row = int(np.prod(arr.shape[1:], dtype=np.int64))
    return select.split_rows(arr.shape[0], n), row


def _out_array(out: Any, shape: tuple[int, ...], dtype: np.dtype, name: str,
               arr: np.ndarray | None = None) -> np.ndarray:
    """``out`` checked as a result buffer of ``shape`` and ``dtype`` (or a new array)."""
    if out is None:
        return np.empty(shape, dtype)
    o = _to_numpy(out, name)
    if o.dtype != dtype:
        raise TypeError(f"swarmfd.{name}: out has dtype {o.dtype}, expected {dtype}")
    if o.shape != shape:
        raise ValueError(f"swarmfd.{name}: out has shape {o.shape}, expected {shape}")
    if not o.flags.c_contiguous or not o.flags.writeable:
        raise ValueError(f"swarmfd.{name}: out must be a writable C-contiguous array")
    if arr is not None and np.shares_memory(o, arr):
        raise ValueError(f"swarmfd.{name}: out overlaps x; pass a separate buffer")
    return o


def reduce_scatter(x: Any, out: Any = None, *, op: str = "sum", group: Any = None,
                   async_op: bool = False) -> Any:
    """Reduce ``x`` across the group and give rank r part r of the result.

    ``x`` is split along its first dimension as ``np.array_split`` would split it into
    group-size parts (uneven parts allowed; a first dimension smaller than the group
    gives some ranks empty parts). Returns ``out`` (a new array when None: part r's
    shape), or a Work that gives it. ``x`` itself is left unchanged.
    """
    g = _group.resolve_group(group, "reduce_scatter()")
    rop, mean = _parse_op(op, "reduce_scatter")
    arr = _to_numpy(x, "reduce_scatter")
    code = _check_array(arr, "reduce_scatter", writable=False)
    _check_op_dtype(rop, mean, arr.dtype, "reduce_scatter")
    rows, row = _dim0_parts(arr, g.size, "reduce_scatter")
    parts = [(a * row, b * row) for a, b in rows]
    a, b = rows[g.rank]
    res = _out_array(out, (b - a, *arr.shape[1:]), arr.dtype, "reduce_scatter", arr)
    flat = np.ascontiguousarray(arr).reshape(-1)
    res_flat = res.reshape(-1)
    return _reduce_scatter_run(g, flat, parts, res_flat, res, rop, mean,
                               _signature(Collective.REDUCE_SCATTER, [arr], code,
                                          ReduceOp.MEAN if mean else rop),
                               lambda: np.copyto(res_flat, flat), async_op)


def _reduce_scatter_run(g: _group.Group, src: np.ndarray | Parts, parts: list[tuple[int, int]],
                        res_flat: np.ndarray, result: Any, rop: ReduceOp, mean: bool,
                        sig: Signature, alone: Callable[[], None], async_op: bool) -> Any:
    """Run the reduce_scatter of ``src`` (the whole input, flat: an array, or Parts,
    read where it is) into ``res_flat`` (this rank's part of
    ``parts``); ``alone()`` fills it in a group of one. Gives ``result``."""
    ufunc = _UFUNCS[rop]

    def body(o: Op) -> Any:
        two = g.two_level()
        hier = o.plane.kind != "shm" and two and \
            select.reduce_scatter_two_level(src.nbytes, two[0])
        if hier:
            flat = src if isinstance(src, np.ndarray) else np.concatenate(src.arrays)
            yield from hier(o, flat, parts, res_flat, ufunc, *two)
            if mean:
                divide_by(res_flat, o.size)
            return
        # Every flat algorithm reads src (an array or Parts) where it is, and divides a
        # mean in this rank's part.
        algo = select.reduce_scatter(o.plane.kind, src.nbytes, o.size)
        yield from algo(o, src, parts, res_flat, ufunc, divide=o.size if mean else 0)

    def finish(_: Any) -> Any:
        if g.size == 1:
            alone()
        return result

    return _run(g, sig, body, finish, async_op)


def reduce_scatter_parts(arrays: Sequence[Any], out: Any, *, op: str = "sum",
                         group: Any = None, async_op: bool = False) -> Any:
    """:func:`reduce_scatter` of the concatenation of ``arrays`` (one dtype, flat, a
    total size that divides by the group size: equal parts), without concatenating
    them: every flat algorithm reads them where they are (the two-level one takes
    them concatenated). Not public: DDP's buckets under ZeRO use it, so
    their gradients need no copy into a bucket. ``out``: this rank's part."""
    g = _group.resolve_group(group, "reduce_scatter()")
    rop, mean = _parse_op(op, "reduce_scatter")
    nps = [_to_numpy(a, "reduce_scatter").reshape(-1) for a in arrays]
    if not nps or len({a.dtype for a in nps}) != 1:
        raise TypeError("swarmfd.reduce_scatter_parts: arrays must be one or more arrays "
                        "of one dtype")
    total = sum(a.size for a in nps)
    if total % g.size:
        raise ValueError(f"swarmfd.reduce_scatter_parts: {total} elements do not split "
                         f"into {g.size} equal parts")
    dtype = nps[0].dtype
    code = _check_array(nps[0], "reduce_scatter", writable=False)
    _check_op_dtype(rop, mean, dtype, "reduce_scatter")
    part = total // g.size
    res = _out_array(out, (part,), dtype, "reduce_scatter")
    buf = Parts([a for a in nps if a.size]) if total else np.zeros(0, dtype)
    parts = [(r * part, (r + 1) * part) for r in range(g.size)]
    # The signature of the concatenated buffer's reduce_scatter (the same call).
    shape = np.broadcast_to(np.zeros((), dtype), (total,))
    return _reduce_scatter_run(g, buf, parts, res, res, rop, mean,
                               _signature(Collective.REDUCE_SCATTER, [shape], code,
                                          ReduceOp.MEAN if mean else rop),
                               lambda: np.copyto(res, np.concatenate(nps)), async_op)


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
    arr = _to_numpy(x, "all_to_all")
    code = _check_array(arr, "all_to_all", writable=False)
    if arr.ndim == 0:
        raise ValueError("swarmfd.all_to_all splits its input along the first dimension, and "
                         "a 0-d array has none: pass an array of at least one dimension")
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
    equal = in_splits is None and out_splits is None
    if rows_out is None and in_splits is None:
        rows_out = list(rows_in)
    row = int(np.prod(arr.shape[1:], dtype=np.int64))
    flat = np.ascontiguousarray(arr).reshape(-1)
    trailing = tuple(arr.shape[1:])
    sig = (_signature(Collective.ALL_TO_ALL, [arr], code, ReduceOp.NONE) if equal else
           Signature(Collective.ALL_TO_ALL, ReduceOp.NONE, code, wire.NO_ROOT, 0,
                     wire.shape_hash(("splits", *trailing)), f"(uneven splits, *{trailing})"))
    state: dict[str, Any] = {}
    if rows_out is not None:
        state["out"] = _out_array(out, (sum(rows_out), *trailing), arr.dtype, "all_to_all", arr)

    def body(o: Op) -> Any:
        matrix = None
        r_out = rows_out
        if not equal and (r_out is None or o.plane.kind == "shm"):
            # Everyone's splits (rank p's row: what p sends to each rank), in this call.
            every = np.empty((n, n), np.int64)
            every[o.me] = rows_in
            yield from _exchange(o, every)
            matrix = every
            theirs = [int(every[p, o.me]) for p in range(n)]
            if r_out is None:
                r_out = theirs
            elif r_out != theirs:
                raise MismatchError(
                    f"swarmfd.all_to_all: out_splits {r_out} of rank {g.world_rank} differ "
                    f"from what the ranks send it ({theirs}): every rank's in_splits[r] must "
                    "equal rank r's out_splits for it")
        if "out" not in state:
            state["out"] = _out_array(out, (sum(r_out), *trailing), arr.dtype, "all_to_all", arr)
        res = state["out"].reshape(-1)
        send = _bounds(rows_in, row)
        recv = _bounds(r_out, row)
        if o.plane.kind == "shm":
            if matrix is None:
                matrix = np.full((n, n), rows_in[0], np.int64)
            totals = [int(matrix[p].sum()) * row for p in range(n)]
            mine_in = [(int(matrix[p, :o.me].sum()) * row, int(matrix[p, :o.me + 1].sum()) * row)
                       for p in range(n)]
            yield from select.shm.all_to_all(o, flat, totals, mine_in, res, recv)
        else:
            yield from select.tcp.all_to_all_pairwise(o, flat, send, res, recv)

    def finish(_: Any) -> Any:
        if "out" not in state:  # a group of one
            state["out"] = _out_array(out, arr.shape, arr.dtype, "all_to_all", arr)
            state["out"][...] = arr
        elif g.size == 1:
            state["out"][...] = arr
        return state["out"]

    return _run(g, sig, body, finish, async_op)


#: Where the tags of a call's second phase start (sizes, then data: Op.phase).
_SECOND_PHASE_TAGS = 1 << 30


def _exchange(o: Op, rows: np.ndarray) -> Any:
    """All-gather the small int64 ``rows`` (this rank's row filled) inside a call: sizes
    before the data, with tags from _SECOND_PHASE_TAGS (apart from the data's)."""
    sub = o.phase(_SECOND_PHASE_TAGS)
    if o.plane.kind == "shm":
        yield from select.shm.all_gather(sub, rows)
    else:
        yield from select.tcp.all_gather_direct(sub, rows)


def _bounds(rows: list[int], row: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for r in rows:
        out.append((start * row, (start + r) * row))
        start += r
    return out


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
    arr = _to_numpy(x, "gather")
    code = _check_array(arr, "gather", writable=False)
    flat = np.ascontiguousarray(arr).reshape(-1)
    rows = None
    if g.rank == root:
        if out is None:
            rows = np.empty((g.size, flat.size), arr.dtype)
        else:
            rows = _gather_out(_to_numpy(out, "gather"), arr, g.size,
                               "world_size" if g.gid == _group.WORLD_GID else "group size",
                               "gather").reshape(g.size, flat.size)
        rows[g.rank] = flat

    def body(o: Op) -> Any:
        return select.gather(o.plane.kind)(o, flat, rows, root)

    def finish(_: Any) -> Any:
        if rows is None:
            return None
        return [rows[r].reshape(arr.shape) for r in range(g.size)]

    return _run(g, _signature(Collective.GATHER, [arr], code, ReduceOp.NONE, root), body,
                finish, async_op)


def scatter(out: Any, chunks: Any = None, src: int = 0, *, group: Any = None,
            group_src: int | None = None, async_op: bool = False) -> Any:
    """Fill every rank's ``out`` with its chunk of ``src``'s ``chunks`` (a list of one
    array per group rank, each of ``out``'s shape and dtype, given on ``src`` only; or
    one array of shape ``(size, *out.shape)``, sent from without a copy when it is
    C-contiguous). ``src`` is a world rank (``group_src``: a group rank). Returns ``out``."""
    g = _group.resolve_group(group, "scatter()")
    root = _root(g, src, group_src, "src", "scatter")
    o_arr = _to_numpy(out, "scatter")
    code = _check_array(o_arr, "scatter")
    stacked = None
    if g.rank == root and (isinstance(chunks, np.ndarray) or hasattr(chunks, "detach")):
        whole = _to_numpy(chunks, "scatter")
        want = (g.size, *o_arr.shape)
        if whole.shape != want or whole.dtype != o_arr.dtype:
            raise ValueError(f"swarmfd.scatter: chunks as one array must have shape {want} "
                             f"and out's dtype {o_arr.dtype}, got shape {whole.shape} and "
                             f"dtype {whole.dtype}")
        if np.shares_memory(whole, o_arr):
            raise ValueError("swarmfd.scatter: out overlaps chunks; pass a separate buffer")
        stacked = np.ascontiguousarray(whole).reshape(g.size, o_arr.size)
    elif g.rank == root:
        items = _items(chunks)
        if items is None or len(items) != g.size:
            raise ValueError(f"swarmfd.scatter: on src, chunks must be a list of {g.size} "
                             f"arrays (one per rank of the group) or one array of shape "
                             f"({g.size}, *out.shape), got {type(chunks).__name__}"
                             + (f" of {len(items)}" if items is not None else ""))
        stacked = np.empty((g.size, o_arr.size), o_arr.dtype)
        for i, c in enumerate(items):
            a = _to_numpy(c, "scatter")
            if a.shape != o_arr.shape or a.dtype != o_arr.dtype:
                raise ValueError(f"swarmfd.scatter: chunk {i} has shape {a.shape} and dtype "
                                 f"{a.dtype}, expected out's {o_arr.shape} and {o_arr.dtype}")
            stacked[i] = a.reshape(-1)
    flat, write_back = _flat(o_arr)

    def body(o: Op) -> Any:
        return select.scatter(o.plane.kind)(o, stacked, flat, root)

    def finish(_: Any) -> Any:
        if g.size == 1 and stacked is not None:
            flat[...] = stacked[0]
        if write_back is not None:
            write_back()
        return out

    return _run(g, _signature(Collective.SCATTER, [o_arr], code, ReduceOp.NONE, root), body,
                finish, async_op)


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
    arr = _to_numpy(x, name)
    code = _check_array(arr, name, writable=not sending)
    flat, write_back = (np.ascontiguousarray(arr).reshape(-1), None) if sending else _flat(arr)
    sig = _signature(Collective.P2P, [arr], code, ReduceOp.NONE)
    label = f"{name} (tag {tag} {'to' if sending else 'from'} rank {peer} on rank " \
            f"{g.world_rank})"
    if g.broken is not None:
        if async_op:
            return completed(None, label, _broken(g))
        raise _broken(g)
    counters = g.p2p_sent if sending else g.p2p_received
    seq = counters.get((peer, tag), 0) + 1
    counters[(peer, tag)] = seq
    t = g._state.transport
    assert t is not None
    op = Op(t.channel, t.tcp, list(g.ranks), g.rank, g.gid, -1, sig)
    gen = (_p2p_algo.send if sending else _p2p_algo.recv)(op, flat, peer, seq, tag)
    finish = _returns(None if sending else x, write_back)
    engine = g._state.engine
    if not async_op and engine.idle():
        with engine.lock:
            return _blocking(g, op.channel, op.plane, label, False, finish, run, op, gen)
    work = engine.submit(g, op, gen, label, finish, p2p=True)
    return work if async_op else work.wait()


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
