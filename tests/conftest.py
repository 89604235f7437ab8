"""Shared fixtures: run a function on N real ranks (processes) on loopback.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initialises
a swarmfd group in each, calls ``fn(rank, world_size, *args)`` and returns the
results in rank order. A child's exception comes back as its formatted
traceback; a rank that does not finish within the timeout fails the test; every
child is killed and reaped whatever happens, so no test can hang or leak.

The test session has one job secret, as ``swarmfd run`` gives a run: a file
(0600) in a private directory (0700), named by ``SWARMFD_SECRET_FILE`` in this
process's environment, so every rank a test spawns inherits the path (and the
directory is removed at the end of the session).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import secrets
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

_CTX = mp.get_context("spawn")
_SECRET_DIR: str | None = None


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


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           init: bool, timeout: float, env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    try:
        import swarmfd as fd

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


def run_ranks_raw(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    group_timeout: float = 30.0,
    init: bool = True,
    env: dict[str, str] | None = None,
) -> dict[int, tuple[bool, Any]]:
    """Run ``fn`` on every rank; {rank: (ok, result or traceback)} of the ranks that reported."""
    port = free_port()
    results = _CTX.Queue()
    procs = [
        _CTX.Process(target=_child, args=(fn, r, world_size, port, args, init, group_timeout,
                                          env or {}, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple[bool, Any]] = {}
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
    finally:
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
    if failures:
        raise RankFailure(failures)
    return [out[r][1] for r in range(world_size)]


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """The :func:`run_ranks` helper as a fixture."""
    return run_ranks
