"""One rank of the mpi4py benchmark (started by ``mpirun`` from compare.py).

Float32 in-place ``Allreduce(IN_PLACE, SUM)``, measured like ``swarmfd bench``
(see _common.py). The transport (TCP or shared memory) is chosen by the
mpirun ``--mca btl`` options, not here. ``--memory BYTES`` instead reports the
extra peak RSS of one all_reduce of that size.
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
from _common import emit, parse_plan, summary, time_loop, vm_hwm_bytes
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", help="BYTES:ITERS,... sizes to time")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="mpi", help="system name to report")
    parser.add_argument("--memory", type=int, help="measure the peak RSS of one all_reduce")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if args.memory:
        measure_memory(comm, args.memory, args.name)
    else:
        bench(comm, parse_plan(args.plan), args.warmup, args.name)


def bench(comm: MPI.Comm, plan: list[tuple[int, int]], warmup: int, name: str) -> None:
    rank, world = comm.Get_rank(), comm.Get_size()
    for size, iters in plan:
        count = max(1, size // 4)
        src = np.full(count, rank + 1, dtype=np.float32)
        x = np.empty_like(src)
        times = time_loop(partial(np.copyto, x, src), comm.Barrier,
                          partial(comm.Allreduce, MPI.IN_PLACE, x, op=MPI.SUM), iters, warmup)
        wrong = int(np.count_nonzero(x != world * (world + 1) / 2))
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        if rank == 0:
            emit({"system": name, "n": world, "collective": "all_reduce", "size": count * 4,
                  "iters": iters, "wrong": wrong, **summary(slowest)})


def measure_memory(comm: MPI.Comm, size: int, name: str) -> None:
    x = np.ones(size // 4, dtype=np.float32)
    small = np.ones(1024, dtype=np.float32)
    comm.Allreduce(MPI.IN_PLACE, small)
    comm.Barrier()
    before = vm_hwm_bytes()
    for _ in range(3):
        comm.Allreduce(MPI.IN_PLACE, x)
    extra = np.array([float(vm_hwm_bytes() - before)])
    comm.Allreduce(MPI.IN_PLACE, extra, op=MPI.MAX)
    if comm.Get_rank() == 0:
        emit({"system": name, "n": comm.Get_size(), "memory_size": size,
              "extra_peak_bytes": int(extra[0])})


if __name__ == "__main__":
    main()
