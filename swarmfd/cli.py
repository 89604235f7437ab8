"""The ``swarmfd`` command line: parse, call the library, map errors to exit codes.

Nothing here implements behaviour; each command is a thin click wrapper over
a library module (``launch`` for ``run``, ``bench`` for ``bench``, the
``swarm`` package for ``build`` and the Docker Swarm commands, imported lazily so
that ``swarmfd run`` never loads the docker SDK).
"""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="swarmfd")
def main() -> None:
    """swarmfd: data-parallel training primitives over a ZeroMQ ring, local or on Docker Swarm."""


# --- swarmfd run (launch.py) -------------------------------------------------


def _parse_env_items(items: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(
                f"{item!r} is not KEY=VALUE (example: -e OMP_NUM_THREADS=1)",
                param_hint="'-e' / '--env'",
            )
        env[key] = value
    return env


@main.command(
    "run",
    context_settings={"allow_interspersed_args": False},
)
@click.option("-n", "--nproc", type=int, required=True, metavar="N",
              help="Number of ranks (processes) to start, >= 1.")
@click.option("--master-addr", default=None, metavar="HOST",
              help="Address of rank 0, set as MASTER_ADDR.  [default: 127.0.0.1]")
@click.option("--master-port", type=int, default=None, metavar="PORT",
              help="MASTER_PORT, torch.distributed's port.  [default: a free port, new per "
                   "restart]")
@click.option("--swarmfd-port", type=int, default=None, metavar="PORT",
              help="SWARMFD_PORT, swarmfd's rendezvous port.  [default: --master-port + 1 "
                   "when that is given, else a second free port, new per restart]")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="Seconds a collective may wait for a peer (sets SWARMFD_TIMEOUT).")
@click.option("--init-timeout", type=float, default=None, metavar="SECONDS",
              help="Seconds init waits for every rank to join (sets SWARMFD_INIT_TIMEOUT; "
                   "default: the timeout).")
@click.option("-e", "--env", "env_items", multiple=True, metavar="KEY=VALUE",
              help="Extra environment variable for every rank; repeatable.")
@click.option("--no-prefix", is_flag=True,
              help="Do not prefix output lines with '[rank R] '.")
@click.option("--max-restarts", type=int, default=0, show_default=True, metavar="K",
              help="Restart the whole group up to K times when a rank fails.")
@click.option("--grace", type=float, default=3.0, show_default=True, metavar="SECONDS",
              help="Time between SIGTERM (or a forwarded Ctrl-C) and SIGKILL when stopping ranks.")
@click.option("--bind-cores/--no-bind-cores", default=None,
              help="Run each rank only on its own share of this host's cores, as Open MPI's "
                   "--bind-to core (steadier small collectives; its threads, libzmq's I/O "
                   "thread too, share them). Off by default: two jobs at once would pin to "
                   "the same cores.  [default: on if SWARMFD_BIND_CORES=1]")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[--] COMMAND...")
@click.pass_context
def run(
    ctx: click.Context,
    nproc: int,
    master_addr: str | None,
    master_port: int | None,
    swarmfd_port: int | None,
    timeout: float | None,
    init_timeout: float | None,
    env_items: tuple[str, ...],
    no_prefix: bool,
    max_restarts: int,
    grace: float,
    bind_cores: bool | None,
    command: tuple[str, ...],
) -> None:
    """Start N local ranks of COMMAND and supervise them.

    Each rank gets WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT (torch.distributed's), SWARMFD_PORT (swarmfd's rendezvous, another
    port, so a script may use both) and SWARMFD_SECRET_FILE (the path of a fresh
    job secret, private to this run and deleted at its end); a first word ending
    in .py runs with this Python. With several ranks, unless OMP_NUM_THREADS is set
    (in this shell or with -e), each gets its share of this host's cores as
    OMP_NUM_THREADS (torch's and numpy's compute threads), at least 1. Output
    lines are prefixed with the rank. The first failing rank stops the others
    and sets the exit code; Ctrl-C stops every rank (exit 130).

    \b
    Examples:
      swarmfd run -n 4 train.py --epochs 3
      swarmfd run -n 2 --max-restarts 2 -e OMP_NUM_THREADS=1 -- python -m mypkg.train
    """
    from .launch import LaunchConfig, bind_cores_from_env, launch

    if not command:
        raise click.UsageError(
            "missing COMMAND: give the program to run, e.g. 'swarmfd run -n 2 train.py'", ctx
        )
    try:
        config = LaunchConfig(
            nproc=nproc,
            command=command,
            env=_parse_env_items(env_items),
            timeout=timeout,
            init_timeout=init_timeout,
            prefix=not no_prefix,
            max_restarts=max_restarts,
            grace=grace,
            bind_cores=bind_cores if bind_cores is not None else bind_cores_from_env(),
            master_port=master_port,
            swarmfd_port=swarmfd_port,
            **({"master_addr": master_addr} if master_addr is not None else {}),
        )
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc), ctx) from None
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


# --- Docker commands (cli_swarm.py registers build, deploy, ls, ps, logs, rm) -
from .cli_swarm import register; register(main)  # noqa: E402, E702, I001
