"""Checkpoint helpers for the tests of ``shard_optimizer_over_replicas``: full
model and optimizer state, DCP save and load through torch's state-dict API."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from models import build_model
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict]:
    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    return {
        name: {"param": full(p).detach().clone()}
        | {key: full(value).clone() for key, value in optim.state[p].items()}
        for name, p in model.named_parameters()
    }


def check_state(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, values in expected.items():
        assert actual[name].keys() == values.keys(), f"{what}: {name}"
        for key, value in values.items():
            assert torch.equal(actual[name][key], value), f"{what}: {name} {key}"


def perturbed(kind: str) -> nn.Module:
    model = build_model(kind)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def save(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)


def load(model, optim, path: Path, process_group: dist.ProcessGroup | None = None) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path, process_group=process_group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
