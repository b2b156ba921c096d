"""Mixed meshes in one model (MoE-style): experts sharded on an HSDP mesh
(replicate=2, shard=2), the dense part on a 1D mesh of all 4 ranks, trained
together against the unsharded reference (DDP math), with gradient clipping by
``fsdp2.clip_grad_norm_`` over both meshes.

``torch.nn.utils.clip_grad_norm_`` cannot do this (pinned below): it stacks
the per-parameter norms, and DTensors on different meshes do not stack.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import labelled, run_ranks
from error_model import REF_TOL, gamma
from models import full_params, global_mean, local_batch, make_optimizer
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.testing import assert_close

import fsdp2
from fsdp2.base.private_dist import dtensor_from_local_no_grad, dtensor_spec

WORLD_SIZE = 4
STEPS = 3
GLOBAL_BATCH = 8
IN_DIM, DIM, HIDDEN, OUT_DIM, N_EXPERTS = 11, 10, 13, 3, 2
# (norm_type, foreach, max_norm): each max_norm is under half the reference's
# norm at every step (checked), so every step really clips. On CPU foreach=None
# takes the multi-tensor kernels, like True.
CLIP_CASES = (
    (2.0, None, 0.05),
    (1.0, False, 0.5),
    (math.inf, None, 0.01),
    (math.inf, False, 0.01),
)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class TinyMoE(nn.Module):
    """Dense input layer, a softmax gate mixing every expert (dense, hence
    deterministic, routing), a dense head. On 4 ranks the gate (2 rows) and the
    head (3 rows) leave some ranks an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.dense_in = nn.Linear(IN_DIM, DIM)
        self.gate = nn.Linear(DIM, N_EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(N_EXPERTS))
        self.head = nn.Linear(DIM, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.dense_in(x))
        weights = torch.softmax(self.gate(h), dim=-1)  # (batch, experts)
        mixed = sum(weights[:, i : i + 1] * expert(h) for i, expert in enumerate(self.experts))
        return self.head(h + mixed)


def _build() -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(GLOBAL_BATCH, IN_DIM, generator=gen), torch.randn(
        GLOBAL_BATCH, OUT_DIM, generator=gen
    )


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(inputs), targets)


def _meshes() -> tuple[DeviceMesh, DeviceMesh]:
    dense = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    experts = init_device_mesh("cpu", (2, WORLD_SIZE // 2), mesh_dim_names=("rep", "shard"))
    return dense, experts


def _shard(model: TinyMoE, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh) -> TinyMoE:
    for expert in model.experts:
        fsdp2.fully_shard(expert, mesh=expert_mesh)
    fsdp2.fully_shard(model, mesh=dense_mesh)  # the root last: dense_in, gate, head
    return model


def _check_layout(model: TinyMoE, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}"
        tensors = {"param": param} if param.grad is None else {"param": param, "grad": param.grad}
        for what, tensor in tensors.items():
            if name.startswith("experts."):
                mesh, placements = expert_mesh, (Replicate(), Shard(0))
            else:
                mesh, placements = dense_mesh, (Shard(0),)
            assert tensor.device_mesh == mesh, f"{name} {what}: mesh {tensor.device_mesh}"
            assert tensor.placements == placements, f"{name} {what}: {tensor.placements}"


def _check_grads(model: nn.Module, ref: nn.Module) -> None:
    for name, param in model.named_parameters():
        assert_close(
            param.grad.full_tensor(),
            ref.get_parameter(name).grad,
            **REF_TOL,
            msg=lambda m, n=name: f"{n}.grad: {m}",
        )


def _same_on_every_rank(value: torch.Tensor, world_size: int) -> None:
    values = [torch.empty_like(value) for _ in range(world_size)]
    dist.all_gather(values, value)
    assert all(torch.equal(v, values[0]) for v in values), f"ranks disagree: {values}"


def _train_with_clipping(
    rank: int,
    world_size: int,
    meshes: tuple[DeviceMesh, DeviceMesh],
    norm_type: float,
    foreach: bool | None,
    max_norm: float,
    shard=_shard,
) -> None:
    ref, model = _build(), shard(_build(), *meshes)
    _check_layout(model, *meshes)
    optims = make_optimizer(ref), make_optimizer(model)
    for step in range(STEPS):
        with labelled(f"step {step}"):
            batch = _batch(step)
            ref_loss = _loss(ref, *batch)
            ref_loss.backward()
            loss = _loss(model, *local_batch(batch, rank, world_size))
            loss.backward()
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
            _check_layout(model, *meshes)
            _check_grads(model, ref)  # before clipping: the engine's averaging

            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            norm = fsdp2.clip_grad_norm_(model.parameters(), max_norm, norm_type, foreach=foreach)
            assert ref_norm > 2 * max_norm, f"{ref_norm} does not clip much"
            assert type(norm) is torch.Tensor, f"the total norm is a {type(norm).__name__}"
            assert_close(norm, ref_norm, rtol=1e-5, atol=0.0)
            _same_on_every_rank(norm, world_size)
            _check_grads(model, ref)  # after clipping: scaled like the reference's
            for optim in optims:
                optim.step()
                optim.zero_grad()
    for name, param in full_params(model).items():
        assert_close(param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _torch_clip_fails(model: nn.Module) -> None:
    """The reason fsdp2.clip_grad_norm_ exists; if torch learns to do this, the
    docs and this module can point to torch's instead."""
    with pytest.raises(RuntimeError, match="must have the same mesh"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _nonfinite_and_partial(
    rank: int, world_size: int, meshes: tuple[DeviceMesh, DeviceMesh]
) -> None:
    model = _shard(_build(), *meshes)
    _loss(model, *local_batch(_batch(0), rank, world_size)).backward()
    _torch_clip_fails(model)
    # A NaN in one rank's shard of a dense grad reaches every rank's total.
    if rank == 0:
        model.dense_in.weight.grad.to_local()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="total 2.0-norm of the gradients is nan"):
        fsdp2.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    # Not raising: the NaN total is returned and every grad becomes NaN, as in torch.
    norm = fsdp2.clip_grad_norm_(model.parameters(), 1.0)
    assert norm.isnan(), norm
    partial = nn.Parameter(torch.zeros(4))
    partial.grad = DTensor.from_local(torch.ones(4), meshes[0], [Partial()])
    with pytest.raises(ValueError, match=r"placed Partial\(sum\) on mesh axis 0"):
        fsdp2.clip_grad_norm_([partial], 1.0)


class _UnusedAllGather(fsdp2.AllGather):
    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        raise AssertionError("refused before it is ever called")


def _shard_in_one_call(model: TinyMoE, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh) -> TinyMoE:
    """The experts on their own mesh inside the root's one fully_shard call."""
    experts = {id(p) for p in model.experts.parameters()}

    def placement(param: nn.Parameter) -> fsdp2.ShardPlacementResult | None:
        return fsdp2.ShardPlacementResult(None, expert_mesh) if id(param) in experts else None

    fsdp2.fully_shard(model, mesh=dense_mesh, shard_placement_fn=placement)
    return model


def _one_call_two_meshes(rank: int, world_size: int, meshes: tuple[DeviceMesh, DeviceMesh]) -> None:
    model = _shard_in_one_call(_build(), *meshes)
    groups = model._fsdp_state.param_groups
    assert [g.mesh_info.mesh for g in groups] == list(meshes), "one group per mesh, dense first"
    rows = fsdp2.summary(model, print_table=False)
    assert [r.num_params for r in rows] == [6, 8], rows  # dense_in, gate, head; 2 experts
    with pytest.raises(ValueError, match="sharded over 2 meshes"):
        model.set_custom_all_gather(_UnusedAllGather())
    _train_with_clipping(rank, world_size, meshes, 2.0, None, 0.05, shard=_shard_in_one_call)


MANY = 20_000  # gradient tensors in the many-tensors case (an MoE's experts)


def _many_tensors(rank: int, world_size: int, meshes: tuple[DeviceMesh, DeviceMesh]) -> None:
    """20k gradients of 1 to 5 rows (so some ranks hold empty shards), a
    quarter on the HSDP mesh: the norm takes one all-reduce per group of
    gradients (two here), not one per tensor, and the norm and the scaled
    gradients are the full gradients' (float64 reference, error model)."""
    dense, experts = meshes
    gen = torch.Generator().manual_seed(7)  # the same full gradients on every rank
    fulls = [torch.randn(1 + i % 5, 3, generator=gen) for i in range(MANY)]
    # Wrapped without from_local or nn.Parameter: 20k of those take seconds.
    specs: dict[tuple[bool, int], DTensorSpec] = {}
    where = {
        True: (experts, (Replicate(), Shard(0)), experts.get_local_rank(1), experts.size(1)),
        False: (dense, (Shard(0),), dense.get_local_rank(0), dense.size(0)),
    }
    params = []
    for i, full in enumerate(fulls):
        mesh, placements, axis_rank, size = where[i % 4 == 0]
        chunks = torch.chunk(full, size)
        local = chunks[axis_rank] if axis_rank < len(chunks) else full[:0]
        spec = specs.get((i % 4 == 0, full.size(0)))
        if spec is None:
            spec = specs[(i % 4 == 0, full.size(0))] = dtensor_spec(
                mesh, placements, full.shape, full.dtype
            )
        param = dtensor_from_local_no_grad(torch.zeros_like(local), spec)
        param.grad = dtensor_from_local_no_grad(local.clone(), spec)
        params.append(param)
    calls = []
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].numel())
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        norm = fsdp2.clip_grad_norm_(params, max_norm=1.0)
    finally:
        dist.all_reduce = all_reduce
    assert calls == [1, 1], f"all-reduces of {calls} elements: one per group expected"
    exact = torch.cat(fulls).double().norm()
    # The squares summed in some order: within gamma(n) of their sum (error model).
    numel = sum(f.numel() for f in fulls)
    assert abs(norm.double() ** 2 - exact**2) <= 2 * gamma(numel) * exact**2, (norm, exact)
    coef = 1.0 / (norm + 1e-6)
    for i in range(0, MANY, 997):
        assert_close(params[i].grad.full_tensor(), fulls[i] * coef, msg=f"gradient {i}")


def _mixed_meshes(rank: int, world_size: int) -> None:
    meshes = _meshes()
    for norm_type, foreach, max_norm in CLIP_CASES:
        with labelled(f"norm_type={norm_type}, foreach={foreach}, max_norm={max_norm}"):
            _train_with_clipping(rank, world_size, meshes, norm_type, foreach, max_norm)
    with labelled("non-finite norm, Partial grad, torch's clip_grad_norm_"):
        _nonfinite_and_partial(rank, world_size, meshes)
    with labelled("both meshes in one fully_shard call (ShardPlacementResult)"):
        _one_call_two_meshes(rank, world_size, meshes)
    with labelled(f"{MANY} gradient tensors"):
        _many_tensors(rank, world_size, meshes)


@pytest.mark.distributed
def test_moe_mixed_meshes_parity_and_clipping(tmp_path: Path) -> None:
    """Experts on a (replicate=2, shard=2) mesh with (Replicate(), Shard(0))
    params and grads, the dense layers on a 4-rank 1D mesh with (Shard(0),):
    losses, grads (before and after clipping) and trained parameters match the
    unsharded reference. fsdp2.clip_grad_norm_ returns a plain tensor, equal on
    every rank, equal (1e-5 relative) to torch's norm of the reference, for the
    2-, 1- and inf-norms with and without foreach, also where some ranks hold
    empty shards. A NaN on one rank fails error_if_nonfinite on every rank; a
    Partial grad is refused; torch's clip_grad_norm_ raises on mixed meshes.
    The same with both meshes in the root's one fully_shard call, the experts
    placed by a ShardPlacementResult: one group per mesh, same numbers. With
    20k gradient tensors on both meshes: one all-reduce per mesh group, the
    full gradients' norm."""
    run_ranks(_mixed_meshes, WORLD_SIZE, tmp_path)


# -- single process: plain tensors, no process group ---------------------------


def _params_with_grads(shapes: list[tuple[int, ...]]) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape, generator=gen)
        params.append(param)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, math.inf])
@pytest.mark.parametrize("foreach", [None, False, True])
def test_clip_plain_tensors_matches_torch(norm_type: float, foreach: bool | None) -> None:
    """On plain tensors fsdp2.clip_grad_norm_ is torch's: same norm, same clipped grads."""
    shapes = [(5, 3), (7,), (2, 2, 2)]
    ours, theirs = _params_with_grads(shapes), _params_with_grads(shapes)
    max_norm = 0.5
    norm = fsdp2.clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    ref_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=foreach)
    assert ref_norm > max_norm
    assert_close(norm, ref_norm, rtol=1e-6, atol=0.0)
    for mine, ref in zip(ours, theirs, strict=True):
        assert_close(mine.grad, ref.grad, rtol=1e-6, atol=0.0)


def test_clip_edge_cases() -> None:
    """Empty grads are skipped (also for the inf norm, where torch raises); no
    grads give 0; a single tensor is accepted; bad norm types raise."""
    params = _params_with_grads([(3,), (0,)])
    expected = params[0].grad.abs().max()
    assert_close(fsdp2.clip_grad_norm_(params, 10.0, math.inf), expected)
    assert fsdp2.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    single = _params_with_grads([(4,)])[0]
    assert_close(fsdp2.clip_grad_norm_(single, 10.0), single.grad.norm())
    for bad in (0.0, -1.0, -math.inf):
        with pytest.raises(ValueError, match="positive norm_type"):
            fsdp2.clip_grad_norm_(params, 1.0, bad)
