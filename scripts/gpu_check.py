"""One command for a GPU (``make gpu-check``): the accelerator path, measured.

On a CUDA machine it prints one table, in a few minutes:

- parity on a small Llama (scripts/llama.py), fp32 and bf16 (``param_dtype``
  bf16, ``reduce_dtype`` fp32): fsdp2 against torch's ``fully_shard`` and
  against the unsharded model, after a few SGD steps, with real NCCL on every
  visible GPU (world size 1 on one GPU);
- torch's fake process group at world size 8 (no data moves): both run, and
  fsdp2's local shards have torch's shapes;
- a ``torch.profiler`` trace (written to ``runs/gpu_check_trace.json``) and
  the fraction of all-gather / reduce-scatter kernel time that overlaps
  compute kernels (needs 2 GPUs or more: a world of one exchanges nothing);
- peak memory and step time against torch's ``fully_shard``;
- CPU offload (``CPUOffloadPolicy``) step time against torch's.

Without CUDA it prints one line saying why and exits 0. The stream protocol
itself is checked without a GPU by tests/test_streams.py.
"""

from __future__ import annotations

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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama import Llama, LlamaConfig  # noqa: E402

import fsdp2  # noqa: E402

CONFIG = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
BATCH, SEQ = 8, 128
PARITY_STEPS, TIMED_STEPS, WARMUP = 3, 10, 3
TRACE = Path("runs") / "gpu_check_trace.json"


def build(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return Llama(CONFIG).to(device)


def shard(model: nn.Module, fully_shard, **kwargs) -> nn.Module:
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def torch_fully_shard():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def torch_policies(bf16: bool, offload: bool) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict = {}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def fsdp2_policies(bf16: bool, offload: bool) -> dict:
    kwargs: dict = {}
    if bf16:
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if offload:
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy()
    return kwargs


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(CONFIG.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (full(p).detach().float() - full(q).detach().float()).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def parity(rank: int, world_size: int, device: torch.device, bf16: bool) -> dict:
    """fsdp2 and torch's fully_shard from equal parameters, and the unsharded
    reference (on every rank's batch, as DDP), after PARITY_STEPS SGD steps."""
    models = {
        "fsdp2": shard(build(device), fsdp2.fully_shard, **fsdp2_policies(bf16, False)),
        "torch": shard(build(device), torch_fully_shard(), **torch_policies(bf16, False)),
        "reference": build(device),
    }
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    losses: dict[str, list[float]] = {k: [] for k in models}
    for step in range(PARITY_STEPS):
        inputs, targets = batch(step, rank, device)
        for name in ("fsdp2", "torch"):
            loss = train_step(models[name], optims[name], inputs, targets)
            dist.all_reduce(loss)
            losses[name].append(loss.item() / world_size)
        everyone = [batch(step, r, device) for r in range(world_size)]
        ref_inputs = torch.cat([i for i, _ in everyone])
        ref_targets = torch.cat([t for _, t in everyone])
        ref = models["reference"]
        if bf16:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = train_step(ref, optims["reference"], ref_inputs, ref_targets)
        else:
            loss = train_step(ref, optims["reference"], ref_inputs, ref_targets)
        losses["reference"].append(loss.item())
    return {
        "loss diff vs torch": max(
            abs(a - b) for a, b in zip(losses["fsdp2"], losses["torch"], strict=True)
        ),
        "param diff vs torch": max_param_diff(models["fsdp2"], models["torch"]),
        "loss diff vs unsharded": max(
            abs(a - b) for a, b in zip(losses["fsdp2"], losses["reference"], strict=True)
        ),
        "param diff vs unsharded": max_param_diff(models["fsdp2"], models["reference"]),
    }


def timed(rank: int, device: torch.device, fully_shard, policies: dict) -> tuple[float, int]:
    """Median step seconds and peak bytes allocated over TIMED_STEPS steps."""
    model = shard(build(device), fully_shard, **policies)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(WARMUP):
        train_step(model, optim, *batch(step, rank, device))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(TIMED_STEPS):
        start = time.perf_counter()
        train_step(model, optim, *batch(step, rank, device))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def overlap_fraction(trace: Path) -> float:
    """Of the NCCL kernels' time, the fraction during which a compute kernel ran."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()
    )
    merged: list[list[float]] = []
    for start, end in compute:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in comm)
    covered = sum(
        max(0.0, min(end, c_end) - max(start, c_start))
        for start, end in comm
        for c_start, c_end in merged
    )
    return covered / total if total else float("nan")


def profile(rank: int, device: torch.device) -> float:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = shard(build(device), fsdp2.fully_shard)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(WARMUP):
        train_step(model, optim, *batch(step, rank, device))
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(3):
            train_step(model, optim, *batch(step, rank, device))
        torch.cuda.synchronize()
    if rank == 0:
        TRACE.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(TRACE))
        return overlap_fraction(TRACE)
    return float("nan")


def worker(rank: int, world_size: int, store_path: str, result_path: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)
    rows: list[tuple[str, str]] = []
    try:
        for bf16 in (False, True):
            result = parity(rank, world_size, device, bf16)
            dtype = "bf16" if bf16 else "fp32"
            for key, value in result.items():
                rows.append((f"{dtype} NCCL x{world_size}: {key}", f"{value:.3g}"))
        for offload in (False, True):
            what = "CPU offload" if offload else "default"
            mine = timed(rank, device, fsdp2.fully_shard, fsdp2_policies(False, offload))
            theirs = timed(rank, device, torch_fully_shard(), torch_policies(False, offload))
            rows.append(
                (
                    f"{what}: step ms, fsdp2 / torch",
                    f"{mine[0] * 1e3:.1f} / {theirs[0] * 1e3:.1f}",
                )
            )
            if not offload:
                rows.append(
                    (
                        f"{what}: peak MiB, fsdp2 / torch",
                        f"{mine[1] / 2**20:.1f} / {theirs[1] / 2**20:.1f}",
                    )
                )
        if world_size >= 2:
            fraction = profile(rank, device)
            rows.append((f"comm kernel time overlapping compute ({TRACE})", f"{fraction:.2f}"))
        else:
            rows.append(("comm kernel time overlapping compute", "n/a: one GPU, no collective"))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))


def fake_world_of_8() -> list[tuple[str, str]]:
    """torch's fake process group at world size 8 on this GPU: no data moves, so
    only that both run and shard alike is checked."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        device = torch.device("cuda", 0)
        mine = shard(build(device), fsdp2.fully_shard)
        theirs = shard(build(device), torch_fully_shard())
        for model in (mine, theirs):
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            train_step(model, optim, *batch(0, 0, device))
        same = all(
            p.to_local().shape == q.to_local().shape
            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True)
        )
    finally:
        dist.destroy_process_group()
    return [("fake PG x8: a step runs, local shards shaped as torch's", "yes" if same else "NO")]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False).")
        return 0
    world_size = min(torch.cuda.device_count(), 8)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        store = os.path.join(tmp, "store")
        mp.spawn(worker, args=(world_size, store, result), nprocs=world_size, join=True)
        rows = [tuple(r) for r in json.loads(Path(result).read_text())]
    rows += fake_world_of_8()
    width = max(len(name) for name, _ in rows)
    print(
        f"gpu-check on {torch.cuda.get_device_name(0)}, {world_size} GPU(s), torch {torch.__version__}"
    )
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
