"""Parameters replaced on their modules between ``fully_shard`` and the first
forward (``setattr(module, name, new_param)``, as a loader filling a
meta-device model does) are adopted at lazy init, as torch's fully_shard does:
a DTensor sharded like the parameter is taken as it is (the very object, so
an optimizer built before the first forward steps it), tied parameters stay
tied. What cannot be adopted (a full tensor among it: it could not be the
object an optimizer holds) raises an error naming the parameter and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist import labelled, run_ranks
from error_model import EXACT, REF_TOL
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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing import assert_close

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2  # against torch's fully_shard: the same bits (tests/error_model.py)
STEPS = 3


def _new_values(kind: str) -> dict[str, torch.Tensor]:
    """Values other than the model's initial ones (a checkpoint to load)."""
    model = build_model(kind)
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=gen) * 0.1 for n, p in model.named_parameters()}


def _replace(model: nn.Module, new_value: Callable[[str, DTensor], DTensor]) -> None:
    """Assigns a new Parameter holding ``new_value(name, param)`` to every
    parameter's module attribute, as transformers' loader does. Tied
    parameters get one new Parameter on both modules."""
    current = dict(model.named_parameters(remove_duplicate=False))
    new: dict[int, nn.Parameter] = {}
    for name, param in current.items():
        if id(param) not in new:
            new[id(param)] = nn.Parameter(new_value(name, param))
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, new[id(param)])


def _sharded(values: dict[str, torch.Tensor]) -> Callable[[str, DTensor], DTensor]:
    """``values[name]`` sharded like the parameter."""
    return lambda name, param: distribute_tensor(values[name], param.device_mesh, param.placements)


def _meta(name: str, param: DTensor) -> DTensor:
    """A meta DTensor sharded like ``param``."""
    local = torch.empty(param.to_local().shape, device="meta")
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def _train_like_torch_and_reference(
    kind: str, values: dict[str, torch.Tensor], model: nn.Module, torch_model: nn.Module
) -> None:
    """``STEPS`` steps of ``model`` (fsdp2), ``torch_model`` (torch's fully_shard)
    and the unsharded reference holding ``values``: losses equal torch's bit
    for bit and the reference's, so are the parameters after; ties kept."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ref = build_model(kind)
    ref.load_state_dict(values, strict=False)
    # Built before the first forward: adoption keeps the assigned objects.
    optims = [make_optimizer(m) for m in (ref, model, torch_model)]
    for step in range(STEPS):
        batch = global_batch(kind, step)
        local = local_batch(batch, rank, world_size)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss, torch_loss = (mean_loss(m, *local) for m in (model, torch_model))
        loss.backward()
        torch_loss.backward()
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        assert_close(loss.detach(), torch_loss.detach(), **EXACT, msg=f"step {step}")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    if kind == "transformer_tied":
        assert ref.output.weight is ref.tok_embeddings.weight
        assert model.output.weight is model.tok_embeddings.weight, "untied by adoption"
    torch_params = dict(torch_model.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}"
        assert_close(param.to_local(), torch_params[name].to_local(), **EXACT, msg=name)
    for name, value in full_params(model).items():
        assert_close(value, ref.get_parameter(name), **REF_TOL, msg=name)


def _both(kind: str, mesh: DeviceMesh) -> tuple[nn.Module, nn.Module]:
    """``kind`` sharded by fsdp2 and by torch's fully_shard."""
    return (
        shard_model(build_model(kind), mesh=mesh),
        shard_model(build_model(kind), torch_fully_shard, mesh=mesh),
    )


def _adopted(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for kind in ("transformer_untied", "transformer_tied"):
        with labelled(kind):
            values = _new_values(kind)
            models = _both(kind, mesh)
            for model in models:
                _replace(model, _sharded(values))
            _train_like_torch_and_reference(kind, values, *models)


def _meta_then_materialized(rank: int, world_size: int) -> None:
    """Meta DTensors assigned after fully_shard, then ``to_empty`` and a load:
    adopted as materialized, trained as torch's and the reference."""
    mesh = init_device_mesh("cpu", (world_size,))
    kind = "transformer_tied"
    values = _new_values(kind)
    models = _both(kind, mesh)
    for model in models:
        _replace(model, _meta)
        model.to_empty(device="cpu")
        sharded = {
            name: distribute_tensor(values[name], param.device_mesh, param.placements)
            for name, param in model.named_parameters()
        }
        model.load_state_dict(sharded, strict=False)
    _train_like_torch_and_reference(kind, values, *models)


def _refused(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    inputs = local_batch(global_batch("mlp", 0), rank, world_size)
    with labelled("wrong shape"):
        model = shard_model(build_model("mlp"), mesh=mesh)
        model.layers[1].weight = nn.Parameter(torch.zeros(3, 3))
        with pytest.raises(
            ValueError, match=r"'layers\.1\.weight' was replaced by a Parameter of shape \(3, 3\)"
        ):
            mean_loss(model, *inputs)
    with labelled("a full tensor"):
        model = shard_model(build_model("mlp"), mesh=mesh)
        model.layers[1].bias = nn.Parameter(torch.zeros(model.layers[1].bias.shape))
        with pytest.raises(
            ValueError, match=r"'layers\.1\.bias' was replaced by .*\(distribute_tensor"
        ):
            mean_loss(model, *inputs)
    with labelled("a DTensor on another mesh"):
        model = shard_model(build_model("mlp"), mesh=mesh)
        other = init_device_mesh("cpu", (world_size,), mesh_dim_names=("other",))
        full = torch.zeros(model.layers[0].weight.shape)
        model.layers[0].weight = nn.Parameter(distribute_tensor(full, other, [Shard(0)]))
        with pytest.raises(ValueError, match=r"'layers\.0\.weight' was replaced by a .* shard"):
            mean_loss(model, *inputs)
    with labelled("still on the meta device"):
        with torch.device("meta"):
            model = build_model("mlp")
        shard_model(model, mesh=mesh)
        model.to_empty(device="cpu")
        bias = model.layers[2].bias
        model.layers[2].bias = nn.Parameter(torch.empty_like(bias, device="meta"))
        with pytest.raises(RuntimeError, match=r"still on meta device: \['layers\.2\.bias'\]"):
            mean_loss(model, *inputs)
    with labelled("replaced after the first forward"):
        model = shard_model(build_model("mlp"), mesh=mesh)
        mean_loss(model, *inputs).backward()
        model.layers[0].bias = nn.Parameter(torch.zeros(model.layers[0].bias.shape))
        with pytest.raises(
            RuntimeError, match=r"'layers\.0\.bias' was replaced .* after the first forward"
        ):
            mean_loss(model, *inputs)


def test_replaced_parameters_are_adopted(tmp_path: Path) -> None:
    """Every parameter of the tied and untied transformer replaced after
    fully_shard by a new Parameter holding a DTensor sharded like the original
    (the tied pair by one Parameter on both modules), the optimizer built
    before the first forward: losses
    and parameters after 3 steps equal torch's fully_shard given the same
    replacements and match the reference built from the new values; the tied
    pair stays one Parameter."""
    run_ranks(_adopted, WORLD_SIZE, tmp_path)


def test_meta_replacements_materialized_later_are_adopted(tmp_path: Path) -> None:
    """Meta DTensors assigned after fully_shard (the tied pair as one), then
    ``to_empty(device="cpu")`` and a sharded load: 3 steps equal torch's
    fully_shard given the same and match the reference; the pair stays tied."""
    run_ranks(_meta_then_materialized, WORLD_SIZE, tmp_path)


def test_replacements_that_cannot_be_adopted(tmp_path: Path) -> None:
    """A wrong shape, a full tensor (it could not stay the Parameter an optimizer
    holds), a DTensor on another mesh, a meta DTensor left unmaterialized
    and a replacement after the first forward each raise an error naming the
    parameter, at the next forward."""
    run_ranks(_refused, WORLD_SIZE, tmp_path)


# -- transformers' own FSDP loading ---------------------------------------------


def _hf_load(path: str, shard) -> nn.Module:
    """``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``,
    which shards the model on the meta device with ``shard`` and then assigns the
    checkpoint's values as new parameters on their modules."""
    import transformers.distributed.fsdp as hf_fsdp
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    original = hf_fsdp.fully_shard
    hf_fsdp.fully_shard = shard
    try:
        config = DistributedConfig(fsdp_size=WORLD_SIZE)
        return LlamaForCausalLM.from_pretrained(path, distributed_config=config)
    finally:
        hf_fsdp.fully_shard = original


def _hf_from_pretrained(rank: int, world_size: int, path: str) -> None:
    import fsdp2

    models = [_hf_load(path, fsdp2.fully_shard), _hf_load(path, torch_fully_shard)]
    for name, param in models[0].named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}"
    if models[0].config.tie_word_embeddings:
        assert models[0].lm_head.weight is models[0].model.embed_tokens.weight, "untied"
    optims = [make_optimizer(m) for m in models]
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        tokens = torch.randint(HF_VOCAB, (4 * world_size, 8), generator=gen).chunk(world_size)[rank]
        losses = [m(tokens, labels=tokens).loss for m in models]
        for loss in losses:
            loss.backward()
        assert_close(losses[0], losses[1], **EXACT, msg=f"step {step}")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    theirs = dict(models[1].named_parameters())
    for name, param in models[0].named_parameters():
        assert_close(param.to_local(), theirs[name].to_local(), **EXACT, msg=name)


HF_VOCAB = 64


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_from_pretrained_with_fsdp(tied: bool, tmp_path: Path) -> None:
    """transformers' FSDP loading with fsdp2 in place of torch's fully_shard
    (a tiny Llama saved to tmp_path, untied and tied embeddings): the assigned
    parameters are adopted, and 3 steps give torch's losses and parameters bit
    for bit (2 ranks, tests/error_model.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    run_ranks(_hf_from_pretrained, WORLD_SIZE, tmp_path / "ranks", str(tmp_path / "llama"))
