"""Talking to the Docker engine: connect, check, create, find, list, stop and remove jobs.

Every Docker call of the Swarm commands is here or in :mod:`.follow`; the
documents they send come from :mod:`.spec` and the answers are read through
:mod:`.tasks`. Each check that can fail runs *before* anything is created, and
each error (:mod:`.errors`) says what to do.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import docker
import docker.errors

from .errors import EngineUnavailableError, JobNotFoundError, SwarmJobError
from .spec import (
    LABEL_ELASTIC,
    LABEL_FAILURE,
    LABEL_IMAGE,
    LABEL_JOB,
    LABEL_STOPPED,
    LABEL_WORLD_SIZE,
    SHM_VOLUME_PREFIX,
    JobSpec,
    build_network_spec,
    build_service_spec,
    secret_name,
)
from .tasks import TaskView, job_state, latest_per_rank, parse_timestamp, summarize

__all__ = [
    "JobInfo",
    "Removal",
    "check_manager",
    "check_name_free",
    "check_networks",
    "connect",
    "create_job",
    "create_secret",
    "create_service",
    "find_service",
    "job_tasks",
    "list_jobs",
    "node_names",
    "node_states",
    "other_nodes",
    "remove_job",
    "remove_service",
    "remove_shm_volumes",
    "resolve_image",
    "scale_job",
    "set_labels",
    "stop_job",
]

API_TIMEOUT = 60.0
REMOVE_TIMEOUT = 60.0
ENTRYPOINT_MODULE = "swarmfd.entrypoint"


def connect(host: str | None = None, *, timeout: float = API_TIMEOUT,
            max_pool_size: int = 10) -> docker.DockerClient:
    """A client for ``host`` (a Docker host URL) or, when ``None``, the environment's
    (``DOCKER_HOST``, ``DOCKER_TLS_VERIFY``, ``DOCKER_CERT_PATH``, else the local socket).

    ``max_pool_size`` bounds the parallel connections (each followed log holds one).
    Raises :class:`EngineUnavailableError` when no engine answers.
    """
    where = host or "the Docker host of the environment (DOCKER_HOST or the local socket)"
    try:
        if host:
            client = docker.DockerClient(base_url=host, timeout=int(timeout),
                                         max_pool_size=max_pool_size)
        else:
            client = docker.from_env(timeout=int(timeout), max_pool_size=max_pool_size)
        client.ping()
    except docker.errors.DockerException as exc:
        raise EngineUnavailableError(
            f"no Docker engine answers at {where}: {exc}. Start the engine (e.g. "
            "`sudo scripts/setup-docker.sh engine`) or point --host / DOCKER_HOST at one"
        ) from None
    return client


def check_manager(client: docker.DockerClient) -> str:
    """Check the engine is a manager of an active Swarm; return this node's ID."""
    swarm = client.info().get("Swarm") or {}
    state = swarm.get("LocalNodeState", "inactive")
    if state != "active":
        raise EngineUnavailableError(
            f"this Docker engine is not part of a Swarm (state {state!r}): run "
            "`docker swarm init` to make it a one-node Swarm (or `docker swarm join` an "
            "existing one), then retry"
        )
    if not swarm.get("ControlAvailable"):
        raise EngineUnavailableError(
            "this Docker engine is a Swarm worker, not a manager: only managers can create "
            "services. Run swarmfd on a manager node, or point --host / DOCKER_HOST at one "
            "(`docker node ls` on a manager lists them)"
        )
    return str(swarm.get("NodeID", ""))


@dataclass(frozen=True)
class ImageChoice:
    """What the service will run (``ref``) and whether it has swarmfd's entrypoint."""

    ref: str
    local: bool
    has_entrypoint: bool | None  # None: not known (a registry image not present here)


def resolve_image(client: docker.DockerClient, image: str, *, pull: bool = False) -> ImageChoice:
    """Find ``image`` on this node and return its ID, so no task start asks a registry.

    With ``pull`` (a registry image every node can reach), the reference is passed to
    Swarm as given and each node pulls it. Without, a missing image is an error that
    says how to make it available: nothing is pulled, because tasks would then depend
    on a registry that may not exist.
    """
    try:
        found = client.images.get(image)
    except docker.errors.ImageNotFound:
        if pull:
            return ImageChoice(ref=image, local=False, has_entrypoint=None)
        raise SwarmJobError(
            f"image {image!r} is not on this node. Build it (`docker build -t {image} .`, or "
            "`scripts/setup-docker.sh image` for the swarmfd image) or load it (`docker load "
            "-i image.tar`) here; on a multi-node Swarm load it on every node, or push it to "
            "a registry every node can reach and deploy with --pull"
        ) from None
    except docker.errors.APIError as exc:
        raise SwarmJobError(f"image {image!r} cannot be looked up: {_explain(exc)}") from None
    config = found.attrs.get("Config") or {}
    words = list(config.get("Entrypoint") or []) + list(config.get("Cmd") or [])
    has_entrypoint = any(ENTRYPOINT_MODULE in str(w) for w in words)
    if pull:
        return ImageChoice(ref=image, local=True, has_entrypoint=has_entrypoint)
    return ImageChoice(ref=str(found.id), local=True, has_entrypoint=has_entrypoint)


def check_name_free(client: docker.DockerClient, name: str) -> None:
    """Raise :class:`SwarmJobError` if a service, network or job already uses ``name``."""
    services = [s for s in client.api.services(filters={"name": name})
                if s.get("Spec", {}).get("Name") == name]
    networks = [n for n in client.api.networks(names=[name]) if n.get("Name") == name]
    labelled = _labelled(client, name)
    if labelled["services"] or labelled["networks"] or labelled["secrets"]:
        raise SwarmJobError(
            f"a job named {name!r} already exists: pick another --name, or remove it first "
            f"with `swarmfd rm {name}`"
        )
    secret = secret_name(name)
    if [s for s in client.api.secrets(filters={"name": secret})
            if s.get("Spec", {}).get("Name") == secret]:
        raise SwarmJobError(
            f"a Docker secret named {secret!r} already exists (not a swarmfd job's): pick "
            f"another --name (or remove it: `docker secret rm {secret}`)"
        )
    if services:
        raise SwarmJobError(
            f"a Swarm service named {name!r} already exists (not a swarmfd job): pick "
            f"another --name (or remove it: `docker service rm {name}`)"
        )
    if networks:
        raise SwarmJobError(
            f"a network named {name!r} already exists (not a swarmfd job): pick another "
            f"--name (or remove it: `docker network rm {name}`)"
        )


def check_networks(client: docker.DockerClient, names: Iterable[str]) -> None:
    """Each extra ``--network`` must exist and be a Swarm-scoped (overlay) network."""
    for name in names:
        try:
            net = client.networks.get(name)
        except docker.errors.NotFound:
            raise SwarmJobError(
                f"--network {name}: no such network. Create it first: "
                f"`docker network create -d overlay --attachable {name}`"
            ) from None
        scope = net.attrs.get("Scope")
        if scope != "swarm":
            raise SwarmJobError(
                f"--network {name}: it is a {scope}-scoped {net.attrs.get('Driver')} network; "
                "Swarm services can only join swarm-scoped (overlay) networks"
            )


def create_secret(client: docker.DockerClient, job: JobSpec) -> str:
    """Create the job's secret ``<job>-secret`` (64 random hex digits, labelled with the
    job); return its ID. The value exists only in Swarm's encrypted store and in the
    ranks' ``/run/secrets/swarmfd_secret``: it is never printed, logged or labelled."""
    try:
        created = client.api.create_secret(secret_name(job.name),
                                           secrets.token_hex(32).encode("ascii"),
                                           labels=job.job_labels())
    except docker.errors.APIError as exc:
        raise SwarmJobError(
            f"Swarm refused to create the secret {secret_name(job.name)!r}: {_explain(exc)}"
        ) from None
    return str(created["ID"])


def create_service(client: docker.DockerClient, job: JobSpec, secret_id: str | None) -> str:
    """Create the job's service (its network must exist); return the service ID."""
    spec = build_service_spec(job, secret_id)
    try:
        created = client.api.create_service(
            spec["TaskTemplate"],
            name=spec["Name"],
            labels=spec["Labels"],
            mode=spec["Mode"],
            endpoint_spec=spec["EndpointSpec"],
        )
    except docker.errors.APIError as exc:
        raise SwarmJobError(
            f"Swarm refused to create the service {job.name!r}: {_explain(exc)}"
        ) from None
    return str(created["ID"])


def _tasks_or_none(client: docker.DockerClient, service_id: str) -> list[dict[str, Any]]:
    try:
        return list(client.api.tasks(filters={"service": service_id}))
    except docker.errors.NotFound:
        return []


def create_job(client: docker.DockerClient, job: JobSpec) -> tuple[str, str]:
    """Create the job's secret, network and service; return (service ID, secret ID).

    If any of them cannot be created (or this is interrupted), what was created is
    removed again, so a failed deploy leaves nothing behind.
    """
    secret_id = create_secret(client, job)
    network = None
    try:
        network = client.networks.create(**build_network_spec(job))
        return create_service(client, job, secret_id), secret_id
    except BaseException as exc:
        if network is not None:
            with contextlib.suppress(docker.errors.APIError):
                network.remove()
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_secret(secret_id)
        if isinstance(exc, docker.errors.APIError):
            raise SwarmJobError(
                f"Swarm refused to create the network {job.name!r}: {_explain(exc)}"
            ) from None
        raise


def remove_service(client: docker.DockerClient, service_id: str, *,
                   timeout: float = REMOVE_TIMEOUT) -> float:
    """Remove one service and wait (bounded) until its tasks are gone from the Swarm and
    its containers from this node, so a new service of the same name starts clean
    (its task names resolve to the new tasks only). Returns the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    with contextlib.suppress(docker.errors.NotFound):
        client.api.remove_service(service_id)
    _wait_containers_gone(client, service_id, deadline)
    while _tasks_or_none(client, service_id):
        if time.monotonic() > deadline:
            raise SwarmJobError(
                f"the tasks of service {service_id[:12]} are still listed "
                f"{timeout:.0f} s after it was removed"
            )
        time.sleep(0.2)
    return time.monotonic() - started


def find_service(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    """The raw service object of job ``name`` (by its label), or ``None``."""
    services = client.api.services(filters={"label": f"{LABEL_JOB}={name}"})
    return services[0] if services else None


def job_tasks(client: docker.DockerClient, service_id: str) -> dict[int, TaskView]:
    """The newest task of each rank of a service."""
    return latest_per_rank(client.api.tasks(filters={"service": service_id}))


def node_names(client: docker.DockerClient) -> dict[str, str]:
    """Node ID -> host name, for messages and ``ps``."""
    try:
        return {n["ID"]: n.get("Description", {}).get("Hostname", n["ID"][:12])
                for n in client.api.nodes()}
    except docker.errors.APIError:
        return {}


def other_nodes(client: docker.DockerClient, node_id: str) -> list[str]:
    """Host names of the other nodes that can run tasks (ready, availability active)."""
    try:
        nodes = client.api.nodes()
    except docker.errors.APIError:
        return []
    return sorted(
        n.get("Description", {}).get("Hostname", n["ID"][:12]) for n in nodes
        if n["ID"] != node_id and (n.get("Status") or {}).get("State") == "ready"
        and (n.get("Spec") or {}).get("Availability", "active") == "active"
    )


@dataclass(frozen=True)
class NodeState:
    """A Swarm node as the manager sees it: host name, state (ready, down, ...), why."""

    name: str
    state: str
    message: str = ""

    def describe(self) -> str:
        return f"{self.state} ({self.message})" if self.message else self.state


def node_states(client: docker.DockerClient) -> dict[str, NodeState]:
    """Node ID -> :class:`NodeState` (empty when the nodes cannot be listed)."""
    try:
        nodes = client.api.nodes()
    except docker.errors.APIError:
        return {}
    return {
        n["ID"]: NodeState(
            name=n.get("Description", {}).get("Hostname", n["ID"][:12]),
            state=str((n.get("Status") or {}).get("State", "unknown")),
            message=str((n.get("Status") or {}).get("Message", "")),
        )
        for n in nodes
    }


@dataclass(frozen=True)
class StopReport:
    """How :func:`stop_job` stopped the ranks that still ran."""

    stopped: tuple[int, ...]  # ranks whose containers were stopped (their tasks are kept)
    scaled_down: bool  # the service was scaled to 0 (Swarm then drops the tasks)


def stop_job(client: docker.DockerClient, service_id: str, node_id: str, world_size: int, *,
             reason: str = "", grace: float = 10.0) -> StopReport:
    """Stop every rank that still runs, keeping what can be kept for inspection.

    ``reason`` (e.g. which rank failed) is recorded in the service label
    ``org.swarmfd.failure``, and the ranks stopped here in ``org.swarmfd.stopped``;
    ``ls`` and ``ps`` show them. Running ranks on this node
    are stopped through their containers (SIGTERM, SIGKILL after ``grace`` seconds):
    their tasks end ``failed`` (exit 143) and stay, with their logs, in the task
    history. Ranks that cannot be reached that way (on other nodes, or not started
    yet) are stopped by scaling the service to 0, the only Swarm-wide stop short of
    removal; Swarm then drops the tasks (the job and its label stay).
    """
    views = job_tasks(client, service_id)
    local = [v for v in views.values()
             if v.phase == "running" and v.container_id and v.node_id == node_id]
    others = [v for v in views.values() if not v.terminal and v not in local]
    missing = world_size - len(views)
    if reason:
        set_labels(client, service_id, {
            LABEL_FAILURE: reason[:1000],
            LABEL_STOPPED: ",".join(str(v.rank) for v in local),
        })

    def stop(view: TaskView) -> None:
        with contextlib.suppress(docker.errors.APIError):
            client.api.stop(view.container_id, timeout=math.ceil(grace))

    threads = [threading.Thread(target=stop, args=(v,), daemon=True) for v in local]
    for t in threads:
        t.start()
    for t in threads:
        t.join(grace + API_TIMEOUT)
    scaled = False
    if others or missing > 0:
        with contextlib.suppress(docker.errors.NotFound):
            client.services.get(service_id).scale(0)
            scaled = True
    return StopReport(stopped=tuple(v.rank for v in local), scaled_down=scaled)


def set_labels(client: docker.DockerClient, service_id: str, labels: dict[str, str],
               replicas: int | None = None) -> None:
    """Add ``labels`` to a service (and set its ``replicas``) without touching its tasks.

    The update sends the service's current spec exactly as stored, with only the
    service labels (and the replicas) changed. (The SDK's ``fetch_current_spec`` would
    send the spec with the engine's defaults filled in, e.g. ``StopGracePeriod``: a
    different task template, which makes Swarm replace every running task.)
    """
    current = client.api.inspect_service(service_id)
    spec = current["Spec"]
    client.api.update_service(
        service_id,
        current["Version"]["Index"],
        task_template=spec["TaskTemplate"],
        name=spec["Name"],
        labels={**(spec.get("Labels") or {}), **labels},
        mode=spec.get("Mode") if replicas is None else {"Replicated": {"Replicas": replicas}},
        update_config=spec.get("UpdateConfig"),
        rollback_config=spec.get("RollbackConfig"),
        endpoint_spec=spec.get("EndpointSpec"),
    )


def scale_job(client: docker.DockerClient, name: str, ranks: int) -> int:
    """Grow or shrink the elastic job ``name`` to ``ranks`` ranks (its service's
    replicas; new tasks join the running job, stopped ones leave it at a commit);
    returns the number it had. :class:`.errors.JobNotFoundError` for no such job,
    :class:`.errors.SwarmJobError` for a job that is not elastic, or ``ranks`` below
    its minimum (``--min-n``)."""
    service = find_service(client, name)
    if service is None:
        raise JobNotFoundError(f"no job named {name!r} (`swarmfd ls` lists the jobs)")
    spec = service.get("Spec", {})
    if (spec.get("Labels") or {}).get(LABEL_ELASTIC) != "1":
        raise SwarmJobError(f"job {name} is not elastic: its world has the size it was "
                            "deployed with (deploy it with --elastic to scale it)")
    env = spec.get("TaskTemplate", {}).get("ContainerSpec", {}).get("Env") or []
    min_n = next((int(e.partition("=")[2]) for e in env
                  if e.startswith("SWARMFD_ELASTIC_MIN_N=") and e.partition("=")[2].isdigit()), 1)
    if ranks < min_n:
        raise SwarmJobError(f"job {name} needs at least {min_n} ranks (--min-n): cannot scale "
                            f"it to {ranks}")
    before = world_size_of(service)
    set_labels(client, service["ID"], {LABEL_WORLD_SIZE: str(ranks)}, replicas=ranks)
    return before


def world_size_of(service: dict[str, Any]) -> int:
    """The job's number of ranks (the label; scaling to 0 on failure keeps it)."""
    labels = service.get("Spec", {}).get("Labels") or {}
    with contextlib.suppress(ValueError):
        return int(labels.get(LABEL_WORLD_SIZE, ""))
    return int(service.get("Spec", {}).get("Mode", {}).get("Replicated", {}).get("Replicas", 0))


@dataclass(frozen=True)
class JobInfo:
    """One row of ``swarmfd ls``."""

    name: str
    image: str
    world_size: int
    state: str
    summary: str
    created: _dt.datetime
    service_id: str


def list_jobs(client: docker.DockerClient) -> list[JobInfo]:
    """Every swarmfd job of this Swarm (services and networks labelled with a job name),
    newest first."""
    services = client.api.services(filters={"label": LABEL_JOB})
    tasks_by_service: dict[str, list[dict[str, Any]]] = {}
    if services:
        for task in client.api.tasks():
            tasks_by_service.setdefault(task.get("ServiceID", ""), []).append(task)
    jobs: dict[str, JobInfo] = {}
    for svc in services:
        spec = svc.get("Spec", {})
        labels = spec.get("Labels") or {}
        name = labels.get(LABEL_JOB, spec.get("Name", "?"))
        world = world_size_of(svc)
        views = list(latest_per_rank(tasks_by_service.get(svc["ID"], [])).values())
        image = labels.get(LABEL_IMAGE) or spec.get("TaskTemplate", {}).get(
            "ContainerSpec", {}).get("Image", "?")
        jobs[name] = JobInfo(
            name=name,
            image=image,
            world_size=world,
            state="failed" if labels.get(LABEL_FAILURE) else job_state(views, world),
            summary=summarize(views, world),
            created=parse_timestamp(svc.get("CreatedAt")),
            service_id=str(svc["ID"]),
        )
    for net in client.api.networks(filters={"label": LABEL_JOB}):
        name = (net.get("Labels") or {}).get(LABEL_JOB, net.get("Name", "?"))
        if name not in jobs:
            jobs[name] = JobInfo(name=name, image="-", world_size=0, state="removed",
                                 summary=f"only its network is left (swarmfd rm {name})",
                                 created=parse_timestamp(net.get("Created")), service_id="")
    return sorted(jobs.values(), key=lambda j: (j.created, j.name), reverse=True)


@dataclass
class Removal:
    """What :func:`remove_job` removed."""

    services: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)
    #: The job's shared-memory volumes on this node (see swarmfd.swarm.spec).
    volumes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _labelled(client: docker.DockerClient, name: str) -> dict[str, list[dict[str, Any]]]:
    label = {"label": f"{LABEL_JOB}={name}"}
    return {
        "services": client.api.services(filters=label),
        "networks": client.api.networks(filters=label),
        "secrets": client.api.secrets(filters=label),
    }


def remove_job(client: docker.DockerClient, name: str, *,
               timeout: float = REMOVE_TIMEOUT, wait: bool = True) -> Removal:
    """Remove everything labelled ``org.swarmfd.job=<name>``, and nothing else.

    Services first; then wait (at most ``timeout`` seconds) until their containers on
    this node are gone, because a network cannot be removed while a container still
    holds an endpoint on it, and a job of the same name may follow; then the networks
    (retried within the same bound), secrets, and the job's shared-memory volume on this
    node (a node's volume lives in that node's engine: on other nodes it stays, an empty
    tmpfs volume record, until ``docker volume prune`` there). Without ``wait`` (a job
    whose tasks all ended, under a name nobody reuses) the containers are left to Swarm,
    which removes them within seconds. Raises :class:`JobNotFoundError` when nothing
    carries the label.
    """
    started = time.monotonic()
    deadline = started + timeout
    found = _labelled(client, name)
    if not any(found.values()):
        raise JobNotFoundError(f"no job named {name!r} (`swarmfd ls` lists the jobs)")
    removal = Removal()
    for svc in found["services"]:
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_service(svc["ID"])
        removal.services.append(svc.get("Spec", {}).get("Name", svc["ID"]))
    for svc in found["services"] if wait else ():
        _wait_containers_gone(client, svc["ID"], deadline)
    for net in found["networks"]:
        _remove_network(client, net, deadline)
        removal.networks.append(net.get("Name", net["Id"]))
    for secret in found["secrets"]:
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_secret(secret["ID"])
        removal.secrets.append(secret.get("Spec", {}).get("Name", secret["ID"]))
    removal.volumes = remove_shm_volumes(client, name)
    removal.seconds = time.monotonic() - started
    return removal


def remove_shm_volumes(client: docker.DockerClient, name: str) -> list[str]:
    """Remove job ``name``'s shared-memory volumes on this node (their containers are gone,
    see :func:`remove_job`); return their names. Only volumes named and labelled as the
    job's (swarmfd.swarm.spec.JobSpec.shm_volume) are touched."""
    found = client.api.volumes(filters={"label": f"{LABEL_JOB}={name}"}).get("Volumes") or []
    removed = []
    for vol in found:
        vname = str(vol.get("Name", ""))
        if not vname.startswith(f"{SHM_VOLUME_PREFIX}{name}-"):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_volume(vname)
        removed.append(vname)
    return removed


def _wait_containers_gone(client: docker.DockerClient, service_id: str, deadline: float) -> None:
    label = {"label": f"com.docker.swarm.service.id={service_id}"}
    while client.api.containers(all=True, filters=label):
        if time.monotonic() > deadline:
            raise SwarmJobError(
                f"the containers of service {service_id[:12]} still exist after the service "
                "was removed; retry `swarmfd rm` in a moment (`docker ps -a` shows them)"
            )
        time.sleep(0.2)


def _remove_network(client: docker.DockerClient, net: dict[str, Any], deadline: float) -> None:
    while True:
        try:
            client.api.remove_network(net["Id"])
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if time.monotonic() > deadline:
                raise SwarmJobError(
                    f"network {net.get('Name')} could not be removed: {_explain(exc)}; retry "
                    "`swarmfd rm` in a moment"
                ) from None
            time.sleep(0.3)


def _explain(exc: docker.errors.APIError) -> str:
    return str(getattr(exc, "explanation", None) or exc)


def docker_error() -> type[Exception]:
    """The Docker SDK's base exception (so callers outside this package need not import it)."""
    return docker.errors.DockerException
