"""Rendezvous: every rank learns every other's :class:`PeerInfo` through rank 0.

Rank 0 serves a ZeroMQ ROUTER at ``MASTER_ADDR`` on swarmfd's own rendezvous port
(``SWARMFD_PORT``, else ``MASTER_PORT + 1``: :func:`swarmfd.config.rendezvous_port`;
MASTER_PORT itself is left to torch.distributed's store, so the two can live side by
side), on MASTER_ADDR's own address when it is one of this host's, else every
interface; every other rank sends it a JSON hello (protocol version, world size, its
PeerInfo) and gets back the table of all of them, plus a random job token rank 0
draws. The ROUTER is always CURVE (authenticated and encrypted with the job's key,
:mod:`swarmfd.comm.security`) unless authentication is off; it exists only during
init. No other fixed port is used.

Strangers at the rendezvous port: frames over MAX_HELLO_MESSAGE and handshakes slower
than HANDSHAKE_IVL_MS drop the connection; failed handshakes and failed accepts are
counted for the timeout's message. A joining rank reports another job secret only on
evidence (see MAX_HANDSHAKE_FAILURES); a handshake rank 0 dropped late is retried.
Nothing received is unpickled: the messages are JSON, validated field by field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import AuthenticationError, ProtocolError, RendezvousError, RendezvousTimeout
from . import wire
from .plane import PeerInfo
from .planes.zmq import HANDSHAKE_FAILED
from .security import ZAP_RENDEZVOUS, Security, keepalive, stranger_facing

__all__ = ["local_address_toward", "rendezvous", "resolve"]

#: Limit on a rendezvous message rank 0 receives (a hello: JSON of a few hundred bytes)
#: and on every frame of the handshakes on rank 0's rendezvous port, which strangers can
#: reach: libzmq allocates a frame before it can tell it is junk, so a stranger pins at
#: most this much per connection (300 connections sending junk frames: +0.9 MiB, against
#: +306 MiB with the former 1 MiB limit; tests/test_front_door.py).
MAX_HELLO_MESSAGE = 4096
#: Limit on the peer table a joining rank receives from rank 0 (about 300 bytes a rank).
MAX_RENDEZVOUS_MESSAGE = 1 << 20
#: After this many handshakes with rank 0 that it refused (another secret), rendezvous
#: gives up. Only refusals count: an explicit one (ZAP's), a cryptographic failure, or a
#: connection rank 0 dropped within QUICK_REFUSAL s of its start (CURVE with another key:
#: rank 0 cannot open this rank's hello). A handshake dropped later (rank 0 busy, or
#: flooded by strangers, evicts it after HANDSHAKE_IVL_MS) is retried until the deadline.
MAX_HANDSHAKE_FAILURES = 2
QUICK_REFUSAL = 0.5
#: Slice of the rendezvous waits: how often they look after the data plane's listener.
RENDEZVOUS_SLICE = 0.05


def _now() -> float:
    return time.monotonic()


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


@dataclass
class _Rdv:
    """What one rendezvous needs (passed to the serve and join sides)."""

    ctx: zmq.Context
    world_size: int
    security: Security | None
    join_timeout: float
    idle: Callable[[], None]


def rendezvous(ctx: zmq.Context, me: PeerInfo, world_size: int, master_ip: str,
               master_port: int, deadline: float, *, security: Security | None,
               join_timeout: float, idle: Callable[[], None]) -> tuple[list[PeerInfo], str]:
    """Exchange every rank's :class:`PeerInfo` through rank 0 (see the module docstring).

    Returns the peer table in rank order and the job token rank 0 drew (random; names
    the job's local resources). ``idle`` is called at least every RENDEZVOUS_SLICE
    seconds (the data plane looks after its listener meanwhile).
    """
    r = _Rdv(ctx, world_size, security, join_timeout, idle)
    if me.rank == 0:
        return _serve_rendezvous(r, me, master_ip, master_port, deadline)
    return _join_rendezvous(r, me, master_ip, master_port, deadline)


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
        **dataclasses.asdict(me),
    }).encode()


def _int(value: Any) -> int:
    """A JSON integer, strictly (no bool, no float): TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _peer(d: dict[str, Any]) -> PeerInfo:
    return PeerInfo(_int(d["rank"]), str(d["endpoint"]), str(d["host"]), _int(d["pid"]),
                    str(d.get("hostkey", "")), str(d.get("token", "")),
                    str(d.get("plane", "")), str(d.get("shm", "")))


def _serve_rendezvous(
    t: _Rdv, me: PeerInfo, master_ip: str, port: int, deadline: float
) -> tuple[list[PeerInfo], str]:
    router = t.ctx.socket(zmq.ROUTER)
    stranger_facing(router, MAX_HELLO_MESSAGE)
    router.setsockopt(zmq.LINGER, 2000)
    keepalive(router)
    if t.security is not None:
        t.security.curve_server(router, ZAP_RENDEZVOUS)
    refused = accept_failed = 0
    bind_ip = _bind_address(master_ip)
    try:
        router.bind(f"tcp://{bind_ip}:{port}")
    except zmq.ZMQError as exc:
        router.close(linger=0)
        raise RendezvousError(
            f"rank 0 cannot serve rendezvous on port {port} ({exc}): swarmfd's rendezvous "
            "port (SWARMFD_PORT, else MASTER_PORT + 1, or init's master_port=) is in use; "
            "is another job using it? choose a free SWARMFD_PORT (or MASTER_PORT)"
        ) from None
    # The monitor only once the bind worked: on a failed bind nothing would close it (and
    # before close() destroyed the context, term() waited for it forever).
    monitor = router.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_ACCEPT_FAILED)
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
    t: _Rdv, me: PeerInfo, master_ip: str, port: int, deadline: float
) -> tuple[list[PeerInfo], str]:
    dealer = t.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.MAXMSGSIZE, MAX_RENDEZVOUS_MESSAGE)
    dealer.setsockopt(zmq.LINGER, 0)
    keepalive(dealer)
    if t.security is not None:
        t.security.curve_client(dealer)
    monitor = dealer.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_CONNECTED)
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
                    f"answer from rank 0 at {master_ip}:{port} (MASTER_ADDR, and SWARMFD_PORT "
                    "else MASTER_PORT + 1: the same on every rank?); is "
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


def _refused_by_rank0(t: _Rdv, rank: int, master_ip: str, port: int) -> str:
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
