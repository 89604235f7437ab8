"""What a running job tells of itself: :func:`stats`, the straggler summary at cleanup,
and the status lines that ``swarmfd run``, ``swarmfd deploy`` and ``swarmfd top`` read.

* :func:`stats` reads this rank's counters (:mod:`swarmfd.counters`): no message, no
  wait.
* At :func:`swarmfd.cleanup` (:func:`summarize`), the ranks of a world of more than
  one that made world calls and saw no failure send their counters to rank 0, which
  logs one line naming the straggler (:func:`swarmfd.counters.straggler`) with the
  figures; nothing when the job was balanced.
* With ``SWARMFD_STATUS`` (seconds; ``swarmfd run`` and ``deploy`` set it) a thread of
  each rank writes a status line to stderr that often (:class:`StatusThread`, the
  format in :mod:`swarmfd.statusline`): the launcher takes these lines out of the
  rank's output and ``swarmfd top`` shows them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from . import group as _group
from . import statusline
from .counters import CallStats, straggler
from .errors import SwarmfdError

__all__ = ["RECENT", "SUMMARY_CALLS", "SUMMARY_TIMEOUT", "StatusThread", "stats", "summarize"]

#: How long rank 0's cleanup waits for the other ranks' counters (seconds).
SUMMARY_TIMEOUT = 5.0
#: The world calls whose waits each rank sends for the summary (its last ones).
SUMMARY_CALLS = 256
#: The world calls whose waits a status line carries (``swarmfd top`` finds the
#: straggler of the last moments in them).
RECENT = 64
_LOG = logging.getLogger("swarmfd")
_KEYS = ("calls", "bytes", "time_s", "wait_s")


def stats(reset: bool = False) -> dict[str, Any]:
    """This rank's counters of its collective calls since init (or the last reset):
    ``{"calls", "bytes", "time_s", "wait_s", "last": {rank: count}, "groups": {name:
    {the same keys}}}``. The top level counts every group's calls (the world's, the
    host group's and new_group's); ``groups`` each group's, by its name ("world",
    "host NAME", "group N"). ``bytes`` adds up each call's buffer, ``time_s`` the time
    inside the calls, ``wait_s`` the time they waited for peers' messages; ``last``
    counts, per world rank, the calls in which this rank waited longest for that
    rank (its own rank: the calls it did not wait in). ``reset=True`` starts a new
    window after reading."""
    s = _group.current("stats()")
    groups = {g.name: g.stats.as_dict() for g in s.groups.values()}
    total: dict[str, Any] = {k: sum(d[k] for d in groups.values()) for k in _KEYS}
    last: dict[int, int] = {}
    for d in groups.values():
        for r, n in d["last"].items():
            last[r] = last.get(r, 0) + n
    total["last"] = dict(sorted(last.items()))
    total["groups"] = groups
    if reset:
        for g in s.groups.values():
            g.stats.reset(s.config.world_size)
        s.since = time.monotonic()
    return total


def _totals(s: Any) -> tuple[float, float]:
    """(seconds inside calls, seconds waited) of every group of ``s``."""
    every: list[CallStats] = [g.stats for g in s.groups.values()]
    return sum(st.time_s for st in every), sum(st.wait_s for st in every)


def summarize(s: Any) -> str:
    """At cleanup: the straggler summary of a world of more than one rank that made world
    calls and saw no failure. Every rank but 0 sends its counters to rank 0, one way
    (a status message: it never waits, and no collective can meet a peer still in its
    training loop); rank 0 waits for them at most SUMMARY_TIMEOUT, and gives up at once
    when a peer is in a collective (it answers a status query from there) or gone.
    Returns (and logs, as a WARNING of logger ``swarmfd``) rank 0's line, or ""."""
    world, engine = s.world, s.engine
    if (s.config.world_size < 2 or world is None or world.seq == 0 or s.transport is None
            or engine is None or not engine.idle()
            or any(g.broken is not None for g in s.groups.values())):
        return ""  # (async calls still pending: the progress thread reads the planes)
    _, waited = _totals(s)
    row = [time.monotonic() - s.since, waited, world.seq,
           *world.stats.recent(world.seq, SUMMARY_CALLS)]
    ch = s.transport.channel
    with engine.lock:  # (the channel is driven by one thread at a time)
        if s.config.rank != 0:
            ch.send_row(0, world.gid, row)
            return ""
        rows = _collect(ch, world.ranks)
    if rows is None:
        return ""
    line = straggler_line([row, *(rows[r] for r in world.ranks[1:])])
    if line:
        _LOG.warning("%s", line)
    return line


def _collect(ch: Any, ranks: tuple[int, ...]) -> dict[int, list[float]] | None:
    """Rank 0: the other ranks' rows, or None when one is in a collective, gone, or has
    not sent its row within SUMMARY_TIMEOUT."""
    st = ch.stalls
    query = st.queries[ch.ask(0, ranks)]
    end = time.monotonic() + SUMMARY_TIMEOUT
    while time.monotonic() < end:
        try:
            ch.service()
        except SwarmfdError:
            return None
        if all(r in st.rows for r in ranks[1:]):
            return st.rows
        if (any(a[2] for a in query.answers.values())
                or any(ch.gone(r) for r in ranks[1:])):
            return None  # a peer is still in a collective, or gone: no summary
        time.sleep(0.005)
    return None


def straggler_line(rows: list[list[float]]) -> str:
    """The summary of the gathered rows (per rank: wall time, time waited, the world's
    last call, then its waits from the oldest kept call on), or "" when no rank
    stands out (see :func:`swarmfd.counters.straggler`)."""
    waits: dict[int, dict[int, float]] = {}
    shares: dict[int, float] = {}
    for r, row in enumerate(rows):
        wall, waited, last = float(row[0]), float(row[1]), int(row[2])
        kept = row[3:3 + min(last, len(row) - 3)]
        waits[r] = {last - len(kept) + 1 + i: float(w) for i, w in enumerate(kept)}
        shares[r] = waited / wall if wall > 0 else 0.0
    found = straggler(waits, shares)
    if found is None:
        return ""
    rank, count, calls = found
    others = [r for r in waits if r != rank]
    share = sum(shares[r] for r in others) / len(others)
    figures = "; ".join(f"rank {r} {rows[r][1]:.1f} s of {rows[r][0]:.1f} s" for r in others)
    return (f"swarmfd: straggler: rank {rank} arrived last in {count} of the last {calls} "
            f"world calls; the other ranks waited {share:.0%} of their time ({figures})")


class StatusThread:
    """Writes a status line of this rank every ``interval`` seconds to file descriptor
    ``fd`` (stderr), and a last one at :meth:`close` (see :mod:`swarmfd.statusline`)."""

    def __init__(self, state: Any, interval: float, fd: int = 2) -> None:
        self.state = state
        self.interval = interval
        self.fd = fd
        self.stop = threading.Event()
        self.prev = (time.monotonic(), 0, 0, 0.0)  # (when, calls, bytes, waited)
        self.thread = threading.Thread(target=self._loop, name="swarmfd-status", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            self._write(final=False)

    def _write(self, final: bool) -> None:
        try:
            record = self.sample(final)
            os.write(self.fd, statusline.encode(record))
        except Exception:  # a status line must never disturb the job
            pass

    def sample(self, final: bool) -> dict[str, Any]:
        """This rank's status now (the fields of :mod:`swarmfd.statusline`)."""
        s = self.state
        groups = list(s.groups.values())
        calls = sum(g.stats.calls for g in groups)
        nbytes = sum(g.stats.bytes for g in groups)
        _, waited = _totals(s)
        now = time.monotonic()
        then, calls0, bytes0, waited0 = self.prev
        self.prev = (now, calls, nbytes, waited)
        dt = max(now - then, 1e-9)
        ch = s.transport.channel if s.transport is not None else None
        state, inside = _doing(ch)
        world = s.world
        seq = world.seq if world is not None else 0
        return {
            "rank": s.config.rank, "world": s.config.world_size, "node": s.hosts[s.config.rank],
            "pid": os.getpid(), "state": state, "in_s": round(inside, 3), "calls": calls,
            "bytes": nbytes, "wait_s": round(waited, 6), "up_s": round(now - s.since, 3),
            "calls_per_s": round((calls - calls0) / dt, 3),
            "mb_per_s": round((nbytes - bytes0) / dt / 1e6, 3),
            "wait_share": round(min(1.0, max(0.0, (waited - waited0) / dt)), 4),
            "stall_s": ch.stalls.threshold if ch is not None else 0.0,
            "blamed": ch.stalls.named() if ch is not None else [],
            "seq": seq, "waits": [round(w, 6) for w in
                                  (world.stats.recent(seq, RECENT) if world else [])],
            "final": final, "summary": s.summary if final else "",
        }

    def close(self) -> None:
        """Stop the thread and write the last line (the job's totals)."""
        self.stop.set()
        self.thread.join(timeout=self.interval + 1.0)
        self._write(final=True)


def _doing(ch: Any) -> tuple[str, float]:
    """What the rank does ("computing", or the call it is in) and for how long (s)."""
    activity = getattr(ch, "activity", "idle")
    g = getattr(activity, "group", None)
    if g is None:
        return ("computing" if activity == "idle" else str(activity)), 0.0
    return (f"{activity.coll.label} #{activity.seq}"
            + ("" if g.name == "world" else f" of {g.name}"),
            max(0.0, time.perf_counter() - g.stats.since))
