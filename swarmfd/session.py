"""Joining and leaving a job: :func:`init`, :func:`init_from_env`, :func:`cleanup`.

``init`` validates the configuration, resolves ``MASTER_ADDR``, binds this rank's TCP
data plane on the interface that routes to rank 0, runs the rendezvous, connects to
every peer and sets up shared memory among each host's ranks (:mod:`swarmfd.group`
describes the groups it makes). A world of one needs no sockets at all. The ranks of
a host agree on their shared memory in calls of their own (not the user's: the
user's first collective is call #1), and a job that spans hosts ends init with an
exchange of every rank's shared-memory plane, so all ranks of a group pick the same
algorithms.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from . import collectives, membership, observe
from . import group as _group
from .comm import malloc as _malloc
from .comm import shm_setup
from .comm import spin as _spin
from .comm import transport as _transport
from .comm.agent import Agent
from .comm.plane import PeerInfo
from .comm.security import Security
from .config import (
    ENV_CMA,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_RANK,
    ENV_WORLD_SIZE,
    Config,
    ElasticOptions,
    config_from_env,
    require_secret,
)
from .engine import Engine
from .errors import (
    AlreadyInitializedError,
    CollectiveTimeout,
    ConfigError,
    ElasticError,
    NotInitializedError,
    PeerLostError,
    RendezvousError,
    RendezvousTimeout,
    SwarmfdError,
)
from .group import DOMAINS_GID, SETUP_GID, Group, _State
from .membership import Member, World, watch_forming

__all__ = ["ABORT_LINGER", "FORMING_TIMEOUT", "JOIN_SILENCE", "PROBE", "cleanup",
           "elastic_state", "init", "init_from_env", "leave_requested", "reform",
           "request_leave"]

#: Seconds a failed group's sockets may take at cleanup to deliver the abort messages.
ABORT_LINGER = 0.5
#: Environment variables init set (see _export_local_ranks); cleanup removes them.
_exported: list[str] = []
_LOG = logging.getLogger("swarmfd")


def init(
    world_size: int | None = None,
    rank: int | None = None,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float | None = None,
    secret: str | bytes | None = None,
    init_timeout: float | None = None,
) -> Config:
    """Join a process group of ``world_size`` ranks as ``rank`` and return its :class:`Config`.

    Transport details not given as arguments come from the environment
    (``MASTER_ADDR``, ``SWARMFD_PORT`` or ``MASTER_PORT``, ``SWARMFD_TIMEOUT``,
    ``SWARMFD_INIT_TIMEOUT``). ``master_port`` is the port of swarmfd's rendezvous on
    ``master_addr`` (:attr:`Config.rendezvous_port`), used as given; without it,
    ``SWARMFD_PORT``, else ``MASTER_PORT + 1`` (29501 when neither is set): MASTER_PORT
    itself is left to torch.distributed, so ``init_process_group`` can run beside
    swarmfd, before or after ``init``.
    ``timeout`` is how long any collective may wait for a peer; ``init_timeout``
    how long this call waits for every rank to join (default: ``timeout``), so
    ranks that start far apart can meet while a stuck collective still fails
    fast.

    Without ``world_size`` and ``rank`` (give both or neither) the group is the one
    the environment describes, as :func:`init_from_env` finds it (``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``, ...; a world of one when nothing is set), and the other
    arguments override it: so a bare ``fd.init()`` under ``swarmfd run`` or on a
    Swarm joins the job instead of silently training alone.

    A world of more than one rank needs the job secret (at least 32 characters,
    the same on every rank): ``secret``, or else the file named by
    ``SWARMFD_SECRET_FILE`` (default ``/run/secrets/swarmfd_secret``), unless
    ``SWARMFD_AUTH=off``. Only processes holding it can join, send data or abort.
    """

    if (world_size is None) != (rank is None):
        raise TypeError("swarmfd.init: give both world_size and rank, or neither (then both "
                        f"come from the environment, WORLD_SIZE and RANK); got world_size="
                        f"{world_size!r}, rank={rank!r}")
    if world_size is None:
        return _start(config_from_env(
            local_rank=local_rank, local_world_size=local_world_size, master_addr=master_addr,
            rendezvous_port=master_port, timeout=timeout, init_timeout=init_timeout), secret)
    env = config_from_env({k: v for k, v in os.environ.items()
                           if k not in (ENV_WORLD_SIZE, ENV_RANK, ENV_LOCAL_RANK,
                                        ENV_LOCAL_WORLD_SIZE)}, rendezvous_port=master_port)
    config = Config(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr if master_addr is not None else env.master_addr,
        rendezvous_port=env.rendezvous_port,
        timeout=timeout if timeout is not None else env.timeout,
        restart_count=env.restart_count,
        init_timeout=init_timeout if init_timeout is not None else env.init_timeout,
        options=env.options,
    )
    return _start(config, secret)


def init_from_env(*, timeout: float | None = None, secret: str | bytes | None = None,
                  init_timeout: float | None = None) -> Config:
    """Join the group the environment describes (``WORLD_SIZE``, ``RANK``, ...).

    With none of the variables set this is a world of one. The job secret is
    found as :func:`init` finds it; ``timeout`` and ``init_timeout`` override
    ``SWARMFD_TIMEOUT`` and ``SWARMFD_INIT_TIMEOUT`` (see :func:`init`).
    """
    return _start(config_from_env(timeout=timeout, init_timeout=init_timeout), secret)


def _security(config: Config, secret: str | bytes | None) -> Security | None:
    """The group's keys (derived from the job secret), or None without authentication."""
    job_secret = require_secret(config.world_size, secret)
    if job_secret is None:
        return None
    return Security.from_secret(job_secret, config.options.encrypt)


def _reserved_ports(config: Config) -> set[int]:
    """Ports this rank's data plane must not listen on (see ``avoid`` of
    :class:`swarmfd.comm.transport.Transport`): the rendezvous port, and MASTER_PORT when
    the environment has a valid one (torch.distributed's, beside swarmfd)."""
    torch_port = config.options.torch_port
    return {config.rendezvous_port} | ({torch_port} if torch_port is not None else set())


def _start(config: Config, secret: str | bytes | None = None) -> Config:
    if config.options.elastic is not None:
        return _elastic_start(config, secret)
    return _form(config, secret)


def _form(config: Config, secret: str | bytes | None = None, agent: Agent | None = None,
          watch: Callable[[], None] | None = None, generation: int = 0) -> Config:
    """Form the world ``config`` describes: the transport, its rendezvous (``agent``:
    this rank's elastic agent, told the others; ``watch``: called as it waits, see
    :class:`~swarmfd.comm.transport.Transport`), the mesh, shared memory, the groups."""
    with _group.STATE_LOCK:
        active = _group.active()
        if active is not None:
            raise AlreadyInitializedError(
                f"swarmfd.init called twice: this process is already rank {active.config.rank} "
                f"of {active.config.world_size}; call swarmfd.cleanup() first"
            )
        if config.world_size == 1:
            config = dataclasses.replace(
                config,
                local_rank=config.local_rank or 0,
                local_world_size=config.local_world_size or 1,
            )
            state = _State(config, None, [config.options.node], generation=generation)
            _group.make_groups(state)
            _group.activate(state)
            _export_local_ranks(config)
            _watch(state)
            return config
        assert config.master_addr is not None  # Config guarantees it for world_size > 1
        security = _security(config, secret)
        opts = config.options
        plane, mode = opts.data_plane, opts.transport
        if plane == "zmq":  # buffers allocated and freed on two threads (swarmfd.comm.malloc)
            _malloc.tune(opts.malloc)
        deadline = time.monotonic() + config.join_timeout
        master_ip = _transport.resolve(config.master_addr, deadline)
        bind_ip = _transport.local_address_toward(master_ip)
        t = _transport.Transport(config.rank, config.world_size, config.timeout, bind_ip,
                                 security, plane, config.join_timeout,
                                 avoid=_reserved_ports(config), swarm_task=opts.swarm_task,
                                 stash_limit=opts.stash_limit, job=opts.job,
                                 agent=f"{agent.inc}@{agent.advertise(master_ip)}"
                                 if agent is not None else "", watch=watch)
        try:
            hostkey = shm_setup.host_key(opts.shm_dir) if mode == "auto" else ""
            me = t.me(opts.node, hostkey)
            peers = t.rendezvous(me, master_ip, config.rendezvous_port, deadline)
            t.connect(None, deadline)
            hosts = [p.host for p in peers]
            # On the zmq plane libzmq's I/O thread moves the bytes of every peer over TCP
            # (all of them with SWARMFD_TRANSPORT=tcp, those of other hosts otherwise).
            zmq_io = plane == "zmq" and (mode == "tcp" or len(set(hosts)) > 1)
            _spin.configure(opts.spin, hosts.count(hosts[config.rank]),
                            threads_per_rank=2 if zmq_io else 1)
            config = _with_local_ranks(config, hosts)
            state = _State(config, t, hosts, hierarchy=opts.hierarchy, generation=generation)
            _group.make_groups(state)
            state.engine = _engine(state)
            _group.activate(state)
            _export_local_ranks(config)
        except BaseException:
            t.close()
            raise
    if any(p.hostkey for p in peers):
        try:
            if hostkey:
                _setup_shm(state, peers, hostkey, deadline, opts.cma)
            if len(set(state.hosts)) > 1:  # (on one host no group is two-level)
                _share_domains(state)
        except BaseException:
            _close_state()
            raise
        for g in state.groups.values():
            g.forget()  # the calls worked out before shared memory was there
    _watch(state)
    return config


def _watch(state: _State) -> None:
    """Start the counters' window and, with SWARMFD_STATUS, the status lines."""
    state.since = time.monotonic()
    if state.config.options.status > 0:
        state.status = observe.StatusThread(state, state.config.options.status)


def _engine(state: _State) -> Any:
    """The progress engine of ``state``'s groups (see swarmfd.engine)."""
    t = state.transport
    assert t is not None

    def failed(g: Group, exc: BaseException, finished: int) -> None:
        if g.broken is None:
            g.broken = exc
        g.broken_from = 0
        t.channel.abort(exc, g.gid, finished)

    engine = Engine(t.channel, state.config.timeout, failed)
    ch = t.channel
    ch.on_group_error = lambda gid, exc, first: _group.group_error(state, gid, exc, first)
    ch.on_report = engine.report
    ch.stalls.threshold = state.config.options.stall_warn

    def describe(gid: int) -> tuple[str, tuple[int, ...]] | None:
        g = state.groups.get(gid)
        return None if g is None else (g.name, g.ranks)

    ch.describe_group = describe
    ch.pending = lambda gid: gid in engine.queues
    return engine


def _setup_shm(state: _State, peers: list[PeerInfo], hostkey: str, deadline: float,
               cma: bool) -> None:
    """Share memory among the ranks of this host (those with this rank's host key).

    The host's ranks agree after each step over TCP, in calls of their own (not the
    user's: the user's first collective is call #1), so one rank that cannot take part
    makes all of them stay on TCP (with a warning naming it and why) instead of
    hanging, and a lost rank raises PeerLostError here as in any collective.
    """
    t = state.transport
    assert t is not None
    local = [p.rank for p in peers if p.hostkey == hostkey]
    if len(local) < 2:
        return
    setup_group = Group(state, SETUP_GID, local, "shared-memory setup")
    plane = shm_setup.setup(t, local, hostkey, max(deadline, time.monotonic()
                                                    + state.config.timeout),
                            lambda reason: _agree(setup_group, reason),
                            state.config.options.shm_dir)
    if plane is None:
        return
    try:
        _setup_cma(plane, setup_group, cma)
    except BaseException:
        plane.close()
        raise
    t.add_shm(plane)


def _setup_cma(plane: Any, group: Group, wanted: bool) -> None:
    """Whether the host's ranks read each other's memory directly (swarmfd.comm.cma):
    only if every one of them can read every other's and none turned it off
    (``wanted``: SWARMFD_CMA); else they all copy through the segments. Two agreements:
    every rank published its probe, then every rank's verdict."""

    plane.publish_probe()
    _agree(group, "")
    verdict = plane.check_probes() if wanted else f"{ENV_CMA}=0"
    failed = _agree(group, verdict)
    plane.enable_cma(not failed)
    if failed:
        logging.getLogger("swarmfd").debug(
            "swarmfd rank %d: shared memory copies through segments, without reading "
            "peers' memory: %s", group.world_rank,
            "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))


def _share_domains(state: _State) -> None:
    """Tell every rank which ranks share memory with which (and each rank's
    SWARMFD_HIERARCHY), so that every member of a group picks the same algorithms
    (see :meth:`Group.two_level`): one all_gather of the world, in a group of its own.
    Ranks whose SWARMFD_HIERARCHY differs would pick different algorithms: a
    ConfigError naming them."""

    t = state.transport
    assert t is not None
    n = state.config.world_size
    shm = t.shm
    domain = min(shm.segments) if shm is not None else -1  # type: ignore[attr-defined]
    mine = np.array([domain, 1 if state.hierarchy == "auto" else 0], dtype=np.int64)
    group = Group(state, DOMAINS_GID, range(n), "shared-memory planes")
    try:
        rows = collectives.all_gather(mine, group=group)
    except SwarmfdError as exc:
        raise type(exc)(f"init, while the ranks shared their shared-memory planes: {exc}"
                        ).with_traceback(exc.__traceback__) from None
    modes = [int(r[1]) for r in rows]
    if len(set(modes)) > 1:
        off = [r for r in range(n) if not modes[r]]
        raise ConfigError(f"SWARMFD_HIERARCHY differs between ranks: 'off' on rank(s) {off}, "
                          "'auto' on the others; every rank of a job must use the same")
    state.shm_domains = [int(r[0]) for r in rows]


def _agree(group: Group, reason: str) -> dict[int, str]:
    """Every member's failure reason ("" for none): {rank: reason} of those that failed."""
    try:
        rows = collectives.all_gather(shm_setup.encode_reason(reason), group=group)
    except SwarmfdError as exc:
        # Say what init was doing: the user called no all_gather.
        raise type(exc)(f"init, while the ranks set up shared memory: {exc}").with_traceback(
            exc.__traceback__) from None
    return {group.ranks[i]: why for i, why in shm_setup.decode_reasons(rows).items()}


def _with_local_ranks(config: Config, hosts: list[str]) -> Config:
    """Fill in local_rank/local_world_size from the hosts the ranks reported."""
    mine = hosts[config.rank]
    derived_rank = hosts[: config.rank].count(mine)
    derived_size = Counter(hosts)[mine]
    local_rank = config.local_rank if config.local_rank is not None else derived_rank
    local_size = (config.local_world_size if config.local_world_size is not None
                  else derived_size)
    try:
        return dataclasses.replace(config, local_rank=local_rank, local_world_size=local_size)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (after grouping ranks by host)") from None


def _export_local_ranks(config: Config) -> None:
    """Put derived LOCAL_RANK/LOCAL_WORLD_SIZE in the environment where they were unset.

    torchrun sets both before a script starts; under ``swarmfd deploy --local-ranks
    node`` they are only known after the rendezvous groups ranks by node, so code
    that reads ``os.environ["LOCAL_RANK"]`` after ``init`` (to pick a GPU, say)
    finds them there, as it would under torchrun. Values already set are left alone
    (they were what the config was built from); :func:`cleanup` removes the ones
    set here, so a later group (or a child process) does not inherit stale values.
    """
    for name, value in ((ENV_LOCAL_RANK, config.local_rank),
                        (ENV_LOCAL_WORLD_SIZE, config.local_world_size)):
        if value is not None and not os.environ.get(name, "").strip():
            os.environ[name] = str(value)
            _exported.append(name)


def cleanup() -> None:
    """Leave the group and close every socket. Idempotent; a later :func:`init` works again.

    Rank 0 first logs the straggler summary, when one rank made the others wait
    (:func:`swarmfd.observe.summarize`; the other ranks send it their counters and
    never wait), and the status thread writes its last line."""
    global _elastic
    s = _group.active()
    if s is not None:
        with contextlib.suppress(Exception):
            s.summary = observe.summarize(s)  # rank 0's straggler line (or "")
    _close_state()
    ctx, _elastic = _elastic, None
    if ctx is not None:
        ctx.agent.close()


def _close_state() -> None:
    """End this process's membership of the current world (the elastic agent stays)."""
    s = _group.active()
    if s is not None and s.status is not None:
        s.status.close()
    with _group.STATE_LOCK:
        s = _group.release()
        while _exported:
            os.environ.pop(_exported.pop(), None)
    if s is None or s.transport is None:
        return
    if s.engine is not None:
        s.engine.close()
    for g in s.groups.values():
        g.forget()  # their views of the segments, which close now
    t = s.transport
    if any(g.broken is not None for g in s.groups.values()):
        # A failed group: give the abort messages queued behind unsent data a moment to
        # leave (peers learn the reason), but do not wait for data a lost peer will never
        # take.
        t.close(linger=int(ABORT_LINGER * 1000))
        return
    try:
        t.channel.flush()
    except SwarmfdError:
        pass
    finally:
        t.close()


# -- elastic jobs ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Elastic:
    """This process's part in an elastic job, beside the current generation's _State: its
    agent (it outlives the generations), the settings, the secret init was given, and the
    world of the current generation (:mod:`swarmfd.membership`)."""

    agent: Agent
    options: ElasticOptions
    config: Config
    secret: str | bytes | None
    world: World | None = None


_elastic: _Elastic | None = None
#: Seconds a new generation may take to build its transport (rendezvous, mesh, shared
#: memory) before the attempt counts as lost and the members re-form again.
FORMING_TIMEOUT = 15.0
#: Seconds a replacement waits without an answer from any member before it concludes
#: that the job has ended.
JOIN_SILENCE = 10.0


def elastic_state() -> _Elastic | None:
    """This process's part in an elastic job (None: not an elastic job, or not init)."""
    return _elastic


def _elastic_start(config: Config, secret: str | bytes | None) -> Config:
    """init of an elastic job: start the agent, then form generation 0 with the others,
    or (a replacement) wait to be let in and form the generation that admits it."""
    global _elastic
    opts = config.options.elastic
    assert opts is not None
    if _elastic is None:
        _elastic = _Elastic(_make_agent(config, opts, secret), opts, config, secret)
    ctx = _elastic
    # Every Swarm task leaves at a commit on SIGTERM: a task of a scaled-up service
    # joins with "1", not "auto", and `swarmfd scale` down stops it the same way.
    if opts.join == "auto" or config.options.swarm_task:
        _leave_on_sigterm()
    start = time.monotonic()
    admitted = _await_admission(ctx, PROBE if opts.join == "auto" else None) \
        if opts.join else None
    if admitted is not None:
        config = _enter(ctx, admitted)
        w = ctx.world
        assert w is not None
        _LOG.warning("swarmfd: this replacement joined the job at generation %d as rank %d of "
                     "%d after %.2f s", w.gen, w.rank, w.size, time.monotonic() - start)
        return config
    try:
        config = _form(config, secret, ctx.agent)
    except BaseException:
        cleanup()
        raise
    s = _group.active()
    assert s is not None
    peers = s.transport.peers if s.transport is not None else []
    agents = [p.agent for p in peers] or [f"{ctx.agent.inc}@{ctx.agent.advertise(_LOOPBACK)}"]
    _settle(ctx, World(0, tuple(Member.parse(a) for a in agents), config.rank,
                       previous=config.world_size, was=tuple(range(config.world_size))))
    return config


_LOOPBACK = "127.0.0.1"


def _make_agent(config: Config, opts: ElasticOptions, secret: str | bytes | None) -> Agent:
    """This process's agent, on its entry of SWARMFD_ELASTIC_PEERS (a starting rank's,
    by its starting RANK) or on SWARMFD_ELASTIC_PORT of every interface."""
    mine = opts.peers[config.rank] if config.rank < len(opts.peers) else None
    if mine is not None and mine[1] is not None:
        host = _transport.resolve(mine[0], time.monotonic() + config.join_timeout)
        port = mine[1]

        def advertise(toward: str) -> str:
            return f"{host}:{port}"
    else:
        host, port = "*", opts.port

        def advertise(toward: str) -> str:
            return f"{_transport.local_address_toward(toward)}:{port}"
    # (A world of one has no secret to check; an elastic one may grow, so it needs one.)
    security = _security(dataclasses.replace(config, world_size=max(2, config.world_size)),
                         secret)
    return Agent((host, port), advertise, security, config.options.job)


def _targets(opts: ElasticOptions) -> Callable[[], list[str]]:
    """Where a replacement sends its ``join``: every entry of SWARMFD_ELASTIC_PEERS,
    names resolved to each of their addresses (``tasks.<service>``: every task)."""
    def targets() -> list[str]:
        out = []
        for host, port in opts.peers:
            try:
                infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
            except OSError:
                continue
            for ip in dict.fromkeys(str(i[4][0]) for i in infos):
                out.append(f"{ip}:{port if port is not None else opts.port}")
        return out
    return targets


def _await_admission(ctx: _Elastic, probe: float | None) -> World | None:
    """A replacement: ask every member to let it in, until a coordinator posts the world
    that admits it. A job that has finished meanwhile ends this process (exit 0); one
    whose members have all gone silent raises :class:`ElasticError`. With ``probe``
    (SWARMFD_ELASTIC_JOIN=auto): None when no formed job answered in ``probe`` seconds
    (the ranks are starting together: this one forms the first world with them)."""
    agent, opts = ctx.agent, ctx.options
    agent.set_info(phase="joining")
    agent.joining(_targets(opts))
    start = time.monotonic()
    deadline = start + ctx.config.join_timeout
    formed = False
    try:
        while True:
            for msg in agent.take("world", "finished", "ack"):
                if msg["op"] == "finished" or msg.get("phase") == "finished":
                    _job_over("the job finished before this replacement could join")
                formed = formed or msg.get("phase") in ("member", "reforming")
                if msg["op"] == "world" and msg.get("to") == agent.inc:
                    try:
                        return World.from_message(msg)
                    except ValueError as exc:
                        _LOG.warning("swarmfd: %s, ignored", exc)
            now = time.monotonic()
            if probe is not None and not formed and now - start > probe:
                return None
            _check_waiting(ctx, start, deadline, now)
            time.sleep(0.02)
    finally:
        agent.joining(None)


#: How long a task that may be a replacement (SWARMFD_ELASTIC_JOIN=auto) listens for a
#: formed job before it takes part in forming the first world.
PROBE = 2.0


def _check_waiting(ctx: _Elastic, start: float, deadline: float, now: float) -> None:
    """A replacement still waiting: the reasons to stop (the job finished, it was asked
    to stop, no member answers, the init timeout)."""
    opts = ctx.options
    if opts.done_file and os.path.exists(opts.done_file):
        _job_over("the job had finished when this replacement started")
    if _leave:
        _job_over("this replacement was asked to stop (SIGTERM) before it was let in")
    if now - (ctx.agent.heard() or start) > JOIN_SILENCE:
        raise ElasticError(
            f"no member of the job answered this replacement for {JOIN_SILENCE:g} s "
            "(SWARMFD_ELASTIC_PEERS): the job has ended, or its members cannot be "
            "reached from here")
    if now > deadline:
        raise RendezvousTimeout(
            f"this replacement was not let into the job within {ctx.config.join_timeout:g} "
            "s (SWARMFD_INIT_TIMEOUT): the members let replacements in at their next "
            "commit (state.commit()); does the job commit?")


_leave = False


def leave_requested() -> bool:
    """Whether this rank was asked to leave the job at its next commit."""
    return _leave


def request_leave() -> None:
    """Ask this rank to leave the job at its next commit (without a rollback)."""
    global _leave
    _leave = True


def _leave_on_sigterm() -> None:
    """On a Swarm task, SIGTERM (``swarmfd scale`` down, ``docker stop``) asks the rank to
    leave at its next commit; a second one ends it as SIGTERM does."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: Any) -> None:
        if _leave:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        request_leave()
        _LOG.warning("swarmfd: asked to stop (SIGTERM): this rank leaves the job at its next "
                     "commit (a second SIGTERM ends it now)")

    signal.signal(signal.SIGTERM, handler)


def _job_over(why: str) -> None:
    """A replacement with nothing to join: say so, and end the process with exit code 0."""
    import sys

    print(f"swarmfd: {why}; exiting (code 0)", file=sys.stderr, flush=True)
    cleanup()
    raise SystemExit(0)


def _enter(ctx: _Elastic, world: World) -> Config:
    """Build ``world``'s transport (its rendezvous at its rank 0); a member lost meanwhile
    (:func:`swarmfd.membership.watch_forming`) or a transport that cannot be built in
    FORMING_TIMEOUT seconds sends the members into another re-formation."""
    base, agent = ctx.config, ctx.agent
    while True:
        agent.set_info(gen=world.gen, phase="forming", members={m.inc for m in world.members})
        config = Config(world_size=world.size, rank=world.rank, master_addr=world.master,
                        rendezvous_port=world.port, timeout=base.timeout,
                        init_timeout=FORMING_TIMEOUT, options=dataclasses.replace(
                            base.options, job=f"{base.options.job}.g{world.gen}"))
        try:
            config = _form(config, ctx.secret, agent,
                           watch_forming(agent, world, time.monotonic()), world.gen)
        except (PeerLostError, RendezvousError, CollectiveTimeout) as exc:
            _LOG.warning("swarmfd rank %d: generation %d could not be formed (%s); re-forming",
                         world.rank, world.gen, exc)
            new = _membership_round(ctx, world, lambda: (), False)
            if new is None:
                raise ElasticError("this rank was let go while the world was re-formed") from exc
            world = new
            continue
        _settle(ctx, world)
        return config


def _settle(ctx: _Elastic, world: World) -> None:
    ctx.world = world
    incs = {m.inc for m in world.members}
    ctx.agent.set_info(gen=world.gen, phase="member", members=incs)
    ctx.agent.forget_joiners(incs)  # (they asked every member; the coordinator let them in)


def _membership_round(ctx: _Elastic, world: World, seen_lost: Callable[[], Iterable[int]],
                      leave: bool) -> World | None:
    opts = ctx.options
    return membership.reform(ctx.agent, world, seen_lost=seen_lost, leave=leave,
                             min_n=opts.min_n, timeout=opts.timeout,
                             port=ctx.config.rendezvous_port)


def reform(*, leave: bool = False) -> World | None:
    """Leave the current generation of an elastic job and form the next one with the
    other members that take part, and the replacements that asked to join
    (:mod:`swarmfd.membership`): its World, this process's place in it; None when this
    rank leaves (``leave``: it asked to, at a commit). The old world's transport stays
    open until the new world is decided (its closed connections are evidence of who is
    lost), then closes; groups made in it refuse every call, saying so."""
    ctx = _elastic
    if ctx is None or ctx.world is None:
        raise NotInitializedError("swarmfd.reform: this process is not a member of an "
                                  "elastic job (SWARMFD_ELASTIC=1, then init)")
    old = _group.active()

    def seen_lost() -> list[int]:
        if old is None or old.transport is None:
            return []
        ch = old.transport.channel
        ch.drain()
        return list(ch.lost)

    new = _membership_round(ctx, ctx.world, seen_lost, leave)
    _close_state()
    if new is None:
        ctx.world = None
        return None
    _enter(ctx, new)
    return ctx.world


atexit.register(cleanup)
