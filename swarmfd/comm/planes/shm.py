"""The shared-memory plane: the ranks of one host, through segments and rings.

Each rank of a host owns:

* one **segment**, an anonymous memory file (``memfd_create``, sealed against resizing)
  mapped by every rank of the host: AREAS areas of SLOTS slots of SEGMENT_BYTES, where
  the algorithms copy into their own slot and read the others' (:meth:`ShmPlane.region`),
  then (x86-64, :data:`RINGS`) a control block and one **record ring** towards each rank
  of the host. A record is a :mod:`swarmfd.comm.wire` header (so signatures are checked
  as on TCP) and at most MAX_RECORD - HEADER_SIZE payload bytes. A rank writes only its
  own segment: its records, their count, and how many of each peer's it read; no system
  call moves a record (a pipe's write and read are one each: docs/performance.md);
* one **inbox**, a pipe. With rings it only wakes a rank that marked itself SLEEPING;
  without, it carries the records (each at most PIPE_BUF, so writes never interleave).
  The owner holds the only read end (and a write end, so it never reads end-of-file); a
  peer's write fails with EPIPE exactly when the owner is gone (or marked GONE), and the
  plane reports it lost.

Nothing has a name: segments and pipes are descriptors and mappings the kernel frees
when the last rank holding one exits. :mod:`swarmfd.comm.shm_setup` hands them around.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import platform
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import ProtocolError
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
#: (swarmfd.group.choose_area), so no group rewrites a slot another still reads. The
#: world's is 0, host groups' 1, new_group's 2-7, groups made by their members alone
#: 8-15. Pages are touched only when used: an unused area costs address space only.
AREAS = 16
AREA_BYTES = SLOTS * SEGMENT_BYTES
#: The rings start after the areas: a control block (this rank's state word, then a
#: cache line per counter), then this rank's ring towards each rank of the host.
RING_BASE = AREAS * AREA_BYTES
RING_BYTES = 4 << 20
RING_CONTROL_BYTES = 64 << 10
#: Records a ring holds at most (fewer on a host of many ranks; a pipe holds 16).
RING_SLOTS = 32
#: The least a ring may hold; a host of more ranks than that allows uses the pipes.
MIN_RING_SLOTS = 4
#: Counters per kind in the control block: ranks a host may have for rings.
RING_MAX_RANKS = 255
#: A cache line (8 words): each counter has one of its own.
_LINE_WORDS = 8
#: The state word's values: it may sleep (peers adding a record write a byte to its
#: inbox), or it closed its plane.
SLEEPING, GONE = 1, 2
#: Rings rely on x86's store order (a record before the counter that publishes it) and
#: a locked instruction as a full fence (_fence); elsewhere records go through pipes.
RINGS = platform.machine().lower() in ("x86_64", "amd64")
SEGMENT_SIZE = RING_BASE + RING_BYTES
#: Views of segments a plane keeps (ShmPlane.region) before it forgets them all.
REGION_VIEWS = 1024
#: Longest record (POSIX writes up to PIPE_BUF atomically).
MAX_RECORD = 4096
#: Looks at a peer's ring in :meth:`ShmPlane.take` before the wait goes to the channel:
#: about what a peer a step behind needs to catch up (docs/performance.md).
POLLS = 200
_pack_header = wire.pack_header
_unpack_header = wire.unpack_header
_HEADER_SIZE = wire.HEADER_SIZE
_join = b"".join
_now = time.monotonic


_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory fence: a lock's acquire and release execute locked instructions,
    which x86 never reorders with loads or stores. It keeps a rank that goes to sleep and
    a peer that adds a record from missing each other's store (ShmPlane.next_header)."""
    _fence_lock.acquire()
    _fence_lock.release()


def ring_slots(ranks: int) -> int:
    """Records each ring holds on a host of ``ranks`` ranks (0: the host uses pipes)."""
    if not RINGS or ranks > RING_MAX_RANKS:
        return 0
    slots = min(RING_SLOTS, (RING_BYTES - RING_CONTROL_BYTES) // (ranks * MAX_RECORD))
    return slots if slots >= MIN_RING_SLOTS else 0


def area_of(group: int) -> int:
    """Byte offset of the area a group uses in every member's segment."""
    return (group % AREAS) * AREA_BYTES


class ShmPlane:
    """Records and segments among the ranks of one host (see module docstring).

    ``segments``: each rank of the host's mapped segment; ``inbox``: this rank's read
    end; ``outboxes``: the peers' write ends. The plane owns and closes all of them.
    """

    name = "shm"
    endpoint = ""
    zero_copy_recv = False
    shares_memory = True
    io_thread = False
    inline_max = MAX_RECORD - _HEADER_SIZE
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
        self.spinner = Spinner()
        self.closed = False
        #: Records each ring holds, 0 when records go through the pipes (see _rings).
        self.ring_slots = ring_slots(len(self.ranks))
        self.outgoing: dict[int, _Ring] = {}
        self.incoming: list[_Ring] = []
        self.incoming_from: dict[int, _Ring] = {}
        self._buffers: list[memoryview] = []
        if self.ring_slots:
            self._rings()
        #: Each rank's pid when every rank of the host can read every other's memory
        #: (:mod:`swarmfd.comm.cma`, :meth:`publish_probe`), else None.
        self.cma_pids: dict[int, int] | None = None
        self._probe = np.frombuffer(os.urandom(16), dtype=np.int64).copy()
        self._pids: dict[int, int] = {}

    def _rings(self) -> None:
        """Set up the rings: a rank writes a peer's records into its own ring towards
        it and counts them; the peer counts what it read (in its own control block),
        which frees the slots. Every word has one writer."""
        local = {r: i for i, r in enumerate(self.ranks)}
        me, slots = local[self.rank], self.ring_slots
        data = {r: memoryview(mm) for r, mm in self.segments.items()}
        words = {r: data[r][RING_BASE:RING_BASE + RING_CONTROL_BYTES].cast("Q")
                 for r in self.ranks}
        self._buffers = [*words.values(), *data.values()]
        self.data = data[self.rank]
        self.words = words[self.rank]
        self.words[0] = 0

        def ring_at(towards: int) -> int:  # in its owner's segment
            return RING_BASE + RING_CONTROL_BYTES + towards * slots * MAX_RECORD

        for r in self.ranks:
            if r == self.rank:
                continue
            i = local[r]
            tail = int(self.words[_LINE_WORDS * (1 + i)])
            head = int(self.words[_LINE_WORDS * (1 + RING_MAX_RANKS + i)])
            # Outgoing: my ring towards r, my tail (count), r's head for me (seen).
            self.outgoing[r] = _Ring(r, ring_at(i), tail, data[self.rank],
                                     _LINE_WORDS * (1 + i), words[r],
                                     _LINE_WORDS * (1 + RING_MAX_RANKS + me))
            # Incoming: r's ring towards me, my head (count), r's tail for me.
            self.incoming.append(_Ring(r, ring_at(me), head, data[r],
                                       _LINE_WORDS * (1 + RING_MAX_RANKS + i), words[r],
                                       _LINE_WORDS * (1 + me)))
            self.incoming_from[r] = self.incoming[-1]

    # -- segments -----------------------------------------------------------------------

    def region(self, rank: int, offset: int, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of ``rank``'s segment; kept,
        as a repeated call asks again (docs/performance.md)."""
        key = (rank, offset, dtype, count)
        view = self.regions.get(key)
        if view is None:
            if len(self.regions) >= REGION_VIEWS:
                self.regions.clear()
            view = self.regions[key] = (
                self.views[rank][offset: offset + count * dtype.itemsize].view(dtype))
        return view

    # -- cross-memory attach -------------------------------------------------------------

    @property
    def reads_peers(self) -> bool:
        """Whether every rank of the host agreed to cross-memory attach (enable_cma)."""
        return self.cma_pids is not None

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
        """Read every peer's probe bytes from its memory and write them back: "" when
        all matched, else why not (the kernel refused, another pid namespace)."""
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

    def header(self, kind: int, sig: wire.Signature, src: int, tag: int, nbytes: int,
               group: int) -> tuple[bytes, bytes]:
        """The header of such a record, cut around the call's number (wire.cut_header)."""
        return wire.cut_header(kind, sig, src, tag, nbytes, 0, group)

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int, payload: Any,
             size: int, copy: bool, group: int = 0) -> None:
        """Write one record to ``dst`` (queued while its ring or pipe is full)."""
        self.send_packed(dst, _pack_header(kind, sig, self.rank, seq, tag, size, 0, group),
                         payload, size, copy)

    def send_packed(self, dst: int, header: bytes, payload: Any, size: int,
                    copy: bool) -> bool:
        """:meth:`Plane.send_packed`; a record is always a copy (``copy`` is ignored)."""
        if self.ring_slots:
            if size > MAX_RECORD - _HEADER_SIZE:
                raise ValueError(f"swarmfd bug: a shared-memory record of "
                                 f"{size + _HEADER_SIZE} bytes exceeds {MAX_RECORD}")
            queue = self.queued.get(dst)
            if not queue and self._put(dst, header, payload, size):
                return False
            # The ring is full: queue the record in order, push what waited before it.
            self.queued.setdefault(dst, collections.deque()).append(
                header + _contiguous(payload).tobytes())
            if queue:
                self._push(dst)
            return True
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
                return True
        else:  # (_write's usual case, inline: a barrier's messages are many)
            fd = self.outboxes.get(dst)
            if fd is not None and dst not in self.owner.lost:
                try:
                    os.write(fd, record)
                    return False
                except OSError:
                    pass  # full or gone: _write sorts it out
        return not self._write(dst, record)

    def _put(self, dst: int, header: bytes, payload: Any, size: int) -> bool:
        """Add one record to the ring towards ``dst``; False when it is full."""
        ring = self.outgoing.get(dst)
        if ring is None or dst in self.owner.lost:
            return True  # gone (or not of this host): the receive side reports it
        count = ring.count
        if count - ring.seen >= self.ring_slots:
            ring.seen = ring.peer_words[ring.peer_counter]
            if count - ring.seen >= self.ring_slots:
                return False
        at = ring.at + (count % self.ring_slots) * MAX_RECORD
        data = self.data
        data[at:at + _HEADER_SIZE] = header
        if size:
            at += _HEADER_SIZE
            data[at:at + size] = payload if type(payload) is bytes else _contiguous(payload)
        # The record before its counter (x86 store order), then a fence before reading
        # the peer's state: a peer that marks itself SLEEPING after this sees the record.
        ring.count = count + 1
        self.words[ring.counter] = count + 1
        _fence()
        if ring.peer_words[0]:
            self._wake(dst)
        return True

    def take(self, src: int, header: bytes, nbytes: int) -> bytes | None:
        """:meth:`Plane.take`: the payload copied out of the ring; looks up to POLLS
        times while the ring is empty, as the spinner allows."""
        if self.records:
            return None
        ring = self.incoming_from.get(src)
        if ring is None:
            return None
        count = ring.count
        words, pc = ring.peer_words, ring.peer_counter
        end = words[pc]
        looked = end == count
        if looked:
            polls = self.spinner.polls(POLLS)
            while end == count:
                polls -= 1
                if polls < 0:
                    return None
                end = words[pc]
        if not 0 < end - count <= self.ring_slots:
            return None
        at = ring.at + (count % self.ring_slots) * MAX_RECORD
        body = at + _HEADER_SIZE
        data = ring.data
        if data[at:body] != header:
            return None
        payload = bytes(data[body:body + nbytes]) if nbytes else b""
        ring.count = count + 1
        self.words[ring.counter] = count + 1
        if looked:  # a catch, as a poll's: else only the misses would count
            self.spinner.caught()
        return payload

    def _wake(self, dst: int) -> None:
        """Wake ``dst`` (it sleeps, or closed its plane: then the write fails)."""
        fd = self.outboxes.get(dst)
        if fd is None:
            return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:
            pass  # full of wake-ups already
        except OSError:  # its inbox is closed: it failed or exited
            self.owner.lost.setdefault(dst, _now())
            self.queued.pop(dst, None)

    def _write(self, dst: int, record: bytes) -> bool:
        """Write ``record`` now, or queue it when the ring or pipe is full (False)."""
        if self.ring_slots:
            if self._put(dst, record[:_HEADER_SIZE], record[_HEADER_SIZE:],
                         len(record) - _HEADER_SIZE):
                return True
            self.queued.setdefault(dst, collections.deque()).append(record)
            return False
        fd = self.outboxes.get(dst)
        if fd is None or dst in self.owner.lost:
            return True  # gone: the receive side reports the loss
        try:
            os.write(fd, record)
            return True
        except BlockingIOError:
            self.queued.setdefault(dst, collections.deque()).append(record)
            return False
        except OSError:  # its inbox is closed: it failed or exited
            self.owner.lost.setdefault(dst, _now())
            self.queued.pop(dst, None)
            return True

    def _push(self, dst: int) -> None:
        queue = self.queued.get(dst)
        while queue:
            record = queue.popleft()
            if not self._write(dst, record):  # queued again at the back: to the front
                again = self.queued[dst]
                again.appendleft(again.pop())
                return
        self.queued.pop(dst, None)

    def send_all(self, kind: int, sig: wire.Signature, body: bytes, group: int = 0) -> None:
        """Best effort: ``body`` to every peer's inbox (aborts, reports); never blocks."""
        record = wire.pack_header(kind, sig, self.rank, 0, 0, len(body), 0, group) + body
        if self.ring_slots:  # after what is queued for a peer, in order
            record = record[:MAX_RECORD]
            for dst in self.outgoing:
                with contextlib.suppress(Exception):
                    if self.queued.get(dst):
                        self._push(dst)
                    if self.queued.get(dst):
                        self.queued[dst].append(record)
                    else:
                        self._write(dst, record)
            return
        for fd in self.outboxes.values():
            with contextlib.suppress(OSError):
                os.write(fd, record[:MAX_RECORD])

    def unsent(self) -> list[int]:
        if not self.queued:  # the usual case: every record went out at once
            return []
        return [dst for dst, q in self.queued.items() if q and dst not in self.owner.lost]

    def wait(self, timeout: float) -> wire.Header | None:
        """Push queued records for up to ``timeout`` s; records that arrive meanwhile
        stay for the next receive (a header only while rings are full)."""
        end = _now() + timeout
        while self.unsent():
            for dst in self.unsent():
                self._push(dst)
            left = end - _now()
            if not self.unsent() or left <= 0:
                return None
            if self.ring_slots:  # a ring frees as its peer reads, who may wait for us
                if self._read():
                    return self._take()
                if self.poller.poll(1):
                    self._drain()
                continue
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
        if self.ring_slots:
            # SLEEPING, a fence, the rings once more: a peer's record added before it
            # could see the mark is read here, one added after wakes us (_put).
            words = self.words
            words[0] = SLEEPING
            _fence()
            if self._read():
                words[0] = 0
                self.spinner.woke()
                return self._take()
            ready = self.poller.poll(max(0, int(timeout * 1000)))
            words[0] = 0
            if ready:
                self._drain()
            if self._read():
                self.spinner.woke()
                return self._take()
            return None
        if self.poller.poll(max(0, int(timeout * 1000))) and self._read():
            self.spinner.woke()
            return self._take()
        return None

    def _drain(self) -> None:
        """Empty the inbox of wake-up bytes (with rings, it carries nothing else)."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while len(os.read(self.inbox, 65536)) == 65536:
                pass

    def _read_rings(self) -> bool:
        """Take the records the peers added to their rings towards this rank."""
        records = self.records
        slots = self.ring_slots
        for ring in self.incoming:
            count = ring.count
            end = ring.peer_words[ring.peer_counter]
            if end == count:
                continue
            if not 0 < end - count <= slots:
                raise ProtocolError(f"rank {ring.peer}'s record ring to rank {self.rank} "
                                    f"counts {end} records after {count} were read")
            data = ring.data
            while count < end:
                at = ring.at + (count % slots) * MAX_RECORD
                body = at + _HEADER_SIZE
                hdr = _unpack_header(data[at:body])
                n = hdr.nbytes
                if n > MAX_RECORD - _HEADER_SIZE or hdr.src != ring.peer:
                    raise ProtocolError(
                        f"a record in rank {ring.peer}'s ring to rank {self.rank} claims "
                        f"{n} bytes from rank {hdr.src}: expected at most "
                        f"{MAX_RECORD - _HEADER_SIZE} from rank {ring.peer}")
                records.append((hdr, data[body:body + n].tobytes() if n else b""))
                count += 1
            ring.count = count  # copied out before the slots are given back
            self.words[ring.counter] = count
        return bool(records)

    def _read(self) -> bool:
        """Read what the inbox holds and parse whole records; True when one is ready."""
        if self.ring_slots:
            return self._read_rings()
        try:
            data = os.read(self.inbox, 65536)
        except (BlockingIOError, InterruptedError):
            return bool(self.records)
        buf = self.buffer + data if self.buffer else data
        n, at = len(buf), 0
        while n - at >= _HEADER_SIZE:  # only this job's ranks write here: bad is a bug
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
        if self.ring_slots:
            self.words[0] = GONE  # peers that add a record now write to the closed inbox
            self.outgoing, self.incoming, self.incoming_from = {}, [], {}
            self.data = self.words = None  # type: ignore[assignment]
            for buf in self._buffers:
                buf.release()
            self._buffers = []
        self.views = {}
        self.regions = {}
        for mm in self.segments.values():  # a live view keeps it: the GC unmaps it later
            with contextlib.suppress(BufferError):
                mm.close()
        self.segments = {}
        for fd in [*self.outboxes.values(), self.inbox, self.own_writer]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.outboxes = {}


def _contiguous(payload: Any) -> memoryview:
    """``payload`` as a flat byte view (a copy when it is not contiguous)."""
    view = memoryview(payload)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class _Ring:
    """One direction of the rings with ``peer``. Outgoing: ``count`` records added,
    ``seen`` read by the peer when last looked; incoming: ``count`` read. ``at``: where
    it starts in ``data`` (its owner's segment); ``counter``: this rank's word for it,
    ``peer_words[peer_counter]`` the peer's."""

    __slots__ = ("at", "count", "counter", "data", "peer", "peer_counter", "peer_words",
                 "seen")

    def __init__(self, peer: int, at: int, count: int, data: memoryview, counter: int,
                 peer_words: memoryview, peer_counter: int) -> None:
        self.peer = peer
        self.at = at
        self.count = count
        self.seen = peer_words[peer_counter]
        self.data = data
        self.counter = counter
        self.peer_words = peer_words
        self.peer_counter = peer_counter
