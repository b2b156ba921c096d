"""CPU overhead of the FSDP hooks: world size 1, a tiny model, many groups.

With 1 rank and 8x8 layers, communication and compute are negligible, so the
time a step takes above the plain model's is what the hooks, state machines
and (trivial) collectives cost on the host. Reported per group per step, for
fsdp2 and torch's fully_shard, interleaved.

    python scripts/bench_overhead.py --groups 64 --steps 200
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh


def build(groups: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(groups)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        import fsdp2

        mesh = init_device_mesh("cpu", (1,))
        models = {"floor": build(args.groups)}
        for name, shard in (("fsdp2", fsdp2.fully_shard), ("torch", torch_fully_shard)):
            model = build(args.groups)
            for layer in model:
                shard(layer, mesh=mesh)
            models[name] = shard(model, mesh=mesh)
        x = torch.randn(2, 8)

        def step(model: nn.Module) -> None:
            model(x).sum().backward()
            for param in model.parameters():
                param.grad = None

        times: dict[str, list[float]] = {name: [] for name in models}
        for i in range(args.steps + 10):
            for name, model in models.items():
                start = time.perf_counter()
                step(model)
                if i >= 10:  # warm-up
                    times[name].append(time.perf_counter() - start)
        floor = statistics.median(times["floor"])
        print(f"{args.groups} groups of Linear(8, 8), world size 1, {args.steps} steps (median)")
        for name in ("fsdp2", "torch"):
            step_time = statistics.median(times[name])
            per_group = (step_time - floor) / args.groups * 1e6
            print(
                f"  {name:6s} step {step_time * 1e3:7.2f} ms   overhead {per_group:6.1f} us/group/step"
            )
        print(f"  floor  step {floor * 1e3:7.2f} ms")
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
