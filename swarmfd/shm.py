"""Shared-memory channel between ranks on one host (what ``swarmfd run`` uses).

When every rank of a group runs on the same machine, in the same network
namespace and with the same ``/dev/shm`` (``swarmfd run``; not separate
containers), collectives move data through shared memory instead of TCP:

* each rank owns one POSIX shared-memory file of ``SLOTS * SEGMENT_BYTES``
  (slots used in turn, so a slot is filled while peers may still read the
  previous ones), mapped by every rank;
* each rank owns one FIFO (its inbox) that peers write small records to: a
  :mod:`swarmfd.wire` header, the same one the TCP path uses, so a record carries
  the collective's signature and mismatches are caught exactly as over TCP.

A record is at most ``PIPE_BUF`` bytes, so writes are atomic and never
interleave. Both kinds of files are created ``0600`` (owner only) under
unpredictable names and unlinked as soon as every rank has opened them: nothing
is left in ``/dev/shm`` even when a rank is killed, and no other user can open
them. A lost peer is noticed through the group's TCP connections (``check``).

Arrays larger than a segment are processed in rounds of ``SEGMENT_BYTES``; the
extra memory of a rank is therefore bounded (its segment and the parts of the
peers' segments it reads), whatever the array size.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import time
from collections.abc import Callable

import numpy as np

from . import wire
from .errors import (
    AbortedError,
    CollectiveError,
    CollectiveTimeout,
    MismatchError,
    PeerLostError,
    ProtocolError,
    abort_kind,
    error_from_abort,
)

#: Bytes of one round (one slot of each rank's segment). Small enough to stay in cache.
SEGMENT_BYTES = 1 << 20
#: Slots per segment: a pipelined all_reduce touches three rounds at once.
SLOTS = 3
#: A wait returns this often (s) to check the deadline and the peers' liveness.
WAIT_SLICE = 0.05
#: After a peer closed its inbox, how long (s) to wait for its abort or for the TCP side
#: to report it lost (which takes the transport's 0.3 s grace) before raising anyway.
PEER_GONE_WAIT = 1.0
#: How long a wait polls before it sleeps (only when every rank can have its own core).
SPIN_SECONDS = 50e-6
#: Consecutive fruitless spins after which waits sleep at once for a while.
SPIN_MAX_MISSES = 8
#: Longest record written to a FIFO (POSIX guarantees atomic writes up to PIPE_BUF).
MAX_RECORD = 4096
SHM_DIR = "/dev/shm"


def host_key() -> str:
    """Identifies what ranks must share to use this channel: machine, netns, /dev/shm, user."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        shm = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{netns}:{shm.st_dev}:{shm.st_ino}:{os.getuid()}"


class ShmChannel:
    """Shared segments and FIFO inboxes of one group (see module docstring)."""

    def __init__(self, rank: int, world_size: int, token: str, timeout: float,
                 check: Callable[[int | None], None]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.check = check  # raises when a peer is lost (argument: the rank waited for)
        self.prefix = os.path.join(SHM_DIR, f"swarmfd-{token}")
        self.segments: list[mmap.mmap | None] = [None] * world_size
        self.views: list[np.ndarray | None] = [None] * world_size
        self.inbox = -1
        self.outboxes: dict[int, int] = {}
        self.pending: dict[tuple[int, int, int], tuple[wire.Header, bytes]] = {}
        self.buffer = b""
        self.round = 0
        self.spin = world_size <= (os.cpu_count() or 1)
        self.spin_misses = 0
        self.sleeps = 0
        self.activity = "idle"
        self._created: list[str] = []

    # -- setup: create own files, (peers create theirs), open peers', unlink own ------------

    def _path(self, rank: int, kind: str) -> str:
        return f"{self.prefix}-{rank}.{kind}"

    def create(self) -> None:
        """Create this rank's segment and inbox (0600, exclusive)."""
        seg = self._path(self.rank, "seg")
        fd = os.open(seg, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._created.append(seg)
        try:
            os.ftruncate(fd, SLOTS * SEGMENT_BYTES)
            self._map(self.rank, fd)
        finally:
            os.close(fd)
        fifo = self._path(self.rank, "fifo")
        os.mkfifo(fifo, 0o600)
        self._created.append(fifo)
        # O_RDWR: the inbox never sees end-of-file and opening it never blocks.
        self.inbox = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)

    def open_peers(self) -> None:
        """Map every peer's segment and open its inbox for writing."""
        for p in range(self.world_size):
            if p == self.rank:
                continue
            fd = os.open(self._path(p, "seg"), os.O_RDWR)
            try:
                if os.fstat(fd).st_size != SLOTS * SEGMENT_BYTES:
                    raise ProtocolError(f"shared segment of rank {p} has the wrong size")
                self._map(p, fd)
            finally:
                os.close(fd)
            self.outboxes[p] = os.open(self._path(p, "fifo"), os.O_WRONLY | os.O_NONBLOCK)

    def unlink_own(self) -> None:
        """Remove this rank's names; the open mappings and FIFOs keep working."""
        for path in self._created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._created = []

    def _map(self, rank: int, fd: int) -> None:
        mm = mmap.mmap(fd, SLOTS * SEGMENT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.segments[rank] = mm
        self.views[rank] = np.frombuffer(mm, dtype=np.uint8)

    def close(self) -> None:
        """Unmap and close everything (idempotent)."""
        self.unlink_own()
        self.views = [None] * self.world_size
        for i, mm in enumerate(self.segments):
            if mm is not None:
                # A view still alive somewhere keeps the mapping; the GC unmaps it later.
                with contextlib.suppress(BufferError):
                    mm.close()
                self.segments[i] = None
        for fd in list(self.outboxes.values()) + ([self.inbox] if self.inbox >= 0 else []):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.outboxes = {}
        self.inbox = -1

    # -- buffers ----------------------------------------------------------------------

    def next_slot(self) -> int:
        """Byte offset of the slot for the next round (in turn; the same on every rank)."""
        slot = (self.round % SLOTS) * SEGMENT_BYTES
        self.round += 1
        return slot

    def region(self, rank: int, slot: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at the start of ``rank``'s slot at offset ``slot``."""
        view = self.views[rank]
        assert view is not None
        return view[slot: slot + count * dtype.itemsize].view(dtype)

    # -- signalling ---------------------------------------------------------------------

    def send(self, dst: int, sig: wire.Signature, seq: int, tag: int,
             kind: int = wire.Kind.DATA, payload: bytes = b"") -> None:
        """Write one record to ``dst``'s inbox (atomic; retries while the FIFO is full)."""
        record = wire.pack_header(kind, sig, self.rank, seq, tag, len(payload)) + payload
        fd = self.outboxes[dst]
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                os.write(fd, record)
                return
            except BlockingIOError:
                pass
            except BrokenPipeError:
                # The peer closed its inbox: it failed or exited, and an abort it sent
                # before is in ours: raise that reason rather than a bare "gone". Else
                # let the group's TCP side see it go (``check`` raises PeerLostError after
                # its grace): the leaving rank then exits first, and the launcher and
                # Swarm name it as the rank that ended the job, not this one.
                gone = time.monotonic() + PEER_GONE_WAIT
                while time.monotonic() < gone:
                    self._read_pending(sig, seq)
                    self.check(dst)
                    time.sleep(0.01)
                raise PeerLostError(
                    f"{self.activity}: rank {dst} closed its inbox (it failed or exited)"
                ) from None
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"{self.activity}: rank {dst} did not read its messages within "
                    f"{self.timeout:g} s"
                )
            self.check(dst)
            select.select([], [fd], [], WAIT_SLICE)

    def recv(self, src: int, sig: wire.Signature, seq: int, tag: int) -> bytes:
        """Wait for the record (src, seq, tag); checks signatures, aborts, liveness, timeout."""
        key = (src, seq & 0xFFFFFFFF, tag)
        deadline = time.monotonic() + self.timeout
        while True:
            got = self.pending.pop(key, None)
            if got is not None:
                hdr, payload = got
                if not hdr.matches(sig):
                    raise self._mismatch(hdr, sig)
                return payload
            self._read(src, sig, seq, deadline)

    def _read(self, src: int, sig: wire.Signature, seq: int, deadline: float) -> None:
        data = self._spin() if self.spin and self.spin_misses < SPIN_MAX_MISSES else b""
        if data:
            self.buffer += data
            self._parse(sig, seq)
            return
        ready, _, _ = select.select([self.inbox], [], [], WAIT_SLICE)
        if self.spin and self.spin_misses >= SPIN_MAX_MISSES:
            self.sleeps += 1
            if self.sleeps % 32 == 0:
                self.spin_misses = SPIN_MAX_MISSES // 2  # try spinning again now and then
        if not ready:
            self.check(src)
            if time.monotonic() >= deadline:
                raise wire.timeout_error(self.activity, sig, self.timeout, src)
            return
        try:
            self.buffer += os.read(self.inbox, 65536)
        except BlockingIOError:
            return
        self._parse(sig, seq)

    def _read_pending(self, sig: wire.Signature, seq: int) -> None:
        """Parse whatever is already in the inbox (raises on an abort or a mismatch)."""
        try:
            self.buffer += os.read(self.inbox, 65536)
        except BlockingIOError:
            return
        self._parse(sig, seq)

    def _spin(self) -> bytes:
        """Poll the inbox for a few microseconds before sleeping in select().

        A peer on another core usually answers within microseconds; catching its
        record without sleeping saves two wake-ups (tens of microseconds each).
        Only used when there is a core per rank. After SPIN_MAX_MISSES spins in a
        row that caught nothing (a busy machine, where the peer is not running),
        spinning pauses so it stops stealing the CPU the peer needs; it is tried
        again every 32 sleeps.
        """
        end = time.perf_counter() + SPIN_SECONDS
        inbox = self.inbox
        while True:
            try:
                data = os.read(inbox, 65536)
                self.spin_misses = 0
                return data
            except BlockingIOError:
                pass
            if time.perf_counter() > end:
                self.spin_misses += 1
                return b""

    def _parse(self, sig: wire.Signature, seq: int) -> None:
        while len(self.buffer) >= wire.HEADER_SIZE:
            try:
                hdr = wire.unpack_header(self.buffer[: wire.HEADER_SIZE])
            except ProtocolError:
                self.buffer = b""  # only our own ranks can write here: cannot happen
                raise
            end = wire.HEADER_SIZE + hdr.nbytes
            if len(self.buffer) < end:
                break
            payload, self.buffer = self.buffer[wire.HEADER_SIZE:end], self.buffer[end:]
            if hdr.kind == wire.Kind.ABORT:
                raise self._aborted(hdr, payload)
            behind = (seq - hdr.seq) & 0xFFFFFFFF
            if behind == 0 and not hdr.matches(sig):
                raise self._mismatch(hdr, sig)
            if 0 < behind < 0x80000000:
                raise wire.finished_call_error(self.rank, hdr)
            self.pending[(hdr.src, hdr.seq, hdr.tag)] = (hdr, payload)

    def barrier(self, sig: wire.Signature, seq: int, tag: int) -> None:
        """Dissemination barrier over the inboxes: ceil(log2 N) rounds."""
        d, step = 1, 0
        while d < self.world_size:
            self.send((self.rank + d) % self.world_size, sig, seq, (tag << 8) | step)
            self.recv((self.rank - d) % self.world_size, sig, seq, (tag << 8) | step)
            d, step = d * 2, step + 1

    def abort(self, error: BaseException) -> None:
        """Tell every peer this rank failed (best effort, never blocks)."""
        if isinstance(error, AbortedError):
            return
        body = json.dumps({"kind": abort_kind(error), "rank": self.rank,
                           "message": str(error)[:3000]}).encode()[: MAX_RECORD - 64]
        sig = wire.Signature(wire.Collective.NONE)
        record = wire.pack_header(wire.Kind.ABORT, sig, self.rank, 0, 0, len(body)) + body
        for fd in self.outboxes.values():
            # A full or closed inbox: that peer learns of the failure through TCP.
            with contextlib.suppress(OSError):
                os.write(fd, record)

    def _mismatch(self, hdr: wire.Header, sig: wire.Signature) -> MismatchError:
        return wire.mismatch_error(self.rank, sig, hdr)

    def _aborted(self, hdr: wire.Header, payload: bytes) -> CollectiveError:
        return error_from_abort(self.activity, hdr.src, payload)


def split_rounds(nbytes: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, stop) element bounds of the rounds an array of ``nbytes`` needs."""
    per = SEGMENT_BYTES // itemsize
    count = nbytes // itemsize
    if count == 0:
        return [(0, 0)]
    return [(a, min(a + per, count)) for a in range(0, count, per)]
