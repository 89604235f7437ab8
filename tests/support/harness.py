"""The rank harness: real ranks (processes) on loopback, watched and always reaped.

One harness, two call styles:

* :func:`run_ranks` / :func:`run_ranks_raw`: ``fn(rank, world_size, *args)`` on every
  rank, after ``fd.init``; the results in rank order (``run_ranks``, which raises
  :class:`RankFailure` with every failing rank's traceback) or ``{rank: (ok, result or
  traceback)}`` of the ranks that reported (``run_ranks_raw``). The transport comes
  from ``env`` (:func:`transport_env`), else from the test's environment.
* :class:`Ranks`, a context manager for the tests that signal, watch and time ranks:
  ``fn(ctx, *args)``, where ``ctx`` (:class:`RankCtx`) knows its rank, can
  ``report(kind, value)`` events the test waits for (:meth:`Ranks.wait`), and shares
  with the test process

  * ``ctx.go``: a flag the test raises (:meth:`Ranks.release`), awaited with
    :meth:`RankCtx.wait_go` (polled, not an Event: setting an Event waits for every
    sleeper to wake, and a stopped rank never does);
  * ``ctx.mark``: a shared double, the ``time.monotonic()`` of a kill or stop.
    ``CLOCK_MONOTONIC`` is system-wide on Linux, so times taken in different processes
    compare directly.

  ``transport`` ("tcp", "zmq" or "shm") selects ``SWARMFD_TRANSPORT`` (tcp / tcp / auto)
  and ``SWARMFD_DATA_PLANE`` ("zmq": the ZeroMQ data plane; otherwise the default, the
  socket plane), and every :meth:`RankCtx.init` checks the group really uses them.

Whatever the style, every rank imports swarmfd and then waits for the others
(:func:`start_line`) before ``init`` or ``fn``: a short group timeout then measures the
group, not start-up skew. A rank that does not answer in time fails the test with the
stacks of each of its threads (faulthandler, on SIGUSR1: :func:`arm_stack_dump`). Every
child is reaped whatever happens (SIGCONT, then SIGKILL of whatever is left), so no
test can hang or leak; :meth:`Ranks.close` asserts none survives.

Logic that does not need processes runs on thread-ranks instead: tests/support/memplane.py
(the algorithms, the message layer) and tests/support/threadranks.py (the public API over the
real planes).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import random
import secrets
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "RankCtx",
    "RankFailure",
    "RankResults",
    "Ranks",
    "StallMeter",
    "allowed",
    "arm_stack_dump",
    "collect_stacks",
    "count_runs",
    "error_info",
    "free_port",
    "record",
    "require",
    "require_installed",
    "run_ranks",
    "run_ranks_raw",
    "stall_meter",
    "start_line",
    "transport_env",
    "write_secret_file",
]

#: Ranks are forked from a fork server (a clean process started once per session, not
#: the test process: no threads, no sockets) that has imported what every rank imports.
#: A spawned rank imported numpy, zmq, pytest and swarmfd itself, 0.5-0.7 s of CPU each;
#: on this 2-core machine, with other tests running, 3 spawned ranks took 4.1-6.8 s to
#: report for duty and 3 forked from the server 0.14-0.44 s (interleaved, 4 runs each).
#: What a spawned rank got from the test process at its start, a forked one gets from
#: the harness: the environment (every rank's os.environ is the test's at the time the
#: ranks were made, plus ``env``) and the test's stdout and stderr (see _child).
#: torch is preloaded too where it is installed (the server skips a module it cannot
#: import): a torch rank imported it itself, about 3 s of CPU each, for 16 ranks of
#: tests/test_torch_ranks.py; the server pays it once. So does torch._dynamo, which a
#: process's first torch optimizer imports (about 4 CPU-seconds a rank otherwise).
#: Importing them starts no thread beyond numpy's OpenBLAS one (2 tasks in
#: /proc/self/task with numpy alone or with torch too) and runs no op, so forking after
#: it is safe (as DataLoader workers do).
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["numpy", "zmq", "psutil", "pytest", "hypothesis", "swarmfd",
                             "swarmfd.comm.transport", "swarmfd.comm.shm_setup",
                             "swarmfd.engine", "tests.support.harness", "torch", "torch._dynamo"])
_STACK_FILES: list[Any] = []  # in a rank: the open file faulthandler writes to

#: How long a spawned rank waits at the start line for the others to have started.
START_LINE_TIMEOUT = 120.0


# -- in a rank -----------------------------------------------------------------------------


def arm_stack_dump(directory: str, rank: int) -> None:
    """In a rank: on SIGUSR1, write every thread's stack to ``directory``/stack-RANK.txt.

    A rank that hangs says where; :func:`collect_stacks` asks for the dumps.
    """
    f = open(os.path.join(directory, f"stack-{rank}.txt"), "w")  # noqa: SIM115 (kept open)
    _STACK_FILES.append(f)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


def start_line(barrier: Any) -> None:
    """In a rank, once swarmfd is imported: wait until every rank of the run got here.

    Ranks start (spawn, import numpy, zmq, swarmfd) at different speeds; on a loaded
    2-core machine measured up to 0.6 s apart for 3 ranks. ``init`` blocks at most the
    group timeout, which a test of collective timeouts sets to a few seconds (1 s in
    one): without a common start, the start-up skew ate into, or beyond, that window.
    """
    barrier.wait(START_LINE_TIMEOUT)


# -- in the test process ----------------------------------------------------------------------


def collect_stacks(directory: str, procs: list[Any]) -> str:
    """The thread stacks of every live rank in ``procs`` (None: skip), as text.

    The ranks must have called :func:`arm_stack_dump` with the same ``directory``.
    """
    asked = []
    for rank, p in enumerate(procs):
        if p is not None and p.pid is not None and p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(0.5)  # faulthandler writes from the signal handler, at once
    parts = []
    for rank in asked:
        path = os.path.join(directory, f"stack-{rank}.txt")
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        parts.append(f"--- rank {rank} stack (pid {procs[rank].pid}) ---\n"
                     f"{text or '(no dump: the process did not answer SIGUSR1)'}")
    return "\n".join(parts)


def write_secret_file(directory: str, name: str = "secret", value: str | None = None) -> str:
    """Write a job secret (a fresh one unless ``value``) to ``directory/name``, mode 0600."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((value if value is not None else secrets.token_hex(32)) + "\n")
    return path


def transport_env(transport: str) -> dict[str, str]:
    """Environment selecting a transport by test name: "auto"/"shm" (shared memory on one
    host), "tcp" (TCP, the default socket data plane) or "zmq" (TCP, ZeroMQ data plane)."""
    return {"auto": {"SWARMFD_TRANSPORT": "auto"}, "shm": {"SWARMFD_TRANSPORT": "auto"},
            "tcp": {"SWARMFD_TRANSPORT": "tcp"},
            "zmq": {"SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": "zmq"}}[transport]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, never handed out before here.

    It lies below the kernel's ephemeral range, as a rendezvous port should: ports the
    kernel hands out meanwhile (every connection's local end, every listener on port
    0, such as the socket plane's) can then not take it before it is used.
    """
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low}..{high - 1} on 127.0.0.1")


# -- the ranks ------------------------------------------------------------------------------


#: What each test transport name sets in a rank's environment (see :class:`Ranks`).
_TRANSPORT_MODES = {"tcp": "tcp", "zmq": "tcp", "shm": "auto"}


class RankCtx:
    """What a rank's function gets: its rank, the world size and the shared channels."""

    def __init__(self, rank: int, world: int, port: int, events: Any, go: Any, mark: Any,
                 group_timeout: float, transport: str | None,
                 init_timeout: float | None = None) -> None:
        self.rank = rank
        self.transport = transport
        self.world = world
        self.port = port
        self.events = events
        self.go = go
        self.mark = mark
        self.group_timeout = group_timeout
        self.init_timeout = init_timeout

    def wait_go(self, timeout: float) -> bool:
        """Wait until the test calls :meth:`Ranks.release`; False on timeout."""
        deadline = time.monotonic() + timeout
        while not self.go.value:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def report(self, kind: str, value: Any = None) -> None:
        """Send one event (picklable value) to the test process."""
        self.events.put((self.rank, kind, value))

    def init(self, port: int | None = None, timeout: float | None = None,
             init_timeout: float | None = None) -> None:
        """Join the group, rank 0 serving the rendezvous on ``port`` (default the
        harness's, :attr:`Ranks.port`: the port the tests attack and probe)."""
        import swarmfd as fd

        wanted = port or self.port
        config = fd.init(self.world, self.rank, master_addr="127.0.0.1", master_port=wanted,
                         timeout=self.group_timeout if timeout is None else timeout,
                         init_timeout=self.init_timeout if init_timeout is None else init_timeout)
        if config.rendezvous_port != wanted:  # (what the tests aim at must be what binds)
            raise AssertionError(f"rank {self.rank}: the rendezvous used port "
                                 f"{config.rendezvous_port}, not the harness's {wanted}")
        if self.transport is None:
            return  # whatever the environment chose (run_ranks)
        from swarmfd import group

        state = group.current()
        on_shm = state.world is not None and getattr(state.world.plane(), "name", "") == "shm"
        if on_shm != (self.transport == "shm"):
            raise AssertionError(f"rank {self.rank} wanted the {self.transport} transport but "
                                 f"the group {'is' if on_shm else 'is not'} on shared memory")
        plane = getattr(state.transport, "plane", None)
        if self.transport == "zmq" and plane != "zmq":
            raise AssertionError(f"rank {self.rank} wanted the {self.transport} transport but "
                                 f"its data plane is {plane}")


def _adopt(test_pid: int, env: dict[str, str]) -> None:
    """In a rank forked from the fork server: take the test's environment, and write to
    the test's stdout and stderr (pytest's capture files, or the terminal), as a rank
    spawned by the test process did."""
    os.environ.clear()
    os.environ.update(env)
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{test_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # a socket, or nothing: keep the server's
        os.dup2(target, fd)
        os.close(target)


def _die_with(test_pid: int) -> None:
    """In a rank: end this process at once when the test process is gone.

    A rank's parent is the fork server, not the test; when a test process died (a pytest
    worker killed by an abort in the test's own code, 2026-12-04), its ranks lived on:
    three ranks of a fuzzed job went on all-reducing with each other, waiting for a
    ``go`` nobody would set, and took a core from the rest of the CI run for 12 minutes.
    A thread waits on the test process's pidfd (it becomes readable when that process
    exits) and then ends this one, as a reaped rank would have ended."""
    def alive() -> bool:
        try:
            os.kill(test_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    try:
        pidfd = os.pidfd_open(test_pid)
    except (AttributeError, OSError):  # no pidfd here, or the test is already gone
        if not alive():
            os._exit(70)
        pidfd = -1

    def watch() -> None:
        if pidfd >= 0:
            select.select([pidfd], [], [])
        else:
            while alive():
                time.sleep(1.0)
        os._exit(70)

    threading.Thread(target=watch, name="swarmfd-test-parent-watch", daemon=True).start()


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           init: bool, group_timeout: float, transport: str | None, env: dict[str, str],
           plain: bool, test_pid: int, events: Any, go: Any, mark: Any, stack_dir: str,
           start: Any, init_timeout: float | None = None) -> None:
    _die_with(test_pid)
    _adopt(test_pid, env)
    arm_stack_dump(stack_dir, rank)
    if transport is not None:
        os.environ["SWARMFD_TRANSPORT"] = _TRANSPORT_MODES[transport]
        if transport == "zmq":
            os.environ["SWARMFD_DATA_PLANE"] = "zmq"
    ctx = RankCtx(rank, world, port, events, go, mark, group_timeout, transport, init_timeout)
    try:
        import swarmfd  # noqa: F401  (imported before the start line: see start_line)

        start_line(start)
        if init:
            ctx.init()
        value = fn(rank, world, *args) if plain else fn(ctx, *args)
        events.put((rank, "result", (True, value)))
    except BaseException:
        events.put((rank, "result", (False, traceback.format_exc())))
    finally:
        try:
            import swarmfd as fd

            fd.cleanup()
        except Exception:
            pass


class RankResults(dict[int, tuple[bool, Any]]):
    """{rank: (ok, result or traceback)}; ``stacks``: the dumps of ranks that hung."""

    stacks: str = ""


class Ranks:
    """N spawned ranks running ``fn(ctx, *args)`` (``plain``: ``fn(rank, world, *args)``);
    see the module docstring. ``transport=None`` leaves the transport to ``env`` and the
    test's environment; ``env`` is added to each rank's environment (the test's).
    ``group_timeout`` is each rank's ``timeout``, and its init's unless ``init_timeout``
    is given."""

    def __init__(self, fn: Callable[..., Any], world: int, *args: Any,
                 group_timeout: float = 60.0, init: bool = True,
                 transport: str | None = "tcp", env: dict[str, str] | None = None,
                 plain: bool = False, init_timeout: float | None = None) -> None:
        assert transport is None or transport in _TRANSPORT_MODES, transport
        self.world = world
        self.port = free_port()
        # One queue per rank: a queue's write lock is shared by its writers, and a rank
        # stopped (SIGSTOP) while its feeder thread holds it would block the others' reports.
        self.queues = [_CTX.Queue() for _ in range(world)]
        self.go = _CTX.Value("b", 0, lock=False)
        self.mark = _CTX.Value("d", 0.0, lock=False)
        self.stack_dir = tempfile.mkdtemp(prefix="swarmfd-stacks-")
        # Held here: Process.start() drops its args, and a barrier collected before the
        # children unpickled it takes its named semaphores with it.
        self.start_barrier = _CTX.Barrier(world)
        self.procs = [
            _CTX.Process(target=_child, daemon=True, args=(
                fn, r, world, self.port, args, init, group_timeout, transport,
                {**os.environ, **(env or {})}, plain, os.getpid(), self.queues[r], self.go,
                self.mark, self.stack_dir, self.start_barrier, init_timeout))
            for r in range(world)
        ]
        self._seen: list[tuple[int, str, Any]] = []
        self.closed = False

    def __enter__(self) -> Ranks:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs if p.pid is not None]

    def signal(self, rank: int, sig: int) -> float:
        """Send ``sig`` to ``rank``; returns the monotonic time just before sending."""
        now = time.monotonic()
        pid = self.procs[rank].pid
        assert pid is not None
        os.kill(pid, sig)
        return now

    def release(self) -> None:
        """Raise the ``go`` flag the ranks wait for with :meth:`RankCtx.wait_go`."""
        self.go.value = 1

    def kill(self, rank: int) -> float:
        """SIGKILL ``rank`` and record the time in ``mark``; returns that time."""
        now = time.monotonic()
        self.mark.value = now
        self.signal(rank, signal.SIGKILL)
        return now

    def _take(self, pred: Callable[[tuple[int, str, Any]], bool]) -> tuple[int, str, Any] | None:
        for i, ev in enumerate(self._seen):
            if pred(ev):
                return self._seen.pop(i)
        return None

    def _poll(self) -> bool:
        """Move every event already queued by any rank to ``_seen``; True if there was one."""
        found = False
        for q in self.queues:
            while True:
                try:
                    self._seen.append(q.get_nowait())
                except queue.Empty:
                    break
                found = True
        return found

    def wait(self, kind: str, ranks: Iterable[int] | None = None,
             timeout: float = 30.0) -> dict[int, Any]:
        """Wait until each of ``ranks`` (default all) reported ``kind``; {rank: value}.

        A rank that reports its final result instead fails the wait with its
        traceback (it will never send ``kind``).
        """
        want = set(range(self.world) if ranks is None else ranks)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while want - set(got):
            ev = self._take(lambda e: e[1] == kind and e[0] in want)
            if ev is not None:
                got[ev[0]] = ev[2]
                continue
            failed = next((e for e in self._seen if e[1] == "result" and e[0] in want
                           and e[0] not in got), None)
            if failed is not None:
                raise AssertionError(
                    f"rank {failed[0]} ended before reporting {kind!r}: {failed[2]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {kind!r} from rank(s) "
                    f"{sorted(want - set(got))}; other events: {self._seen}\n"
                    + collect_stacks(self.stack_dir, self.procs))
            if self._poll():
                continue
            time.sleep(0.005)
            dead = [r for r in want - set(got) if not self.procs[r].is_alive()]
            if dead and not self._poll():
                # One more look: the queue may have been fed just before the exit.
                time.sleep(0.2)
                if not self._poll():
                    raise AssertionError(
                        f"rank(s) {dead} exited (codes "
                        f"{[self.procs[r].exitcode for r in dead]}) before reporting {kind!r}")
        return got

    def results(self, ranks: Iterable[int] | None = None,
                timeout: float = 30.0) -> dict[int, Any]:
        """The return values of ``ranks``; raises with the traceback of any that failed."""
        out = self.wait("result", ranks, timeout)
        failures = {r: v[1] for r, v in out.items() if not v[0]}
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{len(failures)} rank(s) failed:\n{text}")
        return {r: v[1] for r, v in out.items()}

    def outcomes(self, timeout: float) -> RankResults:
        """Every rank's (ok, result or traceback), as they come, for up to ``timeout`` s.

        Never raises: a rank that exited without a word, or did not report in time, is
        missing from the result; ``.stacks`` has the stacks of those still alive, taken
        before they are killed.
        """
        out = RankResults()
        deadline = time.monotonic() + timeout
        while len(out) < self.world and time.monotonic() < deadline:
            self._poll()
            while (ev := self._take(lambda e: e[1] == "result")) is not None:
                out[ev[0]] = ev[2]
            if len(out) == self.world:
                break
            if all(not p.is_alive() for p in self.procs):
                time.sleep(0.05)  # a queue fed just before the exit
                if not self._poll():
                    break
                continue
            time.sleep(0.02)
        if len(out) < self.world:
            out.stacks = collect_stacks(self.stack_dir, [p if r not in out else None
                                                         for r, p in enumerate(self.procs)])
        return out

    def close(self, grace: float = 0.5) -> None:
        """Reap every child: each may take ``grace`` s to exit on its own (its cleanup),
        then SIGCONT and SIGKILL whatever is left; assert none survives."""
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=grace)
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(timeout=10)
        alive = [p.pid for p in self.procs if p.is_alive()]
        for q in self.queues:
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self.stack_dir, ignore_errors=True)
        assert not alive, f"processes {alive} survived SIGKILL"


# -- the run_ranks style ----------------------------------------------------------------------


class RankFailure(AssertionError):
    """One or more ranks raised; carries each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


def run_ranks_raw(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    group_timeout: float = 30.0,
    init: bool = True,
    env: dict[str, str] | None = None,
) -> RankResults:
    """Run ``fn(rank, world_size, *args)`` on every rank (after ``fd.init`` unless
    ``init=False``); {rank: (ok, result or traceback)} of the ranks that reported.

    A rank that did not report within ``timeout`` is missing from the result, and
    ``.stacks`` has its threads' stacks, taken just before it was killed.
    """
    deadline = time.monotonic() + timeout
    ranks = Ranks(fn, world_size, *args, group_timeout=group_timeout, init=init,
                  transport=None, env=env, plain=True)
    with ranks:
        out = ranks.outcomes(timeout)
        # The ranks clean up after reporting: give them until the deadline (at most 5 s).
        ranks.close(grace=max(0.0, min(5.0, deadline - time.monotonic())))
    return out


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on every rank and return the results in rank order; raise on any failure."""
    timeout = kwargs.get("timeout", 60.0)
    out = run_ranks_raw(fn, world_size, *args, **kwargs)
    failures = {r: tb for r, (ok, tb) in out.items() if not ok}
    missing = sorted(set(range(world_size)) - set(out))
    for r in missing:
        failures[r] = f"rank {r} did not finish within {timeout} s (killed)"
    if missing and out.stacks:
        failures[missing[0]] += "\n" + out.stacks
    if failures:
        raise RankFailure(failures)
    return [out[r][1] for r in range(world_size)]


# -- measurements ------------------------------------------------------------------------------


def in_ci() -> bool:
    """True under ``CI=true`` (also 1 or yes): what the suite needs is then a requirement."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str, *, what: str, fix: str, module_level: bool = False) -> None:
    """Skip the calling test for ``reason``, except under ``CI=true``, where it fails: a CI
    without torch, Docker or root, say, must never pass unnoticed. ``what`` names the
    tests that need it ("the Swarm tests"), ``fix`` says how to get it."""
    import pytest

    if in_ci():
        pytest.fail(f"{reason} (CI=true: {what} must run; {fix})", pytrace=False)
    pytest.skip(f"{reason}; {fix} to enable {what}", allow_module_level=module_level)


def require(module: str, install: str) -> Any:
    """Import an optional test dependency: without it the calling test module skips, or
    fails under ``CI=true`` (:func:`unavailable`). ``install`` says how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:  # pragma: no cover - depends on the machine
        unavailable(f"{module} is not importable", what="the tests that need it",
                    fix=install, module_level=True)


def require_installed(module: str, install: str) -> None:
    """Like :func:`require` for a dependency that only the test's child processes import:
    found, not imported (scikit-learn pulls in scipy: about 1.5 CPU-s in every lane's
    collection)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:  # pragma: no cover - depends on the machine
        unavailable(f"{module} is not installed", what="the tests that need it",
                    fix=install, module_level=True)


#: How to get torch: optional for swarmfd's users, required in CI (its CPU wheel, pinned).
TORCH_INSTALL = "pip install torch==2.13.0, the CPU wheel"


def require_torch(*, load: bool = True) -> Any:
    """torch, for a test of swarmfd's torch support: the module (with ``load=False`` only
    found, for a test whose ranks import it). Without it the calling test (or module)
    skips, or fails under ``CI=true``: a broken torch must not pass CI as skips."""
    if not load:
        require_installed("torch", TORCH_INSTALL)
        return None
    return require("torch", TORCH_INSTALL)


def torch_installed() -> bool:
    """For a test that runs with or without torch (what needs it is left out without it):
    whether torch is installed. Under ``CI=true`` its absence fails the calling test."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return True
    if in_ci():  # pragma: no cover - depends on the machine
        unavailable("torch is not installed", what="the tests that need it",
                    fix=TORCH_INSTALL)
    return False


class StallMeter:
    """How long this machine failed to run a high-priority thread, over a time window.

    A bound on how fast a rank detects something (a lost peer within 2 s, a timeout
    within its grace) holds on a machine that runs the rank. On these shared 2-core
    machines the whole machine now and then stops running even the timed lane's
    processes (nice -5) for a second or two: a CI run at its start (five lanes
    collecting, Docker's set-up unpacking packages) once reported a lost peer after
    2.15 s where it takes 0.36 s otherwise. The meter is a thread of the test process
    that sleeps SLICE at a time and records every wake-up later than LATE; a bound
    allows the stall it saw during the measured window (:meth:`stalled`), and says so
    in its message, so that swarmfd's own time is what is bounded. A thread of the test
    process at the lane's priority sees what the ranks, at the same priority, see.
    """

    SLICE = 0.005
    LATE = 0.05

    def __init__(self) -> None:
        self.events: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
        self.thread = threading.Thread(target=self._run, name="stall-meter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            start = time.monotonic()
            time.sleep(self.SLICE)
            late = time.monotonic() - start - self.SLICE
            if late > self.LATE:
                self.events.append((start + self.SLICE, late))

    def stalled(self, since: float, until: float) -> float:
        """Seconds of the window [since, until] in which the meter's thread was due but
        not run."""
        total = 0.0
        for due, late in list(self.events):
            total += max(0.0, min(until, due + late) - max(since, due))
        return total


_STALL_METER: StallMeter | None = None


def stall_meter() -> StallMeter:
    """This process's :class:`StallMeter` (started on the first call: before the window
    a test measures)."""
    global _STALL_METER
    if _STALL_METER is None:
        _STALL_METER = StallMeter()
    return _STALL_METER


#: The bounds the suite holds swarmfd's detections to, written out: a bound in terms of
#: the constant that sets the detection (LOST_PEER_GRACE, KEEPALIVE, TIMEOUT_GRACE) would
#: pass a slower one. A peer that died or left is reported within 2 s.
LOST_PEER_LIMIT = 2.0
#: A host gone without a FIN is found by TCP keepalive in about 4 s (docs/security.md: 1 s
#: idle, 3 probes 1 s apart); the bound allows for when its last packet went, the
#: lost-peer grace and a loaded machine.
VANISHED_PEER_LIMIT = 7.0
#: A rank that times out listens this long to the others' reports (to name the rank
#: really stuck) before it raises.
TIMEOUT_REPORT = 0.6


def allowed(limit: float, since: float, until: float) -> tuple[float, str]:
    """A time bound over the window [since, until], plus the time in it in which this
    machine did not run the test process's :class:`StallMeter` (which must have been
    started before the window: :func:`stall_meter`); with a note for the assertion's
    message. The bound is then on swarmfd's time, not on a machine that stopped running
    the ranks."""
    stall = stall_meter().stalled(since, until)
    return limit + stall, (f"; the machine stalled {stall:.2f} s of it (allowed on top)"
                           if stall else "")


def record(test: str, **values: Any) -> None:
    """Append one measurement to $ROBUST_MEASURE_FILE (JSON lines), when it is set."""
    path = os.environ.get("ROBUST_MEASURE_FILE")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


def error_info(exc: BaseException, since: float) -> dict[str, Any]:
    """A picklable description of a caught exception, with seconds elapsed since ``since``."""
    now = time.monotonic()
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "t": now,
        "elapsed": now - since,
    }


def count_runs(cls: type, method: str) -> dict[str, int]:
    """Count, in this rank's process, the runs of ``cls.method`` that did their work: a
    method that answers a bool counts its True answers, one that answers None (an
    ``__init__``: the objects made) every call. Returns the live count,
    ``{cls.__name__: n}``."""
    counts = {cls.__name__: 0}
    real = getattr(cls, method)

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = real(self, *args, **kwargs)
        counts[cls.__name__] += 1 if done is None else bool(done)
        return done

    setattr(cls, method, counting)
    return counts
