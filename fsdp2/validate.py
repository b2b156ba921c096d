"""Argument checks for ``fully_shard``: user mistakes fail here, before any state changes."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from .policy import MixedPrecisionPolicy, OffloadPolicy

# Set on an original parameter when it is sharded: a later fully_shard call
# that meets the same object (tied to a module outside that group) refuses it.
SHARDED_AS = "_fsdp2_sharded_as"


def check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fully_shard expects an nn.Module, got {type(module).__name__}. "
            "Pass the module whose parameters should form one communication group."
        )
    if type(module).forward is nn.Module.forward:
        raise ValueError(
            f"fully_shard does not support {type(module).__name__}: it has no forward, so "
            "its hooks would never run. Call fully_shard on each child instead "
            "(e.g. `for block in model.layers: fully_shard(block)`) and then on the parent."
        )
    if "_fsdp_state" in module.__dict__:
        raise ValueError(
            f"{type(module).__name__} is already sharded by fully_shard. Call fully_shard "
            "once per module, bottom-up (children first, then the root)."
        )


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "fully_shard(mesh=None) builds a mesh over the default process group, but "
                "torch.distributed is not initialised. Call "
                "torch.distributed.init_process_group() first, or pass mesh=..."
            )
        accelerator = torch.accelerator.current_accelerator()
        device_type = accelerator.type if accelerator is not None else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}. Build "
            "one with torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))."
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard supports 1D meshes (FSDP) and 2D meshes (HSDP: replicate, shard), got "
            f"a {mesh.ndim}D mesh with shape {tuple(mesh.shape)}. Pass the data-parallel "
            "sub-mesh, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']."
        )
    return mesh


def check_reshard_after_forward(value: object, world_size: int) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(
            f"reshard_after_forward must be True, False, None or an int, got {value!r}. "
            "None reshards every group but the root's."
        )
    if value < 1 or world_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the mesh size {world_size}: it is "
            "the size of the rank groups that keep a shard after forward (e.g. the ranks of "
            "one node)."
        )


def check_policies(mp_policy: object, offload_policy: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be an fsdp2.MixedPrecisionPolicy, got {type(mp_policy).__name__}."
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be fsdp2.OffloadPolicy() or fsdp2.CPUOffloadPolicy(), got "
            f"{type(offload_policy).__name__}."
        )


def check_params(
    named_params: list[tuple[str, nn.Parameter]],
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
) -> None:
    gather_dtypes = {mp_policy.param_dtype or p.dtype for _, p in named_params}
    if len(gather_dtypes) > 1:
        by_dtype = {mp_policy.param_dtype or p.dtype: fqn for fqn, p in named_params}
        raise ValueError(
            "fully_shard all-gathers a group in one dtype, but these parameters differ: "
            + ", ".join(f"{fqn!r} is {dtype}" for dtype, fqn in by_dtype.items())
            + ". Shard them in separate fully_shard calls, or set "
            "MixedPrecisionPolicy(param_dtype=...)."
        )
    for fqn, param in named_params:
        if (owner := param.__dict__.get(SHARDED_AS)) is not None:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is the same Parameter as {owner}, which an "
                "earlier fully_shard call already sharded (tied modules in two groups). Shard the "
                "modules that share it in one call (their common parent), or untie them."
            )
        if isinstance(param, DTensor):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is already a DTensor (placements "
                f"{param.placements}). Parameters of a module that fully_shard has not seen "
                "must be plain tensors."
            )
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard does not support scalar parameters: {fqn!r} is 0-dimensional. "
                "Make it a 1D tensor with one element (e.g. nn.Parameter(torch.ones(1)))."
            )
        if param.device.type not in ("cpu", "meta", device.type) or (
            param.device.type == device.type
            and param.device.index is not None
            and device.index is not None
            and param.device != device
        ):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is on {param.device}, but the mesh's device "
                f"is {device}. Move the module to {device} (or to CPU) before sharding."
            )
