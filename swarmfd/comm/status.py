"""Stall reports: which members of a group have not entered the call a rank waits in.

A blocking receive wakes every WAIT_SLICE to check its deadline (:mod:`.channel`). Once
it has waited longer than the stall threshold (``SWARMFD_STALL_WARN``), the rank sends
a *status query* to the group's other members: a :data:`~.wire.Kind.STATUS` message
with a small JSON body, over the TCP plane (which reaches every peer and is
authenticated like every message). Every rank answers from wherever it reads messages:
a wait in any call of any group, a flush, the progress thread. The answer gives the
group's latest call it entered, whether it finished it, and what it waits in now. A
member that does not answer within ANSWER_WINDOW is in no swarmfd wait: it computes,
or is blocked outside swarmfd (a data loader, a lock, I/O).

Then the waiting rank logs one line (logger ``swarmfd``, WARNING: visible with no
logging set-up) naming the call (its public name, its number in the group, the group,
its signature) and the members that have not entered it, each with the last call it
finished, and asks again each period while it waits. On a ring, the rank named is the
one that is late, not the neighbour whose message this rank happens to wait for. The
collective timeout is unchanged; with a threshold below it, the report comes first.

The same messages carry, at cleanup, each rank's counters to rank 0 for the straggler
summary (:func:`row_body`; :mod:`swarmfd.observe`): one way, so no rank ever waits
for another at cleanup but rank 0, and that for a bounded time.

Bodies are JSON, at most MAX_BODY bytes, checked field by field: nothing a peer sends
is unpickled or trusted beyond being shown in a log line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ANSWER_WINDOW", "MAX_BODY", "MAX_ROW", "StallWatch", "answer_body", "parse",
           "query_body", "row_body", "stall_line"]

#: How long a stalled rank waits for the answers to its query before it reports; a
#: member silent that long is in no swarmfd wait (waits read every plane each
#: WAIT_SLICE, 0.05 s).
ANSWER_WINDOW = 0.5
#: The largest status body read; anything longer is dropped.
MAX_BODY = 8192
#: The most numbers a row of counters carries.
MAX_ROW = 512
#: What an answer says of the call its sender waits in, at most.
MAX_DOING = 200
_M = 0xFFFFFFFF
_LOG = logging.getLogger("swarmfd")


def query_body(qid: int, group: int, seq: int) -> bytes:
    """A query: which call of ``group`` has the receiver entered (asker waits in ``seq``)."""
    return json.dumps({"q": qid, "g": group, "s": seq & _M}).encode()


def answer_body(qid: int, group: int, entered: int, finished: int, doing: str) -> bytes:
    """The answer to query ``qid``: the latest call of ``group`` entered and finished
    here, and what this rank waits in now ("" outside a call)."""
    return json.dumps({"a": qid, "g": group, "e": entered & _M, "f": finished & _M,
                       "w": doing[:MAX_DOING]}).encode()


def row_body(group: int, row: list[float]) -> bytes:
    """This rank's counters for the summary (at most MAX_ROW numbers, to the us)."""
    return json.dumps({"r": [round(x, 6) for x in row[:MAX_ROW]], "g": group},
                      separators=(",", ":")).encode()


def _int(info: dict[str, Any], key: str) -> int | None:
    value = info.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _M:
        return value
    return None


def parse(payload: Any) -> dict[str, Any] | None:
    """A status body as {"q" or "a": id, "g": group, ...}, or None when it is not one
    (too long, not JSON, a field missing or of the wrong type)."""
    data = bytes(payload)
    if len(data) > MAX_BODY:
        return None
    try:
        info = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(info, dict) or _int(info, "g") is None:
        return None
    if _int(info, "q") is not None and _int(info, "s") is not None:
        return info
    row = info.get("r")
    if (isinstance(row, list) and len(row) <= MAX_ROW and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)):
        return info
    if (_int(info, "a") is not None and _int(info, "e") is not None
            and _int(info, "f") is not None and isinstance(info.get("w"), str)):
        # What a peer says it does goes into a log line: one line, of printable text.
        info["w"] = "".join(c if c.isprintable() else " " for c in info["w"][:MAX_DOING])
        return info
    return None


def _ranks(ranks: Sequence[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(str(r) for r in ranks))


def stall_line(me: int, call: str, waited: float, seq: int, members: Sequence[int],
               answers: dict[int, tuple[int, int, str]], src: int) -> tuple[str, list[int]]:
    """The report of rank ``me``, whose ``call`` (its description) has waited ``waited``
    s: (the line, the members that have not entered call ``seq``). ``answers``: member
    -> (entered, finished, what it waits in); a member without one is in no swarmfd wait
    and is taken to have finished the call before (it is not inside one). ``src``: the
    rank whose message this rank waits for."""
    missing, why = [], []
    for r in members:
        if r == me:
            continue
        got = answers.get(r)
        if got is not None and (got[0] - seq) & _M < 0x80000000:
            continue  # it entered this call (or a later one)
        missing.append(r)
        if got is None:
            why.append(f"rank {r}: last finished #{(seq - 1) & _M}, not in a swarmfd call")
        else:
            where = f"waiting in {got[2]}" if got[2] else "not in a swarmfd call"
            why.append(f"rank {r}: last finished #{got[1]}, {where}")
    head = f"swarmfd: rank {me}: {call} has waited {waited:.1f} s"
    if not missing:
        doing = answers.get(src, (0, 0, ""))[2]
        return (f"{head}; every member has entered it, this rank waits for rank {src}'s "
                f"message" + (f" (rank {src} waits in {doing})" if doing else ""), [])
    return f"{head}; not entered by {_ranks(missing)} ({'; '.join(why)})", missing


class _Query:
    """A status query sent: when, to whom, and the answers that came."""

    __slots__ = ("answers", "asked_at", "members")

    def __init__(self, asked_at: float, members: Sequence[int]) -> None:
        self.asked_at = asked_at
        self.members = tuple(members)
        self.answers: dict[int, tuple[int, int, str]] = {}


class StallWatch:
    """The stall reports of one channel's waits (see the module docstring): a blocking
    receive's, and each of the progress engine's waiting calls.

    The channel calls :meth:`tick` once a wait passed its stall time, and :meth:`answer`
    for every answer that arrives; :meth:`end` when the wait is over."""

    def __init__(self, me: int, send: Callable[[int, int, bytes], None]) -> None:
        self.me = me
        #: ``send(dst, group, body)``: a status message to a peer (the TCP plane).
        self.send = send
        #: Seconds a wait may last before it is reported; 0: never.
        self.threshold = 0.0
        self.qid = 0
        #: The open queries by id, and the open query of each stalled wait, by (group,
        #: call).
        self.queries: dict[int, _Query] = {}
        self.open: dict[tuple[int, int], int] = {}
        #: The members the latest report of each stalled wait named; the reports logged.
        self.blamed: dict[tuple[int, int], list[int]] = {}
        self.reports = 0
        #: The peers' rows of counters that came (see :func:`row_body`), by rank.
        self.rows: dict[int, list[float]] = {}

    def tick(self, now: float, started: float, group: int, seq: int, call: str,
             members: Sequence[int], src: int) -> float:
        """A wait begun at ``started`` in call ``seq`` of ``group`` passed its stall time:
        ask the members, or (ANSWER_WINDOW after asking, or when all answered) log the
        report. Returns the time of the next tick."""
        key = (group, seq)
        soon = now + min(ANSWER_WINDOW, self.threshold) / 5
        qid = self.open.get(key)
        if qid is None:
            self.open[key] = self.ask(now, group, seq, members)
            return soon
        q = self.queries[qid]
        if now - q.asked_at < ANSWER_WINDOW and len(q.answers) < len(q.members) - 1:
            return soon
        line, self.blamed[key] = stall_line(self.me, call, now - started, seq, q.members,
                                            q.answers, src)
        _LOG.warning("%s", line)
        self.reports += 1
        del self.open[key], self.queries[qid]
        return max(q.asked_at + self.threshold, now + ANSWER_WINDOW)

    def ask(self, now: float, group: int, seq: int, members: Sequence[int]) -> int:
        """Send a new query to ``members`` (but this rank): which call of ``group``
        they are in (this rank waits in ``seq``; 0: none). Its id."""
        self.qid += 1
        self.queries[self.qid] = q = _Query(now, members)
        body = query_body(self.qid, group, seq)
        for r in q.members:
            if r != self.me:
                self.send(r, group, body)
        return self.qid

    def answer(self, src: int, info: dict[str, Any]) -> None:
        """A member's answer ``info`` (from :func:`parse`) to an open query, if it is one."""
        q = self.queries.get(info["a"])
        if q is not None and src in q.members:
            q.answers[src] = (info["e"], info["f"], info["w"])

    def end(self, group: int, seq: int) -> None:
        """The wait in call ``seq`` of ``group`` is over: forget its query and whom it
        blamed."""
        qid = self.open.pop((group, seq), None)
        if qid is not None:
            self.queries.pop(qid, None)
        self.blamed.pop((group, seq), None)

    def named(self) -> list[int]:
        """The ranks the stalled waits' latest reports name (a status line shows them)."""
        return sorted({r for ranks in self.blamed.values() for r in ranks})
