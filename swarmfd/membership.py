"""Generations of an elastic job: who is in the world, and how the next world is formed.

An elastic job runs as a sequence of *generations*. Generation 0 is the world init
formed; each later one is formed by a *re-formation*, after a lost rank (the survivors
restore their last commit) or at a commit that lets replacements in or lets ranks
leave (nothing is rolled back). A generation is a :class:`World`: its members in rank
order, each known by its elastic agent (:mod:`swarmfd.comm.agent`) and *incarnation*
(a random id per process, so a process that took over a lost one's port is not taken
for it).

A re-formation of generation G (:func:`reform`), on every member that takes part:

1. it watches every other member's agent (pings), and posts ``reform`` (generation
   G, its rank, whether it leaves) to each, again every POST_EVERY seconds;
2. a member is *lost* when the data plane of generation G found its connection closed,
   when its agent's connection is down for DOWN_GRACE seconds, when its agent answers
   as another incarnation, or when it has not answered for SILENT seconds;
3. the *coordinator* is the lowest rank of G not lost: the same on every member once
   their views agree (they do, as the verdicts above come in), and never a process
   that is gone. It waits until every other member has posted or is lost (at most
   the elastic timeout: a member that neither answers its peers' loss nor dies is
   left behind then), takes the replacements that asked to join (:func:`plan`:
   survivors in their old order, then replacements, first come first), and posts
   the new world to each: ``world`` (generation G+1, the member's new rank, the
   table, where the new rendezvous is: the coordinator's host, on the job's
   rendezvous port);
4. below ``min_n`` (survivors and replacements), the coordinator waits for
   replacements up to the elastic timeout, then posts ``fail`` (the lost ranks and
   the minimum) and every member raises :class:`ElasticError` saying so.

A member that becomes the coordinator while it waits (the one before it was lost, even
in the middle of step 3) has every post already: everyone posts to everyone. Every
wait is bounded; a loss at any step is a verdict of step 2, so a second loss during a
re-formation is just more of the same round, and a loss while the new world builds its
transport (:func:`watch_forming`) starts another round from generation G+1.

A process declared lost that comes back (a partition that heals) posts ``reform`` of
a generation the others have left: their agents refuse it, and it raises
:class:`ElasticError`; it may come back only as a new process (a replacement).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .comm.agent import Agent, parse_endpoint
from .errors import ElasticError, PeerLostError

__all__ = ["DOWN_GRACE", "LEFT", "POST_EVERY", "SILENT", "Member", "World", "plan", "reform",
           "watch_forming"]

#: How often a re-forming member repeats its ``reform`` (posts to a peer not yet
#: connected are dropped, see swarmfd.comm.agent).
POST_EVERY = 0.2
#: An agent whose connection has been down (refused, closed) this long is lost: a
#: process that died (its port refuses at once). Short blips of a live one pass.
DOWN_GRACE = 0.5
#: An agent that has not answered a ping for this long is lost (a host that vanished
#: without a word; a live agent answers within milliseconds, from its own thread).
SILENT = 3.0
#: A replacement that has not repeated its ``join`` for this long is not let in.
JOINER_FRESH = 2.0
#: How often a waiting loop looks at its mailbox and its verdicts.
STEP = 0.01
#: What a re-formation gives a member the others let go (it asked to leave).
LEFT: Any = object()
_LOG = logging.getLogger("swarmfd")


def _now() -> float:
    return time.monotonic()


@dataclass(frozen=True)
class Member:
    """A member of a generation: its incarnation and its agent's endpoint."""

    inc: str
    endpoint: str

    @classmethod
    def parse(cls, text: str) -> Member:
        """``incarnation@host:port`` (PeerInfo.agent) as a Member; ValueError if not."""
        inc, sep, endpoint = text.partition("@")
        if not sep or not inc.isalnum() or parse_endpoint(endpoint) is None:
            raise ValueError(f"not an elastic agent: {text[:100]!r}")
        return cls(inc, endpoint)

    def __str__(self) -> str:
        return f"{self.inc}@{self.endpoint}"

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0]


@dataclass(frozen=True)
class World:
    """One generation: ``members`` in rank order, this process's ``rank``, where its
    rendezvous is (``master``, ``port``), and where it came from: ``was``, each
    member's rank in the previous generation (-1: a replacement), ``previous``, that
    generation's size, ``lost`` and ``left``, its ranks that were lost or left."""

    gen: int
    members: tuple[Member, ...]
    rank: int
    master: str = ""
    port: int = 0
    was: tuple[int, ...] = ()
    previous: int = 0
    lost: tuple[int, ...] = ()
    left: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.members)

    def message(self, rank: int) -> dict[str, Any]:
        """The ``world`` message that tells member ``rank`` of this world its place."""
        return {"op": "world", "gen": self.gen, "to": self.members[rank].inc, "rank": rank,
                "members": [str(m) for m in self.members], "master": self.master,
                "port": self.port, "was": list(self.was), "previous": self.previous,
                "lost": list(self.lost), "left": list(self.left)}

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> World:
        """A ``world`` message as a World (ValueError when malformed)."""
        try:
            members = tuple(Member.parse(str(m)) for m in msg["members"])
            world = cls(int(msg["gen"]), members, int(msg["rank"]), str(msg["master"]),
                        int(msg["port"]), tuple(int(r) for r in msg["was"]),
                        int(msg["previous"]), tuple(int(r) for r in msg["lost"]),
                        tuple(int(r) for r in msg["left"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed world message ({exc})") from None
        if not 0 <= world.rank < world.size or len(world.was) != world.size \
                or not 1 <= world.port <= 65535:
            raise ValueError("a malformed world message (rank, table or port)")
        return world


def plan(members: Sequence[Member], lost: Iterable[int], leaving: Iterable[int],
         joiners: Sequence[Member]) -> tuple[list[Member], list[int]]:
    """The next generation's members and each one's rank in this one (-1: a replacement):
    the ranks neither lost nor leaving, in their order, then the replacements in the
    order they came (a replacement that is a member already, or twice, counts once)."""
    out = set(lost) | set(leaving)
    stay = [r for r in range(len(members)) if r not in out]
    known = {m.inc for m in members}
    new: list[Member] = []
    for j in joiners:
        if j.inc not in known:
            known.add(j.inc)
            new.append(j)
    return [members[r] for r in stay] + new, stay + [-1] * len(new)


@dataclass
class _Round:
    """One member's view of a re-formation of ``world`` (see :func:`reform`)."""

    agent: Agent
    world: World
    leave: bool
    seen_lost: Callable[[], Iterable[int]] | None
    start: float = field(default_factory=_now)
    lost: dict[int, str] = field(default_factory=dict)
    posted: dict[int, bool] = field(default_factory=dict)  # rank -> it leaves
    posted_at: float = 0.0

    def others(self) -> list[int]:
        return [r for r in range(self.world.size) if r != self.world.rank]

    def verdicts(self) -> None:
        """Step 2 of the module docstring: who is lost now, and why. The data plane's
        closed connections count as they were when this member started the round: later,
        a member that moved on to the next world closes its own (it was told the world,
        as this one will be), and only the agents tell a loss from that."""
        now = _now()
        if self.seen_lost is not None:
            for r in self.seen_lost():
                self.lost.setdefault(r, "its connection closed")
            self.seen_lost = None
        for r in self.others():
            if r in self.lost:
                continue
            m = self.world.members[r]
            s = self.agent.status(m.endpoint)
            if s.inc and s.inc != m.inc:
                self.lost[r] = "another process took its place"
            elif s.down_since is not None and now - s.down_since > DOWN_GRACE:
                self.lost[r] = "its agent's connection closed"
            elif now - (s.pong_at or self.start) > SILENT and r not in self.posted:
                self.lost[r] = f"it did not answer for {SILENT:g} s"

    def post(self) -> None:
        """Tell every member not lost that this one takes part (step 1)."""
        now = _now()
        if now - self.posted_at < POST_EVERY:
            return
        self.posted_at = now
        w = self.world
        msg = {"op": "reform", "gen": w.gen, "rank": w.rank, "inc": w.members[w.rank].inc,
               "leave": self.leave}
        for r in self.others():
            if r not in self.lost:
                self.agent.post(w.members[r].endpoint, msg)

    def mail(self) -> World | None:
        """The members' posts; a world this member is in (:data:`LEFT`: let go), or a
        failure, ends the wait."""
        w, me = self.world, self.world.members[self.world.rank]
        for msg in self.agent.take("reform", "world", "left", "fail", "refused"):
            op, gen = msg["op"], msg.get("gen")
            if op == "reform" and gen == w.gen and isinstance(msg.get("rank"), int) \
                    and 0 <= msg["rank"] < w.size \
                    and msg.get("inc") == w.members[msg["rank"]].inc:
                self.posted[msg["rank"]] = bool(msg.get("leave"))
            elif op in ("world", "left") and gen == w.gen + 1 and msg.get("to") == me.inc:
                if op == "left":
                    return LEFT
                try:
                    return World.from_message(msg)
                except ValueError as exc:
                    _LOG.warning("swarmfd: %s, ignored", exc)
            elif op == "fail" and gen == w.gen:
                raise ElasticError(str(msg.get("why", "the coordinator gave up")))
            elif op == "refused":
                raise ElasticError(str(msg.get("why", "this process was refused")))
        return None

    def coordinator(self) -> int:
        return min(r for r in range(self.world.size) if r not in self.lost)


def reform(agent: Agent, world: World, *, seen_lost: Callable[[], Iterable[int]],
           leave: bool, min_n: int, timeout: float, port: int) -> World | None:
    """Take part in the re-formation of ``world`` (module docstring): the next World, or
    None when this member leaves (it asked to, and the others let it go). Raises
    :class:`ElasticError` below ``min_n`` for longer than ``timeout`` seconds, or when
    this process was declared lost; the wait is bounded by about twice ``timeout``."""
    r = _Round(agent, world, leave, seen_lost)
    agent.set_info(phase="reforming")
    agent.watch(m.endpoint for i, m in enumerate(world.members) if i != world.rank)
    backstop = r.start + 2 * timeout + SILENT
    while True:
        r.verdicts()
        new = r.mail()
        if new is None and r.coordinator() == world.rank:
            new = _coordinate(r, min_n, timeout, port)
        if new is LEFT:
            return None
        if new is not None:
            return new
        r.post()
        if _now() > backstop:
            raise ElasticError(
                f"the world of generation {world.gen} was not re-formed within "
                f"{backstop - r.start:.0f} s: no coordinator answered (lost so far: "
                f"{_story(r.lost)})")
        time.sleep(STEP)


def _coordinate(r: _Round, min_n: int, timeout: float, port: int) -> World | None:
    """The coordinator's step (module docstring, steps 3 and 4): None to wait on, else
    this member's new World (:data:`LEFT` when it leaves)."""
    w, now = r.world, _now()
    waiting = [i for i in r.others() if i not in r.posted and i not in r.lost]
    late = now - r.start > timeout
    if waiting and not late:
        return None
    for i in waiting:
        r.lost[i] = f"it did not take part within {timeout:g} s"
    leaving = {i for i, leaves in r.posted.items() if leaves} | ({w.rank} if r.leave else set())
    joiners = [Member(j["inc"], j["endpoint"]) for j in r.agent.joiners(JOINER_FRESH)]
    r.agent.watch((j.endpoint for j in joiners), more=True)  # connected before the post
    members, was = plan(w.members, r.lost, leaving, joiners)
    if not members and leaving and not r.lost:  # every rank was asked to stop: the end
        for i in leaving - {w.rank}:
            r.agent.post(w.members[i].endpoint, {"op": "left", "gen": w.gen + 1,
                                                 "to": w.members[i].inc})
        return LEFT
    if len(members) < max(min_n, 1):
        if not late:
            return None
        _fail(r, min_n, len(members))
    new = World(w.gen + 1, tuple(members), 0, members[0].host, port, tuple(was), w.size,
                tuple(sorted(r.lost)), tuple(sorted(leaving)))
    me = w.members[w.rank]
    for i, m in enumerate(members):
        if m.inc != me.inc:
            r.agent.post(m.endpoint, new.message(i))
    for i in leaving - {w.rank}:
        r.agent.post(w.members[i].endpoint, {"op": "left", "gen": new.gen,
                                             "to": w.members[i].inc})
    r.agent.forget_joiners(j.inc for j in joiners)
    if w.rank in leaving:
        return LEFT
    return dataclasses.replace(new, rank=was.index(w.rank))


def _fail(r: _Round, min_n: int, have: int) -> None:
    """Below the minimum for too long: every member is told, and this one raises."""
    w = r.world
    why = (f"the world of generation {w.gen} ({w.size} ranks) lost rank(s) "
           f"{sorted(r.lost)} ({_story(r.lost)}); {have} rank(s) are left with the "
           f"replacements that came, below the minimum of {min_n} (--min-n, "
           f"SWARMFD_ELASTIC_MIN_N) for longer than the elastic timeout")
    for _ in range(3):
        for i in r.others():
            if i not in r.lost:
                r.agent.post(w.members[i].endpoint, {"op": "fail", "gen": w.gen, "why": why})
        time.sleep(0.1)
    raise ElasticError(why)


def _story(lost: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(lost.items())) or "none"


def watch_forming(agent: Agent, world: World, since: float) -> Callable[[], None]:
    """What the new world's rendezvous calls as it waits (Transport's ``watch``): a
    member lost since ``since`` (as in :func:`reform`), or a member that gave this
    generation up already, raises :class:`PeerLostError`; the coordinator (rank 0)
    posts ``world`` again to members whose agent does not answer as this generation
    yet (a post before the connection was up is dropped)."""
    members = [m for i, m in enumerate(world.members) if i != world.rank]
    agent.watch((m.endpoint for m in members), more=True)
    last = [0.0]

    def watch() -> None:
        now = _now()
        for i, m in enumerate(world.members):
            if i == world.rank:
                continue
            s = agent.status(m.endpoint)
            gone = (s.inc and s.inc != m.inc) or (
                s.down_since is not None and now - s.down_since > DOWN_GRACE) or (
                now - (s.pong_at or since) > SILENT)
            if gone:
                raise PeerLostError(f"rank {i} of generation {world.gen} was lost while "
                                    "the new world was formed")
            if world.rank == 0 and s.gen < world.gen and now - last[0] > POST_EVERY:
                agent.post(m.endpoint, world.message(i))
        if world.rank == 0 and now - last[0] > POST_EVERY:
            last[0] = now
        for msg in agent.take("reform"):
            if msg.get("gen") == world.gen:
                raise PeerLostError(f"rank {msg.get('rank')} gave up generation "
                                    f"{world.gen} while it was formed")
    return watch
