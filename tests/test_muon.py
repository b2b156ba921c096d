"""fsdp2.optim.Muon against torch.optim.Muon on the unsharded model.

Error model. The optimizer's claim is "the same arithmetic on the same whole
matrix": given the same gradients, every parameter after a step is bitwise
torch.optim.Muon's (momentum, weight decay and the update are elementwise, so
splitting rows changes no bit; Newton-Schulz runs once, on the owner, on the
reassembled matrix in torch's layout). The gradients themselves are not bitwise
the unsharded run's: the sharded backward sums the global batch in another
order (rank-local means, then a reduce-scatter), a few fp32 ulps apart,
checked below to REF_TOL (tests/error_model.py). Newton-Schulz then runs in
bfloat16, where such a difference can flip the rounding of an input element (2**-8 relative) and the iteration
spreads it over the matrix: after a step the parameters of two runs whose
gradients differ by 1 ulp can differ by up to lr * ~2**-7, far above fp32 noise.
(Measured, stepping each optimizer on its own gradients, tied transformer, 2
ranks: 1.2e-7 after steps 1-2, then 1.56e-4 = 0.02 * 2**-7 at step 3, 8.6e-4 by
step 4: one bf16 rounding flip, then its spread.)
So each step the reference trains on the global batch, its gradients are
checked against the sharded ones, and then both optimizers step on the same
(the sharded run's, gathered) gradients and must agree exactly.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from dist import fake_world, labelled, run_ranks
from error_model import REF_TOL
from models import build_model, global_batch, local_batch, mean_loss, shard_model
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing import assert_close

import fsdp2
from fsdp2.optim import Muon, assign_owners, newton_schulz_cost
from fsdp2.optim.exchange import rows_per_rank
from fsdp2.optim.owners import owner_loads

# fp32 gradients of 8 samples summed in another order: a few ulps (~1e-7 relative).
STEPS = 3
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}


def _optimizers(model: nn.Module, muon: type[torch.optim.Optimizer], **muon_kwargs):
    """The recipe: Muon for the 2-D matrices, AdamW for the rest."""
    matrices = [p for p in model.parameters() if p.ndim == 2 and p.requires_grad]
    others = [p for p in model.parameters() if p.ndim != 2 and p.requires_grad]
    optims = [muon(matrices, **{**MUON, **muon_kwargs})]
    if others:
        optims.append(torch.optim.AdamW(others, lr=1e-2, foreach=False))
    return optims


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _step_in_parity(model, ref, optims, ref_optims, kind, step, rank, world_size) -> None:
    """One step: grads checked against the global-batch reference, then both
    optimizers step on the same gradients."""
    batch = global_batch(kind, step)
    mean_loss(ref, *batch).backward()
    mean_loss(model, *local_batch(batch, rank, world_size)).backward()
    for name, param in model.named_parameters():
        ref_param = ref.get_parameter(name)
        if param.grad is None:
            assert ref_param.grad is None, name
            continue
        grad = param.grad.full_tensor()
        assert_close(grad, ref_param.grad, **REF_TOL, msg=lambda m, n=name: f"{n}.grad: {m}")
        ref_param.grad = grad.clone()
    for optim in (*optims, *ref_optims):
        optim.step()
        optim.zero_grad()


def _check_equal(model: nn.Module, ref: nn.Module) -> None:
    for name, param in model.named_parameters():
        full = _full(param.detach())
        expected = ref.get_parameter(name).detach()
        assert torch.equal(full, expected), f"{name}: max diff {(full - expected).abs().max()}"


def _build(kind: str, frozen: bool) -> nn.Module:
    model = build_model(kind)
    if frozen:
        model.layers[1].weight.requires_grad_(False)
    return model


def _parity(rank: int, world_size: int) -> None:
    calls = []
    original = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        # min_numel_to_shard=600 leaves two of the MLP's weights Replicate()d.
        small_replicated = functools.partial(fsdp2.fully_shard, min_numel_to_shard=600)
        for kind, frozen, kwargs, fully_shard in (
            ("mlp", True, {}, fsdp2.fully_shard),
            ("mlp", False, {}, small_replicated),
            (
                "mlp",
                False,
                {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
                fsdp2.fully_shard,
            ),
            ("transformer_tied", False, {}, fsdp2.fully_shard),
            ("mlp", False, {}, torch_fully_shard),  # any Shard(0) DTensor will do
        ):
            with labelled(f"{kind}, frozen={frozen}, {kwargs}, {fully_shard}"):
                ref = _build(kind, frozen)
                model = shard_model(_build(kind, frozen), fully_shard)
                if fully_shard is small_replicated:
                    placements = {p.placements for p in model.parameters() if p.ndim == 2}
                    assert placements == {(Replicate(),), (Shard(0),)}, placements
                optims = _optimizers(model, Muon, **kwargs)
                ref_optims = _optimizers(ref, torch.optim.Muon, **kwargs)
                for step in range(STEPS):
                    calls.clear()
                    _step_in_parity(model, ref, optims, ref_optims, kind, step, rank, world_size)
                    assert len(calls) == 2, f"{len(calls)} all-to-alls in a step, expected 2"
                _check_equal(model, ref)
    finally:
        dist.all_to_all_single = original


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_bitwise(tmp_path: Path, world_size: int) -> None:
    run_ranks(_parity, world_size, tmp_path)


def _hsdp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kind = "transformer_untied"
    ref = build_model(kind)
    model = shard_model(build_model(kind), mesh=mesh)
    for param in model.parameters():
        assert param.placements == (Replicate(), Shard(0)), param.placements
    optims, ref_optims = _optimizers(model, Muon), _optimizers(ref, torch.optim.Muon)
    for step in range(STEPS):
        _step_in_parity(model, ref, optims, ref_optims, kind, step, rank, world_size)
    _check_equal(model, ref)
    # Replicas hold the same shard: it must be bitwise the same.
    replicas = mesh.get_group("replicate")
    for name, param in model.named_parameters():
        local = param.to_local().detach()
        gathered = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(gathered, local, group=replicas)
        assert torch.equal(gathered[0], gathered[1]), f"{name}: replicas differ"


@pytest.mark.distributed
def test_hsdp_replicas_agree_bitwise(tmp_path: Path) -> None:
    run_ranks(_hsdp, 4, tmp_path)


KIND = "transformer_tied"


def _save_at_2(rank: int, world_size: int, checkpoints: Path) -> None:
    ref = build_model(KIND)
    model = shard_model(build_model(KIND))
    optims, ref_optims = _optimizers(model, Muon), _optimizers(ref, torch.optim.Muon)
    for step in range(STEPS):
        _step_in_parity(model, ref, optims, ref_optims, KIND, step, rank, world_size)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optims)}
    for value in state["optim"]["state"].values():
        if "momentum_buffer" in value:
            assert isinstance(value["momentum_buffer"], DTensor)
    dcp.save(state, checkpoint_id=checkpoints / "dcp")
    if rank == 0:
        torch.save(
            {"model": ref.state_dict(), "optims": [o.state_dict() for o in ref_optims]},
            checkpoints / "ref.pt",
        )


def _load_at_4(rank: int, world_size: int, checkpoints: Path) -> None:
    saved = torch.load(checkpoints / "ref.pt", weights_only=True)
    ref = build_model(KIND)
    ref.load_state_dict(saved["model"])
    ref_optims = _optimizers(ref, torch.optim.Muon)
    for optim, optim_state in zip(ref_optims, saved["optims"], strict=True):
        optim.load_state_dict(optim_state)
    torch.manual_seed(rank + 1)  # other values everywhere: the load must set them all
    model = shard_model(build_model(KIND))
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_()
    optims = _optimizers(model, Muon)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optims)}
    dcp.load(state, checkpoint_id=checkpoints / "dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optims, state["optim"])
    _check_equal(model, ref)
    for step in range(STEPS, 2 * STEPS):
        _step_in_parity(model, ref, optims, ref_optims, KIND, step, rank, world_size)
    _check_equal(model, ref)


@pytest.mark.distributed
def test_checkpoint_at_2_resumes_at_4(tmp_path: Path) -> None:
    run_ranks(_save_at_2, 2, tmp_path / "save", tmp_path)
    run_ranks(_load_at_4, 4, tmp_path / "load", tmp_path)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw", "ns_steps": 3, "momentum": 0.5}],
)
def test_plain_tensors_bitwise(kwargs: dict) -> None:
    """Unsharded parameters (wide, tall, square) run locally, as torch does."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in ((5, 9), (9, 5), (6, 6))]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    optim = Muon(params, **{**MUON, **kwargs})
    ref_optim = torch.optim.Muon(ref_params, **{**MUON, **kwargs})
    for _ in range(STEPS):
        for p, ref_p in zip(params, ref_params, strict=True):
            p.grad = torch.randn(p.shape)
            ref_p.grad = p.grad.clone()
        optim.step()
        ref_optim.step()
    for p, ref_p in zip(params, ref_params, strict=True):
        assert torch.equal(p, ref_p)
    assert optim.state_dict()["state"].keys() == ref_optim.state_dict()["state"].keys()


def test_owners_balanced_and_deterministic() -> None:
    shapes = [(256, 256)] * 6 + [(1024, 256), (256, 1024), (17, 33), (65, 7)]
    costs = [newton_schulz_cost(s) for s in shapes]
    for num_ranks in (1, 2, 3, 4, 8):
        owners = assign_owners(costs, num_ranks)
        assert owners == assign_owners(list(costs), num_ranks)  # a pure function of its inputs
        assert set(owners) <= set(range(num_ranks))
        loads = owner_loads(costs, owners, num_ranks)
        # Greedy largest-first: no rank exceeds the mean by more than the largest cost it took.
        assert max(loads) <= sum(costs) / num_ranks + max(costs), loads
    # Six equal matrices on 2 ranks: 3 each, alternating from rank 0.
    assert assign_owners([1] * 6, 2) == [0, 1, 0, 1, 0, 1]
    assert owner_loads([5, 4, 3, 3, 3], assign_owners([5, 4, 3, 3, 3], 2), 2) == [8, 10]
    with pytest.raises(ValueError, match="num_ranks must be at least 1"):
        assign_owners([1], 0)


def test_rows_per_rank_match_torch_chunk() -> None:
    for rows in range(0, 12):
        for num_chunks in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(num_chunks)
            sizes = [len(c) for c in chunks] + [0] * (num_chunks - len(chunks))
            assert rows_per_rank(rows, num_chunks) == sizes, (rows, num_chunks)


def test_rejects_what_torch_muon_rejects() -> None:
    with pytest.raises(ValueError, match="only optimizes 2-D parameters.*AdamW"):
        Muon([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="lr must be >= 0"):
        Muon([nn.Parameter(torch.zeros(2, 2))], lr=-1.0)
    with pytest.raises(ValueError, match="momentum must be >= 0"):
        Muon([nn.Parameter(torch.zeros(2, 2))], momentum=-0.1)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        Muon([nn.Parameter(torch.zeros(2, 2))], weight_decay=-0.1)
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        Muon([nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="ns_steps must be at most 99"):
        Muon([nn.Parameter(torch.zeros(2, 2))], ns_steps=100)
    with pytest.raises(ValueError, match="ns_coefficients must be 3 values"):
        Muon([nn.Parameter(torch.zeros(2, 2))], ns_coefficients=(1.0, 2.0))


def test_rejects_unsupported_placements() -> None:
    with fake_world(4):
        mesh = DeviceMesh("cpu", torch.arange(4))
        dim1 = nn.Parameter(DTensor.from_local(torch.zeros(8, 2), mesh, [Shard(1)]))
        with pytest.raises(ValueError, match=r"sharded on dim 0.*Shard\(dim=1\)"):
            Muon([dim1])
        tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_tp = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), tp, [Shard(0), Shard(1)]))
        with pytest.raises(ValueError, match="without tensor parallelism"):
            Muon([dp_tp])
        both = nn.Parameter(DTensor.from_local(torch.zeros(2, 4), tp, [Shard(0), Shard(0)]))
        with pytest.raises(ValueError, match="along one mesh axis"):
            Muon([both])


@pytest.mark.distributed
def test_bench_muon_mode_counts_collectives(tmp_path: Path) -> None:
    """``bench.py --optim muon`` on a tiny model: two all-to-alls a step for
    fsdp2, none unsharded, owners balanced. Timings are not asserted."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench

    out = tmp_path / "muon.json"
    bench.main(
        ["--optim", "muon", "--dim", "16", "--layers", "3", "--steps", "2", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    counts = result["collectives"]
    assert counts["fsdp2.optim.Muon"] == {"alltoall_base_": 2}
    assert counts["unsharded, one process"] == {}
    assert sum(counts["torch.optim.Muon on DTensors"].values()) > 2
    assert sorted(result["owner_loads"]) == [16**3, 2 * 16**3]  # 3 equal matrices on 2 ranks
