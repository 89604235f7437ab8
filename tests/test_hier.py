"""The two-level algorithms (swarmfd/algorithms/hier.py), in-process on simulated hosts.

Thread-ranks with a memory plane to every rank (the "TCP" between hosts) and real
shared memory among the ranks of each simulated host (tests/support/memplane.py run_hosts):
every collective, even and uneven hosts, two and three hosts, spread placements,
sizes around the rounds and shards, every dtype group, against the sum of the inputs
(exact for integers; floats to float precision, tests/support/reference.py, and bitwise
identical on every rank). tests/test_hier_netsim.py runs the public calls between
real processes on simulated hosts.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from swarmfd.algorithms import hier, select
from swarmfd.algorithms.base import Op
from swarmfd.comm import wire
from swarmfd.counters import CallStats

from .support.memplane import Fabric, run_hier_algorithm, sample_data
from .support.reference import assert_sum

#: Simulated hosts of each rank: even, spread (hosts interleaved in rank order), uneven
#: (3 + 1, 1 + 3, 4 + 2 where K=4 does not divide evenly), three hosts, 2 x 4.
HOSTS = {
    "2x2": [0, 0, 1, 1],
    "2x2-spread": [0, 1, 0, 1],
    "3+1": [0, 0, 0, 1],
    "1+3": [0, 1, 1, 1],
    "4+2-spread": [0, 1, 0, 0, 1, 0],
    "3+2+1": [0, 0, 1, 1, 2, 0],
    "3x2": [0, 0, 1, 1, 2, 2],
    "2x4": [0, 0, 0, 0, 1, 1, 1, 1],
}
DTYPES = [np.int8, np.int64, np.uint32, np.float16, np.float32, np.float64, np.complex128]
#: Element counts: empty, fewer than the shards, odd, and several rounds (float64: a
#: round is 131072 items per rank; with K shards each gets 131072 / K of them).
COUNTS = [0, 1, 3, 1001, 131072 * 2 + 5]


def _check_reduced(got: list[np.ndarray], inputs: list[np.ndarray], dtype: Any) -> None:
    for r in range(1, len(got)):
        assert got[r].tobytes() == got[0].tobytes(), f"rank {r} differs from rank 0 ({dtype})"
    assert_sum(got[0], inputs, what=dtype)


def _crossing(fabric: Fabric, hosts: Any) -> dict[tuple[int, int], int]:
    """Payload bytes sent between ranks on different hosts, by (source, destination)."""
    return {pair: b for pair, b in fabric.link_bytes.items()
            if hosts[pair[0]] != hosts[pair[1]]}


def _flat(op: Op) -> Any:
    """The selection's flat all_reduce on ``op``'s plane: what the large two-level
    all_reduce runs among the shards' owners of more than two hosts."""
    return functools.partial(select.all_reduce, op.plane)


def _all_reduce(kind: str, inputs: list[np.ndarray], hosts: list[int], **kw: Any) -> list[Any]:
    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        buf = inputs[op.me].copy()
        if kind == "small":
            return hier.all_reduce_small(op, buf, np.add, 0, lay, shm, **kw), lambda: buf
        return hier.all_reduce_large(op, buf, np.add, 0, lay, shm, _flat(op), **kw), \
            lambda: buf

    return [r[0] for r in run_hier_algorithm(hosts, make)]


def test_layout() -> None:
    lay = hier.layout_of(["b", "a", "b", "c", "a"], 4)
    assert lay.hosts == ((0, 2), (1, 4), (3,))
    assert (lay.host, lay.local, lay.locals, lay.shards) == (1, 1, [1, 4], 2)
    assert lay.two_level()
    assert not hier.layout_of(["a", "b", "c"], 0).two_level()  # one rank per host
    assert not hier.layout_of(["a", "a"], 1).two_level()  # one host
    with pytest.raises(ValueError, match="bad layout"):
        hier.Layout(((0, 1), (1,)), 0)


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce_large(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    for dtype in DTYPES if count < 1000 else [np.int64, np.float32]:
        inputs = [sample_data(r, count, dtype) for r in range(len(hosts))]
        _check_reduced(_all_reduce("large", inputs, hosts), inputs, dtype)


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 1, 5, 1001, 32768])
def test_all_reduce_small(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    for dtype in DTYPES if count < 1000 else [np.uint32, np.float64]:
        inputs = [sample_data(r, count, dtype) for r in range(len(hosts))]
        _check_reduced(_all_reduce("small", inputs, hosts), inputs, dtype)


@pytest.mark.parametrize("round_bytes", [4096, 65536, 1 << 20])
def test_all_reduce_large_rounds(round_bytes: int) -> None:
    """The pipeline holds for any round size (many small rounds: slots are reused while
    earlier rounds' partials are still on their way between the hosts' leaders, and
    still being combined), on hosts of one, two and four ranks."""
    for shape in ("2x2-spread", "3+1", "1+3", "4+2-spread", "2x4"):
        hosts = HOSTS[shape]
        inputs = [sample_data(r, 50_001, np.float32, seed=round_bytes % 7)
                  for r in range(len(hosts))]
        got = _all_reduce("large", inputs, hosts, round_bytes=round_bytes)
        _check_reduced(got, inputs, np.float32)


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("shape", ["2x4", "2x2-spread", "3+1", "1+3"])
def test_all_reduce_large_streams_between_two_hosts(shape: str, streams: int) -> None:
    """Between two hosts the large all_reduce moves S bytes each way (the two-level
    bound) over at most ``streams`` TCP streams, stream c carried by local index c mod L
    of each host, however many ranks a host holds. (A stream per shard owner made K
    streams share a shaped link; their losses stalled calls on TCP retransmission
    timeouts.)"""
    hosts = HOSTS[shape]
    count = 300_001
    inputs = [sample_data(r, count, np.float32) for r in range(len(hosts))]
    fabric = Fabric(len(hosts))

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        buf = inputs[op.me].copy()
        local = hier._local_op(op, lay, shm)
        return hier._all_reduce_two_hosts(op, buf, np.add, lay, local, 65536,
                                          streams=streams), lambda: buf

    got = [r[0] for r in run_hier_algorithm(hosts, make, fabric=fabric)]
    _check_reduced(got, inputs, np.float32)
    on = [[r for r in range(len(hosts)) if hosts[r] == x] for x in (0, 1)]
    K = max(len(rs) for rs in on)
    C = min(streams, K)
    want = {(on[x][c % len(on[x])], on[1 - x][c % len(on[1 - x])])
            for c in range(C) for x in (0, 1)}
    crossing = _crossing(fabric, hosts)
    assert set(crossing) == want, crossing
    for x in (0, 1):
        sent = sum(b for (src, _), b in crossing.items() if hosts[src] == x)
        assert sent == count * 4, (x, crossing)


@pytest.mark.parametrize("shape", ["2x2-spread", "3+1", "3x2"])
@pytest.mark.parametrize("count", [5, 1001, 131072 + 3])
def test_a_two_level_mean_divides_as_divide_by_divides_the_sum(shape: str, count: int) -> None:
    """The two-level all_reduce (small and large), reduce and reduce_scatter take the
    mean's divide: each gives the bits of its sum divided after by divide_by, on every
    rank (the reduce on its root only, the others' arrays unchanged)."""
    from swarmfd.algorithms.base import divide_by

    hosts = HOSTS[shape]
    n = len(hosts)
    inputs = [sample_data(r, count, np.float32, seed=4) for r in range(n)]
    parts = [(int(b[0]), int(b[-1]) + 1) if len(b) else (0, 0)
             for b in np.array_split(np.arange(count), n)]

    kinds = [k for k in ("small", "large", "reduce", "reduce_scatter")
             if (k != "small" or count * 4 <= select.HIER_SMALL_BYTES)  # one slot at most
             and (k != "reduce_scatter" or len(set(hosts)) == 2)]  # two hosts only

    def make(op: Op, lay: hier.Layout, shm: Any, call: int, divide: int) -> Any:
        buf = inputs[op.me].copy()
        kind = kinds[call]
        if kind == "small":
            return hier.all_reduce_small(op, buf, np.add, divide, lay, shm), lambda: buf
        if kind == "large":
            return hier.all_reduce_large(op, buf, np.add, divide, lay, shm, _flat(op)), \
                lambda: buf
        if kind == "reduce":
            return hier.reduce(op, buf, 1, np.add, divide, lay, shm), lambda: buf
        a, b = parts[op.me]
        out = np.empty(b - a, np.float32)
        return hier.reduce_scatter(op, buf, out, parts, np.add, divide, lay, shm), \
            lambda: out

    sums = run_hier_algorithm(hosts, lambda op, lay, shm, call: make(op, lay, shm, call, 0),
                              calls=len(kinds))
    means = run_hier_algorithm(hosts, lambda op, lay, shm, call: make(op, lay, shm, call, n),
                               calls=len(kinds))
    for r in range(n):
        for c, kind in enumerate(kinds):
            want = sums[r][c].copy()
            if kind != "reduce" or r == 1:
                a, b = parts[r] if kind == "reduce_scatter" else (0, count)
                assert_sum(want, [x[a:b] for x in inputs], what=(r, kind))
                divide_by(want, n)
            else:
                assert np.array_equal(want, inputs[r]), "a non-root's array changed"
            assert means[r][c].tobytes() == want.tobytes(), (r, kind)


def test_all_reduce_calls_in_a_row() -> None:
    """Consecutive calls of both paths rotate through the slots without a rank
    overwriting what a slower one still reads."""
    hosts = HOSTS["4+2-spread"]
    sizes = [10, 70_000, 3, 300_000, 7, 40_000]
    inputs = [[sample_data(r, n, np.float64, seed=c) for c, n in enumerate(sizes)]
              for r in range(len(hosts))]

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        buf = inputs[op.me][call].copy()
        if buf.size < 50_000:
            return hier.all_reduce_small(op, buf, np.add, 0, lay, shm), lambda: buf
        return hier.all_reduce_large(op, buf, np.add, 0, lay, shm, _flat(op),
                                     round_bytes=65536), lambda: buf

    got = run_hier_algorithm(hosts, make, calls=len(sizes))
    for c in range(len(sizes)):
        _check_reduced([g[c] for g in got], [inp[c] for inp in inputs], np.float64)


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 3, 1001, 131072 * 2 + 5])
def test_broadcast(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    n = len(hosts)
    sig_for = {}
    for root in sorted({0, n - 1, n // 2}):
        inputs = [sample_data(r, count, np.int64, seed=root) for r in range(n)]
        sig_for[root] = wire.Signature(wire.Collective.BROADCAST, root=root)

        def make(op: Op, lay: hier.Layout, shm: Any, call: int, root: int = root,
                 inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return hier.broadcast(op, buf, root, lay, shm), lambda: buf

        for got in run_hier_algorithm(hosts, make, sig=sig_for[root]):
            assert np.array_equal(got[0], inputs[root])


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 3, 1001, 131072 * 2 + 5])
def test_reduce(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    n = len(hosts)
    for root in sorted({0, n - 1, n // 2}):
        inputs = [sample_data(r, count, np.int64, seed=root) for r in range(n)]

        def make(op: Op, lay: hier.Layout, shm: Any, call: int, root: int = root,
                 inputs: list[np.ndarray] = inputs) -> Any:
            buf = inputs[op.me].copy()
            return hier.reduce(op, buf, root, np.add, 0, lay, shm), lambda: buf

        got = run_hier_algorithm(hosts, make, sig=wire.Signature(wire.Collective.REDUCE,
                                                                 root=root))
        assert np.array_equal(got[root][0], sum(inputs[1:], start=inputs[0].copy()))
        for r in range(n):
            if r != root:
                assert np.array_equal(got[r][0], inputs[r]), f"rank {r}'s array changed"


@pytest.mark.parametrize("shape", list(HOSTS))
@pytest.mark.parametrize("count", [0, 1, 1001, 131072 + 3])
def test_all_gather(shape: str, count: int) -> None:
    hosts = HOSTS[shape]
    n = len(hosts)
    inputs = [sample_data(r, count, np.float32) for r in range(n)]

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        out = np.full((n, count), np.nan, np.float32)
        out[op.me] = inputs[op.me]
        return hier.all_gather(op, out, lay, shm), lambda: out

    for got in run_hier_algorithm(hosts, make, sig=wire.Signature(wire.Collective.ALL_GATHER)):
        assert np.array_equal(got[0], np.stack(inputs)), "rows out of place"


@pytest.mark.parametrize(("streams", "count"), [(1, 70_001), (2, 70_001), (4, 70_001),
                                                 (None, 70_001), (None, 1000)])
@pytest.mark.parametrize("shape", ["2x4", "3+1", "1+3", "3x2", "4+2-spread"])
def test_all_gather_streams(shape: str, streams: int | None, count: int) -> None:
    """Each host's rows cross to every other host once, over at most ``streams`` TCP
    streams each way (default: STREAMS; a small all_gather, a stream per rank): stream
    c (the rows of locals j = c mod C) leaves from local c and ends at local c mod L of
    the other host. (70001 floats: several rounds, a short last one.)"""
    hosts = HOSTS[shape]
    n = len(hosts)
    inputs = [sample_data(r, count, np.float32) for r in range(n)]
    fabric = Fabric(n)

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        out = np.full((n, count), np.nan, np.float32)
        out[op.me] = inputs[op.me]
        return hier.all_gather(op, out, lay, shm, streams=streams), lambda: out

    for got in run_hier_algorithm(hosts, make, sig=wire.Signature(wire.Collective.ALL_GATHER),
                                  fabric=fabric):
        assert np.array_equal(got[0], np.stack(inputs)), "rows out of place"
    on = {x: [r for r in range(n) if hosts[r] == x] for x in set(hosts)}
    if streams is None:
        small = count * 4 <= hier.SMALL_GATHER_BYTES
        streams = max(len(rs) for rs in on.values()) if small else hier.STREAMS
    want = {(on[x][j % streams], on[g][(j % streams) % len(on[g])])
            for x in on for g in on if g != x for j in range(len(on[x]))}
    crossing = _crossing(fabric, hosts)
    assert set(crossing) == want, crossing
    for x in on:
        for g in on:
            if g != x:
                sent = sum(b for (src, dst), b in crossing.items()
                           if hosts[src] == x and hosts[dst] == g)
                assert sent == len(on[x]) * count * 4, (x, g, crossing)


TWO_HOSTS = [s for s in HOSTS if len(set(HOSTS[s])) == 2]


@pytest.mark.parametrize("shape", TWO_HOSTS)
@pytest.mark.parametrize("count", [0, 5, 1001, 131072 * 2 + 5])
def test_reduce_scatter(shape: str, count: int) -> None:
    """Rank g gets block g of the sum (np.array_split's blocks: uneven, some empty),
    on even and uneven hosts, over several rounds; the input is left unchanged."""
    hosts = HOSTS[shape]
    n = len(hosts)
    parts = [(int(b[0]), int(b[-1]) + 1) if len(b) else (0, 0)
             for b in np.array_split(np.arange(count), n)]
    for dtype in [np.int64, np.float32] if count > 1000 else DTYPES:
        inputs = [sample_data(r, count, dtype) for r in range(n)]

        def make(op: Op, lay: hier.Layout, shm: Any, call: int,
                 inputs: list[np.ndarray] = inputs, dtype: Any = dtype) -> Any:
            buf = inputs[op.me].copy()
            a, b = parts[op.me]
            out = np.full(b - a, 99, dtype)
            return hier.reduce_scatter(op, buf, out, parts, np.add, 0, lay, shm), \
                lambda: (out, buf)

        got = run_hier_algorithm(hosts, make,
                                 sig=wire.Signature(wire.Collective.REDUCE_SCATTER))
        for r in range(n):
            out, buf = got[r][0]
            a, b = parts[r]
            assert np.array_equal(buf, inputs[r]), "the input changed"
            assert_sum(out, [x[a:b] for x in inputs], what=(r, dtype))


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("shape", ["2x4", "3+1", "1+3", "4+2-spread"])
def test_reduce_scatter_streams(shape: str, streams: int) -> None:
    """A host's link carries the other host's blocks once, over at most ``streams``
    streams: the blocks of local j go from local (j mod C) mod L of the other host to
    local (j mod C) mod L of theirs."""
    hosts = HOSTS[shape]
    n, count = len(hosts), 300_001
    parts = [(int(b[0]), int(b[-1]) + 1) for b in np.array_split(np.arange(count), n)]
    inputs = [sample_data(r, count, np.float32) for r in range(n)]
    fabric = Fabric(n)

    def make(op: Op, lay: hier.Layout, shm: Any, call: int) -> Any:
        a, b = parts[op.me]
        out = np.empty(b - a, np.float32)
        return hier.reduce_scatter(op, inputs[op.me], out, parts, np.add, 0, lay, shm,
                                   streams=streams), lambda: out

    got = run_hier_algorithm(hosts, make, sig=wire.Signature(wire.Collective.REDUCE_SCATTER),
                             fabric=fabric)
    for r, (a, b) in enumerate(parts):
        assert_sum(got[r][0], [x[a:b] for x in inputs], what=f"rank {r}")
    on = {x: [r for r in range(n) if hosts[r] == x] for x in (0, 1)}
    pairs = {(on[1 - x][(j % streams) % len(on[1 - x])], on[x][(j % streams) % len(on[x])])
             for x in (0, 1) for j in range(len(on[x]))}
    crossing = _crossing(fabric, hosts)
    assert set(crossing) == pairs, crossing
    for x in (0, 1):
        into = sum(b for (src, dst), b in crossing.items() if hosts[dst] == x)
        assert into == sum(parts[g][1] - parts[g][0] for g in on[x]) * 4, (x, crossing)


def test_progress_engine_drives_the_phases() -> None:
    """The same algorithms issued as async ops (swarmfd.engine): the engine waits on the
    plane of each receive (shared memory inside a host, TCP between), two calls of one
    group queued behind each other."""
    from types import SimpleNamespace

    from swarmfd.engine import Engine

    from .support.memplane import run_hosts

    hosts = HOSTS["3+1"]
    n = len(hosts)
    names = [f"host{h}" for h in hosts]
    inputs = [[sample_data(r, c, np.float32, seed=c) for r in range(n)] for c in (5, 300_001)]

    def fn(r: int, channel: Any, tcp: Any, shm: Any) -> Any:
        rounds = [0]

        def next_slot() -> int:
            from swarmfd.comm.planes import shm as shm_plane

            slot = (rounds[0] % shm_plane.SLOTS) * shm_plane.SEGMENT_BYTES
            rounds[0] += 1
            return slot

        lay = hier.layout_of(names, r)
        engine = Engine(channel, 10.0, lambda g, exc, finished: None)
        group = SimpleNamespace(gid=0, broken=None, stats=CallStats(r, n))
        works, bufs = [], []
        sig = wire.Signature(wire.Collective.ALL_REDUCE)
        for call in range(2):
            buf = inputs[call][r].copy()
            op = Op(channel, tcp, list(range(n)), r, 0, call + 1, sig, None, next_slot)
            algo = (hier.all_reduce_small(op, buf, np.add, 0, lay, shm) if call == 0 else
                    hier.all_reduce_large(op, buf, np.add, 0, lay, shm, _flat(op)))
            works.append(engine.submit(group, op, algo, f"#{call}"))
            bufs.append(buf)
        for w in works:
            w.wait(20)
        engine.close()
        return bufs

    got = run_hosts(fn, hosts)
    for call in range(2):
        _check_reduced([g[call] for g in got], inputs[call], np.float32)


# -- selection -----------------------------------------------------------------------------

#: The capabilities the selection reads of the TCP planes: the socket plane's, and the
#: zmq plane's (whose I/O thread makes it prefer fewer hops).
SOCKET = SimpleNamespace(name="socket", shares_memory=False, reads_peers=False,
                         io_thread=False, inline_max=wire.MAX_PAYLOAD)
ZMQ = SimpleNamespace(name="zmq", shares_memory=False, reads_peers=False, io_thread=True,
                      inline_max=64 << 10)
PLANES = {"socket": SOCKET, "zmq": ZMQ}


def _two_level(choice: select.Choice) -> str | None:
    """The two-level algorithm the selection chose (its name), or None for a flat one."""
    return choice.name if choice.name.startswith("hier.") else None


def _all_reduce_choice(nbytes: int, lay: hier.Layout, plane: str = "socket") -> str | None:
    return _two_level(select.all_reduce(PLANES[plane], nbytes, lay.size, nbytes // 4,
                                        (lay, None)))


def _broadcast_choice(nbytes: int, lay: hier.Layout, root: int) -> str | None:
    return _two_level(select.broadcast(SOCKET, nbytes, lay.size, root, (lay, None)))


def _reduce_choice(nbytes: int, lay: hier.Layout, root: int) -> str | None:
    return _two_level(select.reduce(SOCKET, nbytes, lay.size, root, (lay, None)))


def _reduce_scatter_choice(nbytes: int, lay: hier.Layout) -> str | None:
    return _two_level(select.reduce_scatter(SOCKET, nbytes, lay.size, (lay, None)))


def _all_gather_choice(nbytes: int, lay: hier.Layout, plane: str) -> str | None:
    return _two_level(select.all_gather(PLANES[plane], nbytes, lay.size, (lay, None)))



def test_two_level_layout_selection() -> None:
    """Two-level exactly when the group spans hosts, some host holds several of its ranks,
    each such host's ranks share one shared-memory plane, and SWARMFD_HIERARCHY is auto."""
    from swarmfd.algorithms.select import two_level_layout

    hosts = ["a", "b", "a", "b"]
    lay = two_level_layout(hosts, [0, 1, 0, 1], 2, "auto")
    assert lay is not None and lay.hosts == ((0, 2), (1, 3)) and lay.local == 1
    assert two_level_layout(hosts, [0, 1, 0, 1], 2, "off") is None
    assert two_level_layout(hosts, [0, -1, 0, -1], 0, "auto") is None  # b fell back to TCP
    assert two_level_layout(hosts, [0, 1, 0, 3], 0, "auto") is None  # b: two planes
    # a host of one needs no plane; one host, or one rank per host: flat
    assert two_level_layout(["a", "a", "b"], [0, 0, -1], 2, "auto") is not None
    assert two_level_layout(["a", "a"], [0, 0], 0, "auto") is None
    assert two_level_layout(["a", "b", "c"], [-1, -1, -1], 0, "auto") is None


def test_two_level_selection_by_size() -> None:
    lay = hier.layout_of(["a", "a", "b", "b"], 0)
    assert _all_reduce_choice(4096, lay) == "hier.all_reduce_small"
    assert _all_reduce_choice(select.HIER_SMALL_BYTES, lay) == "hier.all_reduce_small"
    assert _all_reduce_choice(select.HIER_SMALL_BYTES + 4, lay) == "hier.all_reduce_large"
    big = select.HIER_SCATTER_MIN_BYTES
    assert _reduce_scatter_choice(big, lay) == "hier.reduce_scatter"
    assert _reduce_scatter_choice(big - 4, lay) is None  # flat below it
    three = hier.layout_of(["a", "a", "b", "c"], 0)
    assert _reduce_scatter_choice(big, three) is None  # two hosts only


def test_a_small_broadcast_is_two_level_only_where_the_direct_send_crosses_a_link_twice() -> None:
    """Plain data: up to the direct send's size, two-level only when a host other than the
    root's holds several ranks; above it, always."""
    small, large = select.DIRECT_MAX_BYTES, select.DIRECT_MAX_BYTES + 4
    uneven = hier.layout_of(["a", "a", "a", "b"], 0)  # hosts (0, 1, 2) and (3,)
    assert _broadcast_choice(small, uneven, 0) is None  # one copy crosses anyway
    assert _broadcast_choice(small, uneven, 3) == "hier.broadcast"  # 3 would cross
    assert _broadcast_choice(large, uneven, 0) == "hier.broadcast"
    even = hier.layout_of(["a", "b", "a", "b"], 1)
    assert _broadcast_choice(4096, even, 0) == "hier.broadcast"
    assert _broadcast_choice(large, even, 2) == "hier.broadcast"
    nine = hier.layout_of(["a"] * 8 + ["b"], 0)  # 9 ranks: the flat one is the chain
    assert _broadcast_choice(4096, nine, 0) == "hier.broadcast"


# -- the public calls, in-process ------------------------------------------------------------


class _World:
    """Thread-ranks on simulated hosts with a real _State each (memory plane, real shared
    memory, the progress engine), so that the public calls run as in a job that spans
    hosts; ``swarmfd.group.current`` answers each thread with its own state."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        from swarmfd import group as _group

        self.local = threading.local()
        monkeypatch.setattr(_group, "current", lambda what="": self.local.state)

    def run(self, hosts: list[int], fn: Any, hierarchy: str = "auto") -> list[Any]:
        from types import SimpleNamespace

        from swarmfd import group as _group
        from swarmfd import session as _session
        from swarmfd.config import Config

        from .support.memplane import run_hosts

        n = len(hosts)
        names = [f"host{h}" for h in hosts]
        domains = [min(r for r in range(n) if hosts[r] == hosts[q])
                   if hosts.count(hosts[q]) > 1 else -1 for q in range(n)]

        def body(r: int, channel: Any, tcp: Any, shm: Any) -> Any:
            config = Config(world_size=n, rank=r, master_addr="127.0.0.1", timeout=10)
            t = SimpleNamespace(tcp=tcp, shm=shm, channel=channel)
            state = _group._State(config, t, names, hierarchy=hierarchy)  # type: ignore[arg-type]
            state.shm_domains = domains
            _group.make_groups(state)
            state.engine = _session._engine(state)
            self.local.state = state
            try:
                return fn(r, state)
            finally:
                state.engine.close()

        return run_hosts(body, hosts)


def test_public_calls_on_simulated_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective through the public API on 3 + 1 hosts, spread: lists fused per
    dtype group, mean, a non-contiguous array, async ops, a group that crosses hosts
    (world ranks 1, 2, 3 of hosts [0, 1, 0, 0]), a root on either host; every result
    bitwise identical on every rank, and the calls really took the two-level path."""
    import swarmfd as fd
    from swarmfd import collectives

    hosts = [0, 1, 0, 0]
    n = len(hosts)
    taken: list[str] = []
    real = {name: getattr(hier, name) for name in ("all_reduce_small", "all_reduce_large",
                                                    "broadcast", "reduce", "all_gather")}
    for name, fn in real.items():
        def spy(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            taken.append(_name)
            return _fn(*a, **k)
        monkeypatch.setattr(hier, name, spy)

    def body(r: int, state: Any) -> Any:
        out: dict[str, Any] = {}
        big = sample_data(r, 300_001, np.float32)
        out["big"] = collectives.all_reduce(big)
        # 32 KB: the small two-level all_reduce (up to 16 KiB a 3 + 1 world's is flat)
        out["mid"] = collectives.all_reduce(sample_data(r, 8_000, np.float32))
        parts = [sample_data(r, 7, np.float64), sample_data(r, 1000, np.int32),
                 sample_data(r, 5, np.float64)]
        out["list"] = [p.copy() for p in collectives.all_reduce(parts)]
        m = sample_data(r, 70_000, np.float64)
        out["mean"] = collectives.all_reduce(m, op="mean")
        nc = np.arange(40, dtype=np.float32).reshape(8, 5)[:, ::2] * (r + 1)
        out["noncontig"] = collectives.all_reduce(nc).copy()
        w = collectives.all_reduce(sample_data(r, 200_003, np.int64), async_op=True)
        w2 = collectives.all_reduce(sample_data(r, 11, np.int64), op="max", async_op=True)
        out["async"], out["async_max"] = w.wait(20).copy(), w2.wait(20).copy()
        for src in (0, 1):
            b = sample_data(r, 150_000, np.int16)
            out[f"bcast{src}"] = collectives.broadcast(b, src=src).copy()
            x = sample_data(r, 150_000, np.int64)
            out[f"reduce{src}"] = collectives.reduce(x, dst=src).copy()
        out["gather"] = np.stack(collectives.all_gather(sample_data(r, 70_001, np.float32)))
        g = fd.new_group([1, 2, 3])
        if r in (1, 2, 3):
            out["sub"] = collectives.all_reduce(sample_data(r, 100_000, np.float64), group=g)
            out["sub_gather"] = np.stack(collectives.all_gather(sample_data(r, 9, np.uint8),
                                                                group=g))
        collectives.barrier()
        return out

    got = _World(monkeypatch).run(hosts, body)
    inputs = {k: [sample_data(r, c, dt) for r in range(n)] for k, c, dt in (
        ("big", 300_001, np.float32), ("mid", 8_000, np.float32),
        ("mean", 70_000, np.float64),
        ("async", 200_003, np.int64), ("async_max", 11, np.int64),
        ("b", 150_000, np.int16), ("x", 150_000, np.int64), ("gather", 70_001, np.float32),
        ("sub", 100_000, np.float64), ("sub_gather", 9, np.uint8))}
    _check_reduced([o["big"] for o in got], inputs["big"], np.float32)
    _check_reduced([o["mid"] for o in got], inputs["mid"], np.float32)
    _check_reduced([o["async"] for o in got], inputs["async"], np.int64)
    assert all(np.array_equal(o["async_max"], np.max(inputs["async_max"], axis=0))
               for o in got)
    means = [o["mean"] for o in got]
    assert all(m.tobytes() == means[0].tobytes() for m in means)
    assert_sum(means[0], inputs["mean"], n, what="mean")
    for k, (c, dt) in enumerate([(7, np.float64), (1000, np.int32), (5, np.float64)]):
        _check_reduced([o["list"][k] for o in got], [sample_data(r, c, dt) for r in range(n)], dt)
    nc = np.arange(40, dtype=np.float32).reshape(8, 5)[:, ::2]
    assert all(np.array_equal(o["noncontig"], nc * 10) for o in got)
    for src in (0, 1):
        assert all(np.array_equal(o[f"bcast{src}"], inputs["b"][src]) for o in got)
        assert np.array_equal(got[src][f"reduce{src}"], np.sum(inputs["x"], axis=0))
        assert all(np.array_equal(got[r][f"reduce{src}"], inputs["x"][r])
                   for r in range(n) if r != src)
    assert all(np.array_equal(o["gather"], np.stack(inputs["gather"])) for o in got)
    _check_reduced([got[r]["sub"] for r in (1, 2, 3)], inputs["sub"][1:], np.float64)
    assert all(np.array_equal(got[r]["sub_gather"], np.stack(inputs["sub_gather"][1:]))
               for r in (1, 2, 3))
    assert set(taken) == set(real), taken


def test_hierarchy_off_takes_the_flat_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from swarmfd import collectives

    taken: list[str] = []
    for name in ("all_reduce_small", "all_reduce_large", "broadcast", "reduce", "all_gather"):
        monkeypatch.setattr(hier, name, lambda *a, _n=name, **k: taken.append(_n))

    def body(r: int, state: Any) -> Any:
        x = collectives.all_reduce(np.full(300_000, r + 1.0))
        collectives.broadcast(x, src=1)
        return x

    got = _World(monkeypatch).run([0, 0, 1, 1], body, hierarchy="off")
    assert all(np.all(g == 10.0) for g in got) and taken == []


@pytest.mark.parametrize("algo", ["all_reduce_large", "broadcast", "all_gather"])
def test_host_lost_mid_call_is_named_by_every_survivor(algo: str) -> None:
    """Host 1's ranks vanish in the middle of a large call (after some of their rounds;
    the broadcast's root is there; in all_gather before sending anything): every
    survivor raises PeerLostError (or the abort of a local peer that lost it) naming a
    rank of host 1 and its host, within the timeout."""
    import time

    from swarmfd.algorithms.base import complete, run
    from swarmfd.comm.plane import PeerInfo
    from swarmfd.errors import PeerLostError

    from .support.memplane import run_hosts

    hosts = [0, 1, 0, 0, 1]
    n = len(hosts)
    fabric = Fabric(n)
    names = [f"host{h}" for h in hosts]
    count = 1 << 20  # float32: 4 rounds of a slot

    def fn(r: int, channel: Any, tcp: Any, shm: Any) -> Any:
        channel.peers = [PeerInfo(q, f"mem:{q}", names[q], 1000 + q) for q in range(n)]
        slots = [0]

        def next_slot() -> int:
            slots[0] += 1
            return ((slots[0] - 1) % 3) << 20

        sig = wire.Signature(wire.Collective.ALL_REDUCE)
        channel.begin(0, 1)  # as a collective does
        op = Op(channel, tcp, list(range(n)), r, 0, 1, sig, None, next_slot)
        lay = hier.layout_of(names, r)
        buf = np.ones(count, np.float32)
        if algo == "all_reduce_large":
            gen = hier.all_reduce_large(op, buf, np.add, 0, lay, shm, _flat(op))
        elif algo == "broadcast":
            op.sig = wire.Signature(wire.Collective.BROADCAST, root=1)
            gen = hier.broadcast(op, buf, 1, lay, shm)
        else:
            out = np.zeros((n, 1 << 18), np.float32)
            gen = hier.all_gather(op, out, lay, shm)
        if hosts[r] == 1:
            # run a few steps, then vanish (connections close, nothing more is sent)
            if algo != "all_gather":
                req = gen.send(None)
                for _ in range(2):
                    req = gen.send(complete(req))
            fabric.kill(r)
            return None
        start = time.monotonic()
        try:
            run(op, gen)
        except PeerLostError as exc:
            channel.abort(exc, 0, 0)
            return str(exc), time.monotonic() - start
        raise AssertionError("the call succeeded without host 1")

    got = run_hosts(fn, hosts, fabric=fabric, group_timeout=10.0)
    for r in range(n):
        if hosts[r] == 0:
            msg, took = got[r]
            assert "lost rank 1" in msg or "lost rank 4" in msg, msg
            assert "host host1" in msg, msg
            assert took < 5.0, (r, took, msg)


# -- the message layer, as the two-level calls use it -----------------------------------------


def test_reading_another_plane_never_abandons_a_payload_half_read() -> None:
    """While a rank waits on one plane (a shared-memory barrier) the channel reads what
    arrived on the others (TCP data, into the stash) for a bounded time. A payload begun
    must be read to its end, however long the time limit has passed: the plane's stream
    would otherwise parse the rest of it as the next header (seen on simulated hosts as
    "sent bytes that are not a swarmfd message", 3 hosts x 2, all_gather of 16 MiB)."""
    import time

    from swarmfd.comm.channel import LOST_PEER_GRACE, Channel

    from .support.memplane import MemoryPlane

    class SlowPlane(MemoryPlane):
        """A payload that trickles in: read_payload waits in slices, calling between."""

        def read_payload(self, hdr: Any, into: Any, between: Any, keep: bool = False) -> Any:
            end = time.monotonic() + 1.5 * LOST_PEER_GRACE
            while time.monotonic() < end:
                time.sleep(0.02)
                between()
            return super().read_payload(hdr, into, between, keep)

    fabric = Fabric(2)
    channels = [Channel(r, 2, 10.0) for r in range(2)]
    planes = [SlowPlane(fabric, r, channels[r]) for r in range(2)]
    for ch, pl in zip(channels, planes, strict=True):
        ch.add_plane(pl)
    sig = wire.Signature(wire.Collective.ALL_REDUCE)
    for tag in range(2):
        channels[0].send(planes[0], 1, sig, 0, 1, tag, np.full(4, tag, np.int64), copy=True)
    channels[1].begin(0, 1)
    channels[1].set_group(0)
    channels[1].service()
    # The first payload was read whole (into the stash) although the limit passed
    # while reading it; the second waits for the next read.
    assert list(channels[1].stash) == [(0, 0, 1, 0)]
    _hdr, payload = channels[1].stash[(0, 0, 1, 0)]
    assert np.array_equal(np.frombuffer(payload, np.int64), [0, 0, 0, 0])
    channels[1].service()
    assert (0, 0, 1, 1) in channels[1].stash


# -- flat algorithms across hosts: the ring and the chains ordered by host -------------------


def test_flat_collectives_cross_each_host_link_as_few_times_as_their_order_allows() -> None:
    """Four thread-ranks spread over two hosts (a, b, a, b: Swarm's default placement),
    without shared memory, so the flat algorithms run: the broadcast and reduce chains
    cross between the hosts once (S bytes, not the 3 S of a chain in rank order), the
    all_reduce ring twice (3 S, not 6 S)."""
    from .support.threadranks import run_api

    hosts = ["a", "b", "a", "b"]
    S = 4 << 20
    calls = {}
    for name in ("broadcast", "reduce", "all_reduce"):
        fabric = Fabric(4)

        def one(rank: int, world: int, name: str = name) -> bool:
            import swarmfd as fd

            x = np.full(S // 8, float(rank + 1))
            if name == "broadcast":
                fd.broadcast(x, src=1)
                return bool((x == 2.0).all())
            if name == "reduce":
                fd.reduce(x, dst=3)
                return bool((x == (10.0 if rank == 3 else rank + 1)).all())
            fd.all_reduce(x)
            return bool((x == 10.0).all())

        assert all(run_api(one, 4, plane="memory", fabric=fabric, hosts=hosts))
        calls[name] = sum(_crossing(fabric, hosts).values()) / S
    assert calls["broadcast"] < 1.05, calls
    assert calls["reduce"] < 1.05, calls
    assert calls["all_reduce"] < 3.05, calls


def test_a_small_reduce_stays_flat_where_only_the_roots_host_holds_several_ranks() -> None:
    """Plain data: up to HIER_REDUCE_ALONE_MAX_BYTES, flat when every other host holds one
    rank (each sends one copy over its link either way); above it, or when another host
    holds several, two-level."""
    small, large = select.HIER_REDUCE_ALONE_MAX_BYTES, select.HIER_REDUCE_ALONE_MAX_BYTES + 4
    uneven = hier.layout_of(["a", "a", "a", "b"], 0)  # hosts (0, 1, 2) and (3,)
    assert _reduce_choice(small, uneven, 0) is None
    assert _reduce_choice(4096, uneven, 2) is None
    assert _reduce_choice(small, uneven, 3) == "hier.reduce"  # host a's 3 would cross
    assert _reduce_choice(large, uneven, 0) == "hier.reduce"
    even = hier.layout_of(["a", "b", "a", "b"], 1)
    assert _reduce_choice(4096, even, 0) == "hier.reduce"


def test_the_flat_small_all_gathers_link_rows_counted_by_placement() -> None:
    """Plain data: the rows the flat small all_gather carries into the busiest host,
    direct exchange and recursive doubling, as their rounds send them."""
    by_host = hier.layout_of(["a", "a", "b", "b"], 0)
    spread = hier.layout_of(["a", "b", "a", "b"], 0)
    # direct: each of a host's 2 ranks takes the other host's 2 rows
    assert select.flat_gather_rows_in(by_host, False) == 4
    assert select.flat_gather_rows_in(spread, False) == 4
    # doubling: by host the second round crosses (2 rows to each rank), spread the first
    assert select.flat_gather_rows_in(by_host, True) == 4
    assert select.flat_gather_rows_in(spread, True) == 2
    eight = hier.layout_of(["a"] * 4 + ["b"] * 4, 0)
    assert select.flat_gather_rows_in(eight, True) == 16  # the last round: 4 rows to each
    assert select.flat_gather_rows_in(hier.layout_of(["a", "b"] * 4, 0), True) == 4
    # 3+1: the one-rank host takes the other 3 rows either way
    assert select.flat_gather_rows_in(hier.layout_of(["a", "a", "a", "b"], 0), True) == 3
    assert select.flat_gather_rows_in(hier.layout_of(["a", "a", "a", "b"], 0), False) == 3
    # three hosts of two, direct: 2 ranks x 4 rows into each
    assert select.flat_gather_rows_in(hier.layout_of(["a", "a", "b", "b", "c", "c"], 0),
                                      False) == 8


def test_a_small_all_gather_is_two_level_only_where_it_keeps_enough_off_the_link() -> None:
    """Plain data: rows up to HIER_GATHER_FLAT_MAX_BYTES go two-level when that keeps more
    than HIER_GATHER_SAVES_BYTES off the busiest link than the flat one (on the socket
    plane: doubling where N is a power of two; on the zmq plane: the direct exchange);
    larger rows always."""
    saves = select.HIER_GATHER_SAVES_BYTES
    eight = hier.layout_of(["a"] * 4 + ["b"] * 4, 0)  # flat: 16 rows in, two-level: 4
    assert _all_gather_choice(saves // 12, eight, "socket") is None
    assert _all_gather_choice(saves // 12 + 4, eight, "socket") == "hier.all_gather"
    four = hier.layout_of(["a", "a", "b", "b"], 0)  # flat: 4 rows in, two-level: 2
    assert _all_gather_choice(saves // 2, four, "socket") is None
    assert _all_gather_choice(saves // 2 + 4, four, "zmq") == "hier.all_gather"
    # spread at 2x2 over the socket plane: the doubling carries as little as two-level
    most = select.HIER_GATHER_FLAT_MAX_BYTES
    spread = hier.layout_of(["a", "b", "a", "b"], 0)
    assert _all_gather_choice(most, spread, "socket") is None
    assert _all_gather_choice(saves, spread, "zmq") == "hier.all_gather"  # direct: 4
    uneven = hier.layout_of(["a", "a", "a", "b"], 3)
    assert _all_gather_choice(most, uneven, "zmq") is None
    # larger rows: two-level, whatever the placement
    assert _all_gather_choice(most + 4, uneven, "socket") == "hier.all_gather"
    assert _all_gather_choice(most + 4, spread, "socket") == "hier.all_gather"


def test_a_small_all_reduce_stays_flat_where_a_rank_would_fan_out_beyond_the_doubling() -> None:
    """Plain data: up to HIER_FAN_FLAT_MAX_BYTES, flat where the flat all_reduce is
    recursive doubling (socket plane, N a power of two) and some rank of the two-level
    small one would send its host partial to more peers than log2 N; else two-level."""
    uneven = hier.layout_of(["a", "a", "a", "b"], 0)  # the rank of b sends to all 3 of a
    assert select.small_fan(uneven) == 3
    assert select.small_fan(hier.layout_of(["a", "b", "a", "b"], 0)) == 1
    assert select.small_fan(hier.layout_of(["a"] * 6 + ["b"] * 2, 0)) == 3
    assert select.small_fan(hier.layout_of(["a", "a", "b", "b", "c", "c"], 0)) == 2
    most = select.HIER_FAN_FLAT_MAX_BYTES
    assert _all_reduce_choice(most, uneven, "socket") is None
    assert _all_reduce_choice(4096, uneven, "socket") is None
    assert _all_reduce_choice(most + 4, uneven, "socket") == "hier.all_reduce_small"
    assert _all_reduce_choice(4096, uneven, "zmq") == "hier.all_reduce_small"  # direct
    # 6 + 2 ranks: a fan of 3, as many as the doubling's 3 rounds; 7 + 1: 7
    six_two = hier.layout_of(["a"] * 6 + ["b"] * 2, 0)
    assert _all_reduce_choice(4096, six_two, "socket") == "hier.all_reduce_small"
    seven_one = hier.layout_of(["a"] * 7 + ["b"], 0)
    assert _all_reduce_choice(4096, seven_one, "socket") is None
    even = hier.layout_of(["a", "a", "b", "b"], 0)
    assert _all_reduce_choice(4096, even, "socket") == "hier.all_reduce_small"
    # 3 + 2 ranks: not a power of two, the flat one is the direct exchange
    assert _all_reduce_choice(
        4096, hier.layout_of(["a", "a", "a", "b", "b"], 0), "socket") == "hier.all_reduce_small"
