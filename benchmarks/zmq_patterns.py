"""Plain pyzmq socket patterns for a data plane, side by side, without any swarmfd code.

Each round every one of N processes sends SIZE bytes to every peer and receives one
message from each (on loopback); a pattern's figure is the slowest rank's median time
per round. The patterns are the designs the zmq data plane had or could have:

* ``pushpull``: a PULL bound per rank, a PUSH per peer (swarmfd 8ec62ae; the source is
  only the header's claim);
* ``pushpull-meta``: the same, the source read from each message's connection metadata
  (``X-Rank``, set by the sending PUSH; a bound PULL takes any stranger's connection);
* ``dealer-each``: a bound ROUTER that only sends (routing-id frame), a DEALER per peer
  that only receives, readiness read from ZMQ_EVENTS and zmq_poll over them (an earlier
  design of swarmfd's);
* ``dealer-one``: the same ROUTER, one DEALER connected to every peer (libzmq fair-queues
  them), no source;
* ``dealer-meta``: ``dealer-one``, the source read from each message's connection
  metadata (``X-Rank``, set by the sender's ROUTER, ``Frame.get``): swarmfd's plane now.

The patterns alternate run by run (``--runs`` rounds of every pattern), so they see the
same machine load; compare them as ratios within one run::

    python benchmarks/zmq_patterns.py --n 2 --n 4 --size 4096 --runs 4

``--place`` (repeatable) also pins each rank's main thread and libzmq I/O thread: ``same``
(both on core r mod cores), ``cross`` (the main thread on core r, its I/O thread on the
next), ``split`` (every main thread on the first core, every I/O thread on the second);
``none`` leaves them to the scheduler. Measured here, N=2, 4 KiB, dealer-meta
lockstep rounds: same 47-54 us, none 49-59, split 73-81, cross 96-101 us. A round takes
twice as long when a rank's hand-offs to its own I/O thread cross cores, so the zmq
plane's small calls swing between two modes with the scheduler's placement.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
from collections.abc import Callable

import zmq

PATTERNS = ("pushpull", "pushpull-meta", "dealer-each", "dealer-one", "dealer-meta")
PLACES = ("none", "same", "cross", "split")


def _place(place: str, rank: int) -> None:
    """Pin this process's main thread and its libzmq I/O threads (see the module
    docstring); call after the first socket exists (libzmq starts its threads then)."""
    if place == "none":
        return
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[rank % len(cores)]
    main_core, io_core = {"same": (mine, mine),
                          "cross": (mine, cores[(rank + 1) % len(cores)]),
                          "split": (cores[0], cores[-1])}[place]
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith("ZMQbg/IO"):
                os.sched_setaffinity(int(tid), {io_core})
    os.sched_setaffinity(0, {main_core})  # 0: the calling thread


def _by_metadata(rx: zmq.Socket, peers: list[int]) -> Callable[[], bytes]:
    """A receive-any on ``rx`` that also reads each message's source from its
    connection's metadata (``X-Rank``), as the zmq plane does."""
    ranks: dict[str, int] = {str(j): j for j in peers}

    def recv() -> bytes:
        frame = rx.recv(copy=False)
        if ranks[frame.get("X-Rank")] < 0:
            raise AssertionError("unreachable")
        return frame.bytes

    return recv


def _sockets(ctx: zmq.Context, pattern: str, rank: int, n: int, ports: list[int],
             payload: bytes) -> tuple[Callable[[int], None], Callable[[], bytes]]:
    """The pattern's send(peer) and receive-any functions for ``rank``."""
    peers = [j for j in range(n) if j != rank]
    url = "tcp://127.0.0.1:{}".format
    if pattern.startswith("pushpull"):
        rx = ctx.socket(zmq.PULL)
        rx.bind(url(ports[rank]))
        tx = {}
        for j in peers:
            tx[j] = ctx.socket(zmq.PUSH)
            if pattern == "pushpull-meta":
                tx[j].setsockopt(zmq.METADATA, b"X-Rank:%d" % rank)
            tx[j].connect(url(ports[j]))
        return ((lambda j: tx[j].send(payload)),
                rx.recv if pattern == "pushpull" else _by_metadata(rx, peers))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.METADATA, b"X-Rank:%d" % rank)
    router.bind(url(ports[rank]))
    ids = {j: b"%d" % j for j in range(n)}

    def send(j: int) -> None:
        router.send(ids[j], zmq.SNDMORE)
        router.send(payload)

    if pattern == "dealer-each":
        dealers = []
        poller = zmq.Poller()
        for j in peers:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.ROUTING_ID, ids[rank])
            d.connect(url(ports[j]))
            dealers.append(d)
            poller.register(d, zmq.POLLIN)
        events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)

        def recv_each() -> bytes:
            while True:
                for d in dealers:
                    if d.get(events) & pollin:
                        return d.recv(zmq.NOBLOCK)
                poller.poll(50)

        return send, recv_each
    rx = ctx.socket(zmq.DEALER)
    rx.setsockopt(zmq.ROUTING_ID, ids[rank])
    for j in peers:
        rx.connect(url(ports[j]))
    return send, (rx.recv if pattern == "dealer-one" else _by_metadata(rx, peers))


def _rank(pattern: str, rank: int, n: int, size: int, rounds: int, ports: list[int],
          out: mp.Queue, barrier: mp.Barrier, place: str = "none") -> None:
    ctx = zmq.Context()
    try:
        send, recv = _sockets(ctx, pattern, rank, n, ports, b"x" * size)
        _place(place, rank)
        peers = [j for j in range(n) if j != rank]
        barrier.wait()
        for j in peers:  # until every route exists (ROUTER_MANDATORY raises before)
            while True:
                try:
                    send(j)
                    break
                except zmq.ZMQError:
                    time.sleep(0.01)
        for _ in peers:
            recv()
        barrier.wait()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for j in peers:
                send(j)
            for _ in peers:
                recv()
            times.append(time.perf_counter() - t0)
        barrier.wait()
        times.sort()
        out.put((rank, statistics.median(times), times[len(times) // 10]))
    finally:
        ctx.destroy(linger=0)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (each held until all are picked). Fixed
    ports collided now and then with the ephemeral ports of earlier runs' connections."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def run_pattern(pattern: str, n: int, size: int, rounds: int,
                place: str = "none") -> tuple[float, float]:
    """(median, p10) seconds per round of the slowest rank."""
    ports = _free_ports(n)
    out: mp.Queue = mp.Queue()
    barrier = mp.Barrier(n)
    procs = [mp.Process(target=_rank,
                        args=(pattern, r, n, size, rounds, ports, out, barrier, place))
             for r in range(n)]
    for p in procs:
        p.start()
    got = []
    try:
        end = time.monotonic() + 120
        while len(got) < n:
            try:
                got.append(out.get(timeout=1))
            except queue.Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs)
                          if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > end:
                    raise RuntimeError(f"{pattern} N={n}: rank(s) failed or hung "
                                       f"(rank, exit code): {failed or 'timeout'}; see their "
                                       "tracebacks above") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return max(g[1] for g in got), max(g[2] for g in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, action="append", help="ranks (repeatable; 2 and 4)")
    ap.add_argument("--size", type=int, default=4096, help="bytes per message")
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pattern", action="append", choices=PATTERNS)
    ap.add_argument("--place", action="append", choices=PLACES,
                    help="thread placement (repeatable; default none)")
    args = ap.parse_args()
    places = args.place or ["none"]
    for n in args.n or [2, 4]:
        medians: dict[str, list[float]] = {}
        for run in range(args.runs):
            for pattern in args.pattern or PATTERNS:
                for place in places:
                    med, p10 = run_pattern(pattern, n, args.size, args.rounds, place)
                    name = pattern if place == "none" else f"{pattern}@{place}"
                    medians.setdefault(name, []).append(med)
                    print(f"N={n} run={run} {name:12s} median {med * 1e6:7.1f} us  "
                          f"p10 {p10 * 1e6:7.1f} us", flush=True)
        base = medians.get("pushpull")
        for pattern, meds in medians.items():
            ratios = "" if base is None else " ".join(
                f"{m / b:.2f}" for m, b in zip(meds, base, strict=True))
            print(f"N={n} {pattern:12s} medians {' '.join(f'{m * 1e6:.0f}' for m in meds)} us"
                  + (f"; per run / pushpull: {ratios}" if ratios else ""), flush=True)


if __name__ == "__main__":
    main()
