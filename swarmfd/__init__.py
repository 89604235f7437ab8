"""swarmfd: data-parallel training for Python, over shared memory and TCP, local or on Swarm::

    import numpy as np
    import swarmfd as fd

    cfg = fd.init_from_env()            # WORLD_SIZE, RANK, MASTER_ADDR, ... (see swarmfd.config)
    grads = [np.ones(10, np.float32)]
    fd.all_reduce_mean(grads)           # in place, identical on every rank
    fd.print(f"world of {cfg.world_size}")  # main rank only
    fd.cleanup()

Run N ranks locally with ``swarmfd run -n N script.py`` or on Docker Swarm with
``swarmfd deploy IMAGE -n N -- python script.py``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import elastic
from .accumulate import GradAccum
from .collectives import (
    all_gather,
    all_gather_object,
    all_reduce,
    all_reduce_mean,
    all_to_all,
    barrier,
    broadcast,
    broadcast_object,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from .config import Config
from .engine import Work
from .errors import (
    AbortedError,
    AbortedMismatchError,
    AbortedPeerLostError,
    AbortedTimeout,
    AlreadyInitializedError,
    AuthenticationError,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    ElasticError,
    MismatchError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    SwarmfdError,
)
from .group import (
    NON_GROUP_MEMBER,
    Group,
    get_config,
    get_rank,
    get_world_size,
    host_group,
    is_initialized,
    new_group,
)
from .observe import stats
from .session import cleanup, init, init_from_env
from .sharding import shard_batch, shard_indices
from .utils import checkpoint_barrier, get_seed, print, print_config, should_save

__all__ = [
    "NON_GROUP_MEMBER",
    "AbortedError",
    "AbortedMismatchError",
    "AbortedPeerLostError",
    "AbortedTimeout",
    "AlreadyInitializedError",
    "AuthenticationError",
    "CollectiveError",
    "CollectiveTimeout",
    "Config",
    "ConfigError",
    "ElasticError",
    "GradAccum",
    "Group",
    "MismatchError",
    "NotInitializedError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "RendezvousTimeout",
    "SwarmfdError",
    "Work",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_mean",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "checkpoint_barrier",
    "cleanup",
    "elastic",
    "gather",
    "get_config",
    "get_rank",
    "get_seed",
    "get_world_size",
    "host_group",
    "init",
    "init_from_env",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "print",
    "print_config",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "shard_batch",
    "shard_indices",
    "should_save",
    "stats",
]
