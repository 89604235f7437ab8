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
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune"]

#: Allocations up to this size come from the heap: four times the largest message piece.
MMAP_THRESHOLD = 4 << 20
#: Free space the top of a heap keeps before it is returned to the kernel: the pieces a
#: rank has in flight (N-1 peers' worth at most a few MiB) many times over.
TRIM_THRESHOLD = 32 << 20
#: mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

_tuned = False


def tune(mode: str) -> bool:
    """Fix glibc's thresholds once per process where ``mode`` is 'tuned' (see
    swarmfd.config.Options); whether swarmfd set them."""
    global _tuned
    if _tuned:
        return True
    if mode != "tuned":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned
