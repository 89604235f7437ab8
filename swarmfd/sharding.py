"""Data parallelism by splitting the data, not the model: which samples belong to this rank.

Two pure functions (numpy only): :func:`shard_indices`, the dataset indices this rank
trains on in an epoch (the same number on every rank, which must run as many steps);
:func:`shard_batch`, this rank's slice of a batch every rank holds. Both take ``rank=``
and ``world_size=``, else the process group's.
"""

from __future__ import annotations

import operator
from typing import Any, TypeVar

import numpy as np

from .errors import NotInitializedError

__all__ = ["shard_batch", "shard_indices"]

T = TypeVar("T")


def _as_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum``; bools and non-integers are rejected."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    result = operator.index(value)
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def _resolve_group(func: str, rank: object, world_size: object) -> tuple[int, int]:
    """The (rank, world_size) to shard for: the arguments, else the process group's."""
    if rank is None or world_size is None:
        from . import group  # lazy: sharding stays importable (and pure) without a group

        try:
            cfg = group.get_config()
        except NotInitializedError as exc:
            raise NotInitializedError(
                f"{func}() needs this process's rank and the world size: call "
                f"swarmfd.init() / swarmfd.init_from_env() first, or pass rank= and world_size= "
                f"({exc})"
            ) from None
        if rank is None:
            rank = cfg.rank
        if world_size is None:
            world_size = cfg.world_size
    world = _as_int("world_size", world_size, minimum=1)
    r = _as_int("rank", rank, minimum=0)
    if r >= world:
        raise ValueError(f"rank {r} is out of range: expected 0 <= rank < world_size ({world})")
    return r, world


def shard_indices(
    total_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
) -> np.ndarray:
    """This rank's dataset indices for one epoch (``int64``, in visiting order), as
    torch's ``DistributedSampler`` assigns them (its shuffled order differs).

    The ranks' lists are disjoint, cover ``range(total_size)`` and have one length.
    Without ``drop_last`` the order is padded to a multiple of ``world_size`` by
    repeating from its start (``ceil(total_size / world_size)`` each); with it the tail
    is dropped (``total_size // world_size`` each). Rank ``r`` takes every
    ``world_size``-th index from ``r``. ``shuffle``: the order is
    ``np.random.default_rng(seed + epoch).permutation``, alike on every rank: pass the
    current ``epoch``. TypeError for a non-integer argument (bools too), ValueError for
    a negative one, ``world_size < 1`` or ``rank >= world_size``.
    """
    n = _as_int("total_size", total_size, minimum=0)
    seed_i = _as_int("seed", seed, minimum=0)
    epoch_i = _as_int("epoch", epoch, minimum=0)
    r, world = _resolve_group("shard_indices", rank, world_size)

    if shuffle:
        order = np.random.default_rng(seed_i + epoch_i).permutation(n).astype(np.int64, copy=False)
    else:
        order = np.arange(n, dtype=np.int64)

    if drop_last:
        per_rank = n // world
        order = order[: per_rank * world]
    else:
        per_rank = -(-n // world)  # ceil
        padded = per_rank * world
        if padded > n:  # (n > 0 here) np.resize repeats from the start
            order = np.resize(order, padded)
    return np.ascontiguousarray(order[r::world])


def shard_batch(batch: T, dim: int = 0, *, rank: int | None = None,
                world_size: int | None = None) -> T:
    """This rank's part of ``batch`` along ``dim`` (negative counts from the end), split
    as :func:`numpy.array_split` splits (no padding: parts differ by one row at most,
    maybe zero rows). A view of a numpy array, or of a torch tensor (``narrow``; torch
    is never imported). TypeError for another type or a non-integer ``dim``, ValueError
    for a 0-d batch or ``dim`` out of range.
    """
    is_numpy = isinstance(batch, np.ndarray)
    if not is_numpy and not (hasattr(batch, "narrow") and hasattr(batch, "shape")):
        raise TypeError(
            "shard_batch expects a numpy array or a torch tensor, got "
            f"{type(batch).__name__}; convert it with numpy.asarray first"
        )
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim must be an integer, got {dim!r} ({type(dim).__name__})")
    shape = tuple(int(s) for s in batch.shape)  # type: ignore[attr-defined]
    ndim = len(shape)
    d = int(dim)
    if ndim == 0:
        raise ValueError(f"dim {d} is out of range: the batch is 0-dimensional, nothing to split")
    if not -ndim <= d < ndim:
        raise ValueError(
            f"dim {d} is out of range for a batch of shape {shape}: expected "
            f"{-ndim} <= dim < {ndim}"
        )
    d %= ndim
    r, world = _resolve_group("shard_batch", rank, world_size)

    base, extra = divmod(shape[d], world)
    start = r * base + min(r, extra)
    length = base + (1 if r < extra else 0)
    if is_numpy:
        index: list[Any] = [slice(None)] * ndim
        index[d] = slice(start, start + length)
        return batch[tuple(index)]  # type: ignore[index]
    return batch.narrow(d, start, length)  # type: ignore[attr-defined, no-any-return]
