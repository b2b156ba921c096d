"""What the same-model check costs (fsdp2/checks/same_model.py), with and without it,
interleaved: ``fully_shard`` (its fingerprints), the first forward (lazy init,
with the all-reduce) and later steps (the check's collectives counted).

2 gloo ranks (FSDP) or, with ``--hsdp``, 4 (2 x 2, shard_optimizer_over_replicas).
A stack of MLP blocks, one group each. Reported on rank 0, medians.

    python scripts/bench_same_model.py --dim 1024 --layers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
import fsdp2.checks.mistakes
import fsdp2.checks.same_model


def build(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
    )


def _run(with_check: bool, args: argparse.Namespace, mesh, x: torch.Tensor) -> dict[str, float]:
    shard_module = sys.modules["fsdp2.fully_shard"]  # the module, not the function
    remember, check = shard_module.remember, fsdp2.checks.mistakes.check_same_model
    checked = [0.0]
    reduces = [0]

    def timed_check(groups) -> None:
        start = time.perf_counter()
        check(groups)
        checked[0] += time.perf_counter() - start

    def counted(rows, collectives) -> None:
        reduces[0] += 1
        max_over(rows, collectives)

    max_over = fsdp2.checks.same_model._max_over
    shard_module.remember = remember if with_check else (lambda *_: None)
    fsdp2.checks.mistakes.check_same_model = timed_check if with_check else (lambda *_: None)
    fsdp2.checks.same_model._max_over = counted
    kwargs = {"mesh": mesh, "shard_optimizer_over_replicas": args.hsdp}
    try:
        model = build(args.dim, args.layers)
        dist.barrier()
        start = time.perf_counter()
        for block in model:
            fsdp2.fully_shard(block, **kwargs)
        fsdp2.fully_shard(model, **kwargs)
        sharded = time.perf_counter() - start
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dist.barrier()
        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            times.append(time.perf_counter() - start)
            if step == 0:
                at_lazy_init = reduces[0]
        return {
            "fully_shard": sharded,
            "check": checked[0],
            "first step": times[0],
            "later steps": statistics.median(times[1:]),
            "all-reduces at lazy init": at_lazy_init,
            "all-reduces later": reduces[0] - at_lazy_init,
        }
    finally:
        shard_module.remember = remember
        fsdp2.checks.mistakes.check_same_model = check
        fsdp2.checks.same_model._max_over = max_over


def _worker(rank: int, world: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    shape, names = ((2, 2), ("replicate", "shard")) if args.hsdp else ((world,), ("shard",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    x = torch.randn(8, args.dim)
    runs: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(_run(name == "with", args, mesh, x))
    if rank == 0:
        Path(out).write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hsdp", action="store_true")
    args = parser.parse_args()
    world = 4 if args.hsdp else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), out, args), nprocs=world)
        runs = json.loads(Path(out).read_text())
    numel = sum(p.numel() for p in build(args.dim, args.layers).parameters())
    setup = "HSDP 2 x 2, over replicas" if args.hsdp else f"FSDP, {world} ranks"
    print(f"{args.layers} MLP blocks of dim {args.dim}: {numel:,} parameters; {setup}; rank 0")
    keys = list(runs["with"][0])
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, results in runs.items():
        cells = []
        for key in keys:
            value = statistics.median(r[key] for r in results)
            cells.append(f"{value:.0f}" if "all-reduces" in key else f"{value * 1e3:.1f} ms")
        print(f"| {name} check | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
