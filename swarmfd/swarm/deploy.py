"""``swarmfd deploy`` as a library call: check, create, follow, clean up, exit code.

:func:`run_deploy` takes a validated :class:`~.request.DeployRequest` (built from the
command line before any engine is contacted; its ``job`` is the :class:`~.spec.JobSpec`)
and does the rest:

1. checks, before anything is created: an engine answers, it is a Swarm manager, the
   job name is free, the extra networks exist, the image is on this node (its ID is
   then what the service runs, so no task start consults a registry); with
   ``preflight``, before a job that may span nodes, the doctor's fast subset
   (:func:`.doctor.preflight`: the image on every node, the ports, memory);
2. creates the job's secret (``<job>-secret``, mounted in every rank as
   ``/run/secrets/swarmfd_secret``), overlay network and service (a failure removes
   what was created);
   With ``--build DIR`` the project is built first (:mod:`.build`), after
   the checks that need no image; with ``--push REGISTRY`` the image is
   pushed and the service runs it by its registry digest, pulled by each node.
   Without a registry on a Swarm of several nodes, deploy warns that ranks placed
   on other nodes cannot start, and how to fix that;
3. with ``--detach``, returns; else follows the job (:func:`.follow.follow_job`):
   progress on ``progress``, every rank's output to ``output``;
4. when every rank exited 0: removes the job unless ``--keep``; when a rank failed: the
   others were stopped, and the job is kept for inspection unless ``--rm``. Ctrl-C
   stops following and leaves the job running.
5. with ``--max-restarts K``, a failed group is recreated (same secret and network,
   ``SWARMFD_RESTART_COUNT`` k+1) up to K times before 4. applies.

Exit code: 0 when every rank exited 0; the failed rank's exit code (1 when it has
none: rejected, or stopped by Swarm); 130 after Ctrl-C; 1 when the job was removed
while being followed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..jobs import job_line
from . import doctor
from .build import build_project, push_image
from .engine import (
    check_manager,
    check_name_free,
    check_networks,
    connect,
    create_job,
    create_service,
    other_nodes,
    remove_job,
    remove_service,
    resolve_image,
)
from .follow import FollowResult, Sink, follow_job
from .request import DeployRequest

__all__ = ["DeployResult", "interrupt_hint", "run_deploy", "stderr_progress"]


@dataclass
class DeployResult:
    """What happened, for the command line and the tests."""

    name: str
    exit_code: int
    service_id: str = ""
    follow: FollowResult | None = None
    removed: bool = False
    created_after: float = 0.0  # seconds from the call to the service existing
    restarts: int = 0  # how often the group was recreated (--max-restarts)


def interrupt_hint(name: str) -> str:
    """What to do with a job one stopped following."""
    return (
        f"job {name} keeps running.\n"
        f"  follow it again:  swarmfd logs -f {name}\n"
        f"  see its ranks:    swarmfd ps {name}\n"
        f"  stop and remove:  swarmfd rm {name}"
    )


def run_deploy(
    request: DeployRequest,
    *,
    output: Sink | None,
    progress: Callable[[str], None],
    poll: float = 0.3,
) -> DeployResult:
    """Create the job of ``request`` on its Swarm and (unless ``--detach``) follow it.

    With ``--build`` the project's image is built first (``request.job.image`` is then
    a placeholder); with ``--push`` the image is pushed to that registry and run from
    there (every node pulls it by digest). With ``--no-preflight`` unset, the nodes the job
    may use are checked first (:func:`.doctor.preflight`; nothing on one node).

    With ``--max-restarts`` K, a failed group is torn down (its service removed, its
    network and secret kept) and created again with ``SWARMFD_RESTART_COUNT`` k+1, up
    to K times; each restart is reported on ``progress``. An elastic job's tasks are
    restarted by Swarm itself, one by one (:mod:`.spec`), and followed until every
    slot has ended (:func:`.follow.follow_job`).

    Raises :class:`~.errors.SwarmJobError` (or a subclass) before anything is created
    when a check fails; the message says what to do.
    """
    job, build, push = request.job, request.build_request, request.push
    pull, detach, max_restarts = request.pull, request.detach, request.max_restarts
    keep = request.keep_policy
    started = time.monotonic()
    # Each followed rank holds two log connections; keep them out of the pool's way.
    client = connect(request.host, max_pool_size=max(10, 2 * job.world_size + 6))
    try:
        node_id = check_manager(client)
        check_name_free(client, job.name)
        check_networks(client, job.networks)
        image_name = job.image
        if build is not None:
            built = build_project(client, build.directory, base=build.base,
                                  repository=build.repository, extras=build.extras,
                                  options=build.options, rebuild=build.rebuild,
                                  progress=progress)
            image_name = built.ref
        image = resolve_image(client, image_name, pull=pull or bool(push))
        if push:
            pushed = push_image(client, image_name, push, progress=progress)
            image = dataclasses.replace(image, ref=pushed)
        elif not pull and not job.constraints and not image_name.startswith("sha256:"):
            # An image given by its ID is taken to be on every node already (`docker
            # save | docker load` keeps the ID); a tag or a fresh build is not.
            others = other_nodes(client, node_id)
            if others:
                progress(
                    f"warning: this Swarm has {len(others) + 1} nodes and the image "
                    f"{image_name} is only known to be on this one: ranks placed on "
                    f"{', '.join(others[:3])}{' ...' if len(others) > 3 else ''} cannot start "
                    "unless it is there too. Push it to a registry every node can reach "
                    "(--push REGISTRY), load it on every node (`docker save IMAGE | ssh NODE "
                    "docker load`; then deploy it by its ID, sha256:..., and this warning "
                    "goes), or keep the ranks here (--constraint node.hostname==...)"
                )
        if image.has_entrypoint is False:
            progress(
                f"warning: image {image_name!r} does not use swarmfd's entrypoint "
                "(python -m swarmfd.entrypoint), so the ranks get no RANK from their task "
                "slot; build your image FROM the swarmfd image, or set "
                'ENTRYPOINT ["python", "-m", "swarmfd.entrypoint"]'
            )
        job = dataclasses.replace(job, image=image_name, image_ref=image.ref, restart_count=0)
        if not request.no_preflight:
            doctor.preflight(client, job, node_id, progress)
        service_id, secret_id = create_job(client, job)
        result = DeployResult(job.name, 0, service_id, created_after=time.monotonic() - started)
        if detach:
            return result
        ranks = "1 rank" if job.world_size == 1 else f"{job.world_size} ranks"
        progress(f"created job {job.name}: {ranks} of {job.image} ({image.ref[:19]})")
        while True:
            records: dict[int, dict[str, Any]] = {}
            followed = follow_job(client, job.name, service_id, job.world_size, node_id,
                                  output=output, progress=progress, started=started, poll=poll,
                                  records=records, elastic=job.elastic)
            if followed.outcome != "failed" or job.restart_count >= max_restarts or \
                    job.elastic:  # (an elastic job's ranks are restarted one by one)
                break
            attempt = job.restart_count + 1
            progress(f"restart {attempt}/{max_restarts} of job {job.name}: "
                     f"{followed.message}; recreating all {job.world_size} ranks")
            took = remove_service(client, service_id)
            job = dataclasses.replace(job, restart_count=attempt)
            service_id = create_service(client, job, secret_id)
            result.service_id = service_id
            progress(f"restart {attempt}/{max_restarts}: old ranks removed in {took:.1f} s, "
                     f"new ranks created with SWARMFD_RESTART_COUNT={attempt}")
        result.restarts = job.restart_count
        result.follow = followed
        result.exit_code = followed.exit_code
        if followed.outcome == "interrupted":
            progress(f"stopped following (Ctrl-C); {interrupt_hint(job.name)}")
            return result
        if followed.outcome == "removed":
            progress(followed.message)
            return result
        remove = keep == "never" or (keep == "on-failure" and followed.outcome == "done")
        line = job_line(records, job.world_size, time.monotonic() - started)
        if line:
            progress(f"job {job.name}: {line}")
        if followed.outcome == "done":
            progress(f"job {job.name} done: {followed.message}"
                     + (f" (after {job.restart_count} restart(s))" if job.restart_count else ""))
        elif max_restarts and not job.elastic:
            progress(f"job {job.name} failed after {job.restart_count} restart(s) "
                     f"(--max-restarts {max_restarts}): {followed.message}")
        else:
            progress(f"job {job.name} failed: {followed.message}")
        if remove:
            removal = remove_job(client, job.name)
            result.removed = True
            progress(f"removed job {job.name} ({removal.seconds:.1f} s)")
        elif followed.outcome == "done":
            progress(f"kept job {job.name}: `swarmfd logs {job.name}`, `swarmfd ps {job.name}`; "
                     f"remove it with `swarmfd rm {job.name}`")
        else:
            progress(f"kept job {job.name} for inspection: `swarmfd ps {job.name}`, "
                     f"`swarmfd logs {job.name}`; remove it with `swarmfd rm {job.name}`")
        return result
    finally:
        client.close()


def stderr_progress(prefix: str = "swarmfd deploy") -> Callable[[str], None]:
    """A progress callback writing ``<prefix>: <line>`` to stderr."""

    def write(line: str) -> None:
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)

    return write
