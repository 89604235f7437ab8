"""Spin-then-block waits: one policy for every plane of the process (``SWARMFD_SPIN``).

A rank that waits for a peer's message can sleep in the kernel (select, poll, a
blocking receive) or poll for it for a while first. Sleeping costs a wake-up when the
message comes, tens of microseconds each (more under load); a peer on another core
usually answers within microseconds, so polling for a bounded time catches its
message without any wake-up. Polling burns CPU time that training needs,
though, and when ranks outnumber cores it steals the very CPU the peer needs to send.
So:

* waits poll for at most :data:`SPIN_SECONDS` before they block, when every busy
  thread of the host's ranks has a core of its own (``auto``, the default:
  :func:`configure` is told how many ranks share the host). A rank whose data goes
  through ZeroMQ has a second busy thread, libzmq's I/O thread, which moves every
  byte: it counts too (``threads_per_rank=2``);
* when the busy threads outnumber the cores, but by at most
  :data:`MAX_THREADS_PER_CORE` to one, a wait still polls (for at most
  :data:`YIELD_SECONDS`), but gives its core away before every poll
  (``os.sched_yield``): a peer that shares the core runs, sends, and the wait finds
  its message without sleeping and being woken. Beyond that ratio waits block at once;
* and adaptively: after :data:`MAX_MISSES` consecutive polls that caught nothing a
  :class:`Spinner` blocks at once, trying a poll again every :data:`RETRY` waits (a
  busy machine, or a peer that is slow anyway: large messages, compute between calls).
  Where every busy thread has a core of its own, a wait that blocked but had its
  message within :data:`LATE_SECONDS` of giving up (:meth:`Spinner.woke`) was late by
  little: it is no miss, and a spinner that blocked at once polls again. Without that,
  two ranks that both came to block at once (a slow start: imports, setup) stayed so:
  each one's retry poll waited for a peer that had to be woken first, longer than the
  poll lasts, and missed again.

``SWARMFD_SPIN=0`` turns polling off everywhere (every wait blocks at once),
``SWARMFD_SPIN=1`` forces it on (still adaptive; yielding where threads outnumber
cores), ``auto`` (or unset) decides per job. What polling, yielding and the late
wake-ups gain, and where they do not: docs/performance.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..config import usable_cores

__all__ = [
    "LATE_SECONDS",
    "MAX_MISSES",
    "MAX_THREADS_PER_CORE",
    "RETRY",
    "SPIN_SECONDS",
    "YIELD_SECONDS",
    "Spinner",
    "configure",
    "enabled",
    "yielding",
]

#: How long a wait polls before it blocks. A peer on another core usually answers within
#: microseconds; 50 us catches a loopback TCP round trip and a shared-memory record,
#: and bounds what a fruitless poll costs.
SPIN_SECONDS = 50e-6
#: How long a wait polls before it blocks when busy threads outnumber cores: each poll
#: gives the core away first (os.sched_yield), so the wait's polls are fewer and a
#: peer's turn on the core counts into it.
YIELD_SECONDS = 200e-6
#: Busy threads a core may have (the host's ranks, and their libzmq I/O threads) for
#: waits to poll, yielding, rather than block at once (see the module docstring).
MAX_THREADS_PER_CORE = 2
#: A wait whose message came within this many seconds after its poll gave up (or after
#: it blocked at once) was late by little: the peer keeps up, and the wake-ups cost the
#: time (tens of microseconds each, a peer that must be woken first adds its own).
#: Such a wait is no miss (:meth:`Spinner.woke`). Four polls' budget: a wait that blocks
#: for longer waits for a peer that is busy, and polling would burn the CPU it needs.
#: Not where busy threads share cores (yielding polls), where a poll takes CPU time from
#: the peers and a measurement showed nothing beyond the noise (docs/performance.md).
LATE_SECONDS = 4 * SPIN_SECONDS
#: Consecutive fruitless polls after which waits block at once for a while.
MAX_MISSES = 8
#: While blocking at once, a poll is tried again every RETRY waits.
RETRY = 32
#: Whether waits poll at all (set by :func:`configure`; 1 or 0, a constant benchmarks/ab.py
#: can switch per iteration).
ENABLED = 0
#: Whether a polling wait gives its core away before each poll (set by :func:`configure`:
#: the host's busy threads outnumber its cores).
YIELD = 0
_sched_yield = os.sched_yield


def configure(mode: str, local_ranks: int, cores: int | None = None,
              threads_per_rank: int = 1) -> bool:
    """Decide how this process's waits poll: ``mode`` 'on', 'off' or 'auto', for
    ``local_ranks`` ranks on this host with ``threads_per_rank`` busy threads each and
    ``cores`` usable cores (see the module docstring). Returns whether waits poll;
    :func:`yielding` tells whether they give the core away before each poll."""
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
        #: When the last wait stopped polling (or blocked at once) under the adaptive
        #: policy; 0.0: none since the last :meth:`woke`.
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
        """The wait that :meth:`spin` gave up on (or did not poll for) got its message by
        blocking. If that came within LATE_SECONDS the wait was late by little: not a
        miss, and where waits were blocking at once they poll again from the next one.
        Only where every busy thread has a core of its own: where polls give their core
        away (:func:`yielding`) they take CPU time from the peers, and a blocked wait
        counts as a miss (see LATE_SECONDS)."""
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
        """How many looks a plane's ``take`` may take at a peer's message that is not
        there yet, before it leaves the wait to the channel's receive (which polls on,
        then blocks): ``most`` where waits poll now (polling on, not yielding, this
        spinner not blocking at once after misses), else 0."""
        return most if (ENABLED and not YIELD and self.misses < MAX_MISSES) else 0

    def caught(self) -> None:
        """A wait's message was there before it polled at all, or a plane's own look
        (``take``) caught it: the peer keeps up."""
        self.misses = 0
