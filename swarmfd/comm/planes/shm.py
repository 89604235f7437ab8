"""The shared-memory plane: the ranks of one host, through segments and pipes.

Each rank of a host owns:

* one **segment**: an anonymous memory file (``memfd_create``, sealed against
  shrinking and growing) of AREAS areas of SLOTS slots of SEGMENT_BYTES, mapped by
  every rank of the host. A group on this host uses one area (:func:`area_of`); its
  algorithms copy into their own slot and read the others' directly
  (:meth:`ShmPlane.region`). Pages are allocated when first touched, so unused areas
  cost address space only;
* one **inbox**: a pipe that peers write small records to, each a
  :mod:`swarmfd.comm.wire` header and at most MAX_RECORD - HEADER_SIZE payload bytes,
  so a record carries the call's signature and mismatches are caught exactly as on
  TCP. A record is at most PIPE_BUF bytes, so writes are atomic and never interleave.
  The owner holds the only read end (and one write end, so it never reads
  end-of-file); a peer's write fails with EPIPE exactly when the owner is gone, and
  the plane reports that peer lost.

Nothing has a name: the segments and pipes exist only as descriptors and mappings,
freed by the kernel when the last rank holding one exits, however it exits. How the
ranks get each other's descriptors is :mod:`swarmfd.comm.shm_setup`.

This module implements :class:`swarmfd.comm.plane.Plane` (records only: no payload
larger than a record); the message semantics are the channel's, as on every plane.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import select
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import cma, wire
from ..plane import PlaneOwner
from ..spin import Spinner

__all__ = ["AREAS", "REGION_VIEWS", "SEGMENT_BYTES", "SEGMENT_SIZE", "SLOTS", "ShmPlane",
           "area_of"]

#: Bytes of one round (one slot of each rank's segment). Small enough to stay in cache.
SEGMENT_BYTES = 1 << 20
#: Slots per area: a pipelined all_reduce touches three rounds at once.
SLOTS = 3
#: Areas per segment: groups with a member in common use different areas
#: (swarmfd.group.choose_area), so one group's ranks never rewrite a slot another
#: group's ranks still read. The world's is area 0, the host groups' 1, new_group's
#: groups take 2-7 and groups made by their members alone (torch's dist.new_group) 8-15.
#: Pages are touched only by a group that runs, so an unused area costs address space.
AREAS = 16
#: Bytes of one area, and of one rank's segment.
AREA_BYTES = SLOTS * SEGMENT_BYTES
SEGMENT_SIZE = AREAS * AREA_BYTES
#: Views of segments a plane keeps (ShmPlane.region), then forgets all at once: a
#: training loop's calls take a few sizes in a few slots, far fewer.
REGION_VIEWS = 1024
#: Longest record written to an inbox (POSIX guarantees atomic writes up to PIPE_BUF).
MAX_RECORD = 4096
_pack_header = wire.pack_header
_unpack_header = wire.unpack_header
_HEADER_SIZE = wire.HEADER_SIZE
_join = b"".join


def area_of(group: int) -> int:
    """Byte offset of the area a group uses in every member's segment."""
    return (group % AREAS) * AREA_BYTES


def _now() -> float:
    return time.monotonic()


class ShmPlane:
    """Records and segments among the ranks of one host (see module docstring).

    ``segments`` maps each rank of the host (this one included) to its mapped
    segment; ``inbox`` is this rank's read end, ``outboxes`` the write ends of the
    peers' inboxes. The plane owns and closes all of them.
    """

    name = "shm"
    kind = "shm"
    endpoint = ""
    zero_copy_recv = False
    #: The longest abort or report body a record carries.
    max_control = MAX_RECORD - wire.HEADER_SIZE

    def __init__(self, owner: PlaneOwner, rank: int, segments: dict[int, mmap.mmap],
                 inbox: int, outboxes: dict[int, int], own_writer: int = -1) -> None:
        self.owner = owner
        self.rank = rank
        self.ranks = sorted(segments)
        self.segments = segments
        self.views = {r: np.frombuffer(mm, dtype=np.uint8) for r, mm in segments.items()}
        #: Views region() made, by (rank, offset, dtype, count).
        self.regions: dict[tuple[int, int, np.dtype, int], np.ndarray] = {}
        self.inbox = inbox
        self.own_writer = own_writer  # keeps the inbox from ever reading end-of-file
        self.outboxes = outboxes
        os.set_blocking(inbox, False)
        for fd in outboxes.values():
            os.set_blocking(fd, False)
        self.poller = select.poll()  # poll, not select: descriptors may exceed 1023
        self.poller.register(inbox, select.POLLIN)
        self.buffer = b""
        self.records: collections.deque[tuple[wire.Header, bytes]] = collections.deque()
        self.current = b""
        self.queued: dict[int, collections.deque[bytes]] = {}
        # Polls the inbox before sleeping (swarmfd.comm.spin): a peer on another core
        # usually answers within microseconds, and catching its record without sleeping
        # saves two wake-ups (tens of microseconds each).
        self.spinner = Spinner()
        self.closed = False
        #: Each rank's pid when every rank of the host can read every other's memory
        #: (cross-memory attach, :mod:`swarmfd.comm.cma`), else None: see
        #: :meth:`publish_probe`.
        self.cma_pids: dict[int, int] | None = None
        self._probe = np.frombuffer(os.urandom(16), dtype=np.int64).copy()
        self._pids: dict[int, int] = {}

    # -- segments -----------------------------------------------------------------------

    def region(self, rank: int, offset: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of ``rank``'s segment.

        Kept (at most REGION_VIEWS of them): a call of the same size in the same slot
        asks again, and a cached view costs a third of a new one (0.11 against 0.34 us
        here), of which a small call makes several."""
        key = (rank, offset, dtype, count)
        view = self.regions.get(key)
        if view is None:
            if len(self.regions) >= REGION_VIEWS:
                self.regions.clear()
            view = self.regions[key] = (
                self.views[rank][offset: offset + count * dtype.itemsize].view(dtype))
        return view

    # -- cross-memory attach -------------------------------------------------------------

    def _probe_row(self, rank: int) -> np.ndarray:
        """Where ``rank`` publishes its probe (pid, address, 16 secret bytes): the start
        of the last area, unused while init sets the plane up."""
        at = area_of(AREAS - 1)
        return self.views[rank][at:at + 32].view(np.int64)

    def publish_probe(self) -> None:
        """Write this rank's probe to its segment: its pid, and the address of 16 random
        bytes in its memory (also written here), for the peers' :meth:`check_probes`."""
        row = self._probe_row(self.rank)
        row[0], row[1] = os.getpid(), self._probe.ctypes.data
        row[2:4] = self._probe

    def check_probes(self) -> str:
        """Read every peer's probe bytes from its memory, and write them back unchanged
        (after every rank published):
        "" when all matched, else why not (the kernel refused, another pid namespace)."""
        if not cma.available():
            return "the C library has no process_vm_readv/process_vm_writev"
        got = np.zeros(2, np.int64)
        self._pids = {self.rank: os.getpid()}
        for r in self.ranks:
            if r == self.rank:
                continue
            row = self._probe_row(r).copy()  # the peer clears it once all agreed
            self._pids[r] = int(row[0])
            try:
                cma.read(int(row[0]), [(got.ctypes.data, 16)], [(int(row[1]), 16)])
            except OSError as exc:
                return f"reading rank {r}'s memory failed: {exc.strerror or exc}"
            if not np.array_equal(got, row[2:4]):
                return f"rank {r}'s pid names another process here (another pid namespace?)"
            try:  # the same bytes back: the all_reduce also writes peers' buffers
                cma.write(int(row[0]), [(got.ctypes.data, 16)], [(int(row[1]), 16)])
            except OSError as exc:
                return f"writing rank {r}'s memory failed: {exc.strerror or exc}"
        return ""

    def enable_cma(self, on: bool) -> None:
        """Use cross-memory attach (every rank agreed it works), or not; clear the probes."""
        self.cma_pids = dict(self._pids) if on else None
        self._probe_row(self.rank)[:] = 0

    # -- Plane --------------------------------------------------------------------------

    def idle(self) -> None:
        """Nothing listens: the descriptors were exchanged at setup."""

    def connect(self, peers: Any, deadline: float) -> None:
        """Connected at setup (see :mod:`swarmfd.comm.shm_setup`)."""

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int, payload: Any,
             size: int, copy: bool, group: int = 0) -> None:
        """Write one record to ``dst``'s inbox (queued while the pipe is full)."""
        header = _pack_header(kind, sig, self.rank, seq, tag, size, 0, group)
        try:
            record = _join((header, payload))  # one copy
        except TypeError:  # a non-contiguous payload, which join refuses
            record = header + memoryview(payload).tobytes()
        if len(record) > MAX_RECORD:
            raise ValueError(f"swarmfd bug: a shared-memory record of {len(record)} bytes "
                             f"exceeds {MAX_RECORD}")
        if self.queued:  # a pipe was full: records to ``dst`` keep their order
            queue = self.queued.get(dst)
            if queue:
                queue.append(record)
                self._push(dst)
                return
        else:
            # (_write's usual case, written out: a barrier's messages are many.)
            fd = self.outboxes.get(dst)
            if fd is not None and dst not in self.owner.lost:
                try:
                    os.write(fd, record)
                    return
                except OSError:
                    pass  # full or gone: _write sorts it out
        self._write(dst, record)

    def _write(self, dst: int, record: bytes) -> bool:
        """Write ``record`` now; queue it when the pipe is full. False when queued."""
        fd = self.outboxes.get(dst)
        if fd is None or dst in self.owner.lost:
            return True  # gone: the receive side reports the loss
        try:
            os.write(fd, record)
            return True
        except BlockingIOError:
            self.queued.setdefault(dst, collections.deque()).append(record)
            return False
        except (BrokenPipeError, OSError):
            # The peer closed its inbox: it failed or exited. An abort it sent before is
            # in ours; the channel raises that, or the loss after its grace.
            self.owner.lost.setdefault(dst, _now())
            self.queued.pop(dst, None)
            return True

    def _push(self, dst: int) -> None:
        queue = self.queued.get(dst)
        while queue:
            record = queue.popleft()
            if not self._write(dst, record):
                # _write queued it again at the back: put it back at the front instead.
                again = self.queued[dst]
                again.appendleft(again.pop())
                return
        self.queued.pop(dst, None)

    def send_all(self, kind: int, sig: wire.Signature, body: bytes, group: int = 0) -> None:
        """Best effort: ``body`` to every peer's inbox (aborts, reports); never blocks."""
        record = wire.pack_header(kind, sig, self.rank, 0, 0, len(body), 0, group) + body
        for fd in self.outboxes.values():
            with contextlib.suppress(OSError):
                os.write(fd, record[:MAX_RECORD])

    def unsent(self) -> list[int]:
        if not self.queued:  # the usual case: every record went out at once
            return []
        return [dst for dst, q in self.queued.items() if q and dst not in self.owner.lost]

    def wait(self, timeout: float) -> wire.Header | None:
        """Push queued records for up to ``timeout`` s (returns no header: records that
        arrive meanwhile stay in the inbox for the next receive)."""
        end = _now() + timeout
        while self.unsent():
            for dst in self.unsent():
                self._push(dst)
            left = end - _now()
            if not self.unsent() or left <= 0:
                return None
            poller = select.poll()
            for dst in self.unsent():
                poller.register(self.outboxes[dst], select.POLLOUT)
            poller.poll(max(1, int(left * 1000)))
        return None

    def next_header(self, timeout: float, src: int = -1) -> wire.Header | None:
        """The next record's header, or None after ``timeout`` seconds."""
        if self.records:
            return self._take()
        if self.queued:
            for dst in list(self.queued):
                self._push(dst)
        if self._read():
            return self._take()
        if timeout <= 0:
            return None
        if self.spinner.spin(self._read):
            return self._take()
        if self.poller.poll(max(0, int(timeout * 1000))) and self._read():
            self.spinner.woke()
            return self._take()
        return None

    def _read(self) -> bool:
        """Read what the inbox holds and parse whole records; True when one is ready."""
        try:
            data = os.read(self.inbox, 65536)
        except (BlockingIOError, InterruptedError):
            return bool(self.records)
        buf = self.buffer + data if self.buffer else data
        n, at = len(buf), 0
        while n - at >= _HEADER_SIZE:
            # Only this host's ranks of this job can write here (see shm_setup): a bad
            # header is a bug, a ProtocolError that reaches the caller.
            body = at + _HEADER_SIZE
            hdr = _unpack_header(buf[at:body])
            end = body + hdr.nbytes
            if n < end:
                break
            self.records.append((hdr, buf[body:end]))
            at = end
        self.buffer = buf[at:] if at else buf
        return bool(self.records)

    def _take(self) -> wire.Header:
        hdr, self.current = self.records.popleft()
        return hdr

    def read_payload(self, hdr: wire.Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        """The payload of the record :meth:`next_header` returned."""
        payload, self.current = self.current, b""
        if into is None:
            return payload
        memoryview(into).cast("B")[:] = payload
        return None

    def check_lost(self) -> None:
        """Losses are seen as EPIPE when writing (and through the TCP plane)."""

    def close(self, linger: float = 0.0) -> None:
        """Unmap and close everything (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.views = {}
        self.regions = {}
        for mm in self.segments.values():
            # A view still alive somewhere keeps the mapping; the GC unmaps it later.
            with contextlib.suppress(BufferError):
                mm.close()
        self.segments = {}
        for fd in [*self.outboxes.values(), self.inbox, self.own_writer]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.outboxes = {}
