"""What a ZeroMQ data plane could reach at best here, beside swarmfd's two TCP planes.

The targets ask the zmq plane for 0.5x the socket plane's speed at 4 and 64 KiB and 0.9x
from 1 MiB (N=2, all_reduce; benchmarks/targets.py). This measures the ceiling of any
plane built on libzmq: two processes exchanging S bytes with plain pyzmq (no swarmfd
code), the zmq plane's sockets and frames (a bound ROUTER that sends the routing id,
then the data; a DEALER that receives; the payload inline with a 40-byte header up to 64
KiB, else its own frame sent without a copy; the received frame added where it arrived),
and nothing else: no header checks, no matching, no call bookkeeping. Each round every
rank sends its buffer and adds the peer's into it, as the pair exchange does. 16 and 64
MiB go in 1 MiB frames, as the planes' pieces. The rounds are timed two ways:

* as ``swarmfd bench`` times a call (``bench``): the input reset, a barrier (an empty
  frame each way), then the timed exchange; per round the slower rank's time, and their
  median. This is the ceiling of what the targets measure;
* the same, but each wait polls for the frame first, giving its core away between
  looks, for at most 200 us, before it blocks (``bench, polling``): what swarmfd's waits
  do on this machine, where two ranks' four busy threads (each one's own and libzmq's
  I/O thread) share 2 cores (swarmfd.comm.spin);
* back to back (``back to back``): rounds follow one another at once, so a rank may
  already send its next round while its peer reads, which flatters the exchange (the
  two ranks' rounds overlap): rank 0's median.

Interleaved with it, run by run: ``swarmfd bench`` (reset, barrier, timed call; slowest
rank's median) on the socket plane and on the zmq plane. The table gives each one's
median over the runs and the ratios that matter: socket plane / bare pyzmq timed as
bench times calls (what a zmq plane could reach at most, as the targets count it) and
socket plane / zmq plane (what it reaches)::

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
import tempfile
import time

import numpy as np

from swarmfd.bench import parse_sizes

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
#: The zmq plane's limits (swarmfd.comm.planes.zmq): inline payloads, frame size.
INLINE_MAX_BYTES = 64 << 10
PIECE = 1 << 20
HEADER = 40
#: How long a bare rank waits for its peer's message before the run fails (ms).
RECV_TIMEOUT_MS = 30_000
#: How long a polling wait looks before it blocks (s): swarmfd's YIELD_SECONDS.
POLL_SECONDS = 200e-6


def _rounds(size: int) -> int:
    """Timed rounds of the bare exchange at ``size`` (about swarmfd bench's iterations)."""
    return 300 if size <= 1 << 20 else 30 if size <= 16 << 20 else 16


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _bare_side(rank: int, base: int, size: int, rounds: int, timing: str,
               out: str) -> None:
    """One rank of the bare pyzmq exchange, timed as ``timing`` says ('bench' or
    'back-to-back', see the module docstring); its round times (s) saved to ``out``."""
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

    events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)
    poll = timing.endswith("polling")

    def arrived() -> None:
        """With polling: until a frame is there, look (giving the core away between
        looks, as swarmfd's waits do where busy threads outnumber cores) for at most
        POLL_SECONDS, then the blocking receive waits."""
        if poll:
            end = time.perf_counter() + POLL_SECONDS
            while not dealer.get(events) & pollin and time.perf_counter() < end:
                os.sched_yield()

    def exchange() -> None:
        if size <= INLINE_MAX_BYTES:
            router.send(peer, zmq.SNDMORE)
            router.send(b"".join((header, x)))
            arrived()
            frame = dealer.recv(copy=False)
            np.add(x, np.frombuffer(memoryview(frame)[HEADER:], np.float32), out=x)
            return
        for at in range(0, size // 4, per):
            router.send(peer, zmq.SNDMORE)
            router.send(header, zmq.SNDMORE)
            router.send(src[at:at + per], copy=False)
        for at in range(0, size // 4, per):
            arrived()
            dealer.recv(copy=False)
            frame = dealer.recv(copy=False)
            part = x[at:at + per]
            np.add(part, np.frombuffer(frame, np.float32), out=part)

    def barrier() -> None:
        router.send(peer, zmq.SNDMORE)
        router.send(b"")
        arrived()
        dealer.recv()

    bench = timing.startswith("bench")
    np.seterr(all="ignore")
    for _ in range(max(3, rounds // 10)):
        exchange()
    times = np.empty(rounds)
    clock = time.perf_counter
    for i in range(rounds):
        if bench:
            x[...] = 1.0  # (swarmfd bench resets its input before every call)
            barrier()
        t = clock()
        exchange()
        times[i] = clock() - t
    np.save(out, times)
    # The rank that finishes first may still have its last round on the way out: a
    # linger of 0 would drop it and leave the peer waiting for it.
    router.close(linger=RECV_TIMEOUT_MS)
    dealer.close(0)
    ctx.term()


def bare(size: int, rounds: int, timing: str = "bench") -> float:
    """The bare pyzmq exchange of ``size`` bytes between two processes, timed as
    ``timing`` says (see the module docstring): the median round (s), of the slower
    rank's per round ('bench') or of rank 0's ('back-to-back')."""
    base = 20000 + (os.getpid() * 7 + size + len(timing)) % 20000
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}.npy") for r in (0, 1)]
        pid = os.fork()
        if pid == 0:
            try:
                _bare_side(1, base, size, rounds, timing, outs[1])
            finally:
                os._exit(0)
        try:
            _bare_side(0, base, size, rounds, timing, outs[0])
        finally:
            os.waitpid(pid, 0)
        if not timing.startswith("bench"):
            return float(np.median(np.load(outs[0])))
        return float(np.median(np.maximum(np.load(outs[0]), np.load(outs[1]))))


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
    ap.add_argument("--sizes", default=",".join(str(size) for size in SIZES),
                    help="sizes in bytes, e.g. 4K,16M (default: 4K,64K,1M,16M,64M)")
    args = ap.parse_args()
    sizes = tuple(parse_sizes(args.sizes))
    timings = ("bench", "bench-polling", "back-to-back")
    kinds = (*timings, "socket", "zmq")
    got: dict[str, dict[int, list[float]]] = {k: {s: [] for s in sizes} for k in kinds}
    for run in range(args.runs):
        for size in sizes:
            for timing in timings:
                got[timing][size].append(bare(size, _rounds(size), timing))
        for plane in ("socket", "zmq"):
            for size, t in planes(plane, sizes).items():
                got[plane][size].append(t)
        print(f"# run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
    print("| size | bare pyzmq, timed as bench | the same, polling | bare pyzmq, back to "
          "back | socket plane | zmq plane | socket / the faster bare pyzmq timed as bench "
          "(a zmq plane's ceiling) | socket / zmq plane | runs (us: bare as bench; polling; "
          "back to back; socket; zmq) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        b, bp, bb, s, z = (statistics.median(got[k][size]) for k in kinds)
        runs = "; ".join(" ".join(f"{t * 1e6:.0f}" for t in got[k][size]) for k in kinds)
        print(f"| {_label(size)} | {b * 1e6:.0f} us | {bp * 1e6:.0f} us | {bb * 1e6:.0f} us | "
              f"{s * 1e6:.0f} us | {z * 1e6:.0f} us | {s / min(b, bp):.2f}x | {s / z:.2f}x | "
              f"{runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
