"""``min_numel_to_shard``: parameters below the threshold stay whole on every
rank as ``Replicate()`` DTensors, are never all-gathered, and have their
gradients all-reduced; training matches the unsharded reference."""

from pathlib import Path

import pytest
import torch
from dist import labelled, run_ranks
from error_model import REF_TOL
from models import (
    build_model,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing import assert_close

import fsdp2

STEPS = 3
THRESHOLD = 100  # biases, norm weights and the MLP's 7-row head bias; not the weights


def _train(rank: int, world_size: int, mesh, kind: str, **kwargs) -> None:
    ref = build_model(kind)
    model = shard_model(build_model(kind), mesh=mesh, min_numel_to_shard=THRESHOLD, **kwargs)
    dp = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    replicated_bytes = 0
    for name, param in model.named_parameters():
        expected = ref.get_parameter(name)
        if expected.numel() < THRESHOLD:
            assert param.placements == (Replicate(),) * mesh.ndim, (name, param.placements)
            assert torch.equal(param.to_local(), expected), name
            replicated_bytes += expected.numel() * expected.element_size()
        else:
            assert param.placements == dp, (name, param.placements)
    assert replicated_bytes > 0
    optims = make_optimizer(ref), make_optimizer(model)
    with fsdp2.comm_stats(model) as stats:
        for step in range(STEPS):
            batch = global_batch(kind, step)
            ref_loss = mean_loss(ref, *batch)
            ref_loss.backward()
            loss = mean_loss(model, *local_batch(batch, rank, world_size))
            loss.backward()
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
            for name, param in model.named_parameters():
                expected = ref.get_parameter(name).grad
                assert_close(param.grad.full_tensor(), expected, **REF_TOL, msg=name)
            for optim in optims:
                optim.step()
                optim.zero_grad()
    for name, param in full_params(model).items():
        assert_close(param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")
    # Replicated parameters are never all-gathered: every group's all-gather
    # moves only its sharded parameters (each call: world size * padded slots).
    shard_world = mesh.size(mesh.ndim - 1)
    for state in (m._fsdp_state for m in model.modules() if isinstance(m, fsdp2.FSDPModule)):
        if not state.param_groups:  # the MLP's root owns no parameters
            continue
        group = state.param_groups[0]
        name = group.name
        sharded = [p for p in group.fsdp_params if p.sharded_param.placements[-1] != Replicate()]
        gathered = sum(p.layout.slot_numel for p in sharded) * shard_world * 4
        step_stats = stats.steps[-1][name]
        ag, ar = step_stats.all_gather, step_stats.all_reduce
        assert ag.bytes == ag.count * gathered, (name, ag, gathered)
        n_replicated = len(group.fsdp_params) - len(sharded)
        if mesh.ndim == 1:  # one all-reduce of the replicated gradients per backward
            assert ar.count == (1 if n_replicated else 0), (name, ar)


def _replicate_small(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for kind in ("mlp", "transformer_untied"):
        for reshard in (True, 2, False):
            with labelled(f"{kind}, reshard_after_forward={reshard}"):
                _train(rank, world_size, mesh, kind, reshard_after_forward=reshard)
    hsdp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    with labelled("HSDP"):
        _train(rank, world_size, hsdp, "transformer_untied")


@pytest.mark.distributed
def test_min_numel_to_shard_parity(tmp_path: Path) -> None:
    """Small parameters are Replicate() with their full value on every rank; the
    all-gathers carry only the sharded ones; losses, gradients and trained
    parameters match the reference on 4 ranks, with resharding after forward
    on, off and to 2 ranks, and under HSDP (2 x 2)."""
    run_ranks(_replicate_small, 4, tmp_path)
