"""The container entrypoint: Swarm slot -> RANK, validation, waiting for MASTER_ADDR, exec."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmfd import entrypoint
from swarmfd.entrypoint import (
    EXIT_NOT_FOUND,
    EXIT_UNRESOLVED,
    EXIT_USAGE,
    command_argv,
    cpu_limit,
    resolve_timeout,
    task_env,
    wait_for_host,
)
from swarmfd.errors import ConfigError, RendezvousTimeout

SWARM_ENV = {"SWARMFD_TASK_SLOT": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-1"}


def run_entrypoint(
    args: list[str], env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m swarmfd.entrypoint ARGS`` in a child with exactly ``env`` (plus PATH)."""
    child_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    return subprocess.run(
        [sys.executable, "-m", "swarmfd.entrypoint", *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- task_env: pure translation ---------------------------------------------------------


def test_slot_becomes_zero_based_rank():
    """Slot 2 of 3 is rank 1; the single-container local defaults are filled in."""
    env = task_env(SWARM_ENV)
    assert env["RANK"] == "1"
    assert env["LOCAL_RANK"] == "0"
    assert env["LOCAL_WORLD_SIZE"] == "1"
    assert SWARM_ENV.items() <= env.items()


@pytest.mark.parametrize(("slot", "rank"), [("1", "0"), ("3", "2"), (" 2 ", "1")])
def test_every_slot_maps_to_slot_minus_one(slot, rank):
    """Slots are 1-based: slot 1 is rank 0 and the last slot is WORLD_SIZE-1."""
    assert rank == task_env({**SWARM_ENV, "SWARMFD_TASK_SLOT": slot})["RANK"]


def test_input_mapping_is_not_modified():
    """task_env returns a new dict and leaves its input alone."""
    given = dict(SWARM_ENV)
    task_env(given)
    assert given == SWARM_ENV


def test_explicit_rank_wins_over_slot():
    """An explicitly set RANK is kept (the slot is still validated)."""
    assert task_env({**SWARM_ENV, "RANK": "0"})["RANK"] == "0"


def test_explicit_local_rank_is_kept():
    """LOCAL_RANK/LOCAL_WORLD_SIZE are defaults only."""
    env = task_env({**SWARM_ENV, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2")


def test_node_name_leaves_local_ranks_to_rendezvous():
    """With SWARMFD_NODE set, LOCAL_RANK/LOCAL_WORLD_SIZE stay unset (derived per node)."""
    env = task_env({**SWARM_ENV, "SWARMFD_NODE": "node-a"})
    assert env["RANK"] == "1"
    assert "LOCAL_RANK" not in env
    assert "LOCAL_WORLD_SIZE" not in env


def test_node_name_keeps_explicit_local_ranks():
    """Explicit LOCAL_RANK/LOCAL_WORLD_SIZE survive SWARMFD_NODE unchanged."""
    env = task_env({**SWARM_ENV, "SWARMFD_NODE": "n", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_empty_node_name_keeps_the_container_defaults():
    """An empty SWARMFD_NODE counts as unset: one rank per container."""
    env = task_env({**SWARM_ENV, "SWARMFD_NODE": " "})
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_without_slot_rank_is_left_alone():
    """Outside Swarm (no slot) the entrypoint derives no RANK."""
    env = task_env({"PATH": "/bin"})
    assert "RANK" not in env
    assert env["LOCAL_RANK"] == "0"


def test_slot_beyond_world_size_is_rejected():
    """More replicas than WORLD_SIZE is a deployment error that names both variables."""
    with pytest.raises(ConfigError, match=r"SWARMFD_TASK_SLOT=4 exceeds WORLD_SIZE=3"):
        task_env({**SWARM_ENV, "SWARMFD_TASK_SLOT": "4"})


@pytest.mark.parametrize("slot", ["0", "-1", "abc", "{{.Task.Slot}}", "jfplpnyjjkc7edcebqoqpyiq6"])
def test_bad_slot_is_rejected(slot):
    """A slot that is not 1..N (e.g. the node ID Swarm gives replicated-job tasks) is an error."""
    with pytest.raises(ConfigError, match="SWARMFD_TASK_SLOT"):
        task_env({**SWARM_ENV, "SWARMFD_TASK_SLOT": slot})


def test_slot_without_world_size_is_rejected():
    """A slot alone cannot be validated: WORLD_SIZE is required with it."""
    with pytest.raises(ConfigError, match="WORLD_SIZE is not"):
        task_env({"SWARMFD_TASK_SLOT": "1", "MASTER_ADDR": "job-1"})


def test_world_without_master_addr_is_rejected():
    """A world of several ranks needs MASTER_ADDR; the error says what to set."""
    with pytest.raises(ConfigError, match=r"MASTER_ADDR is not set.*\{\{\.Service\.Name\}\}-1"):
        task_env({"SWARMFD_TASK_SLOT": "1", "WORLD_SIZE": "2"})


def test_world_of_one_needs_no_master_addr():
    """A single replica needs no rendezvous address."""
    assert task_env({"SWARMFD_TASK_SLOT": "1", "WORLD_SIZE": "1"})["RANK"] == "0"


@pytest.mark.parametrize("cpus, want", [(2.0, "2"), (1.5, "1"), (0.25, "1"), (8.0, "8")])
def test_a_cpu_limit_sets_the_threads(cpus, want):
    """A container limited to C CPUs runs floor(C) compute threads, at least 1."""
    assert task_env(SWARM_ENV, cpus)["OMP_NUM_THREADS"] == want
    assert task_env({**SWARM_ENV, "SWARMFD_NODE": "n"}, cpus)["OMP_NUM_THREADS"] == want


def test_threads_the_user_set_or_no_limit_are_left_alone():
    assert task_env({**SWARM_ENV, "OMP_NUM_THREADS": "3"}, 1.0)["OMP_NUM_THREADS"] == "3"
    assert task_env({**SWARM_ENV, "OMP_NUM_THREADS": ""}, 1.0)["OMP_NUM_THREADS"] == ""
    assert "OMP_NUM_THREADS" not in task_env(SWARM_ENV, None)
    assert "OMP_NUM_THREADS" not in task_env(SWARM_ENV)


@pytest.mark.parametrize("files, want", [
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
     3.0),
    ({"cpu/cpu.cfs_quota_us": "50000\n"}, None),  # no period: unknown
    ({"cpu.max": "garbage"}, None),
    ({}, None),
])
def test_cpu_limit_reads_the_cgroup_quota(tmp_path, files, want):
    """cgroup v2's cpu.max, else v1's quota and period; None for no limit or unknown."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_limit(str(tmp_path)) == want


def test_bad_world_size_is_rejected():
    """WORLD_SIZE must be a positive integer."""
    with pytest.raises(ConfigError, match="WORLD_SIZE='zero'"):
        task_env({**SWARM_ENV, "WORLD_SIZE": "zero"})


# --- small helpers ------------------------------------------------------------------------


def test_resolve_timeout_default_and_value():
    """SWARMFD_RESOLVE_TIMEOUT defaults to SWARMFD_INIT_TIMEOUT when set (a job that gives
    its ranks that long to start), else to 60 s, and accepts fractions."""
    assert resolve_timeout({}) == 60.0
    assert resolve_timeout({"SWARMFD_RESOLVE_TIMEOUT": "1.5"}) == 1.5
    assert resolve_timeout({"SWARMFD_INIT_TIMEOUT": "600"}) == 600.0
    assert resolve_timeout({"SWARMFD_INIT_TIMEOUT": "600",
                            "SWARMFD_RESOLVE_TIMEOUT": "2"}) == 2.0


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_resolve_timeout_rejects_bad_values(value):
    """A timeout must be a positive finite number of seconds."""
    with pytest.raises(ConfigError, match="SWARMFD_RESOLVE_TIMEOUT"):
        resolve_timeout({"SWARMFD_RESOLVE_TIMEOUT": value})


def test_command_argv_runs_py_files_with_python():
    """A first word ending in .py runs with the given interpreter; others run as they are."""
    assert command_argv(["train.py", "--x"], python="/py") == ["/py", "train.py", "--x"]
    assert command_argv(["echo", "a.py"], python="/py") == ["echo", "a.py"]
    assert command_argv(["--", "echo", "hi"], python="/py") == ["echo", "hi"]


def test_command_argv_requires_a_command():
    """No command is a usage error."""
    with pytest.raises(ConfigError, match="no command given"):
        command_argv([])


# --- wait_for_host: real resolution ----------------------------------------------------


def test_wait_for_resolvable_host_returns_quickly():
    """localhost resolves at once."""
    assert wait_for_host("localhost", 5.0) < 5.0


def test_wait_for_unresolvable_host_times_out():
    """A name that cannot resolve fails after about the timeout, naming MASTER_ADDR."""
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=r"MASTER_ADDR='nonexistent\.invalid'.*1 s"):
        wait_for_host("nonexistent.invalid", 1.0, interval=0.1)
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed < 5.0


def test_wait_is_bounded_when_the_resolver_hangs():
    """A lookup that never returns cannot stretch the wait past the timeout."""

    def hang(_name: str) -> None:
        time.sleep(30)

    start = time.monotonic()
    with pytest.raises(RendezvousTimeout, match="resolver did not answer"):
        wait_for_host("anything", 0.5, resolve=hang)
    assert time.monotonic() - start < 3.0


def test_wait_succeeds_once_the_name_appears():
    """The wait retries until the name resolves (as rank 0's alias appears in Swarm DNS)."""
    calls: list[str] = []

    def appears_on_third_try(name: str) -> None:
        calls.append(name)
        if len(calls) < 3:
            raise OSError(f"{name}: not yet")

    wait_for_host("job-1", 5.0, interval=0.01, resolve=appears_on_third_try)
    assert calls == ["job-1"] * 3


# --- main: a real child process ---------------------------------------------------------


def test_exec_runs_the_command_with_rank_in_its_env():
    """The command runs (replacing the entrypoint) and sees the derived RANK."""
    env = {**SWARM_ENV, "MASTER_ADDR": "localhost"}
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.getpid())"
    proc = run_entrypoint([sys.executable, "-c", code], env)
    assert proc.returncode == 0, proc.stderr
    rank, world, _pid = proc.stdout.split()
    assert (rank, world) == ("1", "3")


def test_exec_replaces_the_entrypoint_process(tmp_path):
    """execvp keeps the PID: the command is the process that was started (signals reach it)."""
    script = tmp_path / "pid.py"
    script.write_text("import os; print(os.getpid())\n")
    child = subprocess.Popen(
        [sys.executable, "-m", "swarmfd.entrypoint", str(script)],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0
    assert str(child.pid) == out.strip()


def test_exit_code_of_the_command_is_kept():
    """The command's exit status is the container's exit status."""
    proc = run_entrypoint([sys.executable, "-c", "raise SystemExit(7)"], {})
    assert proc.returncode == 7


def test_no_command_prints_usage_and_exits_2():
    """Without a command the entrypoint explains itself and exits 2."""
    proc = run_entrypoint([], {})
    assert proc.returncode == EXIT_USAGE
    assert "usage: python -m swarmfd.entrypoint COMMAND" in proc.stderr


def test_help_exits_0():
    """--help prints the usage on stdout."""
    proc = run_entrypoint(["--help"], {})
    assert proc.returncode == 0
    assert "SWARMFD_TASK_SLOT" in proc.stdout


def test_bad_slot_exits_2_without_running_the_command(tmp_path):
    """A slot beyond WORLD_SIZE stops the task before the command runs."""
    marker = tmp_path / "ran"
    proc = run_entrypoint(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        {**SWARM_ENV, "SWARMFD_TASK_SLOT": "5", "MASTER_ADDR": "localhost"},
    )
    assert proc.returncode == EXIT_USAGE
    assert "SWARMFD_TASK_SLOT=5 exceeds WORLD_SIZE=3" in proc.stderr
    assert not marker.exists()


def test_unresolvable_master_addr_exits_3():
    """MASTER_ADDR that never resolves ends the task with a clear error and exit 3."""
    proc = run_entrypoint(
        ["true"],
        {**SWARM_ENV, "MASTER_ADDR": "nonexistent.invalid", "SWARMFD_RESOLVE_TIMEOUT": "1"},
    )
    assert proc.returncode == EXIT_UNRESOLVED
    assert "MASTER_ADDR='nonexistent.invalid' did not resolve within 1 s" in proc.stderr


def test_missing_command_exits_127():
    """A command that does not exist is reported like a shell would (127)."""
    proc = run_entrypoint(["no-such-command-swarmfd"], {})
    assert proc.returncode == EXIT_NOT_FOUND
    assert "command not found: 'no-such-command-swarmfd'" in proc.stderr


def test_core_module_imports_neither_docker_nor_click_nor_zmq():
    """The entrypoint is a core module: its own imports include no docker, click or zmq."""
    tree = ast.parse(Path(entrypoint.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }
    assert set() == imported & {"docker", "click", "zmq"}


# --- the user the ranks run as -----------------------------------------------------------


def test_a_root_container_runs_the_command_as_the_images_user():
    """Started as root: the image's swarmfd user, or SWARMFD_USER's; root with
    SWARMFD_USER=root; as is when not root, or when the image has no swarmfd user (an
    image not built from the swarmfd one); a SWARMFD_USER the image lacks is refused."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    assert entrypoint.rank_user({"SWARMFD_USER": "nobody"}, 0) == nobody
    assert entrypoint.rank_user({"SWARMFD_USER": "nobody"}, 1000) is None
    assert entrypoint.rank_user({"SWARMFD_USER": "root"}, 0) is None
    has_swarmfd = any(p.pw_name == "swarmfd" for p in pwd.getpwall())
    assert (entrypoint.rank_user({}, 0) is not None) == has_swarmfd
    with pytest.raises(ConfigError, match="SWARMFD_USER='no-such-user'"):
        entrypoint.rank_user({"SWARMFD_USER": "no-such-user"}, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing users needs root")
def test_become_gives_the_checkpoint_directory_then_drops_root():
    """become(): a root-owned checkpoint directory is given to the user, then the process
    runs as that user, without root's groups (in a child: it cannot go back)."""
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="swarmfd-test-become-")  # (pytest's are root's only)
    os.chmod(top, 0o755)
    ckpt = Path(top) / "ckpt"
    ckpt.mkdir()
    code = ("import os, pwd, sys\n"
            "from swarmfd import entrypoint\n"
            "env = {'SWARMFD_CHECKPOINT_DIR': sys.argv[1]}\n"
            "entrypoint.become(pwd.getpwnam('nobody'), env)\n"
            "print(os.getuid(), os.getgid(), os.getgroups(), os.stat(sys.argv[1]).st_uid,\n"
            "      env['HOME'], os.access(sys.argv[1], os.W_OK))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True,
                             text=True, timeout=30)
    finally:
        shutil.rmtree(top)
    assert out.returncode == 0, out.stderr
    import pwd

    nobody = pwd.getpwnam("nobody")
    assert out.stdout.split() == [str(nobody.pw_uid), str(nobody.pw_gid), "[]",
                                  str(nobody.pw_uid), nobody.pw_dir, "True"], out.stdout


def test_an_elastic_job_takes_slots_beyond_its_starting_world():
    """A scaled-up elastic service has slots beyond WORLD_SIZE: replacements, not errors."""
    env = task_env({**SWARM_ENV, "SWARMFD_TASK_SLOT": "5", "SWARMFD_ELASTIC": "1"})
    assert env["RANK"] == "4"
