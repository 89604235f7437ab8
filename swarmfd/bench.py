"""``swarmfd bench``: an nccl-tests-like benchmark of swarmfd's collectives.

It runs inside any process group (``swarmfd run -n 2 -- swarmfd bench``, or a Swarm
job). Each iteration resets the input (untimed), runs :func:`swarmfd.barrier` and times
the call; after the loop, one ``all_reduce(op="max")`` of the times gives each
iteration's slowest rank. A row reports their median (and min, p90), ``algbw = bytes /
time`` and ``busbw = algbw * bus_factor`` as nccl-tests do (GB = 1e9 bytes), the CPU
time per call (``cpu_us``: every thread of a rank's process, mean over iterations and
ranks) and the wrong elements of the last result, summed over ranks.

``size`` is each rank's input (algbw counts :func:`moved_bytes`); sendrecv sends it to
the next rank of a ring. Results go into preallocated ``out=`` arrays. Nothing here
prints: ``run_bench`` takes a ``progress`` callback, ``format_*`` render rows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

import swarmfd as fd
from swarmfd.algorithms.base import split

COLLECTIVES: tuple[str, ...] = ("all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                 "all_to_all", "gather", "scatter", "sendrecv")
"""The collectives ``swarmfd bench`` can time."""

FORMATS: tuple[str, ...] = ("table", "csv", "json")
"""Output formats of :func:`format_rows`."""

KIB = 1024
MIB = 1024 * KIB
DEFAULT_MIN_BYTES = 4 * KIB
DEFAULT_MAX_BYTES = 64 * MIB
DEFAULT_FACTOR = 4
DEFAULT_WARMUP = 3

_UNITS = {"": 1, "B": 1, "K": KIB, "KB": KIB, "KIB": KIB, "M": MIB, "MB": MIB, "MIB": MIB,
          "G": 1024 * MIB, "GB": 1024 * MIB, "GIB": 1024 * MIB}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Row:
    """One measured (collective, size) point. Times in microseconds, bandwidths in GB/s."""

    collective: str
    size: int
    count: int
    dtype: str
    world_size: int
    iters: int
    warmup: int
    time_us: float
    min_us: float
    p90_us: float
    algbw: float
    busbw: float
    wrong: int
    #: CPU time per call of one rank (every thread of its process), mean over iterations
    #: and ranks: the price of waits that poll (SWARMFD_SPIN).
    cpu_us: float = 0.0


# --- parsing -----------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``4096``, ``"4K"``, ``"64KiB"``, ``"1M"``, ``"2G"`` (binary
    units); ``ValueError`` naming the bad text and the accepted forms."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise TypeError(f"size must be an int or a string like '4K', got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(text)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"bad size {text!r}: expected a positive integer number of bytes with an optional "
                "unit K, M or G (binary: 4K = 4096), e.g. 4K, 64KiB, 1M, 16M"
            )
        value = int(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"bad size {text!r}: expected a positive number of bytes")
    return value


def parse_sizes(spec: str) -> list[int]:
    """Parse a comma-separated size list, ``"4K,64K,1M"`` -> ``[4096, 65536, 1048576]``."""
    items = [item for item in spec.split(",") if item.strip()]
    if not items:
        raise ValueError(f"bad size list {spec!r}: expected comma-separated sizes like 4K,64K,1M")
    return [parse_size(item) for item in items]


def size_range(
    min_bytes: int = DEFAULT_MIN_BYTES,
    max_bytes: int = DEFAULT_MAX_BYTES,
    factor: int = DEFAULT_FACTOR,
) -> list[int]:
    """Sizes ``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (nccl-tests' -b/-e/-f)."""
    if min_bytes <= 0 or max_bytes <= 0:
        raise ValueError(f"min and max bytes must be positive, got {min_bytes} and {max_bytes}")
    if min_bytes > max_bytes:
        raise ValueError(f"min bytes {min_bytes} exceeds max bytes {max_bytes}")
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise ValueError(f"size factor must be an integer >= 2, got {factor!r}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def parse_collectives(names: Iterable[str]) -> list[str]:
    """Validate collective names (duplicates dropped, order kept); default all_reduce only."""
    result: list[str] = []
    for name in names:
        key = name.strip().lower().replace("-", "_")
        if key not in COLLECTIVES:
            raise ValueError(
                f"unknown collective {name!r}: expected one of {', '.join(COLLECTIVES)}"
            )
        if key not in result:
            result.append(key)
    return result or ["all_reduce"]


def parse_dtype(name: str) -> np.dtype:
    """A numeric numpy dtype from its name (``float32``, ``int64``, ...); else ``ValueError``."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "fiu":
        raise ValueError(
            f"unsupported dtype {name!r}: expected a numeric numpy dtype such as float32, "
            "float64, int32 or int64"
        )
    return dtype


def default_iters(size: int) -> int:
    """Timed iterations for a size: 300 up to 1 MiB, 64 to 16 MiB, else 16."""
    if size <= MIB:
        return 300
    if size <= 16 * MIB:
        return 64
    return 16


def moved_bytes(collective: str, size: int, world_size: int) -> int:
    """The bytes algbw counts for one call of ``size`` (each rank's input, or part): the
    whole result of all_gather and gather, the whole source of scatter, else ``size``."""
    return size * world_size if collective in ("all_gather", "gather", "scatter") else size


def bus_factor(collective: str, world_size: int) -> float:
    """The nccl-tests factor from algorithm bandwidth to bus bandwidth."""
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if collective in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}: expected one of {', '.join(COLLECTIVES)}")


# --- measuring ---------------------------------------------------------------


class _Case:
    """Inputs, the timed call and the result check of one collective at one size."""

    def __init__(self, collective: str, count: int, dtype: np.dtype, rank: int, world: int):
        self.collective = collective
        self.world = world
        if collective == "all_to_all":
            count -= count % world  # equal parts (as nccl-tests' alltoall)
        # Small positive integers, exact in every dtype and in any summation order.
        self.pattern = (np.arange(count, dtype=np.int64) % 7 + 1).astype(dtype)
        if collective == "broadcast" and rank != 0:
            self.source = np.zeros(count, dtype=dtype)
        else:
            self.source = self.pattern * dtype.type(rank + 1)
        self.x = np.empty_like(self.source)
        self.result: object = None
        self.rank = rank
        self.out: np.ndarray | None = None
        if collective == "all_gather":
            self.out = np.empty((world, count), dtype=dtype)
        elif collective == "reduce_scatter":
            a, b = _parts(count, world)[rank]
            self.out = np.empty(b - a, dtype=dtype)
        elif collective in ("all_to_all", "sendrecv", "scatter"):
            self.out = np.empty(count, dtype=dtype)
        elif collective == "gather" and rank == 0:
            self.out = np.empty((world, count), dtype=dtype)
        #: scatter's source on rank 0: row r is what rank r must receive.
        self.chunks: np.ndarray | None = None
        if collective == "scatter" and rank == 0:
            self.chunks = np.stack([self.pattern * dtype.type(r + 1) for r in range(world)])

    def reset(self) -> None:
        np.copyto(self.x, self.source)
        if self.out is not None:
            self.out.fill(0)  # so the check sees what the last call wrote

    def run(self) -> None:
        c = self.collective
        if c == "all_reduce":
            fd.all_reduce(self.x, op="sum")
        elif c == "broadcast":
            fd.broadcast(self.x, src=0)
        elif c == "all_gather":
            self.result = fd.all_gather(self.x, out=self.out)
        elif c == "reduce_scatter":
            fd.reduce_scatter(self.x, self.out)
        elif c == "all_to_all":
            fd.all_to_all(self.x, self.out)
        elif c == "gather":
            self.result = fd.gather(self.x, 0, out=self.out)
        elif c == "scatter":
            fd.scatter(self.out, self.chunks, 0)
        elif self.world == 1:  # no peer: the ring's one hop is this rank
            np.copyto(self.out, self.x)
        else:
            n = self.world
            r = fd.irecv(self.out, (self.rank - 1) % n)
            s = fd.isend(self.x, (self.rank + 1) % n)
            r.wait()
            s.wait()

    def wrong(self) -> int:
        """Number of wrong elements in the last result on this rank."""
        p = self.pattern
        if self.collective == "all_reduce":
            expected = np.zeros_like(p)
            for r in range(self.world):  # in the dtype's own arithmetic (ints may wrap)
                expected = expected + p * p.dtype.type(r + 1)
            return _count_wrong(self.x, expected)
        if self.collective == "broadcast":
            return _count_wrong(self.x, p)
        n = self.world
        if self.collective == "reduce_scatter":
            total = np.zeros_like(p)
            for r in range(n):
                total = total + p * p.dtype.type(r + 1)
            a, b = _parts(p.size, n)[self.rank]
            return _count_wrong(self.out, total[a:b])
        if self.collective == "all_to_all":
            # Part j of rank r's input (its pattern times r + 1) goes to rank j, in rank order.
            a, b = _parts(p.size, n)[self.rank]
            want = np.concatenate([p[a:b] * p.dtype.type(r + 1) for r in range(n)])
            return _count_wrong(self.out, want)
        if self.collective == "sendrecv":
            return _count_wrong(self.out, p * p.dtype.type((self.rank - 1) % n + 1))
        if self.collective == "scatter":
            return _count_wrong(self.out, p * p.dtype.type(self.rank + 1))
        if self.collective == "gather" and self.rank != 0:
            return 0 if self.result is None else p.size
        parts = self.result
        if not isinstance(parts, (list, tuple)) or len(parts) != self.world:
            return p.size * self.world
        return sum(
            _count_wrong(np.asarray(part), p * p.dtype.type(r + 1)) for r, part in enumerate(parts)
        )


#: [start, stop) of ``n`` near-equal parts of ``count`` (as np.array_split cuts them).
_parts = split


def _count_wrong(actual: np.ndarray, expected: np.ndarray) -> int:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return expected.size
    if expected.dtype.kind == "f":
        rtol = 1e-3 if expected.dtype.itemsize <= 2 else 1e-6
        return int(np.count_nonzero(~np.isclose(actual, expected, rtol=rtol, atol=0)))
    return int(np.count_nonzero(actual != expected))


def _measure(case: _Case, iters: int, warmup: int) -> tuple[np.ndarray, float]:
    """Warm up, then time ``iters`` iterations; returns this rank's times in seconds and
    its process's CPU seconds per iteration (inside the timed calls only)."""
    for _ in range(warmup):
        case.reset()
        fd.barrier()
        case.run()
    times = np.empty(iters, dtype=np.float64)
    clock = time.perf_counter
    cpu_clock = time.process_time
    cpu = 0.0
    for i in range(iters):
        case.reset()
        fd.barrier()
        c0 = cpu_clock()
        t0 = clock()
        case.run()
        times[i] = clock() - t0
        cpu += cpu_clock() - c0
    return times, cpu / iters


def run_bench(
    sizes: Sequence[int] | None = None,
    collectives: Sequence[str] = ("all_reduce",),
    dtype: str = "float32",
    iters: int | None = None,
    warmup: int = DEFAULT_WARMUP,
    *,
    check: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time ``collectives`` at each of ``sizes`` (bytes) in the current process group
    (without one, one from the environment, cleaned up after); every rank calls it alike
    and gets the same rows. ``iters=None``: :func:`default_iters`; ``progress`` gets a
    line per point."""
    sizes = list(sizes) if sizes is not None else size_range()
    names = parse_collectives(collectives)
    np_dtype = parse_dtype(dtype)
    if iters is not None and (isinstance(iters, bool) or not isinstance(iters, int) or iters < 1):
        raise ValueError(f"iters must be a positive integer, got {iters!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"sizes must be positive integers (bytes), got {size!r}")

    owns_group = not fd.is_initialized()
    if owns_group:
        fd.init_from_env()
    try:
        rank, world = fd.get_rank(), fd.get_world_size()
        rows = []
        for name in names:
            for size in sizes:
                count = max(1, size // np_dtype.itemsize)
                n_iters = iters if iters is not None else default_iters(size)
                if progress is not None:
                    progress(f"{name} {count * np_dtype.itemsize} B ({count} x {np_dtype.name}), "
                             f"{warmup} warm-up + {n_iters} iterations")
                case = _Case(name, count, np_dtype, rank, world)
                times, cpu_s = _measure(case, n_iters, warmup)
                wrong = np.array([case.wrong() if check else 0], dtype=np.int64)
                del case
                fd.all_reduce(times, op="max")  # slowest rank, once per size
                fd.all_reduce(wrong, op="sum")
                cpu = np.array([cpu_s])
                fd.all_reduce(cpu, op="sum")
                rows.append(_row(name, count, np_dtype, world, n_iters, warmup, times,
                                 int(wrong[0]), float(cpu[0]) / world))
        return rows
    finally:
        if owns_group:
            fd.cleanup()


def _row(name: str, count: int, dtype: np.dtype, world: int, iters: int, warmup: int,
         slowest: np.ndarray, wrong: int, cpu_s: float = 0.0) -> Row:
    size = count * dtype.itemsize
    median = float(np.median(slowest))
    moved = moved_bytes(name, size, world)
    algbw = moved / median / 1e9 if median > 0 else math.inf
    return Row(
        collective=name, size=size, count=count, dtype=dtype.name, world_size=world,
        iters=iters, warmup=warmup, time_us=median * 1e6, min_us=float(np.min(slowest)) * 1e6,
        p90_us=float(np.percentile(slowest, 90)) * 1e6, algbw=algbw,
        busbw=algbw * bus_factor(name, world), wrong=wrong, cpu_us=cpu_s * 1e6,
    )


# --- formatting --------------------------------------------------------------

ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Row))
"""Column names of the CSV and of the JSON row objects, in order."""


def format_table(rows: Sequence[Row]) -> str:
    """An aligned human-readable table (nccl-tests style; ``#`` lines are comments)."""
    header = ("collective", "size(B)", "count", "dtype", "iters", "time(us)", "min(us)",
              "p90(us)", "cpu(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong")
    body = [
        (r.collective, str(r.size), str(r.count), r.dtype, str(r.iters), f"{r.time_us:.1f}",
         f"{r.min_us:.1f}", f"{r.p90_us:.1f}", f"{r.cpu_us:.1f}", f"{r.algbw:.3f}",
         f"{r.busbw:.3f}", str(r.wrong))
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = []
    if rows:
        r0 = rows[0]
        lines.append(f"# swarmfd bench: world_size {r0.world_size}, warmup {r0.warmup}, "
                     "times = slowest rank, median over iterations; busbw per nccl-tests")
    lines.append("# " + "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for line in body:
        lines.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
    if rows:
        bad = sum(r.wrong for r in rows)
        lines.append(f"# wrong results: {bad}" + ("" if bad == 0 else "  <-- FAILED"))
    return "\n".join(lines) + "\n"


def format_csv(rows: Sequence[Row]) -> str:
    """CSV with a header line of :data:`ROW_FIELDS`; floats at full precision."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=ROW_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(asdict(r))
    return out.getvalue()


def format_json(rows: Sequence[Row]) -> str:
    """A JSON object ``{"benchmark", "world_size", "rows": [row objects]}``."""
    doc = {
        "benchmark": "swarmfd bench",
        "world_size": rows[0].world_size if rows else None,
        "rows": [asdict(r) for r in rows],
    }
    return json.dumps(doc, indent=2) + "\n"


def format_rows(rows: Sequence[Row], fmt: str = "table") -> str:
    """Render rows in one of :data:`FORMATS`."""
    if fmt == "table":
        return format_table(rows)
    if fmt == "csv":
        return format_csv(rows)
    if fmt == "json":
        return format_json(rows)
    raise ValueError(f"unknown output format {fmt!r}: expected one of {', '.join(FORMATS)}")


def rows_from_json(text: str) -> list[Row]:
    """Parse :func:`format_json` output back into rows (for tests and compare scripts)."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError("not a swarmfd bench JSON document: expected an object with 'rows'")
    return [Row(**item) for item in doc["rows"]]
