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
import dataclasses
import functools
import json
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import Llama, LlamaConfig  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2.common import chunk_rows  # noqa: E402
from fsdp2.state import get_fsdp_state  # noqa: E402
from fsdp2.wire import rows_wire_bytes  # noqa: E402

ModelConfig = LlamaConfig | ModelArgs  # scripts/llama.py's Llama, or torch's test Transformer

PRESETS: dict[str, ModelConfig] = {
    "demo": LlamaConfig(),
    "small": LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64),
    # scripts/bench.py's default model: torch's test Transformer, 128 x 4 tokens per rank.
    "bench": ModelArgs(
        n_layers=6,
        vocab_size=2048,
        max_seq_len=128,
        dim=256,
        n_heads=8,
        dropout_p=0.0,
        weight_tying=False,
    ),
    # scripts/gpu_check.py's timing model (0.53 B), batch 8 x 512 on one GPU.
    "gpu-check": LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, max_seq_len=512),
    "tinyllama-1.1b": LlamaConfig(
        vocab_size=32000,
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=5632,
        max_seq_len=2048,
    ),
    "llama2-7b": LlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-405b": LlamaConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}

# Published parameter counts (the model cards), checked in tests/test_estimate.py.
PUBLISHED_PARAMS = {
    "tinyllama-1.1b": 1.1e9,
    "llama2-7b": 6.74e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MASTER_ITEMSIZE = 4  # fp32 sharded parameters and optimizer states


# -- what is trained, and on what -------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """The mesh, the dtypes and the optimizer of a run."""

    world_size: int
    replicas: int = 1  # HSDP: mesh (replicas, world_size // replicas)
    shard_optimizer_over_replicas: bool = False
    param_dtype: str = "bf16"  # all-gathered and computed
    reduce_dtype: str = "fp32"  # gradients on the wire
    optimizer_states: int = 2  # fp32 per parameter: AdamW's exp_avg and exp_avg_sq
    activation_checkpointing: bool = False

    @property
    def shards(self) -> int:
        return self.world_size // self.replicas

    def ranks(self, axis: str) -> range:
        """Rank 0's group on ``axis``: the shard axis is the mesh's inner one."""
        return range(self.shards) if axis == "shard" else range(0, self.world_size, self.shards)


@dataclass(frozen=True)
class Links:
    """Bandwidth per GPU and direction, GB/s (1e9 bytes per second)."""

    intra_node_gbps: float = 450.0  # NVLink-class: H100 SXM's NVLink 4, 900 GB/s both ways
    inter_node_gbps: float = 50.0  # IB-class: one 400 Gb/s NIC (InfiniBand NDR) per GPU
    gpus_per_node: int = 8

    def of(self, ranks: range) -> tuple[str, float]:
        """The link a ring over ``ranks`` is bound by, and its GB/s."""
        if len({rank // self.gpus_per_node for rank in ranks}) == 1:
            return "intra-node", self.intra_node_gbps
        return "inter-node", self.inter_node_gbps


# -- sizes: fsdp2's own, over a fake process group --------------------------------------


@dataclass(frozen=True)
class GroupSizes:
    """One param group on rank 0, in elements."""

    root: bool
    numel: int  # unsharded
    local_numel: int  # this rank's sharded parameters (its pieces, over replicas)
    shard_slots: int  # this rank's slots in the shard group's buffers (padded)
    replica_slots: int  # over replicas: its slots in the buffers across replicas (padded)


def build_model(config: ModelConfig) -> nn.Module:
    with torch.device("meta"):
        return Llama(config) if isinstance(config, LlamaConfig) else Transformer(config)


def param_count(config: ModelConfig) -> int:
    return sum(p.numel() for p in build_model(config).parameters())


def shard_sizes(config: ModelConfig, setup: Setup) -> list[GroupSizes]:
    """Shards a meta-device model with ``fully_shard`` (each block, then the
    root) over a fake world of ``setup.world_size`` ranks, this process rank 0,
    and reads each group's sizes off fsdp2's layouts."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setup.world_size)
    try:
        ranks = torch.arange(setup.world_size)
        if setup.replicas > 1:
            mesh = DeviceMesh(
                "cpu", ranks.view(setup.replicas, -1), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = DeviceMesh("cpu", ranks)
        kwargs: dict[str, object] = {"mesh": mesh}
        if setup.shard_optimizer_over_replicas:
            kwargs["shard_optimizer_over_replicas"] = True
        model = build_model(config)
        for block in model.layers:
            fsdp2.fully_shard(block, **kwargs)
        fsdp2.fully_shard(model, **kwargs)
        return [
            _group_sizes(group.fsdp_params, root=module is model)
            for module in model.modules()
            if (state := get_fsdp_state(module)) is not None
            for group in state.param_groups
        ]
    finally:
        dist.destroy_process_group()


def _group_sizes(fsdp_params, root: bool) -> GroupSizes:
    layouts = [p.layout for p in fsdp_params]
    return GroupSizes(
        root=root,
        numel=sum(lay.unsharded_size.numel() for lay in layouts),
        local_numel=sum(lay.local_numel for lay in layouts),
        shard_slots=sum(lay.slot_numel for lay in layouts),
        replica_slots=sum(lay.piece.slot_numel for lay in layouts if lay.piece is not None),
    )


# -- communication ----------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One kind of collective, summed over a step's groups, on rank 0."""

    name: str  # comm_stats's: all_gather, reduce_scatter, all_reduce, replica_*
    axis: str  # "shard" or "replicate"
    ranks: int
    calls: int  # per step
    buffer_bytes: int  # per step: whole buffers, padded (comm_stats's bytes)

    @property
    def sent_bytes(self) -> int:
        """What this rank sends (and receives) of the buffers on a ring."""
        hops = 2 * (self.ranks - 1) if self.name == "all_reduce" else self.ranks - 1
        return self.buffer_bytes * hops // self.ranks

    def seconds(self, gbps: float) -> float:
        return self.sent_bytes / (gbps * 1e9)


def collectives(groups: list[GroupSizes], setup: Setup) -> list[Collective]:
    """The collectives of one step (see the module docstring); none over one rank."""
    param = DTYPES[setup.param_dtype].itemsize
    reduce = DTYPES[setup.reduce_dtype].itemsize
    shards, replicas = setup.shards, setup.replicas
    slots = sum(g.shard_slots for g in groups)
    gathered = sum(g.shard_slots * (1 if g.root else 2) for g in groups)
    blocks = sum(not g.root for g in groups)
    out = []
    if shards > 1:
        out.append(
            Collective(
                "all_gather", "shard", shards, len(groups) + blocks, shards * gathered * param
            )
        )
        out.append(
            Collective("reduce_scatter", "shard", shards, len(groups), shards * slots * reduce)
        )
    if replicas > 1 and not setup.shard_optimizer_over_replicas:
        out.append(Collective("all_reduce", "replicate", replicas, len(groups), slots * reduce))
    elif replicas > 1:
        pieces = sum(g.replica_slots for g in groups)
        out.append(
            Collective(
                "replica_reduce_scatter",
                "replicate",
                replicas,
                len(groups),
                replicas * pieces * reduce,
            )
        )
        out.append(
            Collective(
                "replica_all_gather", "replicate", replicas, len(groups), replicas * pieces * param
            )
        )
    return out


@dataclass(frozen=True)
class Priced:
    collective: Collective
    link: str  # "intra-node" or "inter-node"
    gbps: float
    seconds: float


def price(colls: list[Collective], setup: Setup, links: Links) -> list[Priced]:
    """Each collective at the bandwidth of the link its group crosses."""
    priced = []
    for c in colls:
        link, gbps = links.of(setup.ranks(c.axis))
        priced.append(Priced(c, link, gbps, c.seconds(gbps)))
    return priced


# -- memory -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Bytes per rank at one moment of the step (see the module docstring)."""

    moment: str
    sharded_state: int  # fp32 params + optimizer states
    kept_chunks: int  # shard_optimizer_over_replicas
    root_params: int  # unsharded
    root_grads: int  # unsharded
    blocks_unsharded: int  # 2 blocks' params, in a block's backward
    block_grads: int  # the block's unsharded grads
    reduce_scatter_input: int  # the block before's, in flight
    sharded_grads: int  # fp32, of the blocks reduced before
    activations: int  # and temporaries

    @property
    def peak(self) -> int:
        return sum(v for k, v in vars(self).items() if k != "moment")


class Activations(NamedTuple):
    """Activations and temporaries of the meta step at its moments, bytes."""

    peak: int  # the step's (at the loss, for the models here)
    last_block: int  # at the peak of the last block's backward (the first to run)
    next_block: int  # the largest at another block's backward peak
    first_block: int  # at the peak of the first block's backward


def memory(groups: list[GroupSizes], setup: Setup, activations: Activations) -> Memory:
    """The largest of the step's four candidate peaks (see the module docstring)."""
    param = DTYPES[setup.param_dtype].itemsize
    reduce = DTYPES[setup.reduce_dtype].itemsize
    root = next(g for g in groups if g.root)
    blocks = [g for g in groups if not g.root]
    block = max(blocks, key=lambda g: g.numel, default=GroupSizes(False, 0, 0, 0, 0))
    gathered = setup.shards * block.shard_slots  # a block's all-gather output, padded
    at_loss = Memory(
        moment="the loss",
        sharded_state=(1 + setup.optimizer_states)
        * sum(g.local_numel for g in groups)
        * MASTER_ITEMSIZE,
        kept_chunks=setup.replicas * sum(g.replica_slots for g in groups) * param,
        root_params=setup.shards * root.shard_slots * param,
        root_grads=0,
        blocks_unsharded=0,
        block_grads=0,
        reduce_scatter_input=0,
        sharded_grads=0,
        activations=activations.peak,
    )
    last = dataclasses.replace(
        at_loss,
        moment="the last block's backward",
        root_grads=root.numel * param,
        blocks_unsharded=2 * gathered * param,
        block_grads=block.numel * param,
        activations=activations.last_block,
    )
    following = dataclasses.replace(
        last,
        moment="the next block's backward",
        reduce_scatter_input=gathered * reduce,
        activations=activations.next_block,
    )
    first = dataclasses.replace(
        following,
        moment="the first block's backward",
        sharded_grads=max(len(blocks) - 2, 0) * block.local_numel * MASTER_ITEMSIZE,
        activations=activations.first_block,
    )
    return max(at_loss, last, following, first, key=lambda m: m.peak)


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing of each block of ``model.layers``: forward keeps
    the block's input, backward recomputes the block. Wraps ``forward`` (not the
    call), so hooks on the block (fsdp2's) run once, as under checkpoint_wrapper."""
    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


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


def activation_bytes(
    config: ModelConfig,
    batch: int,
    seq: int,
    dtype: torch.dtype = torch.float32,
    checkpointing: bool = False,
) -> Activations:
    """Activations and temporaries of a training step of the unsharded model
    computing in ``dtype``, at the step's peak and at the peaks of its blocks'
    backward.

    The blocks are alike, so each of these grows by the same bytes per block
    (what one block keeps for backward): measured with 2 and 3 blocks, they
    are extrapolated to ``n_layers`` (tests/test_estimate.py checks that
    against a measurement at the full depth), which keeps a 126-layer model
    as quick as a small one.
    """
    if config.n_layers <= 3:
        return _measure_activations(config, batch, seq, dtype, checkpointing)
    two, three = (
        _measure_activations(
            dataclasses.replace(config, n_layers=n), batch, seq, dtype, checkpointing
        )
        for n in (2, 3)
    )
    extra = config.n_layers - 3
    return Activations(*(c + extra * (c - b) for b, c in zip(two, three, strict=True)))


def _measure_activations(
    config: ModelConfig, batch: int, seq: int, dtype: torch.dtype, checkpointing: bool
) -> Activations:
    """One forward + backward of the unsharded model on the meta device under
    MemTracker, with the loss in fp32 as training loops compute it; the
    Activation, Temp and Buffer bytes it counts.

    Gradients are dropped as soon as they are accumulated and no optimizer
    runs, so nothing but the (constant) parameters competes with activations
    for the peak: for a large model the step's overall peak would otherwise
    be the optimizer's, when activations are gone.
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    model = build_model(config).to(dtype)
    if checkpointing:
        checkpoint_blocks(model)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device="meta")
    tracker = MemTracker()
    tracker.track_external(model)
    with (
        warnings.catch_warnings(),
        tracker,
        patch.object(F, "scaled_dot_product_attention", _flash_attention),
    ):
        # MemTracker warns of the None that a parameter's grad is, once dropped.
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    kinds = ("Activation", "Temp", "Buffer")

    def held(snapshot: dict) -> int:
        return sum(
            nbytes
            for per_device in snapshot.values()
            for kind, nbytes in per_device.items()
            if getattr(kind, "value", kind) in kinds
        )

    blocks = [
        max(held(snap) for snap in tracker.memory_tracking[block].snapshots[_ModState.PEAK_BW])
        for block in model.layers
    ]
    return Activations(
        held(tracker.get_tracker_snapshot("peak")),
        blocks[-1],
        max(blocks[:-1], default=0),
        blocks[0] if len(blocks) > 1 else 0,
    )


# -- compute ----------------------------------------------------------------------------


def flops_per_token(config: ModelConfig, seq: int) -> int:
    """Model FLOPs of a training step per token, torchtitan's convention: 6 per
    weight of a matmul (forward 2, backward 4) plus attention's 12 * layers *
    dim * seq; a recomputation under activation checkpointing is not counted."""
    model = build_model(config)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6 * matmul + 12 * config.n_layers * config.dim * seq


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


# -- compression (1D FSDP, from the shapes) ---------------------------------------------

# CompressionPolicy settings compared: (weights, gradients).
COMPRESSION_SETTINGS = {
    "off": (None, None),
    "weights int8": ("int8", None),
    "gradients bf16": (None, "bf16"),
    "gradients int8": (None, "int8"),
    "both int8": ("int8", "int8"),
}


def group_shapes(model: nn.Module) -> list[list[torch.Size]]:
    """The parameter shapes of each group of the sharding above (one group per
    block of ``model.layers``, then the root with the rest), root first."""
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
    reduce_itemsize: int | None = None,
) -> tuple[int, int]:
    """Per step and rank, the buffers ``comm_stats`` counts (whole): the
    all-gathers (the root once, the other groups in forward and in backward)
    in ``itemsize`` (the param dtype's) and the gradient reductions in
    ``reduce_itemsize`` (the reduce dtype's; default ``itemsize``), or as the
    compression setting sends them."""
    reduce_itemsize = itemsize if reduce_itemsize is None else reduce_itemsize
    all_gather = reduce = 0
    for i, shapes in enumerate(groups):
        slots = _slot_numels(shapes, world_size)
        if not sum(slots):
            continue
        if weights == "int8":
            gathered = world_size * rows_wire_bytes(slots, block_size)
        else:
            gathered = world_size * sum(slots) * itemsize
        all_gather += gathered * (1 if i == 0 else 2)
        if gradients == "bf16":
            reduce += world_size * sum(slots) * 2
        elif gradients == "int8":
            reduce += world_size * rows_wire_bytes(slots, block_size)
        else:
            reduce += world_size * sum(slots) * reduce_itemsize
    return all_gather, reduce


def compression_table(
    config: ModelConfig,
    world_sizes: list[int],
    links: Links,
    param_dtype: str = "bf16",
    reduce_dtype: str = "fp32",
) -> list[dict[str, object]]:
    """Per world size (1D FSDP) and setting: buffers and seconds per step."""
    groups = group_shapes(build_model(config))
    rows = []
    for world_size in world_sizes:
        link, gbps = links.of(range(world_size))
        for name, (weights, gradients) in COMPRESSION_SETTINGS.items():
            ag, rs = wire_bytes(
                groups,
                world_size,
                weights,
                gradients,
                itemsize=DTYPES[param_dtype].itemsize,
                reduce_itemsize=DTYPES[reduce_dtype].itemsize,
            )
            sent = (ag + rs) * (world_size - 1) / world_size
            rows.append(
                {
                    "world_size": world_size,
                    "setting": name,
                    "all_gather_bytes": ag,
                    "reduce_bytes": rs,
                    "link": link,
                    "comm_s": sent / (gbps * 1e9),
                }
            )
    return rows


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
        if value or label.startswith(("fp32", "activations", "peak")):
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
