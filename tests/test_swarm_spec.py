"""Pure spec building and task views of the Swarm commands, with plain data (no Docker)."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time

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
    lost_peer,
    lost_ranks,
    parse_timestamp,
    phase_of,
    root_failure,
    summarize,
)


def make_job(**overrides: object) -> S.JobSpec:
    values: dict[str, object] = {
        "name": "job-1",
        "image": "swarmfd:latest",
        "image_ref": "sha256:" + "ab" * 32,
        "world_size": 3,
        "command": ("python", "train.py"),
        "launch_id": "0a1b2c3d4e5f",
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
    # the node is the rank's host; local ranks stay per container (0 of 1) by default
    assert env["SWARMFD_NODE"] == "{{.Node.Hostname}}"
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")
    assert "SWARMFD_TIMEOUT" not in env_of(S.build_service_spec(make_job()))
    # swarmfd's rendezvous port is derived in each rank (MASTER_PORT + 1), or chosen with -e
    assert "SWARMFD_PORT" not in env
    assert env_of(S.build_service_spec(make_job(
        master_port=65535, env={"SWARMFD_PORT": "4000"})))["SWARMFD_PORT"] == "4000"
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
    assert "LOCAL_RANK" not in env and "LOCAL_WORLD_SIZE" not in env  # derived per node
    # per container, the user's own values win
    env = env_of(S.build_service_spec(make_job(env={"LOCAL_RANK": "3"})))
    assert (env["LOCAL_RANK"], env["SWARMFD_NODE"]) == ("3", "{{.Node.Hostname}}")
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
        {"Type": "bind", "Source": "/data", "Target": "/data", "ReadOnly": True}, SHM_MOUNT]
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
    uid/gid 0, mode 0444 (the ranks run unprivileged); SWARMFD_RESTART_COUNT carries the
    restart count."""
    spec = S.build_service_spec(make_job(restart_count=2), "sid123")
    assert spec["TaskTemplate"]["ContainerSpec"]["Secrets"] == [{
        "SecretID": "sid123", "SecretName": "job-1-secret",
        "File": {"Name": "swarmfd_secret", "UID": "0", "GID": "0", "Mode": 0o444}}]
    assert env_of(spec)["SWARMFD_RESTART_COUNT"] == "2"
    assert "Secrets" not in S.build_service_spec(make_job())["TaskTemplate"]["ContainerSpec"]
    assert env_of(S.build_service_spec(make_job()))["SWARMFD_RESTART_COUNT"] == "0"
    with pytest.raises(ValueError, match="SWARMFD_RESTART_COUNT is set by swarmfd"):
        make_job(env={"SWARMFD_RESTART_COUNT": "1"})
    with pytest.raises(ValueError, match="restart_count must be an integer >= 0"):
        make_job(restart_count=-1)


def test_minimal_spec_has_no_empty_optional_sections():
    """No Resources/Placement/Mounts/Dir unless asked for (ranks that may share a node
    mount the node's shared-memory volume; one rank per node needs none)."""
    task = S.build_service_spec(make_job(max_per_node=1))["TaskTemplate"]
    assert "Resources" not in task
    assert "Mounts" not in task["ContainerSpec"] and "Dir" not in task["ContainerSpec"]
    task = S.build_service_spec(make_job())["TaskTemplate"]
    assert "Resources" not in task and "Placement" not in task
    assert task["ContainerSpec"]["Mounts"] == [SHM_MOUNT]


SHM_MOUNT = {"Type": "volume", "Source": "swarmfd-shm-job-1-0a1b2c3d4e5f",
             "Target": "/run/swarmfd-shm",
             "VolumeOptions": {"NoCopy": True, "Labels": {"org.swarmfd.job": "job-1"},
                               "DriverConfig": {"Name": "local", "Options": {
                                   "type": "tmpfs", "device": "tmpfs", "o": "size=1m"}}}}


def test_ranks_that_may_share_a_node_mount_their_jobs_own_shared_memory_volume():
    """Several ranks, not --max-per-node 1: a tmpfs volume of the job's own (named after
    the job and its launch id, labelled with the job) at /run/swarmfd-shm and
    SWARMFD_SHM_DIR naming it (the contract: -e cannot point it elsewhere while the
    volume is mounted); -e SWARMFD_SHM_DIR=DIR instead is the user's own directory (and
    mount), and then nothing is added. Two deploys never share a volume, and a --mount
    of such a volume (another job's) is refused."""
    spec = S.build_service_spec(make_job(max_per_node=2))
    assert SHM_MOUNT in spec["TaskTemplate"]["ContainerSpec"]["Mounts"]
    assert env_of(spec)["SWARMFD_SHM_DIR"] == S.SHM_TARGET == "/run/swarmfd-shm"
    assert env_of(spec)["SWARMFD_JOB_ID"] == "0a1b2c3d4e5f"
    one, two = (S.JobSpec("job-1", "swarmfd", "sha256:" + "ab" * 32, 2, ("python",))
                for _ in range(2))
    assert one.launch_id != two.launch_id and one.shm_volume() != two.shm_volume()
    with pytest.raises(ValueError, match="a job mounts only its own"):
        make_job(mounts=(S.parse_mount("type=volume,src=swarmfd-shm-other-1234,dst=/x"),))
    with pytest.raises(ValueError, match="SWARMFD_JOB_ID is set by swarmfd"):
        make_job(env={"SWARMFD_JOB_ID": "mine"})
    for job in (make_job(max_per_node=1), make_job(world_size=1)):
        spec = S.build_service_spec(job)
        assert "Mounts" not in spec["TaskTemplate"]["ContainerSpec"]
        assert "SWARMFD_SHM_DIR" not in env_of(spec)
    own = S.build_service_spec(make_job(
        env={"SWARMFD_SHM_DIR": "/shared"},
        mounts=(S.parse_mount("type=volume,src=mine,dst=/shared"),)))
    assert own["TaskTemplate"]["ContainerSpec"]["Mounts"] == [
        {"Type": "volume", "Source": "mine", "Target": "/shared"}]
    assert env_of(own)["SWARMFD_SHM_DIR"] == "/shared"
    with pytest.raises(ValueError, match="the target /run/swarmfd-shm is mounted twice"):
        make_job(mounts=(S.parse_mount("type=tmpfs,dst=/run/swarmfd-shm"),))


# --- JobSpec validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"world_size": 0}, r"number of ranks must be >= 1, got -n 0"),
        ({"world_size": -2}, r">= 1"),
        ({"command": ()}, r"missing COMMAND"),
        ({"master_port": 0}, r"--master-port must be in 1\.\.65535"),
        ({"master_port": 70000}, r"--master-port"),
        ({"master_port": 65535},
         r"MASTER_PORT=65535 leaves no port for swarmfd's rendezvous.*\(MASTER_PORT is "
         r"--master-port, SWARMFD_PORT -e SWARMFD_PORT=PORT\)"),
        ({"env": {"SWARMFD_PORT": "70000"}}, r"SWARMFD_PORT='70000' is invalid: expected a TCP"),
        ({"env": {"SWARMFD_PORT": "x"}}, r"SWARMFD_PORT='x' is not an integer"),
        ({"master_port": 4000, "env": {"SWARMFD_PORT": "4000"}},
         r"SWARMFD_PORT=4000 is MASTER_PORT too"),
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


def test_checkpoint_volume_mounts_a_named_volume_and_sets_the_directory():
    """--checkpoint-volume NAME: a volume mount at /checkpoints, SWARMFD_CHECKPOINT_DIR set,
    next to the other mounts."""
    spec = S.build_service_spec(make_job(
        checkpoint_volume="mnist-ckpt",
        mounts=(S.parse_mount("type=tmpfs,dst=/scratch"),)))
    container = spec["TaskTemplate"]["ContainerSpec"]
    assert container["Mounts"] == [
        {"Type": "tmpfs", "Target": "/scratch"},
        {"Type": "volume", "Source": "mnist-ckpt", "Target": S.CHECKPOINT_TARGET}, SHM_MOUNT]
    assert env_of(spec)["SWARMFD_CHECKPOINT_DIR"] == S.CHECKPOINT_TARGET == "/checkpoints"
    assert "SWARMFD_CHECKPOINT_DIR" not in env_of(S.build_service_spec(make_job()))


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


#: The last lines of a rank that failed because its peer did (swarmfd's PeerLostError).
LOST_RANK_1 = [
    "[rank 0]   File \"/opt/venv/lib/python3.11/site-packages/swarmfd/comm/channel.py\", line 482",
    "swarmfd.errors.PeerLostError: all_reduce (call #46 on rank 0) (all_reduce, op=mean, "
    "dtype=float32, shape=6 arrays, 4547 elements): lost rank 1 (host vm, pid 8, "
    "tcp://10.0.11.3:35665; task slot 2): its connection closed (the process died or "
    "exited, or its host stopped answering TCP keepalive probes) before it sent its data",
]


def test_lost_peer_is_read_from_a_peer_lost_traceback():
    """The rank a PeerLostError names; None for output without one (a rank's own
    message that mentions a lost rank is not swarmfd's error)."""
    assert lost_peer(LOST_RANK_1) == 1
    assert lost_peer(["rank 1: simulated failure after epoch 2"]) is None
    assert lost_peer(["we lost rank 3 (said the user)", "ValueError: bad"]) is None
    assert lost_peer([LOST_RANK_1[1].replace("rank 1 (", "rank 2 ("), LOST_RANK_1[1]]) == 1


def test_root_failure_follows_the_lost_peer_that_failed_too():
    """Swarm reported rank 0 (exit 1, it lost rank 1) before rank 1 (exit 3): rank 1 is
    the cause. Followed along a chain, never round a loop, and only to a peer that
    failed: one that ended well or still runs is not the cause."""
    views = latest_per_rank([
        task(1, "failed", exit_code=1, ts="2024-01-01T00:00:05.1Z"),
        task(2, "failed", exit_code=3, ts="2024-01-01T00:00:05.2Z"),
        task(3, "failed", exit_code=143, ts="2024-01-01T00:00:05.3Z"),
    ])
    first = first_failure(views.values())
    assert first is not None and first.rank == 0
    root = root_failure(first, views, {0: LOST_RANK_1, 1: ["rank 1: simulated failure"]})
    assert root.rank == 1 and exit_code_for(root) == 3
    lost = {0: LOST_RANK_1, 1: [LOST_RANK_1[1].replace("rank 1 (", "rank 2 (")]}
    assert root_failure(first, views, lost).rank == 2  # 0 lost 1, which lost 2
    loop = {0: LOST_RANK_1, 1: [LOST_RANK_1[1].replace("rank 1 (", "rank 0 (")]}
    assert root_failure(first, views, loop).rank == 1
    assert root_failure(first, views, {}) is first  # no logs: Swarm's order
    done = latest_per_rank([task(1, "failed", exit_code=1), task(2, "complete")])
    assert root_failure(done[0], done, {0: LOST_RANK_1}) is done[0]
    running = latest_per_rank([task(1, "failed", exit_code=1), task(2, "running")])
    assert root_failure(running[0], running, {0: LOST_RANK_1}) is running[0]


def test_no_failure_while_running_or_done():
    """Running and complete tasks are not failures."""
    views = latest_per_rank([task(1, "complete"), task(2, "running")]).values()
    assert first_failure(views) is None


def test_rejected_and_stopped_tasks_are_failures_with_exit_code_1():
    """A task that never ran has no exit code: deploy exits 1 for it."""
    rejected = TaskView.from_api(task(1, "rejected", err="No such image: x"))
    # What to do about an image missing on a node is part of the message.
    assert "push it to a registry every node can reach" in failure_message(rejected, "n2")
    assert "docker save IMAGE | ssh NODE docker load" in failure_message(rejected, "n2")
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
    from swarmfd.swarm.follow import LineSplitter

    lines = LineSplitter()
    got = list(lines.feed(b"one\ntw")) + list(lines.feed(b"o\r\nthr")) + list(lines.flush())
    assert got == [b"one", b"two", b"thr"]
    assert list(lines.flush()) == []


def test_line_splitter_cuts_very_long_lines():
    """A line longer than 64 KiB is passed on in 64 KiB pieces, never buffered without end."""
    from swarmfd.swarm.follow import MAX_LINE, LineSplitter

    pieces = list(LineSplitter().feed(b"x" * (2 * MAX_LINE + 5)))
    assert [len(p) for p in pieces] == [MAX_LINE, MAX_LINE]


def test_log_drain_says_which_ranks_output_it_could_not_read():
    """A rank's log stream that has not ended when the drain's time is up, and a stream
    that failed, are named on the progress line: deploy never drops output silently (a
    restart removes the failed attempt's service, and its logs with it)."""
    import threading

    from swarmfd.swarm.follow import LogPump

    release = threading.Event()
    pump = LogPump(None, "service", "node", lambda *a: None)  # type: ignore[arg-type]
    pump._start(release.wait, 30, local=True, rank=3)  # a stream still open
    pump._start(lambda: None, local=True, rank=1)  # one that ended
    pump.errors.append("rank 2: its container is gone (no logs)")
    said: list[str] = []
    try:
        pump.drain(0.2, said.append, "job-x")
    finally:
        release.set()
    assert len(said) == 2, said
    assert said[0].startswith("job-x: warning: the output of rank(s) [3] was not read"), said
    assert said[1] == "job-x: warning: rank 2: its container is gone (no logs)"
    said.clear()
    pump.errors.clear()
    pump.drain(5, said.append, "job-x")
    assert said == []


def test_log_pump_waits_for_the_named_ranks_readers_only():
    """At a failure deploy first reads the ended ranks' logs (wait_for), bounded, and
    does not wait for ranks that still run."""
    import threading

    from swarmfd.swarm.follow import LogPump

    running, ended = threading.Event(), threading.Event()
    pump = LogPump(None, "service", "node", lambda *a: None)  # type: ignore[arg-type]
    pump._start(running.wait, 30, local=True, rank=0)  # a rank that still runs
    pump._start(lambda: (time.sleep(0.2), ended.set()), local=True, rank=1)  # being read
    t0 = time.monotonic()
    pump.wait_for([1], 5)
    assert ended.is_set() and time.monotonic() - t0 < 2
    t0 = time.monotonic()
    pump.wait_for([0], 0.2)  # bounded: the stream of a running rank does not end
    assert 0.15 < time.monotonic() - t0 < 2
    assert pump.unread() == [0]
    running.set()


def test_service_log_details_name_the_task():
    """A service log chunk with details starts with the attributes, task ID among them."""
    from swarmfd.swarm.follow import parse_details

    chunk = (b"com.docker.swarm.node.id=n1,com.docker.swarm.service.id=s1,"
             b"com.docker.swarm.task.id=t42 hello world\n")
    assert parse_details(chunk) == ("t42", b"hello world\n")


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
        (["img", "-n", "2", "--max-restarts", "-1", "--", "true"],
         "--max-restarts must be an integer >= 0 (a number of restarts), got -1"),
        (["img", "-n", "2", "python", "-c", "pass"], "put '--' before COMMAND"),
        (["img", "-n", "2", "--init-timeout", "0", "--", "true"],
         "--init-timeout must be a positive number of seconds"),
        (["--build", ".", "-n", "2", "python", "x.py"], "with --build, put '--' before"),
        (["--build", ".", "img", "-n", "2", "--", "true"], "give no IMAGE (got 'img'"),
        (["img", "-n", "2", "--extra", "torch", "--", "true"], "apply to --build DIR"),
        (["--build", ".", "-n", "2", "--no-index", "--", "true"], "--no-index needs a"),
        (["--build", ".", "-n", "2", "--image-name", "Bad", "--", "true"],
         "is not a valid repository"),
        (["img", "-n", "2", "--push", "http://reg:5000", "--", "true"], "without a scheme"),
        (["img", "-n", "2", "--push", "reg", "--", "true"], "expected a registry"),
        (["img", "-n", "2", "--push", "reg:5000", "--pull", "--", "true"], "drop --pull"),
        (["img", "-n", "2", "--checkpoint-volume", "a b", "--", "true"],
         "expected a volume name"),
        (["img", "-n", "2", "--checkpoint-volume", "ck", "-e", "SWARMFD_CHECKPOINT_DIR=/x",
          "--", "true"], "set by --checkpoint-volume"),
        (["img", "-n", "2", "--checkpoint-volume", "ck", "--mount",
          "type=tmpfs,dst=/checkpoints", "--", "true"], "where --checkpoint-volume mounts"),
    ],
)
def test_deploy_rejects_bad_input_before_contacting_docker(args, message):
    """Bad usage exits 2 with a message saying what is wrong, before any Docker call."""
    result = deploy(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_deploy_build_takes_every_word_as_the_command():
    """With --build there is no IMAGE: every word after '--' is COMMAND (checked as far as
    the unreachable engine, which proves the arguments parsed)."""
    result = deploy("--build", ".", "-n", "2", "--", "python", "train.py", "--epochs", "3")
    assert result.exit_code == 1, result.output
    assert "no Docker engine answers" in result.output


def test_deploy_reports_an_unreachable_engine():
    """Valid input but no engine at --host: exit 1 and say how to start or point at one."""
    result = deploy("img", "-n", "2", "--", "true")
    assert result.exit_code == 1, result.output
    assert "no Docker engine answers at tcp://127.0.0.1:9" in result.output


@pytest.mark.parametrize("command", ["build", "deploy", "ls", "ps", "logs", "rm"])
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


# --- swarmfd build: the project, the hash, the target, the Dockerfile, pip -------------

from swarmfd.swarm import build as B  # noqa: E402
from tests.swarm.wheels import make_wheel  # noqa: E402


def write(path, text: str = "", mode: int = 0o644):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def test_read_project_lists_files_without_git_venvs_caches_and_ignored(tmp_path):
    """.git, virtual environments, caches and what .dockerignore names stay out."""
    write(tmp_path / "train.py", "print(1)")
    write(tmp_path / "requirements.txt", "six\n")
    write(tmp_path / "pkg" / "model.py")
    write(tmp_path / "pkg" / "__pycache__" / "model.cpython-311.pyc")
    write(tmp_path / ".git" / "HEAD")
    write(tmp_path / ".venv" / "bin" / "python")
    write(tmp_path / "data" / "big.bin")
    write(tmp_path / "notes.log")
    write(tmp_path / ".dockerignore", "data\n*.log\n")
    project = B.read_project(tmp_path)
    assert project.files == ("pkg/model.py", "requirements.txt", "train.py")
    assert project.requirements_file == "requirements.txt"
    assert project.requirements == () and not project.installable
    assert B.repository_for(project).startswith("swarmfd-")


def test_read_project_takes_pyproject_dependencies_and_extras(tmp_path):
    """PEP 621 dependencies, a project extra, the built-in torch extra; installable with
    a [build-system]."""
    write(tmp_path / "pyproject.toml", """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "My_Model"
version = "1"
dependencies = ["six>=1"]
[project.optional-dependencies]
plots = ["tabulate"]
""")
    project = B.read_project(tmp_path, ["plots", "torch"])
    assert project.requirements == ("six>=1", "tabulate", "torch==2.13.0")
    assert project.installable and project.name == "My_Model"
    assert B.repository_for(project) == "swarmfd-my-model"
    with pytest.raises(B.BuildError, match="--extra gpu: not an extra of"):
        B.read_project(tmp_path, ["gpu"])


@pytest.mark.parametrize(
    ("pyproject", "message"),
    [
        ("[tool.poetry]\nname='x'\n", "has no \\[project\\] table"),
        ("[project]\nname='x'\ndynamic=['dependencies']\n", "declares its dependencies dynamic"),
        ("[project\n", "cannot be read"),
    ],
)
def test_read_project_rejects_unusable_pyproject(tmp_path, pyproject, message):
    write(tmp_path / "pyproject.toml", pyproject)
    with pytest.raises(B.BuildError, match=message):
        B.read_project(tmp_path)


def test_read_project_rejects_a_missing_directory(tmp_path):
    with pytest.raises(B.BuildError, match="does not exist"):
        B.read_project(tmp_path / "nope")


def test_content_hash_follows_content_not_mtime(tmp_path):
    """Same files: same hash (whatever the mtime); a changed byte, mode, base image,
    extra or wheel option: another hash."""
    script = write(tmp_path / "train.py", "print(1)\n")
    base = "sha256:" + "1" * 64

    def digest(extras=(), base_id=base, options=None):
        return B.content_hash(B.read_project(tmp_path, extras), base_id,
                              options or B.BuildOptions())

    first = digest()
    os.utime(script, (1, 1))
    assert digest() == first
    seen = {first}
    script.write_text("print(2)\n")
    seen.add(digest())
    script.chmod(0o755)
    seen.add(digest())
    seen.add(digest(base_id="sha256:" + "2" * 64))
    seen.add(digest(extras=("torch",)))
    seen.add(digest(options=B.BuildOptions(cpu_torch=False)))
    assert len(seen) == 6


def test_repository_names():
    assert B.validate_repository("team/my-model") == "team/my-model"
    for bad in ("My", "a:b", "-x", ""):
        with pytest.raises(B.BuildError, match="not a valid repository"):
            B.validate_repository(bad)


def test_parse_registry():
    assert B.parse_registry("172.30.76.11:5000/") == "172.30.76.11:5000"
    assert B.parse_registry("registry.example.com/team") == "registry.example.com/team"
    assert B.parse_registry("localhost") == "localhost"
    for bad, message in (("https://r.io", "without a scheme"), ("reg", "expected a registry"),
                         ("r.io/Team", "lowercase")):
        with pytest.raises(ValueError, match=message):
            B.parse_registry(bad)


PROBE = {"python": "3.11", "implementation": "cpython", "machine": "x86_64",
         "libc": "glibc", "libc_version": "2.36", "executable": "/opt/venv/bin/python",
         "installed": {"NumPy": "2.4.6", "swarmfd": "0.1.0", "pyzmq": "27.3.0"},
         "has_pip": True}


def test_target_from_the_image_probe():
    """The base image's Python as pip's download options: versions, ABI, platform tags
    from its glibc down, installed names normalized."""
    target = B.target_from_probe(PROBE)
    assert (target.python, target.abi, target.executable) == ("3.11", "cp311",
                                                               "/opt/venv/bin/python")
    platforms = target.platforms()
    assert platforms[0] == "manylinux_2_36_x86_64"
    assert "manylinux_2_17_x86_64" in platforms and "manylinux2014_x86_64" in platforms
    assert platforms[-1] == "linux_x86_64"
    assert target.installed == {"numpy": "2.4.6", "swarmfd": "0.1.0", "pyzmq": "27.3.0"}
    with pytest.raises(B.BuildError, match="musl"):
        B.target_from_probe({**PROBE, "libc": "", "libc_version": ""}).platforms()
    with pytest.raises(B.BuildError, match="not CPython"):
        B.target_from_probe({**PROBE, "implementation": "ironpython"})


def test_dockerfile_keeps_wheels_out_of_the_final_stage():
    """With wheels: a deps stage installs them under a staging root, the final stage
    copies the installed files, then the project to /workspace; pip check at the end."""
    target = B.target_from_probe(PROBE)
    text = B.dockerfile("sha256:base", target, deps_hash="abc", project_wheel=None,
                        labels={"org.swarmfd.build.content": "h"})
    stages = text.split("FROM ")[1:]
    assert stages[0].startswith("sha256:base AS deps")
    assert "COPY wheels/" in stages[0] and "--root /tmp/swarmfd-root" in stages[0]
    assert "wheels" not in stages[1].replace("swarmfd-wheels", "")
    assert "COPY --from=deps /tmp/swarmfd-root/ /" in stages[1]
    assert "COPY project/ /workspace/" in stages[1] and "WORKDIR /workspace" in stages[1]
    assert "pip check" in stages[1]
    plain = B.dockerfile("sha256:base", target, deps_hash=None, project_wheel="p-1-py3.whl",
                         labels={})
    assert plain.count("FROM ") == 1 and "AS deps" not in plain
    assert "--no-deps /tmp/swarmfd-own/p-1-py3.whl" in plain


def test_context_holds_dockerfile_wheels_and_project(tmp_path):
    import io
    import tarfile

    write(tmp_path / "p" / "train.py", "x")
    write(tmp_path / "p" / "run.sh", "#!/bin/sh\n", 0o755)
    wheel = make_wheel(tmp_path / "wh", "tiny", "1.0")
    buf = io.BytesIO()
    B.write_context(buf, B.read_project(tmp_path / "p"), "FROM x\n", [wheel], None)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert tar.extractfile("Dockerfile").read() == b"FROM x\n"
    assert {"project/train.py", "project/run.sh", f"wheels/{wheel.name}"} <= set(members)
    assert members["project/run.sh"].mode == 0o755
    assert {m.uid for m in members.values()} == {0}


@pytest.fixture
def isolated_pip(monkeypatch):
    """pip without this machine's configuration (no index, no find-links): the wheel
    resolution below sees only the folders a test gives it."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for key in list(os.environ):
        if key.startswith("PIP_") and key != "PIP_CONFIG_FILE":
            monkeypatch.delenv(key)


def test_resolve_wheels_offline_keeps_the_base_packages(tmp_path, isolated_pip):
    """A package from a wheelhouse whose dependency the base image has (numpy): only
    the package is carried, numpy stays the base's (found without any index)."""
    wh = tmp_path / "wh"
    make_wheel(wh, "swarmfd-probe-pkg", "1.0", requires=["numpy>=1.24"])
    write(tmp_path / "p" / "requirements.txt", "swarmfd-probe-pkg==1.0\n")
    lines = []
    wheels = B.resolve_wheels(B.read_project(tmp_path / "p"), B.target_from_probe(PROBE),
                              B.BuildOptions(wheelhouses=(wh,), no_index=True),
                              tmp_path / "out", lines.append)
    assert [w.name for w in wheels] == ["swarmfd_probe_pkg-1.0-py3-none-any.whl"]
    assert any("swarmfd_probe_pkg-1.0" in line for line in lines), lines


def test_resolve_wheels_constrains_torch_to_the_cpu_wheel(tmp_path, isolated_pip):
    """A requirement on torch takes torch 2.13.0+cpu over the same version's CUDA build
    (metadata-only stand-ins here); with only the CUDA build, the error says where the
    CPU wheel comes from, and --no-cpu-torch lets the requirements decide."""
    wh = tmp_path / "wh"
    tag = "cp311-cp311-manylinux_2_28_x86_64"
    make_wheel(wh, "torch", "2.13.0", tag=tag)
    write(tmp_path / "p" / "requirements.txt", "torch>=2\n")
    project = B.read_project(tmp_path / "p")
    target = B.target_from_probe(PROBE)
    with pytest.raises(B.BuildError, match=r"constrained to its CPU build \(torch==2.13.0\+cpu\)"
                                           ", which pip did not find.*download.pytorch.org"):
        B.resolve_wheels(project, target, B.BuildOptions(wheelhouses=(wh,), no_index=True),
                         tmp_path / "out1", lambda line: None)
    cuda = B.resolve_wheels(project, target,
                            B.BuildOptions(wheelhouses=(wh,), no_index=True, cpu_torch=False),
                            tmp_path / "out2", lambda line: None)
    assert [w.name for w in cuda] == [f"torch-2.13.0-{tag}.whl"]
    make_wheel(wh, "torch", "2.13.0+cpu", tag=tag)
    cpu = B.resolve_wheels(project, target, B.BuildOptions(wheelhouses=(wh,), no_index=True),
                           tmp_path / "out3", lambda line: None)
    assert [w.name for w in cpu] == [f"torch-2.13.0+cpu-{tag}.whl"]


def test_resolve_wheels_names_a_missing_package(tmp_path, isolated_pip):
    (tmp_path / "wh").mkdir()
    write(tmp_path / "p" / "requirements.txt", "no-such-package-swarmfd\n")
    with pytest.raises(B.BuildError, match="not in the --wheelhouse folders as a wheel"):
        B.resolve_wheels(B.read_project(tmp_path / "p"), B.target_from_probe(PROBE),
                         B.BuildOptions(wheelhouses=(tmp_path / "wh",), no_index=True),
                         tmp_path / "out", lambda line: None)


def test_build_rejects_bad_input_before_contacting_docker(tmp_path):
    from swarmfd.cli import main

    result = CliRunner().invoke(main, ["build", "-H", "tcp://127.0.0.1:9", str(tmp_path),
                                       "--no-index"])
    assert result.exit_code == 2 and "--no-index needs a --wheelhouse" in result.output
    result = CliRunner().invoke(main, ["build", "-H", "tcp://127.0.0.1:9", str(tmp_path),
                                       "--push", "ftp://x"])
    assert result.exit_code == 2 and "without a scheme" in result.output


# --- elastic jobs ---------------------------------------------------------------------------


def test_an_elastic_job_restarts_failed_tasks_at_once_and_every_task_may_join() -> None:
    spec = S.build_service_spec(make_job(elastic=True, elastic_restarts=3))
    task = spec["TaskTemplate"]
    assert task["RestartPolicy"] == {"Condition": "on-failure", "Delay": 0, "Window": 0,
                                     "MaxAttempts": 3}
    assert task["ContainerSpec"]["StopGracePeriod"] == S.ELASTIC_STOP_GRACE * 10**9
    env = env_of(spec)
    assert env["SWARMFD_ELASTIC"] == "1" and env["SWARMFD_ELASTIC_JOIN"] == "auto"
    assert env["SWARMFD_ELASTIC_PEERS"] == "tasks.{{.Service.Name}}"
    assert spec["Labels"][S.LABEL_ELASTIC] == "1"
    plain = S.build_service_spec(make_job())
    assert plain["TaskTemplate"]["RestartPolicy"]["Condition"] == "none"
    assert "SWARMFD_ELASTIC" not in env_of(plain) and S.LABEL_ELASTIC not in plain["Labels"]
    # --max-restarts 0: Swarm's MaxAttempts 0 would mean "no limit": no restart policy then
    no_restart = S.build_service_spec(make_job(elastic=True, elastic_restarts=0))
    assert no_restart["TaskTemplate"]["RestartPolicy"]["Condition"] == "none"


def test_following_an_elastic_job_reports_failures_and_waits_for_every_slot() -> None:
    from swarmfd.swarm.follow import _Elastic

    said: list[str] = []
    watch = _Elastic(said.append, "job")
    failed = TaskView.from_api(task(2, "failed", exit_code=137, tid="old"))
    running = {0: TaskView.from_api(task(1, "running")), 1: failed}
    assert watch.update(running, {}) is None and "rank 1 exited with code 137" in said[0]
    replaced = {0: TaskView.from_api(task(1, "complete")),
                1: TaskView.from_api(task(2, "complete", tid="new"))}
    watch.settled = None
    assert watch.update(replaced, {}) is None  # settling: a replacement may come
    watch.settled = -1e9  # long ago
    done = watch.update(replaced, {})
    assert done is not None and done.outcome == "done" and done.exit_code == 0
    lost = _Elastic(said.append, "job")
    lost.settled = -1e9
    ended = lost.update({0: failed}, {})
    assert ended is not None and ended.outcome == "failed" and ended.exit_code == 137
    # A rank that left at a commit exits 0 alone: the others, made before, still run.
    left = _Elastic(said.append, "job")
    left.settled = -1e9
    member = TaskView.from_api(task(1, "running", created="2024-01-01T00:00:00Z"))
    leaver = TaskView.from_api(task(2, "complete", ts="2024-01-01T00:05:00Z"))
    assert left.update({0: member, 1: leaver}, {}) is None
    # A replacement made after the members exited 0 came too late: done, and stopped.
    late = TaskView.from_api(task(2, "running", created="2024-01-01T00:09:00Z", tid="late"))
    finished = TaskView.from_api(task(1, "complete", ts="2024-01-01T00:08:00Z"))
    left.settled = -1e9
    end = left.update({0: finished, 1: late}, {})
    assert end is not None and end.outcome == "done" and left.late == [late]
    # Swarm made the replacement as the members finished (before the newest exit 0): it
    # is late once it stayed silent while the status lines flowed, not while a member
    # that works on after the function returned writes them.
    racing = TaskView.from_api(task(2, "running", created="2024-01-01T00:07:59Z", tid="r"))
    member_on = TaskView.from_api(task(3, "running", created="2024-01-01T00:00:00Z"))
    race = _Elastic(said.append, "job")
    views = {0: finished, 1: racing, 2: member_on}
    written = racing.created.timestamp()
    race.settled, race.done_at = -1e9, -1e9
    assert race.update(views, {}, seen={2: written + 60}) is None  # member 2: not late
    race.settled = -1e9
    assert race.update(views, {}, seen={}) is None  # status lines off: nothing is judged
    views = {0: finished, 1: racing}
    race.settled = -1e9
    end = race.update(views, {}, seen={0: written - 1})
    assert end is not None and end.outcome == "done" and race.late == [racing]
    race.settled, race.done_at = -1e9, None
    assert race.update(views, {}, seen={0: written - 1}) is None  # just finished: wait
