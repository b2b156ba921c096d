"""Training parity: fsdp2 against an unsharded reference (DDP math) and against
torch's own ``fully_shard``, at world sizes 1, 2 and 4.

Each test spawns one set of ranks and checks several things in it (spawning
costs seconds). See tests/models.py for the models, the data and why the
reference is trained on the global batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist import labelled, run_ranks
from error_model import (
    REF_TOL,
    check_grads_against_torch,
    check_losses_equal,
    copy_local_shards,
    rank_sum_bounds,
)
from models import (
    MODEL_KINDS,
    build_model,
    expected_shard,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor, Shard
from torch.testing import assert_close

pytestmark = pytest.mark.distributed

WORLD_SIZES = [1, 2, 4]
NUM_STEPS = 5


def _check_sharded_params(model: nn.Module, ref: nn.Module, rank: int, world_size: int) -> None:
    """Every parameter is a Shard(0) DTensor whose local shard is torch.chunk's
    piece of the reference and whose full tensor is the reference."""
    ref_params = dict(ref.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert names == list(ref_params), f"parameter names changed: {names} vs {list(ref_params)}"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}, not a DTensor"
        assert param.placements == (Shard(0),), f"{name}: placements {param.placements}"
        ref_param = ref_params[name].detach()
        assert param.shape == ref_param.shape, f"{name}: global shape {param.shape}"
        local = param.to_local()
        expected = expected_shard(ref_param, rank, world_size)
        assert local.shape == expected.shape, (
            f"{name}: local shard {tuple(local.shape)}, torch.chunk gives {tuple(expected.shape)}"
        )
        assert_close(local, expected, **REF_TOL, msg=lambda m, n=name: f"{n} local shard: {m}")
        assert_close(
            param.full_tensor(), ref_param, **REF_TOL, msg=lambda m, n=name: f"{n} full: {m}"
        )


def _check_sharded_grads(model: nn.Module, ref: nn.Module) -> None:
    """Every trainable parameter's grad is a Shard(0) DTensor shaped like the
    parameter whose full tensor is the reference's grad. (Comparing the
    gradients themselves catches what the parameters would show only after
    many steps.)"""
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad
        assert isinstance(grad, DTensor), f"{name}.grad is {type(grad).__name__}, not a DTensor"
        assert grad.placements == (Shard(0),), f"{name}.grad placements {grad.placements}"
        assert grad.to_local().shape == param.to_local().shape, f"{name}.grad local shape"
        assert_close(
            grad.full_tensor(),
            ref.get_parameter(name).grad,
            **REF_TOL,
            msg=lambda m, n=name: f"{n}.grad vs the reference: {m}",
        )


def _check_tied(model: nn.Module, when: str) -> None:
    assert model.tok_embeddings.weight is model.output.weight, (
        f"{when}: tok_embeddings.weight and output.weight are no longer the same Parameter"
    )


def _train_against_reference_and_torch(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for kind in MODEL_KINDS:
        with labelled(kind):
            _train_one_kind(rank, world_size, mesh, kind)


def _train_one_kind(rank: int, world_size: int, mesh: DeviceMesh, kind: str) -> None:
    ref = build_model(kind)
    model = shard_model(build_model(kind), mesh=mesh)
    torch_model = shard_model(build_model(kind), torch_fully_shard, mesh=mesh)
    replica = build_model(kind)  # the local gradients' sizes, for the bound against torch
    tied = kind == "transformer_tied"
    if tied:
        _check_tied(model, "after fully_shard")
    _check_sharded_params(model, ref, rank, world_size)
    optims = [make_optimizer(m) for m in (ref, model)]

    for step in range(NUM_STEPS):
        when = f"step {step}"
        batch = global_batch(kind, step)
        local = local_batch(batch, rank, world_size)
        copy_local_shards(model, torch_model)
        bounds = rank_sum_bounds(replica, model, mean_loss, local, world_size)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *local)
        loss.backward()
        torch_loss = mean_loss(torch_model, *local)
        torch_loss.backward()

        with labelled(when):
            _check_sharded_grads(model, ref)
        check_grads_against_torch(model, torch_model, bounds, when)
        check_losses_equal(loss, torch_loss, when)
        assert_close(
            global_mean(loss, world_size),
            ref_loss.detach(),
            **REF_TOL,
            msg=lambda m, s=step: f"step {s}: loss vs the unsharded reference: {m}",
        )
        for optim in optims:
            optim.step()
            optim.zero_grad()
        torch_model.zero_grad()

    if tied:
        _check_tied(model, f"after {NUM_STEPS} steps")
    _check_sharded_params(model, ref, rank, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_parity(world_size: int, tmp_path: Path) -> None:
    """For the MLP and the transformer with tied and untied embeddings: losses
    and gradients at every step and parameters after 5 SGD steps match the
    unsharded reference (1e-5); from the same parameters, losses equal torch's
    fully_shard's and gradients are within the error model's bound of a sum over
    ranks in another order (tests/error_model.py)."""
    run_ranks(_train_against_reference_and_torch, world_size, tmp_path)


# Frozen before sharding: a whole group (MLP layers.1, whose gradients still flow
# through to layers.0), and part of a group (the first block's attention and the
# root's position embedding).
FROZEN = {
    "mlp": ("layers.1.weight", "layers.1.bias"),
    "transformer_untied": (
        "layers.0.attention.wq.weight",
        "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight",
        "pos_embeddings.weight",
    ),
}


def _train_with_frozen_params(
    rank: int, world_size: int, mesh: DeviceMesh, kind: str, frozen: tuple[str, ...]
) -> None:
    ref, model = build_model(kind), build_model(kind)
    for m in (ref, model):
        for name, param in m.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
    shard_model(model, mesh=mesh)
    initial = {name: p.detach().clone() for name, p in ref.named_parameters()}
    optims = [make_optimizer(m) for m in (ref, model)]
    for step in range(NUM_STEPS):
        batch = global_batch(kind, step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *local_batch(batch, rank, world_size))
        loss.backward()
        for name, param in model.named_parameters():
            if name in frozen:
                assert not param.requires_grad, f"{name} is trainable after sharding"
                assert param.grad is None, f"{name} got a gradient at step {step}"
        with labelled(f"step {step}"):
            _check_sharded_grads(model, ref)
        assert_close(
            global_mean(loss, world_size),
            ref_loss.detach(),
            **REF_TOL,
            msg=lambda m, s=step: f"step {s}: loss: {m}",
        )
        for optim in optims:
            optim.step()
            optim.zero_grad()
    _check_sharded_params(model, ref, rank, world_size)
    params = full_params(model)
    for name in frozen:
        assert torch.equal(params[name], initial[name]), f"frozen {name} changed"


def _frozen_params(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for kind, frozen in FROZEN.items():
        with labelled(kind):
            _train_with_frozen_params(rank, world_size, mesh, kind, frozen)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_frozen_params(world_size: int, tmp_path: Path) -> None:
    """Parameters frozen before sharding stay frozen, get no gradient and keep
    their values, while the trainable ones still match the reference (trained
    with the same parameters frozen)."""
    run_ranks(_frozen_params, world_size, tmp_path)


def _accumulate_gradients(rank: int, world_size: int, mesh: DeviceMesh, kind: str) -> None:
    ref = build_model(kind)
    model = shard_model(build_model(kind), mesh=mesh)
    optims = [make_optimizer(m) for m in (ref, model)]
    for step in range(2):
        # Two micro-batches per step: two backward calls, no zero_grad between.
        for micro in range(2):
            batch = global_batch(kind, 2 * step + micro)
            mean_loss(ref, *batch).backward()
            mean_loss(model, *local_batch(batch, rank, world_size)).backward()
        with labelled(f"step {step}, grads accumulated over two backward calls"):
            _check_sharded_grads(model, ref)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    _check_sharded_params(model, ref, rank, world_size)


def _gradient_accumulation(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for kind in ("mlp", "transformer_tied"):
        with labelled(kind):
            _accumulate_gradients(rank, world_size, mesh, kind)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_accumulation(world_size: int, tmp_path: Path) -> None:
    """Two forward/backward calls on two micro-batches without zero_grad
    accumulate into the sharded grads like plain PyTorch: their full tensors
    equal the reference's grads accumulated over the two global micro-batches."""
    run_ranks(_gradient_accumulation, world_size, tmp_path)
