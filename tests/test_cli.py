"""The command line's requests (swarmfd/request.py, swarmfd/cli_options.py,
swarmfd/swarm/request.py), in this process with plain data.

* ``run`` and ``deploy`` take the options of JobRequest alike, with one ``-e`` rule set
  and the same errors naming the option.
* An option declared once as a request field is a click option of the command, is
  checked by the request and (with ``env``) reaches every rank, on both commands.
* ``deploy``'s request makes the job's spec and refuses options that contradict each
  other, naming them; nothing contacts an engine.
* ``swarmfd run`` loads neither the Swarm commands nor the docker SDK.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import click
import pytest
from click.testing import CliRunner

from swarmfd.cli import main
from swarmfd.cli_options import build_request, request_options, usage_errors
from swarmfd.launch import LaunchConfig
from swarmfd.request import JobRequest, option, option_specs, parse_env_items
from swarmfd.swarm.request import DeployRequest


def launch_config(**kw: Any) -> LaunchConfig:
    return LaunchConfig(**{"nproc": 2, "command": ("train.py",), **kw})


def deploy_request(**kw: Any) -> DeployRequest:
    return DeployRequest(**{"nproc": 2, "command": ("python", "train.py"), "image": "img",
                            **kw})


MAKERS = {"run": launch_config, "deploy": deploy_request}


# -- the -e rules -----------------------------------------------------------------------------


def test_env_items_set_values_or_pass_this_shells_value() -> None:
    env = parse_env_items(["A=1", "B=x=y", "C=", "HOME", "A=2"], {"HOME": "/root"})
    assert env == {"A": "2", "B": "x=y", "C": "", "HOME": "/root"}


@pytest.mark.parametrize(("item", "message"), [
    ("=1", "-e '=1': expected KEY=VALUE (or KEY alone, to pass this shell's value)"),
    ("1A=2", "expected KEY=VALUE"),
    ("A.B=1", "expected KEY=VALUE"),
    ("UNSET_X", "-e UNSET_X: UNSET_X is not set in this shell; give a value with "
                "-e UNSET_X=VALUE"),
])
def test_env_items_that_are_not_key_value_are_refused(item: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_env_items([item], {})
    assert message in str(info.value)


@pytest.mark.parametrize("command", ["run", "deploy"])
@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "3"}, "-e WORLD_SIZE is not allowed: swarmfd sets WORLD_SIZE for every "
                          "rank; use -n"),
    ({"RANK": "3"}, "-e RANK is not allowed"),
    ({"MASTER_PORT": "3"}, "use --master-port"),
    ({"SWARMFD_TIMEOUT": "3"}, "-e SWARMFD_TIMEOUT is not allowed: swarmfd sets "
                               "SWARMFD_TIMEOUT for every rank; use --timeout"),
    ({"SWARMFD_INIT_TIMEOUT": "3"}, "use --init-timeout"),
    ({"SWARMFD_RESTART_COUNT": "3"}, "use --max-restarts"),
    ({"A": "x\0y"}, "the value of -e A contains a NUL byte"),
    ({"A-B": "1"}, "env name 'A-B' is invalid"),
])
def test_both_commands_refuse_what_swarmfd_or_an_option_sets(command: str, env: dict[str, str],
                                                            message: str) -> None:
    with pytest.raises(ValueError) as info:
        MAKERS[command](env=env)
    assert message in str(info.value)


@pytest.mark.parametrize("command", ["run", "deploy"])
def test_both_commands_take_env_items_or_a_mapping(command: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMFD_TEST_PASSED", "from the shell")
    request = MAKERS[command](env=("SWARMFD_TEST_PASSED", "B=2"))
    assert dict(request.env) == {"SWARMFD_TEST_PASSED": "from the shell", "B": "2"}
    with pytest.raises(TypeError):
        request.env["C"] = "3"  # type: ignore[index]
    assert dict(MAKERS[command](env={"B": "2"}).env) == {"B": "2"}


# -- shared options, one declaration ------------------------------------------------------------


def _params(name: str) -> dict[str, click.Parameter]:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    return {p.name: p for p in command.params if p.name}


def test_run_and_deploy_share_the_options_of_job_request() -> None:
    """Every JobRequest option is an option of both commands, declared alike."""
    run, deploy = _params("run"), _params("deploy")
    shared = [f.name for f, _spec in option_specs(JobRequest)]
    assert shared == ["nproc", "env", "timeout", "init_timeout", "stall_warn", "max_restarts",
                      "elastic", "min_n", "elastic_timeout", "prefix"]
    for name in shared:
        assert run[name].to_info_dict() == deploy[name].to_info_dict(), name


@pytest.mark.parametrize("command", ["run", "deploy"])
@pytest.mark.parametrize(("args", "message"), [
    (["-n", "0"], "the number of ranks must be >= 1, got -n 0"),
    (["-n", "2", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["-n", "2", "--init-timeout", "inf"], "--init-timeout must be a positive number"),
    (["-n", "2", "--max-restarts", "-1"], "--max-restarts must be an integer >= 0"),
    (["-n", "2", "--stall-warn", "-1"], "--stall-warn must be a finite number of seconds >= 0"),
    (["-n", "2", "-e", "RANK=1"], "-e RANK is not allowed"),
    (["-n", "2", "-e", "SWARMFD_TEST_SURELY_UNSET"], "is not set in this shell"),
])
def test_both_commands_refuse_bad_shared_options_alike(command: str, args: list[str],
                                                       message: str) -> None:
    head = ["run"] if command == "run" else ["deploy", "-H", "tcp://127.0.0.1:9", "img"]
    result = CliRunner().invoke(main, [*head, *args, "--", "true"])
    assert result.exit_code == 2, result.output
    assert message in result.output


@dataclass(frozen=True, kw_only=True)
class StallWarned(LaunchConfig):
    """A command request with one more option, as a later feature adds one."""

    stall_warn: float | None = option("--stall-warn", type=float, metavar="SECONDS",
                                      env="SWARMFD_TEST_STALL_WARN",
                                      help="Warn about a call waiting longer than SECONDS.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stall_warn is not None and self.stall_warn <= 0:
            raise ValueError(f"--stall-warn must be > 0, got {self.stall_warn}")


@dataclass(frozen=True, kw_only=True)
class DeployStallWarned(DeployRequest):
    stall_warn: float | None = StallWarned.__dataclass_fields__["stall_warn"]  # type: ignore[assignment]


def test_an_option_declared_once_is_parsed_checked_and_reaches_the_ranks() -> None:
    """A field with option(...) is all a new option needs: click parses it, the request
    checks it, rank_env passes it to every rank, and deploy's job spec carries it."""
    seen: list[Any] = []

    @click.command()
    @request_options(StallWarned)
    @click.argument("command", nargs=-1)
    @click.pass_context
    def cmd(ctx: click.Context, command: tuple[str, ...], **options: Any) -> None:
        with usage_errors(ctx):
            seen.append(build_request(StallWarned, options, command=command))

    result = CliRunner().invoke(cmd, ["-n", "2", "--stall-warn", "2.5", "--timeout", "9",
                                      "x.py"])
    assert result.exit_code == 0, result.output
    assert seen[0].stall_warn == 2.5
    assert seen[0].rank_env() == {"SWARMFD_TIMEOUT": "9.0", "SWARMFD_TEST_STALL_WARN": "2.5"}
    result = CliRunner().invoke(cmd, ["-n", "2", "--stall-warn", "0", "x.py"])
    assert result.exit_code == 2 and "--stall-warn must be > 0, got 0.0" in result.output
    result = CliRunner().invoke(cmd, ["-n", "2", "-e", "SWARMFD_TEST_STALL_WARN=1", "x.py"])
    assert result.exit_code == 2 and "use --stall-warn" in result.output

    job = DeployStallWarned(nproc=2, command=("x",), image="img", stall_warn=2.5,
                            timeout=9).job
    env = dict(item.split("=", 1) for item in job.task_env())
    assert (env["SWARMFD_TEST_STALL_WARN"], env["SWARMFD_TIMEOUT"]) == ("2.5", "9")


# -- run -----------------------------------------------------------------------------------------


def test_launch_config_takes_its_switches_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--bind-cores and --tracebacks: given, or SWARMFD_BIND_CORES / SWARMFD_TRACEBACK."""
    monkeypatch.delenv("SWARMFD_BIND_CORES", raising=False)
    monkeypatch.setenv("SWARMFD_TRACEBACK", "1")
    config = launch_config()
    assert (config.bind_cores, config.tracebacks) == (False, True)
    assert launch_config(tracebacks=False).tracebacks is False
    monkeypatch.setenv("SWARMFD_BIND_CORES", "1")
    monkeypatch.delenv("SWARMFD_TRACEBACK")
    config = launch_config()
    assert (config.bind_cores, config.tracebacks) == (True, False)
    assert launch_config(bind_cores=False).bind_cores is False
    monkeypatch.setenv("SWARMFD_TRACEBACK", "yes")
    with pytest.raises(ValueError, match="SWARMFD_TRACEBACK='yes': expected 1 "):
        launch_config()
    with pytest.raises(FrozenInstanceError):
        launch_config(tracebacks=True).grace = 1  # type: ignore[misc]


def test_the_group_lists_exactly_the_swarm_commands_it_loads_lazily() -> None:
    from swarmfd.cli import SWARM_COMMANDS
    from swarmfd.swarm.cli import COMMANDS

    assert sorted(SWARM_COMMANDS) == sorted(COMMANDS)
    assert all(main.get_command(click.Context(main), name) is COMMANDS[name]
               for name in SWARM_COMMANDS)


def test_swarmfd_run_loads_neither_the_swarm_commands_nor_docker() -> None:
    code = ("import sys\nfrom click.testing import CliRunner\nfrom swarmfd.cli import main\n"
            "r = CliRunner().invoke(main, ['run', '-n', '1', sys.executable, '-c', 'pass'])\n"
            "assert r.exit_code == 0, r.output\n"
            "loaded = {'docker', 'swarmfd.swarm.cli', 'swarmfd.swarm.request'} & set(sys.modules)\n"
            "sys.exit(', '.join(sorted(loaded)) or None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- deploy ---------------------------------------------------------------------------------------


def test_deploy_request_makes_the_jobs_spec() -> None:
    request = deploy_request(
        name="job-1", env=("A=1",), mounts=("type=tmpfs,dst=/tmp",), limit_memory="2G",
        reserve_cpu="0.5", constraints=("node.role==worker",), labels=("team=x",),
        timeout=7.5, max_per_node=1, checkpoint_volume="ck", push="reg.example:5000/t",
        max_restarts=2)
    job = request.job
    assert (job.name, job.image, job.world_size, job.command) == (
        "job-1", "img", 2, ("python", "train.py"))
    assert (job.limit_memory, job.reserve_cpu, job.timeout) == (2 << 30, 500_000_000, 7.5)
    assert (dict(job.env), dict(job.labels), job.checkpoint_volume) == (
        {"A": "1"}, {"team": "x"}, "ck")
    assert [m["Type"] for m in job.mounts] == ["tmpfs"]
    assert (request.push, request.build_request, request.keep_policy) == (
        "reg.example:5000/t", None, "on-failure")
    assert deploy_request(keep=True).keep_policy == "always"
    assert deploy_request(remove=True).keep_policy == "never"
    built = deploy_request(image=None, build_dir=".", name="b").build_request
    assert built is not None and str(built.directory) == "."


@pytest.mark.parametrize(("kw", "message"), [
    ({"keep": True, "remove": True}, "--keep and --rm contradict each other"),
    ({"detach": True, "max_restarts": 1}, "--max-restarts needs deploy to follow the job"),
    ({"detach": True, "remove": True}, "--rm needs deploy to follow the job"),
    ({"push": "reg:5000", "pull": True}, "drop --pull"),
    ({"push": "http://reg:5000"}, "--push 'http://reg:5000': give the registry without a "
                                  "scheme"),
    ({"image": None}, "give IMAGE or --build DIR"),
    ({"build_dir": "."}, "give IMAGE or --build DIR"),
    ({"command": ()}, "missing COMMAND: give the program every rank runs, e.g. "
                      "'swarmfd deploy img -n 2 -- python train.py'"),
    ({"name": "Bad_Name"}, "not DNS-safe"),
    ({"limit_memory": "lots"}, "bad --limit-memory size"),
    ({"local_ranks": "host"}, "--local-ranks must be one of container, node"),
    ({"max_per_node": 0}, "--max-per-node must be an integer >= 1"),
])
def test_deploy_request_refuses_what_does_not_fit_naming_the_options(kw: dict[str, Any],
                                                                     message: str) -> None:
    with pytest.raises(ValueError) as info:
        deploy_request(**kw)
    assert message in str(info.value)


def test_build_options_apply_to_build_only() -> None:
    from swarmfd.swarm.request import BuildChoices

    with pytest.raises(ValueError, match="apply to --build DIR"):
        deploy_request(build=BuildChoices(rebuild=True))
    with pytest.raises(ValueError, match="--no-index needs a --wheelhouse DIR"):
        deploy_request(image=None, build_dir=".", build=BuildChoices(no_index=True))
