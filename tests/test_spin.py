"""The polling-wait policy (swarmfd.comm.spin): who polls, and how it backs off."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from swarmfd.comm import security, spin, transport, wire

from .support.harness import run_ranks_raw
from .support.threadranks import connect_transports
from .test_shm_plane import _planes, _run_setups


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
    # Budgets of 50 ms, not 50 or 200 us: a rank of the suite descheduled for longer than
    # the real budget between two polls ran out of it after two (a CI failure), and what
    # is tested is whether polls yield, not how long they may take.
    monkeypatch.setattr(spin, "SPIN_SECONDS", 0.05)
    monkeypatch.setattr(spin, "YIELD_SECONDS", 0.05)
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


def test_a_wait_late_by_little_is_no_miss_and_ends_blocking_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait that blocked but had its message within LATE_SECONDS of giving up does not
    count as a miss (two ranks that both block at once would otherwise stay so: each
    one's retry poll waits for a peer that must be woken first), and a spinner that was
    blocking at once polls again from the next wait; a wait that blocked for longer
    changes nothing."""
    # 50 ms, not 200 us: this test's own steps between a wait giving up and woke() took
    # longer than 200 us under the suite's load (a CI failure: a "soon" counted late).
    monkeypatch.setattr(spin, "LATE_SECONDS", 0.05)
    spin.configure("on", 1, 1)
    s = spin.Spinner()
    # Polling: each wait gives up, blocks and has its message soon after. Never a miss.
    for _ in range(3 * spin.MAX_MISSES):
        assert not s.spin(lambda: False)
        s.woke()
    assert s.misses == 0 and s.budget() == spin.SPIN_SECONDS
    # Messages that come late: misses, then blocking at once.
    for _ in range(spin.MAX_MISSES):
        assert not s.spin(lambda: False)
        s.gave_up -= 2 * spin.LATE_SECONDS  # (as if the wait had blocked that long)
        s.woke()
    assert s.misses == spin.MAX_MISSES and s.budget() == 0.0
    s.waits = 0
    polled: list[int] = []
    assert not s.spin(lambda: polled.append(1) is None and False)  # blocks at once
    assert not polled and s.gave_up > 0.0
    s.woke()  # ... and its message came at once: the next wait polls
    assert s.misses < spin.MAX_MISSES and s.budget() == spin.SPIN_SECONDS
    assert s.gave_up == 0.0
    s.woke()  # nothing given up since: nothing to count
    assert s.misses == spin.MAX_MISSES // 2
    assert s.spin(lambda: True) and s.misses == 0


def test_a_spinner_that_never_polls_keeps_no_time() -> None:
    spin.configure("off", 1, 64)
    s = spin.Spinner()
    assert not s.spin(lambda: True)
    assert s.gave_up == 0.0
    s.woke()
    assert s.misses == 0


def test_where_polls_give_their_core_away_a_blocked_wait_is_a_miss_however_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks on 2 cores: polls yield, and a wait that blocked counts as a miss
    even when its message came at once (polling on would take the peers' CPU)."""
    monkeypatch.setattr(spin, "_sched_yield", lambda: None)
    spin.configure("auto", 4, 2)
    assert spin.yielding()
    s = spin.Spinner()
    for k in range(1, spin.MAX_MISSES + 1):
        assert not s.spin(lambda: False)
        s.woke()
        assert s.misses == k
    s.waits = 0
    assert not s.spin(lambda: True)  # blocks at once
    s.woke()
    assert s.misses == spin.MAX_MISSES and s.budget() == 0.0


SECRET = b"s" * 40
SIG = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 5, wire.NO_ROOT, 1, 0)


@contextlib.contextmanager
def _pair(plane: str) -> Iterator[tuple[Callable[[], Any], Callable[[], None], Any]]:
    """Two ranks of ``plane`` in this process: (receive rank 1's message on rank 0,
    send it from rank 1, rank 0's data plane)."""
    if plane == "shm":
        (h0, p0), (h1, p1) = _planes(_run_setups(2))
        try:
            yield (lambda: h0.recv(p0, 1, SIG, 0, 7, 3, 5),
                   lambda: h1.send(p1, 0, SIG, 0, 7, 3, b"hello"), p0)
        finally:
            p0.close()
            p1.close()
        return
    sec = security.Security.from_secret(SECRET, False)
    ts = [transport.Transport(r, 2, 10.0, "127.0.0.1", sec, plane) for r in range(2)]
    try:
        connect_transports(ts, 10.0)
        t0, t1 = ts
        # One message first: what setup left queued is read then, not in the test's wait.
        t1.channel.send(t1.tcp, 0, SIG, 0, 6, 3, b"first")
        assert bytes(t0.channel.recv(t0.tcp, 1, SIG, 0, 6, 3, 5)) == b"first"
        yield (lambda: t0.channel.recv(t0.tcp, 1, SIG, 0, 7, 3, 5),
               lambda: t1.channel.send(t1.tcp, 0, SIG, 0, 7, 3, b"hello"), t0.tcp)
    finally:
        for t in ts:
            t.close(linger=0)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("plane", ["shm", "socket", "zmq"])
def test_a_plane_tells_its_spinner_when_a_blocked_wait_got_its_message(
        plane: str, late: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose waits block at once (its polls kept missing) waits for a message
    that comes 0.3 s after it blocked: if that counts as soon after giving up (LATE_SECONDS
    stretched for the test), its next wait polls again; if not, it keeps blocking at
    once (no retry poll meanwhile). Every plane's receive reports the blocked wait's end
    (Spinner.woke)."""
    spin.configure("on", 1, 64)
    monkeypatch.setattr(spin, "LATE_SECONDS", 0.0 if late else 60.0)
    monkeypatch.setattr(spin, "RETRY", 1 << 30)  # no retry poll meanwhile
    with _pair(plane) as (receive, send, data_plane):
        s = data_plane.spinner
        s.misses, s.waits = spin.MAX_MISSES, 0

        def send_once_blocked() -> None:
            # Only once the receiver blocks (under load it may start late), then 0.3 s on.
            deadline = time.monotonic() + 30
            while not s.gave_up and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            send()

        sender = threading.Thread(target=send_once_blocked)
        sender.start()
        try:
            assert bytes(receive()) == b"hello"
        finally:
            sender.join(40)
        assert (s.misses >= spin.MAX_MISSES) is late, s.misses


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
