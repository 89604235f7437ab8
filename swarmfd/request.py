"""What ``swarmfd run`` and ``swarmfd deploy`` are asked to do: one validated request.

A request is a frozen dataclass: :class:`JobRequest` holds what both commands take (the
number of ranks, COMMAND, ``-e``, the timeouts, restarts, the output prefix), and each
command's request extends it (:class:`swarmfd.launch.LaunchConfig` for ``run``,
:class:`swarmfd.swarm.request.DeployRequest` for ``deploy``). It checks every value
when it is made, and its errors (ValueError, TypeError) name the option.

Each field the command line sets is declared with :func:`option`: its flags, its help,
and (``env``) the variable it sets for every rank. The click layer
(:mod:`swarmfd.cli_options`) makes a command's options from these declarations, in
field order, and builds the request from what it parsed. So an option is added in one
place: a field of JobRequest (both commands take it; with ``env`` both pass it to every
rank, through :meth:`JobRequest.rank_env`) or of the command's own request, with its
check in that class's ``__post_init__``.

The rules of ``-e`` (:data:`ENV_HELP`, :func:`parse_env_items`), the same for both
commands: ``-e KEY=VALUE`` sets KEY (the value may be empty or hold '='); ``-e KEY``
passes this shell's value of KEY (an error when it is unset), as ``docker run -e`` does;
KEY is a name of letters, digits and '_' that does not start with a digit; the last
``-e`` of a KEY wins. What the command sets for every rank, itself or from an option
(``SWARMFD_TIMEOUT`` from ``--timeout``), cannot be given with ``-e``: the error names
the option to use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

from .config import (
    ENV_ELASTIC_MIN_N,
    ENV_ELASTIC_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_STALL_WARN,
    ENV_TIMEOUT,
    check_int,
    check_seconds,
)

__all__ = ["DEFAULT_ELASTIC_RESTARTS", "ENV_HELP", "JobRequest", "OptionSpec", "field_default",
           "option", "option_specs", "parse_env_items"]


@dataclass(frozen=True)
class OptionSpec:
    """How a request field is given on the command line (click's terms).

    ``decls``: its flags (``"--bind-cores/--no-bind-cores"`` makes an on/off switch);
    ``type``: int, float or str (None: str); ``flag_value``: a flag's value when given
    (the field's default otherwise); ``multiple``: repeatable, a tuple of the values;
    ``choices``: the values allowed; ``env``: the variable it sets for every rank.
    """

    decls: tuple[str, ...]
    help: str
    metavar: str | None = None
    type: type | None = None
    flag_value: Any = None
    multiple: bool = False
    choices: tuple[str, ...] | None = None
    required: bool = False
    show_default: bool = False
    env: str | None = None

    @property
    def is_flag(self) -> bool:
        return self.flag_value is not None

    @property
    def name(self) -> str:
        """The option as errors name it: its long flag (``--timeout``)."""
        flags = [d.split("/")[0] for d in self.decls]
        return next((f for f in flags if f.startswith("--")), flags[0])


def option(*decls: str, help: str, default: Any = None, metavar: str | None = None,
           type: type | None = None, flag_value: Any = None, multiple: bool = False,
           choices: tuple[str, ...] | None = None, required: bool = False,
           show_default: bool = False, env: str | None = None) -> Any:
    """A request field that the command line sets (see :class:`OptionSpec`); a
    ``required`` one has no default, a ``multiple`` one defaults to ()."""
    spec = OptionSpec(decls, help, metavar, type, flag_value, multiple, choices, required,
                      show_default, env)
    if required:
        return field(metadata={"option": spec})
    return field(default=() if multiple else default, metadata={"option": spec})


def option_specs(cls: type) -> Iterator[tuple[Field[Any], OptionSpec]]:
    """The fields of request class ``cls`` the command line sets, in order, with their
    specs; a field whose metadata names a ``group`` (a request class of its own, as
    ``field(default_factory=C, metadata={"group": C})``) has that class's options in its
    place."""
    for f in fields(cls):
        if "group" in f.metadata:
            yield from option_specs(f.metadata["group"])
        elif "option" in f.metadata:
            yield f, f.metadata["option"]


def field_default(f: Field[Any]) -> Any:
    """A field's default value (None when it has none)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


#: ``--max-restarts`` under ``--elastic`` when not given: replacements per rank.
DEFAULT_ELASTIC_RESTARTS = 3

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: The help of ``-e`` (both commands).
ENV_HELP = ("Environment variable for every rank, repeatable: KEY=VALUE, or KEY alone to "
            "pass this shell's value. What swarmfd sets itself, or from an option, is "
            "refused, naming the option.")


def parse_env_items(items: Iterable[str], environ: Mapping[str, str] | None = None
                    ) -> dict[str, str]:
    """``-e`` items as a dict: ``KEY=VALUE``, or ``KEY`` with its value in ``environ``
    (default: this process's environment). Raises ValueError for a malformed KEY and
    for a bare KEY that is not set."""
    local = os.environ if environ is None else environ
    env: dict[str, str] = {}
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"-e items must be strings, got {item!r}")
        key, sep, value = item.partition("=")
        if not _ENV_KEY.match(key):
            raise ValueError(
                f"-e {item!r}: expected KEY=VALUE (or KEY alone, to pass this shell's "
                "value), KEY of letters, digits and '_', not starting with a digit; e.g. "
                "-e OMP_NUM_THREADS=1")
        if not sep:
            if key not in local:
                raise ValueError(f"-e {key}: {key} is not set in this shell; give a value "
                                 f"with -e {key}=VALUE")
            value = local[key]
        env[key] = value
    return env


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """What ``swarmfd run`` and ``swarmfd deploy`` share (see the module docstring).

    ``env``: a mapping, or ``-e`` items (:func:`parse_env_items`); it becomes a
    read-only dict. Subclasses say which variables they set for every rank
    (:attr:`RESERVED_ENV`, each with the option to use instead) and how to call them
    (:meth:`example`, shown when COMMAND is missing).
    """

    #: Variables the command sets for every rank: -e may not (name -> the option to use).
    RESERVED_ENV: ClassVar[Mapping[str, str]] = MappingProxyType({})

    command: tuple[str, ...]
    nproc: int = option("-n", "--nproc", type=int, required=True, metavar="N",
                        help="Number of ranks, >= 1.")
    env: Mapping[str, str] = option("-e", "--env", multiple=True, metavar="KEY[=VALUE]",
                                    help=ENV_HELP)
    timeout: float | None = option(
        "--timeout", type=float, metavar="SECONDS", env=ENV_TIMEOUT,
        help="Seconds a collective may wait for a peer (sets SWARMFD_TIMEOUT).")
    init_timeout: float | None = option(
        "--init-timeout", type=float, metavar="SECONDS", env=ENV_INIT_TIMEOUT,
        help="Seconds the ranks wait for each other to start (sets SWARMFD_INIT_TIMEOUT; "
             "default: the timeout).")
    stall_warn: float | None = option(
        "--stall-warn", type=float, metavar="SECONDS", env=ENV_STALL_WARN,
        help="Seconds a collective may wait before the waiting ranks log which ranks have "
             "not entered it (sets SWARMFD_STALL_WARN; default 60, 0: never).")
    max_restarts: int = option(
        "--max-restarts", type=int, metavar="K",
        help="When a rank fails, stop the whole group and start it again, up to K times "
             "(SWARMFD_RESTART_COUNT counts them; the same job secret). With --elastic: "
             "start a rank that died again as a replacement that joins the running job, "
             "up to K times per rank.  [default: 0; 3 with --elastic]")
    elastic: bool = option(
        "--elastic", default=False, flag_value=True,
        help="An elastic job (fd.elastic.run): when a rank is lost, the others re-form "
             "the world without it and go on from their last commit; a replacement joins "
             "at their next commit. Sets SWARMFD_ELASTIC=1.")
    min_n: int | None = option(
        "--min-n", type=int, metavar="N", env=ENV_ELASTIC_MIN_N,
        help="With --elastic: the fewest ranks the job goes on with.  [default: 1]")
    elastic_timeout: float | None = option(
        "--elastic-timeout", type=float, metavar="SECONDS", env=ENV_ELASTIC_TIMEOUT,
        help="With --elastic: how long the job may stay below --min-n before every "
             "rank fails, naming the lost ranks.  [default: 60]")
    prefix: bool = option("--no-prefix", default=True, flag_value=False,
                          help="Do not prefix output lines with '[rank R] '.")

    def __post_init__(self) -> None:
        self._set("command", self._checked_command())
        nproc = self.nproc
        if isinstance(nproc, bool) or not isinstance(nproc, int):
            raise TypeError(f"-n/--nproc must be an integer (the number of ranks), got "
                            f"{nproc!r}")
        if nproc < 1:
            raise ValueError(f"the number of ranks must be >= 1, got -n {nproc}")
        self._set("env", MappingProxyType(self._checked_env()))
        for name in ("timeout", "init_timeout"):
            if getattr(self, name) is not None:
                check_seconds(self.option_name(name), getattr(self, name),
                              type_error=TypeError, value_error=ValueError)
        if self.stall_warn is not None:
            check_seconds("--stall-warn", self.stall_warn, allow_zero=True,
                          type_error=TypeError, value_error=ValueError)
        if self.max_restarts is None:
            self._set("max_restarts", DEFAULT_ELASTIC_RESTARTS if self.elastic is True else 0)
        check_int("--max-restarts", self.max_restarts, minimum=0, what="a number of restarts",
                  type_error=TypeError, value_error=ValueError)
        self._check_elastic()
        if not isinstance(self.prefix, bool):
            raise TypeError(f"prefix must be a bool, got {self.prefix!r}")

    def _check_elastic(self) -> None:
        if not isinstance(self.elastic, bool):
            raise TypeError(f"elastic must be a bool, got {self.elastic!r}")
        for name in ("min_n", "elastic_timeout"):
            if getattr(self, name) is not None and not self.elastic:
                raise ValueError(f"{self.option_name(name)} needs --elastic (it sets what an "
                                 "elastic job does when it loses ranks)")
        if self.min_n is not None:
            check_int("--min-n", self.min_n, minimum=1, what="a number of ranks",
                      type_error=TypeError, value_error=ValueError)
            if self.min_n > self.nproc:
                raise ValueError(f"--min-n {self.min_n} is more than the job's ranks (-n "
                                 f"{self.nproc}): expected 1 <= --min-n <= -n")
        if self.elastic_timeout is not None:
            check_seconds("--elastic-timeout", self.elastic_timeout, type_error=TypeError,
                          value_error=ValueError)

    def example(self) -> str:
        """The command with its options, shown when COMMAND is missing."""
        return f"swarmfd run -n {self.nproc} train.py"

    def _set(self, name: str, value: Any) -> None:
        """Normalise a field of this frozen request while it is checked."""
        object.__setattr__(self, name, value)

    @classmethod
    def option_name(cls, name: str) -> str:
        """The option that sets field ``name`` (``--timeout``), for error messages."""
        return next(spec.name for f, spec in option_specs(cls) if f.name == name)

    def _checked_command(self) -> tuple[str, ...]:
        command = self.command
        if isinstance(command, (str, bytes)) or not isinstance(command, Iterable):
            raise TypeError(f"command must be a sequence of strings (an argv), got {command!r}")
        command = tuple(command)
        if not command:
            raise ValueError(f"missing COMMAND: give the program every rank runs, e.g. "
                             f"'{self.example()}'")
        for word in command:
            if not isinstance(word, str):
                raise TypeError(f"command words must be strings, got {word!r} in {command!r}")
            if "\0" in word:
                raise ValueError(f"command word {word!r} contains a NUL byte")
        if command[0] == "":
            raise ValueError("command starts with an empty word: expected a program name")
        return command

    def _checked_env(self) -> dict[str, str]:
        env = self.env
        if isinstance(env, Mapping):
            env = dict(env)
        elif isinstance(env, Iterable) and not isinstance(env, (str, bytes)):
            env = parse_env_items(env)
        else:
            raise TypeError(f"env must be a mapping of str to str or -e items, got {env!r}")
        reserved = {**self.RESERVED_ENV, **{spec.env: spec.name for _f, spec in
                                            option_specs(type(self)) if spec.env}}
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"env entries must be str=str, got {key!r}={value!r}")
            if not _ENV_KEY.match(key):
                raise ValueError(f"env name {key!r} is invalid: expected letters, digits and "
                                 "'_', not starting with a digit")
            if "\0" in value:
                raise ValueError(f"the value of -e {key} contains a NUL byte")
            if key in reserved:
                raise ValueError(f"-e {key} is not allowed: swarmfd sets {key} for every "
                                 f"rank; use {reserved[key]}")
        return env

    def rank_env(self) -> dict[str, str]:
        """The variables this request's options set for every rank (``env`` of their
        declarations): floats as repr() (exact), flags as 1 or 0."""
        out = {}
        for f in fields(self):
            spec = f.metadata.get("option")
            if spec is None or spec.env is None or getattr(self, f.name) is None:
                continue
            value = getattr(self, f.name)
            out[spec.env] = (("1" if value else "0") if isinstance(value, bool)
                             else repr(float(value)) if spec.type is float else str(value))
        return out
