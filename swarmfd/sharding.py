"""Data parallelism by splitting the data, not the model: which samples belong to this rank.

Two pure functions (numpy only; no sockets, no process state beyond reading the
current rank and world size when they are not passed in):

:func:`shard_indices`
    the dataset indices this rank trains on in one epoch. Every rank gets the
    *same number* of indices, because every rank must run the same number of
    steps (and so call the same number of collectives) or the ring deadlocks.
    The padding and striding follow torch's ``DistributedSampler`` exactly, so
    a script ported from torch sees the same assignment of samples to ranks
    (the shuffled order differs: numpy's generator is not torch's).

:func:`shard_batch`
    this rank's slice of a batch that every rank already holds (for example an
    evaluation set), split as :func:`numpy.array_split` splits: no padding, so
    nothing is counted twice, and the parts may differ in length by one.

Both take ``rank=`` and ``world_size=``; when omitted they come from the
process group (:func:`swarmfd.init` / :func:`swarmfd.init_from_env`).
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
    """Return this rank's dataset indices for one epoch (``int64``, in visiting order).

    The ranks' lists are disjoint and together cover ``range(total_size)``,
    except for the padding described next, and all have the same length: that
    equality is what keeps every rank doing the same number of steps.

    * Without ``drop_last`` the list is padded to a multiple of ``world_size``
      by repeating indices from its start (wrapping around as often as needed
      when ``total_size < world_size``), so a few samples are seen twice per
      epoch. Each rank gets ``ceil(total_size / world_size)`` indices.
    * With ``drop_last`` the tail is dropped instead: ``total_size // world_size``
      each, and the last ``total_size % world_size`` indices (of the shuffled
      order) are not visited this epoch.

    Rank ``r`` takes every ``world_size``-th index starting at ``r`` (the
    stride of torch's ``DistributedSampler``).

    With ``shuffle`` the order is ``np.random.default_rng(seed + epoch).permutation``:
    the same on every rank (no communication needed, only the same ``seed``)
    and different from epoch to epoch, so pass the current ``epoch``.

    ``rank``/``world_size`` default to the process group's.

    Raises:
        TypeError: ``total_size``, ``seed``, ``epoch``, ``rank`` or ``world_size``
            is not an integer (bools included).
        ValueError: any of them is negative, ``world_size < 1`` or ``rank >= world_size``.
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
        if padded > n:
            # n > 0 here: padded == 0 when n == 0. np.resize repeats from the start.
            order = np.resize(order, padded)
    return np.ascontiguousarray(order[r::world])


def shard_batch(batch: T, dim: int = 0, *, rank: int | None = None,
                world_size: int | None = None) -> T:
    """Return this rank's part of ``batch`` along ``dim``.

    The split is :func:`numpy.array_split`'s: with ``n`` rows and ``w`` ranks
    the first ``n % w`` ranks get ``n // w + 1`` rows and the rest ``n // w``;
    concatenating every rank's part in rank order gives back ``batch``. A rank
    may get zero rows when ``n < w``.

    Works on numpy arrays (the result is a view: basic slicing, no copy) and,
    by duck typing, on torch tensors (``tensor.narrow``, also a view); torch
    itself is never imported here.

    ``dim`` may be negative, counted from the end as in numpy.
    ``rank``/``world_size`` default to the process group's.

    Raises:
        TypeError: ``batch`` is neither a numpy array nor tensor-like, or
            ``dim`` is not an integer.
        ValueError: ``batch`` is 0-dimensional or ``dim`` is out of range.
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
