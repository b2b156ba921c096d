"""Per-rank memory and bytes per step of 1D FSDP, HSDP and HSDP with
``shard_optimizer_over_replicas`` (also with compression: int8 weights and
bf16 gradients everywhere, or across the replicas only) on the same 4 CPU
gloo ranks (2 x 2 for HSDP), training scripts/llama.py's model with AdamW,
bf16 compute and fp32 reduction (the setting the option is for).

Per rank 0: tensor bytes of the sharded parameters, their gradients, AdamW's
states and (with the option) the shard group's chunks kept (bf16 values, or
int8 codes), read off the tensors after a step; MemTracker's peak over a
step; and comm_stats' bytes per step inside the shard group and across the
replicas.

    python scripts/bench_replicas.py [--dim 256 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama  # noqa: E402

import fsdp2  # noqa: E402

OVER = "HSDP (2 x 2), shard_optimizer_over_replicas"
# Each setup's fully_shard arguments besides the mesh and mp_policy.
SETUPS: dict[str, dict] = {
    "FSDP (4)": {},
    "HSDP (2 x 2)": {},
    OVER: {"shard_optimizer_over_replicas": True},
    f"{OVER}, int8 weights + bf16 gradients": {
        "shard_optimizer_over_replicas": True,
        "compression": fsdp2.CompressionPolicy(weights="int8", gradients="bf16"),
    },
    f"{OVER}, the same across replicas only": {
        "shard_optimizer_over_replicas": True,
        "compression": fsdp2.CompressionPolicy(
            weights="int8", gradients="bf16", across="replicate"
        ),
    },
}
BATCH, SEQ = 2, 64


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _run(setup: str, config: llama.LlamaConfig, rank: int) -> dict[str, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    if setup.startswith("FSDP"):
        mesh = init_device_mesh("cpu", (4,))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = llama.Llama(config)
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "mp_policy": policy, **SETUPS[setup]}
    for block in model.layers:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=gen)

    def step(zero: bool = True) -> None:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        if zero:
            optim.zero_grad()

    step(zero=False)  # AdamW's states exist from here on
    params = list(model.parameters())
    chunks = 0
    for module in model.modules():
        state = fsdp2.fully_shard.state(module)
        for group in state.param_groups if state is not None else ():
            if (kept := group.comms.kept_chunks) is not None:
                chunks += kept.nbytes
    result = {
        "params": _nbytes(params),
        "grads": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": _nbytes(t for s in optim.state.values() for t in s.values() if t.dim()),
        "chunks": chunks,
    }
    optim.zero_grad()
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with fsdp2.comm_stats(model) as stats, tracker:
        step()
    result["peak"] = int(sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))
    totals = stats.totals().values()
    result["in shard group"] = sum(g.all_gather.bytes + g.reduce_scatter.bytes for g in totals)
    result["across replicas"] = sum(
        g.all_reduce.bytes + g.replica_all_gather.bytes + g.replica_reduce_scatter.bytes
        for g in totals
    )
    return result


def _worker(rank: int, store: str, out: str, config: llama.LlamaConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    results = {setup: _run(setup, config, rank) for setup in SETUPS}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    config = llama.LlamaConfig(
        vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=SEQ
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), out, config), nprocs=4)
        results = json.loads(Path(out).read_text())
    numel = sum(p.numel() for p in llama.Llama(config).parameters())
    print(f"llama dim={args.dim} layers={args.layers}: {numel:,} parameters; rank 0, MiB")
    keys = ("params", "grads", "optimizer", "chunks", "peak", "in shard group", "across replicas")
    print("| setup | " + " | ".join(keys) + " | params+grads+optimizer+chunks |")
    print("|---" * (len(keys) + 2) + "|")
    for setup, r in results.items():
        held = r["params"] + r["grads"] + r["optimizer"] + r["chunks"]
        print(f"| {setup} | " + " | ".join(_mib(r[k]) for k in keys) + f" | {_mib(held)} |")


if __name__ == "__main__":
    main()
