"""The root moves its forward inputs to the accelerator blocking, as DDP does:
a caller that refills a pinned staging buffer right after ``model(x)`` must
not overwrite an input during its copy (issue 19, defect 5)."""

from __future__ import annotations

from typing import Any

import torch
from dist import fake_world
from models import build_model, shard_model
from torch.overrides import TorchFunctionMode

from fsdp2.api.state import get_fsdp_state


class RecordMoves(TorchFunctionMode):
    """Records ``Tensor.to`` calls to the meta device (the stand-in accelerator)
    and leaves the tensor where it is, so that forward runs on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[dict[str, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and torch.device("meta") in (*args[1:], kwargs.get("device")):
            self.moves.append(kwargs)
            return args[0]
        return func(*args, **kwargs)


def test_root_inputs_are_moved_blocking() -> None:
    with fake_world(2):
        model = shard_model(build_model("mlp"))
        root = get_fsdp_state(model)
        assert root is not None
        # Only the root's input move reads the state's device: make it an accelerator.
        root.device = torch.device("meta")
        with RecordMoves() as record, torch.no_grad():
            model(torch.randn(4, 17))
    assert len(record.moves) == 1, record.moves
    assert not record.moves[0].get("non_blocking", False), record.moves
