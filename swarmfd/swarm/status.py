"""What ``swarmfd top`` reads of a job on the Swarm: the ranks' status lines.

Each rank writes its status lines to stderr (:mod:`swarmfd.statusline`); Swarm keeps
them in the service log, which a manager reads from every node (``docker exec`` could
not reach the tasks of other nodes). :func:`job_status` reads the last
RECENT_SECONDS of that log and keeps each rank's latest record; :func:`running_jobs`
lists the jobs that run.
"""

from __future__ import annotations

import time
from typing import Any

import docker

from .. import statusline
from .engine import find_service, job_tasks, list_jobs, world_size_of
from .follow import LineSplitter, parse_details

__all__ = ["RECENT_SECONDS", "job_status", "running_jobs"]

#: How far back the service log is read for the latest status line of each rank (a
#: rank writes one every 2 s: swarmfd.swarm.spec.STATUS_INTERVAL).
RECENT_SECONDS = 8


def running_jobs(client: docker.DockerClient) -> list[dict[str, Any]]:
    """The jobs of the Swarm whose ranks run, as ``swarmfd top`` lists them."""
    return [{"name": j.name, "kind": "swarm", "world": j.world_size,
             "started": j.created.timestamp(), "command": j.image}
            for j in list_jobs(client) if j.state in ("running", "starting")]


def job_status(client: docker.DockerClient, name: str) -> dict[str, Any] | None:
    """Job ``name`` with each rank's latest status record (``ranks``), read from the
    service log; None when there is no such job."""
    service = find_service(client, name)
    if service is None:
        return None
    ranks_of = {v.task_id: r for r, v in job_tasks(client, service["ID"]).items()}
    records: dict[int, dict[str, Any]] = {}
    stream = client.api.service_logs(service["ID"], details=True, stdout=False, stderr=True,
                                     follow=False, since=int(time.time()) - RECENT_SECONDS)
    pending: dict[str, LineSplitter] = {}
    for chunk in stream:
        task_id, message = parse_details(chunk)
        rank = ranks_of.get(task_id)
        if rank is None:
            continue
        for line in pending.setdefault(task_id, LineSplitter()).feed(message):
            _, record = statusline.split(line)
            if record:
                records[rank] = record
    created = service.get("CreatedAt", "")
    return {"name": name, "kind": "swarm", "world": world_size_of(service),
            "created": created, "ranks": {str(r): rec for r, rec in records.items()}}
