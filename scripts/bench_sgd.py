"""SGD's optimizer step against plain tensors (issue 49): momentum, nesterov
and weight decay, foreach and for-loop, on N parameter tensors of 8 x 8 in 16
groups, the plain model and fsdp2 at world size 1, interleaved: 7 rounds (the
first dropped), each step on the fresh gradients of a backward.

    python scripts/bench_sgd.py            # 1,024 tensors
    python scripts/bench_sgd.py --params 20480
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2

VARIANTS = {
    "momentum, foreach": {"momentum": 0.9, "foreach": True},
    "nesterov + weight decay, foreach": {
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 0.01,
        "foreach": True,
    },
    "momentum, for-loop": {"momentum": 0.9, "foreach": False},
    "nesterov + weight decay, for-loop": {
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 0.01,
        "foreach": False,
    },
}
GROUPS = 16


class Tensors(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.tensors = nn.ParameterList(nn.Parameter(torch.randn(8, 8)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.stack([p.sum() for p in self.tensors]).sum()


def build(params: int, shard: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(Tensors(params // GROUPS) for _ in range(GROUPS)))
    if shard:
        for group in model:
            fsdp2.fully_shard(group)
        fsdp2.fully_shard(model)
    return model


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    models = {"plain": build(args.params, False), "fsdp2": build(args.params, True)}
    print(f"| {args.params:,} tensors | plain (ms) | fsdp2 (ms) | fsdp2 / plain |")
    print("| --- | --- | --- | --- |")
    for name, options in VARIANTS.items():
        optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3, **options) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        for round_ in range(args.rounds):
            for k in list(models) if round_ % 2 == 0 else list(reversed(models)):
                optims[k].zero_grad()
                models[k](torch.zeros(1)).sum().backward()
                gc.collect()
                start = time.perf_counter()
                optims[k].step()
                times[k].append(time.perf_counter() - start)
        plain, ours = (statistics.median(times[k][1:]) * 1e3 for k in ("plain", "fsdp2"))
        print(f"| {name} | {plain:.1f} | {ours:.1f} | {ours / plain:.2f} |", flush=True)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
