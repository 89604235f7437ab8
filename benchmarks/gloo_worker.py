"""One rank of the torch.distributed gloo benchmark (started N times by compare.py).

Environment: RANK, WORLD_SIZE, MASTER_PORT (rendezvous on tcp://127.0.0.1:PORT),
GLOO_SOCKET_IFNAME=lo. Float32 in-place all_reduce(SUM), measured like
``swarmfd bench`` (see _common.py). ``--memory BYTES`` instead reports the
extra peak RSS of one all_reduce of that size.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist
from _common import emit, parse_plan, summary, time_loop, vm_hwm_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", help="BYTES:ITERS,... sizes to time")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory", type=int, help="measure the peak RSS of one all_reduce")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        if args.memory:
            measure_memory(args.memory, rank, world)
        else:
            bench(parse_plan(args.plan), args.warmup, rank, world)
    finally:
        dist.destroy_process_group()


def bench(plan: list[tuple[int, int]], warmup: int, rank: int, world: int) -> None:
    for size, iters in plan:
        count = max(1, size // 4)
        src = torch.full((count,), float(rank + 1), dtype=torch.float32)
        x = torch.empty_like(src)
        times, cpu_s = time_loop(partial(x.copy_, src), dist.barrier,
                                 partial(dist.all_reduce, x), iters, warmup)
        cpu = torch.tensor([cpu_s], dtype=torch.float64)
        dist.all_reduce(cpu)
        expected = world * (world + 1) / 2
        wrong = int((x != expected).sum())
        slowest = torch.from_numpy(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            emit({"system": "gloo", "n": world, "collective": "all_reduce", "size": count * 4,
                  "iters": iters, "wrong": wrong, "cpu_s": float(cpu[0]) / world,
                  **summary(slowest.numpy())})


def measure_memory(size: int, rank: int, world: int) -> None:
    x = torch.ones(size // 4, dtype=torch.float32)
    small = torch.ones(1024)
    dist.all_reduce(small)
    dist.barrier()
    before = vm_hwm_bytes()
    for _ in range(3):
        dist.all_reduce(x)
    extra = torch.tensor([float(vm_hwm_bytes() - before)], dtype=torch.float64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    if rank == 0:
        emit({"system": "gloo", "n": world, "memory_size": size, "extra_peak_bytes": int(extra)})


if __name__ == "__main__":
    main()
