"""Spawn ranks that a robustness test can signal, watch and always reap.

:class:`Ranks` is a context manager around N spawned processes. Each runs
``fn(ctx, *args)`` where ``ctx`` (:class:`RankCtx`) knows its rank, can
``report(kind, value)`` events to the test (the test waits for them with
:meth:`Ranks.wait`), and shares two things with the test process:

* ``ctx.go``: a shared flag the test raises (:meth:`Ranks.release`) to release
  the ranks, awaited with :meth:`RankCtx.wait_go` (polled, not an Event: setting
  an Event waits for every sleeper to wake, and a stopped rank never does);
* ``ctx.mark``: a shared double, the ``time.monotonic()`` of a kill or stop.
  ``CLOCK_MONOTONIC`` is system-wide on Linux, so times taken in different
  processes compare directly.

``transport`` ("tcp", "zmq" or "shm") selects ``SWARMFD_TRANSPORT`` (tcp / tcp /
auto) and ``SWARMFD_DATA_PLANE`` ("zmq": the ZeroMQ data plane; otherwise the
default, the socket plane), and every :meth:`RankCtx.init` checks the group really
uses them.

The ranks import swarmfd, then wait for each other (``conftest.start_line``) before
``fn`` or ``init``: a short group timeout then measures the group, not start-up skew.

A wait that times out fails with every live rank's thread stacks (faulthandler,
on SIGUSR1), so a hang says where it is. Whatever happens, leaving the ``with``
block sends SIGCONT then SIGKILL to every child still alive and joins it;
:meth:`Ranks.close` asserts none is left.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from .conftest import arm_stack_dump, collect_stacks, free_port, start_line

_CTX = mp.get_context("spawn")


class RankCtx:
    """What a rank's function gets: its rank, the world size and the shared channels."""

    def __init__(self, rank: int, world: int, port: int, events: Any, go: Any, mark: Any,
                 group_timeout: float, transport: str) -> None:
        self.rank = rank
        self.transport = transport
        self.world = world
        self.port = port
        self.events = events
        self.go = go
        self.mark = mark
        self.group_timeout = group_timeout

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
        """Join the group (on ``port``, default the harness's MASTER_PORT)."""
        import swarmfd as fd

        fd.init(self.world, self.rank, master_addr="127.0.0.1",
                master_port=port or self.port,
                timeout=self.group_timeout if timeout is None else timeout,
                init_timeout=init_timeout)
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


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           init: bool, group_timeout: float, transport: str, events: Any, go: Any,
           mark: Any, stack_dir: str, start: Any) -> None:
    arm_stack_dump(stack_dir, rank)
    os.environ["SWARMFD_TRANSPORT"] = {"tcp": "tcp", "zmq": "tcp", "shm": "auto"}[transport]
    if transport == "zmq":
        os.environ["SWARMFD_DATA_PLANE"] = "zmq"
    ctx = RankCtx(rank, world, port, events, go, mark, group_timeout, transport)
    try:
        import swarmfd  # noqa: F401  (imported before the start line: see start_line)

        start_line(start)
        if init:
            ctx.init()
        value = fn(ctx, *args)
        events.put((rank, "result", (True, value)))
    except BaseException:
        events.put((rank, "result", (False, traceback.format_exc())))
    finally:
        try:
            import swarmfd as fd

            fd.cleanup()
        except Exception:
            pass


class Ranks:
    """N spawned ranks running ``fn(ctx, *args)``; see the module docstring."""

    def __init__(self, fn: Callable[..., Any], world: int, *args: Any,
                 group_timeout: float = 60.0, init: bool = True,
                 transport: str = "tcp") -> None:
        assert transport in ("tcp", "zmq", "shm"), transport
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
                fn, r, world, self.port, args, init, group_timeout, transport, self.queues[r],
                self.go, self.mark, self.stack_dir, self.start_barrier))
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

    def close(self) -> None:
        """Reap every child (SIGCONT, then SIGKILL whatever is left); assert none survives."""
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=0.5)
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
