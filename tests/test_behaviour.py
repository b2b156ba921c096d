"""What fsdp2 does around a training step, beyond the numbers: how many
collectives run, what is unsharded when, inference, manual unshard/reshard,
explicit prefetching and the FSDPModule class itself. All at world size 2.

Collectives are counted by wrapping fsdp2's ``all_gather_single`` and
``reduce_scatter_single`` (``tests/dist.py::recorded``) inside the rank
processes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist import labelled, recorded, run_ranks
from error_model import REF_TOL
from models import (
    build_model,
    fsdp_modules,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
    unsharded_bytes,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor
from torch.testing import assert_close
from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

import fsdp2
from fsdp2.engine.states import ShardedState

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
KIND = "transformer_untied"


@dataclass
class CollectiveCounts:
    all_gathers: int = 0
    reduce_scatters: int = 0


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Counts the engine's all-gathers and reduce-scatters while active."""
    counts = CollectiveCounts()
    with recorded("all_gather") as gathers, recorded("reduce_scatter") as reduces:
        yield counts
        counts.all_gathers, counts.reduce_scatters = len(gathers), len(reduces)


def _groups(model: nn.Module) -> Iterator[fsdp2.FSDPModule]:
    """FSDP modules that own parameters (an MLP root owns none)."""
    return (m for m in fsdp_modules(model) if m._fsdp_state.param_groups)


def _is_unsharded(module: fsdp2.FSDPModule) -> bool:
    group = module._fsdp_state.param_groups[0]
    return group.sharded_state is ShardedState.UNSHARDED or group.all_gather_in_flight


def _check_all_resharded(model: nn.Module, when: str) -> None:
    for module in _groups(model):
        group = module._fsdp_state.param_groups[0]
        name = f"{type(module).__name__} (group {group.name!r})"
        assert group.sharded_state is ShardedState.SHARDED, (
            f"{when}: {name} is {group.sharded_state.name}, not SHARDED"
        )
        assert not group.all_gather_in_flight, f"{when}: {name} has an all-gather in flight"
        for fsdp_param in group.fsdp_params:
            held = unsharded_bytes(fsdp_param)
            assert held == 0, f"{when}: {fsdp_param} still holds {held} bytes"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{when}: {name} is a {type(param).__name__}"


def _train_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    loss = mean_loss(model, *batch)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


# -- collectives per step -------------------------------------------------


def _count_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]
) -> CollectiveCounts:
    with count_collectives() as counts:
        mean_loss(model, *batch).backward()
    _check_all_resharded(model, "after backward")
    optim.step()
    optim.zero_grad()
    _check_all_resharded(model, "after optimizer.step()")
    return counts


def _collectives_per_step(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    n_layers = 3
    n_groups = n_layers + 1
    # (label, fully_shard kwargs, blocks frozen before sharding, expected counts)
    cases = [
        # Blocks reshard after forward and all-gather again in backward; the
        # root keeps its parameters from forward to backward.
        ("default", {}, (), CollectiveCounts(2 * n_layers + 1, n_groups)),
        (
            "reshard_after_forward=False",
            {"reshard_after_forward": False},
            (),
            CollectiveCounts(n_groups, n_groups),
        ),
        # A block with no trainable parameters is still gathered for backward
        # (its input gradient needs the weights) but has nothing to reduce.
        ("layers.0 frozen", {}, (0,), CollectiveCounts(2 * n_layers + 1, n_groups - 1)),
    ]
    for label, kwargs, frozen_blocks, expected in cases:
        model = build_model(KIND, n_layers=n_layers)
        for i in frozen_blocks:
            model.layers[i].requires_grad_(False)
        shard_model(model, mesh=mesh, **kwargs)
        optim = make_optimizer(model)
        with labelled(label):
            _check_all_resharded(model, "after fully_shard")
            for step in range(2):
                batch = local_batch(global_batch(KIND, step), rank, world_size)
                counts = _count_step(model, optim, batch)
                assert counts == expected, f"step {step}: {counts}, expected {expected}"


@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_collectives_and_resharding_per_step(world_size: int, tmp_path: Path) -> None:
    """Per training step, on a transformer with one group per block plus the
    root: 2 * n_layers + 1 all-gathers (each block twice, the root once) and one
    reduce-scatter per group with trainable parameters, the same on the second
    step; one all-gather per group without resharding after forward. After
    backward and after optimizer.step() every group is sharded, holds no
    unsharded storage, and the module parameters are DTensors again."""
    run_ranks(_collectives_per_step, world_size, tmp_path)


# -- prefetching and peak unsharded groups --------------------------------


class UnshardedBlocksProbe:
    """Counts unsharded (or being all-gathered) blocks right after each block's
    forward pre-hook and pre-backward hook have run, i.e. at each block's peak:
    the block itself plus whatever it prefetched. The root is left out: it stays
    unsharded from forward to backward by design."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = list(model.layers)
        self.samples: list[tuple[str, int, int]] = []  # (phase, block index, count)
        for i, block in enumerate(self.blocks):
            # Registered after fully_shard, so these run after fsdp2's own hooks.
            block.register_forward_pre_hook(lambda *_, i=i: self._sample("forward", i))
            block.register_forward_hook(lambda _m, _a, out, i=i: self._on_output(out, i))

    def _on_output(self, output: torch.Tensor, i: int) -> None:
        if output.requires_grad:
            # Tensor hooks run in registration order: after fsdp2's pre-backward.
            output.register_hook(lambda _grad: self._sample("backward", i))

    def _sample(self, phase: str, i: int) -> None:
        self.samples.append((phase, i, sum(_is_unsharded(b) for b in self.blocks)))

    def peak(self, phase: str) -> int:
        return max(count for p, _, count in self.samples if p == phase)


def _set_explicit_prefetch(model: nn.Module) -> None:
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def _prefetch_and_peak(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    n_layers = 4
    for explicit in (False, True):
        ref = build_model(KIND, n_layers=n_layers)
        model = shard_model(build_model(KIND, n_layers=n_layers), mesh=mesh)
        if explicit:
            _set_explicit_prefetch(model)
        probe = UnshardedBlocksProbe(model)
        optims = [make_optimizer(m) for m in (ref, model)]
        label = "explicit prefetch" if explicit else "implicit prefetch"
        with labelled(label):
            for step in range(3):
                batch = global_batch(KIND, step)
                ref_loss = _train_step(ref, optims[0], batch)
                with count_collectives() as counts:
                    loss = mean_loss(model, *local_batch(batch, rank, world_size))
                    loss.backward()
                optims[1].step()
                optims[1].zero_grad()
                assert_close(global_mean(loss, world_size), ref_loss, **REF_TOL)
                expected = CollectiveCounts(2 * n_layers + 1, n_layers + 1)
                assert counts == expected, f"step {step}: {counts}, expected {expected}"
            for name, param in full_params(model).items():
                assert_close(
                    param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: f"{n}: {m}"
                )
            samples = probe.samples
            assert probe.peak("forward") <= 2, f"more than two blocks unsharded: {samples}"
            assert probe.peak("backward") <= 2, f"more than two blocks unsharded: {samples}"
            # The probe does see the prefetch: in backward a block and the one
            # before it always overlap; in forward too, by default from the second
            # step on (the next block of the previous forward) or explicitly.
            assert probe.peak("backward") == 2, f"no backward prefetch seen: {samples}"
            assert probe.peak("forward") == 2, f"no forward prefetch seen: {samples}"


@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_prefetch_and_peak_unsharded_blocks(world_size: int, tmp_path: Path) -> None:
    """With the default (implicit forward and backward) prefetch and with explicit
    set_modules_to_forward_prefetch / set_modules_to_backward_prefetch (block i
    prefetches i + 1 in forward and i - 1 in backward): losses and parameters
    match the reference, the all-gather count is unchanged, and at most the
    current and the prefetched block are unsharded at once."""
    run_ranks(_prefetch_and_peak, world_size, tmp_path)


# -- inference --------------------------------------------------------------


def _check_inference(model: nn.Module, ref: nn.Module, inputs: torch.Tensor) -> None:
    model.eval()
    ref.eval()
    with torch.no_grad(), count_collectives() as counts:
        output = model(inputs)
        ref_output = ref(inputs)
    model.train()
    ref.train()
    assert_close(output, ref_output, **REF_TOL)
    assert counts.reduce_scatters == 0, f"{counts.reduce_scatters} reduce-scatters in inference"
    n_groups = len(list(_groups(model)))
    assert counts.all_gathers == n_groups, f"{counts.all_gathers} all-gathers for {n_groups}"
    _check_all_resharded(model, "after a no_grad forward")


def _inference(rank: int, world_size: int, mesh: DeviceMesh, kind: str) -> None:
    ref = build_model(kind)
    model = shard_model(build_model(kind), mesh=mesh)
    optims = [make_optimizer(m) for m in (ref, model)]
    inputs = local_batch(global_batch(kind, 100), rank, world_size)[0]
    with labelled("first forward under no_grad"):
        _check_inference(model, ref, inputs)
    for step in range(2):
        batch = global_batch(kind, step)
        ref_loss = _train_step(ref, optims[0], batch)
        loss = _train_step(model, optims[1], local_batch(batch, rank, world_size))
        assert_close(global_mean(loss, world_size), ref_loss, **REF_TOL)
    with labelled("after training"):
        _check_inference(model, ref, inputs)


def _plain_params(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not isinstance(p, DTensor)}


def _inference_keeping_blocks(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    kind = "transformer_tied"
    ref, model, theirs = build_model(kind), build_model(kind), build_model(kind)
    for sharded, shard in ((model, fsdp2.fully_shard), (theirs, torch_fully_shard)):
        for layer in sharded.layers:
            shard(layer, mesh=mesh, reshard_after_forward=False)
        shard(sharded, mesh=mesh)  # the root: reshard_after_forward's automatic False
    blocks = {name for name, _ in model.named_parameters() if name.startswith("layers.")}
    inputs = local_batch(global_batch(kind, 100), rank, world_size)[0]
    n_groups = len(list(_groups(model)))
    for call in range(2):
        with torch.no_grad(), count_collectives() as counts:
            output = model(inputs)
        with torch.no_grad():
            assert_close(output, ref(inputs), **REF_TOL)
            theirs(inputs)
        # The blocks keep what they were asked to keep, as torch's do: the
        # second call all-gathers the root only.
        assert counts.all_gathers == (n_groups if call == 0 else 1), (call, counts)
        assert _plain_params(model) == blocks, (call, _plain_params(model) ^ blocks)
        assert blocks <= _plain_params(theirs), call
    # An optimizer built now would hold the blocks' unsharded parameters,
    # whose storage the next reshard frees: refused at its first step.
    built_unsharded = make_optimizer(model)
    batch = global_batch(kind, 0)
    mean_loss(model, *local_batch(batch, rank, world_size)).backward()
    _check_all_resharded(model, "after backward")
    with pytest.raises(RuntimeError, match=r"optimizer holds \d+ unsharded parameters: 'layers"):
        built_unsharded.step()
    model.zero_grad()
    optims = [make_optimizer(m) for m in (ref, model)]
    ref_loss = _train_step(ref, optims[0], batch)
    loss = _train_step(model, optims[1], local_batch(batch, rank, world_size))
    assert_close(global_mean(loss, world_size), ref_loss, **REF_TOL)
    _check_all_resharded(model, "after a training step")


def _inference_all_kinds(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for kind in ("mlp", "transformer_tied"):
        with labelled(kind):
            _inference(rank, world_size, mesh, kind)
    with labelled("blocks with reshard_after_forward=False"):
        _inference_keeping_blocks(rank, world_size, mesh)


@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_inference(world_size: int, tmp_path: Path) -> None:
    """model.eval() + torch.no_grad(): the output equals the reference's on the
    same local input, before and after training; each group is all-gathered once,
    nothing is reduce-scattered, and afterwards every group (the root included)
    is sharded with no unsharded storage. Blocks given reshard_after_forward=False
    keep their parameters unsharded after a forward without grad, as torch's
    fully_shard does (a second call all-gathers the root only: its automatic
    False does not keep them when no backward follows); an optimizer built
    while they are unsharded is refused at its first step (it would step freed
    storage); one built after backward trains as the reference."""
    run_ranks(_inference_all_kinds, world_size, tmp_path)


# -- FSDPModule API ---------------------------------------------------------


def _check_unsharded(model: nn.Module, ref: nn.Module, prefix: str) -> None:
    """Parameters under ``prefix`` are plain full-size tensors equal to the reference."""
    for name, param in model.named_parameters():
        if not name.startswith(prefix):
            continue
        ref_param = ref.get_parameter(name)
        assert not isinstance(param, DTensor), f"{name} is still a DTensor"
        assert param.shape == ref_param.shape, f"{name}: {param.shape} vs {ref_param.shape}"
        assert_close(param, ref_param, **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _module_api(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    ref = build_model(KIND)
    model = shard_model(build_model(KIND), mesh=mesh)
    optims = [make_optimizer(m) for m in (ref, model)]

    with labelled("class swap"):
        assert type(model).__name__ == "FSDPTransformer", type(model).__name__
        assert isinstance(model, fsdp2.FSDPModule)
        assert isinstance(model, Transformer)
        assert type(model.layers[0]).__name__ == "FSDPTransformerBlock"
        assert type(model.layers[0]) is type(model.layers[1]), "one FSDP class per class"

    with labelled("deepcopy"):
        with pytest.raises(AssertionError, match="deepcopy"):
            copy.deepcopy(model)
        with pytest.raises(AssertionError, match="deepcopy"):
            copy.deepcopy(model.layers[0])

    root_owned = tuple(n for n, _ in model.named_parameters() if not n.startswith("layers."))
    with labelled("unshard/reshard"):
        assert model.unshard() is None
        for name in root_owned:
            _check_unsharded(model, ref, name)
        for name, param in model.named_parameters():
            if name.startswith("layers."):
                assert isinstance(param, DTensor), f"{name}: only the root was unsharded"
        for block in model.layers:
            block.unshard()
        _check_unsharded(model, ref, "")
        for module in fsdp_modules(model):
            module.reshard()
        _check_all_resharded(model, "after reshard()")

    with labelled("unshard(async_op=True)"):
        handle = model.layers[0].unshard(async_op=True)
        assert isinstance(handle, fsdp2.UnshardHandle), type(handle)
        handle.wait()
        _check_unsharded(model, ref, "layers.0.")
        for step in range(2):
            batch = global_batch(KIND, step)
            ref_loss = _train_step(ref, optims[0], batch)
            loss = _train_step(model, optims[1], local_batch(batch, rank, world_size))
            assert_close(global_mean(loss, world_size), ref_loss, **REF_TOL)
            _check_all_resharded(model, f"after step {step}")
        for name, param in full_params(model).items():
            assert_close(
                param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize("world_size", [WORLD_SIZE])
def test_fsdp_module_api(world_size: int, tmp_path: Path) -> None:
    """The class is swapped to FSDP<Name> (still an instance of the original and
    of FSDPModule); deepcopy raises; unshard() puts plain full-size parameters
    equal to the reference on the module and reshard() puts the DTensors back;
    unshard(async_op=True) returns a handle whose wait() works, and training
    afterwards keeps parity."""
    run_ranks(_module_api, world_size, tmp_path)
