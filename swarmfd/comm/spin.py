"""Spin-then-block waits: one policy for every plane of the process (``SWARMFD_SPIN``).

A rank that waits for a peer's message can sleep in the kernel (select, poll, a
blocking receive) or poll for it for a while first. Sleeping costs a wake-up when the
message comes, tens of microseconds each on this 2-core VM (more under load); a peer
on another core usually answers within microseconds, so polling for a bounded time
catches its message without any wake-up. Polling burns CPU time that training needs,
though, and when ranks outnumber cores it steals the very CPU the peer needs to send.
So:

* waits poll for at most :data:`SPIN_SECONDS` before they block;
* only when every rank of the host can have its own core (``auto``, the default:
  :func:`configure` is told how many ranks share the host) or when forced on. A rank
  whose data goes through ZeroMQ has a second busy thread, libzmq's I/O thread, which
  moves every byte: it needs a core too (``threads_per_rank=2``), or the polling waits
  take the very CPU that brings their messages;
* and adaptively: after :data:`MAX_MISSES` consecutive polls that caught nothing a
  :class:`Spinner` blocks at once, trying a poll again every :data:`RETRY` waits (a
  busy machine, or a peer that is slow anyway: large messages, compute between calls).

``SWARMFD_SPIN=0`` turns polling off everywhere (every wait blocks at once),
``SWARMFD_SPIN=1`` forces it on (still adaptive), ``auto`` (or unset) decides per job.

Measured: on a quieter machine (benchmarks/compare.py, 5 interleaved runs, load
average 1-2, 2026-12-01 20:18, benchmarks/results/compare-20261201-201758.*), at N=2
(polling on under ``auto``) every wait blocking at once (``SWARMFD_SPIN=0``) took
1.11-1.16x the time of the 4 KiB and 64 KiB all_reduce on shared memory and on the
socket plane (medians; 0.99-1.14x for broadcast); at N=4 (polling off under ``auto``
on 2 cores) the two are the same code, and measured 0.90-1.16x, which is the noise.
Under a load average of 4-5 from other work (ab.py, 100 calls a size, 17:10) the ratios
were 0.92-1.06 on every plane, CPU time per call equal within 3%: the peers are rarely
running when a wait polls there, so the misses turn polling off.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import usable_cores

__all__ = ["MAX_MISSES", "RETRY", "SPIN_SECONDS", "Spinner", "configure", "enabled"]

#: How long a wait polls before it blocks. A peer on another core usually answers within
#: microseconds; 50 us catches a loopback TCP round trip here (20-40 us for a 1-byte
#: ping-pong) and a shared-memory record, and bounds what a fruitless poll costs.
SPIN_SECONDS = 50e-6
#: Consecutive fruitless polls after which waits block at once for a while.
MAX_MISSES = 8
#: While blocking at once, a poll is tried again every RETRY waits.
RETRY = 32
#: Whether waits poll at all (set by :func:`configure`; 1 or 0, a constant benchmarks/ab.py
#: can switch per iteration).
ENABLED = 0


def configure(mode: str, local_ranks: int, cores: int | None = None,
              threads_per_rank: int = 1) -> bool:
    """Decide whether this process's waits poll: ``mode`` 'on', 'off' or 'auto' (poll when
    each busy thread of the ``local_ranks`` ranks of this host, ``threads_per_rank`` of
    them per rank, has a core). Returns the decision."""
    global ENABLED
    if cores is None:
        cores = usable_cores()
    on = mode == "on" or (mode == "auto" and local_ranks * threads_per_rank <= cores)
    ENABLED = int(on)
    return on


def enabled() -> bool:
    """Whether waits poll before they block (see :func:`configure`)."""
    return bool(ENABLED)


class Spinner:
    """The adaptive part of the policy, kept per wait site (a plane): see module docstring."""

    __slots__ = ("misses", "waits")

    def __init__(self) -> None:
        self.misses = 0
        self.waits = 0

    def budget(self) -> float:
        """Seconds the next wait may poll before it blocks (0: block at once)."""
        if not ENABLED:
            return 0.0
        if self.misses >= MAX_MISSES:
            self.waits += 1
            if self.waits % RETRY:
                return 0.0
            self.misses = MAX_MISSES // 2  # a few polls again; misses block once more
        return SPIN_SECONDS

    def spin(self, ready: Callable[[], bool]) -> bool:
        """Call ``ready`` until it is true (True) or the budget ran out (False)."""
        budget = self.budget()
        if budget <= 0.0:
            return False
        clock = time.perf_counter
        end = clock() + budget
        while True:
            if ready():
                self.misses = 0
                return True
            if clock() > end:
                self.misses += 1
                return False

    def caught(self) -> None:
        """A wait's message was there before it polled at all: the peer keeps up."""
        self.misses = 0
