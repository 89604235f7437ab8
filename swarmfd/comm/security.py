"""Security: the job's keys, the ZAP policies, and the options of sockets strangers reach.

Every rank derives the same CURVE keypair from the job secret (which is not kept).
Every bound ZeroMQ socket is a server, every connecting one a client, and one ZAP
handler per rank (:class:`Authenticator`) admits only the job's own (docs/security.md):

* the rendezvous: always CURVE, any number of clients holding the job key;
* the zmq data plane: each peer's connection is admitted **once**: a PLAIN user name
  (the connecting rank) and a one-time password (:func:`connection_token`) derived from
  the listener's session token, or, with ``SWARMFD_ENCRYPT=1``, CURVE at most
  ``world_size - 1`` times. A replayed token is refused; a replay that reaches the ZAP
  handler first (it reads requests fair-queued, not in order) costs the rank one of its
  DATA_ATTEMPTS tokens, not its init.

Sockets a stranger can reach (:func:`stranger_facing`) refuse oversized frames and drop
connections not authenticated within HANDSHAKE_IVL_MS.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import struct
import threading
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

__all__ = ["DATA_ATTEMPTS", "HANDSHAKE_IVL_MS", "KEEPALIVE", "ZAP_DATA", "ZAP_RENDEZVOUS",
           "Authenticator", "Security", "connection_token", "keepalive", "routing_id",
           "server_proof", "serving_router", "stranger_facing"]

#: ZAP domains of the rendezvous and of the zmq data plane.
ZAP_RENDEZVOUS = "swarmfd-rendezvous"
ZAP_DATA = "swarmfd-data"
#: A connection to a bound socket not authenticated within this many ms is dropped
#: (libzmq's default: 30 s; a handshake takes a few ms: docs/security.md).
HANDSHAKE_IVL_MS = 2000
#: One-time tokens a rank has for its zmq data connection to each peer.
DATA_ATTEMPTS = 8
#: TCP keepalive (idle s, interval s, probes): a vanished host is found within about
#: idle + interval * probes s; a stopped process's kernel still answers (a timeout).
KEEPALIVE = (1, 1, 3)
#: pyzmq's authenticator logs credentials at DEBUG; its logger here never does.
_ZAP_LOG = logging.getLogger("swarmfd.zap")
_ZAP_LOG.setLevel(logging.WARNING)


@dataclass(frozen=True)
class Security:
    """The job's CURVE keypair (:meth:`from_secret`) and the data-plane mode; ``repr``
    shows neither key."""

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
        """Make ``sock`` a CURVE server of ``domain`` with the job's key."""
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)

    def curve_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client holding the job's key."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def connection_token(session_token: str, client: int, server: int, attempt: int = 0) -> str:
    """The one-time PLAIN password of ``client``'s data connection to ``server`` at
    ``attempt`` (< DATA_ATTEMPTS): one seen on the wire tells nothing of another."""
    msg = b"swarmfd zmq data connection v3\0" + struct.pack("<III", client, server, attempt)
    return hmac.new(session_token.encode(), msg, hashlib.sha256).hexdigest()


def routing_id(session_token: str, rank: int) -> bytes:
    """The routing id of ``rank``'s DEALER, derived from its session token: unknown
    outside the job until its own connection claimed it, and libzmq never routes to a
    later claimant, so a replay ZAP admitted first receives nothing. Without a token,
    the rank's number."""
    if not session_token:
        return b"%d" % rank
    msg = b"swarmfd zmq routing id v1\0" + struct.pack("<I", rank)
    # 80 bits; at most 31 bytes with the rank, which libzmq keeps inline in a message.
    return b"%d." % rank + hmac.new(session_token.encode(), msg,
                                    hashlib.sha256).hexdigest()[:20].encode()


def server_proof(session_token: str, rank: int) -> str:
    """What ``rank``'s zmq data socket announces with its rank (``X-Rank``), checked by
    its peers on every message: a process that binds a lost rank's port cannot pass for
    it (PLAIN does not authenticate the server); sent in clear (CURVE answers that)."""
    if not session_token:
        return str(rank)
    msg = b"swarmfd zmq server proof v1\0" + struct.pack("<I", rank)
    return f"{rank}.{hmac.new(session_token.encode(), msg, hashlib.sha256).hexdigest()[:32]}"


class Authenticator(ThreadAuthenticator):
    """The rank's ZAP handler with swarmfd's policies (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, security: Security, rank: int, world_size: int,
                 token: str) -> None:
        super().__init__(ctx, log=_ZAP_LOG)
        self.job_public = security.public
        self.encrypt = security.encrypt
        #: rank -> attempt -> its unused one-time token (PLAIN data plane).
        self.data_tokens = {j: {a: connection_token(token, j, rank, a)
                                for a in range(DATA_ATTEMPTS)}
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
        """PLAIN: a rank's one-time data connection token, consumed on success."""
        if domain == ZAP_DATA and not self.encrypt:
            try:
                rank = int(username)
            except ValueError:
                rank = -1
            with self._lock:
                left = self.data_tokens.get(rank, {})
                for attempt, expected in list(left.items()):
                    if hmac.compare_digest(password, expected):
                        del left[attempt]  # one-time: a replay is refused
                        return True, b"OK"
        self.denied[domain] += 1
        return False, b"NO ACCESS"

    @property
    def refused(self) -> int:
        """ZAP requests refused so far, every domain."""
        return sum(self.denied.values())


def stranger_facing(sock: zmq.Socket, max_frame: int) -> None:
    """Frames over ``max_frame`` drop the connection before libzmq allocates them; so does
    a handshake not done within HANDSHAKE_IVL_MS."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def keepalive(sock: zmq.Socket) -> None:
    """TCP keepalive (KEEPALIVE) on a ZeroMQ socket's connections."""
    idle, intvl, cnt = KEEPALIVE
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, intvl)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, cnt)
    # TCP_USER_TIMEOUT: see swarmfd.comm.planes.socket._keepalive.
    sock.setsockopt(zmq.TCP_MAXRT, (idle + intvl * cnt) * 1000)


def serving_router(ctx: zmq.Context, security: Security | None, max_frame: int) -> zmq.Socket:
    """A ROUTER socket to bind where strangers can reach it (the rendezvous port, an
    elastic agent): frames capped at ``max_frame`` (:func:`stranger_facing`), TCP
    keepalive, and with ``security`` a CURVE server that admits only the job's keys."""
    router = ctx.socket(zmq.ROUTER)
    stranger_facing(router, max_frame)
    keepalive(router)
    if security is not None:
        security.curve_server(router, ZAP_RENDEZVOUS)
    return router
