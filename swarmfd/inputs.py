"""What every collective does to its arguments before it runs: views, checks, signatures.

The collectives take numpy arrays of a dtype of :data:`swarmfd.comm.wire.DTYPES`, any
shape, contiguous or not (a contiguous copy, written back), ndarray subclasses (a plain
view; masked arrays refused), CPU torch tensors (a zero-copy view) and, for some, lists
of arrays. This module makes them flat arrays and a call
:class:`~swarmfd.comm.wire.Signature`, or an error naming what is wrong and expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .algorithms.base import bounds, split
from .comm import wire
from .comm.wire import Collective, ReduceOp, Signature
from .group import Group

__all__ = ["OP_NAMES", "PARSED_OPS", "UFUNCS", "bounds", "cached", "check_array",
           "check_op_dtype", "check_rank", "dim0_parts", "disjoint", "flat", "gather_out",
           "items", "out_array", "parse_op", "root", "signature", "to_numpy"]

UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
OP_NAMES = {"sum": ReduceOp.SUM, "prod": ReduceOp.PROD, "product": ReduceOp.PROD,
             "min": ReduceOp.MIN, "max": ReduceOp.MAX}
#: The op strings of every call (a training loop repeats them): (op, is_mean).
PARSED_OPS: dict[str, tuple[ReduceOp, bool]] = {
    **{k: (v, False) for k, v in OP_NAMES.items()},
    **{k: (ReduceOp.SUM, True) for k in ("mean", "avg", "average")},
}


# -- inputs ---------------------------------------------------------------------------


def to_numpy(x: Any, name: str) -> np.ndarray:
    """A numpy view of ``x`` (an ndarray, a subclass's plain view, a CPU torch tensor),
    or a TypeError (a masked array: its mask would be ignored)."""
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
    raise TypeError(not_an_array(x, name))


def not_an_array(x: Any, name: str) -> str:
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


def check_array(arr: np.ndarray, name: str, *, writable: bool = True) -> int:
    try:
        code = wire.dtype_code(arr.dtype)
    except TypeError as exc:
        raise TypeError(f"swarmfd.{name}: {exc}") from None
    if writable and not arr.flags.writeable:
        raise ValueError(f"swarmfd.{name} works in place but the array is read-only; pass a "
                         "writable array (e.g. arr.copy())")
    return code


def parse_op(op: Any, name: str) -> tuple[ReduceOp, bool]:
    """(reduce op, is_mean) from a string like "sum" or a ReduceOp."""
    known = PARSED_OPS.get(op) if type(op) is str else None
    if known is not None:
        return known
    if isinstance(op, ReduceOp) and op != ReduceOp.NONE:
        return (ReduceOp.SUM, True) if op == ReduceOp.MEAN else (op, False)
    if isinstance(op, str):
        key = op.lower()
        if key in ("mean", "avg", "average"):
            return ReduceOp.SUM, True
        if key in OP_NAMES:
            return OP_NAMES[key], False
    raise ValueError(f"swarmfd.{name}: unsupported op {op!r}: expected one of "
                     "'sum', 'prod', 'min', 'max', 'mean' (or its alias 'avg')")


def check_op_dtype(op: ReduceOp, mean: bool, dtype: np.dtype, name: str) -> None:
    if mean and dtype.kind not in "fc":
        raise TypeError(f"swarmfd.{name}: the mean of {dtype} values cannot be stored in place; "
                        "expected a floating-point array (or use op='sum' and divide)")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
        raise TypeError(f"swarmfd.{name}: op {op.label} is not defined for complex dtype {dtype}")


def check_rank(value: Any, size: int, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"swarmfd.{name}: {what} must be an integer rank, got {value!r}")
    if not 0 <= int(value) < size:
        raise ValueError(f"swarmfd.{name}: {what}={value} is out of range: expected "
                         f"0 <= {what} < {'world_size' if what in ('src', 'dst') else 'size'} "
                         f"({size})")
    return int(value)


def root(g: Group, world_rank: Any, group_rank: Any, what: str, name: str) -> int:
    """The group rank of a root given as a world rank (``what``) or a group rank."""
    if group_rank is not None:
        return check_rank(group_rank, g.size, f"group_{what}", name)
    r = check_rank(world_rank, g.world_size, what, name)
    return g.world_to_group(r, what, name)


def flat(arr: np.ndarray) -> tuple[np.ndarray, Callable[[], None] | None]:
    """A flat contiguous view of ``arr`` (or a copy plus the function that writes it back)."""
    if arr.flags.c_contiguous:
        return arr.reshape(-1), None
    tmp = np.ascontiguousarray(arr).reshape(-1)

    def write_back() -> None:
        np.copyto(arr, tmp.reshape(arr.shape))

    return tmp, write_back


SIGNATURES: dict[tuple[Any, ...], Signature] = {}


def signature(coll: Collective, arrays: Sequence[np.ndarray], code: int, op: ReduceOp,
               root: int = wire.NO_ROOT) -> Signature:
    """The call's signature (cached: training loops repeat the same calls)."""
    key = (coll, op, code, root, arrays[0].shape) if len(arrays) == 1 else \
        (coll, op, code, root, *(a.shape for a in arrays))
    sig = SIGNATURES.get(key)  # (cached, written out: every call passes here)
    return sig if sig is not None else \
        cached(key, lambda: make_signature(coll, arrays, code, op, root))


def cached(key: tuple[Any, ...], make: Callable[[], Signature]) -> Signature:
    """The signature cached under ``key``, made (and kept) on its first call."""
    sig = SIGNATURES.get(key)
    if sig is None:
        if len(SIGNATURES) > 4096:
            SIGNATURES.clear()
        sig = SIGNATURES[key] = make()
    return sig


def make_signature(coll: Collective, arrays: Sequence[np.ndarray], code: int, op: ReduceOp,
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


def disjoint(arrays: list[np.ndarray]) -> bool:
    """No two of ``arrays`` share memory (by address ranges: a list may hold the same
    array twice, or overlapping views, which only a staging copy reduces right)."""
    ranges = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.size)
    return all(ranges[i][1] <= ranges[i + 1][0] for i in range(len(ranges) - 1))


def items(x: Any) -> Sequence[Any] | None:
    """The elements of ``x`` when it is a list (or tuple) of arrays to fuse, else None."""
    return x if isinstance(x, (list, tuple)) else None


def gather_out(out: np.ndarray, arr: np.ndarray, size: int, what: str,
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


def dim0_parts(arr: np.ndarray, n: int, name: str) -> tuple[list[tuple[int, int]], int]:
    """Row bounds of ``n`` parts of ``arr`` along its first dimension (as np.array_split
    splits), and the elements of one row."""
    if arr.ndim == 0:
        raise ValueError(f"swarmfd.{name} splits its input along the first dimension, and a "
                         "0-d array has none: pass an array of at least one dimension")
    row = int(np.prod(arr.shape[1:], dtype=np.int64))
    return split(arr.shape[0], n), row


def out_array(out: Any, shape: tuple[int, ...], dtype: np.dtype, name: str,
               arr: np.ndarray | None = None) -> np.ndarray:
    """``out`` checked as a result buffer of ``shape`` and ``dtype`` (or a new array)."""
    if out is None:
        return np.empty(shape, dtype)
    o = to_numpy(out, name)
    if o.dtype != dtype:
        raise TypeError(f"swarmfd.{name}: out has dtype {o.dtype}, expected {dtype}")
    if o.shape != shape:
        raise ValueError(f"swarmfd.{name}: out has shape {o.shape}, expected {shape}")
    if not o.flags.c_contiguous or not o.flags.writeable:
        raise ValueError(f"swarmfd.{name}: out must be a writable C-contiguous array")
    if arr is not None and np.shares_memory(o, arr):
        raise ValueError(f"swarmfd.{name}: out overlaps x; pass a separate buffer")
    return o
