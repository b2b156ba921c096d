"""The presets, the setup of a run, and fsdp2's own shard sizes: a meta-device
model sharded by ``fully_shard`` over a fake process group, read as rank 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from llama import Llama, LlamaConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import fsdp2
from fsdp2.api.state import get_fsdp_state

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
