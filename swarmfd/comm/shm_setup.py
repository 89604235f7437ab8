"""How the ranks of one host get each other's shared-memory descriptors, at init.

Ranks sharing a kernel, a user and a way to each other's unix sockets (a network
namespace, or ``SWARMFD_SHM_DIR``) use :class:`swarmfd.comm.planes.shm.ShmPlane`; what
this defends against: docs/security.md ("Other local users", "Other jobs' containers").

The host's lowest rank, the hub, listens on a unix ``SOCK_SEQPACKET`` socket named by a
hash of the job token (abstract, or a 0600 file in ``SWARMFD_SHM_DIR``). It closes a
connection of another uid (``SO_PEERCRED``) before a byte moves; then both sides prove
the job key over both ranks, both nonces and the inode of the hub's end of this very
connection (:func:`peer_inode`), so a relay gets no descriptor; where the kernel cannot
say a rank proves with 0, which a hub that can ask refuses. Descriptors move as
``SCM_RIGHTS`` and are checked before use. The hub serves from its own thread, at most
MAX_PENDING unproven connections for HANDSHAKE_LIMIT each. The ranks agree over TCP
after each step: one that cannot take part makes all fall back to TCP, each logging why.
"""


from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..config import ENV_SHM_DIR
from . import handshake, wire
from .plane import PlaneOwner
from .planes.shm import SEGMENT_SIZE, ShmPlane

__all__ = ["Setup", "Unavailable", "decode_reasons", "encode_reason", "host_key", "setup"]

#: How often (s) the hub's thread looks whether it should stop.
WAIT_SLICE = 0.05
#: Same-user connections not proven yet at once on the hub; a new one evicts the oldest.
MAX_PENDING = 16
#: How long (s) a connection may take to prove itself and hand over (a rank takes ms).
HANDSHAKE_LIMIT = 2.0
#: Connections the hub accepts in a row before it serves the ones in a handshake.
ACCEPT_BATCH = 64
#: The setup socket's accept queue (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 512
#: Ranks per table message: two descriptors each stay under the kernel's SCM_MAX_FD (253).
TABLE_CHUNK = 100
#: Bytes of one rank's fall-back reason in the setup's agreement.
MAX_REASON = 300
#: Handshake greeting: magic, protocol version, sender rank, 16-byte nonce.
HELLO = struct.Struct("<8sBH16s")
#: After a rank's greeting: the inode of the hub's end of the connection (0: unknown).
BOUND = struct.Struct("<Q")
SHM_MAGIC = b"SWFDSHM2"
MAC_SIZE = 32
_MAC_LABEL = b"swarmfd shared-memory socket v2\0"
#: sock_diag (linux/sock_diag.h, linux/unix_diag.h): one unix socket by inode, with its peer.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_UDIAG_SHOW_PEER = 4
_UNIX_DIAG_PEER = 2
_NL_HEADER = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIII2I")
_UNIX_DIAG_MSG = struct.Struct("=BBBBI2I")
_NO_COOKIE = 0xFFFFFFFF
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


_LOG = logging.getLogger("swarmfd")


class Unavailable(Exception):
    """This rank cannot take part in the shared-memory channel (the message says why)."""


def host_key(shm_dir: str = "") -> str:
    """What ranks must share to use shared memory: the kernel, the way to the setup
    socket (network namespace, or the directory ``shm_dir``, ``SWARMFD_SHM_DIR``) and
    the user; "" (logged) when ``shm_dir`` is unusable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    if not shm_dir:
        return f"{boot}:netns:{netns}:{os.getuid()}"
    try:
        st = os.stat(shm_dir)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{shm_dir} is not a directory")
    except OSError as exc:
        _LOG.warning("swarmfd: %s=%r is unusable (%s): this rank will not use shared memory; "
                     "collectives go over TCP (slower)", ENV_SHM_DIR, shm_dir, exc)
        return ""
    return f"{boot}:dir:{st.st_dev}:{st.st_ino}:{os.getuid()}"


def socket_address(token: str, hostkey: str, shm_dir: str = "") -> str:
    """The setup socket of the job with ``token`` on the host ``hostkey``: a file in
    ``shm_dir``, or an abstract socket without one."""
    digest = hashlib.sha256(b"swarmfd shm socket name v1\0"
                            + f"{token}\0{hostkey}".encode()).hexdigest()[:32]
    name = f"swarmfd-shm-{digest}"
    return os.path.join(shm_dir, f"{name}.sock") if shm_dir else f"\0{name}"


def job_key(token: str) -> bytes:
    """The key both sides of a setup connection prove they hold (from the job token)."""
    return hashlib.sha256(b"swarmfd shm socket key v1\0" + token.encode()).digest()


def _check_segment(fd: int) -> None:
    """Refuse ``fd`` unless it is a memfd of SEGMENT_SIZE sealed against resizing (a
    peer shrinking it under a mapping would make reads past the end a SIGBUS)."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise Unavailable(f"a descriptor received as a segment is not a sealed memfd ({exc})") \
            from None
    if not stat.S_ISREG(st.st_mode) or st.st_size != SEGMENT_SIZE or seals & _SEALS != _SEALS:
        raise Unavailable(f"a descriptor received as a segment is not one (size {st.st_size}, "
                          f"seals {seals:#x})")


def _check_writer(fd: int) -> None:
    """Refuse ``fd`` unless it is the non-blocking write end of a pipe."""
    st = os.fstat(fd)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if (not stat.S_ISFIFO(st.st_mode) or flags & os.O_ACCMODE != os.O_WRONLY
            or not flags & os.O_NONBLOCK):
        raise Unavailable("a descriptor received as an inbox is not the write end of a pipe")


def encode_reason(reason: str) -> np.ndarray:
    """One rank's row for the setup's agreement: a flag byte (1: failed) and the reason."""
    row = np.zeros(1 + MAX_REASON, np.uint8)
    if reason:
        data = reason.encode("utf-8", "replace")[:MAX_REASON]
        row[0] = 1
        row[1:1 + len(data)] = np.frombuffer(data, np.uint8)
    return row


def decode_reasons(rows: Iterable[np.ndarray]) -> dict[int, str]:
    """{rank: reason} of the ranks whose row (from :func:`encode_reason`) says they failed."""
    return {r: bytes(row[1:]).rstrip(b"\0").decode("utf-8", "replace") or "(no reason given)"
            for r, row in enumerate(rows) if row[0]}


class _Segments:
    """This rank's segment and inbox, and the peers' it receives, until :meth:`plane`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.segments: dict[int, mmap.mmap] = {}
        self.memfd = -1  # this rank's segment, until every peer has it
        self.inbox = -1  # read end of this rank's pipe (never leaves this process)
        self.writer = -1  # a write end of it: the inbox never reads end-of-file
        self.outboxes: dict[int, int] = {}

    def create(self) -> None:
        """Create and map this rank's segment (a sealed memfd) and its inbox (a pipe)."""
        try:
            self.memfd = os.memfd_create("swarmfd-segment",
                                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise Unavailable(f"memfd_create failed: {exc}") from None
        try:
            os.ftruncate(self.memfd, SEGMENT_SIZE)
            fcntl.fcntl(self.memfd, fcntl.F_ADD_SEALS, _SEALS)
            self._map(self.rank, self.memfd)
        except OSError as exc:
            raise Unavailable(f"could not size, seal or map a segment of {SEGMENT_SIZE} "
                              f"bytes: {exc}") from None
        try:
            self.inbox, self.writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise Unavailable(f"could not create the inbox (a pipe): {exc}") from None

    def attach(self, rank: int, memfd: int, writer: int) -> None:
        """Check and map ``rank``'s segment, keep ``writer`` as its outbox. ``memfd``
        stays the caller's to close; ``writer`` becomes ours, or is closed if refused."""
        try:
            _check_segment(memfd)
            _check_writer(writer)
        except BaseException:
            os.close(writer)
            raise
        self.outboxes[rank] = writer
        try:
            self._map(rank, memfd)
        except OSError as exc:
            raise Unavailable(f"could not map rank {rank}'s segment: {exc}") from None

    def drop_memfd(self) -> None:
        """Close this rank's segment descriptor once every peer has it (the mapping stays)."""
        if self.memfd >= 0:
            os.close(self.memfd)
            self.memfd = -1

    def _map(self, rank: int, fd: int) -> None:
        self.segments[rank] = mmap.mmap(fd, SEGMENT_SIZE, mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)

    def plane(self, owner: PlaneOwner) -> ShmPlane:
        """The plane over these segments and pipes (they become its to close)."""
        plane = ShmPlane(owner, self.rank, self.segments, self.inbox, self.outboxes,
                         self.writer)
        self.segments, self.outboxes = {}, {}
        self.inbox = self.writer = -1
        return plane

    def close(self) -> None:
        """Unmap and close everything still held (idempotent)."""
        for mm in self.segments.values():
            with contextlib.suppress(BufferError):
                mm.close()
        self.segments = {}
        for fd in [*self.outboxes.values(), self.inbox, self.writer, self.memfd]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.outboxes = {}
        self.inbox = self.writer = self.memfd = -1


# -- setup: handing the descriptors around ----------------------------------------------


def _mac(key: bytes, role: bytes, client: int, server: int, nonce_c: bytes,
         nonce_s: bytes, bound: int) -> bytes:
    return handshake.mac(_MAC_LABEL, key, role, client, server, nonce_c, nonce_s,
                         BOUND.pack(bound))


def peer_inode(sock: socket.socket) -> int:
    """The inode of the other end of the unix socket ``sock`` (sock_diag; 0 until it is
    accepted); OSError where the kernel cannot say (no unix_diag, netlink forbidden)."""
    ino = os.fstat(sock.fileno()).st_ino
    req = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino, _UDIAG_SHOW_PEER,
                              _NO_COOKIE, _NO_COOKIE)
    head = _NL_HEADER.pack(_NL_HEADER.size + len(req), _SOCK_DIAG_BY_FAMILY, 1, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
        nl.sendto(head + req, (0, 0))
        data = nl.recv(8192)
    length, kind, _, _, _ = _NL_HEADER.unpack_from(data)
    if kind == _NLMSG_ERROR:
        err = -struct.unpack_from("=i", data, _NL_HEADER.size)[0]
        raise OSError(err, f"sock_diag: {os.strerror(err)}")
    at = _NL_HEADER.size + _UNIX_DIAG_MSG.size
    if _UNIX_DIAG_MSG.unpack_from(data, _NL_HEADER.size)[4] != ino:
        raise OSError(0, "sock_diag answered about another socket")
    while at + 4 <= min(length, len(data)):
        size, kind = struct.unpack_from("=HH", data, at)
        if kind == _UNIX_DIAG_PEER and size >= 8:
            return int(struct.unpack_from("=I", data, at + 4)[0])
        at += max(4, (size + 3) & ~3)
    return 0


def _seen(sock: socket.socket) -> int:
    """:func:`peer_inode`, or 0 where the kernel cannot say."""
    try:
        return peer_inode(sock)
    except OSError as exc:
        _LOG.debug("swarmfd: sock_diag cannot name this connection's other end (%s): the "
                   "shared-memory handshake is not bound to it", exc)
        return 0


def _relayed(count: int) -> str:
    """What the hub says of connections whose valid proof named another connection."""
    return (f"this rank's shared-memory socket got {count} connection(s) carrying a rank's "
            "valid proof made for another connection: a process relays them, sitting "
            "between the ranks and the socket (one that can rename files in "
            f"{ENV_SHM_DIR} took its name?); it got no descriptor")


def _can_diagnose(sock: socket.socket) -> bool:
    """Whether the kernel answers :func:`peer_inode` here (asked about ``sock`` itself)."""
    try:
        peer_inode(sock)
    except OSError:
        return False
    return True


def _peer_uid(sock: socket.socket) -> int:
    """The uid the kernel recorded for the other end of ``sock`` (SO_PEERCRED)."""
    return int(_CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _CRED.size))[1])


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class _Conn:
    """One connection to the hub: its handshake state, then what the rank handed over."""

    __slots__ = ("memfd", "nonce", "rank", "sock", "stage", "started", "writer")

    def __init__(self, sock: socket.socket, started: float) -> None:
        self.sock = sock
        self.started = started
        self.nonce = os.urandom(16)
        self.rank = -1
        self.stage = "hello"  # then "fds" (proven), then admitted
        self.memfd = -1
        self.writer = -1

    def close(self) -> None:
        _close_fds((self.memfd, self.writer))
        self.memfd = self.writer = -1
        self.sock.close()


class _Hub:
    """The hub's setup socket and the thread serving it until every rank handed over."""

    def __init__(self, address: str, rank: int, clients: Iterable[int], key: bytes) -> None:
        self.address = address
        self.rank = rank
        self.clients = frozenset(clients)
        self.key = key
        self.uid = os.getuid()
        #: Ranks that proved themselves and handed over their descriptors.
        self.admitted: dict[int, _Conn] = {}
        #: Connections closed without being admitted (other users, failed handshakes).
        self.refused = 0
        #: Valid proofs made for another connection: a relay was in the path.
        self.relayed = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._bound = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        #: Whether a rank's proof must name this connection (the kernel can say which).
        self.binding = _can_diagnose(self.listener)
        try:
            if not address.startswith("\0"):  # 0600 from bind on (a chmod after it
                # could follow a symlink swapped in meanwhile)
                os.fchmod(self.listener.fileno(), 0o600)
            self.listener.bind(address)
            self._bound = True
            self.listener.listen(LISTEN_BACKLOG)
            self.listener.setblocking(False)
        except BaseException:
            self._close_listener()
            raise
        self.thread = threading.Thread(target=self._serve, name="swarmfd-shm-setup",
                                       daemon=True)
        self.thread.start()

    def _close_listener(self) -> None:
        self.listener.close()
        if self._bound and not self.address.startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
        self._bound = False

    def finish(self) -> dict[int, _Conn]:
        """Stop serving (the listener closes) and return the admitted ranks' connections."""
        self._stop.set()
        self.thread.join(timeout=10 * WAIT_SLICE)
        if self.thread.is_alive():
            raise Unavailable("the shared-memory setup thread did not stop")
        if self.error is not None:
            raise Unavailable(f"the shared-memory setup thread failed: {self.error!r}")
        return self.admitted

    def close(self) -> None:
        """Stop serving and close every connection and descriptor still held (idempotent)."""
        with contextlib.suppress(Unavailable):
            self.finish()
        for c in self.admitted.values():
            c.close()
        self.admitted = {}

    # -- the thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, _Conn] = {}  # in order of arrival
        try:
            sel.register(self.listener, selectors.EVENT_READ, None)
            while not self._stop.is_set() and len(self.admitted) < len(self.clients):
                for key, _ in sel.select(WAIT_SLICE):
                    if key.data is None:
                        self._accept(sel, pending)
                    elif key.data.sock in pending:
                        self._step(sel, pending, key.data)
                now = time.monotonic()
                for c in [c for c in pending.values() if now - c.started > HANDSHAKE_LIMIT]:
                    self._drop(sel, pending, c)
        except BaseException as exc:  # a bug: the main thread reports it
            self.error = exc
        finally:
            for c in list(pending.values()):
                self._drop(sel, pending, c)
            sel.close()
            self._close_listener()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Conn]) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: it stays queued; do not spin on it
                time.sleep(WAIT_SLICE / 5)
                return
            try:
                uid = _peer_uid(sock)
            except OSError:
                uid = -1
            if uid != self.uid:
                self.refused += 1
                sock.close()  # another user: not a byte read or written
                continue
            unproven = [p for p in pending.values() if p.stage == "hello"]
            if len(unproven) >= MAX_PENDING:
                self._drop(sel, pending, unproven[0])  # the oldest unproven
            c = _Conn(sock, time.monotonic())
            try:
                sock.setblocking(False)
                sock.send(HELLO.pack(SHM_MAGIC, wire.PROTOCOL_VERSION, self.rank, c.nonce))
            except OSError:
                self.refused += 1
                sock.close()
                continue
            pending[sock] = c
            sel.register(sock, selectors.EVENT_READ, c)

    def _drop(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Conn],
              c: _Conn) -> None:
        pending.pop(c.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(c.sock)
        self.refused += 1  # counted before the close, which the other end sees at once
        c.close()

    def _step(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Conn],
              c: _Conn) -> None:
        """Advance ``c`` by one message: its proof, then its descriptors."""
        try:
            if c.stage == "hello":  # a plain recv: the kernel closes any descriptors
                msg = c.sock.recv(HELLO.size + BOUND.size + MAC_SIZE + 1)
                c.sock.send(self._prove(c, msg, pending))
                c.stage = "fds"
                return
            msg, fds, flags, _ = socket.recv_fds(c.sock, 2, 2, socket.MSG_CMSG_CLOEXEC)
            c.memfd, c.writer = [*fds, -1, -1][:2]  # maxfds=2: the kernel closed any more
            if msg != b"F" or len(fds) != 2 or flags & socket.MSG_CTRUNC:
                raise Unavailable("not a segment and an inbox")
            c.sock.send(b"A")  # (what they are is checked before use: _Segments.attach)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, Unavailable, ValueError):
            self._drop(sel, pending, c)
            return
        pending.pop(c.sock)
        sel.unregister(c.sock)
        self.admitted[c.rank] = c

    def _prove(self, c: _Conn, msg: bytes, pending: dict[socket.socket, _Conn]) -> bytes:
        """Check a rank's greeting and proof for this very connection; the hub's proof."""
        if len(msg) != HELLO.size + BOUND.size + MAC_SIZE:
            raise ValueError("not a swarmfd greeting")
        magic, version, rank, nonce = HELLO.unpack_from(msg)
        (seen,) = BOUND.unpack_from(msg, HELLO.size)
        if magic != SHM_MAGIC or version != wire.PROTOCOL_VERSION:
            raise ValueError("not a swarmfd greeting")
        if (rank not in self.clients or rank in self.admitted
                or any(p.rank == rank for p in pending.values())):
            raise ValueError(f"a connection claims rank {rank}, unexpected or taken")
        if not hmac.compare_digest(msg[HELLO.size + BOUND.size:],
                                   _mac(self.key, b"c", rank, self.rank, nonce, c.nonce, seen)):
            raise ValueError(f"bad proof from a connection claiming rank {rank}")
        mine = os.fstat(c.sock.fileno()).st_ino
        if seen != mine and (seen or self.binding):
            if seen:
                self.relayed += 1  # rank's valid proof, made for another connection
            raise ValueError(f"rank {rank}'s proof names another connection (a relay?)")
        c.rank = rank
        return _mac(self.key, b"s", rank, self.rank, nonce, c.nonce, seen)


class Setup:
    """One rank's part in setting up its host's channel: ``ranks`` are the host's, the
    lowest the hub; :meth:`close` releases what is still held (idempotent)."""

    def __init__(self, rank: int, ranks: Iterable[int], token: str, hostkey: str,
                 deadline: float, shm_dir: str = "") -> None:
        self.rank = rank
        self.ranks = sorted(ranks)
        self.hub = self.ranks[0]
        self.address = socket_address(token, hostkey, shm_dir)
        self.key = job_key(token)
        self.deadline = deadline
        self.channel: _Segments | None = _Segments(rank)
        self.server: _Hub | None = None  # on the hub
        self.conn: socket.socket | None = None  # on the others: the connection to the hub

    def run(self, agree: Callable[[str], dict[int, str]]) -> _Segments | None:
        """The segments, or None once every rank agreed to fall back to TCP (logged).
        ``agree(reason)`` (a TCP all_gather; "" for success) returns {rank: reason} of
        the ranks that failed, or raises when a rank is lost."""
        for step in (self._create, self._hand_over, self._receive):
            try:
                step()
                reason = ""
            except Unavailable as exc:
                reason = str(exc)
            except OSError as exc:
                reason = f"shared-memory setup failed: {exc}"
            failed = agree(reason)
            if failed:
                relayed = self.server.relayed if self.server is not None else 0
                _LOG.warning(
                    "swarmfd rank %d: shared memory between the ranks of this host is "
                    "unavailable, collectives use TCP (slower): %s%s", self.rank,
                    "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())),
                    f"; {_relayed(relayed)}" if relayed and "relay" not in reason else "")
                self.close()
                return None
        channel, self.channel = self.channel, None
        assert channel is not None
        channel.drop_memfd()
        self.close()
        return channel

    def close(self) -> None:
        """Close the setup's sockets and descriptors (and the channel, unless handed out)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _create(self) -> None:
        """This rank's segment and inbox; the hub's listener, the others' socket."""
        assert self.channel is not None
        self.channel.create()
        try:
            if self.rank == self.hub:
                self.server = _Hub(self.address, self.rank, self.ranks[1:], self.key)
            else:
                self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except (OSError, RuntimeError) as exc:  # RuntimeError: no thread to serve it
            raise Unavailable(f"could not {'listen on' if self.rank == self.hub else 'open'} "
                              f"the host's shared-memory socket: {exc}") from None

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        return left

    def _hand_over(self) -> None:
        """Connect to the hub, prove it and this rank, give it this rank's descriptors."""
        if self.rank == self.hub:
            return  # its thread takes the others' meanwhile
        sock, channel, hub = self.conn, self.channel, self.hub
        assert sock is not None and channel is not None
        try:
            while True:
                sock.settimeout(self._remaining())
                try:
                    sock.connect(self.address)
                    break
                except BlockingIOError:
                    time.sleep(0.001)  # the accept queue is full: the hub drains it
        except OSError as exc:
            raise Unavailable(f"could not connect to the host's shared-memory socket (rank "
                              f"{hub}'s): {exc}") from None
        uid = _peer_uid(sock)
        if uid != os.getuid():
            raise Unavailable(f"the host's shared-memory socket belongs to uid {uid}, not to "
                              f"this rank's uid {os.getuid()}")
        try:
            msg = self._recv(HELLO.size + 1)
            if len(msg) != HELLO.size:
                raise Unavailable("not a swarmfd greeting")
            magic, version, rank, nonce_s = HELLO.unpack(msg)
            if magic != SHM_MAGIC or version != wire.PROTOCOL_VERSION or rank != hub:
                raise Unavailable("not a swarmfd greeting")
            seen = _seen(sock)  # the hub's end of this connection (it accepted already)
            nonce_c = os.urandom(16)
            sock.send(HELLO.pack(SHM_MAGIC, wire.PROTOCOL_VERSION, self.rank, nonce_c)
                      + BOUND.pack(seen)
                      + _mac(self.key, b"c", self.rank, hub, nonce_c, nonce_s, seen))
            if not hmac.compare_digest(
                    self._recv(MAC_SIZE + 1),
                    _mac(self.key, b"s", self.rank, hub, nonce_c, nonce_s, seen)):
                raise Unavailable("its owner did not prove it belongs to this job")
            socket.send_fds(sock, [b"F"], [channel.memfd, channel.writer])
            if self._recv(2) != b"A":
                raise Unavailable(f"rank {hub} did not take this rank's segment")
        except (OSError, Unavailable) as exc:
            raise Unavailable(f"the handshake with rank {hub} on the host's shared-memory "
                              f"socket failed: {exc}") from None

    def _recv(self, n: int) -> bytes:
        assert self.conn is not None
        self.conn.settimeout(self._remaining())
        msg = self.conn.recv(n)
        if not msg:
            raise Unavailable(f"rank {self.hub} closed the connection")
        return msg

    def _receive(self) -> None:
        """Hub: send every rank the others' descriptors. Others: receive and map them."""
        if self.rank == self.hub:
            self._send_tables()
            return
        sock, channel = self.conn, self.channel
        assert sock is not None and channel is not None
        expected = set(self.ranks) - {self.rank}
        while expected:
            try:
                sock.settimeout(self._remaining())
                msg, fds, flags, _ = socket.recv_fds(sock, 1 + 2 * TABLE_CHUNK, 2 * TABLE_CHUNK,
                                                     socket.MSG_CMSG_CLOEXEC)
            except OSError as exc:
                raise Unavailable(f"could not receive the other ranks' segments from rank "
                                  f"{self.hub}: {exc}") from None
            try:
                if not msg:
                    raise Unavailable(f"rank {self.hub} closed the connection before sending "
                                      "the other ranks' segments")
                if flags & socket.MSG_CTRUNC:
                    raise Unavailable(
                        f"could not receive the other ranks' segments: the kernel delivered "
                        f"{len(fds)} descriptor(s) and dropped the rest (MSG_CTRUNC: is this "
                        "process at its descriptor limit, RLIMIT_NOFILE?)")
                ranks = (list(struct.unpack(f"<{len(msg) // 2}H", msg[1:]))
                         if msg[:1] == b"T" and len(msg) % 2 == 1 else [])
                if (not ranks or len(fds) != 2 * len(ranks) or len(set(ranks)) != len(ranks)
                        or not set(ranks) <= expected):
                    raise Unavailable(f"rank {self.hub} sent a malformed table of segments")
                for i, p in enumerate(ranks):
                    writer, fds[2 * i + 1] = fds[2 * i + 1], -1  # the channel's now
                    channel.attach(p, fds[2 * i], writer)
                    expected.discard(p)
            finally:
                _close_fds(fds)

    def _send_tables(self) -> None:
        assert self.server is not None and self.channel is not None
        channel = self.channel
        admitted = self.server.finish()  # every other rank said it handed over: all here
        if set(admitted) != set(self.ranks[1:]):
            relayed = self.server.relayed
            raise Unavailable(
                f"rank(s) {sorted(set(self.ranks[1:]) - set(admitted))} did not hand over "
                "their segments" + (f"; {_relayed(relayed)}" if relayed else ""))
        segments = {self.rank: (channel.memfd, channel.writer)}
        for r, c in admitted.items():
            writer, c.writer = c.writer, -1
            channel.attach(r, c.memfd, writer)
            segments[r] = (c.memfd, writer)
        for r, c in admitted.items():
            others = [p for p in self.ranks if p != r]
            for i in range(0, len(others), TABLE_CHUNK):
                chunk = others[i:i + TABLE_CHUNK]
                try:
                    c.sock.settimeout(self._remaining())
                    socket.send_fds(c.sock, [b"T" + struct.pack(f"<{len(chunk)}H", *chunk)],
                                    [fd for p in chunk for fd in segments[p]])
                except OSError as exc:
                    raise Unavailable(f"could not send rank {r} the other ranks' segments: "
                                      f"{exc}") from None


def setup(t: Any, ranks: list[int], hostkey: str, deadline: float,
          agree: Callable[[str], dict[int, str]], shm_dir: str = "") -> ShmPlane | None:
    """The shared-memory plane with the other ``ranks`` of this host, or None when they
    agreed to use TCP (see :meth:`Setup.run`); ``shm_dir``: as :func:`host_key`'s."""
    s = Setup(t.rank, ranks, t.job_token, hostkey, deadline, shm_dir)
    try:
        segments = s.run(agree)
        return None if segments is None else segments.plane(t.channel)
    finally:
        s.close()
