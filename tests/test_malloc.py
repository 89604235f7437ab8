"""glibc malloc thresholds for message buffers (swarmfd.comm.malloc), in fresh processes:
the thresholds are per process and glibc adapts them as it sees frees."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from swarmfd.comm import malloc
from swarmfd.config import GLIBC_SETTINGS

from .support.harness import run_ranks_raw

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")

#: Allocates 1 MiB (a message piece) and then 2 MiB with libc's malloc, after tune(MODE),
#: and reports whether the first was mmapped and how much free space the top of the heap
#: kept after the second was freed (mallinfo2: hblks, keepcost).
PROBE = r"""
import ctypes, json, os, sys
from swarmfd.comm import malloc
from swarmfd.config import options_from_env
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
        "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
tuned = malloc.tune(options_from_env({**os.environ, "SWARMFD_MALLOC": sys.argv[1]}).malloc)
before = libc.mallinfo2().hblks
p = libc.malloc(1 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(p)
q = libc.malloc(2 << 20)
libc.free(q)
print(json.dumps({"tuned": tuned, "mapped": mapped, "keep": libc.mallinfo2().keepcost}))
"""


def _probe(mode: str, **env: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", **env}, check=True)
    return json.loads(out.stdout)


def test_tuned_buffers_come_from_the_heap_and_its_top_is_kept() -> None:
    got = _probe("tuned")
    assert got["tuned"] and got["mapped"] == 0, got
    assert got["keep"] >= 2 << 20, got  # not trimmed: the next buffer reuses those pages


def test_system_leaves_glibc_alone() -> None:
    got = _probe("system")
    assert not got["tuned"] and got["mapped"] == 1, got  # 1 MiB > glibc's 128 KiB threshold


@pytest.mark.parametrize("name", GLIBC_SETTINGS)
def test_the_user_s_own_glibc_settings_win(name: str) -> None:
    value = "glibc.malloc.trim_threshold=131072" if name == "GLIBC_TUNABLES" else "131072"
    assert not _probe("tuned", **{name: value})["tuned"]


def _tuned(rank: int, world: int) -> bool:
    return malloc.tuned()


@pytest.mark.parametrize("plane", ["socket", "zmq"])
def test_init_tunes_only_the_zmq_plane_s_processes(plane: str) -> None:
    """Only on the zmq plane are buffers allocated on one thread and freed on another."""
    out = run_ranks_raw(_tuned, 2, env={"SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": plane},
                        timeout=60)
    want = plane == "zmq"
    assert out == {0: (True, want), 1: (True, want)}, out
