"""The accelerator path's stream protocol, run on 2 gloo ranks under the stream
model (tests/stream_model.py): every scenario trains a few steps with fsdp2's
streams and events going through the model, which must report no access that
is not ordered after a conflicting one and no free before a use on another
stream. The negative control (waits disabled) must report some."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import labelled, run_ranks
from models import build_model, global_batch, local_batch, mean_loss, shard_model
from stream_model import StreamModel

import fsdp2

STEPS = 3

SCENARIOS = [
    "plain",
    "reshard_after_forward=False",
    "reshard_after_forward=1",
    "explicit prefetch",
    "no forward prefetch",
    "accumulation without sync",
    "accumulation without resharding",
    "mixed precision",
    "reduce-scatter queue of 2",
    "all-reduce hook on a stream",
    "unshard(async_op=True)",
    "share_comm_ctx",
]


def _shard(name: str) -> torch.nn.Module:
    kwargs: dict = {}
    if name == "reshard_after_forward=False":
        kwargs["reshard_after_forward"] = False
    elif name == "reshard_after_forward=1":
        kwargs["reshard_after_forward"] = 1
    elif name == "mixed precision":
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    return shard_model(build_model("mlp"), **kwargs)


def _configure(name: str, model: torch.nn.Module, streams: StreamModel) -> None:
    layers = list(model.layers)
    if name == "explicit prefetch":
        for before, after in zip(layers, layers[1:], strict=False):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    elif name == "no forward prefetch":
        for layer in layers:
            layer.set_modules_to_forward_prefetch([])
    elif name == "reduce-scatter queue of 2":
        model.set_reduce_scatter_max_input_buffers(2)
    elif name == "all-reduce hook on a stream":
        side = streams.new_stream()
        for layer in layers:
            layer.set_all_reduce_hook(lambda t: t.mul_(1.0), stream=side)


def _step(name: str, model: torch.nn.Module, step: int, rank: int, world_size: int) -> None:
    inputs, targets = local_batch(global_batch("mlp", step), rank, world_size)
    if name.startswith("accumulation"):
        half = inputs.size(0) // 2
        if name == "accumulation without sync":
            model.set_requires_gradient_sync(False)
        else:
            model.set_reshard_after_backward(False)
        mean_loss(model, inputs[:half], targets[:half]).backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        mean_loss(model, inputs[half:], targets[half:]).backward()
        return
    if name == "unshard(async_op=True)":
        handle = model.layers[0].unshard(async_op=True)
        assert handle is not None
        handle.wait()
    mean_loss(model, inputs, targets).backward()


def _train(name: str, streams: StreamModel, rank: int, world_size: int) -> None:
    if name == "share_comm_ctx":
        first, second = _shard("plain"), _shard("plain")
        streams.plug_into(first)
        streams.plug_into(second)
        fsdp2.share_comm_ctx([first, second])
        models = [first, second]
    else:
        model = _shard(name)
        streams.plug_into(model)
        _configure(name, model, streams)
        models = [model]
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    with streams:
        for step in range(STEPS):
            for model, optim in zip(models, optims, strict=True):
                _step(name, model, step, rank, world_size)
                optim.step()
                optim.zero_grad()


def _scenarios(rank: int, world_size: int, names: list[str]) -> None:
    for name in names:
        with labelled(name):
            streams = StreamModel()
            _train(name, streams, rank, world_size)
            assert streams.violations == [], "\n".join(streams.violations[:10])
            # The collectives ran on the comm streams, not on the compute stream.
            assert streams.ops_by_stream.get("side1", 0) > 0, streams.ops_by_stream


@pytest.mark.distributed
def test_scenarios_have_no_unordered_access(tmp_path: Path) -> None:
    run_ranks(_scenarios, 2, tmp_path, SCENARIOS)


def _without_waits(rank: int, world_size: int) -> None:
    streams = StreamModel(waits=False)
    _train("plain", streams, rank, world_size)
    # The copy-in written on the compute stream, read by the all-gather on its
    # stream; the all-gather output read by the copy-out; the gradients'
    # reduce-scatter buffers freed on the compute stream.
    assert len(streams.violations) > 0
    assert any("without waiting" in v for v in streams.violations), streams.violations[:5]
    assert any("freed" in v for v in streams.violations), streams.violations[:5]
    dist.barrier()


@pytest.mark.distributed
def test_negative_control_without_waits_reports_violations(tmp_path: Path) -> None:
    run_ranks(_without_waits, 2, tmp_path)
