"""A multi-node Docker Swarm on one machine: N docker-in-docker nodes, for swarmfd's tests.

Each *node* is a container of the node image (``scripts/setup-docker.sh node``) running
its own dockerd; node 1 inits a Swarm of its own (separate from the host's) and the
others join it as workers, so swarmfd's ranks really sit on different Docker engines
and talk over an overlay network (VXLAN) between them. The host's engine only runs the
node containers.

* Nodes run without ``--privileged`` (on some VMs the capability bounding set lacks
  CAP_SYS_RESOURCE and runc then fails "unable to apply caps"): every other
  capability, no seccomp/AppArmor, all devices, a private cgroup namespace.
* Each node's ``/var/lib/docker`` is a labelled named volume (overlay2 cannot sit on
  the node's own overlay root); it is removed with the node.
* Nodes have fixed addresses on a labelled bridge network; the inner Swarm gets an
  address pool of its own so its overlays do not overlap the host's networks.
* Each inner engine's socket is bind-mounted out to ``<run dir>/node<i>/docker.sock``:
  ``DOCKER_HOST=unix://...`` reaches it from the host (CLI and SDK). Nothing listens
  on TCP.
* Images reach the nodes two ways. :meth:`Cluster.load_image` saves an image from the
  host once and loads it into every node (the image ID is the same everywhere, so a
  service can name it by ID). And node 1 runs a registry (Debian's docker-registry, a
  process in the node, plain HTTP on port 5000, its storage on node 1's volume):
  :attr:`Cluster.registry` is its address, which every node's dockerd trusts
  (``--insecure-registry``), so an image pushed there from node 1's engine is pulled
  by the workers, as on a real cluster with a registry.

:meth:`Cluster.add_worker` starts one more node, joined as a worker, into which no image
is loaded (a node an image is missing on); :meth:`Cluster.remove_worker` removes it.

Everything the harness creates (containers, volumes, network) carries the label
``org.swarmfd.multinode``; :func:`cleanup_leftovers` removes all of it, e.g. what a
crashed run left behind. Command line (also ``scripts/multinode.sh``)::

    python -m tests.multinode.cluster up [-n 3] [--image swarmfd:latest]
    python -m tests.multinode.cluster down
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

LABEL = "org.swarmfd.multinode"
DEFAULT_NODE_IMAGE = "swarmfd-node:bookworm-3"
DEFAULT_RUN_DIR = Path("/run/swarmfd-multinode")
DEFAULT_SUBNET_PREFIX = "172.30.76"  # the nodes' bridge: <prefix>.0/24, node i at .10+i
DEFAULT_INNER_POOL = "10.201.0.0/16"  # the inner Swarm's overlay networks
#: Nodes 2..N can advertise this many "gpu" generic resources (named ``<node>-gpu<k>``,
#: as GPU nodes advertise UUIDs). Off by default: Docker 20.10.24 (Debian's docker.io)
#: accepts the service but then rejects every task that reserves one, with "assigned
#: node no longer meets constraints" (discrete and named advertisements alike).
DEFAULT_GPUS_PER_WORKER = 0
NAME_PREFIX = "swarmfd-mn"
ENGINE_WAIT = 60.0
READY_WAIT = 60.0
REGISTRY_PORT = 5000
#: The registry answered /v2/ within about 0.3 s of its start here.
REGISTRY_WAIT = 30.0
REGISTRY_CONFIG = (
    "version: 0.1\n"
    "storage:\n  filesystem:\n    rootdirectory: /var/lib/docker/swarmfd-registry\n"
    f"http:\n  addr: :{REGISTRY_PORT}\n"
)

# --privileged without CAP_SYS_RESOURCE (see the module docstring). The CLI's
# `--security-opt systempaths=unconfined` is MaskedPaths/ReadonlyPaths [] in the API.
NODE_SECURITY: dict[str, Any] = {
    "cap_add": ["ALL"],
    "cap_drop": ["SYS_RESOURCE"],
    "security_opt": ["seccomp=unconfined", "apparmor=unconfined"],
    "device_cgroup_rules": ["a *:* rwm"],
    "cgroupns": "private",
}


def _now() -> float:
    return time.monotonic()


@dataclass
class Node:
    """One docker-in-docker node: its container, address and engine socket."""

    index: int
    name: str
    ip: str
    socket_dir: Path
    container_id: str = ""

    @property
    def docker_host(self) -> str:
        """The ``DOCKER_HOST`` URL of this node's inner engine."""
        return f"unix://{self.socket_dir / 'docker.sock'}"

    @contextlib.contextmanager
    def client(self, timeout: int = 60) -> Iterator[docker.DockerClient]:
        """A Docker SDK client of this node's inner engine, closed on exit."""
        client = docker.DockerClient(base_url=self.docker_host, timeout=timeout)
        try:
            yield client
        finally:
            client.close()


@dataclass
class Cluster:
    """N docker-in-docker nodes forming one Swarm (node 1 the manager).

    ``up()`` starts it, ``load_image()`` puts an image on every node, ``down()``
    removes everything it created; ``timings`` records how long each step took.
    """

    size: int = 3
    node_image: str = DEFAULT_NODE_IMAGE
    run_dir: Path = DEFAULT_RUN_DIR
    subnet_prefix: str = DEFAULT_SUBNET_PREFIX
    inner_pool: str = DEFAULT_INNER_POOL
    gpus_per_worker: int = DEFAULT_GPUS_PER_WORKER
    log: Callable[[str], None] = field(default=lambda line: None)
    host: docker.DockerClient = field(default_factory=lambda: docker.from_env(timeout=120))
    nodes: list[Node] = field(default_factory=list)
    image_id: str = ""  # the last image load_image() put on every node
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 200:
            raise ValueError(f"cluster size must be 1..200 nodes, got {self.size}")
        self.nodes = [
            Node(i, f"{NAME_PREFIX}-{i}", f"{self.subnet_prefix}.{10 + i}",
                 self.run_dir / f"node{i}")
            for i in range(1, self.size + 1)
        ]

    @property
    def network_name(self) -> str:
        return f"{NAME_PREFIX}-net"

    @property
    def manager(self) -> Node:
        return self.nodes[0]

    @property
    def registry(self) -> str:
        """``HOST:PORT`` of the registry in node 1 (``swarmfd deploy --push`` target)."""
        return f"{self.manager.ip}:{REGISTRY_PORT}"

    # --- up --------------------------------------------------------------------------

    def up(self) -> Cluster:
        """Start the nodes and form the Swarm; on any error remove what was created."""
        started = _now()
        try:
            self._start_nodes()
            self.timings["engines"] = _now() - started
            self._form_swarm()
            self._start_registry()
        except BaseException:
            self.down()
            raise
        self.timings["up"] = _now() - started
        self.log(f"multinode: {self.size}-node Swarm ready in {self.timings['up']:.1f} s "
                 f"(engines {self.timings['engines']:.1f} s)")
        return self

    def _start_nodes(self) -> None:
        try:
            self.host.images.get(self.node_image)
        except docker.errors.ImageNotFound:
            raise RuntimeError(
                f"node image {self.node_image} is missing: build it with "
                "`sudo scripts/setup-docker.sh node`"
            ) from None
        labels = {LABEL: "1"}
        ipam = docker.types.IPAMConfig(pool_configs=[
            docker.types.IPAMPool(subnet=f"{self.subnet_prefix}.0/24")])
        self.host.networks.create(self.network_name, driver="bridge", ipam=ipam,
                                            labels=labels)
        for node in self.nodes:
            self._create_node(node)
        deadline = _now() + ENGINE_WAIT
        for node in self.nodes:
            self._wait_engine(node, deadline)

    def _create_node(self, node: Node) -> None:
        """Create and start ``node``'s container (its engine is not waited for)."""
        labels = {LABEL: "1"}
        node.socket_dir.mkdir(parents=True, exist_ok=True)
        volume = self.host.volumes.create(f"{node.name}-data", labels=labels)
        host_config = self.host.api.create_host_config(
            binds={volume.name: {"bind": "/var/lib/docker", "mode": "rw"},
                   str(node.socket_dir): {"bind": "/run/dind", "mode": "rw"}},
            network_mode=self.network_name,
            **NODE_SECURITY,
        )
        host_config.update({"MaskedPaths": [], "ReadonlyPaths": []})
        endpoint = self.host.api.create_endpoint_config(ipv4_address=node.ip)
        dockerd_args = ["--host=unix:///run/dind/docker.sock",
                        f"--insecure-registry={self.registry}"]
        if node.index > 1 and self.gpus_per_worker:
            dockerd_args += [f"--node-generic-resource=gpu={node.name}-gpu{k}"
                             for k in range(self.gpus_per_worker)]
        created = self.host.api.create_container(
            self.node_image,
            command=dockerd_args,
            name=node.name,
            hostname=node.name,
            labels=labels,
            detach=True,
            host_config=host_config,
            networking_config=self.host.api.create_networking_config(
                {self.network_name: endpoint}),
        )
        node.container_id = str(created["Id"])
        self.host.api.start(node.container_id)

    def add_worker(self) -> Node:
        """Start one more node (with no image: none is loaded into it) and join it to the
        Swarm as a worker; it is not in :attr:`nodes`. :meth:`remove_worker` removes it
        (and :meth:`down` does anyway)."""
        index = max(n.index for n in self.nodes) + 1
        node = Node(index, f"{NAME_PREFIX}-{index}", f"{self.subnet_prefix}.{10 + index}",
                    self.run_dir / f"node{index}")
        self._create_node(node)
        self._wait_engine(node, _now() + ENGINE_WAIT)
        with self.manager.client() as mgr:
            token = mgr.swarm.attrs["JoinTokens"]["Worker"]
        with node.client() as client:
            client.swarm.join(remote_addrs=[f"{self.manager.ip}:2377"], join_token=token,
                              advertise_addr=node.ip, listen_addr=f"{node.ip}:2377")
        self._wait_ready(len(self.nodes) + 1)
        return node

    def remove_worker(self, node: Node) -> None:
        """Undo :meth:`add_worker`: the node leaves the Swarm, its container and volume go."""
        with contextlib.suppress(docker.errors.DockerException), node.client(timeout=20) as c:
            c.swarm.leave(force=True)
        with self.manager.client() as mgr:
            for found in mgr.api.nodes(filters={"name": node.name}):
                with contextlib.suppress(docker.errors.NotFound):
                    mgr.api.remove_node(found["ID"], force=True)
        with contextlib.suppress(docker.errors.NotFound):
            self.host.api.remove_container(node.container_id, force=True, v=True)
        with contextlib.suppress(docker.errors.NotFound):
            self.host.api.remove_volume(f"{node.name}-data", force=True)
        shutil.rmtree(node.socket_dir, ignore_errors=True)

    def _wait_engine(self, node: Node, deadline: float) -> None:
        last = ""
        while _now() < deadline:
            if (node.socket_dir / "docker.sock").exists():
                try:
                    with node.client(timeout=5) as client:
                        client.ping()
                    return
                except docker.errors.DockerException as exc:
                    last = str(exc)
            state = self.host.api.inspect_container(node.container_id)["State"]
            if not state.get("Running"):
                break
            time.sleep(0.2)
        logs = self.host.api.logs(node.container_id, tail=20).decode(errors="replace")
        raise RuntimeError(f"node {node.name}: its dockerd did not answer ({last}):\n{logs}")

    def health(self, tail: int = 30) -> str:
        """Each node: its container's state and whether its engine answers; for a node
        whose engine does not, the last ``tail`` lines of its container's log (dockerd's
        own). For a failed test's report: a node that went away says why."""
        lines = []
        for node in self.nodes:
            try:
                state = self.host.api.inspect_container(node.container_id)["State"]
                status = (f"{state.get('Status')} (exit {state.get('ExitCode')}, "
                          f"OOM-killed {state.get('OOMKilled')}, "
                          f"started {state.get('StartedAt')}, finished {state.get('FinishedAt')})")
            except docker.errors.DockerException as exc:
                lines.append(f"{node.name}: container not found ({exc})")
                continue
            try:
                with node.client(timeout=5) as client:
                    client.ping()
                lines.append(f"{node.name}: {status}; engine answers")
            except docker.errors.DockerException as exc:
                log = self.host.api.logs(node.container_id, tail=tail).decode(errors="replace")
                lines.append(f"{node.name}: {status}; engine does not answer ({exc}); "
                             f"last {tail} log lines:\n{log}")
        return "\n".join(lines)

    def broken(self) -> str:
        """"" when every node's container runs and its engine answers; else the health
        report (:meth:`health`) that says which does not, and why."""
        for node in self.nodes:
            try:
                state = self.host.api.inspect_container(node.container_id)["State"]
                if not state.get("Running"):
                    return self.health()
                with node.client(timeout=10) as client:
                    client.ping()
            except docker.errors.DockerException:
                return self.health()
        return ""

    def rebuild(self) -> None:
        """Remove the cluster and bring it up again, with the image it had: after a node's
        engine died under the tests (Debian's dockerd 20.10.24 panicked once in CI, a nil
        task in swarmkit's SetServiceTasksRemove while a service was removed; upstream
        moby/swarmkit#3216), so the tests after it run on a whole Swarm, not on a
        cluster with a dead manager."""
        image = self.image_id
        self.down()
        self.up()
        if image:
            self.load_image(image)

    def _form_swarm(self) -> None:
        with self.manager.client() as mgr:
            mgr.swarm.init(advertise_addr=self.manager.ip,
                           listen_addr=f"{self.manager.ip}:2377",
                           default_addr_pool=[self.inner_pool], subnet_size=24)
            token = mgr.swarm.attrs["JoinTokens"]["Worker"]

        def join(node: Node) -> None:
            with node.client() as client:
                client.swarm.join(remote_addrs=[f"{self.manager.ip}:2377"], join_token=token,
                                  advertise_addr=node.ip, listen_addr=f"{node.ip}:2377")

        _parallel([lambda node=node: join(node) for node in self.nodes[1:]])
        self._wait_ready(self.size)

    def _wait_ready(self, count: int) -> None:
        """Wait until the manager lists ``count`` nodes as ready."""
        deadline = _now() + READY_WAIT
        with self.manager.client() as mgr:
            while True:
                ready = [n for n in mgr.api.nodes() if n["Status"]["State"] == "ready"]
                if len(ready) == count:
                    return
                if _now() > deadline:
                    raise RuntimeError(f"only {len(ready)} of {count} nodes are Ready "
                                       f"after {READY_WAIT:.0f} s")
                time.sleep(0.2)

    def _start_registry(self) -> None:
        """Run docker-registry in node 1 and wait until it answers."""
        started = _now()
        script = (f"mkdir -p /var/lib/docker/swarmfd-registry && printf '%s' '{REGISTRY_CONFIG}'"
                  " > /etc/swarmfd-registry.yml && exec docker-registry serve "
                  "/etc/swarmfd-registry.yml >/var/log/swarmfd-registry.log 2>&1")
        exec_id = self.host.api.exec_create(self.manager.container_id, ["sh", "-c", script])
        self.host.api.exec_start(exec_id, detach=True)
        deadline = _now() + REGISTRY_WAIT
        last = ""
        while _now() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.registry}/v2/", timeout=2) as reply:
                    if reply.status == 200:
                        self.timings["registry"] = _now() - started
                        return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RuntimeError(f"the registry in {self.manager.name} did not answer at "
                           f"http://{self.registry}/v2/ within {REGISTRY_WAIT:.0f} s ({last})")

    # --- images ----------------------------------------------------------------------

    def load_image(self, image: str) -> str:
        """Put the host's ``image`` on every node (docker save once, load in parallel);
        return its ID, which is the same on every node."""
        started = _now()
        image_id = str(self.host.images.get(image).id)
        with tempfile.TemporaryDirectory(prefix="swarmfd-mn-img-", dir="/var/tmp") as tmp:
            tar = Path(tmp) / "image.tar"
            with tar.open("wb") as fh:
                for chunk in self.host.api.get_image(image_id, chunk_size=1 << 20):
                    fh.write(chunk)
            saved = _now() - started

            def load(node: Node) -> None:
                with node.client(timeout=600) as client, tar.open("rb") as fh:
                    client.api.load_image(fh, quiet=True)
                    found = str(client.images.get(image_id).id)
                if found != image_id:  # pragma: no cover - docker load keeps IDs
                    raise RuntimeError(f"{node.name}: loaded {found}, expected {image_id}")

            _parallel([lambda node=node: load(node) for node in self.nodes])
            size = tar.stat().st_size
        self.timings["image_save"] = saved
        self.timings["image_load"] = _now() - started
        self.image_id = image_id
        self.log(f"multinode: image {image_id[:19]} ({size / 1e6:.0f} MB) on "
                 f"{self.size} nodes in {self.timings['image_load']:.1f} s "
                 f"(save {saved:.1f} s)")
        return image_id

    # --- failures ----------------------------------------------------------------------

    def stop_node(self, index: int, *, timeout: int = 10) -> None:
        """Stop node ``index``'s container (its engine and every task on it go away)."""
        self.host.api.stop(self.nodes[index - 1].container_id, timeout=timeout)

    def start_node(self, index: int, timeout: float = READY_WAIT) -> None:
        """Start node ``index``'s stopped container again and wait until the manager lists
        the node as ready (its engine keeps its Swarm state in the container)."""
        node = self.nodes[index - 1]
        self.host.api.start(node.container_id)
        self._wait_listed_ready(node, timeout)

    def disconnect_node(self, index: int) -> None:
        """Cut node ``index`` off the other nodes (a network partition: its processes
        live on, nothing tells the peers, packets are simply lost)."""
        self.host.api.disconnect_container_from_network(self.nodes[index - 1].container_id,
                                                        self.network_name)

    def reconnect_node(self, index: int, timeout: float = READY_WAIT) -> None:
        """Undo :meth:`disconnect_node` (same address) and wait until the manager lists the
        node as ready again."""
        node = self.nodes[index - 1]
        self.host.api.connect_container_to_network(node.container_id, self.network_name,
                                                   ipv4_address=node.ip)
        self._wait_listed_ready(node, timeout)

    def _wait_listed_ready(self, node: Node, timeout: float) -> None:
        deadline = _now() + timeout
        with self.manager.client() as mgr:
            while True:
                states = {n["Description"]["Hostname"]: n["Status"]["State"]
                          for n in mgr.api.nodes()}
                if states.get(node.name) == "ready":
                    return
                if _now() > deadline:
                    raise RuntimeError(f"{node.name} is {states.get(node.name)!r}, not ready, "
                                       f"{timeout:.0f} s after it came back")
                time.sleep(0.3)

    def ipsec_error(self) -> str:
        """Why IPsec (ESP with AES-GCM, what Docker's encrypted overlay uses) cannot work
        in node 1's kernel, or "" when it can: tries to add such an ESP state in a
        throw-away network namespace."""
        probe = ("unshare -n ip xfrm state add src 10.0.0.1 dst 10.0.0.2 proto esp spi 0x100 "
                 "mode transport aead 'rfc4106(gcm(aes))' "
                 "0x0102030405060708090a0b0c0d0e0f1011121314 128")
        exec_id = self.host.api.exec_create(self.manager.container_id, ["sh", "-c", probe])
        output = self.host.api.exec_start(exec_id).decode(errors="replace").strip()
        code = self.host.api.exec_inspect(exec_id)["ExitCode"]
        return "" if code == 0 else f"`ip xfrm state add ... aead rfc4106(gcm(aes))`: {output}"

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index``'s container."""
        self.host.api.kill(self.nodes[index - 1].container_id)

    # --- down --------------------------------------------------------------------------

    def down(self) -> float:
        """Remove the nodes, their volumes, the network and the socket folders."""
        started = _now()
        cleanup_leftovers(self.host, self.run_dir)
        self.timings["down"] = _now() - started
        self.log(f"multinode: cluster removed in {self.timings['down']:.1f} s")
        return self.timings["down"]

    def env(self) -> dict[str, str]:
        """Environment variables that point docker tools at the inner manager."""
        return {"DOCKER_HOST": self.manager.docker_host}


def _parallel(calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` in threads; re-raise the first error after all ended."""
    errors: list[BaseException] = []

    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def leftovers(host: docker.DockerClient) -> dict[str, list[str]]:
    """Names of the harness's containers, volumes and networks that exist now."""
    label = {"label": LABEL}
    return {
        "containers": [c["Names"][0].lstrip("/")
                       for c in host.api.containers(all=True, filters=label)],
        "volumes": [v["Name"] for v in host.api.volumes(filters=label).get("Volumes") or []],
        "networks": [n["Name"] for n in host.api.networks(filters=label)],
    }


def cleanup_leftovers(host: docker.DockerClient, run_dir: Path = DEFAULT_RUN_DIR,
                      timeout: float = 60.0) -> None:
    """Remove every container, volume and network labelled ``org.swarmfd.multinode``
    (this run's or a crashed earlier run's), and the socket folders."""
    label = {"label": LABEL}
    containers = host.api.containers(all=True, filters=label)

    def remove(cid: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            host.api.remove_container(cid, force=True, v=True)

    _parallel([lambda cid=c["Id"]: remove(cid) for c in containers])
    deadline = _now() + timeout
    # Also the nodes' data volumes by name: one removed while its node was being created
    # is made again by the container's bind, without the label, and would then give the
    # next cluster a node that is already part of a swarm.
    named = re.compile(rf"{re.escape(NAME_PREFIX)}-\d+-data")
    volumes = {v["Name"]: v for v in host.api.volumes().get("Volumes") or []
               if named.fullmatch(v["Name"])}
    volumes.update({v["Name"]: v for v in host.api.volumes(filters=label).get("Volumes") or []})
    for vol in volumes.values():
        while True:
            try:
                host.api.remove_volume(vol["Name"], force=True)
                break
            except docker.errors.NotFound:
                break
            except docker.errors.APIError:
                if _now() > deadline:
                    raise
                time.sleep(0.3)
    for net in host.api.networks(filters=label):
        with contextlib.suppress(docker.errors.NotFound):
            host.api.remove_network(net["Id"])
    if run_dir.exists():
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multinode", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start an N-node Swarm (removing leftovers first)")
    up.add_argument("-n", "--nodes", type=int, default=3)
    up.add_argument("--image", action="append", default=[],
                    help="host image to load on every node; repeatable")
    up.add_argument("--node-image", default=os.environ.get("SWARMFD_NODE_IMAGE",
                                                           DEFAULT_NODE_IMAGE))
    sub.add_parser("down", help="remove every node, volume and network of the harness")
    sub.add_parser("status", help="list what of the harness exists")
    args = parser.parse_args(argv)
    host = docker.from_env(timeout=120)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.cmd == "down":
        started = _now()
        cleanup_leftovers(host)
        log(f"multinode: removed in {_now() - started:.1f} s")
        return 0
    if args.cmd == "status":
        for kind, names in leftovers(host).items():
            print(f"{kind}: {' '.join(names) or '-'}")
        return 0
    cleanup_leftovers(host)
    cluster = Cluster(args.nodes, node_image=args.node_image, log=log, host=host).up()
    for image in args.image:
        print(f"IMAGE_ID={cluster.load_image(image)}")
    print(f"DOCKER_HOST={cluster.manager.docker_host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
