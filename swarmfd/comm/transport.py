"""The transport: this process's place in the job's network, built by ``init``.

:class:`Transport` owns what the planes share: the ZeroMQ context, the ZAP handler
(:mod:`swarmfd.comm.security`), the message layer (:class:`Channel`) and its planes:

* the TCP plane to every peer, one of two (``SWARMFD_DATA_PLANE``, all ranks must
  agree; rendezvous checks):

  * ``socket`` (the default): plain TCP connections and a single-threaded progress
    engine (:mod:`swarmfd.comm.planes.socket`). Chosen because ZeroMQ's I/O thread,
    hand-offs and receive copy were the floor of the TCP path: measured on loopback
    at N=2, a bare exchange of 16 MiB / 64 MiB took 9.5-10.2 ms / 35-46 ms through
    pyzmq PUSH/PULL and 6.2 ms / 20.5 ms through non-blocking sockets;
  * ``zmq``: a ROUTER that sends, one DEALER that receives
    (:mod:`swarmfd.comm.planes.zmq`); required for an encrypted data plane
    (``SWARMFD_ENCRYPT=1``: CURVE), selectable otherwise;

* the shared-memory plane (:mod:`swarmfd.comm.planes.shm`) to the peers on this host,
  when there are any and ``SWARMFD_TRANSPORT`` is ``auto``.

Setup, in :meth:`Transport.join`: bind the TCP plane's listener on the interface
that routes to rank 0, run the rendezvous (:mod:`swarmfd.comm.rendezvous`), connect
the TCP plane's mesh (authenticated; its listener closes on the socket plane), then
set up shared memory among each host's ranks. Every step is bounded by the init
deadline; strangers cannot stop or slow it (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Sequence

import zmq

from ..config import DATA_PLANES, DEFAULT_STASH_MB
from . import rendezvous as _rdv
from .channel import WAIT_SLICE, Channel
from .plane import PeerInfo, Plane
from .planes.socket import SocketPlane
from .planes.zmq import ZmqPlane
from .security import KEEPALIVE, Authenticator, Security

__all__ = ["Transport", "local_address_toward", "raise_descriptor_limit", "resolve"]

resolve = _rdv.resolve
local_address_toward = _rdv.local_address_toward
_LOG = logging.getLogger("swarmfd")


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


class Transport:
    """The ZeroMQ context, ZAP handler, channel and planes of one process (see module)."""

    def __init__(self, rank: int, world_size: int, timeout: float, bind_host: str,
                 security: Security | None = None, plane: str = "socket",
                 join_timeout: float | None = None, avoid: Collection[int] = (),
                 swarm_task: bool = False, stash_limit: int = DEFAULT_STASH_MB << 20,
                 job: str = "", agent: str = "",
                 watch: Callable[[], None] | None = None) -> None:
        """``avoid``: ports the TCP plane's listener must not take, though the system may
        pick them: the rendezvous port and MASTER_PORT. A launcher picks those free,
        releases them and starts the ranks, and rank 0 binds them only later; a data
        plane's listener of any rank of that host could get one in between, and rank 0
        then could not serve the rendezvous ("Address already in use": once in about 300
        jobs here), or torch.distributed beside swarmfd its store.

        ``agent``: this rank's elastic agent, told the others at rendezvous (see
        :class:`PeerInfo`); ``watch``: called as the rendezvous waits (an elastic
        re-formation raises from it when a member of the new world is lost)."""
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
        self.channel = Channel(rank, world_size, timeout, swarm_task, stash_limit)
        #: The launch this rank belongs to (see PeerInfo.job), and its elastic agent.
        self.job = job
        self.agent = agent
        self.watch = watch
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.auth: Authenticator | None = None
        #: The per-session token of this rank's data plane (unencrypted data plane).
        self.token = secrets.token_hex(16) if security is not None else ""
        self.tcp: SocketPlane | ZmqPlane
        self.shm: Plane | None = None
        try:
            if security is not None:
                self.auth = Authenticator(self.ctx, security, rank, world_size,
                                          "" if security.encrypt else self.token)
                self.auth.start()
                if security.encrypt:
                    self.token = ""
            if plane == "zmq":
                self.tcp = ZmqPlane(self.channel, self.ctx, rank, world_size, timeout,
                                    bind_host, security, self.auth, self.token, avoid)
            else:
                self.tcp = SocketPlane(self.channel, rank, world_size, bind_host, self.token,
                                       KEEPALIVE, WAIT_SLICE, avoid)
        except BaseException:
            self._stop_auth()
            self.ctx.destroy(linger=0)
            raise
        self.channel.add_plane(self.tcp)
        self.endpoint = self.tcp.endpoint
        self.peers: list[PeerInfo] = []
        self.job_token = ""
        self.closed = False

    # -- setup --------------------------------------------------------------------------

    def _stop_auth(self) -> None:
        if self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
            self.auth = None

    def me(self, host: str, hostkey: str, shm: str = "") -> PeerInfo:
        """What this rank tells the others at rendezvous."""
        return PeerInfo(self.rank, self.endpoint, host, os.getpid(), hostkey, self.token,
                        self.plane, shm, self.job, self.agent)

    def rendezvous(self, me: PeerInfo, master_ip: str, master_port: int,
                   deadline: float) -> list[PeerInfo]:
        """Exchange every rank's PeerInfo through rank 0 (:mod:`~swarmfd.comm.rendezvous`)."""
        self.channel.activity = "rendezvous"
        peers, self.job_token = _rdv.rendezvous(
            self.ctx, me, self.world_size, master_ip, master_port, deadline,
            security=self.security, join_timeout=self.join_timeout, idle=self._idle)
        self.peers = self.channel.peers = peers
        return peers

    def _idle(self) -> None:
        self.tcp.idle()
        if self.watch is not None:
            self.watch()

    def connect(self, peers: Sequence[PeerInfo] | None = None,
                deadline: float | None = None) -> None:
        """Connect the TCP plane to every other rank (by ``deadline``)."""
        if peers is not None:
            self.peers = self.channel.peers = list(peers)
        self.tcp.connect(self.peers, _now() + self.timeout if deadline is None else deadline)
        if self.plane == "socket":
            # The rendezvous is over: its ZAP handler has nothing left to check.
            self._stop_auth()
        self.channel.activity = "idle"

    def add_shm(self, plane: Plane) -> None:
        """Use ``plane`` (shared memory among this host's ranks) from now on."""
        self.shm = plane
        self.channel.add_plane(plane)

    # -- state --------------------------------------------------------------------------

    @property
    def garbage(self) -> int:
        return self.channel.garbage

    def close(self, linger: int | None = None) -> None:
        """Close every plane; pending sends get a short linger (or ``linger`` ms). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.channel.close(min(self.timeout, 5.0) if linger is None else linger / 1000)
        self._stop_auth()
        # Every socket is closed by now (with its linger). destroy(), not term(): a socket
        # left open by a bug would make term() wait forever; this closes it unlingered.
        self.ctx.destroy(linger=0)

