"""Single-copy reads and writes of another process's memory: Linux cross-memory attach
(``process_vm_readv(2)``, ``process_vm_writev(2)``), as Open MPI uses it.

Through a segment every byte is copied twice; this copies once, at about a memcpy's
speed (docs/performance.md). The kernel allows it where ptrace would be (Yama's
``ptrace_scope``, Docker's seccomp profile or another pid namespace may not): the shm
plane's probe finds out (:meth:`~swarmfd.comm.planes.shm.ShmPlane.check_probes`), and it
is used only where every rank of the host can read every other. Nothing here parses
peer data: it copies between buffers whose addresses the ranks published.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
from collections.abc import Sequence

__all__ = ["IOV_MAX", "available", "offsets", "read", "spans", "write"]

#: Most iovecs one process_vm_readv takes (Linux's UIO_MAXIOV).
IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _load("process_vm_readv")
_WRITEV = _load("process_vm_writev")


def available() -> bool:
    """Whether this C library has process_vm_readv and process_vm_writev."""
    return _READV is not None and _WRITEV is not None


def offsets(layout: Sequence[tuple[int, int]]) -> list[int]:
    """Where each of ``layout``'s buffers (address, length) starts in the whole they make
    one after the other, and (last) the whole's length: :func:`spans` takes it."""
    starts = [0]
    for _, n in layout:
        starts.append(starts[-1] + n)
    return starts


def spans(layout: Sequence[tuple[int, int]], starts: Sequence[int], a: int,
          b: int) -> list[tuple[int, int]]:
    """(address, length) pieces of bytes [a, b) of the whole that ``layout``'s buffers
    (address, length), one after the other, make (``starts``: its :func:`offsets`)."""
    out = []
    i = max(0, bisect.bisect_right(starts, a) - 1)
    at = a
    while at < b and i < len(layout):
        addr, n = layout[i]
        stop = min(b, starts[i] + n)
        if stop > at:
            out.append((addr + at - starts[i], stop - at))
        at = max(at, stop)
        i += 1
    return out


def read(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> None:
    """Copy process ``pid``'s ``remote`` pieces (address, length) into this process's
    ``local`` ones (as many bytes); OSError when the kernel refuses (EPERM, ESRCH,
    EFAULT) or copied fewer bytes."""
    _transfer(_READV, "process_vm_readv", pid, local, remote)


def write(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> None:
    """Copy this process's ``local`` pieces (address, length) into process ``pid``'s
    ``remote`` ones, which hold as many bytes; raises as :func:`read` does."""
    _transfer(_WRITEV, "process_vm_writev", pid, local, remote)


def _transfer(fn: ctypes._CFuncPtr | None, name: str, pid: int,  # type: ignore[name-defined]
              local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]) -> None:
    if fn is None:
        raise OSError(0, f"{name} is not available in this C library")
    total = sum(n for _, n in local)
    if total != sum(n for _, n in remote):
        raise ValueError("swarmfd bug: a cross-memory copy of unequal sides")
    # Cut both sides at the union of their boundaries: each batch is alike on both.
    pairs: list[tuple[int, int, int]] = []  # (local address, remote address, length)
    li = ri = 0
    loff = roff = 0
    while li < len(local) and ri < len(remote):
        la, ln = local[li]
        ra, rn = remote[ri]
        n = min(ln - loff, rn - roff)
        if n:
            pairs.append((la + loff, ra + roff, n))
        loff += n
        roff += n
        if loff == ln:
            li, loff = li + 1, 0
        if roff == rn:
            ri, roff = ri + 1, 0
    for at in range(0, len(pairs), IOV_MAX):
        batch = pairs[at:at + IOV_MAX]
        lv = (_Iovec * len(batch))(*[(la, n) for la, _, n in batch])
        rv = (_Iovec * len(batch))(*[(ra, n) for _, ra, n in batch])
        want = sum(n for _, _, n in batch)
        got = fn(pid, lv, len(batch), rv, len(batch), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got != want:
            raise OSError(0, f"copied {got} of {want} bytes")
