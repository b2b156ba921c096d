"""``fully_shard(model, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``:
parameters already DTensors on the whole mesh (tensor parallel on one axis,
``Replicate()`` on the data-parallel ones) are sharded over the named
data-parallel axes. On 4 ranks, against the unsharded reference (DDP math)
and torch's fully_shard: FSDP over "dp" of a (dp, tp) mesh, HSDP over
(replicate, shard) axes, and two shard axes flattened into one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, run_ranks
from error_model import REF_TOL
from models import make_optimizer
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing import assert_close

import fsdp2
from fsdp2 import DataParallelMeshDims

IN, HIDDEN = 6, 10


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


def _distributed(mesh: DeviceMesh, tp_axis: int | None) -> MLP:
    """The MLP with DTensor parameters on all of ``mesh``: column-wise ``up`` and
    row-wise ``down`` on ``tp_axis`` (if any), ``Replicate()`` elsewhere."""
    model = MLP()
    tp = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
    for name, param in list(model.named_parameters()):
        placements = [Replicate()] * mesh.ndim
        if tp_axis is not None:
            placements[tp_axis] = tp.get(name, Replicate())
        module, attr = name.split(".")
        dtensor = distribute_tensor(param.detach(), mesh, placements)
        setattr(getattr(model, module), attr, nn.Parameter(dtensor))
    return model


def _train(
    rank: int,
    mesh: DeviceMesh,
    models: list[nn.Module],
    batch_axes: tuple[str, ...],
    tp_axis: int | None,
    plain: tuple[nn.Module, ...] = (),
) -> None:
    """Each model on this rank's slice of the global batch (sliced over the
    data-parallel axes, whole over the TP axis); the reference on all of it.
    ``plain`` models compute with plain tensors (native FSDP)."""
    ref = MLP()
    optims = [make_optimizer(m) for m in (ref, *models)]
    dp_size = 1
    dp_index = 0
    for name in batch_axes:
        dp_index = dp_index * mesh.size(mesh.mesh_dim_names.index(name)) + mesh.get_local_rank(name)
        dp_size *= mesh.size(mesh.mesh_dim_names.index(name))
    batch_placements = [Replicate()] * mesh.ndim
    batch_placements[mesh.mesh_dim_names.index(batch_axes[0])] = Shard(0)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, IN, generator=gen), torch.randn(8, IN, generator=gen)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        local_x, local_y = x.chunk(dp_size)[dp_index], y.chunk(dp_size)[dp_index]
        losses = []
        for model in models:
            if model in plain:
                out = model(local_x)
            elif tp_axis is None:  # local compute, the data-parallel axes replicated
                out = model(DTensor.from_local(local_x, mesh, [Replicate()] * mesh.ndim)).to_local()
            else:
                inputs = DTensor.from_local(local_x, mesh, batch_placements, run_check=False)
                out = model(inputs).redistribute(mesh, batch_placements).to_local()
            loss = F.mse_loss(out, local_y)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total / dist.get_world_size())
            for name, param in model.named_parameters():
                expected = ref.get_parameter(name).grad
                assert_close(param.grad.full_tensor(), expected, **REF_TOL, msg=name)
        for loss in losses:
            assert_close(loss, ref_loss.detach(), **REF_TOL, msg=f"step {step}")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for model in models:
        for (name, param), other in zip(
            models[0].named_parameters(), model.parameters(), strict=True
        ):
            assert param.placements == other.placements, name
            expected = ref.get_parameter(name)
            assert_close(other.full_tensor(), expected, **REF_TOL, msg=f"{name} after 3 steps")


def _spmd(rank: int, world_size: int) -> None:
    with labelled("FSDP over 'dp' of a (dp, tp) mesh, against torch's"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        ours, theirs = _distributed(mesh, tp_axis=1), _distributed(mesh, tp_axis=1)
        fsdp2.fully_shard(ours, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        torch_fully_shard(theirs, mesh=mesh, dp_mesh_dims=TorchDataParallelMeshDims(shard="dp"))
        # The data-parallel chunk of a TP chunk (_StridedShard) where both shard dim 0.
        assert [str(p.placements) for p in ours.parameters()] == [
            str(p.placements) for p in theirs.parameters()
        ]
        _train(rank, mesh, [ours, theirs], ("dp",), tp_axis=1)
    with labelled("HSDP: replicate over 'dpr', shard over 'dps'"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dpr", "dps"))
        spmd = _distributed(mesh, tp_axis=None)
        dims = DataParallelMeshDims(shard="dps", replicate="dpr")
        fsdp2.fully_shard(spmd, mesh=mesh, dp_mesh_dims=dims)
        assert all(p.placements == (Replicate(), Shard(0)) for p in spmd.parameters())
        native = MLP()
        fsdp2.fully_shard(native, mesh=mesh)  # native HSDP on the same 2D mesh
        _train(rank, mesh, [spmd, native], ("dpr", "dps"), tp_axis=None, plain=(native,))
    with labelled("two shard axes flattened into one"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        spmd = _distributed(mesh, tp_axis=None)
        fsdp2.fully_shard(spmd, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")))
        param = spmd.up.weight
        assert param.device_mesh.ndim == 1 and param.placements == (Shard(0),)
        assert param.to_local().shape == (torch.chunk(torch.empty(HIDDEN), 4)[rank].numel(), IN)
        _train(rank, mesh, [spmd], ("a", "b"), tp_axis=None)


@pytest.mark.distributed
def test_dp_mesh_dims_train_like_the_reference_and_torch(tmp_path: Path) -> None:
    """FSDP over the 'dp' axis of a 2 x 2 (dp, tp) mesh with column/row-wise TP
    DTensors: the same placements as torch's fully_shard, losses and gradients
    equal to the reference and torch's; HSDP over named (replicate, shard) axes
    equals native HSDP; two shard axes are flattened into one 4-rank axis."""
    run_ranks(_spmd, 4, tmp_path)


def test_dp_mesh_dims_validation() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dims = DataParallelMeshDims(shard="dp")
        with pytest.raises(
            ValueError, match=r"must be DTensors on the full SPMD mesh.*'up\.weight'"
        ):
            fsdp2.fully_shard(MLP(), mesh=mesh, dp_mesh_dims=dims)
        sharded_on_dp = _distributed(mesh, tp_axis=0)
        with pytest.raises(ValueError, match=r"Expected Replicate\(\) on DP dim 'dp' \(index 0\)"):
            fsdp2.fully_shard(sharded_on_dp, mesh=mesh, dp_mesh_dims=dims)
        model = _distributed(mesh, tp_axis=1)
        with pytest.raises(ValueError, match=r"'pp' not found in mesh\.mesh_dim_names"):
            fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="pp"))
        with pytest.raises(NotImplementedError, match="replicate axes only"):
            fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
        with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 \(an int\)"):
            fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2)
        with pytest.raises(ValueError, match="At least one of shard or replicate"):
            DataParallelMeshDims()
