"""``swarmfd doctor``'s logic on plain data: the cost model, placement, constraints, and
each check's verdict from what a probe would report (the probe's own lines' format).

The real probe on a real Swarm: tests/swarm/test_doctor.py (one node) and
tests/multinode/test_doctor.py (three nodes, healthy and with faults).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from swarmfd.comm.planes.shm import SEGMENT_SIZE
from swarmfd.swarm import doctor as D
from swarmfd.swarm import probe as P
from swarmfd.swarm import spec as S

GIB = 1 << 30


def node(name: str, **kw: object) -> D.Node:
    return D.Node(id=f"id-{name}", name=name, **{"cores": 4.0, "memory": 16 * GIB, **kw})


# --- the probe's pure parts -------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 8))
def test_pair_rounds_meet_every_pair_once_in_disjoint_rounds(n: int) -> None:
    rounds = P.pair_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks)), r
    assert len(rounds) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)


def test_parse_lines_takes_only_the_probes_json_objects() -> None:
    lines = ["hello", f"{P.MARK} {{\"kind\": \"facts\", \"slot\": 1}}", f"{P.MARK} not json",
             f"{P.MARK} [1, 2]", f"{P.MARK}x {{}}", f"{P.MARK} {{\"kind\": \"links\"}}"]
    assert P.parse_lines(lines) == [{"kind": "facts", "slot": 1}, {"kind": "links"}]


def test_path_mtu_on_loopback_sends_what_the_counter_counts() -> None:
    """Datagrams of the asked size and each step below it leave with don't-fragment and
    arrive whole; the route's MTU (loopback's) is read, and nothing lowers it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counter = P.DatagramCounter(port)
    try:
        found = P.path_mtu("127.0.0.1", port, 1400, (0, 100, 900))
        time.sleep(0.2)
        assert counter.largest_from("127.0.0.1") == 1400
        sizes = {size for (_ip, size) in counter.seen}
    finally:
        counter.close()
    assert sizes == {1400, 1300}  # 1400 - 900 is below 576, never sent
    with open("/sys/class/net/lo/mtu") as f:
        route = min(int(f.read()), 65535)  # an IP packet's largest size caps it
    assert found == {"route": route, "learned": route}


def test_a_task_alone_reports_its_facts_and_an_empty_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """One task (a world of one): facts of this machine, nobody to reach, no measurements."""
    monkeypatch.setenv("SWARMFD_TASK_SLOT", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("SWARMFD_NODE", "here")
    out: list[dict[str, object]] = []
    assert P.main([json.dumps({"mode": "full"})], output=out.append) == 0
    (found,) = out
    assert found["kind"] == "facts" and found["node"] == "here" and found["reach"] == {}
    assert found["memory"]["total"] > 0 and found["memory"]["available"] > 0
    assert found["shm"]["size"] > 0
    assert found["cores"]["affinity"] >= 1


# --- cost model, placement, constraints ------------------------------------------------------


def test_ring_all_reduce_model() -> None:
    """2(N-1)/N * bytes / bandwidth + 2(N-1) * latency; nothing to do for one rank."""
    assert D.ring_all_reduce_seconds(100 << 20, 1, 1e9, 1e-4) == 0.0
    assert D.ring_all_reduce_seconds(1_000_000_000, 2, 1e9, 0.001) == pytest.approx(1.002)
    assert D.ring_all_reduce_seconds(1_000_000_000, 4, 1e9, 0.001) == pytest.approx(1.5 + 0.006)


def test_place_ranks_spreads_and_respects_max_per_node() -> None:
    nodes = [node("a"), node("b", tasks=3), node("c")]
    assert D.place_ranks(4, nodes) == ({"a": 2, "b": 1, "c": 1}, 0)
    assert D.place_ranks(2, nodes) == ({"a": 1, "c": 1}, 0)  # b is the busiest
    assert D.place_ranks(5, nodes, max_per_node=1) == ({"a": 1, "b": 1, "c": 1}, 2)


def test_memory_needed_counts_segments_only_where_ranks_share_a_node() -> None:
    assert D.memory_needed(1, GIB) == GIB
    assert D.memory_needed(3, GIB) == 3 * SEGMENT_SIZE + 3 * GIB
    assert D.memory_needed(2, 0) == 2 * SEGMENT_SIZE


@pytest.mark.parametrize(("expr", "expected"), [
    ("node.hostname==a", True), ("node.hostname==A", True), ("node.hostname!=a", False),
    ("node.role==manager", False), ("node.labels.gpu==true", True),
    ("node.labels.zone==x", False), ("node.labels.zone!=x", True),
    ("engine.labels.disk==ssd", True), ("node.ip==10.0.0.0/8", True),
    ("node.ip==192.168.1.1", False), ("node.platform.os==linux", True),
    ("node.unknown==x", True), ("not a constraint", True),
])
def test_constraint_matches(expr: str, expected: bool) -> None:
    n = node("a", labels={"gpu": "true"}, engine_labels={"disk": "ssd"}, addr="10.1.2.3")
    assert D.constraint_matches(n, expr) is expected


def test_node_from_api_reads_a_managers_address_from_its_manager_status() -> None:
    raw = {"ID": "x1", "Description": {"Hostname": "m1", "Resources": {
        "NanoCPUs": 2_000_000_000, "MemoryBytes": 8 * GIB}},
        "Spec": {"Role": "manager", "Availability": "drain", "Labels": {"k": "v"}},
        "Status": {"State": "ready", "Addr": "0.0.0.0"},
        "ManagerStatus": {"Addr": "10.0.0.5:2377"}}
    n = D.Node.from_api(raw, tasks=2, reserved=GIB)
    assert (n.name, n.addr, n.cores, n.memory, n.availability, n.usable) == (
        "m1", "10.0.0.5", 2.0, 8 * GIB, "drain", False)
    assert (n.tasks, n.reserved, n.labels) == (2, GIB, {"k": "v"})


# --- the checks' verdicts ------------------------------------------------------------------


def facts(node_name: str, slot: int, world: int, reach: str = "ok",
          available: int = 12 * GIB, shm: int = GIB) -> dict[str, object]:
    return {"kind": "facts", "slot": slot, "node": node_name, "time": 0.0,
            "shm": {"size": shm, "free": shm},
            "memory": {"total": 16 * GIB, "available": available, "limit": None, "usage": None},
            "cores": {"affinity": 4, "quota": None},
            "reach": {str(s): reach for s in range(1, world + 1) if s != slot},
            "inbound": [], "addresses": {}, "mesh_seconds": 0.4}


def links(world: int, path: int = 1450, arrived: int = 1450, hosts: int = 1500) -> dict:
    mtu = [{"iface": 1450,
            "overlay": {str(b): {"route": 1450, "learned": path} for b in range(world) if b != a},
            "arrived": {str(b): arrived for b in range(world) if b != a},
            "hosts": {f"n{b}": {"route": 1500, "learned": hosts}
                      for b in range(world) if b != a}}
           for a in range(world)]
    pairs = {f"{a}>{b}": {"latency_us": 100.0 + a, "send_gbps": 1.0 + b / 10}
             for a in range(world) for b in range(world) if a != b}
    return {"kind": "links", "rank": 0, "mtu": mtu, "clock": {"1": 0.0002, "2": -0.0001},
            "planes": {"socket": pairs, "zmq": pairs}, "skipped": [], "seconds": 1.0}


def result(world: int = 3, **kw: object) -> D.ProbeResult:
    names = [f"n{i}" for i in range(world)]
    base = D.ProbeResult(name="swarmfd-doctor-x", nodes=names,
                         facts={n: facts(n, i + 1, world) for i, n in enumerate(names)},
                         links=links(world), rank_node=dict(enumerate(names)), seconds=5.0)
    for key, value in kw.items():
        setattr(base, key, value)
    return base


def test_a_healthy_probe_gives_ok_everywhere() -> None:
    r = result()
    checks = [D.check_image("img", "sha256:abc", r), D.check_overlay(r), D.check_ports(r),
              D.check_mtu(r), D.check_links(r), D.check_clocks(r), D.check_tasks(r, GIB),
              D.check_placement(6, [node(f"n{i}") for i in range(3)], r, GIB)]
    assert [c.status for c in checks] == ["ok"] * 8, [c.detail for c in checks]
    placement = checks[-1].figures
    assert placement["per_node"]["n0"]["ranks"] == 2
    slowest = D.ring_all_reduce_seconds(100 << 20, 6, 1.0e9, 102e-6)
    assert placement["all_reduce_seconds"]["socket"] == pytest.approx(slowest, abs=1e-3)
    assert D.report(checks)["ok"] is True


def test_one_node_checks_say_so_and_pass() -> None:
    r = result(1, links=None)
    for check in (D.check_ports(r), D.check_mtu(r), D.check_links(r), D.check_clocks(r)):
        assert check.status == "ok" and "one node" in check.detail


def test_unreachable_tasks_name_the_pair_and_the_ports() -> None:
    r = result()
    r.facts["n2"]["reach"] = {"1": "timeout", "2": "ok"}
    check = D.check_ports(r)
    assert check.status == "problem"
    assert "n2 cannot reach n0 (timeout)" in check.detail
    assert "4789/udp" in check.fix and "7946/tcp" in check.fix and "ESP" in check.fix


def test_mtu_a_smaller_path_is_a_warning_naming_the_node_in_every_pair() -> None:
    r = result()
    for a, mine in enumerate(r.links["mtu"]):
        for b in list(mine["overlay"]):
            if 2 in (a, int(b)):
                mine["overlay"][b]["learned"] = 1350
                r.links["mtu"][int(b)]["arrived"][str(a)] = 1350
        for h in mine["hosts"]:
            if 2 in (a, int(h[1:])):
                mine["hosts"][h]["learned"] = 1400
    check = D.check_mtu(r)
    assert check.status == "warning"
    assert check.detail.startswith("to and from n2: ")
    assert "1350, not its 1450" in check.detail and "1400, below the 1500" in check.detail
    assert "the link of n2" in check.fix and "mtu 1500" in check.fix


def test_mtu_lost_packets_without_a_lower_path_mtu_are_a_problem() -> None:
    r = result(2)
    r.links["mtu"][1]["arrived"]["0"] = 1300
    check = D.check_mtu(r)
    assert check.status == "problem"
    assert "packets over 1300 bytes are lost on the overlay (n0 to n1)" in check.detail


def test_clock_offsets_over_the_tolerance_are_a_warning() -> None:
    r = result()
    r.links["clock"]["2"] = 2.5
    check = D.check_clocks(r)
    assert check.status == "warning" and "n2" in check.detail and "+2.50 s" in check.detail
    assert "chrony" in check.fix
    assert check.figures["offsets_s"]["n2"] == 2.5


def test_a_missing_image_names_the_node_and_the_fix() -> None:
    r = result(2, rejected={"n9": "No such image: sha256:abc"})
    check = D.check_image("app:1", "sha256:abc", r)
    assert check.status == "problem" and "not on n9" in check.detail
    assert "ssh n9 docker load" in check.fix and "--push REGISTRY" in check.fix
    assert D.check_overlay(r).status == "ok"


def test_nodes_drained_or_down_are_warnings_with_their_fix() -> None:
    nodes = [node("a"), node("b", availability="drain"), node("c", state="down")]
    check = D.check_nodes(nodes)
    assert check.status == "warning"
    assert "b is drained" in check.detail and "c is not ready" in check.detail
    assert "docker node update --availability active b" in check.fix
    only_drained = D.check_nodes([node("a", availability="drain")])
    assert only_drained.status == "problem"


def test_placement_memory_short_on_a_node_is_a_problem_naming_it() -> None:
    """A node whose other tasks reserve most of its memory cannot hold its ranks'
    /dev/shm; the task's own view (available memory) counts too."""
    nodes = [node("n0", reserved=16 * GIB - (512 << 20)), node("n1"), node("n2")]
    r = result()
    check = D.check_placement(3, nodes, r, GIB)
    assert check.status == "problem"
    assert check.detail.startswith("n0 has 512.0 MiB for its 1 rank(s), which need 1.0 GiB")
    assert "give n0 more memory" in check.fix and "--shm-size" in check.fix
    r.facts["n1"]["memory"]["available"] = 100 << 20
    assert "n1 has 100.0 MiB" in D.check_placement(3, nodes[1:], r, GIB).detail


def test_placement_more_ranks_than_cores_is_a_warning() -> None:
    check = D.check_placement(12, [node(f"n{i}") for i in range(2)], result(2), 1 << 20)
    assert check.status == "warning" and "n0 runs 6 ranks on 4 core(s)" in check.detail


def test_report_and_its_text() -> None:
    checks = [D.Check("a", "ok", "fine"), D.Check("b", "warning", "hm", "do x"),
              D.Check("c", "problem", "bad", "do y", {"k": 1})]
    doc = D.report(checks)
    assert doc == {"ok": False, "checks": [
        {"name": "a", "status": "ok", "detail": "fine", "fix": "", "figures": {}},
        {"name": "b", "status": "warning", "detail": "hm", "fix": "do x", "figures": {}},
        {"name": "c", "status": "problem", "detail": "bad", "fix": "do y", "figures": {"k": 1}}]}
    text = D.format_report(checks)
    assert "fix: do y" in text and text.endswith("1 problem(s) would stop a job (1 warning(s))")
    with pytest.raises(ValueError, match="status must be one of"):
        D.Check("x", "fine", "")


# --- the tmpfs at /dev/shm -----------------------------------------------------------------


def test_shm_size_mounts_a_tmpfs_at_dev_shm() -> None:
    job = S.JobSpec(name="j", image="i", image_ref="i", world_size=2, command=("x",),
                    max_per_node=1, shm_size=GIB)
    mounts = S.build_service_spec(job)["TaskTemplate"]["ContainerSpec"]["Mounts"]
    assert mounts == [{"Type": "tmpfs", "Target": "/dev/shm",
                       "TmpfsOptions": {"SizeBytes": GIB, "Mode": 0o1777}}]
    assert S.DEFAULT_SHM_SIZE == GIB
    with pytest.raises(ValueError, match="/dev/shm is where --shm-size mounts its tmpfs"):
        S.JobSpec(name="j", image="i", image_ref="i", world_size=1, command=("x",),
                  shm_size=GIB, mounts=(S.parse_mount("type=tmpfs,dst=/dev/shm"),))
    with pytest.raises(ValueError, match="--shm-size must be a size of at least 1 byte"):
        S.JobSpec(name="j", image="i", image_ref="i", world_size=1, command=("x",),
                  shm_size=0)


def test_deploy_and_doctor_refuse_a_bad_shm_size() -> None:
    from click.testing import CliRunner

    from swarmfd.cli import main

    for argv in (["deploy", "img", "-n", "2", "--shm-size", "lots", "--", "true"],
                 ["doctor", "--shm-size", "0"]):
        out = CliRunner().invoke(main, argv)
        assert out.exit_code == 2 and "bad --shm-size size" in out.output, out.output


def test_doctor_reports_an_unreachable_engine_as_a_problem_in_json() -> None:
    from click.testing import CliRunner

    from swarmfd.cli import main

    out = CliRunner().invoke(main, ["doctor", "--host", "tcp://127.0.0.1:9", "--json"])
    assert out.exit_code == 1
    doc = json.loads(out.output)
    assert doc["ok"] is False and doc["checks"][0]["name"] == "engine"
    assert doc["checks"][0]["status"] == "problem" and "--host" in doc["checks"][0]["fix"]
