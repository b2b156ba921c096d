"""Estimate per-rank memory and communication of fsdp2 at a scale this machine can't run.

One process, no real memory: the model is built on the meta device and
sharded by ``fully_shard`` over a *fake* process group of the requested world
size, so the shard sizes, padding and all-gather volumes are fsdp2's own. The
activations come from one training step of the unsharded model on the meta
device under torch's ``MemTracker`` (meta tensors have sizes, not storage).

    python scripts/estimate.py --model llama-7b --world-size 1024 --batch 1 --seq 4096
    python scripts/estimate.py --model demo --world-size 2 --json out.json
    python scripts/estimate.py --model llama-70b --world-size 512 --replicas 64 \
        --shard-optimizer-over-replicas

Per rank, at the peak of a training step (AdamW, ``zero_grad(set_to_none=True)``,
one group per block + root): the start of backward, when every activation is
still alive, the head's gradients exist and no sharded gradient does yet:

    sharded params + 2 AdamW states                (this rank's shards, 3 copies)
  + root's unsharded params and grads               (kept from forward to backward)
  + 1 block's unsharded params                      (the last block, about to run backward)
  + activations and temporaries                     (the meta step's, at its peak)

Attention is modelled by the flash kernel (output and log-sum-exp kept, not
the attention matrix), as on real devices. Accuracy against MemTracker on
real gloo runs (tests/test_estimate.py, a 0.4 M-parameter model at world
sizes 2 and 4): communication volume exact, peak memory 4% high.

Communication per step: every group all-gathered in forward, the blocks again
in backward, every gradient reduce-scattered, padding included.

With ``--link-gbps`` (the bandwidth each rank has to the others, e.g. 25 GB/s
between nodes) it also prints the per-step communication time of each
``CompressionPolicy`` setting, and ``--compression-grid`` prints that time for
llama-7b and llama-70b at 64 to 1024 ranks (no memory estimate):

    python scripts/estimate.py --model llama-7b --world-size 256 --link-gbps 25
    python scripts/estimate.py --compression-grid --link-gbps 25

The time model is a bandwidth-bound ring (or all-to-all): each rank moves
``(W - 1) / W`` of every buffer over its link, latency and overlap ignored:
an upper bound on exposed time, a lower bound on total time.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import Llama, LlamaConfig  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2.common import chunk_rows  # noqa: E402
from fsdp2.wire import rows_wire_bytes  # noqa: E402

PRESETS = {
    "demo": LlamaConfig(),
    "small": LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64),
    "llama-1b": LlamaConfig(
        vocab_size=32000, dim=2048, n_layers=22, n_heads=32, ffn_dim=5632, max_seq_len=4096
    ),
    "llama-7b": LlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096
    ),
    "llama-70b": LlamaConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, max_seq_len=4096
    ),
}


@dataclass(frozen=True)
class Estimate:
    world_size: int
    params: int  # elements, whole model
    sharded_state_bytes: int  # this rank: params + 2 AdamW states
    root_unsharded_bytes: int  # root params and grads
    blocks_unsharded_bytes: int  # 1 block's params
    activation_bytes: int  # and temporaries
    peak_bytes: int
    all_gather_bytes: int  # per step, whole buffers (what each rank receives, plus its own)
    reduce_scatter_bytes: int  # per step, whole buffers (what each rank sends, plus its own)
    replicas: int = 1  # HSDP: (replicas, world_size // replicas)
    shard_optimizer_over_replicas: bool = False
    # HSDP: per step, whole buffers across the replicas (an all-reduce; with the
    # option a reduce-scatter and an all-gather of the shard group's chunks).
    across_replicas_bytes: int = 0
    chunk_bytes: int = 0  # the option: the shard group's chunks kept (param dtype)


def build_model(config: LlamaConfig) -> Llama:
    with torch.device("meta"):
        return Llama(config)


def _flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """What attention keeps for backward on a real device: the output and the
    log-sum-exp, not the attention matrix. On the meta device
    ``scaled_dot_product_attention`` falls back to the math path, which keeps
    the matrix; the flash kernel's op has a meta implementation."""
    if attn_mask is not None:
        raise ValueError("the estimate models causal attention without a mask")
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    return out


def activation_bytes(config: LlamaConfig, batch: int, seq: int) -> int:
    """Activations and temporaries at their peak in forward + backward of the
    unsharded model on the meta device, as MemTracker classifies them.

    Gradients are dropped as soon as they are accumulated and no optimizer
    runs, so nothing but the (constant) parameters competes with activations
    for the peak: for a large model the step's overall peak would otherwise
    be the optimizer's, when activations are gone.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    model = build_model(config)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device="meta")
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, patch.object(F, "scaled_dot_product_attention", _flash_attention):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    kinds = ("Activation", "Temp", "Buffer")
    return int(
        sum(
            nbytes
            for per_device in tracker.get_tracker_snapshot("peak").values()
            for kind, nbytes in per_device.items()
            if getattr(kind, "value", kind) in kinds
        )
    )


def estimate(
    config: LlamaConfig,
    world_size: int,
    batch: int,
    seq: int,
    replicas: int = 1,
    shard_optimizer_over_replicas: bool = False,
) -> Estimate:
    """Shards a meta-device model over a fake world of ``world_size`` ranks
    (this process is rank 0, which holds the largest shards), as HSDP over
    ``replicas`` replicas if more than one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if replicas > 1:
            ranks = torch.arange(world_size).view(replicas, -1)
            mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = DeviceMesh("cpu", torch.arange(world_size))
        kwargs = {"mesh": mesh}
        if shard_optimizer_over_replicas:
            kwargs["shard_optimizer_over_replicas"] = True
        model = build_model(config)
        for block in model.layers:
            fsdp2.fully_shard(block, **kwargs)
        fsdp2.fully_shard(model, **kwargs)
        rows = {row.module: row for row in fsdp2.summary(model, print_table=False)}
    finally:
        dist.destroy_process_group()
    root = rows.pop("")
    block = max(rows.values(), key=lambda row: row.unsharded_bytes)
    padded = {name: r.unsharded_bytes + r.padding_bytes for name, r in rows.items()}
    root_padded = root.unsharded_bytes + root.padding_bytes
    sharded = 3 * (root.shard_bytes + sum(r.shard_bytes for r in rows.values()))
    root_unsharded = 2 * root.unsharded_bytes
    blocks_unsharded = block.unsharded_bytes
    activations = activation_bytes(config, batch, seq)
    # Across replicas, per step: HSDP all-reduces each shard group's chunk of the
    # gradients; the option reduce-scatters it and all-gathers the chunks again
    # (whole buffers, padded to the shard group's slots).
    chunks = (root_padded + sum(padded.values())) * replicas // world_size
    across = 0 if replicas == 1 else chunks * (2 if shard_optimizer_over_replicas else 1)
    kept = chunks if shard_optimizer_over_replicas else 0
    return Estimate(
        world_size=world_size,
        params=root.numel + sum(r.numel for r in rows.values()),
        sharded_state_bytes=sharded,
        root_unsharded_bytes=root_unsharded,
        blocks_unsharded_bytes=blocks_unsharded,
        activation_bytes=activations,
        peak_bytes=sharded + kept + root_unsharded + blocks_unsharded + activations,
        all_gather_bytes=root_padded + 2 * sum(padded.values()),
        reduce_scatter_bytes=root_padded + sum(padded.values()),
        replicas=replicas,
        shard_optimizer_over_replicas=shard_optimizer_over_replicas,
        across_replicas_bytes=across,
        chunk_bytes=kept,
    )


# CompressionPolicy settings compared: (weights, gradients).
COMPRESSION_SETTINGS = {
    "fp32 (off)": (None, None),
    "weights int8": ("int8", None),
    "gradients bf16": (None, "bf16"),
    "gradients int8": (None, "int8"),
    "both int8": ("int8", "int8"),
}


def group_shapes(model: nn.Module) -> list[list[torch.Size]]:
    """The parameter shapes of each group of the demo sharding (one group per
    block of ``model.layers``, then the root with the rest), in group order."""
    block_params = {id(p) for block in model.layers for p in block.parameters()}
    root = [p.shape for p in model.parameters() if id(p) not in block_params]
    return [root, *([p.shape for p in block.parameters()] for block in model.layers)]


def _slot_numels(shapes: list[torch.Size], world_size: int) -> list[int]:
    """Each parameter's padded slot (``ShardLayout.slot_numel``, dim 0)."""
    return [chunk_rows(s[0], world_size) * (s.numel() // max(s[0], 1)) for s in shapes]


def wire_bytes(
    groups: list[list[torch.Size]],
    world_size: int,
    weights: str | None = None,
    gradients: str | None = None,
    block_size: int = 256,
    itemsize: int = 4,
) -> tuple[int, int]:
    """Per step and rank, the bytes ``comm_stats`` counts (whole buffers): the
    all-gathers (the root once, the other groups in forward and in backward)
    and the gradient reductions, for fp32 (``itemsize``) parameters."""
    all_gather = reduce = 0
    for i, shapes in enumerate(groups):
        slots = _slot_numels(shapes, world_size)
        if not sum(slots):
            continue
        plain = world_size * sum(slots) * itemsize
        gathered = world_size * rows_wire_bytes(slots, block_size) if weights == "int8" else plain
        all_gather += gathered * (1 if i == 0 else 2)
        if gradients == "bf16":
            reduce += world_size * sum(slots) * 2
        elif gradients == "int8":
            reduce += world_size * rows_wire_bytes(slots, block_size)
        else:
            reduce += plain
    return all_gather, reduce


def comm_seconds(nbytes: int, world_size: int, link_bytes_per_s: float) -> float:
    """A bandwidth-bound collective: each rank moves (W - 1) / W of the buffer."""
    return nbytes * (world_size - 1) / world_size / link_bytes_per_s


def compression_table(
    config: LlamaConfig, world_sizes: list[int], link_gbps: float
) -> list[dict[str, object]]:
    """Per world size and setting: bytes and seconds of communication per step."""
    groups = group_shapes(build_model(config))
    rows = []
    for world_size in world_sizes:
        for name, (weights, gradients) in COMPRESSION_SETTINGS.items():
            ag, rs = wire_bytes(groups, world_size, weights, gradients)
            seconds = comm_seconds(ag + rs, world_size, link_gbps * 1e9)
            rows.append(
                {
                    "world_size": world_size,
                    "setting": name,
                    "all_gather_bytes": ag,
                    "reduce_bytes": rs,
                    "comm_s": seconds,
                }
            )
    return rows


def print_compression_table(rows: list[dict[str, object]], name: str, link_gbps: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{name}: communication per step and rank at {link_gbps:g} GB/s per link "
        "(bandwidth-bound, no overlap)"
    )
    for column in ("ranks", "setting", "all-gathered", "reduced", "time", "vs fp32"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    base: dict[object, float] = {}
    for row in rows:
        seconds = float(row["comm_s"])  # type: ignore[arg-type]
        base.setdefault(row["world_size"], seconds)
        table.add_row(
            str(row["world_size"]),
            str(row["setting"]),
            f"{int(row['all_gather_bytes']) / 2**30:.2f} GiB",  # type: ignore[call-overload]
            f"{int(row['reduce_bytes']) / 2**30:.2f} GiB",  # type: ignore[call-overload]
            f"{seconds:.2f} s",
            f"{seconds / base[row['world_size']]:.2f}x",
        )
    Console().print(table)


def print_estimate(e: Estimate, name: str, batch: int, seq: int) -> None:
    from rich.console import Console
    from rich.table import Table

    unit, scale = ("GiB", 2**30) if e.peak_bytes >= 2**30 else ("MiB", 2**20)
    ranks = f"{e.world_size} ranks"
    if e.replicas > 1:
        ranks += f" (HSDP {e.replicas} x {e.world_size // e.replicas}"
        ranks += ", optimizer over replicas)" if e.shard_optimizer_over_replicas else ")"
    table = Table(
        title=f"fsdp2 estimate: {name} ({e.params / 1e9:.2f} B params) on {ranks}, "
        f"{batch} x {seq} tokens per rank, fp32 + AdamW"
    )
    table.add_column("per rank")
    table.add_column(unit, justify="right")
    for label, value in (
        ("sharded params + AdamW states", e.sharded_state_bytes),
        ("shard group's chunks kept (optimizer over replicas)", e.chunk_bytes),
        ("root's unsharded params + grads", e.root_unsharded_bytes),
        ("1 block's unsharded params", e.blocks_unsharded_bytes),
        ("activations and temporaries", e.activation_bytes),
        ("peak", e.peak_bytes),
        ("all-gathered per step", e.all_gather_bytes),
        ("reduce-scattered per step", e.reduce_scatter_bytes),
        ("across replicas per step", e.across_replicas_bytes),
    ):
        table.add_row(label, f"{value / scale:.3f}")
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-7b")
    p.add_argument("--world-size", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: max)")
    p.add_argument("--replicas", type=int, default=1, help="HSDP: replicas (mesh R x W/R)")
    p.add_argument(
        "--shard-optimizer-over-replicas",
        action="store_true",
        help="HSDP: fully_shard(shard_optimizer_over_replicas=True)",
    )
    p.add_argument("--json", help="also write the estimate to this file")
    p.add_argument(
        "--link-gbps",
        type=float,
        help="GB/s per rank between ranks: also print each compression setting's comm time",
    )
    p.add_argument(
        "--compression-grid",
        action="store_true",
        help="only the comm time of each compression setting, llama-7b and llama-70b, "
        "64 to 1024 ranks (needs --link-gbps)",
    )
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    if args.link_gbps is not None and args.link_gbps <= 0:
        p.error("--link-gbps must be positive, e.g. 25 (GB/s between nodes)")
    if args.compression_grid:
        if args.link_gbps is None:
            p.error("--compression-grid needs --link-gbps, e.g. --link-gbps 25")
        grid = {}
        for name in ("llama-7b", "llama-70b"):
            grid[name] = compression_table(PRESETS[name], [64, 128, 256, 512, 1024], args.link_gbps)
            print_compression_table(grid[name], name, args.link_gbps)
        if args.json:
            Path(args.json).write_text(json.dumps(grid, indent=2))
        return
    if args.replicas < 1 or args.world_size % args.replicas:
        p.error(f"--replicas {args.replicas} must divide --world-size {args.world_size}")
    if args.shard_optimizer_over_replicas and args.replicas < 2:
        p.error("--shard-optimizer-over-replicas needs --replicas of 2 or more (HSDP)")
    config = PRESETS[args.model]
    seq = args.seq or config.max_seq_len
    if seq > config.max_seq_len:
        p.error(f"--seq {seq} is longer than {args.model}'s max_seq_len {config.max_seq_len}")
    result = estimate(
        config, args.world_size, args.batch, seq, args.replicas, args.shard_optimizer_over_replicas
    )
    print_estimate(result, args.model, args.batch, seq)
    output: dict[str, object] = asdict(result)
    if args.link_gbps is not None:
        rows = compression_table(config, [args.world_size], args.link_gbps)
        print_compression_table(rows, args.model, args.link_gbps)
        output["compression"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
