"""The socket data plane (swarmfd/comm/planes/socket.py): selection, setup, handshake,
framing, flow.

Most tests build two :class:`Transport` objects in this process (one thread
connects each, as two ranks would) and talk to them directly, so that a test can
write raw bytes where a peer or a stranger would.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth.thread

from swarmfd.comm import handshake, security, transport, wire
from swarmfd.comm.plane import PeerInfo
from swarmfd.comm.planes import socket as lanes
from swarmfd.config import data_plane
from swarmfd.errors import ConfigError, MismatchError, PeerLostError, ProtocolError

from .support.harness import LOST_PEER_LIMIT, RankCtx, Ranks, allowed, run_ranks_raw, stall_meter
from .support.threadranks import connect_transports, peer_info

SECRET = b"s" * 40
SIG = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 5, wire.NO_ROOT, 1, 0)


# -- selection ------------------------------------------------------------------------------


def test_the_socket_plane_is_the_default_and_encryption_selects_zmq() -> None:
    assert data_plane({}) == "socket"
    assert data_plane({"SWARMFD_DATA_PLANE": " ZMQ "}) == "zmq"
    assert data_plane({"SWARMFD_ENCRYPT": "1"}) == "zmq"
    assert data_plane({"SWARMFD_ENCRYPT": "1", "SWARMFD_DATA_PLANE": "zmq"}) == "zmq"
    assert data_plane({"SWARMFD_ENCRYPT": "0", "SWARMFD_DATA_PLANE": "socket"}) == "socket"


def test_an_unknown_data_plane_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"SWARMFD_DATA_PLANE='udp' is invalid: expected "
                                          r"'socket' .* or 'zmq'"):
        data_plane({"SWARMFD_DATA_PLANE": "udp"})


def test_the_socket_plane_cannot_encrypt() -> None:
    with pytest.raises(ConfigError, match="SWARMFD_DATA_PLANE=socket cannot be combined with "
                                          "SWARMFD_ENCRYPT=1: the socket data plane does not "
                                          "encrypt"):
        data_plane({"SWARMFD_DATA_PLANE": "socket", "SWARMFD_ENCRYPT": "1"})


def _plane_of_rank(ctx: RankCtx) -> str:
    os.environ["SWARMFD_DATA_PLANE"] = "zmq" if ctx.rank == 1 else "socket"
    try:
        ctx.init()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "joined"


def test_ranks_on_different_data_planes_refuse_to_start() -> None:
    with Ranks(_plane_of_rank, 2, group_timeout=15.0, init=False) as ranks:
        out = ranks.results(timeout=40)
    assert set(out) == {0, 1}
    for r, text in out.items():
        assert text.startswith("RendezvousError") and "data plane mismatch: rank 1 uses " \
            "SWARMFD_DATA_PLANE='zmq', rank 0 uses SWARMFD_DATA_PLANE='socket'" in text, (r, text)


def _which_plane(rank: int, world: int) -> str:
    from swarmfd import group

    t = group.current().transport
    assert t is not None
    return t.plane


def test_a_bad_data_plane_setting_stops_init_with_a_config_error() -> None:
    out = run_ranks_raw(_which_plane, 2, env={"SWARMFD_TRANSPORT": "tcp",
                                              "SWARMFD_DATA_PLANE": "pigeon"}, timeout=60)
    assert set(out) == {0, 1}
    assert all(not ok and "ConfigError" in tb and "SWARMFD_DATA_PLANE='pigeon'" in tb
               for ok, tb in out.values()), out


# -- an in-process pair of transports -------------------------------------------------------


class Endpoint:
    """A rank's transport as these tests use it: messages of the world group (id 0) on its
    socket plane, through its channel (the message layer)."""

    def __init__(self, t: transport.Transport) -> None:
        self.t = t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.t, name)

    @property
    def ch(self) -> lanes.SocketPlane:
        assert isinstance(self.t.tcp, lanes.SocketPlane)
        return self.t.tcp

    @property
    def stash(self) -> dict[Any, Any]:
        return self.t.channel.stash

    def send(self, dst: int, sig: wire.Signature, seq: int, tag: int, payload: Any = b"",
             **kw: Any) -> None:
        self.t.channel.send(self.t.tcp, dst, sig, 0, seq, tag, payload, **kw)

    def recv(self, src: int, sig: wire.Signature, seq: int, tag: int, nbytes: int,
             into: Any = None) -> Any:
        return self.t.channel.recv(self.t.tcp, src, sig, 0, seq, tag, nbytes, into)

    def flush(self) -> None:
        self.t.channel.flush()


def _make(rank: int, sec: security.Security | None, timeout: float = 10.0) -> Endpoint:
    return Endpoint(transport.Transport(rank, 2, timeout, "127.0.0.1", sec, "socket"))


def _info(t: Endpoint) -> PeerInfo:
    return peer_info(t.t)


def _connect_all(ts: list[Endpoint], timeout: float = 10.0) -> None:
    connect_transports([e.t for e in ts], timeout)


@contextlib.contextmanager
def _meshed(ts: list[Endpoint]) -> Iterator[list[Endpoint]]:
    """``ts`` connected to each other, closed at the end."""
    try:
        _connect_all(ts)
        yield ts
    finally:
        for t in ts:
            t.close(linger=0)


@pytest.fixture(params=["secret", "no-auth"])
def pair(request: pytest.FixtureRequest) -> Iterator[list[Endpoint]]:
    sec = security.Security.from_secret(SECRET, False) if request.param == "secret" else None
    with _meshed([_make(0, sec), _make(1, sec)]) as ts:
        yield ts


def _port(t: Endpoint) -> int:
    return int(t.endpoint.rsplit(":", 1)[1])


def _listening(t: Endpoint, timeout: float = 10.0) -> int:
    """``t``'s data port, once its setup (running on another thread) listens there: the
    socket plane listens only while it connects the mesh."""
    deadline = time.monotonic() + timeout
    while not t.ch.listened_at:
        assert time.monotonic() < deadline, "the data port never listened"
        time.sleep(0.005)
    return _port(t)


def _lane_sock(t: Endpoint, peer: int) -> socket.socket:
    ch = t.ch
    assert isinstance(ch, lanes.SocketPlane)
    return ch.lanes[peer].sock


def test_the_listening_port_is_closed_after_setup(pair: list[Endpoint]) -> None:
    for t in pair:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", _port(t)), timeout=2).close()


def _stranger(port: int, payload: bytes) -> bytes:
    """Connect, send ``payload``, return what came back before the server closed."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    got = b""
    try:
        s.sendall(payload)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server already dropped it
            return got
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return got
            got += chunk
    except (ConnectionResetError, TimeoutError):
        return got
    finally:
        s.close()


@pytest.mark.parametrize("auth", ["secret", "no-auth"])
def test_strangers_during_setup_are_refused_and_counted(auth: str) -> None:
    sec = security.Security.from_secret(SECRET, False) if auth == "secret" else None
    t0, t1 = _make(0, sec), _make(1, sec)
    peers = [_info(t0), _info(t1)]
    errors: list[BaseException] = []

    def setup0() -> None:
        try:
            t0.connect(peers, time.monotonic() + 20)
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=setup0)
    th.start()
    try:
        port = _listening(t0)
        replies = [
            _stranger(port, os.urandom(300)),  # garbage
            _stranger(port, b"GET / HTTP/1.0\r\n\r\n"),
            # a well-formed hello claiming a rank that does not exist
            _stranger(port, handshake.HELLO.pack(lanes.HANDSHAKE_MAGIC, wire.PROTOCOL_VERSION, 7,
                                             0, os.urandom(16))),
        ]
        if sec is not None:
            # rank 1's hello, then a MAC made with the wrong token
            hello = handshake.HELLO.pack(lanes.HANDSHAKE_MAGIC, wire.PROTOCOL_VERSION, 1, 0,
                                     os.urandom(16))
            replies.append(_stranger(port, hello + b"\0" * handshake.MAC_SIZE))
        # a silent stranger holds a connection open while the real rank 1 joins
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        # A stranger whose hello is not a valid one gets nothing at all; one that claims a
        # real rank gets the server's hello and proof (keyed with the claimed rank's
        # token: worthless to it) and, after its wrong MAC, the explicit refusal.
        assert replies[:3] == [b"", b"", b""], replies
        if sec is not None:
            assert len(replies[3]) == handshake.HELLO.size + handshake.MAC_SIZE + 1, replies[3]
            assert replies[3].endswith(lanes.REFUSE)
        t1.connect(peers, time.monotonic() + 20)
        th.join(20)
        assert not errors, errors
        silent.close()
        ch = t0.ch
        assert isinstance(ch, lanes.SocketPlane)
        assert ch.strangers >= len(replies), ch.strangers
        assert set(ch.lanes) == {1}
        # ... and the real pair works.
        t1.send(0, SIG, 1, 0, b"\1\2\3\4")
        assert bytes(t0.recv(1, SIG, 1, 0, 4)) == b"\1\2\3\4"
    finally:
        th.join(25)
        t0.close(linger=0)
        t1.close(linger=0)


def test_a_stranger_with_the_wrong_token_is_refused_by_hmac() -> None:
    """A client that knows the protocol but not rank 0's token: its MAC fails."""
    sec = security.Security.from_secret(SECRET, False)
    t0 = _make(0, sec)
    try:
        threading.Thread(target=lambda: _swallow(t0), daemon=True).start()
        s = socket.create_connection(("127.0.0.1", _listening(t0)), timeout=5)
        nonce_c = os.urandom(16)
        s.sendall(handshake.HELLO.pack(lanes.HANDSHAKE_MAGIC, wire.PROTOCOL_VERSION, 1, 0, nonce_c))
        reply = b""
        while len(reply) < handshake.HELLO.size:
            reply += s.recv(handshake.HELLO.size - len(reply))
        magic, _, sender, _, nonce_s = handshake.HELLO.unpack(reply)
        assert magic == lanes.HANDSHAKE_MAGIC and sender == 0
        s.sendall(lanes._mac("not-the-token", b"c", 1, 0, nonce_c, nonce_s))
        rest = b""
        with pytest.raises((ConnectionResetError, AssertionError)):
            while True:
                chunk = s.recv(64)
                assert chunk, "closed"
                rest += chunk
        # The server sent its own proof first (keyed with the claimed rank's token, which
        # tells the stranger nothing), then, after the wrong MAC, its refusal; and closed.
        assert len(rest) == handshake.MAC_SIZE + 1 and rest.endswith(lanes.REFUSE), rest
        s.close()
        deadline = time.monotonic() + 5
        ch = t0.ch
        assert isinstance(ch, lanes.SocketPlane)
        while ch.strangers < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ch.strangers >= 1 and not ch.lanes
    finally:
        t0.close(linger=0)


def _swallow(t: Endpoint) -> None:
    """Run rank 0's setup alone (its peer never comes): it times out, as it should."""
    peers = [_info(t), PeerInfo(1, "tcp://127.0.0.1:1", "x", 1, "", "tok", "socket")]
    with contextlib.suppress(Exception):
        t.connect(peers, time.monotonic() + 3)


@pytest.mark.waits  # a rank waits for its handshake timeout
def test_a_peer_that_refuses_the_handshake_is_an_authentication_error() -> None:
    """Rank 1 holds a table with another token for rank 0: rank 0 refuses it."""
    sec = security.Security.from_secret(SECRET, False)
    t0, t1 = _make(0, sec), _make(1, sec)
    errors: dict[int, BaseException] = {}
    good = [_info(t0), _info(t1)]
    bad = [PeerInfo(0, t0.endpoint, "h", 1, "", "wrong-token", "socket"), good[1]]

    def run(t: Endpoint, peers: list[PeerInfo]) -> None:
        try:
            t.connect(peers, time.monotonic() + 4)
        except BaseException as exc:
            errors[t.rank] = exc

    try:
        th = [threading.Thread(target=run, args=(t0, good)),
              threading.Thread(target=run, args=(t1, bad))]
        for x in th:
            x.start()
        for x in th:
            x.join(15)
        assert type(errors[1]).__name__ == "AuthenticationError", errors
        assert "rank 0's data socket" in str(errors[1]) and "refused" in str(errors[1])
        assert "RendezvousTimeout" in type(errors[0]).__name__, errors
    finally:
        t0.close(linger=0)
        t1.close(linger=0)


# -- framing --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["magic", "src", "nbytes", "version"])
def test_a_corrupt_header_is_a_protocol_error_naming_the_peer(
        pair: list[Endpoint], bad: str) -> None:
    t0, t1 = pair
    header = bytearray(wire.pack_header(wire.Kind.DATA, SIG, 1, 1, 0, 4))
    if bad == "magic":
        header[:4] = b"EVIL"
    elif bad == "version":
        header[4] = 99
    elif bad == "src":
        header[:] = wire.pack_header(wire.Kind.DATA, SIG, 0, 1, 0, 4)
    else:
        header[:] = wire.pack_header(wire.Kind.DATA, SIG, 1, 1, 0, wire.MAX_PAYLOAD + 1)
    _lane_sock(t1, 0).sendall(bytes(header) + b"\0" * 64)
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="rank 1 sent bytes that are not a swarmfd message"):
        t0.recv(1, SIG, 1, 0, 4)
    assert time.monotonic() - start < 5


def _exchange(t: Endpoint, peer: int, out: np.ndarray, back: np.ndarray,
              piece: int, copy: bool, errors: list[BaseException]) -> None:
    try:
        n = out.nbytes // piece
        ob, ib = out.view(np.uint8), back.view(np.uint8)
        for j in range(n):
            t.send(peer, SIG, 1, j, ob[j * piece:(j + 1) * piece], copy=copy)
        for j in range(n):
            t.recv(peer, SIG, 1, j, piece, into=ib[j * piece:(j + 1) * piece])
        t.flush()
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("copy", [False, True])
def test_large_exchanges_both_ways_at_once_do_not_deadlock(
        pair: list[Endpoint], copy: bool) -> None:
    size, piece = 48 << 20, wire.PIECE_BYTES
    outs = [np.random.default_rng(r).integers(0, 255, size, np.uint8) for r in (0, 1)]
    backs = [np.empty(size, np.uint8) for _ in (0, 1)]
    errors: list[BaseException] = []
    th = [threading.Thread(target=_exchange, args=(pair[r], 1 - r, outs[r], backs[r], piece,
                                                   copy, errors)) for r in (0, 1)]
    for x in th:
        x.start()
    for x in th:
        x.join(60)
    assert not any(x.is_alive() for x in th), "the exchange deadlocked"
    assert not errors, errors
    assert np.array_equal(backs[0], outs[1]) and np.array_equal(backs[1], outs[0])


def test_flush_returns_only_when_the_buffer_is_no_longer_read(
        pair: list[Endpoint]) -> None:
    """Zero-copy sends: after flush the caller may overwrite; the peer gets the old bytes."""
    t0, t1 = pair
    n = 8
    data = np.arange(n * wire.PIECE_BYTES // 8, dtype=np.int64)
    want = data.copy()
    pieces = np.split(data.view(np.uint8), n)
    got = np.empty_like(data)
    gpieces = np.split(got.view(np.uint8), n)
    for j, p in enumerate(pieces):
        t0.send(1, SIG, 1, j, p)
    ch = t0.ch
    assert isinstance(ch, lanes.SocketPlane)
    assert ch.unsent() == [1], "8 MiB should not all fit in the kernel's buffers"
    done = threading.Event()

    def reader() -> None:
        time.sleep(0.3)  # the flush below must wait for this reader
        for j, p in enumerate(gpieces):
            t1.recv(0, SIG, 1, j, p.nbytes, into=p)
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    t0.flush()
    assert ch.unsent() == []
    data[:] = -1  # the caller reuses its buffer at once
    assert done.wait(20)
    assert np.array_equal(got, want)


def test_copy_true_leaves_the_buffer_free_at_once(pair: list[Endpoint]) -> None:
    t0, t1 = pair
    n = 8
    data = np.arange(n * wire.PIECE_BYTES // 8, dtype=np.int64)
    want = data.copy()
    for j, p in enumerate(np.split(data.view(np.uint8), n)):
        t0.send(1, SIG, 1, j, p, copy=True)
    ch = t0.ch
    assert isinstance(ch, lanes.SocketPlane)
    assert ch.lanes[1].zc == 0, "copy=True must not keep views of the caller's buffer"
    data[:] = -1
    sender = threading.Thread(target=t0.flush)  # keeps the queued copies moving
    sender.start()
    got = np.empty_like(want)
    for j, p in enumerate(np.split(got.view(np.uint8), n)):
        t1.recv(0, SIG, 1, j, p.nbytes, into=p)
    sender.join(10)
    assert np.array_equal(got, want)


def test_a_peer_far_ahead_is_a_protocol_error_not_a_growing_stash(
        pair: list[Endpoint]) -> None:
    """A peer's data for calls far ahead of this rank's (a peer cannot be that far ahead):
    the first one is refused as a protocol error instead of being stashed."""
    t0, t1 = pair
    for i in range(5):
        t1.send(0, SIG, 1000 + i, 0, b"\1" * 1024)
    t1.flush()
    with pytest.raises(ProtocolError, match="calls ahead"):
        t0.recv(1, SIG, 2, 0, 4)
    assert not t0.stash


def test_a_message_of_a_finished_call_is_a_mismatch(pair: list[Endpoint]) -> None:
    """Data for a call this rank already finished: the sender was in another collective."""
    t0, t1 = pair
    t1.send(0, SIG, 1, 0, b"\0" * 4)
    t1.flush()
    with pytest.raises(MismatchError, match=r"already\s+finished"):
        t0.recv(1, SIG, 5, 0, 4)


def test_messages_are_matched_by_source_call_and_tag(pair: list[Endpoint]) -> None:
    """Out-of-order tags and small + large messages: each lands where it is asked for."""
    t0, t1 = pair
    sizes = [0, 3, 5000, 70_000, wire.PIECE_BYTES]
    blobs = [os.urandom(s) for s in sizes]
    for tag, b in enumerate(blobs):
        t0.send(1, SIG, 2, tag, b)
    t0.flush()
    for tag in reversed(range(len(blobs))):
        into = bytearray(sizes[tag])
        t1.recv(0, SIG, 2, tag, sizes[tag], into=into if sizes[tag] else None)
        if sizes[tag]:
            assert bytes(into) == blobs[tag]


def test_a_payload_that_trickles_in_wakes_its_reader_a_few_times_not_per_segment(
        pair: list[Endpoint]) -> None:
    """A piece that arrives 16 KiB at a time (a link slower than the CPU) is read after
    a few wake-ups, not one a segment (SO_RCVLOWAT, see lanes.LOWAT_BYTES), every byte
    in place; the socket wakes for every byte again afterwards."""
    t0, t1 = pair
    n, chunk = wire.PIECE_BYTES, 16 << 10
    payload = np.random.default_rng(7).integers(0, 255, n, np.uint8).tobytes()
    header = wire.pack_header(wire.Kind.DATA, SIG, 1, 4, 0, n)
    sock = _lane_sock(t1, 0)

    def trickle() -> None:
        sock.sendall(header + payload[:chunk])
        for a in range(chunk, n, chunk):
            time.sleep(0.002)
            sock.sendall(payload[a:a + chunk])

    ch = t0.ch
    woken = []
    select = ch._select

    def counted(wait: float) -> bool:
        progress = select(wait)
        woken.append(progress)
        return progress

    ch._select = counted  # type: ignore[method-assign]
    writer = threading.Thread(target=trickle)
    writer.start()
    got = bytearray(n)
    t0.recv(1, SIG, 4, 0, n, into=got)
    writer.join(10)
    assert bytes(got) == payload
    # Without SO_RCVLOWAT: about one wake-up a chunk (64).
    assert sum(woken) <= 8, f"{sum(woken)} wake-ups for {n // chunk} chunks"
    lane_sock = _lane_sock(t0, 1)
    assert lane_sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


@pytest.mark.waits  # a rank waits for the loss
def test_a_closed_peer_is_a_lost_peer_after_its_data(pair: list[Endpoint]) -> None:
    """Data sent before the connection closed is still delivered, then the loss shows."""
    t0, t1 = pair
    stall_meter()
    t1.send(0, SIG, 3, 0, b"last words")
    t1.close()
    assert bytes(t0.recv(1, SIG, 3, 0, 10)) == b"last words"
    start = time.monotonic()
    with pytest.raises(Exception, match="lost rank 1") as info:
        t0.recv(1, SIG, 3, 1, 10)
    assert type(info.value).__name__ == "PeerLostError"
    end = time.monotonic()
    limit, stalled = allowed(LOST_PEER_LIMIT, start, end)
    assert end - start < limit, f"{end - start:.2f} s{stalled}"


def test_the_handshake_and_header_layouts_are_fixed() -> None:
    """The handshake is part of the protocol: its layout changes only with the version."""
    assert handshake.HELLO.size == 29 and handshake.MAC_SIZE == 32
    assert struct.calcsize("<8sBHH16s") == handshake.HELLO.size



@pytest.mark.parametrize("wrong", ["signature", "size"])
def test_a_refused_message_is_read_off_the_stream(pair: list[Endpoint], wrong: str) -> None:
    """The message a receive refuses (another signature, another size) is consumed: the
    connection also carries the other groups' calls, whose next header must be found."""
    t0, t1 = pair
    other = wire.Signature(wire.Collective.BROADCAST, dtype=SIG.dtype, count=SIG.count,
                           shape=SIG.shape) if wrong == "signature" else SIG
    t1.send(0, other, 1, 0, b"\0" * (4 if wrong == "signature" else 8000))
    t1.t.channel.send(t1.t.tcp, 0, SIG, 3, 1, 0, b"next")  # group 3's call
    t1.flush()
    with pytest.raises((MismatchError, ProtocolError)):
        t0.recv(1, SIG, 1, 0, 4)
    assert bytes(t0.t.channel.recv(t0.t.tcp, 1, SIG, 3, 1, 0, 4)) == b"next"


# -- the zmq plane: one receiving socket, the source from the connection -------------------


@pytest.fixture(params=["plain", "curve", "no-auth"])
def zmq_trio(request: pytest.FixtureRequest) -> Iterator[list[Endpoint]]:
    """Three ranks on the zmq plane, in-process: rank 0's one DEALER receives from two
    peers, so a message's source must come from its connection."""
    sec = (None if request.param == "no-auth"
           else security.Security.from_secret(SECRET, request.param == "curve"))
    with _trio(sec, "zmq") as ts:
        yield ts


def _trio(sec: security.Security | None, plane: str) -> contextlib.AbstractContextManager[
        list[Endpoint]]:
    """Three ranks on ``plane``, in-process, meshed (closed at the end)."""
    return _meshed([Endpoint(transport.Transport(r, 3, 10.0, "127.0.0.1", sec, plane))
                    for r in range(3)])


def _lose(t: Endpoint, peer: Endpoint) -> None:
    """Close ``peer`` and wait (at most 5 s) until ``t``'s zmq plane records it lost."""
    peer.close(linger=0)
    deadline = time.monotonic() + 5
    while peer.rank not in t.channel.lost and time.monotonic() < deadline:
        t.tcp.check_lost()
        time.sleep(0.01)


def _forge_from(t: Endpoint, dst: int, claimed_src: int, seq: int, tag: int,
                body: bytes) -> None:
    """Send a DATA message from ``t``'s plane whose header claims ``claimed_src``."""
    router = t.tcp.router
    router.send_multipart([t.tcp.ids[dst], wire.pack_header(
        wire.Kind.DATA, SIG, claimed_src, seq, tag, len(body), wire.FLAG_INLINE) + body])


def test_zmq_messages_from_two_peers_are_told_apart_by_their_connection(
        zmq_trio: list[Endpoint]) -> None:
    t0, t1, t2 = zmq_trio
    assert t0.tcp.peers == [1, 2]  # both feed the one DEALER, t0.tcp.rx
    t2.send(0, SIG, 1, 0, b"from-2")
    t1.send(0, SIG, 1, 0, b"from-1")
    t2.flush()
    t1.flush()
    assert bytes(t0.recv(1, SIG, 1, 0, 6)) == b"from-1"
    assert bytes(t0.recv(2, SIG, 1, 0, 6)) == b"from-2"


def test_a_zmq_header_that_claims_another_peer_is_refused_naming_its_connection(
        zmq_trio: list[Endpoint]) -> None:
    """Rank 2 writes src=1 into a header: rank 0 takes its source from the connection
    (rank 2's announced rank), never from the header, and refuses the message."""
    t0, _, t2 = zmq_trio
    _forge_from(t2, 0, 1, 1, 0, b"forged")
    start = time.monotonic()
    with pytest.raises(ProtocolError, match=r"rank 2 sent bytes that are not a swarmfd "
                                            r"message.*claims source rank 1"):
        t0.recv(1, SIG, 1, 0, 6)
    assert time.monotonic() - start < 5


def test_a_closed_zmq_peer_is_reported_lost_by_its_endpoint(
        zmq_trio: list[Endpoint]) -> None:
    """The one DEALER's monitor names a closed connection by endpoint: the lost rank is
    the one that closed, not another peer."""
    t0, _, t2 = zmq_trio
    _lose(t0, t2)
    assert set(t0.channel.lost) == {2}, t0.channel.lost


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_a_zmq_monitor_event_names_the_endpoint_the_plane_dialed(host: str) -> None:
    """The zmq plane's one DEALER finds a lost peer by the endpoint its monitor event
    names (ZmqPlane.at): libzmq names a dialed connection by the very string passed to
    connect(), whatever the host's form (not resolved, not reformatted)."""
    from zmq.utils.monitor import parse_monitor_message

    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        client = ctx.socket(zmq.DEALER)
        for s in (server, client):
            s.setsockopt(zmq.IPV6, 1)
            s.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://[::1]" if host == "[::1]" else "tcp://127.0.0.1")
        mon = client.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        dialed = f"tcp://{host}:{port}"
        client.connect(dialed)
        assert mon.poll(5000), "no handshake"
        reported = parse_monitor_message(mon.recv_multipart())["endpoint"]
        assert reported == dialed.encode(), (reported, dialed)
        client.disable_monitor()
        mon.close(linger=0)
        client.close()
        server.close()
    finally:
        ctx.term()


class _Permissive(zmq.auth.thread.ThreadAuthenticator):
    """A stranger's ZAP handler: every PLAIN client is welcome."""

    def _authenticate_plain(self, domain: str, username: str,
                            password: str) -> tuple[bool, bytes]:
        return True, b"OK"


def test_a_process_on_a_lost_zmq_peers_port_cannot_pass_for_it(
        zmq_trio: list[Endpoint], request: pytest.FixtureRequest) -> None:
    """Once rank 2's connection closed, libzmq keeps dialing its endpoint every 0.1 s,
    and zmq_disconnect does not stop that (libzmq 4.3.5: retries go on after a
    successful disconnect, measured). A process that binds the freed port, announces
    rank 2 and sends a forged message: with PLAIN rank 0 connects to it but drops what
    it sends (it lacks rank 2's server proof); CURVE refuses the connection (the server
    must hold the job key). Without the secret it passes for rank 2: a known gap, by
    design (xfail), as for every forged header without authentication."""
    t0, _, t2 = zmq_trio
    mode = request.node.callspec.params["zmq_trio"]
    if mode == "no-auth":
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "without the job secret a connection's announced rank is not proven")))
    port = int(t2.endpoint.rsplit(":", 1)[1])
    _lose(t0, t2)
    assert 2 in t0.channel.lost
    ctx = zmq.Context()
    auth = _Permissive(ctx) if mode == "plain" else None
    squatter = ctx.socket(zmq.ROUTER)
    try:
        if auth is not None:
            auth.start()
        squatter.setsockopt(zmq.LINGER, 0)
        squatter.setsockopt(zmq.ROUTER_MANDATORY, 1)
        squatter.setsockopt(zmq.METADATA, b"X-Rank:2")
        if mode == "plain":
            squatter.setsockopt(zmq.ZAP_DOMAIN, b"squat")
            squatter.setsockopt(zmq.PLAIN_SERVER, 1)
        elif mode == "curve":  # a CURVE server of its own: it cannot hold the job key
            _public, secret = zmq.curve_keypair()
            squatter.setsockopt(zmq.CURVE_SERVER, 1)
            squatter.setsockopt(zmq.CURVE_SECRETKEY, secret)
        squatter.bind(f"tcp://127.0.0.1:{port}")
        forged = wire.pack_header(wire.Kind.DATA, SIG, 2, 1, 0, 6, wire.FLAG_INLINE) + b"forged"
        sent = False
        deadline = time.monotonic() + 1.0  # libzmq redials every 0.1 s (ZMQ_RECONNECT_IVL)
        while not sent and time.monotonic() < deadline:
            try:
                # Rank 0's routing id: what the handshake of rank 0's connection to the
                # squatter carries in clear (security.routing_id).
                squatter.send_multipart([t0.tcp.ids[0], forged])
                sent = True
            except zmq.ZMQError:  # EHOSTUNREACH: rank 0 is not connected (yet)
                time.sleep(0.02)
        assert sent == (mode != "curve"), mode
        with pytest.raises(PeerLostError):
            got = t0.recv(2, SIG, 1, 0, 6)
            pytest.fail(f"rank 0 took the squatter's message for rank 2's: {bytes(got)!r}")
        if mode == "plain":
            assert t0.tcp.unknown == 1
    finally:
        squatter.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()


def test_the_zmq_server_proof_names_the_rank_and_needs_its_token() -> None:
    """Plain data: the announced value starts with the rank, differs per rank and per
    token, and is the bare rank when there is no token (CURVE, no authentication)."""
    proof = security.server_proof
    assert proof("", 3) == "3"
    a = proof("token-a", 3)
    assert a.startswith("3.") and len(a) == 2 + 32 and a == proof("token-a", 3)
    assert len({a, proof("token-b", 3), proof("token-a", 4)}) == 3


def test_a_peer_lost_in_the_middle_of_a_stashed_message_fails_the_flush_at_once() -> None:
    """Rank 0 flushes a large send to rank 1 (which does not read) while rank 2 starts a
    message to it (1 MiB announced, 1000 bytes sent) and dies: the stash's read of that
    payload can never end. It raises PeerLostError naming rank 2 after the lost-peer
    grace, not after the whole timeout (10 s here; a CI run whose link to a host was cut
    waited out 60 s) and not as the internal cutoff."""
    with _trio(security.Security.from_secret(SECRET, False), "socket") as (t0, _t1, t2):
        big = np.ones(8 << 20, dtype=np.float32)  # 32 MiB: more than the kernel buffers
        piece = 1 << 18  # 1 MiB of float32, the largest message
        for k in range(big.size // piece):
            t0.send(1, SIG, 1, k, big[k * piece:(k + 1) * piece])
        header = wire.pack_header(wire.Kind.DATA, SIG, 2, 1, 5, 1 << 20)
        _lane_sock(t2, 0).sendall(header + b"\0" * 1000)
        t2.close(linger=0)
        start = time.monotonic()
        with pytest.raises(PeerLostError, match=r"lost rank 2 .* in the middle of a message"):
            t0.flush()
        assert time.monotonic() - start < 3


def test_a_peer_lost_in_the_middle_of_a_posted_message_fails_its_group_at_once() -> None:
    """The progress engine's receive (Channel.deliver, async calls): rank 2 dies 1000 bytes
    into a 1 MiB message that a posted receive awaits. The read raises GroupFailure for
    that message's group, carrying PeerLostError, after the lost-peer grace: not after
    the 10 s timeout, and not the internal cutoff escaping the engine."""
    from swarmfd.comm.channel import GroupFailure

    with _trio(security.Security.from_secret(SECRET, False), "socket") as (t0, _t1, t2):
        n = 1 << 20
        header = wire.pack_header(wire.Kind.DATA, SIG, 2, 1, 5, n)
        key = (0, 2, 1, 5)
        into = bytearray(n)
        _lane_sock(t2, 0).sendall(header + b"\0" * 1000)
        t2.close(linger=0)
        start = time.monotonic()
        with pytest.raises(GroupFailure) as failure:
            while t0.channel.deliver(t0.tcp, {key: (SIG, n, into)}, 0.05) is None:
                assert time.monotonic() - start < 5, "the message never came"
        assert failure.value.group == 0
        assert isinstance(failure.value.error, PeerLostError), failure.value.error
        assert "lost rank 2" in str(failure.value.error)
        assert time.monotonic() - start < 3


# -- ports a listener must not take ---------------------------------------------------------


class _FirstSeen:
    """An ``avoid`` set that holds whichever port it is first asked about: the port the
    system picks first is one the launcher reserved."""

    def __init__(self) -> None:
        self.first: int | None = None

    def __contains__(self, port: object) -> bool:
        if self.first is None:
            self.first = int(port)  # type: ignore[call-overload]
        return port == self.first


def _free_now(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("plane", ["socket", "zmq"])
def test_a_plane_never_listens_on_a_port_the_launcher_reserved(plane: str) -> None:
    """The rendezvous port and MASTER_PORT are picked free by the launcher and bound by
    rank 0 only later: a data plane's listener that the system gives one of them must
    take another, and leave that one free (for rank 0 to bind at once)."""
    avoid = _FirstSeen()
    t = transport.Transport(0, 2, 10.0, "127.0.0.1", None, plane, avoid=avoid)
    try:
        assert avoid.first is not None
        assert _port(Endpoint(t)) != avoid.first
        assert _free_now(avoid.first), "the avoided port is still bound"
    finally:
        t.close(linger=0)


def test_take_takes_only_the_expected_message_whole(pair: list[Endpoint],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """send_packed sends what send would; take gives the payload of the peer's next
    message only when its header is the one expected, byte for byte, and all of it is
    here (reading what the kernel holds), and otherwise takes nothing: the channel's
    receive then reads it as always (here: a mismatch, then the message)."""
    from swarmfd.comm import spin

    t0, t1 = pair
    p0, p1 = t0.ch, t1.ch

    def header(src: int, seq: int, n: int, sig: wire.Signature = SIG) -> bytes:
        return wire.pack_header(int(wire.Kind.DATA), sig, src, seq, 0, n, 0, 0)

    head, tail = p0.header(int(wire.Kind.DATA), SIG, 0, 0, 5000, 0)
    assert head + wire.seq_bytes(1) + tail == header(0, 1, 5000)  # cut around the number
    body = os.urandom(5000)
    p0.send_packed(1, header(0, 1, len(body)), body, len(body), False)
    t0.flush()
    got = None
    for _ in range(1000):  # (loopback: here within microseconds)
        got = p1.take(0, header(0, 1, len(body)), len(body))
        if got is not None:
            break
    assert got is not None and bytes(got) == body
    assert p1.take(0, header(0, 2, 4), 4) is None  # nothing sent
    # Another call's header, or another signature: left for the receive.
    other = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 1, count=4)
    p0.send_packed(1, header(0, 2, 4, other), b"abcd", 4, False)
    t0.flush()
    time.sleep(0.05)
    assert p1.take(0, header(0, 3, 4), 4) is None
    assert p1.take(0, header(0, 2, 4), 4) is None
    with pytest.raises(MismatchError, match="all_reduce"):
        t1.recv(0, SIG, 2, 0, 4)
    # A message sent by send is taken alike; one too large for the buffer never is.
    t0.send(1, SIG, 3, 0, b"wxyz")
    t0.flush()
    time.sleep(0.05)
    assert p1.take(0, header(0, 3, 4), 4) == b"wxyz"
    big = lanes.RECV_BUFFER
    assert p1.take(0, header(0, 4, big), big) is None
    # Where waits poll, take looks again (as often as TAKE_POLLS allows: many times
    # here), and a message caught so resets the spinner's misses (the peer keeps up).
    monkeypatch.setattr(spin, "ENABLED", 1)
    monkeypatch.setattr(spin, "YIELD", 0)
    monkeypatch.setattr(lanes, "TAKE_POLLS", 10**7)
    p1.spinner.misses = 5
    late = threading.Timer(0.005, lambda: (t0.send(1, SIG, 5, 0, b"late"), t0.flush()))
    late.start()
    try:
        assert p1.take(0, header(0, 5, 4), 4) == b"late"
    finally:
        late.join()
    assert p1.spinner.misses == 0


def test_send_packed_tells_whether_bytes_stay_queued(pair: list[Endpoint]) -> None:
    """send_packed's answer is what a call flushes on (Op.send): False when the kernel
    took the whole message (nothing queued), True when some of it waits in the queue
    (until a flush, or the next wait, drives it out), and for every message queued
    behind it."""
    t0, t1 = pair
    p0 = t0.ch
    n = 8
    data = np.arange(n * wire.PIECE_BYTES // 8, dtype=np.int64)
    pieces = np.split(data.view(np.uint8), n)
    answers, queued = [], []
    for j, piece in enumerate([np.arange(16, dtype=np.uint8), *pieces]):
        head = wire.pack_header(int(wire.Kind.DATA), SIG, 0, 1, j, piece.nbytes, 0, 0)
        answers.append(p0.send_packed(1, head, piece, piece.nbytes, False))
        queued.append(p0.unsent() == [1])
    assert answers == queued
    assert answers[0] is False and answers[-1] is True, answers  # (8 MiB: not all held)
    first = answers.index(True)
    assert all(answers[first:]), answers  # behind queued bytes: queued
    got = np.empty_like(data)
    reader = threading.Thread(target=lambda: [
        t1.recv(0, SIG, 1, j + 1, p.nbytes, into=p)
        for j, p in enumerate(np.split(got.view(np.uint8), n))])
    t1.recv(0, SIG, 1, 0, 16)
    reader.start()
    t0.flush()
    reader.join(20)
    assert p0.unsent() == [] and np.array_equal(got, data)
