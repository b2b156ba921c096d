"""With ``param_dtype=bf16, reduce_dtype=fp32`` the unsharded gradients are cast
while they are packed into the reduce-scatter input, not copied to fp32 first:
2 + 4 bytes per element at the peak, as torch (issue 19, defect 3)."""

from __future__ import annotations

import torch
from dist import fake_world
from models import build_model, shard_model
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2


class FloatCopies(TorchDispatchMode):
    """The shapes of every fp32 tensor made from a bf16 one by a cast."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cast = func is torch.ops.aten._to_copy.default
        if cast and args[0].dtype == torch.bfloat16 and out.dtype == torch.float32:
            self.shapes.append(tuple(out.shape))
        return out


def test_gradients_cast_while_packing() -> None:
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_world(2):
        model = shard_model(build_model("mlp"), mp_policy=mp)
        loss = model(torch.randn(4, 17)).float().sum()
        unsharded = {tuple(layer.weight.shape) for layer in model.layers}  # DTensor: global
        with FloatCopies() as copies:
            loss.backward()
        assert not unsharded & set(copies.shapes), copies.shapes
        for layer in model.layers:
            assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
