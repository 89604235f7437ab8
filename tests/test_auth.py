"""The job secret: who may join a group, send it data or abort it.

* The secret's sources and validation (explicit ``secret=``, SWARMFD_SECRET_FILE,
  the default path, SWARMFD_AUTH=off), with messages that never contain it.
* Real ranks on loopback: a process with a wrong secret, no authentication or no
  secret cannot join (a clear error on its side, the job unaffected); strangers
  with NULL, PLAIN and CURVE sockets (wrong keys, even the right server key with a
  wrong client key) at the rendezvous and data ports inject nothing and cannot
  abort running all_reduces; SWARMFD_AUTH=off and SWARMFD_ENCRYPT=1 give the same
  exact results.
* ``swarmfd run``: the secret never appears in a rank's /proc environ or cmdline,
  nor in the output; its file is private and removed after the run, also after a
  failure or Ctrl-C, and restarts reuse it.
* TCP keepalive: a peer whose packets vanish (no FIN) is lost within seconds,
  while a stopped one is still a timeout.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

import swarmfd as fd
from swarmfd import config as cfg
from swarmfd.comm import security as transport
from swarmfd.comm import wire
from swarmfd.comm.plane import PeerInfo

from .support.harness import (
    VANISHED_PEER_LIMIT,
    RankCtx,
    Ranks,
    error_info,
    free_port,
    record,
    run_ranks,
    unavailable,
    write_secret_file,
)

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-" + "x" * 40


# -- the secret's sources --------------------------------------------------------------


def test_a_world_of_one_needs_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWARMFD_SECRET_FILE", raising=False)
    assert cfg.require_secret(1, environ={}) is None
    fd.init(1, 0)
    try:
        assert fd.get_world_size() == 1
    finally:
        fd.cleanup()


def test_missing_secret_is_a_clear_error_before_any_network(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWARMFD_SECRET_FILE", raising=False)
    if os.path.exists(cfg.DEFAULT_SECRET_FILE):
        pytest.skip(f"{cfg.DEFAULT_SECRET_FILE} exists on this machine")
    t0 = time.monotonic()
    with pytest.raises(fd.ConfigError) as info:
        # Nobody serves this port: the error must come before any rendezvous.
        fd.init(2, 1, master_addr="127.0.0.1", master_port=free_port(), timeout=30)
    assert time.monotonic() - t0 < 2
    msg = str(info.value)
    for needle in ("job secret", "SWARMFD_SECRET_FILE", cfg.DEFAULT_SECRET_FILE,
                   "SWARMFD_AUTH=off", "secret="):
        assert needle in msg, msg
    assert not fd.is_initialized()


def test_secret_file_validation(tmp_path: Path) -> None:
    short = write_secret_file(str(tmp_path), "short", "tooshort")
    good = write_secret_file(str(tmp_path), "good", "  " + SECRET + "  ")
    big = tmp_path / "big"
    big.write_text("y" * (cfg.MAX_SECRET_BYTES + 10))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {
        str(tmp_path / "nope"): "does not exist",
        str(tmp_path): "not a regular file",
        str(fifo): "not a regular file",  # refused without blocking in open()
        short: "8 characters long: expected at least 32",
        str(big): "larger than",
    }
    for path, expected in cases.items():
        with pytest.raises(fd.ConfigError) as info:
            cfg.load_secret({"SWARMFD_SECRET_FILE": path})
        assert expected in str(info.value) and path in str(info.value), str(info.value)
        assert "tooshort" not in str(info.value)
    assert cfg.load_secret({"SWARMFD_SECRET_FILE": good}) == SECRET.encode()  # stripped
    with pytest.raises(fd.ConfigError) as info:
        cfg.require_secret(2, "short-secret-given-inline")
    assert "secret= argument" in str(info.value)
    assert "short-secret-given-inline" not in str(info.value)
    assert cfg.require_secret(2, SECRET, environ={}) == SECRET.encode()
    assert cfg.require_secret(2, None, environ={"SWARMFD_AUTH": "off"}) is None
    with pytest.raises(fd.ConfigError, match="SWARMFD_AUTH"):
        cfg.auth_enabled({"SWARMFD_AUTH": "maybe"})
    with pytest.raises(fd.ConfigError, match="SWARMFD_ENCRYPT"):
        cfg.encrypt_enabled({"SWARMFD_ENCRYPT": "yes please"})


def test_keys_derive_from_the_secret_and_stay_out_of_reprs() -> None:
    a = transport.Security.from_secret(SECRET.encode(), encrypt=False)
    b = transport.Security.from_secret(SECRET.encode(), encrypt=True)
    c = transport.Security.from_secret(SECRET.encode() + b"!", encrypt=False)
    assert (a.public, a.secret) == (b.public, b.secret)
    assert a.public != c.public
    assert zmq.curve_public(a.secret) == a.public
    assert a.secret.decode() not in repr(a) and a.public.decode() not in repr(a)
    peer = PeerInfo(1, "tcp://x:1", "h", 1, token="tok-should-not-show")
    assert "tok-should-not-show" not in repr(peer)


# -- joining ----------------------------------------------------------------------------


# An intruder still running after 45 s (its init timeout is 20) prints every thread's
# stack and exits, so a hang says where it hangs (a CI run's "auth off" intruder outlived
# the test's 60 s wait once, and SIGKILL left nothing to read).
_INTRUDER = textwrap.dedent("""
    import faulthandler, sys, time
    faulthandler.dump_traceback_later(45, exit=True)
    import swarmfd as fd
    t0 = time.monotonic()
    try:
        fd.init(2, 1, master_addr="127.0.0.1", master_port=int(sys.argv[1]), timeout=20,
                init_timeout=float(sys.argv[2]))
    except Exception as exc:
        print("ERROR", type(exc).__name__, round(time.monotonic() - t0, 2), exc)
        sys.exit(3)
    print("JOINED")
""")
#: How long an intruder tries to join (its init timeout): it never gives up earlier.
INTRUDER_WAIT = 3.0


def _start_intruder(port: int, env: dict[str, str], drop: tuple[str, ...] = (),
                    wait: float = INTRUDER_WAIT) -> subprocess.Popen[str]:
    """Start a process that tries to join as rank 1 (it retries until rank 0 listens)."""
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(env)
    return subprocess.Popen([PY, "-c", _INTRUDER, str(port), str(wait)], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Wait for an intruder: (exit code, output)."""
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out


def _patient_pair(ctx: RankCtx) -> list[float]:
    """Rank 0 waits for rank 1 (which joins once released), then they all_reduce."""
    if ctx.rank == 0:
        ctx.report("serving")
    else:
        assert ctx.wait_go(60)
    ctx.init()
    x = np.arange(1000, dtype=np.float64) * (ctx.rank + 1)
    fd.all_reduce(x)
    return [float(x[1]), float(x[-1])]


def _error_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.startswith("ERROR ")), text)


def test_wrong_secret_no_auth_no_secret_or_another_launch_cannot_join(tmp_path: Path) -> None:
    """Impostors for rank 1, all at once while rank 0 waits: each fails with a clear error
    and rank 0 is unaffected (the real rank 1 then joins). Another secret or SWARMFD_AUTH
    gives no cryptographic evidence (rank 0's CURVE server closes the connection, as a
    squatter would), so those impostors try until their init timeout, then say what they
    saw (and warn meanwhile); a rank of another launch (SWARMFD_JOB_ID) with the right
    secret is refused by rank 0 at once."""
    wrong = write_secret_file(str(tmp_path), "wrong")
    with Ranks(_patient_pair, 2, init=False, group_timeout=60.0) as ranks:
        ranks.wait("serving", [0])
        time.sleep(0.5)  # rank 0 is in rendezvous
        procs = {
            "wrong secret": _start_intruder(ranks.port, {"SWARMFD_SECRET_FILE": wrong}),
            "auth off": _start_intruder(ranks.port, {"SWARMFD_AUTH": "off"}),
            "no secret": _start_intruder(ranks.port, {}, drop=("SWARMFD_SECRET_FILE",)),
            "another launch": _start_intruder(ranks.port, {"SWARMFD_JOB_ID": "job-b"}),
        }
        attempts = {name: _finish(proc) for name, proc in procs.items()}
        ranks.release()
        out = ranks.results(timeout=60)
    record("impostors", **{k: v[1].strip()[:300] for k, v in attempts.items()})
    for name, (code, text) in attempts.items():
        assert code == 3, f"{name}: {text}"
    where = f"127.0.0.1:{ranks.port}"
    wrong_text, off_text = attempts["wrong secret"][1], attempts["auth off"][1]
    assert _error_line(wrong_text).startswith("ERROR RendezvousTimeout"), wrong_text
    assert (f"something at {where} accepts and closes without speaking swarmfd's handshake"
            in wrong_text and "another job secret" in wrong_text), wrong_text
    assert "no rendezvous yet" in wrong_text, wrong_text  # the warning, before the timeout
    assert _error_line(off_text).startswith("ERROR RendezvousTimeout"), off_text
    # libzmq's CURVE server may close before its greeting (with its mechanism) is flushed,
    # so the NULL client sees a mismatch or a silent close; both name the setting.
    assert (f"something at {where} answered" in off_text
            or f"something at {where} accepts and closes" in off_text), off_text
    assert "rank 0 with another SWARMFD_AUTH setting" in off_text or (
        "another job secret or SWARMFD_AUTH setting" in off_text), off_text
    assert "SWARMFD_AUTH=off" in off_text, off_text
    launch = attempts["another launch"][1]
    assert _error_line(launch).startswith("ERROR RendezvousError"), launch
    assert "belongs to another launch (SWARMFD_JOB_ID 'job-b'" in launch, launch
    assert float(_error_line(launch).split()[2]) < 5, launch
    if not os.path.exists(cfg.DEFAULT_SECRET_FILE):
        assert "ERROR ConfigError" in attempts["no secret"][1], attempts["no secret"][1]
    assert out == {0: [3.0, 2997.0], 1: [3.0, 2997.0]}, out


def _rank0_alone(ctx: RankCtx) -> Any:
    try:
        fd.init(2, 0, master_addr="127.0.0.1", master_port=ctx.port, timeout=4.0)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


@pytest.mark.waits  # rank 0 waits for its init timeout
def test_rank0_timeout_mentions_refused_handshakes(tmp_path: Path) -> None:
    """Rank 0 waiting in vain for a rank with another secret says so in its timeout."""
    wrong = write_secret_file(str(tmp_path), "wrong")
    ranks = Ranks(_rank0_alone, 1, init=False, group_timeout=4.0)
    # The intruder starts first and retries until rank 0 listens, so its refused handshakes
    # fall inside rank 0's 4 s wait however slowly either process starts. (Started 1 s
    # after rank 0, its interpreter start-up on a loaded machine raced that window.)
    intruder = _start_intruder(ranks.port, {"SWARMFD_SECRET_FILE": wrong}, wait=4.5)
    try:
        with ranks:
            out = ranks.results(timeout=30)
    finally:
        code, text = _finish(intruder)
    assert code == 3 and "ERROR RendezvousTimeout" in text, text
    assert out[0]["type"] == "RendezvousTimeout", out
    assert "failed the authentication handshake" in out[0]["message"], out


# -- strangers against a running job ----------------------------------------------------


def _looping_job(ctx: RankCtx) -> dict[str, Any]:
    from swarmfd import group

    t = group.current().transport
    assert t is not None
    ctx.report("ports", int(t.endpoint.rsplit(":", 1)[1]))
    x = np.empty(70_000, np.int64)  # direct exchange
    y = np.empty(400_000, np.int64)  # ring, several pieces
    base_x, base_y = np.arange(x.size), np.arange(y.size)
    iters = 0
    flag = np.zeros(1, np.int64)
    w = ctx.world
    while True:
        for buf, base in ((x, base_x), (y, base_y)):
            np.multiply(base, ctx.rank + 1 + iters, out=buf)
            fd.all_reduce(buf)
            want = base * (w * (w + 1) // 2 + w * iters)
            if not np.array_equal(buf, want):
                raise AssertionError(f"rank {ctx.rank}: wrong result at iteration {iters}")
        iters += 1
        flag[0] = ctx.go.value
        fd.all_reduce(flag, op="max")
        if flag[0]:
            break
    denied = t.auth.refused if t.auth is not None else None
    return {"iters": iters, "garbage": t.garbage, "denied": denied}


def _forged_abort() -> list[bytes]:
    body = b'{"kind": "error", "rank": 1, "message": "forged by a stranger"}'
    sig = wire.Signature(wire.Collective.NONE)
    return [wire.pack_header(wire.Kind.ABORT, sig, 1, 0, 0, len(body)), body]


def _forged_data(seq: int) -> list[bytes]:
    sig = wire.Signature(wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, 4, wire.NO_ROOT,
                         70_000, 0)
    return [wire.pack_header(wire.Kind.DATA, sig, 1, seq, 0, 8, wire.FLAG_INLINE) + b"\0" * 8]


def _strangers(ports: list[int], master_port: int, seconds: float) -> dict[str, int]:
    """Sockets of every mechanism with wrong credentials, sending forged aborts and data."""
    good = transport.Security.from_secret(
        Path(os.environ["SWARMFD_SECRET_FILE"]).read_bytes().strip(), encrypt=False)
    other = transport.Security.from_secret(b"not-the-job-secret-" * 3, encrypt=False)
    ctx = zmq.Context()
    sent: dict[str, int] = {}
    socks: list[tuple[str, zmq.Socket]] = []

    def add(name: str, kind: int, port: int, setup: Any) -> None:
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 50)
        setup(s)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append((name, s))

    def null(s: zmq.Socket) -> None:
        pass

    def plain(s: zmq.Socket) -> None:
        s.setsockopt(zmq.PLAIN_USERNAME, b"swarmfd")
        s.setsockopt(zmq.PLAIN_PASSWORD, b"0" * 32)

    def curve_wrong(s: zmq.Socket) -> None:
        other.curve_client(s)

    def curve_stolen_server_key(s: zmq.Socket) -> None:
        # Knows the job's public key (which never leaves the ranks) but not its secret.
        pub, sec = zmq.curve_keypair()
        s.setsockopt(zmq.CURVE_SERVERKEY, good.public)
        s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
        s.setsockopt(zmq.CURVE_SECRETKEY, sec)

    for port in ports:
        for name, setup in (("null", null), ("plain", plain), ("curve-wrong", curve_wrong),
                            ("curve-wrong-client", curve_stolen_server_key)):
            add(name, zmq.PUSH, port, setup)
            add(f"dealer-{name}", zmq.DEALER, port, setup)
    for name, setup in (("rdv-null", null), ("rdv-curve-wrong", curve_wrong),
                        ("rdv-curve-wrong-client", curve_stolen_server_key)):
        add(name, zmq.DEALER, master_port, setup)
    end = time.monotonic() + seconds
    i = 0
    try:
        while time.monotonic() < end:
            for name, s in socks:
                frames = _forged_abort() if i % 2 else _forged_data(i % 64)
                try:
                    s.send_multipart(frames, zmq.NOBLOCK)
                    sent[name] = sent.get(name, 0) + 1
                except zmq.Again:
                    pass
            i += 1
            time.sleep(0.01)
    finally:
        for _, s in socks:
            s.close(linger=0)
        ctx.term()
    return sent


@pytest.mark.parametrize("encrypt", ["0", "0-zmq", "1"])
def test_strangers_inject_nothing_and_cannot_abort(encrypt: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Forged aborts and data from every kind of unauthenticated socket, at every port,
    while 3 ranks loop on exact all_reduces over TCP: nothing reaches the ranks (on the
    socket data plane the data ports are even closed; "0-zmq": the zmq data plane)."""
    monkeypatch.setenv("SWARMFD_ENCRYPT", encrypt[0])
    with Ranks(_looping_job, 3, group_timeout=60.0,
               transport="zmq" if encrypt == "0-zmq" else "tcp") as ranks:
        ports = ranks.wait("ports")
        # The rendezvous port's listener closed when init returned: the rdv-* strangers
        # find it closed, which is what they check (rendezvous-time attacks:
        # test_front_door.py, test_fuzz.py).
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", ranks.port), timeout=2).close()
        sent = _strangers([ports[r] for r in range(3)], ranks.port, 5.0)
        ranks.release()
        out = ranks.results(timeout=60)
    record(f"strangers[encrypt={encrypt}]", sent=sent, out=out)
    for r, v in out.items():
        assert v["iters"] >= 5, out
        assert v["garbage"] == 0, f"rank {r} received stranger traffic: {v}"
    if encrypt == "1":
        # The CURVE clients with a wrong client key got as far as ZAP, and were refused.
        assert sum(v["denied"] for v in out.values()) > 0, out


# -- modes give the same results -----------------------------------------------------------


def _reference_results(rank: int, world: int) -> dict[str, Any]:
    from swarmfd import group

    g = group.current()
    assert g.transport is not None and g.transport.shm is None
    rng = np.random.default_rng(rank)
    out: dict[str, Any] = {}
    for n in (7, 50_000, 700_000):
        x = rng.standard_normal(n).astype(np.float32)
        fd.all_reduce(x)
        out[f"sum{n}"] = hashlib.sha256(x.tobytes()).hexdigest()
        y = rng.standard_normal(n)
        fd.broadcast(y, src=1)
        out[f"bcast{n}"] = hashlib.sha256(y.tobytes()).hexdigest()
        z = fd.all_gather(np.full(n // 7, rank, np.int16))
        out[f"gather{n}"] = [int(a.sum()) for a in z]
    return out


def test_auth_off_and_encryption_give_identical_results() -> None:
    """Socket plane (default), zmq PLAIN+token, CURVE-encrypted and unauthenticated
    groups agree bitwise."""
    results = {}
    for name, env in (("plain", {"SWARMFD_ENCRYPT": "0"}),
                      ("zmq-plain", {"SWARMFD_ENCRYPT": "0", "SWARMFD_DATA_PLANE": "zmq"}),
                      ("encrypted", {"SWARMFD_ENCRYPT": "1"}),
                      ("auth-off", {"SWARMFD_AUTH": "off"})):
        env["SWARMFD_TRANSPORT"] = "tcp"
        results[name] = run_ranks(_reference_results, 2, env=env, timeout=120)
    assert results["plain"][0] == results["plain"][1]
    assert results["zmq-plain"] == results["plain"]
    assert results["encrypted"] == results["plain"]
    assert results["auth-off"] == results["plain"]


def _explicit_secret(rank: int, world: int) -> int:
    port = int(os.environ["TEST_PORT"])
    fd.init(world, rank, master_addr="127.0.0.1", master_port=port, timeout=30, secret=SECRET)
    x = np.ones(3)
    fd.all_reduce(x)
    return int(x.sum())


def test_explicit_secret_argument_joins() -> None:
    """secret= given to init works without any file (and wins over the environment)."""
    port = free_port()
    out = run_ranks(_explicit_secret, 2, init=False,
                    env={"SWARMFD_SECRET_FILE": "/nonexistent", "TEST_PORT": str(port)})
    assert out == [6, 6]


# -- swarmfd run -------------------------------------------------------------------------


_RUN_SCRIPT = textwrap.dedent("""
    import hashlib, os, stat, sys
    import numpy as np
    import swarmfd as fd
    path = os.environ["SWARMFD_SECRET_FILE"]
    secret = open(path, "rb").read().strip()
    mine = [open(f"/proc/{os.getpid()}/{n}", "rb").read() for n in ("environ", "cmdline")]
    parent = [open(f"/proc/{os.getppid()}/{n}", "rb").read() for n in ("environ", "cmdline")]
    leaked = any(secret in blob for blob in mine + parent)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    dmode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
    cfg = fd.init_from_env(timeout=30)
    x = np.ones(4)
    fd.all_reduce(x)
    digest = hashlib.sha256(secret).hexdigest()[:12]
    print(f"REPORT rank={cfg.rank} restart={cfg.restart_count} path={path} "
          f"len={len(secret)} leaked={leaked} mode={mode:o} dmode={dmode:o} "
          f"digest={digest} sum={x.sum():g}", flush=True)
    fd.cleanup()
    if len(sys.argv) > 1 and sys.argv[1] == "fail-first" and cfg.restart_count == 0:
        sys.exit(1)
""")


def _swarmfd_run(tmp_path: Path, *args: str, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    script = tmp_path / "secret_probe.py"
    script.write_text(_RUN_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([PY, "-m", "swarmfd", "run", *args, str(script), *extra], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def _reports(text: str) -> list[dict[str, str]]:
    return [dict(kv.split("=", 1) for kv in line.split("REPORT ", 1)[1].split())
            for line in text.splitlines() if "REPORT " in line]


def test_run_secret_is_private_never_in_environ_cmdline_or_output(tmp_path: Path) -> None:
    code, text = _swarmfd_run(tmp_path, "-n", "2")
    assert code == 0, text
    reps = _reports(text)
    assert len(reps) == 2, text
    paths = {r["path"] for r in reps}
    assert len(paths) == 1, reps
    path = paths.pop()
    assert path != os.environ["SWARMFD_SECRET_FILE"]  # run's own, not the session's
    for r in reps:
        assert r["leaked"] == "False" and r["len"] == "64", r
        assert r["mode"] == "600" and r["dmode"] == "700", r
        assert r["sum"] == "8", r
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    assert not re.search(r"\b[0-9a-f]{64}\b", text), "a 64-hex string in the output"


def test_run_removes_the_secret_after_failure_and_restarts_reuse_it(tmp_path: Path) -> None:
    code, text = _swarmfd_run(tmp_path, "-n", "2", "--max-restarts", "1",
                              extra=("fail-first",))
    assert code == 0, text
    reps = _reports(text)
    assert sorted(r["restart"] for r in reps) == ["0", "0", "1", "1"], text
    assert len({r["digest"] for r in reps}) == 1 and len({r["path"] for r in reps}) == 1
    assert not os.path.exists(reps[0]["path"])
    code, text = _swarmfd_run(tmp_path, "-n", "2", extra=("fail-first",))
    assert code == 1, text
    assert not os.path.exists(_reports(text)[0]["path"])


def _start_sleepers(tmp_path: Path, n: int) -> subprocess.Popen[str]:
    """`swarmfd run -n N` of ranks that print their secret file's path and sleep."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint('PATH', os.environ['SWARMFD_SECRET_FILE'],"
                      " flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([PY, "-m", "swarmfd", "run", "-n", str(n), "--grace", "1",
                             str(script)], env=env, stdout=subprocess.PIPE, text=True)


def _secret_path(proc: subprocess.Popen[str]) -> str:
    """The secret file's path, as the first rank printed it."""
    assert proc.stdout is not None
    return proc.stdout.readline().split("PATH ", 1)[1].strip()


def test_run_removes_the_secret_after_ctrl_c(tmp_path: Path) -> None:
    proc = _start_sleepers(tmp_path, 2)
    try:
        path = _secret_path(proc)
        assert os.path.exists(path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(path)


def test_run_secret_removed_by_guardian_when_launcher_is_killed(tmp_path: Path) -> None:
    proc = _start_sleepers(tmp_path, 1)
    try:
        path = _secret_path(proc)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(path)


# -- TCP keepalive: a vanished peer vs a stopped one ---------------------------------------


def _iptables(*args: str) -> bool:
    try:
        return subprocess.run(["iptables", *args], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _waits_for_rank1(ctx: RankCtx) -> Any:
    from swarmfd import group

    t = group.current().transport
    assert t is not None
    fd.barrier()
    ctx.report("ready", int(t.endpoint.rsplit(":", 1)[1]))
    if ctx.rank == 1:
        time.sleep(120)  # stopped by the test
        return None
    assert ctx.wait_go(30)
    called = time.monotonic()
    try:
        fd.all_reduce(np.ones(10))
    except Exception as exc:
        info = error_info(exc, ctx.mark.value)
        info["in_call"] = info["t"] - called
        return info
    return {"type": None}


@pytest.mark.waits  # a vanished or stopped peer: detection by keepalive or the timeout
@pytest.mark.parametrize(("vanish", "plane"), [(True, "tcp"), (True, "zmq"), (False, "tcp")],
                         ids=["vanished", "vanished-zmq", "stopped"])
def test_a_vanished_peer_is_lost_within_seconds_a_stopped_one_times_out(vanish: bool,
                                                                       plane: str) -> None:
    """Rank 1 is stopped (its kernel still answers); with `vanished`, the packets of the
    data ports are also dropped (a host gone without FIN): rank 0 must see PeerLostError
    within a few seconds instead of waiting for the 12 s timeout. (Both ranks' ports: on
    the socket plane the pair's connection is to rank 0's port, on zmq there is one each
    way.)"""
    rule = None
    if vanish and not _iptables("-L", "OUTPUT", "-n"):
        unavailable("iptables is not usable here", what="the vanished-peer tests",
                    fix="run them as root with iptables installed")
    with Ranks(_waits_for_rank1, 2, group_timeout=12.0, transport=plane) as ranks:
        ports = ranks.wait("ready")
        ranks.signal(1, signal.SIGSTOP)
        ranks.release()
        time.sleep(0.5)  # rank 0 sent its data (acknowledged by rank 1's kernel) and waits
        try:
            if vanish:
                rule = ["OUTPUT", "-o", "lo", "-p", "tcp", "-m", "multiport", "--ports",
                        f"{ports[0]},{ports[1]}", "-m", "comment", "--comment",
                        "swarmfd-test-vanish", "-j", "DROP"]
                assert _iptables("-I", *rule), "cannot add the iptables rule"
            ranks.mark.value = time.monotonic()
            info = ranks.results([0], timeout=40)[0]
        finally:
            if rule is not None:
                _iptables("-D", *rule)
        ranks.signal(1, signal.SIGKILL)
    record(f"keepalive[{'vanished' if vanish else 'stopped'},{plane}]", **info)
    if vanish:
        assert info["type"] == "PeerLostError", info
        assert info["elapsed"] < VANISHED_PEER_LIMIT, info
    else:
        assert info["type"] == "CollectiveTimeout", info
        # Not before the timeout, counted in the call itself: measured from the test's mark
        # (set 0.5 s into the wait, by a process that may be descheduled) the bound of
        # 11 s had about 1 s of headroom.
        assert info["in_call"] >= 12.0, info


def _tokens_used(ctx: RankCtx, used: int) -> dict[str, Any]:
    """Rank 0's data socket holds rank 1's first ``used`` one-time tokens as used (as if
    replays had reached its ZAP handler first): those attempts of rank 1 are refused."""
    from swarmfd.comm import security

    if ctx.rank == 0:
        real = security.connection_token
        security.connection_token = (  # type: ignore[assignment]
            lambda token, client, server, attempt=0:
            "used" if client == 1 and attempt < used else real(token, client, server, attempt))
    try:
        ctx.init(init_timeout=5)
        x = np.full(8, ctx.rank + 1.0)
        fd.all_reduce(x)
    except Exception as exc:  # the error is what the test reads
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "sum": float(x[0])}


def test_a_refused_data_token_is_followed_by_the_next() -> None:
    """A replay that reached a peer's ZAP handler before a rank's own handshake costs
    the rank an attempt, not its init: its next one-time token (unseen) gets in, and
    the job runs (the rank's first 3 tokens refused)."""
    with Ranks(_tokens_used, 2, 3, init=False, transport="zmq", group_timeout=10) as ranks:
        out = ranks.results(timeout=60)
    assert out == {0: {"error": None, "sum": 3.0}, 1: {"error": None, "sum": 3.0}}, out


def test_a_rank_out_of_data_tokens_is_named_with_the_connections_story() -> None:
    """A rank whose every one-time data token a peer refuses fails init with an
    AuthenticationError that says so and tells what its connection did (every attempt
    refused, with times), so replays are told apart from its own connection dropped
    and redialled."""
    from swarmfd.comm.security import DATA_ATTEMPTS

    with Ranks(_tokens_used, 2, DATA_ATTEMPTS, init=False, transport="zmq",
               group_timeout=10) as ranks:
        out = ranks.results(timeout=60)
    err = out[1]["error"] or ""
    assert err.startswith("AuthenticationError: rank 1: the data socket of rank 0"), out
    assert f"refused this rank's connection token ({DATA_ATTEMPTS} attempt(s)" in err, out
    story = err.split("This rank's connection to it: ")[1]
    assert re.fullmatch(r"((refused|closed) at \d+\.\d{3} s(, |$))+", story), err
    assert story.count("refused at") == DATA_ATTEMPTS, err
    assert out[0]["error"] is not None, out  # rank 0 never gets rank 1's connection


def _replay_admitted_first(ctx: RankCtx) -> dict[str, Any]:
    """Rank 1 lets a replay of its first data token in before its own connection, as a
    reader of the network who wins the race at rank 0's ZAP handler would: a DEALER
    that also claims rank 1's number as its routing id."""
    import zmq as z

    from swarmfd import group
    from swarmfd.comm import security
    from swarmfd.comm.planes import zmq as zplane

    replay: dict[str, Any] = {}
    if ctx.rank == 1:
        real_connect = zplane.ZmqPlane.connect

        def connect(self: Any, peers: Any, deadline: float) -> None:
            p0 = next(p for p in peers if p.rank == 0)
            zc = z.Context()
            sock = zc.socket(z.DEALER)
            sock.setsockopt(z.LINGER, 0)
            sock.setsockopt(z.ROUTING_ID, b"1")
            sock.setsockopt(z.PLAIN_USERNAME, b"1")
            sock.setsockopt(z.PLAIN_PASSWORD,
                            security.connection_token(p0.token, 1, 0, 0).encode())
            mon = sock.get_monitor_socket(z.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(p0.endpoint)
            replay.update(ctx=zc, sock=sock, mon=mon, admitted=bool(mon.poll(5000)))
            real_connect(self, peers, deadline)

        zplane.ZmqPlane.connect = connect  # type: ignore[method-assign]
    ctx.init(init_timeout=10)
    x = np.full(8, ctx.rank + 1.0)
    fd.all_reduce(x)
    fd.barrier()
    out: dict[str, Any] = {"sum": float(x[0])}
    if ctx.rank == 1:
        out["replay_admitted"] = replay["admitted"]
        out["replay_received"] = replay["sock"].poll(300)  # anything routed to it?
        out["attempts"] = group.current().transport.tcp.attempts.get(0, 0)
        replay["sock"].close(linger=0)
        replay["mon"].close(linger=0)
        replay["ctx"].term()
    return out


def test_a_replay_admitted_first_neither_passes_for_the_rank_nor_gets_its_data() -> None:
    """A replay that ZAP admitted before a rank's own connection (a reader of the network
    who won the race), claiming the rank's number as its routing id: the rank's own
    connection is refused once and gets in with its next token, its peer routes by the
    rank's secret routing id (security.routing_id) and waits for that route, not for a
    handshake count, so the replay receives nothing and the job's results are exact."""
    with Ranks(_replay_admitted_first, 2, init=False, transport="zmq",
               group_timeout=10) as ranks:
        out = ranks.results(timeout=60)
    assert out[0] == {"sum": 3.0}, out
    assert out[1] == {"sum": 3.0, "replay_admitted": True, "replay_received": 0,
                      "attempts": 1}, out
