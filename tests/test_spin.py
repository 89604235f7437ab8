"""The polling-wait policy (swarmfd.comm.spin): who polls, and how it backs off."""

from __future__ import annotations

import os

import pytest

from swarmfd.comm import spin

from .harness import run_ranks_raw


@pytest.fixture(autouse=True)
def _restore() -> None:
    before = spin.ENABLED, spin.YIELD
    yield
    spin.ENABLED, spin.YIELD = before


@pytest.mark.parametrize(("mode", "local", "cores", "threads", "polls", "yields"), [
    ("auto", 2, 2, 1, True, False),   # a core per rank
    ("auto", 2, 4, 2, True, False),   # zmq: each rank's I/O thread has a core too
    ("auto", 3, 2, 1, True, True),    # more ranks than cores, at most two a core
    ("auto", 4, 2, 1, True, True),
    ("auto", 2, 2, 2, True, True),    # zmq: each rank's I/O thread is a busy thread too
    ("auto", 1, 1, 2, True, True),
    ("auto", 5, 2, 1, False, False),  # more than two busy threads a core: block at once
    ("auto", 4, 2, 2, False, False),  # zmq at N=4 on 2 cores
    ("on", 8, 2, 2, True, True),      # forced on: still adaptive (Spinner), yielding
    ("on", 1, 2, 1, True, False),
    ("off", 1, 64, 1, False, False),
    ("off", 4, 2, 1, False, False),
])
def test_auto_polls_where_busy_threads_have_cores_and_yields_where_two_share_one(
        mode: str, local: int, cores: int, threads: int, polls: bool, yields: bool) -> None:
    assert spin.configure(mode, local, cores, threads_per_rank=threads) is polls
    assert spin.enabled() is polls
    assert spin.yielding() is yields
    assert spin.Spinner().budget() == (
        0.0 if not polls else spin.YIELD_SECONDS if yields else spin.SPIN_SECONDS)


@pytest.mark.parametrize("sharing", [False, True])
def test_a_spinner_gives_the_core_away_before_each_poll_only_where_cores_are_shared(
        sharing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where busy threads share cores a poll that found nothing is followed by
    sched_yield (a peer on the core runs); where each has its own, never."""
    gave: list[int] = []
    monkeypatch.setattr(spin, "_sched_yield", lambda: gave.append(1))
    spin.configure("auto", 4 if sharing else 2, 2)
    polls: list[int] = []

    def ready() -> bool:  # the third poll finds the message
        polls.append(1)
        return len(polls) == 3

    assert spin.Spinner().spin(ready)
    assert len(polls) == 3
    assert len(gave) == (2 if sharing else 0)
    # A wait whose message never comes: polls, yielding, until the budget ran out.
    start = len(gave)
    assert not spin.Spinner().spin(lambda: False)
    assert (len(gave) > start) is sharing


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


def _polls(rank: int, world: int) -> tuple[bool, bool]:
    return spin.enabled(), spin.yielding()


@pytest.mark.parametrize("plane", ["socket", "zmq"])
@pytest.mark.parametrize("world", [2, 4])
def test_init_counts_libzmq_s_io_thread_as_a_busy_thread_of_a_zmq_rank(plane: str,
                                                                        world: int) -> None:
    """Ranks over TCP on this host: polling where each busy thread has a core (on the zmq
    plane a rank has two: its own and libzmq's I/O thread), yielding where two share one,
    blocking at once beyond."""
    out = run_ranks_raw(_polls, world, env={"SWARMFD_TRANSPORT": "tcp",
                                            "SWARMFD_DATA_PLANE": plane,
                                            "SWARMFD_SPIN": "auto"}, timeout=60)
    cores = len(os.sched_getaffinity(0))
    busy = world * (2 if plane == "zmq" else 1)
    polls = busy <= spin.MAX_THREADS_PER_CORE * cores
    want = (polls, polls and busy > cores)
    assert out == {r: (True, want) for r in range(world)}, out
