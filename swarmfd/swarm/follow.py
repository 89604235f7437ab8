"""Following a job: task progress, rank-prefixed logs, failure detection, stopping.

Logs: a task on this node is read from its container (complete and ordered, from the
start once it runs), a task elsewhere through the service log (``details`` names each
line's task; it can drop short-lived tasks' lines). Each line is written whole,
prefixed ``[rank R] ``, stdout to ``out`` and stderr to ``err``.

Failures: :func:`follow_job` polls the tasks every ``poll`` s; a rank that fails, is
rejected or is stopped by Swarm ends the job: the others are stopped (their tasks and
logs stay) and the result names the rank, its exit code and node. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import docker
import docker.errors

from .. import statusline
from .engine import NodeState, job_tasks, node_states, set_labels, stop_job
from .spec import LABEL_FAILURE
from .tasks import (
    NODE_GONE_STATES,
    TaskView,
    exit_code_for,
    failure_message,
    first_failure,
    lost_message,
    lost_ranks,
    parse_timestamp,
    root_failure,
    summarize,
)

__all__ = ["FollowResult", "LineSplitter", "LogPump", "RankOutput", "follow_job", "parse_details",
           "print_logs"]

DEFAULT_POLL = 0.3
STOP_TIMEOUT = 30.0
DRAIN_TIMEOUT = 10.0
#: Lines of each rank's output kept while following, to find in a failed rank's
#: traceback the peer it lost (:func:`.tasks.root_failure`).
TAIL_LINES = 50
SERVICE_LOG_GRACE = 1.0
#: At a failure, how long the ended ranks' logs may take to be read before the others
#: are stopped (milliseconds usually; this bounds a slow engine).
ENDED_READ_TIMEOUT = 5.0
MAX_LINE = 64 * 1024

Sink = Callable[[int, str, bytes, "_dt.datetime | None"], None]


class RankOutput:
    """Writes whole lines, prefixed with ``[rank R] ``, to ``out``/``err`` under one lock."""

    def __init__(self, out: BinaryIO, err: BinaryIO, *, prefix: bool = True) -> None:
        self._streams = {"out": out, "err": err}
        self._prefix = prefix
        self._lock = threading.Lock()

    def __call__(self, rank: int, which: str, line: bytes,
                 when: _dt.datetime | None = None) -> None:
        data = (f"[rank {rank}] ".encode() if self._prefix else b"") + line + b"\n"
        stream = self._streams[which]
        with self._lock:
            stream.write(data)
            stream.flush()


class LineSplitter:
    """Splits a byte stream into lines; a final unterminated piece is kept for flush()."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        self._buf += chunk
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                break
            line, self._buf = self._buf[:end], self._buf[end + 1:]
            yield line.removesuffix(b"\r")
        while len(self._buf) > MAX_LINE:
            piece, self._buf = self._buf[:MAX_LINE], self._buf[MAX_LINE:]
            yield piece

    def flush(self) -> Iterator[bytes]:
        if self._buf:
            piece, self._buf = self._buf, b""
            yield piece


def _split_timestamp(line: bytes) -> tuple[_dt.datetime | None, bytes]:
    stamp, sep, rest = line.partition(b" ")
    if not sep:
        return parse_timestamp(stamp.decode("ascii", "replace")), b""
    return parse_timestamp(stamp.decode("ascii", "replace")), rest


def parse_details(chunk: bytes) -> tuple[str, bytes]:
    """Split a service-log chunk with details into (task ID, message)."""
    attrs, _sep, message = chunk.partition(b" ")
    task_id = ""
    for pair in attrs.split(b","):
        key, _eq, value = pair.partition(b"=")
        if key == b"com.docker.swarm.task.id":
            task_id = value.decode("ascii", "replace")
    return task_id, message


class LogPump:
    """Streams the logs of a service's tasks to a sink, a reader thread per stream.

    ``follow=False`` reads what is there and ends; ``timestamps=True`` passes each
    line's time to the sink. The ranks' status lines (:mod:`swarmfd.statusline`) never
    reach the sink: each rank's latest is kept in ``records``.
    """

    def __init__(
        self,
        client: docker.DockerClient,
        service_id: str,
        node_id: str,
        sink: Sink,
        *,
        ranks: Iterable[int] | None = None,
        follow: bool = True,
        timestamps: bool = False,
        records: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        self.client = client
        self.records: dict[int, dict[str, Any]] = {} if records is None else records
        #: When (``time.time()``) each rank's latest status record came.
        self.seen: dict[int, float] = {}
        self._carry: dict[int, bytes] = {}  # a rank's line begun before a status line
        self.service_id = service_id
        self.node_id = node_id
        self.sink = sink
        self.ranks = None if ranks is None else set(ranks)
        self.follow = follow
        self.timestamps = timestamps
        self._started: set[str] = set()
        self._remote: dict[str, int] = {}  # task ID -> rank, read via the service log
        self._local: set[str] = set()
        #: (reader, reads a local task, rank or None for the service log reader)
        self._threads: list[tuple[threading.Thread, bool, int | None]] = []
        self._streams: list[Any] = []
        self._service_reader = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.errors: list[str] = []

    def update(self, views: dict[int, TaskView]) -> None:
        """Start reading the tasks in ``views`` that run (or ran) and are not read yet."""
        for rank, view in views.items():
            if self.ranks is not None and rank not in self.ranks:
                continue
            if view.task_id in self._started or not view.container_id:
                continue
            if view.phase not in ("running", "done", "failed", "stopped"):
                continue
            self._started.add(view.task_id)
            if view.node_id == self.node_id:
                self._local.add(view.task_id)
                for which in ("out", "err"):
                    self._start(self._read_container, rank, view.container_id, which,
                                local=True, rank=rank)
            else:
                with self._lock:
                    self._remote[view.task_id] = rank
                if not self._service_reader:
                    self._service_reader = True
                    for which in ("out", "err"):
                        self._start(self._read_service, which, local=False)

    def _start(self, target: Callable[..., None], *args: Any, local: bool,
               rank: int | None = None) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"swarmfd-logs-{len(self._threads)}")
        self._threads.append((thread, local, rank))
        thread.start()

    def _emit(self, rank: int, which: str, line: bytes) -> None:
        if self._closed.is_set():
            return  # a service log stream cannot be cancelled: silence it instead
        when = None
        if self.timestamps:
            when, line = _split_timestamp(line)
        if which == "err":
            line, record = statusline.split(self._carry.pop(rank, b"") + line)
            if record is not None:
                if record:
                    self.records[rank] = record
                    self.seen[rank] = time.time()
                if line:
                    self._carry[rank] = line
                return
        self.sink(rank, which, line, when)

    def _read_container(self, rank: int, container_id: str, which: str) -> None:
        try:
            stream = self.client.api.logs(
                container_id, stdout=which == "out", stderr=which == "err", stream=True,
                follow=self.follow, timestamps=self.timestamps,
            )
        except docker.errors.NotFound:
            self.errors.append(f"rank {rank}: its container is gone (no logs)")
            return
        except docker.errors.APIError as exc:
            self.errors.append(f"rank {rank}: cannot read its logs: {exc}")
            return
        self._streams.append(stream)
        lines = LineSplitter()
        try:
            for chunk in stream:
                for line in lines.feed(chunk):
                    self._emit(rank, which, line)
        except Exception as exc:  # a stream cut by close() or by the engine
            self.errors.append(f"rank {rank}: log stream ended: {exc}")
        finally:
            for line in lines.flush():
                self._emit(rank, which, line)

    def _read_service(self, which: str) -> None:
        try:
            stream = self.client.api.service_logs(
                self.service_id, details=True, follow=self.follow, stdout=which == "out",
                stderr=which == "err", timestamps=self.timestamps,
            )
        except docker.errors.APIError as exc:
            self.errors.append(f"cannot read the service logs: {exc}")
            return
        pending: dict[str, LineSplitter] = {}
        try:
            for chunk in stream:
                stamp = b""
                if self.timestamps:
                    stamp, _sep, chunk = chunk.partition(b" ")
                task_id, message = parse_details(chunk)
                rank = self._rank_of_remote(task_id)
                if rank is None:
                    continue
                lines = pending.setdefault(task_id, LineSplitter())
                for line in lines.feed(message):
                    self._emit(rank, which, (stamp + b" " + line) if stamp else line)
        except Exception as exc:
            self.errors.append(f"service log stream ended: {exc}")

    def _rank_of_remote(self, task_id: str) -> int | None:
        with self._lock:
            if task_id in self._remote:
                return self._remote[task_id]
            if task_id in self._local:
                return None
        try:  # a task this pump has not seen yet
            task = self.client.api.inspect_task(task_id)
        except docker.errors.APIError:
            return None
        view = TaskView.from_api(task)
        if view.node_id == self.node_id or (self.ranks is not None and view.rank not in self.ranks):
            return None
        with self._lock:
            self._remote[task_id] = view.rank
        return view.rank

    def wait(self, timeout: float) -> bool:
        """Join the readers, at most ``timeout`` s; True when all ended (the service log
        never ends while following: it is not waited for then)."""
        deadline = time.monotonic() + timeout
        waited = [t for t, local, _rank in self._threads if local or not self.follow]
        for thread in waited:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.follow and self._service_reader:  # its ended tasks' last lines
            time.sleep(max(0.0, min(SERVICE_LOG_GRACE, deadline - time.monotonic())))
        return not any(t.is_alive() for t in waited)

    def wait_for(self, ranks: Iterable[int], timeout: float) -> None:
        """Join the local readers of ``ranks`` (tasks that ended: their streams end once
        read), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        wanted = set(ranks)
        for thread, local, rank in self._threads:
            if local and rank in wanted:
                thread.join(max(0.0, deadline - time.monotonic()))

    def unread(self) -> list[int]:
        """Ranks whose local log stream has not reached its end (after :meth:`wait`)."""
        return sorted({rank for t, local, rank in self._threads
                       if local and rank is not None and t.is_alive()})

    def drain(self, timeout: float, progress: Callable[[str], None], name: str) -> None:
        """:meth:`wait` for the ended ranks' last lines; say on ``progress`` what could
        not be read (a job's logs go with its service: never drop them silently)."""
        self.wait(timeout)
        unread = self.unread()
        if unread:
            progress(f"{name}: warning: the output of rank(s) {unread} was not read to its "
                     f"end within {timeout:.0f} s (the Docker engine is slow to answer); "
                     "lines may be missing above")
        for error in self.errors:
            progress(f"{name}: warning: {error}")

    def close(self) -> None:
        """Cancel the open log streams (their threads then end); nothing is written after."""
        self._closed.set()
        for stream in list(self._streams):
            with contextlib.suppress(Exception):
                stream.close()


@dataclass
class FollowResult:
    """How following a job ended."""

    outcome: str  # "done", "failed", "interrupted" or "removed"
    exit_code: int
    message: str
    failure: TaskView | None = None
    failure_node: str = ""
    all_running_after: float | None = None
    elapsed: float = 0.0
    stopped_after: float | None = None  # seconds from noticing the failure to all stopped
    lost: tuple[int, ...] = ()  # ranks whose node left the Swarm


def follow_job(
    client: docker.DockerClient,
    name: str,
    service_id: str,
    world_size: int,
    node_id: str,
    *,
    output: Sink | None,
    progress: Callable[[str], None],
    started: float | None = None,
    poll: float = DEFAULT_POLL,
    stop_timeout: float = STOP_TIMEOUT,
    drain_timeout: float = DRAIN_TIMEOUT,
    records: dict[int, dict[str, Any]] | None = None,
    elastic: bool = False,
) -> FollowResult:
    """Follow job ``name`` until every rank completed, one failed, or Ctrl-C (which
    leaves the job as it is); an ``elastic`` job until every slot has ended (see
    :class:`_Elastic`). ``output`` receives the ranks' lines (None: no logs),
    ``records`` their status records; ``progress`` a line per change of the phase
    counts, Swarm's pending reasons, all ranks running, and the outcome."""
    t0 = time.monotonic() if started is None else started
    tails = _Tails()
    pump = (LogPump(client, service_id, node_id, tails.wrap(output), records=records)
            if output is not None else None)
    told = _Told(name, world_size, progress)
    all_running: float | None = None
    polls = 0
    watch = _Elastic(progress, name) if elastic else None
    try:
        while True:
            views = job_tasks(client, service_id)
            polls += 1
            elapsed = time.monotonic() - t0
            told.update(views, elapsed)
            all_running = told.all_running
            if pump is not None:
                pump.update(views)
            nodes = node_states(client)
            if watch is not None:
                ended = _elastic_poll(client, service_id, watch, views, nodes,
                                      pump.seen if pump is not None else None)
                if ended is not None:
                    if pump is not None:
                        pump.drain(drain_timeout, progress, name)
                    ended.all_running_after = all_running
                    ended.elapsed = time.monotonic() - t0
                    return ended
                time.sleep(poll)
                continue
            failure = first_failure(views.values())
            lost = _lost(views, nodes)
            if failure is not None or lost:
                return _stop_after_failure(client, name, service_id, world_size, node_id,
                                           failure, lost, nodes, views, pump, progress, t0,
                                           all_running, stop_timeout, drain_timeout, tails)
            if len(views) >= world_size and all(v.phase == "done" for v in views.values()):
                if pump is not None:
                    pump.drain(drain_timeout, progress, name)
                elapsed = time.monotonic() - t0
                return FollowResult("done", 0, f"all {world_size} ranks exited 0 "
                                    f"({elapsed:.1f} s)", all_running_after=all_running,
                                    elapsed=elapsed)
            if (polls % 8 == 0 or not views) and _removed(client, service_id):
                return FollowResult("removed", 1, f"the job {name} was removed while "
                                    "running (by `swarmfd rm` or `docker service rm`)",
                                    all_running_after=all_running,
                                    elapsed=time.monotonic() - t0)
            time.sleep(poll)
    except KeyboardInterrupt:
        return FollowResult("interrupted", 130, "stopped following (Ctrl-C)",
                            all_running_after=all_running, elapsed=time.monotonic() - t0)
    finally:
        if pump is not None:
            pump.close()


@dataclass
class _Told:
    """What :func:`follow_job` said of a job so far: each line once, on a change."""

    name: str
    world_size: int
    progress: Callable[[str], None]
    summary: str = ""
    reasons: dict[int, str] = field(default_factory=dict)
    #: Seconds after the start when every rank ran (None: not yet).
    all_running: float | None = None

    def update(self, views: dict[int, TaskView], elapsed: float) -> None:
        """The phase counts, Swarm's pending reasons, and all ranks running."""
        summary = summarize(views.values(), self.world_size)
        if summary != self.summary:
            self.progress(f"{self.name}: {summary} ({elapsed:.1f} s)")
            self.summary = summary
        for rank, view in views.items():
            reason = view.error if view.phase in ("pending", "starting") else ""
            if reason and self.reasons.get(rank) != reason:
                self.progress(f"{self.name}: rank {rank} {view.state}: {reason}")
            self.reasons[rank] = reason
        if (self.all_running is None and len(views) >= self.world_size
                and all(v.phase in ("running", "done") for v in views.values())
                and any(v.phase == "running" for v in views.values())):
            self.all_running = elapsed
            self.progress(f"{self.name}: all {self.world_size} ranks running after "
                          f"{elapsed:.1f} s")


def _removed(client: docker.DockerClient, service_id: str) -> bool:
    """Whether the job's service is gone (removed by hand while it ran)."""
    try:
        client.api.inspect_service(service_id)
    except docker.errors.NotFound:
        return True
    return False


def _elastic_poll(client: docker.DockerClient, service_id: str, watch: _Elastic,
                  views: dict[int, TaskView], nodes: dict[str, NodeState],
                  seen: dict[int, float] | None) -> FollowResult | None:
    """One poll of an elastic job (:class:`_Elastic`): its outcome once it is over; the
    replacements that came after the end are stopped (the service scaled to 0)."""
    history = [TaskView.from_api(t) for t in client.api.tasks(filters={"service": service_id})]
    ended = watch.update(views, nodes, history, seen)
    if ended is not None and watch.late:
        watch.progress(f"{watch.name}: stopping {len(watch.late)} replacement(s) that came "
                       "after the job had finished")
        with contextlib.suppress(docker.errors.APIError):
            client.services.get(service_id).scale(0)
    return ended


#: Seconds every slot of an elastic job must have stayed ended before it counts as over
#: (Swarm creates the replacement of a failed task a moment after the failure).
ELASTIC_SETTLE = 3.0


class _Elastic:
    """Following an elastic job: a rank that fails or is lost is reported, not acted on
    (Swarm starts its replacement, which joins the running job); the job is over once a
    rank completed (the elastic function returned on every member: they exit 0
    together; a task still running then came too late, and is stopped), or once every
    slot's newest task has ended (a task of a node that left counts as ended) without
    that: failed, with the last failure's code. Either must hold for ELASTIC_SETTLE
    seconds."""

    def __init__(self, progress: Callable[[str], None], name: str) -> None:
        self.progress, self.name = progress, name
        self.told: set[str] = set()
        self.completed = False
        self.last_failure: TaskView | None = None
        self.settled: float | None = None
        #: ``time.monotonic()`` when a rank's exit 0 was first seen.
        self.done_at: float | None = None
        #: Tasks still there when the job was done (replacements that came too late).
        self.late: list[TaskView] = []

    def _late(self, v: TaskView, done: list[Any], seen: dict[int, float] | None) -> bool:
        """Whether ``v``, still running after an exit 0, is a replacement with nothing to
        join: made after the newest exit 0, or (Swarm made it as the members finished)
        silent since it was made while the ranks' status lines flow: a member writes
        one every few seconds until its cleanup, also when it works on after the
        elastic function returned."""
        if not done:
            return False
        if v.created > max(done):
            return True
        return bool(seen) and self.done_at is not None and \
            time.monotonic() - self.done_at > 2 * ELASTIC_SETTLE and \
            seen.get(v.rank, 0.0) < v.created.timestamp()

    def update(self, views: dict[int, TaskView], nodes: dict[str, NodeState],
               history: list[TaskView] | None = None,
               seen: dict[int, float] | None = None) -> FollowResult | None:
        """``views``: each slot's newest task; ``history``: every task of the job (a
        failed one is often replaced before a poll sees it as the newest); ``seen``:
        when (``time.time()``) each rank's latest status line came."""
        lost = {v.task_id for v in _lost(views, nodes)}
        for view in sorted([*views.values(), *(history or [])], key=lambda v: v.updated):
            if view.task_id in self.told:
                continue
            if view.phase == "done":
                self.completed = True
            elif view.phase == "failed" or view.task_id in lost:
                self.told.add(view.task_id)
                self.last_failure = view
                what = (failure_message(view) if view.task_id not in lost
                        else f"rank {view.rank} was lost with its node")
                self.progress(f"{self.name}: {what}; the others go on without it (Swarm "
                              "starts a replacement while it has restarts left)")
        # The members exit 0 together once the function returned on every one: a task
        # still there that was made after the newest exit 0 came too late (Swarm
        # reschedules the tasks of a lost node, whatever their restart policy), with
        # nothing to join. (A rank that left at a commit exits 0 too, alone: the others,
        # made before it, still run.)
        done = [v.updated for v in [*views.values(), *(history or [])] if v.phase == "done"]
        if done and self.done_at is None:
            self.done_at = time.monotonic()
        ended = all(v.terminal or v.task_id in lost or self._late(v, done, seen)
                    for v in views.values())
        if not views or not ended:
            self.settled = None
            return None
        now = time.monotonic()
        self.settled = self.settled or now
        if now - self.settled < ELASTIC_SETTLE:
            return None
        if self.completed:
            self.late = [v for v in views.values() if not v.terminal and v.task_id not in lost]
            return FollowResult("done", 0, "the elastic function returned on every member")
        failure = self.last_failure
        return FollowResult("failed", exit_code_for(failure) if failure else 1,
                            failure_message(failure) if failure else "every rank stopped",
                            failure=failure)


class _Tails:
    """The last :data:`TAIL_LINES` lines of each rank's output, kept by a wrapped sink."""

    def __init__(self) -> None:
        self._lines: dict[int, deque[bytes]] = {}
        self._lock = threading.Lock()

    def wrap(self, sink: Sink) -> Sink:
        def keep(rank: int, which: str, line: bytes, when: _dt.datetime | None) -> None:
            with self._lock:
                self._lines.setdefault(rank, deque(maxlen=TAIL_LINES)).append(line)
            sink(rank, which, line, when)
        return keep

    def snapshot(self) -> dict[int, list[str]]:
        with self._lock:
            return {rank: [line.decode("utf-8", errors="replace") for line in lines]
                    for rank, lines in self._lines.items()}


def _lost(views: dict[int, TaskView], nodes: dict[str, NodeState]) -> list[TaskView]:
    """The ranks whose node has left the Swarm (their tasks can no longer end)."""
    gone = [nid for nid, st in nodes.items() if st.state in NODE_GONE_STATES]
    return lost_ranks(views.values(), gone)


def _describe_failure(failure: TaskView | None, lost: list[TaskView],
                      nodes: dict[str, NodeState]) -> tuple[TaskView, str, str]:
    """The rank that caused the failure, its node's name and the message naming both: a
    rank whose node left, before ranks that failed for losing it."""
    def node_of(view: TaskView) -> NodeState:
        return nodes.get(view.node_id, NodeState(view.node_id[:12], "unknown"))

    if lost:
        cause = lost[0]
        state = node_of(cause)
        message = lost_message(cause, state.name, state.describe())
        if failure is not None:
            message += (f"; rank {failure.rank} failed after it "
                        f"({failure_message(failure, node_of(failure).name)})")
        return cause, state.name, message
    assert failure is not None
    node = node_of(failure).name
    return failure, node, failure_message(failure, node)


def _relabel_failure(client: docker.DockerClient, service_id: str, message: str) -> None:
    """Replace the failure label stop_job set (``swarmfd ls`` shows it) by a truer one."""
    with contextlib.suppress(docker.errors.APIError):
        set_labels(client, service_id, {LABEL_FAILURE: message[:1000]})


def _stop_after_failure(
    client: docker.DockerClient,
    name: str,
    service_id: str,
    world_size: int,
    node_id: str,
    failure: TaskView | None,
    lost: list[TaskView],
    nodes: dict[str, NodeState],
    views: dict[int, TaskView],
    pump: LogPump | None,
    progress: Callable[[str], None],
    t0: float,
    all_running: float | None,
    stop_timeout: float,
    drain_timeout: float,
    tails: _Tails,
) -> FollowResult:
    cause, node, message = _describe_failure(failure, lost, nodes)
    progress(f"{name}: {message}; stopping the other ranks")
    noticed = time.monotonic()
    if pump is not None:
        # Read the ended ranks first: scaling to 0 makes Swarm drop every task and its
        # logs (the failed rank's traceback).
        pump.wait_for([r for r, v in views.items() if v.terminal],
                      min(drain_timeout, ENDED_READ_TIMEOUT))
    try:
        report = stop_job(client, service_id, node_id, world_size, reason=message)
    except docker.errors.NotFound:
        report = None
    if report is not None and report.scaled_down:
        progress(f"{name}: scaled the service to 0 to stop ranks this node cannot stop "
                 "directly (Swarm drops their tasks)")
    deadline = noticed + stop_timeout
    views = job_tasks(client, service_id)
    # Until every rank ended or is lost (a lost node's rank never ends). A node is
    # declared down only after missed heartbeats: the cause is renamed once it is.
    while time.monotonic() < deadline:
        nodes = node_states(client) or nodes
        now_lost = _lost(views, nodes)
        if now_lost and not lost:
            lost = now_lost
            cause, node, message = _describe_failure(failure, lost, nodes)
            progress(f"{name}: {message}")
            _relabel_failure(client, service_id, message)
        lost_ids = {v.task_id for v in now_lost}
        if all(v.terminal or v.task_id in lost_ids for v in views.values()):
            break
        if pump is not None:
            pump.update(views)
        time.sleep(DEFAULT_POLL)
        views = job_tasks(client, service_id)
    stopped_after = time.monotonic() - noticed
    lost_ids = {v.task_id for v in lost}
    left = [r for r, v in views.items() if not v.terminal and v.task_id not in lost_ids]
    if left:
        progress(f"{name}: ranks {left} did not stop within {stop_timeout:.0f} s")
    elif world_size > 1:  # ranks stopped by scaling to 0 have no task any more
        listed = [v for v in views.values() if v.task_id not in lost_ids]
        shown = ", ".join(([summarize(listed)] if listed else [])
                          + ([f"{len(lost)} lost"] if lost else [])) or "no tasks"
        progress(f"{name}: {shown}; the other ranks stopped in {stopped_after:.1f} s")
    if pump is not None:
        pump.update(views)
        pump.drain(drain_timeout, progress, name)
    if failure is not None and not lost:  # its traceback may name the peer it lost
        root = root_failure(failure, views, tails.snapshot())
        if root is not failure:
            first, failure = failure, root
            cause, node, message = _describe_failure(root, [], nodes)
            message += f"; rank {first.rank} failed after it (it lost rank {root.rank})"
            progress(f"{name}: {message}")
            _relabel_failure(client, service_id, message)
    code = exit_code_for(failure) if failure is not None else 1
    return FollowResult("failed", code, message, failure=cause, failure_node=node,
                        all_running_after=all_running, elapsed=time.monotonic() - t0,
                        stopped_after=stopped_after, lost=tuple(v.rank for v in lost))


def print_logs(
    client: docker.DockerClient,
    service_id: str,
    node_id: str,
    output: Sink,
    *,
    ranks: Iterable[int] | None = None,
    follow: bool = False,
    poll: float = 0.5,
    drain_timeout: float = DRAIN_TIMEOUT,
) -> list[str]:
    """Write the logs of a job's ranks to ``output`` (merged in time order; ``follow``:
    as they come until every task ended); the problems met (a container gone, ...)."""
    wanted = None if ranks is None else set(ranks)
    if not follow:
        collected: list[tuple[_dt.datetime, int, int, str, bytes]] = []
        lock = threading.Lock()

        def collect(rank: int, which: str, line: bytes, when: _dt.datetime | None) -> None:
            with lock:
                collected.append((when or _dt.datetime.min.replace(tzinfo=_dt.timezone.utc),
                                  len(collected), rank, which, line))

        pump = LogPump(client, service_id, node_id, collect, ranks=wanted, follow=False,
                       timestamps=True)
        pump.update(job_tasks(client, service_id))
        try:
            pump.wait(drain_timeout)
        finally:
            pump.close()
        for when, _n, rank, which, line in sorted(collected, key=lambda c: (c[0], c[1])):
            output(rank, which, line, when)
        return pump.errors
    pump = LogPump(client, service_id, node_id, output, ranks=wanted, follow=True)
    try:
        while True:
            views = job_tasks(client, service_id)
            pump.update(views)
            mine = [v for r, v in views.items() if wanted is None or r in wanted]
            if mine and all(v.terminal for v in mine):
                pump.wait(drain_timeout)
                return pump.errors
            if not mine:
                try:
                    client.api.inspect_service(service_id)
                except docker.errors.NotFound:
                    pump.wait(drain_timeout)
                    return [*pump.errors, "the job was removed"]
            time.sleep(poll)
    finally:
        pump.close()
