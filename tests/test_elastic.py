"""Elastic jobs: the plan of a new world, the sampler's accounting, the state, the agents'
doors, and whole jobs under ``swarmfd run --elastic`` that lose ranks and take
replacements in (tests/launch_scripts/elastic_job.py: its result counts how many times
each sample was processed in the committed history).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import swarmfd as fd
from swarmfd.comm.agent import Agent
from swarmfd.comm.security import Security
from swarmfd.config import ConfigError, config_from_env, elastic_options
from swarmfd.launch import LaunchConfig, find_free_ports
from swarmfd.membership import Member, World, plan

SCRIPT = str(Path(__file__).parent / "launch_scripts" / "elastic_job.py")
RESULT = re.compile(rb"RESULT rank=(\d+) world=(\d+) gen=(\d+) min=(\d+) max=(\d+) "
                    rb"extra=(\d+) steps=(\d+)")


# -- the plan, the messages, the settings -------------------------------------------------


def _m(i: int) -> Member:
    return Member(f"inc{i}", f"127.0.0.1:{4000 + i}")


def test_a_new_world_keeps_survivors_in_their_order_then_replacements_in_theirs() -> None:
    old = [_m(i) for i in range(5)]
    joiners = [_m(9), _m(7), _m(9), _m(3)]  # a repeat, and one that is a member already
    members, was = plan(old, lost={0, 3}, leaving={4}, joiners=joiners)
    assert members == [_m(1), _m(2), _m(9), _m(7)]
    assert was == [1, 2, -1, -1]
    assert plan(old, lost=set(), leaving=set(), joiners=[]) == (old, [0, 1, 2, 3, 4])


def test_a_world_message_round_trips_and_a_malformed_one_is_refused() -> None:
    w = World(3, (_m(1), _m(2), _m(9)), 0, "127.0.0.1", 29501, (1, 2, -1), 4, (0, 3), ())
    for rank in range(3):
        got = World.from_message(w.message(rank))
        assert got.rank == rank and got.members == w.members and got.was == w.was
        assert (got.gen, got.previous, got.lost, got.port) == (3, 4, (0, 3), 29501)
    for bad in ({**w.message(0), "rank": 3}, {**w.message(0), "port": 0},
                {**w.message(0), "members": ["no-at-sign"]}, {**w.message(0), "was": [1]}):
        with pytest.raises(ValueError, match="malformed"):
            World.from_message(bad)
    with pytest.raises(ValueError):
        Member.parse("inc@host-without-port")


def test_elastic_settings_are_read_once_and_checked() -> None:
    env = {"SWARMFD_ELASTIC": "1", "SWARMFD_ELASTIC_MIN_N": "2",
           "SWARMFD_ELASTIC_PEERS": "127.0.0.1:4001, tasks.job:4002,tasks.job",
           "SWARMFD_PORT": "29601"}
    opts = elastic_options(env)
    assert opts is not None and opts.min_n == 2 and opts.port == 29602
    assert opts.peers == (("127.0.0.1", 4001), ("tasks.job", 4002), ("tasks.job", None))
    assert elastic_options({}) is None
    # A task beyond the starting world (a scaled-up service) can only be a replacement.
    beyond = config_from_env({**env, "SWARMFD_ELASTIC_JOIN": "auto", "WORLD_SIZE": "3",
                              "RANK": "4", "MASTER_ADDR": "job-1"})
    assert beyond.rank == 4 and beyond.world_size == 5
    assert beyond.options.elastic is not None and beyond.options.elastic.join == "1"
    for name, value in (("SWARMFD_ELASTIC_PEERS", "host:99999"),
                        ("SWARMFD_ELASTIC_JOIN", "yes"), ("SWARMFD_ELASTIC_MIN_N", "0")):
        with pytest.raises(ConfigError, match=name):
            elastic_options({**env, name: value})


def test_run_takes_elastic_options_only_with_elastic() -> None:
    assert LaunchConfig(command=("x.py",), nproc=3, elastic=True).max_restarts == 3
    assert LaunchConfig(command=("x.py",), nproc=3).max_restarts == 0
    with pytest.raises(ValueError, match="--min-n needs --elastic"):
        LaunchConfig(command=("x.py",), nproc=3, min_n=2)
    with pytest.raises(ValueError, match="more than the job's ranks"):
        LaunchConfig(command=("x.py",), nproc=3, elastic=True, min_n=4)


# -- the sampler and the state --------------------------------------------------------------


def test_the_sampler_never_processes_a_committed_sample_again_nor_skips_one() -> None:
    """A job's history, with the world changing and rolling back: every sample is
    processed once in the committed history, but for the repeats that even out a
    split's last step (samples processed at that very step by another rank)."""
    total, size = 103, 3
    sampler = fd.elastic.ElasticSampler(total, seed=5)
    counts = np.zeros(total, dtype=np.int64)
    committed = (sampler.elastic_state()[1][0].copy(), counts.copy())
    repeats = 0
    # (world size, steps before the change, whether it rolls back to the last commit)
    for world, steps, rollback in ((4, 5, True), (3, 4, False), (5, 3, True), (2, 99, False)):
        shares = [sampler.indices(world, r) for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # every rank takes the same steps
        repeats += sum(len(s) for s in shares) - len(sampler.remaining())
        for step in range(min(steps, -(-len(shares[0]) // size))):
            for s in shares:
                np.add.at(counts, s[step * size:(step + 1) * size], 1)
            sampler.record_batch(step, size)
            if step % 2 == 1:  # a commit
                committed = (sampler.done.copy(), counts.copy())
        if rollback:
            sampler.load_elastic_state({"epoch": 0}, [committed[0].copy()])
            counts = committed[1].copy()
    assert sampler.remaining().size == 0
    assert counts.min() == 1, "a sample was skipped"
    assert int((counts - 1).sum()) <= repeats and counts.max() <= 2


def test_the_sampler_splits_like_a_distributed_sampler_and_keeps_its_epoch() -> None:
    sampler = fd.elastic.ElasticSampler(10, shuffle=False)
    assert [sampler.indices(3, r).tolist() for r in range(3)] == [
        [0, 3, 6, 9], [1, 4, 7, 9], [2, 5, 8, 9]]
    dropped = fd.elastic.ElasticSampler(10, shuffle=False, drop_last=True)
    assert [dropped.indices(3, r).tolist() for r in range(3)] == [[0, 3, 6], [1, 4, 7],
                                                                  [2, 5, 8]]
    sampler.indices(3, 0)
    sampler.record_batch(0, 2)
    assert sorted(np.flatnonzero(sampler.done)) == [0, 1, 2, 3, 4, 5]
    sampler.set_epoch(0)  # the current epoch: the marks stay
    assert sampler.done.sum() == 6
    sampler.set_epoch(1)
    assert sampler.done.sum() == 0 and len(sampler) == 10  # a world of one


def test_a_state_keeps_one_copy_and_restores_arrays_in_place() -> None:
    params = [np.arange(4.0), np.ones(2, dtype=np.float32)]
    single = np.zeros(3)
    sampler = fd.elastic.ElasticSampler(8)
    state = fd.elastic.State(params=params, single=single, sampler=sampler, epoch=1,
                             history={"loss": [0.5]})
    state.sync()  # a world of one: it only keeps the commit
    params[0] += 10
    single[:] = 7
    sampler.indices(1, 0)
    sampler.record_batch(0, 3)
    state.epoch = 2
    state.history["loss"].append(0.4)
    state.restore()
    assert state.params[0] is params[0] and params[0].tolist() == [0, 1, 2, 3]
    assert state.single is single and single.tolist() == [0, 0, 0]
    assert sampler.done.sum() == 0 and state.epoch == 1 and state.history == {"loss": [0.5]}
    state.commit()  # not an elastic job: no collective, the copy only
    assert state.commits == 1
    with pytest.raises(TypeError, match="a state holds numpy arrays"):
        fd.elastic.State(model=object())
    with pytest.raises(ValueError, match="not a name"):
        fd.elastic.State(commit=1)


# -- the agents' doors ----------------------------------------------------------------------


def _security(secret: str) -> Security:
    return Security.from_secret(secret.encode(), False)


@contextlib.contextmanager
def _agents(*specs: tuple[str, str]) -> Iterator[list[Agent]]:
    """Agents on loopback, each with (secret, job)."""
    ports = find_free_ports("127.0.0.1", len(specs))
    agents: list[Agent] = []
    try:
        for (secret, job), port in zip(specs, ports, strict=True):
            agents.append(Agent(("127.0.0.1", port), lambda _h, p=port: f"127.0.0.1:{p}",
                                _security(secret), job))
        yield agents
    finally:
        for a in agents:
            a.close()


def _wait(predicate, seconds: float = 3.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_only_a_process_of_the_job_can_ask_to_join() -> None:
    """A replacement with the job's secret and launch is recorded and answered; one
    without the secret cannot complete a handshake; one of another launch with the same
    secret is dropped."""
    secret, other = "s" * 20 + "0123456789abcdef", "t" * 20 + "0123456789abcdef"
    with _agents((secret, "job1"), (secret, "job1"), (other, "job1"),
                 (secret, "job2")) as (member, friend, stranger, neighbour):
        member.set_info(gen=0, phase="member")
        target = f"127.0.0.1:{member.port}"
        for a in (stranger, neighbour, friend):
            a.joining(lambda: [target])
        assert _wait(lambda: friend.heard() > 0)
        time.sleep(0.5)
        assert [j["inc"] for j in member.joiners(5.0)] == [friend.inc]
        assert stranger.heard() == 0 and neighbour.heard() == 0
        assert member.dropped > 0  # the neighbour's joins, dropped and counted


def test_a_rank_declared_lost_that_comes_back_is_refused() -> None:
    secret = "s" * 20 + "0123456789abcdef"
    with _agents((secret, "job"), (secret, "job")) as (member, stale):
        member.set_info(gen=2, phase="member", members={member.inc})
        stale.watch([f"127.0.0.1:{member.port}"])  # connects, so that the post is sent
        assert _wait(lambda: stale.status(f"127.0.0.1:{member.port}").pong_at is not None)
        stale.post(f"127.0.0.1:{member.port}", {"op": "reform", "gen": 1, "rank": 1,
                                               "inc": stale.inc, "leave": False})
        assert _wait(lambda: bool(stale._mail))
        refused = stale.take("refused")
        assert refused and "declared lost" in refused[0]["why"]
        assert member.take("reform") == []


# -- whole jobs -------------------------------------------------------------------------------


def run_elastic_job(tmp_path: Path, *args: str, env: dict[str, str], timeout: float = 90,
                    script: str = SCRIPT) -> tuple[int, bytes]:
    """``swarmfd run ARGS script`` with ``env`` for the ranks: its exit code and output
    (stdout and stderr together)."""
    kill_dir = tmp_path / "kills"
    kill_dir.mkdir(exist_ok=True)
    extra = [a for k, v in {**env, "KILL_DIR": str(kill_dir)}.items() for a in ("-e", f"{k}={v}")]
    proc = subprocess.Popen([sys.executable, "-m", "swarmfd", "run", *args, *extra, script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the job did not end in {timeout} s:\n{out.decode()}") from None
    return proc.returncode, out


def _results(out: bytes) -> list[tuple[int, ...]]:
    return [tuple(int(g) for g in m.groups()) for m in RESULT.finditer(out)]


def _check_finished(code: int, out: bytes, n: int, epochs: int, losses: int, events: int
                    ) -> None:
    """Every rank finished in a world of ``n`` after at least ``events`` re-formations
    for ``losses`` lost processes, each replaced, with every sample processed ``epochs``
    times in the committed history (and a few repeats that even out a last step)."""
    text = out.decode(errors="replace")
    assert code == 0, text
    results = _results(out)
    assert sorted(r[0] for r in results) == list(range(n)), text  # every rank, renumbered
    for _rank, world, gen, low, high, extra, _steps in results:
        assert world == n and gen >= events, text
        assert low == epochs, f"a sample was skipped:\n{text}"
        # The repeats that even out a split's last step: at most n - 1 per split (an epoch
        # starts one, so does every re-formation).
        assert high <= epochs + n - 1 and extra <= (n - 1) * (epochs + gen), (
            f"samples processed again:\n{text}")
    assert len({r[2:] for r in results}) == 1, text  # every rank has the same history
    assert text.count("starting a replacement") >= losses, text
    assert text.count("this replacement joined the job") >= losses, text


def test_losses_of_every_position_on_shared_memory_two_at_once_and_one_while_re_forming(
        tmp_path: Path) -> None:
    """N=4 on shared memory, --min-n 3: the last rank dies; the rank that starts as 1
    dies as it re-forms the world (below the minimum now: the survivors wait for a
    replacement); then the first and the last die at the same step; then a middle one.
    Each comes back as a replacement; the job finishes with every sample processed
    exactly as often as without a fault."""
    code, out = run_elastic_job(tmp_path, "-n", "4", "--elastic", "--min-n", "3", env={
        "KILLS": "6:last,16:first,16:last,26:middle", "DIE_IN_REFORM": "1", "EPOCHS": "3",
        "SAMPLES": "200", "STEP_SLEEP": "0.05"})
    _check_finished(code, out, 4, 3, losses=5, events=3)
    assert re.search(rb"lost rank\(s\) \[\d, \d\]", out), out.decode()  # two at once


def test_losses_of_every_position_over_tcp(tmp_path: Path) -> None:
    code, out = run_elastic_job(tmp_path, "-n", "4", "--elastic", env={
        "KILLS": "6:first,16:middle,26:last", "EPOCHS": "3", "SAMPLES": "200",
        "STEP_SLEEP": "0.05", "SWARMFD_TRANSPORT": "tcp"})
    _check_finished(code, out, 4, 3, losses=3, events=3)


def test_below_min_n_for_longer_than_the_timeout_every_survivor_fails_saying_so(
        tmp_path: Path) -> None:
    code, out = run_elastic_job(tmp_path, "-n", "3", "--elastic", "--min-n", "3",
                                "--max-restarts", "0", "--elastic-timeout", "1",
                                env={"KILLS": "4:last"})
    text = out.decode(errors="replace")
    assert code != 0, text
    assert text.count("ElasticError") >= 2 and "below the minimum of 3" in text, text
    assert "lost rank(s) [2]" in text and "RESULT" not in text, text


def test_a_users_exception_ends_the_job_instead_of_re_forming_it(tmp_path: Path) -> None:
    code, out = run_elastic_job(tmp_path, "-n", "3", "--elastic", env={"RAISE_AT": "4"})
    text = out.decode(errors="replace")
    assert code == 1, text
    assert "ValueError: a bug at step 4" in text and "replacement" not in text, text
    assert "generation 1" not in text and "RESULT" not in text, text
    assert text.count("raised ValueError: a bug at step 4") >= 2, text  # the others' error


def test_a_rank_that_asks_to_leave_leaves_at_a_commit_and_old_groups_refuse_calls(
        tmp_path: Path) -> None:
    """The last of 3 ranks asks to leave at step 3: at the commit of step 5 it exits 0,
    and the others go on as a world of 2 without a rollback (every sample processed
    as often as without the change); a group made in the first world refuses a call
    after the change, saying to make it again."""
    code, out = run_elastic_job(tmp_path, "-n", "3", "--elastic", env={
        "LEAVE_AT": "3", "OLD_GROUP": "1", "EPOCHS": "2", "SAMPLES": "120"})
    text = out.decode(errors="replace")
    assert code == 0, text
    results = _results(out)
    assert sorted((r[0], r[1]) for r in results) == [(0, 2), (1, 2)], text
    assert all(r[3] == 2 for r in results), f"a sample was skipped:\n{text}"
    assert "left the job at a commit, as asked" in text, text
    assert "lost rank" not in text.replace("lost rank(s) []", ""), text
    assert text.count("old group refused:") == 2, text
    assert "was made in generation 0" in text and "make it again" in text, text


def test_a_replacement_that_comes_after_the_job_finished_exits_0(tmp_path: Path) -> None:
    done = tmp_path / "finished"
    done.write_text("")
    port, agent = find_free_ports("127.0.0.1", 2)
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "SWARMFD_PORT": str(port), "SWARMFD_ELASTIC": "1", "SWARMFD_ELASTIC_JOIN": "1",
           "SWARMFD_ELASTIC_PEERS": f"127.0.0.1:{agent + 1},127.0.0.1:{agent}",
           "SWARMFD_ELASTIC_DONE": str(done)}
    proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"the job had finished when this replacement started" in proc.stderr
