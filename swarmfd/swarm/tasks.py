"""Pure views of a job's Swarm tasks: rank, phase, outcome, summaries.

The functions here take ``GET /tasks`` objects (plain dicts) and answer what
``deploy``, ``ls`` and ``ps`` ask, without talking to Docker. Swarm's task states, in
the phases swarmfd shows:

``pending``   new, allocated, pending, assigned (waiting for a node / resources)
``starting``  accepted, preparing, ready, starting (the node is creating the container)
``running``   running
``done``      complete (the command exited 0)
``failed``    failed (non-zero exit, ``ContainerStatus.ExitCode``), rejected (could not
              start: bad image, mount, ...)
``stopped``   shutdown, orphaned, remove (stopped by Swarm or by swarmfd)

A rank is its task's slot minus one (slots are 1-based in ``replicated`` mode).
"""

from __future__ import annotations

import datetime as _dt
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PHASES", "TaskView", "exit_code_for", "failure_message", "first_failure", "job_state",
           "latest_per_rank", "lost_message", "lost_peer", "lost_ranks", "parse_timestamp",
           "phase_of", "root_failure", "summarize"]

_PHASE_OF_STATE = {
    "new": "pending",
    "allocated": "pending",
    "pending": "pending",
    "assigned": "pending",
    "accepted": "starting",
    "preparing": "starting",
    "ready": "starting",
    "starting": "starting",
    "running": "running",
    "complete": "done",
    "failed": "failed",
    "rejected": "failed",
    "shutdown": "stopped",
    "orphaned": "stopped",
    "remove": "stopped",
}
#: Display order of the phases.
PHASES = ("pending", "starting", "running", "done", "failed", "stopped")
TERMINAL_PHASES = frozenset({"done", "failed", "stopped"})

_TS_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$")
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def parse_timestamp(text: str | None) -> _dt.datetime:
    """Docker's RFC 3339 timestamp (nanoseconds) in UTC; the epoch when unparseable."""
    match = _TS_RE.match(text or "")
    if match is None:
        return _EPOCH
    base, frac, zone = match.groups()
    micros = int((frac or "0")[:6].ljust(6, "0"))
    when = _dt.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(microsecond=micros)
    if zone in (None, "Z"):
        return when.replace(tzinfo=_dt.timezone.utc)
    sign = 1 if zone[0] == "+" else -1
    offset = _dt.timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
    return (when.replace(tzinfo=_dt.timezone.utc) - sign * offset)


def phase_of(state: str) -> str:
    """The swarmfd phase of a Swarm task state (unknown states count as pending)."""
    return _PHASE_OF_STATE.get(state, "pending")


@dataclass(frozen=True)
class TaskView:
    """The facts about one task that swarmfd shows and decides on."""

    task_id: str
    slot: int
    state: str
    desired_state: str
    node_id: str
    container_id: str
    exit_code: int | None  # only in a terminal state (Swarm reports 0 while running)
    error: str
    message: str
    updated: _dt.datetime
    created: _dt.datetime

    @property
    def rank(self) -> int:
        """The rank: slot - 1."""
        return self.slot - 1

    @property
    def phase(self) -> str:
        return phase_of(self.state)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @classmethod
    def from_api(cls, task: Mapping[str, Any]) -> TaskView:
        """Build a view from one ``GET /tasks`` object."""
        status = task.get("Status") or {}
        container = status.get("ContainerStatus") or {}
        state = str(status.get("State", "new"))
        raw_exit = container.get("ExitCode")
        terminal = phase_of(state) in TERMINAL_PHASES
        exit_code = int(raw_exit) if terminal and isinstance(raw_exit, int) else None
        return cls(
            task_id=str(task.get("ID", "")),
            slot=int(task.get("Slot") or 0),
            state=state,
            desired_state=str(task.get("DesiredState", "")),
            node_id=str(task.get("NodeID", "")),
            container_id=str(container.get("ContainerID", "")),
            exit_code=exit_code,
            error=str(status.get("Err", "")),
            message=str(status.get("Message", "")),
            updated=parse_timestamp(status.get("Timestamp")),
            created=parse_timestamp(task.get("CreatedAt")),
        )


def latest_per_rank(tasks: Iterable[Mapping[str, Any] | TaskView]) -> dict[int, TaskView]:
    """The newest task of each slot, by rank (Swarm keeps older ones after an update)."""
    best: dict[int, TaskView] = {}
    for raw in tasks:
        view = raw if isinstance(raw, TaskView) else TaskView.from_api(raw)
        if view.slot < 1:
            continue
        current = best.get(view.rank)
        if current is None or (view.created, view.updated) > (current.created, current.updated):
            best[view.rank] = view
    return dict(sorted(best.items()))


def first_failure(views: Iterable[TaskView]) -> TaskView | None:
    """The rank that ended the job: the earliest failed/rejected task, else the earliest
    stopped one (a rank Swarm shut down, e.g. its node left); ``None`` if none ended badly."""
    views = list(views)
    for phases in (("failed",), ("stopped",)):
        bad = [v for v in views if v.phase in phases]
        if bad:
            return min(bad, key=lambda v: (v.updated, v.rank))
    return None


#: How swarmfd's PeerLostError names the peer a rank lost (swarmfd/comm/channel.py):
#: "... lost rank K (host H, pid P, ADDRESS; task slot K+1): ...".
_LOST_PEER = re.compile(r"PeerLostError: .*?\blost rank (\d+) \(")


def lost_peer(lines: Iterable[str]) -> int | None:
    """The rank a rank's output says it lost: the last swarmfd ``PeerLostError`` in
    ``lines`` (its uncaught traceback ends with it), or ``None``."""
    found = None
    for line in lines:
        match = _LOST_PEER.search(line)
        if match:
            found = int(match.group(1))
    return found


def root_failure(failure: TaskView, views: Mapping[int, TaskView],
                 outputs: Mapping[int, Iterable[str]]) -> TaskView:
    """The failed rank that ended the job, from ``failure`` (the first Swarm reported):
    while the cause's output says it lost rank K (``PeerLostError``) and K failed too, K
    is the cause (tasks ending within milliseconds reach the manager in either order)."""
    cause, seen = failure, {failure.rank}
    while True:
        peer = lost_peer(outputs.get(cause.rank, ()))
        view = views.get(peer) if peer is not None else None
        if view is None or view.phase != "failed" or peer in seen:
            return cause
        cause = view
        seen.add(view.rank)


#: Node states (``GET /nodes`` ``Status.State``) whose tasks can no longer report.
NODE_GONE_STATES = frozenset({"down", "disconnected", "unknown"})


def lost_ranks(views: Iterable[TaskView], gone_nodes: Iterable[str]) -> list[TaskView]:
    """The tasks not ended whose node has left, by rank: lost (Swarm shows them running
    until the node is back)."""
    gone = set(gone_nodes)
    return sorted((v for v in views if not v.terminal and v.node_id in gone),
                  key=lambda v: v.rank)


def lost_message(lost: TaskView, node: str = "", node_state: str = "") -> str:
    """One line naming a lost rank and its node, e.g. ``rank 2 was lost: its node n3 is
    down (heartbeat failure)``."""
    where = f"its node {node}" if node else "its node"
    return f"rank {lost.rank} was lost: {where} is {node_state or 'down'}"


def exit_code_for(failure: TaskView) -> int:
    """The exit code ``deploy`` returns for a failed rank: its own code if it has one
    (1..255), else 1 (a rejected task, or one stopped by Swarm)."""
    code = failure.exit_code
    if code is not None and 0 < code < 256:
        return code
    return 1


def failure_message(failure: TaskView, node: str = "") -> str:
    """One line naming the rank, what happened, its exit code and node."""
    where = f" on node {node}" if node else ""
    if failure.state == "failed" and failure.exit_code:
        what = f"exited with code {failure.exit_code}"
    elif failure.state == "rejected":
        what = "was rejected (it could not start)"
    elif failure.state == "failed":
        what = "failed"
    else:
        what = f"was stopped by Swarm ({failure.state})"
    detail = failure.error or (failure.message if failure.state != "failed" else "")
    if "No such image" in detail or "manifest unknown" in detail \
            or "pull access denied" in detail:
        detail += (f" (the image is not on {'node ' + node if node else 'its node'}: push it to a "
                   "registry every node can reach and deploy from there, `swarmfd deploy "
                   "--build DIR --push REGISTRY` or `docker push` + `--pull`, or load it on "
                   "every node: `docker save IMAGE | ssh NODE docker load`)")
    return f"rank {failure.rank} {what}{where}" + (f": {detail}" if detail else "")


def summarize(views: Iterable[TaskView], world_size: int | None = None) -> str:
    """Counts per phase, e.g. ``"2 running, 1 pending"``; ranks without a task yet count
    as pending when ``world_size`` is given."""
    views = list(views)
    counts = Counter(v.phase for v in views)
    if world_size is not None and len(views) < world_size:
        counts["pending"] += world_size - len(views)
    parts = [f"{counts[p]} {p}" for p in PHASES if counts[p]]
    return ", ".join(parts) if parts else "no tasks"


def job_state(views: Iterable[TaskView], world_size: int) -> str:
    """One word for the whole job: failed (a rank failed), done (all completed),
    stopped (without a failure), running, starting or pending."""
    views = list(views)
    phases = Counter(v.phase for v in views)
    if phases["failed"]:
        return "failed"
    if world_size > 0 and phases["done"] >= world_size:
        return "done"
    if phases["stopped"]:
        return "stopped"
    if phases["running"]:
        return "running"
    if phases["starting"]:
        return "starting"
    return "pending"
