#!/usr/bin/env python3
"""Simulated hosts on this one machine: network namespaces, one bridge, tbf-shaped links.

Tests and benchmarks of multi-host behaviour (hierarchical collectives, training over a
network) need several hosts with a real, rate-limited network between them. This module
builds them out of kernel objects on one machine, as root::

    with SimulatedHosts(hosts=2, rate="5gbit") as net:
        net.addr(1)                                   # "10.123.X.2", host 1's address
        p = net.popen(0, ["python", "-c", "..."])     # a process inside host 0
        result = net.run_job([sys.executable, "train.py"], placement=[0, 0, 1, 1])
        result.check()                                # raises, with every rank's output

Topology. Host ``i`` is the network namespace ``swarmfd-<tag>-h<i>`` with ``lo`` up and
one interface, ``eth0``, at ``10.123.X.(i+1)/24``. ``eth0`` is one end of a veth pair; the
other end (``swarmfd<tag>-<i>`` in the root namespace) is a port of the bridge
``swarmfd<tag>br``. The bridge has no address and adds no route: the root namespace
cannot reach the hosts, nothing on the machine can clash with the subnet (it is still
chosen to overlap no route of the root namespace), and two harnesses never see each
other. ``<tag>`` is this process's pid in base 36 plus one character per instance, so
two test runs (or two instances in one run) never collide.

Bridged frames pass iptables here (br_netfilter, ``bridge-nf-call-iptables=1``) and
Docker sets the FORWARD policy to DROP, so the harness inserts
``-I FORWARD 1 -i BR -o BR -m comment --comment swarmfd-netsim:<tag> -j ACCEPT``
and deletes it at teardown.

Shaping. Each host's link is limited in both directions with ``tbf``: on the egress of
``eth0`` (the host's upload) and on the egress of the bridge-side veth (its download).
This kernel has tbf and htb but not netem, so there is no delay emulation: latency is
the machine's own (a 1-byte TCP ping-pong: 28-47 us round trip across the bridge, 20 us
inside one host, load 8.6). ``rate=None`` leaves links unshaped. Hosts keep the
machine's TCP congestion control (bbr here; a non-initial namespace may only choose
the allowed ones, reno and bbr).
:data:`DEFAULT_BURST` and :data:`DEFAULT_LATENCY_MS` carry the measurement behind them.

Ranks. ``popen``/``run`` start any command with ``ip netns exec``; ``start_job`` and
``run_job`` start a swarmfd job: N ranks placed on hosts by ``placement`` (the host
index of each rank: ``[0, 0, 1, 1]`` host by host, ``[0, 1, 0, 1]`` spread, see
:func:`make_placement`), with ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR`` (the address of
rank 0's host), ``MASTER_PORT`` (swarmfd's rendezvous then listens on MASTER_PORT + 1),
``SWARMFD_NODE`` (the simulated host's name, so ranks
group by simulated host; all hosts see the one /dev/shm, but swarmfd's shared-memory
host key includes the network namespace, so only ranks of one simulated host can share
memory) and ``SWARMFD_SECRET_FILE`` (a fresh job secret in a 0600 file
inside a 0700 directory, as ``swarmfd run`` does). Every rank runs in its own session;
its stdout and stderr are kept (in files, so no pipe can fill up and block a rank) and
returned. A job that outlives its timeout gets SIGABRT (ranks run with
``PYTHONFAULTHANDLER=1``, so a hung Python rank prints every thread's stack to its
stderr), then SIGKILL to its whole process group; every child is reaped.

Teardown, always. Objects are removed when the ``with`` block ends, at interpreter exit
(atexit), on SIGTERM/SIGINT/SIGHUP (handlers chained to the previous ones) and, if this
process is SIGKILLed, by a small guardian process that notices its pipe closing. At
start the harness removes what a crashed harness left behind (any tag whose pid no
longer exists). Removal kills the processes still inside the namespaces, deletes the
iptables rule, the veths (their qdiscs go with them), the bridge and the namespaces.

CLI (for manual use)::

    python benchmarks/netsim.py up --hosts 2 --rate 5gbit   # persistent, tag "0cli"
    python benchmarks/netsim.py status
    python benchmarks/netsim.py measure --rate none --rate 5gbit --rate 200mbit
    python benchmarks/netsim.py down                        # "0cli" and stale leftovers
    python benchmarks/netsim.py down --all                  # everything of this harness

Only the standard library is imported (the guardian runs this file with ``python -I -S``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any

__all__ = [
    "DEFAULT_BURST",
    "DEFAULT_LATENCY_MS",
    "Job",
    "JobFailed",
    "JobResult",
    "NetsimError",
    "NetsimUnavailable",
    "RankResult",
    "SimulatedHosts",
    "check_requirements",
    "discover",
    "format_rate",
    "make_placement",
    "parse_rate",
    "remove_stale",
]

#: Token bucket size of every shaped link, bytes. Measured here (kernel 6.18, 2 cores,
#: MTU 1500, iperf3 -t 3 and a Python stream): at 5gbit, bursts of 96 KiB, 128 KiB and
#: 256 KiB all gave 4.55-4.75 Gbit/s one way, 4.4-4.6 Gbit/s each way both ways at once
#: (the TCP payload ceiling is 4.78: 1448 of every 1514 bytes tbf counts); 256 KiB gave
#: 23 retransmits both ways, 96 KiB none; 64 KiB fell to 2.2 Gbit/s (a bucket smaller
#: than a 64 KiB GSO packet makes tbf segment every packet). The bucket also lets the
#: first ``burst`` bytes after an idle spell through unshaped, which flatters short
#: transfers (about 9% of a 1 MiB message), so it is kept as small as speed allows.
DEFAULT_BURST = 96 * 1024
#: tbf queue limit, as the time the queue may hold at the rate (limit = rate * latency +
#: burst). 1 ms and 4 ms measured the same at 5gbit; 2 ms was the earlier harness's.
DEFAULT_LATENCY_MS = 2.0
#: Subnets are 10.123.X.0/24 (X from the tag), skipping any the root namespace routes.
SUBNET_PREFIX = "10.123"
#: At most this many hosts: the host index is one base-36 character of the veth name.
MAX_HOSTS = 36
#: Seconds any ip/tc/iptables command may take.
CMD_TIMEOUT = 20.0
#: Default seconds a job may run before it is killed.
DEFAULT_JOB_TIMEOUT = 120.0
#: Seconds between SIGABRT (stack dump) and SIGKILL for a job that timed out.
ABORT_GRACE = 1.0
#: MASTER_PORT of the first job of an instance; its ranks' rendezvous derives
#: MASTER_PORT + 1 (SWARMFD_PORT unset), so each job takes the next pair of ports (the
#: namespaces are private, so nothing else holds these ports).
FIRST_MASTER_PORT = 29500
#: Variables a job sets for every rank (``env`` may not set them).
JOB_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SWARMFD_NODE",
           "SWARMFD_SECRET_FILE")
#: Variables removed from the inherited environment of a job's ranks (a harness that
#: itself runs under ``swarmfd run`` must not hand its own values down).
SCRUBBED_ENV = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SWARMFD_RESTART_COUNT", "SWARMFD_PORT")

_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_TAG = r"[0-9a-z]{2,6}"
_NS_RE = re.compile(rf"^swarmfd-({_TAG})-h(\d+)$")
_BRIDGE_RE = re.compile(rf"^swarmfd({_TAG})br$")
_VETH_RE = re.compile(rf"^swarmfd({_TAG})-[0-9a-z]$")
_COMMENT_PREFIX = "swarmfd-netsim:"
_COMMENT_RE = re.compile(rf"{_COMMENT_PREFIX}({_TAG})(?:[\s\"]|$)")
_NAME_RE = re.compile(r"^[0-9a-z]{1,5}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class NetsimError(RuntimeError):
    """A harness operation failed (the message names the command and its output)."""


class NetsimUnavailable(NetsimError):
    """This machine or user cannot build simulated hosts (the message says what is missing)."""


class JobFailed(NetsimError):
    """A job had a rank that failed or timed out; ``result`` has every rank's output."""

    def __init__(self, result: JobResult) -> None:
        self.result = result
        super().__init__(result.describe())


# --- small pure helpers -----------------------------------------------------------------


def parse_rate(rate: str | int | None) -> int | None:
    """A link rate in bits per second: ``"5gbit"``, ``"200mbit"``, ``2_000_000_000``, or
    ``None``/``"none"``/``"unshaped"`` for no shaping. Units are tc's (SI: 1gbit = 1e9)."""
    if rate is None:
        return None
    if isinstance(rate, bool):
        raise TypeError(f"rate must be a string like '5gbit', bits per second, or None; "
                        f"got {rate!r}")
    if isinstance(rate, int):
        bits = rate
    elif isinstance(rate, str):
        if rate.strip().lower() in ("none", "unshaped", "off", ""):
            return None
        match = _RATE_RE.match(rate)
        if match is None:
            raise ValueError(f"bad rate {rate!r}: expected a number with a unit bit, kbit, "
                             "mbit, gbit or tbit (e.g. 5gbit, 200mbit), or none")
        bits = round(float(match.group(1)) * _RATE_UNITS[(match.group(2) or "bit").lower()])
    else:
        raise TypeError(f"rate must be a string like '5gbit', bits per second, or None; "
                        f"got {rate!r}")
    if bits < 8000:
        raise ValueError(f"bad rate {rate!r}: expected at least 8kbit")
    return bits


def format_rate(bits: int | None) -> str:
    """``5000000000`` -> ``"5gbit"``; ``None`` -> ``"unshaped"``."""
    if bits is None:
        return "unshaped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _RATE_UNITS[unit]
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def make_placement(kind: str, hosts: int, per_host: int) -> list[int]:
    """The host index of each rank for ``hosts`` hosts of ``per_host`` ranks each.

    ``"host"`` (host by host: each host's ranks are consecutive, as torchrun and MPI's
    default mapping by slot number them): ``[0, 0, 1, 1]``; ``"spread"`` (round robin, as
    Swarm's default placement spreads a service's tasks over nodes): ``[0, 1, 0, 1]``.
    """
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
    if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1:
        raise ValueError(f"per_host must be a positive integer, got {per_host!r}")
    if kind == "host":
        return [h for h in range(hosts) for _ in range(per_host)]
    if kind == "spread":
        return [h for _ in range(per_host) for h in range(hosts)]
    raise ValueError(f"unknown placement {kind!r}: expected 'host' (host by host) or 'spread'")


def _b36(n: int) -> str:
    digits = ""
    while True:
        n, d = divmod(n, 36)
        digits = _B36[d] + digits
        if n == 0:
            return digits


def _is_manual(tag: str) -> bool:
    """Tags of CLI ``up`` start with 0 (a pid in base 36 never does): never stale."""
    return tag.startswith("0")


def _tag_pid(tag: str) -> int | None:
    if _is_manual(tag):
        return None
    try:
        return int(tag[:-1], 36)
    except ValueError:
        return None


def ns_name(tag: str, host: int) -> str:
    """The network namespace (and SWARMFD_NODE) of host ``host`` of instance ``tag``."""
    return f"swarmfd-{tag}-h{host}"


def bridge_name(tag: str) -> str:
    """The bridge of instance ``tag`` (at most 15 characters, as interface names must be)."""
    return f"swarmfd{tag}br"


def veth_name(tag: str, host: int) -> str:
    """The root-namespace end of host ``host``'s veth pair."""
    return f"swarmfd{tag}-{_B36[host]}"


# --- running commands -------------------------------------------------------------------


def _cmd(argv: Sequence[str], *, check: bool = True, timeout: float = CMD_TIMEOUT,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run an administrative command (ip, tc, iptables) with a timeout; raise on failure."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise NetsimError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s") from exc
    except FileNotFoundError as exc:
        raise NetsimUnavailable(f"`{argv[0]}` is not installed (needed for `{shlex.join(argv)}`)"
                                ) from exc
    if check and proc.returncode != 0:
        raise NetsimError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _iptables() -> str | None:
    return shutil.which("iptables")


def _bridge_nf_call_iptables() -> bool:
    try:
        with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
            return f.read().strip() == "1"
    except OSError:
        return False  # br_netfilter not loaded: bridged frames skip iptables


def check_requirements() -> None:
    """Raise :class:`NetsimUnavailable` naming what is missing: root, ``ip`` with netns
    support, ``tc``, bridge and veth support, and ``iptables`` when bridged frames pass
    iptables (br_netfilter loaded)."""
    missing = []
    if os.geteuid() != 0:
        missing.append(f"root (this process runs as uid {os.geteuid()}; network namespaces, "
                       "bridges and qdiscs need CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (Debian package {package})")
    if _bridge_nf_call_iptables() and _iptables() is None:
        missing.append("`iptables` (bridged frames pass iptables here: "
                       "net.bridge.bridge-nf-call-iptables=1; Debian package iptables)")
    if missing:
        raise NetsimUnavailable("simulated hosts need " + "; ".join(missing))
    proc = _cmd(["ip", "netns", "list"], check=False)
    if proc.returncode != 0:
        raise NetsimUnavailable(f"`ip netns` does not work here: {proc.stderr.strip()}")


# --- finding and removing the harness's objects -----------------------------------------


@dataclass
class Found:
    """The objects of one instance that exist on the machine right now."""

    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    rules: list[list[str]] = field(default_factory=list)  # iptables -S lines, split

    def empty(self) -> bool:
        return not (self.netns or self.links or self.rules)

    def describe(self) -> str:
        parts = []
        if self.netns:
            parts.append("netns " + ", ".join(self.netns))
        if self.links:
            parts.append("links " + ", ".join(self.links))
        if self.rules:
            parts.append("iptables rules: " + "; ".join(shlex.join(r) for r in self.rules))
        return "; ".join(parts) or "nothing"


def discover() -> dict[str, Found]:
    """Every object of this harness on the machine, by instance tag (live or not)."""
    found: dict[str, Found] = {}
    out = _cmd(["ip", "netns", "list"]).stdout
    for line in out.splitlines():
        name = line.split(" ", 1)[0].strip()
        m = _NS_RE.match(name)
        if m:
            found.setdefault(m.group(1), Found()).netns.append(name)
    out = _cmd(["ip", "-o", "link", "show"]).stdout
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@", 1)[0]
        m = _BRIDGE_RE.match(name) or _VETH_RE.match(name)
        if m:
            found.setdefault(m.group(1), Found()).links.append(name)
    if _iptables() is not None:
        out = _cmd(["iptables", "-w", "10", "-S", "FORWARD"]).stdout
        for line in out.splitlines():
            m = _COMMENT_RE.search(line)
            if m and line.startswith("-A "):
                found.setdefault(m.group(1), Found()).rules.append(shlex.split(line))
    for f in found.values():  # veths before their bridge
        f.links.sort(key=lambda n: n.endswith("br"))
    return found


def _netns_pids(ns: str) -> list[int]:
    proc = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _kill_pids(pids: Iterable[int], wait: float = 5.0) -> None:
    """SIGKILL processes the harness started inside its namespaces; wait until they are gone
    (a zombie holds no namespace, so gone from ``ip netns pids`` is enough)."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[-1].split()[0]
            except (OSError, IndexError):
                break
            if state in ("Z", "X"):
                break
            time.sleep(0.01)


def remove_tag(tag: str) -> list[str]:
    """Remove every object of instance ``tag``: its namespaces' processes, its iptables
    rule, its veths (and their qdiscs), its bridge and its namespaces.

    Returns what could not be removed (empty: nothing is left). Objects that vanish
    meanwhile (another process removing the same leftovers) are not errors.
    """
    found = discover().get(tag)
    if found is None:
        return []
    for ns in found.netns:
        _kill_pids(_netns_pids(ns))
    for rule in found.rules:
        _cmd(["iptables", "-w", "10", "-D", *rule[1:]], check=False)
    for link in found.links:
        _cmd(["ip", "link", "del", link], check=False)
    for ns in found.netns:
        _cmd(["ip", "netns", "del", ns], check=False)
    left = discover().get(tag)
    return [] if left is None or left.empty() else [f"{tag}: {left.describe()}"]


def _is_stale(tag: str) -> bool:
    pid = _tag_pid(tag)
    if pid is None:
        return False  # manual (CLI up) instances stay until `down`
    if pid == os.getpid():
        with _LOCK:
            return tag not in _ACTIVE
    return not os.path.exists(f"/proc/{pid}")


def remove_stale() -> list[str]:
    """Remove what crashed harnesses left behind (tags whose process is gone).

    Returns the tags removed. Raises :class:`NetsimError` if something could not be.
    """
    removed, errors = [], []
    for tag in sorted(discover()):
        if _is_stale(tag):
            errors += remove_tag(tag)
            removed.append(tag)
    if errors:
        raise NetsimError("could not remove leftovers of a previous run: " + "; ".join(errors))
    return removed


# --- process plumbing -------------------------------------------------------------------


def _make_preexec() -> Any:
    """A ``preexec_fn``: SIGKILL the child when this process dies, and no core files (a
    timed-out rank gets SIGABRT for its stack dump)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    import resource

    parent = os.getpid()

    def preexec() -> None:  # between fork and exec: keep it tiny
        if prctl is not None:
            prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _exited(proc: subprocess.Popen[Any]) -> bool:
    """Whether child ``proc`` has exited, without reaping it (its pid, and so its process
    group id, stays taken until we reap it, so killing the group cannot hit a stranger)."""
    if proc.returncode is not None:
        return True  # reaped already
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _wait_exit(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``proc`` to exit, without reaping it."""
    deadline = time.monotonic() + timeout
    while not _exited(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _killpg(proc: subprocess.Popen[Any], sig: int) -> None:
    """Signal ``proc``'s process group (it runs in its own session), unless ``proc`` was
    reaped: then its pid may already belong to someone else."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _reap(proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """Kill what is left of ``proc``'s process group and reap ``proc``; its exit code.

    Safe against pid reuse: until ``proc`` is reaped its pid (the group's id) stays taken.
    """
    _killpg(proc, signal.SIGKILL)  # the leader if it runs, and any stragglers
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # pragma: no cover - SIGKILL is not ignorable
        raise NetsimError(f"process {proc.pid} ({shlex.join(proc.args)}) survived SIGKILL "
                          f"for {timeout:g} s") from exc


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}"


# --- jobs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankResult:
    """How one rank of a job ended, and everything it wrote."""

    rank: int
    host: int
    node: str
    returncode: int
    stdout: str
    stderr: str
    killed: bool  # the harness killed it (job timeout)


@dataclass(frozen=True)
class JobResult:
    """Every rank's result, in rank order."""

    ranks: list[RankResult]
    elapsed: float
    timed_out: bool
    timeout: float | None

    @property
    def ok(self) -> bool:
        """True when every rank exited with code 0 before the timeout."""
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    @property
    def returncodes(self) -> list[int]:
        return [r.returncode for r in self.ranks]

    def stdout(self, rank: int) -> str:
        return self.ranks[rank].stdout

    def describe(self, tail: int = 40) -> str:
        """A report naming each rank's host and exit, with the end of the output of every
        rank that failed (of every rank when the job timed out)."""
        head = (f"job of {len(self.ranks)} ranks "
                + (f"timed out after {self.timeout:g} s" if self.timed_out
                   else f"finished in {self.elapsed:.2f} s"))
        lines = [head]
        for r in self.ranks:
            status = _describe_exit(r.returncode) + (" (killed at the timeout)" if r.killed else "")
            lines.append(f"  rank {r.rank} on host {r.host} ({r.node}): {status}")
        for r in self.ranks:
            if r.returncode == 0 and not self.timed_out:
                continue
            for label, text in (("stderr", r.stderr), ("stdout", r.stdout)):
                body = text.rstrip().splitlines()
                if body:
                    cut = body[-tail:]
                    more = f" (last {tail} of {len(body)} lines)" if len(body) > tail else ""
                    lines.append(f"--- rank {r.rank} {label}{more} ---")
                    lines.extend(cut)
        return "\n".join(lines)

    def check(self) -> JobResult:
        """Raise :class:`JobFailed` unless :attr:`ok`; return self."""
        if not self.ok:
            raise JobFailed(self)
        return self


class Job:
    """A running swarmfd job on simulated hosts (see :meth:`SimulatedHosts.start_job`).

    Use :meth:`wait` (always; or the ``with`` statement, which kills and reaps on exit).
    """

    def __init__(self, net: SimulatedHosts, argv: Sequence[str], placement: Sequence[int],
                 env: Mapping[str, str] | None, master_port: int | None,
                 cwd: str | None) -> None:
        placement = list(placement)
        if not placement:
            raise ValueError("placement is empty: expected the host index of each rank")
        for h in placement:
            net._check_host(h)
        if env is not None:
            bad = sorted(set(env) & set(JOB_ENV))
            if bad:
                raise ValueError(f"env may not set {', '.join(bad)}: the job sets them for "
                                 "every rank (use placement= and master_port=)")
        self.net = net
        self.placement = placement
        self.world_size = len(placement)
        self.master_port = master_port if master_port is not None else net._next_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._done: dict[int, int] = {}
        self._killed: set[int] = set()
        self._result: JobResult | None = None
        self._start = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix="swarmfd-netsim-job-")  # mode 0700
        self.secret_file = os.path.join(self.dir, "secret")
        try:
            fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            for rank, host in enumerate(placement):
                rank_env = dict(env or {})
                rank_env.update(
                    WORLD_SIZE=str(self.world_size), RANK=str(rank),
                    MASTER_ADDR=net.addr(placement[0]), MASTER_PORT=str(self.master_port),
                    SWARMFD_NODE=net.name(host), SWARMFD_SECRET_FILE=self.secret_file,
                )
                with open(self._log(rank, "out"), "wb") as out, \
                        open(self._log(rank, "err"), "wb") as err:
                    self.procs.append(net.popen(host, argv, env=rank_env, stdout=out,
                                                stderr=err, cwd=cwd, _job=True))
        except BaseException:
            self.kill()
            self.wait(timeout=10)
            raise

    def _log(self, rank: int, kind: str) -> str:
        return os.path.join(self.dir, f"rank{rank}.{kind}")

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._result is None:
            self.kill()
            self.wait(timeout=10)

    def poll(self) -> list[int | None]:
        """Each rank's return code, or None while it runs (reaps ranks that ended)."""
        for rank, proc in enumerate(self.procs):
            if rank not in self._done and _exited(proc):
                self._done[rank] = _reap(proc)
                self.net._forget(proc)
        return [self._done.get(r) for r in range(len(self.procs))]

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to rank ``rank``'s process group (a lost rank, for failure tests)."""
        if rank not in self._done:
            _killpg(self.procs[rank], sig)

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every rank on simulated host ``host`` (a lost host)."""
        for rank, h in enumerate(self.placement):
            if h == host:
                self.kill_rank(rank, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every rank still running."""
        for rank in range(len(self.procs)):
            if rank not in self._done:
                self._killed.add(rank)
                self.kill_rank(rank, sig)

    def wait(self, timeout: float | None = DEFAULT_JOB_TIMEOUT) -> JobResult:
        """Wait for every rank (at most ``timeout`` seconds from the job's start, then
        SIGABRT for a stack dump, then SIGKILL), reap them all, remove the job's directory
        and return every rank's exit code and output."""
        if self._result is not None:
            return self._result
        deadline = None if timeout is None else self._start + timeout
        timed_out = False
        try:
            while None in self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.02)
            if timed_out:
                alive = [r for r, c in enumerate(self.poll()) if c is None]
                self._killed.update(alive)
                for r in alive:  # faulthandler prints the stacks, then the rank dies
                    if self.procs[r].returncode is None:  # not reaped: the pid is its own
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self.procs[r].pid, signal.SIGABRT)
                end = time.monotonic() + ABORT_GRACE
                while time.monotonic() < end and None in self.poll():
                    time.sleep(0.02)
        finally:
            for rank, proc in enumerate(self.procs):
                if rank not in self._done:
                    self._killed.add(rank)
                    self._done[rank] = _reap(proc)
                    self.net._forget(proc)
            ranks = []
            for rank in range(len(self.procs)):
                texts = []
                for kind in ("out", "err"):
                    try:
                        with open(self._log(rank, kind), "rb") as f:
                            texts.append(f.read().decode("utf-8", "replace"))
                    except OSError:
                        texts.append("")
                host = self.placement[rank]
                ranks.append(RankResult(rank, host, self.net.name(host), self._done[rank],
                                        texts[0], texts[1], rank in self._killed))
            shutil.rmtree(self.dir, ignore_errors=True)
            self._result = JobResult(ranks, time.monotonic() - self._start, timed_out,
                                     timeout)
        return self._result


# --- the simulated hosts ----------------------------------------------------------------

_LOCK = threading.RLock()
_ACTIVE: dict[str, SimulatedHosts] = {}
_COUNTER = [0]
_PREV_HANDLERS: dict[int, Any] = {}
_HANDLED = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))


def _new_tag() -> str:
    pid36 = _b36(os.getpid())
    with _LOCK:
        for _ in range(36):
            tag = pid36 + _B36[_COUNTER[0] % 36]
            _COUNTER[0] += 1
            if tag not in _ACTIVE:
                return tag
    raise NetsimError("36 simulated networks are already up in this process")


def _teardown_all() -> None:
    with _LOCK:
        nets = list(_ACTIVE.values())
    for net in nets:
        if net._owner == os.getpid():  # never a fork's parent's network
            try:
                net.close()
            except Exception as exc:  # at exit or in a signal handler: say it, go on
                print(f"netsim: teardown of {net.tag} failed: {exc}", file=sys.stderr)


atexit.register(_teardown_all)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _teardown_all()
    prev = _PREV_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set there; atexit and the guardian remain
    for sig in _HANDLED:
        current = signal.getsignal(sig)
        if current is not _on_signal:
            _PREV_HANDLERS[sig] = current
            signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_PREV_HANDLERS.items()):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        del _PREV_HANDLERS[sig]


def _route_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    out = _cmd(["ip", "-4", "route", "show", "table", "all"]).stdout
    kinds = {"local", "broadcast", "unicast", "multicast", "anycast", "blackhole",
             "unreachable", "prohibit", "throw", "nat"}
    for line in out.splitlines():
        words = line.split()
        if not words:
            continue
        dest = words[1] if words[0] in kinds and len(words) > 1 else words[0]
        if dest == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


class SimulatedHosts:
    """``hosts`` simulated hosts on one bridge, links shaped at ``rate`` both ways.

    Use as a context manager (or :meth:`up` then :meth:`close`). ``rate``: ``"5gbit"``,
    ``"200mbit"``, bits per second, or None (unshaped); ``burst`` (bytes) and
    ``latency_ms`` are tbf's (see :data:`DEFAULT_BURST`); ``subnet`` an IPv4 /24 or
    larger (default 10.123.X.0/24, see the module docstring). ``name`` makes a persistent
    instance with tag ``"0" + name`` that only :meth:`close` or the CLI's ``down``
    removes (no guardian, no atexit): the CLI's ``up``. ``guardian=False`` leaves out the
    guardian process (tests of the signal handlers use it).
    """

    def __init__(self, hosts: int = 2, rate: str | int | None = None, *,
                 burst: int = DEFAULT_BURST, latency_ms: float = DEFAULT_LATENCY_MS,
                 subnet: str | None = None, name: str | None = None,
                 guardian: bool = True) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an integer 1..{MAX_HOSTS}, got {hosts!r}")
        self.hosts = hosts
        self.rate = parse_rate(rate)
        self.burst = self._check_burst(burst)
        self.latency_ms = self._check_latency(latency_ms)
        if name is not None and not _NAME_RE.match(name):
            raise ValueError(f"bad name {name!r}: expected 1-5 characters a-z or 0-9")
        self.persistent = name is not None
        self.tag = "0" + name if name is not None else _new_tag()
        self._subnet_arg = None if subnet is None else ipaddress.IPv4Network(subnet)
        if self._subnet_arg is not None and self._subnet_arg.num_addresses < hosts + 2:
            raise ValueError(f"subnet {subnet} is too small for {hosts} hosts")
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge = bridge_name(self.tag)
        self._owner = os.getpid()
        self._procs: set[subprocess.Popen[Any]] = set()
        self._port = FIRST_MASTER_PORT
        self._guardian: subprocess.Popen[bytes] | None = None
        self._want_guardian = guardian
        self._is_up = False

    @staticmethod
    def _check_burst(burst: int) -> int:
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1600:
            raise ValueError(f"burst must be an integer number of bytes >= 1600 (one frame), "
                             f"got {burst!r}")
        return burst

    @staticmethod
    def _check_latency(latency_ms: float) -> float:
        if isinstance(latency_ms, bool) or not isinstance(latency_ms, (int, float)) \
                or not 0 < latency_ms <= 1000:
            raise ValueError(f"latency_ms must be a number of milliseconds in (0, 1000], "
                             f"got {latency_ms!r}")
        return float(latency_ms)

    # -- names ---------------------------------------------------------------------------

    def _check_host(self, host: int) -> None:
        if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < self.hosts:
            raise ValueError(f"host must be an integer 0..{self.hosts - 1}, got {host!r}")

    def name(self, host: int) -> str:
        """Host ``host``'s network namespace name, also its SWARMFD_NODE in jobs."""
        self._check_host(host)
        return ns_name(self.tag, host)

    def addr(self, host: int) -> str:
        """Host ``host``'s IPv4 address (on its ``eth0``)."""
        self._check_host(host)
        if self.subnet is None:
            raise NetsimError("the simulated hosts are not up: use `with SimulatedHosts(...)`")
        return str(self.subnet.network_address + 1 + host)

    def veth(self, host: int) -> str:
        """The root-namespace end of host ``host``'s link (its download qdisc lives here)."""
        self._check_host(host)
        return veth_name(self.tag, host)

    # -- life cycle ----------------------------------------------------------------------

    def __enter__(self) -> SimulatedHosts:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> SimulatedHosts:
        """Create the namespaces, links, bridge, iptables rule and qdiscs."""
        if self._is_up:
            return self
        check_requirements()
        if self.persistent and not discover().get(self.tag, Found()).empty():
            raise NetsimError(f"simulated hosts {self.tag!r} are already up: "
                              f"`netsim.py down --name {self.tag[1:]}` first")
        if not self.persistent:
            with _LOCK:
                _ACTIVE[self.tag] = self
                _install_handlers()
            if self._want_guardian:
                self._start_guardian()
        self._is_up = True
        try:
            try:
                remove_stale()
            except NetsimError as exc:  # another harness may be removing them right now
                print(f"netsim: {exc}", file=sys.stderr)
            self.subnet = self._subnet_arg or self._pick_subnet()
            prefix = self.subnet.prefixlen
            _cmd(["ip", "link", "add", self.bridge, "type", "bridge"])
            _cmd(["ip", "link", "set", self.bridge, "up"])
            for h in range(self.hosts):
                ns, veth = self.name(h), self.veth(h)
                _cmd(["ip", "netns", "add", ns])
                _cmd(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                      "netns", ns])
                _cmd(["ip", "link", "set", veth, "master", self.bridge, "up"])
                _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
                _cmd(["ip", "-n", ns, "addr", "add", f"{self.addr(h)}/{prefix}", "dev", "eth0"])
                _cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if _iptables() is not None:
                _cmd(["iptables", "-w", "10", "-I", "FORWARD", "1", "-i", self.bridge, "-o",
                      self.bridge, "-m", "comment", "--comment", _COMMENT_PREFIX + self.tag,
                      "-j", "ACCEPT"])
            self.set_rate(self.rate)
        except BaseException:
            self.close()
            raise
        return self

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _route_networks()
        start = int(self.tag, 36) % 254
        for k in range(254):
            net = ipaddress.IPv4Network(f"{SUBNET_PREFIX}.{(start + k) % 254 + 1}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise NetsimError(f"every {SUBNET_PREFIX}.X.0/24 overlaps a route of this machine: "
                          "give subnet=")

    def _start_guardian(self) -> None:
        """A process that removes this instance if this process dies without doing it."""
        try:
            self._guardian = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "_guard", self.tag],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:
            self._guardian = None  # atexit and the signal handlers remain

    def _stop_guardian(self) -> None:
        g, self._guardian = self._guardian, None
        if g is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert g.stdin is not None
            g.stdin.write(b"done\n")
            g.stdin.close()
        try:
            g.wait(timeout=10)
        except subprocess.TimeoutExpired:
            g.kill()
            g.wait(timeout=10)

    def close(self) -> None:
        """Kill every process started here, remove every object. Idempotent.

        Raises :class:`NetsimError` naming whatever could not be removed.
        """
        if self._owner != os.getpid() or not self._is_up:
            return
        with _LOCK:
            procs = list(self._procs)
            self._procs.clear()
        for proc in procs:
            with contextlib.suppress(NetsimError):
                _reap(proc)
        errors = remove_tag(self.tag)
        if errors:  # one retry: a rule or link busy for a moment
            time.sleep(0.2)
            errors = remove_tag(self.tag)
        self._is_up = False
        self._stop_guardian()
        with _LOCK:
            _ACTIVE.pop(self.tag, None)
            if not _ACTIVE:
                _restore_handlers()
        if errors:
            raise NetsimError("teardown left objects behind: " + "; ".join(errors))

    down = close

    # -- shaping and links ---------------------------------------------------------------

    def set_rate(self, rate: str | int | None, *, host: int | None = None,
                 burst: int | None = None, latency_ms: float | None = None) -> None:
        """Shape both directions of every host's link (or only ``host``'s) at ``rate``;
        None removes the shaping."""
        bits = parse_rate(rate)
        burst = self.burst if burst is None else self._check_burst(burst)
        latency = self.latency_ms if latency_ms is None else self._check_latency(latency_ms)
        targets = range(self.hosts) if host is None else [host]
        for h in targets:
            self._check_host(h)
            for prefix, dev in ((["tc"], self.veth(h)), (["tc", "-n", self.name(h)], "eth0")):
                if bits is None:
                    proc = _cmd([*prefix, "qdisc", "del", "dev", dev, "root"], check=False)
                    if proc.returncode != 0 and "handle of zero" not in proc.stderr \
                            and "No such file" not in proc.stderr:
                        raise NetsimError(f"tc qdisc del on {dev} failed: {proc.stderr.strip()}")
                else:
                    _cmd([*prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                          f"{bits}bit", "burst", str(burst), "latency", f"{latency:g}ms"])
        if host is None:
            self.rate, self.burst, self.latency_ms = bits, burst, latency

    def set_link(self, host: int, up: bool) -> None:
        """Cut host ``host`` off the network (``up=False``: frames both ways are dropped,
        as when a cable is pulled) or reconnect it."""
        _cmd(["ip", "link", "set", self.veth(host), "up" if up else "down"])

    def qdiscs(self, host: int) -> dict[str, str]:
        """``tc -s qdisc show`` of host ``host``'s upload (eth0) and download (veth)."""
        return {
            "upload": _cmd(["tc", "-n", self.name(host), "-s", "qdisc", "show", "dev",
                            "eth0"]).stdout.strip(),
            "download": _cmd(["tc", "-s", "qdisc", "show", "dev", self.veth(host)]).stdout.strip(),
        }

    def status(self) -> dict[str, Any]:
        """What exists of this instance now, and its settings."""
        found = discover().get(self.tag, Found())
        return {"tag": self.tag, "hosts": self.hosts, "rate": format_rate(self.rate),
                "burst": self.burst, "latency_ms": self.latency_ms,
                "subnet": str(self.subnet), "netns": found.netns, "links": found.links,
                "rules": [shlex.join(r) for r in found.rules]}

    # -- processes -----------------------------------------------------------------------

    def _next_port(self) -> int:
        with _LOCK:
            port = self._port
            self._port += 2  # MASTER_PORT and the rendezvous's MASTER_PORT + 1
            return port

    def _forget(self, proc: subprocess.Popen[Any]) -> None:
        with _LOCK:
            self._procs.discard(proc)

    def popen(self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None,
              cwd: str | None = None, _job: bool = False) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``host`` (``ip netns exec``), in its own session.

        ``env`` adds to (or overrides) this process's environment; stdin is /dev/null;
        ``stdout``/``stderr`` as for :class:`subprocess.Popen`. The child gets SIGKILL if
        this thread dies (PR_SET_PDEATHSIG), and :meth:`close` kills it if it still runs;
        otherwise waiting for it is the caller's job.
        """
        self._check_host(host)
        if not self._is_up:
            raise NetsimError("the simulated hosts are not up: use `with SimulatedHosts(...)`")
        if isinstance(argv, (str, bytes)) or not argv or \
                not all(isinstance(a, str) for a in argv):
            raise TypeError(f"argv must be a non-empty list of strings, got {argv!r}")
        full_env = dict(os.environ)
        if _job:
            for key in SCRUBBED_ENV:
                full_env.pop(key, None)
            full_env.setdefault("PYTHONUNBUFFERED", "1")
            full_env.setdefault("PYTHONFAULTHANDLER", "1")
        full_env.update(env or {})
        proc = subprocess.Popen(["ip", "netns", "exec", self.name(host), *argv], env=full_env,
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd,
                                start_new_session=True, preexec_fn=_make_preexec())
        with _LOCK:
            self._procs.add(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], *, timeout: float = 60.0,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside host ``host`` to completion (killed after ``timeout``
        seconds, with :class:`NetsimError`), output captured as text."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = self.popen(host, argv, env=env, stdout=out, stderr=err, cwd=cwd)
            timed_out = not _wait_exit(proc, timeout)
            code = _reap(proc)  # and whatever it left running in its session
            self._forget(proc)
            out.seek(0)
            err.seek(0)
            result = subprocess.CompletedProcess(proc.args, code,
                                                 out.read().decode("utf-8", "replace"),
                                                 err.read().decode("utf-8", "replace"))
        if timed_out:
            raise NetsimError(f"`{shlex.join(argv)}` on host {host} did not finish within "
                              f"{timeout:g} s; stderr: {result.stderr.strip()[-2000:]}")
        if check and code != 0:
            raise NetsimError(f"`{shlex.join(argv)}` on host {host} failed "
                              f"({_describe_exit(code)}): {result.stderr.strip()[-2000:]}")
        return result

    def start_job(self, argv: Sequence[str], placement: Sequence[int], *,
                  env: Mapping[str, str] | None = None, master_port: int | None = None,
                  cwd: str | None = None) -> Job:
        """Start rank ``r`` of a swarmfd job on host ``placement[r]``; see :class:`Job`."""
        return Job(self, argv, placement, env, master_port, cwd)

    def run_job(self, argv: Sequence[str], placement: Sequence[int], *,
                env: Mapping[str, str] | None = None, timeout: float = DEFAULT_JOB_TIMEOUT,
                master_port: int | None = None, cwd: str | None = None) -> JobResult:
        """Run a swarmfd job to the end (or ``timeout``) and return every rank's result."""
        with self.start_job(argv, placement, env=env, master_port=master_port,
                            cwd=cwd) as job:
            return job.wait(timeout)

    # -- measuring -----------------------------------------------------------------------

    def stream(self, pairs: Sequence[tuple[int, int]], seconds: float = 1.0,
               timeout: float = 30.0) -> list[float]:
        """Bare Python TCP streams, all at once: for each ``(src, dst)`` one connection
        sending from host src to host dst for ``seconds``; returns each stream's goodput
        in bytes per second, measured at the receiver (first byte to EOF)."""
        servers, clients = [], []
        try:
            for src, dst in pairs:
                port = self._next_port() + 10000
                servers.append(self.popen(dst, [sys.executable, "-I", "-c", _STREAM_CODE,
                                                "server", str(port)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
                clients.append(self.popen(src, [sys.executable, "-I", "-c", _STREAM_CODE,
                                                "client", self.addr(dst), str(port),
                                                repr(float(seconds))],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            rates = []
            for server, client in zip(servers, clients, strict=True):
                out, err = server.communicate(timeout=timeout)
                _, cerr = client.communicate(timeout=timeout)
                if server.returncode != 0 or client.returncode != 0:
                    raise NetsimError(f"stream failed: server {_describe_exit(server.returncode)}"
                                      f" {err.decode(errors='replace').strip()}; client "
                                      f"{_describe_exit(client.returncode)} "
                                      f"{cerr.decode(errors='replace').strip()}")
                doc = json.loads(out)
                rates.append(doc["bytes"] / doc["seconds"])
            return rates
        except subprocess.TimeoutExpired as exc:
            raise NetsimError(f"stream did not finish within {timeout:g} s") from exc
        finally:
            for proc in servers + clients:
                _reap(proc)
                self._forget(proc)


_STREAM_CODE = r"""
import json, socket, sys, time
if sys.argv[1] == "server":
    srv = socket.create_server(("0.0.0.0", int(sys.argv[2])))
    srv.settimeout(20)
    conn, _ = srv.accept()
    conn.settimeout(20)
    buf = bytearray(1 << 20)
    n, t0 = 0, None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += k
    print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))
else:
    host, port, seconds = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    data = bytes(1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        conn.sendall(data)
    conn.close()
"""


# --- CLI --------------------------------------------------------------------------------


def _guard(tag: str) -> int:
    """The guardian: wait for the harness's pipe to close; remove ``tag`` unless told done."""
    for sig in _HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    last = b""
    for line in sys.stdin.buffer:
        last = line.strip()
    if last != b"done":
        remove_tag(tag)
    return 0


def _iperf3(net: SimulatedHosts, seconds: float, bidir: bool) -> str:
    if shutil.which("iperf3") is None:
        return "-"
    port = str(net._next_port() + 20000)
    server = net.popen(1, ["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        args = ["iperf3", "-c", net.addr(1), "-p", port, "-t", f"{seconds:g}", "-J"]
        proc = net.run(0, args + (["--bidir"] if bidir else []), timeout=seconds + 20)
        end = json.loads(proc.stdout)["end"]
        fwd = end["sum_received"]["bits_per_second"] / 8e9
        if bidir:
            back = end["sum_received_bidir_reverse"]["bits_per_second"] / 8e9
            return f"{fwd:.3f} / {back:.3f}"
        return f"{fwd:.3f}"
    except (NetsimError, ValueError, KeyError) as exc:
        return f"failed ({exc})"
    finally:
        _reap(server)
        net._forget(server)


def _measure(rates: list[str], seconds: float, burst: int, latency_ms: float) -> None:
    print(f"# bare TCP streams between 2 simulated hosts, {seconds:g} s each, GB/s "
          f"(1e9 bytes) of payload at the receiver; tbf burst {burst} B, latency "
          f"{latency_ms:g} ms")
    print("| rate | nominal GB/s | python one way | python both ways | iperf3 one way | "
          "iperf3 both ways |")
    print("|---|---|---|---|---|---|")
    with SimulatedHosts(2, None, burst=burst, latency_ms=latency_ms) as net:
        for rate in rates:
            net.set_rate(rate)
            one = net.stream([(0, 1)], seconds)[0] / 1e9
            both = [r / 1e9 for r in net.stream([(0, 1), (1, 0)], seconds)]
            nominal = "-" if net.rate is None else f"{net.rate / 8e9:.3f}"
            print(f"| {format_rate(net.rate)} | {nominal} | {one:.3f} | {both[0]:.3f} / "
                  f"{both[1]:.3f} | {_iperf3(net, seconds, False)} | "
                  f"{_iperf3(net, seconds, True)} |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netsim.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create persistent simulated hosts (remove with `down`)")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default=None, help="e.g. 5gbit, 200mbit; default unshaped")
    up.add_argument("--name", default="cli", help="1-5 characters a-z0-9 (tag 0NAME)")
    up.add_argument("--burst", type=int, default=DEFAULT_BURST)
    up.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS)
    down = sub.add_parser("down", help="remove persistent hosts and stale leftovers")
    down.add_argument("--name", default="cli")
    down.add_argument("--all", action="store_true",
                      help="remove every object of this harness, live instances included")
    st = sub.add_parser("status", help="list every instance's objects")
    st.add_argument("--json", action="store_true")
    me = sub.add_parser("measure", help="measure the throughput tbf gives")
    me.add_argument("--rate", action="append", default=None,
                    help="repeatable; 'none' = unshaped (default: none, 5gbit, 2gbit, 200mbit)")
    me.add_argument("--seconds", type=float, default=2.0)
    me.add_argument("--burst", type=int, default=DEFAULT_BURST)
    me.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS)
    guard = sub.add_parser("_guard")
    guard.add_argument("tag")
    args = parser.parse_args(argv)

    if args.command == "_guard":
        return _guard(args.tag)
    try:
        check_requirements()
        if args.command == "up":
            net = SimulatedHosts(args.hosts, args.rate, burst=args.burst,
                                 latency_ms=args.latency_ms, name=args.name).up()
            print(f"simulated hosts {net.tag}: {net.hosts} hosts, {format_rate(net.rate)}, "
                  f"bridge {net.bridge}, subnet {net.subnet}")
            for h in range(net.hosts):
                print(f"  host {h}: netns {net.name(h)}  addr {net.addr(h)}  "
                      f"link {net.veth(h)}")
            print(f"run a command: ip netns exec {net.name(0)} COMMAND; remove: "
                  f"{sys.argv[0]} down --name {args.name}")
        elif args.command == "down":
            errors = []
            for tag in sorted(discover()):
                if args.all or tag == "0" + args.name or _is_stale(tag):
                    errors += remove_tag(tag)
                    print(f"removed {tag}")
            if errors:
                print("could not remove: " + "; ".join(errors), file=sys.stderr)
                return 1
        elif args.command == "status":
            found = discover()
            if args.json:
                print(json.dumps({t: {"netns": f.netns, "links": f.links,
                                      "rules": [shlex.join(r) for r in f.rules],
                                      "state": ("manual" if _is_manual(t) else
                                                "stale" if _is_stale(t) else "live")}
                                  for t, f in found.items()}, indent=2))
            elif not found:
                print("no simulated hosts")
            for tag, f in sorted(found.items()):
                if args.json:
                    break
                state = "manual" if _is_manual(tag) else "stale" if _is_stale(tag) else \
                    f"live (pid {_tag_pid(tag)})"
                print(f"{tag} [{state}]: {f.describe()}")
        elif args.command == "measure":
            _measure(args.rate or ["none", "5gbit", "2gbit", "200mbit"], args.seconds,
                     args.burst, args.latency_ms)
    except NetsimError as exc:
        print(f"netsim.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
