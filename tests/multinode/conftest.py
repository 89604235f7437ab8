"""The multi-node Swarm harness as a pytest fixture (session scope).

``multinode`` stands up an N-node Swarm of docker-in-docker nodes on this machine
(:mod:`tests.multinode.cluster`; N from ``SWARMFD_MN_NODES``, default 3), puts the
swarmfd image (built from the working tree by ``scripts/setup-docker.sh``) on every
node, and yields the :class:`~tests.multinode.cluster.Cluster`: swarmfd is pointed at
its inner manager with ``--host`` or ``DOCKER_HOST``. Leftovers of a crashed earlier
run are removed first (by label); at the end everything is removed, whether the
tests passed or not, and the teardown fails if any container, volume or network of
the harness is left.

Prerequisites (root, a Docker engine, the node image) missing: the tests skip, or
fail under ``CI=true``, like the single-node Swarm tests.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import unavailable

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup-docker.sh"
BUILD_TIMEOUT = 900.0


#: The cluster while the session's fixture holds it (for failure reports).
_CLUSTERS: list[Any] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed or erroring multi-node test's report gets the nodes' health: which node's
    engine stopped answering, and the end of its log (a CI run once found the manager's
    engine gone mid-lane, with nothing to say why)."""
    report = yield
    if report.failed and _CLUSTERS:
        try:
            report.sections.append(("multinode nodes", _CLUSTERS[0].health()))
        except Exception as exc:  # a report must not fail for want of a health check
            report.sections.append(("multinode nodes", f"health check failed: {exc!r}"))
    return report


def _unavailable(reason: str) -> None:
    unavailable(reason, what="the multi-node tests", fix="run `sudo scripts/setup-docker.sh`")


def _build() -> dict[str, str]:
    """Build (or find up to date) the swarmfd image and the node image; their names."""
    try:
        proc = subprocess.run(["bash", str(SETUP_SCRIPT), "base", "wheelhouse", "image", "node"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{SETUP_SCRIPT} did not finish within {BUILD_TIMEOUT:.0f} s")
    if proc.returncode != 0:
        _unavailable(f"{SETUP_SCRIPT} base wheelhouse image node failed "
                     f"(exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines()
                 if line.startswith(("SWARMFD_IMAGE_ID=", "SWARMFD_NODE_IMAGE=")))
    return found


@pytest.fixture(autouse=True)
def _whole_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """Before each test of the cluster: every node's engine answers, or the cluster is
    rebuilt, loudly (Cluster.rebuild: an engine that crashed under an earlier test must
    not fail the tests after it). A test that takes nodes down restores them or is last."""
    if "multinode" in request.fixturenames:
        cluster = request.getfixturevalue("multinode")
        problem = cluster.broken()
        if problem:
            print(f"multinode: a node's engine is gone, rebuilding the cluster:\n{problem}",
                  flush=True)
            cluster.rebuild()
    yield


@pytest.fixture(scope="session")
def multinode() -> Iterator[Any]:
    """An N-node docker-in-docker Swarm with the swarmfd image on every node.

    Attributes used by the tests: ``cluster.manager.docker_host`` (the inner manager),
    ``cluster.image_id``, ``cluster.nodes``, ``cluster.timings``.
    """
    if os.geteuid() != 0:
        _unavailable("the multi-node harness runs node containers with extra capabilities "
                     "and needs root")
    from tests.swarm.docker_setup import ensure_engine

    problem = ensure_engine()
    if problem:
        _unavailable(problem)
    try:
        import docker

        host = docker.from_env(timeout=120)
        host.ping()
    except Exception as exc:  # the SDK's errors, or no SDK at all
        _unavailable(f"no Docker engine answers ({exc})")
    from tests.multinode.cluster import Cluster, cleanup_leftovers, leftovers

    built = _build()
    image = os.environ.get("SWARMFD_TEST_IMAGE", "").strip() or built.get("SWARMFD_IMAGE_ID", "")
    node_image = built.get("SWARMFD_NODE_IMAGE", "")
    assert node_image, "scripts/setup-docker.sh printed no SWARMFD_NODE_IMAGE"
    assert image, "scripts/setup-docker.sh printed no SWARMFD_IMAGE_ID"
    size = int(os.environ.get("SWARMFD_MN_NODES", "3"))
    cleanup_leftovers(host)

    def log(line: str) -> None:
        print(line, flush=True)

    cluster = Cluster(size, node_image=node_image, host=host, log=log)
    try:
        cluster.up()
        cluster.load_image(image)
        _CLUSTERS.append(cluster)
        yield cluster
    finally:
        _CLUSTERS.clear()
        cluster.down()
        left = leftovers(host)
        host.close()
        assert not any(left.values()), f"the harness left behind: {left}"
