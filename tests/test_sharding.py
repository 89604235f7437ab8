"""Tests of swarmfd.sharding: shard_indices and shard_batch are pure functions of their inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import swarmfd as fd
from swarmfd.sharding import shard_batch, shard_indices

from .support.harness import require_torch

sizes = st.integers(min_value=0, max_value=300)
worlds = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=0, max_value=2**32)
epochs = st.integers(min_value=0, max_value=1000)


def reference_sampler(
    n: int, world: int, rank: int, drop_last: bool, order: list[int]
) -> list[int]:
    """torch.utils.data.DistributedSampler.__iter__, written out (order = the epoch's order)."""
    if drop_last and n % world != 0:
        num_samples = math.ceil((n - world) / world)
    else:
        num_samples = math.ceil(n / world)
    total_size = num_samples * world
    indices = list(order)
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    assert len(indices) == total_size
    indices = indices[rank:total_size:world]
    assert len(indices) == num_samples
    return indices


def all_ranks(n: int, world: int, **kw: object) -> list[np.ndarray]:
    return [shard_indices(n, rank=r, world_size=world, **kw) for r in range(world)]


@given(n=sizes, world=worlds, drop_last=st.booleans(), shuffle=st.booleans(), seed=seeds,
       epoch=epochs)
def test_shard_indices_matches_distributed_sampler(n, world, drop_last, shuffle, seed, epoch):
    """Every rank's indices equal torch's DistributedSampler algorithm applied to the same order."""
    order = (np.random.default_rng(seed + epoch).permutation(n).tolist() if shuffle
             else list(range(n)))
    for rank in range(world):
        got = shard_indices(n, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last,
                            rank=rank, world_size=world)
        assert got.dtype == np.int64
        assert got.ndim == 1
        assert reference_sampler(n, world, rank, drop_last, order) == got.tolist()


@given(n=sizes, world=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs)
def test_shard_indices_cover_disjoint_equal_length(n, world, shuffle, seed, epoch):
    """Without drop_last the shards have equal length ceil(n/w), cover all, and only pad repeats."""
    parts = all_ranks(n, world, shuffle=shuffle, seed=seed, epoch=epoch)
    per_rank = -(-n // world)
    assert [len(p) for p in parts] == [per_rank] * world
    joined = np.concatenate(parts)
    assert set(joined.tolist()) == set(range(n))
    # Exactly per_rank*world - n duplicates (the padding); none when it divides evenly.
    assert len(joined) - len(set(joined.tolist())) == per_rank * world - n
    if n % world == 0:
        assert sorted(joined.tolist()) == list(range(n))


@given(n=sizes, world=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs)
def test_shard_indices_drop_last_disjoint(n, world, shuffle, seed, epoch):
    """With drop_last the shards are disjoint, of length n//w, and miss exactly n % w indices."""
    parts = all_ranks(n, world, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=True)
    assert [len(p) for p in parts] == [n // world] * world
    joined = np.concatenate(parts).tolist()
    assert len(set(joined)) == len(joined)
    assert set(joined) <= set(range(n))
    assert n - len(joined) == n % world


@given(n=st.integers(min_value=20, max_value=300), seed=seeds, epoch=epochs)
def test_shuffle_changes_with_epoch_and_seed(n, seed, epoch):
    """The shuffled order is a permutation that depends on seed+epoch (same on every call)."""
    a = shard_indices(n, shuffle=True, seed=seed, epoch=epoch, rank=0, world_size=1)
    again = shard_indices(n, shuffle=True, seed=seed, epoch=epoch, rank=0, world_size=1)
    other_epoch = shard_indices(n, shuffle=True, seed=seed, epoch=epoch + 1, rank=0,
                                world_size=1)
    assert sorted(a.tolist()) == list(range(n))
    assert a.tolist() == again.tolist()
    # 20! permutations: a collision between consecutive seeds would be astronomically unlikely.
    assert a.tolist() != other_epoch.tolist()


def test_shuffle_identical_across_ranks_without_communication():
    """Ranks computing independently agree: their parts interleave back into one permutation."""
    n, world = 103, 4
    parts = all_ranks(n, world, shuffle=True, seed=7, epoch=3)
    order = np.random.default_rng(10).permutation(n)
    padded = np.concatenate([order, order[: 104 - n]])
    for rank, part in enumerate(parts):
        assert padded[rank::world].tolist() == part.tolist()


def test_unshuffled_is_strided():
    """Without shuffle rank r gets r, r+w, r+2w, ... (the DistributedSampler stride)."""
    assert shard_indices(9, rank=1, world_size=3).tolist() == [1, 4, 7]
    # 10 over 3: padded to 12 with the first indices of the list (0, 1)
    assert shard_indices(10, rank=0, world_size=3).tolist() == [0, 3, 6, 9]
    assert shard_indices(10, rank=1, world_size=3).tolist() == [1, 4, 7, 0]
    assert shard_indices(10, rank=2, world_size=3).tolist() == [2, 5, 8, 1]
    assert shard_indices(10, rank=2, world_size=3, drop_last=True).tolist() == [2, 5, 8]
    assert shard_indices(10, rank=1, world_size=4).tolist() == [1, 5, 9]
    assert shard_indices(10, rank=2, world_size=4).tolist() == [2, 6, 0]
    assert shard_indices(10, rank=3, world_size=4).tolist() == [3, 7, 1]


def test_small_and_empty_totals():
    """total_size 0 gives empty shards; total_size < world_size wraps around the list."""
    assert shard_indices(0, rank=0, world_size=3).tolist() == []
    assert shard_indices(0, rank=2, world_size=3, drop_last=True).tolist() == []
    assert [shard_indices(2, rank=r, world_size=5).tolist() for r in range(5)] == [
        [0], [1], [0], [1], [0]
    ]
    assert shard_indices(2, rank=4, world_size=5, drop_last=True).tolist() == []
    assert shard_indices(1, rank=0, world_size=1).tolist() == [0]


def test_numpy_integers_are_accepted():
    """numpy integer scalars are integers too (e.g. len of an array computed with numpy)."""
    got = shard_indices(np.int64(10), seed=np.int32(1), epoch=np.uint8(2), shuffle=True,
                        rank=np.int64(1), world_size=np.int64(2))
    assert len(got) == 5


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"total_size": -1}, ValueError, "total_size must be >= 0"),
        ({"total_size": 3.0}, TypeError, "total_size must be an integer"),
        ({"total_size": True}, TypeError, "total_size must be an integer"),
        ({"total_size": "10"}, TypeError, "total_size must be an integer"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"seed": 1.5}, TypeError, "seed must be an integer"),
        ({"epoch": -2}, ValueError, "epoch must be >= 0"),
        ({"epoch": None}, TypeError, "epoch must be an integer"),
        ({"world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"world_size": False}, TypeError, "world_size must be an integer"),
        ({"rank": 2}, ValueError, "rank 2 is out of range"),
        ({"rank": -1}, ValueError, "rank must be >= 0"),
        ({"rank": np.True_}, TypeError, "rank must be an integer"),
    ],
)
def test_shard_indices_bad_input(kwargs, exc, words):
    """Bad arguments raise TypeError/ValueError naming the argument and what was expected."""
    args = {"total_size": 10, "rank": 0, "world_size": 2, **kwargs}
    total = args.pop("total_size")
    with pytest.raises(exc, match=words):
        shard_indices(total, **args)


# --- shard_batch ---------------------------------------------------------------

shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=4)


@given(shape=shapes, world=worlds, data=st.data())
def test_shard_batch_concatenates_back(shape, world, data):
    """Concatenating every rank's part in rank order gives the batch; sizes follow array_split."""
    dim = data.draw(st.integers(min_value=-len(shape), max_value=len(shape) - 1), label="dim")
    batch = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    parts = [shard_batch(batch, dim, rank=r, world_size=world) for r in range(world)]
    expected = np.array_split(batch, world, axis=dim)
    for part, exp in zip(parts, expected, strict=True):
        assert part.shape == exp.shape
        np.testing.assert_array_equal(part, exp)
        assert part.base is batch or part.size == 0 or np.shares_memory(part, batch)
    np.testing.assert_array_equal(np.concatenate(parts, axis=dim), batch)


def test_shard_batch_is_a_view():
    """The part shares memory with the batch: writing to it writes to the batch."""
    batch = np.zeros((10, 3))
    part = shard_batch(batch, rank=1, world_size=3)
    assert part.shape == (3, 3)
    part[:] = 1
    assert batch[4:7].tolist() == [[1.0] * 3] * 3
    assert batch.sum() == 9


def test_shard_batch_uneven_first_ranks_get_extra():
    """10 rows over 4 ranks: 3, 3, 2, 2 rows, contiguous and in order."""
    batch = np.arange(10)
    parts = [shard_batch(batch, rank=r, world_size=4).tolist() for r in range(4)]
    assert parts == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_shard_batch_negative_dim():
    """dim=-1 splits the last axis."""
    batch = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(shard_batch(batch, -1, rank=2, world_size=3), batch[:, 4:6])


@pytest.mark.parametrize(
    ("batch", "dim", "exc", "words"),
    [
        (np.zeros((2, 3)), 2, ValueError, r"dim 2 is out of range for a batch of shape \(2, 3\)"),
        (np.zeros((2, 3)), -3, ValueError, "dim -3 is out of range"),
        (np.float64(1.0), 0, TypeError, "numpy array or a torch tensor"),
        (np.zeros(()), 0, ValueError, "0-dimensional"),
        ([1, 2, 3], 0, TypeError, "got list"),
        (np.zeros(4), 0.0, TypeError, "dim must be an integer"),
        (np.zeros(4), True, TypeError, "dim must be an integer"),
    ],
)
def test_shard_batch_bad_input(batch, dim, exc, words):
    """Bad batches and dims raise a clear TypeError/ValueError naming the problem."""
    with pytest.raises(exc, match=words):
        shard_batch(batch, dim, rank=0, world_size=2)


def test_shard_batch_bad_rank():
    """rank must be below world_size."""
    with pytest.raises(ValueError, match="rank 3 is out of range"):
        shard_batch(np.zeros(4), rank=3, world_size=3)


# --- process group defaults --------------------------------------------------------


def test_defaults_come_from_the_process_group(alone: None) -> None:
    """Without rank/world_size the functions read them from the initialised group."""
    assert shard_indices(5).tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(shard_batch(np.arange(4)), np.arange(4))


def test_without_group_the_error_says_what_to_do() -> None:
    """No initialised group and no rank/world_size: a RuntimeError saying how to fix it."""
    assert not fd.is_initialized(), "an earlier test left a process group behind"
    with pytest.raises(RuntimeError, match="pass rank= and world_size="):
        shard_indices(10)


# --- torch tensors (skipped without torch, failed under CI=true) ----------------------


def test_shard_batch_torch_tensor_is_a_view():
    """torch tensors are split with narrow(): a view, same split as numpy."""
    torch = require_torch()
    batch = torch.arange(10.0).reshape(5, 2)
    parts = [shard_batch(batch, 0, rank=r, world_size=2) for r in range(2)]
    assert [tuple(p.shape) for p in parts] == [(3, 2), (2, 2)]
    assert torch.equal(torch.cat(parts, 0), batch)
    parts[1].fill_(-1)
    assert batch[3:].eq(-1).all()
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        shard_batch(batch, 2, rank=0, world_size=2)
