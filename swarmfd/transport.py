"""The transport: point-to-point messages between ranks; the only module that imports zmq.

One process group owns one :class:`Transport`. It is one *message layer* over one of
two *data planes* (``SWARMFD_DATA_PLANE``, all ranks must agree; rendezvous checks):

* ``socket`` (the default): plain TCP connections, one per pair of ranks, and a
  single-threaded progress engine (:mod:`swarmfd.lanes`). Receives land straight in
  the caller's array. Chosen because ZeroMQ's I/O thread, hand-offs and receive copy
  were the floor of the TCP path: measured on loopback at N=2, a bare exchange of
  16 MiB / 64 MiB took 9.5-10.2 ms / 35-46 ms through pyzmq PUSH/PULL and
  6.2 ms / 20.5 ms through non-blocking sockets (see the lanes docstring);
* ``zmq``: a ROUTER socket bound on a free port of this host that only *sends* (to
  each peer by its routing id) and one DEALER socket connected to each peer's ROUTER
  that only *receives*, so a message's source is the socket it arrived on, never a
  header's claim; socket monitors report when a peer's connection closes. Required
  for an encrypted data plane (``SWARMFD_ENCRYPT=1``: CURVE), selectable otherwise.

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
  draws and announces over the encrypted rendezvous. On sockets it keys the
  HMAC-SHA256 each side of a connection proves itself with (challenge-response, with
  fresh nonces; see :mod:`swarmfd.lanes`). On zmq each peer's connection carries a
  one-time ZMQ PLAIN password derived from it (:func:`_connection_token`), which
  ZAP admits once: a reader of the network who replays it is refused, and once
  every peer is in, the bound socket admits nothing more. Strangers cannot connect,
  inject or abort; the bytes themselves travel in clear (readable by whoever can
  sniff the network; see README "Security").

Sockets strangers can reach (MASTER_PORT during init; the zmq data socket for the
whole job, since libzmq's unbind would drop its connections) refuse frames larger
than a handshake needs and drop connections that have not authenticated within
HANDSHAKE_IVL_MS, so a stranger pins little memory, briefly; init raises the soft
descriptor limit to the hard one (:func:`raise_descriptor_limit`).

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

import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
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
#: Limit on a rendezvous message rank 0 receives (a hello: JSON of a few hundred bytes)
#: and on every frame of the handshakes on rank 0's MASTER_PORT, which strangers can
#: reach: libzmq allocates a frame before it can tell it is junk, so a stranger pins at
#: most this much per connection (measured: 300 connections sending junk frames of this
#: size, see tests/test_front_door.py).
MAX_HELLO_MESSAGE = 4096
#: Limit on the peer table a joining rank receives from rank 0 (about 300 bytes a rank).
MAX_RENDEZVOUS_MESSAGE = 1 << 20
#: Limit on every frame the zmq data plane's bound socket receives. It only sends, so
#: what arrives is handshakes (a PLAIN hello is under 600 bytes, CURVE's under 400).
MAX_HANDSHAKE_FRAME = 4096
#: A connection to a bound socket (MASTER_PORT, the zmq data socket) that has not
#: authenticated within this many ms is dropped (libzmq's default is 30 s). A legitimate
#: handshake takes a few ms (a CURVE one under 5 ms here, on a loaded machine).
HANDSHAKE_IVL_MS = 2000
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
#: After this many handshakes with rank 0 that it refused (another secret), rendezvous
#: gives up. Only refusals count: an explicit one (ZAP's), a cryptographic failure, or a
#: connection rank 0 dropped within QUICK_REFUSAL s of its start (CURVE with another key:
#: rank 0 cannot open this rank's hello). A handshake dropped later (rank 0 busy, or
#: flooded by strangers, evicts it after HANDSHAKE_IVL_MS) is retried until the deadline.
MAX_HANDSHAKE_FAILURES = 2
QUICK_REFUSAL = 0.5
#: Slice of the rendezvous waits: how often they look after the data plane's listener.
RENDEZVOUS_SLICE = 0.05
#: ZAP domains of the two planes.
ZAP_RENDEZVOUS = "swarmfd-rendezvous"
ZAP_DATA = "swarmfd-data"
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


def _stranger_facing(sock: zmq.Socket, max_frame: int) -> None:
    """Bound a socket a stranger can reach: frames over ``max_frame`` drop the connection
    before libzmq allocates them, and a connection that has not completed its handshake
    within HANDSHAKE_IVL_MS is dropped, so a stranger pins little memory, briefly."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def _keepalive(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)


@dataclass(frozen=True)
class PeerInfo:
    """What rendezvous tells every rank about one peer."""

    rank: int
    #: The address of its data plane: its ROUTER socket (zmq) or listening socket (socket).
    endpoint: str
    host: str
    pid: int
    hostkey: str = ""
    #: The per-session token of this rank's data plane: the key its peers' one-time
    #: PLAIN passwords derive from (zmq) or of its handshakes' HMAC (socket);
    #: unencrypted plane only.
    token: str = field(default="", repr=False)
    #: Its data plane (DATA_PLANES); every rank of a job must use the same.
    plane: str = "zmq"


def _now() -> float:
    return time.monotonic()


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit, as servers do.

    A rank's listeners face strangers during init, and each connection a stranger opens
    costs a descriptor until it is refused or evicted: with a 1024 soft limit (a common
    default) 1100 silent connections would starve the rendezvous. Returns the (old, new)
    soft limit. Leaves the limit alone where it cannot be changed.
    """
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return soft, hard
        return soft, soft
    except (ValueError, OSError):
        return -1, -1


class _Cutoff(Exception):
    """A bounded wait inside the transport ran out (never leaves the transport)."""


def _cutoff(seconds: float) -> Callable[[], None]:
    """A ``between`` callback that ends a payload read after ``seconds``."""
    end = _now() + seconds

    def between() -> None:
        if _now() > end:
            raise _Cutoff
    return between


def _connection_token(session_token: str, client: int, server: int) -> str:
    """The one-time PLAIN password of ``client``'s data connection to ``server``.

    Derived from ``server``'s per-session token (which only the encrypted rendezvous
    carried), so a reader of the network who sees one connection's password learns
    nothing about another's, and ZAP admits each password once: a replay fails.
    """
    msg = b"swarmfd zmq data connection v2\0" + struct.pack("<II", client, server)
    return hmac.new(session_token.encode(), msg, hashlib.sha256).hexdigest()


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler with swarmfd's policies (see Security in the module docstring).

    * rendezvous: CURVE clients holding the job key (any number: the listener closes
      after init);
    * data plane: each peer's connection is admitted **once**. Unencrypted, a PLAIN
      user name is the connecting rank and its password that rank's one-time
      connection token (:func:`_connection_token`), consumed on success; encrypted,
      a CURVE client with the job key, at most ``world_size - 1`` of them. Once every
      peer is in, nothing more is admitted, for as long as the job runs.
    """

    def __init__(self, ctx: zmq.Context, security: Security, rank: int, world_size: int,
                 token: str) -> None:
        super().__init__(ctx, log=_ZAP_LOG)
        self.job_public = security.public
        self.encrypt = security.encrypt
        #: rank -> its one-time data connection token (PLAIN data plane), not yet used.
        self.data_tokens = {j: _connection_token(token, j, rank)
                            for j in range(world_size) if j != rank}
        self.data_curve_left = world_size - 1
        #: Refused ZAP requests per domain (strangers; counted for error messages).
        self.denied: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(ZAP_RENDEZVOUS, self)
        if self.encrypt:
            self.configure_curve_callback(ZAP_DATA, self)

    def callback(self, domain: str, key: bytes) -> bool:
        """CURVE: the job's key; on the data plane at most world_size - 1 times."""
        ok = hmac.compare_digest(key, self.job_public)  # both z85
        if ok and domain == ZAP_DATA:
            with self._lock:
                ok = self.data_curve_left > 0
                self.data_curve_left -= ok
        if not ok:
            self.denied[domain] += 1
        return ok

    def _authenticate_plain(self, domain: str, username: str,
                            password: str) -> tuple[bool, bytes]:
        if domain == ZAP_DATA and not self.encrypt:
            try:
                rank = int(username)
            except ValueError:
                rank = -1
            with self._lock:
                expected = self.data_tokens.get(rank)
                if expected is not None and hmac.compare_digest(password, expected):
                    del self.data_tokens[rank]  # one-time: a replay is refused
                    return True, b"OK"
        self.denied[domain] += 1
        return False, b"NO ACCESS"

    @property
    def refused(self) -> int:
        return sum(self.denied.values())


class _ZmqPlane:
    """The ZeroMQ data plane (see the module docstring).

    Each rank binds one ROUTER socket that only *sends*: to peer j by its routing id.
    It connects one DEALER socket to each peer's ROUTER that only *receives*, so a
    message's source is the socket it arrived on, never a header's claim (a header
    whose ``src`` differs is a protocol error). ZAP admits each peer's DEALER once
    (:class:`_Authenticator`); the bound socket, which is what a stranger can reach
    for as long as the job runs, refuses frames over MAX_HANDSHAKE_FRAME and drops a
    connection that has not authenticated within HANDSHAKE_IVL.
    """

    def __init__(self, t: Transport, bind_host: str) -> None:
        self.t = t
        self.router = t.ctx.socket(zmq.ROUTER)
        sec = t.security
        if sec is not None:
            if sec.encrypt:
                sec.curve_server(self.router, ZAP_DATA)
            else:
                self.router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DATA.encode())
                self.router.setsockopt(zmq.PLAIN_SERVER, 1)
        _stranger_facing(self.router, MAX_HANDSHAKE_FRAME)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, 0)
        # Nothing legitimate is ever received on it: without authentication (AUTH=off) a
        # stranger's messages wait unread in its queue, so keep that queue minimal.
        self.router.setsockopt(zmq.RCVHWM, 1)
        self.router.setsockopt(zmq.LINGER, int(min(t.timeout, 5.0) * 1000))
        _keepalive(self.router)
        port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        # Counts the peers whose DEALER authenticated (setup waits for all of them).
        self.router_monitor: zmq.Socket | None = self.router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED | zmq.EVENT_ACCEPT_FAILED)
        self.inbound = 0
        self.accept_failed = 0
        self.ids = {j: b"%d" % j for j in range(t.world_size)}
        self.dealers: dict[int, zmq.Socket] = {}
        self.sources: dict[zmq.Socket, int] = {}
        self.monitors: dict[zmq.Socket, int] = {}
        self.connected: set[int] = set()
        self.poller = zmq.Poller()
        self.order: list[zmq.Socket] = []
        self.next = 0
        self.trackers: list[tuple[int, zmq.MessageTracker]] = []
        self.raw: bytes = b""  # the frame whose header next_header returned
        self.cur: zmq.Socket | None = None  # the socket it came from

    def idle(self) -> None:
        """Count the events of the bound socket while the rank waits in the rendezvous."""
        self._read_router_monitor()

    def _read_router_monitor(self) -> None:
        mon = self.router_monitor
        if mon is None:
            return
        while mon.poll(0):
            event = parse_monitor_message(mon.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.inbound += 1
            elif event == zmq.EVENT_ACCEPT_FAILED:
                self.accept_failed += 1

    def connect(self, peers: Sequence[PeerInfo], deadline: float) -> None:
        """Connect a DEALER to every peer's ROUTER, and wait until the mesh is up: every
        DEALER authenticated, and every peer's DEALER authenticated with ours (so no
        message is sent before its receiver listens, and no token is left unused)."""
        t = self.t
        for peer in peers:
            if peer.rank == t.rank:
                continue
            sock = t.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, self.ids[t.rank])
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            sock.setsockopt(zmq.RCVTIMEO, WAIT_SLICE_MS)
            sock.setsockopt(zmq.LINGER, 0)
            _keepalive(sock)
            t.client(sock, peer)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
                                          | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(peer.endpoint)
            self.dealers[peer.rank] = sock
            self.sources[sock] = peer.rank
            self.monitors[mon] = peer.rank
            self.poller.register(sock, zmq.POLLIN)
            self.order.append(sock)
        want = t.world_size - 1
        while len(self.connected) < want or self.inbound < want:
            self.check_lost()
            self._read_router_monitor()
            refused = sorted(t.refused)
            if refused:
                raise AuthenticationError(
                    f"rank {t.rank}: the data socket of rank {refused[0]} "
                    f"({t._where(refused[0])}) refused this rank's connection token. A token "
                    "is valid once: was it replayed by someone reading the network before "
                    "this rank's own connection used it? On such a network set "
                    "SWARMFD_ENCRYPT=1"
                )
            lost = sorted(set(t.lost) - self.connected)
            if lost or _now() > deadline:
                missing = sorted(set(self.dealers) - self.connected)
                raise RendezvousTimeout(
                    f"rank {t.rank} could not set up its data connections within the timeout "
                    f"(zmq data plane at {self.endpoint}): "
                    + (f"lost rank(s) {lost} during setup; " if lost else "")
                    + f"connections to rank(s) {missing} not authenticated; "
                    f"{self.inbound} of {want} peers connected to this rank"
                    + (f"; {t.auth.refused} stranger handshake(s) refused" if t.auth else "")
                    + (f"; accepting a connection failed {self.accept_failed} time(s) (out "
                       "of descriptors: a flood of strangers?)" if self.accept_failed else "")
                )
            time.sleep(0.002)
        # Setup is over: the bound socket's events are only strangers' now. Stop its
        # monitor, so that they cannot pile up in it.
        self._stop_router_monitor()

    def _stop_router_monitor(self) -> None:
        mon, self.router_monitor = self.router_monitor, None
        if mon is not None:
            while mon.poll(0):
                mon.recv_multipart()
            with contextlib.suppress(zmq.ZMQError):
                self.router.disable_monitor()
            mon.close(linger=0)

    def close(self, linger: float) -> None:
        """Close every socket; pending sends get ``linger`` seconds."""
        # Read the monitors empty, then stop them before closing their sockets: the other
        # order, or a full monitor pipe, can block in disable_monitor (libzmq#3575).
        self.check_lost()
        self._stop_router_monitor()
        for sock in self.dealers.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        for mon in self.monitors:
            mon.close(linger=0)
        for sock in self.dealers.values():
            sock.close(linger=0)
        self.router.close(linger=int(linger * 1000))

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int,
             payload: Any, size: int, copy: bool) -> None:
        rank = self.t.rank
        try:
            self.router.send(self.ids[dst], zmq.SNDMORE)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.t.lost.setdefault(dst, _now())  # its connection is gone
            return
        if size <= INLINE_MAX_BYTES:
            # One frame: header and payload together (one send, one receive).
            body = payload if isinstance(payload, bytes) else memoryview(payload).tobytes()
            self.router.send(wire.pack_header(kind, sig, rank, seq, tag, size,
                                              wire.FLAG_INLINE) + body)
            return
        self.router.send(wire.pack_header(kind, sig, rank, seq, tag, size), zmq.SNDMORE)
        if copy or size <= COPY_MAX_BYTES:
            self.router.send(payload, copy=True)
            return
        tracker = self.router.send(payload, copy=False, track=True)
        self.trackers.append((dst, tracker))

    def send_all(self, kind: int, sig: wire.Signature, body: bytes) -> None:
        """Best effort: ``body`` as one inline frame to every peer (aborts, reports)."""
        header = wire.pack_header(kind, sig, self.t.rank, 0, 0, len(body), wire.FLAG_INLINE)
        for dst in self.dealers:
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart([self.ids[dst], header + body], zmq.NOBLOCK)

    def unsent(self) -> list[int]:
        self.trackers = [(dst, tr) for dst, tr in self.trackers if not tr.done]
        return [dst for dst, _ in self.trackers]

    def wait(self, timeout: float) -> wire.Header | None:
        if self.trackers:
            with contextlib.suppress(zmq.NotDone):
                self.trackers[0][1].wait(timeout)
        return None

    def _recv_any(self, timeout: float) -> tuple[zmq.Socket, bytes] | None:
        """The next frame from any peer (fair: round-robin), or None after ``timeout``."""
        order = self.order
        if len(order) == 1:
            sock = order[0]
            try:
                if timeout == WAIT_SLICE_MS / 1000:
                    return sock, sock.recv()  # at most WAIT_SLICE (RCVTIMEO), GIL released
                if timeout > 0 and not sock.poll(int(timeout * 1000)):
                    return None
                return sock, sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
        for _ in range(2):
            for i in range(len(order)):
                sock = order[(self.next + i) % len(order)]
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self.next = (self.next + i + 1) % len(order)
                return sock, raw
            if timeout <= 0 or not self.poller.poll(int(timeout * 1000)):
                return None
            timeout = 0
        return None

    def next_header(self, timeout: float) -> wire.Header | None:
        """The next valid header (its payload then read with read_payload) or None after
        ``timeout`` s. A header from a peer that is not a swarmfd message, or claims
        another source, is a protocol error: the peer does not follow the protocol."""
        got = self._recv_any(timeout)
        if got is None:
            return None
        sock, raw = got
        src = self.sources[sock]
        try:
            hdr = wire.unpack_header(raw)
            if hdr.src != src:
                raise ProtocolError(f"a header claims source rank {hdr.src}")
            if hdr.inline and sock.get(zmq.RCVMORE):
                raise ProtocolError("an inline message with a second frame")
        except ProtocolError as exc:
            self._drain(sock)
            raise ProtocolError(
                f"rank {src} sent bytes that are not a swarmfd message on its data connection "
                f"({exc})"
            ) from None
        self.raw = raw
        self.cur = sock
        return hdr

    def read_payload(self, hdr: wire.Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        """The payload of the header next_header returned: into ``into`` (None returned)
        or as a buffer (``bytes`` when the caller ``keep``s it, e.g. in the stash: a zmq
        Frame must not outlive the receive that returned it)."""
        sock, raw = self.cur, self.raw
        assert sock is not None
        self.raw = b""
        if hdr.inline:
            inline = memoryview(raw)[wire.HEADER_SIZE:]
            if into is None:
                return bytes(inline) if keep else inline
            memoryview(into).cast("B")[:] = inline
            return None
        if not sock.get(zmq.RCVMORE):
            if into is None and hdr.nbytes == 0:
                return b""
            raise ProtocolError(f"{self.t.activity}: rank {hdr.src} sent a header without "
                                "payload")
        if into is not None:
            got = sock.recv_into(into)
            self._drain(sock)
            if got != hdr.nbytes:
                raise ProtocolError(f"{self.t.activity}: rank {hdr.src} sent {got} bytes, "
                                    f"expected {hdr.nbytes}")
            return None
        data = sock.recv(copy=False) if hdr.nbytes > INLINE_MAX_BYTES and not keep else (
            sock.recv())
        self._drain(sock)
        return data

    @staticmethod
    def _drain(sock: zmq.Socket) -> None:
        while sock.get(zmq.RCVMORE):
            sock.recv()

    def check_lost(self) -> None:
        for mon, peer in self.monitors.items():
            while True:
                try:
                    msg = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = parse_monitor_message(msg)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.connected.add(peer)
                elif event == zmq.EVENT_DISCONNECTED:
                    self.t.lost.setdefault(peer, _now())
                elif event & _HANDSHAKE_FAILED:
                    # A peer that refuses this rank's credentials: no data will ever flow.
                    self.t.lost.setdefault(peer, _now())
                    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
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
        raise_descriptor_limit()
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        #: What the rendezvous deadline was made of (init_timeout), for its messages.
        self.join_timeout = timeout if join_timeout is None else join_timeout
        self.security = security
        self.plane = plane
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.auth: _Authenticator | None = None
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
        if not security.encrypt:
            self.token = secrets.token_hex(16)
        self.auth = _Authenticator(self.ctx, security, self.rank, self.world_size, self.token)
        self.auth.start()

    def _stop_auth(self) -> None:
        if self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
            self.auth = None

    def client(self, sock: zmq.Socket, peer: PeerInfo | None = None) -> None:
        """Make ``sock`` a client of the rendezvous (``peer`` None) or of ``peer``'s data
        socket (with this rank's one-time connection token there)."""
        sec = self.security
        if sec is None:
            return
        if peer is None or sec.encrypt:
            sec.curve_client(sock)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, b"%d" % self.rank)
            sock.setsockopt(zmq.PLAIN_PASSWORD,
                            _connection_token(peer.token, self.rank, peer.rank).encode())

    def idle(self) -> None:
        """Let the data plane look after its listener while the rank waits elsewhere."""
        self.ch.idle()

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


def _bind_address(master_ip: str) -> str:
    """Where rank 0 serves the rendezvous: MASTER_ADDR's own address when it is one of
    this host's (strangers on other interfaces then cannot even connect), else every
    interface (MASTER_ADDR may name this host through a NAT or a load balancer)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind((master_ip, 0))
        return master_ip
    except OSError:
        return "*"
    finally:
        probe.close()


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
    _stranger_facing(router, MAX_HELLO_MESSAGE)
    router.setsockopt(zmq.LINGER, 2000)
    _keepalive(router)
    if t.security is not None:
        t.security.curve_server(router, ZAP_RENDEZVOUS)
    refused = accept_failed = 0
    bind_ip = _bind_address(master_ip)
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
    monitor = router.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_ACCEPT_FAILED)
    joined: dict[int, tuple[bytes, PeerInfo]] = {}
    try:
        while len(joined) < t.world_size - 1:
            remaining = deadline - _now()
            if remaining <= 0:
                missing = sorted(set(range(1, t.world_size)) - set(joined))
                hint = (f"; {refused} connection(s) failed the authentication handshake "
                        "(strangers, or processes with another job secret or SWARMFD_AUTH "
                        "setting?)" if refused else "")
                if accept_failed:
                    hint += (f"; accepting a connection failed {accept_failed} time(s) (out of "
                             "descriptors: a flood of connections from strangers?)")
                raise RendezvousTimeout(
                    f"rendezvous timed out after {t.join_timeout:g} s: rank 0 waited for "
                    f"rank(s) {missing} of {t.world_size} to join at port {port}{hint} (give "
                    "slow starters longer with SWARMFD_INIT_TIMEOUT or init_timeout=)"
                )
            while monitor.poll(0):
                if parse_monitor_message(monitor.recv_multipart())["event"] == (
                        zmq.EVENT_ACCEPT_FAILED):
                    accept_failed += 1
                else:
                    refused += 1
            t.idle()
            if not router.poll(int(min(remaining, RENDEZVOUS_SLICE) * 1000) + 1):
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
    monitor = dealer.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_CONNECTED)
    dealer.connect(f"tcp://{master_ip}:{port}")
    failures = dropped = 0
    connected_at = _now()
    try:
        dealer.send(_hello(me, t.world_size))
        while True:
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event == zmq.EVENT_CONNECTED:
                    connected_at = _now()
                elif event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    failures = MAX_HANDSHAKE_FAILURES  # refused, or a failed MAC: evidence
                elif _now() - connected_at < QUICK_REFUSAL:
                    failures += 1
                else:
                    dropped += 1  # rank 0 busy or flooded: libzmq reconnects and resends
            if failures >= MAX_HANDSHAKE_FAILURES:
                raise AuthenticationError(_refused_by_rank0(t, me.rank, master_ip, port))
            remaining = deadline - _now()
            if remaining <= 0:
                hint = (f"; {dropped} handshake(s) with rank 0 were dropped before they "
                        "completed (rank 0 overloaded, or flooded by strangers?)"
                        if dropped else "")
                raise RendezvousTimeout(
                    f"rendezvous timed out after {t.join_timeout:g} s: rank {me.rank} got no "
                    f"answer from rank 0 at {master_ip}:{port} (MASTER_ADDR/MASTER_PORT); is "
                    f"rank 0 running?{hint} (give slow starters longer with "
                    "SWARMFD_INIT_TIMEOUT or init_timeout=)"
                )
            t.idle()
            if not dealer.poll(int(min(remaining, RENDEZVOUS_SLICE) * 1000) + 1):
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
