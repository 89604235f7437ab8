"""Async operations: :class:`Work`, and the progress engine that drives them.

An operation issued with ``async_op=True`` returns a :class:`Work` at once and
progresses in the background while the caller computes. The algorithms are
generators (:mod:`swarmfd.algorithms.base`), so the engine can run many at a time on
one thread: it resumes each as far as it can, and when none can go on it waits for
the next message on the planes, which it reads straight into the buffer of the
receive that expects it.

Ordering. Each group's collectives run one at a time, in the order they were issued,
and complete in that order; several may be pending. Different groups' collectives,
and point-to-point operations, progress independently (a rank that waits in one
group's call never holds up another group's).

Who runs it. A blocking call on a process with nothing pending runs on the caller's
thread, as it always did (no thread hand-off: 30-50 us in CPython, more than a small
all_reduce). An async op issued to a group with nothing pending starts on the
caller's thread too (its first sends leave at once) and is then carried on by the
progress thread (started on the first async op), or by any thread that waits: a
:meth:`Work.wait`, or a blocking call issued while ops are pending (it queues behind
them and drives the engine itself until its own op is done). Numpy and socket I/O
release the GIL, so the progress thread overlaps with the caller's compute.

Buffers. An array handed to an async op belongs to the op until :meth:`Work.wait`
returns (or :meth:`Work.is_completed` is true): do not read or write it meanwhile.
Once it completed, its results are in place, written back already for a
non-contiguous array (the write-back runs on whichever thread completes the op).
A Work that is never waited for still completes, and its failure still breaks its
group; only its result is never seen.

Counters. A collective that completes here adds to its group's counters
(:class:`swarmfd.counters.CallStats`): its time from submission to completion, and
what its receives waited for their messages (which may overlap the caller's compute).

Failure. When an op fails, its group breaks (see :mod:`swarmfd.group`): the op's Work
raises the error, and so does every other pending Work of that group.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from time import perf_counter
from typing import Any

from .algorithms.base import FLUSH, Op, request
from .comm.channel import GroupFailure, Key, Posting
from .errors import PeerLostError, SwarmfdError

__all__ = ["Engine", "Work"]

#: How long the progress thread waits on a plane before it looks whether a caller wants to
#: drive the engine (the latency of a wait() that takes over; a caller never waits for a
#: blocked progress thread longer than this).
THREAD_SLICE = 0.001
#: How long a driving caller waits on a plane at a time.
CALLER_SLICE = 0.05
#: Deadlines and lost peers are checked at least this often (s) while messages arrive.
CHECK_EVERY = 0.05
_INF = float("inf")


def _now() -> float:
    return time.monotonic()


class Work:
    """An operation in flight (see the module docstring).

    ``completed_at`` is the ``time.monotonic()`` at which it completed (None before).
    """

    __slots__ = ("_done", "_engine", "_error", "_result", "completed_at", "name")

    def __init__(self, engine: Engine | None, name: str) -> None:
        self._engine = engine
        self.name = name
        # A flag, not a threading.Event: nobody blocks on it (a waiter drives the engine
        # until the flag is set), and an Event (a Condition and a Lock) cost 3-5 us per
        # op to build.
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self.completed_at: float | None = None

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "completed") if self._done \
            else "pending"
        return f"<swarmfd.Work {self.name} {state}>"

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self.completed_at = _now()
        self._done = True  # last: a reader that sees it set sees the result

    def is_completed(self) -> bool:
        """True once the operation ended (successfully or not)."""
        return self._done

    def exception(self) -> BaseException | None:
        """The error the operation ended with; None while it runs or when it succeeded."""
        return self._error if self._done else None

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until the operation completes and return its result (or raise its error).

        ``timeout`` (seconds) bounds this wait only: its expiry raises TimeoutError and
        leaves the operation running; the group's own timeout still decides failure.
        """
        if not self._done:
            engine = self._engine
            if engine is None:
                raise RuntimeError("swarmfd: this Work has no engine to run it (a bug)")
            engine.drive_until(self.is_completed, timeout)
            if not self._done:
                raise TimeoutError(f"swarmfd: {self.name} did not complete within {timeout:g} s "
                                   "(it goes on; wait again, or the group's timeout decides)")
        if self._error is not None:
            raise self._error
        return self._result


def completed(result: Any, name: str, error: BaseException | None = None) -> Work:
    """A Work that is already done (an op with nothing to do: a world of one)."""
    w = Work(None, name)
    w._finish(result, error)
    return w


class _Joined(Work):
    """One Work for several (a list of arrays of several dtypes: one op per dtype).

    It completes when its last part does: ``completed_at`` is that part's, read from
    the parts, not the time somebody first asked (a list all_reduce that completed in
    the background during a backward pass must not seem to end at its ``wait()``).
    """

    __slots__ = ("parts", "then")

    def __init__(self, parts: list[Work], name: str, then: Callable[[], Any]) -> None:
        self.parts = parts
        super().__init__(None, name)
        self.then = then

    @property  # type: ignore[override]
    def completed_at(self) -> float | None:
        times = [p.completed_at for p in self.parts]
        return None if None in times else max(times)  # type: ignore[type-var]

    @completed_at.setter
    def completed_at(self, value: float | None) -> None:
        pass  # derived from the parts (Work.__init__ and _finish assign it)

    def _check(self) -> None:
        if not self._done and all(p.is_completed() for p in self.parts):
            error = next((p.exception() for p in self.parts if p.exception()), None)
            self._finish(None if error else self.then(), error)

    def is_completed(self) -> bool:
        self._check()
        return self._done

    def exception(self) -> BaseException | None:
        self._check()
        return super().exception()

    def wait(self, timeout: float | None = None) -> Any:
        end = None if timeout is None else _now() + timeout
        for p in self.parts:
            try:
                p.wait(None if end is None else max(0.0, end - _now()))
            except TimeoutError:
                raise
            except BaseException:
                pass  # reported below, once every part has ended
        self._check()
        return super().wait(0)


def joined(parts: list[Work], name: str, then: Callable[[], Any]) -> Work:
    """A Work that completes when every one of ``parts`` did; its result is ``then()``."""
    return parts[0] if len(parts) == 1 and then is None else _Joined(parts, name, then)


class _Task:
    """A Work's running state: its op, its algorithm, and what it waits for."""

    __slots__ = ("finish", "gen", "group", "key", "most", "nbytes", "on", "op", "posting", "req",
                 "since", "stall_at", "started", "t0", "waited", "work")

    def __init__(self, work: Work, group: Any, op: Op, gen: Any,
                 finish: Callable[[Any], Any] | None, nbytes: int = 0) -> None:
        self.work = work
        #: For the counters: when it was submitted, its buffer's bytes, what its receives
        #: waited in all, the longest wait and the rank it waited for.
        self.t0 = perf_counter()
        self.nbytes = nbytes
        self.waited = self.most = 0.0
        self.on = -1
        #: When its current wait is next looked at for a stall report (see Channel).
        self.stall_at = _INF
        self.group = group
        self.op = op
        self.gen = gen
        self.finish = finish
        self.started = False
        self.req: Any = None
        self.key: Key | None = None
        self.posting: Posting | None = None
        self.since = 0.0


class _Drive:
    """The context of a thread that drives an engine: it says so (``wanted``, which makes
    the progress thread step aside after its current step), then takes the engine's lock.
    One per engine, holding no state of its own, so that entering it builds nothing (a
    class built per call cost 14 us of every async op and every wait)."""

    __slots__ = ("engine",)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        engine = self.engine
        with engine.cond:
            engine.wanted += 1
        engine.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        engine = self.engine
        engine.lock.release()
        with engine.cond:
            engine.wanted -= 1
            engine.cond.notify_all()


class Engine:
    """The progress engine of one process group (see the module docstring)."""

    def __init__(self, channel: Any, timeout: float,
                 on_fail: Callable[[Any, BaseException, int], None]) -> None:
        self.channel = channel
        self.timeout = timeout
        #: (group, error, the group's last call this rank finished): the group breaks.
        self.on_fail = on_fail
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        #: Pending collectives per group id, in issue order (the first is running).
        self.queues: dict[int, collections.deque[_Task]] = {}
        #: Point-to-point tasks (all running).
        self.p2p: list[_Task] = []
        self.wanted = 0  # callers waiting to drive
        self.checked = 0.0  # when deadlines and lost peers were last checked
        self.thread: threading.Thread | None = None
        self.closed = False
        #: Provisional timeout reports per group: {rank: rank it waited for}, and their
        #: bodies by (group, rank).
        self.reports: dict[int, dict[int, int]] = {}
        self.payloads: dict[tuple[int, int], Any] = {}
        self._drive = _Drive(self)

    # -- submitting ---------------------------------------------------------------------

    def idle(self) -> bool:
        """True when nothing is pending: a blocking call may run inline."""
        return not self.queues and not self.p2p

    def submit(self, group: Any, op: Op, gen: Any, name: str,
               finish: Callable[[Any], Any] | None = None, *, p2p: bool = False,
               nbytes: int = 0) -> Work:
        """Queue an operation (a collective's buffer of ``nbytes``, for the counters);
        start it on this thread when its group has nothing pending."""
        work = Work(self, name)
        task = _Task(work, group, op, gen, finish, nbytes)
        with self._driving():
            if p2p:
                self.p2p.append(task)
                self._advance(task)
            else:
                q = self.queues.setdefault(group.gid, collections.deque())
                q.append(task)
                if len(q) == 1:
                    self._advance(task)
        if not work.is_completed():
            self._wake_thread()
        return work

    # -- driving ------------------------------------------------------------------------

    def _driving(self) -> _Drive:
        """``with`` it: this thread drives the engine (the progress thread steps aside)."""
        return self._drive

    def drive_until(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Drive the engine on this thread until ``done()`` or ``timeout`` s passed."""
        end = None if timeout is None else _now() + timeout
        with self._driving():
            while not done():
                if end is not None and _now() >= end:
                    return
                if self.idle():
                    return
                slice_ = CALLER_SLICE if end is None else max(0.0, min(CALLER_SLICE,
                                                                       end - _now()))
                self._step(slice_)

    def _running(self) -> list[_Task]:
        return [q[0] for q in self.queues.values() if q] + self.p2p

    def _step(self, wait: float) -> None:
        """Advance every running task as far as it goes; then wait up to ``wait`` s for
        the next message, deliver it, and check deadlines and lost peers."""
        progressed = False
        for task in self._running():
            progressed |= self._advance(task)
        running = self._running()
        if not running:
            return
        posted: dict[Key, Posting] = {}
        owners: dict[Key, _Task] = {}
        planes: list[Any] = []
        for t in running:
            if t.key is not None and t.posting is not None:
                posted[t.key] = t.posting
                owners[t.key] = t
            # The plane its receive comes on (a hierarchical call's phases use several).
            plane = request(t.req)[0].plane if t.key is not None else t.op.plane
            if plane not in planes:
                planes.append(plane)
        for plane in self.channel.planes:
            if plane not in planes:
                planes.append(plane)  # aborts and reports may come on any plane
        got = False
        for i, plane in enumerate(planes):
            budget = wait if (i == 0 and not progressed) else 0.0
            while True:
                try:
                    hit = self.channel.deliver(plane, posted, budget)
                except GroupFailure as exc:
                    self._fail_gid(exc.group, exc.error)
                    return
                if hit is None:
                    break
                got = True
                budget = 0.0
                key, payload = hit
                task = owners.pop(key)
                posted.pop(key)
                _waited(task, self.channel)
                task.key = task.posting = None
                self._resume(task, payload)
        now = _now()
        if not got or now - self.checked > CHECK_EVERY:
            # Deadlines and lost peers, also when messages keep coming (a flood, another
            # group's traffic): at least every CHECK_EVERY seconds.
            self.checked = now
            for plane in self.channel.planes:
                plane.check_lost()
            self._check_waits()

    def _advance(self, task: _Task) -> bool:
        """Run ``task`` on as far as it goes without a new message; True on progress."""
        ch = self.channel
        if task.group.broken is not None and _doomed(task) and not task.work.is_completed():
            self._fail_group(task.group)
            return True
        if not task.started:
            task.started = True
            if not _is_p2p(task):
                ch.begin(task.op.gid, task.op.seq)
            self._resume(task, None)
            return True
        if task.req is FLUSH:
            if any(p.unsent() for p in ch.planes):
                for p in ch.planes:
                    p.wait(0)
                return False
            task.req = None
            self._resume(task, None)
            return True
        if task.key is not None and task.posting is not None:
            try:
                found, payload = ch.take(task.key, *task.posting)
            except SwarmfdError as exc:
                self._fail(task, exc)
                return True
            if found:
                _waited(task, self.channel)
                task.key = task.posting = None
                self._resume(task, payload)
                return True
        return False

    def _resume(self, task: _Task, value: Any) -> bool:
        """Send ``value`` into the task's algorithm; set up what it waits for next."""
        ch = self.channel
        try:
            while True:
                req = task.gen.send(value)
                value = None
                if req is FLUSH:
                    if any(p.unsent() for p in ch.planes):
                        task.req, task.key, task.posting = FLUSH, None, None
                        return True
                    continue
                _, key, sig, nbytes, into = request(req)
                found, payload = ch.take(key, sig, nbytes, into)
                if found:
                    value = payload
                    continue
                task.req, task.key, task.posting = req, key, (sig, nbytes, into)
                task.since = now = _now()
                threshold = ch.stalls.threshold
                task.stall_at = now + threshold if threshold and not _is_p2p(task) else _INF
                return True
        except StopIteration as stop:
            self._complete(task, stop.value)
            return True
        except SwarmfdError as exc:
            self._fail(task, exc)
            return True
        except BaseException as exc:  # a bug, or bad input: the op fails, the group breaks
            self._fail(task, exc)
            return True

    def _complete(self, task: _Task, result: Any) -> None:
        """The algorithm ended: flush, write back, finish the Work, start the next."""
        try:
            self.channel.flush()
            if task.finish is not None:
                result = task.finish(result)
        except BaseException as exc:
            self._fail(task, exc)
            return
        self._remove(task)
        if not _is_p2p(task):
            op = task.op
            task.group.stats.record(op.seq, perf_counter() - task.t0, task.nbytes,
                                    task.waited, task.on)
        task.work._finish(result)

    def _remove(self, task: _Task) -> None:
        if _is_p2p(task):
            if task in self.p2p:
                self.p2p.remove(task)
            return
        gid = task.group.gid
        q = self.queues.get(gid)
        if q and q[0] is task:
            q.popleft()
        if q is not None and not q:
            del self.queues[gid]

    def _fail(self, task: _Task, error: BaseException) -> None:
        """``task`` failed: its group breaks, it and the group's other pending ops raise."""
        # A failed collective finished the call before it; a point-to-point message
        # only what precedes the group's running collective (if any: it may be done).
        last = task.op.seq - 1 if not _is_p2p(task) else self.channel.last_call(
            task.group.gid) - 1
        self.on_fail(task.group, error, last)
        self._remove(task)
        task.work._finish(error=error)
        self._fail_group(task.group)

    def _fail_gid(self, gid: int, error: BaseException) -> None:
        for task in self._running():
            if task.group.gid == gid:
                self._fail(task, error)
                return

    def _fail_group(self, group: Any) -> None:
        """Fail every pending op of ``group`` (already broken) with the group's error."""
        q = self.queues.get(group.gid)
        doomed = [t for t in q or [] if _doomed(t)] + [t for t in self.p2p if t.group is group]
        for task in doomed:
            if task in self.p2p:
                self.p2p.remove(task)
            else:
                q.remove(task)  # type: ignore[union-attr]
            task.work._finish(error=group.failure())
        if q is not None and not q:
            del self.queues[group.gid]

    def _check_waits(self) -> None:
        """Timeouts, peers' timeout reports and lost peers of the tasks that wait."""
        ch, now = self.channel, _now()
        for task in self._running():
            if task.key is None:
                continue
            src = task.key[1]
            reports = self.reports.get(task.op.gid)
            if reports:
                # A peer of this group timed out: join the search for the stuck rank at
                # once, as a blocking receive does (its listening window is short).
                waits = dict(reports)
                self.reports.pop(task.op.gid, None)
                ch.set_group(task.op.gid)
                ch.activity = task.work.name
                ch.waiting_for = src
                try:
                    if waits.get(src) == ch.rank:
                        # The rank this one waits for gave up waiting for this one.
                        err: BaseException = self._relayed(task, src, waits)
                    else:
                        err = ch.timeout_error(src, task.op.sig, waits)
                finally:
                    ch.activity = "idle"
                self._fail(task, err)
                continue
            if ch.gone(src, now):
                self._fail(task, PeerLostError(
                    f"{task.work.name}: lost rank {src} ({ch.where(src)}): "
                    f"{ch.why_lost(src)} before it sent its data"))
                continue
            if now - task.since > self.timeout:
                ch.set_group(task.op.gid)
                ch.activity = task.work.name
                err = ch.timeout_error(src, task.op.sig, dict(self.reports.pop(task.op.gid, {})))
                ch.activity = "idle"
                self._fail(task, err)
            elif now >= task.stall_at:
                op = task.op
                task.stall_at = ch.stall_tick(now, task.since, op.gid, op.seq, op.sig, src)

    def report(self, gid: int, rank: int, waited: int, payload: Any) -> None:
        """A peer's provisional timeout report for group ``gid`` (see Channel.timeout_error)."""
        self.reports.setdefault(gid, {})[rank] = waited
        self.payloads[(gid, rank)] = payload

    def _relayed(self, task: _Task, src: int, waits: dict[int, int]) -> BaseException:
        from .errors import error_from_abort

        return error_from_abort(task.work.name, src, self.payloads.pop((task.op.gid, src), b""))

    # -- the progress thread -------------------------------------------------------------

    def _wake_thread(self) -> None:
        with self.cond:
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(target=self._loop, name="swarmfd-progress",
                                               daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (self.idle() or self.wanted):
                    self.cond.wait(0.1)
                if self.closed:
                    return
            with self.lock:
                # Drive until a caller wants the engine, or nothing is pending.
                while not self.idle() and not self.wanted and not self.closed:
                    self._step(THREAD_SLICE)

    def close(self, error: BaseException | None = None) -> None:
        """Stop the progress thread; fail whatever is still pending with ``error``."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        pending = [t for q in self.queues.values() for t in q] + self.p2p
        self.queues.clear()
        self.p2p.clear()
        for task in pending:
            task.work._finish(error=error or RuntimeError(
                f"swarmfd: {task.work.name} was pending when the process group was cleaned "
                "up"))


def _waited(task: _Task, channel: Any) -> None:
    """The message ``task`` waited for since it posted its receive came: count the wait
    (and end its stall report, if it had one)."""
    waited = _now() - task.since
    task.waited += waited
    if waited > task.most:
        task.most, task.on = waited, task.key[1]  # type: ignore[index]
    threshold = channel.stalls.threshold
    if threshold and waited >= threshold:
        channel.stalls.end(task.op.gid, task.op.seq)
    task.stall_at = _INF


def _is_p2p(task: _Task) -> bool:
    return task.op.seq < 0


def _doomed(task: _Task) -> bool:
    """``task``'s group is broken for it: a point-to-point message, or a call from the
    first one the group's failure fails (see Group.broken_from)."""
    return _is_p2p(task) or task.op.seq >= task.group.broken_from
