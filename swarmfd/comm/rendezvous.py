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
counted for the timeout's message. A joining rank never gives up before the init
deadline because of what answers at rank 0's address: a handshake closed or refused
there is not evidence of anything. A CURVE server with another key (rank 0 with another
job secret) cannot open the joiner's hello and closes the connection without a word,
exactly as a squatter on the port that accepts and closes does, and a refusal (ZMTP
ERROR) or a greeting with another mechanism is plain text anyone can send. So the
joiner dials again until the deadline (a squatter that leaves, or a rank 0 that starts
later on the freed port, is then reached), warns once when handshakes keep failing,
and its timeout says what it saw (see :class:`_Seen`).

Jobs: every hello carries the rank's launch (SWARMFD_JOB_ID, "" for ranks started by
hand); rank 0 refuses a rank of another launch (a RendezvousError on that rank) and
goes on waiting for its own, so two jobs with the same secret and port never mix.
Nothing received is unpickled: the messages are JSON, validated field by field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import ProtocolError, RendezvousError, RendezvousTimeout
from . import wire
from .plane import PeerInfo
from .planes.zmq import HANDSHAKE_FAILED
from .security import Security, keepalive, serving_router

__all__ = ["local_address_toward", "rendezvous", "resolve"]

#: Limit on a rendezvous message rank 0 receives (a hello: JSON of a few hundred bytes)
#: and on every frame of the handshakes on rank 0's rendezvous port, which strangers can
#: reach: libzmq allocates a frame before it can tell it is junk, so a stranger pins at
#: most this much per connection (300 connections sending junk frames: +0.9 MiB, against
#: +306 MiB with the former 1 MiB limit; tests/test_front_door.py).
MAX_HELLO_MESSAGE = 4096
#: Limit on the peer table a joining rank receives from rank 0 (about 300 bytes a rank).
MAX_RENDEZVOUS_MESSAGE = 1 << 20
#: After this many failed handshakes with whatever answers at rank 0's address, a
#: joining rank warns (once) that it keeps trying until the init deadline, and why.
WARN_AFTER_FAILURES = 3
#: Slice of the rendezvous waits: how often they look after the data plane's listener.
RENDEZVOUS_SLICE = 0.05


_LOG = logging.getLogger("swarmfd")


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
                    str(d.get("plane", "")), str(d.get("shm", "")), str(d.get("job", "")),
                    str(d.get("agent", "")))


def _serve_rendezvous(
    t: _Rdv, me: PeerInfo, master_ip: str, port: int, deadline: float
) -> tuple[list[PeerInfo], str]:
    router = serving_router(t.ctx, t.security, MAX_HELLO_MESSAGE)
    router.setsockopt(zmq.LINGER, 2000)
    counts = {"refused": 0, "accept_failed": 0}
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
                raise RendezvousTimeout(_serve_timeout(t, joined, port, counts))
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                counts["accept_failed" if event == zmq.EVENT_ACCEPT_FAILED else "refused"] += 1
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
            error = _refusal(t, me, peer, version, world, joined)
            if error is not None:
                router.send_multipart([ident, json.dumps({"error": error}).encode()])
                if version != wire.PROTOCOL_VERSION or peer.job != me.job:
                    continue  # a rank of another version or launch does not break this job
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


def _serve_timeout(t: _Rdv, joined: dict[int, tuple[bytes, PeerInfo]], port: int,
                   counts: dict[str, int]) -> str:
    """Rank 0's rendezvous timeout: who is missing, and the strangers it saw."""
    missing = sorted(set(range(1, t.world_size)) - set(joined))
    hint = (f"; {counts['refused']} connection(s) failed the authentication handshake "
            "(strangers, or processes with another job secret or SWARMFD_AUTH setting?)"
            if counts["refused"] else "")
    if counts["accept_failed"]:
        hint += (f"; accepting a connection failed {counts['accept_failed']} time(s) (out of "
                 "descriptors: a flood of connections from strangers?)")
    return (f"rendezvous timed out after {t.join_timeout:g} s: rank 0 waited for rank(s) "
            f"{missing} of {t.world_size} to join at port {port}{hint} (give slow starters "
            "longer with SWARMFD_INIT_TIMEOUT or init_timeout=)")


def _refusal(t: _Rdv, me: PeerInfo, peer: PeerInfo, version: int, world: int,
             joined: dict[int, tuple[bytes, PeerInfo]]) -> str | None:
    """Why rank 0 refuses a joining rank's hello, or None to admit it."""
    if version != wire.PROTOCOL_VERSION:
        return (f"protocol version mismatch: rank {peer.rank} speaks swarmfd protocol "
                f"{version}, rank 0 speaks {wire.PROTOCOL_VERSION}")
    if peer.job != me.job:
        return (f"rank {peer.rank} (host {peer.host}, pid {peer.pid}) belongs to another "
                f"launch (SWARMFD_JOB_ID {peer.job[:64]!r}, rank 0's is {me.job!r}): two jobs "
                "meet at one rendezvous port; give each its own port (SWARMFD_PORT, "
                "MASTER_PORT), or its own secret")
    if world != t.world_size:
        return (f"world size mismatch: rank {peer.rank} has WORLD_SIZE={world}, rank 0 has "
                f"WORLD_SIZE={t.world_size}")
    if peer.plane != me.plane:
        return (f"data plane mismatch: rank {peer.rank} uses SWARMFD_DATA_PLANE="
                f"{peer.plane[:20]!r}, rank 0 uses SWARMFD_DATA_PLANE={me.plane!r} (the "
                "default is 'socket', 'zmq' with SWARMFD_ENCRYPT=1); every rank must use the "
                "same data plane")
    if not 1 <= peer.rank < t.world_size:
        return f"rank {peer.rank} is out of range 1..{t.world_size - 1}"
    if peer.rank in joined:
        return (f"duplicate rank {peer.rank}: host {peer.host} pid {peer.pid} and host "
                f"{joined[peer.rank][1].host} pid {joined[peer.rank][1].pid}")
    return None


@dataclass
class _Seen:
    """What a joining rank saw at rank 0's address, for its warning and its timeout."""

    connected: int = 0
    closed: int = 0  # closed (or reset) during the handshake, without a word
    mechanism: int = 0  # a greeting with another security mechanism
    refused: int = 0  # a ZMTP ERROR (a refusal, in plain text)
    warned: bool = False

    def add(self, event: int, value: int) -> None:
        if event == zmq.EVENT_CONNECTED:
            self.connected += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refused += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value in _MECHANISM_ERRORS:
            self.mechanism += 1
        else:
            self.closed += 1

    @property
    def failures(self) -> int:
        return self.closed + self.mechanism + self.refused

    def story(self, t: _Rdv, master_ip: str, port: int) -> str:
        """What answers at rank 0's address, as a clause of the timeout's message."""
        where = f"{master_ip}:{port}"
        mine = ("holds a job secret (CURVE)" if t.security is not None
                else "runs without authentication (SWARMFD_AUTH=off)")
        if not self.connected:
            return (f"nothing accepted a connection at {where}: is rank 0 running, and are "
                    "MASTER_ADDR and SWARMFD_PORT (else MASTER_PORT + 1) the same on every "
                    "rank?")
        parts = []
        if self.closed:
            parts.append(
                f"something at {where} accepts and closes without speaking swarmfd's "
                f"handshake ({self.closed} connection(s)): a stranger on rank 0's port, or "
                "rank 0 with another job secret or SWARMFD_AUTH setting (a CURVE server "
                "that cannot authenticate a client closes just as silently)")
        if self.mechanism:
            parts.append(f"something at {where} answered {self.mechanism} time(s) with "
                         "another security mechanism: rank 0 with another SWARMFD_AUTH "
                         "setting, or a stranger")
        if self.refused:
            parts.append(f"something at {where} refused this rank's handshake "
                         f"{self.refused} time(s) (an unauthenticated ZMTP ERROR)")
        if not parts:
            return f"rank 0 at {where} accepted but never answered (is it overloaded?)"
        return ("; ".join(parts) + f". This rank {mine}; every rank of a job must read the "
                "same secret (SWARMFD_SECRET_FILE, default /run/secrets/swarmfd_secret) and "
                "use the same SWARMFD_AUTH setting")


#: Handshake failures (the monitor's value) that mean the greeting offered another
#: security mechanism (NULL against CURVE, say).
_MECHANISM_ERRORS = frozenset({zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH})


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
    seen = _Seen()
    try:
        dealer.send(_hello(me, t.world_size))
        while True:
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())
                seen.add(event["event"], event["value"])
            if seen.failures >= WARN_AFTER_FAILURES and not seen.warned:
                seen.warned = True
                _LOG.warning("swarmfd rank %d: no rendezvous yet: %s; trying again until the "
                             "init timeout (%g s)", me.rank,
                             seen.story(t, master_ip, port), t.join_timeout)
            remaining = deadline - _now()
            if remaining <= 0:
                raise RendezvousTimeout(
                    f"rendezvous timed out after {t.join_timeout:g} s: rank {me.rank} got no "
                    f"answer from rank 0: {seen.story(t, master_ip, port)} (give slow "
                    "starters longer with SWARMFD_INIT_TIMEOUT or init_timeout=)")
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
            return _table(t, reply)
    finally:
        _close_monitored(dealer, monitor)


def _table(t: _Rdv, reply: dict[str, Any]) -> tuple[list[PeerInfo], str]:
    """The peer table and job token of rank 0's reply, checked."""
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


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop a socket's monitor, then close both (see Transport.close on the order)."""
    while monitor.poll(0):
        monitor.recv_multipart()
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close()
