"""Spin-then-block waits: one policy for every plane of the process (``SWARMFD_SPIN``).

A peer on another core usually answers within microseconds, a wake-up costs tens, and
polling burns CPU the peers may need (docs/performance.md). So waits poll SPIN_SECONDS
where every busy thread of the host (a zmq rank's I/O thread too) has a core; where they
outnumber cores by at most MAX_THREADS_PER_CORE to one, YIELD_SECONDS, yielding the core
before each poll; beyond, they block at once. A :class:`Spinner` blocks at once after
MAX_MISSES fruitless polls, polling again every RETRY waits; where polls do not yield,
a wait that blocked but had its message within LATE_SECONDS is no miss (else two ranks
blocking at once stay so).
``SWARMFD_SPIN=0`` turns polling off, ``1`` on (still adaptive), ``auto`` decides.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..config import usable_cores

__all__ = ["LATE_SECONDS", "MAX_MISSES", "MAX_THREADS_PER_CORE", "RETRY", "SPIN_SECONDS",
           "YIELD_SECONDS", "Spinner", "configure", "enabled", "yielding"]

#: How long a wait polls before it blocks: a loopback TCP round trip or a record.
SPIN_SECONDS = 50e-6
#: The same where busy threads outnumber cores (each poll yields the core first).
YIELD_SECONDS = 200e-6
#: Busy threads a core may have for waits to poll, yielding, rather than block at once.
MAX_THREADS_PER_CORE = 2
#: A message that came within this long after the poll gave up was late by little: no
#: miss (:meth:`Spinner.woke`). Four polls' budget; longer means a busy peer.
LATE_SECONDS = 4 * SPIN_SECONDS
#: Consecutive fruitless polls after which waits block at once for a while.
MAX_MISSES = 8
#: While blocking at once, a poll is tried again every RETRY waits.
RETRY = 32
#: Whether waits poll (1 or 0, set by :func:`configure`; benchmarks/ab.py switches it).
ENABLED = 0
#: Whether a polling wait yields its core before each poll (set by :func:`configure`).
YIELD = 0
_sched_yield = os.sched_yield


def configure(mode: str, local_ranks: int, cores: int | None = None,
              threads_per_rank: int = 1) -> bool:
    """Decide how this process's waits poll (``mode`` 'on', 'off' or 'auto') for
    ``local_ranks`` ranks of ``threads_per_rank`` busy threads on ``cores``; whether
    waits poll."""
    global ENABLED, YIELD
    if cores is None:
        cores = usable_cores()
    busy = local_ranks * threads_per_rank
    on = mode == "on" or (mode == "auto" and busy <= MAX_THREADS_PER_CORE * cores)
    ENABLED = int(on)
    YIELD = int(on and busy > cores)
    return on


def enabled() -> bool:
    """Whether waits poll before they block (see :func:`configure`)."""
    return bool(ENABLED)


def yielding() -> bool:
    """Whether polling waits give the core away before each poll (see :func:`configure`)."""
    return bool(ENABLED and YIELD)


class Spinner:
    """The adaptive part of the policy, kept per wait site (a plane): see module docstring."""

    __slots__ = ("gave_up", "misses", "waits")

    def __init__(self) -> None:
        self.misses = 0
        self.waits = 0
        #: When the last wait stopped polling (or blocked at once); 0.0: none since woke.
        self.gave_up = 0.0

    def budget(self) -> float:
        """Seconds the next wait may poll before it blocks (0: block at once)."""
        if not ENABLED:
            return 0.0
        if self.misses >= MAX_MISSES:
            self.waits += 1
            if self.waits % RETRY:
                return 0.0
            self.misses = MAX_MISSES // 2  # a few polls again; misses block once more
        return YIELD_SECONDS if YIELD else SPIN_SECONDS

    def spin(self, ready: Callable[[], bool]) -> bool:
        """Call ``ready`` until it is true (True) or the budget ran out (False)."""
        budget = self.budget()
        clock = time.perf_counter
        if budget <= 0.0:
            if ENABLED and not YIELD:  # blocking at once for a while (misses): see woke
                self.gave_up = clock()
            return False
        end = clock() + budget
        give = _sched_yield if YIELD else None  # (a local test a poll: tens of ns)
        while True:
            if ready():
                self.misses = 0
                return True
            now = clock()
            if now > end:
                self.misses += 1
                if give is None:  # (see woke)
                    self.gave_up = now
                return False
            if give is not None:
                give()

    def woke(self) -> None:
        """The wait :meth:`spin` gave up on got its message by blocking: within
        LATE_SECONDS it is no miss (set only where polls do not yield)."""
        t = self.gave_up
        if not t:
            return
        self.gave_up = 0.0
        if time.perf_counter() - t > LATE_SECONDS:
            return
        if self.misses >= MAX_MISSES:
            self.misses = MAX_MISSES // 2
        elif self.misses:
            self.misses -= 1

    def polls(self, most: int) -> int:
        """Looks a plane's ``take`` may take at a message not there yet: ``most`` where
        waits poll now without yielding, else 0."""
        return most if (ENABLED and not YIELD and self.misses < MAX_MISSES) else 0

    def caught(self) -> None:
        """A message was there before the wait polled, or ``take`` caught it."""
        self.misses = 0
