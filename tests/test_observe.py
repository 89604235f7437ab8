"""What a running job tells of itself: the counters and ``fd.stats()``, stall reports,
the straggler summary at cleanup, the status lines (swarmfd.observe, swarmfd.counters,
swarmfd.comm.status, swarmfd.statusline).

The rules (who is the straggler, what a stall line says, how a status record is cut out
of a rank's output) are tested on plain data; the behaviour on real ranks with few,
small calls: a rank that sleeps before a call (the others report it within 2 s of the
threshold), a rank slowed on every step (the summary names it, and the counters add
up to the sleeps), a balanced run (nothing said).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from swarmfd.comm import status
from swarmfd.config import ConfigError, options_from_env
from swarmfd.counters import MIN_CALLS, CallStats, straggler
from swarmfd.observe import straggler_line
from swarmfd.statusline import MARK, encode, split

from .conftest import run_ranks

# -- the rules, on plain data -------------------------------------------------------------


def test_the_rank_that_waits_least_in_most_calls_is_the_straggler() -> None:
    # Rank 2 arrives last in every call: it waits ~0, the others 50 ms.
    waits = {r: {c: (0.0001 if r == 2 else 0.05) for c in range(1, 11)} for r in range(3)}
    assert straggler(waits, {0: 0.5, 1: 0.5, 2: 0.01}) == (2, 10, 10)
    # The same pattern, but the others waited 5 % of their time: nobody is named.
    assert straggler(waits, {0: 0.05, 1: 0.05, 2: 0.0}) is None


def test_a_balanced_job_names_no_straggler() -> None:
    # The last rank changes from call to call, and the waits are small.
    waits = {r: {c: 0.002 * ((r + c) % 3) for c in range(1, 31)} for r in range(3)}
    assert straggler(waits, {0: 0.3, 1: 0.3, 2: 0.3}) is None
    # Waits that differ by less than the floor decide nothing.
    even = {r: {c: 0.0002 * r for c in range(1, 31)} for r in range(3)}
    assert straggler(even, {0: 0.5, 1: 0.5, 2: 0.5}) is None
    # Too few calls that kept anybody waiting.
    few = {r: {c: (0.0 if r == 1 else 0.1) for c in range(1, MIN_CALLS)} for r in range(2)}
    assert straggler(few, {0: 0.9, 1: 0.0}) is None
    # Last in 4 of the 6 calls that kept someone waiting, by chance: nobody is named (a
    # loaded machine's scheduler does this).
    late = {r: {c: 0.0 for c in range(1, 11)} for r in range(3)}
    for c in (1, 3, 5, 7):
        late[0][c] = late[2][c] = 0.02
    late[1][2] = 0.02  # call 2: rank 0 (and 2) last; call 4: rank 2
    late[0][4] = late[1][4] = 0.02
    assert straggler(late, {0: 0.9, 1: 0.5, 2: 0.9}) is None


def test_a_straggler_is_named_when_every_other_call_waits_for_nobody() -> None:
    # Two calls a step, the slow rank computes before the first: it is last in every
    # call that kept someone waiting, half of all calls.
    waits = {r: {c: (0.05 if c % 2 and r != 1 else 0.0002) for c in range(1, 21)}
             for r in range(3)}
    assert straggler(waits, {0: 0.9, 1: 0.01, 2: 0.9}) == (1, 10, 20)


def test_only_the_calls_every_rank_reported_count() -> None:
    # Rank 1's view starts at call 5 (an older window): calls 1-4 are not compared.
    waits = {0: {c: 0.05 for c in range(1, 11)},
             1: {c: 0.0 for c in range(5, 11)}}
    assert straggler(waits, {0: 0.6, 1: 0.0}) == (1, 6, 6)


def test_the_summary_line_names_the_straggler_with_figures() -> None:
    calls = 20
    rows = [[10.0, 6.0, calls, *([0.05] * calls)],
            [10.0, 0.1, calls, *([0.0] * calls)],
            [10.0, 5.5, calls, *([0.04] * calls)]]
    line = straggler_line(rows)
    assert "straggler: rank 1 arrived last in 20 of the last 20 world calls" in line
    assert "rank 0 6.0 s of 10.0 s" in line and "rank 2 5.5 s of 10.0 s" in line
    assert straggler_line([[10.0, 0.2, calls, *([0.01] * calls)]] * 3) == ""


def test_counters_record_calls_bytes_waits_and_the_rank_waited_for() -> None:
    st = CallStats(me=1, world=3)
    st.record(1, 0.5, 4096, 0.4, 2)
    st.record(2, 0.1, 4096, 0.0, 0)
    assert st.as_dict() == {"calls": 2, "bytes": 8192, "time_s": 0.6, "wait_s": 0.4,
                            "last": {1: 1, 2: 1}}
    assert st.recent(2, 5) == [0.4, 0.0]
    st.reset(3)
    assert st.as_dict()["calls"] == 0 and st.recent(2, 2) == [0.0, 0.0]


def test_a_stall_line_names_the_ranks_that_have_not_entered_the_call() -> None:
    # Rank 0 waits in call 7 of 4 members: rank 1 entered it, rank 2 is in another
    # group's call, rank 3 did not answer.
    answers = {1: (7, 6, "all_reduce (call #7 on rank 1)"),
               2: (6, 6, "broadcast (call #3 on rank 2, group 2)")}
    line, missing = status.stall_line(0, "all_reduce #7 of the world (dtype=float32)", 1.52,
                                      7, (0, 1, 2, 3), answers, src=1)
    assert missing == [2, 3]
    assert line.startswith("swarmfd: rank 0: all_reduce #7 of the world (dtype=float32) "
                           "has waited 1.5 s; not entered by ranks 2, 3 (")
    assert "rank 2: last finished #6, waiting in broadcast (call #3 on rank 2" in line
    assert "rank 3: last finished #6, not in a swarmfd call" in line
    line, missing = status.stall_line(0, "barrier #2 of group 4", 3.0, 2, (0, 5),
                                      {5: (2, 1, "barrier (call #2 on rank 5)")}, src=5)
    assert missing == [] and "every member has entered it" in line


def test_status_bodies_are_checked_field_by_field() -> None:
    assert status.parse(status.query_body(3, 0, 7)) == {"q": 3, "g": 0, "s": 7}
    assert status.parse(status.answer_body(3, 0, 7, 6, "x"))["e"] == 7
    assert status.parse(status.row_body(0, [1.5, 2.0, 3]))["r"] == [1.5, 2.0, 3]
    for bad in (b"not json", b"[1, 2]", b'{"q": "1", "g": 0, "s": 1}',
                b'{"a": 1, "g": 0, "e": 1, "f": 0, "w": 5}', b'{"r": [true], "g": 0}',
                b'{"q": 1, "g": -1, "s": 1}', b"{" + b" " * status.MAX_BODY + b"}"):
        assert status.parse(bad) is None, bad


def test_a_status_record_is_cut_out_of_a_rank_output_line() -> None:
    record = {"rank": 2, "state": "computing"}
    assert split(b"epoch 3\n") == (b"epoch 3\n", None)
    assert split(encode(record)) == (b"", record)
    # A progress bar without its newline, then the record: the bar's text comes back
    # for the reader to put before the next line.
    assert split(b"\r 45%|####" + encode(record)) == (b"\r 45%|####", record)
    assert split(MARK + b"{not json\n") == (b"", {})


def test_the_stall_and_status_settings_are_read_and_checked() -> None:
    assert options_from_env({}).stall_warn == 60.0 and options_from_env({}).status == 0.0
    opts = options_from_env({"SWARMFD_STALL_WARN": "0", "SWARMFD_STATUS": "1.5"})
    assert (opts.stall_warn, opts.status) == (0.0, 1.5)
    with pytest.raises(ConfigError, match="SWARMFD_STALL_WARN='soon'"):
        options_from_env({"SWARMFD_STALL_WARN": "soon"})
    with pytest.raises(ConfigError, match="SWARMFD_STATUS='-1'"):
        options_from_env({"SWARMFD_STATUS": "-1"})


# -- on real ranks ------------------------------------------------------------------------


class _Lines(logging.Handler):
    """The lines logger ``swarmfd`` writes, with when they came."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic(), record.getMessage()))


def _late_rank(rank: int, world: int, late: int, sleep: float, async_op: bool) -> Any:
    import swarmfd as fd

    keep = _Lines()
    logging.getLogger("swarmfd").addHandler(keep)
    x = np.ones(256, np.float32)
    fd.barrier()
    for _ in range(5):  # balanced calls: nothing to report
        fd.all_reduce(x)
    quiet = list(keep.lines)
    if rank == late:
        time.sleep(sleep)
    began = time.monotonic()
    if async_op:  # the progress engine waits (and reports) instead
        fd.all_reduce(x, async_op=True).wait()
    else:
        fd.all_reduce(x)
    return quiet, [(t - began, line) for t, line in keep.lines], fd.get_world_size()


@pytest.mark.waits
@pytest.mark.parametrize("transport", ["shm", "tcp", "tcp-async"])
def test_a_late_rank_is_reported_by_the_others_before_the_timeout(transport: str) -> None:
    """Rank 2 sleeps 3 s before the 7th call (SWARMFD_STALL_WARN=1): ranks 0 and 1 log
    a line naming rank 2 and the call within 2 s of the threshold, and again a period
    later, whether they wait in a blocking call or for an async one; nobody logs
    anything in the balanced calls before."""
    env = {"SWARMFD_STALL_WARN": "1", "SWARMFD_TRANSPORT": "auto" if transport == "shm"
           else "tcp"}
    out = run_ranks(_late_rank, 3, 2, 3.0, transport.endswith("async"), env=env, timeout=60,
                    group_timeout=20)
    for rank, (quiet, lines, _) in enumerate(out):
        assert quiet == [], (rank, quiet)
        if rank == 2:
            assert lines == [], lines
            continue
        assert len(lines) >= 2, (rank, lines)
        first_at, first = lines[0]
        assert 1.0 <= first_at <= 3.0, (rank, lines)
        assert f"swarmfd: rank {rank}: all_reduce #7 of the world" in first, first
        assert "not entered by rank 2 (rank 2: last finished #6, not in a swarmfd call)" \
            in first, first


def _slowed(rank: int, world: int, slow: int, sleep: float, steps: int) -> Any:
    import swarmfd as fd

    keep = _Lines()
    logging.getLogger("swarmfd").addHandler(keep)
    x = np.ones(256, np.float32)
    fd.barrier()
    fd.stats(reset=True)
    for _ in range(steps):
        if rank == slow:
            time.sleep(sleep)
        fd.all_reduce(x)
    got = fd.stats()
    fd.cleanup()
    return got, [line for _, line in keep.lines]


@pytest.mark.parametrize("slow", [1, None])
def test_a_rank_slowed_every_step_is_named_by_the_summary(slow: int | None) -> None:
    """Rank 1 sleeps 50 ms before each of 10 all_reduces: rank 0's cleanup names it as
    the straggler (and nobody else), and each rank's counters add up to the sleeps.
    Without the sleeps, nothing is said."""
    steps, sleep = 10, 0.05
    out = run_ranks(_slowed, 3, -1 if slow is None else slow, sleep, steps, timeout=60)
    for rank, (got, lines) in enumerate(out):
        assert got["calls"] == steps and got["bytes"] == steps * 1024, got
        assert got["groups"]["world"]["calls"] == steps
        assert 0 <= got["wait_s"] <= got["time_s"], got
        assert sum(got["last"].values()) == steps, got
        summary = [line for line in lines if "straggler" in line]
        if slow is None:
            assert summary == [], summary
            continue
        if rank == slow:
            assert got["wait_s"] < 0.5 * steps * sleep, got
        else:
            assert 0.7 * steps * sleep <= got["wait_s"] <= got["time_s"], got
            assert got["last"].get(slow, 0) >= steps // 2, got
        if rank == 0:
            assert len(summary) == 1 and "straggler: rank 1 arrived last" in summary[0], lines
        else:
            assert summary == [], summary
