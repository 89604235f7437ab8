"""The counters of the collective calls, kept per group on every rank, and the straggler
rule read from them.

Always on, and cheap: a call adds to them a few numbers it has at hand (two
``time.perf_counter()`` readings, its buffer's bytes, what its blocking receives
waited: :attr:`swarmfd.comm.channel.Channel.waited`). docs/observability.md gives
their cost.

* ``calls``, ``bytes`` (each call's buffer), ``time_s`` (inside the calls);
* ``wait_s``: time the calls waited for peers' messages;
* ``last``: per world rank, the calls in which this rank waited longest for that
  rank's message (its own rank: the calls it did not wait in, counted as the rest). Where a call's
  algorithm hears of a late rank through others (a ring passes the delay on), the
  rank named is the one whose message this rank waited for;
* ``waits``: this rank's wait in each of the group's last WINDOW calls, by call
  number. Every rank numbers a group's calls alike, so the waits of all ranks line
  up: in each call, the rank that waited least arrived last (it found the others
  there), whatever the algorithm. :func:`straggler` reads them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["LAST_SHARE", "MIN_CALLS", "SKEW_FLOOR", "WAIT_SHARE", "WINDOW", "CallStats",
           "straggler"]

#: Calls whose waits each group keeps, per rank (a power of two).
WINDOW = 1024
_MASK = WINDOW - 1
#: A call in which the ranks' waits differ by less than this (seconds) kept nobody
#: waiting: it names no last rank.
SKEW_FLOOR = 0.001
#: A straggler makes the other ranks wait more than this share of their wall time.
WAIT_SHARE = 0.10
#: Fewer calls that kept a rank waiting than this name no straggler.
MIN_CALLS = 3
#: A straggler arrived last in at least this share of the calls that kept a rank waiting.
LAST_SHARE = 0.75


class CallStats:
    """One group's counters on this rank (see the module docstring); ``me``: this rank's
    world rank, ``world``: the world's size."""

    __slots__ = ("bytes", "calls", "last", "me", "since", "time_s", "wait_s", "waits")

    def __init__(self, me: int, world: int) -> None:
        self.me = me
        #: ``time.perf_counter()`` when the group's current (or last) call began.
        self.since = 0.0
        self.reset(world)

    def reset(self, world: int) -> None:
        """Start a new window: every count at zero."""
        self.calls = 0
        self.bytes = 0
        self.time_s = 0.0
        self.wait_s = 0.0
        self.last = [0] * world
        self.waits = [0.0] * WINDOW

    def record(self, seq: int, took: float, nbytes: int, waited: float, on: int) -> None:
        """Call ``seq`` took ``took`` s for ``nbytes``, of which it waited ``waited`` s,
        longest for world rank ``on`` (the blocking path does the same inline)."""
        self.calls += 1
        self.bytes += nbytes
        self.time_s += took
        self.waits[seq & _MASK] = waited
        if waited:
            self.wait_s += waited
            self.last[on] += 1

    def as_dict(self) -> dict[str, Any]:
        """The public form (:func:`swarmfd.stats`): ``last`` without the ranks at 0.
        The calls that did not wait count for this rank: they are the calls not counted
        for another (a call adds to ``last`` only when it waited, one step less)."""
        last = list(self.last)
        last[self.me] += self.calls - sum(last)
        return {"calls": self.calls, "bytes": self.bytes, "time_s": self.time_s,
                "wait_s": self.wait_s, "last": {r: n for r, n in enumerate(last) if n}}

    def recent(self, seq: int, count: int) -> list[float]:
        """The waits of calls ``seq - count + 1`` .. ``seq`` (those still kept)."""
        count = min(count, WINDOW, seq)
        return [self.waits[s & _MASK] for s in range(seq - count + 1, seq + 1)]


def straggler(waits: Mapping[int, Mapping[int, float]],
              shares: Mapping[int, float]) -> tuple[int, int, int] | None:
    """The rank that makes the others wait, from every rank's view: ``waits`` maps each
    rank to its waits by call number, ``shares`` each rank to the share of its wall
    time it waited. In each call every rank reported, the rank that waited least
    arrived last, if the waits differ by SKEW_FLOOR at least. A rank that arrived last
    in at least LAST_SHARE of the calls that kept a rank waiting (MIN_CALLS of them at
    least) while the other ranks waited more than WAIT_SHARE of their time on average
    is the straggler: (rank, calls it arrived last in, calls every rank reported); else
    None. A plain majority is not enough: in a balanced job on a loaded machine a few
    calls keep someone waiting by chance, and one rank may be last in most of those;
    a straggler is last in nearly all of them (a job whose other calls wait for nobody
    included)."""
    if len(waits) < 2:
        return None
    ranks = sorted(waits)
    common = set.intersection(*(set(waits[r]) for r in ranks))
    last: Counter[int] = Counter()
    decided = 0
    for call in common:
        seen = sorted((waits[r][call], r) for r in ranks)
        if seen[-1][0] - seen[0][0] < SKEW_FLOOR:
            continue
        decided += 1
        last[seen[0][1]] += 1
    if decided < MIN_CALLS:
        return None
    rank, count = last.most_common(1)[0]
    others = [shares.get(r, 0.0) for r in ranks if r != rank]
    if count < LAST_SHARE * decided or sum(others) / len(others) <= WAIT_SHARE:
        return None
    return rank, count, len(common)
