"""Gradient accumulation: a large effective batch from several small ones.

Each optimizer step is split into ``steps`` micro-steps: :meth:`GradAccum.step` adds
each micro-step's gradients to private accumulators; once :meth:`GradAccum.should_step`,
:meth:`GradAccum.finish` writes their *mean* back into the gradients, to be averaged
across ranks and handed to the optimizer::

    accum = fd.GradAccum(grads, steps=4)
    for batch in batches:
        forward_backward(batch)          # fills ``grads`` with fresh gradients
        accum.step(grads)
        if accum.should_step():
            fd.all_reduce_mean(accum.finish(grads))
            optimizer_step(params, grads)

With equal micro-batches the mean is the gradient of the mean loss over all of them,
so ``lr`` keeps its meaning whatever ``steps`` is; and the all-reduce runs once a cycle
(every rank accumulates as many micro-steps, so the mean of means is the mean).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from .algorithms.base import divide_by

__all__ = ["GradAccum"]


def _is_tensor(obj: Any) -> bool:
    """Duck-typed torch tensor check (torch is never imported here)."""
    return hasattr(obj, "detach") and hasattr(obj, "shape") and hasattr(obj, "numpy")


def _to_numpy(grad: Any) -> tuple[np.ndarray, bool]:
    """A numpy array holding ``grad`` and whether it shares its memory: a CPU tensor's
    zero-copy view, else (GPU, bfloat16) a float32 copy."""
    if isinstance(grad, np.ndarray):
        return grad, True
    if _is_tensor(grad):
        detached = grad.detach()
        try:
            return detached.numpy(), True
        except (TypeError, RuntimeError):  # not on the CPU, or a dtype numpy lacks
            return detached.float().cpu().numpy(), False
    raise TypeError(
        f"expected a numpy array or a torch tensor as gradient, got {type(grad).__name__}"
    )


class _Slot:
    """One parameter: where its gradient lives and the running sum of it."""

    __slots__ = ("acc", "dtype", "shape")

    def __init__(self) -> None:
        self.shape: tuple[int, ...] | None = None
        self.dtype: np.dtype | None = None
        self.acc: np.ndarray | None = None

    def buffer(self) -> np.ndarray:
        """The accumulator; only called once the gradient's shape is known."""
        if self.acc is None:  # unreachable through the public API
            raise RuntimeError("GradAccum internal error: accumulator used before allocation")
        return self.acc


class GradAccum:
    """Accumulate gradients over ``steps`` micro-steps and hand back their mean.

    ``params``: an iterable (a single array counts as one) of gradient arrays or of
    objects with a ``.grad`` (a numpy array or torch tensor). :meth:`step` and
    :meth:`finish` take the same params in the same order; shapes and dtypes are checked
    against the first seen. Sums are in the gradient's dtype, float16's in float32 (it
    loses its bits and overflows at 65504); integer gradients are rejected (no mean).
    :meth:`step` does not clear the gradients: with torch, ``zero_grad()`` before every
    ``backward()``, or earlier micro-steps count again.
    """

    def __init__(self, params: Iterable[Any] | np.ndarray, steps: int) -> None:
        if isinstance(steps, (bool, np.bool_)) or not isinstance(steps, (int, np.integer)):
            raise TypeError(
                f"steps must be a positive integer, got {steps!r} ({type(steps).__name__})"
            )
        if steps < 1:
            raise ValueError(
                f"steps must be a positive integer (micro-steps per cycle), got {steps}"
            )
        self._steps = int(steps)
        self._count = 0
        items = self._as_list(params)
        self._slots = [_Slot() for _ in items]
        for i, item in enumerate(items):
            grad = self._grad_of(item, i)
            if grad is not None:
                self._bind(i, _to_numpy(grad)[0])

    # -- public API -------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Micro-steps per cycle (the ``steps`` given at construction)."""
        return self._steps

    @property
    def count(self) -> int:
        """Micro-steps accumulated since the last :meth:`finish` or :meth:`reset`."""
        return self._count

    @property
    def num_params(self) -> int:
        """Number of parameters (gradients) tracked."""
        return len(self._slots)

    def step(self, params: Iterable[Any] | np.ndarray) -> None:
        """Add the current gradients of ``params`` to the accumulators; count one
        micro-step. ValueError for another number of params, a changed shape or dtype, a
        missing gradient; TypeError for a gradient neither numpy nor torch."""
        grads = self._grads(params, "step")
        for i, (slot, grad) in enumerate(zip(self._slots, grads, strict=True)):
            if slot.acc is None:
                self._bind(i, grad)
            self._check(i, grad, "step")
        for slot, grad in zip(self._slots, grads, strict=True):
            np.add(slot.buffer(), grad, out=slot.buffer(), casting="same_kind")
        self._count += 1

    def should_step(self) -> bool:
        """True once ``steps`` micro-steps are accumulated: time to :meth:`finish` and update."""
        return self._count >= self._steps

    def finish(self, params: Iterable[Any] | np.ndarray) -> list[Any]:
        """Write the mean over the micro-steps accumulated (:attr:`count`: a short last
        cycle too) into the gradients of ``params``, in place, and :meth:`reset`. Returns
        them as numpy views for ``swarmfd.all_reduce_mean`` (a GPU tensor itself).
        RuntimeError with nothing accumulated; else raises as :meth:`step`."""
        if self._count == 0:
            raise RuntimeError(
                "GradAccum.finish() called with no accumulated micro-steps: "
                "call step(params) after each backward pass first"
            )
        items = self._as_list(params)
        self._check_len(items, "finish")
        targets: list[tuple[Any, np.ndarray, bool]] = []
        for i, item in enumerate(items):
            grad = self._grad_of(item, i)
            if grad is None:
                raise ValueError(f"finish: param {i} has no gradient (.grad is None)")
            view, shared = _to_numpy(grad)
            self._check(i, view, "finish")
            targets.append((grad, view, shared))
        # All checked before anything is written: a bad call leaves the gradients untouched.
        out: list[Any] = []
        for slot, (grad, view, shared) in zip(self._slots, targets, strict=True):
            mean = slot.buffer()
            divide_by(mean, self._count)
            if shared:
                np.copyto(view, mean, casting="same_kind")
                out.append(view)
            else:
                torch = sys.modules["torch"]  # already loaded: ``grad`` is a torch tensor
                with torch.no_grad():
                    grad.copy_(torch.from_numpy(mean))
                out.append(grad)
        self.reset()
        return out

    def reset(self) -> None:
        """Discard the accumulated gradients and start a new cycle (count back to 0)."""
        for slot in self._slots:
            if slot.acc is not None:
                slot.acc.fill(0)
        self._count = 0

    def __repr__(self) -> str:
        return f"GradAccum(num_params={self.num_params}, steps={self._steps}, count={self._count})"

    # -- internals ----------------------------------------------------------------

    @staticmethod
    def _as_list(params: Iterable[Any] | np.ndarray) -> list[Any]:
        if isinstance(params, np.ndarray) or hasattr(params, "grad"):
            return [params]
        try:
            return list(params)
        except TypeError:
            raise TypeError(
                "params must be a sequence of gradient arrays or of objects with a .grad "
                f"attribute, got {type(params).__name__}"
            ) from None

    @staticmethod
    def _grad_of(item: Any, index: int) -> Any:
        """The gradient of ``item``: itself (an array, or a tensor not requiring grad),
        else its ``.grad`` (maybe None), looked up every call (torch may replace it)."""
        if isinstance(item, np.ndarray):
            return item
        grad = getattr(item, "grad", None)
        if grad is not None:
            return grad
        if _is_tensor(item) and not getattr(item, "requires_grad", False):
            return item
        if hasattr(item, "grad"):
            return None
        raise TypeError(
            f"param {index} is a {type(item).__name__}: expected a numpy gradient array, "
            "a torch tensor, or an object with a .grad attribute"
        )

    def _check_len(self, items: list[Any], method: str) -> None:
        if len(items) != len(self._slots):
            raise ValueError(
                f"{method}: got {len(items)} params, expected {len(self._slots)} "
                "(the same params as at construction, in the same order)"
            )

    def _grads(self, params: Iterable[Any] | np.ndarray, method: str) -> list[np.ndarray]:
        items = self._as_list(params)
        self._check_len(items, method)
        grads = []
        for i, item in enumerate(items):
            grad = self._grad_of(item, i)
            if grad is None:
                raise ValueError(
                    f"{method}: param {i} has no gradient (.grad is None): run the backward "
                    "pass before step()"
                )
            grads.append(_to_numpy(grad)[0])
        return grads

    def _bind(self, index: int, grad: np.ndarray) -> None:
        """Fix the shape/dtype of param ``index`` and allocate its accumulator."""
        if not np.issubdtype(grad.dtype, np.inexact):
            raise TypeError(
                f"param {index} has a gradient of dtype {grad.dtype}: expected a floating "
                "(or complex) dtype, since the mean of integer gradients is not representable"
            )
        acc_dtype = np.float32 if grad.dtype == np.float16 else grad.dtype
        slot = self._slots[index]
        slot.shape = tuple(grad.shape)
        slot.dtype = grad.dtype
        slot.acc = np.zeros(grad.shape, dtype=acc_dtype)

    def _check(self, index: int, grad: np.ndarray, method: str) -> None:
        slot = self._slots[index]
        if tuple(grad.shape) != slot.shape:
            raise ValueError(
                f"{method}: param {index} has gradient shape {tuple(grad.shape)}, expected "
                f"{slot.shape} (as first seen)"
            )
        if grad.dtype != slot.dtype:
            raise ValueError(
                f"{method}: param {index} has gradient dtype {grad.dtype}, expected "
                f"{slot.dtype} (as first seen)"
            )
