"""The transport: point-to-point messages between ranks; the only module that imports zmq.

One process group owns one :class:`Transport`. It is one *message layer* over one of
two *data planes* (``SWARMFD_DATA_PLANE``, all ranks must agree; rendezvous checks):

* ``socket`` (the default): plain TCP connections, one per pair of ranks, and a
  single-threaded progress engine (:mod:`swarmfd.lanes`). Receives land straight in
  the caller's array. Chosen because ZeroMQ's I/O thread, hand-offs and receive copy
  were the floor of the TCP path: measured on loopback at N=2, a bare exchange of
  16 MiB / 64 MiB took 9.5-10.2 ms / 35-46 ms through pyzmq PUSH/PULL and
  6.2 ms / 20.5 ms through non-blocking sockets (see the lanes docstring);
* ``zmq``: a PULL socket bound on a free port of this host (every peer sends to
  it) and one PUSH socket connected to each peer, with a socket monitor that
  reports when the peer's connection closes. Required for an encrypted data plane
  (``SWARMFD_ENCRYPT=1``: CURVE), selectable otherwise.

The message layer is the same on both: receives that block in short slices
(``WAIT_SLICE_MS``), so every wait is bounded by the group timeout and a lost peer
is noticed within a fraction of a second; a stash for early messages; signatures
checked on every message; aborts and the timeout culprit chain.

Messages are a :mod:`swarmfd.wire` header and a payload (on zmq, one or two
frames; on sockets, the header and exactly ``nbytes`` bytes on the stream). Sends
never block: on zmq the sockets queue (no high-water mark) and libzmq's I/O thread
moves the bytes while the caller reduces the previous piece; on sockets what the
kernel does not take at once is queued and every wait drives it. Large payloads
are sent zero-copy; :meth:`Transport.flush` waits until the data plane released
them (on sockets: sent every queued byte), so a collective never returns while
the caller's array is still being read.

Receives name what they wait for (source rank, sequence number, tag). A
message that arrives early (from another peer, or from a later collective of
a faster peer) is kept in a small stash until asked for. Bytes that are not a
valid swarmfd message are dropped and counted; they never reach an array.
Nothing received is ever unpickled: control payloads are JSON.

Rendezvous (:func:`rendezvous`) also lives here: rank 0 serves a ROUTER at
``MASTER_ADDR:MASTER_PORT``; every other rank sends it a JSON hello (rank,
world size, protocol version, data plane, data endpoint, host) and gets back the
table of all endpoints. No other fixed port is used; the socket plane's listening
port is closed as soon as its connections are set up.

Security (:class:`Security`, built from the job secret). Every rank derives
the same CURVE keypair from the secret (SHA-256 of it, with a domain label, is
the secret key). Every socket that binds is a server, every socket that
connects a client, and a ZAP handler (pyzmq's ``ThreadAuthenticator``) admits
only connections that prove they hold the job's key:

* rendezvous: always CURVE (authenticated and encrypted);
* data plane, ``encrypt=True``: CURVE as well;
* data plane, ``encrypt=False``: a random per-session token that each rank
  draws and announces over the encrypted rendezvous. On zmq it is the ZMQ PLAIN
  password of its data socket (ZAP admits only that token); on sockets, the key
  of the HMAC-SHA256 each side of a connection proves itself with (mutual, with
  nonces; see :mod:`swarmfd.lanes`). Strangers cannot connect, inject or abort;
  the bytes themselves travel in clear (readable by whoever can sniff the
  network; see README "Security").

A process whose secret differs fails its handshake with rank 0 and raises
:class:`AuthenticationError` at once. Without a secret (``SWARMFD_AUTH=off``)
every zmq socket uses the NULL mechanism and the socket plane's handshake carries no
HMAC: anyone who can reach a port during setup can join the mesh.

Bounds against a peer gone wrong: zmq data sockets refuse frames over
``MAX_FRAME`` (libzmq drops the connection before allocating), the socket plane
refuses any header over ``wire.MAX_PAYLOAD`` (and drops the stream), messages for
calls more than ``MAX_CALLS_AHEAD`` ahead are a protocol error, and TCP
keepalive (``KEEPALIVE_*``) finds a peer whose host vanished without a FIN.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from . import lanes, wire
from .config import DATA_PLANES
from .errors import (
    AbortedError,
    AuthenticationError,
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    abort_is_provisional,
    abort_kind,
    abort_waited_for,
    error_from_abort,
)

#: After a timeout, how long a rank listens to the others' timeout reports to find the
#: rank that is really stuck (see Transport._timeout).
TIMEOUT_GRACE = 0.6
#: How long a peer whose connection closed may still deliver what it had sent.
LOST_PEER_GRACE = 0.3
#: A blocking receive returns at least this often (ms) to check deadlines and lost peers.
WAIT_SLICE_MS = 50
#: Payloads up to this size travel inline (one frame with the header, copied).
INLINE_MAX_BYTES = 64 << 10
#: Larger payloads up to this size are copied into their own frame (one memcpy, done
#: without the GIL); still larger ones go zero-copy. Measured at N=2 over TCP (interleaved
#: A/B): a 256 KiB all_reduce took 2.9-3.4x longer inline (a 256 KiB Python bytes object
#: per copy) and 64 KiB 1.5x longer zero-copy (the tracking) than this copy; the ring's
#: 1 MiB pieces stream 1.2-1.3x faster zero-copy than copied.
COPY_MAX_BYTES = 512 << 10
#: Limit on a rendezvous message (a hello or a table), against garbage.
MAX_RENDEZVOUS_MESSAGE = 1 << 20
#: Limit on one frame of the data socket: the largest legitimate one (a header with an
#: inline payload, or a payload of MAX_PAYLOAD) plus CURVE's few bytes of overhead.
MAX_FRAME = wire.HEADER_SIZE + wire.MAX_PAYLOAD + 4096
#: A peer's message for a call this far ahead of the receiver's is a protocol error
#: (collectives end with every rank having heard from the others, so a correct peer is
#: at most a call or two ahead); bounds what the stash can hold.
MAX_CALLS_AHEAD = 16
#: TCP keepalive on every connection: probe after KEEPALIVE_IDLE s of silence, every
#: KEEPALIVE_INTVL s, give up after KEEPALIVE_CNT unanswered probes. A host that vanished
#: (no FIN) is then found within about IDLE + INTVL * CNT seconds; a stopped process still
#: answers (its kernel does), so a SIGSTOP stays a timeout, not a loss.
KEEPALIVE_IDLE = 1
KEEPALIVE_INTVL = 1
KEEPALIVE_CNT = 3
#: After this many failed handshakes with rank 0 (another secret), rendezvous gives up.
MAX_HANDSHAKE_FAILURES = 2
#: ZAP domains of the two planes.
ZAP_RENDEZVOUS = "swarmfd-rendezvous"
ZAP_DATA = "swarmfd-data"
_PLAIN_USER = "swarmfd"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: pyzmq's authenticator logs credentials at DEBUG; its logger here never does.
_ZAP_LOG = logging.getLogger("swarmfd.zap")
_ZAP_LOG.setLevel(logging.WARNING)


@dataclass(frozen=True)
class Security:
    """The job's CURVE keypair (derived from the job secret) and the data-plane mode.

    Built with :meth:`from_secret`; the secret itself is not kept. ``repr`` shows
    neither key.
    """

    public: bytes = field(repr=False)
    secret: bytes = field(repr=False)
    encrypt: bool = False

    @classmethod
    def from_secret(cls, job_secret: bytes, encrypt: bool) -> Security:
        """Derive the keypair: every rank with the same secret gets the same one."""
        seed = hashlib.sha256(b"swarmfd CURVE key v1\0" + job_secret).digest()
        secret = z85.encode(seed)
        return cls(zmq.curve_public(secret), secret, encrypt)

    def curve_server(self, sock: zmq.Socket, domain: str) -> None:
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)

    def curve_client(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


class _JobKey:
    """ZAP credentials check: admit only the job's public key; count the others."""

    def __init__(self, public: bytes) -> None:
        self.public = public
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.public)
        if not ok:
            self.denied += 1
        return ok


def _keepalive(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)


@dataclass(frozen=True)
class PeerInfo:
    """What rendezvous tells every rank about one peer."""

    rank: int
    #: The address of its data plane: its PULL socket (zmq) or listening socket (socket).
    endpoint: str
    host: str
    pid: int
    hostkey: str = ""
    #: The per-session token of this rank's data plane: the PLAIN password of its data
    #: socket (zmq) or the HMAC key of its handshakes (socket); unencrypted plane only.
    token: str = field(default="", repr=False)
    #: Its data plane (DATA_PLANES); every rank of a job must use the same.
    plane: str = "zmq"


def _now() -> float:
    return time.monotonic()


class _Cutoff(Exception):
    """A bounded wait inside the transport ran out (never leaves the transport)."""


def _cutoff(seconds: float) -> Callable[[], None]:
    """A ``between`` callback that ends a payload read after ``seconds``."""
    end = _now() + seconds

    def between() -> None:
        if _now() > end:
            raise _Cutoff
    return between


class _ZmqPlane:
    """The ZeroMQ data plane: a PULL socket every peer sends to, a PUSH socket (with a
    loss monitor) to each peer. Implements the channel interface the transport uses
    (the same as :class:`swarmfd.lanes.Lanes`)."""

    def __init__(self, t: Transport, bind_host: str) -> None:
        self.t = t
        self.pull = t.ctx.socket(zmq.PULL)
        sec = t.security
        if sec is not None and t.auth is not None:
            if sec.encrypt:
                sec.curve_server(self.pull, ZAP_DATA)
            else:
                self.pull.setsockopt(zmq.ZAP_DOMAIN, ZAP_DATA.encode())
                self.pull.setsockopt(zmq.PLAIN_SERVER, 1)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self.pull.setsockopt(zmq.RCVTIMEO, WAIT_SLICE_MS)
        _keepalive(self.pull)
        port = self.pull.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self.push: dict[int, zmq.Socket] = {}
        self.monitors: dict[zmq.Socket, int] = {}
        self.trackers: list[tuple[int, zmq.MessageTracker]] = []
        self.raw: bytes = b""  # the frame whose header next_header returned

    def connect(self, peers: Sequence[PeerInfo], deadline: float) -> None:
        """Open a PUSH connection (with a loss monitor) to every other rank."""
        t = self.t
        for peer in peers:
            if peer.rank == t.rank:
                continue
            sock = t.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, int(min(t.timeout, 5.0) * 1000))
            _keepalive(sock)
            t.client(sock, peer)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
            sock.connect(peer.endpoint)
            self.push[peer.rank] = sock
            self.monitors[mon] = peer.rank

    def close(self, linger: float) -> None:
        """Close every socket; pending sends get ``linger`` seconds."""
        # Read the monitors empty, then stop them before closing their sockets: the other
        # order, or a full monitor pipe, can block in disable_monitor (libzmq#3575).
        self.check_lost()
        for sock in self.push.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        for mon in self.monitors:
            mon.close(linger=0)
        for sock in self.push.values():
            sock.close(linger=int(linger * 1000))
        self.pull.close(linger=0)

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int,
             payload: Any, size: int, copy: bool) -> None:
        sock = self.push[dst]
        rank = self.t.rank
        if size <= INLINE_MAX_BYTES:
            # One frame: header and payload together (one send, one receive).
            body = payload if isinstance(payload, bytes) else memoryview(payload).tobytes()
            sock.send(wire.pack_header(kind, sig, rank, seq, tag, size, wire.FLAG_INLINE)
                      + body)
            return
        sock.send(wire.pack_header(kind, sig, rank, seq, tag, size), zmq.SNDMORE)
        if copy or size <= COPY_MAX_BYTES:
            sock.send(payload, copy=True)
            return
        tracker = sock.send(payload, copy=False, track=True)
        self.trackers.append((dst, tracker))

    def send_all(self, kind: int, sig: wire.Signature, body: bytes) -> None:
        """Best effort: ``body`` as one inline frame to every peer (aborts, reports)."""
        header = wire.pack_header(kind, sig, self.t.rank, 0, 0, len(body), wire.FLAG_INLINE)
        for sock in self.push.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.send(header + body, zmq.NOBLOCK)

    def unsent(self) -> list[int]:
        self.trackers = [(dst, tr) for dst, tr in self.trackers if not tr.done]
        return [dst for dst, _ in self.trackers]

    def wait(self, timeout: float) -> wire.Header | None:
        if self.trackers:
            with contextlib.suppress(zmq.NotDone):
                self.trackers[0][1].wait(timeout)
        return None

    def next_header(self, timeout: float) -> wire.Header | None:
        """The next valid header (its payload then read with read_payload) or None after
        ``timeout`` s. Garbage is dropped and counted."""
        pull = self.pull
        for _ in range(1000):
            try:
                if timeout == WAIT_SLICE_MS / 1000:
                    raw = pull.recv()  # blocks at most WAIT_SLICE (RCVTIMEO), GIL released
                else:
                    if timeout > 0 and not pull.poll(int(timeout * 1000)):
                        return None
                    raw = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            timeout = 0
            try:
                hdr = wire.unpack_header(raw)
            except ProtocolError:
                self.t.garbage += 1
                self._drain()
                continue
            if hdr.inline and pull.get(zmq.RCVMORE):
                self.t.garbage += 1  # an inline message has one frame: this is not ours
                self._drain()
                continue
            self.raw = raw
            return hdr
        return None

    def read_payload(self, hdr: wire.Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        """The payload of the header next_header returned: into ``into`` (None returned)
        or as a buffer (``bytes`` when the caller ``keep``s it, e.g. in the stash: a zmq
        Frame must not outlive the receive that returned it)."""
        pull, raw = self.pull, self.raw
        self.raw = b""
        if hdr.inline:
            inline = memoryview(raw)[wire.HEADER_SIZE:]
            if into is None:
                return bytes(inline) if keep else inline
            memoryview(into).cast("B")[:] = inline
            return None
        if not pull.get(zmq.RCVMORE):
            if into is None:
                return b""  # not awaited: an empty abort, or garbage counted by the caller
            raise ProtocolError(f"{self.t.activity}: rank {hdr.src} sent a header without "
                                "payload")
        if into is not None:
            got = pull.recv_into(into)
            self._drain()
            if got != hdr.nbytes:
                raise ProtocolError(f"{self.t.activity}: rank {hdr.src} sent {got} bytes, "
                                    f"expected {hdr.nbytes}")
            return None
        data = pull.recv(copy=False) if hdr.nbytes > INLINE_MAX_BYTES and not keep else (
            pull.recv())
        self._drain()
        return data

    def _drain(self) -> None:
        while self.pull.get(zmq.RCVMORE):
            self.pull.recv()

    def check_lost(self) -> None:
        for mon, peer in self.monitors.items():
            while True:
                try:
                    msg = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = parse_monitor_message(msg)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.t.lost.setdefault(peer, _now())
                elif event["event"] & _HANDSHAKE_FAILED:
                    # A peer that refuses this rank's credentials: no data will ever flow.
                    self.t.lost.setdefault(peer, _now())
                    self.t.refused.add(peer)


class _SocketPlane(lanes.Lanes):
    """The socket data plane (:mod:`swarmfd.lanes`) with the channel interface."""

    def check_lost(self) -> None:
        """Losses are recorded as the engine reads (EOF, reset): nothing to poll."""


class Transport:
    """Point-to-point messaging between the ranks of one group (see module docstring).

    The message layer (stash, signatures, aborts, timeouts, lost peers) is this
    class; the bytes move through its channel ``ch``: the socket data plane
    (:mod:`swarmfd.lanes`) or the ZeroMQ one (:class:`_ZmqPlane`).
    """

    def __init__(self, rank: int, world_size: int, timeout: float, bind_host: str,
                 security: Security | None = None, plane: str = "zmq",
                 join_timeout: float | None = None) -> None:
        if plane not in DATA_PLANES:
            raise ValueError(f"unknown data plane {plane!r}: expected one of {DATA_PLANES}")
        if plane == "socket" and security is not None and security.encrypt:
            raise ValueError("the socket data plane does not encrypt: use the zmq one")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        #: What the rendezvous deadline was made of (init_timeout), for its messages.
        self.join_timeout = timeout if join_timeout is None else join_timeout
        self.security = security
        self.plane = plane
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.auth: ThreadAuthenticator | None = None
        self.job_key: _JobKey | None = None
        #: The per-session token of this rank's data plane (unencrypted data plane).
        self.token = ""
        self.stash: dict[tuple[int, int, int], tuple[wire.Header, Any]] = {}
        self.lost: dict[int, float] = {}
        self.refused: set[int] = set()  # peers whose data socket refused our handshake
        self.garbage = 0
        self.ch: _ZmqPlane | _SocketPlane
        try:
            if security is not None:
                self._start_auth(security)
            if plane == "zmq":
                self.ch = _ZmqPlane(self, bind_host)
            else:
                self.ch = _SocketPlane(self, rank, world_size, bind_host, self.token,
                                       (KEEPALIVE_IDLE, KEEPALIVE_INTVL, KEEPALIVE_CNT),
                                       WAIT_SLICE_MS / 1000)
        except BaseException:
            self._stop_auth()
            self.ctx.destroy(linger=0)
            raise
        self.endpoint = self.ch.endpoint
        self.peers: list[PeerInfo] = []
        self.waiting_for = -1
        self.data_via_shm = False  # set once the group moves its data to shared memory
        self.closed = False
        # What the caller is doing, for error messages.
        self.activity = "rendezvous"

    # -- setup --------------------------------------------------------------------------

    def _start_auth(self, security: Security) -> None:
        """Start the ZAP handler (rendezvous always; the zmq data socket too)."""
        self.auth = ThreadAuthenticator(self.ctx, log=_ZAP_LOG)
        self.auth.start()
        self.job_key = _JobKey(security.public)
        self.auth.configure_curve_callback(ZAP_RENDEZVOUS, self.job_key)
        if security.encrypt:
            self.auth.configure_curve_callback(ZAP_DATA, self.job_key)
        else:
            self.token = secrets.token_hex(16)
            self.auth.configure_plain(ZAP_DATA, {_PLAIN_USER: self.token})

    def _stop_auth(self) -> None:
        if self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
            self.auth = None

    def client(self, sock: zmq.Socket, peer: PeerInfo | None = None) -> None:
        """Make ``sock`` a client of the rendezvous (``peer`` None) or of ``peer``'s data socket."""
        sec = self.security
        if sec is None:
            return
        if peer is None or sec.encrypt:
            sec.curve_client(sock)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, _PLAIN_USER.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, peer.token.encode())

    def connect(self, peers: Sequence[PeerInfo], deadline: float | None = None) -> None:
        """Connect the data plane to every other rank (by ``deadline``)."""
        self.peers = list(peers)
        self.ch.connect(self.peers, _now() + self.timeout if deadline is None else deadline)
        if self.plane == "socket":
            # Rendezvous is over: its ZAP handler has nothing left to check.
            self._stop_auth()

    def close(self, linger: int | None = None) -> None:
        """Close every socket; pending sends get a short linger (or ``linger`` ms). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.ch.close(min(self.timeout, 5.0) if linger is None else linger / 1000)
        self._stop_auth()
        # Every socket is closed by now (with its linger). destroy(), not term(): a socket
        # left open by a bug would make term() wait forever; this closes it unlingered.
        self.ctx.destroy(linger=0)

    # -- sending ------------------------------------------------------------------------

    def send(
        self,
        dst: int,
        sig: wire.Signature,
        seq: int,
        tag: int,
        payload: Any = b"",
        *,
        nbytes: int | None = None,
        kind: int = wire.Kind.DATA,
        copy: bool = False,
    ) -> None:
        """Queue one message to ``dst``; never blocks.

        Large payloads are sent without a copy (:meth:`flush` waits until they
        left before the collective returns), unless ``copy``: then the caller
        may overwrite its buffer as soon as this returns.
        """
        if nbytes is not None:
            size = nbytes
        elif isinstance(payload, bytes):
            size = len(payload)
        else:
            size = memoryview(payload).nbytes
        if size > wire.MAX_PAYLOAD:
            raise ValueError(f"swarmfd bug: a message of {size} bytes exceeds the limit of "
                             f"{wire.MAX_PAYLOAD}; collectives must cut buffers into pieces")
        self.ch.send(dst, kind, sig, seq, tag, payload, size, copy)

    def flush(self) -> None:
        """Wait until the data plane no longer reads any buffer handed to :meth:`send`.

        Messages that arrive meanwhile are stashed (a peer may be flushing towards
        this rank at the same time).
        """
        pending = self.ch.unsent()
        if not pending:
            return
        deadline = _now() + self.timeout
        while pending:
            dst = pending[0]
            if _now() > deadline:
                raise CollectiveTimeout(
                    f"{self.activity}: sending to rank {dst} did not complete within "
                    f"{self.timeout:g} s"
                )
            self.ch.check_lost()
            if dst in self.lost and _now() - self.lost[dst] > LOST_PEER_GRACE:
                self._raise_pending_abort()
                raise PeerLostError(
                    f"{self.activity}: rank {dst} disconnected before receiving this rank's data"
                    f" ({self._where(dst)}): {self._why_lost(dst)}"
                )
            hdr = self.ch.wait(0.01)
            if hdr is not None:
                self._keep(hdr, keep_data=True, between=_cutoff(self.timeout))
            pending = self.ch.unsent()

    def abort(self, error: BaseException) -> None:
        """Tell every peer that this rank failed, so they fail fast too (best effort)."""
        if isinstance(error, AbortedError):
            return  # the originator already told everyone
        if getattr(error, "announced", False):
            return  # a timeout: announced to everyone while its culprit was found
        self._send_control(json.dumps({"kind": abort_kind(error), "rank": self.rank,
                                       "message": str(error)[:wire.MAX_ABORT_TEXT]}))

    def _send_control(self, text: str) -> None:
        """Send an abort message (JSON ``text``) to every peer, best effort."""
        self.ch.send_all(wire.Kind.ABORT, wire.Signature(wire.Collective.NONE), text.encode())

    # -- receiving ----------------------------------------------------------------------

    def recv(
        self,
        src: int,
        sig: wire.Signature,
        seq: int,
        tag: int,
        nbytes: int,
        into: Any = None,
    ) -> Any:
        """Receive the message (src, seq, tag) of ``nbytes`` bytes.

        With ``into`` (a writable buffer of ``nbytes``) the payload lands there
        and ``None`` is returned; otherwise a buffer (``bytes``, ``bytearray`` or a
        zmq Frame) is returned. Raises :class:`CollectiveTimeout` after the group
        timeout, :class:`PeerLostError` when ``src`` disconnects,
        :class:`MismatchError` when a peer's signature differs,
        :class:`AbortedError` when a peer failed.
        """
        key = (src, seq & 0xFFFFFFFF, tag)
        stashed = self.stash.pop(key, None)
        if stashed is not None:
            payload = stashed[1]
            if not stashed[0].matches(sig):
                raise self._mismatch(stashed[0], sig)
            self._check_size(stashed[0], nbytes)
            if into is None:
                return payload
            memoryview(into).cast("B")[:] = payload
            return None
        deadline = _now() + self.timeout
        ch = self.ch
        self.waiting_for = src
        last_check = _now()

        def between() -> None:
            self._between_slices(src, deadline, sig)

        while True:
            hdr = ch.next_header(WAIT_SLICE_MS / 1000)
            if hdr is None:
                between()
                continue
            if (hdr.src, hdr.seq, hdr.tag) == key and hdr.kind == wire.Kind.DATA:
                if not hdr.matches(sig):
                    raise self._mismatch(hdr, sig)
                self._check_size(hdr, nbytes)
                if into is None and nbytes and self.plane == "socket":
                    # An uninitialised array to receive into: bytearray(n) would zero it
                    # first (interleaved A/B, N=2: 0.95-0.98x the time at 64 KiB-16 MiB).
                    into = np.empty(nbytes, np.uint8)
                    ch.read_payload(hdr, into, between)
                    return into
                return ch.read_payload(hdr, into, between)
            self._other(hdr, sig, seq, between)
            # Messages keep coming but not the one awaited (a flood of garbage, say): the
            # deadline and the peer's liveness still count. Checked after the message was
            # handled: arriving at the deadline, it may be the report that explains the wait.
            if _now() - last_check > WAIT_SLICE_MS / 1000:
                between()
                last_check = _now()

    def _other(self, hdr: wire.Header, sig: wire.Signature, seq: int,
               between: Callable[[], None]) -> None:
        """Handle a message that is not the one being waited for."""
        payload = self.ch.read_payload(hdr, None, between, keep=True)
        if not self._from_peer(hdr):
            self.garbage += 1
            return
        if hdr.kind == wire.Kind.ABORT:
            waited = abort_waited_for(payload)
            if abort_is_provisional(payload) and waited is not None and self.waiting_for >= 0:
                # A peer timed out: find out, with everyone, who is really stuck.
                raise self._timeout(self.waiting_for, sig, {hdr.src: waited})
            raise self._aborted(hdr, payload)
        if hdr.kind != wire.Kind.DATA:
            self.garbage += 1
            return
        behind = (seq - hdr.seq) & 0xFFFFFFFF
        ahead = (hdr.seq - seq) & 0xFFFFFFFF
        if behind == 0 and not hdr.matches(sig):
            raise self._mismatch(hdr, sig)
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
        # Early message (another peer, or a later collective of a faster peer): keep it.
        self.stash[(hdr.src, hdr.seq, hdr.tag)] = (hdr, payload)

    def _from_peer(self, hdr: wire.Header) -> bool:
        """True when ``hdr`` claims a source that is another rank of this group."""
        return 0 <= hdr.src < self.world_size and hdr.src != self.rank

    def _check_size(self, hdr: wire.Header, nbytes: int) -> None:
        if hdr.nbytes != nbytes:
            raise ProtocolError(
                f"{self.activity}: rank {hdr.src} announced {hdr.nbytes} bytes for message "
                f"{hdr.tag}, expected {nbytes}"
            )

    def _between_slices(self, src: int, deadline: float, sig: wire.Signature) -> None:
        """After a wait slice without data: check the deadline and whether ``src`` is gone."""
        self.ch.check_lost()
        now = _now()
        if src in self.lost and now - self.lost[src] > LOST_PEER_GRACE:
            self._raise_pending_abort()
            raise PeerLostError(
                f"{self.activity} {sig.describe()}: lost rank {src} ({self._where(src)}): "
                f"{self._why_lost(src)} before it sent its data"
            )
        if now >= deadline:
            raise self._timeout(src, sig, {})

    def _timeout(self, src: int, sig: wire.Signature, waits: dict[int, int]) -> CollectiveTimeout:
        """The error for a wait on ``src`` that timed out, naming the rank really at fault.

        In a ring, rank A may time out waiting for B while B waits for a stopped C. So
        a rank that times out first tells everyone whom it waited for, then listens
        for TIMEOUT_GRACE to the others' reports (``waits``: rank -> rank it waited
        for), and follows the chain from ``src`` to the first rank that reported
        nothing: the one that is stuck.
        """
        waits[self.rank] = src
        self._send_control(json.dumps({
            "kind": "timeout", "rank": self.rank, "waiting_for": src,
            "message": f"rank {self.rank} timed out waiting for rank {src}",
            "provisional": True}))
        end = _now() + TIMEOUT_GRACE
        between = _cutoff(TIMEOUT_GRACE)
        with contextlib.suppress(_Cutoff, ProtocolError):
            while _now() < end:
                hdr = self.ch.next_header(min(0.005, max(0.0, end - _now())))
                if hdr is None:
                    continue
                payload = self.ch.read_payload(hdr, None, between)
                if hdr.kind == wire.Kind.ABORT and self._from_peer(hdr):
                    waited = abort_waited_for(payload)
                    if waited is not None and 0 <= waited < self.world_size:
                        waits.setdefault(hdr.src, waited)
        culprit, chain = src, [self.rank, src]
        while culprit in waits and waits[culprit] not in chain:
            culprit = waits[culprit]
            chain.append(culprit)
        via = " -> ".join(f"rank {r}" for r in chain)
        error = wire.timeout_error(self.activity, sig, self.timeout, culprit,
                                   where=self._where(culprit), waits=via)
        error.announced = True  # type: ignore[attr-defined]
        return error

    def _raise_pending_abort(self) -> None:
        """Read what already arrived and raise the first abort in it (it explains a loss)."""
        self._read_available(keep_data=True)

    def drain_unused(self) -> None:
        """Empty the data plane of a group whose data goes through shared memory.

        Nothing legitimate arrives there but aborts (raised here); anything else a
        stranger sends is dropped and counted, so it cannot pile up in memory.
        """
        self._read_available(keep_data=False)

    def _read_available(self, *, keep_data: bool, limit: int = 10_000) -> None:
        """Read up to ``limit`` waiting messages without blocking; raise on a final abort.

        Data messages are stashed for a later receive (``keep_data``) or dropped.
        """
        between = _cutoff(LOST_PEER_GRACE)
        with contextlib.suppress(_Cutoff):
            for _ in range(limit):
                hdr = self.ch.next_header(0)
                if hdr is None:
                    return
                self._keep(hdr, keep_data=keep_data, between=between)

    def _keep(self, hdr: wire.Header, *, keep_data: bool, between: Callable[[], None]) -> None:
        """Take a message that arrived outside a receive: raise a final abort, stash data
        (``keep_data``) or drop and count it."""
        payload = self.ch.read_payload(hdr, None, between, keep=True)
        if not self._from_peer(hdr):
            self.garbage += 1
            return
        if hdr.kind == wire.Kind.ABORT and not abort_is_provisional(payload):
            raise self._aborted(hdr, payload)
        if keep_data and hdr.kind == wire.Kind.DATA:
            self.stash[(hdr.src, hdr.seq, hdr.tag)] = (hdr, payload)
        else:
            self.garbage += 1

    def check_peer(self, src: int | None) -> None:
        """Raise :class:`PeerLostError` when ``src`` disconnected (for waits outside TCP)."""
        if self.data_via_shm:
            self.drain_unused()
        self.ch.check_lost()
        if src is not None and src in self.lost and _now() - self.lost[src] > LOST_PEER_GRACE:
            self._raise_pending_abort()
            raise PeerLostError(
                f"{self.activity}: lost rank {src} ({self._where(src)}): "
                f"{self._why_lost(src)} before it signalled"
            )

    def _why_lost(self, rank: int) -> str:
        if rank in self.refused:
            return ("its data socket refused this rank's authentication handshake (does it "
                    "run with another job secret or SWARMFD_AUTH setting?)")
        return ("its connection closed (the process died or exited, or its host stopped "
                "answering TCP keepalive probes)")

    def _where(self, rank: int) -> str:
        if 0 <= rank < len(self.peers):
            p = self.peers[rank]
            return f"host {p.host}, pid {p.pid}, {p.endpoint}"
        return "unknown address"

    def _mismatch(self, hdr: wire.Header, sig: wire.Signature) -> MismatchError:
        return wire.mismatch_error(self.rank, sig, hdr)

    def _aborted(self, hdr: wire.Header, payload: bytes) -> CollectiveError:
        return error_from_abort(self.activity, hdr.src, payload)


# -- addresses and rendezvous -----------------------------------------------------------


def resolve(host: str, deadline: float) -> str:
    """Resolve ``host`` to an IPv4 address, retrying until ``deadline`` (DNS may lag)."""
    last: Exception | None = None
    while True:
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
            return str(infos[0][4][0])
        except OSError as exc:
            last = exc
        if _now() > deadline:
            raise RendezvousTimeout(f"MASTER_ADDR {host!r} does not resolve: {last}")
        time.sleep(0.1)


def local_address_toward(ip: str) -> str:
    """The address of this host's interface that routes to ``ip`` (no packet is sent)."""
    if ip.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        return str(probe.getsockname()[0])
    finally:
        probe.close()


def rendezvous(
    transport: Transport,
    master_ip: str,
    master_port: int,
    deadline: float,
    host: str,
    hostkey: str = "",
) -> tuple[list[PeerInfo], str]:
    """Exchange data endpoints through rank 0.

    Returns the peer table in rank order and the job token rank 0 drew (random,
    names this group's local resources such as shared-memory files).
    """
    me = PeerInfo(transport.rank, transport.endpoint, host, os.getpid(), hostkey,
                  transport.token, transport.plane)
    if transport.rank == 0:
        return _serve_rendezvous(transport, me, master_ip, master_port, deadline)
    return _join_rendezvous(transport, me, master_ip, master_port, deadline)


def _hello(me: PeerInfo, world_size: int) -> bytes:
    return json.dumps({
        "swarmfd": wire.PROTOCOL_VERSION, "rank": me.rank, "world_size": world_size,
        "endpoint": me.endpoint, "host": me.host, "pid": me.pid, "hostkey": me.hostkey,
        "token": me.token, "plane": me.plane,
    }).encode()


def _int(value: Any) -> int:
    """A JSON integer, strictly (no bool, no float): TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _peer(d: dict[str, Any]) -> PeerInfo:
    return PeerInfo(_int(d["rank"]), str(d["endpoint"]), str(d["host"]), _int(d["pid"]),
                    str(d.get("hostkey", "")), str(d.get("token", "")),
                    str(d.get("plane", "zmq")))


def _serve_rendezvous(
    t: Transport, me: PeerInfo, master_ip: str, port: int, deadline: float
) -> tuple[list[PeerInfo], str]:
    router = t.ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_MESSAGE)
    router.setsockopt(zmq.LINGER, 2000)
    _keepalive(router)
    if t.security is not None:
        t.security.curve_server(router, ZAP_RENDEZVOUS)
    refused = 0
    bind_ip = master_ip if master_ip.startswith("127.") else "*"
    try:
        router.bind(f"tcp://{bind_ip}:{port}")
    except zmq.ZMQError as exc:
        router.close(linger=0)
        raise RendezvousError(
            f"rank 0 cannot serve rendezvous on MASTER_PORT {port} ({exc}); is another job "
            "using it? choose a free MASTER_PORT"
        ) from None
    # The monitor only once the bind worked: on a failed bind nothing would close it (and
    # before close() destroyed the context, term() waited for it forever).
    monitor = router.get_monitor_socket(_HANDSHAKE_FAILED)
    joined: dict[int, tuple[bytes, PeerInfo]] = {}
    try:
        while len(joined) < t.world_size - 1:
            remaining = deadline - _now()
            if remaining <= 0:
                missing = sorted(set(range(1, t.world_size)) - set(joined))
                hint = (f"; {refused} connection(s) failed the authentication handshake "
                        "(processes with another job secret or SWARMFD_AUTH setting?)"
                        if refused else "")
                raise RendezvousTimeout(
                    f"rendezvous timed out after {t.join_timeout:g} s: rank 0 waited for "
                    f"rank(s) {missing} of {t.world_size} to join at port {port}{hint} (give "
                    "slow starters longer with SWARMFD_INIT_TIMEOUT or init_timeout=)"
                )
            while monitor.poll(0):
                monitor.recv_multipart()
                refused += 1
            if not router.poll(int(min(remaining, 0.25) * 1000) + 1):
                continue
            frames = router.recv_multipart()
            if len(frames) != 2:
                continue
            ident, body = frames
            try:
                hello = json.loads(body.decode("utf-8"))
                peer = _peer(hello)
                version, world = _int(hello["swarmfd"]), _int(hello["world_size"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError,
                    OverflowError):
                continue  # not a swarmfd hello: ignore
            error = None
            if version != wire.PROTOCOL_VERSION:
                error = (f"protocol version mismatch: rank {peer.rank} speaks swarmfd protocol "
                         f"{version}, rank 0 speaks {wire.PROTOCOL_VERSION}")
            elif world != t.world_size:
                error = (f"world size mismatch: rank {peer.rank} has WORLD_SIZE={world}, rank 0 "
                         f"has WORLD_SIZE={t.world_size}")
            elif peer.plane != me.plane:
                error = (f"data plane mismatch: rank {peer.rank} uses SWARMFD_DATA_PLANE="
                         f"{peer.plane[:20]!r}, rank 0 uses SWARMFD_DATA_PLANE={me.plane!r} (the "
                         "default is 'socket', 'zmq' with SWARMFD_ENCRYPT=1); every rank must "
                         "use the same data plane")
            elif not 1 <= peer.rank < t.world_size:
                error = f"rank {peer.rank} is out of range 1..{t.world_size - 1}"
            elif peer.rank in joined:
                error = (f"duplicate rank {peer.rank}: host {peer.host} pid {peer.pid} and host "
                         f"{joined[peer.rank][1].host} pid {joined[peer.rank][1].pid}")
            if error is not None:
                router.send_multipart([ident, json.dumps({"error": error}).encode()])
                if version != wire.PROTOCOL_VERSION:
                    continue  # a stranger of another version does not break this job
                for other_ident, _ in joined.values():
                    router.send_multipart([other_ident, json.dumps({"error": error}).encode()])
                raise RendezvousError(error)
            joined[peer.rank] = (ident, peer)
        table = [me] + [joined[r][1] for r in range(1, t.world_size)]
        token = secrets.token_hex(8)
        reply = json.dumps({"peers": [p.__dict__ for p in table], "token": token}).encode()
        for ident, _ in joined.values():
            router.send_multipart([ident, reply])
        return table, token
    finally:
        _close_monitored(router, monitor)


def _join_rendezvous(
    t: Transport, me: PeerInfo, master_ip: str, port: int, deadline: float
) -> tuple[list[PeerInfo], str]:
    dealer = t.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_MESSAGE)
    dealer.setsockopt(zmq.LINGER, 0)
    _keepalive(dealer)
    t.client(dealer)
    monitor = dealer.get_monitor_socket(_HANDSHAKE_FAILED)
    dealer.connect(f"tcp://{master_ip}:{port}")
    failures = 0
    try:
        dealer.send(_hello(me, t.world_size))
        while True:
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())
                failures += 1 if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL else (
                    MAX_HANDSHAKE_FAILURES)
            if failures >= MAX_HANDSHAKE_FAILURES:
                raise AuthenticationError(_refused_by_rank0(t, me.rank, master_ip, port))
            remaining = deadline - _now()
            if remaining <= 0:
                raise RendezvousTimeout(
                    f"rendezvous timed out after {t.join_timeout:g} s: rank {me.rank} got no "
                    f"answer from rank 0 at {master_ip}:{port} (MASTER_ADDR/MASTER_PORT); is "
                    "rank 0 running? (give slow starters longer with SWARMFD_INIT_TIMEOUT or "
                    "init_timeout=)"
                )
            if not dealer.poll(int(min(remaining, 0.1) * 1000) + 1):
                continue
            body = dealer.recv()
            try:
                reply = json.loads(body.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                continue
            if "error" in reply:
                raise RendezvousError(f"rank 0 refused rank {me.rank}: {reply['error']}")
            try:
                peers = [_peer(p) for p in reply["peers"]]
                token = str(reply["token"])
            except (KeyError, TypeError, ValueError):
                raise ProtocolError("rank 0 sent a malformed peer table") from None
            if [p.rank for p in peers] != list(range(t.world_size)):
                raise ProtocolError("rank 0 sent a peer table with wrong ranks")
            if not token.isalnum():
                raise ProtocolError("rank 0 sent a malformed job token")
            return peers, token
    finally:
        _close_monitored(dealer, monitor)


def _refused_by_rank0(t: Transport, rank: int, master_ip: str, port: int) -> str:
    if t.security is None:
        mine = "runs without authentication (SWARMFD_AUTH=off)"
    else:
        mine = "holds a job secret"
    return (
        f"rank {rank} cannot join: the authentication handshake with rank 0 at "
        f"{master_ip}:{port} failed. This process {mine}; rank 0 runs with another job secret"
        f"{' or with authentication' if t.security is None else ' or without authentication'}"
        ". Every rank of a job must read the same secret (SWARMFD_SECRET_FILE, default "
        "/run/secrets/swarmfd_secret) and the same SWARMFD_AUTH setting"
    )


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop a socket's monitor, then close both (see Transport.close on the order)."""
    while monitor.poll(0):
        monitor.recv_multipart()
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close()
