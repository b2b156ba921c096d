"""Every elementwise torch optimizer's step against plain tensors (issue 49):
each class fsdp2 steps on local tensors (``ELEMENTWISE`` in
fsdp2/optim/local_step.py), foreach, for-loop and (where torch has one on this
device) fused, with SGD also with momentum, nesterov and weight decay; on N
parameter tensors of 8 x 8 in 16 groups, the plain model and fsdp2 at world
size 1, interleaved: 7 rounds (the first dropped), each step on the fresh
gradients of a backward.

    python scripts/bench_optim.py                        # 1,024 tensors
    python scripts/bench_optim.py --params 20480
    python scripts/bench_optim.py --optimizers SGD       # SGD's variants only
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.optim.local_step import ELEMENTWISE

GROUPS = 16
FUSED = ("SGD", "Adam", "AdamW", "Adagrad")  # the classes with a fused CPU kernel
SGD_MOMENTUM = {"momentum": 0.9}
SGD_NESTEROV = {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}


def variants(optimizer: str) -> dict[str, dict[str, Any]]:
    """The rows of one optimizer: its name and implementation, and the
    options it runs with (torch's defaults otherwise)."""
    implementations = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    if optimizer in FUSED:
        implementations["fused"] = {"fused": True}
    if optimizer != "SGD":
        return {f"{optimizer}, {k}": options for k, options in implementations.items()}
    rows = {}
    for extra_name, extra in (("momentum", SGD_MOMENTUM), ("nesterov + wd", SGD_NESTEROV)):
        for k, options in implementations.items():
            rows[f"SGD {extra_name}, {k}"] = {**extra, **options}
    return rows


OPTIMIZERS = sorted(cls.__name__ for cls in ELEMENTWISE)


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


def time_steps(
    models: dict[str, nn.Module], optimizer: str, options: dict[str, Any], rounds: int
) -> dict[str, float]:
    """Median step time (ms) per model, the first round dropped; the models'
    order alternates every round."""
    cls = getattr(torch.optim, optimizer)
    optims = {k: cls(m.parameters(), lr=1e-3, **options) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for round_ in range(rounds):
        for k in list(models) if round_ % 2 == 0 else list(reversed(models)):
            optims[k].zero_grad()
            models[k](torch.zeros(1)).sum().backward()
            gc.collect()
            start = time.perf_counter()
            optims[k].step()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=OPTIMIZERS)
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    models = {"plain": build(args.params, False), "fsdp2": build(args.params, True)}
    print(f"| {args.params:,} tensors | plain (ms) | fsdp2 (ms) | fsdp2 / plain |")
    print("| --- | --- | --- | --- |")
    ratios = {}
    for optimizer in args.optimizers:
        for name, options in variants(optimizer).items():
            ms = time_steps(models, optimizer, options, args.rounds)
            ratios[name] = ms["fsdp2"] / ms["plain"]
            print(
                f"| {name} | {ms['plain']:.1f} | {ms['fsdp2']:.1f} | {ratios[name]:.2f} |",
                flush=True,
            )
    worst = max(ratios, key=ratios.__getitem__)
    print(f"\nhighest fsdp2 / plain: {ratios[worst]:.2f} ({worst})", flush=True)
    gc.collect()
    dist.destroy_process_group()
    return ratios


if __name__ == "__main__":
    main()
