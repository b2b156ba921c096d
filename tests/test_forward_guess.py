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


def test_wrong_guess_is_dropped_off_the_compute_stream() -> None:
    """On accelerators (the stream model here), dropping a wrong guess does not
    make the compute stream wait for its all-gather: the copy-in stream, where
    the buffer's bytes return, waits for it before the buffer goes."""
    from stream_model import FakeStream, StreamModel

    from fsdp2.engine.param_group import FSDPParamGroup

    # The events themselves are kept, not their ids: an id can be reused once
    # an event of an earlier forward is freed.
    waits: list[tuple[str, object]] = []
    dropped: list[object] = []
    wait_event, cancel = FakeStream.wait_event, FSDPParamGroup.cancel_unshard

    def logged_wait(stream, event):
        waits.append((stream.name, event))
        wait_event(stream, event)

    def logged_cancel(group):
        if group.all_gather_in_flight:
            dropped.append(group._all_gather.in_flight.event)
        cancel(group)

    with fake_world(2):
        model = Branchy()
        for layer in model.layers:
            fsdp2.fully_shard(layer)
        fsdp2.fully_shard(model)
        streams = StreamModel()
        streams.plug_into(model)
        FakeStream.wait_event = logged_wait  # type: ignore[method-assign]
        FSDPParamGroup.cancel_unshard = logged_cancel  # type: ignore[method-assign]
        try:
            with streams, torch.no_grad():
                model(torch.randn(2, 8))  # learns the order 0, 1, 2, 3
                model.skip = {1}
                dropped.clear()
                model(torch.randn(2, 8))  # guesses 1 after 0: dropped when 2 guesses 3
                model(torch.randn(2, 8))  # the next copy-in waits for the dropped one
        finally:
            FakeStream.wait_event, FSDPParamGroup.cancel_unshard = wait_event, cancel
    assert dropped, "a wrong guess should have been dropped"

    def is_dropped(event: object) -> bool:
        return any(event is d for d in dropped)

    on_compute = [e for name, e in waits if name == "current" and is_dropped(e)]
    on_copy_in = [e for name, e in waits if name == "all_gather_copy_in" and is_dropped(e)]
    assert not on_compute, "the compute stream waited for a dropped all-gather"
    assert {id(e) for e in on_copy_in} == {id(e) for e in dropped}, (on_copy_in, dropped)
    assert not streams.violations, streams.violations[:3]
