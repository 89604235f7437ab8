"""The message layer: one per process, written once, over any number of planes.

The algorithms talk to peers through :class:`Channel`; the bytes move through its
planes (:mod:`swarmfd.comm.plane`): a TCP plane (socket or zmq) to every peer, and
the shared-memory plane to the peers on this host. Whatever the plane, the channel
gives every message the same semantics:

* **Matching.** A receive names what it waits for: group, source rank, the call's
  sequence number in that group, and a tag. A message that arrives early (from
  another peer, another group, or a later call of a faster peer) is kept in the
  *stash* until asked for; one for a call more than MAX_CALLS_AHEAD ahead is a
  protocol error. What a peer has waiting in the stash is bounded in bytes too
  (``stash_limit``, ``SWARMFD_STASH_MB``): a peer that sends more than that which
  nobody asked for yet (distinct tags, point-to-point pieces, groups this rank has
  not made) fails the call with a :class:`ProtocolError` naming it, so neither a bug
  nor a rank that holds the secret can grow its peers' memory without bound.
* **Signatures.** Every header carries the call's signature (collective, op, dtype,
  root, count, shape hash); the first message of a mismatching call raises
  :class:`MismatchError` on the rank that receives it, naming both sides. A message
  of a call this rank already finished means its sender was in another collective.
* **Deadlines.** Every wait is bounded by the timeout. A rank that times out tells
  the others whom it waited for, listens TIMEOUT_GRACE to their reports, and names
  the rank at the end of the chain: the one really stuck (on every plane alike).
* **Lost peers.** A peer whose connection closed (EOF, reset, keepalive, a closed
  shared-memory inbox) may still deliver what it sent for LOST_PEER_GRACE; then a
  wait on it raises :class:`PeerLostError`, after reading any abort it sent first
  (an abort explains a loss better than the loss).
* **Aborts.** A rank whose call fails tells the group's other members (best effort,
  on every plane); they raise the same kind of error (:func:`error_from_abort`).
  An abort's JSON is cut to fit the plane before it is encoded, so it always parses.
  It says the last call the aborting rank finished: a rank still in that call (or an
  earlier one) gets all of that rank's messages for it, so it finishes the call and
  fails the next ones from the failed call on (:attr:`Channel.on_group_error`).
  Without that, whether the call finished depended on which connection delivered
  first: a root waiting for rank A's acknowledgement failed when rank B's abort of
  the next call came first on another connection.
* **Strangers.** A header that is not a swarmfd message is a protocol error of the
  connection it came on (planes validate the source); nothing is unpickled.

Groups: messages carry a group id. The channel knows each group's current call
(:meth:`Channel.begin`); a message or abort for another group than the one being
waited on is stashed, or reported to that group (:attr:`Channel.on_group_error`),
and never disturbs the current call.

Stalls. A blocking receive that waited longer than the stall threshold asks the
group's members which call they are in and logs who has not entered this one
(:mod:`.status`); every wait answers such queries. Each blocking receive also adds the
time it waited to :attr:`Channel.waited` (the call layer's counters read it).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import DEFAULT_STASH_MB, ENV_STASH_MB
from ..errors import (
    AbortedError,
    CollectiveTimeout,
    MismatchError,
    PeerLostError,
    ProtocolError,
    abort_finished,
    abort_is_provisional,
    abort_kind,
    abort_waited_for,
    error_from_abort,
)
from . import wire
from .plane import PeerInfo, Plane
from .status import StallWatch, answer_body, parse, row_body

__all__ = ["Channel", "GroupFailure", "Key", "Posting"]

#: After a timeout, how long a rank listens to the others' timeout reports to find the
#: rank that is really stuck (see Channel.timeout_error).
TIMEOUT_GRACE = 0.6
#: How long a peer whose connection closed may still deliver what it had sent. It also
#: gives a leaving rank a head start: it exits before the ranks that lose it raise, so
#: the launcher and Swarm name it as the rank that ended the job.
LOST_PEER_GRACE = 0.3
#: A blocking receive returns at least this often (s) to check deadlines and lost peers.
WAIT_SLICE = 0.05
#: A peer's message for a call this far ahead of the receiver's is a protocol error
#: (collectives end with every rank having heard from the others, so a correct peer is
#: at most a call or two ahead); bounds what the stash can hold.
MAX_CALLS_AHEAD = 16
#: The reason text an abort carries at most (also cut to fit the plane's records).
MAX_ABORT_TEXT = wire.MAX_ABORT_TEXT
#: What a stashed message costs besides its payload (its key, header and dict entry,
#: rounded up): empty messages under distinct keys are not free either.
STASH_ENTRY_BYTES = 512

_NONE = wire.Signature(wire.Collective.NONE)
Key = tuple[int, int, int, int]  # (group, src, seq, tag)
#: What a posted receive expects: (signature, nbytes, buffer to land in or None).
Posting = tuple[wire.Signature, int, Any]


class GroupFailure(Exception):
    """A message broke one group's call (raised by :meth:`Channel.deliver`)."""

    def __init__(self, group: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.group = group
        self.error = error


_now = time.monotonic
#: Message kinds as plain ints for the receive loop (an enum member is a class attribute
#: lookup each time).
_DATA = int(wire.Kind.DATA)
_P2P = int(wire.Kind.P2P)
_P2P_READY = int(wire.Kind.P2P_READY)
_STATUS = int(wire.Kind.STATUS)
#: The kinds a posted receive may take (not aborts, not status messages).
_POSTABLE = frozenset((_DATA, _P2P, _P2P_READY))
_INF = float("inf")
_P2P_COLL = int(wire.Collective.P2P)
_P2P_KEYS = wire.P2P_KEYS
_MAX_PAYLOAD = wire.MAX_PAYLOAD


class _Cutoff(Exception):
    """A bounded wait inside the channel ran out (never leaves the channel)."""


def _cutoff(seconds: float) -> Callable[[], None]:
    """A ``between`` callback that ends a payload read after ``seconds``."""
    end = _now() + seconds

    def between() -> None:
        if _now() > end:
            raise _Cutoff
    return between


def abort_body(kind: str, rank: int, message: str, limit: int, **extra: Any) -> bytes:
    """An abort's JSON, with ``message`` cut (ending in "...") to at most MAX_ABORT_TEXT
    characters and so that the *encoded* body fits ``limit`` bytes: the longest such
    start of the message, found by bisection (escapes make a character cost 1 to 12
    bytes, so the body's excess says little about how much to cut)."""
    def encode(text: str) -> bytes:
        return json.dumps({"kind": kind, "rank": rank, "message": text, **extra}).encode()

    if len(message) <= MAX_ABORT_TEXT:
        body = encode(message)
        if len(body) <= limit:
            return body
    lo, hi = 0, min(len(message), MAX_ABORT_TEXT - 3)  # the longest prefix that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(message[:mid] + "...")) <= limit:
            lo = mid
        else:
            hi = mid - 1
    body = encode(message[:lo] + "...")
    return body if len(body) <= limit else encode("")


class Channel:
    """Point-to-point messages between this rank and its peers (see module docstring)."""

    def __init__(self, rank: int, world_size: int, timeout: float,
                 swarm_task: bool = False,
                 stash_limit: int = DEFAULT_STASH_MB << 20) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.planes: list[Plane] = []
        self.peers: list[PeerInfo] = []
        self.stash: dict[Key, tuple[wire.Header, Any]] = {}
        #: Bytes each peer has waiting in the stash (see the module docstring), and the
        #: most it may have.
        self.stashed = [0] * world_size
        self.stash_limit = stash_limit
        #: rank -> when its connection (on any plane) was found closed or broken.
        self.lost: dict[int, float] = {}
        #: Peers whose listener refused this rank's authentication.
        self.refused: set[int] = set()
        #: Messages dropped as not from a peer, or of no known kind.
        self.garbage = 0
        #: The sequence number of each group's current (latest begun) call.
        self.calls: dict[int, int] = {}
        #: Called with (group, error, first) for an abort or mismatch of a group other
        #: than the one being waited on, or an abort of a later call than the current
        #: one: that group is broken from its call ``first`` on (0: every call, the
        #: running ones too), the current call goes on.
        self.on_group_error: Callable[[int, BaseException, int], None] = \
            lambda g, e, first: None
        #: True while a point-to-point call runs on the caller's thread: an abort of a
        #: later collective call is raised at once (the message waited for may never
        #: come: nothing orders it before the collective that failed).
        self.p2p = False
        #: Called with (group, rank, rank it waited for, payload) for a peer's provisional
        #: timeout report of a group other than the one being waited on.
        self.on_report: Callable[[int, int, int, Any], None] = lambda g, r, w, p: None
        #: What the rank is doing, for error messages.
        self.activity = "idle"
        #: A Swarm task (its slot is its rank + 1): errors name the slot too.
        self.swarm_task = swarm_task
        self.waiting_for = -1
        self._group = 0  # the group of the call being waited on
        self.serviced = 0.0  # when service_others last read the other planes
        #: Seconds the blocking receives of the current call waited in all, the longest
        #: one and the rank it waited for (the call layer reads and resets them).
        self.waited = 0.0
        self.waited_most = 0.0
        self.waited_on = -1
        #: Stall reports (see the module docstring): the watch, when the current wait
        #: began and when it next looks at its stall (never, without a threshold).
        self.stalls = StallWatch(rank, self._send_status)
        self.wait_began = 0.0
        self.stall_at = _INF
        self.stalled = False
        #: A group's name and world ranks, or None for a group of init's own (not
        #: reported); whether the progress engine has calls of a group pending.
        self.describe_group: Callable[[int], tuple[str, Sequence[int]] | None] = \
            lambda gid: None
        self.pending: Callable[[int], bool] = lambda gid: False

    # -- bookkeeping --------------------------------------------------------------------

    def add_plane(self, plane: Plane) -> None:
        self.planes.append(plane)

    def begin(self, group: int, seq: int) -> None:
        """A call of ``group`` with sequence number ``seq`` starts on this rank."""
        self.calls[group] = seq

    def enter(self, group: int, seq: int, activity: Any, collective: bool = True) -> None:
        """A blocking call runs on this thread: ``group``'s call ``seq`` (a collective)
        or a point-to-point message of ``group`` (``collective`` False: its seq is not
        the group's); ``activity`` names it in errors until :meth:`leave`."""
        if collective:
            self.calls[group] = seq
        self._group = group
        self.activity = activity
        self.p2p = not collective

    def leave(self) -> None:
        """The blocking call :meth:`enter` began is over."""
        self.activity = "idle"
        self.p2p = False

    def last_call(self, group: int) -> int:
        """The number of ``group``'s latest call begun on this rank (0: none)."""
        return self.calls.get(group, 0)

    def where(self, rank: int) -> str:
        """A peer's host, pid and address (its TCP endpoint, or "shared memory" for a
        peer reached through this host's), for error messages (on a Swarm, where task
        slots count from 1 and host names carry the slot, also its slot)."""
        if 0 <= rank < len(self.peers):
            p = self.peers[rank]
            slot = f"; task slot {rank + 1}" if self.swarm_task else ""
            via = "shared memory" if self._shares_memory(rank) else p.endpoint
            return f"host {p.host}, pid {p.pid}, {via}{slot}"
        return "unknown address"

    def _shares_memory(self, rank: int) -> bool:
        """Whether ``rank`` is reached through this host's shared-memory plane."""
        return any(plane.shares_memory and rank in getattr(plane, "ranks", ())
                   for plane in self.planes)

    def gone(self, rank: int, now: float | None = None) -> bool:
        """``rank``'s connection was found closed more than LOST_PEER_GRACE ago (what it
        had sent has been delivered by now)."""
        since = self.lost.get(rank)
        return since is not None and (_now() if now is None else now) - since > LOST_PEER_GRACE

    def _incomplete(self, src: int) -> CollectiveTimeout:
        """The error of a message from ``src`` whose payload did not arrive completely
        within the timeout (a read outside a blocking receive)."""
        return CollectiveTimeout(
            f"{self.activity}: a message from rank {src} did not arrive completely within "
            f"{self.timeout:g} s ({self.where(src)})")

    def why_lost(self, rank: int) -> str:
        """Why ``rank`` is lost, as the plane it was reached through saw it."""
        if rank in self.refused:
            return ("its data socket refused this rank's authentication handshake (does it "
                    "run with another job secret or SWARMFD_AUTH setting?)")
        if self._shares_memory(rank):
            return "its process ended (it died or exited)"
        return ("its connection closed (the process died or exited, or its host stopped "
                "answering TCP keepalive probes)")

    def _from_peer(self, hdr: wire.Header) -> bool:
        """True when ``hdr`` claims a source that is another rank of the job."""
        return 0 <= hdr.src < self.world_size and hdr.src != self.rank

    # -- sending ------------------------------------------------------------------------

    def send(self, plane: Plane, dst: int, sig: wire.Signature, group: int, seq: int,
             tag: int, payload: Any = b"", *, nbytes: int | None = None,
             kind: int = wire.Kind.DATA, copy: bool = False) -> None:
        """Queue one message to ``dst`` on ``plane``; never blocks.

        Large payloads are sent without a copy (:meth:`flush` waits until they left
        before the collective returns), unless ``copy``: then the caller may overwrite
        its buffer as soon as this returns.
        """
        size = nbytes if nbytes is not None else (
            len(payload) if type(payload) is bytes else memoryview(payload).nbytes)
        if size > _MAX_PAYLOAD:
            raise wire.too_large(size)
        plane.send(dst, kind, sig, seq, tag, payload, size, copy, group)

    def flush(self) -> None:
        """Wait until no plane reads any buffer handed to :meth:`send` any more.

        Messages that arrive meanwhile are stashed (a peer may be flushing towards
        this rank at the same time).
        """
        for plane in self.planes:
            pending = plane.unsent()
            if not pending:
                continue
            deadline = _now() + self.timeout
            while pending:
                dst = pending[0]
                if _now() > deadline:
                    raise CollectiveTimeout(
                        f"{self.activity}: sending to rank {dst} did not complete within "
                        f"{self.timeout:g} s"
                    )
                plane.check_lost()
                if self.gone(dst):
                    self._raise_pending_abort()
                    raise PeerLostError(
                        f"{self.activity}: rank {dst} disconnected before receiving this "
                        f"rank's data ({self.where(dst)}): {self.why_lost(dst)}"
                    )
                hdr = plane.wait(0.01)
                if hdr is not None:
                    try:
                        self._keep(plane, hdr, keep_data=True,
                                   between=self._stash_between(hdr.src))
                    except _Cutoff:
                        raise self._incomplete(hdr.src) from None
                pending = plane.unsent()

    def abort(self, error: BaseException, group: int, finished: int) -> None:
        """Tell every peer that this rank's call in ``group`` failed (best effort), and
        that ``finished`` was its last finished call of the group (see module
        docstring: peers still in it finish it)."""
        if isinstance(error, AbortedError):
            return  # the originator already told everyone
        if getattr(error, "announced", False):
            return  # a timeout: announced to everyone while its culprit was found
        self._control(group, abort_kind(error), str(error), finished=finished & 0xFFFFFFFF)

    def _control(self, group: int, kind: str, message: str, **extra: Any) -> None:
        """Send an abort or report (JSON) to every peer on every plane, best effort."""
        for plane in self.planes:
            limit = getattr(plane, "max_control", MAX_ABORT_TEXT + 1024)
            body = abort_body(kind, self.rank, message, limit, **extra)
            with contextlib.suppress(Exception):
                plane.send_all(wire.Kind.ABORT, _NONE, body, group)

    # -- receiving ----------------------------------------------------------------------

    def recv(self, plane: Plane, src: int, sig: wire.Signature, group: int, seq: int,
             tag: int, nbytes: int, into: Any = None) -> Any:
        """Receive the collective message (group, src, seq, tag): see :meth:`recv_key`."""
        return self.recv_key(plane, (group, src, seq & 0xFFFFFFFF, tag), sig, nbytes, into)

    def recv_key(self, plane: Plane, key: Key, sig: wire.Signature, nbytes: int,
                 into: Any = None) -> Any:
        """Receive the message ``key`` of ``nbytes`` bytes from ``plane`` (a collective's
        (group, src, seq, tag), or a point-to-point piece's, :func:`wire.p2p_key`).

        With ``into`` (a writable buffer of ``nbytes``) the payload lands there and
        ``None`` is returned; otherwise a buffer is returned (of any size when
        ``nbytes`` is :data:`wire.ANY_SIZE`). Raises
        :class:`CollectiveTimeout` after the timeout, :class:`PeerLostError` when
        ``src`` disconnects, :class:`MismatchError` when a peer's signature differs,
        :class:`AbortedError` when a peer failed.
        """
        stashed = self.stash.pop(key, None)
        if stashed is not None:
            hdr, payload = stashed
            self.stashed[hdr.src] -= hdr.nbytes + STASH_ENTRY_BYTES
            if not hdr.matches(sig):
                raise wire.mismatch_error(self.rank, sig, hdr)
            if hdr.nbytes != nbytes:
                self._check_size(hdr, nbytes)
            if into is None:
                return payload
            memoryview(into).cast("B")[:] = payload
            return None
        group, src, seq = key[0] & 0xFFFF, key[1], key[2]
        if key[0] & _P2P_KEYS:
            # While a recv waits, the group's collective messages are judged against its
            # last call (finished: none of its messages may still come).
            seq = (self.calls.get(group, 0) + 1) & 0xFFFFFFFF
        last_check = began = self.wait_began = _now()
        deadline = last_check + self.timeout
        self.waiting_for = src
        self._group = group
        threshold = self.stalls.threshold
        self.stall_at = last_check + threshold if threshold and not key[0] & _P2P_KEYS else _INF

        def between() -> None:
            self._between_slices(plane, src, deadline, sig, seq)

        while True:
            hdr = plane.next_header(WAIT_SLICE, src)
            if hdr is None:
                between()
                continue
            kind = hdr.kind
            if ((kind == _DATA and (hdr.group, hdr.src, hdr.seq, hdr.tag) == key)
                    or (_P2P <= kind <= _P2P_READY and wire.message_key(hdr) == key)):
                if (hdr.nbytes != nbytes and nbytes != wire.ANY_SIZE) or not hdr.matches(sig):
                    # Read the payload off the stream first: the connection carries the
                    # other groups' calls, which must still find a header next.
                    plane.read_payload(hdr, None, between, keep=True)
                    if not hdr.matches(sig):
                        raise wire.mismatch_error(self.rank, sig, hdr)
                    self._check_size(hdr, nbytes)
                got = plane.read_payload(hdr, into, between)
                waited = _now() - began
                self.waited += waited
                if waited > self.waited_most:
                    self.waited_most, self.waited_on = waited, src
                if self.stalled:
                    self.stalled = False
                    self.stalls.end(group, seq)
                return got
            self._other(plane, hdr, sig, seq, between)
            # Messages keep coming but not the one awaited (a flood, say): the deadline
            # and the peer's liveness still count. Checked after the message was handled:
            # arriving at the deadline, it may be the report that explains the wait.
            if _now() - last_check > WAIT_SLICE:
                between()
                last_check = _now()

    def take(self, key: Key, sig: wire.Signature, nbytes: int, into: Any) -> tuple[bool, Any]:
        """The stashed message ``key``, if it arrived: (True, payload or None when it was
        copied ``into``), else (False, None). Raises on a signature or size mismatch."""
        stashed = self.stash.pop(key, None)
        if stashed is None:
            return False, None
        hdr, payload = stashed
        self.stashed[hdr.src] -= hdr.nbytes + STASH_ENTRY_BYTES
        if not hdr.matches(sig):
            raise wire.mismatch_error(self.rank, sig, hdr)
        self._check_size(hdr, nbytes)
        if into is None:
            return True, payload
        memoryview(into).cast("B")[:] = payload
        return True, None

    def deliver(self, plane: Plane, posted: dict[Key, Posting],
                timeout: float) -> tuple[Key, Any] | None:
        """Wait up to ``timeout`` s for one message on ``plane`` (the progress engine's
        receive). One that a posted receive expects is read straight into its buffer and
        returned with its key; any other is handled as outside a receive: stashed, or an
        abort, mismatch or timeout report passed to its group (:attr:`on_group_error`,
        :attr:`on_report`), so one group's failure never disturbs another's calls.
        Raises :class:`GroupFailure` for a posted message whose signature or size is
        wrong (that call fails)."""
        self._group = -1
        hdr = plane.next_header(timeout)
        if hdr is None:
            return None
        key = wire.message_key(hdr)
        posting = posted.get(key) if hdr.kind in _POSTABLE else None
        # A sender lost in the middle of its message fails that message's group (its
        # connection carries nothing more), not every call of the engine.
        between = self._stash_between(hdr.src, aborts=False)
        try:
            if posting is None:
                with contextlib.suppress(_Cutoff):
                    self._other(plane, hdr, _NONE, 0, between)
                return None
            sig, nbytes, into = posting
            try:
                if not hdr.matches(sig):
                    raise wire.mismatch_error(self.rank, sig, hdr)
                self._check_size(hdr, nbytes)
            except (MismatchError, ProtocolError) as exc:
                plane.read_payload(hdr, None, between, keep=True)  # drop it
                raise GroupFailure(hdr.group, exc) from None
            return key, plane.read_payload(hdr, into, between)
        except (PeerLostError, ProtocolError) as exc:  # (the latter: a peer's stash full)
            raise GroupFailure(hdr.group, exc) from None
        except _Cutoff:
            raise GroupFailure(hdr.group, self._incomplete(hdr.src)) from None

    def _other(self, plane: Plane, hdr: wire.Header, sig: wire.Signature, seq: int,
               between: Callable[[], None]) -> None:
        """Handle a message that is not the one being waited for."""
        payload = plane.read_payload(hdr, None, between, keep=True)
        src = hdr.src
        if (hdr.kind == _DATA and hdr.group == self._group and src != self.rank
                and 0 <= src < self.world_size):
            # The common case, decided here in full: a peer's message of the group
            # waited on, for this call or one at most MAX_CALLS_AHEAD later (a small
            # call's peers send in any order). Anything else takes the general path below.
            ahead = (hdr.seq - seq) & 0xFFFFFFFF
            if (ahead <= MAX_CALLS_AHEAD if ahead else
                    sig.coll == _P2P_COLL or hdr.matches(sig)):
                self._stash((hdr.group, src, hdr.seq, hdr.tag), hdr, payload)
                return
        if self._elsewhere(plane, hdr, payload):
            return
        if hdr.kind == wire.Kind.ABORT:
            waited = abort_waited_for(payload)
            if abort_is_provisional(payload) and waited is not None and self.waiting_for >= 0:
                if waited == self.rank and hdr.src == self.waiting_for:
                    # The rank this one waits for gave up waiting for this one: nobody is
                    # stuck, this rank came too late. Its timeout is relayed, not its own.
                    raise error_from_abort(self.activity, hdr.src, payload)
                # A peer timed out: find out, with everyone, who is really stuck.
                raise self.timeout_error(self.waiting_for, sig, {hdr.src: waited})
            self._final_abort(hdr, payload, deferrable=sig.coll != wire.Collective.P2P)
            return
        if hdr.kind != wire.Kind.DATA:
            self.garbage += 1
            return
        behind = (seq - hdr.seq) & 0xFFFFFFFF
        if behind == 0 and sig.coll != wire.Collective.P2P and not hdr.matches(sig):
            raise wire.mismatch_error(self.rank, sig, hdr)
        self._check_window(hdr, seq)
        # Early message (another peer, or a later collective of a faster peer): keep it.
        self._stash((hdr.group, hdr.src, hdr.seq, hdr.tag), hdr, payload)

    def _elsewhere(self, plane: Plane, hdr: wire.Header, payload: Any) -> bool:
        """Take a message that is not the current group's collective traffic (garbage,
        point to point, another group's); True when it was one, False to go on with it."""
        if not self._from_peer(hdr):
            self.garbage += 1
        elif hdr.kind == _STATUS:
            self._status(plane, hdr, payload)
        elif hdr.kind >= wire.Kind.P2P:
            self._stash_p2p(hdr, payload)
        elif hdr.group != self._group:
            self._for_other_group(hdr, payload)
        else:
            return False
        return True

    def _stash_p2p(self, hdr: wire.Header, payload: Any) -> None:
        """Keep a point-to-point message until its recv asks for it. (No call window: a
        large message waits at its sender until the receiver is ready, so what waits
        here is small ones and requests to send.)"""
        self._stash(wire.message_key(hdr), hdr, payload)

    def _stash(self, key: Key, hdr: wire.Header, payload: Any) -> None:
        """Keep a message until a receive asks for it, within what its sender may have
        waiting here (``stash_limit``); beyond that raise ProtocolError naming the
        sender (the message is dropped). One under a key already stashed replaces it."""
        src = hdr.src
        cost = hdr.nbytes + STASH_ENTRY_BYTES
        old = self.stash.get(key)
        held = self.stashed[src] - (old[0].nbytes + STASH_ENTRY_BYTES if old else 0)
        if held + cost > self.stash_limit:
            raise ProtocolError(
                f"{self.activity}: rank {src} sent more than {self.stash_limit / 2**20:g} MiB "
                f"that this rank has not asked for yet ({held + cost} bytes in messages kept "
                f"for later calls, tags, groups or receives; {ENV_STASH_MB} bounds it): rank "
                f"{src} does not follow the protocol; if one of this job's calls really "
                f"sends that much ahead, raise {ENV_STASH_MB}"
            )
        self.stash[key] = (hdr, payload)
        self.stashed[src] = held + cost

    def _check_window(self, hdr: wire.Header, seq: int) -> None:
        """Raise for a message of a call already finished here, or too far ahead."""
        behind = (seq - hdr.seq) & 0xFFFFFFFF
        ahead = (hdr.seq - seq) & 0xFFFFFFFF
        if 0 < behind < 0x80000000:
            # Every message of a call is consumed within that call: one that arrives
            # after the call ended means the sender was in another collective.
            raise wire.finished_call_error(self.rank, hdr)
        if MAX_CALLS_AHEAD < ahead < 0x80000000:
            raise ProtocolError(
                f"{self.activity}: rank {hdr.src} sent data for call #{hdr.seq}, {ahead} calls "
                f"ahead of this rank (at most {MAX_CALLS_AHEAD} are possible); it does not "
                "follow the protocol"
            )

    def _for_other_group(self, hdr: wire.Header, payload: Any) -> None:
        """A message of another group than the one waited on: stash it, or break that group
        (an abort, or a message out of its window), never the current call."""
        if hdr.kind == wire.Kind.ABORT:
            if not abort_is_provisional(payload):
                first = self._first_failed(hdr.group, payload)
                self.on_group_error(hdr.group, error_from_abort(
                    f"group {hdr.group}" if not first else f"call #{first} of group "
                    f"{hdr.group}", hdr.src, payload), first)
            else:
                waited = abort_waited_for(payload)
                if waited is not None:
                    self.on_report(hdr.group, hdr.src, waited, payload)
            return
        if hdr.kind != wire.Kind.DATA:
            self.garbage += 1
            return
        try:
            self._check_window(hdr, self.calls.get(hdr.group, 0))
        except (MismatchError, ProtocolError) as exc:
            self.on_group_error(hdr.group, exc, 0)
            return
        self._stash((hdr.group, hdr.src, hdr.seq, hdr.tag), hdr, payload)

    def _first_failed(self, group: int, payload: Any) -> int:
        """The first call of ``group`` (in this rank's numbering) that an abort with
        ``payload`` fails: the one after the aborting rank's last finished call, when
        that is this rank's current call or a later one (at most MAX_CALLS_AHEAD on);
        else 0, every call, the current one too."""
        finished = abort_finished(payload)
        if finished is None:
            return 0
        current = self.calls.get(group, 0)
        ahead = (finished - current) & 0xFFFFFFFF
        return current + ahead + 1 if ahead <= MAX_CALLS_AHEAD else 0

    def _final_abort(self, hdr: wire.Header, payload: Any, deferrable: bool) -> None:
        """A final abort of the group being waited on: raised, unless the aborting rank
        finished this rank's current call (``deferrable``: a collective's wait), which
        then goes on; the group fails from the failed call on."""
        first = self._first_failed(hdr.group, payload) if deferrable and not self.p2p else 0
        if not first:
            raise error_from_abort(self.activity, hdr.src, payload)
        self.on_group_error(hdr.group, error_from_abort(
            f"call #{first} of group {hdr.group}", hdr.src, payload), first)

    def _check_size(self, hdr: wire.Header, nbytes: int) -> None:
        if nbytes == wire.ANY_SIZE:
            return  # the algorithm checks what came
        if hdr.nbytes != nbytes and hdr.coll == wire.Collective.ALL_TO_ALL:
            # Each rank chose its own splits: disagreeing ones show as a size difference.
            raise MismatchError(
                f"{self.activity}: all_to_all split mismatch: rank {hdr.src} sends this rank "
                f"{hdr.nbytes} bytes in message {hdr.tag & 0xFFFFF} of step {hdr.tag >> 20}, "
                f"this rank expects {nbytes} (its out_splits); every rank's in_splits[r] must "
                "equal rank r's out_splits for it"
            )
        if hdr.nbytes != nbytes:
            raise ProtocolError(
                f"{self.activity}: rank {hdr.src} announced {hdr.nbytes} bytes for message "
                f"{hdr.tag}, expected {nbytes}"
            )

    def _between_slices(self, plane: Plane, src: int, deadline: float,
                        sig: wire.Signature, seq: int) -> None:
        """After a wait slice without the message: look at the other planes, then check
        whether ``src`` is gone and the deadline."""
        for other in self.planes:
            other.check_lost()
            if other is not plane:
                self._read_available(other, keep_data=True)
        now = _now()
        if self.gone(src, now):
            self._raise_pending_abort()
            raise PeerLostError(
                f"{self.activity} {sig.describe()}: lost rank {src} ({self.where(src)}): "
                f"{self.why_lost(src)} before it sent its data"
            )
        if now >= deadline:
            raise self.timeout_error(src, sig, {})
        if now >= self.stall_at:
            self.stalled = True
            self.stall_at = self.stall_tick(now, self.wait_began, self._group, seq, sig, src)

    # -- stall reports --------------------------------------------------------------------

    def stall_tick(self, now: float, began: float, group: int, seq: int,
                   sig: wire.Signature, src: int) -> float:
        """A wait begun at ``began`` (on ``src``, in call ``seq`` of ``group``) passed its
        stall time: the next step of its report (see :mod:`.status`). When to call again
        (never, for a group of init's own)."""
        info = self.describe_group(group)
        if info is None:
            return _INF
        name, members = info
        where = "the world" if name == "world" else name
        rest = sig.describe()[1:-1].partition(", ")[2]
        call = (f"{sig.coll.label} #{seq & 0xFFFFFFFF} of {where}"
                + (f" ({rest})" if rest else ""))
        return self.stalls.tick(now, began, group, seq, call, members, src)

    def _send_status(self, dst: int, group: int, body: bytes) -> None:
        """A status message to ``dst`` on the TCP plane (it reaches every peer), best
        effort."""
        with contextlib.suppress(Exception):
            self.planes[0].send(dst, _STATUS, _NONE, 0, 0, body, len(body), True, group)

    def send_row(self, dst: int, group: int, row: list[float]) -> None:
        """This rank's counters to ``dst`` (the summary at cleanup), best effort."""
        self._send_status(dst, group, row_body(group, row))

    def ask(self, group: int, members: Sequence[int]) -> int:
        """Ask ``members`` which call of ``group`` they are in; the query's id (the
        answers land in ``stalls.queries[id]``)."""
        return self.stalls.ask(_now(), group, 0, members)

    def _status(self, plane: Plane, hdr: wire.Header, payload: Any) -> None:
        """A peer's status query (answered at once, on the plane it came on) or its
        answer to this rank's query (kept for the report)."""
        info = parse(payload)
        if info is None:
            self.garbage += 1
            return
        if "a" in info:
            self.stalls.answer(hdr.src, info)
            return
        if "r" in info:
            self.stalls.rows[hdr.src] = info["r"]
            return
        g = info["g"]
        entered = self.calls.get(g, 0)
        busy = self.activity != "idle"
        inside = (busy and self._group == g and not self.p2p) or self.pending(g)
        doing = str(self.activity) if busy else ("async calls" if self.pending(g) else "")
        body = answer_body(info["q"], g, entered, entered - 1 if inside else entered, doing)
        with contextlib.suppress(Exception):
            plane.send(hdr.src, _STATUS, _NONE, 0, 0, body, len(body), True, g)

    def timeout_error(self, src: int, sig: wire.Signature,
                      waits: dict[int, int]) -> CollectiveTimeout:
        """The error for a wait on ``src`` that timed out, naming the rank really at fault.

        In a ring, rank A may time out waiting for B while B waits for a stopped C. So
        a rank that times out first tells everyone whom it waited for, then listens
        for TIMEOUT_GRACE to the others' reports (``waits``: rank -> rank it waited
        for), and follows the chain from ``src`` to the first rank that reported
        nothing: the one that is stuck.
        """
        group = self._group
        waits[self.rank] = src
        first = wire.timeout_error(self.activity, sig, self.timeout, src, where=self.where(src))
        self._control(group, "timeout", str(first), waiting_for=src, provisional=True)
        end = _now() + TIMEOUT_GRACE
        between = _cutoff(TIMEOUT_GRACE)
        with contextlib.suppress(_Cutoff, ProtocolError):
            while _now() < end:
                for plane in self.planes:
                    hdr = plane.next_header(min(0.005, max(0.0, end - _now())))
                    if hdr is None:
                        continue
                    payload = plane.read_payload(hdr, None, between, keep=True)
                    if (hdr.kind == wire.Kind.ABORT and self._from_peer(hdr)
                            and hdr.group == group):
                        waited = abort_waited_for(payload)
                        if waited is not None and 0 <= waited < self.world_size:
                            waits.setdefault(hdr.src, waited)
                    elif self._from_peer(hdr) and hdr.kind == _STATUS:
                        self._status(plane, hdr, payload)
                    elif self._from_peer(hdr) and hdr.kind >= wire.Kind.P2P:
                        self._stash_p2p(hdr, payload)
                    elif self._from_peer(hdr) and hdr.group != group:
                        self._for_other_group(hdr, payload)  # other groups' calls go on
        culprit, chain = src, [self.rank, src]
        while culprit in waits and waits[culprit] not in chain:
            culprit = waits[culprit]
            chain.append(culprit)
        via = " -> ".join(f"rank {r}" for r in chain)
        error = wire.timeout_error(self.activity, sig, self.timeout, culprit,
                                   where=self.where(culprit), waits=via)
        # The verdict, for the ranks that come later (the reports above were provisional).
        self._control(group, "timeout", str(error))
        error.announced = True  # type: ignore[attr-defined]
        return error

    def _raise_pending_abort(self) -> None:
        """Read what already arrived and raise the first abort in it (it explains a loss)."""
        for plane in self.planes:
            self._read_available(plane, keep_data=True)

    def service(self, planes: Sequence[Plane] | None = None) -> None:
        """Read what waits on ``planes`` (default: all) without blocking: aborts of the
        current group are raised, data is stashed, anything else dropped and counted."""
        for plane in self.planes if planes is None else planes:
            self._read_available(plane, keep_data=True)

    def service_others(self, plane: Plane) -> None:
        """:meth:`service` the planes other than ``plane`` if WAIT_SLICE passed since
        the last time: a blocking call on one plane sees a peer's abort on another soon,
        without a read on every plane before every call (a system call each)."""
        now = _now()
        if now - self.serviced < WAIT_SLICE:
            return
        self.serviced = now
        for other in self.planes:
            if other is not plane:
                self._read_available(other, keep_data=True)

    def _read_available(self, plane: Plane, *, keep_data: bool, limit: int = 10_000) -> None:
        """Read up to ``limit`` waiting messages, for at most LOST_PEER_GRACE, without
        blocking; raise on a final abort.

        Data messages are stashed for a later receive (``keep_data``) or dropped. The
        time limit is checked between messages, never inside one: a payload begun is read
        to its end (a stream left in the middle of one would parse its bytes as the next
        header), within the timeout like any read.
        """
        end = _now() + LOST_PEER_GRACE
        with contextlib.suppress(_Cutoff):
            for _ in range(limit):
                if _now() > end:
                    return
                hdr = plane.next_header(0)
                if hdr is None:
                    return
                self._keep(plane, hdr, keep_data=keep_data,
                           between=self._stash_between(hdr.src))

    def _stash_between(self, src: int, aborts: bool = True) -> Callable[[], None]:
        """The ``between`` of a payload read outside a blocking receive (a message stashed
        while flushing or reading another plane, or read by the progress engine):
        ``src`` lost for LOST_PEER_GRACE raises PeerLostError (its connection ended in the
        middle of the message: the rest will never come), after a pending abort of the
        call when ``aborts``; else the read ends at the timeout. Without the first check
        such a read waited out the whole timeout (60 s in a CI run whose link to a host
        was cut)."""
        cutoff = _cutoff(self.timeout)

        def between() -> None:
            if self.gone(src):
                if aborts:  # an abort explains the loss better (the engine reads its own)
                    self._raise_pending_abort()
                raise PeerLostError(
                    f"{self.activity}: lost rank {src} ({self.where(src)}): "
                    f"{self.why_lost(src)} in the middle of a message to this rank"
                )
            cutoff()
        return between

    def _keep(self, plane: Plane, hdr: wire.Header, *, keep_data: bool,
              between: Callable[[], None]) -> None:
        """Take a message that arrived outside a receive: raise a final abort of the
        current group, stash data (``keep_data``) or drop and count it."""
        payload = plane.read_payload(hdr, None, between, keep=True)
        if self._elsewhere(plane, hdr, payload):
            return
        if hdr.kind == wire.Kind.ABORT and not abort_is_provisional(payload):
            self._final_abort(hdr, payload, deferrable=True)
        elif keep_data and hdr.kind == wire.Kind.DATA:
            self._stash((hdr.group, hdr.src, hdr.seq, hdr.tag), hdr, payload)
        elif hdr.kind != wire.Kind.ABORT:
            self.garbage += 1

    def check_peer(self, src: int | None) -> None:
        """Raise :class:`PeerLostError` when ``src`` disconnected (waits outside recv)."""
        for plane in self.planes:
            plane.check_lost()
        if src is not None and self.gone(src):
            self._raise_pending_abort()
            raise PeerLostError(
                f"{self.activity}: lost rank {src} ({self.where(src)}): "
                f"{self.why_lost(src)} before it signalled"
            )

    def drain(self, limit: int = 10_000) -> None:
        """Read and drop what waits on every plane, whatever it is, without blocking: a
        world being left (an elastic re-formation) still learns which of its peers'
        connections closed, as every plane records that as it reads."""
        for plane in self.planes:
            with contextlib.suppress(Exception):
                plane.check_lost()
                for _ in range(limit):
                    hdr = plane.next_header(0)
                    if hdr is None:
                        break
                    plane.read_payload(hdr, None, _cutoff(LOST_PEER_GRACE), keep=False)

    def set_group(self, group: int) -> None:
        """The group whose call is running now (its aborts raise; others' are reported)."""
        self._group = group

    def close(self, linger: float) -> None:
        """Close every plane; queued sends get ``linger`` seconds."""
        for plane in self.planes:
            with contextlib.suppress(Exception):
                plane.close(linger)

