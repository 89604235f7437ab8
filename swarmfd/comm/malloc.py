"""Fixed glibc malloc thresholds for the message buffers of the zmq data plane.

Its buffers are allocated on one thread and freed on another (the rank's and libzmq's
I/O thread), and pieces (up to 1 MiB) exceed glibc's initial mmap threshold. glibc then
adapts: the free space at the top of the heap keeps crossing the trim threshold, is
returned to the kernel and faulted in again, zeroed, on the next allocation: system time
grows with every call (docs/performance.md). So init fixes both thresholds (which stops
the adapting): at most TRIM_THRESHOLD stays mapped beyond use, within what glibc's own
adapting (up to 32 MiB) gives anyway. Not on the socket plane, where it gained nothing.
``SWARMFD_MALLOC=system``, glibc's own settings (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) or another C library leave glibc alone.
:func:`keep` is the one place that sets them: fully_shard raises them further for the
unit buffers it frees and allocates again unit after unit (swarmfd.torch._tensors).
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MMAP_MAX", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep", "tune", "tuned"]

#: Allocations up to this size come from the heap: four times the largest message piece.
MMAP_THRESHOLD = 4 << 20
#: Free space the top of a heap keeps before it is returned to the kernel: the pieces a
#: rank has in flight (N-1 peers' worth at most a few MiB) many times over.
TRIM_THRESHOLD = 32 << 20
#: mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): allocations
#: above it are always mapped afresh.
MMAP_MAX = 32 << 20

#: The thresholds swarmfd set so far in this process (it only ever raises them).
_kept: dict[str, int] = {"mmap": 0, "trim": 0}


def keep(mmap: int, trim: int, mode: str) -> bool:
    """Raise glibc's mmap threshold to ``mmap`` (at most MMAP_MAX) and its trim threshold
    to ``trim``, never lowering what swarmfd set before, where ``mode`` is 'tuned' (see
    swarmfd.config.Options) and the C library is glibc; whether they are now at least
    these. Setting either stops glibc's adapting (docstring above)."""
    mmap = min(mmap, MMAP_MAX)
    if _kept["mmap"] >= mmap and _kept["trim"] >= trim:
        return True
    if mode != "tuned" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap, trim = max(mmap, _kept["mmap"]), max(trim, _kept["trim"])
    if not (mallopt(M_MMAP_THRESHOLD, mmap) and mallopt(M_TRIM_THRESHOLD, trim)):
        return False
    _kept.update(mmap=mmap, trim=trim)
    return True


def tune(mode: str) -> bool:
    """Fix glibc's thresholds for message buffers (MMAP_THRESHOLD, TRIM_THRESHOLD) where
    ``mode`` is 'tuned'; whether swarmfd set them (or higher ones)."""
    return keep(MMAP_THRESHOLD, TRIM_THRESHOLD, mode)


def tuned() -> bool:
    """Whether swarmfd set glibc's thresholds in this process (at least tune's)."""
    return _kept["mmap"] >= MMAP_THRESHOLD and _kept["trim"] >= TRIM_THRESHOLD
