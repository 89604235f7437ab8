"""The probe ``swarmfd doctor`` (and ``deploy``'s preflight) runs as a job: one task per node.

It runs inside each task, in the image the job would run, and prints what it finds as
lines ``swarmfd-probe {json}`` on stdout, which :mod:`.doctor` reads from the tasks'
logs. Nothing in it talks to Docker. It is sent as the task's command
(``python -c <this file's source>``) rather than imported from the image, so an image
built with another swarmfd version is probed alike: the first part needs the standard
library only, the second swarmfd's public API.

1. **Facts and the mesh** (both modes). The task's own view: its node, ``/dev/shm``
   size and free space, memory (``/proc/meminfo`` and its cgroup's limit), the cores it
   gets (full mode), its clock. Then every task resolves every other task's host name
   ``<job>-<slot>`` (a name that resolves means that task runs) and opens a TCP
   connection to it over the job's overlay network; a peer whose name resolves but that
   cannot be reached is what blocked ports between nodes look like. Each task prints
   a ``facts`` line.
2. **Measurements** (``--mode full``, when every task reached every other). The tasks
   join a swarmfd group (the job's secret authenticates it, as for any job) and measure:

   * the path MTU on the overlay between each pair: datagrams with don't-fragment of
     the overlay interface's MTU and smaller, counted where they arrive, and the path
     MTU the kernel learned; and toward each other node's own address (passed in
     ``--nodes``), the hosts' path MTU as the task's node knows it: a VXLAN overlay
     needs 50 bytes more than its own MTU there;
   * clock offsets against rank 0 (the least round trip of a few exchanges);
   * each pair's latency (half the median round trip of 8 bytes) and bandwidth (16 MiB
     each way) through swarmfd's socket plane, then again through the ZeroMQ plane,
     pairs taking turns in rounds (:func:`pair_rounds`). A pair that loses full-size
     packets without the kernel knowing (a black hole: TCP would stall) is skipped.

   Rank 0 prints a ``links`` line with everything; any rank that fails prints one with
   ``error``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["MARK", "PROBE_PORT", "DatagramCounter", "main", "pair_rounds", "parse_lines",
           "path_mtu"]

#: Prefix of every result line on stdout.
MARK = "swarmfd-probe"
#: The mesh's TCP port and the MTU probe's UDP port, inside the probe job's own network.
PROBE_PORT = 29490
#: Port of the datagrams sent toward the other nodes' own addresses (discard): only their
#: size matters, and the ICMP "fragmentation needed" that may come back.
DISCARD_PORT = 9
#: VXLAN's bytes around each overlay packet (outer IPv4, UDP, VXLAN and Ethernet headers).
VXLAN_OVERHEAD = 50
#: IP and UDP headers of a datagram.
UDP_HEADERS = 28
#: Linux socket options (not in Python's socket module).
IP_MTU_DISCOVER, IP_MTU, IP_PMTUDISC_DO, IP_PMTUDISC_PROBE = 10, 14, 2, 3
#: Datagram sizes tried below the overlay MTU: how far down packets still arrive.
MTU_STEPS = (50, 100, 150, 200, 300, 450)
LATENCY_ROUNDS = 30
BANDWIDTH_BYTES = 16 << 20
BANDWIDTH_ROUNDS = 3
CLOCK_ROUNDS = 8


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``n`` ranks once, in rounds of disjoint pairs (the circle method:
    n-1 rounds for even n, n for odd), so pairs measured at once never share a rank."""
    ranks: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(ranks)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ranks[i], ranks[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs
                       if a is not None and b is not None])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return [r for r in rounds if r]


def parse_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The result objects in a task's output lines (other lines and bad JSON ignored)."""
    found = []
    for line in lines:
        head, _sep, body = line.partition(" ")
        if head != MARK:
            continue
        try:
            value = json.loads(body)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def emit(record: dict[str, Any]) -> None:
    print(f"{MARK} {json.dumps(record, separators=(',', ':'))}", flush=True)


# --- 1. facts and the mesh ---------------------------------------------------------------


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory() -> dict[str, int | None]:
    """The node's memory (``/proc/meminfo``: total, available) and this task's cgroup
    limit and usage (v2, else v1; ``None`` when it has no limit)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _sep, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    info[key] = int(parts[0]) * 1024
    except OSError:
        pass
    limit = _read_int("/sys/fs/cgroup/memory.max")
    usage = _read_int("/sys/fs/cgroup/memory.current")
    if limit is None and usage is None:
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    if limit is not None and limit >= 1 << 60:  # v1 writes "no limit" as a huge number
        limit = None
    return {"total": info.get("MemTotal"), "available": info.get("MemAvailable"),
            "limit": limit, "usage": usage}


def shm() -> dict[str, int | None]:
    """Size and free bytes of ``/dev/shm`` (what torch's DataLoader workers fill)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return {"size": None, "free": None}
    return {"size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}


def facts(slot: int) -> dict[str, Any]:
    """What this task sees of itself."""
    return {"kind": "facts", "slot": slot,
            "node": os.environ.get("SWARMFD_NODE") or socket.gethostname(),
            "shm": shm(), "memory": memory(), "time": time.time()}


class _Listener:
    """A socket served by a thread until :meth:`close`; ``_take`` handles what arrives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take()
            except (OSError, ValueError):
                continue

    def _take(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


class _Inbound(_Listener):
    """The mesh's listener: which slots connected to this task (each sends its slot)."""

    def __init__(self) -> None:
        self.slots: set[int] = set()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", PROBE_PORT))
        sock.listen(64)
        super().__init__(sock)

    def _take(self) -> None:
        conn, _addr = self.sock.accept()
        with conn:
            conn.settimeout(2.0)
            slot = int(conn.recv(16).decode("ascii").strip())
            self.slots.add(slot)
            conn.sendall(b"ok\n")


def _connect(ip: str, slot: int) -> str:
    """One attempt to reach a peer's listener: "ok", "refused", "timeout" or the error."""
    try:
        with socket.create_connection((ip, PROBE_PORT), timeout=1.0) as conn:
            conn.sendall(f"{slot}\n".encode("ascii"))
            conn.settimeout(2.0)
            return "ok" if conn.recv(8).startswith(b"ok") else "no answer"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return str(exc.strerror or exc)


def mesh(job: str, slot: int, world: int, start_timeout: float,
         reach_timeout: float) -> dict[str, Any]:
    """Reach every other task of the job over the overlay, and be reached by it.

    A peer's name resolves once its task runs (``start_timeout`` from now at most); from
    then on it has ``reach_timeout`` seconds to accept a connection, and to make one to
    this task. Returns each peer's outcome ("ok", "unresolved": it never started,
    "timeout": packets lost on the way, "refused", ...), the slots that reached this
    task, and the peers' addresses.
    """
    peers = [s for s in range(1, world + 1) if s != slot]
    started = time.monotonic()
    inbound = _Inbound()
    addresses: dict[int, str] = {}
    resolved_at: dict[int, float] = {}
    reach = {s: "unresolved" for s in peers}

    def waiting(s: int, now: float) -> bool:
        if s not in addresses:
            return now - started < start_timeout
        window = now - resolved_at[s]
        return ((reach[s] != "ok" and window < reach_timeout)
                or (s not in inbound.slots and window < reach_timeout + 1.0))

    try:
        while True:
            now = time.monotonic()
            for s in peers:
                if s not in addresses and now - started < start_timeout:
                    try:
                        addresses[s] = socket.gethostbyname(f"{job}-{s}")
                        resolved_at[s] = now
                    except OSError:
                        continue
                if s in addresses and reach[s] != "ok" and now - resolved_at[s] < reach_timeout:
                    reach[s] = _connect(addresses[s], slot)
            if not any(waiting(s, time.monotonic()) for s in peers):
                break
            time.sleep(0.05)
    finally:
        inbound.close()
    return {"reach": {str(s): v for s, v in reach.items()},
            "inbound": sorted(inbound.slots & set(peers)),
            "addresses": {str(s): ip for s, ip in addresses.items()},
            "mesh_seconds": round(time.monotonic() - started, 3)}


# --- 2. measurements ---------------------------------------------------------------------


class DatagramCounter(_Listener):
    """Counts the MTU probe's datagrams as they arrive: (sender address, size) -> n."""

    def __init__(self, port: int = PROBE_PORT) -> None:
        self.seen: dict[tuple[str, int], int] = {}
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", port))
        super().__init__(sock)

    def _take(self) -> None:
        data, (ip, _port) = self.sock.recvfrom(65536)
        key = (ip, len(data) + UDP_HEADERS)
        self.seen[key] = self.seen.get(key, 0) + 1

    def largest_from(self, ip: str) -> int:
        return max((size for (src, size) in self.seen if src == ip), default=0)


def _send_sized(sock: socket.socket, size: int, copies: int) -> None:
    """Send ``copies`` datagrams of ``size`` bytes (IP packet); one this host refuses
    (larger than the MTU it knows) is not sent."""
    with contextlib.suppress(OSError):
        for _ in range(copies):
            sock.send(b"\0" * (size - UDP_HEADERS))
            time.sleep(0.002)


def path_mtu(ip: str, port: int, size: int | None = None,
             steps: Iterable[int] = ()) -> dict[str, int]:
    """Toward ``ip``: the route's MTU; datagrams of ``size`` bytes (default: that MTU)
    with don't-fragment, and the path MTU the kernel learned from them (an ICMP
    "fragmentation needed" lowers it); then, with don't-fragment but the learned MTU
    ignored, datagrams of ``size - step`` for each step, to be counted where they arrive.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((ip, port))
        route = sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
        size = route if size is None else size
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        for _ in range(2):
            _send_sized(sock, size, 2)
            time.sleep(0.05)
        learned = sock.getsockopt(socket.IPPROTO_IP, IP_MTU)
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
        for step in steps:
            if size - step >= 576:
                _send_sized(sock, size - step, 3)
    return {"route": route, "learned": learned}


def _mtu(fd: Any, rank: int, ips: list[str], nodes: dict[str, str],
         my_node: str) -> dict[str, Any]:
    """This rank's part of the MTU measurement (every rank calls it: it holds barriers):
    toward each peer on the overlay, toward each other node's own address, and the
    largest datagram that arrived from each peer."""
    counter = DatagramCounter()
    try:
        fd.barrier()
        overlay = {str(peer): path_mtu(ip, PROBE_PORT, None, (0, *MTU_STEPS))
                   for peer, ip in enumerate(ips) if peer != rank}
        iface = min((o["route"] for o in overlay.values()), default=0)
        hosts = {name: path_mtu(addr, DISCARD_PORT, iface + VXLAN_OVERHEAD)
                 for name, addr in nodes.items() if name != my_node and addr and iface}
        fd.barrier()
        time.sleep(0.2)
        arrived = {str(peer): counter.largest_from(ip) for peer, ip in enumerate(ips)
                   if peer != rank}
    finally:
        counter.close()
    return {"iface": iface, "overlay": overlay, "arrived": arrived, "hosts": hosts}


def _clock(fd: Any, np: Any, rank: int, world: int) -> dict[str, float]:
    """Rank 0: each rank's clock minus its own, from the exchange of least round trip."""
    buf = np.zeros(1, np.float64)
    offsets: dict[str, float] = {}
    if rank == 0:
        for peer in range(1, world):
            best = (float("inf"), 0.0)
            for _ in range(CLOCK_ROUNDS):
                t0 = time.time()
                fd.send(np.array([t0]), peer)
                fd.recv(buf, peer)
                t1 = time.time()
                best = min(best, (t1 - t0, float(buf[0]) - (t0 + t1) / 2))
            offsets[str(peer)] = best[1]
    else:
        for _ in range(CLOCK_ROUNDS):
            fd.recv(buf, 0)
            fd.send(np.array([time.time()]), 0)
    return offsets


def _pair(fd: Any, np: Any, peer: int, first: bool) -> dict[str, float]:
    """Latency and bandwidth between this rank and ``peer`` (``first``: this rank leads)."""
    small, ack = np.zeros(1, np.float64), np.zeros(1, np.uint8)
    big = np.ones(BANDWIDTH_BYTES // 8, np.float64)
    trips = []
    for i in range(5 + LATENCY_ROUNDS):
        t0 = time.perf_counter()
        if first:
            fd.send(small, peer)
            fd.recv(small, peer)
        else:
            fd.recv(small, peer)
            fd.send(small, peer)
        if i >= 5:
            trips.append(time.perf_counter() - t0)
    result = {"latency_us": statistics.median(trips) / 2 * 1e6}
    for sender in (True, False):
        times = []
        for i in range(1 + BANDWIDTH_ROUNDS):
            t0 = time.perf_counter()
            if sender == first:
                fd.send(big, peer)
                fd.recv(ack, peer)
            else:
                fd.recv(big, peer)
                fd.send(ack, peer)
            if i:
                times.append(time.perf_counter() - t0)
        if sender == first:
            result["send_gbps"] = BANDWIDTH_BYTES / statistics.median(times) / 1e9
    return result


def _links(fd: Any, np: Any, rank: int, world: int,
           skip: set[tuple[int, int]]) -> dict[str, Any]:
    """Every pair's latency and bandwidth on the current plane, gathered on every rank."""
    mine: dict[str, Any] = {}
    for pairs in pair_rounds(world):
        for a, b in pairs:
            if rank in (a, b) and (a, b) not in skip:
                peer = b if rank == a else a
                mine[f"{rank}>{peer}"] = _pair(fd, np, peer, rank == a)
        fd.barrier()
    merged: dict[str, Any] = {}
    for part in fd.all_gather_object(mine):
        merged.update(part)
    return merged


def _black_holes(world: int, mtu: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """Pairs whose full-size packets are lost in one direction without the kernel having
    learned a smaller path MTU: TCP over them would stall."""
    holes = set()
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            sent = mtu[a]["overlay"].get(str(b), {})
            got = mtu[b]["arrived"].get(str(a), 0)
            if sent and sent.get("learned") == sent.get("route") and got < sent["route"]:
                holes.add((min(a, b), max(a, b)))
    return holes


def measure(args: dict[str, Any], own_ip: str) -> dict[str, Any]:
    """Part 2, every rank: join the group twice (socket plane, then ZeroMQ) and measure."""
    import numpy as np

    import swarmfd as fd

    os.environ.update(SWARMFD_DATA_PLANE="socket", SWARMFD_TRANSPORT="tcp")
    cfg = fd.init_from_env()
    rank, world = cfg.rank, cfg.world_size
    started = time.monotonic()
    try:
        ips = fd.all_gather_object(own_ip)
        node = os.environ.get("SWARMFD_NODE", "")
        mtu = fd.all_gather_object(_mtu(fd, rank, ips, args.get("nodes", {}), node))
        clock = _clock(fd, np, rank, world)
        skip = _black_holes(world, mtu)
        planes = {"socket": _links(fd, np, rank, world, skip)}
    finally:
        fd.cleanup()
    os.environ["SWARMFD_DATA_PLANE"] = "zmq"
    fd.init(master_port=cfg.rendezvous_port + 2)
    try:
        planes["zmq"] = _links(fd, np, rank, world, skip)
    finally:
        fd.cleanup()
    return {"kind": "links", "rank": rank, "mtu": mtu, "clock": clock, "planes": planes,
            "skipped": sorted(f"{a}-{b}" for a, b in skip),
            "seconds": round(time.monotonic() - started, 3)}


def own_address(peers: Iterable[str]) -> str:
    """This task's address on the job's network: its source address toward a peer."""
    for peer in peers:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, PROBE_PORT))
            return str(sock.getsockname()[0])
    return ""


def cores() -> dict[str, Any]:
    """The cores this task may run on, and its CPU quota if it has one (the entrypoint's
    reading of the cgroup)."""
    quota = None
    try:
        from swarmfd.entrypoint import cpu_limit

        quota = cpu_limit()
    except ImportError:
        pass
    return {"affinity": len(os.sched_getaffinity(0)), "quota": quota}


def main(argv: list[str] | None = None, output: Callable[[dict[str, Any]], None] = emit) -> int:
    """``python -c SOURCE '{"mode": "quick"|"full", "nodes": {...}, ...}'`` in a task."""
    raw = (sys.argv[1:] if argv is None else argv) or ["{}"]
    args = json.loads(raw[0])
    slot = int(os.environ.get("SWARMFD_TASK_SLOT", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    found = facts(slot)
    full = args.get("mode") == "full"
    if full:
        found["cores"] = cores()
    found.update(mesh(os.environ.get("SWARMFD_JOB", ""), slot, world,
                      float(args.get("start_timeout", 60)), float(args.get("reach_timeout", 5))))
    found["ip"] = own_address(found["addresses"].values())
    output(found)
    if not full or world < 2 or any(v != "ok" for v in found["reach"].values()):
        return 0
    try:
        result = measure(args, found["ip"])
    except Exception as exc:  # reported, not raised: the doctor names it
        output({"kind": "links", "rank": slot - 1, "error": f"{type(exc).__name__}: {exc}"})
        return 0
    if result["rank"] == 0:
        output(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
