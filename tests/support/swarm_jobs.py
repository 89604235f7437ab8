"""Helpers shared by the Swarm tests (tests/swarm) and the multi-node tests (tests/multinode)."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

#: A job's command (``python -c``): rank 1 sleeps 50 ms before each all_reduce, for 90 s
#: at most (``swarmfd top`` flags it).
SLOWED_JOB = (
    "import time\n"
    "import numpy as np\n"
    "import swarmfd as fd\n"
    "fd.init()\n"
    "x = np.ones(256, np.float32)\n"
    "end = time.monotonic() + 90\n"
    "while time.monotonic() < end:\n"
    "    if fd.get_rank() == 1:\n"
    "        time.sleep(0.05)\n"
    "    fd.all_reduce(x)\n"
)


def top_rows(run: Callable[..., Any], name: str, ranks: int, timeout: float = 90) -> Any:
    """``swarmfd top --once --json NAME`` (through ``run(*args)``, which returns a
    CompletedProcess) until it shows ``ranks`` ranks at work and a straggler; its rows."""
    import json

    rows: list[dict[str, Any]] = []

    def ready() -> bool:
        nonlocal rows
        out = run("top", "--once", "--json", name)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        return (len(rows) == ranks and all(r["calls_per_s"] > 0 for r in rows)
                and any(r["straggler"] for r in rows))

    with contextlib.suppress(TimeoutError):  # the caller's assertions show the rows
        wait_until(ready, timeout, f"swarmfd top showing the {ranks} ranks of {name}")
    return rows


def rank_lines(text: str) -> dict[int, list[str]]:
    """deploy's '[rank R] line' output, grouped by rank (prefix removed)."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\[rank (\d+)\] (.*)$", line)
        if m:
            lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); TimeoutError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)


@contextlib.contextmanager
def job_names(client: Any, prefix: str,
              tolerate: tuple[type[Exception], ...] = ()) -> Iterator[Callable[[str], str]]:
    """A factory of unique job names; every job named by it is removed from ``client``'s
    Swarm on exit (a job already gone is fine, as are the ``tolerate`` errors)."""
    from swarmfd.swarm.engine import remove_job
    from swarmfd.swarm.errors import JobNotFoundError

    names: list[str] = []

    def make(what: str) -> str:
        name = f"{prefix}-{what}-{uuid.uuid4().hex[:6]}"
        names.append(name)
        return name

    yield make
    for name in names:
        with contextlib.suppress(JobNotFoundError, *tolerate):
            remove_job(client, name, timeout=60)
