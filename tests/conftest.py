"""Shared fixtures: the session's job secret, and the rank harness as a fixture.

The test session has one job secret, as ``swarmfd run`` gives a run: a file (0600) in a
private directory (0700), named by ``SWARMFD_SECRET_FILE`` in this process's
environment, so every rank a test spawns inherits the path (and the directory is
removed at the end of the session).

The rank harness itself (``run_ranks``, ``run_ranks_raw``, ``Ranks``, ``free_port``,
...) is tests/harness.py; its names are importable from here too, as the test files
have always imported them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

from .harness import (
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


#: The tests marked ``waits``, by node id (the scheduler of xdist's controller sees node
#: ids, not markers); pytest_collection_modifyitems checks that the two agree.
WAITS = (
    "tests/test_readme.py::test_fresh_clone_commands_run",
    "tests/test_robustness.py::test_sigstop_times_out_after_the_configured_timeout",
    "tests/test_robustness.py::test_sigstop_during_a_loop_of_large_all_reduces",
    "tests/test_robustness.py::test_init_timeout_lets_a_late_rank_join",
    "tests/test_auth.py::test_a_vanished_peer_is_lost_within_seconds",
    "tests/test_collectives.py::test_a_silent_rank_times_out_naming_the_peer",
)
#: The Docker tests (marked ``swarm``), by node id.
DOCKER = ("tests/swarm/", "tests/multinode/", "tests/test_readme.py::test_swarm_")
def lane_of(nodeid: str) -> str:
    """``waiting`` or ``working`` (see :func:`pytest_xdist_make_scheduler`)."""
    return "waiting" if nodeid.startswith(DOCKER + WAITS) else "working"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """DOCKER and WAITS name exactly the tests marked ``swarm`` and ``waits``."""
    wrong = [item.nodeid for item in items
             if item.nodeid.startswith(DOCKER) != bool(item.get_closest_marker("swarm"))
             or item.nodeid.startswith(WAITS) != bool(item.get_closest_marker("waits"))]
    if wrong:
        raise pytest.UsageError(
            "tests/conftest.py DOCKER/WAITS disagree with the swarm/waits markers of "
            f"{wrong[:5]}: mark them, or list them (or both, the other way)")


#: The working lane's CPU priority below the waiting lane's (nice), under xdist: the
#: waiting lane's timing bounds (a stopped peer reported within timeout + grace + 1 s)
#: then hold beside a busy working lane, which still gets whatever CPU the mostly idle
#: waiting lane leaves. At equal priority, a stopped zmq peer was once reported 4.47 s
#: after the stop against a bound of 4.1 s.
WORKING_LANE_NICE = 5
_lane_priority_set = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In an xdist worker, before its first test (and so before it forks any rank):
    lower the working lane's priority (see :data:`WORKING_LANE_NICE`). A worker runs
    the tests of one lane only (:func:`pytest_xdist_make_scheduler`)."""
    global _lane_priority_set
    if _lane_priority_set or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _lane_priority_set = True
    if lane_of(item.nodeid) == "working":
        os.nice(WORKING_LANE_NICE)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Two lanes under pytest-xdist (``SWARMFD_TEST_LANES=2 scripts/test.sh``), each in collection
    order on a worker of its own:

    * ``waiting``: the Docker tests (engine, images, a one-node and a multi-node Swarm)
      and the tests marked ``waits`` (a rank stopped until a timeout fires, a fresh venv
      being installed). They mostly wait: the machine was 85-93 % idle during the
      multi-node tests;
    * ``working``: every other test, in-process logic and the rank processes.

    Run in one lane, the suite left the 2 cores 46 % idle. A third lane (the unit tests
    beside these two) was no faster (757-760 s wall either way: the working lane is the
    longest) and put the timing bounds of the waiting tests beside two busy lanes: a
    stopped zmq peer was reported 4.47 s after the stop against a bound of 4.1 s."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """The :func:`run_ranks` helper as a fixture."""
    return run_ranks


