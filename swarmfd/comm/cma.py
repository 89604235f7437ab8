"""Single-copy reads and writes of another process's memory: Linux cross-memory attach
(``process_vm_readv(2)``, ``process_vm_writev(2)``), as Open MPI's shared-memory
transport uses it.

Through shared memory every byte is copied twice: into a segment, then out of it.
With cross-memory attach a rank reads its peer's buffer straight into its own (one
copy, at about the speed of a memcpy: docs/performance.md).
The kernel allows it between processes of one user when ptrace would be allowed
(Yama's ``ptrace_scope`` may forbid it between siblings; Docker's default seccomp
profile forbids the call itself without CAP_SYS_PTRACE; another pid namespace hides
the peer): the shared-memory plane's probe finds out
(:meth:`~swarmfd.comm.planes.shm.ShmPlane.check_probes`), and the plane uses it only
when every rank of the host could read every other (:mod:`swarmfd.group` agrees on that
at init).

Nothing here parses peer data: a read or a write copies bytes between buffers whose
addresses the ranks of one host published to each other in their shared segments (the
kernel checks the same permission for both).
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
    """Whether this C library has process_vm_readv and process_vm_writev (the kernel may
    still refuse them)."""
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
    """Copy the bytes of process ``pid``'s ``remote`` pieces (address, length) into this
    process's ``local`` ones, which hold as many bytes. Raises OSError when the kernel
    refuses (EPERM), the process is gone (ESRCH) or an address is not mapped (EFAULT),
    and also when fewer bytes were copied than asked."""
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
    # Cut both sides at the union of their boundaries, so that each batch of at most
    # IOV_MAX pieces holds the same bytes on both.
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
