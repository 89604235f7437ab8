"""``swarmfd top [JOB]``: every rank of a running job, live, as ``docker stats`` shows
containers.

The figures are the ranks' own status lines (:mod:`swarmfd.statusline`): a local job's
from its status file (:mod:`swarmfd.jobs`), a Swarm job's from its service log
(:mod:`swarmfd.swarm.status`, read through a manager: every node's ranks). Per rank:
its node, what it does (computing, or inside which call for how long), calls and MB
a second, the share of its time it waited for others, and marks on the straggler (the
rank the others wait for: :func:`swarmfd.counters.straggler` over the world's last
calls, or the rank the stalled ranks' reports name) and on stalled ranks (inside one
call for longer than the stall threshold). rich draws the table; ``--once`` prints one
table, ``--once --json`` a list of {"rank", "node", "state", "calls_per_s",
"mb_per_s", "wait_share", "straggler", "stalled"}.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from .config import DEFAULT_STALL_WARN
from .counters import straggler

__all__ = ["REFRESH", "TopError", "pick_job", "render", "rows", "show"]

#: Seconds between refreshes of the live table.
REFRESH = 1.0
#: A rank's latest status line older than this (seconds) says nothing of now.
STALE = 10.0


class TopError(Exception):
    """No job to show, or several and none chosen: the message says which there are."""


def rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The table of ``job`` (its ``world`` and its ranks' latest records), one row per
    rank, in rank order; a rank without a record yet shows as "starting"."""
    world = int(job.get("world", 0))
    records = {int(r): rec for r, rec in (job.get("ranks") or {}).items()}
    late = _straggler(records)
    out = []
    for rank in range(world):
        rec = records.get(rank, {})
        inside = float(rec.get("in_s", 0.0))
        threshold = float(rec.get("stall_s") or DEFAULT_STALL_WARN)
        state = str(rec.get("state", "starting"))
        if rec.get("final"):
            state = "finished"
        elif inside >= 0.1:
            state = f"{state} for {inside:.1f} s"
        out.append({"rank": rank, "node": str(rec.get("node", "-")), "state": state,
                    "calls_per_s": float(rec.get("calls_per_s", 0.0)),
                    "mb_per_s": float(rec.get("mb_per_s", 0.0)),
                    "wait_share": float(rec.get("wait_share", 0.0)),
                    "straggler": rank in late,
                    "stalled": bool(rec) and not rec.get("final") and inside >= threshold})
    return out


def _straggler(records: dict[int, dict[str, Any]]) -> set[int]:
    """The ranks to mark: those the stalled ranks' reports name, else the straggler of
    the world's last calls (each record carries its waits in them)."""
    blamed = {r for rec in records.values() for r in rec.get("blamed") or []
              if isinstance(r, int)}
    if blamed:
        return blamed
    waits: dict[int, dict[int, float]] = {}
    for rank, rec in records.items():
        seq, kept = int(rec.get("seq", 0)), rec.get("waits") or []
        waits[rank] = {seq - len(kept) + 1 + i: float(w) for i, w in enumerate(kept)}
    shares = {r: float(rec.get("wait_share", 0.0)) for r, rec in records.items()}
    found = straggler(waits, shares) if len(records) > 1 else None
    return set() if found is None else {found[0]}


def render(job: dict[str, Any], table: list[dict[str, Any]]) -> Any:
    """The rich table of ``job``'s rows."""
    from rich import box
    from rich.table import Table

    # docker stats' look: a title, upper-case headers over plain columns.
    t = Table(title=f"{job.get('name', '?')} ({job.get('kind', '?')}, "
                    f"{job.get('world', '?')} ranks)", title_justify="left",
              box=box.SIMPLE_HEAD, header_style="bold")
    for name, right in (("RANK", True), ("NODE", False), ("STATE", False),
                        ("CALLS/S", True), ("MB/S", True), ("WAIT %", True), ("", False)):
        t.add_column(name, justify="right" if right else "left", no_wrap=True)
    for row in table:
        marks = [m for m, on in (("[bold red]straggler[/]", row["straggler"]),
                                 ("[bold yellow]stalled[/]", row["stalled"])) if on]
        t.add_row(str(row["rank"]), row["node"], row["state"], f"{row['calls_per_s']:.1f}",
                  f"{row['mb_per_s']:.2f}", f"{100 * row['wait_share']:.0f}", " ".join(marks))
    return t


def pick_job(name: str | None, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The job named ``name`` among ``jobs`` (local and Swarm), or with no name the only
    one; TopError listing them otherwise."""
    if name is not None:
        found = [j for j in jobs if j["name"] == name]
        if found:
            return found[0]
        raise TopError(f"no running job named {name!r}" + _listing(jobs))
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise TopError("no running swarmfd job of this user (local, from `swarmfd run`, or "
                       "on the Swarm, from `swarmfd deploy`)")
    raise TopError("several jobs are running: give one of them as JOB" + _listing(jobs))


def _listing(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return ""
    return ":\n" + "\n".join(f"  {j['name']}  ({j['kind']}, {j.get('world', '?')} ranks: "
                             f"{j.get('command', '')})" for j in jobs)


def show(read: Callable[[], dict[str, Any]], *, once: bool, as_json: bool,
         echo: Callable[[str], None], refresh: float = REFRESH) -> None:
    """Show the job ``read()`` returns: one table (``once``; as JSON with
    ``as_json``), or a live one until Ctrl-C (or the job's end)."""
    if once:
        job = read()
        table = rows(job)
        if as_json:
            echo(json.dumps(table))
            return
        from rich.console import Console

        Console().print(render(job, table))
        return
    from rich.live import Live

    job = read()
    with Live(render(job, rows(job)), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(refresh)
                job = read()
                live.update(render(job, rows(job)))
        except KeyboardInterrupt:
            pass
