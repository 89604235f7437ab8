"""The Docker Swarm commands: ``swarmfd build``, ``deploy``, ``ls``, ``ps``, ``logs``, ``rm``.

Thin click wrappers: parse the options into a request (:mod:`.request`, which checks
them before any engine is contacted), call the library (:mod:`.deploy`, :mod:`.build`,
:mod:`.engine`), map its errors to exit codes. The modules that import the docker SDK
are imported inside the commands, and ``swarmfd``'s command group imports this module
only when one of these commands runs (:data:`COMMANDS`), so ``swarmfd run`` loads
neither.
"""

from __future__ import annotations

import datetime as _dt
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..cli_options import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    build_request,
    click_option,
    request_options,
    usage_errors,
)
from .request import HOST, BuildChoices, DeployRequest, parse_push

F = TypeVar("F", bound=Callable[..., Any])

_host_option = click_option("host", HOST)


def _fail(ctx: click.Context, message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"swarmfd {ctx.info_name}: error: {message}", err=True)
    ctx.exit(code)


def _swarm_errors(func: F) -> F:
    """Turn the swarm package's errors into a message and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from .errors import SwarmJobError

        ctx = click.get_current_context()
        try:
            return func(*args, **kwargs)
        except SwarmJobError as exc:
            _fail(ctx, str(exc))
        except _docker_api_error() as exc:
            _fail(ctx, f"the Docker engine refused: {getattr(exc, 'explanation', None) or exc}")

    return wrapper  # type: ignore[return-value]


def _docker_api_error() -> type[Exception]:
    from .engine import docker_error

    return docker_error()


class _TextSink:
    """A binary-write front for a text stream that has no ``.buffer``."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        return int(self._stream.write(data.decode("utf-8", "replace")) or 0)

    def flush(self) -> None:
        self._stream.flush()


def _rank_output(prefix: bool) -> Any:
    """Rank-prefixed output to this process's stdout/stderr (bytes, never re-encoded)."""
    from .follow import RankOutput

    out, err = (getattr(s, "buffer", None) or _TextSink(s) for s in (sys.stdout, sys.stderr))
    return RankOutput(out, err, prefix=prefix)


def _connect(host: str | None, max_pool_size: int = 10) -> tuple[Any, str]:
    """A client of a Swarm manager at ``host``, and this node's ID."""
    from .engine import check_manager, connect

    client = connect(host, max_pool_size=max_pool_size)
    try:
        node_id = check_manager(client)
    except BaseException:
        client.close()
        raise
    return client, node_id


# --- build -----------------------------------------------------------------------------


@click.command("build", epilog="Exit code: 0 when the image is built (or up to date); 1 "
                               "for errors, 2 for bad usage.")
@click.argument("directory", default=".", metavar="[DIR]",
                type=click.Path(file_okay=False))
@request_options(BuildChoices)
@click.option("--push", "registry", default=None, metavar="REGISTRY",
              help="Then push the image to REGISTRY (HOST[:PORT][/PATH]) and print the "
                   "reference every node can pull.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@_host_option
@click.pass_context
@_swarm_errors
def build(ctx: click.Context, directory: str, registry: str | None, quiet: bool,
          host: str | None, **options: Any) -> None:
    """Build DIR (default: .) into an image FROM the swarmfd image, for `swarmfd deploy`.

    The image holds DIR's files in /workspace (the working directory) and the packages
    of DIR/requirements.txt and/or DIR/pyproject.toml (with a [build-system], the project
    itself too). Wheels are resolved by this machine's pip (its index and find-links,
    plus --wheelhouse folders) for the image's Python and carried into the build, which
    needs no network. A requirement on torch gets the CPU wheel (torch==2.13.0+cpu).
    The tag is a hash of the content: an unchanged project is not built again. DIR's
    .dockerignore keeps files out; .git, virtual environments and caches never go in.

    Prints the image reference on stdout (after --push: REGISTRY/REPO:TAG@DIGEST).

    \b
    Examples:
      swarmfd build myproject
      swarmfd build --extra torch .
      swarmfd build --wheelhouse ./wheels --no-index .
      swarmfd deploy "$(swarmfd build -q .)" -n 4 -- python train.py
    """
    from .build import build_project, push_image
    from .deploy import stderr_progress
    from .engine import connect

    with usage_errors(ctx):
        request = build_request(BuildChoices, options).request(directory)
        if registry is not None:
            registry = parse_push(registry)
    progress = (lambda line: None) if quiet else stderr_progress("swarmfd build")
    client = connect(host, timeout=600)
    try:
        built = build_project(client, request.directory, base=request.base,
                              repository=request.repository, extras=request.extras,
                              options=request.options, rebuild=request.rebuild,
                              progress=progress)
        ref = built.ref
        if registry is not None:
            ref = push_image(client, built.ref, registry, progress=progress)
    except KeyboardInterrupt:
        click.echo("swarmfd build: interrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    finally:
        client.close()
    click.echo(ref)


# --- deploy ----------------------------------------------------------------------------

#: Stands for IMAGE when --build makes it (see _DeployCommand.parse_args).
_BUILT_IMAGE = "\0built"


class _DeployCommand(click.Command):
    """``deploy`` with a hint when COMMAND's options were taken for deploy's own.

    With ``--build DIR`` there is no IMAGE: a placeholder is put first so that click
    takes it as IMAGE and every word the user gave becomes COMMAND. Words before ``--``
    other than options would then be an IMAGE given as well, which is refused.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        head = args[:args.index("--")] if "--" in args else args
        if any(a == "--build" or a.startswith("--build=") for a in head):
            ctx.meta["swarmfd.after_dash"] = (len(args) - args.index("--") - 1
                                              if "--" in args else None)
            args = [_BUILT_IMAGE, *args]
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if "--" not in args:
                exc.message += (
                    " If it belongs to COMMAND, put '--' before COMMAND: "
                    "swarmfd deploy IMAGE -n N [OPTIONS] -- COMMAND [ARGS]..."
                )
            raise


@click.command(
    "deploy",
    cls=_DeployCommand,
    epilog="Exit code: 0 when every rank exited 0; else the failed rank's exit code "
           "(1 if it has none); 130 after Ctrl-C; 1 for errors, 2 for bad usage.",
)
@click.argument("image", metavar="IMAGE|--build DIR")
@request_options(DeployRequest)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND...")
@click.pass_context
@_swarm_errors
def deploy(ctx: click.Context, image: str, command: tuple[str, ...], **options: Any) -> None:
    """Run COMMAND as N ranks on the Docker Swarm, as one job.

    Creates one replicated service (N tasks of IMAGE), one overlay network and one
    secret (<job>-secret: a random key every rank reads at
    /run/secrets/swarmfd_secret), all labelled with the job name. Each rank gets
    WORLD_SIZE, RANK (from its task slot), LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT (swarmfd's rendezvous listens on MASTER_PORT + 1, inside the job's
    network; nothing is published); IMAGE must use swarmfd's entrypoint (the swarmfd
    image does).
    Swarm numbers task slots from 1: rank R is slot R+1, so its container's host name
    is <job>-<R+1> and rank 0's address is <job>-1.
    Put '--' before COMMAND when COMMAND has options of its own.

    --build DIR builds your project into an image first (see `swarmfd build --help`)
    and runs that; on a Swarm of several nodes add --push REGISTRY so every node can
    pull it.

    Then it follows the job: task progress on stderr, every rank's output prefixed
    with '[rank R] '. When a rank fails, the other ranks are stopped and deploy exits
    with that rank's exit code, naming the rank and its node. A job whose ranks all
    exited 0 is removed; a failed job is kept for `swarmfd ps` / `swarmfd logs`
    (--keep keeps it always, --rm removes it always). Ctrl-C stops following and
    leaves the job running (remove it with `swarmfd rm NAME`). Everything is checked
    before anything is created.

    \b
    Examples:
      swarmfd deploy swarmfd:latest -n 3 -- python /opt/swarmfd/examples/train.py
      swarmfd deploy swarmfd:latest -n 4 --name mlp-1 -e OMP_NUM_THREADS=1 \\
          --mount type=bind,src=/data,dst=/data,readonly --limit-memory 2G -- train.py
      swarmfd deploy -d myimage:1 -n 8 --max-per-node 2 --generic-resource gpu=1 -- train.py
      swarmfd deploy --build myproject -n 3 -- python train.py
      swarmfd deploy --build . --push registry.example.com:5000 -n 8 --max-per-node 1 \\
          --checkpoint-volume mnist-ckpt --max-restarts 2 -- python train.py
    """
    from .deploy import run_deploy, stderr_progress

    with usage_errors(ctx):
        request = build_request(DeployRequest, options, command=command,
                                image=_image(ctx, image, options["build_dir"], command))
    name = request.job.name
    try:
        result = run_deploy(request, output=_rank_output(prefix=request.prefix),
                            progress=stderr_progress("swarmfd deploy"))
    except KeyboardInterrupt:  # before following began (while checking or creating)
        click.echo(f"swarmfd deploy: interrupted; if job {name} was created already, "
                   f"`swarmfd ps {name}` shows it and `swarmfd rm {name}` removes it",
                   err=True)
        ctx.exit(EXIT_INTERRUPTED)
    if request.detach:
        click.echo(name)
    ctx.exit(result.exit_code)


def _image(ctx: click.Context, image: str, build_dir: str | None,
           command: tuple[str, ...]) -> str | None:
    """IMAGE as given, or None with --build (whose placeholder took IMAGE's place:
    _DeployCommand), when the words before '--' hold no IMAGE as well."""
    if build_dir is None:
        return image
    after_dash = ctx.meta.get("swarmfd.after_dash")
    if after_dash is None:
        raise click.UsageError(
            "with --build, put '--' before COMMAND: swarmfd deploy --build DIR -n N "
            "[OPTIONS] -- COMMAND...", ctx)
    if len(command) > after_dash:
        raise click.UsageError(
            f"--build makes the image: give no IMAGE (got {command[0]!r} before '--')", ctx)
    return None


# --- ls ---------------------------------------------------------------------------------


def _ago(when: _dt.datetime) -> str:
    if when.year < 1980:
        return "-"
    seconds = (_dt.datetime.now(_dt.timezone.utc) - when).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{max(0, int(seconds))}s ago"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )


@click.command("ls")
@click.option("-q", "--quiet", is_flag=True, help="Print job names only.")
@_host_option
@click.pass_context
@_swarm_errors
def ls(ctx: click.Context, quiet: bool, host: str | None) -> None:
    """List the swarmfd jobs of the Swarm, newest first.

    STATE is the job's: pending, starting, running, done, failed or stopped; TASKS
    counts its ranks per phase.

    \b
    Examples:
      swarmfd ls
      swarmfd ls -q | xargs -r swarmfd rm      # remove every job
    """
    from .engine import list_jobs

    client, _node = _connect(host)
    try:
        jobs = list_jobs(client)
    finally:
        client.close()
    if quiet:
        for job in jobs:
            click.echo(job.name)
        return
    rows = [["NAME", "IMAGE", "RANKS", "STATE", "TASKS", "CREATED"]]
    rows += [[j.name, j.image, str(j.world_size), j.state, j.summary, _ago(j.created)]
             for j in jobs]
    click.echo(_table(rows))


# --- ps ---------------------------------------------------------------------------------


@click.command("ps")
@click.argument("job")
@_host_option
@click.pass_context
@_swarm_errors
def ps(ctx: click.Context, job: str, host: str | None) -> None:
    """Show each rank of JOB: its task's state, node, exit code, host name and error.

    EXIT is shown once a task has ended (Swarm reports 0 while it runs). HOST is the
    rank's container host name, <job>-<slot>: Swarm numbers task slots from 1, so rank
    R is slot R+1 and runs as <job>-<R+1> (rank 0, the MASTER_ADDR, is <job>-1); Docker's
    own listings (docker service ps, docker ps) show the slot, swarmfd the rank.

    \b
    Examples:
      swarmfd ps swarmfd-keen-3fa9
    """
    from .engine import find_service, job_tasks, node_names, world_size_of
    from .errors import JobNotFoundError
    from .spec import LABEL_FAILURE, LABEL_STOPPED
    from .tasks import job_state

    client, _node = _connect(host)
    try:
        service = find_service(client, job)
        if service is None:
            raise JobNotFoundError(f"no job named {job!r} (`swarmfd ls` lists the jobs)")
        views = job_tasks(client, service["ID"])
        nodes = node_names(client)
    finally:
        client.close()
    world = world_size_of(service)
    labels = service.get("Spec", {}).get("Labels") or {}
    stopped = {s.strip() for s in labels.get(LABEL_STOPPED, "").split(",") if s.strip()}
    rows = [["RANK", "STATE", "NODE", "EXIT", "UPDATED", "TASK", "HOST", "ERROR"]]
    for rank in range(world):
        view = views.get(rank)
        if view is None:
            rows.append([str(rank), "no task", "-", "-", "-", "-", f"{job}-{rank + 1}", ""])
            continue
        rows.append([
            str(rank),
            view.state,
            nodes.get(view.node_id, view.node_id[:12] or "-"),
            "-" if view.exit_code is None else str(view.exit_code),
            _ago(view.updated),
            view.task_id[:12],
            f"{job}-{view.slot}",
            f"{view.error} (stopped by swarmfd after the failure)"
            if str(rank) in stopped and view.terminal else view.error,
        ])
    failure = labels.get(LABEL_FAILURE)
    state = f"failed: {failure}" if failure else job_state(views.values(), world)
    click.echo(f"job {job}: {state} ({world} ranks; rank R runs as task slot R+1, host "
               f"{job}-<R+1>)")
    click.echo(_table(rows))


# --- logs -------------------------------------------------------------------------------


@click.command("logs")
@click.argument("job")
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing new lines until every rank has ended (Ctrl-C stops).")
@click.option("-r", "--rank", "ranks", type=click.IntRange(min=0), multiple=True, metavar="R",
              help="Only rank R; repeatable.  [default: every rank]")
@click.option("--no-prefix", is_flag=True, help="Do not prefix lines with '[rank R] '.")
@_host_option
@click.pass_context
@_swarm_errors
def logs(ctx: click.Context, job: str, follow: bool, ranks: tuple[int, ...], no_prefix: bool,
         host: str | None) -> None:
    """Print the output of JOB's ranks, each line prefixed with '[rank R] '.

    A rank's stdout goes to stdout, its stderr to stderr. Without --follow, the
    ranks' lines are merged in time order.

    \b
    Examples:
      swarmfd logs swarmfd-keen-3fa9
      swarmfd logs -f --rank 0 swarmfd-keen-3fa9
    """
    from .engine import find_service, world_size_of
    from .errors import JobNotFoundError
    from .follow import print_logs

    client, node_id = _connect(host)
    try:
        service = find_service(client, job)
        if service is None:
            raise JobNotFoundError(f"no job named {job!r} (`swarmfd ls` lists the jobs)")
        world = world_size_of(service)
        if 2 * world + 2 > 10:  # each rank's stdout and stderr reader holds a connection
            client.close()
            client, node_id = _connect(host, max_pool_size=2 * world + 2)
        bad = [r for r in ranks if r >= world]
        if bad:
            raise click.UsageError(f"--rank {bad[0]}: job {job} has ranks 0..{world - 1}", ctx)
        output = _rank_output(prefix=not no_prefix)
        try:
            problems = print_logs(client, service["ID"], node_id, output,
                                  ranks=ranks or None, follow=follow)
        except KeyboardInterrupt:
            ctx.exit(EXIT_INTERRUPTED)
        for problem in problems:
            click.echo(f"swarmfd logs: {problem}", err=True)
    finally:
        client.close()


# --- rm ---------------------------------------------------------------------------------


@click.command("rm")
@click.argument("jobs", nargs=-1, required=True, metavar="JOB...")
@click.option("--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              metavar="SECONDS", help="Longest wait for the job's containers to go.")
@_host_option
@click.pass_context
@_swarm_errors
def rm(ctx: click.Context, jobs: tuple[str, ...], timeout: float, host: str | None) -> None:
    """Remove JOB: its service (stopping its ranks), network and secrets.

    Only objects labelled org.swarmfd.job=JOB are removed. Waits (at most --timeout
    seconds) until the ranks' containers are gone, so the network can be removed.

    \b
    Examples:
      swarmfd rm swarmfd-keen-3fa9
      swarmfd rm $(swarmfd ls -q)
    """
    from .engine import remove_job
    from .errors import JobNotFoundError

    client, _node = _connect(host)
    failed = 0
    try:
        for name in jobs:
            try:
                removal = remove_job(client, name, timeout=timeout)
            except JobNotFoundError as exc:
                click.echo(f"swarmfd rm: error: {exc}", err=True)
                failed += 1
                continue
            parts = [f"{len(removal.services)} service(s)", f"{len(removal.networks)} network(s)"]
            if removal.secrets:
                parts.append(f"{len(removal.secrets)} secret(s)")
            click.echo(f"removed {name}: {', '.join(parts)} ({removal.seconds:.1f} s)")
    finally:
        client.close()
    if failed:
        ctx.exit(EXIT_ERROR)


#: The commands, by name, for swarmfd's command group, which lists their names without
#: importing this module (swarmfd.cli.SWARM_COMMANDS: a new command goes in both).
COMMANDS: dict[str, click.Command] = {
    command.name: command for command in (build, deploy, ls, ps, logs, rm)  # type: ignore[misc]
}
