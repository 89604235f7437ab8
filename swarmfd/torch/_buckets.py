"""Gradient buckets: which parameters travel together, and where in the flat buffer.

Shared by :class:`~swarmfd.torch.DistributedDataParallel` (a bucket is one async
collective during backward) and :class:`~swarmfd.torch.ZeroRedundancyOptimizer` (a
bucket is one flat segment split into N equal parts, part r owned by rank r): when
both are used, they use the same buckets, so that DDP's reduce-scatter of a bucket
hands each rank exactly the gradients of the part it owns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Bytes of the first bucket (torch DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB): it
#: holds the last layers, whose gradients are ready first, so its collective starts
#: early in the backward pass instead of waiting for a full ``bucket_cap_mb``.
FIRST_BUCKET_BYTES = 1 << 20


def comm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient is reduced in: bfloat16 in float32 (numpy has no bfloat16)."""
    return torch.float32 if dtype is torch.bfloat16 else dtype


class Slot:
    """One parameter's place in a bucket: elements [offset, offset + numel)."""

    __slots__ = ("bucket", "name", "numel", "offset", "param", "position")

    def __init__(self, param: torch.Tensor, name: str, position: int) -> None:
        self.param = param
        self.name = name
        self.position = position  # index among the parameters given to assign()
        self.offset = 0
        self.numel = param.numel()
        self.bucket = -1


class Bucket:
    """Parameters of one dtype, flattened into one buffer of ``padded`` elements.

    ``padded`` is ``numel`` rounded up to a multiple of the group size, so that the
    buffer splits into ``size`` equal parts of ``part`` elements (the padding is zero
    and never read back).
    """

    def __init__(self, index: int, dtype: torch.dtype, size: int) -> None:
        self.index = index
        self.dtype = dtype
        self.comm_dtype = comm_dtype(dtype)
        self.size = size
        self.slots: list[Slot] = []
        self.numel = 0

    def add(self, slot: Slot) -> None:
        slot.offset, slot.bucket = self.numel, self.index
        self.slots.append(slot)
        self.numel += slot.numel

    @property
    def padded(self) -> int:
        return -(-self.numel // self.size) * self.size

    @property
    def part(self) -> int:
        return self.padded // self.size

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.comm_dtype).element_size()

    def __repr__(self) -> str:
        return (f"<bucket {self.index}: {len(self.slots)} params, {self.numel} x "
                f"{self.dtype}>")


def assign(params: Sequence[tuple[str, torch.Tensor]], size: int, cap_bytes: int,
           first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """Buckets of ``params`` (name, tensor), in reverse order, by dtype, capped in bytes.

    Reverse registration order approximates the order in which backward produces
    gradients (last layer first). A bucket closes once it holds at least its cap (the
    first bucket of each dtype ``first_cap_bytes``, later ones ``cap_bytes``), so a
    parameter larger than the cap gets a bucket of its own. Buckets are numbered in
    the order they were opened; collectives are issued in that order on every rank.
    """
    buckets: list[Bucket] = []
    open_: dict[torch.dtype, Bucket] = {}
    closed_count: dict[torch.dtype, int] = {}
    for position in range(len(params) - 1, -1, -1):
        name, p = params[position]
        slot = Slot(p, name, position)
        b = open_.get(p.dtype)
        if b is None:
            b = open_[p.dtype] = Bucket(len(buckets), p.dtype, size)
            buckets.append(b)
        b.add(slot)
        cap = first_cap_bytes if closed_count.get(p.dtype, 0) == 0 else cap_bytes
        if b.nbytes >= cap:
            del open_[p.dtype]
            closed_count[p.dtype] = closed_count.get(p.dtype, 0) + 1
    return buckets


def describe(buckets: Sequence[Bucket]) -> str:
    """``3 buckets: 4.0, 4.0, 5.6 MB``: for logs and errors."""
    sizes = ", ".join(f"{b.nbytes / 1e6:.1f}" for b in buckets)
    return f"{len(buckets)} bucket(s): {sizes} MB"
