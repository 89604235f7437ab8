"""Shared fixtures: the session's job secret, and the rank harness as a fixture.

The test session has one job secret, as ``swarmfd run`` gives a run: a file (0600) in a
private directory (0700), named by ``SWARMFD_SECRET_FILE`` in this process's
environment, so every rank a test spawns inherits the path (and the directory is
removed at the end of the session).

The rank harness itself (``run_ranks``, ``run_ranks_raw``, ``Ranks``, ``free_port``,
...) is tests/support/harness.py; its names are importable from here too, as the test files
have always imported them.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .support.harness import (
    START_LINE_TIMEOUT,
    RankFailure,
    RankResults,
    arm_stack_dump,
    collect_stacks,
    free_port,
    run_ranks,
    run_ranks_raw,
    start_line,
    transport_env,
    write_secret_file,
)

__all__ = ["START_LINE_TIMEOUT", "RankFailure", "RankResults", "arm_stack_dump",
           "collect_stacks", "free_port", "run_ranks", "run_ranks_raw", "start_line",
           "transport_env", "write_secret_file"]

_SECRET_DIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Give the session's ranks a job secret (see the module docstring)."""
    global _SECRET_DIR
    _SECRET_DIR = tempfile.mkdtemp(prefix="swarmfd-test-secret-")
    os.environ["SWARMFD_SECRET_FILE"] = write_secret_file(_SECRET_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SECRET_DIR is not None:
        shutil.rmtree(_SECRET_DIR, ignore_errors=True)


def _marked(mark: str) -> frozenset[str]:
    """The tests marked ``mark``, as node ids without parameters (``tests/x.py::test_f``),
    read from the test files' source: a decorator ``@pytest.mark.MARK`` (called or not)
    on a test function, or ``pytestmark`` naming it in a module. The scheduler of xdist's
    controller sees node ids, never markers, so the lanes are decided from the source;
    pytest_collection_modifyitems checks the result against the collected markers."""
    root = Path(__file__).resolve().parent.parent
    found: set[str] = set()

    def names(node: ast.AST) -> set[str]:
        return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}

    for path in sorted((root / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(root).as_posix()
        whole = any(isinstance(n, ast.Assign) and any(
            getattr(t, "id", "") == "pytestmark" for t in n.targets) and mark in names(n.value)
            for n in tree.body)
        for n in tree.body:
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_") and (
                    whole or any(mark in names(d) for d in n.decorator_list)):
                found.add(f"{rel}::{n.name}")
    return frozenset(found)


#: The tests marked ``waits``: they mostly wait (a stopped rank, a timeout, a fresh venv
#: installing), and most of them bound how long a detection takes: they run in the
#: ``timed`` lane, beside no other timing test, at the highest priority of the lanes
#: (:data:`LANE_NICE`).
WAITS = _marked("waits")
#: The Docker tests (marked ``swarm``), by node id.
MULTINODE = "tests/multinode/"
DOCKER = ("tests/swarm/", MULTINODE, "tests/test_readme.py::test_swarm_")
#: The two lanes of the tests no other lane takes. The lanes of a laned run
#: (``SWARMFD_TEST_LANES``, scripts/test.sh): :func:`lane_of`, :data:`LANE_NICE` and
#: :func:`pytest_xdist_make_scheduler`.
WORKING = ("working-a", "working-b")


def lane_of(nodeid: str) -> str:
    """The lane of a test: ``multinode`` (tests/multinode/), ``swarm`` (the other Docker
    tests), ``timed``, or one of the two working lanes (by a hash of the node id: the
    parameters of one heavy test spread over both)."""
    if nodeid.startswith(MULTINODE):
        return "multinode"
    if nodeid.startswith(DOCKER):
        return "swarm"
    if nodeid.split("[", 1)[0] in WAITS:
        return "timed"
    return WORKING[zlib.crc32(nodeid.encode()) % len(WORKING)]


#: Tests run first in their lane (a lane runs in collection order): the timed lane's
#: stop and kill tests. When the multi-node tests ran in collection order in the same
#: lane as the one-node ones, three stopped-peer bounds of the timed lane were missed
#: (3.54-3.94 s against 3.5 s) while the multi-node registry test built, pushed and
#: pulled images on both cores; its image work now comes a few minutes into its lane.
FIRST = ("tests/test_robustness.py::test_sigstop", "tests/test_robustness.py::test_sigkill")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The lanes agree with the markers: DOCKER's paths hold exactly the tests marked
    ``swarm``, and WAITS (read from the source) exactly those marked ``waits`` (a mark
    the source reading misses, e.g. one set by a fixture, fails here); FIRST tests go
    first (the order is otherwise the collection's)."""
    wrong = [item.nodeid for item in items
             if item.nodeid.startswith(DOCKER) != bool(item.get_closest_marker("swarm"))
             or (item.nodeid.split("[", 1)[0] in WAITS)
             != bool(item.get_closest_marker("waits"))]
    if wrong:
        raise pytest.UsageError(
            "tests/conftest.py: the lanes disagree with the swarm/waits markers of "
            f"{wrong[:5]}: mark a Docker test swarm (in tests/swarm/ or tests/multinode/), "
            "and a timed test with the decorator @pytest.mark.waits")
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))


#: CPU priorities (nice) of the lanes under xdist: the timed lane's bounds (a stopped
#: peer reported within timeout + grace + 1 s, a stranger's flood delaying init by at
#: most 1 s) must hold beside busy lanes, which still get whatever CPU the mostly idle
#: timed lane leaves. At equal priority, a stopped zmq peer was once reported 4.47 s
#: after the stop against a bound of 4.1 s; with the working lanes at +5 and the others
#: at 0, two stopped shared-memory peers were reported 3.56 and 3.94 s after the stop
#: (bound 3.5 s) while the multi-node registry test kept both cores busy with image
#: builds, pushes and pulls (the engine's work, at the engine's priority, 0). So the
#: timed lane runs above the engine where it may (root: raising a priority needs
#: CAP_SYS_NICE), the working lanes below it.
LANE_NICE = {"timed": -5, "swarm": 0, "multinode": 0, "working-a": 5, "working-b": 5}
_lane_priority_set = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In an xdist worker, before its first test (and so before it forks any rank): set
    the lane's priority (see :data:`LANE_NICE`; a negative nice, which needs CAP_SYS_NICE,
    is skipped where it is not permitted). A worker runs the tests of one lane only
    (:func:`pytest_xdist_make_scheduler`)."""
    global _lane_priority_set
    if _lane_priority_set or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _lane_priority_set = True
    with contextlib.suppress(PermissionError):
        os.nice(LANE_NICE[lane_of(item.nodeid)])


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Five lanes under pytest-xdist (``scripts/test.sh``: ``-n 5``), each in collection
    order on a worker of its own:

    * ``swarm``: the one-node Docker Swarm tests (the engine, images, the README's Swarm
      commands). They wait on the engine most of the time;
    * ``multinode``: tests/multinode/ (three engines in containers, an overlay network,
      a registry). Its Swarm needs about 240 CPU-s in its 4-5 minutes, most of it the
      engines' own work (about 4 CPU-s to start and remove a 3-rank job);
    * ``timed``: the tests marked ``waits`` (a rank stopped until a timeout fires, a
      fresh venv installing), the detection-time and init-delay bounds among them;
    * ``working-a`` and ``working-b``: every other test (in-process logic and the rank
      processes), at a lower priority, split in two so that both cores stay busy once
      the Docker tests are done.

    The two Docker lanes were one until 2026-12-01: then it was the longest lane, 596-724 s
    of one-after-the-other waits for the engines (a fresh machine's set-up among them),
    while the working lanes ended 40-100 s earlier. Measured in one lane, the suite
    needed about 1170 CPU-seconds in 1190 s of wall time (the 2 cores 51 % busy). Without
    xdist the hook is never called and the suite runs in one lane."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


#: The environment contract of a rank (swarmfd.config): :func:`alone` removes it.
CONTRACT_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SWARMFD_PORT")


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A world of one in this process (whatever job the test session runs in)."""
    import swarmfd as fd

    for name in CONTRACT_VARS:
        monkeypatch.delenv(name, raising=False)
    fd.init(1, 0)
    yield
    fd.cleanup()


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """The :func:`run_ranks` helper as a fixture."""
    return run_ranks


