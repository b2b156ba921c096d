"""``unshard(async_op=True)``'s handle holds no buffer: once the module's
forward has copied the all-gather out, the all-gather output is freed even
while the caller keeps the handle (issue 19, defect 7)."""

from __future__ import annotations

import weakref

import torch
from dist import fake_world
from models import build_model, shard_model


def test_handle_does_not_keep_the_all_gather_output() -> None:
    with fake_world(2):
        model = shard_model(build_model("mlp"))
        model(torch.randn(4, 17))  # lazy init
        layer = model.layers[0]
        handle = layer.unshard(async_op=True)
        assert handle is not None
        in_flight = layer._fsdp_state.param_groups[0]._all_gather
        assert in_flight is not None
        freed: list[bool] = []
        weakref.finalize(in_flight.all_gather_output.untyped_storage(), freed.append, True)
        del in_flight
        with torch.no_grad():
            model(torch.randn(4, 17))  # the forward waits for the all-gather and copies it out
        assert freed == [True]
        handle.wait()  # a no-op now
        assert layer._fsdp_state.param_groups[0]._all_gather is None
