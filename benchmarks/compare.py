"""Compare swarmfd's collectives with torch.distributed (gloo) and Open MPI, side by side.

Usage (from the repository root, with the bench extras installed; see README.md)::

    .venv/bin/python benchmarks/compare.py            # N=2 and N=4, 5 sizes, 3 runs
    .venv/bin/python benchmarks/compare.py --quick    # 30 iterations per size, 2 runs
    .venv/bin/python benchmarks/compare.py --all-sizes -n 2   # 4K..64M by x4
    .venv/bin/python benchmarks/compare.py -n 2 --systems gloo,swarmfd --runs 1

Every system runs as its own job with its own launcher, all on loopback:

``swarmfd``   ``swarmfd run -n N -- swarmfd bench`` with the default transport
              (shared memory between ranks on one host)
``swarmfd-tcp`` the same with SWARMFD_TRANSPORT=tcp (ZeroMQ over TCP loopback, as
              between hosts); other variants: ``--variant NAME:KEY=VALUE,...``
``gloo``      benchmarks/gloo_worker.py started N times, ``init_process_group("gloo",
              init_method="tcp://127.0.0.1:PORT")``, GLOO_SOCKET_IFNAME=lo,
              torch.set_num_threads(1)
``mpi-tcp``   ``mpirun ... --mca btl self,tcp --mca btl_tcp_if_include lo`` + mpi_worker.py
``mpi-shm``   ``mpirun ... --mca btl self,vader`` (shared memory) + mpi_worker.py

and measures float32 collectives (in-place all_reduce(SUM) by default; ``--collective``
picks others: broadcast, all_gather, reduce_scatter, all_to_all, gather, scatter,
sendrecv, with swarmfd bench's sizes and busbw) the same way (docs/performance.md): per
iteration reset the input (untimed), the system's own barrier, time; an
iteration's time is the slowest rank's; the median over iterations; then the
median and the best of ``--runs`` interleaved runs (for run in 1..R: for system:
all sizes, the systems in reverse order on even runs; why both: :func:`summarize`).
By default broadcast and all_gather are measured in the same jobs as all_reduce (gloo:
all_reduce only). The rest of the collective set: ``--collective reduce_scatter
--collective all_to_all --collective gather --collective scatter --collective sendrecv
--systems mpi-tcp,mpi-shm,swarmfd,swarmfd-tcp``.

Systems that are not installed are skipped with a note. Every subprocess has a
timeout. Results: ``<out-dir>/compare-<stamp>-raw.csv`` (every run),
``compare-<stamp>.csv`` (median and best of the runs), ``compare-<stamp>.md`` (the tables printed on
stdout) and ``compare-<stamp>.png`` (busbw and latency vs size, log-log).
A memory probe (``--memory``, on by default) reports each system's extra peak RSS
during a 64 MiB all_reduce relative to the array size.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarmfd.bench import (
    COLLECTIVES,
    bus_factor,
    default_iters,
    moved_bytes,
    parse_size,
    parse_sizes,
    size_range,
)

HERE = Path(__file__).resolve().parent
#: Where the outputs go by default: ignored by git (benchmarks/README.md).
OUT_DIR = HERE / "out"
PY = sys.executable
MPIRUN_BASE = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "--mca", "oob_tcp_if_include", "lo", "--mca", "pml", "ob1"]
MPI_BTL = {
    "mpi-tcp": ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"],
    "mpi-shm": ["--mca", "btl", "self,vader"],
}
DEFAULT_SIZES = "4K,64K,1M,16M,64M"  # the sizes of docs/performance.md
RATIO_SIZES = (4 * 1024, 64 * 1024, 1 << 20, 16 << 20, 64 << 20)


@dataclass
class Variant:
    """A swarmfd configuration: a name and the environment it runs with."""

    name: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Result:
    """One (run, system, N, collective, size) measurement; times in seconds."""

    run: int
    system: str
    n: int
    collective: str
    size: int
    iters: int
    median_s: float
    min_s: float
    p90_s: float
    wrong: int
    #: CPU time per call of one rank (its process, every thread), mean over ranks.
    cpu_s: float = 0.0


DEFAULT_VARIANTS = (
    # What `swarmfd run` uses between ranks on one host (SWARMFD_TRANSPORT=auto: shared memory).
    Variant("swarmfd"),
    # TCP on loopback, as between hosts.
    Variant("swarmfd-tcp", {"SWARMFD_TRANSPORT": "tcp"}),
)


# --- subprocesses ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


#: Where swarmfd's jobs run: not the repository root, whose ``swarmfd`` package
#: ``python -m`` would import from the working directory ahead of PYTHONPATH: run
#: there, a variant's PYTHONPATH (another tree's swarmfd) would be silently ignored and
#: a "before/after" compare would run the same code twice.
NEUTRAL_CWD = tempfile.gettempdir()


def run_procs(cmds: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
              timeout: float, cwd: str | None = None) -> list[tuple[int, str, str]]:
    """Run commands concurrently (each in its own session); kill all on timeout or failure.

    Returns (exit code, stdout, stderr) per command. Raises RuntimeError when
    the deadline passes or a process fails, with the failing process's stderr.
    """
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        files = []
        try:
            for cmd, env in zip(cmds, envs, strict=True):
                out = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
                err = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
                files.append((out, err))
                procs.append(subprocess.Popen(list(cmd), env=env, stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              cwd=cwd))
            failed = _wait_all(procs, timeout)
            if failed is not None and failed.startswith("timed out"):
                failed += "\n" + stack_dumps(procs)
            results = []
            for p, (out, err) in zip(procs, files, strict=True):
                if p.poll() is None:
                    _kill_group(p)
                out.seek(0)
                err.seek(0)
                results.append((p.returncode, out.read(), err.read()))
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
    if failed is None and any(code != 0 for code, _, _ in results):
        failed = "a process exited non-zero"
    if failed is not None:
        detail = "\n".join(f"--- {' '.join(cmds[i])[:120]} (exit {code})\n{err[-2000:]}"
                           for i, (code, _, err) in enumerate(results) if code != 0)
        raise RuntimeError(f"{failed}\n{detail}")
    return results


def stack_dumps(procs: Sequence[subprocess.Popen]) -> str:
    """Python stacks of every live process under ``procs`` (py-spy), to diagnose a hang."""
    spy = shutil.which("py-spy") or str(Path(PY).with_name("py-spy"))
    if not os.path.exists(spy) or importlib.util.find_spec("psutil") is None:
        return "(install py-spy and psutil for stack dumps of hung processes)"
    import psutil

    dumps = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(proc.pid)
            for p in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error, subprocess.SubprocessError, OSError):
                    if "python" not in os.path.basename(p.exe()):
                        continue
                    out = subprocess.run([spy, "dump", "--pid", str(p.pid)], timeout=30,
                                         capture_output=True, text=True)
                    dumps.append(f"== pid {p.pid}: {' '.join(p.cmdline())[:160]}\n"
                                 f"{out.stdout}{out.stderr}")
    return "\n".join(dumps) or "(no Python processes left to dump)"


def _wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every process; stop early (returning why) on a deadline or a failure."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
        bad = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad:
            return f"process {bad[0]} exited with code {procs[bad[0]].returncode}"
        time.sleep(0.02)
    return None


def json_lines(text: str) -> list[dict]:
    """Every JSON object printed on its own line (a launcher's '[rank R] ' prefix allowed)."""
    records = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        with contextlib.suppress(json.JSONDecodeError):
            obj = json.loads(line[start:])
            if isinstance(obj, dict):
                records.append(obj)
    return records


# --- systems -------------------------------------------------------------------------


def plan_arg(plan: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{size}:{iters}" for size, iters in plan)


def run_gloo(n: int, plan: Sequence[tuple[int, int]], warmup: int, timeout: float,
             extra: Sequence[str] = ()) -> list[dict]:
    port = _free_port()
    base = dict(os.environ, WORLD_SIZE=str(n), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1")
    args = list(extra) or ["--plan", plan_arg(plan), "--warmup", str(warmup)]
    cmds = [[PY, str(HERE / "gloo_worker.py"), *args] for _ in range(n)]
    envs = [dict(base, RANK=str(r)) for r in range(n)]
    results = run_procs(cmds, envs, timeout)
    return json_lines(results[0][1])


def run_mpi(name: str, n: int, plan: Sequence[tuple[int, int]], warmup: int, timeout: float,
            extra: Sequence[str] = (), collectives: Sequence[str] = ("all_reduce",)
            ) -> list[dict]:
    args = list(extra) or ["--plan", plan_arg(plan), "--warmup", str(warmup),
                           *(a for c in collectives for a in ("--collective", c))]
    cmd = ["mpirun", *MPIRUN_BASE, *MPI_BTL[name], "-n", str(n),
           PY, str(HERE / "mpi_worker.py"), "--name", name, *args]
    results = run_procs([cmd], [dict(os.environ)], timeout)
    return json_lines(results[0][1])


def collective_timeout(job_timeout: float) -> int:
    """swarmfd's own collective timeout: well inside the job's, so swarmfd reports a hang."""
    return max(10, int(job_timeout / 3))


def run_swarmfd(variant: Variant, n: int, plan: Sequence[tuple[int, int]], warmup: int,
                timeout: float, collectives: Sequence[str]) -> list[dict]:
    sizes = ",".join(str(size) for size, _ in plan)
    counts = {it for _, it in plan}
    default = all(it == default_iters(size) for size, it in plan)
    if not default and len(counts) != 1:
        raise ValueError("swarmfd bench takes one --iters value or its default schedule")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [PY, "-m", "swarmfd", "run", "-n", str(n),
               "--timeout", str(collective_timeout(timeout)), "--",
               PY, "-m", "swarmfd", "bench", "--sizes", sizes, "--warmup", str(warmup),
               "--format", "json", "--output", out, "--quiet"]
        for name in collectives:
            cmd += ["--op", name]
        if not default:
            cmd += ["--iters", str(counts.pop())]
        run_procs([cmd], [dict(os.environ, **variant.env)], timeout, cwd=NEUTRAL_CWD)
        with open(out, encoding="utf-8") as f:
            doc = json.load(f)
    return [{"system": variant.name, "n": n, "collective": r["collective"], "size": r["size"],
             "iters": r["iters"], "wrong": r["wrong"], "median_s": r["time_us"] / 1e6,
             "min_s": r["min_us"] / 1e6, "p90_s": r["p90_us"] / 1e6,
             "cpu_s": r.get("cpu_us", 0.0) / 1e6} for r in doc["rows"]]


def swarmfd_origin(variant: Variant) -> str:
    """The directory of the swarmfd package a variant's jobs import (its environment, the
    jobs' working directory): printed with the results, so that a compare of two trees
    shows it ran two trees."""
    cmd = [PY, "-c", "import os, swarmfd; print(os.path.dirname(swarmfd.__file__))"]
    return run_procs([cmd], [dict(os.environ, **variant.env)], 60,
                     cwd=NEUTRAL_CWD)[0][1].strip()


def swarmfd_memory(variant: Variant, n: int, size: int, timeout: float) -> list[dict]:
    cmd = [PY, "-m", "swarmfd", "run", "-n", str(n), "--timeout", str(collective_timeout(timeout)),
           "--", PY, str(HERE / "memory.py"), "--size", str(size), "--system", variant.name]
    results = run_procs([cmd], [dict(os.environ, **variant.env)], timeout, cwd=NEUTRAL_CWD)
    return json_lines(results[0][1])


def available_systems(variants: Sequence[Variant]) -> tuple[list[str], list[str]]:
    """(systems to run, notes about the ones skipped)."""
    systems, notes = [], []
    if importlib.util.find_spec("torch") is not None:
        systems.append("gloo")
    else:
        notes.append("gloo skipped: torch is not installed (pip install torch==2.13.0)")
    if shutil.which("mpirun") and importlib.util.find_spec("mpi4py") is not None:
        systems += ["mpi-tcp", "mpi-shm"]
    else:
        notes.append("MPI skipped: needs Debian openmpi-bin libopenmpi-dev and pip mpi4py")
    systems += [v.name for v in variants]
    return systems, notes


# --- analysis -------------------------------------------------------------------------


def busbw(collective: str, size: int, n: int, seconds: float) -> float:
    """Bus bandwidth in GB/s, as swarmfd bench reports it."""
    return moved_bytes(collective, size, n) / seconds / 1e9 * bus_factor(collective, n)


def summarize(results: Sequence[Result]) -> list[dict]:
    """Median and best (smallest) of the runs' medians per (system, n, collective, size).

    Why both: on this kind of machine a whole job is now and then slowed 2-4x (every
    system alike, pinned ranks too: the kernel time per call doubles), so which
    system had the unlucky jobs moves the median of a few runs. Such disturbances
    only ever add time: the best run is each system's least disturbed measurement.
    """
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((r.system, r.n, r.collective, r.size), []).append(r)
    rows = []
    for (system, n, coll, size), rs in groups.items():
        t = statistics.median(r.median_s for r in rs)
        rows.append({"system": system, "n": n, "collective": coll, "size": size,
                     "runs": len(rs), "iters": rs[0].iters, "median_s": t,
                     "best_s": min(r.median_s for r in rs),
                     "run_medians_us": " ".join(f"{r.median_s * 1e6:.1f}" for r in rs),
                     "latency_us": t * 1e6, "busbw_gbps": busbw(coll, size, n, t),
                     "cpu_us": statistics.median(r.cpu_s for r in rs) * 1e6,
                     "wrong": sum(r.wrong for r in rs)})
    return rows


def human_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def human_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"
    return f"{seconds * 1e6:.0f} us" if seconds >= 1e-5 else f"{seconds * 1e6:.1f} us"


def _grids(summary: Sequence[dict], systems: Sequence[str], ns: Sequence[int],
           sizes: Sequence[int], collectives: Sequence[str], title: str,
           cell: Callable[[dict, str, int], str | None]) -> list[str]:
    """The lines of one markdown table per collective and N (``title`` formatted with
    ``coll`` and ``n``): a row per system, a column per size, ``cell(row, coll, size)``
    or "-" where there is no figure."""
    index = {(r["system"], r["n"], r["collective"], r["size"]): r for r in summary}
    out = []
    for coll in collectives:
        for n in ns:
            rows = [sy for sy in systems if any((sy, n, coll, s) in index for s in sizes)]
            if not rows:
                continue
            out.append(title.format(coll=coll, n=n))
            out.append("| system | " + " | ".join(human_size(s) for s in sizes) + " |")
            out.append("|---" * (len(sizes) + 1) + "|")
            for system in rows:
                cells = []
                for s in sizes:
                    r = index.get((system, n, coll, s))
                    text = None if r is None else cell(r, coll, s)
                    cells.append("-" if text is None else text)
                out.append(f"| {system} | " + " | ".join(cells) + " |")
    return out


def markdown_tables(summary: Sequence[dict], systems: Sequence[str], ns: Sequence[int],
                    sizes: Sequence[int], collectives: Sequence[str] = ("all_reduce",)) -> str:
    """docs/performance.md-style tables, one per collective and N: latency below 1 MiB,
    'latency / busbw' from 1 MiB (every size for the collectives other than all_reduce)."""

    def cell(r: dict, coll: str, s: int) -> str:
        text = human_time(r["median_s"])
        if s >= 1 << 20 or coll != "all_reduce":
            text += f" / {r['busbw_gbps']:.2f}"
        if r["wrong"]:
            text += " WRONG"
        return text

    out = _grids(summary, systems, ns, sizes, collectives,
                 "\n### {coll}, world_size {n}: median latency / busbw (GB/s)\n", cell)
    return "\n".join(out) + "\n"


def cpu_tables(summary: Sequence[dict], systems: Sequence[str], ns: Sequence[int],
               sizes: Sequence[int], collectives: Sequence[str] = ("all_reduce",)) -> str:
    """Next to latency: CPU time per call of one rank (its process, every thread: progress
    and I/O threads count), median of the runs; and its share of the latency (1.0 = a
    core busy for the whole call: polling waits, or work)."""

    def cell(r: dict, coll: str, s: int) -> str | None:
        if not r.get("cpu_us"):
            return None
        return f"{human_time(r['cpu_us'] / 1e6)} ({r['cpu_us'] / 1e6 / r['median_s']:.2f})"

    out = _grids(summary, systems, ns, sizes, collectives,
                 "\n### {coll}, world_size {n}: CPU time per call per rank (x latency)\n",
                 cell)
    return "\n".join(out) + "\n" if out else ""


def ratio_tables(summary: Sequence[dict], variants: Sequence[str], baselines: Sequence[str],
                 ns: Sequence[int], sizes: Sequence[int], stat: str = "median_s",
                 collectives: Sequence[str] = ("all_reduce",)) -> str:
    """Speed-up of each swarmfd variant over each baseline: t_baseline / t_swarmfd.

    Greater than 1 means swarmfd is faster. For sizes >= 1 MiB this is also the
    busbw ratio (busbw_swarmfd / busbw_baseline). ``stat``: ``median_s`` (median
    of the runs) or ``best_s`` (best run of each system, see :func:`summarize`).
    """
    index = {(r["system"], r["n"], r["collective"], r["size"]): r[stat] for r in summary}
    which = "median of the runs" if stat == "median_s" else "best run of each system"
    out = []
    for coll in collectives:
        lines = []
        for n in ns:
            for variant in variants:
                for base in baselines:
                    cells = []
                    for s in sizes:
                        mine = index.get((variant, n, coll, s))
                        theirs = index.get((base, n, coll, s))
                        cells.append("-" if mine is None or theirs is None else
                                     f"{theirs / mine:.2f}x")
                    if any(c != "-" for c in cells):
                        lines.append(f"| {variant} | {base} | {n} | " + " | ".join(cells)
                                     + " |")
        if lines:
            out += [f"\n### swarmfd speed-up, {coll}, {which} (t_baseline / t_swarmfd; > 1 = "
                    "swarmfd faster; latency ratio below 1 MiB, busbw ratio from 1 MiB)\n",
                    "| swarmfd | vs | N | " + " | ".join(human_size(s) for s in sizes) + " |",
                    "|---" * (len(sizes) + 3) + "|", *lines]
    return "\n".join(out) + "\n"


def plot(summary: Sequence[dict], systems: Sequence[str], ns: Sequence[int], path: Path) -> bool:
    """Log-log plots vs size, a column per N: all_reduce busbw and latency, one line per
    system; then busbw of swarmfd's collectives (all_reduce, broadcast, all_gather)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    has_extra = any(r["collective"] != "all_reduce" for r in summary)
    rows = 3 if has_extra else 2
    fig, axes = plt.subplots(rows, len(ns), figsize=(6.5 * len(ns), 4.4 * rows), squeeze=False)
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    ticks = sorted({r["size"] for r in summary})

    def points(system: str, coll: str, n: int) -> list[tuple[int, float, float]]:
        return sorted((r["size"], r["busbw_gbps"], r["latency_us"]) for r in summary
                      if r["system"] == system and r["collective"] == coll and r["n"] == n)

    for col, n in enumerate(ns):
        bw_ax, lat_ax = axes[0][col], axes[1][col]
        for system in systems:
            pts = points(system, "all_reduce", n)
            if pts:
                xs = [p[0] for p in pts]
                bw_ax.plot(xs, [p[1] for p in pts], "-o", color=colors[system], label=system,
                           markersize=4)
                lat_ax.plot(xs, [p[2] for p in pts], "-o", color=colors[system], label=system,
                            markersize=4)
        bw_ax.set_title(f"all_reduce, world_size {n}: bus bandwidth (float32, in place)")
        lat_ax.set_title(f"all_reduce, world_size {n}: latency (slowest rank, median)")
        panels = [(bw_ax, "busbw (GB/s)"), (lat_ax, "median latency (us)")]
        if has_extra:
            ax = axes[2][col]
            styles = {"all_reduce": "-o", "broadcast": "--s", "all_gather": ":^"}
            for system in systems:
                for coll, style in styles.items():
                    pts = points(system, coll, n)
                    if pts and any(r["system"] == system and r["collective"] != "all_reduce"
                                   for r in summary):
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                                color=colors[system], label=f"{system} {coll}", markersize=4)
            ax.set_title(f"swarmfd collectives, world_size {n}: bus bandwidth")
            panels.append((ax, "busbw (GB/s)"))
        for ax, ylabel in panels:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ticks, [human_size(t).replace(" ", "") for t in ticks], fontsize=8)
            ax.set_xlabel("message size per rank")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def versions() -> str:
    parts = [f"Python {sys.version.split()[0]}"]
    for dist in ("numpy", "pyzmq", "torch", "mpi4py", "swarmfd"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
    if shutil.which("mpirun"):
        with contextlib.suppress(Exception):
            line = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                                  timeout=20).stdout.splitlines()[0]
            parts.append(line.strip())
    return ", ".join(parts)


# --- driver -------------------------------------------------------------------------


def parse_variant(text: str) -> Variant:
    """``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]`` -> Variant."""
    name, _, spec = text.partition(":")
    env = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"bad variant {text!r}: expected NAME:KEY=VALUE,...")
        env[key] = value
    if not name:
        raise argparse.ArgumentTypeError(f"bad variant {text!r}: missing NAME")
    return Variant(name, env)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", dest="ns", type=int, action="append",
                   help="ranks per job; repeatable (default: 2 and 4)")
    p.add_argument("--sizes", help=f"sizes, e.g. 4K,1M (default {DEFAULT_SIZES})")
    p.add_argument("--all-sizes", action="store_true", help="4 KiB .. 64 MiB by factors of 4")
    p.add_argument("--iters", type=int,
                   help="timed iterations at every size (default: 300 up to 1 MiB, 64 to "
                        "16 MiB, 16 above)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up iterations (default 3)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; median taken")
    p.add_argument("--quick", action="store_true",
                   help="30 iterations at every size, 2 warm-ups, 2 runs")
    p.add_argument("--systems", help="comma list among gloo,mpi-tcp,mpi-shm and the swarmfd "
                                     "variant names (default: all available)")
    p.add_argument("--variant", action="append", type=parse_variant, metavar="NAME[:K=V,...]",
                   help="a swarmfd variant: a name and environment; repeatable, added to "
                        "the defaults ("
                        "'swarmfd' = default transport, shared memory on one host, and "
                        "'swarmfd-tcp:SWARMFD_TRANSPORT=tcp')")
    p.add_argument("--collective", action="append", dest="collectives", metavar="NAME",
                   choices=COLLECTIVES,
                   help="a collective to compare; repeatable (default: all_reduce, broadcast "
                        "and all_gather; gloo runs all_reduce only)")
    p.add_argument("--no-extra-collectives", action="store_true",
                   help="all_reduce only (no broadcast and all_gather)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory probe")
    p.add_argument("--memory-size", default="64M", help="array size of the memory probe")
    p.add_argument("--timeout", type=float, default=240,
                   help="seconds per launched job (swarmfd's collective timeout: a third)")
    p.add_argument("--out-dir", default=str(OUT_DIR),
                   help="where the CSV, markdown and PNG go (default: benchmarks/out)")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ns = args.ns or [2, 4]
    if args.sizes and args.all_sizes:
        sys.exit("compare.py: give --sizes or --all-sizes, not both")
    sizes = size_range() if args.all_sizes else parse_sizes(args.sizes or DEFAULT_SIZES)
    iters, warmup, runs = args.iters, args.warmup, args.runs
    if args.quick:
        iters, warmup, runs = iters or 30, min(warmup, 2), min(runs, 2)
    plan = [(s, iters or default_iters(s)) for s in sizes]
    # Given variants are added to the defaults (one of the same name replaces it).
    given = {v.name: v for v in args.variant or []}
    variants = [given.pop(v.name, v) for v in DEFAULT_VARIANTS] + list(given.values())
    systems, notes = available_systems(variants)
    if args.systems:
        wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in ("gloo", "mpi-tcp", "mpi-shm",
                                                   *(v.name for v in variants))]
        if unknown:
            sys.exit(f"compare.py: unknown system(s) {unknown}")
        systems = [s for s in systems if s in wanted]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    by_name = {v.name: v for v in variants}
    collectives = args.collectives or (
        ["all_reduce"] + ([] if args.no_extra_collectives else ["broadcast", "all_gather"]))
    if "all_reduce" not in collectives:
        systems = [s for s in systems if s != "gloo"]

    origins = {v.name: swarmfd_origin(v) for v in variants if v.name in systems}
    for name, origin in origins.items():
        print(f"note: {name} imports swarmfd from {origin}", file=sys.stderr)
        tree = by_name[name].env.get("PYTHONPATH", "").split(os.pathsep)[0]
        if tree and not origin.startswith(os.path.abspath(tree)):
            sys.exit(f"compare.py: variant {name} sets PYTHONPATH={tree} but its jobs import "
                     f"swarmfd from {origin}")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    failures: list[str] = []
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    for n in ns:
        for run in range(1, runs + 1):
            # Odd runs go through the systems in order, even runs in reverse: whatever
            # the position in a round does (a warm cache, a neighbour's leftovers), it
            # does to every system alike over the runs.
            for system in (systems if run % 2 else systems[::-1]):
                t0 = time.monotonic()
                print(f"[{time.monotonic() - started:6.1f}s] N={n} run {run}/{runs} "
                      f"{system} ...", file=sys.stderr, flush=True)
                try:
                    if system == "gloo":
                        recs = run_gloo(n, plan, warmup, args.timeout)
                    elif system in MPI_BTL:
                        recs = run_mpi(system, n, plan, warmup, args.timeout,
                                       collectives=collectives)
                    else:
                        recs = run_swarmfd(by_name[system], n, plan, warmup, args.timeout,
                                           collectives)
                except (RuntimeError, OSError, ValueError, KeyError) as exc:
                    failures.append(f"N={n} run {run} {system}: {exc}")
                    print(f"  FAILED: {exc}", file=sys.stderr)
                    continue
                print(f"  done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
                results += [Result(run=run, system=system, n=n, collective=r["collective"],
                                   size=r["size"], iters=r["iters"], median_s=r["median_s"],
                                   min_s=r["min_s"], p90_s=r["p90_s"], wrong=r["wrong"],
                                   cpu_s=r.get("cpu_s", 0.0))
                            for r in recs]

    memory = []
    if not args.no_memory:
        mem_size = parse_size(args.memory_size)
        for n in ns:
            for system in systems:
                try:
                    if system == "gloo":
                        recs = run_gloo(n, [], 0, args.timeout, ["--memory", str(mem_size)])
                    elif system in MPI_BTL:
                        recs = run_mpi(system, n, [], 0, args.timeout,
                                       ["--memory", str(mem_size)])
                    else:
                        recs = swarmfd_memory(by_name[system], n, mem_size, args.timeout)
                except (RuntimeError, OSError) as exc:
                    failures.append(f"memory N={n} {system}: {exc}")
                    continue
                for r in recs:
                    r["system"] = system
                    memory.append(r)

    summary = summarize(results)
    raw_csv = out_dir / f"compare-{stamp}-raw.csv"
    with open(raw_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(Result.__dataclass_fields__))
        w.writeheader()
        for r in results:
            w.writerow(r.__dict__)
    sum_csv = out_dir / f"compare-{stamp}.csv"
    with open(sum_csv, "w", newline="") as f:
        if summary:
            w = csv.DictWriter(f, fieldnames=list(summary[0]))
            w.writeheader()
            w.writerows(summary)

    swarm_names = [v.name for v in variants if v.name in systems]
    baselines = [s for s in ("gloo", "mpi-tcp", "mpi-shm") if s in systems]
    lines = [f"## swarmfd vs gloo vs Open MPI ({stamp})\n",
             f"{versions()}.",
             f"float32 {', '.join(collectives)} (all_reduce in place, SUM); median over "
             "iterations of the slowest rank, "
             f"median of {runs} interleaved run(s); warm-up {warmup}; iterations "
             + ", ".join(f"{human_size(s)}:{it}" for s, it in plan) + ".",
             f"Machine: {os.cpu_count()} CPUs; 1-minute load average {load_before:.1f} at the "
             f"start, {os.getloadavg()[0]:.1f} at the end (other work on the machine inflates "
             "absolute figures; compare systems within one run).",
             "swarmfd variants: " + "; ".join(
                 f"{v.name} ({' '.join(f'{k}={x}' for k, x in v.env.items()) or 'default'}; "
                 f"swarmfd from {origins.get(v.name, '?')})"
                 for v in variants) + "."]
    text = "\n".join(lines) + "\n" + markdown_tables(summary, systems, ns, sizes, collectives)
    text += cpu_tables(summary, systems, ns, sizes, collectives)
    if swarm_names and baselines:
        for stat in ("median_s", "best_s"):
            text += ratio_tables(summary, swarm_names, baselines, ns,
                                 [s for s in sizes if s in RATIO_SIZES] or sizes, stat,
                                 collectives)
    if memory:
        text += ("\n### extra peak RSS of one rank during a "
                 f"{human_size(memory[0]['memory_size'])} all_reduce (VmHWM delta, max over "
                 "ranks; goal for swarmfd: <= 0.5 x array)\n\n| system | N | extra MiB | "
                 "x array |\n|---|---|---|---|\n")
        for m in memory:
            text += (f"| {m['system']} | {m['n']} | {m['extra_peak_bytes'] / 2**20:.1f} | "
                     f"{m['extra_peak_bytes'] / m['memory_size']:.2f} |\n")
    if failures:
        log = out_dir / f"compare-{stamp}-failures.txt"
        log.write_text("\n\n".join(failures) + "\n")
        text += "\n### failures (details and stack dumps: " + log.name + ")\n\n"
        text += "\n".join(f"- {f.splitlines()[0]}" for f in failures) + "\n"
    md = out_dir / f"compare-{stamp}.md"
    md.write_text(text)
    print(text)
    png = out_dir / f"compare-{stamp}.png"
    if not args.no_plot and summary and plot(summary, systems, ns, png):
        print(f"plot: {png}", file=sys.stderr)
    print(f"csv: {sum_csv} (raw: {raw_csv}); markdown: {md}; total "
          f"{time.monotonic() - started:.0f}s", file=sys.stderr)
    wrong = sum(r.wrong for r in results)
    return 1 if failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
