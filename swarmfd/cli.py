"""The ``swarmfd`` command line: parse, call the library, map errors to exit codes.

Each command wraps a library module: ``launch`` (``run``, options from
:class:`swarmfd.launch.LaunchConfig`), ``top``, ``bench``, and :mod:`swarmfd.swarm.cli`
(``build``, ``deploy``, ``scale``, ``doctor``...), imported only when a Swarm command
runs, so that ``swarmfd run`` never loads docker.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from . import __version__
from .cli_options import build_request, request_options, usage_errors
from .launch import LaunchConfig, launch

#: The Docker Swarm commands, defined in this module (imported when one of them runs).
SWARM_COMMANDS = ("build", "deploy", "ls", "ps", "logs", "rm", "scale", "doctor")
_SWARM_CLI = "swarmfd.swarm.cli"


class _Commands(click.Group):
    """The ``swarmfd`` group, whose Swarm commands are loaded when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*self.commands, *SWARM_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in SWARM_COMMANDS:
            return importlib.import_module(_SWARM_CLI).COMMANDS[cmd_name]
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarmfd")
def main() -> None:
    """swarmfd: data-parallel training primitives over shared memory and TCP, run locally
    or on Docker Swarm."""


# --- swarmfd run (launch.py) -------------------------------------------------


@main.command("run", context_settings={"allow_interspersed_args": False})
@request_options(LaunchConfig)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[--] COMMAND...")
@click.pass_context
def run(ctx: click.Context, command: tuple[str, ...], **options: Any) -> None:
    """Start N local ranks of COMMAND and supervise them.

    Each rank gets WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT (torch.distributed's), SWARMFD_PORT (swarmfd's rendezvous, another
    port, so a script may use both) and SWARMFD_SECRET_FILE (the path of a fresh
    job secret, private to this run and deleted at its end); a first word ending
    in .py runs with this Python. With several ranks, unless OMP_NUM_THREADS is set
    (in this shell or with -e), each gets its share of this host's cores as
    OMP_NUM_THREADS (torch's and numpy's compute threads), at least 1. Output
    lines are prefixed with the rank. The first failing rank stops the others
    and sets the exit code; once it has, another rank's traceback that only says it
    lost its peer is cut to one line (--tracebacks shows it whole). Ctrl-C stops
    every rank (exit 130).

    \b
    Examples:
      swarmfd run -n 4 train.py --epochs 3
      swarmfd run -n 2 --max-restarts 2 -e OMP_NUM_THREADS=1 -- python -m mypkg.train
    """
    with usage_errors(ctx):
        config = build_request(LaunchConfig, options, command=command)
    try:
        code = launch(config)
    except FileNotFoundError as exc:
        click.echo(f"swarmfd run: {exc}", err=True)
        ctx.exit(127)
    except ValueError as exc:  # e.g. a master address that does not resolve
        raise click.UsageError(str(exc), ctx) from None
    except OSError as exc:  # not executable, exec format error, out of processes...
        click.echo(f"swarmfd run: cannot start the ranks: {exc}", err=True)
        ctx.exit(126)
    ctx.exit(code)


# --- swarmfd top (top.py) -------------------------------------------------------


@main.command("top")
@click.argument("job", required=False)
@click.option("--once", is_flag=True, help="Print one table and exit (for scripts).")
@click.option("--json", "as_json", is_flag=True,
              help="With --once: print the rows as JSON, a list of {rank, node, state, "
                   "calls_per_s, mb_per_s, wait_share, straggler, stalled}.")
@click.option("-H", "--host", default=None, metavar="URL",
              help="Docker host of a Swarm manager, for jobs on the Swarm.  [default: "
                   "$DOCKER_HOST, else the local socket]")
@click.pass_context
def top(ctx: click.Context, job: str | None, once: bool, as_json: bool,
        host: str | None) -> None:
    """Show every rank of a running job, live: what it does, its calls and MB a second,
    how much of its time it waits for others, the straggler and stalled ranks.

    JOB is a local job (`swarmfd run`, named run-PID) or a Swarm job (`swarmfd deploy`);
    without JOB, this user's only running job (several: they are listed). The figures
    come from the ranks' status lines (SWARMFD_STATUS), through the launcher or the
    service log: no port is opened. Ctrl-C ends the live view.

    \b
    Examples:
      swarmfd top
      swarmfd top --once --json swarmfd-keen-3fa9
    """
    from . import top as top_lib

    if as_json and not once:
        raise click.UsageError("--json needs --once (the live view is a table)", ctx)
    try:
        read = _top_source(job, host)
        top_lib.show(read, once=once, as_json=as_json, echo=click.echo)
    except top_lib.TopError as exc:
        click.echo(f"swarmfd top: {exc}", err=True)
        ctx.exit(1)


def _top_source(name: str | None, host: str | None) -> Any:
    """The function that reads the job ``swarmfd top`` shows (see
    :func:`swarmfd.top.pick_job`) anew. The Swarm is asked only when no local job has the name."""
    from . import jobs
    from . import top as top_lib

    local = jobs.local_jobs()
    if name is not None and any(j["name"] == name for j in local):
        candidates = local
    else:
        candidates = local + _swarm_jobs(host, required=host is not None)
    chosen = top_lib.pick_job(name, candidates)
    if chosen["kind"] == "local":
        def read() -> dict[str, Any]:
            found = [j for j in jobs.local_jobs() if j["name"] == chosen["name"]]
            if not found:
                raise top_lib.TopError(f"job {chosen['name']} has ended")
            return found[0]
        return read
    from .swarm.engine import connect
    from .swarm.status import job_status

    client = connect(host)

    def read_swarm() -> dict[str, Any]:
        got = job_status(client, chosen["name"])
        if got is None:
            raise top_lib.TopError(f"job {chosen['name']} was removed")
        return got
    return read_swarm


def _swarm_jobs(host: str | None, required: bool) -> list[dict[str, Any]]:
    """The running jobs of the Swarm at ``host``; none when no manager answers (unless
    ``required``: then its error)."""
    from .swarm.errors import SwarmJobError

    try:
        from .swarm.engine import check_manager, connect
        from .swarm.status import running_jobs

        client = connect(host)
        try:
            check_manager(client)
            return running_jobs(client)
        finally:
            client.close()
    except (SwarmJobError, OSError) as exc:
        if required:
            from .top import TopError

            raise TopError(str(exc)) from None
        return []


# --- swarmfd bench (bench.py) ------------------------------------------------


@main.command("bench", epilog="See the module docstring of swarmfd.bench for the method.")
@click.option("--op", "--collective", "collectives", multiple=True, metavar="NAME",
              help="Collective to time: all_reduce, broadcast, all_gather, reduce_scatter, "
                   "all_to_all or sendrecv (isend+irecv around a ring); repeatable.  "
                   "[default: all_reduce]")
@click.option("--sizes", default=None, metavar="LIST",
              help="Comma-separated sizes in bytes per rank, e.g. 4K,64K,1M,16M,64M.")
@click.option("-b", "--min-bytes", default=None, metavar="SIZE",
              help="Smallest size when --sizes is not given.  [default: 4K]")
@click.option("-e", "--max-bytes", default=None, metavar="SIZE",
              help="Largest size when --sizes is not given.  [default: 64M]")
@click.option("-f", "--factor", type=int, default=None, metavar="F",
              help="Multiply the size by F between steps.  [default: 4]")
@click.option("-i", "--iters", type=int, default=None, metavar="N",
              help="Timed iterations per size.  [default: 300 up to 1 MiB, 64 to 16 MiB, 16 above]")
@click.option("-w", "--warmup", type=int, default=3, show_default=True, metavar="N",
              help="Untimed warm-up iterations per size.")
@click.option("--dtype", default="float32", show_default=True,
              help="Element type: float32, float64, int32, int64, ...")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True, help="Output format (rank 0 prints it).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the output to FILE instead of stdout.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Verify each size's result; wrong results make the exit code 1.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")
@click.pass_context
def bench(
    ctx: click.Context,
    collectives: tuple[str, ...],
    sizes: str | None,
    min_bytes: str | None,
    max_bytes: str | None,
    factor: int | None,
    iters: int | None,
    warmup: int,
    dtype: str,
    fmt: str,
    output: str | None,
    check: bool,
    quiet: bool,
) -> None:
    """Time swarmfd's collectives in the current group (nccl-tests style).

    Joins the group from the environment (a world of one when none is set),
    times each collective at each size (reset input, barrier, time; slowest
    rank; median) and prints size, time, algbw and busbw on rank 0.

    \b
    Examples:
      swarmfd run -n 2 -- swarmfd bench
      swarmfd run -n 4 -- swarmfd bench --op all_reduce --op all_gather --sizes 4K,1M,64M
      swarmfd run -n 2 -- swarmfd bench -b 1K -e 16M -f 2 --format csv -o bench.csv
    """
    import swarmfd as fd

    from . import bench as bench_lib
    from .errors import SwarmfdError

    try:
        if sizes is not None and (min_bytes or max_bytes or factor):
            raise ValueError("give either --sizes or --min-bytes/--max-bytes/--factor, not both")
        if sizes is not None:
            size_list = bench_lib.parse_sizes(sizes)
        else:
            size_list = bench_lib.size_range(
                bench_lib.parse_size(min_bytes) if min_bytes else bench_lib.DEFAULT_MIN_BYTES,
                bench_lib.parse_size(max_bytes) if max_bytes else bench_lib.DEFAULT_MAX_BYTES,
                factor if factor is not None else bench_lib.DEFAULT_FACTOR,
            )
        names = bench_lib.parse_collectives(collectives)
        bench_lib.parse_dtype(dtype)
        if iters is not None and iters < 1:
            raise ValueError(f"--iters must be >= 1, got {iters}")
        if warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {warmup}")
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc), ctx) from None

    try:
        fd.init_from_env()
    except SwarmfdError as exc:
        click.echo(f"swarmfd bench: cannot join the group: {exc}", err=True)
        ctx.exit(1)
    try:
        is_main = fd.get_rank() == 0

        def progress(line: str) -> None:
            if is_main and not quiet:
                click.echo(f"swarmfd bench: {line}", err=True)

        rows = bench_lib.run_bench(size_list, names, dtype, iters, warmup, check=check,
                                   progress=progress)
        if is_main:
            text = bench_lib.format_rows(rows, fmt)
            if output is None:
                click.echo(text, nl=False)
            else:
                with open(output, "w", encoding="utf-8") as f:
                    f.write(text)
    except SwarmfdError as exc:
        click.echo(f"swarmfd bench: rank {fd.get_rank()}: {exc}", err=True)
        ctx.exit(1)
    finally:
        fd.cleanup()
    wrong = sum(r.wrong for r in rows)
    if wrong:
        if is_main:
            click.echo(f"swarmfd bench: {wrong} wrong result elements (see the #wrong column)",
                       err=True)
        ctx.exit(1)
