"""The shared-memory channel's setup: no names, nothing left behind, no stranger gets in.

What the shared-memory setup promises against another local user, guarded here:

* the segments and inboxes have no name (memfds and pipes): a job never has a file in
  ``/dev/shm``, during init, during collectives or after;
* kill -9 of one rank, or of every rank, at each moment of the setup (every agreement
  and inside the descriptor exchange): the survivors' init raises PeerLostError naming
  the rank, every descriptor is closed, and ``/dev/shm`` holds nothing of the job;
* another local user (uid 65534, "nobody") who reads ``/proc/net/unix`` and ``/dev/shm``,
  hammers the setup socket and pre-creates the names the old design used, gets no
  descriptor, not even a byte, and the job stays on shared memory without a warning;
* a real failure on one rank (its descriptor limit) makes every rank fall back to TCP
  with a warning on stderr naming the rank and the cause, and the job completes;
* a process of the same uid in the shared directory (SWARMFD_SHM_DIR) that takes the
  setup socket's name and relays the ranks' connections gets no descriptor: the proofs
  name the connection, the hub refuses the relayed one, and the job runs over TCP,
  saying so.

The protocol logic (proofs, refusals, eviction, descriptor checks) is tested in-process
first; processes only where processes matter.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from swarmfd.comm import shm_setup as shm
from swarmfd.comm import wire
from swarmfd.comm.channel import LOST_PEER_GRACE, Channel
from swarmfd.comm.planes.shm import ShmPlane
from swarmfd.errors import CollectiveTimeout, MismatchError, PeerLostError

from .support.attacker import Attacker
from .support.harness import LOST_PEER_LIMIT, allowed, stall_meter, unavailable
from .support.robust_harness import RankCtx, Ranks, error_info, record

#: A job token as the rendezvous draws them (16 hex digits).
TOKEN = "0123456789abcdef"
#: An unused uid to play "another local user".
NOBODY = 65534


# -- pure logic ---------------------------------------------------------------------------


def test_agreement_rows_carry_each_failed_ranks_reason() -> None:
    """encode_reason/decode_reasons: "" is success; a reason survives (cut at MAX_REASON
    bytes, never breaking the decode)."""
    rows = [shm.encode_reason(""), shm.encode_reason("memfd_create failed: [Errno 24] x"),
            shm.encode_reason("é" * shm.MAX_REASON)]
    assert all(r.shape == (1 + shm.MAX_REASON,) and r.dtype == np.uint8 for r in rows)
    got = shm.decode_reasons(rows)
    assert set(got) == {1, 2}
    assert got[1] == "memfd_create failed: [Errno 24] x"
    assert got[2].startswith("é" * 10) and len(got[2].encode()) <= shm.MAX_REASON


def test_host_key_names_kernel_namespace_or_directory_and_user(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The host key changes with SWARMFD_SHM_DIR (a directory replaces the network
    namespace); an unusable directory is a logged fall-back, not a silent one."""
    plain = shm.host_key()
    assert f":netns:{os.stat('/proc/self/ns/net').st_ino}:{os.getuid()}" in plain
    st = os.stat(tmp_path)
    assert shm.host_key(str(tmp_path)).endswith(f":dir:{st.st_dev}:{st.st_ino}:{os.getuid()}")
    assert shm.socket_address(TOKEN, "k", str(tmp_path)).startswith(
        str(tmp_path) + "/swarmfd-shm-")
    with caplog.at_level(logging.WARNING, "swarmfd"):
        assert shm.host_key(str(tmp_path / "missing")) == ""
    assert "SWARMFD_SHM_DIR" in caplog.text and "missing" in caplog.text


def test_socket_address_is_abstract_and_reveals_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the setup socket is abstract (no file); its name differs per job and
    host and does not contain the token; the key is another derivation again."""
    a = shm.socket_address(TOKEN, "host-a")
    assert a.startswith("\0swarmfd-shm-") and TOKEN not in a
    assert a != shm.socket_address(TOKEN, "host-b") != shm.socket_address("f" * 16, "host-a")
    assert shm.job_key(TOKEN).hex() not in a and len(shm.job_key(TOKEN)) == 32


# -- the protocol, in one process ------------------------------------------------------------


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _run_setups(n: int, hostkey: str = f"test-{os.getpid()}",
                timeout: float = 5.0) -> list[Any]:
    """Run the setup of ``n`` ranks as threads of this process; agreement by a barrier.
    The host key is this process's: two test runs at once (the same test in two
    sessions) would otherwise meet at one setup socket."""
    barrier = threading.Barrier(n)
    rows: list[np.ndarray] = [shm.encode_reason("")] * n
    out: list[Any] = [None] * n

    def rank(r: int) -> None:
        def agree(reason: str) -> dict[int, str]:
            rows[r] = shm.encode_reason(reason)
            barrier.wait(10)
            got = shm.decode_reasons(list(rows))
            barrier.wait(10)
            return got

        setup = shm.Setup(r, range(n), TOKEN, hostkey, time.monotonic() + 5)
        try:
            out[r] = setup.run(agree)
        except BaseException as exc:
            out[r] = exc
            setup.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out


def _planes(segments: list[Any], timeout: float = 5.0) -> list[tuple[Channel, ShmPlane]]:
    """The shared-memory plane of each rank's segments, each with a channel of its own."""
    out = []
    for seg in segments:
        ch = Channel(seg.rank, len(segments), timeout)
        plane = seg.plane(ch)
        ch.add_plane(plane)
        out.append((ch, plane))
    return out


def test_setup_gives_every_rank_every_segment_and_inbox() -> None:
    """Three ranks (threads): each maps the others' segments (a write is seen by all) and
    can write to every inbox; the setup sockets and segment descriptors are closed after,
    and closing the channels leaves no descriptor behind."""
    before = _open_fds()
    chans = _run_setups(3)
    assert all(c is not None for c in chans)
    c0, c1, c2 = chans
    assert c0 is not None and c1 is not None and c2 is not None
    for c in chans:
        assert c is not None
        assert c.memfd == -1 and sorted(c.outboxes) == sorted({0, 1, 2} - {c.rank})
    # Exactly the channels' descriptors are open now, per rank: its inbox (read and write
    # end), 2 outboxes, and the 3 that Python's mmap objects keep (a dup of the memfd each;
    # the memfds received or created were closed once mapped).
    assert len(_open_fds() - before) == 3 * (2 + 2 + 3)
    (h0, p0), (h1, p1), (h2, p2) = _planes(chans)
    dt = np.dtype(np.float32)
    p2.region(2, 0, dt, 4)[...] = [1, 2, 3, 4]
    assert list(p0.region(2, 0, dt, 4)) == [1, 2, 3, 4] == list(p1.region(2, 0, dt, 4))
    sig = wire.Signature(wire.Collective.BARRIER)
    h1.send(p1, 0, sig, 0, 7, 3, b"hello")
    h2.send(p2, 0, sig, 0, 7, 4)
    assert bytes(h0.recv(p0, 1, sig, 0, 7, 3, 5)) == b"hello"
    assert bytes(h0.recv(p0, 2, sig, 0, 7, 4, 0)) == b""
    for p in (p0, p1, p2):
        p.close()
    assert _open_fds() == before


def test_region_views_are_kept_bounded_and_let_go_at_close(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A plane hands out the same view for the same region again (a small call's views
    cost a third), a different one for any other offset, dtype or count, keeps at most
    REGION_VIEWS of them, and drops them at close, so the segments unmap and no
    descriptor stays open."""
    from swarmfd.comm.planes import shm as shm_plane

    before = _open_fds()
    (_, p0), (_, p1) = _planes(_run_setups(2))
    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    a = p0.region(1, 64, f32, 4)
    assert p0.region(1, 64, f32, 4) is a
    for other in (p0.region(1, 64, f32, 5), p0.region(1, 128, f32, 4),
                  p0.region(1, 64, i64, 4), p0.region(0, 64, f32, 4)):
        assert other is not a
    p1.region(1, 64, f32, 4)[...] = [5, 6, 7, 8]  # the owner writes; the kept view sees it
    assert list(a) == [5, 6, 7, 8]
    monkeypatch.setattr(shm_plane, "REGION_VIEWS", 8)
    for k in range(20):
        p0.region(0, 8 * k, f32, 2)[...] = k
        assert len(p0.regions) <= 8
    assert [float(p0.region(0, 8 * k, f32, 2)[1]) for k in range(20)] == list(range(20))
    del a, other  # (the test's own views would keep their segments mapped)
    for p in (p0, p1):
        p.close()
    assert not p0.regions and _open_fds() == before


@pytest.mark.waits  # bounds how long the loss takes to show
def test_a_write_to_an_inbox_breaks_when_its_owner_is_gone() -> None:
    """The owner holds the only read end of its inbox: once it closed, a peer's write
    fails (EPIPE), the plane reports that peer lost, and a wait on it raises
    PeerLostError after the channel's lost-peer grace (as on every plane)."""
    planes = _planes(_run_setups(3, timeout=0.5))
    sig = wire.Signature(wire.Collective.BARRIER)
    try:
        (_, p1), (h2, p2) = planes[1], planes[2]
        stall_meter()
        p1.close()
        t0 = time.monotonic()
        h2.send(p2, 1, sig, 0, 1, 0)  # EPIPE: recorded, not raised
        assert 1 in h2.lost
        with pytest.raises(PeerLostError, match="lost rank 1"):
            h2.recv(p2, 1, sig, 0, 1, 0, 0)
        t1 = time.monotonic()
        limit, stalled = allowed(LOST_PEER_LIMIT, t0, t1)
        assert LOST_PEER_GRACE <= t1 - t0 < limit, (t1 - t0, stalled)
    finally:
        for _, p in planes:
            p.close()


# -- the record rings (swarmfd.comm.planes.shm, x86-64) ----------------------------------

_SIG = wire.Signature(wire.Collective.BARRIER)


def _send(ch: Channel, plane: ShmPlane, dst: int, tag: int, payload: bytes = b"") -> None:
    ch.send(plane, dst, _SIG, 0, 1, tag, payload)


def _recv(ch: Channel, plane: ShmPlane, src: int, tag: int, nbytes: int = 0) -> Any:
    return ch.recv(plane, src, _SIG, 0, 1, tag, nbytes)


def test_ring_slots_follow_the_hosts_rank_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank of a host computes the same ring size from the host's rank count: the
    most a ring holds for a few ranks, fewer as they share the ring space, none (pipes)
    beyond what the control block counts or below MIN_RING_SLOTS a ring."""
    from swarmfd.comm.planes import shm as plane
    monkeypatch.setattr(plane, "RINGS", True)
    space = plane.RING_BYTES - plane.RING_CONTROL_BYTES
    assert plane.ring_slots(2) == plane.ring_slots(8) == plane.RING_SLOTS
    assert plane.ring_slots(64) == space // (64 * plane.MAX_RECORD) < plane.RING_SLOTS
    assert plane.ring_slots(space // (plane.MIN_RING_SLOTS * plane.MAX_RECORD) + 1) == 0
    assert plane.ring_slots(plane.RING_MAX_RANKS + 1) == 0
    # Every counter has a cache line of its own inside the control block.
    assert (1 + 2 * plane.RING_MAX_RANKS) * 64 <= plane.RING_CONTROL_BYTES
    monkeypatch.setattr(plane, "RINGS", False)
    assert plane.ring_slots(2) == 0


@pytest.mark.parametrize("rings", [True, False], ids=["rings", "pipes"])
def test_records_keep_their_order_past_a_full_ring(monkeypatch: pytest.MonkeyPatch,
                                                   rings: bool) -> None:
    """More records than a ring (or pipe) holds, sent before the peer reads any: the
    sender keeps the rest (sends never block), pushes them as the peer reads, and the
    peer gets every record, payload intact, in order; then the rings keep working
    around their wrap."""
    from swarmfd.comm.planes import shm as plane
    monkeypatch.setattr(plane, "RINGS", rings)
    planes = _planes(_run_setups(2))
    try:
        (h0, p0), (h1, p1) = planes
        assert (p0.ring_slots > 0) is rings and p1.ring_slots == p0.ring_slots
        count = 3 * max(p0.ring_slots, 16) + 5
        bodies = [bytes([i % 251]) * (1 + i * 97 % 3000) for i in range(count)]
        for i, body in enumerate(bodies):
            _send(h0, p0, 1, i, body)
        if rings:  # the ring is full: the rest waits in order
            assert p0.unsent() == [1] and len(p0.queued[1]) == count - p0.ring_slots
        for i, body in enumerate(bodies):
            assert _recv(h1, p1, 0, i, len(body)) == body
            if i % 7 == 0 and p0.unsent():
                p0.wait(0.01)  # the sender pushes on (as its waits and flushes do)
        assert p0.unsent() == []
        for round_ in range(3 * max(p0.ring_slots, 1)):  # around the wrap, both ways
            _send(h1, p1, 0, round_, b"x" * round_)
            assert _recv(h0, p0, 1, round_, round_) == b"x" * round_
    finally:
        for _, p in planes:
            p.close()


def test_an_abort_to_a_full_ring_follows_the_records_before_it() -> None:
    """An abort (send_all) to a peer whose ring is full is kept after the records queued
    before it, not dropped, and reaches the peer last once the peer reads."""
    planes = _planes(_run_setups(2))
    try:
        (h0, p0), (_, p1) = planes
        if not p0.ring_slots:
            _no_rings()
        count = p0.ring_slots + 3
        for i in range(count):
            _send(h0, p0, 1, i)
        p0.send_all(int(wire.Kind.ABORT), _SIG, b"{}", 0)
        assert len(p0.queued[1]) == 4
        got = []
        deadline = time.monotonic() + 5
        while len(got) < count + 1 and time.monotonic() < deadline:
            hdr = p1.next_header(0.01)
            if hdr is not None:
                p1.read_payload(hdr, None, lambda: None)
                got.append((hdr.kind, hdr.tag))
            p0.wait(0.001)
        assert got == [(int(wire.Kind.DATA), i) for i in range(count)] + [
            (int(wire.Kind.ABORT), 0)]
    finally:
        for _, p in planes:
            p.close()


@pytest.mark.waits  # bounds how long a sleeping rank takes to wake
def test_a_sleeping_rank_is_woken_by_a_record() -> None:
    """A rank that gives up polling marks itself SLEEPING and blocks in its inbox; a peer
    that adds a record sees the mark and writes a byte there, so the wait ends with the
    record at once, not after its timeout. The mark is cleared afterwards."""
    from swarmfd.comm.planes import shm as plane
    planes = _planes(_run_setups(2))
    try:
        (h0, p0), (_, p1) = planes
        if not p1.ring_slots:
            _no_rings()
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(p1.next_header(10.0)))
        t0 = time.monotonic()
        waiter.start()
        deadline = time.monotonic() + 5
        while p1.words[0] != plane.SLEEPING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert p1.words[0] == plane.SLEEPING, "the waiting rank never marked itself asleep"
        time.sleep(0.2)
        _send(h0, p0, 1, 7, b"abc")
        waiter.join(5)
        assert not waiter.is_alive()
        elapsed = time.monotonic() - t0
        assert got and got[0] is not None and got[0].tag == 7 and elapsed < 5.0, (got, elapsed)
        assert p1.words[0] == 0
    finally:
        for _, p in planes:
            p.close()


def test_a_bad_record_in_a_ring_is_a_protocol_error() -> None:
    """A ring holds only its owner's records: one that claims another sender, or more
    bytes than a record has, is a ProtocolError naming the ring (a bug, never read as
    data); so is a counter that claims more records than the ring holds."""
    from swarmfd.comm.planes import shm as plane
    from swarmfd.errors import ProtocolError
    planes = _planes(_run_setups(2))
    try:
        (_, p0), (_, p1) = planes
        if not p0.ring_slots:
            _no_rings()
        ring = p0.outgoing[1]

        def forge(src: int, nbytes: int) -> None:
            header = wire.pack_header(int(wire.Kind.DATA), _SIG, src, 1, 0, nbytes, 0, 0)
            at = ring.at + (ring.count % p0.ring_slots) * plane.MAX_RECORD
            p0.data[at:at + len(header)] = header
            ring.count += 1
            p0.words[ring.counter] = ring.count

        forge(src=2, nbytes=0)
        with pytest.raises(ProtocolError, match="ring to rank 1 claims 0 bytes from rank 2"):
            p1.next_header(0)
        p1.records.clear()
        p1.incoming[0].count = ring.count  # past the bad record
        forge(src=0, nbytes=plane.MAX_RECORD)
        with pytest.raises(ProtocolError, match=f"claims {plane.MAX_RECORD} bytes"):
            p1.next_header(0)
        p0.words[ring.counter] = ring.count + p0.ring_slots + 1
        with pytest.raises(ProtocolError, match=r"counts \d+ records after"):
            p1.next_header(0)
    finally:
        for _, p in planes:
            p.close()


@pytest.mark.waits  # bounds how long a read waits
def test_an_inbox_never_reads_end_of_file() -> None:
    """The owner keeps a write end of its own inbox: when every peer has closed its
    outboxes, a wait for a record is a timeout after the group timeout (the inbox is
    silent, not at end-of-file, which select would report ready forever)."""
    planes = _planes(_run_setups(3), timeout=0.5)
    sig = wire.Signature(wire.Collective.BARRIER)
    try:
        (h0, p0), (_, p1), (_, p2) = planes
        p1.close()
        p2.close()
        got: list[BaseException] = []

        def wait() -> None:
            try:
                h0.recv(p0, 1, sig, 0, 1, 0, 0)
            except BaseException as exc:
                got.append(exc)

        t0 = time.monotonic()
        waiter = threading.Thread(target=wait, daemon=True)  # at end-of-file it would spin
        waiter.start()
        waiter.join(5)
        assert not waiter.is_alive(), "the wait did not end: its inbox reads end-of-file?"
        assert len(got) == 1 and isinstance(got[0], CollectiveTimeout), got
        # The timeout, then the channel's TIMEOUT_GRACE of listening for reports.
        assert 0.45 < time.monotonic() - t0 < 2.5
    finally:
        for _, p in planes:
            p.close()


def _no_rings() -> None:
    """Skip a test of the records' rings where records travel through the pipes (not on
    x86-64), or fail under CI=true: there a missing ring is a broken one."""
    unavailable("records travel through the pipes on this machine",
                what="the tests of the shared-memory rings", fix="run them on x86-64")


def _hub(clients: list[int]) -> tuple[shm._Hub, str]:
    # Not "@swarmfd...": the other-user attacker test (another lane, maybe at the same
    # time) floods every socket of that name it finds in /proc/net/unix, and these tests
    # count the connections their hub refused (a CI run counted 7557 instead of 6).
    address = "\0test-hub-" + os.urandom(8).hex()
    return shm._Hub(address, 0, clients, shm.job_key(TOKEN)), address


def _connect(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(address)
    return s


def _closed_without_fds(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the hub closed ``s`` (EOF) having sent no descriptor."""
    s.settimeout(timeout)
    while True:
        msg, fds, _, _ = socket.recv_fds(s, 4096, 16)
        for fd in fds:
            os.close(fd)
        if fds:
            return False
        if not msg:
            return True


@pytest.mark.waits  # bounds an eviction time
def test_hub_refuses_bad_proofs_and_strangers_then_admits_the_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong key, a replayed proof, a reflected (hub-role) proof, an unknown rank, a
    valid proof made for another connection (what a relay passes on) and a silent
    connection are each closed without a descriptor and counted (the relayed one also
    as such); the real rank 1 is admitted after them."""
    monkeypatch.setattr(shm, "HANDSHAKE_LIMIT", 0.3)
    hub, address = _hub([1])
    try:
        key = shm.job_key(TOKEN)

        def attempt(make: Callable[[bytes, bytes, int], bytes]) -> bool:
            s = _connect(address)
            try:
                hello = s.recv(4096)
                _, _, hub_rank, nonce_s = shm.HELLO.unpack(hello)
                assert hub_rank == 0
                nonce_c = os.urandom(16)
                s.send(make(nonce_c, nonce_s, shm.peer_inode(s)))
                return _closed_without_fds(s)
            finally:
                s.close()

        def hello(rank: int, nonce_c: bytes, seen: int) -> bytes:
            return (shm.HELLO.pack(shm.SHM_MAGIC, wire.PROTOCOL_VERSION, rank, nonce_c)
                    + shm.BOUND.pack(seen))

        old_nonce = os.urandom(16)
        other = shm.job_key("f" * 16)  # another job's key
        assert attempt(lambda nc, ns, b: hello(1, nc, b) + shm._mac(other, b"c", 1, 0, nc, ns,
                                                                    b))
        assert attempt(lambda nc, ns, b: hello(1, nc, b) + shm._mac(key, b"c", 1, 0, nc,
                                                                    old_nonce, b))
        assert attempt(lambda nc, ns, b: hello(1, nc, b) + shm._mac(key, b"s", 1, 0, nc, ns, b))
        assert attempt(lambda nc, ns, b: hello(5, nc, b) + shm._mac(key, b"c", 5, 0, nc, ns, b))
        assert attempt(lambda nc, ns, b: hello(1, nc, b + 1) + shm._mac(key, b"c", 1, 0, nc, ns,
                                                                        b + 1))  # relayed
        assert hub.relayed == 1
        assert attempt(lambda nc, ns, b: b"GET / HTTP/1.0\r\n\r\n")
        silent = _connect(address)
        t0 = time.monotonic()
        assert _closed_without_fds(silent)
        assert 0.25 < time.monotonic() - t0 < 2.0  # evicted after HANDSHAKE_LIMIT
        silent.close()
        assert hub.refused == 7
        client = shm.Setup(1, [0, 1], TOKEN, "", time.monotonic() + 5)
        client.address = address
        try:
            client._create()
            client._hand_over()
            admitted = hub.finish()
            assert list(admitted) == [1]
        finally:
            client.close()
    finally:
        hub.close()


@pytest.mark.waits  # bounds a handshake time
def test_hub_bounds_connections_in_a_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """More silent same-user connections than MAX_PENDING: the oldest are evicted at
    once (not after the silence limit), but not a rank that already proved itself: it
    hands over its descriptors after the flood and is admitted."""
    monkeypatch.setattr(shm, "HANDSHAKE_LIMIT", 30.0)
    hub, address = _hub([1])
    socks = []
    key = shm.job_key(TOKEN)
    ch = shm._Segments(1)
    ch.create()
    rank = _connect(address)
    try:
        _, _, _, nonce_s = shm.HELLO.unpack(rank.recv(4096))
        nonce_c = os.urandom(16)
        seen = shm.peer_inode(rank)
        rank.send(shm.HELLO.pack(shm.SHM_MAGIC, wire.PROTOCOL_VERSION, 1, nonce_c)
                  + shm.BOUND.pack(seen) + shm._mac(key, b"c", 1, 0, nonce_c, nonce_s, seen))
        assert rank.recv(4096) == shm._mac(key, b"s", 1, 0, nonce_c, nonce_s, seen)  # proven
        for _ in range(shm.MAX_PENDING + 8):
            socks.append(_connect(address))
        t0 = time.monotonic()
        for s in socks[:8]:
            assert _closed_without_fds(s, timeout=5)
        assert time.monotonic() - t0 < 2.0
        socket.send_fds(rank, [b"F"], [ch.memfd, ch.writer])
        assert rank.recv(16) == b"A"
        assert list(hub.finish()) == [1] and hub.refused == 8 + shm.MAX_PENDING
    finally:
        for s in [*socks, rank]:
            s.close()
        ch.close()
        hub.close()


def test_a_rank_gets_in_while_the_accept_queue_is_flooded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accept queue is full (the hub held back for 0.3 s) and connections opened and
    closed in a loop keep it busy: the rank's connect, refused with EAGAIN, is retried
    until the hub has drained the queue, and the rank gets in."""
    monkeypatch.setattr(shm, "LISTEN_BACKLOG", 1)
    monkeypatch.setattr(shm, "ACCEPT_BATCH", 0)  # the hub accepts nothing for now
    hub, address = _hub([1])
    queued = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    stop = threading.Event()
    flooded = [0]

    def flood() -> None:
        while not stop.is_set():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            flooded[0] += 1
            with contextlib.suppress(OSError):
                s.connect(address)
            s.close()

    flooders = [threading.Thread(target=flood) for _ in range(2)]
    client = shm.Setup(1, [0, 1], TOKEN, "", time.monotonic() + 5)
    client.address = address
    try:
        for q in queued[:2]:
            q.connect(address)
        queued[2].setblocking(False)
        with pytest.raises(BlockingIOError):
            queued[2].connect(address)  # the queue is full
        for t in flooders:
            t.start()
        threading.Timer(0.3, setattr, (shm, "ACCEPT_BATCH", 64)).start()
        client._create()
        t0 = time.monotonic()
        client._hand_over()
        assert time.monotonic() - t0 > 0.25  # it waited for the queue, and got in
        assert list(hub.finish()) == [1]
    finally:
        stop.set()
        for t in flooders:
            t.join(10)
        for q in queued:
            q.close()
        client.close()
        hub.close()
    assert flooded[0] > 100 and hub.refused >= 2  # the two queued ones, at least


def test_a_rank_sends_nothing_to_a_socket_that_does_not_prove_it_is_the_hub() -> None:
    """A listener that answers the greeting but cannot prove the job's key gets no
    descriptor: the rank stops and says why."""
    address = "\0swarmfd-shm-test-" + os.urandom(8).hex()
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fake.bind(address)
    fake.listen(1)
    got: list[Any] = []

    def serve() -> None:
        conn, _ = fake.accept()
        conn.settimeout(5)
        conn.send(shm.HELLO.pack(shm.SHM_MAGIC, wire.PROTOCOL_VERSION, 0, os.urandom(16)))
        conn.recv(4096)
        conn.send(os.urandom(shm.MAC_SIZE))  # not the proof
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 16, 4)
            got.append((msg, len(fds)))
            for fd in fds:
                os.close(fd)
        except OSError as exc:
            got.append(exc)
        conn.close()

    server = threading.Thread(target=serve)
    server.start()
    client = shm.Setup(1, [0, 1], TOKEN, "", time.monotonic() + 5)
    client.address = address
    try:
        client._create()
        with pytest.raises(shm.Unavailable, match="did not prove it belongs to this job"):
            client._hand_over()
    finally:
        client.close()
        server.join(10)
        fake.close()
    assert got == [(b"", 0)], got  # the rank closed the connection; no descriptor came


def test_received_descriptors_are_checked_before_use() -> None:
    """attach refuses a memfd that is not sealed against resizing, and a read end in
    place of an inbox's write end; a refused writer is closed, an accepted one kept."""
    ch = shm._Segments(0)
    ch.create()
    unsealed = os.memfd_create("swarmfd-test")
    r, w = os.pipe2(os.O_NONBLOCK)
    try:
        os.ftruncate(unsealed, shm.SEGMENT_SIZE)
        with pytest.raises(shm.Unavailable, match="not one"):
            ch.attach(1, unsealed, w)
        with pytest.raises(OSError):
            os.fstat(w)  # closed by attach
        r2, w2 = os.pipe2(os.O_NONBLOCK)
        with pytest.raises(shm.Unavailable, match="not the write end of a pipe"):
            ch.attach(1, ch.memfd, r2)
        with pytest.raises(OSError):
            os.fstat(r2)
        assert ch.outboxes == {}
        ch.attach(1, ch.memfd, w2)  # a sealed segment and a write end: kept
        assert ch.outboxes == {1: w2}
    finally:
        os.close(unsealed)
        os.close(r)
        ch.close()


# -- real ranks: what a job leaves in /dev/shm -------------------------------------------


def _shm_held() -> list[str]:
    """Paths under /dev/shm this process maps or holds open, except multiprocessing's
    (the test harness's semaphores, sem.*, and shared values, pym-*)."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                paths.add(parts[5].strip())
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            paths.add(target)
    return sorted(p for p in paths if not p.startswith(("/dev/shm/sem.", "/dev/shm/pym-")))


def _job_entries(token: str) -> list[str]:
    """Entries of /dev/shm that belong to the job of ``token`` (the old design named its
    files after it; the new one names nothing, and its socket name is a hash)."""
    return sorted(e for e in os.listdir("/dev/shm") if token and token in e)


def _memfd_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("/memfd:swarmfd" in line for line in f)


def _fd_targets() -> dict[int, str]:
    out = {}
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
    return out


def _instrument(ctx: RankCtx, moment: str | None) -> list[str]:
    """In a rank: report the /dev/shm state at every collective of init ("agreement 1",
    ...), and pause (for the test to kill) at ``moment``: an agreement, "handing over"
    (about to send its descriptors to the hub), "sending tables" (the hub, about to send
    every rank the others'), "got table" (just received them). Returns [job token]."""
    import swarmfd.collectives as coll
    import swarmfd.comm.rendezvous as tr

    token: list[str] = [""]
    real_rendezvous = tr.rendezvous

    def rendezvous(*a: Any, **k: Any) -> Any:
        peers, tok = real_rendezvous(*a, **k)
        token[0] = tok
        return peers, tok

    tr.rendezvous = rendezvous  # type: ignore[assignment]

    def pause(here: str) -> None:
        ctx.report("paused", {"at": here, "token": token[0], "held": _shm_held(),
                              "entries": _job_entries(token[0])})
        time.sleep(600)

    calls = [0]
    for name in ("all_gather", "all_reduce"):
        real = getattr(coll, name)

        def wrapper(*a: Any, _real: Callable[..., Any] = real, **k: Any) -> Any:
            calls[0] += 1
            here = f"agreement {calls[0]}"
            ctx.report("state", {"at": here, "held": _shm_held(),
                                 "entries": _job_entries(token[0]),
                                 "memfds": _memfd_segments()})
            if moment == here:
                pause(here)
            return _real(*a, **k)

        setattr(coll, name, wrapper)
    if moment in ("handing over", "sending tables"):
        def send_fds(*a: Any, **k: Any) -> Any:
            pause(moment)

        socket.send_fds = send_fds  # type: ignore[assignment]
    if moment == "got table":
        real_recv = socket.recv_fds

        def recv_fds(*a: Any, **k: Any) -> Any:
            got = real_recv(*a, **k)
            pause(moment)
            return got

        socket.recv_fds = recv_fds  # type: ignore[assignment]
    return token


def _job(ctx: RankCtx, moments: dict[int, str]) -> dict[str, Any]:
    """Init with the instrumentation above, then (if init worked) collectives; report the
    state during them. A failed init reports its error and what it left open."""
    import swarmfd as fd
    from swarmfd import group

    token = _instrument(ctx, moments.get(ctx.rank))
    before = _fd_targets()
    t0 = time.monotonic()
    try:
        ctx.init()
    except BaseException as exc:
        err = error_info(exc, t0)
        fd.cleanup()
        left = {n: t for n, t in _fd_targets().items() if before.get(n) != t}
        return {"error": err, "left": left, "held": _shm_held(),
                "entries": _job_entries(token[0]), "memfds": _memfd_segments()}
    x = np.full(3 << 20, ctx.rank + 1.0, np.float32)  # 12 MiB: several shm rounds
    fd.all_reduce(x)
    during = {"held": _shm_held(), "entries": _job_entries(token[0]),
              "memfds": _memfd_segments(), "on_shm": group.current().transport.shm is not None}
    fd.barrier()
    return {"sum": float(x[0]), "during": during, "token": token[0]}


def test_a_job_has_no_file_in_dev_shm_during_init_collectives_or_after() -> None:
    """Three ranks on shared memory: at every agreement of init and during collectives no
    rank holds or maps anything in /dev/shm, no entry there bears the job's token, and
    after the job there is none either; the segments are memfds (mapped, so really used)."""
    with Ranks(_job, 3, {}, init=False, transport="shm", group_timeout=30) as ranks:
        out = ranks.results(timeout=90)
        states = [ev[2] for ev in ranks._seen if ev[1] == "state"]
    token = out[0]["token"]
    assert token and all(v["token"] == token for v in out.values())
    assert all(v["sum"] == 6.0 and v["during"]["on_shm"] for v in out.values()), out
    # Five agreements on each rank: three of the setup, two of cross-memory attach.
    assert len(states) == 3 * 5, states
    for s in [*states, *(v["during"] for v in out.values())]:
        assert s["held"] == [] and s["entries"] == [], s
    assert all(v["during"]["memfds"] == 3 for v in out.values()), out
    assert _job_entries(token) == []


#: Moments to kill one rank: (victim, moment). Rank 0 is the hub, 1 and 2 connect to it.
KILLS = [(1, "agreement 1"), (1, "agreement 2"), (1, "agreement 3"), (0, "agreement 2"),
         (1, "agreement 5"), (1, "handing over"), (0, "sending tables"), (2, "got table")]


@pytest.mark.parametrize(("victim", "moment"), KILLS, ids=[f"rank{v}-{m.replace(' ', '-')}"
                                                           for v, m in KILLS])
def test_kill_of_one_rank_during_setup_names_it_and_leaves_nothing(victim: int,
                                                                   moment: str) -> None:
    """kill -9 of one rank at a moment of the setup: the others' init raises
    PeerLostError naming it, leaves no descriptor open and nothing in /dev/shm."""
    with Ranks(_job, 3, {victim: moment}, init=False, transport="shm",
               group_timeout=20) as ranks:
        paused = ranks.wait("paused", [victim], timeout=60)[victim]
        killed_at = ranks.kill(victim)
        survivors = [r for r in range(3) if r != victim]
        out = ranks.results(survivors, timeout=60)
    token = paused["token"]
    record(f"shm-kill[{victim}@{moment}]", after_kill={r: v.get("error", {}).get("t", 0) - killed_at
                                                     for r, v in out.items()},
           errors={r: v.get("error", {}).get("message") for r, v in out.items()})
    try:
        assert _job_entries(token) == [], "left in /dev/shm"
        for r, v in out.items():
            err = v.get("error")
            assert err is not None, f"rank {r} did not fail: {v}"
            assert "PeerLostError" in err["mro"], err
            assert f"lost rank {victim} " in err["message"], err
            assert err["t"] - killed_at < 5.0, err
            assert v["left"] == {}, f"rank {r} left descriptors open: {v['left']}"
            assert v["held"] == [] and v["memfds"] == 0, v
        assert paused["held"] == [] and paused["entries"] == [], paused
    finally:
        _remove_entries(token)


@pytest.mark.parametrize("moment", ["agreement 1", "agreement 3"])
def test_kill_of_every_rank_during_setup_leaves_nothing(moment: str) -> None:
    """kill -9 of every rank at once during the setup leaves nothing in /dev/shm (named
    segments could not promise that: nobody survives to unlink them)."""
    with Ranks(_job, 3, {r: moment for r in range(3)}, init=False, transport="shm",
               group_timeout=20) as ranks:
        paused = ranks.wait("paused", timeout=60)
        for r in range(3):
            ranks.kill(r)
        for p in ranks.procs:
            p.join(10)
    token = paused[0]["token"]
    try:
        assert _job_entries(token) == [], "left in /dev/shm"
        assert all(v["held"] == [] and v["entries"] == [] for v in paused.values()), paused
    finally:
        _remove_entries(token)


def _remove_entries(token: str) -> None:
    """Remove what a job of ``token`` left in /dev/shm (only the old design could)."""
    for e in _job_entries(token):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", e))


# -- real ranks: another local user --------------------------------------------------------

#: The attacker, run as another user (uid 65534). For as long as its stdin stays open it
#: looks for swarmfd's setup sockets in /proc/net/unix (abstract names are listed there
#: for everyone), connects to each again and again (and floods it with connections it
#: closes unread), trying to read a greeting or descriptors; and it does what broke the
#: old design: it reads the job token off /dev/shm names and creates the names of the
#: ranks that have not created theirs yet. Prints its tally as JSON.
_ATTACKER = r"""
import json, os, select, socket, sys
world = int(sys.argv[1])
stats = {"sockets": 0, "connects": 0, "refused": 0, "bytes": 0, "fds": 0, "flood": 0,
         "created": []}
seen = set()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    try:
        with open("/proc/net/unix") as f:
            names = [l.split()[-1] for l in f.readlines()[1:] if l.split()[-1:] and
                     l.split()[-1].startswith("@swarmfd")]
    except OSError:
        names = []
    for name in names:
        if name not in seen:
            seen.add(name)
            stats["sockets"] += 1
        addr = "\0" + name[1:]
        for i in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(0.5)
            try:
                s.connect(addr)
            except OSError:
                stats["refused"] += 1
                s.close()
                break
            if i % 5:
                stats["flood"] += 1  # connect and close, never read
                s.close()
                continue
            stats["connects"] += 1
            try:
                s.send(b"\0" * 75)
                msg, fds, _, _ = socket.recv_fds(s, 4096, 16)
                stats["bytes"] += len(msg)
                stats["fds"] += len(fds)
                for fd in fds:
                    os.close(fd)
            except OSError:
                pass
            s.close()
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        entries = []
    for e in entries:
        if e.startswith("swarmfd-") and e.endswith(".seg"):
            token = e[len("swarmfd-"):].rsplit("-", 1)[0]
            for r in range(world):
                base = f"/dev/shm/swarmfd-{token}-{r}"
                try:
                    os.close(os.open(base + ".seg", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
                    stats["created"].append(base + ".seg")
                    os.mkfifo(base + ".fifo", 0o600)
                    stats["created"].append(base + ".fifo")
                except OSError:
                    pass
print(json.dumps(stats), flush=True)
"""


def _job_under_attack(ctx: RankCtx, late: int) -> dict[str, Any]:
    """Init (rank ``late`` starts its shared-memory setup 0.5 s after the others, so the
    attacker has time to find the socket and the names), collectives; report the
    warnings the swarmfd logger emitted."""
    import swarmfd as fd
    from swarmfd import group, session

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("swarmfd").addHandler(Keep(logging.WARNING))
    if ctx.rank == late:
        real = session._setup_shm

        def later(*a: Any, **k: Any) -> Any:
            time.sleep(0.5)
            return real(*a, **k)

        session._setup_shm = later  # type: ignore[assignment]
    fd.init(ctx.world, ctx.rank, master_addr="127.0.0.1", master_port=ctx.port,
            timeout=ctx.group_timeout)
    x = np.full(1000, ctx.rank + 1.0, np.float32)
    fd.all_reduce(x)
    return {"on_shm": group.current().transport.shm is not None, "sum": float(x[0]),
            "warnings": records}


def _python_for(uid: int) -> str | None:
    """A Python interpreter that ``uid`` can run (this one may live under /root)."""
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3",
                      "/usr/local/bin/python3"):
        try:
            ok = subprocess.run([candidate, "-I", "-S", "-c", "import socket; socket.recv_fds"],
                                user=uid, group=uid, cwd="/", capture_output=True,
                                timeout=30).returncode == 0
        except OSError:
            ok = False
        if ok:
            return candidate
    return None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_local_user_cannot_downgrade_a_job_or_get_its_descriptors() -> None:
    """uid 65534 finds the setup socket, connects to it and floods it, and pre-creates
    the old design's names, during two jobs (one with a rank 0.5 s late): it reads not
    a byte and gets no descriptor, and every job stays on shared memory, warning-free."""
    python = _python_for(NOBODY)
    if python is None:
        pytest.skip(f"no Python interpreter that uid {NOBODY} may run")
    attacker = subprocess.Popen(
        [python, "-I", "-S", "-c", _ATTACKER, "3"], user=NOBODY, group=NOBODY,
        cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    created: list[str] = []
    try:
        assert attacker.stdout is not None and attacker.stdin is not None
        ready, _, _ = select.select([attacker.stdout], [], [], 30)
        assert ready and attacker.stdout.readline().strip() == "ready"
        results = []
        for late in (2, -1):
            with Ranks(_job_under_attack, 3, late, init=False, transport="shm",
                       group_timeout=20) as ranks:
                results.append(ranks.results(timeout=90))
        stdout, stderr = attacker.communicate(timeout=30)  # closes its stdin: it stops
        assert attacker.returncode == 0 and stdout.strip(), stderr
        stats = json.loads(stdout.strip().splitlines()[-1])
        created = stats["created"]
        record("shm-another-user", stats=stats, results=results)
    finally:
        if attacker.poll() is None:
            attacker.kill()
        attacker.wait(10)
        for path in created:
            with contextlib.suppress(OSError):
                os.unlink(path)
    for out in results:
        for r, v in out.items():
            assert v["on_shm"] and v["sum"] == 6.0, (r, v)
            assert v["warnings"] == [], (r, v)
    assert stats["sockets"] >= 1 and stats["connects"] >= 1, stats  # it did find them
    assert stats["bytes"] == 0 and stats["fds"] == 0, stats


# -- real ranks: a real failure on one rank falls back, loudly --------------------------------


def _tight(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` run with RLIMIT_NOFILE at the lowest free descriptor: any descriptor it
    would create fails (EMFILE) or is dropped by the kernel (received ones)."""
    import resource

    def tight(*a: Any, **k: Any) -> Any:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        low = os.open("/dev/null", os.O_RDONLY)
        os.close(low)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        try:
            return call(*a, **k)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return tight


def _reduce_capturing(init: Callable[[], Any]) -> dict[str, Any]:
    """``init()``, an all_reduce and a barrier, with stderr captured as the logging
    module's last-resort handler writes it (no handler configured): whether the rank is
    on shared memory, the sum, and what it wrote."""
    import swarmfd as fd
    from swarmfd import group

    captured = io.StringIO()
    sys.stderr = captured
    try:
        init()
        x = np.full(300_000, fd.get_rank() + 1.0, np.float32)
        fd.all_reduce(x)
        fd.barrier()
        return {"on_shm": group.current().transport.shm is not None, "sum": float(x[-1]),
                "stderr": captured.getvalue()}
    finally:
        sys.stderr = sys.__stderr__


def _job_with_a_failure(ctx: RankCtx, victim: int, what: str) -> dict[str, Any]:
    """Rank ``victim`` hits its descriptor limit during its whole shared-memory setup
    ("setup": at the first descriptor it creates) or only when it receives the others'
    descriptors ("recv_fds")."""
    import swarmfd as fd
    from swarmfd import session

    if ctx.rank == victim:
        if what == "setup":  # the whole shared-memory setup: its first descriptor fails
            session._setup_shm = _tight(session._setup_shm)  # type: ignore[assignment]
        else:
            socket.recv_fds = _tight(socket.recv_fds)  # type: ignore[assignment]
    return _reduce_capturing(lambda: fd.init(ctx.world, ctx.rank, master_addr="127.0.0.1",
                                             master_port=ctx.port, timeout=ctx.group_timeout))


@pytest.mark.parametrize(("victim", "what", "cause"), [
    # The first descriptor of the setup is the memfd; if other threads of the rank close
    # descriptors meanwhile, the memfd takes one and the pipe fails instead, or the
    # pipe another, and the map (mmap duplicates the memfd) fails.
    (1, "setup", r"rank 1: (memfd_create failed|could not create the inbox \(a pipe\)|"
                 r"could not size, seal or map a segment of \d+ bytes): "
                 r"\[Errno 24\] Too many open files"),
    (2, "recv_fds", r"rank 2: could not receive the other ranks' segments: the kernel "
                    r"delivered 0 descriptor\(s\) and dropped the rest \(MSG_CTRUNC"),
])
def test_a_failure_on_one_rank_falls_back_to_tcp_with_a_warning(victim: int, what: str,
                                                                 cause: str) -> None:
    """Every rank falls back to TCP, says so once on stderr naming the rank and the
    cause, and the job completes over TCP."""
    with Ranks(_job_with_a_failure, 3, victim, what, init=False, transport="shm",
               group_timeout=20) as ranks:
        out = ranks.results(timeout=90)
    for r, v in out.items():
        assert not v["on_shm"] and v["sum"] == 6.0, (r, v)
        lines = [line for line in v["stderr"].splitlines() if "shared memory" in line]
        assert len(lines) == 1, (r, v["stderr"])
        assert lines[0].startswith(f"swarmfd rank {r}: shared memory between the ranks of "
                                   "this host is unavailable, collectives use TCP"), lines
        assert re.search(cause, lines[0]), lines


# -- real ranks: the socket in a shared directory ------------------------------------------


def _job_in_dir(ctx: RankCtx, directory: str) -> dict[str, Any]:
    import swarmfd as fd
    import swarmfd.collectives as coll
    from swarmfd import group

    seen: list[list[tuple[str, int]]] = []
    real = coll.all_gather

    def all_gather(*a: Any, **k: Any) -> Any:
        entries = []
        for e in os.listdir(directory):
            with contextlib.suppress(FileNotFoundError):  # unlinked meanwhile
                entries.append((e, os.stat(os.path.join(directory, e)).st_mode & 0o777))
        seen.append(entries)
        return real(*a, **k)

    coll.all_gather = all_gather  # type: ignore[assignment]
    ctx.init()
    fd.barrier()
    return {"on_shm": group.current().transport.shm is not None, "seen": seen,
            "after": os.listdir(directory)}


def test_setup_socket_in_a_shared_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With SWARMFD_SHM_DIR the setup socket is a 0600 file there while the ranks connect
    (the hub's view at the first agreement), gone once they have (everyone's view at the
    last): the job is on shared memory and leaves the directory empty."""
    with tempfile.TemporaryDirectory(prefix="swarmfd-test-shm-dir-") as d:
        monkeypatch.setenv(shm.ENV_SHM_DIR, d)
        with Ranks(_job_in_dir, 2, d, init=False, transport="shm", group_timeout=20) as ranks:
            out = ranks.results(timeout=90)
        assert os.listdir(d) == []
    (name, mode), = out[0]["seen"][0]
    assert name.startswith("swarmfd-shm-") and name.endswith(".sock") and mode == 0o600, out
    for v in out.values():
        # Five agreements: three of the setup, two of cross-memory attach.
        assert v["on_shm"] and len(v["seen"]) == 5 and v["seen"][2:] == [[]] * 3, v
        assert v["after"] == [], v


# -- real ranks: a relay in the shared directory ------------------------------------------


def _job_behind_a_relay(ctx: RankCtx) -> dict[str, Any]:
    """:func:`_reduce_capturing`; the ranks other than the hub connect to the setup
    socket 0.3 s late (so the relay, which renames the socket as it appears, is in
    place)."""
    real = shm.Setup._hand_over

    def late(self: Any) -> None:
        if self.rank != self.hub:
            time.sleep(0.3)
        real(self)

    shm.Setup._hand_over = late  # type: ignore[method-assign]
    return _reduce_capturing(ctx.init)


def test_a_relay_in_the_shared_directory_gets_no_descriptor_and_changes_nothing() -> None:
    """Another job's process shares SWARMFD_SHM_DIR under the same uid (as every job's
    tasks shared the node's volume): it renames the setup socket as it appears, binds
    its own under the name and passes each rank's connection through, descriptors and
    all. The proofs name the hub's end of the connection, which through the relay is
    not the one the rank sees: the hub refuses the relayed proof, the relay gets no
    descriptor, and both ranks say so and run over TCP, with exact results."""
    with tempfile.TemporaryDirectory(prefix="swarmfd-test-shm-relay-") as d:
        env = {shm.ENV_SHM_DIR: d, "SWARMFD_TRANSPORT": "auto"}
        with Attacker("shm-relay", d, "--duration", 60, wait_ready=True) as relay, \
                Ranks(_job_behind_a_relay, 2, init=False, transport=None, env=env,
                      group_timeout=20) as ranks:
            out = ranks.results(timeout=90)
        attack = relay.result
    record("shm-relay", attack=attack, out={r: {k: v[k] for k in ("on_shm", "sum")}
                                            for r, v in out.items()})
    assert attack.get("interposed", 0) >= 1 and attack.get("messages", 0) >= 2, attack
    assert attack.get("descriptors", 0) == 0, attack
    for r, v in out.items():
        assert not v["on_shm"] and v["sum"] == 3.0, (r, v)
        lines = [ln for ln in v["stderr"].splitlines() if "shared memory" in ln]
        assert len(lines) == 1 and "collectives use TCP" in lines[0], (r, v["stderr"])
    assert "a process relays them" in out[0]["stderr"], out[0]["stderr"]  # the hub knows


# -- real ranks: reading each other's memory ------------------------------------------------


def _cma_job(ctx: RankCtx, off: int) -> dict[str, Any]:
    import swarmfd as fd
    from swarmfd import group
    from swarmfd.comm import cma

    if ctx.rank == off:
        os.environ["SWARMFD_CMA"] = "0"
    ctx.init()

    reads = [0]
    real = cma.read

    def counting(pid: int, local: Any, remote: Any) -> None:
        reads[0] += 1
        real(pid, local, remote)

    cma.read = counting  # type: ignore[assignment]
    plane = group.current().transport.shm
    x = np.full(3 << 20, float(ctx.rank + 1), np.float32)  # 12 MiB
    fd.all_reduce(x, op="mean")
    return {"pids": plane.cma_pids, "pid": os.getpid(), "reads": reads[0],
            "mean": [float(x.min()), float(x.max())]}


@pytest.mark.parametrize("on", [True, False])
def test_ranks_of_a_host_read_each_others_memory_unless_turned_off(on: bool) -> None:
    """Local ranks (one pid namespace, reads allowed) agree at init to read each other's
    memory: every rank knows every rank's real pid, and a 12 MiB all_reduce reads the
    peers' buffers; SWARMFD_CMA=0 on one rank only turns it off for all (no read), and
    the mean is right either way."""
    with Ranks(_cma_job, 3, -1 if on else 1, init=False, transport="shm",
               group_timeout=30) as ranks:
        out = ranks.results(timeout=90)
    pids = {r: v["pid"] for r, v in out.items()}
    for v in out.values():
        assert v["mean"] == [2.0, 2.0], v
        if on:
            assert {int(k): p for k, p in v["pids"].items()} == pids, v
            assert v["reads"] >= 2, v  # its chunk's operand from each peer, and more
        else:
            assert v["pids"] is None and v["reads"] == 0, v


def test_a_bad_swarmfd_cma_fails_init_at_once_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """SWARMFD_CMA is read before init starts anything: a bad value is a ConfigError
    naming it (not a rank that leaves the others waiting in the setup)."""
    import swarmfd as fd
    from swarmfd.config import ConfigError

    monkeypatch.setenv("SWARMFD_CMA", "sometimes")
    with pytest.raises(ConfigError, match="SWARMFD_CMA"):
        fd.init(world_size=2, rank=0, master_addr="127.0.0.1", master_port=1,
                secret="0123456789abcdef" * 3)


def test_a_packed_record_goes_through_the_rings_and_is_taken_in_a_few_steps_or_not_at_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """send_packed adds a record (its header packed already) that the peer's receive
    reads as a send's; take takes the peer's next record only when it is the one
    expected, byte for byte, and gives its payload, and otherwise leaves it (and
    everything else) for the channel's receive: a record of another call, a signature
    that differs, records read already, an empty ring. A full ring keeps the record
    queued, in order (send_packed says so: the caller must flush)."""
    from swarmfd.comm import spin
    from swarmfd.comm.planes import shm as plane_module

    planes = _planes(_run_setups(2))
    try:
        (h0, p0), (h1, p1) = planes
        if not p0.ring_slots:
            _no_rings()

        def header(src: int, seq: int, sig: wire.Signature = _SIG, n: int = 0) -> bytes:
            return wire.pack_header(int(wire.Kind.DATA), sig, src, seq, 0, n, 0, 0)

        head, tail = p0.header(int(wire.Kind.DATA), _SIG, 0, 0, 0, 0)
        assert head + wire.seq_bytes(1) + tail == header(0, 1)
        # A packed record is what the channel's receive expects from a send.
        assert p0.send_packed(1, header(0, 1), b"", 0, False) is False
        assert _recv(h1, p1, 0, 0) == b""
        # The expected record is taken (with its payload); the ring is then empty.
        assert p0.send_packed(1, header(0, 2, n=3), b"xyz", 3, False) is False
        assert p1.take(0, header(0, 2, n=3), 3) == b"xyz"
        assert p1.take(0, header(0, 3), 0) is None
        assert p1.next_header(0) is None
        # Another call's record, or the same call under another signature, stays put,
        # and the channel's receive reads it as what it is.
        other = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 1, count=4)
        p0.send_packed(1, header(0, 1, other), b"", 0, False)
        assert p1.take(0, header(0, 2), 0) is None
        assert p1.take(0, header(0, 1), 0) is None
        with pytest.raises(MismatchError, match="all_reduce"):
            _recv(h1, p1, 0, 0)
        # Records read already come first: take leaves them to the receive.
        _send(h0, p0, 1, 5)
        p0.send_packed(1, header(0, 1), b"", 0, False)
        p1.next_header(0)  # reads both, takes the first
        assert p1.records and p1.take(0, header(0, 1), 0) is None
        p1.records.clear()
        # Where waits poll, take looks again while the ring is empty (as often as
        # POLLS allows: many times here); a record caught so tells the spinner the peer
        # keeps up (its misses reset, as a wait's poll that catches its record does);
        # one there at the first look changes nothing.
        monkeypatch.setattr(spin, "ENABLED", 1)
        monkeypatch.setattr(spin, "YIELD", 0)
        monkeypatch.setattr(plane_module, "POLLS", 10**8)
        p1.spinner.misses = 5
        p0.send_packed(1, header(0, 6), b"", 0, False)
        assert p1.take(0, header(0, 6), 0) == b"" and p1.spinner.misses == 5
        late = threading.Timer(0.005, lambda: p0.send_packed(1, header(0, 7), b"", 0, False))
        late.start()
        try:
            assert p1.take(0, header(0, 7), 0) == b""
        finally:
            late.join()
        assert p1.spinner.misses == 0
        # A full ring: the next record is queued, in order, and send_packed says so.
        for _ in range(p0.ring_slots):
            assert p0.send_packed(1, header(0, 9), b"", 0, False) is False
        assert p0.send_packed(1, header(0, 10), b"", 0, False) is True
        assert p0.unsent() == [1] and list(p0.queued[1]) == [header(0, 10)]
        for _ in range(p0.ring_slots):
            assert p1.take(0, header(0, 9), 0) == b""
        p0.wait(1.0)  # pushes the queued record into the ring the peer emptied
        assert p0.unsent() == [] and p1.take(0, header(0, 10), 0) == b""
    finally:
        for _, p in planes:
            p.close()
