"""Memory probe: the extra peak RSS of one rank during a large swarmfd all_reduce.

Run it inside a group::

    swarmfd run -n 2 -- python benchmarks/memory.py --size 64M

Each rank allocates and touches a float32 array of ``--size`` bytes, joins the
group and warms it up with a small all_reduce, then reads its resident-set
high-water mark (``VmHWM`` in /proc/self/status), runs ``--repeat`` all_reduces
of the large array and reads VmHWM again. The difference is the memory the
collective needed beyond the user's array (buffers, temporaries, message
copies); rank 0 prints the largest over ranks as one JSON line, also relative
to the array size (the goal: at most 0.5).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from _common import vm_hwm_bytes  # this script's folder is first on sys.path

import swarmfd as fd
from swarmfd.bench import parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64M", help="array size in bytes (4K, 1M, 64M, ...)")
    parser.add_argument("--repeat", type=int, default=3, help="all_reduces of the large array")
    parser.add_argument("--system", default="swarmfd", help="name to report")
    args = parser.parse_args(argv)
    size = parse_size(args.size)

    x = np.ones(size // 4, dtype=np.float32)  # allocated and touched before the baseline
    fd.init_from_env()
    try:
        fd.all_reduce(np.ones(1024, dtype=np.float32))
        fd.barrier()
        before = vm_hwm_bytes()
        for _ in range(args.repeat):
            fd.all_reduce(x)
        extra = np.array([float(vm_hwm_bytes() - before)])
        fd.all_reduce(extra, op="max")
        if fd.get_rank() == 0:
            record = {"system": args.system, "n": fd.get_world_size(), "memory_size": x.nbytes,
                      "extra_peak_bytes": int(extra[0]),
                      "extra_per_array": float(extra[0]) / x.nbytes}
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
    finally:
        fd.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
