"""Checkpoint and utility helpers; they work before :func:`swarmfd.init` too (as in a
world of one), so a script can print and seed before it joins the group."""

from __future__ import annotations

import builtins
import sys
from typing import Any

from . import collectives, group
from .config import Config

__all__ = ["checkpoint_barrier", "get_seed", "print", "print_config", "should_save"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _rank() -> int:
    return group.get_rank() if group.is_initialized() else 0


def should_save() -> bool:
    """True on the main rank (rank 0): the one rank that writes checkpoints."""
    return _rank() == 0


def checkpoint_barrier() -> None:
    """A barrier after the main rank wrote a checkpoint, so that no rank reads it or
    changes the state before it is complete (a no-op before init)."""
    if group.is_initialized():
        collectives.barrier()


def print(*args: Any, **kwargs: Any) -> None:
    """``print`` on the main rank only (flushed, so logs of all ranks interleave sanely)."""
    if _rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def get_seed(base_seed: int, rank: int | None = None) -> int:
    """A 64-bit seed from ``base_seed`` and the rank, distinct per rank and well mixed
    (splitmix64 of base + rank * golden, a bijection): for per-rank randomness such as
    augmentation; use the base seed itself for what all ranks must share."""
    if isinstance(base_seed, bool) or not isinstance(base_seed, int):
        raise TypeError(f"get_seed: base_seed must be an integer, got {base_seed!r}")
    r = _rank() if rank is None else rank
    return _splitmix64((base_seed + r * _GOLDEN) & _MASK64)


def print_config(config: Config | None = None, file: Any = None) -> None:
    """Print a one-line summary of ``config`` (default: the active group's) on this rank."""
    if config is None:
        config = group.get_config()
    builtins.print(
        f"swarmfd config: rank {config.rank}/{config.world_size} "
        f"local_rank {config.local_rank}/{config.local_world_size} "
        f"main={config.is_main} rendezvous={config.master_addr}:{config.rendezvous_port} "
        f"timeout={config.timeout:g}s init_timeout={config.join_timeout:g}s "
        f"restart={config.restart_count}",
        file=file if file is not None else sys.stdout,
        flush=True,
    )
