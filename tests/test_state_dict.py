"""Meta-device initialisation, state dicts and distributed checkpoints
(docs/usage.md), against an unsharded reference (DDP math, see tests/models.py):
a model initialised or loaded through fsdp2 must train exactly like a plain copy
holding the same values, and a checkpoint must restore the same numbers at
any world size.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from dist import labelled, run_ranks
from error_model import REF_TOL
from models import (
    build_model,
    expected_shard,
    full_params,
    global_batch,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing import assert_close

pytestmark = pytest.mark.distributed

KIND = "transformer_untied"
# State dicts: tied embedding and head, one Parameter under two keys.
SD_KIND = "transformer_tied"
NUM_STEPS = 3


# -- a model with a non-persistent buffer -------------------------------------

ROTARY_DIM = 10
ROTARY_OUT = 7


def _freqs(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return 1.0 / 10000 ** (torch.arange(dim, device=device) / dim)


class RotaryBlock(nn.Module):
    """A Linear whose output is scaled by fixed frequencies in a non-persistent
    buffer, like rotary embeddings' tables: in no state dict."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("freqs", torch.empty(dim), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """docs/usage.md's recipe: recompute after ``to_empty``."""
        with torch.no_grad():
            self.freqs.copy_(_freqs(self.dim, self.freqs.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.cos(self.freqs * 7.0) * self.proj(x)


class RotaryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RotaryBlock(ROTARY_DIM) for _ in range(2))
        self.head = nn.Linear(ROTARY_DIM, ROTARY_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _build(kind: str) -> nn.Module:
    if kind == "rotary":
        torch.manual_seed(0)
        return RotaryModel()
    return build_model(kind)


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "rotary":
        gen = torch.Generator().manual_seed(2000 + step)
        return torch.randn(8, ROTARY_DIM, generator=gen), torch.randn(8, ROTARY_OUT, generator=gen)
    return global_batch(kind, step)


def _perturbed(kind: str) -> nn.Module:
    """A model of ``kind`` with different values from ``_build``'s, to load into."""
    model = _build(kind)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


# -- helpers ------------------------------------------------------------------


def _train_in_parity(
    model: nn.Module,
    ref: nn.Module,
    rank: int,
    world_size: int,
    *,
    kind: str = KIND,
    steps: range = range(NUM_STEPS),
    optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Trains both (``model`` on this rank's part of the batch), checking each
    step's loss and grads and the parameters at the end. ``group``: the ranks
    ``model`` is sharded over, if not all."""
    ref_optim, optim = optims or (make_optimizer(ref), make_optimizer(model))
    for step in steps:
        batch = _batch(kind, step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *local_batch(batch, rank, world_size))
        loss.backward()
        with labelled(f"step {step}"):
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            assert_close(total / world_size, ref_loss.detach(), **REF_TOL)
            for name, param in model.named_parameters():
                assert_close(
                    param.grad.full_tensor(),
                    ref.get_parameter(name).grad,
                    **REF_TOL,
                    msg=lambda m, n=name: f"{n}.grad: {m}",
                )
        for o in (ref_optim, optim):
            o.step()
            o.zero_grad()
    _check_params(model, ref, REF_TOL)


def _check_params(model: nn.Module, ref: nn.Module, tol: dict[str, float]) -> None:
    for name, param in full_params(model).items():
        assert_close(param, ref.get_parameter(name), **tol, msg=lambda m, n=name: f"{n}: {m}")


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict]:
    """Full parameters and optimizer state by parameter name (collective)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    return {
        "params": {name: full(p).detach().clone() for name, p in model.named_parameters()},
        "optim": {
            name: {key: full(value).clone() for key, value in optim.state[p].items()}
            for name, p in model.named_parameters()
        },
    }


def _check_equal_state(actual: dict, expected: dict, what: str) -> None:
    """Bit for bit: a checkpoint round trip must not change a single bit."""
    assert actual["params"].keys() == expected["params"].keys(), what
    for name, value in expected["params"].items():
        assert torch.equal(actual["params"][name], value), f"{what}: parameter {name} differs"
    for name, state in expected["optim"].items():
        assert state, f"{what}: {name} has no optimizer state to compare"
        assert actual["optim"][name].keys() == state.keys(), f"{what}: optimizer keys of {name}"
        for key, value in state.items():
            assert torch.equal(actual["optim"][name][key], value), f"{what}: {name} {key}"


def _save(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)


def _load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    path: Path,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path, process_group=process_group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


# -- meta-device initialisation -----------------------------------------------


def _meta_model(kind: str, mesh: DeviceMesh) -> nn.Module:
    with torch.device("meta"):
        model = _build(kind)
    shard_model(model, mesh=mesh)
    for name, param in model.named_parameters():
        assert param.to_local().is_meta, f"{name} was allocated before to_empty"
    model.to_empty(device="cpu")
    return model


def _check_buffers(model: nn.Module, correct: bool, when: str) -> None:
    expected = _freqs(ROTARY_DIM)
    for i, layer in enumerate(model.layers):
        matches = torch.allclose(layer.freqs, expected)
        assert matches == correct, f"{when}: layers.{i}.freqs = {layer.freqs}"


def _load_full_state_dict(rank: int, world_size: int, mesh: DeviceMesh, kind: str) -> None:
    expected = _build(kind).state_dict()
    # torch's set_model_state_dict turns the values it is given into DTensors in place.
    full_sd = {key: value.clone() for key, value in expected.items()}
    model = _meta_model(kind, mesh)
    if kind == "rotary":
        # Uninitialised memory: anything but the frequencies.
        _check_buffers(model, correct=False, when="after to_empty")
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        assert torch.equal(param.full_tensor(), expected[name]), f"{name} not loaded"
    if kind == "rotary":
        assert not any("freqs" in key for key in expected), list(expected)
        _check_buffers(model, correct=False, when="after loading (not in the state dict)")
        for module in model.modules():
            if hasattr(module, "init_buffers"):
                module.init_buffers()
        _check_buffers(model, correct=True, when="after init_buffers()")
    ref = _build(kind)
    ref.load_state_dict(expected)
    _train_in_parity(model, ref, rank, world_size, kind=kind)


def _reset_parameters(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    model = _meta_model(KIND, mesh)
    torch.manual_seed(1)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    init = full_params(model)
    # Each module's own init, not leftover memory.
    for name, value in init.items():
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, nn.LayerNorm):
            expected = (
                torch.ones_like(value) if name.endswith("weight") else torch.zeros_like(value)
            )
            assert torch.equal(value, expected), f"{name} = {value}"
        elif isinstance(module, nn.Linear):
            bound = 1 / module.in_features**0.5  # kaiming_uniform_(a=sqrt(5)) and the bias'
            assert value.abs().max() <= bound, f"{name}: {value.abs().max()} > {bound}"
            assert value.std() > bound / 4, f"{name}: std {value.std()}"
        elif isinstance(module, nn.Embedding):
            assert 0.8 < value.std() < 1.2 and value.mean().abs() < 0.2, f"{name}: not N(0, 1)"
    ref = _build(KIND)
    ref.load_state_dict(init)
    _train_in_parity(model, ref, rank, world_size)


def _broadcast_and_assign(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """Rank 0 alone holds the full weights; every rank builds on meta, receives
    them by broadcast, shards them like ``model.state_dict()`` and loads them
    with ``assign=True`` (no ``to_empty``). A tied weight stays tied."""
    with torch.device("meta"):
        unmaterialized = shard_model(_build(SD_KIND), mesh=mesh)
    with pytest.raises(
        RuntimeError,
        match=r"materialized from meta device.*still on meta device: \['tok_embeddings.weight', "
        r".*\] and \d+ more in other groups.*to_empty",
    ):
        unmaterialized(_batch(SD_KIND, 0)[0].chunk(world_size)[rank])
    full = _build(SD_KIND).state_dict() if rank == 0 else None
    with torch.device("meta"):
        model = shard_model(_build(SD_KIND), mesh=mesh)
    sharded = {}
    for key, meta in model.state_dict().items():
        value = full[key] if rank == 0 else torch.empty(meta.shape, dtype=meta.dtype)
        dist.broadcast(value, src=0)
        sharded[key] = distribute_tensor(value, meta.device_mesh, meta.placements)
    model.load_state_dict(sharded, assign=True)
    assert model.output.weight is model.tok_embeddings.weight, "the tie was lost"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and not param.is_meta, name
    _train_in_parity(model, _build(SD_KIND), rank, world_size, kind=SD_KIND)


def _meta_init(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    for kind in (KIND, "rotary"):
        with labelled(f"{kind}: set_model_state_dict(full_state_dict=True)"):
            _load_full_state_dict(rank, world_size, mesh, kind)
    with labelled("reset_parameters()"):
        _reset_parameters(rank, world_size, mesh)
    with labelled("rank 0's weights broadcast, sharded, load_state_dict(assign=True)"):
        _broadcast_and_assign(rank, world_size, mesh)


# -- state dicts and distributed checkpoints ----------------------------------


def _model_state_dict(
    rank: int, world_size: int, mesh: DeviceMesh, kind: str
) -> tuple[nn.Module, torch.optim.Optimizer]:
    ref = build_model(kind)
    model = shard_model(build_model(kind), mesh=mesh)
    optims = (make_optimizer(ref), make_optimizer(model))
    _train_in_parity(model, ref, rank, world_size, kind=kind, steps=range(2), optims=optims)
    ref_sd = ref.state_dict()

    with labelled("model.state_dict()"):
        sd = model.state_dict()
        assert list(sd) == list(ref_sd), f"keys {list(sd)} vs {list(ref_sd)}"
        for key, value in sd.items():
            assert isinstance(value, DTensor), f"{key} is a {type(value).__name__}"
            assert value.placements == (Shard(0),), f"{key}: {value.placements}"
            assert_close(value.full_tensor(), ref_sd[key], **REF_TOL)

    with labelled("load_state_dict of DTensors"):
        other = shard_model(_perturbed(kind), mesh=mesh)
        result = other.load_state_dict(sd)
        assert not result.missing_keys and not result.unexpected_keys, result
        for name, param in other.named_parameters():
            source = model.get_parameter(name)
            assert isinstance(param, DTensor), f"{name} is no longer a DTensor"
            assert torch.equal(param.to_local(), source.to_local()), f"{name} differs"
        if kind == "transformer_tied":
            assert other.tok_embeddings.weight is other.output.weight, "untied by loading"

    with labelled("load_state_dict of full tensors"):
        other = shard_model(_perturbed(kind), mesh=mesh)
        result = other.load_state_dict(ref_sd)
        assert not result.missing_keys and not result.unexpected_keys, result
        for name, param in other.named_parameters():
            assert isinstance(param, DTensor), f"{name} is no longer a DTensor"
            expected = expected_shard(ref_sd[name], rank, world_size)
            assert torch.equal(param.to_local(), expected), f"{name}: wrong local shard"
            assert torch.equal(param.full_tensor(), ref_sd[name]), f"{name}: wrong full tensor"

    with labelled("shape mismatch"):
        key = "layers.0.attention.wq.weight"
        bad = dict(ref_sd)
        bad[key] = torch.zeros(18, 19)
        message = (
            rf"{re.escape(key)}.*{re.escape('torch.Size([18, 19])')}.*"
            rf"{re.escape('torch.Size([18, 18])')}"
        )
        with pytest.raises(RuntimeError, match=message):
            shard_model(_perturbed(kind), mesh=mesh).load_state_dict(bad)

    with labelled("optimizer state"):
        ref_optim, optim = optims
        for name, param in model.named_parameters():
            ref_state = ref_optim.state[ref.get_parameter(name)]
            value = optim.state[param]["momentum_buffer"]
            assert isinstance(value, DTensor), f"{name} momentum buffer is not a DTensor"
            assert value.placements == (Shard(0),), f"{name} momentum: {value.placements}"
            # Linear in the gradients: as close as they are (tests/error_model.py).
            assert_close(value.full_tensor(), ref_state["momentum_buffer"], **REF_TOL)

    with labelled("full state dicts (cpu_offload)"):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_sd = get_model_state_dict(model, options=options)
        full_osd = get_optimizer_state_dict(model, optim, options=options)
        gathered = {key: value.full_tensor() for key, value in sd.items()}  # on every rank
        if rank == 0:
            assert list(full_sd) == list(ref_sd), f"keys {list(full_sd)} vs {list(ref_sd)}"
            for key, value in full_sd.items():
                assert type(value) is torch.Tensor and value.device.type == "cpu", key
                assert torch.equal(value, gathered[key]), key
                assert_close(value, ref_sd[key], **REF_TOL)
            params = dict(ref.named_parameters())
            for name, state in full_osd["state"].items():
                ref_state = ref_optim.state[params[name]]
                buffer = state["momentum_buffer"]
                assert type(buffer) is torch.Tensor, f"{name} momentum buffer"
                assert_close(buffer, ref_state["momentum_buffer"], **REF_TOL)
        else:
            assert full_sd == {}, f"rank {rank} got a full state dict: {list(full_sd)}"
            assert full_osd == {}, f"rank {rank} got a full optimizer state dict"
    return model, optim


def _checkpoint_round_trip(
    rank: int, world_size: int, mesh: DeviceMesh, model, optim, path: Path
) -> None:
    """dcp.save, load into a model holding other values, and the next step of
    both is the same bit for bit."""
    _save(model, optim, path)
    other = shard_model(_perturbed(SD_KIND), mesh=mesh)
    other_optim = make_optimizer(other)
    _load(other, other_optim, path)
    _check_equal_state(_full_state(other, other_optim), _full_state(model, optim), "loaded")
    batch = local_batch(_batch(SD_KIND, 10), rank, world_size)
    losses = []
    for m, o in ((model, optim), (other, other_optim)):
        loss = mean_loss(m, *batch)
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1]), losses
    _check_equal_state(_full_state(other, other_optim), _full_state(model, optim), "trained")


def _meta_init_and_state_dicts_at_2(rank: int, world_size: int, checkpoints: Path) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    with labelled("meta-device init"):
        _meta_init(rank, world_size, mesh)
    model, optim = _model_state_dict(rank, world_size, mesh, SD_KIND)
    # For the next spawn: the model after 2 steps, and its full state.
    _save(model, optim, checkpoints / "world_size_2")
    full = _full_state(model, optim)
    if rank == 0:
        torch.save(full, checkpoints / "world_size_2.pt")
    with labelled("dcp round trip"):
        _checkpoint_round_trip(rank, world_size, mesh, model, optim, checkpoints / "round_trip")


def _load_at_4_then_2(rank: int, world_size: int, checkpoints: Path) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    # The reference does not depend on the world size: train it as the first spawn did.
    ref = build_model(SD_KIND)
    ref_optim = make_optimizer(ref)
    for step in range(2):
        mean_loss(ref, *_batch(SD_KIND, step)).backward()
        ref_optim.step()
        ref_optim.zero_grad()

    with labelled("saved at 2, loaded at 4"):
        model = shard_model(_perturbed(SD_KIND), mesh=mesh)
        optim = make_optimizer(model)
        _load(model, optim, checkpoints / "world_size_2")
        expected = torch.load(checkpoints / "world_size_2.pt")
        _check_equal_state(_full_state(model, optim), expected, "loaded at 4")
        _train_in_parity(
            model, ref, rank, world_size, kind=SD_KIND, steps=range(2, 3), optims=(ref_optim, optim)
        )
        _save(model, optim, checkpoints / "world_size_4")
        expected = _full_state(model, optim)

    with labelled("saved at 4, loaded at 2"):
        # Two independent 2-rank worlds, ranks 0-1 and 2-3, each loading the checkpoint.
        pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "shard"))["shard"]
        model = shard_model(_perturbed(SD_KIND), mesh=pairs)
        optim = make_optimizer(model)
        _load(model, optim, checkpoints / "world_size_4", process_group=pairs.get_group())
        _check_equal_state(_full_state(model, optim), expected, "loaded at 2")
        _train_in_parity(
            model,
            ref,
            pairs.get_local_rank(),
            2,
            kind=SD_KIND,
            steps=range(3, 4),
            optims=(ref_optim, optim),
            group=pairs.get_group(),
        )


def test_meta_init_state_dicts_and_checkpoints(tmp_path: Path) -> None:
    """Meta-device init at world size 2: built under torch.device("meta"),
    sharded (shards still meta), then to_empty(device="cpu"), then either
    set_model_state_dict of a full state dict (parameters equal it bit for bit)
    or reset_parameters() on every submodule (LayerNorms ones/zeros, Linears
    within their init bound, embeddings N(0, 1)), or without to_empty: rank 0's
    weights broadcast, sharded with distribute_tensor and loaded with
    assign=True (the tie kept): training then matches a reference holding the
    same values over 3 steps. A forward before materializing names the meta
    parameters. A non-persistent buffer
    holds garbage after to_empty, still after loading the state dict, and the
    right values after the documented recipe (init_buffers() on every module
    that has it).

    State dicts at world size 2, for the transformer with a tied embedding and head
    after 2 steps in parity: model.state_dict() holds Shard(0) DTensors whose
    full tensors are the reference's; load_state_dict takes DTensors (shards
    copied exactly) and full tensors (each rank keeps torch.chunk's piece); a
    shape mismatch names the key and both shapes; the optimizer state is
    Shard(0) DTensors close to the reference's; full state dicts with
    cpu_offload give rank 0 plain CPU tensors equal to the reference's. A dcp
    save/load into a model holding other values restores parameters and
    optimizer state bit for bit, and the next step is identical. Across world
    sizes: saved at 2, loaded at 4 (bit for bit, then a step in parity), saved
    at 4 and loaded by two 2-rank worlds (bit for bit, then a step in parity)."""
    checkpoints = tmp_path / "checkpoints"
    for path in (checkpoints, tmp_path / "world_size_2", tmp_path / "world_size_4"):
        path.mkdir()
    run_ranks(_meta_init_and_state_dicts_at_2, 2, tmp_path / "world_size_2", checkpoints)
    run_ranks(_load_at_4_then_2, 4, tmp_path / "world_size_4", checkpoints)
