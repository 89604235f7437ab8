"""A loopback fuzzer for swarmfd's ports (rank 0's rendezvous port and the ranks' data ports).

:class:`Fuzzer` sends, for a bounded time and only to 127.0.0.1:

* ``raw``: a TCP connection with random bytes, then closed;
* ``zmtp``: a TCP connection with a valid ZMTP 3.0 greeting, a READY command for
  a PUSH socket, then random frame bytes (random flags and sizes, up to 2^64);
* ``push``: random multipart messages from ZMTP-valid zmq PUSH sockets (some
  long-lived, some opened for one message);
* ``dealer``: random multipart messages from zmq DEALER sockets (accepted by
  the rendezvous ROUTER, refused by the data PULL sockets);
* ``forged``: two-frame messages whose first frame is a swarmfd header with
  the right magic and version and random fields (kind, collective, source
  rank, sequence number, ...), biased toward plausible values (existing ranks,
  small sequence numbers, DATA and ABORT kinds).

The mix is seeded, so a failure can be replayed.

:func:`fuzz_in_a_process` runs a :class:`Fuzzer` in a process of its own. libzmq can
abort the *sending* process when a peer drops a connection in the middle of a
multipart message (``Assertion failed: !more (src/lb.cpp)``, zeromq/libzmq#1338: PUSH
and DEALER sockets share that load balancer), which is what the ranks do to a stranger
that sends frames over their limit. In the test process that abort took the pytest
worker down (a CI run of 2026-12-04, beside the job-level fuzz on the zmq plane); in a
process of its own it ends one attacker, and the next one (another seed) goes on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import signal
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq

from swarmfd.comm import wire

#: A ZMTP 3.0 greeting (NULL mechanism, client) and a READY command for a PUSH socket.
ZMTP_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
                 + b"\x00" + b"\x00" * 31)
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
ZMTP_READY = b"\x04" + bytes([len(_READY_BODY)]) + _READY_BODY


def zmtp_handshake(sock: socket.socket) -> None:
    """Send the greeting and read the peer's (libzmq drops bytes sent before its greeting)."""
    sock.sendall(ZMTP_GREETING)
    got = b""
    while len(got) < len(ZMTP_GREETING):
        chunk = sock.recv(len(ZMTP_GREETING) - len(got))
        if not chunk:
            raise ConnectionError("the peer closed during the ZMTP greeting")
        got += chunk


def forged_message(rng: random.Random, world: int, max_payload: int = 4096) -> list[bytes]:
    """A message whose header has the right magic and version and random fields.

    Half are plausible: an existing source rank, a small sequence number, a real
    kind and collective, and a payload that matches ``nbytes`` (inline in the
    header frame or as a second frame). The others are random after the version.
    """
    fields = list(wire.HEADER.unpack(rng.randbytes(wire.HEADER_SIZE)))
    fields[0], fields[1] = wire.MAGIC, wire.PROTOCOL_VERSION
    payload = rng.randbytes(rng.randint(0, max_payload))
    if rng.random() < 0.5:
        return [wire.HEADER.pack(*fields)] + [payload] * rng.randint(0, 2)
    fields[2] = rng.choice([int(k) for k in wire.Kind])  # kind
    fields[3] = rng.choice([int(c) for c in wire.Collective])  # collective
    fields[7] = rng.randrange(world)  # src
    fields[9] = rng.randrange(0, 64)  # seq
    fields[10] = rng.randrange(0, 8)  # tag
    fields[13] = len(payload)  # nbytes
    inline = getattr(wire, "FLAG_INLINE", 0)
    if inline and rng.random() < 0.5:
        fields[6] = inline
        return [wire.HEADER.pack(*fields) + payload]
    fields[6] = 0
    return [wire.HEADER.pack(*fields), payload]


class Fuzzer:
    """Sends random traffic to ``data_ports`` and ``master_port``, the port rank 0's
    rendezvous binds (``Config.rendezvous_port``; see module docstring)."""

    def __init__(self, data_ports: list[int], master_port: int | None, world: int, seed: int,
                 kinds: tuple[str, ...] = ("raw", "zmtp", "push", "dealer", "forged"),
                 max_frame: int = 1 << 18) -> None:
        self.rng = random.Random(seed)
        self.data_ports = data_ports
        self.ports = data_ports + ([master_port] if master_port else [])
        self.world = world
        self.kinds = kinds
        self.max_frame = max_frame
        self.ctx = zmq.Context()
        self.sent: Counter[str] = Counter()
        self.bytes = 0
        self.pushers = [self._socket(zmq.PUSH, p) for p in data_ports]

    def _socket(self, kind: int, port: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 100)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    def _size(self) -> int:
        """Log-uniform frame size, 0 .. max_frame bytes."""
        if self.rng.random() < 0.1:
            return 0
        return int(2 ** self.rng.uniform(0, self.max_frame.bit_length() - 1))

    def _frames(self) -> list[bytes]:
        return [self.rng.randbytes(self._size()) for _ in range(self.rng.randint(1, 4))]

    def _send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.Again):
            sock.send_multipart(frames, zmq.NOBLOCK)
            self.bytes += sum(len(f) for f in frames)

    def _raw(self, port: int, greet: bool) -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                data = self.rng.randbytes(self.rng.randint(0, 4096))
                if greet:
                    zmtp_handshake(s)
                    # Random frames: flags byte then a 1- or 8-byte size, then junk.
                    data = ZMTP_READY + bytes([self.rng.choice([0, 1, 2, 3])]) + data
                s.sendall(data)
                self.bytes += len(data)
        except OSError:
            pass  # refused (the rendezvous port is closed once the group formed) or reset

    def step(self) -> str:
        """Send one random payload; its kind."""
        kind = self.rng.choice(self.kinds)
        port = self.rng.choice(self.ports)
        if kind == "raw":
            self._raw(port, greet=False)
        elif kind == "zmtp":
            self._raw(port, greet=True)
        elif kind == "push":
            if self.rng.random() < 0.2:
                sock = self._socket(zmq.PUSH, port)
                self._send(sock, self._frames())
                sock.close()
            else:
                self._send(self.rng.choice(self.pushers), self._frames())
        elif kind == "dealer":
            sock = self._socket(zmq.DEALER, port)
            self._send(sock, self._frames())
            sock.close()
        elif kind == "forged":
            self._send(self.rng.choice(self.pushers), forged_message(self.rng, self.world))
        else:
            raise AssertionError(kind)
        self.sent[kind] += 1
        return kind

    def close(self) -> None:
        for sock in self.pushers:
            sock.close(linger=1000)  # let the last queued messages out
        self.ctx.term()


#: Attackers a :func:`fuzz_in_a_process` run may lose to libzmq's abort before it fails.
MAX_ABORTS = 5


@dataclass
class Fuzzed:
    """What :func:`fuzz_in_a_process` sent: payloads by kind, bytes, and the exit codes of
    attackers that libzmq aborted (each replaced by a fresh one)."""

    sent: Counter[str] = field(default_factory=Counter)
    bytes: int = 0
    aborted: list[int] = field(default_factory=list)


def _fuzz_child(data_ports: list[int], master_port: int | None, world: int, seed: int,
                kinds: tuple[str, ...], max_frame: int, end: float, stop: float,
                at_least: int, pause: float, shared: Any) -> None:
    """One attacker: fuzz until ``stop``, or from ``end`` once ``at_least`` payloads were
    sent by it and the attackers before it (``shared``: counts by kind, then bytes;
    written after every payload, so an abort loses none)."""
    fuzzer = Fuzzer(data_ports, master_port, world, seed, kinds, max_frame)
    index = {k: i for i, k in enumerate(kinds)}
    try:
        while True:
            now = time.monotonic()
            if now >= stop or (now >= end and sum(shared[:len(kinds)]) >= at_least):
                return
            before = fuzzer.bytes
            kind = fuzzer.step()
            shared[index[kind]] += 1
            shared[len(kinds)] += fuzzer.bytes - before
            time.sleep(pause)
    finally:
        fuzzer.close()


def fuzz_in_a_process(data_ports: list[int], master_port: int | None, world: int,
                      seed: int, kinds: tuple[str, ...] = ("raw", "zmtp", "push", "dealer",
                                                           "forged"),
                      max_frame: int = 1 << 18, *, seconds: float, at_least: int = 0,
                      limit: float | None = None, pause: float = 0.002,
                      attacker: Any = None) -> Fuzzed:
    """A :class:`Fuzzer` in a process of its own (see the module docstring): it sends for
    ``seconds`` (pausing ``pause`` between payloads), and on until ``at_least`` payloads
    were sent, but not beyond ``limit`` seconds in all: a fuzzer slowed by a busy
    machine still sends its share. An attacker that libzmq aborts (SIGABRT) is replaced
    by one with the next seed, which goes on until the same deadlines; any other end of
    an attacker (an exception: its traceback is on stderr), more than MAX_ABORTS aborts,
    or an attacker that outlives its deadline by 30 s is an AssertionError.
    ``attacker``: the process's function (default :func:`_fuzz_child`; its arguments),
    for the tests of this runner."""
    ctx = mp.get_context("forkserver")
    start = time.monotonic()
    end = start + seconds
    stop = start + max(seconds, limit if limit is not None else seconds)
    shared = ctx.Array("q", len(kinds) + 1, lock=False)
    out = Fuzzed()
    while True:
        proc = ctx.Process(target=attacker or _fuzz_child, daemon=True, args=(
            data_ports, master_port, world, seed + len(out.aborted), kinds, max_frame, end,
            stop, at_least, pause, shared))
        proc.start()
        proc.join(max(0.0, stop - time.monotonic()) + 30.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise AssertionError(f"a fuzzing process did not stop by its deadline ({kinds})")
        if proc.exitcode != -signal.SIGABRT:
            break
        out.aborted.append(proc.exitcode)
        if len(out.aborted) > MAX_ABORTS:
            break
    out.sent = Counter({k: shared[i] for i, k in enumerate(kinds) if shared[i]})
    out.bytes = shared[len(kinds)]
    if proc.exitcode not in (0, -signal.SIGABRT) or len(out.aborted) > MAX_ABORTS:
        raise AssertionError(
            f"a fuzzing process ended with exit code {proc.exitcode} after "
            f"{len(out.aborted)} libzmq abort(s) of attackers before it (its traceback, if "
            f"any, is on stderr); sent {dict(out.sent)}")
    return out
