"""Memory per rank at the step's peak: its four moments, and the activations
of one training step of the unsharded model on the meta device."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple
from unittest.mock import patch

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .sizes import DTYPES, MASTER_ITEMSIZE, GroupSizes, ModelConfig, Setup, build_model


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
        return measure_activations(config, batch, seq, dtype, checkpointing)
    two, three = (
        measure_activations(
            dataclasses.replace(config, n_layers=n), batch, seq, dtype, checkpointing
        )
        for n in (2, 3)
    )
    extra = config.n_layers - 3
    return Activations(*(c + extra * (c - b) for b, c in zip(two, three, strict=True)))


def measure_activations(
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
