"""The FSDPModule methods that tune gradient reduction and communication,
each against a reference: the gradient divide factor (a loss summed and
normalised by the global count), zero gradients for parameters a rank did
not use (against DDP with ``find_unused_parameters=True``), no backward
all-gather for an embedding, an all-reduce hook (FSDP plus a hook equals
native HSDP), custom all-gather and reduce-scatter collectives, several
reduce-scatters in flight, a separate reduce-scatter process group, and roots
sharing their communication context.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, recorded, run_ranks
from error_model import EXACT, REF_TOL
from models import (
    MLP_DIMS,
    build_model,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

import fsdp2
from fsdp2.engine.reduction import ReductionPipeline


def _fsdp_modules(model: nn.Module) -> list[fsdp2.FSDPModule]:
    return [m for m in model.modules() if isinstance(m, fsdp2.FSDPModule)]


def _check_grads_equal(model: nn.Module, other: nn.Module, tol: dict = EXACT) -> None:
    others = dict(other.named_parameters())
    for name, param in model.named_parameters():
        assert_close(
            param.grad.to_local(), others[name].grad.to_local(), **tol, msg=lambda m, n=name: n
        )


# -- gradient reduction: divide factor, unused parameters, unshard_in_backward ------


def _divide_factor(rank: int, world_size: int) -> None:
    """A loss summed over the local batch and divided by the global batch size,
    with a divide factor of 1, trains like the mean loss of the reference."""
    ref = build_model("mlp")
    model = shard_model(build_model("mlp"))
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo always sums: no change
    optims = [make_optimizer(m) for m in (ref, model)]
    for step in range(3):
        inputs, targets = global_batch("mlp", step)
        ref_loss = mean_loss(ref, inputs, targets)
        ref_loss.backward()
        local_inputs, local_targets = local_batch((inputs, targets), rank, world_size)
        loss = F.mse_loss(model(local_inputs), local_targets, reduction="sum") / targets.numel()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total, ref_loss.detach(), **REF_TOL)
        for name, param in model.named_parameters():
            assert_close(param.grad.full_tensor(), ref.get_parameter(name).grad, **REF_TOL)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
        model.set_reduce_scatter_divide_factor(2.0)
    assert (
        model.layers[0]._fsdp_state.param_groups[0].gradient_divide_factor == 1.0
    )  # not recursive
    for bad in (0, -1.0, "2"):  # True is 1, as torch reads it (test_validation)
        with pytest.raises(ValueError, match="positive number"):
            model.layers[0].set_gradient_divide_factor(bad)


class Routed(nn.Module):
    """A shared layer and two experts; each rank routes all its tokens to one
    expert (rank r to expert r % 2), so an expert is unused on half the ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.head(F.relu(self.experts[expert](F.relu(self.shared(x)))))


def _unused_parameters(rank: int, world_size: int) -> None:
    ddp = DistributedDataParallel(Routed(), find_unused_parameters=True)
    model = Routed()
    fsdp2.fully_shard(model)  # one group: an unused expert leaves a hole in it
    model.set_reduce_scatter_unused_params(True)
    optims = [make_optimizer(m) for m in (ddp, model)]
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world_size, 8, generator=gen).chunk(world_size)[rank]
        y = torch.randn(4 * world_size, 4, generator=gen).chunk(world_size)[rank]
        expert = (rank + step) % 2
        ddp_loss = F.mse_loss(ddp(x, expert), y)
        ddp_loss.backward()
        loss = F.mse_loss(model(x, expert), y)
        loss.backward()
        assert_close(loss, ddp_loss, **REF_TOL)
        ddp_params = dict(ddp.module.named_parameters())
        for name, param in model.named_parameters():
            assert_close(
                param.grad.full_tensor(), ddp_params[name].grad, **REF_TOL, msg=lambda m, n=name: n
            )
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _unshard_in_backward(rank: int, world_size: int) -> None:
    """The token and position embeddings as one group whose backward does not
    all-gather (a lookup's gradient needs only the indices): one all-gather
    fewer per step, the same gradients as with it."""
    models = []
    for unshard_in_backward in (True, False):
        model = build_model("transformer_untied")
        fsdp2.fully_shard([model.tok_embeddings, model.pos_embeddings])
        shard_model(model)
        model.tok_embeddings.set_unshard_in_backward(unshard_in_backward)
        models.append(model)
    ref = build_model("transformer_untied")
    optims = [make_optimizer(m) for m in (ref, *models)]
    for step in range(3):
        batch = global_batch("transformer_untied", step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        counts = []
        for model in models:
            with recorded("all_gather") as calls:
                loss = mean_loss(model, *local_batch(batch, rank, world_size))
                loss.backward()
            counts.append(len(calls))
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        # Forward: embeddings, 2 blocks, root; backward: 2 blocks (+ embeddings).
        assert counts == [4 + 3, 4 + 2], counts
        _check_grads_equal(models[1], models[0])
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for name, param in full_params(models[1]).items():
        assert_close(param, ref.get_parameter(name), **REF_TOL, msg=name)


@pytest.mark.distributed
def test_divide_factor_unused_params_and_unshard_in_backward(tmp_path: Path) -> None:
    """set_gradient_divide_factor(1) with a loss normalised by the global batch
    trains like the reference's mean loss (force-sum on, deprecated alias
    warns); set_reduce_scatter_unused_params with experts unused on some ranks
    matches DDP(find_unused_parameters=True) without hanging;
    set_unshard_in_backward(False) on the embeddings saves one all-gather per
    step and changes no gradient."""
    run_ranks(_divide_factor, 2, tmp_path / "divide")
    run_ranks(_unused_parameters, 2, tmp_path / "unused")
    run_ranks(_unshard_in_backward, 2, tmp_path / "embeddings")


# -- hooks, custom collectives, in-flight reduce-scatters, process groups -----------


class CountingAllGather(fsdp2.AllGather):
    def __init__(self) -> None:
        self.allocated: list[torch.Size] = []
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.Size(size))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class CountingReduceScatter(fsdp2.ReduceScatter):
    def __init__(self) -> None:
        self.allocated: list[torch.Size] = []
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(torch.Size(size))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        assert op == dist.ReduceOp.SUM
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def _train_pair(rank: int, world_size: int, models: list[nn.Module], steps: int = 2) -> None:
    """Trains the reference-equal ``models[0]`` and each other model on the same
    local batches; every gradient equal to ``models[0]``'s."""
    optims = [make_optimizer(m) for m in models]
    for step in range(steps):
        local = local_batch(global_batch("mlp", step), rank, world_size)
        for model in models:
            mean_loss(model, *local).backward()
        for other in models[1:]:
            _check_grads_equal(other, models[0])
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _hook_equals_native_hsdp(rank: int, world_size: int) -> None:
    """FSDP over each half plus an all-reduce hook across the halves computes
    what native HSDP does; a hook on native HSDP sees the all-reduced output."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate_group = mesh.get_group("replicate")
    hsdp = shard_model(build_model("mlp"), mesh=mesh)
    seen: list[int] = []
    for layer in hsdp.layers:  # the root holds no parameters
        layer.set_all_reduce_hook(lambda output: seen.append(output.numel()))
    fsdp = shard_model(build_model("mlp"), mesh=mesh["shard"])

    def across_halves(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate_group)
        output.div_(2)  # fsdp2 averaged over the 2 ranks of the shard group already

    for layer in fsdp.layers:
        layer.set_all_reduce_hook(across_halves)
    ref = build_model("mlp")
    optims = [make_optimizer(m) for m in (ref, hsdp, fsdp)]
    for step in range(2):
        seen.clear()
        batch = global_batch("mlp", step)
        mean_loss(ref, *batch).backward()
        for model in (hsdp, fsdp):
            mean_loss(model, *local_batch(batch, rank, world_size)).backward()
        # One call per block and step, with its padded shard (weights and biases).
        padded = [
            sum(math.ceil(p.size(0) / 2) * p[0].numel() for p in layer.parameters())
            for layer in ref.layers
        ]
        assert sorted(seen) == sorted(padded), (seen, padded)
        for name, param in fsdp.named_parameters():
            expected = ref.get_parameter(name).grad
            assert_close(param.grad.full_tensor(), expected, **REF_TOL, msg=name)
            assert_close(param.grad.to_local(), hsdp.get_parameter(name).grad.to_local(), **REF_TOL)
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _custom_collectives(rank: int, world_size: int) -> None:
    default = shard_model(build_model("mlp"))
    custom = shard_model(build_model("mlp"))
    all_gather, reduce_scatter = CountingAllGather(), CountingReduceScatter()
    for module in _fsdp_modules(custom):
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    _train_pair(rank, world_size, [default, custom])
    n_layers = len(MLP_DIMS) - 1
    # Per step: each layer all-gathered in forward and backward, reduce-scattered once.
    assert all_gather.calls == 2 * 2 * n_layers, all_gather.calls
    assert reduce_scatter.calls == 2 * n_layers, reduce_scatter.calls
    assert len(all_gather.allocated) == all_gather.calls  # the output buffer
    assert len(reduce_scatter.allocated) == 2 * reduce_scatter.calls  # input and output
    with pytest.raises(TypeError, match=r"allocate\(size, \*, dtype, device\)"):
        custom.layers[0].set_custom_all_gather(dist.all_gather_into_tensor)


def _in_flight_and_groups(rank: int, world_size: int) -> None:
    with labelled("two reduce-scatters in flight"):
        peaks: list[int] = []
        make_room = ReductionPipeline.make_room

        def recording(pipeline: ReductionPipeline) -> None:
            make_room(pipeline)
            peaks.append(len(pipeline.reduce_scatters) + 1)

        default = shard_model(build_model("mlp"))
        wide = shard_model(build_model("mlp"))
        wide.set_reduce_scatter_max_input_buffers(2)
        ReductionPipeline.make_room = recording  # type: ignore[method-assign]
        try:
            _train_pair(rank, world_size, [default, wide])
        finally:
            ReductionPipeline.make_room = make_room  # type: ignore[method-assign]
        assert max(peaks) == 2, peaks
        for bad, error in ((0, ValueError), (True, TypeError), (1.5, TypeError)):
            with pytest.raises(error, match="max_input_buffers must be"):
                wide.set_reduce_scatter_max_input_buffers(bad)
    with labelled("separate reduce-scatter process group"):
        default = shard_model(build_model("mlp"))
        separate = shard_model(build_model("mlp"))
        separate.set_separate_reduce_scatter_group()
        with recorded("reduce_scatter") as calls:
            _train_pair(rank, world_size, [default, separate])
        groups = {id(call.group) for call in calls}
        assert len(groups) == 2, "the default model's group and the separate one"
        shard_group = separate.layers[0]._fsdp_state.mesh_info.shard_group
        variant = separate.layers[0]._fsdp_state.param_groups[0].comms.reduce_scatter
        rs_group = variant.collectives.process_group
        assert rs_group is not shard_group
        assert dist.get_process_group_ranks(rs_group) == dist.get_process_group_ranks(shard_group)
    with labelled("share_comm_ctx"):
        torch.manual_seed(0)
        full = nn.Sequential(nn.Linear(17, 33), nn.ReLU(), nn.Linear(33, 7))
        first, second = nn.Sequential(full[0], full[1]), nn.Sequential(full[2])
        ref = nn.Sequential(nn.Linear(17, 33), nn.ReLU(), nn.Linear(33, 7))
        ref.load_state_dict(full.state_dict())
        for chunk in (first, second):  # two roots, as pipeline stages' chunks are
            fsdp2.fully_shard(chunk[0])
            fsdp2.fully_shard(chunk)
        fsdp2.share_comm_ctx([first, second])
        assert first._fsdp_state.root_ctx.comm is second._fsdp_state.root_ctx.comm
        optims = [make_optimizer(m) for m in (ref, first, second)]
        for step in range(2):
            inputs, targets = global_batch("mlp", step)
            ref_loss = F.mse_loss(ref(inputs), targets)
            ref_loss.backward()
            local_inputs, local_targets = local_batch((inputs, targets), rank, world_size)
            loss = F.mse_loss(second(first(local_inputs)), local_targets)
            loss.backward()
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
            for optim in optims:
                optim.step()
                optim.zero_grad()
        assert (
            second._fsdp_state.root_ctx.comm is first._fsdp_state.root_ctx.comm
        )  # after lazy init


@pytest.mark.distributed
def test_hooks_custom_collectives_and_process_groups(tmp_path: Path) -> None:
    """On 4 ranks: FSDP on each half of a 2 x 2 mesh plus set_all_reduce_hook
    all-reducing across the halves trains like native HSDP and the reference,
    and a hook on native HSDP is called once per group and step with its
    padded shard. On 2 ranks: custom all-gather and reduce-scatter
    collectives are used for every collective and buffer, with gradients equal
    to the default ones; two reduce-scatters in flight, and a separate
    reduce-scatter process group (same ranks, another group), leave every
    gradient unchanged; two roots sharing a communication context train like
    the reference."""
    run_ranks(_hook_equals_native_hsdp, 4, tmp_path / "hook")
    run_ranks(_custom_collectives, 2, tmp_path / "custom")
    run_ranks(_in_flight_and_groups, 2, tmp_path / "in_flight")


def test_settings_that_need_an_accelerator_or_a_callable() -> None:
    with fake_world(2):
        model = fsdp2.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))
        with pytest.raises(ValueError, match="set_post_optim_event needs an accelerator"):
            model.set_post_optim_event(object())
        with pytest.raises(ValueError, match=r"stream=\.\.\.\) needs an accelerator"):
            model.set_all_reduce_hook(lambda t: None, stream=object())
        with pytest.raises(TypeError, match="expects a callable"):
            model.set_all_reduce_hook(3)  # type: ignore[arg-type]  (None removes the hook)
        with pytest.raises(
            ValueError, match="share_comm_ctx expects modules passed to fully_shard"
        ):
            fsdp2.share_comm_ctx([model, nn.Linear(2, 2)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.set_force_sum_reduction_for_comms(False)
