"""Entry points for swarmfd's own layers above the collectives (``swarmfd.torch`` and the
features built on the core), not for users: what they need of the core that the public
API does not say. Names here may change without notice.

* :func:`all_reduce_in_place` / :func:`reduce_scatter_parts`: DDP's and ZeRO's buckets
  reduce their gradients where they are, without a copy into a bucket;
* :func:`members_group`, :func:`choose_area` and the ids and areas they take: groups
  made by their members alone (torch's ``new_group`` through the c10d backend);
* :func:`options`: the running job's options, as init read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import inputs as _in
from .algorithms import select
from .algorithms.base import Parts
from .collectives import reduce_scatter_run
from .comm.wire import Collective, ReduceOp
from .config import Options
from .group import (
    MEMBER_AREAS,
    MEMBERS_FIRST_GID,
    MEMBERS_MAX_GID,
    choose_area,
    current,
    members_group,
    resolve_group,
)

__all__ = ["MEMBERS_FIRST_GID", "MEMBERS_MAX_GID", "MEMBER_AREAS", "all_reduce_in_place",
           "choose_area", "members_group", "options", "reduce_scatter_parts"]


def options(what: str = "swarmfd.torch") -> Options:
    """The running job's options (``SWARMFD_*``, read once at init); ``what`` names the
    caller if the process group is not initialised."""
    return current(what).config.options


def all_reduce_in_place(group: Any, nbytes: int, count: int, arrays: int = 1) -> bool:
    """Whether an all_reduce of a list of ``arrays`` disjoint, contiguous, writable arrays
    of one dtype (``count`` items, ``nbytes``) reduces them where they are (Parts)."""
    g = resolve_group(group, "all_reduce()")
    plane = g.plane()
    return plane is not None and g.size > 1 and select.all_reduce(
        plane, nbytes, g.size, count, g.two_level(), arrays).parts


def reduce_scatter_parts(arrays: Sequence[Any], out: Any, *, op: str = "sum",
                         group: Any = None, async_op: bool = False) -> Any:
    """``reduce_scatter`` of the concatenation of ``arrays`` (one dtype, a total that
    divides into equal parts) read where they are; ``out``: this rank's part."""
    g = resolve_group(group, "reduce_scatter()")
    rop, mean = _in.parse_op(op, "reduce_scatter")
    nps = [_in.to_numpy(a, "reduce_scatter").reshape(-1) for a in arrays]
    if not nps or len({a.dtype for a in nps}) != 1:
        raise TypeError("swarmfd.reduce_scatter_parts: arrays must be one or more arrays "
                        "of one dtype")
    total = sum(a.size for a in nps)
    if total % g.size:
        raise ValueError(f"swarmfd.reduce_scatter_parts: {total} elements do not split "
                         f"into {g.size} equal parts")
    dtype = nps[0].dtype
    code = _in.check_array(nps[0], "reduce_scatter", writable=False)
    _in.check_op_dtype(rop, mean, dtype, "reduce_scatter")
    part = total // g.size
    res = _in.out_array(out, (part,), dtype, "reduce_scatter")
    buf = Parts([a for a in nps if a.size]) if total else np.zeros(0, dtype)
    parts = [(r * part, (r + 1) * part) for r in range(g.size)]
    shape = np.broadcast_to(np.zeros((), dtype), (total,))
    sig = _in.signature(Collective.REDUCE_SCATTER, [shape], code,
                        ReduceOp.MEAN if mean else rop)
    key = ("parts", total, dtype, op) if isinstance(op, (str, ReduceOp)) else None
    return reduce_scatter_run(g, buf, parts, res, res, rop, mean, sig, key, async_op)
