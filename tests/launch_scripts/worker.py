"""A rank for the launcher tests: ``worker.py MODE [args]``; see each mode's function.

Ranks record their PID (and a child's PID) in PIDDIR so the tests can check
that nothing of the run survives: ``<attempt>-<rank>.pid`` and ``.child``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ATTEMPT = int(os.environ.get("SWARMFD_RESTART_COUNT", "0"))

ENV_KEYS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SWARMFD_PORT", "SWARMFD_TIMEOUT", "SWARMFD_RESTART_COUNT", "PYTHONUNBUFFERED",
)


def record(piddir: str, child: bool) -> None:
    """Write this rank's PID, and start and record a sleeping child in its process group."""
    d = Path(piddir)
    if child:
        kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (d / f"{ATTEMPT}-{RANK}.child").write_text(str(kid.pid))
    (d / f"{ATTEMPT}-{RANK}.pid").write_text(str(os.getpid()))


def wait_for_all(piddir: str) -> None:
    deadline = time.monotonic() + 10
    while len(list(Path(piddir).glob(f"{ATTEMPT}-*.pid"))) < WORLD:
        if time.monotonic() > deadline:
            sys.exit("worker: the other ranks did not start within 10 s")
        time.sleep(0.02)


def mode_env(*extra: str) -> None:
    """Print the contract variables (and any named in argv) as one JSON line."""
    keys = (*ENV_KEYS, *extra)
    print(json.dumps({"executable": sys.executable, **{k: os.environ.get(k) for k in keys}}))


def mode_bind_ports() -> None:
    """Rank 0 listens on MASTER_PORT and SWARMFD_PORT at MASTER_ADDR, both at once (as
    torch's store and swarmfd's rendezvous would), and prints the two ports as JSON."""
    if RANK != 0:
        return
    import socket

    ports = [int(os.environ["MASTER_PORT"]), int(os.environ["SWARMFD_PORT"])]
    socks = [socket.create_server((os.environ["MASTER_ADDR"], p)) for p in ports]
    print(json.dumps({"bound": [s.getsockname()[1] for s in socks]}))
    for s in socks:
        s.close()


def mode_sleep(piddir: str, *flags: str) -> None:
    """Record PIDs (with a child), then sleep 60 s; ``ignore`` makes it deaf to INT/TERM."""
    if "ignore" in flags:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(piddir, child=True)
    time.sleep(60)


def mode_fail(piddir: str, rank: str, code: str) -> None:
    """Rank ``rank`` exits with ``code`` (``-S``: kills itself with signal S) once all started."""
    record(piddir, child=True)
    if int(rank) != RANK:
        time.sleep(60)
        return
    wait_for_all(piddir)
    print(f"rank {RANK} failing", file=sys.stderr)
    c = int(code)
    if c < 0:
        os.kill(os.getpid(), -c)
        time.sleep(10)
    sys.exit(c)


def mode_follow(piddir: str) -> None:
    """The last rank exits 3; rank 0 exits 1 0.1 s after it sees that (like a lost peer,
    which swarmfd raises only after its 0.3 s grace, LOST_PEER_GRACE). The launcher
    orders exits as its threads see them: two within its scheduling latency (milliseconds,
    more on a loaded machine: a CI run saw rank 0's first when it followed at once) can
    come in either order."""
    record(piddir, child=False)
    wait_for_all(piddir)
    last = WORLD - 1
    if last == RANK:
        sys.exit(3)
    if RANK == 0:
        stat = Path(f"/proc/{Path(piddir, f'{ATTEMPT}-{last}.pid').read_text()}/stat")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                text = stat.read_bytes()
            except OSError:
                break
            if text[text.rfind(b")") + 2 :][:1] in (b"Z", b"X"):
                break
        time.sleep(0.1)
        sys.exit(1)
    time.sleep(60)


def mode_output(lines: str) -> None:
    """stdout/stderr lines, many long lines to tempt interleaving, bad UTF-8, a partial line."""
    out = sys.stdout
    print(f"out {RANK}")
    print(f"err {RANK}", file=sys.stderr)
    for i in range(int(lines)):
        out.write(f"line {RANK} {i} {'x' * 200}\n")
    out.flush()
    sys.stdout.buffer.write(b"bytes \xff\xfe " + str(RANK).encode() + b"\n")
    sys.stdout.buffer.write(f"partial {RANK}".encode())
    sys.stdout.flush()


def mode_restart(piddir: str) -> None:
    """Fail with code 3 on attempts 0 and 1 (rank 1 only); succeed from attempt 2 on."""
    record(piddir, child=False)
    print(f"attempt {ATTEMPT} port {os.environ['MASTER_PORT']} "
          f"swarmfd {os.environ['SWARMFD_PORT']}")
    if ATTEMPT < 2 and RANK == 1:
        wait_for_all(piddir)
        sys.exit(3)
    if ATTEMPT < 2:
        time.sleep(60)


def mode_leave_child(piddir: str) -> None:
    """Start a sleeping child in this rank's group, then exit 0 without waiting for it."""
    record(piddir, child=True)


def mode_affinity() -> None:
    """Print the CPUs this rank, and a thread it starts, may run on, as one JSON line."""
    import threading

    seen: list[list[int]] = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    print(json.dumps({"rank": RANK, "cpus": sorted(os.sched_getaffinity(0)),
                      "thread": seen[0], "omp": os.environ.get("OMP_NUM_THREADS")}))


def mode_spam(count: str) -> None:
    """Write ``count`` lines to stdout (for a reader that goes away)."""
    for i in range(int(count)):
        print(f"spam {RANK} {i}")


if __name__ == "__main__":
    globals()[f"mode_{sys.argv[1].replace('-', '_')}"](*sys.argv[2:])
