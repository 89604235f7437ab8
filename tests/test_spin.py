"""The polling-wait policy (swarmfd.comm.spin): who polls, and how it backs off."""

from __future__ import annotations

import os

import pytest

from swarmfd.comm import spin

from .harness import run_ranks_raw


@pytest.fixture(autouse=True)
def _restore() -> None:
    before = spin.ENABLED
    yield
    spin.ENABLED = before


@pytest.mark.parametrize(("mode", "local", "cores", "threads", "polls"), [
    ("auto", 2, 2, 1, True),    # a core per rank
    ("auto", 3, 2, 1, False),   # more ranks than cores
    ("auto", 2, 2, 2, False),   # zmq: each rank's I/O thread needs a core too
    ("auto", 2, 4, 2, True),
    ("auto", 1, 1, 2, False),
    ("on", 8, 2, 2, True),      # forced on: still adaptive (Spinner)
    ("off", 1, 64, 1, False),
])
def test_auto_polls_only_when_every_busy_thread_has_a_core(mode: str, local: int, cores: int,
                                                           threads: int, polls: bool) -> None:
    assert spin.configure(mode, local, cores, threads_per_rank=threads) is polls
    assert spin.enabled() is polls


def test_a_spinner_blocks_at_once_after_fruitless_polls_and_retries_now_and_then() -> None:
    spin.configure("on", 1, 1)
    s = spin.Spinner()

    def wait() -> bool:  # one wait whose message never comes: did it poll?
        calls = []
        assert not s.spin(lambda: calls.append(1) is None and False)
        return bool(calls)

    assert all(wait() for _ in range(spin.MAX_MISSES))
    # Then it blocks at once, and every RETRY-th blocking wait polls again, as do the next
    # ones until MAX_MISSES // 2 more polls missed.
    again = spin.MAX_MISSES - spin.MAX_MISSES // 2
    cycle = [False] * (spin.RETRY - 1) + [True] * again
    assert [wait() for _ in range(3 * len(cycle))] == cycle * 3
    fresh = spin.Spinner()
    for _ in range(spin.MAX_MISSES - 1):
        fresh.spin(lambda: False)
    assert fresh.spin(lambda: True) and fresh.misses == 0  # a catch starts over


def _polls(rank: int, world: int) -> bool:
    return spin.enabled()


@pytest.mark.parametrize("plane", ["socket", "zmq"])
def test_init_counts_libzmq_s_io_thread_as_a_busy_thread_of_a_zmq_rank(plane: str) -> None:
    """Two ranks over TCP on this host: polling where each busy thread has a core (on the
    zmq plane a rank has two: its own and libzmq's I/O thread)."""
    out = run_ranks_raw(_polls, 2, env={"SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": plane,
                                        "SWARMFD_SPIN": "auto"}, timeout=60)
    want = 2 * (2 if plane == "zmq" else 1) <= len(os.sched_getaffinity(0))
    assert out == {0: (True, want), 1: (True, want)}, out
