"""The ZeroMQ plane: a bound ROUTER that only sends, one DEALER that only receives.

Each rank sends to peer j through its ROUTER by j's routing id (security.routing_id),
and receives on one DEALER connected to every peer's ROUTER (libzmq fair-queues them;
docs/performance.md). A message's source is its connection's ``X-Rank`` (announced by the
peer's ROUTER with :func:`~swarmfd.comm.security.server_proof`), never a header's claim:
a connection that announced no peer is dropped, a header claiming another is a protocol
error. ZAP admits each DEALER connection once (:class:`~swarmfd.comm.security.Authenticator`).

The bound ROUTER faces strangers as long as the job runs (unbind would drop its
connections): it refuses frames over MAX_HANDSHAKE_FRAME, drops connections not
authenticated within HANDSHAKE_IVL_MS, and binds only after the rendezvous (which
shares libzmq's I/O thread). A message is a header with its payload inline (one frame)
up to INLINE_MAX_BYTES, else two frames (copied up to COPY_MAX_BYTES, zero-copy above).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ...errors import AuthenticationError, ProtocolError, RendezvousError, RendezvousTimeout
from .. import spin, wire
from ..plane import PeerInfo, PlaneOwner, reserve_port
from ..security import (
    DATA_ATTEMPTS,
    ZAP_DATA,
    Authenticator,
    Security,
    connection_token,
    keepalive,
    routing_id,
    server_proof,
    stranger_facing,
)
from ..spin import Spinner

__all__ = ["ZmqPlane"]

#: A blocking receive returns at least this often (ms) to check deadlines and lost peers.
WAIT_SLICE_MS = 50
WAIT_SLICE = WAIT_SLICE_MS / 1000
#: Payloads up to this size travel inline (one frame with the header, copied).
INLINE_MAX_BYTES = 64 << 10
#: Larger payloads up to this size are copied into their own frame (one memcpy without
#: the GIL); larger ones go zero-copy (docs/performance.md).
COPY_MAX_BYTES = 512 << 10
#: Largest frame the DEALER takes: a header and MAX_PAYLOAD plus CURVE's overhead.
MAX_FRAME = wire.HEADER_SIZE + wire.MAX_PAYLOAD + 4096
#: Largest frame the bound ROUTER takes: it only sends, so only handshakes arrive (a
#: PLAIN hello is under 600 bytes, CURVE's under 400).
MAX_HANDSHAKE_FRAME = 4096
#: Messages libzmq queues from one peer before it stops reading that connection: what a
#: peer can pin in this rank's memory, besides the channel's stash (docs/security.md).
RX_HWM = 64
#: Frames left on the bound socket that one check_lost reads and drops (it runs every
#: wait slice; the socket queues one message a connection, RCVHWM=1).
STRANGER_READS = 256
#: Options and flags as plain ints: pyzmq's enums cost twice the time on the receive
#: path (docs/performance.md).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
#: libzmq's send and receive without pyzmq's wrapper (it only handles DRAFT arguments):
#: a third less per frame, and every message is two (docs/performance.md).
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_unpack_header = wire.unpack_header
_pack_header = wire.pack_header
_FLAG_INLINE = wire.FLAG_INLINE
_join = b"".join
_now = time.monotonic
#: The DEALER monitor's events, as a refused connection's history tells them.
_EVENT_NAMES = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "authenticated",
                zmq.EVENT_DISCONNECTED: "closed",
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol)",
                zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused"}
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


#: The first delay (ms, doubling up to 0.1 s) before the DEALER dials a peer again: the
#: peer binds as it leaves the rendezvous, maybe after this rank dialled.
RECONNECT_FIRST_MS = 5


class ZmqPlane:
    """The ZeroMQ data plane (see the module docstring)."""

    name = "zmq"
    zero_copy_recv = True
    shares_memory = False
    reads_peers = False
    io_thread = True
    inline_max = INLINE_MAX_BYTES

    def __init__(self, t: PlaneOwner, ctx: zmq.Context, rank: int, world_size: int,
                 timeout: float, bind_host: str, security: Security | None,
                 auth: Authenticator | None, token: str = "",
                 avoid: Collection[int] = ()) -> None:
        self.t = t
        self.rank = rank
        self.world_size = world_size
        self.security = security
        self.auth = auth
        self.ctx = ctx
        self.router = self._router(ctx, security, timeout, token, rank)
        self.reserved: socket.socket | None = reserve_port(bind_host, avoid)
        self.endpoint = f"tcp://{bind_host}:{self.reserved.getsockname()[1]}"
        # Counts authenticated peers and failed accepts, not failed handshakes: a storm
        # of strangers would make this rank read thousands a second while it sets up.
        self.router_monitor: zmq.Socket | None = self.router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_ACCEPT_FAILED)
        self.inbound = 0
        self.accept_failed = 0
        self.dropped = 0  # stranger frames read off the bound socket (_drop_strangers)
        #: Each rank's routing id (security.routing_id; the peers' are set in connect()).
        self.ids = {j: b"%d" % j for j in range(world_size)}
        self.ids[rank] = routing_id(token, rank)
        #: The one receiving socket, connected to every peer's ROUTER in connect().
        self.rx = ctx.socket(zmq.DEALER)
        self.rx.setsockopt(zmq.ROUTING_ID, self.ids[rank])
        self.rx.setsockopt(zmq.RCVHWM, RX_HWM)
        self.rx.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self.rx.setsockopt(zmq.RCVTIMEO, WAIT_SLICE_MS)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.setsockopt(zmq.RECONNECT_IVL, RECONNECT_FIRST_MS)
        self.rx.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
        keepalive(self.rx)
        self.rx_monitor: zmq.Socket | None = None
        self.peers: list[int] = []
        #: A connection's X-Rank (as Frame.get returns it) -> the peer's rank.
        self.rank_of: dict[str, int] = {}
        #: Messages dropped because their connection announced no peer's rank.
        self.unknown = 0
        #: A peer's endpoint (as the DEALER's monitor reports it) -> the peer's rank.
        self.at: dict[bytes, int] = {}
        self.connected: set[int] = set()
        #: The DEALER monitor's events per peer during setup (seconds since connect(),
        #: event): told when a peer refuses this rank's token.
        self.history: dict[int, list[tuple[float, str]]] = {}
        self.setup_start = 0.0
        #: peer -> this rank's attempt at its data connection (its one-time token's index).
        self.attempts: dict[int, int] = {}
        self.trackers: list[tuple[int, zmq.MessageTracker]] = []
        #: The frame whose header next_header returned, and whether a payload frame follows.
        self.raw: memoryview | bytes = b""
        self.more = False
        #: A frame take read and did not want: next_header returns it first.
        self.back: zmq.Frame | None = None
        self.spinner = Spinner()

    @staticmethod
    def _router(ctx: zmq.Context, sec: Security | None, timeout: float, token: str,
                rank: int) -> zmq.Socket:
        """The ROUTER that sends: authenticated (CURVE, or PLAIN with one-time tokens),
        facing strangers, its receive queue minimal."""
        router = ctx.socket(zmq.ROUTER)
        if sec is not None:
            if sec.encrypt:
                sec.curve_server(router, ZAP_DATA)
            else:
                router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DATA.encode())
                router.setsockopt(zmq.PLAIN_SERVER, 1)
        stranger_facing(router, MAX_HANDSHAKE_FRAME)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.RCVHWM, 1)  # nothing legitimate arrives: keep it minimal
        router.setsockopt(zmq.LINGER, int(min(timeout, 5.0) * 1000))
        keepalive(router)
        # Its rank, with a proof, on every message it sends; before bind, which copies it.
        router.setsockopt(zmq.METADATA, f"X-Rank:{server_proof(token, rank)}".encode())
        return router

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
        """Connect the DEALER to every peer and wait until every connection authenticated
        and this ROUTER routes to every peer's routing id (:meth:`_probe`). Routes count,
        not handshakes: a replay ZAP admitted first lacks the routing id. A peer that
        refuses this rank's one-time token is dialled with the next (DATA_ATTEMPTS)."""
        t = self.t
        rx = self.rx
        self.setup_start = _now()
        self._bind()
        by_rank = {p.rank: p for p in peers}
        self.rx_monitor = rx.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
                                                | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for peer in peers:
            if peer.rank == self.rank:
                continue
            self._client(rx, peer)  # read by connect(): each connection has its own
            rx.connect(peer.endpoint)
            self.peers.append(peer.rank)
            self.rank_of[server_proof(peer.token, peer.rank)] = peer.rank
            self.at[peer.endpoint.encode()] = peer.rank
            self.ids[peer.rank] = routing_id(peer.token, peer.rank)
        want = self.world_size - 1
        routed: set[int] = set()
        while len(self.connected) < want or len(routed) < want:
            self.check_lost()
            self._read_router_monitor()
            for p in self.peers:
                if p not in routed and self._probe(p):
                    routed.add(p)
            for p in sorted(t.refused):
                if self._redial(by_rank[p]):
                    t.refused.discard(p)
                    t.lost.pop(p, None)  # the refusal's: the peer is there
            refused = sorted(t.refused)
            if refused:
                raise AuthenticationError(
                    f"rank {self.rank}: the data socket of rank {refused[0]} "
                    f"({t.where(refused[0])}) refused this rank's connection token "
                    f"({self.attempts.get(refused[0], 0) + 1} attempt(s), each with a token "
                    "of its own). A token is valid once: were they replayed by someone "
                    "reading the network before this rank's own connection used them? On "
                    "such a network set SWARMFD_ENCRYPT=1. This rank's connection to it: "
                    + ", ".join(f"{what} at {at:.3f} s"
                                for at, what in self.history.get(refused[0], []))
                )
            lost = sorted(set(t.lost) - self.connected)
            if lost or _now() > deadline:
                missing = sorted(set(self.peers) - self.connected)
                raise RendezvousTimeout(
                    f"rank {self.rank} could not set up its data connections within the timeout "
                    f"(zmq data plane at {self.endpoint}): "
                    + (f"lost rank(s) {lost} during setup; " if lost else "")
                    + f"connections to rank(s) {missing} not authenticated; "
                    f"{len(routed)} of {want} peers connected to this rank ("
                    f"{self.inbound} handshake(s) completed)"
                    + (f"; {self.auth.refused} stranger handshake(s) refused"
                       if self.auth else "")
                    + (f"; accepting a connection failed {self.accept_failed} time(s) (out "
                       "of descriptors: a flood of strangers?)" if self.accept_failed else "")
                )
            time.sleep(0.002)
        self._stop_router_monitor()  # from now on only strangers' events: stop it

    def _bind(self) -> None:
        """Bind the ROUTER to the port held since init."""
        reserved, self.reserved = self.reserved, None
        if reserved is None:
            return
        reserved.close()
        try:
            self.router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            raise RendezvousError(
                f"rank {self.rank} cannot bind its zmq data socket at {self.endpoint}, the "
                f"port it held since init ({exc}): another process took it in between"
            ) from None

    def _probe(self, peer: int) -> bool:
        """Whether this ROUTER routes to ``peer``'s routing id: an empty frame sent to it
        (ROUTER_MANDATORY refuses an id no connection holds), which its receiver skips."""
        try:
            _send(self.router, self.ids[peer], _SNDMORE)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        _send(self.router, b"", 0)
        return True

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
        # Read the monitors empty and stop them first: else disable_monitor can block
        # (libzmq#3575).
        self.check_lost()
        self._stop_router_monitor()
        mon, self.rx_monitor = self.rx_monitor, None
        if mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.rx.disable_monitor()
            mon.close(linger=0)
        if self.reserved is not None:
            self.reserved.close()
            self.reserved = None
        self.rx.close(linger=0)
        self.router.close(linger=int(linger * 1000))

    def _redial(self, peer: PeerInfo) -> bool:
        """Dial ``peer`` again with the next one-time token (PLAIN only: a CURVE refusal
        is a wrong key); False when none is left."""
        sec = self.security
        attempt = self.attempts.get(peer.rank, 0) + 1
        if sec is None or sec.encrypt or attempt >= DATA_ATTEMPTS:
            return False
        self.attempts[peer.rank] = attempt
        with contextlib.suppress(zmq.ZMQError):  # (not connected any more: fine)
            self.rx.disconnect(peer.endpoint)
        self._client(self.rx, peer)
        self.rx.connect(peer.endpoint)
        return True

    def _client(self, sock: zmq.Socket, peer: PeerInfo) -> None:
        """Credentials of this rank's connection to ``peer``'s ROUTER (libzmq copies a
        socket's options into each connection when connect() is called)."""
        sec = self.security
        if sec is None:
            return
        if sec.encrypt:
            sec.curve_client(sock)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, b"%d" % self.rank)
            sock.setsockopt(zmq.PLAIN_PASSWORD, connection_token(
                peer.token, self.rank, peer.rank, self.attempts.get(peer.rank, 0)).encode())

    def header(self, kind: int, sig: wire.Signature, src: int, tag: int, nbytes: int,
               group: int) -> tuple[bytes, bytes]:
        """:meth:`Plane.header`, marked inline up to INLINE_MAX_BYTES."""
        return wire.cut_header(kind, sig, src, tag, nbytes,
                               _FLAG_INLINE if nbytes <= INLINE_MAX_BYTES else 0, group)

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int,
             payload: Any, size: int, copy: bool, group: int = 0) -> None:
        self.send_packed(dst, _pack_header(
            kind, sig, self.rank, seq, tag, size,
            _FLAG_INLINE if size <= INLINE_MAX_BYTES else 0, group), payload, size, copy)

    def send_packed(self, dst: int, header: bytes, payload: Any, size: int,
                    copy: bool) -> bool:
        """:meth:`Plane.send_packed`: inline, ``header`` and ``payload`` joined in one
        frame; else two frames, the payload zero-copy (and tracked) above COPY_MAX_BYTES
        unless ``copy``."""
        if not self._route(dst):
            return False
        if size <= INLINE_MAX_BYTES:
            try:
                frame = _join((header, payload))
            except TypeError:
                frame = header + memoryview(payload).tobytes()
            _send(self.router, frame)
            return False
        router = self.router
        _send(router, header, _SNDMORE)
        if copy or size <= COPY_MAX_BYTES:
            _send(router, payload)
            return False
        tracker = _send(router, payload, 0, False, True)
        self.trackers.append((dst, tracker))
        return True

    def _route(self, dst: int) -> bool:
        """Send ``dst``'s routing id (a message's first frame); False, ``dst`` recorded
        as lost, when no connection holds it (ROUTER_MANDATORY)."""
        try:
            _send(self.router, self.ids[dst], _SNDMORE)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.t.lost.setdefault(dst, _now())  # its connection is gone
            return False
        return True

    def send_all(self, kind: int, sig: wire.Signature, body: bytes, group: int = 0) -> None:
        """Best effort: ``body`` as one inline frame to every peer (aborts, reports)."""
        header = wire.pack_header(kind, sig, self.rank, 0, 0, len(body), wire.FLAG_INLINE,
                                  group)
        for dst in self.peers:
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart([self.ids[dst], header + body], zmq.NOBLOCK)

    def unsent(self) -> list[int]:
        if not self.trackers:  # the usual case: nothing was sent without a copy
            return []
        self.trackers = [(dst, tr) for dst, tr in self.trackers if not tr.done]
        return [dst for dst, _ in self.trackers]

    def wait(self, timeout: float) -> wire.Header | None:
        if self.trackers:
            with contextlib.suppress(zmq.NotDone):
                self.trackers[0][1].wait(timeout)
        return None

    def _recv(self, timeout: float) -> zmq.Frame | None:
        """The next frame from any peer, or None after ``timeout``: polls ZMQ_EVENTS for
        the spin budget (a non-blocking recv on an empty socket raises, slowly), then
        blocks in the DEALER. Without polling a one-slice wait is one blocking recv:
        reading ZMQ_EVENTS costs a poll() system call (docs/performance.md)."""
        rx = self.rx
        if not spin.ENABLED and timeout == WAIT_SLICE:
            return self._recv_frame(0)
        if not rx.get(_EVENTS) & _POLLIN:
            if timeout <= 0:
                return None
            if not self.spinner.spin(lambda: bool(rx.get(_EVENTS) & _POLLIN)):
                if timeout == WAIT_SLICE:
                    frame = self._recv_frame(0)
                    if frame is not None:
                        self.spinner.woke()
                    return frame
                if not rx.poll(int(timeout * 1000)):
                    return None
                self.spinner.woke()
        else:
            self.spinner.caught()
        return self._recv_frame(_NOBLOCK)

    def _recv_frame(self, flags: int) -> zmq.Frame | None:
        """One recv on the DEALER: blocking for at most WAIT_SLICE (RCVTIMEO), or with
        NOBLOCK not at all; None when nothing came."""
        try:
            return self.rx.recv(flags, copy=False)
        except zmq.Again:
            return None

    def next_header(self, timeout: float, src: int = -1) -> wire.Header | None:
        """:meth:`Plane.next_header` (``src`` is ignored: there is one queue); a header
        that is not a swarmfd message or claims another source is a ProtocolError."""
        if self.back is not None:  # a frame take read and put back
            frame, self.back = self.back, None
        elif timeout == WAIT_SLICE and not spin.ENABLED:  # _recv's first case, inline
            try:
                frame = _recv(self.rx, 0, False)
            except zmq.Again:
                return None
        else:
            frame = self._recv(timeout)
            if frame is None:
                return None
        peer = self.rank_of.get(frame.get(b"X-Rank"))
        if peer is None:  # whoever bound a lost peer's port: dropped, never parsed
            self._drain()
            self.unknown += 1
            return None
        raw = memoryview(frame)  # (not frame.buffer, which is slower)
        self.more = more = frame.more  # (no getsockopt)
        try:
            hdr = _unpack_header(raw)
            if hdr.src != peer:
                raise ProtocolError(f"a header claims source rank {hdr.src}")
            if hdr.inline and more:
                raise ProtocolError("an inline message with a second frame")
        except ProtocolError as exc:
            if not len(raw) and not more:
                return None  # the peer's probe of its route to this rank (connect())
            self._drain()
            raise ProtocolError(
                f"rank {peer} sent bytes that are not a swarmfd message on its data "
                f"connection ({exc})"
            ) from None
        self.raw = raw
        return hdr

    def take(self, src: int, expected: bytes, nbytes: int) -> memoryview | None:
        """:meth:`Plane.take` of an inline message that is the next frame within one
        wait slice; another frame is put back for :meth:`next_header`."""
        if self.back is not None or nbytes > INLINE_MAX_BYTES:
            return None
        frame = self._recv(WAIT_SLICE)
        if frame is None:
            return None
        raw = memoryview(frame)
        if (len(raw) != wire.HEADER_SIZE + nbytes or frame.more
                or raw[:wire.HEADER_SIZE] != expected
                or self.rank_of.get(frame.get(b"X-Rank")) != src):
            self.back = frame
            return None
        return raw[wire.HEADER_SIZE:]

    def read_payload(self, hdr: wire.Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        """:meth:`Plane.read_payload`: ``keep`` gives bytes, as a Frame must not outlive
        the receive that returned it."""
        raw = self.raw
        self.raw = b""
        rx = self.rx
        if hdr.inline:
            inline = raw[wire.HEADER_SIZE:]
            if into is None:
                return bytes(inline) if keep else inline
            memoryview(into).cast("B")[:] = inline
            return None
        if not self.more:
            if into is None and hdr.nbytes == 0:
                return b""
            raise ProtocolError(f"{self.t.activity}: rank {hdr.src} sent a header without "
                                "payload")
        if into is not None:
            got = rx.recv_into(into)
            self._drain()
            if got != hdr.nbytes:
                raise ProtocolError(f"{self.t.activity}: rank {hdr.src} sent {got} bytes, "
                                    f"expected {hdr.nbytes}")
            return None
        data = rx.recv(copy=False) if hdr.nbytes > INLINE_MAX_BYTES and not keep else (
            rx.recv())
        self._drain()
        return data

    def _drop_strangers(self) -> None:
        """Read and drop what reached the bound socket (a stranger's: no peer sends to it):
        left unread, each message keeps its closed connection's pipe alive in libzmq, and
        memory grows while strangers connect (docs/security.md)."""
        router = self.router
        for _ in range(STRANGER_READS):
            try:
                router.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.dropped += 1

    def _drain(self) -> None:
        """Read and drop the rest of the current message."""
        rx = self.rx
        while rx.get(_RCVMORE):
            rx.recv()

    def check_lost(self) -> None:
        """Record peers whose connection closed or refused us (the DEALER's monitor names
        the endpoint), and drop what strangers left on the bound socket."""
        self._drop_strangers()
        mon = self.rx_monitor
        if mon is None:
            return
        while True:
            try:
                msg = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            got = parse_monitor_message(msg)
            peer = self.at.get(got["endpoint"])
            if peer is None:
                continue  # not a peer's endpoint: cannot happen, the DEALER dials only them
            event = got["event"]
            if self.router_monitor is not None:  # still setting up: keep the story
                trail = self.history.setdefault(peer, [])
                if len(trail) < 16:
                    trail.append((_now() - self.setup_start, _EVENT_NAMES.get(event, str(event))))
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected.add(peer)
            elif event == zmq.EVENT_DISCONNECTED:
                if self.router_monitor is not None and peer in self.attempts and \
                        peer not in self.connected:
                    continue  # the close of a refused attempt, redialled (connect())
                self.t.lost.setdefault(peer, _now())
            elif event & HANDSHAKE_FAILED:  # refused: no data will ever flow
                self.t.lost.setdefault(peer, _now())
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.t.refused.add(peer)
