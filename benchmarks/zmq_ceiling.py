"""What a ZeroMQ data plane could reach at best here, beside swarmfd's two TCP planes.

Issue 16 asks the zmq plane for 0.5x the socket plane's speed at 4 and 64 KiB and 0.9x
from 1 MiB (N=2, all_reduce). This measures the ceiling of any plane built on libzmq:
two processes exchanging S bytes with plain pyzmq (no swarmfd code), the zmq plane's
sockets and frames (a bound ROUTER that sends the routing id, then the data; a DEALER
that receives; the payload inline with a 40-byte header up to 64 KiB, else its own
frame sent without a copy; the received frame added where it arrived), and nothing
else: no header checks, no matching, no call bookkeeping. Each round every rank sends
its buffer and adds the peer's into it, as the pair exchange does; rounds run back to
back, so a rank may already send its next round while its peer reads (which only
flatters the exchange). 16 MiB goes in 1 MiB frames, as the planes' pieces.

Interleaved with it, run by run: ``swarmfd bench`` (reset, barrier, timed call; slowest
rank's median) on the socket plane and on the zmq plane. The table gives each one's
median over the runs and the ratios that matter: socket plane / bare pyzmq (what a zmq
plane could reach at most, as issue 16 counts it) and socket plane / zmq plane (what
it reaches)::

    python benchmarks/zmq_ceiling.py --runs 3
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
import time

import numpy as np

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
#: The zmq plane's limits (swarmfd.comm.planes.zmq): inline payloads, frame size.
INLINE_MAX_BYTES = 64 << 10
PIECE = 1 << 20
HEADER = 40
#: How long a bare rank waits for its peer's message before the run fails (ms).
RECV_TIMEOUT_MS = 30_000


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _bare_side(rank: int, base: int, size: int, rounds: int, out: int) -> None:
    """One rank of the bare pyzmq exchange; rank 0 writes the median round (s) to ``out``."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"tcp://127.0.0.1:{base + rank}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"r%d" % rank)
    # A message that never comes fails the run instead of hanging it.
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(f"tcp://127.0.0.1:{base + 1 - rank}")
    peer = b"r%d" % (1 - rank)
    end = time.monotonic() + 10
    while True:  # until the peer's DEALER is connected (ROUTER_MANDATORY)
        try:
            router.send(peer, zmq.SNDMORE)
            router.send(b"ready")
            break
        except zmq.ZMQError:
            if time.monotonic() > end:
                raise
            time.sleep(0.01)
    dealer.recv()
    x = np.ones(size // 4, np.float32)
    src = x.copy()  # (sent without a copy: must not change while libzmq sends it)
    header = bytes(HEADER)
    per = PIECE // 4

    def exchange() -> None:
        if size <= INLINE_MAX_BYTES:
            router.send(peer, zmq.SNDMORE)
            router.send(b"".join((header, x)))
            frame = dealer.recv(copy=False)
            np.add(x, np.frombuffer(memoryview(frame)[HEADER:], np.float32), out=x)
            return
        for at in range(0, size // 4, per):
            router.send(peer, zmq.SNDMORE)
            router.send(header, zmq.SNDMORE)
            router.send(src[at:at + per], copy=False)
        for at in range(0, size // 4, per):
            dealer.recv(copy=False)
            frame = dealer.recv(copy=False)
            part = x[at:at + per]
            np.add(part, np.frombuffer(frame, np.float32), out=part)

    np.seterr(all="ignore")
    for _ in range(max(3, rounds // 10)):
        exchange()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        exchange()
        times.append(time.perf_counter() - t)
    if rank == 0:
        os.write(out, f"{statistics.median(times)}\n".encode())
    # The rank that finishes first may still have its last round on the way out: a
    # linger of 0 would drop it and leave the peer waiting for it.
    router.close(linger=RECV_TIMEOUT_MS)
    dealer.close(0)
    ctx.term()


def bare(size: int, rounds: int) -> float:
    """Median round (s) of the bare pyzmq exchange of ``size`` bytes, two processes."""
    base = 20000 + (os.getpid() * 7 + size) % 20000
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _bare_side(1, base, size, rounds, w)
        finally:
            os._exit(0)
    try:
        _bare_side(0, base, size, rounds, w)
    finally:
        os.waitpid(pid, 0)
    os.close(w)
    with os.fdopen(r) as f:
        return float(f.read().split()[0])


def planes(plane: str, sizes: tuple[int, ...]) -> dict[int, float]:
    """``swarmfd bench`` of all_reduce at ``sizes`` on ``plane`` ('socket' or 'zmq'):
    the slowest rank's median (s) at each size."""
    env = {**os.environ, "SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": plane}
    spec = ",".join(str(s) for s in sizes)
    out = subprocess.run(
        [sys.executable, "-m", "swarmfd", "run", "-n", "2", "--", sys.executable, "-m",
         "swarmfd", "bench", "--sizes", spec, "--format", "csv", "-q"],
        env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [line.split("] ", 1)[-1] for line in out.splitlines()]
    got = {}
    for row in csv.DictReader(io.StringIO("\n".join(r for r in rows if "," in r))):
        got[int(row["size"])] = float(row["time_us"]) * 1e-6
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs")
    args = ap.parse_args()
    got: dict[str, dict[int, list[float]]] = {k: {s: [] for s in SIZES}
                                              for k in ("bare", "socket", "zmq")}
    for run in range(args.runs):
        for size in SIZES:
            got["bare"][size].append(bare(size, 300 if size <= 1 << 20 else 30))
        for plane in ("socket", "zmq"):
            for size, t in planes(plane, SIZES).items():
                got[plane][size].append(t)
        print(f"# run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
    print("| size | bare pyzmq exchange | socket plane | zmq plane | socket / bare pyzmq "
          "(a zmq plane's ceiling) | socket / zmq plane | runs (us: bare; socket; zmq) |")
    print("|---|---|---|---|---|---|---|")
    for size in SIZES:
        b, s, z = (statistics.median(got[k][size]) for k in ("bare", "socket", "zmq"))
        runs = "; ".join(" ".join(f"{t * 1e6:.0f}" for t in got[k][size])
                         for k in ("bare", "socket", "zmq"))
        print(f"| {_label(size)} | {b * 1e6:.0f} us | {s * 1e6:.0f} us | {z * 1e6:.0f} us | "
              f"{s / b:.2f}x | {s / z:.2f}x | {runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
