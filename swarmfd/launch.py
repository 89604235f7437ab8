"""The local launcher behind ``swarmfd run``: start N ranks on this host, supervise them.

``swarmfd run -n N [options] [--] COMMAND...`` starts N copies of COMMAND (a first
word ending in ``.py`` runs with the current Python, ``sys.executable``). Each copy
(a *rank*) gets the environment contract of :mod:`swarmfd.config`:

``WORLD_SIZE``             N
``RANK``, ``LOCAL_RANK``   0..N-1 (every rank is local, so both are equal)
``LOCAL_WORLD_SIZE``       N
``MASTER_ADDR``            ``--master-addr`` (default ``127.0.0.1``)
``MASTER_PORT``            ``--master-port``, or a free port picked by binding port 0
                           on MASTER_ADDR (a new one on every restart): the port
                           torch.distributed's store binds, should the script use it
``SWARMFD_PORT``           ``--swarmfd-port``, else ``--master-port`` + 1 when that is
                           given, else a second free port, distinct from MASTER_PORT
                           (new on every restart): the port swarmfd's rendezvous binds
``SWARMFD_TIMEOUT``        ``--timeout``, when given
``SWARMFD_INIT_TIMEOUT``   ``--init-timeout``, when given
``SWARMFD_RESTART_COUNT``  0 on the first attempt, then 1, 2, ... on each restart
``SWARMFD_SECRET_FILE``    the path of this run's job secret (see below)
``SWARMFD_JOB_ID``         a fresh random id on every attempt: rank 0 refuses a rank of
                           another launch that reaches its port, even with the secret
``PYTHONUNBUFFERED``       1 (so Python ranks stream their output promptly)
``OMP_NUM_THREADS``        with several ranks, when neither the launcher's environment
                           nor ``-e`` sets it: this host's usable cores divided among
                           the ranks, at least 1 (:func:`rank_threads`)

plus the launcher's own environment and any ``-e KEY=VALUE``. The contract
variables cannot be set with ``-e``: the launcher owns them. Ranks read no
input: their stdin is ``/dev/null``.

Threads. torch, and numpy through OpenBLAS, start one compute thread per core in
every process by default, and OpenBLAS's threads spin while they wait for work: N
ranks on C cores then run N x C threads that take turns on the cores the ranks'
collectives need. torchrun sets OMP_NUM_THREADS=1 for the same reason; this
launcher gives each rank its share of the cores instead (one thread each when
ranks are as many as cores or more), which halved the README's two-rank example on
two cores (the measurement: docs/performance.md). A value the user gives, in the
launcher's environment or with ``-e``, is passed through unchanged; a single rank is
left to the libraries' own defaults (torch's counts physical cores, where
the affinity mask counts hyperthreads), as torchrun does.

Cores. With ``bind_cores`` (``--bind-cores``, or ``SWARMFD_BIND_CORES=1`` in the
launcher's environment) each rank runs only on its own share of the cores this launcher
may use (:func:`core_sets`: rank r on the r-th run of cores // N of them; ranks take
cores in turn when they outnumber them), set between fork and exec, so every thread the
rank starts inherits it: libzmq's I/O thread then shares its rank's core, where a
message hand-off between the two costs no wake-up on another core (Open MPI's
``--bind-to core``, DeepSpeed's ``--bind_cores_to_rank``). It is off by default, as in
torchrun (Open MPI binds by default, DeepSpeed on request): two jobs at once on one host
would pin their ranks to the same cores, and a pinned rank cannot move away from other
work on its core; and pinned, the collectives measured up to a fifth faster or slower,
by plane and size, or the same (the measurement: docs/performance.md).

Output. Every line a rank writes goes to the same stream (stdout or stderr) of
the launcher, prefixed with ``[rank R] `` (unless ``prefix`` is off). Lines are
written whole, under one lock, so ranks never interleave mid-line. A final line
without a newline is still printed (the prefix mode adds the newline). Output is
handled as bytes and never decoded, so binary or non-UTF-8 output cannot break
the launcher. A line longer than 64 KiB is cut into 64 KiB pieces.

Failure. The first rank to exit non-zero (a rank killed by signal S counts as
exit code 128+S, as shells report it) fails the group: the launcher prints
``swarmfd run: rank R exited with code C; stopping the other ranks`` on stderr,
sends SIGTERM to every rank, waits ``grace`` seconds and then sends SIGKILL.
With ``max_restarts=K`` the whole group is then started again, up to K times;
the exit code is the last attempt's. Its peers may see it go before they are
stopped: from the moment it exits, a traceback on another rank's stderr that
begins with a lost peer (``PeerLostError``, or ``AbortedError``: a peer gave up the
call) is replaced by one line, ``[rank R] PeerLostError in FILE:LINE (FUNCTION):
MESSAGE``, the message naming the lost rank; the failed rank's own traceback, which
it printed before it exited, and every other error pass unchanged. ``tracebacks``
(``--tracebacks``, or ``SWARMFD_TRACEBACK=1``) prints these tracebacks, and those of
an interruption, whole.

Elastic jobs (``--elastic``, :mod:`swarmfd.elastic`). A rank that a signal ended is
started again as a replacement (``SWARMFD_ELASTIC_JOIN=1``, the same ``RANK``) that
joins the running job, up to ``max_restarts`` times per rank (3 by default); the others
are not stopped. Each rank's elastic agent listens on a port of its own
(``SWARMFD_ELASTIC_PEERS``: every rank's, by starting rank), and ``SWARMFD_ELASTIC_DONE``
names a file the launcher writes once a rank exited 0 (the job finished: a replacement
still waiting then exits 0). The run exits 0 once every process ended, if the job
finished (:class:`_ElasticAttempt`). A replacement is not pinned (``bind_cores``): it
starts while the launcher's reader threads run, where a ``preexec_fn`` is not safe.

Interruption. SIGINT (Ctrl-C), SIGTERM or SIGHUP to the launcher is forwarded
to every rank; after ``grace`` seconds (or at a second signal) the ranks are
killed. The launcher then exits with 128+signal (130 for Ctrl-C). It never
restarts after an interruption. From the moment the signal arrives, a Python
traceback on a rank's stderr that ends in ``KeyboardInterrupt`` (what every
Python rank prints when Ctrl-C reaches it: some 20 lines each, interleaved) is
replaced by one line, ``[rank R] KeyboardInterrupt in FILE:LINE (FUNCTION)``,
naming the innermost frame outside swarmfd and installed packages; other output
(a script that catches the interrupt and saves, other errors) passes unchanged
(:class:`TracebackFilter`).
A last line sums up: ``stopped all N rank(s) after SIGINT (exit code 130)``.

Job secret. Every run draws a fresh secret (``secrets.token_hex(32)``) and
writes it to a file (mode 0600) in a private temporary directory (mode 0700);
the ranks get only its path, in ``SWARMFD_SECRET_FILE``, never the secret in
their environment or command line. Restarts reuse it. The directory is
removed when the run ends, however it ends (failure, Ctrl-C, or, through the
guardian, a SIGKILLed launcher).

No orphans. Each rank runs in its own session and process group, and the
launcher signals the whole group, so processes a rank started are stopped too,
even after a successful run. If the launcher itself is SIGKILLed, each rank
gets SIGKILL from the kernel (``PR_SET_PDEATHSIG``, Linux), and a small guardian
process, which notices the launcher's end when its pipe closes, stops whatever
is left in the ranks' process groups.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, MappingProxyType
from typing import IO, Any, ClassVar

from . import statusline
from .config import (
    ENV_ELASTIC,
    ENV_ELASTIC_DONE,
    ENV_ELASTIC_JOIN,
    ENV_ELASTIC_PEERS,
    ENV_ELASTIC_PORT,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_OMP_THREADS,
    ENV_PORT,
    ENV_RANK,
    ENV_RESTART_COUNT,
    ENV_SECRET_FILE,
    ENV_STATUS,
    ENV_WORLD_SIZE,
    check_int,
    check_seconds,
    usable_cores,
)
from .jobs import JobStatus, job_line
from .request import JobRequest, option

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_MASTER_ADDR",
    "ENV_BIND_CORES",
    "ENV_TRACEBACK",
    "RESERVED_ENV",
    "LaunchConfig",
    "TracebackFilter",
    "bind_cores_from_env",
    "core_sets",
    "exit_code_of",
    "find_free_port",
    "find_free_ports",
    "flag_from_env",
    "launch",
    "rank_threads",
    "resolve_command",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_GRACE = 3.0
#: ``SWARMFD_BIND_CORES=1`` in the launcher's environment: ``bind_cores`` by default
#: (``swarmfd run --bind-cores``; see the module docstring, "Cores").
ENV_BIND_CORES = "SWARMFD_BIND_CORES"

#: Variables the launcher sets for every rank; ``-e`` may not override them (the option
#: to use instead). ``--timeout`` and ``--init-timeout`` add theirs (swarmfd.request).
RESERVED_ENV: Mapping[str, str] = MappingProxyType({
    ENV_WORLD_SIZE: "-n",
    ENV_RANK: "-n (each rank gets its own)",
    ENV_LOCAL_RANK: "-n (each rank gets its own)",
    ENV_LOCAL_WORLD_SIZE: "-n",
    ENV_MASTER_ADDR: "--master-addr",
    ENV_MASTER_PORT: "--master-port",
    ENV_PORT: "--swarmfd-port",
    ENV_RESTART_COUNT: "--max-restarts (the launcher counts the restarts)",
    ENV_SECRET_FILE: "nothing: every run makes a fresh job secret",
    "SWARMFD_JOB_ID": "nothing: every attempt draws one (rank 0 refuses other launches)",
    ENV_ELASTIC: "--elastic",
    ENV_ELASTIC_JOIN: "nothing: the launcher starts replacements itself (--elastic)",
    ENV_ELASTIC_PEERS: "nothing: the launcher gives each rank's agent a port (--elastic)",
    ENV_ELASTIC_PORT: "nothing: the launcher gives each rank's agent a port (--elastic)",
    ENV_ELASTIC_DONE: "nothing: the launcher writes it (--elastic)",
})
#: ``SWARMFD_TRACEBACK=1`` in the launcher's environment: ``tracebacks`` by default
#: (``swarmfd run --tracebacks``; see the module docstring, "Failure").
ENV_TRACEBACK = "SWARMFD_TRACEBACK"

_MAX_LINE = 64 * 1024
#: SWARMFD_STATUS for the ranks (unless set): a status line a second (see swarmfd.jobs).
STATUS_INTERVAL = "1"
_POLL = 0.05
_READER_DRAIN = 1.0  # seconds to wait for a rank's output after its group is gone
_HANDLED_SIGNALS = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None
)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig(JobRequest):
    """What ``swarmfd run`` should start; validated on creation (``ValueError``/``TypeError``
    naming the option). The fields it shares with ``swarmfd deploy`` are
    :class:`swarmfd.request.JobRequest`'s.

    ``command`` is the argv of every rank; ``env`` adds variables to the launcher's
    environment (a mapping or ``-e`` items); ``master_port`` is MASTER_PORT
    (torch.distributed's) and ``swarmfd_port`` SWARMFD_PORT (swarmfd's rendezvous):
    ``None`` picks a free port per attempt, except that a ``swarmfd_port`` of ``None``
    beside a given ``master_port`` is ``master_port + 1``, as a rank would derive it (the
    two always differ); ``grace`` is how long ranks get between SIGTERM (or a forwarded
    Ctrl-C) and SIGKILL; ``timeout`` (seconds) becomes ``SWARMFD_TIMEOUT`` for the
    ranks, and ``init_timeout`` ``SWARMFD_INIT_TIMEOUT``; ``bind_cores`` runs each rank
    on its own share of the cores (:func:`core_sets`); ``tracebacks`` prints the
    tracebacks the launcher otherwise cuts to one line (module docstring, "Failure").
    ``bind_cores`` and ``tracebacks`` of None (the default) take ENV_BIND_CORES and
    ENV_TRACEBACK of the launcher's environment (1 or 0; unset is 0).
    """

    RESERVED_ENV: ClassVar[Mapping[str, str]] = RESERVED_ENV

    master_addr: str = option("--master-addr", default=DEFAULT_MASTER_ADDR, show_default=True,
                              metavar="HOST", help="Address of rank 0, set as MASTER_ADDR.")
    master_port: int | None = option(
        "--master-port", type=int, metavar="PORT",
        help="MASTER_PORT, torch.distributed's port.  [default: a free port, new per restart]")
    swarmfd_port: int | None = option(
        "--swarmfd-port", type=int, metavar="PORT",
        help="SWARMFD_PORT, swarmfd's rendezvous port.  [default: --master-port + 1 when that "
             "is given, else a second free port, new per restart]")
    grace: float = option(
        "--grace", type=float, default=DEFAULT_GRACE, show_default=True, metavar="SECONDS",
        help="Time between SIGTERM (or a forwarded Ctrl-C) and SIGKILL when stopping ranks.")
    bind_cores: bool | None = option(
        "--bind-cores/--no-bind-cores", default=None,
        help="Run each rank only on its own share of this host's cores, as Open MPI's "
             "--bind-to core (steadier small collectives; its threads, libzmq's I/O thread "
             "too, share them). Off by default: two jobs at once would pin to the same "
             "cores.  [default: on if SWARMFD_BIND_CORES=1]")
    tracebacks: bool | None = option(
        "--tracebacks/--no-tracebacks", default=None,
        help="Print the ranks' tracebacks in full. Without it, once a rank has failed (or "
             "after Ctrl-C) a traceback that only says a rank lost its peer (or was "
             "interrupted) is cut to one line naming where.  [default: on if "
             "SWARMFD_TRACEBACK=1]")

    def __post_init__(self) -> None:
        super().__post_init__()
        if (not isinstance(self.master_addr, str) or not self.master_addr.strip()
                or any(c.isspace() for c in self.master_addr)):
            raise ValueError(f"--master-addr must be a host name or IP address without "
                             f"spaces, got {self.master_addr!r}")
        self._check_ports()
        _check_seconds("--grace", self.grace, allow_zero=True)
        for name, env_name in (("bind_cores", ENV_BIND_CORES), ("tracebacks", ENV_TRACEBACK)):
            value = getattr(self, name)
            if value is None:
                self._set(name, flag_from_env(env_name))
            elif not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool (or None: from {env_name}), got "
                                f"{value!r}")

    def _check_ports(self) -> None:
        for name in ("master_port", "swarmfd_port"):
            port, option_name = getattr(self, name), self.option_name(name)
            if port is not None:
                _check_int(option_name, port, minimum=1, what="a TCP port")
                if port > 65535:
                    raise ValueError(f"{option_name} must be a TCP port 1..65535, got {port}")
        if self.swarmfd_port is None and self.master_port == 65535:
            raise ValueError(
                "--master-port 65535 leaves no port for swarmfd's rendezvous (SWARMFD_PORT, "
                "by default MASTER_PORT + 1): give a lower --master-port or a --swarmfd-port")
        if self.swarmfd_port is not None and self.swarmfd_port == self.master_port:
            raise ValueError(
                f"--swarmfd-port and --master-port are both {self.master_port}: MASTER_PORT "
                "is torch.distributed's, swarmfd's rendezvous needs a port of its own")


def _check_int(name: str, value: object, *, minimum: int, what: str) -> None:
    check_int(name, value, minimum=minimum, what=what, type_error=TypeError,
              value_error=ValueError)


def _check_seconds(name: str, value: object, *, allow_zero: bool) -> None:
    check_seconds(name, value, allow_zero=allow_zero, type_error=TypeError,
                  value_error=ValueError)


# --- small pure helpers -------------------------------------------------------


def exit_code_of(returncode: int) -> int:
    """Map a :class:`subprocess.Popen` return code to a shell exit code (signal S -> 128+S)."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name} (exit code {exit_code_of(returncode)})"


def resolve_command(command: Sequence[str], path: str | None = None) -> list[str]:
    """Turn the user's COMMAND into the argv to execute, checking that it can start.

    A first word ending in ``.py`` runs with ``sys.executable``. Raises
    :class:`FileNotFoundError` when the program or script does not exist (so the
    user gets one clear message instead of N failing ranks) and
    :class:`PermissionError` when it is not executable. ``path`` is the PATH
    to search (default: the launcher's).
    """
    argv = list(command)
    if not argv:
        raise ValueError("command is empty: expected the program (and its arguments) to run")
    first = argv[0]
    if first.endswith(".py"):
        if not os.path.isfile(first):
            raise FileNotFoundError(f"script not found: {first!r} (no such file)")
        return [sys.executable, *argv]
    if os.sep in first or (os.altsep and os.altsep in first):
        if not os.path.exists(first):
            raise FileNotFoundError(f"command not found: {first!r} (no such file)")
        if os.path.isdir(first) or not os.access(first, os.X_OK):
            raise PermissionError(f"command is not executable: {first!r}")
        return argv
    if shutil.which(first, path=path) is None:
        raise FileNotFoundError(f"command not found: {first!r} (not an executable on PATH)")
    return argv


def find_free_port(host: str = DEFAULT_MASTER_ADDR) -> int:
    """Return a TCP port that is free on ``host`` right now (bind port 0, read it, close).

    Another process may take the port before rank 0 binds it; that race is
    small, and a restart picks a new port anyway.
    """
    return find_free_ports(host, 1)[0]


def find_free_ports(host: str = DEFAULT_MASTER_ADDR, count: int = 2,
                    avoid: Iterable[int] = ()) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` right now, none of them in ``avoid``.

    Every socket stays bound until all are picked, so the kernel cannot hand out one
    port twice (MASTER_PORT and SWARMFD_PORT must differ); see :func:`find_free_port`
    for the race that remains.
    """
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"master_addr {host!r} does not resolve to an address: {exc}") from None
    family, socktype, proto, _, sockaddr = infos[0]
    avoided = set(avoid)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(family, socktype, proto))
            try:
                sock.bind(sockaddr)
            except OSError:
                # Not an address of this host (a launcher for a remote master, say):
                # any free local port is as good a guess as we can make.
                sock.bind(("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0))
            port = int(sock.getsockname()[1])
            if port not in avoided:
                ports.append(port)
        return ports


# --- output -------------------------------------------------------------------


class _Output:
    """Serializes whole lines from many reader threads onto two binary streams."""

    def __init__(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self._streams = {1: stdout, 2: stderr}
        self._broken: set[int] = set()
        self._lock = threading.Lock()

    def write(self, fd: int, data: bytes) -> None:
        with self._lock:
            if fd in self._broken:
                return  # e.g. `swarmfd run ... | head`: keep draining the ranks, drop output
            stream = self._streams[fd]
            try:
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):
                self._broken.add(fd)

    def note(self, message: str) -> None:
        """A launcher message on stderr: ``swarmfd run: <message>``."""
        self.write(2, f"swarmfd run: {message}\n".encode(errors="replace"))


_TRACEBACK = b"Traceback (most recent call last):"
_CHAIN = (b"During handling of the above exception, another exception occurred:",
          b"The above exception was the direct cause of the following exception:")
_FRAME = re.compile(rb'^\s*File "([^"]*)", line (\d+), in (.*?)\s*$')
#: Frames in these places are not where the user's program was interrupted.
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/",
                  os.sep + "swarmfd" + os.sep, "/lib/python3")


#: The first exception of a traceback that :class:`TracebackFilter` cuts to one line:
#: an interruption, or a peer that is gone (its own traceback says why).
_CONSEQUENCES = re.compile(rb"^(?:KeyboardInterrupt|(?:swarmfd\.errors\.)?(?:PeerLostError|"
                           rb"AbortedError))(?::|$)")
_MAX_SUMMARY = 600


class TracebackFilter:
    """Cuts a traceback whose first exception is an interruption or a lost peer
    (``KeyboardInterrupt``, swarmfd's ``PeerLostError`` or ``AbortedError``) to one line;
    the rest passes through.

    ``feed`` takes a rank's stderr lines (bytes, with or without the newline); ``flush``
    at its end. ``emit`` receives the lines to print, each one newline-terminated. A
    traceback is held until it is complete (its exception line, and any chained
    traceback after it); then one line replaces it (``NAME in FILE:LINE (FUNCTION):
    MESSAGE``, at the innermost frame outside swarmfd and installed packages, and ``;
    then LAST`` when a chained exception of another kind ended it), or it is emitted
    as it was. It runs only once a rank has failed or the launcher was interrupted:
    before that, such a traceback is the failure itself.
    """

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self._emit = emit
        self._held: list[bytes] = []
        self._state = "idle"  # idle | frames | after (the exception line seen) | chain

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def feed(self, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        text = line.rstrip(b"\r\n")
        if self._state == "idle":
            if text == _TRACEBACK:
                self._held, self._state = [line], "frames"
            else:
                self._emit(line)
            return
        if self._state == "after" and not (text == b"" or text in _CHAIN
                                            or text == _TRACEBACK):
            self._decide()
            self.feed(line)
            return
        self._held.append(line)
        if text == _TRACEBACK:
            self._state = "frames"
        elif text in _CHAIN:
            self._state = "chain"
        elif self._state == "frames" and text and not text[:1].isspace():
            self._state = "after"

    def flush(self) -> None:
        if self._held:
            if self._state in ("after", "chain"):
                self._decide()
            else:  # cut off mid-traceback: show what there is
                for line in self._held:
                    self._emit(line)
        self._held, self._state = [], "idle"

    def _decide(self) -> None:
        held, self._held, self._state = self._held, [], "idle"
        texts = [h.rstrip(b"\r\n") for h in held]
        exceptions = [i for i, t in enumerate(texts) if t and not t[:1].isspace()
                      and t != _TRACEBACK and t not in _CHAIN]
        if not exceptions or not _CONSEQUENCES.match(texts[exceptions[0]]):
            for line in held:
                self._emit(line)
            return
        first = texts[exceptions[0]]
        name, _, message = first.partition(b":")
        summary = name.rsplit(b".", 1)[-1]
        where = _where(texts[:exceptions[0]])
        if where is not None:
            summary += b" in " + where
        if message.strip():
            summary += b": " + message.strip()
        last = texts[exceptions[-1]]
        if last.partition(b":")[0] != name:
            summary += b"; then " + last[:300]
        self._emit(summary[:_MAX_SUMMARY] + b"\n")


def _where(texts: list[bytes]) -> bytes | None:
    """``FILE:LINE (FUNCTION)`` of the innermost frame of ``texts`` (a traceback's lines)
    outside swarmfd and installed packages (else the innermost), the file relative to
    the working directory when it is below it."""
    frames = [m for m in (_FRAME.match(t) for t in texts) if m]
    own = [m for m in frames if not any(part.encode() in m.group(1) for part in _LIBRARY_PARTS)]
    if not frames:
        return None
    where = (own or frames)[-1]
    path = where.group(1)
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(os.fsdecode(path))
        if not relative.startswith(".."):
            path = os.fsencode(relative)
    return b"%s:%s (%s)" % (path, where.group(2), where.group(3))


def _pump(pipe: IO[bytes], fd: int, prefix: bytes, output: _Output,
          collapse: Callable[[], bool] | None = None,
          status: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Copy one rank's pipe to the output line by line until EOF.

    Once ``collapse()`` is true (another rank failed, or the launcher was interrupted),
    the lines go through a :class:`TracebackFilter`. With ``status``, the rank's status
    lines (:mod:`swarmfd.statusline`) go there instead of the output; what the rank had
    written of a line before one is put back before the rest of that line.
    """

    def emit(line: bytes) -> None:
        if prefix:
            if not line.endswith(b"\n"):
                line += b"\n"
            line = prefix + line
        output.write(fd, line)

    cut = TracebackFilter(emit) if collapse is not None else None
    carry = b""
    try:
        with pipe:
            while True:
                line = pipe.readline(_MAX_LINE)
                if not line:
                    if carry:
                        emit(carry)
                    break
                if status is not None:
                    line, record = statusline.split(carry + line)
                    carry = b""
                    if record is not None:
                        if record:
                            status(record)
                        carry = line
                        continue
                if cut is not None and (cut.holding or collapse()):
                    cut.feed(line)
                else:
                    emit(line)
    except (OSError, ValueError):
        pass  # the pipe broke; nothing more to copy
    if cut is not None:
        cut.flush()


# --- process groups -----------------------------------------------------------


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # kill(0) also succeeds for zombies nobody has reaped yet (in a container
    # whose init does not reap); on Linux, look at the real states.
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _make_preexec(cpus: Sequence[int] | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGKILL the rank when the launcher dies,
    and running it on ``cpus`` (when given)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl: Any = None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.restype = ctypes.c_int
    except (OSError, AttributeError):
        if cpus is None:
            return None
    pr_set_pdeathsig = 1
    sigkill = int(signal.SIGKILL)
    launcher = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        if prctl is not None:
            prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)
            if os.getppid() != launcher:  # the launcher died before prctl took effect
                os.kill(os.getpid(), sigkill)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return preexec


_GUARDIAN_CODE = r"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
grace = float(sys.argv[1])
groups = set()
secret_dir = b""
for line in sys.stdin.buffer:
    op, _, arg = line.strip().partition(b" ")
    if op == b"add":
        groups.add(int(arg))
    elif op == b"del":
        groups.discard(int(arg))
    elif op == b"secret":
        secret_dir = arg

def alive(g):
    try:
        os.killpg(g, 0)
        return True
    except OSError:
        return False
for sig in (signal.SIGTERM, signal.SIGKILL):
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while any(alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
if secret_dir:
    for name in os.listdir(secret_dir) if os.path.isdir(secret_dir) else ():
        try:
            os.unlink(os.path.join(secret_dir, name))
        except OSError:
            pass
    try:
        os.rmdir(secret_dir)
    except OSError:
        pass
"""


class _Guardian:
    """A helper process that stops the ranks' process groups if the launcher dies.

    The launcher tells it each group (``add``) and each group it has cleaned up
    (``del``) over a pipe. When the pipe closes, because the launcher finished
    or was killed, the guardian stops the groups still on its list: SIGTERM,
    ``grace``, SIGKILL. It ignores SIGINT/SIGTERM/SIGHUP and runs in its own
    session, so a Ctrl-C or a group kill aimed at the launcher leaves it to
    do its job.
    """

    def __init__(self, grace: float) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARDIAN_CODE, repr(float(grace))],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            self._proc = None  # degrade to PDEATHSIG alone

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def add(self, pgid: int) -> None:
        self._send(f"add {pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"del {pgid}")

    def remove_at_exit(self, directory: str) -> None:
        """Have the guardian delete ``directory`` (the secret's) if the launcher cannot."""
        self._send(f"secret {directory}")

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class _Signals:
    """Records SIGINT/SIGTERM/SIGHUP sent to the launcher while installed (main thread only)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in _HANDLED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class _Outcome:
    code: int
    interrupted: bool = False


class _Attempt:
    """One start of the N ranks: spawn, copy output, supervise, stop."""

    def __init__(
        self,
        config: LaunchConfig,
        argv: list[str],
        env: dict[str, str],
        output: _Output,
        guardian: _Guardian,
        signals: _Signals,
        job: JobStatus | None = None,
    ) -> None:
        self.config = config
        #: Where the ranks' status lines go (swarmfd top reads them there).
        self.job = job
        self.argv = argv
        self.env = env
        self.output = output
        self.guardian = guardian
        self.signals = signals
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[list[threading.Thread]] = []
        self.waiters: list[threading.Thread] = []
        self.exits: list[tuple[int, int]] = []  # (rank, returncode) in the order they ended
        self.ended: list[subprocess.Popen[bytes]] = []  # the processes of exits, in order
        self.interrupted = threading.Event()  # set before a launcher signal is forwarded
        self.failed = threading.Event()  # set as soon as a rank exits non-zero
        self.stopped = False
        self.succeeded = False

    def run(self) -> _Outcome:
        try:
            self._spawn()
            self._start_readers()
            return self._supervise()
        finally:
            self._cleanup()

    def _spawn(self) -> None:
        n = self.config.nproc
        cores = None
        if self.config.bind_cores:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("bind_cores (--bind-cores) needs sched_setaffinity, which "
                                 "this system does not have (Linux has it)")
            cores = core_sets(n, sorted(os.sched_getaffinity(0)))
        for rank in range(n):
            preexec = _make_preexec(cores[rank] if cores is not None else None)
            env = dict(self.env)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            # Reader threads start only after every rank is spawned: preexec_fn
            # is only safe to run while this process has no other threads.
            proc = subprocess.Popen(
                self.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec,
            )
            self.procs.append(proc)
            self.guardian.add(proc.pid)

    def _start_readers(self) -> None:
        for rank, proc in enumerate(self.procs):
            self._watch(rank, proc)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Copy ``proc``'s output (rank ``rank``'s) and reap it, on threads of their own."""
        prefix = f"[rank {rank}] ".encode() if self.config.prefix else b""
        threads = []
        collapse = None if self.config.tracebacks else self._collapsing
        for fd, pipe in ((1, proc.stdout), (2, proc.stderr)):
            assert pipe is not None
            status = self.job.add if fd == 2 and self.job is not None else None
            t = threading.Thread(
                target=_pump,
                args=(pipe, fd, prefix, self.output, collapse if fd == 2 else None, status),
                name=f"swarmfd-run-rank{rank}-fd{fd}",
                daemon=True,
            )
            t.start()
            threads.append(t)
        while len(self.readers) <= rank:
            self.readers.append([])
        self.readers[rank].extend(threads)
        waiter = threading.Thread(
            target=self._wait_for,
            args=(rank, proc),
            name=f"swarmfd-run-rank{rank}-wait",
            daemon=True,
        )
        waiter.start()
        self.waiters.append(waiter)

    def _collapsing(self) -> bool:
        """Whether the ranks' tracebacks of lost peers and interruptions are cut now."""
        return self.failed.is_set() or self.interrupted.is_set()

    def _wait_for(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Reap one rank and record when it ended relative to the others."""
        rc = proc.wait()
        if rc != 0:
            self.failed.set()  # before its peers can find it gone (LOST_PEER_GRACE)
        self.exits.append((rank, rc))  # list.append is atomic; the order is the exit order
        self.ended.append(proc)

    def _supervise(self) -> _Outcome:
        n = self.config.nproc
        while True:
            if self.signals.received:
                sig = self.signals.received[0]
                name = signal.Signals(sig).name
                self.output.note(f"received {name}; stopping all {n} rank(s)")
                self.interrupted.set()
                self._stop(sig)
                self._drain_all()
                self.output.note(f"stopped all {n} rank(s) after {name} (exit code {128 + sig})")
                return _Outcome(128 + sig, interrupted=True)
            exits = list(self.exits)
            failed = next(((r, rc) for r, rc in exits if rc != 0), None)
            if failed is not None:
                rank, rc = failed
                self._drain(rank)  # its last words (a traceback) before our message
                others = "; stopping the other ranks" if n > 1 else ""
                self.output.note(f"rank {rank} {_describe_exit(rc)}{others}")
                self._stop(signal.SIGTERM)
                return _Outcome(exit_code_of(rc))
            if len(exits) == n:
                self.succeeded = True
                return _Outcome(0)
            time.sleep(_POLL)

    def _drain_all(self) -> None:
        """Wait (bounded) for every rank's last output, so the summary comes last."""
        deadline = time.monotonic() + _READER_DRAIN
        for threads in self.readers:
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))

    def _drain(self, rank: int) -> None:
        deadline = time.monotonic() + 0.5
        for t in self.readers[rank] if rank < len(self.readers) else ():
            t.join(max(0.0, deadline - time.monotonic()))

    def _alive(self) -> bool:
        return any(p.poll() is None for p in self.procs) or any(
            _group_alive(p.pid) for p in self.procs
        )

    def _slot(self, proc: subprocess.Popen[bytes]) -> int:
        """The rank ``proc`` was started as (a replacement: the rank it replaced)."""
        env_rank = getattr(proc, "swarmfd_rank", None)
        return env_rank if env_rank is not None else self.procs.index(proc)

    def _stop(self, sig: int) -> None:
        """Signal every rank's group, wait ``grace`` (cut short by a new signal), then SIGKILL."""
        self.stopped = True
        seen = len(self.signals.received)
        for proc in self.procs:
            _killpg(proc.pid, sig)
        if self._wait_gone(self.config.grace, lambda: len(self.signals.received) > seen):
            return
        for proc in self.procs:
            _killpg(proc.pid, signal.SIGKILL)
        # SIGKILL cannot be caught, but a process in uninterruptible sleep may take a
        # moment to die; give up after a while rather than hang the launcher.
        self._wait_gone(5.0, lambda: False)

    def _wait_gone(self, timeout: float, cut_short: Callable[[], bool]) -> bool:
        """Poll until every rank and its group are gone (True) or the time is up (False)."""
        deadline = time.monotonic() + timeout
        while self._alive():
            if time.monotonic() >= deadline or cut_short():
                return False
            time.sleep(_POLL)
        return True

    def _cleanup(self) -> None:
        # Ranks that exited 0 may have left processes in their groups: stop them
        # too. Also covers an exception in this module after a partial spawn.
        if self._alive():
            leftovers = sorted({self._slot(p) for p in self.procs if _group_alive(p.pid)})
            if leftovers and self.succeeded:
                self.output.note(
                    f"stopping processes left running by rank(s) {', '.join(map(str, leftovers))}"
                )
            self._stop(signal.SIGTERM)
        for proc in self.procs:
            if proc.poll() is None:  # only after a failed _stop (a process stuck in the kernel)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
        deadline = time.monotonic() + _READER_DRAIN
        for t in [*self.waiters, *(t for threads in self.readers for t in threads)]:
            t.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if not _group_alive(proc.pid):  # else the guardian keeps trying after we exit
                self.guardian.forget(proc.pid)


class _ElasticAttempt(_Attempt):
    """The N ranks of an elastic job (``--elastic``, see swarmfd.elastic): a rank that
    dies is started again as a replacement that joins the running job, up to
    ``max_restarts`` times per rank; the others are never stopped for it.

    A rank is replaced when a signal ended it (SIGKILL, a crash), the job has not
    finished, and some other rank still runs (a replacement needs members to join):
    a rank whose program exited with a code of its own ended the job on purpose (an
    exception: its peers raise too), and is not. The first rank to exit 0 means the
    elastic function returned on every member: the job has finished, nothing is
    replaced any more, and ``SWARMFD_ELASTIC_DONE`` is written, so that a replacement
    still waiting exits 0. The run exits 0 once every process has ended, if the job
    finished; else with the code of the last rank that failed (the one that ended the
    job: the ranks lost before did not).
    """

    def __init__(self, *args: Any, done_file: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.done_file = done_file
        self.current: dict[int, subprocess.Popen[bytes]] = {}

    def _spawn(self) -> None:
        super()._spawn()
        self.current = dict(enumerate(self.procs))

    def _replace(self, rank: int, restart: int) -> None:
        """Start a replacement of ``rank`` (no preexec_fn: the reader threads run; the
        guardian stops it should the launcher be killed)."""
        env = dict(self.env)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), SWARMFD_ELASTIC_JOIN="1",
                   SWARMFD_RESTART_COUNT=str(restart))
        proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        proc.swarmfd_rank = rank  # type: ignore[attr-defined]
        self.procs.append(proc)
        self.guardian.add(proc.pid)
        self.current[rank] = proc
        self._watch(rank, proc)

    def _supervise(self) -> _Outcome:
        restarts = [0] * self.config.nproc
        handled, last_failure, finished = 0, None, False
        while True:
            if self.signals.received:
                return super()._supervise()  # an interruption: as without --elastic
            while handled < len(self.ended):
                (rank, rc), proc = self.exits[handled], self.ended[handled]
                handled += 1
                if rc == 0:
                    if not finished:
                        finished = True
                        with open(self.done_file, "w"):
                            pass
                    continue
                others = any(p.poll() is None for r, p in self.current.items() if p is not proc)
                if rc < 0 and not finished and others and \
                        restarts[rank] < self.config.max_restarts:
                    restarts[rank] += 1
                    self._drain(rank)
                    self.output.note(f"rank {rank} {_describe_exit(rc)}; starting a replacement "
                                     f"that joins the job (restart {restarts[rank]} of "
                                     f"{self.config.max_restarts} of this rank)")
                    self._replace(rank, restarts[rank])
                    continue
                last_failure = rc
                self._drain(rank)
                self.output.note(f"rank {rank} {_describe_exit(rc)}" + (
                    "; the others go on without it" if others and not finished else ""))
            if handled == len(self.ended) and all(p.poll() is not None
                                                  for p in self.current.values()):
                self.succeeded = finished
                return _Outcome(0 if finished or last_failure is None
                                else exit_code_of(last_failure))
            time.sleep(_POLL)


def _ports(config: LaunchConfig) -> tuple[int, int]:
    """This attempt's (MASTER_PORT, SWARMFD_PORT): as given, derived, or fresh free ports."""
    master, own = config.master_port, config.swarmfd_port
    if master is not None:
        return master, own if own is not None else master + 1
    if own is not None:
        return find_free_ports(config.master_addr, 1, avoid=(own,))[0], own
    master, own = find_free_ports(config.master_addr, 2)
    return master, own


def flag_from_env(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off default from variable ``name`` of ``environ`` (default: this process's
    environment): 1 or 0; empty or unset is 0."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 (on) or 0 (off)")
    return value == "1"


def bind_cores_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``bind_cores``'s default: ENV_BIND_CORES (``SWARMFD_BIND_CORES``), 1 or 0."""
    return flag_from_env(ENV_BIND_CORES, environ)


def core_sets(nproc: int, cores: Sequence[int]) -> list[list[int]]:
    """The cores each of ``nproc`` ranks runs on under ``bind_cores``: ``cores`` (the
    launcher's usable CPUs, in order) cut into runs of len(cores) // nproc, rank r on
    the r-th (the cores left over stay unused: :func:`rank_threads` gives each rank that
    many threads). Ranks that outnumber the cores take one each in turn (rank r on
    cores[r % len(cores)])."""
    if nproc < 1 or not cores:
        raise ValueError(f"core_sets needs ranks and cores, got nproc={nproc}, "
                         f"cores={list(cores)}")
    per = len(cores) // nproc
    if per == 0:
        return [[cores[r % len(cores)]] for r in range(nproc)]
    return [list(cores[r * per:(r + 1) * per]) for r in range(nproc)]


def rank_threads(nproc: int, cores: int | None = None) -> int:
    """The OMP_NUM_THREADS that ``swarmfd run`` gives each of ``nproc`` ranks on this
    host when the user gives none: ``cores`` (default: the CPUs this process may run
    on, its affinity mask, which a container's cpuset narrows) divided among the
    ranks, at least 1 (see the module docstring, "Threads")."""
    if cores is None:
        cores = usable_cores()
    return max(1, cores // max(1, nproc))


def _rank_env(config: LaunchConfig, port: int, swarmfd_port: int, restart: int,
              secret_file: str, agents: Sequence[int] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(config.env)
    if config.nproc > 1 and ENV_OMP_THREADS not in env:
        env[ENV_OMP_THREADS] = str(rank_threads(config.nproc))
    env.update(
        WORLD_SIZE=str(config.nproc),
        LOCAL_WORLD_SIZE=str(config.nproc),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(port),
        SWARMFD_PORT=str(swarmfd_port),
        SWARMFD_RESTART_COUNT=str(restart),
        SWARMFD_SECRET_FILE=secret_file,
        SWARMFD_JOB_ID=secrets.token_hex(6),  # this attempt's ranks only (rendezvous)
    )
    env.update(config.rank_env())
    if config.elastic:
        env.update({ENV_ELASTIC: "1", ENV_ELASTIC_DONE: _done_file(secret_file),
                    ENV_ELASTIC_PEERS: ",".join(f"{config.master_addr}:{p}" for p in agents)})
    env.setdefault(ENV_STATUS, STATUS_INTERVAL)
    return env


def _done_file(secret_file: str) -> str:
    """Where an elastic run notes that its job finished (beside the secret, as private)."""
    return os.path.join(os.path.dirname(secret_file), "finished")


def _write_secret() -> tuple[str, str]:
    """A fresh job secret in a new private directory: (directory, file path)."""
    directory = tempfile.mkdtemp(prefix="swarmfd-secret-")  # mode 0700
    path = os.path.join(directory, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)
    return directory, path


def launch(
    config: LaunchConfig,
    *,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> int:
    """Run ``config.command`` as ``config.nproc`` ranks until they finish; return the exit code.

    0 when every rank exits 0; else the first failing rank's code (128+S for a
    rank killed by signal S), from the last attempt under ``max_restarts``;
    128+S when the launcher got signal S (130 for Ctrl-C). Rank output goes to
    ``stdout``/``stderr`` (binary streams; default: this process's). Raises
    :class:`FileNotFoundError`/:class:`PermissionError` when the command cannot
    be started, before any rank starts. Signal handlers for SIGINT, SIGTERM and
    SIGHUP are installed for the duration when called from the main thread.
    Call it from a thread that outlives the run (the main thread, ideally):
    PR_SET_PDEATHSIG fires when the thread that started the ranks ends.
    """
    argv = resolve_command(config.command, path=os.environ.get("PATH"))
    for stream in (sys.stdout, sys.stderr):  # keep earlier text output in order
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    output = _Output(
        stdout if stdout is not None else sys.stdout.buffer,
        stderr if stderr is not None else sys.stderr.buffer,
    )
    guardian = _Guardian(config.grace)
    secret_dir = ""
    job = JobStatus(config.nproc, argv)
    started = time.monotonic()
    try:
        secret_dir, secret_file = _write_secret()
        guardian.remove_at_exit(secret_dir)
        with _Signals() as signals:
            restart = 0
            while True:
                if signals.received:  # arrived between two attempts: do not start another
                    return 128 + signals.received[0]
                port, swarmfd_port = _ports(config)
                if config.elastic:  # one attempt: the ranks that die are replaced one by one
                    agents = find_free_ports(config.master_addr, config.nproc,
                                             avoid=(port, swarmfd_port))
                    env = _rank_env(config, port, swarmfd_port, 0, secret_file, agents)
                    outcome = _ElasticAttempt(config, argv, env, output, guardian, signals,
                                              job, done_file=_done_file(secret_file)).run()
                    _end_line(output, job, started)
                    return outcome.code
                env = _rank_env(config, port, swarmfd_port, restart, secret_file)
                job.ranks.clear()
                outcome = _Attempt(config, argv, env, output, guardian, signals, job).run()
                if outcome.code == 0 or outcome.interrupted:
                    _end_line(output, job, started)
                    return outcome.code
                if restart >= config.max_restarts:
                    _end_line(output, job, started)
                    if config.max_restarts:
                        output.note(
                            f"no restarts left (max_restarts={config.max_restarts}); "
                            f"exiting with code {outcome.code}"
                        )
                    return outcome.code
                restart += 1
                output.note(
                    f"restart {restart} of {config.max_restarts}: starting {config.nproc} "
                    "rank(s) again"
                )
    finally:
        job.close()
        if secret_dir:
            shutil.rmtree(secret_dir, ignore_errors=True)
        guardian.close()


def _end_line(output: _Output, job: JobStatus, started: float) -> None:
    """The job's one-line status at its end (from the ranks' last status lines)."""
    line = job_line(job.ranks, job.world, time.monotonic() - started)
    if line:
        output.note(line)
