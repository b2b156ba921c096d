"""Implicit forward prefetch with a data-dependent module order: a wrong guess
is dropped when the next guess is made, instead of holding its all-gather
output until the end of forward: one guess at most is alive next to the
running group (issue 19, defect 10)."""

from __future__ import annotations

import torch
import torch.nn as nn
from dist import fake_world

import fsdp2


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = layer(x)
        return x


def _group(module: nn.Module):
    return module._fsdp_state.param_groups[0]


def test_wrong_forward_prefetch_is_dropped_at_the_next_guess() -> None:
    with fake_world(2):
        model = Branchy()
        for layer in model.layers:
            fsdp2.fully_shard(layer)
        fsdp2.fully_shard(model)
        in_flight: list[list[int]] = []

        def record(module: nn.Module, args: tuple) -> None:
            # Which groups hold an all-gather output, as this layer's forward starts.
            in_flight.append(
                [i for i, m in enumerate(model.layers) if _group(m).all_gather_in_flight]
            )

        for layer in model.layers:
            layer.register_forward_pre_hook(record)
        with torch.no_grad():
            model(torch.randn(2, 8))  # learns the order 0, 1, 2, 3
            model.skip = {1}
            in_flight.clear()
            model(torch.randn(2, 8))  # guesses 1 after 0, but 2 runs and guesses 3
    # Layer 2's guess (3) replaced layer 0's wrong one (1): not held to the end.
    assert in_flight == [[1], [3], []], in_flight
