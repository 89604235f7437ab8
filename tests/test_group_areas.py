"""Groups' shared-memory areas: two groups with a member in common never share one.

A rank writes its rounds of every group into its own segment, in the group's area,
and its peers read them there after the rank may have moved on to another group's
call. When a group's area followed its id (id modulo 8), the 7th new_group of a
2-rank job shared the world's area and 39-102 of 20000 interleaved all_reduces came
out wrong, silently; async calls of nine overlapping groups of three ranks, 3 and 6 on
two of the ranks. ``swarmfd.group.choose_area`` now gives each group an area no group
with a common member uses, or none (its calls go over TCP).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import swarmfd as fd
from swarmfd import group as _group

from .conftest import run_ranks, transport_env


def _made(*groups: tuple[list[int], int | None]) -> list[tuple[frozenset[int], int | None]]:
    return [(frozenset(members), area) for members, area in groups]


def test_an_area_is_never_the_world_s_or_the_host_groups() -> None:
    assert _group.choose_area([], [0, 1]) == 2
    assert 0 not in _group.USER_AREAS and 1 not in _group.USER_AREAS


def test_groups_with_a_member_in_common_take_different_areas() -> None:
    made = _made(([0, 1], 2), ([2, 3], 2), ([1, 2], 3))
    assert _group.choose_area(made, [0, 3]) == 3  # its members are in area 2's groups only
    assert _group.choose_area(made, [1]) == 4  # 1 is in area 2's and area 3's
    assert _group.choose_area(made, [0, 2]) == 4


def test_groups_without_a_member_in_common_may_share_an_area() -> None:
    made = _made(([0, 1], 2), ([1, 2], 3))
    assert _group.choose_area(made, [4, 5]) == 2
    assert _group.choose_area(made, [3]) == 2


def test_groups_made_by_their_members_take_areas_of_their_own() -> None:
    """members_group's areas (torch's sub-groups) are apart from new_group's: each kind
    agrees on its own, so neither can take an area the other uses."""
    assert not set(_group.MEMBER_AREAS) & set(_group.USER_AREAS)
    assert 0 not in _group.MEMBER_AREAS and 1 not in _group.MEMBER_AREAS
    made = _made(([0, 1], _group.MEMBER_AREAS[0]))
    assert _group.choose_area(made, [1, 2], _group.MEMBER_AREAS) == _group.MEMBER_AREAS[1]
    assert _group.choose_area(made, [2, 3], _group.MEMBER_AREAS) == _group.MEMBER_AREAS[0]


def test_no_free_area_means_no_shared_memory() -> None:
    made = _made(*(([0, 1], a) for a in _group.USER_AREAS))
    assert _group.choose_area(made, [1, 2]) is None
    assert _group.choose_area(made + _made(([1, 2], None)), [2, 3]) == 2  # None takes none


def _interleave(rank: int, world: int) -> dict[str, Any]:
    groups = [fd.new_group([0, 1]) for _ in range(len(_group.USER_AREAS) + 1)]
    wrong = 0
    for i in range(6000):
        a = np.full(1024, rank + 1.0, np.float32)
        b = np.full(1024, 10.0 * (rank + 1), np.float32)
        g = groups[-1] if i % 2 else groups[i // 2 % len(groups)]
        fd.all_reduce(a)
        fd.all_reduce(b, group=g)
        wrong += int(not (a == 3).all()) + int(not (b == 30).all())
    return {"wrong": wrong, "areas": [g.area for g in groups],
            "planes": ["shm" if g.plane().shares_memory else "tcp" for g in groups]}


def test_interleaved_groups_on_shared_memory_keep_their_rounds_apart() -> None:
    """Seven groups of the same two ranks beside the world: the first six on shared
    memory in areas of their own, the seventh over TCP; every result exact."""
    for r in run_ranks(_interleave, 2, env=transport_env("shm"), timeout=120):
        assert r["wrong"] == 0, r
        assert r["areas"] == [*_group.USER_AREAS, None], r
        assert r["planes"] == ["shm"] * len(_group.USER_AREAS) + ["tcp"], r


#: Nine groups of three ranks: six get areas of their own, three go over TCP.
_SPECS = [[0, 1], [1, 2], [0, 2], [0, 1, 2], [0, 1], [1, 2], [0, 1, 2], [0, 2], [0, 1]]


def _async_mix(rank: int, world: int) -> dict[str, Any]:
    import random

    groups = [fd.new_group(s) for s in _SPECS]
    rng = random.Random(7)  # the same choices on every rank
    wrong = 0
    for _ in range(1500):
        pending = []
        for _ in range(rng.randint(1, 4)):
            gi = rng.randrange(len(groups))
            size = rng.choice([16, 1024, 70000])
            if groups[gi] is fd.NON_GROUP_MEMBER:
                continue
            x = np.full(size, rank + 1.0, np.float32)
            w = fd.all_reduce(x, group=groups[gi], async_op=True)
            pending.append((w, x, sum(m + 1.0 for m in _SPECS[gi])))
        for w, x, want in pending:
            w.wait()
            wrong += int(not (x == want).all())
    return {"wrong": wrong, "areas": [g.area if g is not fd.NON_GROUP_MEMBER else "-"
                                      for g in groups]}


def test_async_calls_of_many_groups_in_flight_keep_their_rounds_apart() -> None:
    """Async all_reduces of nine overlapping groups of three ranks in flight at once, on
    shared memory: every result exact (with areas by group id, 3 and 6 of them were
    wrong), and every rank agrees on each group's area."""
    out = run_ranks(_async_mix, 3, env=transport_env("shm"), timeout=180)
    for r in out:
        assert r["wrong"] == 0, r
    for gi, spec in enumerate(_SPECS):
        areas = {out[m]["areas"][gi] for m in spec}
        assert len(areas) == 1, (spec, areas)
    assert [out[_SPECS[gi][0]]["areas"][gi] for gi in range(len(_SPECS))] == \
        [2, 3, 4, 5, 6, 7, None, None, None]
