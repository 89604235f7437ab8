"""The ZeroMQ transport: the only module of swarmfd that imports zmq.

One process group owns one :class:`Transport`:

* a PULL socket bound on a free port of this host (every peer sends to it);
* one PUSH socket connected to each peer, with a socket monitor that reports
  when the peer's connection closes (the peer died or exited);
* receives that block in short slices (``WAIT_SLICE_MS``), so every wait is
  bounded by the group timeout and a lost peer is noticed within a fraction
  of a second.

Messages are (header, payload) frame pairs from :mod:`swarmfd.wire`. Sends
never block (no high-water mark): the sockets queue and libzmq's I/O thread
moves the bytes while the caller reduces the previous piece. Large payloads
are sent zero-copy; :meth:`Transport.flush` waits until libzmq released them,
so a collective never returns while the caller's array is still being read.

Receives name what they wait for (source rank, sequence number, tag). A
message that arrives early (from another peer, or from a later collective of
a faster peer) is kept in a small stash until asked for. Bytes that are not a
valid swarmfd message are dropped and counted; they never reach an array.
Nothing received is ever unpickled: control payloads are JSON.

Rendezvous (:func:`rendezvous`) also lives here: rank 0 serves a ROUTER at
``MASTER_ADDR:MASTER_PORT``; every other rank sends it a JSON hello (rank,
world size, protocol version, data endpoint, host) and gets back the table of
all endpoints. No other fixed port is used.

Security (:class:`Security`, built from the job secret). Every rank derives
the same CURVE keypair from the secret (SHA-256 of it, with a domain label, is
the secret key). Every socket that binds is a server, every socket that
connects a client, and a ZAP handler (pyzmq's ``ThreadAuthenticator``) admits
only connections that prove they hold the job's key:

* rendezvous: always CURVE (authenticated and encrypted);
* data plane, ``encrypt=True``: CURVE as well;
* data plane, ``encrypt=False``: ZMQ PLAIN with a random per-session token
  that each rank draws for its own data socket and announces over the
  encrypted rendezvous; ZAP admits only that token. Strangers cannot connect,
  inject or abort; the bytes themselves travel in clear (readable by whoever
  can sniff the network, as the token is; see README "Security").

A process whose secret differs fails its handshake with rank 0 and raises
:class:`AuthenticationError` at once. Without a secret (``SWARMFD_AUTH=off``)
every socket uses the NULL mechanism, as before.

Bounds against a peer gone wrong: data sockets refuse frames over
``MAX_FRAME`` (libzmq drops the connection before allocating), messages for
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from . import wire
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
    endpoint: str
    host: str
    pid: int
    hostkey: str = ""
    #: The PLAIN password of this rank's data socket (unencrypted data plane only).
    token: str = field(default="", repr=False)


def _now() -> float:
    return time.monotonic()


class Transport:
    """Point-to-point messaging between the ranks of one group (see module docstring)."""

    def __init__(self, rank: int, world_size: int, timeout: float, bind_host: str,
                 security: Security | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.security = security
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.auth: ThreadAuthenticator | None = None
        self.job_key: _JobKey | None = None
        #: The password peers give this rank's data socket (unencrypted data plane).
        self.token = ""
        try:
            self.pull = self.ctx.socket(zmq.PULL)
            if security is not None:
                self._start_auth(security)
            self.pull.setsockopt(zmq.RCVHWM, 0)
            self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            self.pull.setsockopt(zmq.RCVTIMEO, WAIT_SLICE_MS)
            _keepalive(self.pull)
            port = self.pull.bind_to_random_port(f"tcp://{bind_host}")
        except BaseException:
            self._stop_auth()
            self.ctx.destroy(linger=0)
            raise
        self.endpoint = f"tcp://{bind_host}:{port}"
        self.push: dict[int, zmq.Socket] = {}
        self.monitors: dict[zmq.Socket, int] = {}
        self.peers: list[PeerInfo] = []
        self.stash: dict[tuple[int, int, int], tuple[wire.Header, bytes]] = {}
        self.lost: dict[int, float] = {}
        self.refused: set[int] = set()  # peers whose data socket refused our handshake
        self.trackers: list[tuple[int, zmq.MessageTracker]] = []
        self.garbage = 0
        self.waiting_for = -1
        self.data_via_shm = False  # set once the group moves its data to shared memory
        self.closed = False
        # What the caller is doing, for error messages.
        self.activity = "rendezvous"

    # -- setup --------------------------------------------------------------------------

    def _start_auth(self, security: Security) -> None:
        """Start the ZAP handler and make the data socket a server of the right mechanism."""
        self.auth = ThreadAuthenticator(self.ctx, log=_ZAP_LOG)
        self.auth.start()
        self.job_key = _JobKey(security.public)
        self.auth.configure_curve_callback(ZAP_RENDEZVOUS, self.job_key)
        if security.encrypt:
            self.auth.configure_curve_callback(ZAP_DATA, self.job_key)
            security.curve_server(self.pull, ZAP_DATA)
        else:
            self.token = secrets.token_hex(16)
            self.auth.configure_plain(ZAP_DATA, {_PLAIN_USER: self.token})
            self.pull.setsockopt(zmq.ZAP_DOMAIN, ZAP_DATA.encode())
            self.pull.setsockopt(zmq.PLAIN_SERVER, 1)

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

    def connect(self, peers: Sequence[PeerInfo]) -> None:
        """Open a PUSH connection (with a loss monitor) to every other rank."""
        self.peers = list(peers)
        for peer in self.peers:
            if peer.rank == self.rank:
                continue
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, int(min(self.timeout, 5.0) * 1000))
            _keepalive(sock)
            self.client(sock, peer)
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
            sock.connect(peer.endpoint)
            self.push[peer.rank] = sock
            self.monitors[mon] = peer.rank

    def close(self, linger: int | None = None) -> None:
        """Close every socket; pending sends get a short linger (or ``linger`` ms). Idempotent."""
        if self.closed:
            return
        self.closed = True
        # Read the monitors empty, then stop them before closing their sockets: the other
        # order, or a full monitor pipe, can block in disable_monitor (libzmq#3575).
        self._check_monitors()
        for sock in self.push.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        for mon in self.monitors:
            mon.close(linger=0)
        for sock in self.push.values():
            sock.close(linger=linger)
        self.pull.close(linger=0)
        self._stop_auth()
        self.ctx.term()

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

        Payloads over ``COPY_MAX_BYTES`` are sent without a copy and tracked
        (:meth:`flush` waits for them before the collective returns), unless
        ``copy``: then the payload is copied at once and the caller may
        overwrite its buffer right away.
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
        sock = self.push[dst]
        if size <= INLINE_MAX_BYTES:
            # One frame: header and payload together (one send, one receive).
            body = payload if isinstance(payload, bytes) else memoryview(payload).tobytes()
            sock.send(wire.pack_header(kind, sig, self.rank, seq, tag, size, wire.FLAG_INLINE)
                      + body)
            return
        sock.send(wire.pack_header(kind, sig, self.rank, seq, tag, size), zmq.SNDMORE)
        if copy or size <= COPY_MAX_BYTES:
            sock.send(payload, copy=True)
            return
        tracker = sock.send(payload, copy=False, track=True)
        self.trackers.append((dst, tracker))

    def flush(self) -> None:
        """Wait until libzmq no longer reads any buffer handed to :meth:`send`."""
        if not self.trackers:
            return
        deadline = _now() + self.timeout
        pending = self.trackers
        while pending:
            pending = [(dst, t) for dst, t in pending if not t.done]
            if not pending:
                break
            dst = pending[0][0]
            if _now() > deadline:
                raise CollectiveTimeout(
                    f"{self.activity}: sending to rank {dst} did not complete within "
                    f"{self.timeout:g} s"
                )
            self._check_monitors()
            if dst in self.lost and _now() - self.lost[dst] > LOST_PEER_GRACE:
                self._raise_pending_abort()
                raise PeerLostError(
                    f"{self.activity}: rank {dst} disconnected before receiving this rank's data"
                    f" ({self._where(dst)}): {self._why_lost(dst)}"
                )
            with contextlib.suppress(zmq.NotDone):
                pending[0][1].wait(0.01)
        self.trackers = []

    def abort(self, error: BaseException) -> None:
        """Tell every peer that this rank failed, so they fail fast too (best effort)."""
        if isinstance(error, AbortedError):
            return  # the originator already told everyone
        if getattr(error, "announced", False):
            return  # a timeout: announced to everyone while its culprit was found
        body = json.dumps({"kind": abort_kind(error), "rank": self.rank,
                           "message": str(error)[:wire.MAX_ABORT_TEXT]}).encode()
        sig = wire.Signature(wire.Collective.NONE)
        header = wire.pack_header(wire.Kind.ABORT, sig, self.rank, 0, 0, len(body))
        for sock in self.push.values():
            try:
                sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
                sock.send(body, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

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
        and ``None`` is returned; otherwise a buffer (``bytes`` or a zmq Frame)
        is returned. Raises :class:`CollectiveTimeout` after the group timeout,
        :class:`PeerLostError` when ``src`` disconnects, :class:`MismatchError`
        when a peer's signature differs, :class:`AbortedError` when a peer failed.
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
        pull = self.pull
        self.waiting_for = src
        last_check = _now()
        while True:
            try:
                raw = pull.recv()  # blocks at most WAIT_SLICE (RCVTIMEO), GIL released
            except zmq.Again:
                raw = None
            if raw is None:
                self._between_slices(src, deadline, sig)
                continue
            hdr = self._parse(raw)
            if hdr is not None:
                if (hdr.src, hdr.seq, hdr.tag) == key and hdr.kind == wire.Kind.DATA:
                    if not hdr.matches(sig):
                        self._drain()
                        raise self._mismatch(hdr, sig)
                    self._check_size(hdr, nbytes)
                    if hdr.inline:
                        inline = memoryview(raw)[wire.HEADER_SIZE:]
                        if into is None:
                            return inline
                        memoryview(into).cast("B")[:] = inline
                        return None
                    if not pull.get(zmq.RCVMORE):
                        raise ProtocolError(
                            f"{self.activity}: rank {src} sent a header without payload"
                        )
                    if into is not None:
                        got = pull.recv_into(into)
                        if got != nbytes:
                            raise ProtocolError(f"{self.activity}: rank {src} sent {got} bytes, "
                                                f"expected {nbytes}")
                        return None
                    if nbytes > INLINE_MAX_BYTES:
                        return pull.recv(copy=False)
                    return pull.recv()
                self._other(hdr, sig, seq, raw)
            # Messages keep coming but not the one awaited (a flood of garbage, say): the
            # deadline and the peer's liveness still count. Checked after the message was
            # handled: arriving at the deadline, it may be the report that explains the wait.
            if _now() - last_check > WAIT_SLICE_MS / 1000:
                self._between_slices(src, deadline, sig)
                last_check = _now()

    def _other(self, hdr: wire.Header, sig: wire.Signature, seq: int, raw: bytes) -> None:
        """Handle a message that is not the one being waited for."""
        payload = raw[wire.HEADER_SIZE:] if hdr.inline else self._payload()
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

    def _parse(self, raw: bytes) -> wire.Header | None:
        try:
            hdr = wire.unpack_header(raw)
        except ProtocolError:
            self.garbage += 1
            self._drain()
            return None
        if hdr.inline and self.pull.get(zmq.RCVMORE):
            self.garbage += 1  # an inline message has one frame: this is not ours
            self._drain()
            return None
        return hdr

    def _payload(self) -> bytes:
        if not self.pull.get(zmq.RCVMORE):
            return b""
        data = self.pull.recv()
        self._drain()
        return data

    def _drain(self) -> None:
        while self.pull.get(zmq.RCVMORE):
            self.pull.recv()

    def _check_size(self, hdr: wire.Header, nbytes: int) -> None:
        if hdr.nbytes != nbytes:
            raise ProtocolError(
                f"{self.activity}: rank {hdr.src} announced {hdr.nbytes} bytes for message "
                f"{hdr.tag}, expected {nbytes}"
            )

    def _between_slices(self, src: int, deadline: float, sig: wire.Signature) -> None:
        """After a wait slice without data: check the deadline and whether ``src`` is gone."""
        self._check_monitors()
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
        self._announce_timeout(src)
        end = _now() + TIMEOUT_GRACE
        while _now() < end:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.005)
                continue
            hdr = self._parse(raw)
            if hdr is None:
                continue
            payload = raw[wire.HEADER_SIZE:] if hdr.inline else self._payload()
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

    def _announce_timeout(self, src: int) -> None:
        body = json.dumps({"kind": "timeout", "rank": self.rank, "waiting_for": src,
                           "message": f"rank {self.rank} timed out waiting for rank {src}",
                           "provisional": True}).encode()
        sig = wire.Signature(wire.Collective.NONE)
        header = wire.pack_header(wire.Kind.ABORT, sig, self.rank, 0, 0, len(body),
                                  wire.FLAG_INLINE)
        for sock in self.push.values():
            with contextlib.suppress(zmq.ZMQError):
                sock.send(header + body, zmq.NOBLOCK)

    def _raise_pending_abort(self) -> None:
        """Read what already arrived and raise the first abort in it (it explains a loss)."""
        self._read_available(keep_data=True)

    def drain_unused(self) -> None:
        """Empty the data socket of a group whose data goes through shared memory.

        Nothing legitimate arrives there but aborts (raised here); anything else a
        stranger sends is dropped and counted, so it cannot pile up in memory.
        """
        self._read_available(keep_data=False)

    def _read_available(self, *, keep_data: bool, limit: int = 10_000) -> None:
        """Read up to ``limit`` waiting messages without blocking; raise on a final abort.

        Data messages are stashed for a later receive (``keep_data``) or dropped.
        """
        for _ in range(limit):
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            hdr = self._parse(raw)
            if hdr is None:
                continue
            payload = raw[wire.HEADER_SIZE:] if hdr.inline else self._payload()
            if not self._from_peer(hdr):
                self.garbage += 1
                continue
            if hdr.kind == wire.Kind.ABORT and not abort_is_provisional(payload):
                raise self._aborted(hdr, payload)
            if keep_data and hdr.kind == wire.Kind.DATA:
                self.stash[(hdr.src, hdr.seq, hdr.tag)] = (hdr, payload)
            else:
                self.garbage += 1

    def check_peer(self, src: int | None) -> None:
        """Raise :class:`PeerLostError` when ``src`` disconnected (for waits outside zmq)."""
        if self.data_via_shm:
            self.drain_unused()
        self._check_monitors()
        if src is not None and src in self.lost and _now() - self.lost[src] > LOST_PEER_GRACE:
            self._raise_pending_abort()
            raise PeerLostError(
                f"{self.activity}: lost rank {src} ({self._where(src)}): "
                f"{self._why_lost(src)} before it signalled"
            )

    def _check_monitors(self) -> None:
        for mon, peer in self.monitors.items():
            while True:
                try:
                    msg = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = parse_monitor_message(msg)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.lost.setdefault(peer, _now())
                elif event["event"] & _HANDSHAKE_FAILED:
                    # A peer that refuses this rank's credentials: no data will ever flow.
                    self.lost.setdefault(peer, _now())
                    self.refused.add(peer)

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
                  transport.token)
    if transport.rank == 0:
        return _serve_rendezvous(transport, me, master_ip, master_port, deadline)
    return _join_rendezvous(transport, me, master_ip, master_port, deadline)


def _hello(me: PeerInfo, world_size: int) -> bytes:
    return json.dumps({
        "swarmfd": wire.PROTOCOL_VERSION, "rank": me.rank, "world_size": world_size,
        "endpoint": me.endpoint, "host": me.host, "pid": me.pid, "hostkey": me.hostkey,
        "token": me.token,
    }).encode()


def _int(value: Any) -> int:
    """A JSON integer, strictly (no bool, no float): TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _peer(d: dict[str, Any]) -> PeerInfo:
    return PeerInfo(_int(d["rank"]), str(d["endpoint"]), str(d["host"]), _int(d["pid"]),
                    str(d.get("hostkey", "")), str(d.get("token", "")))


def _serve_rendezvous(
    t: Transport, me: PeerInfo, master_ip: str, port: int, deadline: float
) -> tuple[list[PeerInfo], str]:
    router = t.ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_MESSAGE)
    router.setsockopt(zmq.LINGER, 2000)
    _keepalive(router)
    if t.security is not None:
        t.security.curve_server(router, ZAP_RENDEZVOUS)
    monitor = router.get_monitor_socket(_HANDSHAKE_FAILED)
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
                    f"rendezvous timed out after {t.timeout:g} s: rank 0 waited for rank(s) "
                    f"{missing} of {t.world_size} to join at port {port}{hint}"
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
                    f"rendezvous timed out after {t.timeout:g} s: rank {me.rank} got no answer "
                    f"from rank 0 at {master_ip}:{port} (MASTER_ADDR/MASTER_PORT); is rank 0 "
                    "running?"
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
