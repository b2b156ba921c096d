"""Parameters whose shards are tensor subclasses that all-gather themselves
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, torch's fully_shard
contract): a test-local int8 row-quantized weight (two all-gather inputs of
different dtypes plus metadata, uneven dim 0) trains like the unsharded
reference, is refreshed in place (``out=``) from its second unshard on, and
travels as bytes. See [Note: all-gather extensions] in extension.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, recorded, run_ranks
from error_model import REF_TOL
from models import make_optimizer
from quantized import RowQuantized
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing import assert_close

import fsdp2

DIM, HIDDEN, OUT = 12, 7, 5  # 7 rows: uneven over 2 ranks (4, 3) and 4 ranks (2, 2, 2, 1)


class Block(nn.Module):
    """An int8 row-quantized projection (trainable or frozen) with a float32
    bias in the same group, and a float32 LoRA-style adapter."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, HIDDEN)
        self.proj.weight = nn.Parameter(
            RowQuantized.quantize(self.proj.weight), requires_grad=trainable
        )
        self.adapter = nn.Linear(DIM, HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.relu(self.proj(x) + self.adapter(x)))


class Model(nn.Module):
    def __init__(self, trainable: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(trainable) for _ in range(2))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.dequantize() if isinstance(local, RowQuantized) else local


def _quantized_training(rank: int, world_size: int) -> None:
    for trainable in (True, False):
        with labelled(f"quantized weights {'trainable' if trainable else 'frozen'}"):
            RowQuantized.post_all_gather_calls.clear()
            ref, model = Model(trainable), Model(trainable)
            for layer in model.layers:
                fsdp2.fully_shard(layer)
            fsdp2.fully_shard(model)
            weight = model.layers[0].proj.weight
            assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
            assert isinstance(weight.to_local(), RowQuantized)
            chunks = torch.chunk(torch.empty(HIDDEN), world_size)
            rows = chunks[rank].numel() if rank < len(chunks) else 0
            assert weight.to_local().shape == (rows, DIM), weight.to_local().shape
            optims = [
                make_optimizer([p for p in m.parameters() if p.requires_grad]) for m in (ref, model)
            ]
            for step in range(3):
                gen = torch.Generator().manual_seed(step)
                x, y = torch.randn(8, DIM, generator=gen), torch.randn(8, OUT, generator=gen)
                ref_loss = F.mse_loss(ref(x), y)
                ref_loss.backward()
                with recorded("all_gather") as calls:
                    loss = F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
                    loss.backward()
                dtypes = [call.output.dtype for call in calls]
                total = loss.detach().clone()
                dist.all_reduce(total)
                assert_close(total / world_size, ref_loss.detach(), **REF_TOL)
                # Each block: int8 rows + float32 scales + float32 params -> bytes.
                assert dtypes.count(torch.uint8) == 2 * 2, dtypes  # 2 blocks, forward and backward
                grad = model.layers[0].proj.weight.grad
                if trainable:  # a plain tensor gradient, reduce-scattered as any other
                    assert type(grad.to_local()) is torch.Tensor
                    expected = torch.chunk(ref.layers[0].proj.weight.grad, world_size)
                    if rank < len(expected):
                        assert_close(grad.to_local(), expected[rank], **REF_TOL)
                else:
                    assert grad is None
                for optim in optims:
                    optim.step()
                    optim.zero_grad()
            # Two groups, two unshards per step (forward, backward): the first
            # builds the unsharded parameter, every later one refills it (out=).
            calls = RowQuantized.post_all_gather_calls
            assert len(calls) == 2 * 2 * 3, len(calls)
            assert [fresh for fresh, _ in calls[:2]] == [True, True], calls
            assert not any(fresh for fresh, _ in calls[2:]), calls
            outs = {id(out) for _, out in calls[2:]}
            assert len(outs) == 2, "out= is one unsharded parameter per group"
            model.layers[0].unshard()
            assert id(model.layers[0].proj.weight) in outs  # that very parameter
            model.layers[0].reshard()
            for (name, param), ref_param in zip(
                model.named_parameters(), ref.parameters(), strict=True
            ):
                expected = torch.chunk(_dequantized(ref_param), world_size)
                if rank < len(expected):
                    assert_close(_dequantized(param), expected[rank], **REF_TOL, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_weights_train_like_reference(tmp_path: Path, world_size: int) -> None:
    """Int8 row-quantized weights (trainable, and frozen next to a float32
    adapter) all-gather their two inner tensors through the subclass's
    fsdp_pre/post_all_gather, padded on the uneven dim 0, in one byte buffer
    with the float32 parameters of the group; losses, gradients and trained
    weights equal the unsharded model's."""
    run_ranks(_quantized_training, world_size, tmp_path)


class HalfProtocol(torch.Tensor):
    """Defines only one method of the pair."""

    def fsdp_pre_all_gather(self, mesh):
        return (self,), None


def test_extension_is_checked_in_fully_shard() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        linear = nn.Linear(4, 4)
        linear.weight = nn.Parameter(linear.weight.detach().as_subclass(HalfProtocol))
        with pytest.raises(TypeError, match=r"defines fsdp_pre_all_gather but not fsdp_post"):
            fsdp2.fully_shard(linear, mesh=mesh)
        for kwargs, match in (
            ({"reshard_after_forward": 2}, r"not supported reshard_after_forward=2"),
            (
                {"shard_placement_fn": lambda p: Shard(1) if isinstance(p, RowQuantized) else None},
                r"not supported sharded on dim 1",
            ),
        ):
            model = Model(trainable=True)
            with pytest.raises(ValueError, match=match):
                fsdp2.fully_shard(model.layers[0], mesh=mesh, **kwargs)
