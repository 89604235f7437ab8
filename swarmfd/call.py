"""The call layer: how one collective call of a group runs, blocking or async.

A call is an algorithm (a generator of :mod:`swarmfd.algorithms`) driven over an
:class:`~.algorithms.base.Op`: blocking, with nothing pending on the progress engine, on
the caller's thread (:func:`swarmfd.algorithms.base.run`); async, or behind pending
async work, by the progress engine (:mod:`swarmfd.engine`).

A :class:`Schedule` is a kind of call worked out once (signature, the selection's
choice and its arguments, an op with headers packed and views kept), kept by the group
under the call's key (whatever the choice depends on), so repeated calls are looked up
and both forms of a call run the same schedule. docs/internals.md, "How a call flows".

Every call adds to its group's :class:`~swarmfd.counters.CallStats`. A call that raises
breaks its group and tells the peers (an abort); later calls raise
:meth:`Group.failure`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

from .algorithms.base import Op, run
from .algorithms.select import Choice
from .comm.wire import DTYPES, Collective, Signature
from .counters import WINDOW
from .engine import Work, completed
from .group import WORLD_GID, Group

__all__ = ["MAX_SCHEDULES", "Label", "Schedule", "label", "run_call", "run_message",
           "schedule"]

#: Schedules a group keeps before it forgets them all (a training loop takes a few shapes).
MAX_SCHEDULES = 256
_MASK = WINDOW - 1


class Label:
    """What a call is, for error messages ("all_reduce (call #7 on rank 2)"), formatted
    only when a message needs it."""

    __slots__ = ("coll", "group", "seq")

    def __init__(self, coll: Collective, group: Group, seq: int = 0) -> None:
        self.coll, self.group, self.seq = coll, group, seq

    def __str__(self) -> str:
        g = self.group
        return (f"{self.coll.label} (call #{self.seq} on rank {g.world_rank}"
                + ("" if g.gid == WORLD_GID else f", {g.name}") + ")")

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def label(g: Group, sig: Signature) -> str:
    """The label of ``g``'s current call of ``sig``."""
    return str(Label(sig.coll, g, g.seq))


class Schedule:
    """A kind of call of one group, worked out once: ``algo(op, *bufs, *args,
    *choice.args)``, ``bufs`` what each call passes; ``choice`` None: nothing to send."""

    __slots__ = ("algo", "args", "choice", "engine", "group", "label", "nbytes", "op",
                 "others", "sig")

    def __init__(self, group: Group, sig: Signature, choice: Choice | None,
                 args: Sequence[Any] = ()) -> None:
        self.group = group
        self.sig = sig
        self.choice = choice
        self.algo = None if choice is None else choice.algo
        self.args = tuple(args) if choice is None else (*args, *choice.args)
        self.label = Label(sig.coll, group)
        self.engine = group.engine
        #: The call's buffer, in bytes (what the counters add up).
        self.nbytes = sig.count * DTYPES[sig.dtype].itemsize if sig.dtype in DTYPES else 0
        plane = group.plane()
        ch = group.channel
        #: The op every blocking call of the schedule runs with (None: no peers).
        self.op = None if plane is None or group.size == 1 or choice is None else Op(
            ch, plane, group.ranks, group.rank, group.gid, 0, sig,
            plane if plane.shares_memory else None, group.next_slot, 0, group.ring)
        #: Whether aborts may come on another plane than the call's (read now and then).
        self.others = ch is not None and len(ch.planes) > 1

    @property
    def parts(self) -> bool:
        """Whether the algorithm takes :class:`~.algorithms.base.Parts`."""
        return self.choice is not None and self.choice.parts

    def run(self, *bufs: Any) -> Any:
        """Run one call on ``bufs``, blocking; the algorithm's result."""
        g = self.group
        if g.broken is not None and g.seq + 1 >= g.broken_from:
            raise g.failure()
        g.seq = seq = g.seq + 1
        op = self.op
        if op is None:
            g.stats.record(seq, 0.0, self.nbytes, 0.0, 0)
            return None
        engine = self.engine
        if engine.queues or engine.p2p:  # behind pending async work: the engine runs it
            return self._submit(bufs, seq, None).wait()
        self.label.seq = op.seq = seq  # (Op.at, written out: every call passes here)
        op.seqb = (seq & 0xFFFFFFFF).to_bytes(4, "little")
        op.out[0] = False
        st = g.stats
        st.since = t0 = perf_counter()
        result = _blocking(g, engine, op, self.algo(op, *bufs, *self.args),  # type: ignore[misc]
                           self.label, True, self.others)
        # The counters (CallStats.record, written out: every call passes here).
        st.time_s += perf_counter() - t0
        st.calls += 1
        st.bytes += self.nbytes
        ch = op.channel
        waited = ch.waited
        st.waits[seq & _MASK] = waited
        if waited:  # (a call that did not wait counts for this rank: CallStats.as_dict)
            st.wait_s += waited
            st.last[ch.waited_on] += 1
            ch.waited = ch.waited_most = 0.0
        return result

    def start(self, *bufs: Any, finish: Callable[[Any], Any] | None = None) -> Work:
        """Issue one call on ``bufs`` as async work: a :class:`Work` that gives
        ``finish(result)`` (or the result) once the call completed."""
        g = self.group
        if g.broken is not None and g.seq + 1 >= g.broken_from:
            return completed(None, label(g, self.sig), g.failure())
        g.seq = seq = g.seq + 1
        if self.op is None:
            g.stats.record(seq, 0.0, self.nbytes, 0.0, 0)
            return completed(finish(None) if finish is not None else None, label(g, self.sig))
        return self._submit(bufs, seq, finish)

    def _submit(self, bufs: tuple[Any, ...], seq: int,
                finish: Callable[[Any], Any] | None) -> Work:
        op = self.op.copy().at(seq)  # type: ignore[union-attr]
        return self.group.engine.submit(self.group, op, self.algo(op, *bufs, *self.args),
                                        label(self.group, self.sig), finish,
                                        nbytes=self.nbytes)


def schedule(g: Group, key: Any, make: Callable[[], Schedule]) -> Schedule:
    """``g``'s schedule of ``key``, made by ``make()`` on its first call and kept
    (``key`` None: made for this call only)."""
    if key is None:
        return make()
    found = g.schedules.get(key)
    if found is None:
        if len(g.schedules) >= MAX_SCHEDULES:
            g.schedules.clear()
        found = g.schedules[key] = make()
    return found


def run_call(s: Schedule, bufs: tuple[Any, ...], finish: Callable[[Any], Any] | None,
             async_op: bool) -> Any:
    """Run ``s`` on ``bufs`` and give ``finish(result)``, or (``async_op``) a Work that
    gives it."""
    if async_op:
        return s.start(*bufs, finish=finish)
    result = s.run(*bufs)
    return finish(result) if finish is not None else result


def _blocking(g: Group, engine: Any, op: Op, gen: Any, activity: Any, collective: bool,
              others: bool) -> Any:
    """Drive ``gen`` on ``op`` on the caller's thread (nothing pending on the engine):
    ``g``'s current call (``collective``) or a point-to-point message of ``g``. A
    failure breaks the group and the peers hear of it."""
    ch = op.channel
    with engine.lock:  # the progress thread may be finishing its last step
        ch.enter(g.gid, g.seq, activity, collective)
        try:
            if others:  # aborts may come on another plane than this call's
                ch.service_others(op.plane)
            result = run(op, gen)
            if op.out[0] or not collective:
                ch.flush()
            return result
        except BaseException as exc:
            ch.waited = ch.waited_most = 0.0
            g.broken, g.broken_from = exc, 0  # names the last call this rank finished
            ch.abort(exc, g.gid, g.seq - 1 if collective else g.seq)
            raise
        finally:
            ch.leave()


def run_message(g: Group, op: Op, gen: Any, activity: str,
                finish: Callable[[Any], Any] | None, async_op: bool) -> Any:
    """A point-to-point message of ``g`` (``gen``: its algorithm on ``op``), blocking on
    the caller's thread when nothing is pending, else through the engine: gives
    ``finish(result)``, or (``async_op``) a Work that gives it."""
    engine = g.engine
    if not async_op and engine.idle():
        ch = op.channel
        try:
            result = _blocking(g, engine, op, gen, activity, False, len(ch.planes) > 1)
        finally:
            ch.waited = ch.waited_most = 0.0  # a message is no collective: not counted
        return finish(result) if finish is not None else result
    work = engine.submit(g, op, gen, activity, finish, p2p=True)
    return work if async_op else work.wait()
