"""The message layer (swarmfd.comm.channel) on its own: thread-ranks over an in-memory
plane and over real shared memory, no process and no socket.

What it owns, whatever the plane: matching by (group, source, call, tag) with a stash
for early messages, the call window, signatures and mismatches, deadlines with the
culprit chain, the lost-peer grace, aborts and their encoding, and the separation of
groups (one group's failure never disturbs another's call).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pytest

from swarmfd.comm import wire
from swarmfd.comm.channel import (
    LOST_PEER_GRACE,
    MAX_CALLS_AHEAD,
    STASH_ENTRY_BYTES,
    Channel,
    abort_body,
)
from swarmfd.errors import (
    AbortedError,
    CollectiveTimeout,
    MismatchError,
    PeerLostError,
    ProtocolError,
)

from .support.harness import LOST_PEER_LIMIT, allowed, stall_meter
from .support.memplane import Fabric, run_threads

SIG = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM,
                     wire.dtype_code(np.dtype(np.float32)), count=4,
                     shape=wire.shape_hash((4,)))
PLANES = ["memory", "shm"]


def _payload(v: float) -> bytes:
    return np.full(4, v, np.float32).tobytes()


def _value(data: Any) -> float:
    return float(np.frombuffer(bytes(data), np.float32)[0])


@pytest.mark.parametrize("plane", PLANES)
def test_messages_match_by_group_source_call_and_tag_and_early_ones_wait(plane: str) -> None:
    """Ranks 1 and 2 send two calls of group 0, then two of group 7, two tags each;
    rank 0 takes group 7 first, and within a call the tags and sources in reverse:
    each receive gets exactly its message (the calls of one group come in order)."""
    sends = [(g, seq, tag) for g in (0, 7) for seq in (1, 2) for tag in (0, 3)]
    order = [(g, seq, tag) for g in (7, 0) for seq in (1, 2) for tag in (3, 0)]

    def fn(r: int, ch: Channel, pl: Any) -> Any:
        if r == 0:
            got = {}
            for g, seq, tag in order:
                for src in (2, 1):
                    ch.begin(g, seq)
                    got[(g, seq, tag, src)] = _value(ch.recv(pl, src, SIG, g, seq, tag, 16))
            return got
        for g, seq, tag in sends:
            ch.send(pl, 0, SIG, g, seq, tag, _payload(100 * r + 10 * g + seq + tag / 10))
        ch.flush()
        return None

    got = run_threads(fn, 3, plane=plane)[0]
    assert got == {(g, s, t, src): pytest.approx(100 * src + 10 * g + s + t / 10)
                   for g, s, t in sends for src in (1, 2)}


@pytest.mark.parametrize("plane", PLANES)
def test_a_different_signature_is_a_mismatch_naming_both_calls(plane: str) -> None:
    other = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.MAX, SIG.dtype,
                           count=4, shape=SIG.shape)

    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            ch.send(pl, 0, other, 0, 1, 0, _payload(1))
            ch.flush()
            return None
        with pytest.raises(MismatchError) as info:
            ch.recv(pl, 1, SIG, 0, 1, 0, 16)
        return str(info.value)

    msg = run_threads(fn, 2, plane=plane)[0]
    assert "op=sum" in msg and "op=max" in msg and "rank 1" in msg, msg


def test_a_message_too_far_ahead_is_a_protocol_error_not_a_growing_stash() -> None:
    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            ch.send(pl, 0, SIG, 0, 1 + MAX_CALLS_AHEAD + 1, 0, _payload(1))
            ch.send(pl, 0, SIG, 0, 1, 0, _payload(2))
            return None
        with pytest.raises(ProtocolError, match=f"at most {MAX_CALLS_AHEAD}"):
            ch.recv(pl, 1, SIG, 0, 1, 0, 16)
        return len(ch.stash)

    assert run_threads(fn, 2)[0] == 0


@pytest.mark.waits  # a rank waits for its timeout
@pytest.mark.parametrize("plane", PLANES)
def test_a_timeout_names_the_stuck_rank_not_the_one_waited_for(plane: str) -> None:
    """Rank 0 waits for 1, which waits for 2, which never sends (stuck): both waiting
    ranks' timeouts name rank 2 and the chain of waits, on every plane."""
    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 2:
            time.sleep(2.5)  # stuck in its own computation
            return None
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            ch.recv(pl, r + 1, SIG, 0, 1, 0, 16)
        return str(info.value), time.monotonic() - t0

    out = run_threads(fn, 3, plane=plane, group_timeout=0.5)
    for r in (0, 1):
        msg, took = out[r]
        assert "waiting for rank 2" in msg, msg
        assert took < 0.5 + 1.5, f"rank {r} took {took:.2f} s"


@pytest.mark.waits  # bounds the lost-peer grace
@pytest.mark.parametrize("plane", PLANES)
def test_a_vanished_peer_is_lost_after_the_grace(plane: str) -> None:
    fabric = Fabric(2)
    gone = threading.Event()

    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            fabric.kill(1)
            if plane == "shm":
                pl.close()  # its inbox closes: the peer's write sees EPIPE
            gone.set()
            return None
        # (Rank 1 is gone before rank 0 writes: after a fixed 50 ms sleep, a loaded CI
        # lane once ran the write first, into a still open inbox, and nothing was lost.)
        assert gone.wait(10), "rank 1 did not get to vanish"
        if plane == "shm":
            ch.send(pl, 1, SIG, 0, 1, 0, _payload(0))
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="lost rank 1") as info:
            ch.recv(pl, 1, SIG, 0, 1, 0, 16)
        return t0, time.monotonic(), str(info.value)

    stall_meter()
    t0, t1, msg = run_threads(fn, 2, plane=plane, group_timeout=30, fabric=fabric)[0]
    limit, stalled = allowed(LOST_PEER_LIMIT, t0, t1)
    assert LOST_PEER_GRACE * 0.9 <= t1 - t0 < limit, (t1 - t0, stalled, msg)
    # What the plane the peer was reached through saw.
    assert ("its process ended" if plane == "shm" else "its connection closed") in msg, msg


def test_a_peer_is_named_by_the_plane_that_reaches_it() -> None:
    """A peer on this host's shared memory is named by it, not by its TCP endpoint, and
    its loss is its process ending; a peer over TCP, by its endpoint and connection."""
    from types import SimpleNamespace

    from swarmfd.comm.plane import PeerInfo

    ch = Channel(0, 3, 1.0)
    ch.peers = [PeerInfo(r, f"tcp://10.0.0.{r}:5000", "h", 40 + r) for r in range(3)]
    ch.add_plane(SimpleNamespace(shares_memory=False, name="socket"))  # type: ignore[arg-type]
    ch.add_plane(SimpleNamespace(shares_memory=True, name="shm",  # type: ignore[arg-type]
                                 ranks=[0, 1]))
    assert ch.where(1) == "host h, pid 41, shared memory"
    assert ch.why_lost(1) == "its process ended (it died or exited)"
    assert ch.where(2) == "host h, pid 42, tcp://10.0.0.2:5000"
    assert ch.why_lost(2).startswith("its connection closed")


@pytest.mark.parametrize("plane", PLANES)
def test_an_abort_reaches_the_waiting_rank_with_its_message(plane: str) -> None:
    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            ch.activity = "all_reduce (call #1 on rank 1)"
            ch.abort(ValueError("the loss is NaN at step 9"), 0, 0)
            return None
        with pytest.raises(AbortedError) as info:
            ch.recv(pl, 1, SIG, 0, 1, 0, 16)
        return str(info.value)

    msg = run_threads(fn, 2, plane=plane)[0]
    assert "rank 1 failed" in msg and "the loss is NaN at step 9" in msg, msg


@pytest.mark.parametrize("plane", PLANES)
def test_another_groups_abort_breaks_that_group_only(plane: str) -> None:
    """An abort of group 5 arrives while rank 0 waits in group 0: group 0's call still
    gets its data; group 5's failure is handed to on_group_error."""
    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            ch.abort(RuntimeError("group five went wrong"), 5, 0)
            ch.send(pl, 0, SIG, 0, 1, 0, _payload(42))
            ch.flush()
            return None
        broken: list[tuple[int, str]] = []
        ch.on_group_error = lambda g, e, first: broken.append((g, str(e)))
        value = _value(ch.recv(pl, 1, SIG, 0, 1, 0, 16))
        return value, broken

    value, broken = run_threads(fn, 2, plane=plane)[0]
    assert value == 42
    assert [g for g, _ in broken] == [5] and "group five went wrong" in broken[0][1]


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("finished", [1, 1 + MAX_CALLS_AHEAD])
def test_an_abort_of_a_later_call_lets_the_current_call_finish(plane: str,
                                                                finished: int) -> None:
    """Rank 1 finished call 1 and failed a later one; its abort reaches rank 0 before
    rank 2's message of call 1 (another connection). Rank 0's call 1 gets that message,
    and the group is broken from call ``finished + 1`` on (on_group_error). In a
    point-to-point wait the same abort raises at once (nothing orders the message
    awaited before the failed collective)."""
    told, done = threading.Event(), threading.Event()

    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            ch.abort(RuntimeError("the loss is NaN in call 2"), 0, finished)
            told.set()
            done.wait(10)
            ch.abort(RuntimeError("another failure"), 0, finished)
            return None
        if r == 2:
            told.wait(10)
            time.sleep(0.2)  # the abort is read first
            ch.send(pl, 0, SIG, 0, 1, 0, _payload(42))
            ch.flush()
            return None
        broken: list[tuple[int, str, int]] = []
        ch.on_group_error = lambda g, e, first: broken.append((g, str(e), first))
        value = _value(ch.recv(pl, 2, SIG, 0, 1, 0, 16))
        done.set()
        ch.p2p = True
        with pytest.raises(AbortedError, match="another failure"):
            ch.recv(pl, 1, SIG, 0, 1, 9, 16)
        return value, broken

    value, broken = run_threads(fn, 3, plane=plane)[0]
    assert value == 42
    assert [(g, first) for g, _, first in broken] == [(0, finished + 1)], broken
    assert "rank 1 failed and aborted the group" in broken[0][1], broken
    assert "the loss is NaN in call 2" in broken[0][1], broken


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("finished", [0, 2 + MAX_CALLS_AHEAD, None])
def test_an_abort_of_the_current_call_raises_at_once(plane: str, finished: Any) -> None:
    """An abort whose sender failed in the current call (it finished call 0), one
    from further ahead than a peer can be, or one that does not say, raises in the
    wait at once."""
    def fn(r: int, ch: Channel, pl: Any) -> Any:
        ch.begin(0, 1)
        if r == 1:
            if finished is None:
                ch._control(0, "error", "the loss is NaN")
            else:
                ch.abort(RuntimeError("the loss is NaN"), 0, finished)
            return None
        with pytest.raises(AbortedError, match="the loss is NaN"):
            ch.recv(pl, 1, SIG, 0, 1, 0, 16)
        return True

    assert run_threads(fn, 2, plane=plane)[0]


@pytest.mark.parametrize("limit", [200, 1000, 4096 - wire.HEADER_SIZE])
def test_an_abort_body_fits_its_plane_and_stays_valid_json(limit: int) -> None:
    """A long message (quotes, newlines, non-ASCII: JSON escapes grow it) is cut so the
    encoded body fits the plane's record, and it still decodes with its start intact."""
    message = ('step 9: "loss" is NaN\n' + "é\\" * 5000)
    body = abort_body("error", 3, message, limit, waiting_for=1)
    assert len(body) <= limit
    doc = json.loads(body)
    assert doc["rank"] == 3 and doc["waiting_for"] == 1 and doc["kind"] == "error"
    assert doc["message"].startswith('step 9: "loss" is NaN') or limit < 100
    assert doc["message"].endswith("...")


P2P_SIG = wire.Signature(wire.Collective.P2P, wire.ReduceOp.SUM,
                         wire.dtype_code(np.dtype(np.uint8)), count=1)


@pytest.mark.parametrize("plane", PLANES)
def test_a_peer_that_overfills_the_stash_fails_the_call_naming_it(plane: str) -> None:
    """Rank 1 (it has the secret, but a bug) sends messages nobody asked for (64 KiB; 2 KiB
    records on shared memory, what its rings carry) under distinct keys, inside every
    window the channel accepts: tags of the next call but one, point-to-point pieces, a
    group rank 0 never made. Rank 0's receive fails with a ProtocolError naming rank 1
    and the bound, and what rank 1 has waiting there stays within it. Below the bound
    the same messages are kept and taken as always, and what is taken no longer counts."""
    size = 2048 if plane == "shm" else 1 << 16
    limit = 16 * size
    big = np.ones(size, np.uint8).tobytes()
    keys = ([(0, 3, tag, wire.Kind.DATA, SIG) for tag in range(10)]
            + [(5, 1, tag, wire.Kind.P2P, P2P_SIG) for tag in range(10)]
            + [(999, 1, tag, wire.Kind.DATA, SIG) for tag in range(10)])

    def fn(r: int, ch: Channel, pl: Any) -> Any:
        if r == 0:
            ch.stash_limit = limit
            ch.begin(0, 1)
            with pytest.raises(ProtocolError) as info:
                ch.recv(pl, 1, SIG, 0, 1, 0, 16)
            held = ch.stashed[1]
            ch.stashed[1] = 0
            ch.stash.clear()
            ch.stash_limit = 64 << 20
            ch.recv(pl, 1, SIG, 0, 1, 0, 16)  # the rest of the first flood, kept
            ch.begin(0, 2)
            marker = _value(ch.recv(pl, 1, SIG, 0, 2, 0, 16))  # the second: every key again
            full = ch.stashed[1]
            ch.recv_key(pl, (0, 1, 3, 9), SIG, len(big))
            return str(info.value), held, marker, full, ch.stashed[1]
        for seq in (1, 2):
            for g, s, tag, kind, sig in keys:
                ch.send(pl, 0, sig, g, s, tag, big, kind=kind)
                ch.flush()
            ch.send(pl, 0, SIG, 0, seq, 0, _payload(7.0 + seq))
            ch.flush()
        return None

    message, held, marker, full, after = run_threads(fn, 2, plane=plane)[0]
    assert f"rank 1 sent more than {limit / 2**20:g} MiB that this rank has not asked" in message
    assert "SWARMFD_STASH_MB" in message and "does not follow the protocol" in message
    assert 0 < held <= limit, held
    cost = size + STASH_ENTRY_BYTES
    assert marker == 9.0 and full == len(keys) * cost and after == full - cost, (full, after)
