"""The training features of docs/usage.md, each against an unsharded reference
(DDP math: a plain copy trained on the global batch with a mean loss) and, where
torch has the same option, against ``torch.distributed.fsdp.fully_shard``:
mixed precision, gradient accumulation, resharding policies, frozen, tied and
ignored parameters, gradient clipping, activation checkpointing, CPU offload
and forward methods other than ``forward``. State dicts and meta-device
initialisation are in test_state_dict.py. A few single-process tests at the
end pin differences from torch's fully_shard that need no data.

Collectives are recorded by wrapping ``torch.distributed.all_gather_single``
and ``reduce_scatter_single`` inside the rank processes (the engine looks them
up on ``torch.distributed`` at call time; torch's fully_shard uses other
collectives, so only fsdp2's are recorded).
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, run_ranks, wrapped_collectives
from error_model import (
    EXACT,
    REF_TOL,
    check_grads_against_torch,
    check_losses_equal,
    copy_local_shards,
    rank_sum_bounds,
)
from models import (
    MLP_DIMS,
    build_model,
    fsdp_modules,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
    transformer_args,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.testing import assert_close
from torch.testing._internal.distributed._tensor.common_dtensor import (
    Transformer,
    TransformerBlock,
)
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from fsdp2.base.private_dist import local_tensor
from fsdp2.engine.states import ShardedState

WORLD_SIZE = 2
KIND = "transformer_untied"
N_LAYERS = 2
NUM_STEPS = 3


# -- helpers ------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    kind: str  # "all_gather" or "reduce_scatter"
    nbytes: int  # of the whole buffer: all-gather output, reduce-scatter input
    dtype: torch.dtype
    group_ranks: tuple[int, ...]  # global ranks of the process group it ran on


@contextlib.contextmanager
def record_collectives() -> Iterator[list[Collective]]:
    """Records fsdp2's all-gathers and reduce-scatters while active."""
    log: list[Collective] = []

    def recording(kind: str):
        def wrap(original):
            def collective(self, output, input, *args, **kwargs):
                buffer = output if kind == "all_gather" else input
                ranks = tuple(dist.get_process_group_ranks(self.process_group))
                nbytes = buffer.numel() * buffer.element_size()
                log.append(Collective(kind, nbytes, buffer.dtype, ranks))
                return original(self, output, input, *args, **kwargs)

            return collective

        return wrap

    with (
        wrapped_collectives("all_gather", recording("all_gather")),
        wrapped_collectives("reduce_scatter", recording("reduce_scatter")),
    ):
        yield log


def _of_kind(log: list[Collective], kind: str) -> list[Collective]:
    return [c for c in log if c.kind == kind]


def _groups(model: nn.Module) -> list[fsdp2.FSDPModule]:
    """FSDP modules that own parameters."""
    return [m for m in fsdp_modules(model) if m._fsdp_state.param_groups]


def _sharded_states(model: nn.Module) -> dict[str, ShardedState]:
    return {
        m._fsdp_state.param_groups[0].name: m._fsdp_state.param_groups[0].sharded_state
        for m in _groups(model)
    }


def _check_all_sharded(model: nn.Module, when: str) -> None:
    states = _sharded_states(model)
    assert set(states.values()) == {ShardedState.SHARDED}, f"{when}: {states}"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{when}: {name} is a {type(param).__name__}"


def _ref_name(name: str) -> str:
    """The reference's name of a parameter (checkpoint_wrapper adds a prefix)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _check_grads(
    model: nn.Module, ref: nn.Module, tol: dict[str, float] = REF_TOL, what: str = "reference"
) -> None:
    """Frozen parameters have no grad; every other grad is a Shard(0) DTensor
    whose full tensor is the reference's grad."""
    for name, param in model.named_parameters():
        ref_grad = ref.get_parameter(_ref_name(name)).grad
        if isinstance(ref_grad, DTensor):  # another fsdp2 run
            ref_grad = ref_grad.full_tensor()
        if not param.requires_grad:
            assert param.grad is None, f"frozen {name} has a gradient"
            continue
        grad = param.grad
        assert isinstance(grad, DTensor), f"{name}.grad is {type(grad).__name__}, not a DTensor"
        assert grad.placements == (Shard(0),), f"{name}.grad placements {grad.placements}"
        assert_close(
            grad.full_tensor(), ref_grad, **tol, msg=lambda m, n=name: f"{n}.grad vs {what}: {m}"
        )


def _check_grads_match_torch(model: nn.Module, torch_model: nn.Module) -> None:
    """Equal to torch's on WORLD_SIZE = 2 ranks (tests/error_model.py, point 2)."""
    torch_params = dict(torch_model.named_parameters())
    for name, param in model.named_parameters():
        if param.grad is None:
            assert torch_params[name].grad is None, f"{name}: no grad, torch has one"
            continue
        assert param.grad.dtype == torch_params[name].grad.dtype, f"{name}.grad dtype"
        assert_close(
            param.grad.to_local(),
            torch_params[name].grad.to_local(),
            **EXACT,
            msg=lambda m, n=name: f"{n}.grad local shard vs torch fully_shard: {m}",
        )


def _check_params(model: nn.Module, ref: nn.Module, tol: dict[str, float] = REF_TOL) -> None:
    for name, param in full_params(model).items():
        assert_close(
            param,
            ref.get_parameter(_ref_name(name)),
            **tol,
            msg=lambda m, n=name: f"{n} vs the reference: {m}",
        )


def _check_loss(loss: torch.Tensor, ref_loss: torch.Tensor, world_size: int, step: int) -> None:
    assert_close(
        global_mean(loss, world_size),
        ref_loss.detach(),
        **REF_TOL,
        msg=lambda m: f"step {step}: loss vs the reference: {m}",
    )


def _step(*optims: torch.optim.Optimizer) -> None:
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _train_in_parity(
    model: nn.Module,
    ref: nn.Module,
    rank: int,
    world_size: int,
    *,
    kind: str = KIND,
    steps: int = NUM_STEPS,
    after_backward: Callable[[int], None] | None = None,
) -> list[list[Collective]]:
    """Trains ``model`` on local batches and ``ref`` on the global ones, checking
    losses and grads each step and parameters at the end. Returns each step's
    collectives."""
    optims = [make_optimizer(m) for m in (ref, model)]
    logs = []
    for step in range(steps):
        batch = global_batch(kind, step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        with record_collectives() as log:
            loss = mean_loss(model, *local_batch(batch, rank, world_size))
            loss.backward()
        logs.append(log)
        if after_backward is not None:
            after_backward(step)
        with labelled(f"step {step}"):
            _check_loss(loss, ref_loss, world_size, step)
            _check_grads(model, ref)
        _step(*optims)
    _check_params(model, ref)
    return logs


def _padded_bytes(params: list[nn.Parameter], world_size: int) -> int:
    """Bytes of an fp32 communication buffer holding ``params`` in the padded
    layout: every rank's slot is ceil(dim0 / world_size) rows."""
    return 4 * world_size * sum(math.ceil(p.size(0) / world_size) * p[0].numel() for p in params)


# -- mixed precision, CPU offload ---------------------------------------------

# bf16 compute against the fp32 reference: bf16 has an 8-bit mantissa.
BF16_LOSS_TOL = {"rtol": 1e-2, "atol": 1e-3}


def _record_dtypes(module: nn.Module, seen: list[tuple[torch.dtype, torch.dtype, str]]) -> None:
    """A forward pre-hook (registered after fully_shard, so it runs after the
    engine's) that records what ``module`` computes with."""

    def hook(mod: nn.Module, args: tuple) -> None:
        seen.append((mod.weight.dtype, args[0].dtype, type(mod.weight).__name__))

    module.register_forward_pre_hook(hook)


def _mixed_precision_training(
    rank: int, world_size: int, mesh: DeviceMesh, reduce_dtype: torch.dtype
) -> None:
    bf16 = torch.bfloat16
    ref = build_model(KIND)
    model = shard_model(
        build_model(KIND),
        mesh=mesh,
        mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce_dtype),
    )
    torch_model = shard_model(
        build_model(KIND),
        torch_fully_shard,
        mesh=mesh,
        mp_policy=TorchMixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce_dtype),
    )
    seen, torch_seen = [], []
    _record_dtypes(model.layers[0].attention.wq, seen)
    _record_dtypes(torch_model.layers[0].attention.wq, torch_seen)
    optims = [make_optimizer(m) for m in (ref, model, torch_model)]

    for step in range(NUM_STEPS):
        batch = global_batch(KIND, step)
        local = local_batch(batch, rank, world_size)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        with record_collectives() as log:
            loss = mean_loss(model, *local)
            loss.backward()
        torch_loss = mean_loss(torch_model, *local)
        torch_loss.backward()
        with labelled(f"step {step}"):
            assert {c.dtype for c in _of_kind(log, "all_gather")} == {bf16}, log
            assert {c.dtype for c in _of_kind(log, "reduce_scatter")} == {reduce_dtype}, log
            assert_close(loss.detach(), torch_loss.detach(), **EXACT)
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **BF16_LOSS_TOL)
            for name, param in model.named_parameters():
                assert param.dtype == torch.float32, f"sharded {name} is {param.dtype}"
                assert param.grad.dtype == torch.float32, f"{name}.grad is {param.grad.dtype}"
                assert isinstance(param.grad, DTensor), f"{name}.grad is not a DTensor"
            _check_grads_match_torch(model, torch_model)
        _step(*optims)

    # The hook on an inner Linear: bf16 unsharded weight, bf16 input (cast at the root).
    assert seen == [(bf16, bf16, "Parameter")] * NUM_STEPS, seen
    assert [s[:2] for s in seen] == [s[:2] for s in torch_seen], torch_seen
    for param in model.parameters():
        state = optims[1].state[param]
        buffer = state["momentum_buffer"]
        assert isinstance(buffer, DTensor), "the optimizer's momentum buffer is not a DTensor"
        assert buffer.dtype == torch.float32, f"the optimizer's momentum buffer is {buffer.dtype}"
    torch_params = dict(torch_model.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, f"sharded {name} is {param.dtype}"
        assert_close(
            param.to_local(),
            torch_params[name].to_local(),
            **EXACT,
            msg=lambda m, n=name: f"{n} vs torch fully_shard: {m}",
        )


def _output_dtype(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """The MLP computes in bf16: its output is bf16 unless the root's
    output_dtype casts it (only the root's, so the layers still pass bf16 on).
    The first Linear gets the fp32 input cast to bf16 (cast_forward_inputs)."""
    bf16 = torch.bfloat16
    inputs = local_batch(global_batch("mlp", 0), rank, world_size)[0]
    for output_dtype in (None, torch.float32):
        outputs = []
        for shard in (fsdp2.fully_shard, torch_fully_shard):
            policy_cls = (
                fsdp2.MixedPrecisionPolicy
                if shard is fsdp2.fully_shard
                else TorchMixedPrecisionPolicy
            )
            model = build_model("mlp")
            seen = []
            _record_dtypes(model.layers[0], seen)
            for layer in model.layers:
                shard(layer, mesh=mesh, mp_policy=policy_cls(param_dtype=bf16))
            root_policy = policy_cls(param_dtype=bf16, output_dtype=output_dtype)
            shard(model, mesh=mesh, mp_policy=root_policy)
            outputs.append(model(inputs))
            assert [s[:2] for s in seen] == [(bf16, bf16)], seen
        output, torch_output = outputs
        assert output.dtype == (output_dtype or bf16), f"{output_dtype}: {output.dtype}"
        assert torch_output.dtype == output.dtype, torch_output.dtype
        assert_close(output, torch_output, rtol=0, atol=0)


def _cpu_offload(rank: int, world_size: int, mesh: DeviceMesh, policy: fsdp2.OffloadPolicy) -> None:
    ref = build_model(KIND)
    model = shard_model(build_model(KIND), mesh=mesh, offload_policy=policy)
    optim = make_optimizer(model)
    optims = [make_optimizer(ref), optim]
    for step in range(2):
        batch = global_batch(KIND, step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        loss = mean_loss(model, *local_batch(batch, rank, world_size))
        loss.backward()
        with labelled(f"step {step}"):
            _check_loss(loss, ref_loss, world_size, step)
            _check_grads(model, ref)
            for name, param in model.named_parameters():
                assert param.device.type == "cpu", f"{name} on {param.device}"
                assert param.to_local().device.type == "cpu", f"{name}'s shard"
                assert param.grad.to_local().device.type == "cpu", f"{name}.grad"
        _step(*optims)
    for param in model.parameters():
        for key, value in optim.state[param].items():
            if key != "step":
                assert value.to_local().device.type == "cpu", f"optimizer {key}"
    _check_params(model, ref)


def _mixed_precision_and_offload(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for reduce_dtype in (torch.float32, torch.bfloat16):
        with labelled(f"param_dtype=bf16, reduce_dtype={reduce_dtype}"):
            _mixed_precision_training(rank, world_size, mesh, reduce_dtype)
    with labelled("output_dtype"):
        _output_dtype(rank, world_size, mesh)
    policies = (fsdp2.CPUOffloadPolicy(pin_memory=True), fsdp2.CPUOffloadPolicy(pin_memory=False))
    for policy in (*policies, fsdp2.OffloadPolicy()):
        with labelled(repr(policy)):
            _cpu_offload(rank, world_size, mesh, policy)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_mixed_precision_and_cpu_offload(world_size: int, tmp_path: Path) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 or bf16), against
    torch's fully_shard with the same policy over 3 SGD steps: all-gathers run
    in bf16 and reduce-scatters in reduce_dtype (gloo sums bf16); an inner
    Linear computes with a bf16 weight on a bf16 input; local losses equal
    torch's and match the fp32 reference within bf16 tolerance; sharded params,
    their grads and the optimizer state stay fp32 DTensors; grads and params
    equal torch's bit for bit (world size 2: a bf16 reduction included, since
    dividing by 2 before the sum is exact). The
    root's output_dtype casts the output like torch's, and the fp32 input
    reaches the first Linear as bf16 (cast_forward_inputs). CPUOffloadPolicy (pinned
    or not) and OffloadPolicy() on a CPU mesh: accepted, parameters, grads and
    optimizer state on the CPU, parity over 2 steps."""
    run_ranks(_mixed_precision_and_offload, world_size, tmp_path)


# -- gradient accumulation, resharding after backward, last backward ----------

N_MICRO = 3


def _micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [global_batch(KIND, N_MICRO * step + i) for i in range(N_MICRO)]


def _accumulate_ref(ref: nn.Module, step: int) -> None:
    """Gradients summed over the micro-batches' mean losses."""
    for batch in _micro_batches(step):
        mean_loss(ref, *batch).backward()


def _accumulate(
    model: nn.Module, rank: int, world_size: int, step: int, way: str
) -> list[tuple[list[Collective], list[Collective]]]:
    """Runs the micro-batches of ``step`` the given way; returns the
    (forward, backward) collectives of each."""
    logs = []
    for i, batch in enumerate(_micro_batches(step)):
        last = i == N_MICRO - 1
        if way != "sync every micro-batch":
            model.set_requires_gradient_sync(last)
        if way == "no sync, no reshard after backward":
            model.set_reshard_after_backward(last)
        with record_collectives() as forward_log:
            loss = mean_loss(model, *local_batch(batch, rank, world_size))
        with record_collectives() as backward_log:
            loss.backward()
        logs.append((forward_log, backward_log))
        if not last and way != "sync every micro-batch":
            with labelled(f"micro-batch {i}"):
                for name, param in model.named_parameters():
                    assert param.grad is None, f"{name} has a sharded grad before the sync"
    return logs


def _gradient_accumulation(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    n_groups = N_LAYERS + 1
    ways = (
        "sync every micro-batch",
        "no sync until the last",
        "no sync, no reshard after backward",
    )
    ref = build_model(KIND)
    models = {way: shard_model(build_model(KIND), mesh=mesh) for way in ways}
    optims = [make_optimizer(m) for m in (ref, *models.values())]
    for step in range(2):
        _accumulate_ref(ref, step)
        for way, model in models.items():
            with labelled(f"step {step}, {way}"):
                logs = _accumulate(model, rank, world_size, step, way)
                reduce_scatters = [len(_of_kind(b, "reduce_scatter")) for _, b in logs]
                forward_gathers = [len(_of_kind(f, "all_gather")) for f, _ in logs]
                backward_gathers = [len(_of_kind(b, "all_gather")) for _, b in logs]
                if way == "sync every micro-batch":
                    assert reduce_scatters == [n_groups] * N_MICRO, reduce_scatters
                else:
                    assert reduce_scatters == [0] * (N_MICRO - 1) + [n_groups], reduce_scatters
                if way == "no sync, no reshard after backward":
                    # Everything stays unsharded between micro-batches, so the next
                    # forward gathers nothing; blocks still reshard after forward,
                    # so backward gathers them again.
                    assert forward_gathers == [n_groups] + [0] * (N_MICRO - 1), forward_gathers
                else:
                    assert forward_gathers == [n_groups] * N_MICRO, forward_gathers
                assert backward_gathers == [N_LAYERS] * N_MICRO, backward_gathers
                _check_all_sharded(model, "after the last micro-batch")
                _check_grads(model, ref)
        baseline = models[ways[0]]
        for way in ways[1:]:
            with labelled(f"step {step}, {way} vs syncing every micro-batch"):
                # Reduced once or per micro-batch: the same terms summed in
                # another order, as against the reference.
                _check_grads(models[way], baseline, REF_TOL, "syncing every micro-batch")
        _step(*optims)
    for way, model in models.items():
        with labelled(way):
            _check_params(model, ref)


def _reshard_after_backward_off(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """Between two micro-batches with set_reshard_after_backward(False), every
    group holds plain unsharded parameters equal to the reference's."""
    ref = build_model(KIND)
    model = shard_model(build_model(KIND), mesh=mesh)
    model.set_reshard_after_backward(False)
    batch = global_batch(KIND, 0)
    mean_loss(ref, *batch).backward()
    mean_loss(model, *local_batch(batch, rank, world_size)).backward()
    states = _sharded_states(model)
    assert set(states.values()) == {ShardedState.UNSHARDED}, states
    for name, param in model.named_parameters():
        assert not isinstance(param, DTensor), f"{name} was resharded"
        assert_close(param, ref.get_parameter(name), rtol=0, atol=0)
    with record_collectives() as log, torch.no_grad():
        output = model(local_batch(batch, rank, world_size)[0])
    assert log == [], f"a forward after backward without resharding communicated: {log}"
    with torch.no_grad():
        assert_close(output, ref(local_batch(batch, rank, world_size)[0]), **REF_TOL)
    model.reshard()
    for block in model.layers:
        block.reshard()
    _check_all_sharded(model, "after reshard()")


def _last_backward(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """set_is_last_backward(False) leaves the last reduce-scatter (the root's)
    in flight: the root's grads are missing until a later backward with True
    finishes it, and the accumulated grads are then the reference's."""
    ref = build_model(KIND)
    model = shard_model(build_model(KIND), mesh=mesh)
    optims = [make_optimizer(m) for m in (ref, model)]
    root_owned = [n for n, _ in model.named_parameters() if not n.startswith("layers.")]
    for step in range(2):
        batches = [global_batch(KIND, 2 * step + i) for i in range(2)]
        for batch in batches:
            mean_loss(ref, *batch).backward()
        model.set_is_last_backward(False)
        mean_loss(model, *local_batch(batches[0], rank, world_size)).backward()
        for name, param in model.named_parameters():
            in_flight = name in root_owned
            assert (param.grad is None) == in_flight, (
                f"step {step}: {name}.grad is {'set' if param.grad is not None else 'None'}"
            )
        model.set_is_last_backward(True)
        mean_loss(model, *local_batch(batches[1], rank, world_size)).backward()
        with labelled(f"step {step}"):
            _check_grads(model, ref)
        _step(*optims)
    _check_params(model, ref)
    # An optimizer step right after a backward that was not the last steps every
    # gradient, as after torch's: the step finishes what that backward left.
    batch = global_batch(KIND, 4)
    mean_loss(ref, *batch).backward()
    model.set_is_last_backward(False)
    mean_loss(model, *local_batch(batch, rank, world_size)).backward()
    assert any(p.grad is None for p in model.parameters()), "nothing was left in flight"
    _step(*optims)
    model.set_is_last_backward(True)
    with labelled("a step after a backward that was not the last"):
        _check_params(model, ref)


def _async_unshard(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """Every group unsharded with unshard(async_op=True) and waited for before
    forward: the forward gathers nothing, training keeps parity."""
    ref = build_model(KIND)
    model = shard_model(build_model(KIND), mesh=mesh)
    optims = [make_optimizer(m) for m in (ref, model)]
    for step in range(2):
        batch = global_batch(KIND, step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        with record_collectives() as unshard_log:
            handles = [m.unshard(async_op=True) for m in _groups(model)]
        assert all(isinstance(h, fsdp2.UnshardHandle) for h in handles), handles
        for handle in handles:
            handle.wait()
        with record_collectives() as forward_log:
            loss = mean_loss(model, *local_batch(batch, rank, world_size))
        loss.backward()
        with labelled(f"step {step}"):
            assert len(unshard_log) == N_LAYERS + 1, unshard_log
            assert forward_log == [], f"forward gathered again: {forward_log}"
            _check_loss(loss, ref_loss, world_size, step)
            _check_grads(model, ref)
            _check_all_sharded(model, "after backward")
        _step(*optims)
    _check_params(model, ref)


def _accumulation_and_resharding(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    with labelled("gradient accumulation"):
        _gradient_accumulation(rank, world_size, mesh)
    with labelled("set_reshard_after_backward(False)"):
        _reshard_after_backward_off(rank, world_size, mesh)
    with labelled("set_is_last_backward"):
        _last_backward(rank, world_size, mesh)
    with labelled("unshard(async_op=True)"):
        _async_unshard(rank, world_size, mesh)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_accumulation_and_manual_resharding(world_size: int, tmp_path: Path) -> None:
    """Gradient accumulation over 3 micro-batches for 2 steps, three ways:
    syncing every micro-batch, set_requires_gradient_sync(False) until the last
    (no reduce-scatter until then, no sharded grad until then), and that plus
    set_reshard_after_backward(False) (no all-gather in the later forwards). All
    three give the reference's summed grads and the same grads as each other
    (1e-5). set_reshard_after_backward(False) leaves plain unsharded parameters
    and the next forward communicates nothing; set_is_last_backward(False)
    leaves the root's reduce-scatter in flight until a later backward with True,
    whose grads are then the reference's; unshard(async_op=True) handles waited
    before forward leave the forward nothing to gather, with parity."""
    run_ranks(_accumulation_and_resharding, world_size, tmp_path)


# -- reshard_after_forward True, False and 2 ----------------------------------


def _shard_blocks(
    model: nn.Module, shard: Callable[..., nn.Module], mesh: DeviceMesh, value: bool | int
) -> nn.Module:
    """``reshard_after_forward=value`` on each block; the root keeps its default."""
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=value)
    shard(model, mesh=mesh)
    return model


def _reshard_after_forward(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    everyone = tuple(range(world_size))
    half = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))  # this rank's pair: 0-1 or 2-3
    # (blocks' reshard_after_forward, process group of each backward all-gather)
    cases = [(True, [everyone] * N_LAYERS), (False, []), (2, [half] * N_LAYERS)]
    for value, backward_groups in cases:
        with labelled(f"reshard_after_forward={value}"):
            ref = build_model(KIND)
            model = _shard_blocks(build_model(KIND), fsdp2.fully_shard, mesh, value)
            torch_model = _shard_blocks(build_model(KIND), torch_fully_shard, mesh, value)
            replica = build_model(KIND)
            optims = [make_optimizer(m) for m in (ref, model)]
            for step in range(2):
                batch = global_batch(KIND, step)
                local = local_batch(batch, rank, world_size)
                # 4 ranks: torch's model from fsdp2's parameters, gradients within
                # the bound of a sum over ranks in another order (error_model.py).
                copy_local_shards(model, torch_model)
                bounds = rank_sum_bounds(replica, model, mean_loss, local, world_size)
                ref_loss = mean_loss(ref, *batch)
                ref_loss.backward()
                with record_collectives() as forward_log:
                    loss = mean_loss(model, *local)
                blocks_after_forward = {
                    block._fsdp_state.param_groups[0].sharded_state for block in model.layers
                }
                with record_collectives() as backward_log:
                    loss.backward()
                torch_loss = mean_loss(torch_model, *local)
                torch_loss.backward()
                with labelled(f"step {step}"):
                    forward_groups = [c.group_ranks for c in forward_log]
                    assert forward_groups == [everyone] * (N_LAYERS + 1), forward_groups
                    groups = [c.group_ranks for c in _of_kind(backward_log, "all_gather")]
                    assert groups == backward_groups, groups
                    expected_state = {
                        True: ShardedState.SHARDED,
                        False: ShardedState.UNSHARDED,
                        2: ShardedState.SHARDED_POST_FORWARD,
                    }[value]
                    assert blocks_after_forward == {expected_state}, blocks_after_forward
                    if value == 2:
                        # The same padded bytes, gathered from 2 ranks instead of 4.
                        sizes = [c.nbytes for c in _of_kind(backward_log, "all_gather")]
                        assert sizes == [c.nbytes for c in forward_log[1:]][::-1], sizes
                    _check_loss(loss, ref_loss, world_size, step)
                    check_losses_equal(loss, torch_loss, "local loss")
                    _check_grads(model, ref)
                    check_grads_against_torch(model, torch_model, bounds, "grads")
                    _check_all_sharded(model, "after backward")
                _step(*optims)
                torch_model.zero_grad()
            _check_params(model, ref)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [4])
def test_reshard_after_forward(world_size: int, tmp_path: Path) -> None:
    """At world size 4, blocks with reshard_after_forward True, False and 2
    (the root with its default): losses, grads and parameters match the
    reference (1e-5); from the same parameters, losses equal torch's
    fully_shard's with the same value and grads are within the error model's
    bound of a sum over 4 ranks in another order. After
    forward the blocks are SHARDED, UNSHARDED and SHARDED_POST_FORWARD; every
    forward all-gather runs over all 4 ranks; backward gathers each block again
    over 4 ranks (True), not at all (False), or over this rank's pair of
    consecutive ranks (2), moving the same bytes as the forward's."""
    run_ranks(_reshard_after_forward, world_size, tmp_path)


# -- frozen, tied and ignored parameters, gradient clipping -------------------


class LoRALinear(nn.Module):
    """A Linear with a frozen weight, a trainable bias and a trainable low-rank
    adapter: frozen and trainable parameters in one group."""

    def __init__(self, d_in: int, d_out: int, rank: int = 3) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)  # nonzero: both get grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


class LoRAMLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = MLP_DIMS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            LoRALinear(d_in, d_out) for d_in, d_out in zip(dims[:-1], dims[1:], strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def _build_lora() -> LoRAMLP:
    torch.manual_seed(0)
    return LoRAMLP()


def _lora(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    ref = _build_lora()
    model = shard_model(_build_lora(), mesh=mesh)
    frozen_before = {
        n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad
    }
    # One group per layer (the root owns nothing), in backward order.
    layers = list(ref.layers)[::-1]
    all_gather_bytes = [_padded_bytes(list(layer.parameters()), world_size) for layer in layers]
    trainable = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    reduce_scatter_bytes = [_padded_bytes(params, world_size) for params in trainable]
    assert all(r < a for r, a in zip(reduce_scatter_bytes, all_gather_bytes, strict=True))

    def check_bytes(log: list[Collective]) -> None:
        sizes = [c.nbytes for c in _of_kind(log, "reduce_scatter")]
        assert sizes == reduce_scatter_bytes, f"reduce-scatter bytes {sizes}"
        # Frozen weights are still gathered: forward, then backward's input grads need them.
        sizes = [c.nbytes for c in _of_kind(log, "all_gather")]
        assert sorted(sizes) == sorted(all_gather_bytes * 2), f"all-gather bytes {sizes}"

    logs = _train_in_parity(model, ref, rank, world_size, kind="mlp")
    for step, log in enumerate(logs):
        with labelled(f"step {step}"):
            check_bytes(log)
    for name, param in full_params(model).items():
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), f"frozen {name} changed"


def _tied(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """The transformer's embedding and output head share one (33, 18) Parameter
    in the root's group: 17 and 16 rows at world size 2."""
    ref = build_model("transformer_tied")
    model = shard_model(build_model("transformer_tied"), mesh=mesh)
    assert model.tok_embeddings.weight is model.output.weight, "untied by fully_shard"
    assert model.output.weight.to_local().size(0) == (17, 16)[rank]
    _train_in_parity(model, ref, rank, world_size, kind="transformer_tied")
    assert model.tok_embeddings.weight is model.output.weight, "untied by training"


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _shared_with_nested_group(mesh: DeviceMesh) -> None:
    model = TwoLinears()
    fsdp2.fully_shard(model.a, mesh=mesh)
    with pytest.raises(ValueError, match=r"'b\.weight' is the same Parameter as 'a\.weight'"):
        fsdp2.fully_shard(model, mesh=mesh)


def _ignored(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    """MLP layers.1.weight ignored (passed to both calls that could take it)."""
    ref, local_ref = build_model("mlp"), build_model("mlp")
    model, torch_model = build_model("mlp"), build_model("mlp")
    for m, shard in ((model, fsdp2.fully_shard), (torch_model, torch_fully_shard)):
        ignored = {m.layers[1].weight}
        for layer in m.layers:
            shard(layer, mesh=mesh, ignored_params=ignored)
        shard(m, mesh=mesh, ignored_params=ignored)
    name = "layers.1.weight"
    param = model.get_parameter(name)
    assert type(param) is nn.Parameter and not isinstance(param, DTensor), type(param)
    assert torch.equal(param.detach(), ref.get_parameter(name).detach()), "ignored param changed"

    batch = global_batch("mlp", 0)
    local = local_batch(batch, rank, world_size)
    mean_loss(ref, *batch).backward()
    mean_loss(local_ref, *local).backward()
    mean_loss(torch_model, *local).backward()
    with record_collectives() as log:
        mean_loss(model, *local).backward()

    # Not all-gathered and not reduce-scattered: the bytes are those of the
    # other parameters of its group only.
    groups = [
        list(ref.layers[0].parameters()),
        [ref.layers[1].bias],
        list(ref.layers[2].parameters()),
    ]
    group_bytes = sorted(_padded_bytes(params, world_size) for params in groups)
    sizes = sorted(c.nbytes for c in _of_kind(log, "all_gather"))
    assert sizes == sorted(group_bytes * 2), f"all-gather bytes {sizes}, expected {group_bytes}"
    sizes = sorted(c.nbytes for c in _of_kind(log, "reduce_scatter"))
    assert sizes == group_bytes, f"reduce-scatter bytes {sizes}, expected {group_bytes}"
    # Not reduced: each rank keeps the gradient of its own batch (torch does the same).
    grad = param.grad
    assert type(grad) is torch.Tensor, f"ignored param's grad is a {type(grad).__name__}"
    # No sum over ranks: the same local computation as a plain model's and torch's.
    assert_close(grad, local_ref.get_parameter(name).grad, **EXACT)
    assert_close(grad, torch_model.get_parameter(name).grad, **EXACT)
    other_ranks = [torch.empty_like(grad) for _ in range(world_size)]
    dist.all_gather(other_ranks, grad)
    assert not torch.equal(other_ranks[0], other_ranks[1]), "the ignored grads were synced"
    for n, p in model.named_parameters():
        if n != name:
            assert_close(p.grad.full_tensor(), ref.get_parameter(n).grad, **REF_TOL)


# Frozen before sharding in the "some frozen" case: part of a block and of the root.
FROZEN = ("layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "pos_embeddings.weight")


def _clip_grad_norm(rank: int, world_size: int, mesh: DeviceMesh, frozen: tuple[str, ...]) -> None:
    ref, model = build_model(KIND), build_model(KIND)
    for m in (ref, model):
        for name in frozen:
            m.get_parameter(name).requires_grad_(False)
    shard_model(model, mesh=mesh)
    max_norm = 0.1  # below the reference's norms (checked): every step clips

    def clip_and_check(step: int) -> None:
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert ref_norm > 2 * max_norm, f"step {step}: {ref_norm} does not clip much"
        assert isinstance(norm, DTensor), f"the total norm is a {type(norm).__name__}"
        assert_close(norm.full_tensor(), ref_norm, **REF_TOL)
        # The grads checked next are the clipped ones.

    _train_in_parity(model, ref, rank, world_size, after_backward=clip_and_check)


class DTensorOps(TorchDispatchMode):
    """Counts the ops run on a DTensor (each dispatched through sharding
    propagation)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += DTensor in types
        return func(*args, **(kwargs or {}))


def _torchs_clipping_routed(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    from torch.nn.utils import clip_grad_norm_ as bound_before_the_install
    from torch.nn.utils import get_total_norm as torchs_total_norm

    ref, model = build_model(KIND), build_model(KIND)
    shard_model(model, mesh=mesh)
    max_norm = 0.1

    def torchtitans(params: Iterator[nn.Parameter]) -> torch.Tensor:
        params = list(params)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.full_tensor())
        return norm

    clips = [  # one per step
        lambda params: torch.nn.utils.clip_grad_norm_(params, max_norm),
        lambda params: bound_before_the_install(params, max_norm),
        torchtitans,
    ]

    def clip_and_check(step: int) -> None:
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        theirs = torchs_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        with DTensorOps() as ops:
            norm = clips[step](model.parameters())
        assert ops.count == 0, f"step {step}: {ops.count} ops on DTensors"
        assert isinstance(norm, DTensor) and norm.placements == (Replicate(),), norm
        assert ref_norm > 2 * max_norm, f"step {step}: {ref_norm} does not clip much"
        assert_close(norm.full_tensor(), ref_norm, **REF_TOL)
        # torch's own on the same DTensor gradients, to the last bit.
        assert torch.equal(norm.full_tensor(), theirs.full_tensor()), (norm, theirs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this module holds torch's fully_shard (the reference)
        names = fsdp2.install_as_torch_fsdp()
    with names:
        _train_in_parity(model, ref, rank, world_size, after_backward=clip_and_check)
        # torch's dtype: the norm of bf16 gradients is bf16.
        full = torch.randn(13, 5, generator=torch.Generator().manual_seed(0))
        bf16 = distribute_tensor(full.bfloat16(), mesh, [Shard(0)])
        norm = torch.nn.utils.get_total_norm([bf16], 3.0)
        assert norm.dtype == torch.bfloat16
        assert_close(norm.full_tensor(), torch.linalg.vector_norm(full.bfloat16(), 3.0))
        assert torch.equal(norm.full_tensor(), torchs_total_norm([bf16], 3.0).full_tensor())
        # A Partial gradient is left to torch's own, which reduces it.
        partial = DTensor.from_local(full * (rank + 1), mesh, [Partial()])
        with DTensorOps() as ops:
            norm = torch.nn.utils.get_total_norm([partial])
        assert ops.count > 0
        expected = torch.linalg.vector_norm(full * sum(range(1, world_size + 1)))
        assert_close(norm.full_tensor(), expected)


class ForeachNorms(TorchDispatchMode):
    """The number of tensors in each ``_foreach_norm``."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten._foreach_norm:
            self.sizes.append(len(args[0]))
        return func(*args, **(kwargs or {}))


def _clipping_reads_whole_buffers(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    model = build_model(KIND)
    shard_model(model, mesh=mesh)
    mean_loss(model, *local_batch(global_batch(KIND, 0), rank, world_size)).backward()
    params = list(model.parameters())
    fulls = [p.grad.full_tensor() for p in params]

    def expected_norm(chosen: list[int]) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.cat([fulls[i].flatten() for i in chosen]))

    everything = list(range(len(params)))
    with ForeachNorms() as whole:
        norm = fsdp2.clip_grad_norm_(params, max_norm=1e9)  # norms only (a factor of 1)
    assert_close(norm, expected_norm(everything), **REF_TOL)
    # The groups whose buffers hold no padding go in as one tensor each.
    assert sum(whole.sizes) < len(params), whole.sizes
    # Without one parameter its group goes in per gradient, and the norm is the rest's.
    names = [name for name, _ in model.named_parameters()]
    left_out = names.index("layers.0.attention.wq.weight")  # a block of even shapes
    chosen = [i for i in everything if i != left_out]
    with ForeachNorms() as partial:
        norm = fsdp2.clip_grad_norm_([params[i] for i in chosen], max_norm=1e9)
    assert sum(partial.sizes) > sum(whole.sizes), (partial.sizes, whole.sizes)
    assert_close(norm, expected_norm(chosen), **REF_TOL)
    # A gradient given twice counts twice, as torch's: per gradient.
    twice = fsdp2.clip_grad_norm_([params[0], *params], max_norm=1e9)
    assert_close(twice, expected_norm([0, *everything]), **REF_TOL)
    # Scaling the buffers scales every gradient by torch's factor.
    max_norm = 0.5 * float(expected_norm(everything))
    total = fsdp2.clip_grad_norm_(params, max_norm)
    factor = max_norm / (total + 1e-6)
    for param, full in zip(params, fulls, strict=True):
        assert_close(param.grad.full_tensor(), full * factor, **REF_TOL)


def _frozen_tied_ignored(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    with labelled("LoRA: frozen weight, trainable bias and adapter in one group"):
        _lora(rank, world_size, mesh)
    with labelled("tied parameters in one group"):
        _tied(rank, world_size, mesh)
    with labelled("a parameter shared with a nested group"):
        _shared_with_nested_group(mesh)
    with labelled("ignored_params"):
        _ignored(rank, world_size, mesh)
    for frozen in ((), FROZEN):
        with labelled(f"clip_grad_norm_, frozen {frozen}"):
            _clip_grad_norm(rank, world_size, mesh, frozen)
    with labelled("torch's clipping routed by install_as_torch_fsdp()"):
        _torchs_clipping_routed(rank, world_size, mesh)
    with labelled("clipping reads a group's gradients as its buffer"):
        _clipping_reads_whole_buffers(rank, world_size, mesh)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_frozen_tied_ignored_params_and_clipping(world_size: int, tmp_path: Path) -> None:
    """LoRA layers (frozen weight, trainable bias and adapter in one group):
    parity over 3 steps, frozen weights get no grad and keep their values, each
    reduce-scatter moves exactly the trainable parameters' padded bytes while
    the all-gathers still carry the frozen ones. Tied embedding and head in the
    root's group (uneven rows) stay one Parameter and train with parity. A
    Parameter shared with an already-sharded child raises ValueError naming
    both. An ignored parameter stays a plain full Parameter, is in no
    all-gather or reduce-scatter, and its grad is this rank's local one
    (like torch's), while the other grads are the reference's.
    clip_grad_norm_(model.parameters(), 0.1) returns a DTensor whose full
    tensor is the reference's total norm (1e-5), and the clipped grads and the
    trained parameters are the reference's, with and without frozen params.
    The same under install_as_torch_fsdp(), which routes torch's clipping to
    local norms: torch.nn.utils.clip_grad_norm_, the same function bound
    before the install, and torchtitan's get_total_norm + clip_grads_with_norm_
    run no op on a DTensor and return a Replicate DTensor of the reference's
    norm, bit for bit torch's own on the same gradients; bf16 gradients give a
    bf16 norm, as torch's; a Partial gradient is
    left to torch's own. Clipping takes a group's gradients as their one
    buffer when all of them are given (fewer tensors normed than parameters),
    per gradient when one is missing or one is given twice, the norms and the
    scaled gradients the reference's each way."""
    run_ranks(_frozen_tied_ignored, world_size, tmp_path)


# -- against torch's fully_shard in this process --------------------------------
# A "fake" process group of world size 2 builds meshes without spawning ranks;
# its collectives move no data, so these tests look at what is sharded and at
# which calls raise, never at values. Each runs torch's fully_shard (which must
# pass) and fsdp2's.


@pytest.fixture(scope="module")
def fake_mesh() -> Iterator[DeviceMesh]:
    with fake_world(WORLD_SIZE):
        yield init_device_mesh("cpu", (WORLD_SIZE,))


def _torch_and_fsdp2(behaviour: str) -> pytest.MarkDecorator:
    """Parametrizes ``shard`` with torch's fully_shard and fsdp2's: both must show
    ``behaviour`` (fsdp2 once got each of these wrong)."""
    return pytest.mark.parametrize(
        "shard",
        [
            pytest.param(torch_fully_shard, id="torch"),
            pytest.param(fsdp2.fully_shard, id="fsdp2"),
        ],
    )


@_torch_and_fsdp2(
    "a parameter that a child's fully_shard(ignored_params=...) ignored stays ignored by the parent"
)
def test_ignored_in_child_stays_ignored(fake_mesh: DeviceMesh, shard) -> None:
    """fully_shard(child, ignored_params={p}) then fully_shard(parent): torch
    leaves p a plain tensor (a parent never takes a sharded child's
    parameters); fsdp2 must too."""
    model = build_model("mlp")
    shard(model.layers[1], mesh=fake_mesh, ignored_params={model.layers[1].weight})
    shard(model, mesh=fake_mesh)
    assert not isinstance(model.layers[1].weight, DTensor), "the parent sharded it"


def test_param_shared_between_sibling_groups_raises(fake_mesh: DeviceMesh) -> None:
    """docs/usage.md: a parameter shared between two groups is rejected inside
    fully_shard: with a.weight is b.weight, fully_shard(a) then fully_shard(b)
    raises (siblings do not know each other's paths, so the message names the
    parameter and the class of the module that sharded it first)."""
    model = TwoLinears()
    fsdp2.fully_shard(model.a, mesh=fake_mesh)
    with pytest.raises(
        ValueError, match=r"'weight' is the same Parameter as 'weight' of Linear.*already sharded"
    ):
        fsdp2.fully_shard(model.b, mesh=fake_mesh)
    assert type(model.b) is nn.Linear  # refused before any change


@_torch_and_fsdp2(
    "unshard() on a block before the model's first forward does not make the block a root"
)
def test_unshard_block_before_first_forward(fake_mesh: DeviceMesh, shard) -> None:
    """Prefetching a block by hand before the very first step, as
    docs/usage.md shows (``handle.wait()`` before the module's forward)."""
    model = shard_model(build_model("mlp"), shard, mesh=fake_mesh)
    handle = model.layers[0].unshard(async_op=True)
    handle.wait()
    mean_loss(model, *global_batch("mlp", 0)).backward()


@_torch_and_fsdp2(
    "UnshardHandle.wait() after the module's forward already waited for the all-gather is a no-op"
)
def test_unshard_handle_waited_after_forward(fake_mesh: DeviceMesh, shard) -> None:
    """torch's forward waits for a pending unshard itself, so a handle waited
    for later has nothing left to do."""
    model = shard_model(build_model("mlp"), shard, mesh=fake_mesh)
    mean_loss(model, *global_batch("mlp", 0)).backward()
    handle = model.layers[0].unshard(async_op=True)
    loss = mean_loss(model, *global_batch("mlp", 1))
    handle.wait()
    loss.backward()


def test_cast_after_forward_frees_old_shards(fake_mesh: DeviceMesh) -> None:
    """``model.to(dtype)`` after a step (shards replaced): nothing of fsdp2 holds
    the old shards (the all-gather's kept inputs let go at once), so their
    memory is free before the next forward."""
    model = shard_model(build_model("mlp"), mesh=fake_mesh)
    mean_loss(model, *global_batch("mlp", 0)).backward()
    model.zero_grad(set_to_none=True)
    old = [weakref.ref(local_tensor(p)) for p in model.parameters()]
    model.to(torch.float64)
    gc.collect()
    held = [i for i, ref in enumerate(old) if ref() is not None]
    assert not held, f"old shards still held: {held} of {len(old)}"


# -- activation checkpointing, forward methods --------------------------------


class CheckpointedBlock(TransformerBlock):
    """Recomputes the whole block in backward: checkpoint inside a sharded module's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def _checkpointed_model(how: str, mesh: DeviceMesh) -> nn.Module:
    model = build_model(KIND)
    if how == "checkpoint() inside each block's forward":
        for block in model.layers:
            block.__class__ = CheckpointedBlock
    elif how == "checkpoint_wrapper before fully_shard":
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    elif how == "checkpoint() around each sharded block":
        model.checkpoint_activations = True  # the Transformer's own option
    return shard_model(model, mesh=mesh)


def _activation_checkpointing(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    counts = {}
    hows = (
        "none",
        "checkpoint() inside each block's forward",
        "checkpoint_wrapper before fully_shard",
        "checkpoint() around each sharded block",
    )
    for how in hows:
        with labelled(how):
            recomputed = []
            model = _checkpointed_model(how, mesh)
            # Count the attention's forwards: checkpointing must actually recompute.
            model.layers[0].get_submodule(
                "_checkpoint_wrapped_module.attention" if "wrapper" in how else "attention"
            ).register_forward_hook(lambda *_, r=recomputed: r.append(torch.is_grad_enabled()))
            logs = _train_in_parity(model, build_model(KIND), rank, world_size)
            expected_forwards = NUM_STEPS * (1 if how == "none" else 2)
            assert len(recomputed) == expected_forwards, recomputed
            counts[how] = [
                (len(_of_kind(log, "all_gather")), len(_of_kind(log, "reduce_scatter")))
                for log in logs
            ]
    # Each block gathered once in forward and once in backward, the root once.
    assert counts["none"] == [(2 * N_LAYERS + 1, N_LAYERS + 1)] * NUM_STEPS, counts
    assert all(c == counts["none"] for c in counts.values()), counts


class GenerativeTransformer(Transformer):
    def generate(self, tokens: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding that calls the submodules itself, not ``forward``.
        Returns the tokens and the logits of each new one, (batch, n_new, vocab)."""
        logits = []
        for _ in range(n_new):
            window = tokens[:, -self.max_seq_len :]
            pos = torch.arange(window.size(1))
            h = self.tok_embeddings(window) + self.pos_embeddings(pos)
            for layer in self.layers:
                h = layer(h)
            logits.append(self.output(self.norm(h))[:, -1])
            tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
        return tokens, torch.stack(logits, dim=1)


def _build_generative() -> GenerativeTransformer:
    torch.manual_seed(0)
    return GenerativeTransformer(transformer_args(weight_tying=False, n_layers=N_LAYERS))


def _forward_method(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    ref = _build_generative()
    model = shard_model(_build_generative(), mesh=mesh)
    fsdp2.register_fsdp_forward_method(model, "generate")
    optims = [make_optimizer(m) for m in (ref, model)]
    n_new = 3
    for step in range(2):
        prompts, targets = global_batch(KIND, step)
        prompts, targets = prompts[:, :4], targets[:, 0]
        local_prompts, local_targets = local_batch((prompts, targets), rank, world_size)
        with labelled(f"step {step}, no_grad"), torch.no_grad():
            with record_collectives() as log:
                tokens, logits = model.generate(local_prompts, n_new)
            ref_tokens, ref_logits = ref.generate(local_prompts, n_new)
            assert torch.equal(tokens, ref_tokens), f"{tokens} vs {ref_tokens}"
            assert_close(logits, ref_logits, **REF_TOL)
            # The root once for the call, each block once per new token.
            assert len(_of_kind(log, "all_gather")) == 1 + n_new * N_LAYERS, log
            assert _of_kind(log, "reduce_scatter") == [], log
            _check_all_sharded(model, "after generate")
        with labelled(f"step {step}, training through generate"):
            ref_loss = F.cross_entropy(ref.generate(prompts, 1)[1][:, 0], targets)
            ref_loss.backward()
            loss = F.cross_entropy(model.generate(local_prompts, 1)[1][:, 0], local_targets)
            loss.backward()
            _check_loss(loss, ref_loss, world_size, step)
            _check_grads(model, ref)
            _check_all_sharded(model, "after backward")
        _step(*optims)
    _check_params(model, ref)


def _checkpointing_and_forward_methods(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    with labelled("activation checkpointing"):
        _activation_checkpointing(rank, world_size, mesh)
    with labelled("register_fsdp_forward_method"):
        _forward_method(rank, world_size, mesh)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_activation_checkpointing_and_forward_methods(world_size: int, tmp_path: Path) -> None:
    """Activation checkpointing three ways (torch.utils.checkpoint inside each
    block's forward, checkpoint_wrapper applied before fully_shard, and
    checkpoint around each sharded block): the attention really runs twice per
    step, losses, grads and parameters match the reference over 3 steps, and
    the all-gather and reduce-scatter counts per step equal those without
    checkpointing (2 * n_layers + 1 and n_layers + 1). A registered ``generate``
    that calls the submodules directly: under no_grad its tokens and logits
    equal the reference's, it gathers the root once and each block once per new
    token, and leaves every group SHARDED; trained through, its grads and
    parameters match the reference's."""
    run_ranks(_checkpointing_and_forward_methods, world_size, tmp_path)
