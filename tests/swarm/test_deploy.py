"""``swarmfd deploy``, ``ls``, ``ps``, ``logs``, ``rm`` and the stack files on a real Swarm.

Every test runs the real command line (``python -m swarmfd ...``) in a subprocess
with a timeout, uses unique job names, and removes what it created in ``finally``
(through the library, so cleanup does not depend on the command under test). The
image is passed by ID (the ``swarmfd_image`` fixture), or by a throw-away tag.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmfd.statusline import MARK
from swarmfd.swarm.spec import LABEL_JOB
from tests.support.swarm_jobs import job_names, rank_lines, wait_until

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]
STACKS = ROOT / "stacks"
CLI_TIMEOUT = 180.0
TRAIN = "/opt/swarmfd/examples/train.py"
TERMINAL = {"complete", "failed", "rejected", "shutdown", "orphaned", "remove"}


def swarmfd(*args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``python -m swarmfd ARGS`` to completion (bounded); return its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "swarmfd", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def job_objects(client: Any, name: str) -> dict[str, list[Any]]:
    """Everything on this node that carries the job's label."""
    label = {"label": f"{LABEL_JOB}={name}"}
    return {
        "services": client.api.services(filters=label),
        "networks": client.api.networks(filters=label),
        "secrets": client.api.secrets(filters=label),
        "containers": client.api.containers(all=True, filters=label),
    }


def _try_remove_network(client: Any, network_id: str) -> bool:
    import docker.errors

    try:
        client.api.remove_network(network_id)
    except docker.errors.NotFound:
        return True
    except docker.errors.APIError:  # a just-stopped task may still hold an endpoint
        return False
    return True


@pytest.fixture
def job_name(swarm: Any) -> Iterator[Callable[[str], str]]:
    """A factory of unique job names; every job named by it is removed at teardown."""
    with job_names(swarm, "sfdt") as make:
        yield make


# --- 1. the example training job --------------------------------------------------------


def test_deploy_trains_on_three_ranks(swarm: Any, swarmfd_image: str,
                                      job_name: Callable[[str], str]) -> None:
    """N=3 of examples/train.py: exit 0, every rank trained, identical params, job removed."""
    name = job_name("train")
    started = time.monotonic()
    proc = swarmfd("deploy", swarmfd_image, "-n", "3", "--name", name, "--",
                   "python", TRAIN, "--epochs", "3")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    for rank in range(3):
        assert f"rank {rank}: trained on 2400 samples" in lines.get(rank, []), proc.stdout
    assert any("params identical on all 3 ranks: OK" in line for line in lines[0])
    assert f"{name}: all 3 ranks running after" in proc.stderr
    assert f"job {name} done: all 3 ranks exited 0" in proc.stderr
    assert f"removed job {name}" in proc.stderr
    # The job's last line, from the ranks' status lines (which were not shown).
    assert f"job {name}: 3 rank(s), " in proc.stderr, proc.stderr
    assert MARK.decode() not in proc.stdout + proc.stderr
    # Everything of a successful job is gone (the default: remove on success).
    assert not any(job_objects(swarm, name).values())
    print(f"deploy -n 3 train.py --epochs 3: {elapsed:.1f} s end to end")


# --- 2. one rank fails ----------------------------------------------------------------

FAIL_RANK_1 = (
    "import os, sys, time\n"
    "rank = int(os.environ['RANK'])\n"
    "print(f'rank {rank} up', flush=True)\n"
    "time.sleep(2)\n"
    "if rank == 1:\n"
    "    print('rank 1 fails now', file=sys.stderr, flush=True)\n"
    "    sys.exit(3)\n"
    "time.sleep(120)\n"
)


def test_failing_rank_stops_the_others_and_rm_removes_everything(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """Rank 1 exits 3: deploy exits 3 within seconds naming it, the others are stopped,
    the job is kept for ps/logs, and rm leaves no service, network, secret or container."""
    name = job_name("fail")
    started = time.monotonic()
    proc = swarmfd("deploy", swarmfd_image, "-n", "3", "--name", name, "--",
                   "python", "-c", FAIL_RANK_1, timeout=90)
    elapsed = time.monotonic() - started
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert re.search(r"rank 1 exited with code 3 on node \S+", proc.stderr), proc.stderr
    assert "[rank 1] rank 1 fails now" in proc.stderr  # the rank's stderr, prefixed
    assert {0, 1, 2} <= set(rank_lines(proc.stdout))
    # The others sleep 120 s: deploy returning well before shows they were stopped.
    assert elapsed < 40, f"deploy took {elapsed:.1f} s"
    assert f"kept job {name} for inspection" in proc.stderr
    service = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})[0]
    tasks = swarm.api.tasks(filters={"service": service["ID"]})
    assert tasks and all(t["Status"]["State"] in TERMINAL for t in tasks), tasks
    assert not swarm.api.containers(filters={"label": f"{LABEL_JOB}={name}"})  # none running

    ps = swarmfd("ps", name, timeout=60)
    assert ps.returncode == 0, ps.stderr
    assert f"job {name}: failed: rank 1 exited with code 3" in ps.stdout
    assert ps.stdout.splitlines()[0].endswith(
        f"(3 ranks; rank R runs as task slot R+1, host {name}-<R+1>)"), ps.stdout
    rows = {int(line.split()[0]): line for line in ps.stdout.splitlines()[2:]}
    assert sorted(rows) == [0, 1, 2]
    assert re.match(r"1\s+failed\s+\S+\s+3\s", rows[1]), ps.stdout
    for rank, row in rows.items():  # the host name carries the slot, rank + 1
        assert f" {name}-{rank + 1} " in row + " ", ps.stdout
    for rank in (0, 2):
        assert "stopped by swarmfd after the failure" in rows[rank], ps.stdout

    rm_started = time.monotonic()
    rm = swarmfd("rm", name, timeout=90)
    rm_elapsed = time.monotonic() - rm_started
    assert rm.returncode == 0, rm.stderr
    assert f"removed {name}: 1 service(s), 1 network(s)" in rm.stdout
    assert not any(job_objects(swarm, name).values()), job_objects(swarm, name)
    again = swarmfd("rm", name, timeout=60)
    assert again.returncode == 1
    assert f"no job named {name!r}" in again.stderr
    print(f"failing job: deploy returned after {elapsed:.1f} s, rm took {rm_elapsed:.1f} s")


# --- 3. the stack files -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("stack_file", "service", "env", "expected"),
    [
        ("allreduce.yml", "bench", {"WORLD_SIZE": "3"}, r"# wrong results: 0"),
        ("train.yml", "train", {"WORLD_SIZE": "2", "EPOCHS": "2"},
         r"params identical on all 2 ranks: OK"),
    ],
)
def test_stack_file_deploys_and_completes(swarm: Any, swarmfd_image: str, stack_file: str,
                                          service: str, env: dict[str, str],
                                          expected: str) -> None:
    """`docker stack deploy --resolve-image never` of a stack file: every rank completes."""
    stack = f"sfdt-stack-{uuid.uuid4().hex[:6]}"
    world = int(env["WORLD_SIZE"])
    docker_cli = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    deploy_env = {**os.environ, **env, "SWARMFD_IMAGE": swarmfd_image}
    label = {"label": f"com.docker.stack.namespace={stack}"}
    # The stacks use the external secret swarmfd_secret, made as stacks/README.md says
    # (a test-owned one if none exists; one already there is used and left alone).
    import docker.errors

    own_secret = None
    if not [x for x in swarm.api.secrets(filters={"name": "swarmfd_secret"})
            if x["Spec"]["Name"] == "swarmfd_secret"]:
        own_secret = swarm.api.create_secret(
            "swarmfd_secret", secrets.token_hex(32).encode(),
            labels={"org.swarmfd.test": "1"})["ID"]
    try:
        proc = subprocess.run(
            [docker_cli, "stack", "deploy", "--resolve-image", "never", "-c",
             str(STACKS / stack_file), stack],
            capture_output=True, text=True, timeout=120, env=deploy_env)
        assert proc.returncode == 0, proc.stdout + proc.stderr

        def finished() -> list[dict[str, Any]] | None:
            tasks = swarm.api.tasks(filters={"service": f"{stack}_{service}"})
            done = len(tasks) >= world and all(t["Status"]["State"] in TERMINAL for t in tasks)
            return tasks if done else None

        tasks = wait_until(finished, 150, f"stack {stack}'s tasks to end")
        logs = {
            t["Slot"]: swarm.api.logs(t["Status"]["ContainerStatus"]["ContainerID"]).decode()
            for t in tasks
        }
        states = {t["Slot"]: (t["Status"]["State"], t["Status"].get("Err")) for t in tasks}
        assert all(s == "complete" for s, _ in states.values()), (states, logs)
        assert sorted(logs) == list(range(1, world + 1))
        assert re.search(expected, logs[1]), logs[1]
    finally:
        subprocess.run([docker_cli, "stack", "rm", stack], capture_output=True, timeout=120)
        wait_until(lambda: not swarm.api.containers(all=True, filters=label), 60,
                   f"stack {stack}'s containers to go")
        for net in swarm.api.networks(filters=label):
            wait_until(lambda net=net: _try_remove_network(swarm, net["Id"]), 60,
                       f"network {net['Name']} to be removable")
        if own_secret:
            with contextlib.suppress(docker.errors.NotFound):
                swarm.api.remove_secret(own_secret)


# --- 4. detach, logs -f, ls, ps, logs ---------------------------------------------------

CHATTY = (
    "import os, sys, time\n"
    "import swarmfd as fd\n"
    "fd.init_from_env(timeout=60)  # so rank 0 cannot end before rank 1 resolved its name\n"
    "rank = int(os.environ['RANK'])\n"
    "print(f'out line 1 of rank {rank}', flush=True)\n"
    "print(f'err line of rank {rank}', file=sys.stderr, flush=True)\n"
    "time.sleep(1 + 3 * rank)\n"
    "print(f'out line 2 of rank {rank} LOCAL_RANK={os.environ[\"LOCAL_RANK\"]} '\n"
    "      f'OMP_NUM_THREADS={os.environ.get(\"OMP_NUM_THREADS\")}', flush=True)\n"
    "if rank == 0:\n"
    "    print('options', os.getcwd(), os.environ['GREETING'], open('/data/hello.txt').read(),\n"
    "          fd.get_config().join_timeout, file=sys.stderr, flush=True)\n"
    "fd.barrier()\n"
    "fd.cleanup()\n"
)


def test_detach_logs_ls_ps(swarm: Any, swarmfd_image: str, tmp_path: Path,
                           job_name: Callable[[str], str]) -> None:
    """deploy -d prints the name; logs -f follows to the end; ls, ps and logs show the job,
    which runs the image by ID although it was given by tag, with the options given."""
    name = job_name("show")
    (tmp_path / "hello.txt").write_text("from-the-host")
    # The ranks run as the image's unprivileged user: a bind-mounted directory must be
    # readable by it, as for any container that does not run as root.
    tmp_path.chmod(0o755)
    (tmp_path / "hello.txt").chmod(0o644)
    tag = f"sfdt-image:{uuid.uuid4().hex[:8]}"
    repo, _, version = tag.partition(":")
    assert swarm.images.get(swarmfd_image).tag(repo, version)
    try:
        started = time.monotonic()
        proc = swarmfd("deploy", "-d", tag, "-n", "2", "--name", name, "--label", "team=test",
                       "-e", "GREETING=hi", "--workdir", "/scratch", "--init-timeout", "120",
                       "--mount", "type=tmpfs,dst=/scratch,tmpfs-size=16M",
                       "--mount", f"type=bind,src={tmp_path},dst=/data,readonly",
                       "--limit-memory", "256M", "--reserve-cpu", "0.1", "--limit-cpu", "1",
                       "--", "python", "-c", CHATTY, timeout=60)
        detach_seconds = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == name
        service = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})[0]
        spec = service["Spec"]
        assert spec["TaskTemplate"]["ContainerSpec"]["Image"] == swarmfd_image
        assert spec["Labels"]["team"] == "test"
        assert spec["TaskTemplate"]["Resources"] == {
            "Limits": {"MemoryBytes": 256 << 20, "NanoCPUs": 1_000_000_000},
            "Reservations": {"NanoCPUs": 100_000_000}}

        follow = swarmfd("logs", "-f", name, timeout=90)
        assert follow.returncode == 0, follow.stderr
        out = rank_lines(follow.stdout)
        # The entrypoint gave each task the threads of its CPU limit (1 CPU).
        assert out == {
            0: ["out line 1 of rank 0", "out line 2 of rank 0 LOCAL_RANK=0 OMP_NUM_THREADS=1"],
            1: ["out line 1 of rank 1", "out line 2 of rank 1 LOCAL_RANK=0 OMP_NUM_THREADS=1"]}
        assert rank_lines(follow.stderr) == {
            0: ["err line of rank 0", "options /scratch hi from-the-host 120.0"],
            1: ["err line of rank 1"]}
        wait_until(lambda: all(t["Status"]["State"] == "complete"
                               for t in swarm.api.tasks(filters={"service": service["ID"]})),
                   30, "both tasks complete")

        # The path for ranks on other nodes: Swarm's service log (forced here by
        # claiming that this node is another one) gives the same lines.
        from swarmfd.swarm.follow import RankOutput, print_logs

        remote_out, remote_err = io.BytesIO(), io.BytesIO()
        problems = print_logs(swarm, service["ID"], "some-other-node",
                              RankOutput(remote_out, remote_err))
        assert problems == []
        assert rank_lines(remote_out.getvalue().decode()) == out
        assert rank_lines(remote_err.getvalue().decode()) == rank_lines(follow.stderr)

        ls = swarmfd("ls", timeout=60)
        assert ls.returncode == 0, ls.stderr
        row = next(line for line in ls.stdout.splitlines() if line.startswith(name + " "))
        assert row.split()[:5] == [name, tag, "2", "done", "2"], row
        assert name in swarmfd("ls", "-q", timeout=60).stdout.split()

        ps = swarmfd("ps", name, timeout=60)
        assert ps.returncode == 0, ps.stderr
        assert ps.stdout.splitlines()[0].startswith(f"job {name}: done (2 ranks; ")
        rows = [line.split() for line in ps.stdout.splitlines()[2:]]
        assert [(r[0], r[1], r[3]) for r in rows] == [("0", "complete", "0"),
                                                      ("1", "complete", "0")]

        logs = swarmfd("logs", name, "--rank", "1", timeout=60)
        assert logs.returncode == 0, logs.stderr
        assert rank_lines(logs.stdout) == {1: out[1]}
        merged = swarmfd("logs", "--no-prefix", name, timeout=60)
        # Merged in time order: both first lines before rank 1's delayed second line.
        lines = merged.stdout.splitlines()
        assert lines.index("out line 1 of rank 1") < lines.index(
            "out line 2 of rank 1 LOCAL_RANK=0 OMP_NUM_THREADS=1")
        assert lines.index("out line 2 of rank 0 LOCAL_RANK=0 OMP_NUM_THREADS=1") < lines.index(
            "out line 2 of rank 1 LOCAL_RANK=0 OMP_NUM_THREADS=1")
        print(f"deploy --detach returned after {detach_seconds:.1f} s")
    finally:
        with contextlib.suppress(Exception):
            swarm.images.remove(tag)


# --- 5. bad input: clear errors, nothing created ----------------------------------------


def test_bad_input_is_rejected_before_anything_is_created(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """N<1, a missing image, a name in use and a missing command: errors, nothing created."""
    name = job_name("bad")
    cases = [
        (["deploy", swarmfd_image, "-n", "0", "--name", name, "--", "true"], 2,
         "number of ranks must be >= 1"),
        (["deploy", swarmfd_image, "-n", "2", "--name", name], 2, "missing COMMAND"),
        (["deploy", "sfdt-no-such-image:nope", "-n", "2", "--name", name, "--", "true"], 1,
         "image 'sfdt-no-such-image:nope' is not on this node"),
        (["deploy", swarmfd_image, "-n", "2", "--name", name, "--network", "sfdt-no-net",
          "--", "true"], 1, "--network sfdt-no-net: no such network"),
    ]
    for args, code, message in cases:
        proc = swarmfd(*args, timeout=60)
        assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert not any(job_objects(swarm, name).values()), args

    # A name in use: the existing job is left alone.
    first = swarmfd("deploy", "-d", swarmfd_image, "-n", "1", "--name", name, "--",
                    "sleep", "60", timeout=60)
    assert first.returncode == 0, first.stderr
    service_id = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})[0]["ID"]
    again = swarmfd("deploy", swarmfd_image, "-n", "2", "--name", name, "--", "true", timeout=60)
    assert again.returncode == 1
    assert f"a job named {name!r} already exists" in again.stderr
    assert f"swarmfd rm {name}" in again.stderr
    services = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})
    assert [s["ID"] for s in services] == [service_id]
    assert services[0]["Spec"]["Mode"]["Replicated"]["Replicas"] == 1


# --- Ctrl-C -------------------------------------------------------------------------------


def _default_sigint() -> None:
    """In the CLI's child, before exec: SIGINT as a terminal gives it. A test session
    started in the background by a shell without job control inherits SIGINT ignored,
    and a Python started with SIGINT ignored keeps ignoring it (no KeyboardInterrupt):
    the deploy then never saw this test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_following_and_leaves_the_job(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """SIGINT while following: exit 130, the hint names `swarmfd rm`, the job still runs."""
    name = job_name("intr")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmfd", "deploy", swarmfd_image, "-n", "2", "--name", name,
         "--", "sleep", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_default_sigint)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while not any("all 2 ranks running" in line for line in seen):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the ranks did not all run within 90 s: {seen}"
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=min(remaining, 1.0)))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    err = "".join(seen)
    assert proc.returncode == 130, err
    assert f"job {name} keeps running" in err
    assert f"swarmfd rm {name}" in err
    service = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})[0]
    states = [t["Status"]["State"] for t in swarm.api.tasks(filters={"service": service["ID"]})]
    assert states == ["running", "running"]


# --- per-node local ranks and the start-up figure ---------------------------------------

LOCAL_PROBE = (
    "import time\n"
    "import swarmfd as fd\n"
    "cfg = fd.init_from_env(timeout=60)\n"
    "print(f'local {cfg.rank} {cfg.local_rank} {cfg.local_world_size}', flush=True)\n"
    "fd.barrier()\n"
    "time.sleep(2)  # keep every rank running for a moment: the start-up figure needs it\n"
    "fd.cleanup()\n"
)


def test_four_ranks_start_and_group_per_node(swarm: Any, swarmfd_image: str,
                                             job_name: Callable[[str], str]) -> None:
    """N=4 with --local-ranks node on one node: LOCAL_RANK 0..3 of 4; reports start-up time."""
    name = job_name("four")
    proc = swarmfd("deploy", swarmfd_image, "-n", "4", "--name", name, "--local-ranks", "node",
                   "--", "python", "-c", LOCAL_PROBE, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = sorted(tuple(map(int, line.split()[1:])) for lines in rank_lines(proc.stdout).values()
                   for line in lines if line.startswith("local "))
    assert found == [(0, 0, 4), (1, 1, 4), (2, 2, 4), (3, 3, 4)]
    m = re.search(r"all 4 ranks running after ([\d.]+) s", proc.stderr)
    assert m, proc.stderr
    print(f"deploy -n 4: all 4 ranks running {float(m.group(1)):.1f} s after the deploy call")


# --- the job secret -----------------------------------------------------------------------

# The probes join the group and leave it together: a rank that ended before the others
# started would take its task name out of DNS while they still resolve MASTER_ADDR.
SECRET_PROBE = (
    "import os, stat, sys\n"
    "import swarmfd as fd\n"
    "fd.init_from_env(timeout=60)\n"
    "path = '/run/secrets/swarmfd_secret'\n"
    "st = os.stat(path)\n"
    "value = open(path).read().strip()\n"
    "print(f'secret {len(value)} {oct(stat.S_IMODE(st.st_mode))} {st.st_uid} "
    "as {os.getuid()}', flush=True)\n"
    "# for the test only: hand the value to the host, to look for it where it must not be\n"
    "with open(f'/out/secret-{os.environ[\"RANK\"]}', 'w') as f:\n"
    "    f.write(value)\n"
    "fd.barrier()\n"
    "fd.cleanup()\n"
)


def test_job_secret_is_mounted_in_every_rank_and_exposed_nowhere(
        swarm: Any, swarmfd_image: str, tmp_path: Path,
        job_name: Callable[[str], str]) -> None:
    """deploy creates <job>-secret (labelled), every rank reads the same 64 hex digits at
    /run/secrets/swarmfd_secret (root's, 0444) as the image's unprivileged user (uid
    10001, so /out, a bind mount, is opened to it); the value is in no env, argument,
    label or log line; rm removes the secret with the job."""
    name = job_name("secret")
    tmp_path.chmod(0o777)
    proc = swarmfd("deploy", swarmfd_image, "-n", "2", "--name", name, "--keep",
                   "--mount", f"type=bind,src={tmp_path},dst=/out", "--",
                   "python", "-c", SECRET_PROBE, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert lines == {0: ["secret 64 0o444 0 as 10001"], 1: ["secret 64 0o444 0 as 10001"]}, \
        proc.stdout
    values = {(tmp_path / f"secret-{r}").read_text() for r in (0, 1)}
    assert len(values) == 1
    value = values.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", value)

    found = swarm.api.secrets(filters={"label": f"{LABEL_JOB}={name}"})
    assert [x["Spec"]["Name"] for x in found] == [f"{name}-secret"]
    service = swarm.api.services(filters={"label": f"{LABEL_JOB}={name}"})[0]
    container = service["Spec"]["TaskTemplate"]["ContainerSpec"]
    assert container["Secrets"] == [{
        "SecretID": found[0]["ID"], "SecretName": f"{name}-secret",
        "File": {"Name": "swarmfd_secret", "UID": "0", "GID": "0", "Mode": 0o444}}]
    inspected = str(swarm.api.inspect_service(service["ID"])) + str(found)
    logs = swarmfd("logs", name, timeout=60)
    assert logs.returncode == 0, logs.stderr
    for where, text in (("service/secret inspect", inspected), ("deploy output",
                        proc.stdout + proc.stderr), ("logs", logs.stdout + logs.stderr)):
        assert value not in text, f"the secret appears in the {where}"
    assert not any(value in e for e in container.get("Env", []) + container.get("Args", []))

    rm = swarmfd("rm", name, timeout=90)
    assert rm.returncode == 0, rm.stderr
    assert "1 secret(s)" in rm.stdout
    assert not any(job_objects(swarm, name).values())


# --- --max-restarts ----------------------------------------------------------------------


def test_max_restarts_recreates_the_group_which_resumes_from_its_checkpoint_volume(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """train.py (no --checkpoint-dir: it takes SWARMFD_CHECKPOINT_DIR) fails on restart 0
    after saving epoch 2 to the --checkpoint-volume; deploy --max-restarts 1 recreates
    both ranks with SWARMFD_RESTART_COUNT=1, which resume from the volume and finish:
    exit 0, job removed, the volume kept (with the checkpoint of the last epoch)."""
    import docker.errors

    name = job_name("restart")
    volume = f"{name}-ckpt"
    try:
        started = time.monotonic()
        proc = swarmfd("deploy", swarmfd_image, "-n", "2", "--name", name,
                       "--max-restarts", "1", "--checkpoint-volume", volume, "--",
                       "python", TRAIN, "--epochs", "4", "--fail-at-epoch", "2", timeout=180)
        elapsed = time.monotonic() - started
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert re.search(r"restart 1/1 of job \S+: rank 1 exited with code 3 on node \S+",
                         proc.stderr), proc.stderr
        assert "new ranks created with SWARMFD_RESTART_COUNT=1" in proc.stderr
        assert "simulated failure after epoch 2" in proc.stdout + proc.stderr
        assert "checkpoints: /checkpoints/train_checkpoint.npz every 1 epoch(s)" in proc.stdout
        assert re.search(r"resumed from /checkpoints/train_checkpoint.npz at epoch 2/4 "
                         r"\(restart 1; rank 0's copy\)", proc.stdout), proc.stdout
        assert "epoch   1/4" not in proc.stdout.split("restart=1")[1]  # no epoch run twice
        assert "params identical on all 2 ranks: OK" in proc.stdout
        assert f"job {name} done: all 2 ranks exited 0" in proc.stderr
        assert "(after 1 restart(s))" in proc.stderr
        assert not any(job_objects(swarm, name).values())
        # The volume outlives the job, holding the last epoch's checkpoint.
        out = swarm.containers.run(
            swarmfd_image, ["python", "-c", "import numpy as np; print(int(np.load("
                            "'/c/train_checkpoint.npz')['next_epoch']))"],
            volumes={volume: {"bind": "/c", "mode": "ro"}}, remove=True, entrypoint=[])
        assert out.decode().strip() == "4"
        print(f"deploy --max-restarts 1 --checkpoint-volume (fail, restart, resume): "
              f"{elapsed:.1f} s")
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            swarm.volumes.get(volume).remove(force=True)


def test_max_restarts_gives_up_after_the_last_failure(
        swarm: Any, swarmfd_image: str, job_name: Callable[[str], str]) -> None:
    """A rank that fails every time: K+1 attempts, then deploy exits with its code and
    names it; the failed job is kept (with its secret) for inspection."""
    name = job_name("giveup")
    # Rank 0 outlives rank 1 (deploy stops it when rank 1 fails): rank 1's entrypoint
    # looks rank 0's task name up first, and a rank 0 that ended after 1 s had once
    # left DNS before a loaded CI run's rank 1 resolved it (exit 3, not 4).
    script = ("import os, sys, time\n"
              "print('attempt', os.environ['SWARMFD_RESTART_COUNT'], flush=True)\n"
              "time.sleep(1 if os.environ['RANK'] == '1' else 120)\n"
              "sys.exit(4 if os.environ['RANK'] == '1' else 0)\n")
    proc = swarmfd("deploy", swarmfd_image, "-n", "2", "--name", name, "--max-restarts", "2",
                   "--", "python", "-c", script, timeout=180)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "restart 1/2 of job" in proc.stderr and "restart 2/2 of job" in proc.stderr
    assert re.search(r"job \S+ failed after 2 restart\(s\) \(--max-restarts 2\): rank 1 "
                     r"exited with code 4", proc.stderr), proc.stderr
    assert rank_lines(proc.stdout)[1] == ["attempt 0", "attempt 1", "attempt 2"], (
        proc.stdout + proc.stderr)
    objects = job_objects(swarm, name)
    assert len(objects["services"]) == 1 and len(objects["secrets"]) == 1

