"""Comm hooks for :meth:`DistributedDataParallel.register_comm_hook` (torch's names).

A hook is ``hook(state, bucket) -> work``: ``bucket`` is a
:class:`~swarmfd.torch.ddp.GradBucket` (this rank's unscaled flat gradients), and
``work.wait()`` returns the averaged flat gradients. ``state`` is the swarmfd group
(None: the world), as torch's default hooks take the process group::

    ddp.register_comm_hook(None, swarmfd.torch.comm_hooks.fp16_compress_hook)
"""

from __future__ import annotations

from typing import Any

import torch

import swarmfd as fd

from ._tensors import Work
from .ddp import GradBucket


def allreduce_hook(state: Any, bucket: GradBucket) -> Work:
    """The default behaviour as a hook: the mean of the bucket over the group."""
    buf = bucket.buffer()
    return Work(fd.all_reduce(buf.numpy(), op="mean", group=state, async_op=True),
                None, buf)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> Work:
    """Halve the bytes on the wire: the bucket travels as float16, divided first.

    Each rank divides its gradients by N and rounds them to float16, the float16 sums
    are all-reduced, and the result is widened back into the bucket. Dividing first
    keeps the values and the sum in float16's range (torch's hook divides after
    rounding, so a gradient above 65504 becomes inf there); the price
    is float16's 11-bit mantissa, about 3 decimal digits, and gradients below 6e-8
    (float16's smallest subnormal) times N flush to zero.
    """
    buf = bucket.buffer()
    if buf.dtype == torch.float16:
        return allreduce_hook(state, bucket)
    buf.div_(fd.get_world_size(state))  # before rounding: no overflow of float16's range
    compressed = buf.to(torch.float16)

    def decompress() -> None:
        buf.copy_(compressed)

    return Work(fd.all_reduce(compressed.numpy(), op="sum", group=state, async_op=True),
                decompress, buf)
