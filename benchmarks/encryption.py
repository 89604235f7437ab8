"""What the job secret costs: group start-up and all_reduce, per security mode, interleaved.

Run on two ranks over TCP (shared memory would bypass the data sockets)::

    SWARMFD_TRANSPORT=tcp swarmfd run -n 2 -- python benchmarks/encryption.py

Modes: ``off`` (SWARMFD_AUTH=off: NULL rendezvous, socket data plane without a
handshake MAC), ``socket`` (the default: the secret, CURVE rendezvous, socket data
plane whose connections are authenticated by HMAC with per-session tokens),
``plain`` (the secret, ZeroMQ data plane authenticated by a per-session PLAIN
token: SWARMFD_DATA_PLANE=zmq), ``curve`` (SWARMFD_ENCRYPT=1: the ZeroMQ data plane
encrypted too). Each round
starts a group in every mode in turn, in a rotating order (so slow phases of a
shared machine hit every mode alike; a first round is discarded as warm-up),
times ``init`` and the all_reduce of each size (the slower rank's time). The
init time is the joiners': rank 0 starts serving at an agreed moment, the
others call init 0.2 s later (so no connection waits for libzmq's reconnect
interval) and their init covers the handshakes, the rendezvous and the data
connections;
the medians over the rounds are printed by rank 0, with ratios to ``socket`` (the
default),
and as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import swarmfd as fd

MODES = {
    "off": {"SWARMFD_AUTH": "off", "SWARMFD_ENCRYPT": "0", "SWARMFD_DATA_PLANE": "socket"},
    "socket": {"SWARMFD_AUTH": "on", "SWARMFD_ENCRYPT": "0", "SWARMFD_DATA_PLANE": "socket"},
    "plain": {"SWARMFD_AUTH": "on", "SWARMFD_ENCRYPT": "0", "SWARMFD_DATA_PLANE": "zmq"},
    "curve": {"SWARMFD_AUTH": "on", "SWARMFD_ENCRYPT": "1", "SWARMFD_DATA_PLANE": "zmq"},
}
#: The mode the others are compared with: the default configuration.
REFERENCE = "socket"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes-mib", default="1,64")
    ap.add_argument("--iters", default="20,3", help="timed all_reduces per size and round")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    iters = [int(s) for s in args.iters.split(",")]
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    base_port = int(os.environ["MASTER_PORT"])
    bufs = {m: np.ones((m << 20) // 4, np.float32) for m in sizes}
    init_times: dict[str, list[float]] = {m: [] for m in MODES}
    times: dict[tuple[str, int], list[float]] = {(m, s): [] for m in MODES for s in sizes}
    port = base_port
    start = time.time() + 1.0  # every rank runs on this host: one clock
    names = list(MODES)
    for rnd in range(args.rounds + 1):  # round 0 warms up (and absorbs the start skew)
        for mode in names[rnd % len(names):] + names[:rnd % len(names)]:
            os.environ.update(MODES[mode])
            port += 1
            time.sleep(max(0.0, start + (0.2 if rank else 0.0) - time.time()))
            t0 = time.perf_counter()
            fd.init(world, rank, master_addr=os.environ["MASTER_ADDR"], master_port=port,
                    timeout=120)
            took = np.array([time.perf_counter() - t0 if rank else 0.0])
            fd.all_reduce(took, op="max")
            if rnd:
                init_times[mode].append(float(took[0]))
            for size, n in zip(sizes, iters, strict=True):
                x = bufs[size]
                fd.all_reduce(x)  # warm-up (allocations, connections at full speed)
                fd.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    fd.all_reduce(x)
                dt = np.array([(time.perf_counter() - t0) / n])
                fd.all_reduce(dt, op="max")
                if rnd:
                    times[(mode, size)].append(float(dt[0]))
                x[:] = 1.0
            when = np.array([time.time() + 0.5])
            fd.broadcast(when, src=0)
            start = float(when[0])
            fd.cleanup()
    if rank != 0:
        return
    summary: dict[str, object] = {"world": world, "rounds": args.rounds}
    print(f"{'mode':<6} {'init ms':>8} " + " ".join(
        f"{f'{s} MiB ms':>11} {'GB/s':>6} {'x ' + REFERENCE:>8}" for s in sizes))
    for mode in MODES:
        init_ms = statistics.median(init_times[mode]) * 1e3
        cells = []
        for s in sizes:
            med = statistics.median(times[(mode, s)])
            ref = statistics.median(times[(REFERENCE, s)])
            gbs = (s << 20) / med / 1e9
            cells.append(f"{med * 1e3:>11.1f} {gbs:>6.2f} {med / ref:>8.2f}")
            summary[f"{mode}_{s}MiB_ms"] = round(med * 1e3, 2)
            summary[f"{mode}_{s}MiB_ratio_to_{REFERENCE}"] = round(med / ref, 3)
        summary[f"{mode}_init_ms"] = round(init_ms, 1)
        print(f"{mode:<6} {init_ms:>8.1f} " + " ".join(cells))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
