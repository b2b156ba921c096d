"""Activation checkpointing composed with every way of grouping a model:
checkpointing with the composable ``checkpoint(block)``, with
``torch.utils.checkpoint`` around each sharded block, and with
``checkpoint_wrapper``; blocks as groups, blocks and embeddings in module
lists, and a weight tied between the embedding and the head (in one list, or
both in the root); every ``reshard_after_forward``, the root's included.
Each against the unsharded reference (DDP math).

A forward recomputed in backward runs the sharded module's hooks again, and
non-reentrant checkpointing may stop it early, before its post-hook: the
recomputation must only unshard, touching none of forward's bookkeeping.
(It used to claim the iteration's forward root, so the next forward ended
the root's group in the middle of the root's forward.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist import labelled, run_ranks
from error_model import REF_TOL
from models import (
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    transformer_args,
)
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.testing import assert_close
from torch.testing._internal.distributed._tensor.common_dtensor import (
    Transformer,
    TransformerBlock,
)

import fsdp2

WORLD_SIZE = 2
N_LAYERS = 3
KIND = "transformer_tied"  # the batches of models.global_batch
GROUPINGS = ("blocks", "module lists", "tied weight in a list")
CHECKPOINTS = ("composable checkpoint", "torch.utils.checkpoint", "checkpoint_wrapper")


def _build(tied: bool) -> Transformer:
    torch.manual_seed(0)
    return Transformer(transformer_args(weight_tying=tied, n_layers=N_LAYERS))


def _sharded(grouping: str, how: str, reshard: bool | int) -> nn.Module:
    model = _build(tied=grouping != "module lists")
    if how == "composable checkpoint":
        for block in model.layers:
            checkpoint(block)
    elif how == "torch.utils.checkpoint":
        model.checkpoint_activations = True  # the Transformer's own option
    else:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    shard = {"reshard_after_forward": reshard}
    if grouping == "module lists":
        fsdp2.fully_shard(model.layers[0], **shard)
        fsdp2.fully_shard([model.layers[1], model.layers[2]], **shard)
        fsdp2.fully_shard([model.tok_embeddings, model.pos_embeddings], **shard)
        fsdp2.fully_shard([model.norm, model.output], **shard)
    else:
        if grouping == "tied weight in a list":
            fsdp2.fully_shard([model.tok_embeddings, model.output], **shard)
        for block in model.layers:
            fsdp2.fully_shard(block, **shard)
    fsdp2.fully_shard(model, **shard)  # "blocks": the root owns the tied weight
    return model


def _train(rank: int, world_size: int, grouping: str, how: str, reshard: bool | int) -> None:
    ref = _build(tied=grouping != "module lists")
    model = _sharded(grouping, how, reshard)
    recomputed = []
    attention = next(
        m
        for n, m in model.named_modules()
        if n.replace("_checkpoint_wrapped_module.", "") == "layers.0.attention"
    )
    attention.register_forward_hook(lambda *_: recomputed.append(None))
    optims = [make_optimizer(m) for m in (ref, model)]
    for step in range(3):
        batch = global_batch(KIND, step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *local_batch(batch, rank, world_size))
        loss.backward()
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    assert len(recomputed) == 2 * 3, f"the attention ran {len(recomputed)} times in 3 steps"
    for name, param in full_params(model).items():
        ref_name = name.replace("_checkpoint_wrapped_module.", "")
        assert_close(param, ref.get_parameter(ref_name), **REF_TOL, msg=lambda m, n=name: n)


def _grid(rank: int, world_size: int, grouping: str) -> None:
    for how in CHECKPOINTS:
        for reshard in (True, False, 2):
            with labelled(f"{grouping}, {how}, reshard_after_forward={reshard}"):
                _train(rank, world_size, grouping, how, reshard)


@pytest.mark.distributed
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_activation_checkpointing_with_every_grouping(grouping: str, tmp_path: Path) -> None:
    """Each checkpointing method with each resharding policy (root included)
    recomputes the blocks and trains like the reference for this grouping."""
    run_ranks(_grid, WORLD_SIZE, tmp_path, grouping)
