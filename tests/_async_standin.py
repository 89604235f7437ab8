"""TEMPORARY, test-only: the async collective API of issue 14, stood in on today's core.

swarmfd.torch is written against the core API of issue 14 ("Async collectives and the
full collective set"), which the lead engineer is merging: ``group=`` and
``async_op=`` on ``all_reduce``/``broadcast``/``all_gather``/``reduce_scatter``,
``fd.Work``, ``fd.Group``/``fd.new_group``, ``fd.get_rank(group)``. Until it lands in
main, :func:`install` patches those names into ``swarmfd`` *synchronously* on top of
today's blocking calls, so the DDP/ZeRO logic can be tested for correctness (an
"async" op here runs to completion before it returns; nothing overlaps).

When the real core is present (``fd.all_reduce`` takes ``async_op``), :func:`install`
does nothing and the tests run against it. Delete this file once the core is merged.
It is never imported by ``swarmfd`` itself.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

import swarmfd as fd

_ORIGINAL: dict[str, Any] = {}


def real_core_present() -> bool:
    """True when ``swarmfd`` already has the async API (this stand-in then does nothing)."""
    fn = _ORIGINAL.get("all_reduce", fd.all_reduce)
    try:
        return "async_op" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class Work:
    """A finished op: ``wait()`` returns its result or raises its error."""

    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error

    def wait(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return self._error


class Group:
    """The world, as the only group the stand-in has (``rank``, ``size``, ``ranks``)."""

    def __init__(self) -> None:
        self.rank = _ORIGINAL["get_rank"]()
        self.size = _ORIGINAL["get_world_size"]()
        self.ranks = tuple(range(self.size))

    def __repr__(self) -> str:
        return f"<stand-in world group of {self.size}>"


def _check_group(group: Any, name: str) -> None:
    if group is not None and not isinstance(group, Group):
        raise TypeError(f"stand-in {name}: group must be None or the stand-in world group")
    if isinstance(group, Group) and group.size != _ORIGINAL["get_world_size"]():
        raise NotImplementedError("stand-in: only the world group")


def _run(name: str, group: Any, async_op: bool, call: Any) -> Any:
    _check_group(group, name)
    if not async_op:
        return call()
    try:
        return Work(call())
    except BaseException as exc:  # the async contract: errors come out of wait()
        if not isinstance(exc, Exception):
            raise
        return Work(error=exc)


def all_reduce(x: Any, op: str = "sum", *, group: Any = None, async_op: bool = False) -> Any:
    if isinstance(op, str) and op.lower() == "avg":
        op = "mean"
    return _run("all_reduce", group, async_op, lambda: _ORIGINAL["all_reduce"](x, op))


def broadcast(x: Any, src: int = 0, *, group: Any = None, async_op: bool = False) -> Any:
    return _run("broadcast", group, async_op, lambda: _ORIGINAL["broadcast"](x, src))


def all_gather(x: Any, out: Any = None, *, group: Any = None, async_op: bool = False) -> Any:
    return _run("all_gather", group, async_op, lambda: _ORIGINAL["all_gather"](x, out))


def reduce_scatter(x: Any, out: Any = None, *, op: str = "sum", group: Any = None,
                   async_op: bool = False) -> Any:
    def call() -> Any:
        arr = x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)
        if arr.ndim == 0:
            raise ValueError("reduce_scatter: a 0-d array has no first dimension")
        full = np.ascontiguousarray(arr).copy()
        _ORIGINAL["all_reduce"](full, "mean" if op in ("mean", "avg") else op)
        rank, size = _ORIGINAL["get_rank"](), _ORIGINAL["get_world_size"]()
        part = np.array_split(full, size, axis=0)[rank]
        if out is None:
            return part.copy()
        o = out.detach().numpy() if hasattr(out, "detach") else out
        if o.shape != part.shape or o.dtype != part.dtype:
            raise ValueError(f"reduce_scatter: out is {o.shape} {o.dtype}, expected "
                             f"{part.shape} {part.dtype}")
        if np.shares_memory(o, arr):
            raise ValueError("reduce_scatter: out overlaps x")
        np.copyto(o, part)
        return out
    return _run("reduce_scatter", group, async_op, call)


def barrier(group: Any = None) -> None:
    _check_group(group, "barrier")
    _ORIGINAL["barrier"]()


def new_group(ranks: Any = None) -> Group:
    size = _ORIGINAL["get_world_size"]()
    if ranks is not None and sorted(ranks) != list(range(size)):
        raise NotImplementedError("stand-in new_group: only the whole world")
    return Group()


def get_rank(group: Any = None) -> int:
    return group.rank if isinstance(group, Group) else _ORIGINAL["get_rank"]()


def get_world_size(group: Any = None) -> int:
    return group.size if isinstance(group, Group) else _ORIGINAL["get_world_size"]()


_PATCHED = {"all_reduce": all_reduce, "broadcast": broadcast, "all_gather": all_gather,
            "reduce_scatter": reduce_scatter, "barrier": barrier, "new_group": new_group,
            "get_rank": get_rank, "get_world_size": get_world_size, "Work": Work,
            "Group": Group}


def install() -> bool:
    """Patch the stand-in into ``swarmfd`` unless the real core is there; True if patched."""
    if _ORIGINAL:
        return True
    if real_core_present():
        return False
    for name in _PATCHED:
        _ORIGINAL[name] = getattr(fd, name, None)
    for name, value in _PATCHED.items():
        setattr(fd, name, value)
    return True


def uninstall() -> None:
    """Undo :func:`install`."""
    for name, value in _ORIGINAL.items():
        if value is None:
            delattr(fd, name)
        else:
            setattr(fd, name, value)
    _ORIGINAL.clear()
