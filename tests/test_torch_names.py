"""``fsdp2.install_as_torch_fsdp()``: fsdp2's objects under torch's public FSDP2
names, undone on exit, and a real client (accelerate) that looks them up when it
runs sharding and training with fsdp2, bit for bit as fsdp2 called directly.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from dist import run_ranks
from models import (
    build_model,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
)
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from fsdp2.api.torch_names import FSDP2_OBJECTS, TORCH_NAMESPACES
from fsdp2.optim import torch_clipping

STEPS = 3


def _torch_names() -> dict[tuple[str, str], object]:
    found = {}
    for namespace in TORCH_NAMESPACES:
        module = importlib.import_module(namespace)
        for name in FSDP2_OBJECTS:
            if hasattr(module, name):
                found[namespace, name] = getattr(module, name)
    return found


CLIPPING = {
    "torch.nn.utils": ("clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_"),
    "torch.nn.utils.clip_grad": ("clip_grad_norm_", "_get_total_norm", "_clip_grads_with_norm_"),
}


def _clipping_names() -> dict[str, object]:
    return {
        f"{namespace}.{name}": getattr(importlib.import_module(namespace), name)
        for namespace, names in CLIPPING.items()
        for name in names
    }


# torch.distributed.pipelining: the names it bound at its import, rebound by the
# install, and the method wrapped for the split backward (torch_internals.py).
PIPELINING = {
    "torch.distributed.pipelining.stage.FSDPModule",
    "torch.distributed.pipelining.stage.fully_shard",
    "torch.distributed.pipelining.schedules.FSDPModule",
    "torch.distributed.pipelining.schedules.UnshardHandle",
    "torch.distributed.pipelining.stage._PipelineStageBase.backward_maybe_with_nosync",
}


def test_install_puts_fsdp2_under_torchs_names_and_undo_restores_them() -> None:
    before = _torch_names()
    clipping = _clipping_names()
    assert before[("torch.distributed.fsdp", "FSDPModule")] is not fsdp2.FSDPModule
    defining = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    torch_module_class = defining.FSDPModule
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other test modules may hold torch's names
        with fsdp2.install_as_torch_fsdp() as names:
            namespaces = {f"{namespace}.{name}" for namespace, name in before}
            assert set(names.replaced) >= namespaces | clipping.keys() | PIPELINING
            # Beyond those: torch's own modules that bound torch's names, only.
            others = set(names.replaced) - namespaces - clipping.keys() - PIPELINING
            assert all(name.startswith("torch.") for name in others), others
            assert len(names.replaced) == len(set(names.replaced))
            stage = sys.modules["torch.distributed.pipelining.stage"]
            assert (stage.FSDPModule, stage.fully_shard) == (fsdp2.FSDPModule, fsdp2.fully_shard)
            for name, routed in _clipping_names().items():
                assert routed is getattr(torch_clipping, name.rsplit(".", 1)[1].lstrip("_")), name
            for (namespace, name), _ in before.items():
                assert getattr(sys.modules[namespace], name) is FSDP2_OBJECTS[name], name
            from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

            assert (FSDPModule, MixedPrecisionPolicy) == (
                fsdp2.FSDPModule,
                fsdp2.MixedPrecisionPolicy,
            )
            assert fully_shard is fsdp2.fully_shard
            # torch's own fully_shard reads FSDPModule from its module: left alone.
            assert defining.FSDPModule is torch_module_class
            again = fsdp2.install_as_torch_fsdp()  # already installed: nothing to replace
            assert again.replaced == []
            again.undo()
            assert torch_fsdp.fully_shard is fsdp2.fully_shard
    assert _torch_names() == before
    assert _clipping_names() == clipping
    assert stage.FSDPModule is torch_module_class
    assert stage.fully_shard is importlib.import_module("torch.distributed.fsdp").fully_shard
    assert not hasattr(stage._PipelineStageBase.backward_maybe_with_nosync, "__wrapped__")
    names.undo()  # a second undo changes nothing
    assert _torch_names() == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp2.install_as_torch_fsdp(clipping=False) as names:
            assert _clipping_names() == clipping
            assert not set(names.replaced) & clipping.keys()


def test_undo_restores_torchs_names_in_namespaces_imported_by_the_install() -> None:
    """``torch.distributed._composable.fsdp`` is imported from the patched
    ``torch.distributed.fsdp``: imported after the patch, it would keep fsdp2's."""
    composable = [n for n in TORCH_NAMESPACES if n.startswith("torch.distributed._composable")]
    saved = {name: sys.modules.pop(name) for name in composable if name in sys.modules}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fsdp2.install_as_torch_fsdp().undo()
        fresh = importlib.import_module(composable[0])
        assert fresh.FSDPModule is torch_fsdp.FSDPModule is not fsdp2.FSDPModule
        assert fresh.fully_shard is torch_fsdp.fully_shard
    finally:  # the modules other tests imported, as they were
        sys.modules.update(saved)
        if composable[0] in saved:
            parent = sys.modules["torch.distributed._composable"]
            parent.fsdp = saved[composable[0]]  # type: ignore[attr-defined]


def test_install_names_modules_that_imported_torchs_names_before_it() -> None:
    early = types.ModuleType("early_client")
    early.FSDPModule = torch_fsdp.FSDPModule  # type: ignore[attr-defined]
    early.MixedPrecisionPolicy = torch_fsdp.MixedPrecisionPolicy  # type: ignore[attr-defined]
    sys.modules["early_client"] = early
    try:
        with pytest.warns(UserWarning, match=r"early_client \(FSDPModule\)") as record:
            fsdp2.install_as_torch_fsdp().undo()
        # torch's policies are converted by fsdp2: holding them is fine
        assert not any("early_client (FSDPModule, Mixed" in str(w.message) for w in record)
    finally:
        del sys.modules["early_client"]


def _reference_shard(model: torch.nn.Module) -> None:
    """What accelerate's fsdp2_prepare_model does with a transformer-block wrap
    policy, with fsdp2 called directly: each block, the final norm (its "tail"),
    then the root."""
    for block in model.layers:
        fsdp2.fully_shard(block, reshard_after_forward=True)
    fsdp2.fully_shard([model.norm], reshard_after_forward=False)
    fsdp2.fully_shard(model)


def _accelerate_trains_with_fsdp2(rank: int, world_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing imported so far holds torch's names
        names = fsdp2.install_as_torch_fsdp()  # before importing accelerate
    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import DistributedType
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["TransformerBlock"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # accelerate turns FSDP on for accelerator devices only (AcceleratorState
    # sets DistributedType.FSDP for MULTI_GPU, MULTI_XPU, ..., not MULTI_CPU):
    # on CPU it would run DDP, so the test turns it on as it would there (in
    # PartialState too, from which each AcceleratorState() copies it).
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2

    kind = "transformer_untied"
    model = build_model(kind)
    optimizer = make_optimizer(model)
    model, optimizer = accelerator.prepare(model, optimizer)

    assert isinstance(model, fsdp2.FSDPModule)
    assert all(isinstance(block, fsdp2.FSDPModule) for block in model.layers)
    assert isinstance(model.norm, fsdp2.FSDPModule)
    assert fsdp2.fully_shard.state(model) is not None
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.placements == (Shard(0),) and param.device_mesh.size() == world_size
    # accelerate's own check sees a sharded model: nothing to do a second time
    assert fsdp2_prepare_model(accelerator, model) is model

    reference = build_model(kind)
    _reference_shard(reference)
    reference_optimizer = make_optimizer(reference)

    for step in range(STEPS):
        inputs, targets = local_batch(global_batch(kind, step), rank, world_size)
        loss = mean_loss(model, inputs, targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

        reference_loss = mean_loss(reference, inputs, targets)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        assert torch.equal(global_mean(loss, world_size), global_mean(reference_loss, world_size))

    trained, expected = full_params(model), full_params(reference)
    assert trained.keys() == expected.keys()
    for name in expected:
        assert torch.equal(trained[name], expected[name]), name
    # accelerate's full state dict (torch's DCP helpers, on rank 0) of fsdp2's model
    state_dict = accelerator.get_state_dict(model)
    if rank == 0:
        for name in expected:
            assert torch.equal(state_dict[name], expected[name]), name
    assert accelerator.is_fsdp2  # still, after accelerate's own calls
    names.undo()
    assert torch_fsdp.FSDPModule is not fsdp2.FSDPModule


@pytest.mark.distributed
def test_accelerate_shards_and_trains_with_fsdp2_after_install(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    run_ranks(_accelerate_trains_with_fsdp2, 2, tmp_path)


# -- the private names RL clients read (torch_internals.py) ------------------------


def _rl_client_steps(fsdp_module_cls: type, lookup_module: str) -> tuple[list, list, dict]:
    """Three training steps driven as verl 0.9.1 drives torch's FSDP state, on a
    model sharded by whichever ``fully_shard`` torch's names hold:

    - before each step, verl's ``fsdp_utils.set_reshard_after_forward``
      (fsdp_utils.py:846-852): ``_get_fsdp_state()``,
      ``_auto_reshard_after_forward = False`` and the group's
      ``post_forward_mesh_info`` from torch's ``_get_post_forward_mesh_info``,
      False at the second step (parameters kept unsharded after forward), True
      otherwise;
    - after each step, verl's engines' offload (veomni/utils.py:59-67): torch's
      ``_get_module_fsdp_state`` looked up when it runs, the group's
      ``_training_state`` set to torch's ``TrainingState.IDLE``, then
      ``model.reshard()``.

    Returns the losses, which parameters were unsharded after each forward, and
    the trained parameters."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    kind = "transformer_untied"
    model = build_model(kind)
    shard = torch_fsdp.fully_shard
    for block in model.layers:
        shard(block)
    shard(model)
    optimizer = make_optimizer(model)
    losses, unsharded_after_forward = [], []
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(STEPS):
        for module in model.modules():
            if isinstance(module, fsdp_module_cls):
                state = module._get_fsdp_state()
                state._auto_reshard_after_forward = False
                if group := state._fsdp_param_group:
                    group.post_forward_mesh_info = _get_post_forward_mesh_info(
                        step != 1, group.mesh_info
                    )
        inputs, targets = local_batch(global_batch(kind, step), rank, world_size)
        loss = mean_loss(model, inputs, targets)
        unsharded_after_forward.append(
            [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss.detach(), world_size))
        lookup = importlib.import_module(lookup_module)._get_module_fsdp_state
        found = 0
        for module in model.modules():
            state = lookup(module)
            if state is not None and (group := state._fsdp_param_group) is not None:
                group._training_state = TrainingState.IDLE
                found += 1
        assert found == len(model.layers) + 1, f"the state lookup found {found} groups"
        model.reshard()
    return losses, unsharded_after_forward, full_params(model)


def _rl_clients(rank: int, world_size: int) -> None:
    lookup_module = "torch.distributed.fsdp._fully_shard._fsdp_state"
    theirs = _rl_client_steps(torch_fsdp.FSDPModule, lookup_module)
    with fsdp2.install_as_torch_fsdp():
        ours = _rl_client_steps(torch_fsdp.FSDPModule, lookup_module)
        assert torch_fsdp.FSDPModule is fsdp2.FSDPModule
    (losses, unsharded, params), (torch_losses, torch_unsharded, torch_params) = ours, theirs
    # The setter took effect: the blocks kept their parameters unsharded after
    # the second step's forward only (the root never reshards after forward).
    assert len(unsharded[1]) > len(unsharded[0]) == len(unsharded[2]), unsharded
    assert unsharded == torch_unsharded, (unsharded, torch_unsharded)
    for step, (loss, torch_loss) in enumerate(zip(losses, torch_losses, strict=True)):
        assert torch.equal(loss, torch_loss), (step, loss, torch_loss)
    assert params.keys() == torch_params.keys()
    for name, param in params.items():
        assert torch.equal(param, torch_params[name]), name
    lookup = importlib.import_module(lookup_module)._get_module_fsdp_state
    assert not hasattr(lookup, "__wrapped__"), "undo() gave torch's state lookup back"


@pytest.mark.distributed
def test_rl_clients_private_state_reads_after_install(tmp_path: Path) -> None:
    """verl's reshard-after-forward setter and its engines' offload reset, which
    read torch FSDP's private state, drive fsdp2's modules after the install as
    they drive torch's: the same parameters unsharded after each forward, the
    same losses and trained parameters, bit for bit."""
    run_ranks(_rl_clients, 2, tmp_path)
