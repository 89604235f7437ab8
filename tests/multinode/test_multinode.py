"""swarmfd across nodes: a Swarm of docker-in-docker nodes (the ``multinode`` fixture).

Ranks sit on different Docker engines and talk over the job's overlay network
(VXLAN between the nodes). swarmfd runs on the host, pointed at the inner manager
with ``--host`` or ``DOCKER_HOST``. Every test runs the real command line in a
subprocess with a timeout and removes its job. The node-loss test stops a node, so
it runs last (file order).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmfd.statusline import MARK
from swarmfd.swarm.spec import LABEL_JOB
from tests.support.swarm_jobs import SLOWED_JOB, job_names, rank_lines, top_rows, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.multinode]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "/opt/swarmfd/examples/train.py"
CLI_TIMEOUT = 180.0


def swarmfd(cluster: Any, *args: str, via_env: bool = False, preflight: bool = False,
            timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``python -m swarmfd ARGS`` against the inner manager: ``--host`` after the
    subcommand, or ``DOCKER_HOST`` in the environment with ``via_env``. A deploy skips
    its preflight (a few seconds each; tests/multinode/test_doctor.py tests it) unless
    ``preflight``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DOCKER_HOST", None)
    argv = list(args)
    if argv[0] == "deploy" and not preflight and "--no-preflight" not in argv:
        argv[1:1] = ["--no-preflight"]
    if via_env:
        env["DOCKER_HOST"] = cluster.manager.docker_host
    else:
        argv[1:1] = ["--host", cluster.manager.docker_host]
    return subprocess.run([sys.executable, "-m", "swarmfd", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def job_objects_on(node: Any, name: str) -> dict[str, list[str]]:
    """What of job ``name`` exists on one node's engine (containers, the network)."""
    with node.client() as client:
        containers = client.api.containers(all=True,
                                           filters={"label": f"{LABEL_JOB}={name}"})
        networks = [n for n in client.api.networks(names=[name]) if n.get("Name") == name]
        services = client.api.services(filters={"label": f"{LABEL_JOB}={name}"}) \
            if node.index == 1 else []
    return {"containers": [c["Id"][:12] for c in containers],
            "networks": [n["Name"] for n in networks],
            "services": [s["Spec"]["Name"] for s in services]}


@pytest.fixture
def job_name(multinode: Any) -> Iterator[Callable[[str], str]]:
    """Unique job names; every job named by it is removed from the inner Swarm after."""
    import docker

    from swarmfd.swarm.errors import SwarmJobError

    client = docker.DockerClient(base_url=multinode.manager.docker_host, timeout=60)
    try:
        with job_names(client, "mn", tolerate=(SwarmJobError,)) as make:
            yield make
    finally:
        client.close()


def node_names(cluster: Any) -> list[str]:
    return [n.name for n in cluster.nodes]


# --- 1. one rank per node: the example training job ------------------------------------


def test_train_one_rank_per_node(multinode: Any, job_name: Callable[[str], str]) -> None:
    """N ranks, --max-per-node 1: exit 0, identical parameters on every rank, and
    `swarmfd ps` (through DOCKER_HOST) reports each rank on a different node."""
    n = len(multinode.nodes)
    name = job_name("train")
    started = time.monotonic()
    proc = swarmfd(multinode, "deploy", multinode.image_id, "-n", str(n), "--name", name,
                   "--max-per-node", "1", "--keep", "--", "python", TRAIN, "--epochs", "3",
                   preflight=True)  # a healthy Swarm: the preflight lets the job through
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    for rank in range(n):
        assert f"rank {rank}: trained on {7200 // n} samples" in lines.get(rank, []), proc.stdout
    assert any(f"params identical on all {n} ranks: OK" in line for line in lines[0])
    # The ranks' status lines came through the service log from every node (deploy's
    # last line of the job is made of them) and were not shown.
    assert f"job {name}: {n} rank(s), " in proc.stderr, proc.stderr
    assert MARK.decode() not in proc.stdout + proc.stderr

    ps = swarmfd(multinode, "ps", name, via_env=True)
    assert ps.returncode == 0, ps.stderr
    assert ps.stdout.splitlines()[0].startswith(f"job {name}: done ({n} ranks; ")
    rows = [line.split() for line in ps.stdout.splitlines()[2:]]
    assert [(r[0], r[1], r[3]) for r in rows] == [(str(k), "complete", "0") for k in range(n)]
    assert sorted(r[2] for r in rows) == sorted(node_names(multinode)), ps.stdout
    rm = swarmfd(multinode, "rm", name)
    assert rm.returncode == 0, rm.stderr
    print(f"\nmultinode N={n}, one rank per node, train.py --epochs 3: {elapsed:.1f} s "
          f"end to end\n{ps.stdout}")


def test_top_shows_the_ranks_of_every_node_from_the_manager(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """One rank per node, rank 1 slowed on every step: `swarmfd top` on the manager
    (which cannot `docker exec` into other nodes' tasks) shows every rank on its node,
    from the service log, and flags rank 1."""
    n = len(multinode.nodes)
    name = job_name("top")
    proc = swarmfd(multinode, "deploy", "-d", multinode.image_id, "-n", str(n), "--name",
                   name, "--max-per-node", "1", "--", "python", "-c", SLOWED_JOB)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = top_rows(lambda *args: swarmfd(multinode, *args), name, n)
    assert [r["rank"] for r in table] == list(range(n)), table
    assert sorted(r["node"] for r in table) == sorted(node_names(multinode)), table
    assert [r["straggler"] for r in table] == [r == 1 for r in range(n)], table


# --- 2. two ranks per node: LOCAL_RANK --------------------------------------------------

LOCAL_PROBE = (
    "import os\n"
    "import swarmfd as fd\n"
    "cfg = fd.init_from_env(timeout=60)\n"
    "print(f'local {cfg.rank} {cfg.local_rank} {cfg.local_world_size} "
    "{os.environ[\"SWARMFD_NODE\"]}', flush=True)\n"
    "fd.barrier()\n"
    "fd.cleanup()\n"
)


def _local_ranks(stdout: str) -> dict[str, list[tuple[int, int, int]]]:
    per_node: dict[str, list[tuple[int, int, int]]] = {}
    for lines in rank_lines(stdout).values():
        for line in lines:
            if line.startswith("local "):
                _, rank, local, size, node = line.split()
                per_node.setdefault(node, []).append((int(rank), int(local), int(size)))
    return {node: sorted(v) for node, v in per_node.items()}


def test_two_ranks_per_node_get_local_rank_0_and_1(multinode: Any,
                                                   job_name: Callable[[str], str]) -> None:
    """2N ranks, --max-per-node 2, --local-ranks node: on every node LOCAL_RANK is 0 and
    1 (in rank order) and LOCAL_WORLD_SIZE is 2."""
    n = 2 * len(multinode.nodes)
    name = job_name("local")
    started = time.monotonic()
    proc = swarmfd(multinode, "deploy", multinode.image_id, "-n", str(n), "--name", name,
                   "--max-per-node", "2", "--local-ranks", "node", "--",
                   "python", "-c", LOCAL_PROBE)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    per_node = _local_ranks(proc.stdout)
    assert sorted(per_node) == sorted(node_names(multinode)), proc.stdout
    for node, ranks in per_node.items():
        assert [(local, size) for _rank, local, size in ranks] == [(0, 2), (1, 2)], (node, ranks)
    print(f"\nmultinode N={n}, two ranks per node: {elapsed:.1f} s end to end; {per_node}")


def test_constraints_and_resources_place_ranks(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """A --constraint on a node's host name (with a memory reservation) pins every rank
    to that node; LOCAL_RANK then counts them there."""
    target = multinode.nodes[-1].name
    pinned = job_name("pin")
    proc = swarmfd(multinode, "deploy", multinode.image_id, "-n", "2", "--name", pinned,
                   "--constraint", f"node.hostname=={target}", "--local-ranks", "node",
                   "--reserve-memory", "32M", "--", "python", "-c", LOCAL_PROBE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _local_ranks(proc.stdout) == {target: [(0, 0, 2), (1, 1, 2)]}, proc.stdout


# --- 3. the benchmark across nodes, plain and encrypted ---------------------------------

#: The bench of the plain and encrypted runs: every plane and encryption across nodes,
#: checked (bench verifies its results) and printed. Sizes to 4 MiB (the ring's several
#: pieces per step); 16 MiB took most of the four jobs' 31 engine CPU-seconds in CI.
#: The two-level bench below keeps 16 MiB, where the two algorithms differ most.
BENCH = ("swarmfd", "bench", "--sizes", "64K,1M,4M", "--iters", "10", "--quiet")


def _bench_table(stdout: str) -> str:
    return "\n".join(rank_lines(stdout).get(0, []))


def test_bench_across_nodes_plain_and_encrypted(multinode: Any,
                                                job_name: Callable[[str], str]) -> None:
    """`swarmfd bench` with one rank per node over the plain overlay (socket data plane,
    then the ZeroMQ data plane), then with the transport's CURVE encryption
    (SWARMFD_ENCRYPT=1), then over an encrypted overlay (--encrypt-network). The
    encrypted network is checked to carry the
    option; where the nodes' kernel cannot do IPsec the ranks cannot reach each other,
    which the job must then report as a failure within its timeout."""
    n = len(multinode.nodes)

    def bench(what: str, label: str, *options: str) -> None:
        started = time.monotonic()
        proc = swarmfd(multinode, "deploy", multinode.image_id, "-n", str(n), "--name",
                       job_name(what), "--max-per-node", "1", *options, "--", *BENCH)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        table = _bench_table(proc.stdout)
        assert "busbw" in table, table
        print(f"\nswarmfd bench, {n} ranks on {n} nodes, {label} "
              f"({time.monotonic() - started:.1f} s):\n{table}")

    bench("bench", "plain overlay")
    # The ZeroMQ data plane over the same overlay, for comparison with the default socket
    # plane (and as the plane the encrypted run below uses).
    bench("bench-zmq", "plain overlay, SWARMFD_DATA_PLANE=zmq", "-e",
          "SWARMFD_DATA_PLANE=zmq")
    # The transport's own encryption (CURVE on the data plane) over the same plain
    # overlay: the alternative to an encrypted overlay, and what works on any kernel.
    bench("bench-curve", "plain overlay, SWARMFD_ENCRYPT=1", "-e", "SWARMFD_ENCRYPT=1")

    encrypted = job_name("bench-enc")
    ipsec_error = multinode.ipsec_error()
    done: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: done.setdefault("proc", swarmfd(
        multinode, "deploy", multinode.image_id, "-n", str(n), "--name", encrypted,
        "--max-per-node", "1", "--encrypt-network", "--timeout", "15",
        "--no-preflight",  # the job's own failure is what is tested, not the preflight's
        "--", *BENCH)),
        daemon=True)
    started = time.monotonic()
    runner.start()
    import docker

    client = docker.DockerClient(base_url=multinode.manager.docker_host, timeout=60)
    try:
        net = wait_until(lambda: [n for n in client.api.networks(names=[encrypted])
                                  if n.get("Name") == encrypted], 60, "the job's network")[0]
        assert "encrypted" in (client.api.inspect_network(net["Id"]).get("Options") or {})
    finally:
        client.close()
    runner.join(CLI_TIMEOUT)
    proc = done["proc"]
    elapsed = time.monotonic() - started
    if not ipsec_error:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        print(f"\nswarmfd bench, {n} ranks on {n} nodes, encrypted overlay "
              f"({elapsed:.1f} s):\n{_bench_table(proc.stdout)}")
        return
    # No IPsec in this kernel: Docker creates the network and starts the tasks, but
    # drops the unencrypted VXLAN traffic between nodes. The ranks must fail (not hang)
    # and deploy must say so.
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert re.search(r"rank \d+ exited with code \d+ on node", proc.stderr), proc.stderr
    assert elapsed < 120, f"the encrypted job took {elapsed:.0f} s to fail"
    print(f"\nencrypted overlay: this kernel cannot do IPsec ({ipsec_error}); the job "
          f"failed as expected after {elapsed:.1f} s:\n"
          + "\n".join(line for line in proc.stderr.splitlines() if "error" in line.lower())[:1500])


# --- 3b. two ranks per node: the two-level collectives ------------------------------------

HIER_JOB = (ROOT / "tests" / "support" / "hier_job.py").read_text()
HIER_PREFIX = "HIER-RESULT "


def test_two_level_collectives_with_two_ranks_per_node(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """2 ranks per node (N=6 on 3 nodes), default deploy options: the two containers of a
    node share memory through their job's own volume on it, and every collective takes
    the two-level path (tests/support/hier_job.py --expect-two-level: each rank checks every
    result and fails on a silent fall-back to flat TCP)."""
    n = 2 * len(multinode.nodes)
    name = job_name("hier")
    started = time.monotonic()
    proc = swarmfd(multinode, "deploy", multinode.image_id, "-n", str(n), "--name", name,
                   "--max-per-node", "2", "--timeout", "60", "--",
                   "python", "-c", HIER_JOB, "--expect-two-level", "--sizes", "0,3,70000,300000")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    results = {}
    for rank, lines in rank_lines(proc.stdout).items():
        found = [ln for ln in lines if ln.startswith(HIER_PREFIX)]
        assert found, (rank, lines)
        results[rank] = json.loads(found[-1][len(HIER_PREFIX):])
    assert sorted(results) == list(range(n)), proc.stdout
    nodes = {r["host"] for r in results.values()}
    assert sorted(nodes) == sorted(node_names(multinode)), results
    for rank, r in results.items():
        assert r["failures"] == [] and r["shm"], (rank, r)
        layout = [sorted(h) for h in r["layout"]]
        assert sorted(layout) == sorted(
            sorted(q for q in results if results[q]["host"] == node) for node in nodes), r
    print(f"\nmultinode N={n}, two ranks per node, two-level collectives: {elapsed:.1f} s end "
          f"to end; layout {results[0]['layout']}, calls {results[0]['calls']}")


def test_bench_two_level_against_flat_two_ranks_per_node(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """`swarmfd bench` with 2 ranks per node, flat (SWARMFD_HIERARCHY=off) then
    two-level: both correct (bench checks its results); the tables are the report."""
    n = 2 * len(multinode.nodes)
    tables = {}
    for label, extra in (("flat", ("-e", "SWARMFD_HIERARCHY=off")), ("two-level", ())):
        started = time.monotonic()
        proc = swarmfd(multinode, "deploy", multinode.image_id, "-n", str(n), "--name",
                       job_name("hbench"), "--max-per-node", "2", *extra, "--",
                       "swarmfd", "bench", "--sizes", "64K,1M,16M", "--iters", "5",
                       "--op", "all_reduce", "--op", "broadcast", "--quiet")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        tables[label] = _bench_table(proc.stdout)
        assert "busbw" in tables[label], tables[label]
        print(f"\nswarmfd bench, {n} ranks, 2 per node on {len(multinode.nodes)} nodes, "
              f"{label} ({time.monotonic() - started:.1f} s):\n{tables[label]}")


# --- 4. your own project on every node: the in-cluster registry --------------------------


def test_own_project_reaches_the_other_nodes_through_the_registry(
        multinode: Any, tmp_path: Path, job_name: Callable[[str], str]) -> None:
    """deploy --build on the manager, one rank per node: without a registry the ranks on
    the other nodes cannot start and deploy says what to do (after warning first); with
    --push to the registry in the cluster every node pulls the image (by digest) and the
    job succeeds."""
    from tests.swarm.wheels import probe_lines, probe_project

    n = len(multinode.nodes)
    if n < 2:
        pytest.skip("needs at least two nodes")
    project, wheelhouse = probe_project(tmp_path)
    repo = f"mn-own-{uuid.uuid4().hex[:6]}"
    build = ["--build", str(project), "--base", multinode.image_id, "--wheelhouse",
             str(wheelhouse), "--no-index", "--image-name", repo]

    started = time.monotonic()
    # Without the preflight (which would refuse first: tests/multinode/test_doctor.py),
    # to see what the job itself says when its ranks cannot start.
    local = swarmfd(multinode, "deploy", *build, "-n", str(n), "--max-per-node", "1",
                    "--name", job_name("noreg"), "--rm", "--no-preflight", "--",
                    "python", "train.py")
    local_seconds = time.monotonic() - started
    assert local.returncode != 0, local.stdout + local.stderr
    assert f"warning: this Swarm has {n} nodes and the image {repo}:" in local.stderr
    assert re.search(r"rank \d+ was rejected \(it could not start\) on node swarmfd-mn-\d: "
                     r".*push it to a registry every node can reach", local.stderr), local.stderr
    built = re.search(rf"built {repo}:[0-9a-f]+ \(sha256:\w+, \d+ MB\) in ([\d.]+) s",
                      local.stderr)
    assert built, local.stderr

    name = job_name("reg")
    started = time.monotonic()
    proc = swarmfd(multinode, "deploy", *build, "--push", multinode.registry, "-n", str(n),
                   "--max-per-node", "1", "--name", name, "--keep", "--",
                   "python", "train.py")
    pushed_seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rank_lines(proc.stdout) == probe_lines(n), proc.stdout
    assert "is up to date" in proc.stderr  # built by the first deploy
    assert "this Swarm has" not in proc.stderr
    push = re.search(rf"pushed {re.escape(multinode.registry)}/{repo}:[0-9a-f]+ "
                     r"\(sha256:\w+\) in ([\d.]+) s", proc.stderr)
    assert push, proc.stderr
    running = re.search(r"all \d+ ranks running after ([\d.]+) s", proc.stderr)
    assert running, proc.stderr
    with multinode.manager.client() as client:
        service = client.api.services(filters={"label": f"{LABEL_JOB}={name}"})[0]
        image = service["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]
        assert re.fullmatch(rf"{re.escape(multinode.registry)}/{repo}:[0-9a-f]{{12}}"
                            r"@sha256:[0-9a-f]{64}", image), image
        tasks = client.api.tasks(filters={"service": service["ID"]})
        assert len({t["NodeID"] for t in tasks}) == n
    for node in multinode.nodes[1:]:  # the workers pulled it from the registry
        with node.client() as client:
            digests = [d for i in client.images.list() for d in i.attrs.get("RepoDigests", [])]
        assert any(d.startswith(f"{multinode.registry}/{repo}@sha256:") for d in digests), \
            (node.name, digests)
    rm = swarmfd(multinode, "rm", name)
    assert rm.returncode == 0, rm.stderr
    print(f"\nown project across {n} nodes: deploy --build without a registry failed as "
          f"expected in {local_seconds:.1f} s (cold build {built.group(1)} s); with --push "
          f"{pushed_seconds:.1f} s end to end (push {push.group(1)} s, all ranks running "
          f"{running.group(1)} s after the call)\nwithout a registry:\n"
          + "\n".join(line for line in local.stderr.splitlines()
                      if "warning" in line or "rejected" in line))


# --- 5. a node is lost mid-job (last: they stop a node) --------------------------------

ELASTIC = (
    "import os, time, numpy as np\n"
    "import swarmfd as fd\n"
    "fd.init_from_env()\n"
    "print(f'up {fd.get_rank()} {os.environ[\"SWARMFD_NODE\"]}', flush=True)\n"
    "state = fd.elastic.State(x=np.zeros(4096, np.float32), step=0)\n"
    "@fd.elastic.run\n"
    "def train(state):\n"
    "    while state.step < 200:\n"
    "        g = np.ones(4096, np.float32)\n"
    "        fd.all_reduce_mean(g)\n"
    "        state.x += g\n"
    "        state.step += 1\n"
    "        if state.step % 10 == 0:\n"
    "            state.commit()\n"
    "        time.sleep(0.05)\n"
    "train(state)\n"
    "print(f'done {fd.get_rank()} of {fd.get_world_size()} x={state.x[0]:.0f}', flush=True)\n"
)


def test_an_elastic_job_finishes_on_the_other_nodes_when_one_stops(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """deploy --elastic, one rank per node: node 2 stops dead mid-job (its container
    SIGKILLed: no FIN, no RST). The ranks on the others find its rank lost (TCP
    keepalive), re-form the world without it, resume from their last commit and finish
    (every step counted once: x = 200); deploy exits 0, stopping the replacement Swarm
    may start too late. Node 2 is started again."""
    n = len(multinode.nodes)
    if n < 3:
        pytest.skip("needs at least three nodes")
    name = job_name("elastic")
    victim = multinode.nodes[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DOCKER_HOST", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmfd", "deploy", "--host", multinode.manager.docker_host,
         multinode.image_id, "-n", str(n), "--name", name, "--max-per-node", "1", "--rm",
         "--elastic", "--", "python", "-c", ELASTIC],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    try:
        wait_until(lambda: proc.poll() is not None or sum(
            "] up " in line for _t, line in out.lines) == n, 120, "every rank up")
        assert proc.poll() is None, f"deploy ended early:\n{out.text()}\n{err.text()}"
        time.sleep(3.0)
        stopped = time.time()
        multinode.kill_node(victim.index)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"deploy did not end:\n{out.text()}\n{err.text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        multinode.start_node(victim.index)
    out.join(10)
    err.join(10)
    assert proc.returncode == 0, out.text() + err.text()
    done = re.findall(r"\] done (\d+) of (\d+) x=(\d+)", out.text())
    assert len(done) == n - 1 and all(d[1:] == (str(n - 1), "200") for d in done), out.text()
    reformed = [t - stopped for t, line in err.lines if "swarmfd: generation 1 after a lost "
                "rank" in line]
    assert reformed, err.text()
    print(f"\nelastic node loss: the survivors re-formed {min(reformed):.1f}-"
          f"{max(reformed):.1f} s after {victim.name} was killed")


LOOP = (
    "import os, time, numpy as np\n"
    "import swarmfd as fd\n"
    "cfg = fd.init_from_env()  # SWARMFD_TIMEOUT from --timeout\n"
    "print(f'up {cfg.rank} {os.environ[\"SWARMFD_NODE\"]}', flush=True)\n"
    "x = np.ones(4096, np.float32)\n"
    "try:\n"
    "    while True:\n"
    "        fd.all_reduce(x); x[:] = 1; time.sleep(0.02)\n"
    "except Exception as exc:\n"
    "    # a peer's abort relays its loss or timeout: name the public class it is\n"
    "    kind = next((k.__name__ for k in (fd.PeerLostError, fd.CollectiveTimeout)\n"
    "                 if isinstance(exc, k)), type(exc).__name__)\n"
    "    print(f'failed {cfg.rank} at {time.time():.3f}: {kind}: {exc}', flush=True)\n"
    "    raise SystemExit(1)\n"
)


class _Reader:
    """Collects a process's output lines with their arrival times, in a thread."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: Any) -> None:
        for line in stream:
            self.lines.append((time.time(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _t, line in self.lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def test_partitioned_node_is_named_and_the_job_ends(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """Cut node 2 off the network mid-job (no FIN, no RST: its processes live on). The
    surviving ranks fail by --timeout at the latest, naming the rank they wait for;
    deploy names the lost rank and its node once the manager declares it down, and
    nothing of the job is left on the nodes still reachable. Node 2 is reconnected."""
    n = len(multinode.nodes)
    if n < 3:
        pytest.skip("needs at least three nodes")
    name = job_name("part")
    victim = multinode.nodes[1]
    try:
        _stdout, stderr, failures, lost_rank, exited_after = _run_and_break(
            multinode, name, victim, timeout="8",
            action=lambda: multinode.disconnect_node(victim.index))
        assert f"rank {lost_rank} was lost: its node {victim.name} is down" in stderr, stderr
        assert f"job {name} failed: rank {lost_rank} was lost" in stderr, stderr
        for rank, (after, kind, message) in failures.items():
            assert kind in ("CollectiveTimeout", "PeerLostError"), (rank, message)
            assert f"rank {lost_rank}" in message, (rank, message)
            assert after < 8 + 5, f"rank {rank} failed only after {after:.1f} s"
        for node in multinode.nodes:
            if node is not victim:
                wait_until(lambda node=node: not any(job_objects_on(node, name).values()), 60,
                           f"job {name} gone from {node.name}")
    finally:
        multinode.reconnect_node(victim.index)
    detect = {rank: f"{after:.1f} s {kind}" for rank, (after, kind, _m) in failures.items()}
    print(f"\npartition of {victim.name}: surviving ranks failed after {detect}; deploy "
          f"exited after {exited_after:.1f} s")


def _run_and_break(cluster: Any, name: str, victim: Any, action: Callable[[], None],
                   timeout: str = "60") -> tuple[str, str, dict[int, Any], int, float]:
    """Deploy LOOP with one rank per node, break ``victim`` with ``action`` once every
    rank runs, wait for deploy; return its output, each rank's failure (seconds after
    the action, error type, message), the rank on the victim and deploy's exit time."""
    n = len(cluster.nodes)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DOCKER_HOST", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmfd", "deploy", "--host", cluster.manager.docker_host,
         cluster.image_id, "-n", str(n), "--name", name, "--max-per-node", "1", "--rm",
         "--local-ranks", "node", "--timeout", timeout, "--", "python", "-c", LOOP],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out, err = _Reader(proc.stdout), _Reader(proc.stderr)
    try:
        wait_until(lambda: proc.poll() is not None or sum(
            line.split("] ", 1)[-1].startswith("up ") for _t, line in out.lines) == n,
            90, "every rank up")
        assert proc.poll() is None, f"deploy ended early:\n{out.text()}\n{err.text()}"
        time.sleep(1.0)  # a few hundred all_reduces across the nodes
        ups = [line.split("] ", 1)[1].split() for _t, line in out.lines if "] up " in line]
        lost_rank = next(int(r) for _up, r, node in ups if node == victim.name)
        broken_at = time.time()
        action()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    out.join(10)
    err.join(10)
    exited_after = max(t for t, _line in err.lines) - broken_at
    stdout, stderr = out.text(), err.text()
    assert proc.returncode != 0, stdout + stderr
    failures = {}
    for _t, line in out.lines:
        m = re.match(r"^\[rank (\d+)\] failed (\d+) at ([\d.]+): (\w+): (.*)$", line)
        if m:
            failures[int(m.group(1))] = (float(m.group(3)) - broken_at, m.group(4), m.group(5))
    survivors = sorted(set(range(n)) - {lost_rank})
    assert sorted(failures) == survivors, stdout
    return stdout, stderr, failures, lost_rank, exited_after


def test_node_loss_fails_the_job_naming_the_rank_and_node(
        multinode: Any, job_name: Callable[[str], str]) -> None:
    """Stop the last node's container mid-job: every surviving rank fails within seconds
    naming the lost rank; deploy exits non-zero naming that rank and its node; nothing
    of the job is left on the other nodes."""
    n = len(multinode.nodes)
    if n < 2:
        pytest.skip("needs at least two nodes")
    name = job_name("loss")
    victim = multinode.nodes[-1]
    timing: dict[str, float] = {}

    def stop() -> None:
        started = time.time()
        multinode.stop_node(victim.index)
        timing["stop"] = time.time() - started

    _stdout, stderr, failures, lost_rank, exited_after = _run_and_break(
        multinode, name, victim, stop)
    for rank, (after, kind, message) in failures.items():
        assert kind == "PeerLostError", (rank, message)
        assert f"lost rank {lost_rank}" in message, (rank, message)
        assert after < 15, f"rank {rank} noticed the loss only after {after:.1f} s"
    # deploy names the lost rank and its node.
    assert f"rank {lost_rank} was lost: its node {victim.name} is down" in stderr, stderr
    assert f"job {name} failed: rank {lost_rank} was lost" in stderr, stderr
    # Nothing of the job is left on the nodes that are still up.
    for node in multinode.nodes[:-1]:
        wait_until(lambda node=node: not any(job_objects_on(node, name).values()), 60,
                   f"job {name} gone from {node.name}")
    detect = {rank: f"{after:.1f} s" for rank, (after, _k, _m) in failures.items()}
    print(f"\nnode loss: `docker stop` of {victim.name} took {timing['stop']:.1f} s; "
          f"surviving ranks failed after {detect}; deploy exited after {exited_after:.1f} s\n"
          + "\n".join(line for line in stderr.splitlines() if line.startswith("swarmfd deploy")))
