"""Ranks as threads of this process, for the tests of the message layer and the algorithms.

* :class:`MemoryPlane`: a :class:`swarmfd.comm.plane.Plane` over in-memory queues (every
  message is packed and decoded with the real wire format, payloads are copied);
  :meth:`Fabric.kill` makes a rank vanish as a closed connection would, and
  :meth:`Fabric.slow` delays one link (so a message on another link overtakes it).
* :func:`shm_planes`: real :class:`swarmfd.comm.planes.shm.ShmPlane` objects for N
  thread-ranks, over real memfd segments and pipes (no setup socket: the descriptors
  are shared in-process).
* :func:`run_threads`: ``fn(rank, channel, plane)`` on N threads, each rank with its own
  :class:`swarmfd.comm.channel.Channel`; returns the results in rank order, raises with
  every failing rank's traceback, and never hangs (a thread that does not finish in time
  fails the test with its stack).
* :func:`run_algorithm`: one collective call (an :class:`~swarmfd.algorithms.base.Op`
  and an algorithm) on every thread-rank.
* :func:`run_hosts` and :func:`run_hier_algorithm`: the same on *simulated hosts*
  (``hosts=[0, 0, 1, 1]``: the host of each rank): every rank has a memory plane to
  every other (kind "tcp", one :class:`Fabric`) and a real shared-memory plane to the
  ranks of its host (none on a host of one), both under one channel, as a rank of a
  job that spans hosts has.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import mmap
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from swarmfd.algorithms.base import Op, run
from swarmfd.comm import wire
from swarmfd.comm.channel import Channel
from swarmfd.comm.planes import shm as shm_plane


class Fabric:
    """The queues between N in-memory planes, and which ranks are gone."""

    def __init__(self, n: int) -> None:
        self.n = n
        #: Each rank's incoming messages: (header, payload, packed header).
        self.queues: list[queue.Queue[tuple[wire.Header, bytes, bytes]]] = [
            queue.Queue() for _ in range(n)]
        self.dead: set[int] = set()
        self.sent = 0
        #: Payload bytes sent over each link, by (source rank, destination rank).
        self.link_bytes: collections.Counter[tuple[int, int]] = collections.Counter()

        #: Delayed links: (source, destination) -> the queue of their messages' carrier.
        self.delayed: dict[tuple[int, int], queue.Queue[Any]] = {}

    def kill(self, rank: int) -> None:
        """``rank`` vanishes: its messages stop, peers see its connection close."""
        self.dead.add(rank)

    def slow(self, src: int, dst: int, seconds: float) -> None:
        """Deliver what ``src`` sends ``dst`` ``seconds`` late, in order (a congested
        connection: the messages of other links overtake it)."""
        carrier: queue.Queue[Any] = queue.Queue()
        self.delayed[(src, dst)] = carrier

        def carry() -> None:
            while True:
                due, message = carrier.get()
                time.sleep(max(0.0, due + seconds - time.monotonic()))
                self.queues[dst].put(message)

        threading.Thread(target=carry, daemon=True, name=f"link {src}->{dst}").start()

    def put(self, src: int, dst: int, message: tuple[wire.Header, bytes, bytes]) -> None:
        carrier = self.delayed.get((src, dst))
        if carrier is None:
            self.queues[dst].put(message)
        else:
            carrier.put((time.monotonic(), message))


class MemoryPlane:
    """A plane over in-memory queues (see the module docstring)."""

    name = "memory"
    endpoint = ""
    zero_copy_recv = False
    shares_memory = False
    reads_peers = False
    io_thread = False
    inline_max = wire.MAX_PAYLOAD

    def __init__(self, fabric: Fabric, rank: int, owner: Any) -> None:
        self.fabric = fabric
        self.rank = rank
        self.owner = owner
        self.current = b""

    def idle(self) -> None:
        pass

    def connect(self, peers: Any, deadline: float) -> None:
        pass

    def header(self, kind: int, sig: wire.Signature, src: int, tag: int, nbytes: int,
               group: int) -> tuple[bytes, bytes]:
        return wire.cut_header(kind, sig, src, tag, nbytes, 0, group)

    def send(self, dst: int, kind: int, sig: wire.Signature, seq: int, tag: int, payload: Any,
             size: int, copy: bool, group: int = 0) -> None:
        self.send_packed(dst, wire.pack_header(kind, sig, self.rank, seq, tag, size, 0, group),
                         payload, size, copy)

    def send_packed(self, dst: int, header: bytes, payload: Any, size: int,
                    copy: bool) -> bool:
        if self.rank in self.fabric.dead or dst in self.fabric.dead:
            return False
        body = payload if isinstance(payload, bytes) else memoryview(payload).tobytes()
        assert len(body) == size
        self.fabric.sent += 1
        self.fabric.link_bytes[(self.rank, dst)] += size
        self.fabric.put(self.rank, dst, (wire.unpack_header(header), body, header))
        return False

    def take(self, src: int, header: bytes, nbytes: int) -> Any:
        """The next message when it is ``src``'s with ``header`` (the in-memory queue
        holds every peer's messages in arrival order: only its head is looked at)."""
        if self.rank in self.fabric.dead:
            return None
        q = self.fabric.queues[self.rank]
        with q.mutex:
            if not q.queue or q.queue[0][2] != header:
                return None
            _, body, _ = q.queue.popleft()
        return body

    def send_all(self, kind: int, sig: wire.Signature, body: bytes, group: int = 0) -> None:
        for dst in range(self.fabric.n):
            if dst != self.rank:
                self.send(dst, kind, sig, 0, 0, body, len(body), True, group)

    def next_header(self, timeout: float, src: int = -1) -> wire.Header | None:
        if self.rank in self.fabric.dead:
            time.sleep(timeout)
            return None
        try:
            hdr, self.current, _ = self.fabric.queues[self.rank].get(
                timeout=max(timeout, 0) or None, block=timeout > 0)
        except queue.Empty:
            return None
        return hdr

    def read_payload(self, hdr: wire.Header, into: Any, between: Callable[[], None],
                     keep: bool = False) -> Any:
        payload, self.current = self.current, b""
        if into is None:
            return np.frombuffer(payload, np.uint8).copy() if payload else b""
        memoryview(into).cast("B")[:] = payload
        return None

    def unsent(self) -> list[int]:
        return []

    def wait(self, timeout: float) -> wire.Header | None:
        return None

    def check_lost(self) -> None:
        for r in self.fabric.dead:
            if r != self.rank:
                self.owner.lost.setdefault(r, time.monotonic())

    def close(self, linger: float) -> None:
        pass


class ThreadFailure(AssertionError):
    """One or more thread-ranks raised; carries each failing rank's traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


def shm_planes(n: int, channels: list[Channel], ranks: list[int] | None = None,
               cma: bool = False) -> list[shm_plane.ShmPlane]:
    """One real shared-memory plane per thread-rank (memfd segments, pipe inboxes):
    for ranks 0..n-1, or for the world ranks ``ranks`` (``channels`` indexed by world
    rank), in the order of ``ranks``. ``cma``: the planes probe each other as init's
    ranks do and read each other's memory (this process's own: the pids are all one)."""
    ranks = list(range(n)) if ranks is None else ranks
    n = len(ranks)
    memfds, pipes = [], []
    for _ in range(n):
        fd = os.memfd_create("swarmfd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, shm_plane.SEGMENT_SIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        memfds.append(fd)
        pipes.append(os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC))
    planes = []
    try:
        for r in range(n):
            segments = {ranks[p]: mmap.mmap(memfds[p], shm_plane.SEGMENT_SIZE,
                                            mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                        for p in range(n)}
            outboxes = {ranks[p]: os.dup(pipes[p][1]) for p in range(n) if p != r}
            planes.append(shm_plane.ShmPlane(channels[ranks[r]], ranks[r], segments,
                                             os.dup(pipes[r][0]), outboxes,
                                             os.dup(pipes[r][1])))
    finally:
        for fd in memfds:
            os.close(fd)
        for a, b in pipes:
            os.close(a)
            os.close(b)
    if cma:
        for pl in planes:
            pl.publish_probe()
        verdicts = [pl.check_probes() for pl in planes]
        assert verdicts == [""] * n, verdicts
        for pl in planes:
            pl.enable_cma(True)
    return planes


def run_threads(fn: Callable[..., Any], n: int, *args: Any, plane: str = "memory",
                timeout: float = 30.0, group_timeout: float = 10.0,
                fabric: Fabric | None = None) -> list[Any]:
    """Run ``fn(rank, channel, plane, *args)`` on ``n`` thread-ranks (see module docstring).

    ``plane``: "memory" (a :class:`MemoryPlane` per rank), "shm" (real shared memory) or
    "shm-cma" (real shared memory whose ranks read each other's memory).
    """
    channels = [Channel(r, n, group_timeout) for r in range(n)]
    if plane in ("shm", "shm-cma"):
        planes: list[Any] = shm_planes(n, channels, cma=plane == "shm-cma")
    else:
        fabric = fabric or Fabric(n)
        planes = [MemoryPlane(fabric, r, channels[r]) for r in range(n)]
    for ch, pl in zip(channels, planes, strict=True):
        ch.add_plane(pl)
    try:
        return _on_threads(lambda r: fn(r, channels[r], planes[r], *args), n, timeout,
                           fabric)
    finally:
        if plane == "shm":
            for p in planes:
                with contextlib.suppress(Exception):
                    p.close()


def run_hosts(fn: Callable[..., Any], hosts: list[int], *args: Any, timeout: float = 30.0,
              group_timeout: float = 10.0, fabric: Fabric | None = None) -> list[Any]:
    """Run ``fn(rank, channel, tcp, shm, *args)`` on one thread-rank per entry of
    ``hosts`` (the simulated host of each rank): ``tcp`` a :class:`MemoryPlane` to every
    rank, ``shm`` a real shared-memory plane to the ranks of the same host (None on a
    host of one); both planes are the rank's channel's, the memory plane first."""
    n = len(hosts)
    channels = [Channel(r, n, group_timeout) for r in range(n)]
    fabric = fabric or Fabric(n)
    tcp = [MemoryPlane(fabric, r, channels[r]) for r in range(n)]
    shm: list[Any] = [None] * n
    try:
        for host in sorted(set(hosts)):
            ranks = [r for r in range(n) if hosts[r] == host]
            if len(ranks) > 1:
                for r, pl in zip(ranks, shm_planes(0, channels, ranks), strict=True):
                    shm[r] = pl
        for r in range(n):
            channels[r].add_plane(tcp[r])
            if shm[r] is not None:
                channels[r].add_plane(shm[r])
        return _on_threads(lambda r: fn(r, channels[r], tcp[r], shm[r], *args), n, timeout,
                           fabric)
    finally:
        for p in shm:
            if p is not None:
                with contextlib.suppress(Exception):
                    p.close()


def run_rank_threads(body: Callable[[int], None], n: int,
                     timeout: float) -> tuple[list[threading.Thread], list[int], str]:
    """Start ``body(rank)`` on n daemon threads named ``rank-R`` and join them until
    ``timeout``: the threads, the ranks still running, and their stacks ("" if none)."""
    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank-{r}")
               for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    frames = sys._current_frames() if hung else {}
    stacks = "".join(
        f"--- rank {r} stack ---\n"
        + "".join(traceback.format_stack(frames[threads[r].ident]))  # type: ignore[index]
        for r in hung if threads[r].ident in frames)
    return threads, hung, stacks


def sample_data(rank: int, count: int, dtype: Any, seed: int = 0) -> np.ndarray:
    """Rank-dependent test input of ``count`` items: small integers, or floats (complex:
    both parts) spread over seven orders of magnitude, so sums depend on their order."""
    rng = np.random.default_rng(seed * 100 + rank)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return rng.integers(0, 50, count).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dt)
    return (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dt)


def _on_threads(body: Callable[[int], Any], n: int, timeout: float,
                fabric: Fabric | None) -> list[Any]:
    """``body(rank)`` on n threads: the results in rank order, or every failure with its
    traceback, or the stacks of the ranks that did not finish within ``timeout``."""
    results: dict[int, tuple[bool, Any]] = {}

    def run_one(r: int) -> None:
        try:
            results[r] = (True, body(r))
        except BaseException:
            results[r] = (False, traceback.format_exc())

    _, hung, stacks = run_rank_threads(run_one, n, timeout)
    if hung:
        if fabric is not None:
            for r in range(n):
                fabric.kill(r)  # let the stuck threads end (they are daemons anyway)
        raise AssertionError(f"rank(s) {hung} did not finish within {timeout} s\n{stacks}")
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    if failures:
        raise ThreadFailure(failures)
    return [results[r][1] for r in range(n)]


def run_algorithm(n: int, make: Callable[[Op], Any], *, plane: str = "memory",
                  sig: wire.Signature | None = None, ring: list[int] | None = None,
                  timeout: float = 30.0) -> list[Any]:
    """One call on ``n`` thread-ranks: ``make(op)`` returns (algorithm generator, result
    getter); returns each rank's result."""
    sig = sig or wire.Signature(wire.Collective.ALL_REDUCE)
    slots = [0] * n

    def fn(r: int, channel: Channel, pl: Any) -> Any:
        def next_slot(r: int = r) -> int:
            slot = shm_plane.area_of(0) + (slots[r] % shm_plane.SLOTS) * shm_plane.SEGMENT_BYTES
            slots[r] += 1
            return slot

        op = Op(channel, pl, list(range(n)), r, 0, 1, sig,
                pl if pl.shares_memory else None, next_slot)
        algo, result = make(op)
        run(op, algo)
        channel.flush()
        return result()

    return run_threads(fn, n, plane=plane, timeout=timeout)


def run_hier_algorithm(hosts: list[int], make: Callable[..., Any], *,
                       sig: wire.Signature | None = None, timeout: float = 30.0,
                       calls: int = 1, fabric: Fabric | None = None) -> list[Any]:
    """``calls`` calls of a group of every rank on simulated ``hosts`` (see
    :func:`run_hosts`): ``make(op, layout, shm, call)`` returns (algorithm generator,
    result getter); the root op is on the memory plane, as a real call's is on TCP
    (``fabric``: its queues, to look at the traffic afterwards). Returns each rank's
    list of results (one per call)."""
    from swarmfd.algorithms.hier import layout_of

    sig = sig or wire.Signature(wire.Collective.ALL_REDUCE)
    n = len(hosts)
    names = [f"host{h}" for h in hosts]

    def fn(r: int, channel: Channel, tcp: Any, shm: Any) -> Any:
        rounds = [0]

        def next_slot() -> int:
            slot = shm_plane.area_of(0) + (rounds[0] % shm_plane.SLOTS) * shm_plane.SEGMENT_BYTES
            rounds[0] += 1
            return slot

        lay = layout_of(names, r)
        out = []
        for call in range(calls):
            op = Op(channel, tcp, list(range(n)), r, 0, call + 1, sig, None, next_slot)
            channel.begin(0, call + 1)
            algo, result = make(op, lay, shm, call)
            run(op, algo)
            channel.flush()
            out.append(result())
        return out

    return run_hosts(fn, hosts, timeout=timeout, fabric=fabric)
