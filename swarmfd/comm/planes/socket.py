"""The socket plane: plain TCP connections and a single-threaded progress engine.

One thread per rank doing non-blocking ``sendmsg`` and ``recv_into`` straight into the
array, as MPI and gloo do, takes half to two thirds of ZeroMQ's time (docs/performance.md).
A full mesh (rank i dials every j < i; TCP_NODELAY, keepalive); a message is the
:mod:`swarmfd.comm.wire` header and exactly ``nbytes`` of payload. Every header is
validated (source = the connection's rank, ``nbytes <= MAX_PAYLOAD``); a bad one drops
the connection (:class:`ProtocolError`). What the kernel does not take is queued, and
every wait drives every queue, so two ranks sending to each other never deadlock.

The data port listens only while the mesh connects (docs/security.md, "Strangers on the
network"); each connection starts with the handshake of HANDSHAKE_MAGIC. A dialled
handshake that fails without evidence is dialled again until the init deadline; only a
wrong MAC or a proven listener's refusal raise :class:`AuthenticationError`. The bytes
travel in clear (SWARMFD_ENCRYPT=1 takes the zmq plane with CURVE).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import selectors
import socket
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from ...errors import AuthenticationError, ProtocolError, RendezvousTimeout
from .. import wire
from ..handshake import HELLO, MAC_SIZE, NO_RANK, mac, verify
from ..plane import PeerInfo, PlaneOwner, reserve_port
from ..spin import Spinner

__all__ = ["SocketPlane"]

#: Per-connection receive buffer: headers and small payloads arrive in one recv.
RECV_BUFFER = 128 << 10
#: Payloads up to this size are copied when they must be queued; larger ones are queued
#: as zero-copy views unless copy=True.
SMALL_SEND = 64 << 10
#: Empty reads of a peer's connection before :meth:`SocketPlane.take` gives up: about
#: a small message's time over loopback (docs/performance.md).
TAKE_POLLS = 16
#: A payload read about to block with at least LOWAT_MIN bytes to come asks the kernel
#: (SO_RCVLOWAT) not to wake it before min(the rest, LOWAT_BYTES) are queued: across
#: hosts the rest trickles in a segment at a time, and each wake-up costs CPU
#: (docs/performance.md). Smaller remainders block without it (latency untouched).
LOWAT_BYTES = 512 << 10
LOWAT_MIN = 64 << 10
#: At most this many queued buffers go into one sendmsg.
MAX_IOV = 64
#: Handshake (protocol 2): both sides send HELLO (magic, version, sender and receiver
#: rank, nonce); with a job secret the listener proves first that it knows the
#: connector's token (a MAC), the connector checks it and proves it knows the
#: listener's, and the listener ends with ACCEPT or REFUSE. Only a failed MAC or a
#: REFUSE from a listener that proved itself is evidence of another job secret.
HANDSHAKE_MAGIC = b"SWFDLAN2"
ACCEPT = b"\x01"
REFUSE = b"\x00"
_MAC_LABEL = b"swarmfd socket data plane v2\0"
#: Accepted connections in their handshake at once. At the limit a new one evicts a
#: silent one (nothing received, among the EVICT_SCAN stalest), else the stalest. A peer
#: sends its hello as it connects and it is read on accept, so a flood of silent
#: connections only ever evicts its own; an evicted peer dials again.
MAX_PENDING_HANDSHAKES = 1024
EVICT_SCAN = 64
#: Connections accepted in a row before the handshakes in progress get their turn.
ACCEPT_BATCH = 64
#: Unauthenticated connections a second at which a setup timeout names a flood.
FLOOD_RATE = 100
#: How long an accepted connection may take for each handshake step before it is closed.
HANDSHAKE_STEP_LIMIT = 1.0
#: A dialled handshake that failed without evidence dials again after RETRY_FIRST,
#: doubling up to RETRY_MAX, until the init deadline.
RETRY_FIRST = 0.01
RETRY_MAX = 0.25
#: Listen backlog (capped at net.core.somaxconn): queued connections cost no descriptor,
#: and a peer behind a flood is accepted, not dropped (a lost SYN is resent after 1 s).
LISTEN_BACKLOG = 4096
#: At close, how long to read (and drop) what peers still send until they close too.
CLOSE_DRAIN = 1.0
_now = time.monotonic


def _set_lowat(sock: socket.socket, nbytes: int) -> int:
    """Set ``sock``'s SO_RCVLOWAT (see LOWAT_BYTES); returns it, or 1 where refused."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
    except OSError:
        return 1
    return nbytes


def _keepalive(sock: socket.socket, idle: int, intvl: int, cnt: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, cnt)
    # Keepalive probes only idle connections; the user timeout ends one with data in
    # flight as soon (a stopped peer's kernel still acknowledges: SIGSTOP stays a timeout).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (idle + intvl * cnt) * 1000)


def _mac(token: str, role: bytes, client: int, server: int, nonce_c: bytes,
         nonce_s: bytes) -> bytes:
    return mac(_MAC_LABEL, token, role, client, server, nonce_c, nonce_s)


class _Lane:
    """One established connection to a peer: its receive buffer and send queue."""

    __slots__ = ("busy", "dead", "hdr", "mask", "muted", "out", "rank", "rbuf", "rend", "rstart",
                 "rview", "sock", "zc")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.rbuf = bytearray(RECV_BUFFER)
        self.rview = memoryview(self.rbuf)
        self.rstart = 0
        self.rend = 0
        self.hdr: wire.Header | None = None  # parsed, payload not read yet
        self.busy = False  # its payload is being read
        self.muted = False  # read interest off while a parsed header waits
        self.dead = False
        self.out: collections.deque[list[Any]] = collections.deque()  # [view, zero-copy]
        self.zc = 0  # queued zero-copy views of caller buffers
        self.mask = 0

    def to_front(self) -> None:
        """Move the bytes read and not yet parsed to the start of the buffer."""
        left = self.rend - self.rstart
        self.rview[:left] = self.rview[self.rstart:self.rend]
        self.rstart, self.rend = 0, left


class _Handshake:
    """A connection whose handshake is in progress (see HANDSHAKE_MAGIC for the steps)."""

    __slots__ = ("connected", "endpoint", "inbuf", "last", "nonce", "outbuf", "peer",
                 "peer_nonce", "peer_rank", "sock", "stage")

    def __init__(self, sock: socket.socket, peer: int, now: float, endpoint: str = "") -> None:
        self.sock = sock
        self.peer = peer  # expected rank (we dialled) or NO_RANK (we accepted)
        self.endpoint = endpoint
        self.last = now  # when it last made progress (eviction order, step limit)
        self.connected = peer == NO_RANK  # accepted sockets are connected
        self.nonce = os.urandom(16)
        self.peer_nonce = b""
        self.peer_rank = peer
        self.inbuf = bytearray()
        self.outbuf = b""
        # Dialled: hello -> mac (with a secret) -> status -> done; accepted: hello -> mac -> done.
        self.stage = "hello"


class _Refused(Exception):
    """The listener, having proven itself, refused this rank's proof (evidence)."""


class _Impostor(Exception):
    """The listener failed to prove it is the rank we dialled (a MAC that fails)."""


class SocketPlane:
    """The full mesh of one rank and its progress engine (see module docstring)."""

    name = "socket"
    zero_copy_recv = False
    shares_memory = False
    reads_peers = False
    #: No I/O thread: this rank's own system calls move its bytes.
    io_thread = False
    #: A message's header and payload go out in one system call at any size.
    inline_max = wire.MAX_PAYLOAD

    def __init__(self, owner: PlaneOwner, rank: int, world_size: int, bind_host: str,
                 token: str, keepalive: tuple[int, int, int], wait_slice: float,
                 avoid: Collection[int] = ()) -> None:
        self.owner = owner
        self.wait_slice = wait_slice
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.keepalive = keepalive
        self.listener: socket.socket | None = reserve_port(bind_host, avoid)
        self.listener.setblocking(False)
        self.endpoint = f"tcp://{bind_host}:{self.listener.getsockname()[1]}"
        self.sel = selectors.DefaultSelector()
        self.lanes: dict[int, _Lane] = {}
        self.ready: collections.deque[_Lane] = collections.deque()
        self.current: _Lane | None = None
        self.spinner = Spinner()
        #: Accepted connections closed unauthenticated (strangers, or evicted peers' dials).
        self.strangers = 0
        #: Accepted connections still in their handshake when setup ended.
        self.strangers_pending = 0
        #: When the listener opened (0: never), for the flood's rate in a timeout.
        self.listened_at = 0.0
        #: Handshakes in progress: accepted ones in eviction order (oldest progress first).
        self._accepted: collections.OrderedDict[socket.socket, _Handshake] = (
            collections.OrderedDict())
        self._dialled: dict[socket.socket, _Handshake] = {}
        self._hs_sel: selectors.BaseSelector | None = selectors.DefaultSelector()
        self._tokens: dict[int, str] = {}
        #: Per dialled peer: when to dial next, the next delay, attempts, the last failure.
        self._retry_at: dict[int, float] = {}
        self._backoff: dict[int, float] = {}
        self._attempts: dict[int, int] = {}
        self._last_error: dict[int, str] = {}
        self.closed = False

    # -- setup --------------------------------------------------------------------------

    def idle(self) -> None:
        """Nothing to do: the listener opens only in :meth:`connect`."""

    def connect(self, peers: Sequence[PeerInfo], deadline: float) -> None:
        """Connect the mesh by ``deadline``, then stop listening (see the module
        docstring); accepted connections that fail are closed and counted, never fatal."""
        self._tokens = {p.rank: p.token for p in peers}
        endpoints = {p.rank: p.endpoint for p in peers}
        hs_sel = self._hs_sel
        assert hs_sel is not None
        self._retry_at = {j: 0.0 for j in range(self.rank)}
        try:
            self._listen()
            while len(self.lanes) < self.world_size - 1:
                now = _now()
                if now > deadline:
                    raise RendezvousTimeout(self._setup_timeout())
                for j, at in list(self._retry_at.items()):
                    if at <= now:
                        del self._retry_at[j]
                        self._attempts[j] = self._attempts.get(j, 0) + 1
                        hs = self._dial(j, endpoints[j], now)
                        self._dialled[hs.sock] = hs
                        hs_sel.register(hs.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                        hs)
                wait = min(0.05, max(0.0, deadline - now))
                if self._retry_at:
                    wait = min(wait, max(0.0, min(self._retry_at.values()) - now))
                for key, _ in hs_sel.select(wait):
                    if key.data is None:
                        self._accept(_now())
                    elif key.data.sock in self._accepted or key.data.sock in self._dialled:
                        self._advance(key.data)  # (else evicted earlier in this batch)
                self._evict_stale(_now())
        finally:
            self.strangers_pending += len(self._accepted)
            for hs in [*self._accepted.values(), *self._dialled.values()]:
                self._drop(hs)
            hs_sel.close()
            self._hs_sel = None
            self.stop_listening()

    def _listen(self) -> None:
        """Open the listener, if any rank dials this one; else give its port back."""
        if self.listener is None or self._hs_sel is None:
            return
        if self.rank == self.world_size - 1:
            self.stop_listening()
            return
        self.listener.listen(LISTEN_BACKLOG)
        self.listened_at = _now()
        self._hs_sel.register(self.listener, selectors.EVENT_READ, None)

    def _advance(self, hs: _Handshake) -> None:
        """One step of a handshake: admit it when done; a failure closes it (a dialled
        one is dialled again, an accepted one counted) or, on evidence, raises."""
        try:
            done = self._step(hs, self._tokens)
        except (_Refused, _Impostor) as exc:
            self._drop(hs)
            raise AuthenticationError(
                f"rank {self.rank}: rank {hs.peer}'s data socket ({hs.endpoint}) {exc}; does "
                "it run with another job secret or SWARMFD_AUTH setting?") from None
        except (OSError, ValueError) as exc:
            self._drop(hs)
            if hs.peer == NO_RANK:
                self.strangers += 1
            else:  # no evidence: evicted by a flood, or not listening yet
                self._last_error[hs.peer] = str(exc) or type(exc).__name__
                delay = self._backoff.get(hs.peer, RETRY_FIRST)
                self._backoff[hs.peer] = min(RETRY_MAX, delay * 2)
                self._retry_at[hs.peer] = _now() + delay
            return
        if done:
            self._finish(hs)
        elif self._hs_sel is not None:
            self._hs_sel.modify(hs.sock, selectors.EVENT_READ
                                | (selectors.EVENT_WRITE if hs.outbuf or not hs.connected
                                   else 0), hs)

    def _setup_timeout(self) -> str:
        missing = sorted(set(range(self.world_size)) - {self.rank} - set(self.lanes))
        dialled = [f"rank {j}: {self._attempts[j]} attempt(s), last: {self._last_error[j]}"
                   for j in missing if self._attempts.get(j) and j in self._last_error]
        strangers = self.strangers + len(self._accepted)
        seconds = max(1e-3, _now() - self.listened_at) if self.listened_at else 0.0
        if seconds and strangers / seconds >= FLOOD_RATE:
            cause = (f"a flood of connections at this rank's listener: {strangers} that did "
                     f"not authenticate in {seconds:.1f} s ({strangers / seconds:.0f} a "
                     "second), from strangers; the peers' own dials were lost among them")
        else:
            cause = (f"{self.strangers} connection(s) that did not authenticate were closed "
                     f"and {len(self._accepted)} were still in their handshake")
        return (
            f"rank {self.rank} could not set up its data connections with rank(s) {missing} "
            f"within the timeout (socket data plane at {self.endpoint}"
            + (f"; {'; '.join(dialled)}" if dialled else "") + f"; {cause})"
        )

    def stop_listening(self) -> None:
        """Close the listening socket: nobody can connect any more."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _dial(self, j: int, endpoint: str, now: float) -> _Handshake:
        host, port = endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex((host, int(port)))
        hs = _Handshake(sock, j, now, endpoint)
        if err not in (0, errno.EINPROGRESS):
            hs.connected = False
        hs.outbuf = HELLO.pack(HANDSHAKE_MAGIC, wire.PROTOCOL_VERSION, self.rank, j, hs.nonce)
        return hs

    def _accept(self, now: float) -> None:
        """Accept up to ACCEPT_BATCH connections, making room at the limit, and read
        each one's hello at once (see MAX_PENDING_HANDSHAKES)."""
        if self.listener is None or self._hs_sel is None:
            return
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._accepted:
                    self._evict(next(iter(self._accepted.values())))  # free a descriptor
                    continue
                return
            if len(self._accepted) >= MAX_PENDING_HANDSHAKES:
                self._make_room()
            sock.setblocking(False)
            hs = _Handshake(sock, NO_RANK, now)
            self._accepted[sock] = hs
            self._hs_sel.register(sock, selectors.EVENT_READ, hs)
            self._advance(hs)

    def _make_room(self) -> None:
        """Evict one accepted handshake (see MAX_PENDING_HANDSHAKES)."""
        victim = None
        for i, hs in enumerate(self._accepted.values()):
            if victim is None:
                victim = hs
            if hs.stage == "hello" and not hs.inbuf:
                victim = hs
                break
            if i >= EVICT_SCAN:
                break
        if victim is not None:
            self._evict(victim)

    def _evict(self, hs: _Handshake) -> None:
        self._drop(hs)
        self.strangers += 1

    def _evict_stale(self, now: float) -> None:
        """Close accepted connections that made no progress for HANDSHAKE_STEP_LIMIT."""
        while self._accepted:
            hs = next(iter(self._accepted.values()))
            if now - hs.last <= HANDSHAKE_STEP_LIMIT:
                return
            self._evict(hs)

    def _forget(self, hs: _Handshake) -> None:
        """Take ``hs`` out of the handshakes in progress."""
        self._accepted.pop(hs.sock, None)
        self._dialled.pop(hs.sock, None)
        if self._hs_sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._hs_sel.unregister(hs.sock)

    def _drop(self, hs: _Handshake) -> None:
        self._forget(hs)
        hs.sock.close()

    def _finish(self, hs: _Handshake) -> None:
        """A handshake completed: admit the connection as ``hs.peer_rank``'s lane."""
        self._forget(hs)
        self._admit(hs)

    def _send(self, hs: _Handshake, data: bytes) -> None:
        hs.outbuf += data
        try:
            n = hs.sock.send(hs.outbuf)
        except BlockingIOError:
            n = 0
        hs.outbuf = hs.outbuf[n:]

    def _step(self, hs: _Handshake, tokens: dict[int, str]) -> bool:
        """Advance one handshake; True when it is complete. Raises on a bad peer."""
        sock = hs.sock
        if not hs.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == errno.EINPROGRESS:
                return False
            if err:
                raise ConnectionRefusedError(err, os.strerror(err))
            hs.connected = True
        if hs.outbuf:
            self._send(hs, b"")
        while hs.stage != "done":
            need = {"hello": HELLO.size, "mac": MAC_SIZE, "status": 1}[hs.stage]
            try:
                data = sock.recv(need - len(hs.inbuf))
            except BlockingIOError:
                break
            if not data:
                raise ConnectionResetError("connection closed during the handshake")
            hs.inbuf += data
            if len(hs.inbuf) < need:
                break
            msg, hs.inbuf = bytes(hs.inbuf), bytearray()
            hs.last = _now()
            if hs.peer == NO_RANK:
                self._accepted.move_to_end(sock)
                self._server_step(hs, msg, tokens)
            else:
                self._client_step(hs, msg, tokens)
        return hs.stage == "done" and not hs.outbuf

    def _server_step(self, hs: _Handshake, msg: bytes, tokens: dict[int, str]) -> None:
        """One message from a connection we accepted: a hello, then (secret) its MAC."""
        client, server = hs.peer_rank, self.rank
        if hs.stage == "hello":
            self._check_hello(hs, msg)
            client = hs.peer_rank
            reply = HELLO.pack(HANDSHAKE_MAGIC, wire.PROTOCOL_VERSION, self.rank, client,
                               hs.nonce)
            if not self.token:
                hs.stage = "done"
                self._send(hs, reply + ACCEPT)
                return
            # Prove ourselves first, so that the client can trust our verdict on its proof.
            hs.stage = "mac"
            self._send(hs, reply + _mac(tokens[client], b"s", client, server, hs.peer_nonce,
                                        hs.nonce))
            return
        if not verify(msg, _mac(self.token, b"c", client, server, hs.peer_nonce,
                                             hs.nonce)):
            with contextlib.suppress(OSError):
                hs.sock.send(REFUSE)
            raise ValueError(f"bad handshake MAC from a connection claiming rank {client}")
        hs.stage = "done"
        self._send(hs, ACCEPT)

    def _client_step(self, hs: _Handshake, msg: bytes, tokens: dict[int, str]) -> None:
        """One message from the rank we dialled: its hello, its MAC (secret), its verdict."""
        client, server = self.rank, hs.peer
        if hs.stage == "hello":
            self._check_hello(hs, msg)
            hs.stage = "mac" if self.token else "status"
            return
        if hs.stage == "mac":
            if not verify(msg, _mac(self.token, b"s", client, server, hs.nonce,
                                                 hs.peer_nonce)):
                raise _Impostor("failed to prove it knows this rank's session token (its "
                                "handshake MAC is wrong): it is not that rank of this job")
            hs.stage = "status"
            self._send(hs, _mac(tokens[server], b"c", client, server, hs.nonce,
                                hs.peer_nonce))
            return
        if msg == ACCEPT:
            hs.stage = "done"
            return
        if msg == REFUSE and self.token:
            raise _Refused("proved itself and refused this rank's proof: the two hold "
                           "different session tokens")
        raise ValueError(f"handshake status {msg!r} from rank {server}" if msg != REFUSE
                         else f"rank {server} refused this connection (it already has one "
                              "claiming this rank: without SWARMFD_AUTH anyone can claim one)")

    def _check_hello(self, hs: _Handshake, msg: bytes) -> None:
        magic, version, sender, receiver, nonce = HELLO.unpack(msg)
        if magic != HANDSHAKE_MAGIC:
            raise ValueError(f"bad handshake magic {magic!r}")
        if version != wire.PROTOCOL_VERSION:
            raise ValueError(f"peer speaks swarmfd wire protocol version {version}, this "
                             f"process speaks {wire.PROTOCOL_VERSION}")
        if hs.peer == NO_RANK:  # we accepted: only higher ranks connect to us
            if receiver != self.rank or not self.rank < sender < self.world_size:
                raise ValueError(f"handshake from rank {sender} for rank {receiver}")
            if sender in self.lanes:
                with contextlib.suppress(OSError):
                    hs.sock.send(HELLO.pack(HANDSHAKE_MAGIC, wire.PROTOCOL_VERSION, self.rank,
                                            sender, hs.nonce) + REFUSE
                                 if not self.token else b"")
                raise ValueError(f"duplicate connection from rank {sender}")
        elif sender != hs.peer or receiver != self.rank:
            raise ValueError(f"expected rank {hs.peer}, the peer says it is rank {sender}")
        hs.peer_rank = sender
        hs.peer_nonce = nonce

    def _admit(self, hs: _Handshake) -> None:
        rank = hs.peer_rank
        sock = hs.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(sock, *self.keepalive)  # buffer sizes stay autotuned (docs/performance.md)
        lane = _Lane(rank, sock)
        self.lanes[rank] = lane
        lane.mask = selectors.EVENT_READ
        self.sel.register(sock, lane.mask, lane)

    # -- sending ------------------------------------------------------------------------

    def header(self, kind: int, sig: wire.Signature, src: int, tag: int, nbytes: int,
               group: int) -> tuple[bytes, bytes]:
        """The header of such a message, cut around the call's number (wire.cut_header)."""
        return wire.cut_header(kind, sig, src, tag, nbytes, 0, group)

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int,
             payload: Any, size: int, copy: bool, group: int = 0) -> None:
        """Send one message to ``dst`` now, or queue what the kernel did not take."""
        self.send_packed(dst, wire.pack_header(kind, sig, self.rank, seq, tag, size, 0, group),
                         payload, size, copy)

    def send_packed(self, dst: int, header: bytes, payload: Any, size: int,
                    copy: bool) -> bool:
        """:meth:`send` with a packed header; whether bytes to ``dst`` stay queued."""
        lane = self.lanes[dst]
        if lane.dead:
            return False  # the receive side reports the loss
        view = memoryview(payload).cast("B") if size else None
        if lane.out:
            lane.out.append([memoryview(header), False])
            if view is not None:
                self._queue(lane, view, copy)
            self._push(lane)
            return bool(lane.out)
        try:
            n = lane.sock.sendmsg([header, view]) if view is not None else lane.sock.send(header)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._lost(lane)
            return False
        if n == len(header) + size:
            return False  # all of it (the usual case): nothing queued, no mask to change
        if n < len(header):
            lane.out.append([memoryview(header)[n:], False])
            n = 0
        else:
            n -= len(header)
        if view is not None and n < size:
            self._queue(lane, view[n:], copy)
        self._update(lane)
        return True

    def _queue(self, lane: _Lane, view: memoryview, copy: bool) -> None:
        if copy or len(view) <= SMALL_SEND:
            lane.out.append([memoryview(bytes(view)), False])
        else:
            lane.out.append([view, True])
            lane.zc += 1

    def send_all(self, kind: int, sig: wire.Signature, body: bytes, group: int = 0) -> None:
        """Best effort: queue ``body`` with its header to every live peer (aborts, reports)."""
        header = wire.pack_header(kind, sig, self.rank, 0, 0, len(body), 0, group)
        for lane in self.lanes.values():
            if not lane.dead:
                lane.out.append([memoryview(header + body), False])
                self._push(lane)

    def _push(self, lane: _Lane) -> bool:
        """Send what the kernel takes from ``lane``'s queue; True on progress."""
        out = lane.out
        if not out or lane.dead:
            return False
        try:
            n = lane.sock.sendmsg([item[0] for item in list(out)[:MAX_IOV]])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self._lost(lane)
            return False
        sent = n
        while n:
            item = out[0]
            size = len(item[0])
            if n >= size:
                n -= size
                out.popleft()
                if item[1]:
                    lane.zc -= 1
            else:
                item[0] = item[0][n:]
                n = 0
        self._update(lane)
        return sent > 0

    def _push_all(self) -> None:
        for lane in self.lanes.values():
            if lane.out:
                self._push(lane)

    def unsent(self) -> list[int]:
        """Peers with any queued bytes: with no I/O thread, what stays queued moves only
        when this rank calls in again, and a peer may need it to finish this call."""
        return [lane.rank for lane in self.lanes.values() if lane.out and not lane.dead]

    def pending_bytes(self) -> bool:
        return any(lane.out and not lane.dead for lane in self.lanes.values())

    # -- receiving ----------------------------------------------------------------------

    def next_header(self, timeout: float, src: int = -1) -> wire.Header | None:
        """The next message's header (its payload must then be read with
        :meth:`read_payload`), or None after ``timeout`` seconds; drives sends."""
        if self.ready:
            return self._take()
        for lane in self.lanes.values():
            if lane.hdr is None and not lane.busy and not lane.dead:
                self._pump(lane)
        return self._progress(timeout, until_sent=False)

    def take(self, src: int, expected: bytes, nbytes: int) -> memoryview | None:
        """:meth:`Plane.take`: a view into the connection's buffer, when the message fits
        it. Reads up to TAKE_POLLS times (as the spinner allows); what it read and did
        not take stays in the buffer for the channel's receive."""
        lane = self.lanes.get(src)
        need = wire.HEADER_SIZE + nbytes
        if (lane is None or self.ready or lane.hdr is not None or lane.busy or lane.dead
                or need > RECV_BUFFER):
            return None
        start = lane.rstart
        looked = False
        polls = -1
        while lane.rend - start < need:
            if RECV_BUFFER - start < need:  # room for all of it: the start of the buffer
                lane.to_front()
                start = 0
            try:
                n = lane.sock.recv_into(lane.rview[lane.rend:])
            except (BlockingIOError, InterruptedError):
                if polls < 0:
                    polls = self.spinner.polls(TAKE_POLLS)
                polls -= 1
                if polls < 0:
                    return None
                looked = True
                continue
            except OSError:
                return None  # the receive finds the connection lost
            if n == 0:
                return None  # (end of file: the receive reads it again and reports it)
            lane.rend += n
        body = start + wire.HEADER_SIZE
        if lane.rview[start:body] != expected:
            return None
        lane.rstart = start + need
        if looked:
            self.spinner.caught()  # caught by looking again (see ShmPlane.take)
        return lane.rview[body:start + need]

    def _progress(self, timeout: float, until_sent: bool) -> wire.Header | None:
        """Drive sends and receives until a header is ready (returned), ``timeout``
        passed or, ``until_sent``, the queues are empty (None)."""
        end = _now() + timeout
        blocked = False
        while not self.ready:
            self._push_all()
            if until_sent and not self.unsent():
                return None
            wait = end - _now()
            if wait <= 0:
                return None
            if not until_sent and self.spinner.spin(self._poll):
                break
            self._select(wait)
            blocked = True
        if blocked and not until_sent:
            self.spinner.woke()
        return self._take()

    def _poll(self) -> bool:
        """Push queued sends and read every idle lane once, without waiting; True when a
        header is ready (a spinning wait's step)."""
        for lane in self.lanes.values():
            if lane.out:
                self._push(lane)
            if lane.hdr is None and not lane.busy and not lane.dead:
                self._pump(lane)
        return bool(self.ready)

    def _select(self, wait: float) -> bool:
        """One wait for readiness; pumps readable lanes and pushes writable ones."""
        progress = False
        for key, mask in self.sel.select(wait):
            lane = key.data
            if mask & selectors.EVENT_WRITE:
                progress |= self._push(lane)
            if not mask & selectors.EVENT_READ:
                continue
            if lane.busy:
                progress = True  # its payload reader takes it
            elif lane.hdr is not None:  # mute it until its payload is read, else every
                lane.muted = True  # wait would return at once
                self._update(lane)
            else:
                progress |= self._pump(lane)
        return progress

    def _take(self) -> wire.Header:
        lane = self.ready.popleft()
        hdr = lane.hdr
        assert hdr is not None
        lane.hdr = None
        self.current = lane
        return hdr

    def _pump(self, lane: _Lane) -> bool:
        """Read what is available into ``lane``'s buffer until a header is complete."""
        if lane.hdr is not None or lane.dead:
            return False
        if self._parse(lane):
            return True
        if lane.rstart and lane.rstart == lane.rend:
            lane.rstart = lane.rend = 0
        elif lane.rstart > RECV_BUFFER // 2:
            lane.to_front()
        try:
            n = lane.sock.recv_into(lane.rview[lane.rend:])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            n = 0
        if n == 0:
            self._lost(lane)
            return True
        lane.rend += n
        self._parse(lane)
        return True

    def _parse(self, lane: _Lane) -> bool:
        """Decode a complete header from ``lane``'s buffer; raise when it is not one."""
        if lane.rend - lane.rstart < wire.HEADER_SIZE:
            return False
        start = lane.rstart
        raw = lane.rview[start:start + wire.HEADER_SIZE]
        try:
            hdr = wire.unpack_header(raw)
            if hdr.src != lane.rank:
                raise ProtocolError(f"a header claims source rank {hdr.src}")
            if hdr.nbytes > wire.MAX_PAYLOAD or hdr.inline:
                raise ProtocolError(f"a header announces {hdr.nbytes} payload bytes "
                                    f"(at most {wire.MAX_PAYLOAD}, never inline)")
        except ProtocolError as exc:
            self._lost(lane)
            raise ProtocolError(
                f"rank {lane.rank} sent bytes that are not a swarmfd message on its data "
                f"connection ({exc}); the connection is dropped"
            ) from None
        lane.rstart += wire.HEADER_SIZE
        lane.hdr = hdr
        self.ready.append(lane)
        return True

    def read_payload(self, hdr: wire.Header, into: Any,
                     between: Callable[[], None], keep: bool = False) -> Any:
        """:meth:`Plane.read_payload` (``keep`` changes nothing here)."""
        lane = self.current
        assert lane is not None
        self.current = None
        n = hdr.nbytes
        # Uninitialised: bytearray(n) would zero it first (docs/performance.md).
        buf = np.empty(n, np.uint8) if into is None else None
        target = memoryview(buf if buf is not None else into).cast("B")
        got = min(n, lane.rend - lane.rstart)
        if got:
            target[:got] = lane.rview[lane.rstart:lane.rstart + got]
            lane.rstart += got
        if lane.muted:
            lane.muted = False
            self._update(lane)
        if got < n:
            lane.busy = True
            try:
                self._read_rest(lane, target, got, n, between)
            finally:
                lane.busy = False
        if not lane.dead:
            self._parse(lane)
        return buf

    def _read_rest(self, lane: _Lane, target: memoryview, got: int, n: int,
                   between: Callable[[], None]) -> None:
        sock = lane.sock
        last = _now()
        k = -1

        def read_once() -> int:
            """Bytes read (> 0), none yet (-1), or the connection lost (0)."""
            try:
                return sock.recv_into(target[got:])
            except (BlockingIOError, InterruptedError):
                return -1
            except OSError:
                return 0

        def poll() -> bool:  # a spinning wait's step
            nonlocal k
            self._push_all()
            k = read_once()
            return k >= 0

        lowat = 1  # the socket's SO_RCVLOWAT (see LOWAT_BYTES)
        try:
            while got < n:
                if not lane.dead:
                    k = read_once()
                    if k < 0:
                        self.spinner.spin(poll)  # k: what the poll's last read gave
                    if k > 0:
                        got += k
                        continue
                    if k == 0:
                        self._lost(lane)
                    else:  # about to block: not before a good part of the rest is here
                        want = min(n - got, LOWAT_BYTES)
                        if want != lowat and (lowat > 1 or want >= LOWAT_MIN):
                            lowat = _set_lowat(sock, want)
                self._push_all()
                if _now() - last >= self.wait_slice:
                    between()
                    last = _now()
                self._select(self.wait_slice)
        finally:
            if lowat != 1 and not lane.dead:
                _set_lowat(sock, 1)

    def wait(self, timeout: float) -> wire.Header | None:
        """:meth:`Plane.wait`: a peer may be flushing towards this rank meanwhile."""
        return self._progress(timeout, until_sent=True)

    def check_lost(self) -> None:
        """Losses are recorded as the engine reads (EOF, reset): nothing to poll."""

    # -- bookkeeping --------------------------------------------------------------------

    def _update(self, lane: _Lane) -> None:
        if lane.dead:
            return
        mask = (0 if lane.muted else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if lane.out else 0)
        if mask != lane.mask:
            if lane.mask == 0:
                self.sel.register(lane.sock, mask, lane)
            elif mask == 0:
                self.sel.unregister(lane.sock)
            else:
                self.sel.modify(lane.sock, mask, lane)
            lane.mask = mask

    def _lost(self, lane: _Lane) -> None:
        """``lane``'s connection closed or broke: no more data will come from it."""
        if lane.dead:
            return
        lane.dead = True
        if lane.mask:
            self.sel.unregister(lane.sock)
            lane.mask = 0
        # End our side at once: a leaving peer waits in close() for it, so it exits
        # before the ranks that lost it raise, and the launcher names it first.
        with contextlib.suppress(OSError):
            lane.sock.shutdown(socket.SHUT_WR)
        lane.out.clear()
        lane.zc = 0
        self.owner.lost.setdefault(lane.rank, _now())

    def close(self, linger: float) -> None:
        """Give queued sends up to ``linger`` seconds, then close every socket."""
        if self.closed:
            return
        self.closed = True
        end = _now() + linger
        while self.pending_bytes() and _now() < end:
            self._push_all()
            if self.pending_bytes():
                self.sel.select(min(0.05, max(0.0, end - _now())))
        self.stop_listening()
        # Closing with unread bytes sends a reset, destroying what the peer has not read
        # (an abort just sent): end our side and read until the peers end theirs.
        live = [lane for lane in self.lanes.values() if not lane.dead]
        for lane in live:
            with contextlib.suppress(OSError):
                lane.sock.shutdown(socket.SHUT_WR)
            lane.out.clear()
            lane.hdr = None
            lane.muted = False
            self._update(lane)  # read interest only
        end = min(end, _now() + CLOSE_DRAIN)
        while live and _now() < end:
            for key, _ in self.sel.select(min(0.05, max(0.0, end - _now()))):
                lane = key.data
                try:
                    n = lane.sock.recv_into(lane.rview)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0
                if n == 0:
                    self._lost(lane)
            live = [lane for lane in live if not lane.dead]
        for lane in self.lanes.values():
            lane.sock.close()
        self.sel.close()

