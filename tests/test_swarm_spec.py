"""Pure spec building and task views of the Swarm commands, with plain data (no Docker)."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from swarmfd.swarm import spec as S
from swarmfd.swarm.tasks import (
    TaskView,
    exit_code_for,
    failure_message,
    first_failure,
    job_state,
    latest_per_rank,
    lost_message,
    lost_ranks,
    parse_timestamp,
    phase_of,
    summarize,
)


def make_job(**overrides: object) -> S.JobSpec:
    values: dict[str, object] = {
        "name": "job-1",
        "image": "swarmfd:latest",
        "image_ref": "sha256:" + "ab" * 32,
        "world_size": 3,
        "command": ("python", "train.py"),
    }
    values.update(overrides)
    return S.JobSpec(**values)  # type: ignore[arg-type]


def env_of(spec: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in spec["TaskTemplate"]["ContainerSpec"]["Env"])


# --- the service spec -------------------------------------------------------------------


def test_service_spec_has_the_swarm_contract():
    """replicated N, restart none, dnsrr, init, templated hostname, Args not Command."""
    spec = S.build_service_spec(make_job())
    task = spec["TaskTemplate"]
    container = task["ContainerSpec"]
    assert spec["Name"] == "job-1"
    assert spec["Mode"] == {"Replicated": {"Replicas": 3}}
    assert spec["EndpointSpec"] == {"Mode": "dnsrr"}
    assert task["RestartPolicy"]["Condition"] == "none"
    assert container["Init"] is True
    assert container["Hostname"] == "{{.Service.Name}}-{{.Task.Slot}}"
    assert container["Image"] == "sha256:" + "ab" * 32
    assert container["Args"] == ["python", "train.py"]
    assert "Command" not in container  # Command would replace the entrypoint
    assert task["Networks"] == [{"Target": "job-1"}]


def test_service_env_sets_world_slot_master_and_port():
    """WORLD_SIZE=N, the slot template, MASTER_ADDR=<service>-1, MASTER_PORT."""
    env = env_of(S.build_service_spec(make_job(master_port=1234, timeout=7.5,
                                               init_timeout=600)))
    assert env["WORLD_SIZE"] == "3"
    assert env["SWARMFD_INIT_TIMEOUT"] == "600"
    assert env["SWARMFD_TASK_SLOT"] == "{{.Task.Slot}}"
    assert env["MASTER_ADDR"] == "{{.Service.Name}}-1"
    assert env["MASTER_PORT"] == "1234"
    assert env["SWARMFD_TIMEOUT"] == "7.5"
    assert env["SWARMFD_JOB"] == "job-1"
    assert "SWARMFD_NODE" not in env
    assert "SWARMFD_TIMEOUT" not in env_of(S.build_service_spec(make_job()))
    assert "SWARMFD_INIT_TIMEOUT" not in env_of(S.build_service_spec(make_job()))


def test_user_env_is_kept_and_cannot_override_the_contract():
    """-e values reach the ranks; PYTHONUNBUFFERED is a default the user may change."""
    env = env_of(S.build_service_spec(make_job(env={"A": "1", "PYTHONUNBUFFERED": "0"})))
    assert env["A"] == "1"
    assert env["PYTHONUNBUFFERED"] == "0"
    with pytest.raises(ValueError, match="WORLD_SIZE is set by swarmfd"):
        make_job(env={"WORLD_SIZE": "9"})


def test_local_ranks_per_node_sets_the_node_template():
    """--local-ranks node passes the node's host name, so swarmfd groups ranks per node."""
    env = env_of(S.build_service_spec(make_job(local_ranks="node")))
    assert env["SWARMFD_NODE"] == "{{.Node.Hostname}}"
    with pytest.raises(ValueError, match="--local-ranks"):
        make_job(local_ranks="host")


def test_labels_name_the_job_everywhere():
    """Service, containers and network carry org.swarmfd.job; the service also N and image."""
    job = make_job(labels={"team": "x"}, version="0.1.0")
    spec = S.build_service_spec(job)
    assert spec["Labels"] == {
        "team": "x", S.LABEL_JOB: "job-1", S.LABEL_WORLD_SIZE: "3",
        S.LABEL_IMAGE: "swarmfd:latest", S.LABEL_VERSION: "0.1.0",
    }
    assert spec["TaskTemplate"]["ContainerSpec"]["Labels"] == {"team": "x", S.LABEL_JOB: "job-1"}
    net = S.build_network_spec(job)
    assert net == {"name": "job-1", "driver": "overlay", "attachable": True,
                   "labels": {"team": "x", S.LABEL_JOB: "job-1"}}


def test_resources_placement_mounts_workdir_and_networks():
    """Every option lands in its Engine API field."""
    job = make_job(
        reserve_cpu=S.parse_cpus("0.5"), limit_cpu=S.parse_cpus("2"),
        reserve_memory=S.parse_memory("512M"), limit_memory=S.parse_memory("2G"),
        generic_resources=(S.parse_generic_resource("gpu=1"),),
        constraints=(S.parse_constraint("node.role == worker"),), max_per_node=2,
        mounts=(S.parse_mount("type=bind,src=/data,dst=/data,ro"),),
        workdir="/work", networks=("shared",),
    )
    task = S.build_service_spec(job)["TaskTemplate"]
    assert task["Resources"] == {
        "Limits": {"NanoCPUs": 2_000_000_000, "MemoryBytes": 2 << 30},
        "Reservations": {"NanoCPUs": 500_000_000, "MemoryBytes": 512 << 20,
                         "GenericResources": [
                             {"DiscreteResourceSpec": {"Kind": "gpu", "Value": 1}}]},
    }
    assert task["Placement"] == {"Constraints": ["node.role==worker"], "MaxReplicas": 2}
    assert task["ContainerSpec"]["Mounts"] == [
        {"Type": "bind", "Source": "/data", "Target": "/data", "ReadOnly": True}]
    assert task["ContainerSpec"]["Dir"] == "/work"
    assert task["Networks"] == [{"Target": "job-1"}, {"Target": "shared"}]


def test_encrypt_network_sets_the_overlay_option():
    """--encrypt-network: Docker's `encrypted` overlay option, nothing else changes."""
    plain = S.build_network_spec(make_job())
    assert "options" not in plain
    encrypted = S.build_network_spec(make_job(encrypt_network=True))
    assert encrypted == {**plain, "options": {"encrypted": ""}}


def test_job_secret_is_mounted_as_a_root_only_file_and_restart_count_is_in_the_env():
    """The secret's ID and name (never its value) in the spec: target swarmfd_secret,
    uid/gid 0, mode 0400; SWARMFD_RESTART_COUNT carries the restart count."""
    spec = S.build_service_spec(make_job(restart_count=2), "sid123")
    assert spec["TaskTemplate"]["ContainerSpec"]["Secrets"] == [{
        "SecretID": "sid123", "SecretName": "job-1-secret",
        "File": {"Name": "swarmfd_secret", "UID": "0", "GID": "0", "Mode": 0o400}}]
    assert env_of(spec)["SWARMFD_RESTART_COUNT"] == "2"
    assert "Secrets" not in S.build_service_spec(make_job())["TaskTemplate"]["ContainerSpec"]
    assert env_of(S.build_service_spec(make_job()))["SWARMFD_RESTART_COUNT"] == "0"
    with pytest.raises(ValueError, match="SWARMFD_RESTART_COUNT is set by swarmfd"):
        make_job(env={"SWARMFD_RESTART_COUNT": "1"})
    with pytest.raises(ValueError, match="restart_count must be an integer >= 0"):
        make_job(restart_count=-1)


def test_minimal_spec_has_no_empty_optional_sections():
    """No Resources/Placement/Mounts/Dir unless asked for."""
    task = S.build_service_spec(make_job())["TaskTemplate"]
    assert "Resources" not in task and "Placement" not in task
    assert "Mounts" not in task["ContainerSpec"] and "Dir" not in task["ContainerSpec"]


# --- JobSpec validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"world_size": 0}, r"number of ranks must be >= 1, got -n 0"),
        ({"world_size": -2}, r">= 1"),
        ({"command": ()}, r"missing COMMAND"),
        ({"master_port": 0}, r"--master-port must be in 1\.\.65535"),
        ({"master_port": 70000}, r"--master-port"),
        ({"timeout": 0}, r"--timeout must be a positive"),
        ({"timeout": float("nan")}, r"--timeout"),
        ({"init_timeout": 0}, r"--init-timeout must be a positive"),
        ({"init_timeout": float("inf")}, r"--init-timeout"),
        ({"max_per_node": 0}, r"--max-per-node must be an integer >= 1"),
        ({"workdir": "rel/dir"}, r"--workdir must be an absolute path"),
        ({"networks": ("job-1",)}, r"job's own network"),
        ({"reserve_cpu": 2, "limit_cpu": 1}, r"--reserve-cpu is larger than --limit-cpu"),
        ({"reserve_memory": 2, "limit_memory": 1}, r"--reserve-memory"),
        ({"image": " "}, r"image is empty"),
        ({"name": "Bad_Name"}, r"not DNS-safe"),
    ],
)
def test_jobspec_rejects_bad_values(overrides, message):
    """Each bad value raises ValueError naming the option and what was expected."""
    with pytest.raises(ValueError, match=message):
        make_job(**overrides)


def test_jobspec_type_errors():
    """A non-int N or a non-string command word is a TypeError."""
    with pytest.raises(TypeError):
        make_job(world_size=2.0)
    with pytest.raises(TypeError):
        make_job(command=("python", 3))


def test_duplicate_mount_targets_are_rejected():
    """Two mounts on one target cannot both apply."""
    m = S.parse_mount("type=volume,src=a,dst=/x")
    with pytest.raises(ValueError, match="/x is mounted twice"):
        make_job(mounts=(m, S.parse_mount("type=tmpfs,dst=/x")))


# --- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "job-1", "mnist-run-2", "x" * 50, "a1-b2"])
def test_valid_job_names(name):
    """DNS labels of lowercase letters, digits and hyphens are accepted unchanged."""
    assert S.validate_job_name(name) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty"),
        ("x" * 51, "at most 50"),
        ("Job", "not DNS-safe"),
        ("1job", "not DNS-safe"),
        ("job-", "not DNS-safe"),
        ("job_1", "not DNS-safe"),
        ("job.1", "not DNS-safe"),
        ("-job", "not DNS-safe"),
    ],
)
def test_invalid_job_names(name, message):
    """Names that cannot be DNS labels (or services) are rejected with the rule."""
    with pytest.raises(ValueError, match=message):
        S.validate_job_name(name)


def test_generated_names_are_valid_and_varied():
    """swarmfd-<word>-<4 hex>, valid, and not all the same."""
    names = {S.generate_job_name() for _ in range(50)}
    assert len(names) > 40
    for name in names:
        assert re.fullmatch(r"swarmfd-[a-z]+-[0-9a-f]{4}", name)
        S.validate_job_name(name)


# --- option parsers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512M", 512 << 20), ("2G", 2 << 30), ("2g", 2 << 30), ("1.5G", 3 << 29),
     ("64MiB", 64 << 20), ("512MB", 512 << 20), ("1048576", 1 << 20), ("4k", 4096),
     ("1T", 1 << 40), ("100b", 100)],
)
def test_parse_memory(text, expected):
    """Docker-style sizes, binary units."""
    assert S.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-1G", "G", "12X", "1.2.3M", "ib", "5iB", "0.5"])
def test_parse_memory_rejects(text):
    """Non-sizes and sizes under one byte."""
    with pytest.raises(ValueError, match="size"):
        S.parse_memory(text)


def test_parse_cpus():
    """CPU counts become NanoCPUs; non-positive and non-numbers are rejected."""
    assert S.parse_cpus("0.5") == 500_000_000
    assert S.parse_cpus("4") == 4_000_000_000
    for bad in ("0", "-1", "x", "inf", "nan", "1e-12"):
        with pytest.raises(ValueError, match="cpu"):
            S.parse_cpus(bad)


def test_parse_env_items():
    """KEY=VALUE, values with '=', and bare KEY from the given environment."""
    env = S.parse_env_items(["A=1", "B=x=y", "C=", "HOME"], {"HOME": "/root"})
    assert env == {"A": "1", "B": "x=y", "C": "", "HOME": "/root"}


@pytest.mark.parametrize(
    ("item", "message"),
    [("=1", "expected KEY=VALUE"), ("1A=2", "expected KEY=VALUE"), ("UNSET_X", "not set"),
     ("RANK=1", "-e RANK is not allowed"), ("MASTER_PORT=1", "--master-port"),
     ("SWARMFD_TIMEOUT=3", "--timeout"), ("SWARMFD_INIT_TIMEOUT=3", "--init-timeout")],
)
def test_parse_env_items_rejects(item, message):
    """Malformed keys, unset bare keys, and the variables swarmfd owns."""
    with pytest.raises(ValueError, match=message):
        S.parse_env_items([item], {})


def test_parse_labels():
    """KEY=VALUE and bare KEY; org.swarmfd.* is reserved."""
    assert S.parse_labels(["a=1", "b.c/d=x=y", "flag"]) == {"a": "1", "b.c/d": "x=y", "flag": ""}
    with pytest.raises(ValueError, match="reserved"):
        S.parse_labels(["org.swarmfd.job=x"])
    with pytest.raises(ValueError, match="bad label"):
        S.parse_labels(["=x"])


def test_parse_constraint():
    """== and != constraints are normalised; anything else is rejected."""
    assert S.parse_constraint(" node.labels.gpu == true ") == "node.labels.gpu==true"
    assert S.parse_constraint("node.role!=manager") == "node.role!=manager"
    for bad in ("node.role", "node.role=worker", "==x", "node.role==", "a>b"):
        with pytest.raises(ValueError, match="bad constraint"):
            S.parse_constraint(bad)


def test_parse_generic_resource():
    """Counts are discrete resources, other values named ones."""
    assert S.parse_generic_resource("gpu=2") == {
        "DiscreteResourceSpec": {"Kind": "gpu", "Value": 2}}
    assert S.parse_generic_resource("gpu=GPU-1a2b") == {
        "NamedResourceSpec": {"Kind": "gpu", "Value": "GPU-1a2b"}}
    for bad in ("gpu", "gpu=", "=1", "gpu=0", "g pu=1"):
        with pytest.raises(ValueError, match="generic resource"):
            S.parse_generic_resource(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("type=bind,src=/data,dst=/data",
         {"Type": "bind", "Source": "/data", "Target": "/data"}),
        ("type=bind,source=/a,target=/b,readonly,bind-propagation=rshared",
         {"Type": "bind", "Source": "/a", "Target": "/b", "ReadOnly": True,
          "BindOptions": {"Propagation": "rshared"}}),
        ("src=cache,dst=/cache",
         {"Type": "volume", "Source": "cache", "Target": "/cache"}),
        ("type=volume,src=v,destination=/v,ro=false,volume-nocopy,volume-driver=local,"
         "volume-opt=type=nfs,volume-label=a=b",
         {"Type": "volume", "Source": "v", "Target": "/v", "ReadOnly": False,
          "VolumeOptions": {"NoCopy": True, "Labels": {"a": "b"},
                            "DriverConfig": {"Name": "local", "Options": {"type": "nfs"}}}}),
        ("type=tmpfs,dst=/scratch,tmpfs-size=1G,tmpfs-mode=1777",
         {"Type": "tmpfs", "Target": "/scratch",
          "TmpfsOptions": {"SizeBytes": 1 << 30, "Mode": 0o1777}}),
    ],
)
def test_parse_mount(text, expected):
    """Docker's --mount syntax becomes the Engine API Mount object."""
    assert S.parse_mount(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("type=bind,src=rel,dst=/x", "absolute source"),
        ("type=bind,dst=/x", "absolute source"),
        ("type=volume,src=v,dst=rel", "absolute target"),
        ("type=nfs,dst=/x", "type='nfs'"),
        ("type=bind,src=/a,dst=/b,colour=red", "unknown key 'colour'"),
        ("type=bind,src=/a,dst=/b,src=/c", "given twice"),
        ("type=tmpfs,src=/a,dst=/b", "takes no source"),
        ("type=bind,src=/a,dst=/b,volume-nocopy", "type=volume only"),
        ("type=volume,src=a,dst=/b,tmpfs-size=1M", "type=tmpfs only"),
        ("type=volume,src=a,dst=/b,bind-propagation=shared", "type=bind only"),
        ("type=bind,src=/a,dst=/b,bind-propagation=sideways", "bind-propagation"),
        ("type=bind,src=/a,dst=/b,readonly=maybe", "not true or false"),
        ("type=tmpfs,dst=/b,tmpfs-mode=rwx", "octal"),
        ("type=volume,src=a,dst=/b,volume-opt=novalue", "KEY=VALUE"),
        ("dst", "not KEY=VALUE"),
    ],
)
def test_parse_mount_rejects(text, message):
    """Bad mounts are rejected naming the offending part."""
    with pytest.raises(ValueError, match=re.escape(message)):
        S.parse_mount(text)


# --- task views ---------------------------------------------------------------------------


def task(slot: int, state: str, *, exit_code: int = 0, err: str = "", ts: str = "",
         created: str = "2024-01-01T00:00:00Z", node: str = "n1", tid: str = "") -> dict:
    return {
        "ID": tid or f"t{slot}{state}",
        "Slot": slot,
        "NodeID": node,
        "CreatedAt": created,
        "DesiredState": "running",
        "Status": {"State": state, "Err": err, "Timestamp": ts or "2024-01-01T00:00:01Z",
                   "ContainerStatus": {"ContainerID": f"c{slot}", "ExitCode": exit_code}},
    }


def test_parse_timestamp_handles_nanoseconds_and_trimmed_zeros():
    """Docker trims trailing zeros of the nanoseconds; order must still be right."""
    a = parse_timestamp("2026-11-29T14:48:02.4313Z")
    b = parse_timestamp("2026-11-29T14:48:02.431303559Z")
    assert a < b
    assert b.microsecond == 431303
    assert parse_timestamp("2026-11-29T15:48:02+01:00") == parse_timestamp("2026-11-29T14:48:02Z")
    assert parse_timestamp(None).year == 1970
    assert parse_timestamp("garbage").year == 1970


def test_view_maps_slot_to_rank_and_hides_exit_code_while_running():
    """rank = slot - 1; ExitCode (0 while running) is only trusted in a terminal state."""
    running = TaskView.from_api(task(2, "running"))
    assert (running.rank, running.phase, running.exit_code) == (1, "running", None)
    failed = TaskView.from_api(task(1, "failed", exit_code=3, err="task: non-zero exit (3)"))
    assert (failed.rank, failed.phase, failed.exit_code, failed.terminal) == (0, "failed", 3, True)


def test_phases():
    """Swarm states group into swarmfd's phases."""
    assert [phase_of(s) for s in ("new", "assigned", "preparing", "running", "complete",
                                  "rejected", "shutdown", "weird")] == [
        "pending", "pending", "starting", "running", "done", "failed", "stopped", "pending"]


def test_latest_per_rank_picks_the_newest_task_of_each_slot():
    """Older tasks of a slot (task history) are ignored; slot-less tasks too."""
    views = latest_per_rank([
        task(1, "failed", created="2024-01-01T00:00:00Z", tid="old"),
        task(1, "running", created="2024-01-01T00:00:05Z", tid="new"),
        task(2, "running"),
        {**task(0, "running"), "Slot": None},
    ])
    assert list(views) == [0, 1]
    assert views[0].task_id == "new"


def test_first_failure_is_the_earliest_failed_task():
    """The rank that failed first is blamed, not the ones that failed because of it."""
    views = latest_per_rank([
        task(1, "failed", exit_code=1, ts="2024-01-01T00:00:05.2Z"),
        task(2, "failed", exit_code=3, ts="2024-01-01T00:00:05.1Z"),
        task(3, "running"),
    ]).values()
    failure = first_failure(views)
    assert failure is not None and failure.rank == 1
    assert exit_code_for(failure) == 3
    assert failure_message(failure, "node-a").startswith("rank 1 exited with code 3 on node node-a")


def test_no_failure_while_running_or_done():
    """Running and complete tasks are not failures."""
    views = latest_per_rank([task(1, "complete"), task(2, "running")]).values()
    assert first_failure(views) is None


def test_rejected_and_stopped_tasks_are_failures_with_exit_code_1():
    """A task that never ran has no exit code: deploy exits 1 for it."""
    rejected = TaskView.from_api(task(1, "rejected", err="No such image: x"))
    assert first_failure([rejected]) is rejected
    assert exit_code_for(rejected) == 1
    assert "rejected" in failure_message(rejected) and "No such image" in failure_message(rejected)
    stopped = TaskView.from_api(task(2, "shutdown"))
    assert first_failure([stopped]) is stopped
    assert exit_code_for(stopped) == 1
    # A failed task beats a stopped one, whatever their times.
    assert first_failure([stopped, TaskView.from_api(task(3, "failed", exit_code=2))]).rank == 2


def test_ranks_on_a_node_that_left_are_lost():
    """A task still 'running' on a node the manager declared down is lost; ended tasks
    and tasks on ready nodes are not."""
    views = latest_per_rank([
        task(1, "running", node="n1"), task(2, "failed", exit_code=1, node="n2"),
        task(3, "running", node="n3"), task(4, "running", node="n3"),
        task(5, "complete", node="n3"),
    ]).values()
    lost = lost_ranks(views, ["n3"])
    assert [v.rank for v in lost] == [2, 3]
    assert lost_ranks(views, []) == []
    assert lost_message(lost[0], "node-3", "down (heartbeat failure)") == (
        "rank 2 was lost: its node node-3 is down (heartbeat failure)")


def test_summary_and_job_state():
    """Counts per phase (missing tasks count as pending) and one word for the job."""
    views = list(latest_per_rank([task(1, "running"), task(2, "complete")]).values())
    assert summarize(views, 4) == "2 pending, 1 running, 1 done"
    assert summarize([], None) == "no tasks"
    assert job_state(views, 4) == "running"
    done = list(latest_per_rank([task(1, "complete"), task(2, "complete")]).values())
    assert job_state(done, 2) == "done"
    assert job_state(done, 3) == "pending"
    assert job_state([*views, TaskView.from_api(task(3, "failed", exit_code=1))], 3) == "failed"
    assert job_state([TaskView.from_api(task(1, "preparing"))], 1) == "starting"
    assert job_state([TaskView.from_api(task(1, "shutdown"))], 1) == "stopped"


def test_timestamps_are_timezone_aware():
    """Views compare with aware datetimes (ls computes ages against now in UTC)."""
    view = TaskView.from_api(task(1, "running"))
    assert view.updated.tzinfo is not None
    assert view.updated < dt.datetime.now(dt.timezone.utc)


# --- log plumbing -------------------------------------------------------------------------


def test_line_splitter_keeps_partial_lines_until_complete():
    """Chunks split anywhere still give whole lines; the unterminated rest comes at flush."""
    from swarmfd.swarm.follow import _Lines

    lines = _Lines()
    got = list(lines.feed(b"one\ntw")) + list(lines.feed(b"o\r\nthr")) + list(lines.flush())
    assert got == [b"one", b"two", b"thr"]
    assert list(lines.flush()) == []


def test_line_splitter_cuts_very_long_lines():
    """A line longer than 64 KiB is passed on in 64 KiB pieces, never buffered without end."""
    from swarmfd.swarm.follow import MAX_LINE, _Lines

    pieces = list(_Lines().feed(b"x" * (2 * MAX_LINE + 5)))
    assert [len(p) for p in pieces] == [MAX_LINE, MAX_LINE]


def test_service_log_details_name_the_task():
    """A service log chunk with details starts with the attributes, task ID among them."""
    from swarmfd.swarm.follow import _parse_details

    chunk = (b"com.docker.swarm.node.id=n1,com.docker.swarm.service.id=s1,"
             b"com.docker.swarm.task.id=t42 hello world\n")
    assert _parse_details(chunk) == ("t42", b"hello world\n")


def test_rank_output_prefixes_whole_lines_per_stream():
    """stdout lines go to out, stderr lines to err, each prefixed (or not)."""
    import io

    from swarmfd.swarm.follow import RankOutput

    out, err = io.BytesIO(), io.BytesIO()
    write = RankOutput(out, err)
    write(2, "out", b"hello")
    write(0, "err", b"oops")
    assert (out.getvalue(), err.getvalue()) == (b"[rank 2] hello\n", b"[rank 0] oops\n")
    plain = io.BytesIO()
    RankOutput(plain, plain, prefix=False)(1, "out", b"x")
    assert plain.getvalue() == b"x\n"


# --- the command line, before any engine is contacted -----------------------------------


def deploy(*args: str):
    from swarmfd.cli import main

    # An unreachable engine: any check that got as far as Docker would fail differently.
    return CliRunner().invoke(main, ["deploy", "-H", "tcp://127.0.0.1:9", *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["img", "-n", "0", "--", "true"], "number of ranks must be >= 1"),
        (["img", "-n", "2"], "missing COMMAND"),
        (["img", "-n", "2", "--name", "Bad_Name", "--", "true"], "not DNS-safe"),
        (["img", "-n", "2", "--limit-memory", "lots", "--", "true"], "bad --limit-memory size"),
        (["img", "-n", "2", "-e", "RANK=3", "--", "true"], "-e RANK is not allowed"),
        (["img", "-n", "2", "--mount", "type=bind,dst=/x", "--", "true"], "absolute source"),
        (["img", "-n", "2", "--keep", "--rm", "--", "true"], "contradict"),
        (["img", "-n", "2", "-d", "--rm", "--", "true"], "--rm needs deploy to follow"),
        (["img", "-n", "2", "-d", "--max-restarts", "1", "--", "true"],
         "--max-restarts needs deploy to follow"),
        (["img", "-n", "2", "--max-restarts", "-1", "--", "true"], "-1 is not in the range"),
        (["img", "-n", "2", "python", "-c", "pass"], "put '--' before COMMAND"),
        (["img", "-n", "2", "--init-timeout", "0", "--", "true"],
         "--init-timeout must be a positive number of seconds"),
    ],
)
def test_deploy_rejects_bad_input_before_contacting_docker(args, message):
    """Bad usage exits 2 with a message saying what is wrong, before any Docker call."""
    result = deploy(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_deploy_reports_an_unreachable_engine():
    """Valid input but no engine at --host: exit 1 and say how to start or point at one."""
    result = deploy("img", "-n", "2", "--", "true")
    assert result.exit_code == 1, result.output
    assert "no Docker engine answers at tcp://127.0.0.1:9" in result.output


@pytest.mark.parametrize("command", ["deploy", "ls", "ps", "logs", "rm"])
def test_every_swarm_command_has_an_example_in_its_help(command):
    """--help of each command shows an example invocation."""
    from swarmfd.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert f"swarmfd {command} " in result.output


def test_swarmfd_run_does_not_import_docker():
    """The Swarm commands load the docker SDK lazily: the CLI module alone does not."""
    code = "import sys, swarmfd.cli; sys.exit('docker' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_spec_and_tasks_modules_do_not_import_docker():
    """The pure modules can be used (and tested) without the SDK."""
    code = ("import sys, swarmfd.swarm.spec, swarmfd.swarm.tasks; "
            "sys.exit('docker' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
