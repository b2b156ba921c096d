"""Benchmark: fsdp2 against torch's fully_shard, DDP and the no-communication floor.

Every rank holds the four contenders (same model, same initial weights, same
data) and runs their training steps interleaved, rotating the order every
round, so drift of this shared machine hits all of them alike. Reported per
contender: median step time (slowest rank) and its ratios to torch's
fully_shard and to the floor, peak tensor memory of one step (a dispatch-mode
tracker, which works on CPU), and bytes all-gathered / reduce-scattered per
step against the theoretical volume.

    python scripts/bench.py                    # defaults: 2 gloo ranks, ~1 minute
    python scripts/bench.py --json out.json --dim 512 --layers 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

CONTENDERS = ("fsdp2", "torch", "ddp", "floor")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per-rank batch size")
    p.add_argument("--steps", type=int, default=12, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--reshard-after-forward",
        choices=("default", "true", "false"),
        default="default",
        help="policy for both FSDP contenders (default: True except the root)",
    )
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    return args


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    model_args = ModelArgs(
        n_layers=args.layers,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        dim=args.dim,
        n_heads=args.heads,
        dropout_p=0.0,
        weight_tying=False,
    )
    return Transformer(model_args)


def shard(model: nn.Module, fully_shard, mesh, reshard_after_forward: str) -> nn.Module:
    kwargs = {}
    if reshard_after_forward != "default":
        kwargs["reshard_after_forward"] = reshard_after_forward == "true"
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


class CommCounter:
    """Counts bytes passed to the all-gather and reduce-scatter that both FSDPs call."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.active = False
        self._orig = {}
        for name in ("all_gather_single", "reduce_scatter_single"):
            self._orig[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name))

    def _wrap(self, name: str):
        orig = self._orig[name]

        def counted(output, input, *a, **kw):
            if self.active:
                big = output if name == "all_gather_single" else input
                self.bytes[name] += big.numel() * big.element_size()
            return orig(output, input, *a, **kw)

        return counted


def theoretical_bytes(model: nn.Module, reshard_after_forward: str) -> dict[str, int]:
    """Unpadded volume of one step: every parameter all-gathered in forward, the
    blocks' again in backward when they reshard (the root never does by default),
    every gradient reduce-scattered."""
    root = block = 0
    for fqn, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if fqn.startswith("layers."):
            block += nbytes
        else:
            root += nbytes
    regathered = {"default": block, "true": block + root, "false": 0}[reshard_after_forward]
    return {"all_gather_single": root + block + regathered, "reduce_scatter_single": root + block}


def implied_peak_bytes(model: nn.Module, floor_peak: int, world_size: int) -> int:
    """The least memory an FSDP step can peak at, from the sizes: sharded
    parameters, gradients and AdamW's two states; the root's unsharded
    parameters and gradients (kept from forward to backward) plus two blocks'
    (the one computing and the one prefetched) and one block's gradients; and
    the activations, taken as the floor contender's peak minus its four
    full-size copies of the parameters."""
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    root = total - block * len(model.layers)
    activations = floor_peak - 4 * total
    return 4 * total // world_size + 2 * root + 2 * block + block + activations


def worker(rank: int, args: argparse.Namespace, store: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=300),
    )
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp2

    mesh = init_device_mesh("cpu", (args.world_size,))
    counter = CommCounter()
    models = {
        "fsdp2": shard(build_model(args), fsdp2.fully_shard, mesh, args.reshard_after_forward),
        "torch": shard(build_model(args), torch_fully_shard, mesh, args.reshard_after_forward),
        "ddp": nn.parallel.DistributedDataParallel(build_model(args)),
        "floor": build_model(args),
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    loss_fn = nn.CrossEntropyLoss()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step(name: str, step: int) -> float:
        x, y = batch(step)
        out = models[name](x)
        loss = loss_fn(out.reshape(-1, out.size(-1)), y.reshape(-1))
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)
        return loss.item()

    # Warm-up, then one step per contender counted for bytes.
    for step in range(args.warmup):
        for name in CONTENDERS:
            train_step(name, step)
    comm_bytes = {}
    for name in ("fsdp2", "torch"):
        counter.bytes.clear()
        counter.active = True
        train_step(name, 0)
        counter.active = False
        comm_bytes[name] = dict(counter.bytes)

    times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    losses: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    for step in range(args.steps):
        shift = step % len(CONTENDERS)
        for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(train_step(name, args.warmup + step))
            times[name].append(time.perf_counter() - start)

    # Slowest rank per step.
    slowest = {}
    for name in CONTENDERS:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()

    peak = {name: peak_memory(train_step, name, models[name], optims[name]) for name in CONTENDERS}

    expected = theoretical_bytes(models["floor"], args.reshard_after_forward)
    implied = implied_peak_bytes(models["floor"], peak["floor"], args.world_size)
    if rank == 0:
        result = {
            "args": vars(args),
            "step_time_s": {k: statistics.median(v) for k, v in slowest.items()},
            "peak_memory_bytes": peak,
            "implied_peak_bytes": implied,
            "comm_bytes": comm_bytes,
            "theoretical_comm_bytes": expected,
            "final_loss": {k: v[-1] for k, v in losses.items()},
        }
        with open(result_path, "w") as f:
            json.dump(result, f)
    gc.collect()
    dist.destroy_process_group()


def peak_memory(train_step, name: str, model: nn.Module, optim) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        train_step(name, 0)
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(sum(per_device["Total"] for per_device in snapshot.values()))


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    times, peak = result["step_time_s"], result["peak_memory_bytes"]
    comm, expected = result["comm_bytes"], result["theoretical_comm_bytes"]
    a = result["args"]
    table = Table(
        title=f"{a['world_size']} gloo ranks, transformer dim {a['dim']} x {a['layers']} layers, "
        f"batch {a['batch']}x{a['seq']} per rank, {a['steps']} interleaved steps"
    )
    for col in (
        "contender",
        "step (ms)",
        "/ torch",
        "/ floor",
        "peak MiB",
        "/ torch",
        "AG MiB",
        "RS MiB",
    ):
        table.add_column(col, justify="right")
    for name in CONTENDERS:
        row_comm = comm.get(name, {})
        table.add_row(
            name,
            f"{1e3 * times[name]:.1f}",
            f"{times[name] / times['torch']:.3f}",
            f"{times[name] / times['floor']:.3f}",
            f"{peak[name] / 2**20:.1f}",
            f"{peak[name] / peak['torch']:.3f}",
            f"{row_comm.get('all_gather_single', 0) / 2**20:.2f}" if row_comm else "-",
            f"{row_comm.get('reduce_scatter_single', 0) / 2**20:.2f}" if row_comm else "-",
        )
    console = Console(width=120)
    console.print(table)
    implied = result["implied_peak_bytes"]
    console.print(
        f"peak memory implied by the sizes: {implied / 2**20:.1f} MiB; fsdp2 / implied = "
        f"{peak['fsdp2'] / implied:.3f}, torch / implied = {peak['torch'] / implied:.3f}"
    )
    console.print(
        f"theoretical per step (unpadded): all-gather "
        f"{expected['all_gather_single'] / 2**20:.2f} MiB, reduce-scatter "
        f"{expected['reduce_scatter_single'] / 2**20:.2f} MiB"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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


if __name__ == "__main__":
    main(sys.argv[1:])
