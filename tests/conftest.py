"""Shared fixtures: run a function on N real ranks (processes) on loopback.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, lines them up
once each has imported swarmfd (:func:`start_line`), initialises a swarmfd group
in each, calls ``fn(rank, world_size, *args)`` and returns the results in rank
order. A child's exception comes back as its formatted traceback; a rank that
does not finish within the timeout fails the test with the stack of each of its
threads (see :func:`arm_stack_dump`); every child is
killed and reaped whatever happens, so no test can hang or leak.

The test session has one job secret, as ``swarmfd run`` gives a run: a file
(0600) in a private directory (0700), named by ``SWARMFD_SECRET_FILE`` in this
process's environment, so every rank a test spawns inherits the path (and the
directory is removed at the end of the session).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import random
import secrets
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

_CTX = mp.get_context("spawn")
_SECRET_DIR: str | None = None
_STACK_FILES: list[Any] = []  # in a rank: the open file faulthandler writes to


def arm_stack_dump(directory: str, rank: int) -> None:
    """In a rank: on SIGUSR1, write every thread's stack to ``directory``/stack-RANK.txt.

    A rank that hangs says where; :func:`collect_stacks` asks for the dumps.
    """
    f = open(os.path.join(directory, f"stack-{rank}.txt"), "w")  # noqa: SIM115 (kept open)
    _STACK_FILES.append(f)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


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


def pytest_configure(config: pytest.Config) -> None:
    """Give the session's ranks a job secret (see the module docstring)."""
    global _SECRET_DIR
    _SECRET_DIR = tempfile.mkdtemp(prefix="swarmfd-test-secret-")
    os.environ["SWARMFD_SECRET_FILE"] = write_secret_file(_SECRET_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SECRET_DIR is not None:
        shutil.rmtree(_SECRET_DIR, ignore_errors=True)


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

    It lies below the kernel's ephemeral range, as a MASTER_PORT should: ports the
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


#: How long a spawned rank waits at the start line for the others to have started.
START_LINE_TIMEOUT = 120.0


def start_line(barrier: Any) -> None:
    """In a rank, once swarmfd is imported: wait until every rank of the run got here.

    Ranks start (spawn, import numpy, zmq, swarmfd) at different speeds; on a loaded
    2-core machine measured up to 0.6 s apart for 3 ranks. ``init`` blocks at most the
    group timeout, which a test of collective timeouts sets to a few seconds (1 s in
    one): without a common start, the start-up skew ate into, or beyond, that window.
    """
    barrier.wait(START_LINE_TIMEOUT)


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           init: bool, timeout: float, env: dict[str, str], results: Any,
           stack_dir: str, start: Any) -> None:
    os.environ.update(env)
    arm_stack_dump(stack_dir, rank)
    try:
        import swarmfd as fd

        start_line(start)
        if init:
            fd.init(world, rank, master_addr="127.0.0.1", master_port=port, timeout=timeout)
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import swarmfd as fd

            fd.cleanup()
        except Exception:
            pass


class RankFailure(AssertionError):
    """One or more ranks raised; carries each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


class RankResults(dict[int, tuple[bool, Any]]):
    """{rank: (ok, result or traceback)}; ``stacks``: the dumps of ranks that hung."""

    stacks: str = ""


def run_ranks_raw(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    group_timeout: float = 30.0,
    init: bool = True,
    env: dict[str, str] | None = None,
) -> RankResults:
    """Run ``fn`` on every rank; {rank: (ok, result or traceback)} of the ranks that reported.

    A rank that did not report within ``timeout`` is missing from the result, and
    ``.stacks`` has its threads' stacks, taken just before it was killed.
    """
    port = free_port()
    results = _CTX.Queue()
    stack_dir = tempfile.mkdtemp(prefix="swarmfd-stacks-")
    start = _CTX.Barrier(world_size)
    procs = [
        _CTX.Process(target=_child, args=(fn, r, world_size, port, args, init, group_timeout,
                                          env or {}, results, stack_dir, start), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out = RankResults()
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            out[rank] = (ok, value)
        if len(out) < world_size:
            out.stacks = collect_stacks(stack_dir, [p if r not in out else None
                                                    for r, p in enumerate(procs)])
    finally:
        shutil.rmtree(stack_dir, ignore_errors=True)
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
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


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """The :func:`run_ranks` helper as a fixture."""
    return run_ranks
