"""``swarmfd doctor`` and deploy's preflight across nodes (the ``multinode`` fixture).

A healthy Swarm first: every check ok, with the figures the probe measured. Then one run
that carries four faults, each on a node of its own:

* a fresh worker joined with no image at all (the image is missing there);
* the link of node 2 carries 1400 bytes, less than the overlay's 1450 and VXLAN's 50
  (its interface, and the other nodes' routes toward it, so the hosts' own TCP adapts);
* node 3 drained;
* a service on node 1 that reserves all but 512 MiB of its memory (less than one rank's
  /dev/shm).

doctor names each with its fix, and deploy's preflight refuses a job there. Everything
is undone after, in the order it was done, so the tests after these find the cluster as
it was. The probe leaves no service, network or secret behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmfd.swarm.spec import LABEL_JOB

pytestmark = [pytest.mark.swarm, pytest.mark.multinode]

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT = 240.0
GIB = 1 << 30


def swarmfd(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m swarmfd ARGS`` against the inner manager (``--host`` after the command)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DOCKER_HOST", None)
    argv = [args[0], "--host", cluster.manager.docker_host, *args[1:]]
    return subprocess.run([sys.executable, "-m", "swarmfd", *argv], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT, env=env, cwd=ROOT)


def doctor_json(cluster: Any, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = swarmfd(cluster, "doctor", "--json", "--image", cluster.image_id, *args)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"doctor --json printed no JSON (exit {proc.returncode}):\n{proc.stdout}"
                    f"\n{proc.stderr}")
    return proc.returncode, doc, proc.stderr


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


def swarmfd_objects(cluster: Any, prefix: str) -> list[str]:
    """Services, networks and secrets of the inner Swarm whose job label starts with
    ``prefix`` (the probe jobs' are swarmfd-doctor-* and swarmfd-preflight-*)."""
    with cluster.manager.client() as client:
        found = (client.api.services(filters={"label": LABEL_JOB})
                 + client.api.networks(filters={"label": LABEL_JOB})
                 + client.api.secrets(filters={"label": LABEL_JOB}))
    labels = [((o.get("Spec") or o).get("Labels") or {}).get(LABEL_JOB, "") for o in found]
    return [name for name in labels if name.startswith(prefix)]


def test_a_healthy_swarm_reports_ok_with_measured_figures(multinode: Any) -> None:
    """Every check ok; each node pair measured both ways on both planes; the overlay's
    MTU passes; clocks agree; -n 2N places two ranks a node and estimates an all_reduce
    of 100 MiB; nothing of the probe is left."""
    n = len(multinode.nodes)
    started = time.monotonic()
    code, doc, stderr = doctor_json(multinode, "-n", str(2 * n))
    elapsed = time.monotonic() - started
    checks = by_name(doc)
    assert code == 0 and doc["ok"] is True, (doc, stderr)
    assert {c["name"]: c["status"] for c in doc["checks"]} == {
        name: "ok" for name in ("engine", "nodes", "image", "overlay", "ports", "mtu", "links",
                                "clocks", "tasks", "placement")}, doc
    names = sorted(node.name for node in multinode.nodes)
    pairs = {f"{a}>{b}" for a in names for b in names if a != b}
    for plane in ("socket", "zmq"):
        measured = checks["links"]["figures"][plane]
        assert set(measured) == pairs, measured
        assert all(v["gbps"] > 0 and v["latency_us"] > 0 for v in measured.values()), measured
    mtu = checks["mtu"]["figures"]
    assert mtu["overlay_mtu"] == 1450 and set(mtu["overlay"]) == pairs
    assert all(v["arrived"] == v["path"] == 1450 for v in mtu["overlay"].values()), mtu
    assert all(v["path"] >= 1500 for v in mtu["hosts"].values()), mtu
    assert set(checks["clocks"]["figures"]["offsets_s"]) | {
        checks["clocks"]["figures"]["reference"]} == set(names)
    tasks = checks["tasks"]["figures"]
    assert sorted(tasks) == names and all(t["shm_bytes"] == GIB for t in tasks.values())
    placement = checks["placement"]["figures"]
    assert {k: v["ranks"] for k, v in placement["per_node"].items()} == {x: 2 for x in names}
    assert set(placement["all_reduce_seconds"]) == {"socket", "zmq"}
    assert all(s > 0 for s in placement["all_reduce_seconds"].values())
    assert swarmfd_objects(multinode, "swarmfd-doctor-") == []
    print(f"\nswarmfd doctor on {n} nodes, healthy ({elapsed:.1f} s end to end):")
    for c in doc["checks"]:
        print(f"  {c['status']:<8} {c['name']:<10} {c['detail']}")
    for plane in ("socket", "zmq"):
        print(f"  {plane}: " + ", ".join(
            f"{k} {v['latency_us']:.0f} us {v['gbps']:.2f} GB/s"
            for k, v in sorted(checks["links"]["figures"][plane].items())))
    print(f"  clock offsets: {checks['clocks']['figures']}")


def test_blocked_overlay_traffic_names_the_pairs_and_the_ports(multinode: Any) -> None:
    """Node 3 drops the overlay's VXLAN traffic (4789/udp): its tasks' names still
    resolve (gossip works) but no connection gets through; doctor exits 1 naming those
    pairs and the ports to open, and measures nothing it cannot."""
    if len(multinode.nodes) < 3:
        pytest.skip("needs three nodes")
    third = multinode.nodes[2]
    container = multinode.host.containers.get(third.container_id)
    rule = "INPUT -p udp --dport 4789 -j DROP"
    _run(container, f"iptables -I {rule}")
    try:
        started = time.monotonic()
        code, doc, stderr = doctor_json(multinode)
        elapsed = time.monotonic() - started
    finally:
        _run(container, f"iptables -D {rule}")
    checks = by_name(doc)
    assert code == 1 and doc["ok"] is False, (doc, stderr)
    ports = checks["ports"]
    assert ports["status"] == "problem", ports
    blocked = {p for p, s in ports["figures"]["pairs"].items() if s != "ok"}
    assert blocked and all(third.name in p.split(">") for p in blocked), ports
    assert f"cannot reach {third.name}" in ports["detail"] or \
        ports["detail"].count(f"{third.name} cannot reach") > 0, ports
    assert "4789/udp" in ports["fix"] and "7946/tcp" in ports["fix"]
    assert checks["links"]["status"] == "warning" and "not measured" in checks["links"]["detail"]
    assert swarmfd_objects(multinode, "swarmfd-doctor-") == []
    print(f"\nswarmfd doctor with 4789/udp blocked on {third.name} ({elapsed:.1f} s): "
          f"{ports['detail']}\n  fix: {ports['fix']}")


def _run(container: Any, cmd: str) -> None:
    code, output = container.exec_run(["sh", "-c", cmd])
    assert code == 0, f"{cmd}: {output.decode(errors='replace')}"


@contextlib.contextmanager
def four_faults(cluster: Any) -> Iterator[dict[str, str]]:
    """The four faults of the module docstring; undone on exit (each undo attempted,
    the first error raised after all ran)."""
    import docker

    first, second, third = cluster.nodes[:3]
    undo: list[Callable[[], None]] = []
    containers = {node.name: cluster.host.containers.get(node.container_id)
                  for node in cluster.nodes}
    try:
        fresh = cluster.add_worker()
        undo.append(lambda: cluster.remove_worker(fresh))
        containers[fresh.name] = cluster.host.containers.get(fresh.container_id)
        _run(containers[second.name], "ip link set dev eth0 mtu 1400")
        undo.append(lambda: _run(containers[second.name], "ip link set dev eth0 mtu 1500"))
        for name in (first.name, third.name, fresh.name):
            _run(containers[name], f"ip route replace {second.ip}/32 dev eth0 mtu 1400")
            undo.append(lambda name=name: _run(containers[name],
                                               f"ip route del {second.ip}/32 dev eth0"))
        with cluster.manager.client() as client:
            drained = client.nodes.get(third.name)
            spec = dict(drained.attrs["Spec"], Availability="drain")
            drained.update(spec)
            undo.append(lambda: _set_availability(cluster, third.name, "active"))
            memory = client.nodes.get(first.name).attrs["Description"]["Resources"]["MemoryBytes"]
            hog = client.services.create(
                cluster.image_id, command=["sleep", "600"], init=True,
                name=f"mn-doctor-hog-{uuid.uuid4().hex[:6]}",
                constraints=[f"node.hostname=={first.name}"],
                resources=docker.types.Resources(mem_reservation=memory - (512 << 20)),
                restart_policy=docker.types.RestartPolicy(condition="none"))
            undo.append(lambda: _remove_service(cluster, hog.id))
            _wait(lambda: any(t["Status"]["State"] == "running" for t in hog.tasks()),
                  "the memory hog runs")
        yield {"image": fresh.name, "mtu": second.name, "drained": third.name,
               "memory": first.name}
    finally:
        errors = []
        for step in reversed(undo):
            try:
                step()
            except Exception as exc:  # every undo runs; the first error is raised after
                errors.append(exc)
        if errors:
            raise errors[0]


def _set_availability(cluster: Any, name: str, availability: str) -> None:
    with cluster.manager.client() as client:
        node = client.nodes.get(name)
        node.update(dict(node.attrs["Spec"], Availability=availability))


def _remove_service(cluster: Any, service_id: str) -> None:
    from swarmfd.swarm.engine import remove_service

    with cluster.manager.client() as client:
        remove_service(client, service_id)


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)


def test_four_faults_are_each_found_and_named_and_deploy_refuses(multinode: Any) -> None:
    """One run with the four faults (module docstring): doctor exits 1 and names each
    node with its fix; the probe still measured the nodes that could run it. deploy's
    preflight refuses a 3-rank job there, naming the image's node and the memory's,
    and creates nothing."""
    if len(multinode.nodes) < 3:
        pytest.skip("needs three nodes")
    with four_faults(multinode) as at:
        started = time.monotonic()
        code, doc, stderr = doctor_json(multinode, "-n", "3")
        elapsed = time.monotonic() - started
        checks = by_name(doc)
        assert code == 1 and doc["ok"] is False, (doc, stderr)
        image, nodes, mtu, placement = (checks[k] for k in ("image", "nodes", "mtu", "placement"))
        assert image["status"] == "problem" and f"is not on {at['image']}:" in image["detail"]
        assert f"ssh {at['image']} docker load" in image["fix"]
        assert "--push REGISTRY" in image["fix"]
        assert nodes["status"] == "warning" and f"{at['drained']} is drained" in nodes["detail"]
        assert f"docker node update --availability active {at['drained']}" in nodes["fix"]
        assert mtu["status"] in ("warning", "problem"), mtu
        assert mtu["detail"].startswith(f"to and from {at['mtu']}: "), mtu
        assert "1400" in mtu["detail"] and f"the link of {at['mtu']}" in mtu["fix"]
        assert "an MTU of at least 1500" in mtu["fix"]
        assert placement["status"] == "problem", placement
        assert placement["detail"].startswith(f"{at['memory']} has 512.0 MiB"), placement
        assert f"give {at['memory']} more memory" in placement["fix"]
        # The probe measured the two nodes that could run it, and only those.
        measured = {at["memory"], at["mtu"]}
        assert set(checks["tasks"]["figures"]) == measured
        assert checks["ports"]["status"] == checks["links"]["status"] == "ok", doc
        assert {s for p in checks["links"]["figures"]["socket"] for s in p.split(">")} == measured
        assert swarmfd_objects(multinode, "swarmfd-doctor-") == []

        name = f"mn-pre-{uuid.uuid4().hex[:6]}"
        refused_started = time.monotonic()
        refused = swarmfd(multinode, "deploy", multinode.image_id, "-n", "3", "--name", name,
                          "--", "python", "-c", "pass")
        refused_after = time.monotonic() - refused_started
        assert refused.returncode == 1, refused.stdout + refused.stderr
        err = refused.stderr
        assert "the preflight found what would stop this job (--no-preflight skips it)" in err
        assert f"image: the image {multinode.image_id[7:19]} is not on {at['image']}" in err
        assert f"placement: {at['memory']} has 512.0 MiB" in err
        assert swarmfd_objects(multinode, name) == []
        assert swarmfd_objects(multinode, "swarmfd-preflight-") == []
    print(f"\nswarmfd doctor with four faults ({elapsed:.1f} s end to end):")
    for c in doc["checks"]:
        print(f"  {c['status']:<8} {c['name']:<10} {c['detail']}")
        if c["status"] != "ok":
            print(f"  {'':<19} fix: {c['fix']}")
    print(f"deploy -n 3 there: refused after {refused_after:.1f} s:\n{err}")
