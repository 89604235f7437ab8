#!/usr/bin/env python3
"""Step time of data-parallel training: torch DDP (gloo) vs swarmfd.torch DDP and ZeRO.

The model: an MLP 256 -> 1024 x 4 -> 10 (3.4 M parameters, 13.6 MB
of float32 gradients), batch 64 per rank, SGD with momentum (``--optim adam``: Adam),
one thread per rank. Variants:

``nocomm``        N processes that never synchronise: the compute floor
``torch-ddp``     ``torch.nn.parallel.DistributedDataParallel`` over gloo
``swarmfd-ddp``   ``swarmfd.torch.DistributedDataParallel``
``swarmfd-zero``  the same with ``ZeroRedundancyOptimizer(Adam)``
``swarmfd-fsdp``  ``fully_shard`` on every Linear, then on the model (parameters,
                  gradients and optimizer state sharded)
``swarmfd-zero2`` the same with ``reshard_after_forward=False`` (ZeRO-2)

The sharded variants are not in the default list: ``--fsdp`` adds them and makes the
model 8 hidden layers deep (``--layers``), each Linear a unit.

Configurations: N=2 and N=4 ranks on loopback (``swarmfd run``), swarmfd on shared
memory (``shm``) and on TCP (``tcp``, ``SWARMFD_TRANSPORT=tcp``, the socket plane; ``zmq``,
the ZeroMQ plane: ``--planes shm,tcp,zmq``); and one rank on each of two simulated hosts
linked at 5 Gbit/s (``--netsim``, benchmarks/netsim.py; root).
nocomm and torch-ddp do not depend on swarmfd's plane: on loopback they run once per N.

Method: ``--rounds`` rounds, each running every (configuration, variant) job once, in
an order rotated from round to round (interleaved, so drifts of the machine's load
hit every variant alike). A job times ``--steps`` steps after ``--warmup``; a rank's
figure is its median step, a job's the slowest rank's, a variant's the median over
rounds. Each rank also reports its median CPU time a step (the process's, every
thread): on a shared machine it moves less than the time. The verdicts are ratios of
figures of the same run. Memory is measured with Adam in extra jobs (swarmfd DDP with
plain Adam and with ZeRO, per N, shared memory): each rank's peak RSS (VmHWM) and its
optimizer state (every tensor the optimizer holds; ZeRO: its local optimizers' state);
with the sharded variants also the bytes of parameters and gradients each rank holds,
and the most gathered parameters and unsharded gradients it held at once.

    python benchmarks/train.py                    # loopback, N=2 and 4, both planes
    python benchmarks/train.py --netsim           # + two simulated hosts at 5 Gbit/s
    python benchmarks/train.py --quick            # a short smoke run
    python benchmarks/train.py --fsdp --planes shm --optim adam   # + fully_shard, ZeRO-2

Writes ``--out`` (default benchmarks/out/train-<time>): .md (table and verdicts),
.csv (every job) and .png (needs matplotlib: pip install -e ".[bench]").
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VARIANTS = ("nocomm", "torch-ddp", "swarmfd-ddp", "swarmfd-zero", "swarmfd-fsdp",
            "swarmfd-zero2")
DEFAULT_VARIANTS = VARIANTS[:4]
SHARDED = ("swarmfd-fsdp", "swarmfd-zero2")
#: The variants whose memory the extra jobs with Adam measure.
MEMORY_VARIANTS = ("swarmfd-ddp", "swarmfd-zero", *SHARDED)
#: Nominal link rate of the simulated hosts (5 Gbit/s; netsim measured
#: 4.55-4.75 Gbit/s of TCP payload one way on it).
NETSIM_RATE = 5e9
BATCH, IN, HIDDEN, LAYERS, OUT = 64, 256, 1024, 4, 10
#: The environment of each swarmfd plane on loopback (``--planes``): shared memory, and
#: TCP on the socket plane or on the ZeroMQ plane.
PLANE_ENV = {"shm": {"SWARMFD_TRANSPORT": "auto"},
             "tcp": {"SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": "socket"},
             "zmq": {"SWARMFD_TRANSPORT": "tcp", "SWARMFD_DATA_PLANE": "zmq"}}


# -- a rank -----------------------------------------------------------------------------


def _model(depth: int = LAYERS) -> Any:
    import torch

    layers: list[Any] = [torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(HIDDEN, OUT))
    return torch.nn.Sequential(*layers)


def _state_bytes(opt: Any) -> int:
    import torch

    if hasattr(opt, "state_bytes"):
        return int(opt.state_bytes())
    return sum(v.numel() * v.element_size() for st in opt.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


def _tensor_bytes(tensors: Any) -> int:
    """Bytes of distinct storages among ``tensors`` (None skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _memory(variant: str, model: Any, opt: Any) -> dict[str, int]:
    """The bytes of parameters, gradients (ZeRO: also its reduced shards) and, for the
    sharded variants, the most gathered parameters and unsharded gradients held at once
    and the largest unit's parameters."""
    params = list(model.parameters())
    out = {"params_bytes": _tensor_bytes(params),
           "grads_bytes": _tensor_bytes(p.grad for p in params)}
    if variant == "swarmfd-zero":
        out["grads_bytes"] += _tensor_bytes(opt._shard_grads)
    if variant in SHARDED:
        from swarmfd.torch import fsdp

        stats = fsdp.memory_stats(model)
        out.update(params_bytes=stats["params"], grads_bytes=stats["grads"],
                   transient_bytes=stats["peak_unsharded"], unit_bytes=stats["largest_unit"],
                   unsharded_bytes=stats["unsharded_total"])
    return out


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> None:
    """One rank: build the variant, time the steps, print one JSON line."""
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    variant = args.variant
    trace: _Trace | None = None
    torch.manual_seed(0)
    model = _model(args.layers)
    x, y = torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,))
    if variant == "torch-ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        m = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    elif variant in SHARDED:
        import swarmfd as fd
        import swarmfd.torch as sft

        fd.init_from_env()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                sft.fully_shard(layer, reshard_after_forward=variant == "swarmfd-fsdp")
        m = sft.fully_shard(model, reshard_after_forward=variant == "swarmfd-fsdp")
    elif variant.startswith("swarmfd"):
        import swarmfd as fd
        import swarmfd.torch as sft

        fd.init_from_env()
        m = sft.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb,
                                        overlap={"on": True, "off": False}.get(args.overlap))
        if args.trace:
            trace = _Trace(m)
    else:
        m = model
    cls, kw = ((torch.optim.Adam, {"lr": 1e-4}) if args.optim == "adam" else
               (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}))
    if variant == "swarmfd-zero":
        opt = sft.ZeroRedundancyOptimizer(m.parameters(), cls, **kw)
    else:
        opt = cls(m.parameters(), **kw)
    steps, fwd, cpu = [], [], []
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        if trace is not None:
            trace.step(t1, t2, keep=i >= args.warmup)
        if i >= args.warmup:
            steps.append(t2 - t0)
            fwd.append(t1 - t0)
            cpu.append(time.process_time() - c0)
    rec = {"rank": rank, "variant": variant, "step_ms": 1e3 * statistics.median(steps),
           "fwd_ms": 1e3 * statistics.median(fwd), "cpu_ms": 1e3 * statistics.median(cpu),
           "state_bytes": _state_bytes(opt),
           "hwm_bytes": _vm_hwm(), **_memory(variant, m, opt)}
    if trace is not None:
        rec["trace"] = trace.summary()
    print(json.dumps(rec), flush=True)
    if variant == "torch-ddp":
        torch.distributed.destroy_process_group()
    elif variant.startswith("swarmfd"):
        fd.cleanup()


class _Trace:
    """Where a swarmfd DDP step's time goes (``--trace``): per step, from the start of
    ``backward()``, when each bucket was issued and when its all-reduce completed
    (``Work.completed_at``), when autograd finished (DDP's end-of-backward callback
    starts) and when the step ended; the medians over the timed steps, in ms."""

    def __init__(self, ddp: Any) -> None:
        self.ddp, self.steps = ddp, []
        self.issued: list[tuple[float, Any]] = []
        self.autograd_end = 0.0
        issue, finalize = ddp._issue, ddp._finalize

        def traced_issue(b: Any) -> Any:
            work = issue(b)
            self.issued.append((time.monotonic(), work))
            return work

        def traced_finalize() -> None:
            self.autograd_end = time.monotonic()
            finalize()

        ddp._issue, ddp._finalize = traced_issue, traced_finalize
        self.sizes = [4 * b.padded for b in ddp._buckets]

    def step(self, t_backward: float, t_end: float, keep: bool) -> None:
        """Record the step whose backward started at ``t_backward`` (perf_counter)."""
        issued, self.issued = self.issued, []
        if not keep:
            return
        shift = time.monotonic() - time.perf_counter()  # rebase on Work's clock
        t0 = t_backward + shift
        self.steps.append({
            "issued": [1e3 * (t - t0) for t, _ in issued],
            "done": [1e3 * (w.completed_at - t0) for _, w in issued],
            "autograd_end": 1e3 * (self.autograd_end - t0), "end": 1e3 * (t_end + shift - t0)})

    def summary(self) -> dict[str, Any]:
        def med(get: Any) -> float:
            return round(statistics.median(get(s) for s in self.steps), 2)

        n = len(self.steps[0]["issued"])
        return {"bucket_bytes": self.sizes,
                "issued_ms": [med(lambda s, i=i: s["issued"][i]) for i in range(n)],
                "done_ms": [med(lambda s, i=i: s["done"][i]) for i in range(n)],
                "autograd_end_ms": med(lambda s: s["autograd_end"]),
                "step_end_ms": med(lambda s: s["end"])}


# -- the driver ---------------------------------------------------------------------------


def _records(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        start = line.find("{")
        if start >= 0:
            with contextlib.suppress(ValueError):
                rec = json.loads(line[start:])
                if isinstance(rec, dict) and "step_ms" in rec:
                    out.append(rec)
    return out


def _worker_argv(args: argparse.Namespace, variant: str, optim: str | None = None,
                 steps: int | None = None) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "worker", "--variant", variant,
            "--steps", str(steps or args.steps), "--warmup", str(args.warmup),
            "--bucket-cap-mb", str(args.bucket_cap_mb), "--optim", optim or args.optim,
            "--overlap", args.overlap, "--layers", str(args.layers),
            *(["--trace"] if args.trace and variant == "swarmfd-ddp" else [])]


def _run_loopback(args: argparse.Namespace, n: int, plane: str, variant: str,
                  optim: str | None = None, steps: int | None = None) -> list[dict[str, Any]]:
    env = {**os.environ, **PLANE_ENV[plane], "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("SWARMFD_SECRET_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "swarmfd", "run", "-n", str(n), "--",
                           *_worker_argv(args, variant, optim, steps)], capture_output=True,
                          text=True,
                          env=env, timeout=args.job_timeout, cwd=ROOT)
    recs = _records(proc.stdout)
    if proc.returncode != 0 or len(recs) != n:
        raise RuntimeError(f"{variant} at N={n} ({plane}) failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return recs


def _run_netsim(args: argparse.Namespace, net: Any, variant: str) -> list[dict[str, Any]]:
    # gloo would advertise the address the host name resolves to (127.0.0.1 inside a
    # namespace): it must use the simulated host's interface.
    env = {"SWARMFD_TRANSPORT": "auto", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": os.environ.get("PATH", ""), "GLOO_SOCKET_IFNAME": "eth0"}
    result = net.run_job(_worker_argv(args, variant), placement=[0, 1], env=env,
                         timeout=args.job_timeout)
    result.check()
    recs = [r for rank in range(2) for r in _records(result.stdout(rank))]
    if len(recs) != 2:
        raise RuntimeError(f"{variant} on netsim: {len(recs)} records\n{result.describe()}")
    return recs


def _configs(args: argparse.Namespace) -> list[tuple[str, int]]:
    out = [(plane, n) for n in args.sizes for plane in args.planes]
    if args.netsim:
        out.append(("netsim", 2))
    return out


def _jobs(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(config, N, variant) of one round; plane-independent variants once per N."""
    jobs = []
    for plane, n in _configs(args):
        for v in args.variants:
            if plane != "netsim" and v in ("nocomm", "torch-ddp") and plane != args.planes[0]:
                continue
            jobs.append((plane, n, v))
    return jobs


def _figure(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """A job's figures: its slowest rank's step, the most any rank held."""
    keys = [k for k in recs[0] if k.endswith(("_ms", "_bytes"))]
    return {k: max(r.get(k, 0) for r in recs) for k in keys}


def measure(args: argparse.Namespace) -> tuple[dict[tuple[str, int, str], list[dict[str, Any]]],
                                               list[dict[str, Any]]]:
    jobs = _jobs(args)
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    rows = []
    with contextlib.ExitStack() as stack:
        net = None
        if args.netsim:
            sys.path.insert(0, str(HERE))
            from netsim import SimulatedHosts

            net = stack.enter_context(SimulatedHosts(hosts=2, rate="5gbit"))
        for rnd in range(args.rounds):
            k = rnd % len(jobs)
            for plane, n, v in jobs[k:] + jobs[:k]:
                t0 = time.monotonic()
                recs = (_run_netsim(args, net, v) if plane == "netsim"
                        else _run_loopback(args, n, plane, v))
                fig = _figure(recs)
                results.setdefault((plane, n, v), []).append(fig)
                rows.append({"round": rnd, "config": plane, "n": n, "variant": v, **fig,
                             "load1": os.getloadavg()[0]})
                print(f"round {rnd + 1}/{args.rounds}  {plane:6s} N={n}  {v:13s} "
                      f"{fig['step_ms']:7.1f} ms/step  ({time.monotonic() - t0:.0f} s job, "
                      f"load {os.getloadavg()[0]:.1f})", flush=True)
                for rec in recs:
                    if "trace" in rec:
                        print(f"  trace rank {rec['rank']}: forward {rec['fwd_ms']:.1f} ms, "
                              f"then from backward's start (ms): {json.dumps(rec['trace'])}",
                              flush=True)
    mem = [v for v in MEMORY_VARIANTS if v in args.variants]
    if mem and ("swarmfd-zero" in mem or set(SHARDED) & set(mem)):  # memory, with Adam
        if "swarmfd-ddp" not in mem:
            mem.insert(0, "swarmfd-ddp")  # (the unsharded figures to compare with)
        for n in args.sizes:
            for v in mem:
                fig = _figure(_run_loopback(args, n, "shm", v, "adam", steps=3))
                results[("adam", n, v)] = [fig]
                rows.append({"round": -1, "config": "adam", "n": n, "variant": v, **fig,
                             "load1": os.getloadavg()[0]})
                print(f"memory with Adam  N={n}  {v:13s} state "
                      f"{fig['state_bytes'] / 1e6:.1f} MB, peak RSS "
                      f"{fig['hwm_bytes'] / 1e6:.0f} MB", flush=True)
    return results, rows


def _median(results: dict[tuple[str, int, str], list[dict[str, Any]]], plane: str, n: int,
            v: str, key: str = "step_ms") -> float | None:
    figs = results.get((plane, n, v)) or results.get((_base_plane(results, n), n, v))
    return statistics.median(f[key] for f in figs) if figs else None


def _base_plane(results: dict[tuple[str, int, str], Any], n: int) -> str:
    """The loopback configuration whose jobs hold N's plane-independent variants."""
    for plane, nn, v in results:
        if nn == n and v in ("nocomm", "torch-ddp") and plane != "netsim":
            return plane
    return "shm"


def report(args: argparse.Namespace, results: dict[tuple[str, int, str], list[dict[str, Any]]]
           ) -> tuple[str, list[tuple[str, float | None, float, bool | None]]]:
    """The markdown table, and the verdicts: (what, measured, limit, ok)."""
    grad_bytes = 4 * _param_count(args.layers)
    lines = ["| config | N | " + " | ".join(args.variants) + " | swarmfd-ddp / nocomm | "
             "swarmfd-ddp / torch-ddp |", "|" + " --- |" * (len(args.variants) + 4)]
    verdicts: list[tuple[str, float | None, float, bool | None]] = []
    for plane, n in _configs(args):
        figs = {v: _median(results, plane, n, v) for v in args.variants}
        base, tddp, sddp = figs.get("nocomm"), figs.get("torch-ddp"), figs.get("swarmfd-ddp")
        r_floor = sddp / base if sddp and base else None
        r_torch = sddp / tddp if sddp and tddp else None
        cells = [f"{figs[v]:.1f}" if figs[v] else "-" for v in args.variants]
        lines.append(f"| {plane} | {n} | " + " | ".join(cells) +
                     f" | {_fmt(r_floor)} | {_fmt(r_torch)} |")
        if plane == "shm" and n == 2:
            verdicts.append(("N=2 shm: swarmfd DDP / no communication <= 1.15", r_floor, 1.15,
                             None if r_floor is None else r_floor <= 1.15))
        if plane in ("shm", "tcp"):
            limit = 0.75 if n == 2 else 0.8
            verdicts.append((f"N={n} {plane}: swarmfd DDP / torch DDP <= {limit}", r_torch,
                             limit, None if r_torch is None else r_torch <= limit))
        fsdp = figs.get("swarmfd-fsdp")
        if fsdp and plane == "shm" and n == 2 and sddp:
            verdicts.append(("N=2 shm: swarmfd fully_shard / swarmfd DDP <= 1.3", fsdp / sddp,
                             1.3, fsdp / sddp <= 1.3))
        if fsdp and plane == "shm" and tddp:
            verdicts.append((f"N={n} shm: swarmfd fully_shard / torch DDP <= 1", fsdp / tddp,
                             1.0, fsdp / tddp <= 1.0))
        if plane == "netsim":
            verdicts.append(("netsim 5 Gbit/s: swarmfd DDP / torch DDP <= 0.8", r_torch, 0.8,
                             None if r_torch is None else r_torch <= 0.8))
            link_ms = 1e3 * grad_bytes * 8 * 2 * (n - 1) / n / NETSIM_RATE
            fwd = _median(results, plane, n, "nocomm", "fwd_ms") or 0.0
            bound = 1.15 * max(base or 0.0, link_ms) + fwd
            verdicts.append((f"netsim: swarmfd DDP <= 1.15 x max(no-comm, link {link_ms:.1f} ms)"
                             f" + forward {fwd:.1f} ms = {bound:.1f} ms", sddp, bound,
                             None if sddp is None else sddp <= bound))
    cpu = ["", "CPU time a step (the process's, every thread; the rank that used most), ms:",
           "", "| config | N | " + " | ".join(args.variants) + " |",
           "|" + " --- |" * (len(args.variants) + 2)]
    for plane, n in _configs(args):
        cells = [_fmt(_median(results, plane, n, v, "cpu_ms")) for v in args.variants]
        cpu.append(f"| {plane} | {n} | " + " | ".join(cells) + " |")
    mem, mem_verdicts = _memory_report(args, results)
    return "\n".join(lines + cpu + mem), verdicts + mem_verdicts


def _memory_report(args: argparse.Namespace,
                   results: dict[tuple[str, int, str], list[dict[str, Any]]]
                   ) -> tuple[list[str], list[tuple[str, float | None, float, bool | None]]]:
    """The memory table of the jobs with Adam (MB per rank, the most any rank held)."""
    mem = ["", "Memory with Adam (shared memory), MB per rank:", "",
           "| N | variant | parameters | gradients | Adam state | of unsharded Adam | "
           "gathered (peak) | sum | peak RSS |", "|" + " --- |" * 9]
    verdicts: list[tuple[str, float | None, float, bool | None]] = []
    for n in args.sizes:
        ddp = results.get(("adam", n, "swarmfd-ddp"), [{}])[0]
        full = ddp.get("state_bytes")
        unsharded = sum(ddp.get(k, 0) for k in ("params_bytes", "grads_bytes", "state_bytes"))
        for v in MEMORY_VARIANTS:
            fig = results.get(("adam", n, v), [None])[0]
            if fig is None:
                continue
            frac = fig["state_bytes"] / full if full else None
            total = sum(fig.get(k, 0) for k in ("params_bytes", "grads_bytes", "state_bytes",
                                                "transient_bytes"))
            mem.append(f"| {n} | {v} | {fig.get('params_bytes', 0) / 1e6:.1f} | "
                       f"{fig.get('grads_bytes', 0) / 1e6:.1f} | "
                       f"{fig['state_bytes'] / 1e6:.1f} | {_fmt(frac)} | "
                       f"{fig.get('transient_bytes', 0) / 1e6:.1f} | {total / 1e6:.1f} | "
                       f"{fig['hwm_bytes'] / 1e6:.0f} |")
            if v == "swarmfd-zero" and frac is not None:
                verdicts.append((f"N={n}: ZeRO's Adam state per rank <= 1/N + 5 % of "
                                 "unsharded Adam's", frac, 1 / n + 0.05, frac <= 1 / n + 0.05))
            if v == "swarmfd-fsdp" and unsharded:
                bound = 1.1 * (unsharded / n + 2 * fig["unit_bytes"])
                verdicts.append((
                    f"N={n}: fully_shard's parameters + gradients + Adam state + gathered "
                    f"<= 1.1 x (unsharded {unsharded / 1e6:.1f} MB / N + two units "
                    f"{2 * fig['unit_bytes'] / 1e6:.1f} MB) = {bound / 1e6:.1f} MB (MB)",
                    total / 1e6, bound / 1e6, total <= bound))
    return mem, verdicts


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _param_count(depth: int = LAYERS) -> int:
    return (IN * HIDDEN + HIDDEN) + (depth - 1) * (HIDDEN * HIDDEN + HIDDEN) + HIDDEN * OUT + OUT


def plot(args: argparse.Namespace, results: dict[tuple[str, int, str], list[dict[str, Any]]],
         path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    configs = _configs(args)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(configs), 4))
    width = 0.8 / len(args.variants)
    for i, v in enumerate(args.variants):
        vals = [_median(results, p, n, v) or 0 for p, n in configs]
        ax.bar([c + i * width for c in range(len(configs))], vals, width, label=v)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(configs))],
                  [f"{p} N={n}" for p, n in configs])
    ax.set_ylabel("ms per step (median of rounds)")
    ax.set_title(f"MLP {IN}-{HIDDEN}x{args.layers}-{OUT}, batch {BATCH}/rank, {args.optim}, "
                 "1 thread/rank", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        p = argparse.ArgumentParser(prog="train.py worker")
        p.add_argument("--variant", choices=VARIANTS, required=True)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--warmup", type=int, default=5)
        p.add_argument("--bucket-cap-mb", type=float, default=25.0)
        p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto")
        p.add_argument("--optim", choices=("sgd", "adam"), default="sgd")
        p.add_argument("--trace", action="store_true")
        p.add_argument("--layers", type=int, default=LAYERS)
        worker(p.parse_args(argv[1:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2,4", help="ranks on loopback (default 2,4)")
    p.add_argument("--planes", default="shm,tcp",
                   help="swarmfd planes on loopback: shm, tcp (the socket plane), zmq")
    p.add_argument("--netsim", action="store_true", help="also two simulated hosts, 5 Gbit/s")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: the first four; "
                        "--fsdp adds the sharded two)")
    p.add_argument("--fsdp", action="store_true",
                   help="add swarmfd-fsdp and swarmfd-zero2, on 8 hidden layers unless --layers")
    p.add_argument("--layers", type=int, default=None,
                   help=f"hidden layers (default {LAYERS}; 8 with --fsdp)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="swarmfd DDP's overlap= (auto: where a core is free for it)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="bucket_cap_mb of both DDPs (default torch's 25)")
    p.add_argument("--optim", choices=("sgd", "adam"), default="sgd",
                   help="optimizer of the timed steps (default SGD, momentum 0.9)")
    p.add_argument("--job-timeout", type=float, default=300.0)
    p.add_argument("--trace", action="store_true",
                   help="swarmfd-ddp ranks report when each bucket was issued and completed")
    p.add_argument("--quick", action="store_true", help="1 round, 8 steps, N=2 shm only")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.planes = [s for s in args.planes.split(",") if s]
    args.variants = [v for v in (args.variants or ",".join(DEFAULT_VARIANTS)).split(",") if v]
    if args.fsdp:
        args.variants += [v for v in SHARDED if v not in args.variants]
    args.layers = args.layers or (8 if args.fsdp else LAYERS)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.sizes, args.planes = 1, 8, 2, [2], ["shm"]
    bad = set(args.variants) - set(VARIANTS) or set(args.planes) - set(PLANE_ENV)
    if bad:
        p.error(f"unknown {sorted(bad)}")
    out = args.out or HERE / "out" / time.strftime("train-%Y%m%d-%H%M%S")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min)", flush=True)
    results, rows = measure(args)
    table, verdicts = report(args, results)
    head = [f"# Training step time ({time.strftime('%Y-%m-%d %H:%M')}, {args.rounds} rounds x "
            f"{args.steps} steps, {args.optim}, bucket_cap_mb {args.bucket_cap_mb:g}, "
            f"{args.layers} hidden layers)", ""]
    loads = f"{min(r['load1'] for r in rows):.1f} - {max(r['load1'] for r in rows):.1f}"
    lines = [*head, f"loads (1 min) during the jobs: {loads}", "", "ms per step:", "", table,
             "", "Targets:", ""]
    for what, got, _limit, ok in verdicts:
        mark = "n/a" if ok is None else ("PASS" if ok else "MISS")
        lines.append(f"- {mark}: {what} (measured {_fmt(got)})")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    png = plot(args, results, out.with_suffix(".png"))
    print("\n" + text)
    print(f"wrote {out.with_suffix('.md')}, .csv" + (", .png" if png else
                                                      " (no matplotlib: no .png)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
