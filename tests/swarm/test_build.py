"""``swarmfd build`` and ``swarmfd deploy --build`` against the real engine.

A project directory (a script and a requirements file naming a small pure-Python package
from a wheelhouse made by the test, offline: ``--no-index``) is built FROM the swarmfd
image and deployed with ``-n 3``; building it again finds the image by its content tag;
an edited script rebuilds on the cached dependency stage. Every image the test makes
carries a unique repository name and is removed at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.swarm_jobs import job_names, rank_lines
from tests.swarm.wheels import probe_lines, probe_project

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]

def swarmfd(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "swarmfd", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture
def image_repo(docker_client: Any) -> Iterator[str]:
    """A unique image repository; every image of it is removed afterwards."""
    repo = f"sfdt-build-{uuid.uuid4().hex[:8]}"
    yield repo
    for image in docker_client.images.list(name=repo):
        for tag in image.tags:
            with contextlib.suppress(Exception):
                docker_client.images.remove(tag, force=True)


@pytest.fixture
def job_name(swarm: Any) -> Iterator[Callable[[str], str]]:
    with job_names(swarm, "sfdt") as make:
        yield make


def test_own_project_is_built_from_a_wheelhouse_deployed_and_not_rebuilt(
        swarm: Any, swarmfd_image: str, tmp_path: Path, image_repo: str,
        job_name: Callable[[str], str]) -> None:
    """deploy --build DIR (requirements.txt naming a wheelhouse package that needs numpy,
    offline) -n 3: exit 0, every rank imports the package; build again: up to date, same
    tag; an edited script: a new tag, the packages' stage from the cache."""
    project, wheelhouse = probe_project(tmp_path)
    build_opts = ["--base", swarmfd_image, "--wheelhouse", str(wheelhouse), "--no-index",
                  "--image-name", image_repo]

    name = job_name("own")
    started = time.monotonic()
    proc = swarmfd("deploy", "--build", str(project), *build_opts, "-n", "3", "--name", name,
                   "--", "python", "train.py")
    deploy_seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert lines == probe_lines(3), proc.stdout
    built = re.search(rf"built ({image_repo}:[0-9a-f]{{12}}) \(sha256:[0-9a-f]+, \d+ MB\) in "
                      r"([\d.]+) s", proc.stderr)
    assert built, proc.stderr
    assert "swarmfd_probe_pkg-1.0-py3-none-any.whl" in proc.stderr  # pip's progress
    assert "Step 1/" in proc.stderr  # the build's progress
    assert "numpy" not in proc.stderr.split("go into the build:")[1].splitlines()[0]
    assert f"job {name} done: all 3 ranks exited 0" in proc.stderr
    tag = built.group(1)

    started = time.monotonic()
    again = swarmfd("build", str(project), *build_opts)
    cached_seconds = time.monotonic() - started
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == tag
    assert f"{tag} is up to date" in again.stderr and "Step 1/" not in again.stderr

    with (project / "train.py").open("a") as fh:
        fh.write("# edited\n")
    started = time.monotonic()
    edited = swarmfd("build", str(project), *build_opts)
    edit_seconds = time.monotonic() - started
    assert edited.returncode == 0, edited.stderr
    new_tag = edited.stdout.strip()
    assert new_tag.startswith(f"{image_repo}:") and new_tag != tag
    # The package stage (COPY wheels, pip install) comes from the cache.
    install = edited.stderr.split("Step 3/")[1].split("Step 5/")[0]
    assert install.count("(cached)") == 2, edited.stderr
    repos = {t for image in swarm.images.list(name=image_repo) for t in image.tags}
    assert {tag, new_tag, f"{image_repo}:deps"} == repos
    assert not swarm.images.list(filters={"dangling": True,
                                          "label": "org.swarmfd.build.deps"})
    print(f"\nown project: deploy --build -n 3 (cold build) {deploy_seconds:.1f} s "
          f"(build {built.group(2)} s); build again (up to date) {cached_seconds:.1f} s; "
          f"after an edit {edit_seconds:.1f} s")
