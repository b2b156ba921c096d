"""HSDP: a 2D mesh (replicate, shard) on 4 ranks (2 x 2), against the unsharded
reference trained on the global batch (DDP math)."""

from pathlib import Path

import pytest
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

STEPS = 3


def _hsdp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    for kind in ("mlp", "transformer_untied"):
        for reshard, accumulate in ((True, False), (2, False), (True, True)):
            case = f"{kind}, reshard_after_forward={reshard}, deferred all-reduce={accumulate}"
            with labelled(case):
                ref = build_model(kind)
                model = shard_model(build_model(kind), mesh=mesh, reshard_after_forward=reshard)
                for param in model.parameters():
                    assert param.placements == (Replicate(), Shard(0)), param.placements
                optims = make_optimizer(ref), make_optimizer(model)
                for step in range(STEPS):
                    # Accumulating: two micro-batches, the first without the all-reduce
                    # across replicas (the reduce-scatter inside the shard group still runs).
                    micro = (2 * step, 2 * step + 1) if accumulate else (step,)
                    for i, seed in enumerate(micro):
                        batch = global_batch(kind, seed)
                        ref_loss = mean_loss(ref, *batch)
                        ref_loss.backward()
                        model.set_requires_all_reduce(i == len(micro) - 1)
                        loss = mean_loss(model, *local_batch(batch, rank, world_size))
                        loss.backward()
                        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
                    for name, grad in ((n, p.grad) for n, p in model.named_parameters()):
                        expected = ref.get_parameter(name).grad
                        assert_close(
                            grad.full_tensor(),
                            expected,
                            **REF_TOL,
                            msg=lambda m, n=name: f"{n}: {m}",
                        )
                    for optim in optims:
                        optim.step()
                        optim.zero_grad()
                for name, param in full_params(model).items():
                    assert_close(
                        param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: f"{n}: {m}"
                    )


@pytest.mark.distributed
def test_hsdp_parity(tmp_path: Path) -> None:
    """Parameters are placed (Replicate(), Shard(0)); gradients (reduce-scatter in
    the shard group, all-reduce across replicas, also deferred with
    set_requires_all_reduce(False)) and trained parameters match the reference,
    with resharding after forward to the whole shard group and to 2 ranks."""
    run_ranks(_hsdp, 4, tmp_path)
