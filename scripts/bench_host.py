"""Host time of a training step with many parameter tensors: the optimizer
step, gradient clipping, forward and backward, and the whole step, for the
plain model, fsdp2 and torch's fully_shard, interleaved in one run.

The model has 16 groups (``fully_shard`` on each, then the root), each of
P / 16 parameter tensors of 8 x 8 kept as separate parameters (an MoE
block's experts), all used in every forward, so that every tensor has a
gradient and the per-tensor host work dominates. The plain model runs the
same local sizes: at world size W each of its tensors has the rows one rank
of the sharded models holds (8 / W x 8).

    python scripts/bench_host.py                          # 1k, 5k, 20k tensors; 1 and 2 ranks
    python scripts/bench_host.py --params 1000 --world-sizes 1 --rounds 5
    python scripts/bench_host.py --device cuda --world-sizes 1  # one GPU, NCCL
    python scripts/bench_host.py --params 20000 --world-sizes 1 --torch-up-to 20000 \
        --measures "whole step" --step-optimizer "AdamW for-loop"  # torch's step at 20k

On a GPU each measure ends with ``torch.cuda.synchronize()``, so a time is
the host's or the device's, whichever is longer: with tensors this small the
host's.

Torch's code on DTensors runs up to ``--torch-up-to`` tensors (1000 by
default): torch's fully_shard, and ``clip_grad_norm_`` on fsdp2's gradients.
Its first optimizer step and its first clip on DTensors propagate shardings
uncached, and that grows faster than the tensor count (on this 2-core
machine the first AdamW foreach step took 30 s at 1k tensors and 124 s at
2k; torch's first clip over fsdp2's gradients 4.4 s at 1k and 76 s at 5k),
so a 5k run of it would take most of an hour before its first timed round.
Its fused first step is no better (at 20k still in sharding propagation
after 72 min). What torch's fully_shard can run at 20k is the for-loop
AdamW (``foreach=False``: one op per tensor, each propagation cached after
its first shape): ``--step-optimizer "AdamW for-loop"`` times the whole step
with it and with ``clip_grad_norm_(..., foreach=False)``, for every model
alike (torch's clip on DTensors otherwise takes the foreach path, whose first
call at 20k is as slow).

Each round times every measure once for each model, the models' order
rotated every round (the optimizer steps and clips on the gradients of the
round's backward); the table gives the median over the rounds (the slowest
rank's, at world size 2) and the ratios to plain:

- forward+backward;
- one optimizer step each of ``AdamW(foreach=True)``, ``AdamW(fused=True)``
  and ``SGD(foreach=True, momentum=0.9)``, on the gradients of that backward;
- ``torch.nn.utils.clip_grad_norm_``, and for fsdp2 also the same function as
  ``fsdp2.install_as_torch_fsdp()`` routes it ("installed") and
  ``fsdp2.clip_grad_norm_``;
- the whole step: forward, backward, a clip (``fsdp2.clip_grad_norm_`` for
  fsdp2, torch's for the others), the AdamW step (``--step-optimizer``,
  foreach by default), ``zero_grad()``.

Under each table, the hooks' cost: forward+backward above the plain model's,
per group per step (microseconds), fsdp2's and torch's, and their ratio; then
the same of the training thread's CPU time (``time.thread_time``), which
leaves out its waits: at world size 2 on a CPU, the collectives' latency
and the other rank's pace.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdp2  # noqa: E402
from fsdp2.api.torch_names import TorchFSDPNames  # noqa: E402
from fsdp2.optim.torch_clipping import route_torch_clipping  # noqa: E402

GROUPS = 16
DIM = 8
BATCH = 4
MODELS = ("plain", "fsdp2", "torch")
MEASURES = (
    "forward+backward",
    "AdamW foreach",
    "AdamW fused",
    "SGD foreach",
    "clip (torch's)",
    "clip (torch's, installed)",
    "clip (fsdp2's)",
    "whole step",
)


# forward+backward's CPU time of the training thread (its key in the results).
TRAINING_THREAD_CPU = "forward+backward, training thread's CPU"


class Experts(nn.Module):
    """``count`` separate (rows, DIM) weights, summed into one matrix per forward."""

    def __init__(self, count: int, rows: int) -> None:
        super().__init__()
        self.experts = nn.ParameterList(
            nn.Parameter(torch.randn(rows, DIM) * 0.1) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack(list(self.experts)).sum(0)
        return x + torch.tanh(x[:, : weight.size(0)] @ weight).sum(1, keepdim=True)


def build(params: int, rows: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Experts(params // GROUPS, rows) for _ in range(GROUPS)))


def _models(
    params: int, world_size: int, with_torch: bool, device: torch.device
) -> dict[str, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only

    mesh = init_device_mesh(device.type, (world_size,))
    models: dict[str, nn.Module] = {"plain": build(params, DIM // world_size).to(device)}
    for name, shard in (("fsdp2", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        if name == "torch" and not with_torch:
            continue
        model = build(params, DIM).to(device)
        for group in model:
            shard(group, mesh=mesh)
        models[name] = shard(model, mesh=mesh)
    return models


def _installed_clip(params: list[nn.Parameter]) -> object:
    """``torch.nn.utils.clip_grad_norm_`` as ``fsdp2.install_as_torch_fsdp()``
    routes it, for this call only (the plain model's clip stays torch's own)."""
    routed = TorchFSDPNames(route_torch_clipping())
    try:
        return torch.nn.utils.clip_grad_norm_(params, 1.0)
    finally:
        routed.undo()


def _optimizers(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    params = list(model.parameters())
    return {
        "AdamW foreach": torch.optim.AdamW(params, lr=1e-3, foreach=True),
        "AdamW fused": torch.optim.AdamW(params, lr=1e-3, fused=True),
        "SGD foreach": torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
        # the whole step's only (--step-optimizer), no row of its own
        "AdamW for-loop": torch.optim.AdamW(params, lr=1e-3, foreach=False),
    }


def _run(
    rank: int,
    world_size: int,
    store: str,
    params: int,
    rounds: int,
    with_torch: bool,
    device_type: str,
    measured: tuple[str, ...],
    step_optimizer: str,
    out: str,
) -> None:
    torch.set_num_threads(1)
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    models = _models(params, world_size, with_torch, device)
    names = [name for name in MODELS if name in models]
    optims = {name: _optimizers(model) for name, model in models.items()}
    x = torch.randn(BATCH, DIM, device=device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def backward(model: nn.Module) -> None:
        model(x).square().mean().backward()

    def measures(name: str) -> dict[str, Callable[[], object]]:
        model, opt = models[name], optims[name]
        params = list(model.parameters())
        torch_clip = name != "fsdp2" or with_torch  # torch's code on fsdp2's DTensors
        # With the for-loop optimizer the clip is a for-loop too (torch's on DTensors
        # takes the foreach path by default, whose first call at 20k takes hours).
        foreach = False if step_optimizer == "AdamW for-loop" else None

        def clip() -> object:  # each model's own: fsdp2's for fsdp2
            if name == "fsdp2":
                return fsdp2.clip_grad_norm_(params, 1.0, foreach=foreach)
            return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)

        def whole() -> None:
            backward(model)
            clip()
            opt[step_optimizer].step()
            opt[step_optimizer].zero_grad()

        found: dict[str, Callable[[], object]] = {
            "forward+backward": lambda: backward(model),
            **{key: o.step for key, o in opt.items()},
            "whole step": whole,
        }
        if torch_clip:
            found["clip (torch's)"] = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)
        if name == "fsdp2":
            found["clip (fsdp2's)"] = lambda: fsdp2.clip_grad_norm_(params, 1.0)
            found["clip (torch's, installed)"] = lambda: _installed_clip(params)
        return found

    times: dict[tuple[str, str], list[float]] = {}

    def timed(measure: str, name: str, fn: Callable[[], object], keep: bool) -> None:
        if measure not in measured and measure != "forward+backward":  # the gradients
            return
        keep = keep and measure in measured
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        synchronize()
        elapsed = time.perf_counter() - start
        if keep:
            times.setdefault((measure, name), []).append(elapsed)
            if measure == "forward+backward":  # the training thread's own work, waits left out
                cpu = time.thread_time() - start_cpu
                times.setdefault((TRAINING_THREAD_CPU, name), []).append(cpu)

    for i in range(rounds + 1):  # the first round warms up (optimizer states, lazy init)
        order = names[i % len(names) :] + names[: i % len(names)]
        steps = {name: measures(name) for name in names}
        for name in order:
            timed("forward+backward", name, steps[name]["forward+backward"], i > 0)
        # On those gradients: each optimizer step and clip (their values do not
        # change how long a step takes).
        for measure in MEASURES[1:-1]:
            for name in order:
                if (fn := steps[name].get(measure)) is not None:
                    timed(measure, name, fn, i > 0)
        for name in order:
            models[name].zero_grad()
            timed("whole step", name, steps[name]["whole step"], i > 0)
    medians = torch.tensor(
        [statistics.median(t) for t in times.values()], dtype=torch.float64, device=device
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
    if rank == 0:
        lines = [f"{m}\t{n}\t{v}" for (m, n), v in zip(times, medians.tolist(), strict=True)]
        Path(out).write_text("\n".join(lines))
    gc.collect()
    dist.destroy_process_group()


def _table(
    results: dict[tuple[str, str], float],
    params: int,
    world_size: int,
    device: str,
    step_optimizer: str = "AdamW foreach",
) -> str:
    head = (
        f"{params:,} parameter tensors in {GROUPS} groups, world size {world_size}, {device}"
        f" (ms, median; the whole step with {step_optimizer})"
    )
    rows = [
        head,
        f"| measure | {' | '.join(MODELS)} | fsdp2 / plain | torch / plain | fsdp2 / torch |",
    ]
    rows.append("|---" * 7 + "|")
    for measure in [m for m in MEASURES if any(key[0] == m for key in results)]:
        values = {n: results.get((measure, n)) for n in MODELS}
        cells = [f"{v * 1e3:.1f}" if v is not None else "" for v in values.values()]
        plain, mine, theirs = values["plain"], values["fsdp2"], values["torch"]

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}" if a is not None and b else ""

        if measure in ("clip (fsdp2's)", "clip (torch's, installed)"):
            # against plain tensors and torch's clip on torch's
            plain, theirs = (
                results.get(("clip (torch's)", "plain")),
                results.get(("clip (torch's)", "torch")),
            )
        rows.append(
            f"| {measure} | {' | '.join(cells)} | {ratio(mine, plain)} | "
            f"{ratio(values['torch'], plain)} | {ratio(mine, theirs)} |"
        )
    rows += _hooks_line(results)
    return "\n".join(rows)


def _hooks_line(results: dict[tuple[str, str], float]) -> list[str]:
    """The hooks' cost as issue 33 states its target: forward+backward above
    the plain model's, per group per step, fsdp2's against torch's; then the
    same of the training thread's CPU time, which leaves out the time it
    waits (at world size 2, for the other rank and gloo's threads)."""
    lines = []
    for measure, head in (
        ("forward+backward", "hooks (forward+backward above plain) per group per step"),
        (TRAINING_THREAD_CPU, "the training thread's CPU time of it"),
    ):
        plain = results.get((measure, "plain"))
        above = {
            name: (value - plain) / GROUPS * 1e6
            for name in ("fsdp2", "torch")
            if plain is not None and (value := results.get((measure, name))) is not None
        }
        if "fsdp2" not in above:
            continue
        line = f"{head}: fsdp2 {above['fsdp2']:.0f} us"
        if "torch" in above:
            ratio = above["fsdp2"] / above["torch"]
            line += f", torch {above['torch']:.0f} us, fsdp2 / torch {ratio:.2f}"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=int, nargs="+", default=[1000, 5000, 20000])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--torch-up-to", type=int, default=1000, help="the most tensors torch runs")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--measures",
        nargs="+",
        choices=MEASURES,
        default=list(MEASURES),
        metavar="MEASURE",
        help='the measures to run (default: all); e.g. "whole step" alone skips torch\'s\n'
        "first AdamW foreach step, which above a few thousand tensors takes hours",
    )
    p.add_argument(
        "--step-optimizer",
        default="AdamW foreach",
        choices=("AdamW foreach", "AdamW fused", "AdamW for-loop"),
        help="the whole step's optimizer (default: AdamW foreach)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and max(args.world_sizes) > torch.cuda.device_count():
        p.error(f"--device cuda needs a GPU per rank; this machine has {torch.cuda.device_count()}")
    for world_size in args.world_sizes:
        for params in args.params:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "out.tsv")
                mp.spawn(
                    _run,
                    args=(
                        world_size,
                        os.path.join(tmp, "store"),
                        params,
                        args.rounds,
                        params <= args.torch_up_to,
                        args.device,
                        tuple(args.measures),
                        args.step_optimizer,
                        out,
                    ),
                    nprocs=world_size,
                )
                results = {}
                for line in Path(out).read_text().splitlines():
                    measure, name, value = line.split("\t")
                    results[(measure, name)] = float(value)
            table = _table(results, params, world_size, args.device, args.step_optimizer)
            print(table, flush=True)
            print()


if __name__ == "__main__":
    main()
