"""A deployed job's ranks share memory through a volume of their job's own, and run
unprivileged (a real Swarm; see tests/swarm/conftest.py).

Every job on a node used to mount the node's one ``swarmfd-shm`` volume, so another
job's rank could watch the directory where a job's setup socket appears (docs/
security.md). Now: each deploy's ranks mount ``swarmfd-shm-<job>-<launch id>``, a tmpfs
volume labelled with the job, no other job's task mounts it, and ``swarmfd rm`` removes
it with the job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from swarmfd.swarm.spec import LABEL_JOB
from tests.support.swarm_jobs import job_names, rank_lines
from tests.swarm.test_deploy import swarmfd

pytestmark = pytest.mark.swarm

PROBE = (
    "import os\n"
    "import numpy as np\n"
    "import swarmfd as fd\n"
    "from swarmfd import group\n"
    "fd.init_from_env(timeout=60)\n"
    "x = np.full(4, fd.get_rank() + 1.0)\n"
    "fd.all_reduce(x)\n"
    "shm = group.current().transport.shm is not None\n"
    "fs = [ln.split(' - ')[1].split()[0] for ln in open('/proc/self/mountinfo')\n"
    "      if ln.split()[4] == '/run/swarmfd-shm']\n"
    "print(f'shm={shm} sum={x[0]:g} uid={os.getuid()} fs={fs}', flush=True)\n"
    "fd.barrier()\n"
    "fd.cleanup()\n"
)


@pytest.fixture
def job_name(swarm: Any) -> Iterator[Callable[[str], str]]:
    with job_names(swarm, "sfdt") as make:
        yield make


def _volumes(client: Any, name: str) -> list[dict[str, Any]]:
    return client.api.volumes(filters={"label": f"{LABEL_JOB}={name}"}).get("Volumes") or []


def test_a_jobs_ranks_share_memory_through_its_own_volume_removed_with_it(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """Two ranks on this node, as the image's unprivileged user: on shared memory through
    a tmpfs volume named and labelled after their job (the only one of the job); rm
    removes it."""
    name = job_name("shmvol")
    proc = swarmfd("deploy", swarmfd_image, "-n", "2", "--name", name, "--keep",
                   "--", "python", "-c", PROBE, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    want = "shm=True sum=3 uid=10001 fs=['tmpfs']"
    assert lines == {0: [want], 1: [want]}, proc.stdout + proc.stderr
    volumes = _volumes(swarm, name)
    assert len(volumes) == 1, volumes
    volume = volumes[0]
    assert volume["Name"].startswith(f"swarmfd-shm-{name}-"), volume
    assert volume["Driver"] == "local" and volume["Options"]["type"] == "tmpfs", volume
    rm = swarmfd("rm", name, timeout=90)
    assert rm.returncode == 0, rm.stdout + rm.stderr
    assert not _volumes(swarm, name), _volumes(swarm, name)
