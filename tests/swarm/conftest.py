"""Fixtures for tests against a real Docker engine and a one-node Swarm.

Nothing here is mocked: the fixtures talk to the engine through the Docker SDK.

``docker_client``   a ``docker.DockerClient`` for the local engine (under
                    ``scripts/test.sh`` it first runs ``scripts/setup-docker.sh engine``,
                    see ``docker_setup.py``); the tests are skipped when no engine
                    answers (with ``CI=true`` they fail instead)
``swarm``           the client, after checking this node is an active Swarm manager
``swarmfd_image``   the ID (``sha256:...``) of the swarmfd image, built or refreshed by
                    ``scripts/setup-docker.sh base wheelhouse image`` (fast when nothing
                    changed); ``SWARMFD_TEST_IMAGE=<id or tag>`` uses that image instead.
                    Tests refer to the image by ID so no task ever tries a registry.
``unique_name``     a factory of unique, recognisable names for services and networks
``overlay_network`` an attachable overlay network (labelled), removed at teardown
``remove_service``  a callable: remove a service and wait (bounded) for its containers

Run the engine-side set-up first (as root): ``scripts/setup-docker.sh``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import unavailable
from tests.swarm.docker_setup import ensure_engine

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "setup-docker.sh"
TEST_LABEL = "org.swarmfd.test"
IMAGE_BUILD_TIMEOUT = 900.0
CLEANUP_TIMEOUT = 60.0


def _unavailable(reason: str) -> None:
    """Skip, or fail under CI where the engine is a requirement, not an option."""
    unavailable(reason, what="the Swarm tests", fix="run `sudo scripts/setup-docker.sh`")


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A Docker SDK client for the local engine (API version negotiated)."""
    try:
        import docker
    except ImportError:  # pragma: no cover - docker is a runtime dependency
        _unavailable("the docker SDK is not installed")
    problem = ensure_engine()
    if problem:
        _unavailable(problem)
    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except docker.errors.DockerException as exc:
        _unavailable(f"no Docker engine answers ({exc})")
    yield client
    client.close()


@pytest.fixture(scope="session")
def swarm(docker_client: Any) -> Any:
    """The client, checked to be a manager of an active Swarm."""
    info = docker_client.info()["Swarm"]
    state = info.get("LocalNodeState")
    if state != "active":
        _unavailable(f"the Docker engine is not in a Swarm (LocalNodeState={state!r})")
    assert info.get("ControlAvailable"), "this node is in a Swarm but is not a manager"
    return docker_client


@pytest.fixture(scope="session")
def swarmfd_image(docker_client: Any) -> str:
    """The swarmfd image's ID, built from the working tree by scripts/setup-docker.sh."""
    override = os.environ.get("SWARMFD_TEST_IMAGE", "").strip()
    if override:
        return str(docker_client.images.get(override).id)
    try:
        proc = subprocess.run(
            ["bash", str(SETUP_SCRIPT), "base", "wheelhouse", "image"],
            capture_output=True,
            text=True,
            timeout=IMAGE_BUILD_TIMEOUT,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{SETUP_SCRIPT} did not build the image within {IMAGE_BUILD_TIMEOUT:.0f} s")
    if proc.returncode != 0:
        pytest.fail(
            f"{SETUP_SCRIPT} base wheelhouse image failed (exit {proc.returncode}):\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    ids = [
        line.split("=", 1)[1]
        for line in proc.stdout.splitlines()
        if line.startswith("SWARMFD_IMAGE_ID=")
    ]
    assert ids, f"{SETUP_SCRIPT} printed no SWARMFD_IMAGE_ID line:\n{proc.stdout}"
    image_id = ids[-1].strip()
    assert image_id.startswith("sha256:"), image_id
    return image_id


@pytest.fixture
def unique_name() -> Callable[[str], str]:
    """Return a factory: ``unique_name("img")`` -> ``"swarmfd-test-img-1a2b3c4d"``."""

    def make(what: str) -> str:
        return f"swarmfd-test-{what}-{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture
def overlay_network(swarm: Any, unique_name: Callable[[str], str]) -> Iterator[Any]:
    """An attachable overlay network for one test, removed after its services."""
    network = swarm.networks.create(
        unique_name("net"),
        driver="overlay",
        attachable=True,
        labels={TEST_LABEL: "1"},
    )
    try:
        yield network
    finally:
        remove_network(swarm, network)


@pytest.fixture
def remove_service(swarm: Any) -> Callable[[Any], None]:
    """Return ``remove(service)``: remove it and wait until its task containers are gone."""

    def remove(service: Any) -> None:
        _remove_service(swarm, service)

    return remove


def _remove_service(client: Any, service: Any, timeout: float = CLEANUP_TIMEOUT) -> None:
    """Remove a service and wait (bounded) until its task containers are gone."""
    import docker

    name = service.name
    with contextlib.suppress(docker.errors.NotFound):
        service.remove()
    deadline = time.monotonic() + timeout
    label = f"com.docker.swarm.service.name={name}"
    # The low-level list: containers.list() inspects each listed container, and one that
    # Docker removes in between makes that inspect fail (404), as happened in a CI run.
    while client.api.containers(all=True, filters={"label": label}):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"containers of service {name} still exist {timeout:.0f} s after removal"
            )
        time.sleep(0.2)


def remove_network(client: Any, network: Any, timeout: float = CLEANUP_TIMEOUT) -> None:
    """Remove a network, retrying while a just-removed task still holds an endpoint."""
    import docker

    deadline = time.monotonic() + timeout
    while True:
        try:
            network.remove()
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
