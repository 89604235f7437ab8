"""Tests of the local launcher (``swarmfd run`` / :mod:`swarmfd.launch`) with real processes.

Most tests run ``python -m swarmfd run`` as a subprocess in its own session,
with ranks from ``tests/launch_scripts/worker.py`` that record their PIDs (and
a child's) in a directory, so each test can check that no process of the run
survives. Every wait has a deadline; the ``runs`` fixture kills whatever a test
leaves behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarmfd.cli import main
from swarmfd.launch import (
    LaunchConfig,
    bind_cores_from_env,
    core_sets,
    exit_code_of,
    find_free_port,
    launch,
    rank_threads,
    resolve_command,
)

from .support.harness import unavailable

if not sys.platform.startswith("linux"):  # pragma: no cover - depends on the machine
    unavailable("the launcher tests use /proc and PDEATHSIG", what="the launcher tests",
                fix="run them on Linux", module_level=True)

SCRIPTS = Path(__file__).parent / "launch_scripts"
WORKER = str(SCRIPTS / "worker.py")
LINE = re.compile(rb"^\[rank (\d+)\] (.*)$")


# --- helpers ------------------------------------------------------------------


def alive(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie nobody reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def recorded_pids(piddir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(piddir.iterdir()) if p.read_text().strip()]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def wait_recorded(piddir: Path, count: int, timeout: float = 20) -> list[int]:
    """Wait until ``count`` PID files exist and are written; return their PIDs."""
    wait_for(
        lambda: sum(1 for p in piddir.iterdir() if p.read_text().strip()) >= count,
        timeout,
        f"{count} PID files in {piddir}",
    )
    return recorded_pids(piddir)


def assert_all_gone(pids: list[int], timeout: float = 10) -> None:
    assert pids, "no PIDs were recorded: the test would prove nothing"
    try:
        wait_for(lambda: not any(alive(p) for p in pids), timeout, "the run's processes to end")
    except AssertionError:
        survivors = [p for p in pids if alive(p)]
        raise AssertionError(f"processes of the run survived: {survivors}") from None


class Runs:
    """Starts launcher subprocesses and, at teardown, kills anything still alive."""

    def __init__(self, tmp_path: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.piddir = tmp_path / "pids"
        self.piddir.mkdir()

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarmfd", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 30,
            env: dict[str, str] | None = None) -> tuple[int, bytes, bytes]:
        proc = self.start(*args, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, err = proc.communicate()
            raise AssertionError(
                f"swarmfd run {' '.join(args)} did not finish in {timeout} s\n"
                f"stdout: {out.decode(errors='replace')}\nstderr: {err.decode(errors='replace')}"
            ) from None
        return proc.returncode, out, err

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for pid in recorded_pids(self.piddir):
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Runs]:
    r = Runs(tmp_path)
    try:
        yield r
    finally:
        r.kill_all()
        for proc in r.procs:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def by_rank(out: bytes) -> dict[int, list[bytes]]:
    """Group prefixed output lines by rank; every line must carry a prefix."""
    lines: dict[int, list[bytes]] = {}
    for raw in out.splitlines():
        m = LINE.match(raw)
        assert m, f"line without a rank prefix: {raw!r}"
        lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


# --- the environment contract ---------------------------------------------------


def test_each_rank_sees_the_contract_env(runs: Runs) -> None:
    """WORLD_SIZE/RANK/LOCAL_*/MASTER_*/restart count/unbuffered, one port for all ranks."""
    code, out, err = runs.run("-n", "3", WORKER, "env")
    assert (code, err) == (0, b"")
    seen = {r: json.loads(lines[0]) for r, lines in by_rank(out).items()}
    assert sorted(seen) == [0, 1, 2]
    ports = {(env["MASTER_PORT"], env["SWARMFD_PORT"]) for env in seen.values()}
    assert len(ports) == 1
    master, own = map(int, ports.pop())
    assert 1 <= master <= 65535 and 1 <= own <= 65535 and master != own
    for rank, env in seen.items():
        assert {
            "WORLD_SIZE": "3",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "SWARMFD_RESTART_COUNT": "0",
            "PYTHONUNBUFFERED": "1",
        }.items() <= env.items()


def test_options_reach_the_ranks_env(runs: Runs) -> None:
    """--master-addr, --master-port, --timeout, --init-timeout and repeated -e KEY=VALUE
    are set for every rank."""
    code, out, _ = runs.run(
        "-n", "2", "--master-addr", "localhost", "--master-port", "23456", "--timeout", "7.5",
        "--init-timeout", "600", "-e", "FOO=bar=baz", "-e", "EMPTY=", WORKER, "env", "FOO",
        "EMPTY", "SWARMFD_INIT_TIMEOUT",
    )  # fmt: skip
    assert code == 0
    for env in (json.loads(lines[0]) for lines in by_rank(out).values()):
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("localhost", "23456")
        assert env["SWARMFD_PORT"] == "23457"  # derived as a rank would: MASTER_PORT + 1
        assert float(env["SWARMFD_TIMEOUT"]) == 7.5
        assert float(env["SWARMFD_INIT_TIMEOUT"]) == 600.0
        assert (env["FOO"], env["EMPTY"]) == ("bar=baz", "")


def test_each_rank_gets_its_share_of_the_cores_unless_threads_are_given(runs: Runs) -> None:
    """OMP_NUM_THREADS: unset, this host's usable cores divided among several ranks (at
    least 1), and left unset for a single rank (the libraries' defaults, as torchrun);
    given in the launcher's environment or with -e, passed through unchanged."""
    unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))
    cases = [
        (("-n", "1"), unset, None),
        (("-n", "2"), unset, str(max(1, cores // 2))),
        (("-n", "3"), unset, str(max(1, cores // 3))),
        (("-n", "2"), {**unset, "OMP_NUM_THREADS": "5"}, "5"),
        (("-n", "2", "-e", "OMP_NUM_THREADS=7"), unset, "7"),
        (("-n", "2", "-e", "OMP_NUM_THREADS="), unset, ""),
    ]
    for args, env, want in cases:
        code, out, err = runs.run(*args, WORKER, "env", "OMP_NUM_THREADS", env=env)
        assert (code, err) == (0, b""), (args, err)
        seen = [json.loads(lines[0])["OMP_NUM_THREADS"] for lines in by_rank(out).values()]
        assert seen == [want] * int(args[1]), (args, seen)


@pytest.mark.parametrize("nproc, cores, want", [(1, 1, 1), (2, 2, 1), (4, 2, 1), (3, 2, 1),
                                                (1, 8, 8), (2, 8, 4), (3, 8, 2), (16, 8, 1)])
def test_rank_threads_divides_the_cores_among_the_ranks(nproc: int, cores: int,
                                                        want: int) -> None:
    assert rank_threads(nproc, cores) == want


def test_rank_threads_counts_the_cores_this_process_may_use() -> None:
    assert rank_threads(1) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("nproc, cores, want", [
    (1, [0, 1], [[0, 1]]),
    (2, [0, 1], [[0], [1]]),
    (2, [2, 3, 5, 7], [[2, 3], [5, 7]]),
    (3, [0, 1, 2, 3, 4, 5, 6, 7], [[0, 1], [2, 3], [4, 5]]),  # 6, 7 unused: 2 threads each
    (4, [0, 1], [[0], [1], [0], [1]]),  # more ranks than cores: in turn
    (3, [4, 6], [[4], [6], [4]]),
])
def test_core_sets_give_each_rank_its_own_run_of_cores(nproc: int, cores: list[int],
                                                        want: list[list[int]]) -> None:
    got = core_sets(nproc, cores)
    assert got == want
    assert all(len(c) == rank_threads(nproc, len(cores)) for c in got)


def test_core_sets_refuse_no_ranks_or_no_cores() -> None:
    for nproc, cores in ((0, [0]), (2, [])):
        with pytest.raises(ValueError, match="core_sets needs ranks and cores"):
            core_sets(nproc, cores)


def test_bind_cores_from_the_environment_is_1_or_0() -> None:
    assert bind_cores_from_env({}) is False
    assert bind_cores_from_env({"SWARMFD_BIND_CORES": ""}) is False
    assert bind_cores_from_env({"SWARMFD_BIND_CORES": "0"}) is False
    assert bind_cores_from_env({"SWARMFD_BIND_CORES": " 1 "}) is True
    with pytest.raises(ValueError, match=r"SWARMFD_BIND_CORES='yes': expected 1"):
        bind_cores_from_env({"SWARMFD_BIND_CORES": "yes"})
    with pytest.raises(TypeError, match="bind_cores must be a bool"):
        LaunchConfig(nproc=1, command=["true"], bind_cores="1")  # type: ignore[arg-type]


def test_bind_cores_pins_each_rank_and_its_threads_to_its_share(runs: Runs) -> None:
    """--bind-cores (or SWARMFD_BIND_CORES=1): each rank, and a thread it starts, runs
    only on core_sets' share of the launcher's cores; without it (and with
    --no-bind-cores over the variable) every rank keeps the launcher's mask. A bad
    variable is a usage error naming it."""
    mask = sorted(os.sched_getaffinity(0))
    unset = {k: v for k, v in os.environ.items() if k != "SWARMFD_BIND_CORES"}
    for n in (2, 3):
        cases = [(("--bind-cores",), unset, core_sets(n, mask)),
                 ((), {**unset, "SWARMFD_BIND_CORES": "1"}, core_sets(n, mask)),
                 ((), unset, [mask] * n),
                 (("--no-bind-cores",), {**unset, "SWARMFD_BIND_CORES": "1"}, [mask] * n)]
        for flags, env, want in cases:
            code, out, err = runs.run("-n", str(n), *flags, WORKER, "affinity", env=env)
            assert (code, err) == (0, b""), (flags, err)
            got = {r: json.loads(lines[0]) for r, lines in by_rank(out).items()}
            assert [got[r]["cpus"] for r in range(n)] == want, (flags, got)
            assert [got[r]["thread"] for r in range(n)] == want, (flags, got)
    code, _, err = runs.run("-n", "2", WORKER, "affinity",
                            env={**unset, "SWARMFD_BIND_CORES": "yes"})
    assert code == 2 and b"SWARMFD_BIND_CORES='yes'" in err, err


def test_torch_and_swarmfd_get_two_distinct_free_ports(runs: Runs) -> None:
    """MASTER_PORT (torch.distributed's store) and SWARMFD_PORT (swarmfd's rendezvous) are
    both free when the ranks start: rank 0 listens on both at once."""
    code, out, err = runs.run("-n", "2", WORKER, "bind-ports")
    assert (code, err) == (0, b""), err
    bound = json.loads(by_rank(out)[0][0])["bound"]
    assert len(set(bound)) == 2, bound


def test_swarmfd_port_option(runs: Runs) -> None:
    """--swarmfd-port sets SWARMFD_PORT; MASTER_PORT is then a free port of its own."""
    code, out, err = runs.run("-n", "1", "--swarmfd-port", "23458", WORKER, "env")
    assert code == 0, err
    env = json.loads(by_rank(out)[0][0])
    assert env["SWARMFD_PORT"] == "23458" and env["MASTER_PORT"] not in ("23458", None)


def test_the_ports_of_an_attempt() -> None:
    """Given, derived (--master-port + 1, as a rank would) or fresh and distinct."""
    from swarmfd.launch import _ports

    def ports(**kw: int) -> tuple[int, int]:
        return _ports(LaunchConfig(nproc=1, command=["true"], **kw))

    assert ports(master_port=23456) == (23456, 23457)
    assert ports(master_port=23456, swarmfd_port=40000) == (23456, 40000)
    master, own = ports(swarmfd_port=40000)
    assert own == 40000 and master != own
    master, own = ports()
    assert master != own


@pytest.mark.parametrize(("args", "message"), [
    (("-e", "SWARMFD_PORT=1"), "-e SWARMFD_PORT is not allowed: swarmfd sets SWARMFD_PORT "
     "for every rank; use --swarmfd-port"),
    (("--master-port", "65535"), "--master-port 65535 leaves no port for swarmfd's rendezvous"),
    (("--master-port", "23456", "--swarmfd-port", "23456"),
     "--swarmfd-port and --master-port are both 23456"),
    (("--swarmfd-port", "70000"), "--swarmfd-port must be a TCP port 1..65535"),
])
def test_cli_refuses_bad_ports(args: tuple[str, ...], message: str) -> None:
    result = CliRunner().invoke(main, ["run", "-n", "1", *args, WORKER, "env"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_py_path_runs_with_the_current_python(runs: Runs) -> None:
    """A first word ending in .py (not executable itself) runs with sys.executable."""
    assert not os.access(WORKER, os.X_OK), "the test script must not be executable"
    code, out, _ = runs.run("-n", "1", WORKER, "env")
    assert code == 0
    assert sys.executable == json.loads(by_rank(out)[0][0])["executable"]


def test_a_free_port_is_bindable() -> None:
    """find_free_port returns a port nothing listens on."""
    port = find_free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --- exit codes and failures ------------------------------------------------------


@pytest.mark.parametrize(
    ("codes", "expected"),
    [("0 0", 0), ("0 5", 5), ("7 0", 7)],
)
def test_exit_code_is_the_failing_ranks(runs: Runs, codes: str, expected: int) -> None:
    """All zero -> 0; otherwise the failing rank's code."""
    script = f"import os, sys; sys.exit(int('{codes}'.split()[int(os.environ['RANK'])]))"
    code, _, err = runs.run("-n", "2", "--", sys.executable, "-c", script)
    assert expected == code
    if expected:
        assert f"exited with code {expected}".encode() in err


def test_failing_rank_stops_the_others_quickly(runs: Runs) -> None:
    """Rank 1 exits 3 while the others sleep 60 s: exit 3 within seconds, nothing survives.

    The grace is long, so the SIGTERM itself must reach every process of each group.
    """
    start = time.monotonic()
    code, _, err = runs.run("-n", "3", "--grace", "30", WORKER, "fail", str(runs.piddir), "1", "3")
    elapsed = time.monotonic() - start
    assert code == 3, err
    assert elapsed < 15, f"took {elapsed:.1f} s"  # the grace is 30 s
    assert b"swarmfd run: rank 1 exited with code 3; stopping the other ranks\n" in err
    # The failing rank's own stderr comes before the launcher's verdict.
    assert err.index(b"[rank 1] rank 1 failing") < err.index(b"swarmfd run: rank 1 exited")
    assert_all_gone(recorded_pids(runs.piddir))
    assert len(recorded_pids(runs.piddir)) == 6  # 3 ranks + 3 children


def test_the_first_rank_to_fail_is_blamed_not_the_lowest(runs: Runs) -> None:
    """Rank 2 exits 3, rank 0 exits 1 0.1 s later (a third of swarmfd's lost-peer grace):
    the run reports rank 2 and exits 3."""
    code, _, err = runs.run("-n", "3", WORKER, "follow", str(runs.piddir))
    assert code == 3, err
    assert b"swarmfd run: rank 2 exited with code 3; stopping the other ranks" in err
    assert b"rank 0 exited" not in err
    assert_all_gone(recorded_pids(runs.piddir))


def test_rank_killed_by_a_signal_is_a_failure(runs: Runs) -> None:
    """A rank dying of SIGKILL makes the run fail with 137 and says so."""
    code, _, err = runs.run("-n", "2", WORKER, "fail", str(runs.piddir), "0", str(-signal.SIGKILL))
    assert code == 128 + signal.SIGKILL
    assert b"rank 0 was killed by SIGKILL (exit code 137); stopping the other ranks" in err
    assert_all_gone(recorded_pids(runs.piddir))


def test_processes_left_by_a_successful_rank_are_stopped(runs: Runs) -> None:
    """A rank that exits 0 but leaves a child behind: the child is stopped too."""
    code, _, err = runs.run("-n", "2", WORKER, "leave-child", str(runs.piddir))
    assert code == 0
    assert b"stopping processes left running by rank(s) 0, 1" in err
    assert_all_gone(recorded_pids(runs.piddir))


def test_max_restarts_restarts_the_group_until_it_succeeds(runs: Runs) -> None:
    """Fails on attempts 0 and 1, succeeds on 2: --max-restarts 2 ends 0 with 3 attempts."""
    code, out, err = runs.run("-n", "2", "--max-restarts", "2", WORKER, "restart", str(runs.piddir))
    assert code == 0, err
    attempts = [re.fullmatch(rb"attempt (\d+) port (\d+) swarmfd (\d+)", line).groups()
                for line in by_rank(out)[0]]
    assert [a for a, _, _ in attempts] == [b"0", b"1", b"2"]
    assert len({p for _, p, _ in attempts}) > 1, "a new free port is picked per restart"
    assert len({q for _, _, q in attempts}) > 1, "a new SWARMFD_PORT is picked per restart"
    assert all(p != q for _, p, q in attempts), attempts
    assert err.count(b"swarmfd run: rank 1 exited with code 3") == 2
    assert b"restart 1 of 2" in err and b"restart 2 of 2" in err
    assert_all_gone(recorded_pids(runs.piddir))


def test_max_restarts_exhausted_returns_the_last_code(runs: Runs) -> None:
    """With one restart the script still fails: exit 3, and the launcher says it gave up."""
    code, out, err = runs.run("-n", "2", "--max-restarts", "1", "--master-port", "23457",
                              WORKER, "restart", str(runs.piddir))  # fmt: skip
    assert code == 3
    assert by_rank(out)[1] == [b"attempt 0 port 23457 swarmfd 23458",
                               b"attempt 1 port 23457 swarmfd 23458"]
    assert b"no restarts left (max_restarts=1); exiting with code 3" in err


# --- output -----------------------------------------------------------------------


def test_output_is_prefixed_whole_lines_on_the_matching_stream(runs: Runs) -> None:
    """stdout and stderr keep their stream; lines never mix; bad UTF-8 and partial lines pass."""
    code, out, err = runs.run("-n", "3", WORKER, "output", "3000")
    assert code == 0, err
    lines = by_rank(out)
    assert sorted(lines) == [0, 1, 2]
    for rank, got in lines.items():
        assert f"out {rank}".encode() == got[0]
        assert [f"line {rank} {i} {'x' * 200}".encode() for i in range(3000)] == got[1:3001]
        assert b"bytes \xff\xfe " + str(rank).encode() == got[3001]
        assert f"partial {rank}".encode() == got[3002]  # the launcher added the newline
    assert by_rank(err) == {0: [b"err 0"], 1: [b"err 1"], 2: [b"err 2"]}


def test_no_prefix_passes_lines_through(runs: Runs) -> None:
    """--no-prefix: the ranks' bytes unchanged."""
    code, out, _ = runs.run("-n", "1", "--no-prefix", WORKER, "output", "2")
    assert code == 0
    expected = b"out 0\n" + b"".join(f"line 0 {i} {'x' * 200}\n".encode() for i in range(2))
    assert expected + b"bytes \xff\xfe 0\npartial 0" == out


def test_reader_going_away_does_not_hang_the_run(runs: Runs) -> None:
    """Like `swarmfd run ... | head -1`: the launcher drains the ranks and ends."""
    proc = runs.start("-n", "2", WORKER, "spam", "20000")
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=20) == 0


# --- signals and orphans ------------------------------------------------------------


@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_every_rank(runs: Runs, sig: int, expected: int) -> None:
    """Ctrl-C (or SIGTERM) is forwarded to each rank's group; exit 128+S, nothing survives."""
    proc = runs.start("-n", "2", "--grace", "30", WORKER, "sleep", str(runs.piddir))
    pids = wait_recorded(runs.piddir, 4)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=15)  # the grace is 30 s
    assert expected == proc.returncode
    assert f"received {signal.Signals(sig).name}; stopping all 2 rank(s)".encode() in err
    assert_all_gone(pids)


INTERRUPTIBLE = r"""
import os, sys, time
from pathlib import Path
import numpy as np

def wait_here():
    Path(sys.argv[1], os.environ["RANK"] + ".pid").write_text(str(os.getpid()))
    time.sleep(60)

if os.environ["RANK"] == "1":
    try:
        wait_here()
    except KeyboardInterrupt:
        print("rank 1 saves before it goes", file=sys.stderr, flush=True)
        raise
else:
    wait_here()
"""


def test_ctrl_c_prints_one_line_per_rank_not_their_tracebacks(runs: Runs) -> None:
    """Ctrl-C on Python ranks: exit 130, each rank's KeyboardInterrupt traceback becomes
    one line naming where it was, what a rank prints while handling it still shows, and
    a summary ends the output."""
    proc = runs.start("-n", "2", "--grace", "20", sys.executable, "-c", INTERRUPTIBLE,
                      str(runs.piddir))
    wait_for(lambda: len(list(runs.piddir.iterdir())) == 2, 20, "both ranks waiting")
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    lines = err.decode().splitlines()
    assert lines[0] == "swarmfd run: received SIGINT; stopping all 2 rank(s)", lines
    assert lines[-1] == "swarmfd run: stopped all 2 rank(s) after SIGINT (exit code 130)"
    middle = sorted(lines[1:-1])
    assert middle == ["[rank 0] KeyboardInterrupt in <string>:8 (wait_here)",
                      "[rank 1] KeyboardInterrupt in <string>:8 (wait_here)",
                      "[rank 1] rank 1 saves before it goes"], lines
    assert "Traceback" not in err.decode()


TRACEBACK_KI = b"""Traceback (most recent call last):
  File "/home/u/train.py", line 12, in <module>
    main()
  File "/home/u/train.py", line 9, in main
    fd.all_reduce(x)
  File "/venv/lib/python3.11/site-packages/swarmfd/collectives.py", line 662, in all_reduce
    _fused(g, x)
           ^^^^
KeyboardInterrupt
"""

CHAINED = TRACEBACK_KI + b"""
During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/home/u/train.py", line 14, in <module>
    fd.cleanup()
swarmfd.errors.PeerLostError: lost rank 1
"""

OTHER = b"""Traceback (most recent call last):
  File "/home/u/train.py", line 3, in <module>
    1 / 0
ZeroDivisionError: division by zero
"""


def _filtered(*chunks: bytes) -> list[bytes]:
    from swarmfd.launch import TracebackFilter

    out: list[bytes] = []
    f = TracebackFilter(out.append)
    for chunk in chunks:
        for line in chunk.splitlines(keepends=True):
            f.feed(line)
    f.flush()
    return out


def test_interrupt_filter_collapses_keyboard_interrupts_only() -> None:
    """A KeyboardInterrupt traceback: one line at the innermost frame outside swarmfd and
    installed packages; chained, with the final error appended; anything else as is."""
    assert _filtered(TRACEBACK_KI) == [
        b"KeyboardInterrupt in /home/u/train.py:9 (main)\n"]
    assert _filtered(CHAINED) == [b"KeyboardInterrupt in /home/u/train.py:9 (main); then "
                                  b"swarmfd.errors.PeerLostError: lost rank 1\n"]
    assert _filtered(OTHER) == OTHER.splitlines(keepends=True)
    # Lines around a traceback keep their order; a traceback cut short is shown as is.
    assert _filtered(b"before\n", TRACEBACK_KI, b"after\n", b"Traceback (most recent call "
                     b"last):\n  File \"x\", line 1\n") == [
        b"before\n", b"KeyboardInterrupt in /home/u/train.py:9 (main)\n", b"after\n",
        b"Traceback (most recent call last):\n", b'  File "x", line 1\n']


def test_ranks_deaf_to_signals_are_killed_after_the_grace(runs: Runs) -> None:
    """Ranks ignoring SIGINT/SIGTERM are SIGKILLed after --grace; exit is still 130."""
    proc = runs.start("-n", "2", "--grace", "0.5", WORKER, "sleep", str(runs.piddir), "ignore")
    pids = wait_recorded(runs.piddir, 4)
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    proc.communicate(timeout=15)
    assert proc.returncode == 130
    assert time.monotonic() - start < 8  # the ranks would sleep 60 s
    assert_all_gone(pids)


def test_second_ctrl_c_kills_without_waiting_for_the_grace(runs: Runs) -> None:
    """A second SIGINT during the grace period SIGKILLs the ranks at once."""
    proc = runs.start("-n", "2", "--grace", "30", WORKER, "sleep", str(runs.piddir), "ignore")
    pids = wait_recorded(runs.piddir, 4)
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGINT)
    proc.communicate(timeout=15)
    assert proc.returncode == 130
    assert time.monotonic() - start < 8  # the grace is 30 s
    assert_all_gone(pids)


def test_launcher_killed_with_sigkill_takes_its_ranks_along(runs: Runs) -> None:
    """PDEATHSIG kills the ranks; the guardian stops the ranks' children."""
    proc = runs.start("-n", "2", "--grace", "0.5", WORKER, "sleep", str(runs.piddir))
    pids = wait_recorded(runs.piddir, 4)
    proc.kill()  # only the launcher: not its session, not the guardian
    proc.wait(timeout=5)
    assert_all_gone(pids)


# --- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 0}, "the number of ranks must be >= 1, got -n 0"),
        ({"nproc": True}, "-n/--nproc must be an integer (the number of ranks), got True"),
        ({"command": []}, "missing COMMAND: give the program every rank runs, e.g. "
                          "'swarmfd run -n 2 train.py'"),
        ({"command": "python x.py"}, "command must be a sequence of strings"),
        ({"master_port": 70000}, "--master-port must be a TCP port 1..65535"),
        ({"swarmfd_port": 0}, "--swarmfd-port must be an integer >= 1 (a TCP port)"),
        ({"master_port": 65535}, "--master-port 65535 leaves no port for swarmfd's rendezvous"),
        ({"master_port": 80, "swarmfd_port": 80}, "--swarmfd-port and --master-port are both 80"),
        ({"env": {"SWARMFD_PORT": "3"}}, "-e SWARMFD_PORT is not allowed"),
        ({"master_addr": " "}, "--master-addr must be a host name"),
        ({"env": {"RANK": "3"}}, "-e RANK is not allowed: swarmfd sets RANK for every rank; "
                                 "use -n (each rank gets its own)"),
        ({"env": {"A=B": "1"}}, "env name 'A=B' is invalid"),
        ({"env": ["A"]}, "-e A: A is not set in this shell"),
        ({"timeout": 0}, "--timeout must be a positive number of seconds"),
        ({"init_timeout": -1}, "--init-timeout must be a positive number of seconds"),
        ({"env": {"SWARMFD_INIT_TIMEOUT": "9"}},
         "-e SWARMFD_INIT_TIMEOUT is not allowed: swarmfd sets SWARMFD_INIT_TIMEOUT for every "
         "rank; use --init-timeout"),
        ({"max_restarts": -1}, "--max-restarts must be an integer >= 0"),
        ({"grace": float("nan")}, "--grace must be a finite number of seconds >= 0"),
    ],
)
def test_launch_config_rejects_bad_input(kwargs: dict, message: str) -> None:
    """Each bad field raises ValueError/TypeError naming the field and what was expected."""
    args = {"nproc": 2, "command": ["true"], **kwargs}
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        LaunchConfig(**args)


def test_launch_config_is_frozen_and_normalized() -> None:
    """command becomes a tuple; env is a read-only copy."""
    env = {"A": "1"}
    cfg = LaunchConfig(nproc=1, command=["echo", "hi"], env=env)
    env["B"] = "2"
    assert (cfg.command, dict(cfg.env)) == (("echo", "hi"), {"A": "1"})
    with pytest.raises(TypeError):
        cfg.env["C"] = "3"  # type: ignore[index]


def test_resolve_command(tmp_path: Path) -> None:
    """.py -> current Python; missing programs and scripts fail before anything starts."""
    assert [sys.executable, WORKER, "env"] == resolve_command([WORKER, "env"])
    assert resolve_command(["true"]) == ["true"]
    with pytest.raises(FileNotFoundError, match="script not found"):
        resolve_command([str(tmp_path / "missing.py")])
    with pytest.raises(FileNotFoundError, match="command not found: 'no-such-program-xyz'"):
        resolve_command(["no-such-program-xyz"])
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(PermissionError, match="not executable"):
        resolve_command([str(plain)])


def test_exit_code_of_maps_signals_like_shells() -> None:
    """Popen's -S becomes 128+S; codes pass through."""
    assert tuple(exit_code_of(c) for c in (0, 3, -2, -9)) == (0, 3, 130, 137)


def test_cli_nproc_zero_is_a_usage_error() -> None:
    """-n 0 exits 2 with a message naming nproc."""
    result = CliRunner().invoke(main, ["run", "-n", "0", "true"])
    assert result.exit_code == 2
    assert "the number of ranks must be >= 1, got -n 0" in result.output


def test_cli_missing_nproc_and_command_are_usage_errors() -> None:
    """Without -n, or without COMMAND, click reports a usage error (exit 2)."""
    no_n = CliRunner().invoke(main, ["run", "true"])
    assert no_n.exit_code == 2 and "Missing option '-n'" in no_n.output
    no_cmd = CliRunner().invoke(main, ["run", "-n", "2"])
    assert no_cmd.exit_code == 2 and "missing COMMAND" in no_cmd.output


@pytest.mark.parametrize(
    ("env_arg", "message"),
    [("SWARMFD_TEST_SURELY_UNSET", "-e SWARMFD_TEST_SURELY_UNSET: SWARMFD_TEST_SURELY_UNSET is "
      "not set in this shell; give a value with -e SWARMFD_TEST_SURELY_UNSET=VALUE"),
     ("1A=2", "expected KEY=VALUE (or KEY alone, to pass this shell's value)"),
     ("WORLD_SIZE=4", "-e WORLD_SIZE is not allowed: swarmfd sets WORLD_SIZE for every rank; "
      "use -n"),
     ("SWARMFD_TIMEOUT=4", "use --timeout")],
)
def test_cli_bad_env_is_a_usage_error(env_arg: str, message: str) -> None:
    """-e KEY must be set here, KEY a name; the launcher's variables and those its options
    set are refused naming the option."""
    result = CliRunner().invoke(main, ["run", "-n", "1", "-e", env_arg, "true"])
    assert result.exit_code == 2
    assert message in result.output


def test_cli_missing_program_exits_127(tmp_path: Path) -> None:
    """A command that does not exist: one clear message, exit 127, no ranks started."""
    result = CliRunner().invoke(main, ["run", "-n", "2", str(tmp_path / "nope.py")])
    assert result.exit_code == 127
    assert "swarmfd run: script not found" in result.output


def test_cli_program_that_cannot_execute_exits_126(tmp_path: Path) -> None:
    """An executable file the kernel cannot run (no shebang): exit 126 with the OS error."""
    prog = tmp_path / "noshebang"
    prog.write_text("echo hi\n")
    prog.chmod(0o755)
    result = CliRunner().invoke(main, ["run", "-n", "2", str(prog)])
    assert result.exit_code == 126
    assert "swarmfd run: cannot start the ranks: [Errno 8] Exec format error" in result.output


def test_cli_help_shows_an_example() -> None:
    """--help documents the options and shows how to call it."""
    result = CliRunner().invoke(main, ["run", "--help"])
    assert result.exit_code == 0
    assert "swarmfd run -n 4 train.py" in result.output
    for option in ("--nproc", "--master-port", "--swarmfd-port", "--max-restarts", "--no-prefix",
                   "--env"):
        assert option in result.output


def test_cli_passes_options_after_the_command_to_it() -> None:
    """Options after COMMAND belong to COMMAND (no `--` needed), and output is captured."""
    result = CliRunner().invoke(main, ["run", "-n", "2", WORKER, "env", "--no-prefix"])
    assert result.exit_code == 0, result.output
    assert {0, 1} == set(by_rank(result.stdout_bytes))
    assert "--no-prefix" in json.loads(by_rank(result.stdout_bytes)[0][0])


def test_library_launch_writes_to_given_streams() -> None:
    """launch() with explicit binary streams; rank output lands there, prefixed."""
    out, err = io.BytesIO(), io.BytesIO()
    command = [sys.executable, "-c", "import os; print(os.environ['RANK'])"]
    code = launch(LaunchConfig(nproc=2, command=command), stdout=out, stderr=err)
    assert (code, err.getvalue()) == (0, b"")
    assert by_rank(out.getvalue()) == {0: [b"0"], 1: [b"1"]}


# --- a real swarmfd job --------------------------------------------------------------


def test_real_two_rank_all_reduce(runs: Runs) -> None:
    """init_from_env + all_reduce through `swarmfd run -n 2`: both ranks print the sum."""
    code, out, err = runs.run("-n", "2", str(SCRIPTS / "allreduce.py"), timeout=40)
    assert code == 0, err.decode(errors="replace")
    expected = [b"result 10 12 14 16 world 2"]
    assert {0: expected, 1: expected} == by_rank(out)


LOST_PEER = str(SCRIPTS / "lost_peer.py")


@pytest.mark.parametrize(("transport", "plane_says"), [
    ("auto", "(host {host}, pid {pid}, shared memory): its process ended (it died or exited)"),
    ("tcp", "tcp://127.0.0.1:"),
], ids=["shm", "tcp"])
def test_a_lost_peer_after_a_failure_is_one_line_saying_what_its_plane_saw(
        runs: Runs, transport: str, plane_says: str) -> None:
    """Rank 1 exits 3; rank 0 finds it gone and raises PeerLostError. Its traceback
    becomes one line naming where it was, the lost rank and what the plane it ran on
    saw (shared memory: the process ended; TCP: the connection closed)."""
    code, _, err = runs.run("-n", "2", "--grace", "10", LOST_PEER, timeout=40,
                            env={**os.environ, "SWARMFD_TRANSPORT": transport})
    text = err.decode(errors="replace")
    assert code == 3, text
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("[rank 0]")]
    assert len(lines) == 1, text
    assert lines[0].startswith(
        f"[rank 0] PeerLostError in {os.path.relpath(LOST_PEER)}:17 (<module>): all_reduce "), text
    assert "lost rank 1 (host " in lines[0] and lines[0].endswith(" before it sent its data")
    pid = re.search(r"pid (\d+)", lines[0])
    assert pid is not None
    assert plane_says.format(host=socket.gethostname(), pid=pid.group(1)) in lines[0], lines[0]
    if transport == "tcp":
        assert "its connection closed" in lines[0] and "shared memory" not in lines[0]


def test_tracebacks_shows_the_lost_peers_traceback_whole(runs: Runs) -> None:
    """--tracebacks keeps rank 0's traceback as it was (SWARMFD_TRACEBACK=1 is its
    default: tests/test_cli.py)."""
    code, _, err = runs.run("-n", "2", "--grace", "10", "--tracebacks", LOST_PEER, timeout=40)
    text = err.decode(errors="replace")
    assert code == 3, text
    assert "[rank 0] Traceback (most recent call last):" in text, text
    assert "[rank 0] swarmfd.errors.PeerLostError: all_reduce " in text, text


def test_traceback_filter_cuts_a_lost_peer_to_one_line_and_keeps_real_errors() -> None:
    """A traceback that begins with PeerLostError or AbortedError: one line, the message
    kept; one that begins with another error (a lost peer while handling it) is kept
    whole; chained after a lost peer, the last error is appended."""
    lost = TRACEBACK_KI.replace(b"KeyboardInterrupt\n", b"swarmfd.errors.PeerLostError: "
                                b"all_reduce: lost rank 1 (host h, pid 9, shared memory)\n")
    assert _filtered(lost) == [b"PeerLostError in /home/u/train.py:9 (main): all_reduce: "
                               b"lost rank 1 (host h, pid 9, shared memory)\n"]
    aborted = OTHER.replace(b"ZeroDivisionError: division by zero",
                            b"swarmfd.errors.AbortedError: rank 2 aborted")
    assert _filtered(aborted) == [b"AbortedError in /home/u/train.py:3 (<module>): rank 2 "
                                  b"aborted\n"]
    real_first = OTHER + CHAINED.split(b"\n\n", 1)[1].replace(b"KeyboardInterrupt", b"")
    assert _filtered(real_first) == real_first.splitlines(keepends=True)
    then = lost + b"\nDuring handling of the above exception, another exception occurred:\n" \
        + OTHER
    assert _filtered(then)[0].endswith(b"; then ZeroDivisionError: division by zero\n")
