"""The running jobs ``swarmfd top`` can show, and what their ranks last said.

``swarmfd run`` takes every rank's status lines out of its stderr
(:mod:`swarmfd.statusline`) and keeps the latest of each rank in a *status file*:
``<dir>/<job>.json``, where ``<dir>`` is private to the user (``$XDG_RUNTIME_DIR/swarmfd``,
else ``/tmp/swarmfd-<uid>``; mode 0700, owned by the user, or it is not used). The file
is replaced whole (write, then rename) and removed when the run ends; a file whose
launcher is gone (or that was not rewritten for STALE_AFTER) is stale: skipped and
removed. Jobs on a Swarm are read from the service logs
(:mod:`swarmfd.swarm.status`). Nothing listens on a port.

:func:`job_line` is the line ``swarmfd run`` and ``swarmfd deploy`` print at the end of
a job: its calls, its wall time and rank 0's straggler summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from typing import Any

__all__ = ["JobStatus", "job_line", "local_jobs", "status_dir"]

#: A status file is rewritten at most this often (seconds) while lines come in.
WRITE_EVERY = 0.5
#: A status file not rewritten for this long (seconds) is stale: its launcher was killed
#: (its pid may be another process's by now). Ranks write a line a second.
STALE_AFTER = 60.0


def status_dir(create: bool = False) -> str | None:
    """This user's private directory of status files, or None when there is none (or
    it is not private: another user could read or plant files there)."""
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = (os.path.join(runtime, "swarmfd") if runtime and os.path.isdir(runtime)
            else os.path.join(tempfile.gettempdir(), f"swarmfd-{uid}"))
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o700)
    try:
        info = os.lstat(base)
    except OSError:
        return None
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != uid
            or stat.S_IMODE(info.st_mode) & 0o077):
        return None
    return base


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_jobs() -> list[dict[str, Any]]:
    """The jobs ``swarmfd run`` runs for this user now, as their status files hold them
    (newest first)."""
    base = status_dir()
    if base is None:
        return []
    jobs = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if not name.endswith(".json"):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                job = json.load(f)
            fresh = time.time() - os.stat(path).st_mtime < STALE_AFTER
        except (OSError, ValueError):
            continue
        if (isinstance(job, dict) and isinstance(job.get("pid"), int) and fresh
                and _alive(job["pid"])):
            jobs.append(job)
        else:  # a launcher that was killed left it
            with contextlib.suppress(OSError):
                os.unlink(path)
    return sorted(jobs, key=lambda j: -float(j.get("started", 0)))


class JobStatus:
    """The latest status record of each rank of a local job, kept in its status file."""

    def __init__(self, world: int, command: list[str]) -> None:
        self.name = f"run-{os.getpid()}"
        self.world = world
        self.started = time.time()
        self.command = " ".join(command)[:200]
        self.ranks: dict[int, dict[str, Any]] = {}
        self.written = 0.0
        base = status_dir(create=True)
        self.path = None if base is None else os.path.join(base, f"{self.name}.json")

    def add(self, record: dict[str, Any]) -> None:
        """A rank's status record (from its stderr)."""
        rank = record.get("rank")
        if isinstance(rank, int) and 0 <= rank < self.world:
            self.ranks[rank] = record
            if time.monotonic() - self.written >= WRITE_EVERY or record.get("final"):
                self.write()

    def write(self) -> None:
        """Replace the status file (best effort)."""
        self.written = time.monotonic()
        if self.path is None:
            return
        data = {"name": self.name, "kind": "local", "pid": os.getpid(),
                "started": self.started, "command": self.command, "world": self.world,
                "ranks": {str(r): rec for r, rec in sorted(self.ranks.items())}}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
                      encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def close(self) -> None:
        """The job ended: remove its status file."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def job_line(ranks: dict[int, dict[str, Any]], world: int, wall: float) -> str:
    """The end-of-job line from the ranks' last status records: the world's calls, the
    job's wall time and rank 0's straggler summary ("" without any record)."""
    if not ranks:
        return ""
    calls = max(int(r.get("seq", 0)) for r in ranks.values())
    total = sum(int(r.get("calls", 0)) for r in ranks.values())
    done = sum(1 for r in ranks.values() if r.get("final"))
    summary = str(ranks.get(0, {}).get("summary", "")).removeprefix("swarmfd: ")
    told = "" if done == world else f"; {done} of {world} ranks told their totals"
    return (f"{world} rank(s), {calls} world calls ({total} calls of all ranks and groups) "
            f"in {wall:.1f} s{told}; " + (summary or "no straggler"))
