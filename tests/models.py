"""Models, data and sharding helpers shared by the distributed tests.

Every rank builds the same model (same seed) and the same *global* batch for a
step (same seed), then takes its own slice with :func:`local_batch`. A plain
copy trained on the global batch with a mean loss is the reference (DDP math):
averaging the local mean-loss gradients over ranks gives the global mean's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from error_model import LR, MOMENTUM, WEIGHT_DECAY
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import fsdp2

GLOBAL_BATCH_SIZE = 8  # divisible by every world size tested (1, 2, 4)
MLP_DIMS = (17, 33, 65, 7)  # uneven: no dim divides evenly by 2 or 4 except by accident
# Uneven too: vocab 33 rows -> 9, 9, 9, 6 at world size 4; max_seq_len 9 rows of
# pos_embeddings -> 3, 3, 3, 0, so rank 3 holds an empty shard.
VOCAB_SIZE = 33
SEQ_LEN = 9
DIM = 18
N_HEADS = 3

MODEL_KINDS = ("mlp", "transformer_tied", "transformer_untied")


class MLP(nn.Module):
    """17 -> 33 -> 65 -> 7 with ReLU; each Linear is its own submodule in ``layers``.

    Sharding each layer and then the root leaves the root with no parameters of
    its own, which is a case worth covering next to the transformer's
    parameter-owning root.
    """

    def __init__(self, dims: tuple[int, ...] = MLP_DIMS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(d_in, d_out) for d_in, d_out in zip(dims[:-1], dims[1:], strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def transformer_args(*, weight_tying: bool, n_layers: int = 2) -> ModelArgs:
    return ModelArgs(
        n_layers=n_layers,
        vocab_size=VOCAB_SIZE,
        max_seq_len=SEQ_LEN,
        dim=DIM,
        n_heads=N_HEADS,
        dropout_p=0.0,
        weight_tying=weight_tying,
    )


def build_model(kind: str, *, n_layers: int = 2) -> nn.Module:
    """The same freshly initialised model on every rank (seeded)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP()
    if kind in ("transformer_tied", "transformer_untied"):
        args = transformer_args(weight_tying=kind == "transformer_tied", n_layers=n_layers)
        return Transformer(args)
    raise ValueError(f"unknown model kind {kind!r}")


def shard_model(
    model: nn.Module, fully_shard: Callable[..., nn.Module] = fsdp2.fully_shard, **kwargs: Any
) -> nn.Module:
    """One group per block of ``model.layers``, then the root (which takes the rest).

    ``fully_shard`` is fsdp2's or torch's: both share this signature.
    """
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def global_batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the whole batch of ``step``: identical on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        inputs = torch.randn(GLOBAL_BATCH_SIZE, MLP_DIMS[0], generator=gen)
        targets = torch.randn(GLOBAL_BATCH_SIZE, MLP_DIMS[-1], generator=gen)
    else:
        inputs = torch.randint(VOCAB_SIZE, (GLOBAL_BATCH_SIZE, SEQ_LEN), generator=gen)
        targets = torch.randint(VOCAB_SIZE, (GLOBAL_BATCH_SIZE, SEQ_LEN), generator=gen)
    return inputs, targets


def local_batch(
    batch: tuple[torch.Tensor, ...], rank: int, world_size: int
) -> tuple[torch.Tensor, ...]:
    """This rank's slice of a global batch (dim 0)."""
    return tuple(torch.chunk(t, world_size)[rank] for t in batch)


def mean_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch (and tokens): equal local batches make the rank average
    of local losses (and gradients) the global mean."""
    output = model(inputs)
    if output.dim() == 3:  # transformer logits (batch, seq, vocab)
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())
    return F.mse_loss(output, targets)


def make_optimizer(model: nn.Module | list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum and weight decay: its update is linear in the gradient,
    so last-bit differences in gradients stay last-bit differences in
    parameters (tests/error_model.py, point 3). foreach=False: the same
    per-parameter kernels on plain tensors and DTensors."""
    params = list(model.parameters()) if isinstance(model, nn.Module) else model
    return torch.optim.SGD(
        params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, foreach=False
    )


def global_mean(local: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank average of a scalar: equals the reference's loss on the global batch."""
    total = local.detach().clone()
    dist.all_reduce(total)
    return total / world_size


def expected_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """``torch.chunk(full, world_size)[rank]``, or an empty (0, ...) tensor when
    ``torch.chunk`` returns fewer chunks than ranks."""
    chunks = torch.chunk(full, world_size, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_empty((0, *full.shape[1:]))


def fsdp_modules(model: nn.Module) -> Iterator[nn.Module]:
    return (m for m in model.modules() if isinstance(m, fsdp2.FSDPModule))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full size (DTensors via ``full_tensor()``)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }


def unsharded_bytes(fsdp_param: Any) -> int:
    """Bytes an ``FSDPParam``'s unsharded storage holds: 0 once resharded.
    (Its padded buffer's storage, or an extension's outputs and inner tensors.)"""
    extension = fsdp_param.extension
    if extension is None:
        tensors = [t for t in (fsdp_param._unsharded_padded,) if t is not None]
    else:
        tensors = [*extension._outputs, *extension._inner_tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().size() for t in tensors}
    return sum(storages.values())
