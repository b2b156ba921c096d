"""``shard_placement_fn``: parameters sharded on a dim other than 0, against the
unsharded reference trained on the global batch (DDP math), at world sizes 2
and 4 and with HSDP on a 2x2 mesh.

The model has "expert" weights whose dim 0 (2 experts) is too small to shard
over 4 ranks: they go on Shard(1) (or Shard(-1), their last dim), as does the
input Linear's weight (Shard(-1) on an even last dim). Everything else stays
on dim 0, some of it uneven (5 output rows, 2 expert biases: empty shards at
world size 4). See tests/models.py for why the reference is trained on the
global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import labelled, run_ranks
from error_model import (
    EXACT,
    REF_TOL,
    check_grads_against_torch,
    check_losses_equal,
    copy_local_shards,
    rank_sum_bounds,
)
from models import global_mean, local_batch, make_optimizer
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing import assert_close

import fsdp2

pytestmark = pytest.mark.distributed

STEPS = 3
BATCH = 8  # global: divisible by 2 and 4
IN_DIM, DIM, HIDDEN, OUT_DIM, EXPERTS = 12, 16, 8, 5, 2
# What shard_placement_fn returns per parameter name; the rest get None (dim 0).
# Every dim here splits evenly over 2 and 4 ranks: 12 (inp.weight's last dim),
# 16 (DIM) and 8 (HIDDEN).
SHARD_ON = {
    "inp.weight": -1,  # (16, 12): dim 1
    "layers.0.w1": 1,  # (2, 16, 8)
    "layers.0.w2": 1,  # (2, 8, 16)
    "layers.1.w1": 1,
    "layers.1.w2": -1,  # (2, 8, 16): dim 2, the last
}


class ExpertBlock(nn.Module):
    """Every token through every expert (dense), summed: a residual MLP with
    batched weights. ``w1`` is used through ``torch.bmm``, ``w2`` through einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM**0.5)
        self.b1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN) * 0.1)  # dim 0 of 2: uneven at 4
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).expand(EXPERTS, -1, -1)  # (experts, batch, dim)
        h = F.relu(torch.bmm(h, self.w1) + self.b1[:, None, :])
        return x + torch.einsum("ebh,ehd->bd", h, self.w2)


class ExpertModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, DIM)
        self.layers = nn.ModuleList(ExpertBlock() for _ in range(2))
        self.out = nn.Linear(DIM, OUT_DIM)  # 5 rows: uneven on dim 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _build(seed: int = 0) -> ExpertModel:
    torch.manual_seed(seed)
    return ExpertModel()


def _shard_dim(name: str, param: torch.Tensor) -> int:
    """The dim ``name`` should end up sharded on (negative dims resolved)."""
    return SHARD_ON.get(name, 0) % param.dim()


def _shard(
    model: ExpertModel,
    mesh: DeviceMesh,
    fully_shard: Callable[..., nn.Module] = fsdp2.fully_shard,
    **kwargs: Any,
) -> ExpertModel:
    """One group per block, then the root; SHARD_ON through shard_placement_fn.
    ``fully_shard`` is fsdp2's or torch's."""
    by_id = {id(p): Shard(SHARD_ON[n]) for n, p in model.named_parameters() if n in SHARD_ON}

    def placement(param: nn.Parameter) -> Shard | None:
        return by_id.get(id(param))

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement, **kwargs)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement, **kwargs)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, IN_DIM, generator=gen), torch.randn(BATCH, OUT_DIM, generator=gen)


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(inputs), targets)


def _chunk(full: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """``torch.chunk(full, world_size, dim)[rank]``, empty past the last chunk."""
    chunks = torch.chunk(full, world_size, dim=dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, full.size(dim), 0)


def _check_params(model: nn.Module, ref: nn.Module, mesh: DeviceMesh, exact: bool) -> None:
    """Placements are (Shard(d),) or (Replicate(), Shard(d)) with d from SHARD_ON;
    the local shard is torch.chunk's piece of the reference on dim d, contiguous;
    the full tensor is the reference. ``exact``: bit for bit (before training)."""
    tol = EXACT if exact else REF_TOL
    world_size, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    replicated = (Replicate(),) if mesh.ndim == 2 else ()
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params)
    for name, param in model.named_parameters():
        expected_ref = ref_params[name].detach()
        dim = _shard_dim(name, expected_ref)
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}"
        assert param.placements == (*replicated, Shard(dim)), f"{name}: {param.placements}"
        assert param.shape == expected_ref.shape, f"{name}: global shape {param.shape}"
        local = param.to_local()
        expected = _chunk(expected_ref, dim, rank, world_size)
        assert local.shape == expected.shape, (
            f"{name}: local shape {tuple(local.shape)}, torch.chunk on dim {dim} gives "
            f"{tuple(expected.shape)}"
        )
        assert local.is_contiguous(), f"{name}: local shard is not contiguous"
        assert_close(local, expected, **tol, msg=lambda m, n=name: f"{n} local shard: {m}")
        assert_close(param.full_tensor(), expected_ref, **tol, msg=lambda m, n=name: f"{n}: {m}")


def _check_grads(model: nn.Module, ref: nn.Module) -> None:
    for name, param in model.named_parameters():
        grad = param.grad
        assert isinstance(grad, DTensor), f"{name}.grad is {type(grad).__name__}"
        assert grad.placements == param.placements, f"{name}.grad placements {grad.placements}"
        assert grad.to_local().shape == param.to_local().shape, f"{name}.grad local shape"
        assert_close(
            grad.full_tensor(),
            ref.get_parameter(name).grad,
            **REF_TOL,
            msg=lambda m, n=name: f"{n}.grad vs the reference: {m}",
        )


def _train(
    model: nn.Module,
    ref: nn.Module,
    mesh: DeviceMesh,
    accumulate: bool = False,
    first_step: int = 0,
) -> None:
    """STEPS SGD steps on model and ref, checking the loss and the grads every
    step. ``accumulate``: two micro-batches per step, the first with gradient
    sync off (no sharded grad after it)."""
    rank, world_size = mesh.get_rank(), mesh.size()
    optims = make_optimizer(ref), make_optimizer(model)
    for step in range(first_step, first_step + STEPS):
        micro = (2 * step, 2 * step + 1) if accumulate else (step,)
        for i, seed in enumerate(micro):
            last = i == len(micro) - 1
            batch = _batch(seed)
            ref_loss = _loss(ref, *batch)
            ref_loss.backward()
            model.set_requires_gradient_sync(last)
            loss = _loss(model, *local_batch(batch, rank, world_size))
            loss.backward()
            assert_close(
                global_mean(loss, world_size),
                ref_loss.detach(),
                **REF_TOL,
                msg=lambda m, s=step, i=i: f"step {s}, micro-batch {i}: loss: {m}",
            )
            if not last:
                for name, param in model.named_parameters():
                    assert param.grad is None, f"step {step}: {name}.grad before the sync"
        with labelled(f"step {step}"):
            _check_grads(model, ref)
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _against_torch(mesh: DeviceMesh) -> None:
    """With the same shard_placement_fn as torch's fully_shard and from the same
    parameters, for STEPS steps: the same placements and local shard shapes,
    equal local losses, grads within the error model's bound."""
    rank, world_size = mesh.get_rank(), mesh.size()
    model = _shard(_build(), mesh)
    torch_model = _shard(_build(), mesh, torch_fully_shard)
    replica = _build()
    optim = make_optimizer(model)
    for step in range(STEPS):
        when = f"step {step}"
        batch = local_batch(_batch(step), rank, world_size)
        # torch's model from fsdp2's parameters: tests/error_model.py, point 2.
        copy_local_shards(model, torch_model)
        bounds = rank_sum_bounds(replica, model, _loss, batch, world_size)
        loss, torch_loss = _loss(model, *batch), _loss(torch_model, *batch)
        loss.backward()
        torch_loss.backward()
        check_losses_equal(loss, torch_loss, when)
        for name, param in model.named_parameters():
            torch_param = torch_model.get_parameter(name)
            assert param.placements == torch_param.placements, (name, torch_param.placements)
            assert param.grad.placements == torch_param.grad.placements, name
        check_grads_against_torch(model, torch_model, bounds, when)
        optim.step()
        optim.zero_grad()
        torch_model.zero_grad()


def _hsdp(world_size: int) -> None:
    """A (replicate, shard) mesh: the shard group is half the world."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    ref = _build()
    model = _shard(_build(), mesh)
    assert model.layers[0].w1.placements == (Replicate(), Shard(1))
    _check_params(model, ref, mesh, exact=True)
    _train(model, ref, mesh)
    _check_params(model, ref, mesh, exact=False)


def _parity(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    cases = [("default", None, False), ("False", False, False), ("default", None, True)]
    if world_size == 4:
        cases.append(("2", 2, False))
    for label, reshard, accumulate in cases:
        with labelled(f"reshard_after_forward={label}, no-sync micro-batch={accumulate}"):
            ref = _build()
            model = _shard(_build(), mesh, reshard_after_forward=reshard)
            _check_params(model, ref, mesh, exact=True)
            _train(model, ref, mesh, accumulate)
            _check_params(model, ref, mesh, exact=False)

    with labelled("against torch's fully_shard"):
        _against_torch(mesh)

    with labelled("load_state_dict of full tensors"):
        model = _shard(_build(), mesh)
        other = _build(seed=1)  # different values, same shapes
        model.load_state_dict(other.state_dict())
        _check_params(model, other, mesh, exact=True)
        # The loaded values are what forward all-gathers: training matches.
        _train(model, other, mesh, first_step=STEPS)
        _check_params(model, other, mesh, exact=False)

    with labelled("load_state_dict of DTensors sharded on dim 0"):
        source = _build(seed=1)
        for layer in source.layers:
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(source, mesh=mesh)  # no shard_placement_fn: all Shard(0)
        model = _shard(_build(), mesh)
        model.load_state_dict(source.state_dict())  # DTensor redistributes to Shard(d)
        _check_params(model, _build(seed=1), mesh, exact=True)

    if world_size == 4:
        with labelled("HSDP on a 2x2 mesh"):
            _hsdp(world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_placement_parity(world_size: int, tmp_path: Path) -> None:
    """Expert weights on Shard(1)/Shard(-1) and a Linear weight on Shard(-1),
    the rest on (partly uneven) dim 0: placements and local shards are
    torch.chunk's on that dim; losses every step, grads' full tensors and
    trained parameters match the reference (1e-5) with reshard_after_forward
    None, False and 2 (world size 4), and with a first micro-batch under
    set_requires_gradient_sync(False); from the same parameters, local shard
    shapes and losses equal torch's fully_shard's with the same function and
    grads are within the error model's bound (tests/error_model.py).
    load_state_dict of a plain model's full tensors gives its values exactly,
    and training from them matches it; so does load_state_dict of a
    Shard(0)-sharded copy's DTensors. At world size 4, HSDP on a 2x2 (replicate, shard) mesh too: expert weights are
    placed (Replicate(), Shard(1)) holding torch.chunk's piece over the shard
    group, and training matches the reference."""
    run_ranks(_parity, world_size, tmp_path)
