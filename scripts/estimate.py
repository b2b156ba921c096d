"""Estimate fsdp2's per-rank memory, communication and its time at a scale this
machine can't run.

    python scripts/estimate.py --model llama3-8b --world-size 8 --batch 2 --seq 8192
    python scripts/estimate.py --model llama3-70b --world-size 512 --replicas 64 \\
        --shard-optimizer-over-replicas --activation-checkpointing

The model of a step (AdamW, ``zero_grad(set_to_none=True)``, one group per block
and the root, ``reshard_after_forward`` left to its default):

Sizes are fsdp2's own: the model is built on the meta device and sharded by
``fully_shard`` over a fake process group of the requested size, as rank 0
(the largest shards). Parameters are kept in fp32 (the sharded master copy
and the optimizer's states); ``--param-dtype`` is the all-gathered and
computed dtype and ``--reduce-dtype`` the gradients' on the wire
(``MixedPrecisionPolicy``).

Memory per rank at the peak, the largest of four moments of a step:

    fp32 sharded params + optimizer states   (this rank's shards, or pieces over replicas)
  + kept chunks                               (shard_optimizer_over_replicas, param dtype)
  + root's unsharded params                   (param dtype, kept from forward to backward)
  + at the loss (the meta step's peak activations, no gradient yet);
    or in the last block's backward (the first to run): the root's unsharded
    grads, 2 blocks' unsharded params (it and the next, prefetched) and its
    grads (param dtype), the activations at its backward's peak;
    or in the next block's backward: the same, its activations, and the
    reduce-scatter input (reduce dtype) of the block before, in flight;
    or in the first block's backward: the same, its activations, and the
    fp32 sharded grads of the blocks reduced before.

Gradients are counted whole for the moment (an upper bound: some are made
later in it).
The meta step computes in the param dtype; attention keeps what the flash
kernel keeps (output and log-sum-exp, not the matrix); with
``--activation-checkpointing`` each block is checkpointed, so only the blocks'
inputs stay and one block's activations are recomputed at a time.

Communication per step, the collectives fsdp2 issues under comm_stats's names:
in the shard group the root all-gathered once, every block in forward and
again in backward, every gradient reduce-scattered; across the replicas plain
HSDP all-reduces each reduce-scatter's output, while
``--shard-optimizer-over-replicas`` reduce-scatters it onto the pieces and,
after the optimizer step, all-gathers the chunks from the pieces. Each buffer
is counted whole and padded (what comm_stats counts) and as what a rank sends
of it on a ring: (n-1)/n of it for an all-gather or a reduce-scatter, 2(n-1)/n
for an all-reduce. Time is those bytes at the bandwidth of the link the group
crosses: inside a node if all the group's ranks share one, else between nodes
(the ring's slowest link); no latency, no overlap with compute: an upper bound
on exposed communication, a lower bound on its total time.

``--compression`` adds each ``CompressionPolicy`` setting's communication time
(1D FSDP) and ``--compression-grid`` prints it for llama3-8b and llama3-70b at
64 to 1024 ranks. docs/performance.md compares the estimate with measured runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimator.comm import (  # noqa: E402
    Collective,
    Links,
    Priced,
    collectives,
    compression_table,
    group_shapes,
    price,
    wire_bytes,
)
from estimator.memory import (  # noqa: E402
    Memory,
    activation_bytes,
    checkpoint_blocks,
    flops_per_token,
    memory,
)
from estimator.sizes import (  # noqa: E402
    DTYPES,
    PRESETS,
    PUBLISHED_PARAMS,
    ModelConfig,
    Setup,
    build_model,
    param_count,
    shard_sizes,
)

__all__ = [  # what tests and other scripts use from here
    "DTYPES",
    "PRESETS",
    "PUBLISHED_PARAMS",
    "Collective",
    "Estimate",
    "Links",
    "Memory",
    "Priced",
    "Setup",
    "activation_bytes",
    "build_model",
    "checkpoint_blocks",
    "collectives",
    "compression_table",
    "estimate",
    "group_shapes",
    "main",
    "param_count",
    "price",
    "shard_sizes",
    "wire_bytes",
]


# -- the estimate -----------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    params: int  # elements, whole model
    batch: int  # sequences per rank
    seq: int
    memory: Memory
    collectives: tuple[Collective, ...]
    flops_per_step: int  # per rank: model FLOPs (flops_per_token)

    def buffer_bytes(self, name: str) -> int:
        return sum(c.buffer_bytes for c in self.collectives if c.name == name)

    @property
    def all_gather_bytes(self) -> int:  # in the shard group, per step, whole buffers
        return self.buffer_bytes("all_gather")

    @property
    def reduce_scatter_bytes(self) -> int:  # in the shard group, per step, whole buffers
        return self.buffer_bytes("reduce_scatter")

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak


def estimate(config: ModelConfig, setup: Setup, batch: int, seq: int) -> Estimate:
    groups = shard_sizes(config, setup)
    activations = activation_bytes(
        config, batch, seq, DTYPES[setup.param_dtype], setup.activation_checkpointing
    )
    return Estimate(
        setup=setup,
        params=sum(g.numel for g in groups),
        batch=batch,
        seq=seq,
        memory=memory(groups, setup, activations),
        collectives=tuple(collectives(groups, setup)),
        flops_per_step=flops_per_token(config, seq) * batch * seq,
    )


# -- output -----------------------------------------------------------------------------


def assumptions(setup: Setup, links: Links, peak_tflops: float | None = None) -> list[str]:
    """What the estimate assumed, in the words the output prints."""
    lines = [
        f"links: {links.gpus_per_node} GPUs per node; {links.intra_node_gbps:g} GB/s per GPU "
        f"inside a node (NVLink-class), {links.inter_node_gbps:g} GB/s between nodes "
        "(IB-class), per direction; a group is priced inside a node only if all its "
        "ranks share one (mesh ranks in order, the shard axis inner)",
        "algorithm: ring, bandwidth-bound: a rank sends (n-1)/n of each all-gather or "
        "reduce-scatter buffer and 2(n-1)/n of an all-reduce's; no latency, no overlap",
        f"dtypes: parameters all-gathered and computed in {setup.param_dtype}, gradients "
        f"reduced in {setup.reduce_dtype}; fp32 master shards and {setup.optimizer_states} "
        "fp32 optimizer states per parameter",
        "counted per step: one group per block and the root; the root all-gathered once, "
        "blocks in forward and again in backward; every gradient reduce-scattered; HSDP: "
        "an all-reduce across replicas, or with the option a reduce-scatter across "
        "replicas and an all-gather of the chunks after the optimizer step",
        "memory: the largest of four moments (the loss; the last, the next and the first "
        "block's backward) of sharded state, unsharded params and grads, reduce-scatter "
        "input in flight and activations "
        + (
            "(blocks checkpointed: their inputs, one block recomputed)"
            if setup.activation_checkpointing
            else "(no activation checkpointing)"
        ),
    ]
    if peak_tflops is not None:
        lines.append(
            f"compute: model FLOPs (6 per matmul weight and token + attention) at "
            f"{peak_tflops:g} TFLOPS, 100% of it"
        )
    return lines


def describe(setup: Setup) -> str:
    if setup.replicas == 1:
        return f"FSDP over {setup.world_size} ranks"
    hsdp = f"HSDP {setup.replicas} x {setup.shards}"
    return hsdp + (", optimizer over replicas" if setup.shard_optimizer_over_replicas else "")


def _console():
    """rich's console, 120 columns wide when not a terminal (its default, 80,
    cuts the tables' cells)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)


def _flops(n: float) -> str:
    return f"{n / 1e12:.1f} TFLOP" if n >= 1e12 else f"{n / 1e9:.2f} GFLOP"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def print_estimate(e: Estimate, name: str, links: Links, peak_tflops: float) -> list[Priced]:
    from rich.table import Table

    console = _console()
    unit, scale = ("GiB", 2**30) if e.memory.peak >= 2**30 else ("MiB", 2**20)
    print(
        f"fsdp2 estimate: {name} ({e.params / 1e9:.2f} B params), {describe(e.setup)}, "
        f"{e.batch} x {e.seq} tokens per rank. Assumed:"
    )
    for line in assumptions(e.setup, links, peak_tflops):
        print(f"- {line}")
    table = Table(title="memory per rank at the peak")
    table.add_column("")
    table.add_column(unit, justify="right")
    m = e.memory
    dtype = e.setup.param_dtype
    rows = [
        (f"fp32 sharded params + {e.setup.optimizer_states} optimizer states", m.sharded_state),
        (f"kept chunks ({dtype}, optimizer over replicas)", m.kept_chunks),
        (f"root's unsharded params ({dtype})", m.root_params),
        (f"root's unsharded grads ({dtype})", m.root_grads),
        (f"2 blocks' unsharded params ({dtype})", m.blocks_unsharded),
        (f"1 block's unsharded grads ({dtype})", m.block_grads),
        (f"1 reduce-scatter input in flight ({e.setup.reduce_dtype})", m.reduce_scatter_input),
        ("fp32 sharded grads of the blocks reduced", m.sharded_grads),
        ("activations and temporaries", m.activations),
        (f"peak, at {m.moment}", m.peak),
    ]
    for label, value in rows:
        if value or label.startswith(("fp32 sharded params", "activations", "peak")):
            table.add_row(label, f"{value / scale:.2f}")
    console.print(table)
    priced = price(list(e.collectives), e.setup, links)
    table = Table(title="communication per rank and step")
    for column in ("collective", "ranks", "link", "calls", "buffers", "sent (ring)", "time"):
        table.add_column(column, justify="left" if column in ("collective", "link") else "right")
    for p in priced:
        c = p.collective
        table.add_row(
            c.name,
            str(c.ranks),
            f"{p.link} {p.gbps:g} GB/s",
            str(c.calls),
            f"{c.buffer_bytes / scale:.2f} {unit}",
            f"{c.sent_bytes / scale:.2f} {unit}",
            _seconds(p.seconds),
        )
    total = sum(p.seconds for p in priced)
    between = sum(p.seconds for p in priced if p.link == "inter-node")
    table.add_row("total", "", "", "", "", "", _seconds(total))
    console.print(table)
    compute = e.flops_per_step / (peak_tflops * 1e12)
    print(
        f"communication {_seconds(total)} per step ({_seconds(between)} of it between nodes); "
        f"compute {_flops(e.flops_per_step)} per rank and step: {_seconds(compute)} "
        f"at {peak_tflops:g} TFLOPS"
    )
    return priced


def print_compression_table(rows: list[dict[str, object]], name: str, links: Links) -> None:
    from rich.table import Table

    table = Table(
        title=f"{name}, 1D FSDP: communication per step and rank, ring, bandwidth-bound "
        f"({links.intra_node_gbps:g} GB/s inside a node of {links.gpus_per_node}, "
        f"{links.inter_node_gbps:g} between nodes)"
    )
    for column in ("ranks", "setting", "all-gathered", "reduced", "link", "time", "vs off"):
        table.add_column(column, justify="left" if column in ("setting", "link") else "right")
    base: dict[object, float] = {}
    for row in rows:
        seconds = float(row["comm_s"])  # type: ignore[arg-type]
        base.setdefault(row["world_size"], seconds)
        table.add_row(
            str(row["world_size"]),
            str(row["setting"]),
            f"{int(row['all_gather_bytes']) / 2**30:.2f} GiB",  # type: ignore[call-overload]
            f"{int(row['reduce_bytes']) / 2**30:.2f} GiB",  # type: ignore[call-overload]
            str(row["link"]),
            f"{seconds:.2f} s",
            f"{seconds / base[row['world_size']]:.2f}x",
        )
    _console().print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama3-8b")
    p.add_argument("--world-size", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: max)")
    p.add_argument("--replicas", type=int, default=1, help="HSDP: replicas (mesh R x W/R)")
    p.add_argument(
        "--shard-optimizer-over-replicas",
        action="store_true",
        help="HSDP: fully_shard(shard_optimizer_over_replicas=True)",
    )
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--optimizer-states",
        type=int,
        default=2,
        help="fp32 states per parameter: AdamW 2 (default), SGD with momentum 1, SGD 0",
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint each block")
    p.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    p.add_argument(
        "--intra-node-gbps",
        type=float,
        default=Links.intra_node_gbps,
        help="GB/s per GPU and direction inside a node (default: NVLink 4, H100 SXM)",
    )
    p.add_argument(
        "--inter-node-gbps",
        type=float,
        default=Links.inter_node_gbps,
        help="GB/s per GPU and direction between nodes (default: one 400 Gb/s NIC per GPU)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="peak FLOPS per GPU for the compute line (default: H100 SXM, bf16 dense)",
    )
    p.add_argument("--json", help="also write the estimate to this file")
    p.add_argument(
        "--compression",
        action="store_true",
        help="also print each CompressionPolicy setting's comm time (1D FSDP only)",
    )
    p.add_argument(
        "--compression-grid",
        action="store_true",
        help="only the comm time of each compression setting, llama3-8b and llama3-70b, "
        "64 to 1024 ranks (no memory estimate)",
    )
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    if args.gpus_per_node < 1:
        p.error("--gpus-per-node must be at least 1")
    for flag in ("intra_node_gbps", "inter_node_gbps", "peak_tflops"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.replicas < 1 or args.world_size % args.replicas:
        p.error(f"--replicas {args.replicas} must divide --world-size {args.world_size}")
    if args.shard_optimizer_over_replicas and args.replicas < 2:
        p.error("--shard-optimizer-over-replicas needs --replicas of 2 or more (HSDP)")
    if args.compression and args.replicas > 1:
        p.error("--compression models 1D FSDP only: leave out --replicas")
    seq = args.seq or PRESETS[args.model].max_seq_len
    if seq > PRESETS[args.model].max_seq_len:
        p.error(f"--seq {seq} is longer than {args.model}'s max_seq_len")
    args.seq = seq
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    links = Links(args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node)
    if args.compression_grid:
        grid = {}
        for name in ("llama3-8b", "llama3-70b"):
            grid[name] = compression_table(
                PRESETS[name], [64, 128, 256, 512, 1024], links, args.param_dtype, args.reduce_dtype
            )
            print_compression_table(grid[name], name, links)
        if args.json:
            Path(args.json).write_text(json.dumps(grid, indent=2))
        return
    setup = Setup(
        world_size=args.world_size,
        replicas=args.replicas,
        shard_optimizer_over_replicas=args.shard_optimizer_over_replicas,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        optimizer_states=args.optimizer_states,
        activation_checkpointing=args.activation_checkpointing,
    )
    config = PRESETS[args.model]
    result = estimate(config, setup, args.batch, args.seq)
    priced = print_estimate(result, args.model, links, args.peak_tflops)
    output: dict[str, object] = {
        **asdict(result),
        "peak_bytes": result.peak_bytes,
        "links": asdict(links),
        "assumed": assumptions(setup, links, args.peak_tflops),
        "priced": [asdict(p) for p in priced],
        "comm_s": sum(p.seconds for p in priced),
        "compute_s": result.flops_per_step / (args.peak_tflops * 1e12),
    }
    if args.compression:
        rows = compression_table(
            config, [args.world_size], links, args.param_dtype, args.reduce_dtype
        )
        print_compression_table(rows, args.model, links)
        output["compression"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
