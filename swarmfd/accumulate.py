"""Gradient accumulation: a large effective batch from several small ones.

When a batch does not fit in memory (or a bigger effective batch is wanted
without more ranks) each optimizer step is split into ``steps`` micro-steps.
After every micro-step's backward pass :meth:`GradAccum.step` adds the
gradients to private accumulators; once :meth:`GradAccum.should_step` says
enough micro-steps are in, :meth:`GradAccum.finish` writes their *mean* back
into the gradients, which are then averaged across ranks with
:func:`swarmfd.all_reduce_mean` and handed to the optimizer::

    accum = fd.GradAccum(grads, steps=4)
    for batch in batches:
        forward_backward(batch)          # fills ``grads`` with fresh gradients
        accum.step(grads)
        if accum.should_step():
            fd.all_reduce_mean(accum.finish(grads))
            optimizer_step(params, grads)

Why the mean and why communicate only once per cycle: with equal-sized
micro-batches the mean of the micro-step gradients is exactly the gradient of
the mean loss over all of them, so ``lr`` keeps its meaning whatever ``steps``
is; and the expensive all-reduce runs once per ``steps`` micro-steps, not once
per micro-step (mean over micro-steps, then mean over ranks, equals the mean
over everything because every rank accumulates the same number of micro-steps).

This is the Python counterpart of the C ``fd_grad_accum_*`` functions.
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
    """A numpy array holding ``grad`` and whether it shares ``grad``'s memory.

    numpy arrays are returned as they are. Torch tensors (recognised by
    ``detach``) become a zero-copy view via ``.detach().numpy()`` when they
    live on the CPU in a dtype numpy knows; otherwise (GPU, bfloat16) a copy,
    through float32 for dtypes numpy lacks.
    """
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

    ``params`` is a sequence (list, tuple, or any iterable such as a torch
    ``model.parameters()`` generator; a single numpy array counts as one) of
    either gradient arrays themselves (numpy) or objects with a ``.grad``
    attribute holding a numpy array or a torch tensor (torch parameters). The
    same kind of sequence, with the same number of entries in the same order,
    is passed to :meth:`step` and :meth:`finish`; shapes and dtypes are checked
    against the first ones seen (at construction, or at the first :meth:`step`
    for torch parameters whose ``.grad`` is still ``None`` before the first
    backward pass).

    Accumulator precision: gradients are summed in their own dtype, except
    float16, which is summed in float32 (a float16 sum loses most of its bits
    and overflows at 65504 after a few large micro-steps); the mean is then
    written back in the gradient's dtype. Integer or bool gradients are
    rejected: a mean of them is not representable.

    :meth:`step` does not clear the gradients: compute fresh ones before each
    call (with torch, ``zero_grad()`` before every ``backward()``), or the
    earlier micro-steps are counted again.
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
        """Add the current gradients of ``params`` to the accumulators; count one micro-step.

        Raises:
            ValueError: a different number of params than at construction, a
                gradient whose shape or dtype changed, or a missing (``None``) gradient.
            TypeError: a gradient that is not a numpy array or a torch tensor.
        """
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
        """Write the mean of the accumulated micro-steps into the gradients of ``params``.

        The mean is over the micro-steps actually accumulated (:attr:`count`),
        so a shorter last cycle at the end of an epoch is averaged correctly.
        Writes happen in place; then a new cycle starts (:meth:`reset`).

        Returns the gradients as numpy arrays sharing memory with them, ready
        for ``swarmfd.all_reduce_mean`` (for a torch gradient that has no
        zero-copy numpy view, e.g. on a GPU, the tensor itself).

        Raises:
            RuntimeError: no micro-step was accumulated since the last finish/reset.
            ValueError/TypeError: as :meth:`step`.
        """
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
        """The gradient of ``item``: itself if it is one, else its ``.grad`` (maybe None).

        A torch tensor has a ``.grad`` attribute too; one that does not require
        grad and has none (e.g. ``p.grad`` passed directly) is the gradient itself.
        The gradient is looked up on every call because torch may replace
        ``.grad`` with a new tensor between steps (``zero_grad(set_to_none=True)``).
        """
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
