"""The swarmfd image on a real engine: it imports, maps slot -> RANK, and runs as a Swarm job."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.swarm

TERMINAL_STATES = {"complete", "failed", "rejected", "shutdown", "orphaned", "remove"}
JOB_TIMEOUT = 120.0

# Each task reports its rank, its own address and the address MASTER_ADDR resolves to.
# Rank 0 then serves MASTER_PORT until every other rank has connected and sent its rank
# (so its name stays in DNS while the others look it up, as a real rendezvous would);
# the others connect to MASTER_ADDR:MASTER_PORT over the overlay network.
PROBE = """
import os, socket, time
import swarmfd, zmq, numpy
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
print("rank=%d world=%d slot=%s host=%s my_ip=%s master=%s master_ip=%s" % (
    rank, world, os.environ["SWARMFD_TASK_SLOT"], socket.gethostname(),
    socket.gethostbyname(socket.gethostname()), master, socket.gethostbyname(master)), flush=True)
if rank == 0:
    server = socket.create_server(("", port))
    server.settimeout(60)
    peers = []
    for _ in range(world - 1):
        conn, _addr = server.accept()
        with conn:
            conn.settimeout(60)
            peers.append(int(conn.recv(16).decode()))
    print("peers=%s" % ",".join(map(str, sorted(peers))), flush=True)
else:
    deadline = time.monotonic() + 60
    while True:  # rank 0's name resolves once its container starts, before it listens
        try:
            conn = socket.create_connection((master, port), timeout=5)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with conn:
        conn.sendall(str(rank).encode())
# The test reads this output from the running container: Docker once removed a finished
# task's container within half a second of its exit, before its logs were read.
print("end=1", flush=True)
time.sleep(1.0)
"""


def test_image_imports_swarmfd_and_its_dependencies(docker_client: Any, swarmfd_image: str) -> None:
    """The image's Python has swarmfd, pyzmq and numpy; the examples are in the image."""
    code = (
        "import os, swarmfd, zmq, numpy; "
        "print(swarmfd.__version__, sorted(os.listdir('/opt/swarmfd/examples')))"
    )
    out = docker_client.containers.run(
        swarmfd_image, ["python", "-c", code], network_mode="none", remove=True
    )
    version, examples = out.decode().strip().split(" ", 1)
    import swarmfd

    assert version == swarmfd.__version__
    assert "train.py" in examples


def test_entrypoint_maps_slot_to_rank(docker_client: Any, swarmfd_image: str) -> None:
    """SWARMFD_TASK_SLOT=2 of WORLD_SIZE=3 runs the command with RANK=1."""
    out = docker_client.containers.run(
        swarmfd_image,
        ["python", "-c", 'import os;print(os.environ["RANK"])'],
        environment={"SWARMFD_TASK_SLOT": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "localhost"},
        network_mode="none",
        remove=True,
    )
    assert out.decode().strip() == "1"


def test_entrypoint_rejects_slot_beyond_world_size(docker_client: Any, swarmfd_image: str) -> None:
    """A slot beyond WORLD_SIZE ends the container with exit 2 before the command runs."""
    import docker

    with pytest.raises(docker.errors.ContainerError) as info:
        docker_client.containers.run(
            swarmfd_image,
            ["python", "-c", "print('should not run')"],
            environment={"SWARMFD_TASK_SLOT": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"},
            network_mode="none",
            remove=True,
        )
    assert info.value.exit_status == 2
    assert b"SWARMFD_TASK_SLOT=3 exceeds WORLD_SIZE=2" in info.value.stderr


def _wait_terminal(client: Any, service: Any, replicas: int,
                   timeout: float) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Poll until ``replicas`` tasks are in a terminal state: the tasks sorted by slot, and
    each slot's output, read from its container as soon as it shows the probe's last
    line (``end=1``; the probe then lives on for a second), so a container that Docker
    removes right after it exits has been read already."""
    deadline = time.monotonic() + timeout
    tasks: list[dict[str, Any]] = []
    logs: dict[int, str] = {}
    while time.monotonic() < deadline:
        tasks = service.tasks()
        for task in tasks:
            slot = task.get("Slot")
            if slot is not None and "end=1" not in logs.get(slot, ""):
                out = _task_logs(client, task)
                if out is not None:
                    logs[slot] = out
        if len(tasks) >= replicas and all(t["Status"]["State"] in TERMINAL_STATES for t in tasks):
            return sorted(tasks, key=lambda t: t["Slot"]), logs
        time.sleep(0.25)
    states = {t.get("Slot"): t["Status"]["State"] for t in tasks}
    raise TimeoutError(f"service {service.name}: tasks not done after {timeout:.0f} s: {states}")


def _task_logs(client: Any, task: dict[str, Any]) -> str | None:
    """The task container's output so far (from the container: service logs can drop
    lines), or None when it has no container (yet, or any more)."""
    import docker

    container_id = task["Status"].get("ContainerStatus", {}).get("ContainerID")
    if not container_id:
        return None
    try:
        return client.containers.get(container_id).logs(stdout=True, stderr=True).decode()
    except docker.errors.NotFound:
        return None


def test_two_replica_swarm_job_runs_every_rank(
    swarm: Any,
    swarmfd_image: str,
    overlay_network: Any,
    unique_name: Callable[[str], str],
    remove_service: Callable[[Any], None],
) -> None:
    """A one-shot 2-replica service runs rank 0 and rank 1; MASTER_ADDR is slot 1's address."""
    from docker.types import EndpointSpec, RestartPolicy, ServiceMode

    replicas = 2
    name = unique_name("job")
    started = time.monotonic()
    service = swarm.services.create(
        swarmfd_image,
        # args= (ContainerSpec.Args) replaces the image's CMD; the SDK's command= would
        # replace its ENTRYPOINT and skip the slot -> RANK mapping.
        args=["python", "-c", PROBE],
        name=name,
        env=[
            f"WORLD_SIZE={replicas}",
            "SWARMFD_TASK_SLOT={{.Task.Slot}}",
            "MASTER_ADDR={{.Service.Name}}-1",
            "MASTER_PORT=29500",
            "SWARMFD_RESOLVE_TIMEOUT=60",
        ],
        hostname="{{.Service.Name}}-{{.Task.Slot}}",
        mode=ServiceMode("replicated", replicas=replicas),
        restart_policy=RestartPolicy(condition="none"),
        endpoint_spec=EndpointSpec(mode="dnsrr"),
        networks=[overlay_network.name],
        labels={"org.swarmfd.test": "1"},
        init=True,
    )
    try:
        tasks, found = _wait_terminal(swarm, service, replicas, JOB_TIMEOUT)
        elapsed = time.monotonic() - started
        logs = {t["Slot"]: found.get(t["Slot"], f"<no output read: {t['Status'].get('Err')}>")
                for t in tasks}
        for task in tasks:
            status = task["Status"]
            assert status["State"] == "complete", (task["Slot"], status, logs[task["Slot"]])
        lines = {
            slot: dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
            for slot, out in logs.items()
        }
        print(f"2-replica swarm job: all tasks complete {elapsed:.1f} s after create")
        assert sorted(lines) == [1, 2]
        assert [lines[s]["rank"] for s in (1, 2)] == ["0", "1"]
        assert {f["world"] for f in lines.values()} == {"2"}
        assert lines[1]["host"] == f"{name}-1"
        assert lines[2]["master"] == f"{name}-1"
        # The name every rank uses for rank 0 resolves to slot 1's own address.
        assert lines[2]["master_ip"] == lines[1]["my_ip"]
        assert lines[1]["master_ip"] == lines[1]["my_ip"]
        # Rank 1 reached rank 0 at MASTER_ADDR:MASTER_PORT over the overlay network.
        assert lines[1]["peers"] == "1"
    finally:
        remove_service(service)
