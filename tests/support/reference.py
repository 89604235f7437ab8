"""The check of a reduction's result against the sum of its inputs, to float precision.

Integers must be the sum exactly (wrapping as their dtype does). Floats may differ from
the exact sum only by rounding: each addition rounds once, by at most the dtype's
epsilon times the magnitude of what it adds, so ``n`` operands added in any order (a
chain, a ring, a tree) end within ``(n - 1) * eps * sum(|x|)`` of the exact sum,
element by element. The reference is the sum in float64 (complex128), itself that
close to the exact sum for float64 data; the slack allowed is twice that bound, one
rounding more for a mean's division, and a few subnormals. A contribution lost
anywhere, the smallest value of data spread over orders of magnitude included, then
shows wherever it is larger than the rounding of the sum it belongs to, where a fixed
``rtol=1e-2, atol=1e-2`` accepted the loss of any value under 0.01 and of up to 1 % of
any sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def off_the_sum(got: np.ndarray, inputs: Sequence[np.ndarray], divide: int = 0) -> str | None:
    """Why ``got`` is not the sum of ``inputs`` (divided by ``divide`` when not 0: a
    mean), or None when it is (see the module docstring)."""
    first = np.asarray(inputs[0])
    if got.shape != first.shape or got.dtype != first.dtype:
        return f"got {got.dtype}{got.shape}, the inputs are {first.dtype}{first.shape}"
    n = len(inputs)
    if first.dtype.kind in "iub":
        assert not divide, "a mean of integers is not a sum"
        want = sum(inputs[1:], start=first.copy())
        bad = got != want
        slack = np.zeros(got.shape)
    else:
        want, slack = _sum_and_slack(inputs, divide)
        off = np.subtract(got, want, dtype=want.dtype)
        bad = ~(np.abs(off) <= slack)  # NaN is off too
    if not bad.any():
        return None
    i = np.unravel_index(int(np.argmax(bad)), got.shape)
    return (f"{int(bad.sum())} of {got.size} elements are off the sum of the {n} inputs"
            f"{f' / {divide}' if divide else ''}; the first, at {tuple(map(int, i))}: "
            f"got {got[i]!r}, want {want[i]!r} (+- {slack[i]:.3g}), "
            f"the inputs {[x[i] for x in inputs]!r}")


def _sum_and_slack(inputs: Sequence[np.ndarray], divide: int) -> tuple[np.ndarray, np.ndarray]:
    """The sum of ``inputs`` in float64 (complex128) divided by ``divide`` (when not 0),
    and the slack a result may differ from it by (see the module docstring); in place,
    one input at a time (the suite checks thousands of results, some of 1 MiB)."""
    first = np.asarray(inputs[0])
    info = np.finfo(first.dtype)
    wide = np.complex128 if first.dtype.kind == "c" else np.float64
    want = np.zeros(first.shape, wide)
    slack = np.zeros(first.shape)
    wide_x = np.empty(first.shape, wide)
    for x in inputs:
        np.copyto(wide_x, x)
        want += wide_x
        slack += np.abs(wide_x)
    n, d = len(inputs), divide or 1
    slack *= (2 * n + 2) * float(info.eps) / d
    slack += (n + 1) * float(info.smallest_subnormal)
    if divide:
        want /= divide
    return want, slack


def assert_sum(got: np.ndarray, inputs: Sequence[np.ndarray], divide: int = 0,
               what: Any = "") -> None:
    """Assert that ``got`` is the sum of ``inputs`` (divided by ``divide`` when not 0),
    exactly for integers, to float precision for floats (:func:`off_the_sum`)."""
    problem = off_the_sum(got, inputs, divide)
    assert problem is None, f"{what}: {problem}" if what != "" else problem
