"""swarmfd.torch: PyTorch data parallelism over swarmfd (the only module that imports torch).

A one-line swap for torch scripts (CPU tensors; torch stays optional for swarmfd)::

    import swarmfd as fd
    import swarmfd.torch as sft

    fd.init_from_env()                                  # under swarmfd run / deploy
    model = sft.DistributedDataParallel(model)          # was torch.nn.parallel.DDP
    opt = sft.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

* :class:`DistributedDataParallel`: gradients bucketed in reverse registration order
  and averaged by async collectives overlapped with backward; ``no_sync``,
  ``find_unused_parameters``, comm hooks (:mod:`swarmfd.torch.comm_hooks`).
* :class:`ZeroRedundancyOptimizer`: ZeRO stage 1, flat equal shards of the optimizer
  state; under DDP the buckets are reduce-scattered, so gradients are reduced once.
* :func:`fully_shard` (:mod:`swarmfd.torch.fsdp`): FSDP2's API, parameters, gradients
  and optimizer state sharded; ``reshard_after_forward=False`` is ZeRO-2.
* :mod:`swarmfd.torch.checkpoint` (``save``/``load``): sharded safetensors
  checkpoints that load at any world size; :func:`get_state_dict`,
  :func:`set_state_dict`: whole (streamed to rank 0) or sharded state dicts.
* :func:`broadcast_parameters`, :func:`broadcast_optimizer_state`: one rank's model or
  optimizer state to all (JSON structure, array data, never pickle).
* :func:`all_reduce`, :func:`broadcast`, :func:`all_reduce_gradients`: tensor
  collectives that also take bfloat16 (reduced in float32), generators and dicts.
* ``torch.distributed.init_process_group("swarmfd")`` (registered on import, see
  :mod:`swarmfd.torch.c10d`): torch's own API and DDP over swarmfd.

CUDA tensors are not supported: swarmfd moves host memory, and this package says so
when it meets one.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        "swarmfd.torch needs PyTorch, which swarmfd does not install: "
        "pip install torch==2.13.0 (the CPU wheel)") from exc

from . import checkpoint, comm_hooks, elastic
from .c10d import ProcessGroupSwarmfd, register
from .collectives import all_reduce, all_reduce_gradients, broadcast
from .ddp import DistributedDataParallel, GradBucket
from .fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from .state import broadcast_optimizer_state, broadcast_parameters
from .state_dict import get_state_dict, set_state_dict
from .zero import ZeroRedundancyOptimizer

register()

DDP = DistributedDataParallel

__all__ = [
    "DDP",
    "DistributedDataParallel",
    "FSDPModule",
    "GradBucket",
    "MixedPrecisionPolicy",
    "ProcessGroupSwarmfd",
    "ZeroRedundancyOptimizer",
    "all_reduce",
    "all_reduce_gradients",
    "broadcast",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "checkpoint",
    "comm_hooks",
    "elastic",
    "fully_shard",
    "get_state_dict",
    "set_state_dict",
]
