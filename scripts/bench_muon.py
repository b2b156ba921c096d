"""``scripts/bench.py --optim muon``: Muon's optimizer step on sharded parameters.

Three contenders, each with its own copy of the same model and gradients, their
optimizer steps interleaved with the order rotated every round (as bench.py
does for training steps): fsdp2.optim.Muon on fsdp2's sharded DTensors,
torch.optim.Muon on the same kind of sharded DTensors (DTensor redistributes
inside every matmul), and torch.optim.Muon on the unsharded model, run by every
rank on its own (one process's work; no communication). Reported: median step
time (slowest rank), collectives per step (torch's CommDebugMode), and the
owners' Newton-Schulz cost per rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

CONTENDERS = ("fsdp2.optim.Muon", "torch.optim.Muon on DTensors", "unsharded, one process")
MUON = {"lr": 0.02}


def _model(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)))


def worker(rank: int, args: argparse.Namespace, store: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=300),
    )
    import fsdp2
    from fsdp2.optim import Muon, assign_owners, newton_schulz_cost
    from fsdp2.optim.owners import owner_loads

    mesh = init_device_mesh("cpu", (args.world_size,))
    models = {}
    for name in CONTENDERS[:2]:
        model = _model(args)
        for layer in model:
            fsdp2.fully_shard(layer, mesh=mesh)
        models[name] = fsdp2.fully_shard(model, mesh=mesh)
    models[CONTENDERS[2]] = _model(args)
    grads = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        for i, p in enumerate(models[CONTENDERS[2]].parameters())
    ]
    for model in models.values():
        for param, grad in zip(model.parameters(), grads, strict=True):
            sharded = isinstance(param, DTensor)
            param.grad = distribute_tensor(grad, mesh, param.placements) if sharded else grad
    optims = {
        CONTENDERS[0]: Muon(models[CONTENDERS[0]].parameters(), **MUON),
        CONTENDERS[1]: torch.optim.Muon(models[CONTENDERS[1]].parameters(), **MUON),
        CONTENDERS[2]: torch.optim.Muon(models[CONTENDERS[2]].parameters(), **MUON),
    }
    for _ in range(args.warmup):
        for optim in optims.values():
            optim.step()
    counts = {}
    for name, optim in optims.items():
        with CommDebugMode() as comm:
            optim.step()
        counts[name] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for step in range(args.steps):
        shift = step % len(CONTENDERS)
        for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
            dist.barrier()
            start = time.perf_counter()
            optims[name].step()
            times[name].append(time.perf_counter() - start)
    slowest = {}
    for name in CONTENDERS:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = statistics.median(t.tolist())
    costs = [newton_schulz_cost(p.shape) for p in models[CONTENDERS[2]].parameters()]
    loads = owner_loads(costs, assign_owners(costs, args.world_size), args.world_size)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "step_s": slowest,
                    "collectives": counts,
                    "owner_loads": loads,
                },
                f,
            )
    gc.collect()  # gloo threads still holding tensors can abort the exit otherwise
    dist.destroy_process_group()


def report(result: dict) -> None:
    a, step = result["args"], result["step_s"]
    print(
        f"Muon optimizer step: {a['layers']} x Linear({a['dim']}, {a['dim']}, bias=False), "
        f"{a['world_size']} gloo ranks, {a['steps']} interleaved steps, median of the slowest rank"
    )
    unsharded = step[CONTENDERS[2]]
    for name in CONTENDERS:
        counts = result["collectives"][name]
        total = sum(counts.values())
        what = ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"
        print(
            f"  {name:30s} {1e3 * step[name]:8.2f} ms  x{step[name] / unsharded:5.2f} unsharded  "
            f"{total:3d} collectives/step ({what})"
        )
    loads = result["owner_loads"]
    print(
        f"  owners' Newton-Schulz cost per rank: {loads} "
        f"(max / mean = {max(loads) / (sum(loads) / len(loads)):.3f})"
    )
    ratio = step[CONTENDERS[1]] / step[CONTENDERS[0]]
    print(f"  fsdp2.optim.Muon is {ratio:.1f}x faster than torch.optim.Muon on DTensors")


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(
            worker,
            args=(args, os.path.join(tmp, "store"), result_path),
            nprocs=args.world_size,
            join=True,
        )
        with open(result_path) as f:
            result = json.load(f)
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
