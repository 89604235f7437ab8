"""The environment contract, turned into a frozen, validated :class:`Config`.

A swarmfd process learns its place in the job from these variables (the names
torch.distributed uses, so launchers and scripts carry over unchanged):

``WORLD_SIZE``        number of ranks in the job (default 1)
``RANK``              this process's rank, 0..WORLD_SIZE-1 (default 0)
``LOCAL_RANK``        rank among the processes on this host (default: RANK when
                      the world is one host, else derived at rendezvous)
``LOCAL_WORLD_SIZE``  number of ranks on this host
``MASTER_ADDR``       host name or address of rank 0 (required when WORLD_SIZE > 1)
``MASTER_PORT``       rendezvous port served by rank 0 (default 29500)
``SWARMFD_TIMEOUT``   seconds any collective may wait for a peer (default 300)

Every value is validated here, once; bad input raises :class:`ConfigError`
(a ``ValueError``) naming the variable, the value and what was expected.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import ConfigError

DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT = 300.0

ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_TIMEOUT = "SWARMFD_TIMEOUT"
ENV_RESTART_COUNT = "SWARMFD_RESTART_COUNT"


@dataclass(frozen=True)
class Config:
    """Where this process sits in the job. Immutable; validated on creation.

    ``local_rank``/``local_world_size`` of ``None`` mean "not given": the
    process group fills them in at rendezvous by grouping ranks per host.
    """

    world_size: int
    rank: int
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    timeout: float = DEFAULT_TIMEOUT
    restart_count: int = 0
    is_main: bool = field(init=False)

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, minimum=1)
        _check_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ConfigError(
                f"rank {self.rank} is out of range: expected 0 <= rank < world_size "
                f"({self.world_size})"
            )
        if self.local_world_size is not None:
            _check_int("local_world_size", self.local_world_size, minimum=1)
            if self.local_world_size > self.world_size:
                raise ConfigError(
                    f"local_world_size {self.local_world_size} exceeds world_size "
                    f"{self.world_size}"
                )
        if self.local_rank is not None:
            _check_int("local_rank", self.local_rank, minimum=0)
            limit = self.local_world_size if self.local_world_size is not None else self.world_size
            if self.local_rank >= limit:
                raise ConfigError(
                    f"local_rank {self.local_rank} is out of range: expected 0 <= local_rank < "
                    f"{'local_world_size' if self.local_world_size is not None else 'world_size'}"
                    f" ({limit})"
                )
        _check_int("master_port", self.master_port, minimum=1)
        if self.master_port > 65535:
            raise ConfigError(f"master_port {self.master_port} is out of range: expected 1..65535")
        if self.master_addr is not None and (
            not isinstance(self.master_addr, str) or not self.master_addr.strip()
        ):
            raise ConfigError(
                f"master_addr must be a non-empty host name, got {self.master_addr!r}"
            )
        if self.world_size > 1 and self.master_addr is None:
            raise ConfigError(
                f"a world of {self.world_size} ranks needs MASTER_ADDR (the address of rank 0); "
                "set the environment variable MASTER_ADDR or pass master_addr="
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        _check_int("restart_count", self.restart_count, minimum=0)
        object.__setattr__(self, "is_main", self.rank == 0)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def parse_env_int(environ: Mapping[str, str], name: str, *, minimum: int = 0,
                  hint: str = "") -> int | None:
    """Read an integer environment variable; ``None`` when unset or empty.

    ``hint`` is appended to the error message (where the value should come from).
    """
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer: "
            f"expected an integer >= {minimum}{hint}"
        ) from None
    if value < minimum:
        raise ConfigError(
            f"environment variable {name}={raw!r} is invalid: expected an integer >= {minimum}"
            f"{hint}"
        )
    return value


def parse_env_float(environ: Mapping[str, str], name: str) -> float | None:
    """Read a positive float environment variable; ``None`` when unset or empty."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"environment variable {name}={raw!r} is invalid: expected a positive number of seconds"
        )
    return value


def config_from_env(environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
    """Build a :class:`Config` from the environment contract (see module docstring).

    With none of the variables set this is a world of one. ``overrides``
    (``timeout=...`` and friends) win over the environment.
    """
    env = os.environ if environ is None else environ
    world_size = parse_env_int(env, ENV_WORLD_SIZE, minimum=1)
    rank = parse_env_int(env, ENV_RANK, minimum=0)
    if world_size is None and rank not in (None, 0):
        raise ConfigError(f"{ENV_RANK}={rank} is set but {ENV_WORLD_SIZE} is not: set both")
    if world_size is not None and world_size > 1 and rank is None:
        raise ConfigError(f"{ENV_WORLD_SIZE}={world_size} is set but {ENV_RANK} is not: set both")
    values: dict[str, object] = {
        "world_size": world_size if world_size is not None else 1,
        "rank": rank if rank is not None else 0,
        "local_rank": parse_env_int(env, ENV_LOCAL_RANK, minimum=0),
        "local_world_size": parse_env_int(env, ENV_LOCAL_WORLD_SIZE, minimum=1),
        "master_addr": (env.get(ENV_MASTER_ADDR) or "").strip() or None,
        "master_port": parse_env_int(env, ENV_MASTER_PORT, minimum=1) or DEFAULT_MASTER_PORT,
        "timeout": parse_env_float(env, ENV_TIMEOUT) or DEFAULT_TIMEOUT,
        "restart_count": parse_env_int(env, ENV_RESTART_COUNT, minimum=0) or 0,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values["world_size"] == 1 and values["master_addr"] is None:
        values["local_rank"] = values["local_rank"] if values["local_rank"] is not None else 0
        values["local_world_size"] = values["local_world_size"] or 1
    try:
        return Config(**values)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from the environment: {_describe(env)})") from None


def _describe(env: Mapping[str, str]) -> str:
    names = (ENV_WORLD_SIZE, ENV_RANK, ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE, ENV_MASTER_ADDR,
             ENV_MASTER_PORT)
    shown = [f"{n}={env[n]}" for n in names if n in env]
    return ", ".join(shown) if shown else "none of the variables set"
