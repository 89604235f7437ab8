"""Tests of swarmfd.bench and the ``swarmfd bench`` command."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from swarmfd import bench
from swarmfd.bench import Row
from swarmfd.cli import main

CONTRACT_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SWARMFD_PORT", "SWARMFD_TIMEOUT", "SWARMFD_RESTART_COUNT")


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No group variables in the environment: init_from_env makes a world of one."""
    for name in CONTRACT_VARS:
        monkeypatch.delenv(name, raising=False)


def sample_rows() -> list[Row]:
    row = Row(collective="all_reduce", size=4096, count=1024, dtype="float32", world_size=2,
              iters=300, warmup=3, time_us=103.25, min_us=90.5, p90_us=140.125,
              algbw=4096 / 103.25e-6 / 1e9, busbw=4096 / 103.25e-6 / 1e9, wrong=0)
    return [row, replace(row, collective="all_gather", size=67108864, count=16777216,
                         time_us=64000.0, algbw=2.097152, busbw=1.048576)]


# --- sizes and other inputs ---------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("4K", 4096), ("4k", 4096), ("64KiB", 65536), (" 1M ", 1048576),
    ("16MB", 16 * 2**20), ("2G", 2 * 2**30), ("7B", 7), (123, 123),
])
def test_parse_size_accepts_binary_units(text: str | int, expected: int) -> None:
    """Sizes are bytes with optional K/M/G binary units."""
    assert expected == bench.parse_size(text)


@pytest.mark.parametrize("text", ["", "K", "4X", "-4K", "1.5M", "0", "4 K B", "0K"])
def test_parse_size_rejects_bad_input_clearly(text: str) -> None:
    """A bad size raises ValueError quoting the text and naming the accepted forms."""
    with pytest.raises(ValueError, match="size") as info:
        bench.parse_size(text)
    assert repr(text) in str(info.value)


def test_parse_size_rejects_wrong_types() -> None:
    """Non-int, non-str sizes (and bools) are a TypeError."""
    for value in (True, 4.0, None):
        with pytest.raises(TypeError, match="size"):
            bench.parse_size(value)  # type: ignore[arg-type]


def test_parse_sizes_list() -> None:
    """A comma-separated list becomes bytes, in order."""
    assert bench.parse_sizes("4K,1M") == [4096, 1048576]
    assert bench.parse_sizes("4K,64K,1M,16M,64M") == [4096, 65536, 2**20, 16 * 2**20, 64 * 2**20]


@pytest.mark.parametrize("spec", ["", ",", "4K,oops", "4K;1M"])
def test_parse_sizes_rejects_bad_lists(spec: str) -> None:
    """An empty list or a bad item is a ValueError."""
    with pytest.raises(ValueError, match="size"):
        bench.parse_sizes(spec)


def test_size_range_defaults_are_powers_of_four_from_4k_to_64m() -> None:
    """The default sweep is 4 KiB .. 64 MiB by factors of 4, both ends included."""
    assert [4096 * 4**i for i in range(8)] == bench.size_range()
    assert bench.size_range(1024, 4096, 2) == [1024, 2048, 4096]
    with pytest.raises(ValueError, match="exceeds"):
        bench.size_range(4096, 1024)
    with pytest.raises(ValueError, match="factor"):
        bench.size_range(1024, 4096, 1)


def test_parse_collectives() -> None:
    """Names are validated, normalised and deduplicated; the default is all_reduce."""
    assert bench.parse_collectives([]) == ["all_reduce"]
    assert bench.parse_collectives(
        ["broadcast", "all-gather", "broadcast"]) == ["broadcast", "all_gather"]
    with pytest.raises(ValueError, match="unknown collective 'all_scatter'"):
        bench.parse_collectives(["all_scatter"])


def test_parse_dtype() -> None:
    """Numeric dtypes are accepted; anything else is a ValueError naming it."""
    assert np.dtype("int64") == bench.parse_dtype("int64")
    for bad in ("str", "nonsense", "bool", "complex64"):
        with pytest.raises(ValueError, match=repr(bad)):
            bench.parse_dtype(bad)


def test_default_iters_and_bus_factors() -> None:
    """Iteration counts follow the method of docs/performance.md; bus factors follow
    nccl-tests."""
    sizes = (4096, 2**20, 2**20 + 1, 16 * 2**20, 64 * 2**20)
    assert [bench.default_iters(s) for s in sizes] == [300, 300, 64, 64, 16]
    assert bench.bus_factor("all_reduce", 2) == 1.0
    assert bench.bus_factor("all_reduce", 4) == 1.5
    assert bench.bus_factor("all_gather", 4) == 0.75
    assert bench.bus_factor("broadcast", 4) == 1.0
    assert bench.bus_factor("all_reduce", 1) == 0.0


# --- formatting -----------------------------------------------------------------


def test_csv_parses_back() -> None:
    """CSV has a header of the Row fields and round-trips every value."""
    rows = sample_rows()
    parsed = list(csv.DictReader(io.StringIO(bench.format_csv(rows))))
    assert list(bench.ROW_FIELDS) == list(parsed[0].keys())
    assert len(rows) == len(parsed)
    for row, got in zip(rows, parsed, strict=True):
        assert row.collective == got["collective"]
        assert row.size == int(got["size"])
        assert row.time_us == float(got["time_us"])
        assert row.busbw == float(got["busbw"])


def test_json_parses_back() -> None:
    """JSON is one object with the rows; rows_from_json rebuilds equal Rows."""
    rows = sample_rows()
    text = bench.format_json(rows)
    doc = json.loads(text)
    assert doc["world_size"] == 2
    assert rows == bench.rows_from_json(text)
    with pytest.raises(ValueError, match="rows"):
        bench.rows_from_json("[1, 2]")


def test_table_is_aligned_and_flags_failures() -> None:
    """Every data line has the same width; wrong results are called out."""
    rows = sample_rows()
    text = bench.format_table(rows)
    data = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(data) == 2
    assert len(data[0]) == len(data[1])
    assert "103.2" in data[0] and "67108864" in data[1]
    assert "FAILED" not in text
    assert "FAILED" in bench.format_table([replace(rows[0], wrong=3)])


def test_format_rows_rejects_unknown_format() -> None:
    """An unknown format is a ValueError naming the choices."""
    with pytest.raises(ValueError, match="table, csv, json"):
        bench.format_rows(sample_rows(), "xml")


# --- measuring in a world of one --------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_run_bench_world_of_one() -> None:
    """In a world of one every collective runs, results are right and busbw factors apply."""
    rows = bench.run_bench([4096, 65536], list(bench.COLLECTIVES), "int32", iters=3,
                           warmup=1)
    assert [(r.collective, r.size) for r in rows] == [
        (name, size) for name in bench.COLLECTIVES for size in (4096, 65536)]
    for r in rows:
        assert (r.world_size, r.iters, r.wrong, r.dtype) == (1, 3, 0, "int32")
        assert r.size // 4 == r.count
        assert 0 < r.min_us <= r.time_us <= r.p90_us
        assert r.algbw > 0
        expected_bus = r.algbw if r.collective in ("broadcast", "sendrecv") else 0.0
        assert expected_bus == pytest.approx(r.busbw)


@pytest.mark.usefixtures("world_of_one")
def test_run_bench_rounds_size_down_to_whole_elements() -> None:
    """A size that is not a multiple of the item size is rounded down (at least one element)."""
    rows = bench.run_bench([10, 3], ["all_reduce"], "float64", iters=1, warmup=0)
    assert [(r.size, r.count) for r in rows] == [(8, 1), (8, 1)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"iters": 0}, "iters"), ({"warmup": -1}, "warmup"), ({"dtype": "str"}, "dtype"),
    ({"collectives": ["all_scatter"]}, "collective"), ({"sizes": [0]}, "sizes"),
])
def test_run_bench_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """Bad arguments fail before any group is joined."""
    args = {"sizes": [4096], **kwargs}
    with pytest.raises(ValueError, match=match):
        bench.run_bench(**args)


def test_wrong_results_are_counted() -> None:
    """The result check finds corrupted elements in each collective's output."""
    dtype = np.dtype("float32")
    case = bench._Case("all_reduce", 10, dtype, rank=0, world=2)
    case.reset()
    case.x *= 3  # rank0 input 1x pattern; the right sum over 2 ranks is 3x pattern
    assert case.wrong() == 0
    case.x[4] += 1
    assert case.wrong() == 1
    case = bench._Case("all_gather", 10, dtype, rank=1, world=2)
    case.result = [case.pattern.copy(), case.pattern * 2]
    assert case.wrong() == 0
    case.result = [case.pattern.copy()]
    assert case.wrong() == 20


# --- the command line ---------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_cli_world_of_one_json_output(tmp_path: os.PathLike) -> None:
    """`swarmfd bench` writes parseable JSON to --output and exits 0."""
    out = os.path.join(tmp_path, "bench.json")
    result = CliRunner().invoke(main, ["bench", "--sizes", "4K,16K", "-i", "2", "-w", "0",
                                       "--op", "all_gather", "--format", "json", "-o", out])
    assert result.exit_code == 0, result.output
    with open(out, encoding="utf-8") as f:
        rows = bench.rows_from_json(f.read())
    assert [(r.collective, r.size) for r in rows] == [("all_gather", 4096), ("all_gather", 16384)]


@pytest.mark.parametrize(("args", "match"), [
    (["--sizes", "4K,huge"], "bad size 'huge'"),
    (["--sizes", "4K", "--min-bytes", "1K"], "either --sizes or"),
    (["--op", "all_scatter"], "unknown collective"),
    (["--dtype", "text"], "unsupported dtype"),
    (["-b", "1M", "-e", "4K"], "exceeds"),
])
def test_cli_rejects_bad_options(args: list[str], match: str) -> None:
    """Bad options are a usage error (exit 2) with a clear message."""
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2
    assert match in result.output


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_two_ranks_through_swarmfd_run(tmp_path: os.PathLike, transport: str) -> None:
    """A real 2-rank run via `swarmfd run -n 2 -- swarmfd bench` gives correct JSON rows
    for every collective (each row's ``wrong`` is the count of wrong elements)."""
    out = os.path.join(tmp_path, "bench.json")
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env["SWARMFD_TRANSPORT"] = transport
    cmd = [sys.executable, "-m", "swarmfd", "run", "-n", "2", "--timeout", "60", "--",
           sys.executable, "-m", "swarmfd", "bench", "--sizes", "4K,64K", "--iters", "5",
           *(a for c in bench.COLLECTIVES for a in ("--op", c)),
           "--format", "json", "--output", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    with open(out, encoding="utf-8") as f:
        rows = bench.rows_from_json(f.read())
    assert [(r.collective, r.size) for r in rows] == [
        (c, s) for c in bench.COLLECTIVES for s in (4096, 65536)]
    for r in rows:
        assert (r.world_size, r.iters, r.wrong) == (2, 5, 0)
        assert r.time_us > 0
        assert r.algbw * bench.bus_factor(r.collective, 2) == pytest.approx(r.busbw)
    assert "swarmfd bench: all_reduce 4096 B" in proc.stderr  # progress goes to stderr


def test_compare_script_runs_swarmfd(tmp_path: os.PathLike) -> None:
    """benchmarks/compare.py measures swarmfd and writes its CSV and markdown tables."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "compare.py")
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    cmd = [sys.executable, script, "-n", "2", "--systems", "swarmfd", "--sizes", "4K,1M",
           "--iters", "3", "--warmup", "1", "--runs", "1", "--no-memory", "--no-plot",
           "--timeout", "90", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "| system | 4 KiB | 1 MiB |" in proc.stdout
    assert any(line.startswith("| swarmfd | ") for line in proc.stdout.splitlines())
    (summary,) = [p for p in os.listdir(tmp_path) if p.endswith(".csv") and "raw" not in p]
    with open(os.path.join(tmp_path, summary), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    got = {(r["collective"], int(r["size"])) for r in rows}
    assert got == {(c, s) for c in ("all_reduce", "broadcast", "all_gather") for s in (4096, 2**20)}
    assert all(int(r["wrong"]) == 0 and float(r["latency_us"]) > 0 for r in rows)


def test_steps_script_counts_a_calls_python_steps() -> None:
    """benchmarks/steps.py counts the bytecodes and Python calls of a collective in every
    rank of a real job, per function, and names the layers a call passes through."""
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    script = os.path.join(root, "benchmarks", "steps.py")
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    cmd = [sys.executable, script, "--tree", f"here={root}", "-n", "2", "--plane", "socket",
           "--call", "all_reduce", "--warmup", "2", "--calls", "3", "--top", "40",
           "--timeout", "90"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    (total,) = [line for line in proc.stdout.splitlines() if line.startswith("  here: ")]
    bytecodes = int(total.split()[1])
    assert 100 < bytecodes < 100_000, total
    # (After the warm-up the call runs its schedule, swarmfd/call.py, whose algorithm
    # algorithms/base.py:run drives: the channel's receive runs only when the peer's
    # message is not there whole at once.)
    for layer in ("collectives.py:all_reduce", "call.py:run", "base.py:run",
                  "socket.py:send_packed"):
        assert layer in proc.stdout, proc.stdout


def _compare_module():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "compare.py")
    spec = importlib.util.spec_from_file_location("swarmfd_compare_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_compare_reports_the_median_and_the_best_of_the_runs() -> None:
    """Plain data: one disturbed run moves the median of three, not the best one."""
    cmp = _compare_module()

    def result(run: int, system: str, seconds: float):
        return cmp.Result(run=run, system=system, n=2, collective="all_reduce", size=1 << 20,
                          iters=300, median_s=seconds, min_s=seconds, p90_s=seconds, wrong=0)

    # swarmfd: runs 1 and 2 disturbed (2x); gloo: run 3 disturbed.
    results = [result(1, "swarmfd", 0.8e-3), result(2, "swarmfd", 0.7e-3),
               result(3, "swarmfd", 0.4e-3), result(1, "gloo", 1.0e-3),
               result(2, "gloo", 1.1e-3), result(3, "gloo", 2.0e-3)]
    rows = {r["system"]: r for r in cmp.summarize(results)}
    assert rows["swarmfd"]["median_s"] == pytest.approx(0.7e-3)
    assert rows["swarmfd"]["best_s"] == pytest.approx(0.4e-3)
    assert rows["gloo"]["best_s"] == pytest.approx(1.0e-3)
    summary = list(rows.values())
    median_table = cmp.ratio_tables(summary, ["swarmfd"], ["gloo"], [2], [1 << 20])
    best_table = cmp.ratio_tables(summary, ["swarmfd"], ["gloo"], [2], [1 << 20], "best_s")
    assert "median of the runs" in median_table
    assert "| swarmfd | gloo | 2 | 1.57x |" in median_table  # 1.1 / 0.7
    assert "best run of each system" in best_table
    assert "| swarmfd | gloo | 2 | 2.50x |" in best_table  # 1.0 / 0.4


def test_a_compare_variant_with_another_tree_imports_that_tree(tmp_path: os.PathLike) -> None:
    """A variant's PYTHONPATH (another checkout's swarmfd, for before/after compares) is
    what its jobs import, from the repository root too: ``python -m`` puts the working
    directory first, so jobs that ran in the repository would import its swarmfd whatever
    PYTHONPATH said."""
    cmp = _compare_module()
    tree = os.path.join(tmp_path, "tree")
    os.makedirs(os.path.join(tree, "swarmfd"))
    with open(os.path.join(tree, "swarmfd", "__init__.py"), "w", encoding="utf-8") as f:
        f.write("")
    here = os.getcwd()
    os.chdir(os.path.join(os.path.dirname(__file__), os.pardir))  # the repository root
    try:
        other = cmp.swarmfd_origin(cmp.Variant("other", {"PYTHONPATH": tree}))
        default = cmp.swarmfd_origin(cmp.Variant("default", {}))
    finally:
        os.chdir(here)
    assert other == os.path.join(tree, "swarmfd")
    assert os.path.samefile(default, os.path.dirname(cmp.__file__) + "/../swarmfd")


def test_compare_writes_where_git_ignores_it() -> None:
    """compare.py's outputs go to benchmarks/out/ by default, which git ignores (outputs
    are never committed); no results folder is tracked under benchmarks/."""
    cmp = _compare_module()
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
    default = cmp.build_parser().parse_args([]).out_dir
    assert os.path.samefile(os.path.dirname(default), os.path.join(root, "benchmarks"))
    assert os.path.basename(default) == "out"
    try:
        ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/out/compare-x.csv"],
                                 cwd=root, capture_output=True, timeout=30)
        tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=root,
                                 capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no git here")
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, "benchmarks/out/ is not ignored by git"
    files = tracked.stdout.split()
    assert not [f for f in files if f.startswith(("benchmarks/out/", "benchmarks/results/"))]
    assert len(files) <= 40, len(files)


def test_targets_judges_each_target_by_both_statistics_and_refuses_a_raw_csv(
        tmp_path: os.PathLike) -> None:
    """benchmarks/targets.py on plain data: a target met by the median only, one by both;
    a compare's raw CSV (no best_s) is refused naming what it expected."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "targets.py")
    summary = os.path.join(tmp_path, "compare-x.csv")
    fields = ["system", "n", "collective", "size", "median_s", "best_s"]
    with open(summary, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        # 4 KiB at N=2, socket plane vs Open MPI TCP (at least 1x): median 1.1x, best 0.9x.
        w.writerow({"system": "swarmfd-tcp", "n": 2, "collective": "all_reduce",
                    "size": 4096, "median_s": 30e-6, "best_s": 30e-6})
        w.writerow({"system": "mpi-tcp", "n": 2, "collective": "all_reduce",
                    "size": 4096, "median_s": 33e-6, "best_s": 27e-6})
        # 64 KiB (at least 0.8x): 1.0x both.
        w.writerow({"system": "swarmfd-tcp", "n": 2, "collective": "all_reduce",
                    "size": 65536, "median_s": 60e-6, "best_s": 50e-6})
        w.writerow({"system": "mpi-tcp", "n": 2, "collective": "all_reduce",
                    "size": 65536, "median_s": 60e-6, "best_s": 50e-6})
    out = subprocess.run([sys.executable, script, summary], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| socket plane vs Open MPI TCP | 2 | 4 KiB | 1x | 1.10x | 0.90x | by the median |" \
        in out.stdout
    assert "| socket plane vs Open MPI TCP | 2 | 64 KiB | 0.8x | 1.00x | 1.00x | yes |" \
        in out.stdout
    assert "1 of 2 measured targets met by both statistics." in out.stdout
    raw = os.path.join(tmp_path, "compare-x-raw.csv")
    with open(raw, "w", newline="") as f:
        csv.writer(f).writerow(["run", "system", "n", "collective", "size", "median_s"])
    out = subprocess.run([sys.executable, script, raw], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "not compare-STAMP-raw.csv" in out.stderr, out.stderr
