"""Elastic training: a lost rank costs a re-formation of the world, not the job.

The names are Horovod's elastic API's::

    import swarmfd as fd

    fd.init_from_env()                                   # swarmfd run --elastic ...
    params = np.zeros(1000)
    sampler = fd.elastic.ElasticSampler(len(data), shuffle=True, seed=0)
    state = fd.elastic.State(params=params, sampler=sampler, epoch=0, batch=0)

    @fd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch in sampler.batches(64):            # this rank's share of what is left
                step(batch)
                state.sampler.record_batch(state.batch, 64)
                state.batch += 1
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

* :class:`State` holds the values to carry across a change of the world: numpy arrays
  (and lists of them), plain values (numbers, strings, lists, dicts: what
  :func:`swarmfd.broadcast_object` sends), and objects that describe their own state
  (:class:`ElasticSampler`; :class:`swarmfd.torch.elastic.TorchState` adds a model and
  its optimizer). ``commit()`` keeps one copy in memory (no disk) and is a collective
  of the current world; ``restore()`` goes back to it; ``sync()`` sends rank 0's
  values to every rank; ``register_reset_callbacks`` runs code after the world changed
  (to scale the learning rate, or make again a group made with ``new_group``).
* :func:`run` calls the function and, when a collective raises because a peer was
  lost (:class:`~swarmfd.PeerLostError` or its aborted form: the liveness checks'
  verdict: a process that ended, a connection closed, a host that stopped answering),
  every survivor restores its last commit, the world is re-formed from the survivors
  and the replacements that asked to join (:func:`swarmfd.session.reform`), the reset
  callbacks run, the state is synced from the new rank 0, and the function is called
  again. A replacement is let in at the next ``commit()`` of the others: that commit
  re-forms the world without a rollback. Anything else (a collective timeout with
  every peer alive, a mismatch, the user's own exception) ends the job as without
  elasticity: this rank tells the others (they raise :class:`~swarmfd.AbortedError`),
  then raises.
* :class:`ElasticSampler`: the epoch's samples not processed yet, split among the
  current world, so that no committed sample is processed again in its epoch and none
  is skipped.

Ranks are given at each re-formation: survivors keep their order, replacements come
last; ``fd.get_rank()`` and ``fd.get_world_size()`` tell the current ones (``RANK``
in the environment stays the starting one), and every rank logs the change. A
replacement runs the script from the top: its ``init`` waits until it is let in,
and ``sync()`` overwrites what it built. So between ``init`` and the elastic function
a script builds its model, optimizer, sampler and state, and calls no collective of
its own (the others are in their reset meanwhile); wrapping the model in
:class:`swarmfd.torch.DistributedDataParallel` is fine (:class:`TorchState` rebuilds
it on the survivors with the same collectives).
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from . import collectives, session
from . import group as _group
from .errors import ElasticError, PeerLostError, SwarmfdError
from .membership import JOINER_FRESH

__all__ = ["FINISH_LINGER", "ElasticError", "ElasticSampler", "State", "Stateful",
           "request_leave", "run"]

F = TypeVar("F", bound=Callable[..., Any])
#: Seconds the members of a Swarm job that lost ranks answer "finished" after the end.
FINISH_LINGER = 3.0
_LOG = logging.getLogger("swarmfd")


class Stateful(Protocol):
    """An object that describes its own state to :class:`State`: plain values (what
    :func:`swarmfd.broadcast_object` sends) and numpy arrays. ``elastic_state`` gives
    the live arrays (a sync broadcasts into them in place); ``load_elastic_state``
    takes values and arrays (copies it may keep) and makes them the object's state."""

    def elastic_state(self) -> tuple[dict[str, Any], list[np.ndarray]]: ...

    def load_elastic_state(self, values: dict[str, Any], arrays: list[np.ndarray]) -> None: ...


class _WorldChanged(Exception):
    """A commit decided to re-form the world (replacements wait, or ranks leave)."""

    def __init__(self, joiners: int, leaving: list[int], me: int) -> None:
        super().__init__(f"{joiners} replacement(s) wait, rank(s) {leaving} leave")
        self.leave = me in leaving
        self.at = time.monotonic()


request_leave = session.request_leave


def _kind(value: Any) -> str:
    """How :class:`State` keeps ``value``: "array", "arrays", "stateful" or "plain"."""
    if isinstance(value, np.ndarray):
        return "array"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, np.ndarray)
                                                          for v in value):
        return "arrays"
    if callable(getattr(value, "elastic_state", None)) and callable(
            getattr(value, "load_elastic_state", None)):
        return "stateful"
    return "plain"


def _check_plain(value: Any, where: str) -> None:
    """A value :func:`swarmfd.broadcast_object` sends, else TypeError naming it."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return
    if isinstance(value, float):
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, f"{where} key {k!r}")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"swarmfd.elastic.State: {where} is a {type(value).__name__}; a state holds numpy "
        "arrays (or lists of them), plain values (None, bool, int, float, str, bytes, and "
        "lists, tuples, dicts, sets of them), and objects with elastic_state() and "
        "load_elastic_state() (ElasticSampler; a torch model and optimizer go in "
        "swarmfd.torch.elastic.TorchState)")


class State:
    """The values an elastic job carries across changes of its world (module docstring).

    Each keyword becomes an attribute (``state.epoch``); assign it as any attribute.
    The values named here are the state: :meth:`commit` copies them, :meth:`restore`
    puts the copy back (arrays in place, so references to them stay good),
    :meth:`sync` sends rank 0's to every rank.
    """

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_names", tuple(values))
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "commits", 0)
        for name, value in values.items():
            if name.startswith("_") or name in _RESERVED:
                raise ValueError(f"swarmfd.elastic.State: {name!r} is not a name a state value "
                                 f"can have (it starts with '_' or is one of {sorted(_RESERVED)})")
            if _kind(value) == "plain":
                _check_plain(value, name)
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"swarmfd.elastic.State({', '.join(self._names)}; {self.commits} commit(s))"

    # -- Horovod's API -----------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Run each of ``callbacks`` (no arguments) after every change of the world, before
        the state is synced: local work only (scale a learning rate, make a group again);
        a collective there would not be matched by a replacement, which runs none."""
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"register_reset_callbacks: {cb!r} is not callable")
            self._reset_callbacks.append(cb)

    def on_reset(self) -> None:
        """After the world changed: :meth:`reset`, then the reset callbacks."""
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def reset(self) -> None:
        """What the state itself rebuilds for a new world (TorchState: DDP)."""

    def commit(self) -> None:
        """Keep a copy of the state, then agree with the world on what happens next: a
        collective (call it on every rank at the same point). When replacements wait to
        join, or ranks leave, the world is re-formed here, without a rollback (the
        function is called again, from this commit)."""
        self.save()
        object.__setattr__(self, "commits", self.commits + 1)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """The collective half of :meth:`commit`: raises (to :func:`run`) when the world
        is to be re-formed. A no-op outside an elastic job."""
        ctx = session.elastic_state()
        if ctx is None or not _group.is_initialized():
            return
        n, me = _group.get_world_size(), _group.get_rank()
        votes = np.zeros(n + 1, dtype=np.int64)
        if me == 0 and ctx.world is not None:
            members = {m.inc for m in ctx.world.members}
            votes[0] = sum(j["inc"] not in members for j in ctx.agent.joiners(JOINER_FRESH))
        votes[1 + me] = int(session.leave_requested())
        collectives.all_reduce(votes)
        if votes.any():
            raise _WorldChanged(int(votes[0]), [r for r in range(n) if votes[1 + r]], me)

    def save(self) -> None:
        """Copy every value (what :meth:`commit` keeps, without its collective)."""
        old = self._saved or {}
        saved = {}
        for name in self._names:
            value = getattr(self, name)
            kind = _kind(value)
            before = old.get(name)
            if kind == "array":
                saved[name] = _keep(value, before)
            elif kind == "arrays":
                saved[name] = _keep_all(value, before)
            elif kind == "stateful":
                plain, arrays = value.elastic_state()
                saved[name] = (copy.deepcopy(plain),
                               _keep_all(arrays, before[1] if isinstance(before, tuple) else None))
            else:
                _check_plain(value, name)
                saved[name] = copy.deepcopy(value)
        object.__setattr__(self, "_saved", saved)

    def restore(self) -> None:
        """Put the last commit back (arrays in place where their shape is unchanged)."""
        saved = self._saved
        if saved is None:
            raise ElasticError("swarmfd.elastic.State.restore: nothing to restore: no commit "
                               "or sync happened yet")
        for name, copied in saved.items():
            value = getattr(self, name)
            kind = _kind(value)
            if kind == "array":
                _put(self, name, value, copied)
            elif kind == "arrays":
                for v, c in zip(value, copied, strict=False):
                    np.copyto(v, c)
            elif kind == "stateful":
                plain, arrays = copied
                value.load_elastic_state(copy.deepcopy(plain), [a.copy() for a in arrays])
            else:
                object.__setattr__(self, name, copy.deepcopy(copied))

    def sync(self) -> None:
        """Make every rank's values rank 0's (a collective), then keep them as the commit."""
        self._sync_values()
        self.save()

    def _sync_values(self) -> None:
        """The collective part of :meth:`sync`."""
        if _group.is_initialized() and _group.get_world_size() > 1:
            plain: dict[str, Any] = {}
            arrays: list[np.ndarray] = []
            loads: list[tuple[Any, str, int, int]] = []
            for name in self._names:
                value = getattr(self, name)
                kind = _kind(value)
                if kind == "array":
                    arrays.append(value)
                elif kind == "arrays":
                    arrays.extend(value)
                elif kind == "stateful":
                    values, live = value.elastic_state()
                    plain[name] = values
                    loads.append((value, name, len(arrays), len(live)))
                    arrays.extend(live)
                else:
                    plain[name] = value
            _broadcast_arrays(arrays)
            plain = collectives.broadcast_object({**plain, "commits": self.commits}, src=0)
            for name in self._names:
                if _kind(getattr(self, name)) == "plain":
                    object.__setattr__(self, name, plain[name])
            for value, name, at, count in loads:
                value.load_elastic_state(plain[name], arrays[at:at + count])
            object.__setattr__(self, "commits", plain["commits"])


def _keep(value: np.ndarray, previous: Any) -> np.ndarray:
    """A copy of ``value``, written into ``previous`` when it fits (a commit then
    allocates nothing: fresh pages cost more than the copy)."""
    if isinstance(previous, np.ndarray) and previous is not value and \
            previous.shape == value.shape and previous.dtype == value.dtype:
        np.copyto(previous, value)
        return previous
    return value.copy()


def _keep_all(values: Sequence[np.ndarray], previous: Any) -> list[np.ndarray]:
    before = previous if isinstance(previous, list) and len(previous) == len(values) \
        else [None] * len(values)
    return [_keep(v, b) for v, b in zip(values, before, strict=True)]


_RESERVED = frozenset(name for name in dir(State) if not name.startswith("_")) | {"commits"}


def _put(state: State, name: str, value: np.ndarray, copied: np.ndarray) -> None:
    if value.shape == copied.shape and value.dtype == copied.dtype and value.flags.writeable:
        np.copyto(value, copied)
    else:
        object.__setattr__(state, name, copied.copy())


def _broadcast_arrays(arrays: list[np.ndarray]) -> None:
    """Broadcast from rank 0, in place (non-contiguous arrays through a copy)."""
    flat = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]
    nonempty = [a for a in flat if a.size]
    if nonempty:
        collectives.broadcast(nonempty, src=0)
    for a, f in zip(arrays, flat, strict=True):
        if f is not a:
            np.copyto(a, f)


# -- run --------------------------------------------------------------------------------------


def run(func: F) -> F:
    """Decorate the training function ``func(state, *args, **kwargs)`` (module docstring).

    Outside an elastic job it syncs the state and calls ``func`` once. In one, it
    returns ``func``'s result once the function returned on every member of the world
    (a collective at the end); a rank that leaves (asked to, at a commit) ends its
    process with exit code 0.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError("swarmfd.elastic.run: the function's first argument must be a "
                            f"swarmfd.elastic.State, got {type(state).__name__}")
        changed: _Change | None = None
        while True:
            try:
                if changed is not None:
                    state.on_reset()
                state.sync()
                if changed is not None:
                    changed.log(state)
                    changed = None
                result = func(state, *args, **kwargs)
                _finish()
                return result
            except _WorldChanged as change:
                changed = _Change(change.at, "a commit", change.leave)
            except PeerLostError as exc:
                if session.elastic_state() is None:
                    raise
                _fully_sharded(state, exc)
                changed = _Change(time.monotonic(), "a lost rank", False)
                state.restore()
            except BaseException as exc:
                _tell_others(exc)
                raise
            changed.reform()

    return wrapper  # type: ignore[return-value]


class _Change:
    """A change of the world under way: why, since when, and this rank's place before."""

    def __init__(self, at: float, why: str, leave: bool) -> None:
        self.at, self.why, self.leave = at, why, leave
        self.rank = _group.get_rank() if _group.is_initialized() else -1
        self.size = _group.get_world_size() if _group.is_initialized() else 0

    def reform(self) -> None:
        try:
            world = session.reform(leave=self.leave)
        except BaseException as exc:
            _tell_others(exc)
            raise
        if world is None:
            _LOG.warning("swarmfd rank %d: left the job at a commit, as asked; exiting "
                         "(code 0)", self.rank)
            session.cleanup()
            raise SystemExit(0)

    def log(self, state: State) -> None:
        """The change, on every rank: who left or joined, the new world, since when."""
        ctx = session.elastic_state()
        if ctx is None or ctx.world is None:
            return
        w = ctx.world
        joined = w.was.count(-1)
        _LOG.warning(
            "swarmfd: generation %d after %s: lost rank(s) %s, left %s, %d joined; world of "
            "%d (was %d), this rank %s -> %d; resumed from commit %d; re-formed in %.2f s",
            w.gen, self.why, list(w.lost), list(w.left), joined, w.size, w.previous,
            self.rank if self.rank >= 0 else "new", w.rank, state.commits,
            time.monotonic() - self.at)


def _finish() -> None:
    """The function returned on this rank: wait until it has on every rank (a loss
    meanwhile is a loss like any), then tell waiting replacements the job is over."""
    ctx = session.elastic_state()
    if ctx is None or not _group.is_initialized():
        return
    collectives.barrier()
    ctx.agent.finish()
    if ctx.options.join == "auto" and _group.get_world_size() < ctx.config.world_size:
        # A Swarm task: a replacement of a lost rank may be starting (nothing outside the
        # Swarm knows the job ended): answer it "finished" for a moment, so it exits 0.
        time.sleep(FINISH_LINGER)


def _tell_others(exc: BaseException) -> None:
    """This rank ends the job (not a loss): tell every peer, so that none takes this
    rank's exit for a loss (they raise AbortedError). A collective's own failure told
    them already; a rank that leaves or exits (SystemExit) has nothing to tell."""
    if isinstance(exc, (SwarmfdError, SystemExit)):
        return
    s = _group.active()
    if s is None or s.transport is None or session.elastic_state() is None:
        return
    world = s.world
    assert world is not None
    why = RuntimeError(f"rank {s.config.rank} raised {type(exc).__name__}: {exc}")
    try:
        s.transport.channel.abort(why, world.gid, world.seq)
        s.transport.channel.flush()
    except (SwarmfdError, OSError):
        pass


def _fully_sharded(state: State, exc: BaseException) -> None:
    """fully_shard under elastic is not supported: a loss there ends the job, saying so."""
    check = getattr(state, "_check_elastic_loss", None)
    if check is not None:
        check(exc)


# -- the sampler -------------------------------------------------------------------------------


class ElasticSampler:
    """The indices of an epoch, split among the current world, that survive changes of it.

    ``data``: a length or anything with ``len()``; the epoch's order is a permutation
    drawn from ``seed`` and the epoch (``shuffle``), else 0..len-1. Iterating gives
    this rank's share of the samples of the epoch *not processed yet*: the remaining
    ones dealt round-robin over the ranks (rank r takes every W-th from the r-th), the
    shares evened out, when the remaining count does not divide, with repeats of
    samples processed at the same step by another rank (so no sample committed before
    is processed again), or (``drop_last``) without the last, uneven step.
    ``record_batch(batch, size)`` after each step marks what *every* rank processed in
    it (all ranks step together: one ``size`` per step, in order; ``batch`` is taken
    for Horovod's signature and not needed); a commit keeps the marks. After a
    change of the world the function starts over: the next iteration splits what is
    left among the new world. ``set_epoch(e)`` starts epoch ``e`` (nothing is marked);
    calling it for the current epoch keeps the marks (so it can stand at the top of an
    epoch loop that is entered again after a restore).
    """

    def __init__(self, data: Any, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        total = data if isinstance(data, (int, np.integer)) and not isinstance(data, bool) \
            else len(data)
        if total < 0:
            raise ValueError(f"ElasticSampler: a data set of {total} samples")
        self.total = int(total)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        #: 1 for each sample of the epoch processed (and recorded) so far.
        self.done = np.zeros(self.total, dtype=np.uint8)
        #: The split being iterated: what was left, in order, and the world it was dealt to.
        self._split: tuple[np.ndarray, int] | None = None
        self._taken = 0  # samples per rank recorded since that split

    def __repr__(self) -> str:
        return (f"swarmfd.elastic.ElasticSampler(epoch {self.epoch}, "
                f"{int(self.done.sum())}/{self.total} processed)")

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.done[:] = 0
        self._split = None

    def remaining(self) -> np.ndarray:
        """The epoch's samples not processed yet, in the epoch's order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.total)
        else:
            order = np.arange(self.total)
        return order[self.done[order] == 0]

    def indices(self, world: int | None = None, rank: int | None = None) -> np.ndarray:
        """This rank's share of what is left (``world`` and ``rank``: the current ones
        unless given); starts a new split, which :meth:`record_batch` then follows."""
        if world is None or rank is None:
            initialized = _group.is_initialized()
            world = _group.get_world_size() if initialized else 1
            rank = _group.get_rank() if initialized else 0
        order = self.remaining()
        self._split = (order, world)
        self._taken = 0
        steps, extra = divmod(len(order), world)
        if self.drop_last or extra == 0:
            return order[rank:steps * world:world]
        mine = order[rank::world]
        if rank < extra:
            return mine
        # A repeat of a sample another rank processes at the same (last) step.
        return np.append(mine, order[steps * world + (rank - extra) % extra])

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        split, taken = self._split, self._taken
        try:
            return len(self.indices())
        finally:
            self._split, self._taken = split, taken

    def batches(self, size: int) -> Iterator[np.ndarray]:
        """This rank's share in batches of ``size`` (the last one may be shorter)."""
        mine = self.indices()
        for at in range(0, len(mine), size):
            yield mine[at:at + size]

    def record_batch(self, batch: int, size: int) -> None:
        """Every rank processed its next ``size`` samples of the current split (see the
        class doc)."""
        if self._split is None:
            self.indices()
        assert self._split is not None
        order, world = self._split
        end = min(len(order), (self._taken + size) * world)
        if self.drop_last:
            end = min(end, len(order) // world * world)
        self.done[order[self._taken * world:end]] = 1
        self._taken += size

    def record_indices(self, indices: Sequence[int]) -> None:
        """Mark ``indices`` processed (every rank must mark the same: a sample any rank
        processed)."""
        self.done[np.asarray(indices, dtype=np.int64)] = 1

    def elastic_state(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        return {"epoch": self.epoch}, [self.done]

    def load_elastic_state(self, values: dict[str, Any], arrays: list[np.ndarray]) -> None:
        self.epoch = int(values["epoch"])
        if arrays[0] is not self.done:
            np.copyto(self.done, arrays[0])
        self._split = None
