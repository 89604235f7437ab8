"""The plane interface: how the message layer (:mod:`swarmfd.comm.channel`) moves bytes.

A *plane* connects this rank to some of its peers and moves whole messages: a
:mod:`swarmfd.comm.wire` header and its payload. Three implement it:

* :class:`swarmfd.comm.planes.socket.SocketPlane`: plain TCP connections and a
  single-threaded progress engine (the default between hosts);
* :class:`swarmfd.comm.planes.zmq.ZmqPlane`: a ZeroMQ ROUTER that sends and one DEALER
  that receives (required for an encrypted data plane);
* :class:`swarmfd.comm.planes.shm.ShmPlane`: the ranks of one host, through shared
  memory; its messages are small records (the data itself moves through shared
  segments the shm algorithms address directly).

Whatever a plane does differently stays inside it. The message layer on top is the
same for all: matching, the stash, signatures, deadlines, lost peers, aborts.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .wire import Header, Signature

__all__ = ["PeerInfo", "Plane", "PlaneOwner", "reserve_port"]


@dataclass(frozen=True)
class PeerInfo:
    """What rendezvous tells every rank about one peer."""

    rank: int
    #: The address of its TCP data plane: its ROUTER socket (zmq) or listening socket.
    endpoint: str
    host: str
    pid: int
    #: What ranks must share to use shared memory (machine, network namespace, user);
    #: "" when the rank does not offer it (SWARMFD_TRANSPORT=tcp).
    hostkey: str = ""
    #: The per-session token of its data plane: the key its peers' one-time PLAIN
    #: passwords derive from (zmq), of its handshakes' HMAC (socket), and of its
    #: shared-memory handshake; unencrypted plane only.
    token: str = field(default="", repr=False)
    #: Its TCP data plane (config.DATA_PLANES); every rank of a job must use the same.
    plane: str = "socket"
    #: Where it offers its host's shared memory (the shm plane's local socket), or "".
    shm: str = ""
    #: The launch it belongs to (SWARMFD_JOB_ID, "" for ranks started by hand): rank 0
    #: refuses a rank of another launch, even one with the same secret.
    job: str = ""
    #: Its elastic agent (``incarnation@host:port``, :mod:`swarmfd.comm.agent`), "" when
    #: the job is not elastic.
    agent: str = ""


class PlaneOwner(Protocol):
    """What a plane reports into: the message layer that owns it."""

    #: rank -> when its connection was found closed or broken.
    lost: dict[int, float]
    #: Peers whose listener refused this rank's authentication.
    refused: set[int]
    #: What the rank is doing, for error messages.
    activity: str

    def where(self, rank: int) -> str:
        """A peer's host, pid and address, for error messages."""


class Plane(Protocol):
    """One way of moving messages between this rank and ``peers`` (see module docstring).

    Sends never block: what the kernel (or libzmq) does not take at once is queued,
    and every wait drives the queues. A large payload may be sent without a copy:
    :meth:`unsent` names the peers whose queued bytes still read the caller's buffers
    and :meth:`wait` drives them out.
    """

    #: "socket", "zmq" or "shm": for messages and logs; nothing chooses by it.
    name: str
    #: Whether the peers' shared-memory segments are mapped here: the algorithms then
    #: address them directly (:meth:`Op.region`), and messages are only small records.
    shares_memory: bool
    #: Whether this rank reads and writes its peers' buffers directly (cross-memory
    #: attach, shared memory only; every rank of the host agreed it can).
    reads_peers: bool
    #: Whether an I/O thread (libzmq's) moves every message: a hop then costs thread
    #: hand-offs on both ends, so the choice prefers fewer hops to fewer messages.
    io_thread: bool
    #: The largest payload a message carries in one frame (or record) with its header.
    inline_max: int
    #: Where peers reach it (announced at rendezvous); "" when that is not a TCP address.
    endpoint: str
    #: Whether a payload read without a buffer (``read_payload(hdr, None, ...)``) is
    #: handed over as it arrived (ZeroMQ's frame), rather than copied into a new buffer
    #: (the socket plane): algorithms that reduce piece after piece receive into one
    #: reused buffer where it is not (:meth:`swarmfd.algorithms.base.Op.recv_operand`).
    zero_copy_recv: bool

    def idle(self) -> None:
        """Look after listeners while the rank waits elsewhere (the rendezvous)."""

    def connect(self, peers: Sequence[PeerInfo], deadline: float) -> None:
        """Connect to ``peers`` (authenticated), by ``deadline``."""

    def send(self, dst: int, kind: int, sig: Signature, seq: int, tag: int, payload: Any,
             size: int, copy: bool, group: int) -> None:
        """Queue one message; ``copy``: the caller's buffer is free when this returns."""

    def header(self, kind: int, sig: Signature, src: int, tag: int, nbytes: int,
               group: int) -> tuple[bytes, bytes]:
        """The header of a message (``src``'s, ``tag``, ``nbytes`` of payload, in
        ``group``) as this plane frames it, cut around the call's number
        (:func:`swarmfd.comm.wire.cut_header`): a call repeated many times packs its
        headers once (:meth:`send_packed`, :meth:`take`)."""

    def send_packed(self, dst: int, header: bytes, payload: Any, size: int,
                    copy: bool) -> bool:
        """:meth:`send` of a message whose header is packed already (from
        :meth:`header`); whether bytes to ``dst`` stay queued, still reading the
        caller's buffer or waiting to go out: only then must the caller flush."""

    def take(self, src: int, header: bytes, nbytes: int) -> Any:
        """``src``'s next message when its header is ``header`` (packed, byte for byte)
        and it is here whole: its payload (a view valid until the plane reads again, or
        bytes), what the channel's receive would give, in a few steps. None, having
        consumed nothing, in any other case (the channel's receive then handles it: a
        mismatch, an abort, another call's message, a lost peer)."""

    def send_all(self, kind: int, sig: Signature, body: bytes, group: int) -> None:
        """Best effort: ``body`` to every peer (aborts, timeout reports); never raises."""

    def next_header(self, timeout: float, src: int = -1) -> Header | None:
        """The next message's header, or None after ``timeout`` seconds (drives sends).
        Its payload must be read with :meth:`read_payload` before the next call.
        ``src`` is the peer the caller waits for (-1: any): a plane that reads its peers
        through separate sockets looks there first (a hint, never a filter)."""

    def read_payload(self, hdr: Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        """The payload of the header :meth:`next_header` returned: into ``into`` (None
        returned) or as a new buffer (``keep``: one that may outlive the next receive).
        Calls ``between`` after every wait slice without progress."""

    def unsent(self) -> list[int]:
        """Peers with queued bytes that still read a caller's buffer (or must go out)."""

    def wait(self, timeout: float) -> Header | None:
        """Drive queued sends for up to ``timeout`` s; a header that arrived meanwhile."""

    def check_lost(self) -> None:
        """Record peers whose connection closed in the owner's ``lost``."""

    def close(self, linger: float) -> None:
        """Close everything; queued sends get ``linger`` seconds."""


def reserve_port(host: str, avoid: Collection[int] = ()) -> socket.socket:
    """A TCP socket bound on ``host`` to a port the system picks, but none of ``avoid``
    (see ``avoid`` of :class:`swarmfd.comm.transport.Transport`), and not listening: the
    port is a rank's data endpoint, announced in the rendezvous, and nobody can connect
    to it (the kernel resets every attempt) until the plane listens, once the rendezvous
    is over (see the planes). Without SO_REUSEADDR, so that no other socket can bind the
    port meanwhile. A port to avoid stays bound until another is found, so that the
    system does not pick it again."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held: list[socket.socket] = []
    try:
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.bind((host, 0))
            except BaseException:
                sock.close()
                raise
            if sock.getsockname()[1] not in avoid:
                return sock
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
