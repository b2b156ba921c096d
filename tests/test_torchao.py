"""torchao's low-precision weights under fsdp2, against torch's fully_shard on
the same model and data (2 gloo ranks):

- int8 quantized training (``int8_weight_only_quantized_training``): the
  weights all-gather their int8 data and float scales through the extension
  protocol; both FSDPs train identically.
- float8 training with ``enable_fsdp_float8_all_gather=True``: fsdp2
  all-gathers the float8 bytes (a quarter of the fp32 volume), which torch's
  fully_shard cannot do over gloo (it has no float8 dtype); the result equals
  torch's fully_shard gathering fp32 and casting after (the same tensorwise
  scale, computed across the shards by the subclass).
- MX training (mxfp8, emulated on CPU; its weight gradient in mxfp8 or
  bf16): the weight wrapper all-gathers its bf16 data and hands it to the
  matmul out of a custom Function; the backward all-gather refills that data
  in place, which autograd must not see as a modification of what it saved.
- NF4 (QLoRA): frozen 4-bit base weights next to trainable adapters.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import labelled, recorded, run_ranks
from error_model import EXACT
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.testing import assert_close

import fsdp2

pytest.importorskip("torchao")

WORLD_SIZE = 2
DIM = 64
# Against torch's fully_shard on 2 ranks: the same bits (tests/error_model.py,
# point 2), AdamW included (torchao's recipe for these weights).


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 32)
    )


def _int8_model() -> nn.Module:
    from torchao import quantize_
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    model = _mlp()
    quantize_(model, int8_weight_only_quantized_training())
    return model


def _mx_model(wgrad_with_hp: bool) -> nn.Module:
    """MX training (mxfp8, emulated on CPU): each Linear's weight wrapped in
    torchao's MXFP8TrainingWeightWrapperTensor, which hands its data to the
    matmul through a custom Function; with ``wgrad_with_hp`` the weight
    gradient is computed in bf16 instead of mxfp8."""
    from torchao import quantize_
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import KernelPreference

    model = _mlp()
    config = MXFP8TrainingOpConfig(
        kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=wgrad_with_hp
    )
    quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module, nn.Linear))
    return model


def _float8_model(float8_all_gather: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _mlp()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    convert_to_float8_training(model, config=config)
    return model


class LoRALinear(nn.Module):
    """A frozen NF4 base weight and a trainable low-rank adapter."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        base = torch.randn(dim, dim) / dim**0.5
        self.weight = nn.Parameter(to_nf4(base, 64, 32), requires_grad=False)
        self.lora_a = nn.Linear(dim, 8, bias=False)
        self.lora_b = nn.Linear(8, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x))


def _nf4_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(LoRALinear(2 * DIM), nn.ReLU(), LoRALinear(2 * DIM))


def _shard(model: nn.Module, fully_shard, **kwargs) -> nn.Module:
    for module in model:
        if any(True for _ in module.parameters()):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train_both(rank: int, models: tuple[nn.Module, nn.Module], out_dim: int, batch: int = 4):
    """Three AdamW steps of both models on this rank's slice of ``batch``
    rows; per-step losses and fsdp2's all-gathers of each step."""
    optims = [
        # weight_decay=0: the int8 weight has no in-place mul_ for the decay.
        torch.optim.AdamW(
            [p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0, foreach=False
        )
        for m in models
    ]
    in_dim = next(m for m in models[0].modules() if hasattr(m, "weight")).weight.shape[1]
    losses, gathers = [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(batch * WORLD_SIZE, in_dim, generator=gen).chunk(WORLD_SIZE)[rank]
        y = torch.randn(batch * WORLD_SIZE, out_dim, generator=gen).chunk(WORLD_SIZE)[rank]
        step_losses = []
        for i, model in enumerate(models):
            with recorded("all_gather") as calls:
                loss = F.mse_loss(model(x).float(), y)  # MX training computes in bf16
                loss.backward()
            if i == 0:  # fsdp2's (torch's fully_shard calls another collective)
                gathers.append(
                    [(c.output.dtype, c.output.numel() * c.output.element_size()) for c in calls]
                )
            step_losses.append(loss.detach())
        losses.append(step_losses)
        for optim in optims:
            torch.manual_seed(100 + step)  # int8 weights round stochastically in the step
            optim.step()
            optim.zero_grad()
    for step, (ours, theirs) in enumerate(losses):
        assert_close(ours, theirs, **EXACT, msg=lambda m, s=step: f"step {s}: {m}")
    return gathers


def _plain(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "get_original_weight"):  # NF4
        return t.get_original_weight()
    if hasattr(t, "int_data"):  # int8
        return t.dequantize()
    if hasattr(t, "_data"):  # MX training's weight wrapper
        return t._data
    return getattr(t, "_tensor", t)  # float8 training's weight wraps a plain tensor


def _check_same_params(model: nn.Module, torch_model: nn.Module, same_types: bool = True) -> None:
    theirs = dict(torch_model.named_parameters())
    for name, param in model.named_parameters():
        ours, other = param.to_local(), theirs[name].to_local()
        if same_types:
            assert type(ours) is type(other), (
                f"{name}: {type(ours).__name__}, {type(other).__name__}"
            )
        assert_close(_plain(ours), _plain(other), **EXACT, msg=lambda m, n=name: f"{n}: {m}")


def _mx_checkpoint_round_trip(models: tuple[nn.Module, nn.Module], path: str, mp: dict) -> None:
    """fsdp2's trained MX model through DCP into a fresh one, as torchtitan
    saves and resumes: the loaded parameters are the trained ones, torch's
    fully_shard's too, bit for bit, and still MX training weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    dcp.save(get_model_state_dict(models[0]), checkpoint_id=path)
    fresh = _shard(_mx_model(False), fsdp2.fully_shard, mp_policy=fsdp2.MixedPrecisionPolicy(**mp))
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()  # nothing of the fresh initialisation can pass for the loaded
    state = get_model_state_dict(fresh)
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import KernelPreference, ScaleCalculationMode

    wrapper = type(fresh[0].weight.to_local())
    # DCP's weights-only unpickler refuses a tensor subclass and the config it
    # carries unless told about them (under torch's fully_shard too): torch's
    # documented allow-list.
    allowed = [wrapper, MXFP8TrainingOpConfig, KernelPreference, ScaleCalculationMode]
    with torch.serialization.safe_globals(allowed):
        dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    _check_same_params(fresh, models[0])
    _check_same_params(fresh, models[1])


def _torchao_training(rank: int, world_size: int, checkpoints: str) -> None:
    warnings.filterwarnings("ignore")  # torchao's import-time notices, once per rank
    with labelled("int8 quantized training"):
        models = (
            _shard(_int8_model(), fsdp2.fully_shard),
            _shard(_int8_model(), torch_fully_shard),
        )
        assert type(models[0][0].weight.to_local()).__name__ == "Int8QuantizedTrainingLinearWeight"
        gathers = _train_both(rank, models, 32)
        # int8 data + float32 scales + float32 biases travel together as bytes.
        assert {dtype for seen in gathers for dtype, _ in seen} == {torch.uint8}, gathers
        _check_same_params(*models)
    with labelled("float8 training, float8 all-gather"):
        models = (
            _shard(_float8_model(float8_all_gather=True), fsdp2.fully_shard),
            _shard(_float8_model(float8_all_gather=False), torch_fully_shard),
        )
        gathers = _train_both(rank, models, 32)
        # Per Linear(64, 64): 4096 float8 bytes of weight + 64 float32 biases,
        # against 4 * 4096 + 256 bytes in fp32.
        first = gathers[0][: len(gathers[0]) // 2]  # the forward's
        assert (torch.uint8, DIM * DIM + 4 * DIM) in first, first
        _check_same_params(*models, same_types=False)  # torch's gathers plain weights
    for wgrad_with_hp in (False, True):
        with labelled(f"MX training (mxfp8, emulated), wgrad_with_hp={wgrad_with_hp}"):
            # MX training's subclass all-gathers its data in the param dtype.
            mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
            models = (
                _shard(
                    _mx_model(wgrad_with_hp),
                    fsdp2.fully_shard,
                    mp_policy=fsdp2.MixedPrecisionPolicy(**mp),
                ),
                _shard(
                    _mx_model(wgrad_with_hp),
                    torch_fully_shard,
                    mp_policy=TorchMixedPrecisionPolicy(**mp),
                ),
            )
            assert (
                type(models[0][0].weight.to_local()).__name__ == "MXFP8TrainingWeightWrapperTensor"
            )
            gathers = _train_both(rank, models, 32, batch=32)  # mxfp8 blocks: 32 rows
            assert {dtype for seen in gathers for dtype, _ in seen} == {torch.bfloat16}, gathers
            _check_same_params(*models)
            if not wgrad_with_hp:
                _mx_checkpoint_round_trip(models, f"{checkpoints}/mx", mp)
    with labelled("NF4 base weights with adapters (QLoRA)"):
        models = (_shard(_nf4_model(), fsdp2.fully_shard), _shard(_nf4_model(), torch_fully_shard))
        _train_both(rank, models, 2 * DIM)
        for name, param in models[0].named_parameters():
            if name.endswith("weight") and "lora" not in name:
                assert type(param.to_local()).__name__ == "NF4Tensor", name
                assert param.grad is None and not param.requires_grad, name
            else:
                assert param.grad is None and param.requires_grad, name  # zero_grad'ed
        _check_same_params(*models)


@pytest.mark.distributed
def test_torchao_weights_train_like_torch_fully_shard(tmp_path: Path) -> None:
    """int8 quantized training, float8 training with float8 all-gather (over
    gloo, which torch's fully_shard cannot do), MX training (mxfp8, wgrad in
    mxfp8 or bf16) and NF4 frozen weights with adapters train exactly like
    torch's fully_shard on the same data."""
    run_ranks(_torchao_training, WORLD_SIZE, tmp_path, str(tmp_path))
