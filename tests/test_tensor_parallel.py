"""FSDP over tensor parallelism: a transformer parallelized with torch's TP plans
on ``mesh["tp"]`` and sharded by fsdp2 over ``mesh["dp"]`` of a 2x2 mesh, against
the unsharded reference trained on the global batch (DDP math over the dp ranks;
the two tp ranks of a dp group see the same data)."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist import fake_world, labelled, run_ranks
from error_model import EXACT, REF_TOL
from models import global_mean, make_optimizer, mean_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing import assert_close
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import fsdp2

STEPS = 3
MAX_NORM = 0.5
BATCH = 4  # global: 2 rows per dp rank
# Uneven over dp on purpose (TP's own plans need even splits): vocab 34 -> 17
# rows per tp rank -> 9 and 8 per dp rank; 10 positions -> 5 -> 3 and 2.
ARGS = {"n_layers": 2, "vocab_size": 34, "max_seq_len": 10, "dim": 16, "n_heads": 4}


def _build(weight_tying: bool) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(**ARGS, dropout_p=0.0, weight_tying=weight_tying))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    shape = (BATCH, ARGS["max_seq_len"])
    return (
        torch.randint(ARGS["vocab_size"], shape, generator=gen),
        torch.randint(ARGS["vocab_size"], shape, generator=gen),
    )


def _shard_2d(model: Transformer, mesh, seq_parallel: bool) -> Transformer:
    Transformer.parallelize(
        model, mesh["tp"], use_seq_parallel=seq_parallel, local_output_for_attn=True
    )
    model.tp_names = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh["dp"])
    fsdp2.fully_shard(model, mesh=mesh["dp"])
    return model


def _check_placements(model: Transformer, ref: Transformer, mesh, seq_parallel: bool) -> None:
    """Every TP parameter is a DTensor on the (dp, tp) mesh whose full tensor is
    the reference's; a dim sharded by both dp and tp is a strided shard. The
    others (norms without sequence parallelism) are sharded on the dp mesh."""
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        if name not in model.tp_names:
            assert param.device_mesh == mesh["dp"] and param.placements == (Shard(0),), name
            assert_close(param.full_tensor(), ref.get_parameter(name), rtol=0, atol=0)
            continue
        assert param.device_mesh.mesh_dim_names == ("dp", "tp"), (name, param.device_mesh)
        assert torch.equal(param.device_mesh.mesh, mesh.mesh), name
        dp_placement, tp_placement = param.placements
        if tp_placement == Shard(0):
            assert dp_placement == _StridedShard(0, split_factor=2), (name, param.placements)
        else:
            assert dp_placement == Shard(0), (name, param.placements)
        assert_close(param.full_tensor(), ref.get_parameter(name), rtol=0, atol=0)
    attention = model.layers[0].attention
    assert attention.wq.weight.placements[1] == Shard(0)  # colwise
    assert attention.wo.weight.placements[1] == Shard(1)  # rowwise
    assert (model.norm.weight.placements[-1] == Replicate()) == seq_parallel


def _train(rank: int, world_size: int, seq_parallel: bool, weight_tying: bool) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    ref = _build(weight_tying)
    model = _shard_2d(_build(weight_tying), mesh, seq_parallel)
    _check_placements(model, ref, mesh, seq_parallel)
    if weight_tying:
        assert model.output.weight is model.tok_embeddings.weight
    optims = make_optimizer(ref), make_optimizer(model)
    for step in range(STEPS):
        batch = _batch(step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *(torch.chunk(t, dp_size)[dp_rank] for t in batch))
        loss.backward()
        # Every rank's loss is its dp group's: the mean over all ranks is the dp mean.
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        # Gradients on two meshes (dp, and dp x tp): clipped by the total norm.
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert ref_norm > MAX_NORM  # clipping really happens
        assert_close(fsdp2.clip_grad_norm_(model.parameters(), MAX_NORM), ref_norm, **REF_TOL)
        for name, param in model.named_parameters():
            assert param.grad.placements == param.placements, (name, param.grad.placements)
            expected = ref.get_parameter(name).grad
            assert_close(
                param.grad.full_tensor(), expected, **REF_TOL, msg=lambda m, n=name: f"{n}: {m}"
            )
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for name, param in model.named_parameters():
        expected = ref.get_parameter(name)
        assert_close(param.full_tensor(), expected, **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _parity(rank: int, world_size: int) -> None:
    for seq_parallel, weight_tying in ((False, False), (True, False), (False, True)):
        with labelled(f"sequence parallel={seq_parallel}, tied={weight_tying}"):
            _train(rank, world_size, seq_parallel, weight_tying)


@pytest.mark.distributed
def test_fsdp_over_tp_parity(tmp_path: Path) -> None:
    """Placements are (Shard(0) or _StridedShard, TP placement) on the 2x2 (dp, tp)
    mesh, full tensors equal the original, and losses, gradient norms (clipped
    across the dp and dp x tp meshes), gradients (also Partial ones from
    sequence-parallel norms) and trained parameters match the reference, with
    and without sequence parallelism and with tied embeddings."""
    run_ranks(_parity, 4, tmp_path)


def _checkpoint(rank: int, world_size: int, path: Path) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _shard_2d(_build(False), mesh, seq_parallel=True)
    optim = make_optimizer(model)
    dp_rank = mesh["dp"].get_local_rank()
    mean_loss(model, *(torch.chunk(t, 2)[dp_rank] for t in _batch(0))).backward()
    optim.step()
    dcp.save(model.state_dict(), checkpoint_id=path)
    expected = {name: t.full_tensor() for name, t in model.state_dict().items()}
    fsdp_only = fsdp2.fully_shard(_build(False), mesh=init_device_mesh("cpu", (world_size,)))
    state = fsdp_only.state_dict()
    dcp.load(state, checkpoint_id=path)
    for name, tensor in state.items():
        assert tensor.placements == (Shard(0),), name
        assert_close(tensor.full_tensor(), expected[name], rtol=0, atol=0, msg=name)
        assert not torch.equal(expected[name], _build(False).state_dict()[name]), name


@pytest.mark.distributed
def test_checkpoint_from_2d_to_fsdp_only(tmp_path: Path) -> None:
    """torch.distributed.checkpoint saved under FSDP x TP on 2x2 (after a step, so
    the values differ from the initial ones) loads under FSDP alone on 4 ranks
    with the same full tensors."""
    run_ranks(_checkpoint, 4, tmp_path, tmp_path / "ckpt")


# -- single process: HSDP x TP layouts under a fake world of 8 ranks ----------


def test_hsdp_over_tp_placements() -> None:
    """A (replicate, shard, tp) = 2 x 2 x 2 mesh: TP parameters become 3D DTensors
    placed (Replicate(), <dp shard>, <tp placement>) whose local tensor has the
    shape of this rank's dp chunk of its TP chunk; others stay 2D HSDP
    (construction only: 8 real ranks are too many for 2 cores)."""
    with fake_world(8, rank=5):
        _check_hsdp_over_tp_placements()


def _check_hsdp_over_tp_placements() -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    ref = _build(False)
    model = _build(False)
    Transformer.parallelize(model, mesh["tp"], use_seq_parallel=False, local_output_for_attn=True)
    tp_names = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh["replicate", "shard"])
    fsdp2.fully_shard(model, mesh=mesh["replicate", "shard"])
    # Rank 5 = coordinates (1, 0, 1): replica 1, dp shard 0, tp rank 1.
    shard_rank, tp_rank = 0, 1
    for name, param in model.named_parameters():
        full = ref.get_parameter(name)
        if name not in tp_names:
            assert param.placements == (Replicate(), Shard(0)), name
            assert torch.equal(param.to_local(), torch.chunk(full, 2)[shard_rank]), name
            continue
        assert param.device_mesh.mesh_dim_names == ("replicate", "shard", "tp"), name
        tp_placement = param.placements[2]
        tp_local = full
        if isinstance(tp_placement, Shard):
            tp_local = torch.chunk(full, 2, dim=tp_placement.dim)[tp_rank]
        if tp_placement == Shard(0):
            assert param.placements[:2] == (Replicate(), _StridedShard(0, split_factor=2)), name
        else:
            assert param.placements[:2] == (Replicate(), Shard(0)), name
        # Shapes only: the fake group's scatter left TP's local values unset.
        assert param.to_local().shape == torch.chunk(tp_local, 2)[shard_rank].shape, name
        assert param.shape == full.shape, name
    assert len(tp_names) > 0


def _matches_torch_bf16(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    models = []
    for fully_shard, policy in (
        (fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy(**dtypes)),
        (torch_fully_shard, TorchMixedPrecisionPolicy(**dtypes)),
    ):
        model = _build(False)
        Transformer.parallelize(
            model, mesh["tp"], use_seq_parallel=True, local_output_for_attn=True
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
        models.append(fully_shard(model, mesh=mesh["dp"], mp_policy=policy))
    ours, theirs = models
    for (name, param), (_, expected) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert param.placements == expected.placements, (name, param.placements)
        assert param.device_mesh == expected.device_mesh, name
    optims = [make_optimizer(m) for m in models]
    for step in range(STEPS):
        batch = [torch.chunk(t, 2)[dp_rank] for t in _batch(step)]
        losses = [mean_loss(m, *batch) for m in models]
        for loss in losses:
            loss.backward()
        # FSDP over 2 ranks: the same bits as torch's (tests/error_model.py).
        assert_close(losses[0], losses[1], **EXACT, msg=f"step {step}")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for (name, param), (_, expected) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert_close(param.full_tensor(), expected.full_tensor(), **EXACT, msg=name)


@pytest.mark.distributed
def test_fsdp_over_tp_matches_torch_in_bf16(tmp_path: Path) -> None:
    """With bf16 compute and fp32 reduction, sequence parallelism on, fsdp2 over TP
    places every parameter as torch's fully_shard over TP does (same mesh, same
    _StridedShard), and trains to the same losses and parameters."""
    run_ranks(_matches_torch_bf16, 4, tmp_path)


def _hsdp_over_tp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = mesh["replicate", "shard"]
    replica, shard = dp_mesh.get_coordinate()
    dp_rank, dp_size = replica * 2 + shard, 4
    ref = _build(False)
    model = _build(False)
    Transformer.parallelize(model, mesh["tp"], use_seq_parallel=True, local_output_for_attn=True)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=dp_mesh)
    fsdp2.fully_shard(model, mesh=dp_mesh)
    optims = make_optimizer(ref), make_optimizer(model)
    for step in range(2):
        batch = _batch(step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *(torch.chunk(t, dp_size)[dp_rank] for t in batch))
        loss.backward()
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        for name, param in model.named_parameters():
            expected = ref.get_parameter(name).grad
            assert_close(param.grad.full_tensor(), expected, **REF_TOL, msg=name)
        for optim in optims:
            optim.step()
            optim.zero_grad()


@pytest.mark.distributed
def test_hsdp_over_tp_parity(tmp_path: Path) -> None:
    """HSDP x TP on 8 ranks, a (replicate, shard, tp) = 2 x 2 x 2 mesh: gradients
    (reduce-scattered over shard, all-reduced over replicate, TP-local) and
    losses match the reference trained on the global batch."""
    run_ranks(_hsdp_over_tp, 8, tmp_path)
