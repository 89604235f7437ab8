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
import time
from collections import Counter
from typing import Any

import numpy as np

from . import collectives, observe
from . import group as _group
from .comm import malloc as _malloc
from .comm import shm_setup
from .comm import spin as _spin
from .comm import transport as _transport
from .comm.plane import PeerInfo
from .comm.security import Security
from .config import (
    ENV_CMA,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_RANK,
    ENV_WORLD_SIZE,
    Config,
    config_from_env,
    require_secret,
)
from .engine import Engine
from .errors import AlreadyInitializedError, ConfigError, SwarmfdError
from .group import DOMAINS_GID, SETUP_GID, Group, _State

__all__ = ["ABORT_LINGER", "cleanup", "init", "init_from_env"]

#: Seconds a failed group's sockets may take at cleanup to deliver the abort messages.
ABORT_LINGER = 0.5
#: Environment variables init set (see _export_local_ranks); cleanup removes them.
_exported: list[str] = []


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
    import os

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
            state = _State(config, None, [config.options.node])
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
                                 stash_limit=opts.stash_limit, job=opts.job)
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
            state = _State(config, t, hosts, hierarchy=opts.hierarchy)
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
            cleanup()
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
    import os

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
    import os

    s = _group.active()
    if s is not None:
        with contextlib.suppress(Exception):
            s.summary = observe.summarize(s)  # rank 0's straggler line (or "")
        if s.status is not None:
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


atexit.register(cleanup)
