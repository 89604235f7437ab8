"""Tensors in, numpy views out: the one place that checks what swarmfd.torch accepts.

The core moves numpy arrays (a CPU tensor through its zero-copy ``.numpy()`` view).
What torch code naturally passes needs a little more, which lives here so the core
stays numpy-only:

* **bfloat16**, which numpy has no dtype for: broadcast moves its bits as int16 (a
  copy needs no arithmetic); a reduction runs in float32 and is rounded back once.
* **CUDA tensors** are refused with a plain message: this is a CPU-only build.
* **Containers**: a tensor, a list, tuple or generator of tensors, or a dict
  (``state_dict``) of them; a None element (a parameter without a gradient) is an
  error naming it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from swarmfd import _internal
from swarmfd.comm import malloc

#: Floating dtypes gradients may have (bfloat16 is reduced in float32).
FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64, torch.bfloat16)

#: Dtypes moved as raw bits of the same width where numpy has no equivalent.
_BIT_VIEWS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def describe(t: torch.Tensor) -> str:
    """``float32[3, 4]``: a tensor's dtype and shape, for messages."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def check_cpu(t: Any, what: str, fn: str) -> torch.Tensor:
    """``t`` if it is a CPU tensor; else a TypeError naming ``what`` and saying why."""
    if t is None:
        raise TypeError(f"swarmfd.torch.{fn}: {what} is None, expected a tensor (a parameter "
                        "that got no gradient in this backward pass has grad None)")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"swarmfd.torch.{fn}: {what} is a {type(t).__name__}, expected a "
                        "torch.Tensor")
    if t.device.type != "cpu":
        raise TypeError(f"swarmfd.torch.{fn}: {what} is on {t.device}, but swarmfd supports "
                        "CPU tensors only (it moves numpy views of host memory; there is no "
                        "GPU path): move it with .cpu(), or use torch.distributed with NCCL "
                        "for GPU training")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"swarmfd.torch.{fn}: {what} has layout {t.layout}; only dense "
                        "(strided) tensors are supported")
    return t


def flatten(x: Any, fn: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of ``x``: a tensor, an iterable of tensors, or a dict of them.

    Names are ``"element i"`` or ``"key 'k'"``, so an error can say which one is wrong.
    A module's parameters (``module.parameters()``, a generator) work as a list does.
    """
    if isinstance(x, torch.Tensor):
        return [("the tensor", check_cpu(x, "the tensor", fn))]
    if isinstance(x, Mapping):
        return [(f"key {k!r}", check_cpu(v, f"key {k!r}", fn)) for k, v in x.items()]
    if isinstance(x, Iterable) and not isinstance(x, (str, bytes, np.ndarray)):
        return [(f"element {i}", check_cpu(v, f"element {i}", fn)) for i, v in enumerate(x)]
    raise TypeError(f"swarmfd.torch.{fn} expects a tensor, a list, tuple or generator of "
                    f"tensors, or a dict of them, got {type(x).__name__}")


def bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory as moved by a copy (bfloat16 as int16 bits)."""
    view = _BIT_VIEWS.get(t.dtype)
    return (t.detach().view(view) if view is not None else t.detach()).numpy()


def reducible(t: torch.Tensor, what: str, fn: str) -> None:
    """A TypeError if ``t``'s dtype cannot be reduced (bool; the core checks the rest)."""
    if t.dtype is torch.bool:
        raise TypeError(f"swarmfd.torch.{fn}: {what} has dtype torch.bool, which cannot be "
                        "reduced; expected a numeric dtype")


class Staged:
    """Tensors as the core reduces them: bfloat16 ones through a float32 copy.

    ``arrays`` are what to hand to a reduction; ``finish()`` writes the float32
    results back into the bfloat16 tensors (rounding once) and must run after the
    reduction completed.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.arrays: list[np.ndarray] = []
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in tensors:
            if t.dtype is torch.bfloat16:
                wide = t.detach().to(torch.float32)
                self._back.append((t, wide))
                self.arrays.append(wide.numpy())
            else:
                self.arrays.append(t.detach().numpy())

    def finish(self) -> None:
        for t, wide in self._back:
            with torch.no_grad():
                t.copy_(wide)


class Work:
    """An op of swarmfd.torch in flight: the core's Work plus what to do after it.

    ``wait()`` waits for the core op, runs the completion step once (bfloat16
    write-back, decompression) and returns ``result``; its error is the op's.
    Like the core's Work: the tensors belong to the op until ``wait()`` returns.
    """

    def __init__(self, work: Any, then: Callable[[], None] | None = None,
                 result: Any = None) -> None:
        self._work, self._then, self._result = work, then, result
        self._done = False

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            if self._work is not None:
                self._work.wait(timeout) if timeout is not None else self._work.wait()
            self._done = True
            if self._then is not None:
                then, self._then = self._then, None
                then()
        return self._result

    def is_completed(self) -> bool:
        return self._done or self._work is None or bool(self._work.is_completed())

    def exception(self) -> BaseException | None:
        return None if self._work is None else self._work.exception()


_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32,
                 torch.float64: np.float64, torch.bfloat16: np.int16}


def memory(t: torch.Tensor) -> np.ndarray:
    """A numpy view of contiguous ``t``'s elements (bfloat16 as int16 bits) that does not
    pin its storage.

    ``Tensor.numpy()`` marks the storage unresizable for good, and fully_shard frees a
    gathered unit by resizing its storage to zero (every view of it, those autograd
    saved included, then holds no memory; the next gather resizes the same storage
    back). The view is valid until that storage is resized: the caller keeps it no
    longer than the collective that writes or reads it. Writes through it do not bump
    the tensor's version counter, which autograd's saved views of the same storage
    share.
    """
    dtype = np.dtype(_NUMPY_DTYPES[t.dtype])
    if t.numel() == 0:
        return np.empty(0, dtype)
    if not t.is_contiguous():
        raise ValueError("swarmfd.torch: memory() needs a contiguous tensor")
    raw = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return np.frombuffer(raw, dtype=dtype)


def keep_freed(nbytes: int, working: int) -> bool:
    """Let glibc keep freed blocks of up to ``nbytes`` on its heap and up to ``working``
    bytes free at its top, rather than return them to the kernel: fully_shard frees a
    unit's gathered parameters and gradients after each unit and allocates the next
    unit's at once, and glibc's adaptive thresholds (a trim at twice the largest freed
    block) hand that memory back and fault it in again, zeroed, unit after unit. The
    tensors still release their memory; the process keeps at most ``working`` bytes more
    mapped than in use. Never below swarmfd's own message-buffer tuning; nothing under
    ``SWARMFD_MALLOC=system``, glibc's own settings, or another C library
    (:func:`swarmfd.comm.malloc.keep`). Whether the thresholds are now at least these."""
    return malloc.keep(max(nbytes, malloc.MMAP_THRESHOLD),
                       max(working, malloc.TRIM_THRESHOLD), _internal.options().malloc)
