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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Two lanes when pytest-xdist runs the session with ``--dist loadgroup`` (as
    scripts/test.sh does), each in collection order on a worker of its own:

    * ``waiting``: the Docker tests (marked ``swarm``) and the tests marked ``waits``
      (a rank stopped until a timeout fires, a fresh venv being installed). They mostly
      wait: the machine was 85-93 % idle during the multi-node tests;
    * ``working``: every other test, the ones that keep ranks busy.

    Beside the waiting lane the working lane runs much as it would alone; two lanes of
    busy ranks side by side would make every timing bound compete for two cores."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        waiting = item.get_closest_marker("swarm") or item.get_closest_marker("waits")
        item.add_marker(pytest.mark.xdist_group("waiting" if waiting else "working"))


@pytest.fixture
def ranks() -> Callable[..., list[Any]]:
    """The :func:`run_ranks` helper as a fixture."""
    return run_ranks
