"""The status lines of a rank: how ``swarmfd top`` learns what every rank does.

With ``SWARMFD_STATUS`` set (seconds; ``swarmfd run`` and ``swarmfd deploy`` set it),
each rank writes one line that often to its stderr (:class:`swarmfd.observe.StatusThread`):
MARK, then a JSON object, then a newline, in one ``write``. Nothing listens on a port:
the lines travel with the rank's own output, through the pipe ``swarmfd run`` reads
or through the Swarm's service log (which a manager reads from every node). Whoever
reads a rank's stderr takes them out (:func:`split`): ``swarmfd run`` keeps the latest
per rank in a private status file (:mod:`swarmfd.jobs`), ``deploy`` and ``logs`` hide
them. A line the rank's own code had begun without its newline (a progress bar) is
put back together around the record.

Fields: ``rank``, ``world``, ``node``, ``pid``, ``state`` ("computing", or the call it
is in: "all_reduce #7", "broadcast #3 of group 2"), ``in_s`` (for how long),
``calls``, ``bytes``, ``wait_s`` (totals), ``up_s`` (seconds since init),
``calls_per_s``, ``mb_per_s``, ``wait_share`` (since the line before), ``stall_s``
(the stall threshold), ``blamed`` (the ranks its latest stall report named), ``seq``
(the world's last call) and ``waits`` (this rank's waits in the world's last calls, up
to ``seq``), ``final`` (the last line, at cleanup) and ``summary`` (rank 0's straggler
line, in its last line).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MARK", "MAX_RECORD", "encode", "split"]

#: What starts a status record: a control character no text starts a line with.
MARK = b"\x1eswarmfd-status "
#: A longer record is not one (its JSON is not read).
MAX_RECORD = 16 << 10


def encode(record: dict[str, Any]) -> bytes:
    """The line of ``record``."""
    return MARK + json.dumps(record, separators=(",", ":")).encode() + b"\n"


def split(line: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """A line read from a rank's stderr (with or without its newline) as (what the rank
    wrote before the record, the record): (``line``, None) when it holds none. The
    text before is the start of a line the rank had not ended: the reader keeps it and
    puts it before its next line."""
    at = line.find(MARK)
    if at < 0:
        return line, None
    body = line[at + len(MARK):].rstrip(b"\r\n")
    record: Any = None
    if len(body) <= MAX_RECORD:
        try:
            record = json.loads(body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            record = None
    if not isinstance(record, dict) or not isinstance(record.get("rank"), int):
        record = {}
    return line[:at], record
