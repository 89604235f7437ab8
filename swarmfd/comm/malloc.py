"""Fixed glibc malloc thresholds for the message buffers of the zmq data plane.

Every message buffer is allocated on one thread and freed on another: pyzmq copies a
sent payload into a buffer the rank's thread allocates and libzmq's I/O thread frees
once it is on the wire, and a received one is allocated by the I/O thread and freed by
the rank. Pieces are up to wire.MAX_PAYLOAD (1 MiB), above glibc's initial mmap
threshold (128 KiB), and glibc adapts its thresholds to what it sees: after the first
large free the mmap threshold rises to that size and the trim threshold to twice it.
From then on the free space at the top of the heap keeps crossing the trim threshold:
the freeing thread returns it to the kernel (brk, or madvise in a thread's arena) and
the allocating thread grows the heap again, and every page of a new buffer is faulted
in and zeroed anew: system time a call, and the call's time, grow with it
(docs/performance.md).

So on the zmq plane init fixes both thresholds, which also stops glibc's adapting
(mallopt): buffers up to MMAP_THRESHOLD come from the heap and are reused, and the
heap keeps up to TRIM_THRESHOLD of free space at its top. (The socket plane allocates
and frees on the rank's own thread, where fixed thresholds gained nothing: they are
not set there.)
The cost is memory the process keeps mapped: at most TRIM_THRESHOLD at the top of
each heap beyond what it uses. glibc itself moves the mmap threshold up to 32 MiB as
it sees large frees, so 4 MiB is within what a process gets anyway.
``SWARMFD_MALLOC=system`` leaves glibc alone, and so do glibc's own settings
(``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) when
present, and a C library other than glibc.
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
    """Fix glibc's trim and mmap thresholds (see the module docstring), once per process;
    ``mode`` 'tuned' or 'system' (SWARMFD_MALLOC, or glibc's own settings in the
    environment: swarmfd.config.Options). Returns whether they are set by swarmfd."""
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
