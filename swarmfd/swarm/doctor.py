"""``swarmfd doctor``: check a Swarm before a job runs on it, and say how to fix it.

The checks, in order; each is a small function returning a :class:`Check` (name,
status ``ok``/``warning``/``problem``, detail, fix, figures):

``engine``     an engine answers at ``--host`` and is a manager of an active Swarm;
``nodes``      the Swarm's nodes: ready, availability, cores, memory, labels;
``image``      the image the job would run is on every node, or every node pulls it from
               its registry: a manager cannot list a worker's images, so the probe job
               (below) runs it on every node, and a node without it rejects its task;
``overlay``    an overlay network can be created and the probe job runs on every node;
``ports``      from the probe: every task reaches every other over the overlay (the
               ports to open when not);
``mtu``        from the probe: the path MTU on the overlay against its interfaces' MTU,
               and the hosts' path MTU against the overlay's plus VXLAN's 50 bytes;
``links``      from the probe: each node pair's latency and bandwidth through swarmfd's
               socket plane and its ZeroMQ plane;
``clocks``     from the probe: each node's clock offset from the first node's;
``tasks``      from the probe: ``/dev/shm``, memory and cores inside a task, per node;
``placement``  with ``-n N``: where N ranks would go, whether each node has the cores and
               the memory for its ranks' shared-memory segments and ``/dev/shm``, and
               the expected time of an all_reduce of 100 MiB (:func:`ring_all_reduce_seconds`).

The **probe** is a swarmfd job like any other (:mod:`.engine` creates it: a secret, an
attachable overlay network, a service) of one task per usable node, running
:mod:`.probe` in the image; it is removed whatever happens, Ctrl-C included (a second
Ctrl-C waits for the removal). A node that rejects its task (no image) is left out and
the probe runs again on the others, so they are still measured.

``deploy`` runs a fast subset before a job that may span nodes (:func:`preflight`): the
probe in its quick mode (the mesh only: image, ports, memory inside a task) and the
memory each node needs for its ranks; it refuses with the problems and their fixes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import docker
import docker.errors

from ..comm.planes.shm import SEGMENT_SIZE
from . import probe
from .engine import connect, create_job, find_service, job_tasks, remove_job, resolve_image
from .errors import EngineUnavailableError, JobNotFoundError, SwarmJobError
from .follow import LogPump
from .spec import DEFAULT_SHM_SIZE, LABEL_JOB, JobSpec
from .tasks import TaskView

if TYPE_CHECKING:
    from .build import BuildRequest

__all__ = [
    "STATUSES",
    "Check",
    "Node",
    "PreflightError",
    "ProbeResult",
    "check_clocks",
    "check_engine",
    "check_image",
    "check_links",
    "check_mtu",
    "check_nodes",
    "check_overlay",
    "check_placement",
    "check_ports",
    "check_tasks",
    "constraint_matches",
    "format_report",
    "memory_needed",
    "place_ranks",
    "preflight",
    "read_nodes",
    "report",
    "ring_all_reduce_seconds",
    "run_doctor",
    "run_probe",
]

STATUSES = ("ok", "warning", "problem")
#: The all_reduce whose time ``-n N`` estimates.
ALL_REDUCE_BYTES = 100 << 20
#: Clock offsets larger than this are a warning (log lines and checkpoint times of
#: different nodes no longer order; Swarm's certificates assume synchronised clocks).
CLOCK_TOLERANCE = 0.5
#: How long the probe may take, end to end (a node may pull the image first).
PROBE_TIMEOUT = 180.0
#: How long the probe's tasks wait for each other to start, and then to be reached.
START_TIMEOUT = 60.0
REACH_TIMEOUT = 5.0
#: After the tasks ended, how long their result lines may take to arrive.
RESULT_WAIT = 10.0
#: After a first task was rejected, how long to wait for the others to be placed.
REJECT_SETTLE = 3.0
#: How long a task may wait for Swarm to find it a node (pulling an image comes after).
PENDING_LIMIT = 15.0
#: How long the probe's containers and network may stay listed here after its removal.
GONE_WAIT = 20.0
PORTS_FIX = ("open these between every two nodes (host firewalls, cloud security groups): "
             "4789/udp (the overlay's VXLAN traffic), 7946/tcp and 7946/udp (gossip: how "
             "nodes learn each other's tasks), 2377/tcp to the managers, and IP protocol 50 "
             "(ESP) for encrypted overlays (--encrypt-network)")
IMAGE_FIX = ("load the image on {nodes} (e.g. `docker save {image} | ssh {node} docker "
             "load`), or push it to a registry every node can reach (`swarmfd deploy --push "
             "REGISTRY`, or `docker push` and `swarmfd deploy --pull`)")
AGAIN = "fix the problems above, then run `swarmfd doctor` again"
#: The probe's program, sent as its command (see :mod:`.probe`).
PROBE_SOURCE = Path(probe.__file__).read_text()


@dataclass
class Check:
    """One line of the report: what was checked, how it went, what to do, what was measured."""

    name: str
    status: str
    detail: str
    fix: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "fix": self.fix, "figures": self.figures}


def report(checks: Iterable[Check]) -> dict[str, Any]:
    """``--json``'s document: ``ok`` when no check found a problem (a job can run)."""
    items = list(checks)
    return {"ok": all(c.status != "problem" for c in items),
            "checks": [c.as_dict() for c in items]}


def format_report(checks: Iterable[Check]) -> str:
    """One line a check, its fix under it; the verdict last."""
    items = list(checks)
    lines = []
    for c in items:
        lines.append(f"{c.status:<8} {c.name:<10} {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':<19} fix: {c.fix}")
    problems = sum(c.status == "problem" for c in items)
    warnings = sum(c.status == "warning" for c in items)
    if problems:
        lines.append(f"{problems} problem(s) would stop a job ({warnings} warning(s))")
    else:
        lines.append(f"a job can run ({warnings} warning(s))")
    return "\n".join(lines)


# --- nodes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A Swarm node as the manager sees it, with the tasks that run there."""

    id: str
    name: str
    role: str = "worker"
    state: str = "ready"
    availability: str = "active"
    addr: str = ""
    cores: float = 0.0
    memory: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    engine_labels: dict[str, str] = field(default_factory=dict)
    os: str = "linux"
    arch: str = "x86_64"
    tasks: int = 0  # tasks running there now
    reserved: int = 0  # memory those tasks reserve

    @property
    def usable(self) -> bool:
        """Swarm places new tasks here: ready and active (not drained nor paused)."""
        return self.state == "ready" and self.availability == "active"

    @classmethod
    def from_api(cls, raw: dict[str, Any], tasks: int = 0, reserved: int = 0) -> Node:
        desc, spec, status = (raw.get(k) or {} for k in ("Description", "Spec", "Status"))
        resources, platform = desc.get("Resources") or {}, desc.get("Platform") or {}
        addr = str(status.get("Addr") or "")
        if addr in ("", "0.0.0.0"):  # a manager may report its address here instead
            addr = str((raw.get("ManagerStatus") or {}).get("Addr", "")).rpartition(":")[0]
        return cls(
            id=str(raw.get("ID", "")), name=str(desc.get("Hostname") or raw.get("ID", "")[:12]),
            role=str(spec.get("Role", "worker")), state=str(status.get("State", "unknown")),
            availability=str(spec.get("Availability", "active")), addr=addr,
            cores=(resources.get("NanoCPUs") or 0) / 1e9,
            memory=int(resources.get("MemoryBytes") or 0),
            labels=dict(spec.get("Labels") or {}),
            engine_labels=dict((desc.get("Engine") or {}).get("Labels") or {}),
            os=str(platform.get("OS", "")), arch=str(platform.get("Architecture", "")),
            tasks=tasks, reserved=reserved)


def read_nodes(client: docker.DockerClient) -> list[Node]:
    """Every node, with the count and memory reservations of the tasks running there."""
    count: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for task in client.api.tasks(filters={"desired-state": "running"}):
        node = task.get("NodeID")
        if not node:
            continue
        count[node] = count.get(node, 0) + 1
        wants = ((task.get("Spec") or {}).get("Resources") or {}).get("Reservations") or {}
        reserved[node] = reserved.get(node, 0) + int(wants.get("MemoryBytes") or 0)
    nodes = [Node.from_api(n, count.get(n["ID"], 0), reserved.get(n["ID"], 0))
             for n in client.api.nodes()]
    return sorted(nodes, key=lambda n: n.name)


_CONSTRAINT = re.compile(r"^\s*([A-Za-z0-9_.\-/]+)\s*(==|!=)\s*(.*?)\s*$")


def constraint_matches(node: Node, expr: str) -> bool:
    """Whether a placement constraint admits ``node``, as Swarm reads it: node.id,
    node.hostname, node.role, node.platform.os/arch, node.ip (an address or a network),
    node.labels.K, engine.labels.K; values compare without case; a missing label is
    unequal to anything. An attribute not known here admits every node."""
    match = _CONSTRAINT.match(expr)
    if match is None:
        return True
    attr, op, want = match.groups()
    key = attr.lower()
    known = {"node.id": node.id, "node.hostname": node.name, "node.role": node.role,
             "node.platform.os": node.os, "node.platform.arch": node.arch}
    if key == "node.ip":
        try:
            equal = ipaddress.ip_address(node.addr) in ipaddress.ip_network(want, strict=False)
        except ValueError:
            equal = False
    elif key in known or key.startswith(("node.labels.", "engine.labels.")):
        labels = node.labels if key.startswith("node.labels.") else node.engine_labels
        actual = known[key] if key in known else labels.get(attr.split(".", 2)[2])
        equal = actual is not None and actual.casefold() == want.casefold()
    else:
        return True
    return equal if op == "==" else not equal


def place_ranks(n: int, nodes: list[Node],
                max_per_node: int | None = None) -> tuple[dict[str, int], int]:
    """Where Swarm's spread puts ``n`` ranks on ``nodes``: each on a node with the fewest
    of the job's ranks (then the fewest tasks, then by name), at most ``max_per_node``
    on one. Returns ranks per node (nodes with none left out) and the ranks left over."""
    counts = {x.name: 0 for x in nodes}
    busy = {x.name: x.tasks for x in nodes}
    unplaced = 0
    for _ in range(n):
        room = [x for x in counts if max_per_node is None or counts[x] < max_per_node]
        if not room:
            unplaced += 1
            continue
        counts[min(room, key=lambda x: (counts[x], busy[x], x))] += 1
    return {k: v for k, v in counts.items() if v}, unplaced


def memory_needed(ranks: int, shm_size: int) -> int:
    """Bytes a node needs for ``ranks`` ranks of one job: each rank's shared-memory segment
    (SEGMENT_SIZE, only when the node has more than one rank: one alone uses TCP), and its
    ``/dev/shm`` tmpfs once filled (both count against the tasks' memory as pages are
    written)."""
    return (ranks * SEGMENT_SIZE if ranks > 1 else 0) + ranks * shm_size


def ring_all_reduce_seconds(nbytes: int, ranks: int, bandwidth: float, latency: float) -> float:
    """The cost model of ``-n N``'s estimate: a ring all_reduce of ``nbytes`` on ``ranks``
    ranks takes 2(N-1) steps (a reduce-scatter, then an all-gather), each sending
    nbytes/N over every link of the ring at once, so the slowest link sets the pace::

        2(N-1)/N * nbytes / bandwidth + 2(N-1) * latency

    ``bandwidth`` (bytes/s) and ``latency`` (s) of the slowest node pair. It leaves out
    the reduction's own arithmetic, hops within a node (shared memory, faster than the
    links) and the two-level algorithms' savings: an estimate, not a promise."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _names(items: Iterable[str]) -> str:
    items = sorted(items)
    return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


# --- the probe ----------------------------------------------------------------------------


@dataclass
class ProbeResult:
    """What the probe job found, by node name."""

    name: str = ""
    nodes: list[str] = field(default_factory=list)  # where it ran (the last attempt)
    rejected: dict[str, str] = field(default_factory=dict)  # node -> why it could not start
    failed: dict[str, str] = field(default_factory=dict)  # node -> how its task ended badly
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its facts line
    links: dict[str, Any] | None = None  # rank 0's links line (full mode)
    errors: list[str] = field(default_factory=list)
    rank_node: dict[int, str] = field(default_factory=dict)
    create_error: str = ""
    seconds: float = 0.0

    def node_of(self, rank: int | str) -> str:
        return self.rank_node.get(int(rank), f"rank {rank}")


def _routable(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified)


class _Interrupts:
    """Hold Ctrl-C while the probe is removed; raise it once that is done."""

    def __init__(self) -> None:
        self.pending = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(_signum: int, _frame: Any) -> None:
            self.pending = True

        previous = signal.signal(signal.SIGINT, note)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        if self.pending:
            raise KeyboardInterrupt


def _remove(client: docker.DockerClient, name: str, ended: bool, wait: bool,
            progress: Callable[[str], None]) -> None:
    """Remove the probe job, holding Ctrl-C meanwhile; say so if something stays.

    Tasks that had not ``ended`` are stopped first (:func:`_stop_tasks`). With ``wait``
    this returns once this node lists no container nor network of the job; without (the
    preflight, whose tasks all ended) the containers are left to Swarm, which removes
    them within about 2 s: that much less before deploy's job starts.
    """
    with _Interrupts().held():
        try:
            if not ended:
                _stop_tasks(client, name)
            remove_job(client, name, wait=wait)
            if wait:
                _all_gone(client, name)
        except JobNotFoundError:
            pass
        except (SwarmJobError, docker.errors.DockerException) as exc:
            progress(f"warning: the probe job {name} could not be removed ({exc}); remove "
                     f"it with `swarmfd rm {name}`")


def _stop_tasks(client: docker.DockerClient, name: str) -> None:
    """Scale the job to 0 and wait (bounded) until none of its tasks is still starting
    or running. A service removed while a node prepares its task can get that task's
    container created after the removal, when its tasks can no longer be listed; while
    the service exists they can."""
    service = find_service(client, name)
    if service is None:
        return
    with contextlib.suppress(docker.errors.NotFound):
        client.services.get(service["ID"]).scale(0)
    deadline = time.monotonic() + GONE_WAIT
    with contextlib.suppress(docker.errors.NotFound):
        while time.monotonic() < deadline and not all(
                v.terminal for v in job_tasks(client, service["ID"]).values()):
            time.sleep(0.2)


def _all_gone(client: docker.DockerClient, name: str) -> None:
    """Wait (bounded) until this node lists no container and no network of the job: the
    node's copy of the network of a task stopped while it started stays a few seconds
    (3 s here) after Swarm's is gone."""
    deadline = time.monotonic() + GONE_WAIT
    label = {"label": f"{LABEL_JOB}={name}"}
    while True:
        containers = client.api.containers(all=True, filters=label)
        networks = client.api.networks(filters=label)
        if not containers and not networks:
            return
        if time.monotonic() > deadline:
            left = [c["Id"][:12] for c in containers] + [n.get("Name", "") for n in networks]
            raise SwarmJobError(f"{', '.join(left)} still listed {GONE_WAIT:.0f} s after "
                                "the job was removed")
        for net in [] if containers else networks:
            with contextlib.suppress(docker.errors.APIError):
                client.api.remove_network(net["Id"])
        time.sleep(0.2)


def _probe_job(name: str, image: str, ref: str, nodes: list[Node], hosts: dict[str, str],
               others: list[str], mode: str, shm_size: int | None, encrypt: bool,
               constraints: tuple[str, ...]) -> JobSpec:
    args = {"mode": mode, "nodes": hosts,
            "start_timeout": START_TIMEOUT, "reach_timeout": REACH_TIMEOUT}
    return JobSpec(
        name=name, image=image, image_ref=ref, world_size=len(nodes),
        command=("python", "-c", PROBE_SOURCE, json.dumps(args)),
        constraints=constraints + tuple(f"node.id!={i}" for i in others),
        max_per_node=1, timeout=20.0, init_timeout=START_TIMEOUT,
        encrypt_network=encrypt, shm_size=shm_size)


def _watch(client: docker.DockerClient, service_id: str, node_id: str, world: int,
           deadline: float, full: bool) -> tuple[dict[int, TaskView], dict[int, list[str]]]:
    """Follow the probe's tasks until all ended (or one was rejected and the rest placed,
    or one found no node for PENDING_LIMIT, or the deadline), then wait for their result
    lines; return the tasks and lines."""
    lines: dict[int, list[str]] = {}
    lock = threading.Lock()

    def sink(rank: int, which: str, line: bytes, _when: Any) -> None:
        with lock:
            lines.setdefault(rank, []).append(
                ("" if which == "out" else "stderr: ") + line.decode("utf-8", "replace"))

    pump = LogPump(client, service_id, node_id, sink)
    started = time.monotonic()
    rejected_at = None
    views: dict[int, TaskView] = {}
    try:
        while time.monotonic() < deadline:
            views = job_tasks(client, service_id)
            pump.update(views)
            if any(v.state == "rejected" for v in views.values()):
                rejected_at = rejected_at or time.monotonic()
                settled = len(views) >= world and all(
                    v.phase in ("running", "done", "failed", "stopped") for v in views.values())
                if settled or time.monotonic() - rejected_at > REJECT_SETTLE:
                    break
            if len(views) >= world and all(v.terminal for v in views.values()):
                break
            if time.monotonic() - started > PENDING_LIMIT and any(
                    v.state == "pending" and v.error for v in views.values()):
                break  # Swarm finds no node for a task ("no suitable node ...")
            time.sleep(0.25)
        until = min(deadline, time.monotonic() + RESULT_WAIT)
        while time.monotonic() < until and not _results_in(views, lines, lock, full):
            time.sleep(0.1)
    finally:
        pump.close()
    with lock:
        return views, {r: list(v) for r, v in lines.items()}


def _results_in(views: dict[int, TaskView], lines: dict[int, list[str]],
                lock: threading.Lock, full: bool) -> bool:
    """Every task that completed printed its facts; in full mode, when those say every
    task reached every other (so the measurements ran), a links line came too."""
    with lock:
        found = {r: probe.parse_lines(v) for r, v in lines.items()}
    done = [r for r, v in views.items() if v.phase == "done"]
    facts = [next((x for x in found.get(r, []) if x.get("kind") == "facts"), None)
             for r in done]
    if any(f is None for f in facts):
        return False
    measured = full and len(done) == len(views) > 1 and all(
        all(s == "ok" for s in (f.get("reach") or {}).values()) for f in facts if f)
    return not measured or any(x.get("kind") == "links" for v in found.values() for x in v)


def _gather(result: ProbeResult, views: dict[int, TaskView], lines: dict[int, list[str]],
            names: dict[str, str], world: int) -> None:
    for rank, view in sorted(views.items()):
        node = names.get(view.node_id, view.node_id[:12] or f"rank {rank}")
        result.rank_node[rank] = node
        tail = [ln[len("stderr: "):] for ln in lines.get(rank, []) if ln.startswith("stderr: ")]
        if view.state == "rejected":
            result.rejected[node] = view.error or view.message
        elif view.phase == "failed":
            result.failed[node] = (f"its task failed (exit code {view.exit_code}): {view.error}"
                                   + (f"; last output: {' | '.join(tail[-3:])}" if tail else ""))
        elif view.phase != "done":
            result.failed[node] = f"its task was still {view.state} ({view.error or view.message})"
        for rec in probe.parse_lines(lines.get(rank, [])):
            if rec.get("kind") == "facts":
                result.facts[node] = rec
            elif rec.get("kind") == "links" and "error" in rec:
                result.errors.append(f"{node}: {rec['error']}")
            elif rec.get("kind") == "links":
                result.links = rec
    if len(views) < world:
        result.errors.append(f"only {len(views)} of {world} probe tasks were created")


def _probe_once(client: docker.DockerClient, node_id: str, image: str, ref: str,
                nodes: list[Node], hosts: dict[str, str], others: list[str], *, mode: str,
                shm_size: int | None,
                encrypt: bool, constraints: tuple[str, ...], timeout: float,
                progress: Callable[[str], None]) -> ProbeResult:
    name = f"swarmfd-{'doctor' if mode == 'full' else 'preflight'}-{secrets.token_hex(3)}"
    job = _probe_job(name, image, ref, nodes, hosts, others, mode, shm_size, encrypt,
                     constraints)
    result = ProbeResult(name=name, nodes=[n.name for n in nodes])
    started = time.monotonic()
    progress(f"probing {len(nodes)} node(s) with job {name} ({_short(ref)})")
    ended = False  # every task ended by itself
    try:
        try:
            service_id, _secret = create_job(client, job)
        except SwarmJobError as exc:
            result.create_error = str(exc)
            return result
        views, lines = _watch(client, service_id, node_id, job.world_size,
                              started + timeout, mode == "full")
        ended = len(views) == job.world_size and all(v.terminal for v in views.values())
        _gather(result, views, lines, {n.id: n.name for n in read_nodes(client)},
                job.world_size)
    finally:
        _remove(client, name, ended, mode == "full" or not ended, progress)
        result.seconds = time.monotonic() - started
    return result


def run_probe(client: docker.DockerClient, node_id: str, image: str, ref: str,
              nodes: list[Node], all_nodes: list[Node], *, mode: str = "full",
              shm_size: int | None = DEFAULT_SHM_SIZE, encrypt: bool = False,
              constraints: tuple[str, ...] = (), timeout: float = PROBE_TIMEOUT,
              retry: bool = True,
              progress: Callable[[str], None] = lambda _line: None) -> ProbeResult:
    """Run the probe job (:mod:`.probe`, ``mode`` "full" or "quick") with one task on each
    of ``nodes`` (the rest of ``all_nodes`` excluded), remove it, and return what it found.
    With ``retry``, nodes that rejected their task are left out and it runs again."""
    # Each task measures the hosts' path toward every ready node's own address.
    hosts = {n.name: n.addr for n in all_nodes if n.state == "ready" and _routable(n.addr)}

    def once(on: list[Node]) -> ProbeResult:
        others = [n.id for n in all_nodes if n.id not in {x.id for x in on}]
        return _probe_once(client, node_id, image, ref, on, hosts, others, mode=mode,
                           shm_size=shm_size, encrypt=encrypt, constraints=constraints,
                           timeout=timeout, progress=progress)

    result = once(nodes)
    left = [n for n in nodes if n.name not in result.rejected]
    if retry and result.rejected and left:
        progress(f"{_names(result.rejected)} cannot run the image: probing the other "
                 f"{len(left)} node(s) again")
        again = once(left)
        again.rejected = {**result.rejected, **again.rejected}
        again.seconds += result.seconds
        return again
    return result


# --- the checks ---------------------------------------------------------------------------


def check_engine(client: docker.DockerClient, where: str) -> Check:
    """The engine answers and is a manager of an active Swarm."""
    version = client.version()
    swarm = client.info().get("Swarm") or {}
    state = swarm.get("LocalNodeState", "inactive")
    figures = {"version": version.get("Version"), "api_version": version.get("ApiVersion"),
               "swarm": state, "manager": bool(swarm.get("ControlAvailable")),
               "nodes": swarm.get("Nodes"), "managers": swarm.get("Managers")}
    engine = f"Docker {figures['version']} at {where}"
    if state != "active":
        return Check("engine", "problem", f"{engine} is not part of a Swarm (state {state})",
                     "`docker swarm init` makes it a one-node Swarm; `docker swarm join` adds "
                     "it to one", figures)
    if not swarm.get("ControlAvailable"):
        return Check("engine", "problem", f"{engine} is a Swarm worker, not a manager",
                     "point --host (or DOCKER_HOST) at a manager: only managers create "
                     "services (`docker node ls` on a manager lists them)", figures)
    return Check("engine", "ok", f"{engine} answers: a manager of a Swarm of "
                 f"{swarm.get('Nodes')} node(s)", "", figures)


def check_nodes(nodes: list[Node]) -> Check:
    """Which nodes take tasks; the others, and how to bring them back."""
    figures = {n.name: {"role": n.role, "state": n.state, "availability": n.availability,
                        "cores": n.cores, "memory": n.memory, "labels": n.labels,
                        "address": n.addr, "tasks": n.tasks, "reserved_memory": n.reserved}
               for n in nodes}
    usable = [n for n in nodes if n.usable]
    down = [n.name for n in nodes if n.state != "ready"]
    held = {n.name: n.availability for n in nodes if n.state == "ready" and not n.usable}
    parts = [f"{n.name} ({n.role}, {n.cores:g} cores, {_size(n.memory)})" for n in usable]
    detail = f"{len(usable)} of {len(nodes)} node(s) take tasks: {', '.join(parts) or 'none'}"
    fixes = []
    if down:
        detail += f"; {_names(down)} {'is' if len(down) == 1 else 'are'} not ready"
        fixes.append(f"start the Docker engine of {_names(down)} and let it reach the managers "
                     "(2377/tcp, 7946/tcp and udp), or remove a node gone for good: "
                     "`docker node rm NAME`")
    for name, availability in sorted(held.items()):
        detail += f"; {name} is {'drained' if availability == 'drain' else availability}"
        fixes.append(f"`docker node update --availability active {name}` lets it take "
                     "tasks again")
    status = "problem" if not usable else "warning" if fixes else "ok"
    return Check("nodes", status, detail, "; ".join(fixes), figures)


_IMAGE_ERROR = re.compile(r"no such image|manifest unknown|pull access denied|not found|"
                          r"unauthorized|repository does not exist|pull", re.IGNORECASE)


def check_image(image: str, ref: str, result: ProbeResult) -> Check:
    """The image starts on every node (the probe's tasks ran it)."""
    missing = {n: why for n, why in result.rejected.items() if _IMAGE_ERROR.search(why)}
    ran = sorted(set(result.nodes) - set(result.rejected) - set(result.failed))
    figures = {"image": image, "ref": ref, "runs_on": ran, "missing": missing}
    shown = _short(image) if image == ref else f"{_short(image)} ({_short(ref)})"
    if missing:
        return Check("image", "problem", f"the image {shown} is not on "
                     f"{_names(missing)}: {next(iter(missing.values()))}",
                     IMAGE_FIX.format(nodes=_names(missing), image=_short(image),
                                      node=min(missing)), figures)
    if not ran:
        return Check("image", "warning", f"not checked: the probe did not run "
                     f"({result.create_error or 'no task started'})", AGAIN, figures)
    return Check("image", "ok", f"{shown} runs on {len(ran)} node(s)", "", figures)


def _short(image: str) -> str:
    """An image ID as Docker shows it (12 hex digits, which its commands take too)."""
    return image[7:19] if image.startswith("sha256:") and len(image) > 19 else image


def check_overlay(result: ProbeResult) -> Check:
    """The probe's overlay network was created and its tasks ran to the end."""
    figures = {"job": result.name, "seconds": round(result.seconds, 1), "nodes": result.nodes}
    if result.create_error:
        return Check("overlay", "problem", f"the probe job could not be created: "
                     f"{result.create_error}",
                     "create an overlay network by hand to see why (`docker network create -d "
                     "overlay --attachable swarmfd-try`); the managers' engine log says more",
                     figures)
    failed = {n: why for n, why in result.failed.items()
              if not (result.rejected and "still running" in why)}
    failed.update({n: why for n, why in result.rejected.items() if not _IMAGE_ERROR.search(why)})
    if failed:
        node, why = next(iter(sorted(failed.items())))
        return Check("overlay", "problem", f"the probe did not run through on "
                     f"{_names(failed)}: {node}: {why}",
                     "look at that node's engine (`docker node ps NODE`, its engine log); "
                     + AGAIN, figures)
    ran = len(set(result.nodes) - set(result.rejected))
    return Check("overlay", "ok", f"an overlay network was created and the probe ran on "
                 f"{ran} node(s) ({result.seconds:.1f} s)", "", figures)


def _one_node(result: ProbeResult) -> bool:
    return len(set(result.nodes) - set(result.rejected)) < 2


def check_ports(result: ProbeResult) -> Check:
    """Every probe task reached every other over the overlay (TCP, both ways)."""
    if _one_node(result):
        return Check("ports", "ok", "one node: no traffic between nodes to check", "",
                     {"pairs": {}})
    if not result.facts:
        return Check("ports", "warning", "not checked: no probe task reported", AGAIN)
    gone = set(result.rejected) | set(result.failed)
    pairs = {}
    for node, found in sorted(result.facts.items()):
        for slot, status in sorted((found.get("reach") or {}).items()):
            peer = result.node_of(int(slot) - 1)
            if peer not in gone:
                pairs[f"{node}>{peer}"] = status
    bad = {p: s for p, s in pairs.items() if s != "ok"}
    mesh = max(float(f.get("mesh_seconds") or 0) for f in result.facts.values())
    figures = {"pairs": pairs, "mesh_seconds": mesh}
    if bad:
        said = ", ".join(f"{p.replace('>', ' cannot reach ')} ({s})" for p, s in
                         sorted(bad.items())[:6])
        why = (" (a name that never resolves: the nodes do not gossip, 7946)"
               if any(s == "unresolved" for s in bad.values()) else "")
        return Check("ports", "problem", f"tasks cannot reach each other over the overlay: "
                     f"{said}{why}", PORTS_FIX, figures)
    return Check("ports", "ok", f"every task reached every other over the overlay "
                 f"({len(pairs)} connections in {mesh:.1f} s)", "", figures)


def _pair_names(result: ProbeResult, key: str) -> str:
    a, _sep, b = key.partition(">")
    return f"{result.node_of(a)}>{result.node_of(b)}"


def _mtu_pairs(result: ProbeResult) -> tuple[int, dict[str, dict[str, int]],
                                             dict[str, dict[str, int]]]:
    """The overlay's MTU; per ordered node pair on the overlay: the interface's MTU, the
    path MTU the kernel learned, the largest datagram that arrived; per node pair of the
    hosts: the path MTU the sender's node knows."""
    per_rank = (result.links or {}).get("mtu") or []
    overlay: dict[str, dict[str, int]] = {}
    hosts: dict[str, dict[str, int]] = {}
    for a, mine in enumerate(per_rank):
        for b, sent in sorted((mine.get("overlay") or {}).items()):
            got = (per_rank[int(b)].get("arrived") or {}).get(str(a), 0)
            overlay[_pair_names(result, f"{a}>{b}")] = {
                "interface": int(sent.get("route") or 0), "path": int(sent.get("learned") or 0),
                "arrived": int(got or 0)}
        for name, seen in sorted((mine.get("hosts") or {}).items()):
            hosts[f"{result.node_of(a)}>{name}"] = {"path": int(seen.get("learned") or 0)}
    iface = min((int(m.get("iface") or 0) for m in per_rank), default=0)
    return iface, overlay, hosts


def check_mtu(result: ProbeResult) -> Check:
    """The overlay's packets fit every path: a path that cannot carry them fragments them
    (slow: moby/moby#37855) or, where nothing says so, loses them (TCP stalls)."""
    if _one_node(result):
        return Check("mtu", "ok", "one node: the overlay does not leave it", "", {})
    if not (result.links or {}).get("mtu"):
        return Check("mtu", "warning", "not measured: the probe's measurements did not run",
                     AGAIN)
    iface, overlay, hosts = _mtu_pairs(result)
    need = iface + probe.VXLAN_OVERHEAD
    lost = {p: v for p, v in overlay.items() if v["arrived"] < min(v["interface"], v["path"])}
    small = {p: v for p, v in overlay.items() if v["path"] < v["interface"] and p not in lost}
    narrow = {p: v for p, v in hosts.items() if v["path"] < need}
    figures = {"overlay_mtu": iface, "needed_by_hosts": need, "overlay": overlay, "hosts": hosts}
    if not (lost or small or narrow):
        return Check("mtu", "ok", f"the overlay's {iface}-byte packets pass between every "
                     f"node pair; the hosts' paths carry the {need} bytes they need", "",
                     figures)
    said = []
    if lost:
        said.append(f"packets over {min(v['arrived'] for v in lost.values())} bytes are lost "
                     f"on the overlay ({_pairs(lost)})")
    if small:
        said.append(f"the overlay's path MTU is {min(v['path'] for v in small.values())}, not "
                    f"its {iface} ({_pairs(small)})")
    if narrow:
        said.append(f"the hosts' path MTU is {min(v['path'] for v in narrow.values())}, below "
                    f"the {need} its packets need ({_pairs(narrow)})")
    nodes = [set(p.split(">")) for p in {**lost, **small, **narrow}]
    common = set.intersection(*nodes)
    where = f"the link of {_names(common)}" if common else "those links"
    fix = (f"give {where} an MTU of at least {need} (the overlay's {iface} + "
           f"{probe.VXLAN_OVERHEAD} bytes of VXLAN), e.g. `ip link set dev IFACE mtu {need}`; "
           "where the network cannot carry that, an overlay of a smaller MTU fits it: "
           "`docker network create -d overlay --opt com.docker.network.driver.mtu=SIZE ...`")
    status = "problem" if lost else "warning"
    at = f"to and from {_names(common)}: " if common else ""
    return Check("mtu", status, at + "; ".join(said), fix, figures)


def _pairs(found: dict[str, Any]) -> str:
    names = [p.replace(">", " to ") for p in sorted(found)]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _plane_figures(result: ProbeResult, plane: str) -> dict[str, dict[str, float]]:
    found = ((result.links or {}).get("planes") or {}).get(plane) or {}
    return {_pair_names(result, k): {"latency_us": round(float(v.get("latency_us", 0)), 1),
                                     "gbps": round(float(v.get("send_gbps", 0)), 3)}
            for k, v in sorted(found.items())}


def _spread(values: list[float], unit: str, digits: int) -> str:
    if not values:
        return "?"
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def check_links(result: ProbeResult) -> Check:
    """Each node pair's latency and bandwidth, through both of swarmfd's TCP planes."""
    if _one_node(result):
        return Check("links", "ok", "one node: ranks there use shared memory, no links", "", {})
    if result.errors:
        return Check("links", "problem", f"swarmfd's ranks failed between the nodes: "
                     f"{'; '.join(result.errors[:3])}",
                     "see ports and mtu above; a collective timeout means packets are lost "
                     "on the way", {"errors": result.errors})
    if not result.links:
        return Check("links", "warning", "not measured: the probe's measurements did not run",
                     AGAIN)
    figures: dict[str, Any] = {p: _plane_figures(result, p) for p in ("socket", "zmq")}
    parts = []
    for plane in ("socket", "zmq"):
        pairs = figures[plane].values()
        parts.append(f"{plane} plane: latency {_spread([v['latency_us'] for v in pairs], ' us', 0)}"
                     f", {_spread([v['gbps'] for v in pairs], ' GB/s', 2)}")
    skipped = [_pair_names(result, k.replace("-", ">")) for k in result.links.get("skipped", [])]
    figures["skipped"] = skipped
    if skipped:
        return Check("links", "warning", f"not measured between {', '.join(skipped)} (packets "
                     "lost, see mtu); " + "; ".join(parts), "see mtu above", figures)
    return Check("links", "ok", "; ".join(parts), "", figures)


def check_clocks(result: ProbeResult) -> Check:
    """Each node's clock against the first node's (the probe's rank 0)."""
    if _one_node(result):
        return Check("clocks", "ok", "one node: one clock", "", {})
    offsets = (result.links or {}).get("clock")
    if not offsets:
        return Check("clocks", "warning", "not measured: the probe's measurements did not run",
                     AGAIN)
    by_node = {result.node_of(r): round(float(s), 6) for r, s in sorted(offsets.items())}
    reference = result.node_of(0)
    figures = {"reference": reference, "offsets_s": by_node, "tolerance_s": CLOCK_TOLERANCE}
    worst = max(by_node.items(), key=lambda kv: abs(kv[1]))
    if abs(worst[1]) > CLOCK_TOLERANCE:
        off = {n: s for n, s in by_node.items() if abs(s) > CLOCK_TOLERANCE}
        return Check("clocks", "warning", f"{_names(off)} differ from {reference} by up to "
                     f"{worst[1]:+.2f} s", "synchronise the nodes' clocks: chrony, ntpd or "
                     "systemd-timesyncd on every node", figures)
    return Check("clocks", "ok", f"within {abs(worst[1]) * 1e3:.1f} ms of {reference}", "",
                 figures)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _task_memory(found: dict[str, Any]) -> int | None:
    """Memory a task on that node can still take: available, or its cgroup's room."""
    mem = found.get("memory") or {}
    values = [_int(mem.get("available"))]
    limit = _int(mem.get("limit"))
    if limit is not None:
        values.append(limit - (_int(mem.get("usage")) or 0))
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _task_cores(found: dict[str, Any]) -> float | None:
    cores = found.get("cores") or {}
    values = [v for v in (cores.get("affinity"), cores.get("quota"))
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return float(min(values)) if values else None


def check_tasks(result: ProbeResult, shm_size: int | None) -> Check:
    """``/dev/shm``, memory and cores as a task sees them, per node."""
    if not result.facts:
        return Check("tasks", "warning", "not measured: no probe task reported", AGAIN)
    figures = {node: {"shm_bytes": (f.get("shm") or {}).get("size"),
                      "shm_free": (f.get("shm") or {}).get("free"),
                      "memory_available": _task_memory(f),
                      "memory_limit": (f.get("memory") or {}).get("limit"),
                      "cores": _task_cores(f)}
               for node, f in sorted(result.facts.items())}
    shm = [v["shm_bytes"] for v in figures.values() if _int(v["shm_bytes"]) is not None]
    mem = [v["memory_available"] for v in figures.values() if v["memory_available"] is not None]
    cores = [v["cores"] for v in figures.values() if v["cores"] is not None]
    detail = (f"/dev/shm {_size(min(shm)) if shm else '?'}, memory available "
              f"{_size(min(mem)) if mem else '?'}"
              + (f", {min(cores):g} core(s) a task" if cores else "")
              + f" (least of {len(figures)} node(s))")
    short = {n: v["shm_bytes"] for n, v in figures.items()
             if shm_size and _int(v["shm_bytes"]) is not None and v["shm_bytes"] < shm_size}
    if short:
        return Check("tasks", "warning", f"/dev/shm in a task on {_names(short)} is "
                     f"{_size(min(short.values()))}, not the {_size(shm_size)} asked for",
                     "that engine did not mount the tmpfs over /dev/shm: update Docker on "
                     "those nodes", figures)
    return Check("tasks", "ok", detail, "", figures)


def _free_memory(node: Node, found: dict[str, Any] | None) -> int | None:
    """Memory the job can have on ``node``: its memory less what other tasks reserve, and
    no more than a task there found available."""
    values = [node.memory - node.reserved if node.memory else None]
    if found:
        values.append(_task_memory(found))
    known = [v for v in values if v is not None]
    return max(0, min(known)) if known else None


def _estimate(result: ProbeResult, used: set[str], ranks: int) -> dict[str, float]:
    """Seconds of an all_reduce of ALL_REDUCE_BYTES per plane, from the slowest pair of
    the nodes in use (:func:`ring_all_reduce_seconds`)."""
    found = {}
    for plane in ("socket", "zmq"):
        pairs = [v for k, v in _plane_figures(result, plane).items()
                 if set(k.split(">")) <= used]
        if len(used) < 2 or not pairs or min(v["gbps"] for v in pairs) <= 0:
            continue
        bandwidth = min(v["gbps"] for v in pairs) * 1e9
        latency = max(v["latency_us"] for v in pairs) / 1e6
        found[plane] = round(ring_all_reduce_seconds(ALL_REDUCE_BYTES, ranks, bandwidth,
                                                     latency), 3)
    return found


def check_placement(n: int, nodes: list[Node], result: ProbeResult, shm_size: int,
                    max_per_node: int | None = None, *, estimate: bool = True) -> Check:
    """Where ``n`` ranks would go; each node's cores and memory for its ranks; the
    expected time of an all_reduce of 100 MiB."""
    counts, unplaced = place_ranks(n, nodes, max_per_node)
    by_name = {x.name: x for x in nodes}
    rows: dict[str, Any] = {}
    short, crowded = {}, {}
    for name, ranks in sorted(counts.items()):
        found = result.facts.get(name)
        need = memory_needed(ranks, shm_size)
        free = _free_memory(by_name[name], found)
        cores = [c for c in (by_name[name].cores or None,
                             _task_cores(found) if found else None) if c]
        rows[name] = {"ranks": ranks, "memory_needed": need, "memory_free": free,
                      "cores": min(cores) if cores else None}
        if free is not None and need > free:
            short[name] = f"{name} has {_size(free)} for its {ranks} rank(s), which need " \
                          f"{_size(need)} ({_size(need - ranks * shm_size)} of shared-memory " \
                          f"segments, {ranks} x {_size(shm_size)} of /dev/shm)"
        if cores and ranks > min(cores):
            crowded[name] = f"{name} runs {ranks} ranks on {min(cores):g} core(s)"
    seconds = _estimate(result, set(counts), n) if estimate else {}
    figures = {"ranks": n, "per_node": rows, "unplaced": unplaced, "shm_size": shm_size,
               "all_reduce_bytes": ALL_REDUCE_BYTES, "all_reduce_seconds": seconds,
               "model": "2(N-1)/N * bytes / bandwidth + 2(N-1) * latency, slowest node pair"}
    where = ", ".join(f"{r['ranks']} on {name}" for name, r in rows.items())
    detail = f"-n {n}: {where or 'nowhere'}"
    if seconds:
        detail += "; all_reduce of 100 MiB about " + ", ".join(
            f"{s:.2f} s ({p})" for p, s in seconds.items())
    if unplaced:
        return Check("placement", "problem", f"{detail}; {unplaced} rank(s) find no node "
                     f"(at most {max_per_node} a node)", "fewer ranks, a larger "
                     "--max-per-node, or more nodes", figures)
    if short:
        return Check("placement", "problem", "; ".join(short.values()),
                     f"give {_names(short)} more memory (or stop what reserves it), put fewer "
                     "ranks there (--max-per-node, --constraint), or mount a smaller "
                     f"/dev/shm (--shm-size, now {_size(shm_size)})", figures)
    if crowded:
        return Check("placement", "warning", f"{detail}; " + "; ".join(crowded.values()),
                     "ranks sharing a core slow each other down: fewer ranks a node "
                     "(--max-per-node) or more nodes", figures)
    return Check("placement", "ok", detail, "", figures)


# --- the command and deploy's preflight -----------------------------------------------------


def _image(client: docker.DockerClient, image: str, build: BuildRequest | None,
           progress: Callable[[str], None]) -> tuple[str, str]:
    """The image's name and what the probe runs: its ID when it is on this node (as deploy
    runs it), else the name as given (every node pulls it from its registry)."""
    if build is not None:
        from .build import build_project

        image = build_project(client, build.directory, base=build.base,
                              repository=build.repository, extras=build.extras,
                              options=build.options, rebuild=build.rebuild,
                              progress=progress).ref
    try:
        return image, resolve_image(client, image).ref
    except SwarmJobError:
        return image, image


def run_doctor(host: str | None = None, *, image: str | None = None,
               build: BuildRequest | None = None,
               world_size: int | None = None, shm_size: int = DEFAULT_SHM_SIZE,
               progress: Callable[[str], None] = lambda _line: None) -> list[Check]:
    """Every check in order, against the Swarm manager at ``host`` (``build``: a
    :class:`~.build.BuildRequest` whose image is built first; ``world_size``: the
    placement of a job of that many ranks). The probe job is removed before this
    returns, also on Ctrl-C."""
    where = host or "DOCKER_HOST (or the local socket)"
    try:
        client = connect(host)
    except EngineUnavailableError as exc:
        return [Check("engine", "problem", str(exc), "start the engine, or point --host "
                      "(or DOCKER_HOST) at a Swarm manager")]
    try:
        checks = [check_engine(client, where)]
        if checks[-1].status == "problem":
            return checks
        nodes = read_nodes(client)
        checks.append(check_nodes(nodes))
        usable = [n for n in nodes if n.usable]
        if not usable:
            return checks
        name, ref = _image(client, image or "swarmfd:latest", build, progress)
        node_id = str((client.info().get("Swarm") or {}).get("NodeID", ""))
        result = run_probe(client, node_id, name, ref, usable, nodes, shm_size=shm_size,
                           progress=progress)
        checks += [check_image(name, ref, result), check_overlay(result), check_ports(result),
                   check_mtu(result), check_links(result), check_clocks(result),
                   check_tasks(result, shm_size)]
        if world_size:
            checks.append(check_placement(world_size, usable, result, shm_size))
        return checks
    finally:
        client.close()


class PreflightError(SwarmJobError):
    """deploy's preflight found what would stop the job; the message lists it with fixes."""


def preflight(client: docker.DockerClient, job: JobSpec, node_id: str,
              progress: Callable[[str], None]) -> list[Check]:
    """deploy's fast subset of the checks, before a job that may span nodes: the image on
    every node the job may use, the ports between them, and each node's memory for its
    ranks' segments and ``/dev/shm``. Nothing runs for one rank or one usable node.
    Raises :class:`PreflightError` naming each problem and its fix."""
    if job.world_size < 2:
        return []
    nodes = read_nodes(client)
    usable = [n for n in nodes if n.usable
              and all(constraint_matches(n, c) for c in job.constraints)]
    if len(usable) < 2:
        return []
    started = time.monotonic()
    result = run_probe(client, node_id, job.image, job.image_ref, usable, nodes,
                       mode="quick", shm_size=job.shm_size, encrypt=job.encrypt_network,
                       constraints=job.constraints, retry=False,
                       progress=lambda line: progress(f"preflight: {line}"))
    checks = [check_image(job.image, job.image_ref, result), check_overlay(result),
              check_ports(result),
              check_placement(job.world_size, usable, result, job.shm_size or 0,
                              job.max_per_node, estimate=False)]
    problems = [c for c in checks if c.status == "problem"]
    if problems:
        raise PreflightError(
            "the preflight found what would stop this job (--no-preflight skips it):\n"
            + "\n".join(f"  {c.name}: {c.detail}\n    fix: {c.fix}" for c in problems))
    progress(f"preflight: the image, the ports and memory are fine on {len(usable)} nodes "
             f"({time.monotonic() - started:.1f} s)")
    return checks
