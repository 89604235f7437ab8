"""One rank of the mpi4py benchmark (started by ``mpirun`` from compare.py).

Float32 collectives measured like ``swarmfd bench`` (see _common.py), with its
sizes and checks: ``--collective`` all_reduce (``Allreduce(IN_PLACE, SUM)``,
the default), broadcast (``Bcast``), all_gather (``Allgather``),
reduce_scatter (``Reduce_scatter`` of ``np.array_split`` counts), all_to_all
(``Alltoall``, equal parts), gather (``Gather``), scatter (``Scatter``) and
sendrecv (``Sendrecv`` around a ring). The transport (TCP or shared memory) is
chosen by the mpirun ``--mca btl`` options, not here. ``--memory BYTES``
instead reports the extra peak RSS of one all_reduce of that size.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import emit, parse_plan, summary, time_loop, vm_hwm_bytes
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", help="BYTES:ITERS,... sizes to time")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--name", default="mpi", help="system name to report")
    parser.add_argument("--memory", type=int, help="measure the peak RSS of one all_reduce")
    parser.add_argument("--collective", action="append", choices=COLLECTIVES,
                        help="collective(s) to time, in order (default: all_reduce)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if args.memory:
        measure_memory(comm, args.memory, args.name)
    else:
        for collective in args.collective or ["all_reduce"]:
            bench(comm, parse_plan(args.plan), args.warmup, args.name, collective)


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
               "gather", "scatter", "sendrecv")


class Case:
    """Buffers, the timed call and the result check of one collective at one size."""

    def __init__(self, comm: MPI.Comm, collective: str, count: int) -> None:
        rank, n = comm.Get_rank(), comm.Get_size()
        self.rank, self.n, self.collective = rank, n, collective
        if collective == "all_to_all":
            count = max(n, count - count % n)
        self.count = count
        self.pattern = (np.arange(count) % 7 + 1).astype(np.float32)
        self.source = self.pattern * np.float32(rank + 1)
        if collective == "broadcast" and rank != 0:
            self.source = np.zeros(count, np.float32)
        self.x = np.empty_like(self.source)
        parts = np.array_split(np.arange(count), n)
        self.counts = [len(p) for p in parts]
        self.starts = [int(p[0]) if len(p) else 0 for p in parts]
        if collective in ("all_gather", "gather"):
            self.out = np.empty((n, count), np.float32)
        elif collective == "reduce_scatter":
            self.out = np.empty(self.counts[rank], np.float32)
        else:
            self.out = np.empty(count, np.float32)
        self.chunks = np.stack([self.pattern * np.float32(r + 1) for r in range(n)]) \
            if collective == "scatter" and rank == 0 else None
        calls = {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, self.x, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(self.x, root=0),
            "all_gather": lambda: comm.Allgather(self.x, self.out),
            "reduce_scatter": lambda: comm.Reduce_scatter(self.x, self.out, self.counts,
                                                         op=MPI.SUM),
            "all_to_all": lambda: comm.Alltoall(self.x, self.out),
            "gather": lambda: comm.Gather(self.x, self.out if rank == 0 else None, root=0),
            "scatter": lambda: comm.Scatter(self.chunks, self.out, root=0),
            "sendrecv": lambda: comm.Sendrecv(self.x, (rank + 1) % n, recvbuf=self.out,
                                              source=(rank - 1) % n),
        }
        self.call = calls[collective]

    def reset(self) -> None:
        np.copyto(self.x, self.source)
        self.out.fill(0)

    def wrong(self) -> int:
        """Wrong elements of the last result on this rank."""
        p, n, c = self.pattern, self.n, self.collective
        total = p * np.float32(n * (n + 1) / 2)
        if c == "all_reduce":
            got, want = self.x, total
        elif c == "broadcast":
            got, want = self.x, p
        elif c == "all_gather" or (c == "gather" and self.rank == 0):
            got, want = self.out, np.stack([p * np.float32(r + 1) for r in range(n)])
        elif c == "gather":
            return 0
        elif c == "reduce_scatter":
            a = self.starts[self.rank]
            got, want = self.out, total[a:a + self.counts[self.rank]]
        elif c == "all_to_all":
            k = self.count // n
            a = self.rank * k
            got, want = self.out, np.concatenate([p[a:a + k] * np.float32(r + 1)
                                                  for r in range(n)])
        elif c == "scatter":
            got, want = self.out, p * np.float32(self.rank + 1)
        else:
            got, want = self.out, p * np.float32((self.rank - 1) % n + 1)
        return int(np.count_nonzero(~np.isclose(got, want, rtol=1e-6, atol=0)))


def bench(comm: MPI.Comm, plan: list[tuple[int, int]], warmup: int, name: str,
          collective: str) -> None:
    rank, world = comm.Get_rank(), comm.Get_size()
    for size, iters in plan:
        case = Case(comm, collective, max(1, size // 4))
        times, cpu = time_loop(case.reset, comm.Barrier, case.call, iters, warmup)
        cpu = comm.allreduce(cpu, op=MPI.SUM) / world
        wrong = np.array([float(case.wrong())])
        comm.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        if rank == 0:
            emit({"system": name, "n": world, "collective": collective,
                  "size": case.count * 4, "iters": iters, "wrong": int(wrong[0]),
                  "cpu_s": cpu, **summary(slowest)})


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
