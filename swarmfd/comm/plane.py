"""The plane interface: how the message layer (:mod:`swarmfd.comm.channel`) moves bytes.

A *plane* connects this rank to some peers and moves whole messages (a
:mod:`swarmfd.comm.wire` header and its payload): :mod:`.planes.socket` (plain TCP, the
default between hosts), :mod:`.planes.zmq` (ZeroMQ; the one that encrypts) and
:mod:`.planes.shm` (one host's shared memory: small records, the data moving through
segments the algorithms address). What a plane does differently stays inside it; the
message layer on top (docs/internals.md) is the same for all.
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
    #: What ranks must share to use shared memory (shm_setup.host_key); "" where not offered.
    hostkey: str = ""
    #: The per-session token its data plane's handshakes prove (unencrypted plane only).
    token: str = field(default="", repr=False)
    #: Its TCP data plane (config.DATA_PLANES); every rank of a job must use the same.
    plane: str = "socket"
    #: Where it offers its host's shared memory (the shm plane's local socket), or "".
    shm: str = ""
    #: Its launch (SWARMFD_JOB_ID, "" by hand): rank 0 refuses a rank of another launch.
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
    """One way of moving messages between this rank and its peers.

    Sends never block: what is not taken at once is queued, and every wait drives the
    queues; :meth:`unsent` names the peers whose queued bytes may still read a caller's
    buffer, and :meth:`wait` drives them out.
    """

    #: "socket", "zmq" or "shm": for messages and logs; nothing chooses by it.
    name: str
    #: The peers' segments are mapped here: algorithms address them, messages are records.
    shares_memory: bool
    #: This rank reads and writes its peers' buffers (cross-memory attach, agreed by all).
    reads_peers: bool
    #: An I/O thread (libzmq's) moves every message: a hop costs hand-offs at both ends.
    io_thread: bool
    #: The largest payload a message carries in one frame (or record) with its header.
    inline_max: int
    #: Where peers reach it (announced at rendezvous); "" when that is not a TCP address.
    endpoint: str
    #: A payload read without a buffer comes as it arrived (ZeroMQ's frame), not copied:
    #: elsewhere a piecewise reduction reuses one buffer (Op.recv_operand).
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
        """A message's header as this plane frames it, cut around the call's number
        (:func:`swarmfd.comm.wire.cut_header`): a repeated call packs it once."""

    def send_packed(self, dst: int, header: bytes, payload: Any, size: int,
                    copy: bool) -> bool:
        """:meth:`send` with a header packed from :meth:`header`; whether bytes to ``dst``
        stay queued (only then must the caller flush)."""

    def take(self, src: int, header: bytes, nbytes: int) -> Any:
        """``src``'s next message if its header is ``header`` byte for byte and it is here
        whole: its payload (a view valid until the plane reads again, or bytes). Else
        None, having consumed nothing: the channel's receive then handles it."""

    def send_all(self, kind: int, sig: Signature, body: bytes, group: int) -> None:
        """Best effort: ``body`` to every peer (aborts, timeout reports); never raises."""

    def next_header(self, timeout: float, src: int = -1) -> Header | None:
        """The next message's header (its payload read with :meth:`read_payload` before
        the next call), or None after ``timeout`` s; drives sends. ``src``: the peer
        waited for (-1: any), a hint, never a filter."""

    def read_payload(self, hdr: Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        """The payload of :meth:`next_header`'s header: into ``into`` (None returned) or a
        new buffer (``keep``: may outlive the next receive). Calls ``between`` (which
        raises on a deadline or a lost peer) after every wait slice without progress."""

    def unsent(self) -> list[int]:
        """Peers with queued bytes that still read a caller's buffer (or must go out)."""

    def wait(self, timeout: float) -> Header | None:
        """Drive queued sends for up to ``timeout`` s; a header that arrived meanwhile."""

    def check_lost(self) -> None:
        """Record peers whose connection closed in the owner's ``lost``."""

    def close(self, linger: float) -> None:
        """Close everything; queued sends get ``linger`` seconds."""


def reserve_port(host: str, avoid: Collection[int] = ()) -> socket.socket:
    """A TCP socket bound on ``host`` to a free port not in ``avoid``, not listening:
    a rank's data endpoint, announced at rendezvous, which resets every connection until
    the plane listens. No SO_REUSEADDR, so nothing else binds it meanwhile."""
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
