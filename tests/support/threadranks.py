"""The public API on thread-ranks: ``fd.all_reduce`` & co. of N ranks in this process.

:func:`run_api` runs ``fn(rank, world, *args)`` on N threads, each a rank of its own
process group, over the real planes: every rank builds a real
:class:`swarmfd.comm.transport.Transport` (its channel, its socket or zmq TCP plane,
bound on loopback, with the session's job secret), the ranks connect their TCP mesh
to each other (authenticated, as in init), and with ``plane="shm"`` they also share
real shared memory (memfd segments and pipes, :func:`tests.support.memplane.shm_planes`).
Each rank then gets what ``fd.init`` would have given it: the world group, its host
group and the progress engine (``swarmfd.group.make_groups``, ``swarmfd.session._engine``).

What makes the calls of a thread find its own group: ``swarmfd.group.current`` (the
one accessor of the process state, which every collective goes through) is replaced,
while the ranks run, by one that returns the calling thread's state (falling back to
the real one on other threads). So ``fd.all_reduce(x)`` on rank 2's thread is rank 2's
call, ``fd.get_rank()`` is 2, ``fd.new_group`` makes rank 2's groups.

What this does not run: rendezvous, the shared-memory setup between processes
(memfds over a unix socket: tests/test_shm_plane.py), process boundaries, ``fd.init`` and
``fd.cleanup``. The process tests (tests/conftest.py ``run_ranks``) keep one run per
plane of what is tested here for every size; failure detection stays in processes.

Like ``run_ranks`` it returns the results in rank order, raises with every failing
rank's traceback (:class:`RankFailure`) and never hangs: a thread that does not finish
in time fails the test with its stack (the planes are then closed under it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from swarmfd import config as _config
from swarmfd import group as _group
from swarmfd import session as _session
from swarmfd.comm import security as _security
from swarmfd.comm import transport as _transport
from swarmfd.comm.channel import Channel
from swarmfd.comm.plane import PeerInfo

from .harness import RankFailure
from .memplane import Fabric, MemoryPlane, run_rank_threads, shm_planes

__all__ = ["PLANES", "run_api"]

#: The planes a thread-rank group can run on: the two TCP planes and shared memory
#: (whose groups' TCP side is the socket plane, as with SWARMFD_TRANSPORT=auto).
PLANES = ("memory", "socket", "zmq", "shm")

_local = threading.local()
_real_current = _group.current
_patch_lock = threading.Lock()


def _current(what: str = "this call") -> Any:
    state = getattr(_local, "state", None)
    return state if state is not None else _real_current(what)


@contextlib.contextmanager
def _thread_states() -> Iterator[None]:
    """``swarmfd.group.current`` answers per thread while the block runs."""
    with _patch_lock:
        _group.current = _current
        try:
            yield
        finally:
            _group.current = _real_current


def _job_security() -> _security.Security | None:
    """The session's job secret (tests/conftest.py), as every spawned rank uses it."""
    secret = _config.require_secret(2, None)
    return None if secret is None else _security.Security.from_secret(
        secret, _config.encrypt_enabled())


def peer_info(t: _transport.Transport) -> PeerInfo:
    """What the rendezvous would tell the others of this in-process rank's transport."""
    return PeerInfo(t.rank, t.endpoint, "localhost", os.getpid(), "", t.token, t.plane)


def connect_transports(ts: list[_transport.Transport], timeout: float) -> None:
    """Connect every rank's TCP plane to the others, one thread per rank (as in init);
    raises the first rank's error, or when a rank did not finish in time."""
    peers = [peer_info(t) for t in ts]
    errors: list[BaseException] = []

    def connect(t: _transport.Transport) -> None:
        try:
            t.connect(peers, time.monotonic() + timeout)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(t,), daemon=True) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 5)
    if errors:
        raise errors[0]
    if any(th.is_alive() for th in threads):
        raise AssertionError(f"the thread-ranks' TCP planes did not connect in {timeout} s")


class _MemoryTransport:
    """What a group needs of a transport, over :class:`tests.support.memplane.MemoryPlane`."""

    plane = "memory"

    def __init__(self, rank: int, world: int, group_timeout: float, fabric: Fabric) -> None:
        self.rank = rank
        self.channel = Channel(rank, world, group_timeout)
        self.tcp = MemoryPlane(fabric, rank, self.channel)
        self.shm = None
        self.channel.add_plane(self.tcp)

    def close(self, linger: int | None = None) -> None:
        self.channel.close(0)


def _states(world: int, plane: str, group_timeout: float,
            fabric: Fabric | None = None, hosts: list[str] | None = None) -> list[Any]:
    """One process state per rank, as ``fd.init`` builds it (see the module docstring)."""
    assert plane in PLANES, plane
    if plane == "memory":
        fabric = fabric or Fabric(world)
        return [_state(r, world, _MemoryTransport(r, world, group_timeout, fabric),
                       group_timeout, hosts) for r in range(world)]
    assert hosts is None, "simulated hosts are for the memory plane"
    sec = _job_security()
    ts: list[_transport.Transport] = []
    try:
        for r in range(world):
            ts.append(_transport.Transport(r, world, group_timeout, "127.0.0.1", sec,
                                           "zmq" if plane == "zmq" else "socket"))
        connect_transports(ts, max(group_timeout, 10.0))
        if plane == "shm":
            for t, p in zip(ts, shm_planes(world, [t.channel for t in ts]), strict=True):
                t.add_shm(p)
        return [_state(r, world, t, group_timeout) for r, t in enumerate(ts)]
    except BaseException:
        for t in ts:
            t.close(linger=0)
        raise


def _state(rank: int, world: int, t: Any, group_timeout: float,
           hosts: list[str] | None = None) -> Any:
    """Rank ``rank``'s process state over transport ``t``: its groups and engine.
    ``hosts``: the host each rank reports (default: all on one)."""
    hosts = hosts or ["localhost"] * world
    cfg = _config.Config(world, rank, local_rank=hosts[:rank].count(hosts[rank]),
                         local_world_size=hosts.count(hosts[rank]),
                         master_addr="127.0.0.1", timeout=group_timeout)
    state = _group._State(cfg, t, hosts)
    _group.make_groups(state)
    state.engine = _session._engine(state)
    return state


def _close(state: Any, linger: int | None) -> None:
    with contextlib.suppress(Exception):
        state.engine.close()
    with contextlib.suppress(Exception):
        state.transport.close(linger=linger)


def run_api(fn: Callable[..., Any], world: int, *args: Any, plane: str = "socket",
            timeout: float = 120.0, group_timeout: float = 30.0,
            fabric: Fabric | None = None, hosts: list[str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` thread-ranks of one group over ``plane``
    ("memory", "socket", "zmq" or "shm"); the results in rank order (see the module
    docstring). On the memory plane, ``fabric`` is the one to use (to read its traffic
    afterwards) and ``hosts`` the host each rank reports: ranks on different "hosts"
    share no memory there (every plane is the memory one), but the group orders its
    ring by them, as on real hosts."""
    states = _states(world, plane, group_timeout, fabric, hosts)
    results: dict[int, tuple[bool, Any]] = {}

    def body(r: int) -> None:
        _local.state = states[r]
        try:
            results[r] = (True, fn(r, world, *args))
        except BaseException:
            results[r] = (False, traceback.format_exc())
        finally:
            _local.state = None

    threads: list[threading.Thread] = []
    hung: list[int] = []
    with _thread_states():
        try:
            threads, hung, stacks = run_rank_threads(body, world, timeout)
        finally:
            broken = hung or any(not ok for ok, _ in results.values())
            for s in states:
                _close(s, 0 if broken else None)
            for t in threads:
                t.join(5.0)  # a hung rank's planes are closed: its waits end
    failures = {r: v for r, (ok, v) in results.items() if not ok}
    for r in hung:
        failures[r] = f"rank {r} did not finish within {timeout} s\n{stacks}"
    if failures:
        raise RankFailure(failures)
    return [results[r][1] for r in range(world)]
