"""The checks ``fully_shard`` makes of each parameter it is given (arguments.py
runs them, before anything is built): what it is, where it is, how it may be
sharded."""

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base.markers import SHARDED, SHARDED_AS
from ..base.policy import MixedPrecisionPolicy
from ..base.private_dist import concatenate_meshes
from ..comm.mesh_info import MeshInfo, SpmdAxes, strided_layout_matches
from ..engine.extension import POST_ALL_GATHER, PRE_ALL_GATHER
from .mesh import MeshInfos, ShardPlacementResult, resolve_mesh


def check_params(
    named_params: list[tuple[str, nn.Parameter]],
    mesh: DeviceMesh,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    spmd: SpmdAxes | None = None,
) -> None:
    _check_reduce_dtypes(named_params, mp_policy)
    for fqn, param in named_params:
        if (owner := param.__dict__.get(SHARDED_AS)) is not None:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is the same Parameter as {owner}, which an "
                "earlier fully_shard call already sharded (tied modules in two groups). Shard the "
                "modules that share it in one call (their common parent), or untie them."
            )
        if spmd is not None:
            _check_spmd_param(fqn, param, spmd)
        elif isinstance(param, DTensor):
            _check_tp_param(fqn, param, mesh)
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard does not support scalar parameters: {fqn!r} is 0-dimensional. "
                f"Change {fqn} to a 1D tensor with numel equal to 1 (e.g. "
                "nn.Parameter(torch.ones(1)))."
            )
        if not param.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters: {fqn!r} has shape "
                f"{tuple(param.shape)} and strides {param.stride()} (e.g. channels_last). Make "
                "it contiguous before fully_shard, e.g. "
                "module.to(memory_format=torch.contiguous_format)."
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


def _check_reduce_dtypes(
    named_params: list[tuple[str, nn.Parameter]], mp_policy: MixedPrecisionPolicy
) -> None:
    """Parameters of different dtypes are all-gathered together (as bytes), but
    the gradients of a group are reduced in one dtype."""
    by_dtype: dict[torch.dtype, str] = {}
    for fqn, param in named_params:
        if param.requires_grad:
            cast = mp_policy.param_dtype if param.dtype.is_floating_point else None
            by_dtype.setdefault(mp_policy.reduce_dtype or cast or param.dtype, fqn)
    if len(by_dtype) > 1:
        raise ValueError(
            "fully_shard reduces the gradients of a group in one dtype, but these trainable "
            "parameters would reduce in different ones: "
            + ", ".join(f"{fqn!r} in {dtype}" for dtype, fqn in by_dtype.items())
            + ". Set MixedPrecisionPolicy(reduce_dtype=...), or shard them in separate "
            "fully_shard calls."
        )


def check_all_gather_extension(
    fqn: str, param: nn.Parameter, shard_dim: int, reshard_to_group: int | None
) -> bool:
    """Whether ``param`` all-gathers itself (see [Note: all-gather extensions]),
    refusing what fsdp2 cannot do with such a parameter."""
    local = param.to_local() if isinstance(param, DTensor) else param
    has_pre = hasattr(local, PRE_ALL_GATHER)
    if has_pre != hasattr(local, POST_ALL_GATHER):
        defined, missing = (
            (PRE_ALL_GATHER, POST_ALL_GATHER) if has_pre else (POST_ALL_GATHER, PRE_ALL_GATHER)
        )
        raise TypeError(
            f"fully_shard: parameter {fqn!r} is a {type(local).__name__} that defines "
            f"{defined} but not {missing}. A tensor subclass that all-gathers itself must "
            "define both (see torch.distributed.fsdp.fully_shard's extension protocol)."
        )
    if not has_pre:
        return False
    unsupported = (
        ("tensor-parallel DTensor", isinstance(param, DTensor)),
        (f"sharded on dim {shard_dim}", shard_dim != 0),
        (f"reshard_after_forward={reshard_to_group}", reshard_to_group is not None),
    )
    for what, applies in unsupported:
        if applies:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a {type(local).__name__} that all-gathers "
                f"itself (fsdp_pre_all_gather), which is not supported {what}. Shard it on "
                "dim 0 of a plain tensor, with reshard_after_forward True or False."
            )
    return True


def _check_spmd_param(fqn: str, param: nn.Parameter, spmd: SpmdAxes) -> None:
    """With ``dp_mesh_dims`` every parameter is a DTensor on the full mesh,
    ``Replicate()`` on its data-parallel axes (fsdp2 shards over them)."""
    names = spmd.mesh.mesh_dim_names or ()
    if not isinstance(param, DTensor) or param.device_mesh != spmd.mesh:
        where = (
            f"a DTensor on {param.device_mesh}" if isinstance(param, DTensor) else "a plain tensor"
        )
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh passed to fully_shard ({spmd.mesh}), but {fqn!r} is {where}. Distribute it "
            "first, e.g. with distribute_module or distribute_tensor(param, mesh, placements)."
        )
    for axis in sorted(spmd.data_parallel):
        if not isinstance(param.placements[axis], Replicate):
            raise ValueError(
                f"Expected Replicate() on DP dim {names[axis]!r} (index {axis}) but got "
                f"{param.placements[axis]} for {fqn!r}: with dp_mesh_dims, fsdp2 shards the "
                "parameters over the data-parallel axes itself."
            )
    _check_shard_or_replicate(fqn, param)


def _check_shard_or_replicate(fqn: str, param: DTensor) -> None:
    unsupported = [p for p in param.placements if type(p) not in (Shard, Replicate)]
    if unsupported:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor placed {param.placements}; only "
            "Shard(dim) and Replicate() tensor-parallel placements can be sharded further. "
            "Redistribute it to Shard or Replicate before fully_shard."
        )


def _check_tp_param(fqn: str, param: DTensor, mesh: DeviceMesh) -> None:
    """A DTensor parameter is a tensor-parallel one: sharded or replicated over
    axes orthogonal to ``mesh`` (see [Note: FSDP over tensor parallelism])."""
    if param.__dict__.get(SHARDED):
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is already a DTensor sharded by fully_shard on a "
            "parent module. Call fully_shard bottom-up: each child first, then its parent."
        )
    if set(param.device_mesh.mesh.flatten().tolist()) == set(mesh.mesh.flatten().tolist()):
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is already a DTensor on the ranks of the mesh "
            f"passed to fully_shard ({param.placements} on {param.device_mesh}). For tensor "
            "parallelism, parallelize over mesh['tp'] and shard over mesh['dp'] of one 2D mesh; "
            "otherwise pass plain tensors."
        )
    _check_shard_or_replicate(fqn, param)
    if param.device_mesh.device_type != mesh.device_type:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor on a {param.device_mesh.device_type} "
            f"mesh, but the data-parallel mesh is on {mesh.device_type}. Use one device type."
        )
    try:
        concatenate_meshes([mesh, param.device_mesh])
    except ValueError as error:
        raise ValueError(
            f"fully_shard over tensor parallelism needs the data-parallel mesh {mesh} and the "
            f"parameters' TP mesh {param.device_mesh} to be named slices of one mesh: build "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
            "parallelize with mesh['tp'] and pass fully_shard(..., mesh=mesh['dp']), or pass "
            "the whole mesh with dp_mesh_dims=DataParallelMeshDims(shard='dp')."
        ) from error


def shard_placements(
    named_params: list[tuple[str, nn.Parameter]],
    shard_placement_fn: Callable[[nn.Parameter], object] | None,
    meshes: MeshInfos,
    device: torch.device,
) -> list[tuple[int, MeshInfo]]:
    """The dim each parameter is sharded on (negative dims counted from the end)
    and the mesh: ``shard_placement_fn``'s ``Shard(dim)`` or
    ``ShardPlacementResult``, or dim 0 of the call's mesh where it returns None."""
    if shard_placement_fn is None:
        return [(0, meshes.default)] * len(named_params)
    if not callable(shard_placement_fn):
        raise TypeError(
            "shard_placement_fn must be a function param -> Shard(dim) | ShardPlacementResult "
            f"| None, got {type(shard_placement_fn).__name__}."
        )
    placements = []
    for fqn, param in named_params:
        result = shard_placement_fn(param)
        placement, mesh_info = result, meshes.default
        if isinstance(result, ShardPlacementResult) or hasattr(result, "mesh_info"):
            placement = getattr(result, "placement", None)
            # torch's ShardPlacementResult holds its FSDPMeshInfo, which has the mesh.
            mesh = (
                result.mesh
                if isinstance(result, ShardPlacementResult)
                else getattr(result, "mesh_info").mesh  # noqa: B009 (typed object)
            )
            mesh = resolve_mesh(mesh)
            if mesh.device_type != device.type:
                raise ValueError(
                    f"shard_placement_fn put {fqn!r} on a {mesh.device_type} mesh, but "
                    f"fully_shard's mesh is on {device.type}. Use one device type."
                )
            mesh_info = meshes.of(mesh)
        if placement is None:
            placements.append((0, mesh_info))
            continue
        if type(placement) is not Shard:
            raise TypeError(
                f"shard_placement_fn returned {result!r} for {fqn!r}; it must return "
                "torch.distributed.tensor.Shard(dim), fsdp2.ShardPlacementResult(placement, "
                "mesh) or None (for Shard(0) on fully_shard's mesh)."
            )
        ndim = param.dim()
        dim = placement.dim + ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < ndim:
            # AssertionError and NotImplementedError below, as torch's fully_shard raises.
            raise AssertionError(
                f"Shard dim {placement.dim} is invalid for {ndim}D tensor {fqn!r} (shape "
                f"{tuple(param.shape)}): shard_placement_fn returned Shard({placement.dim}). "
                f"Return a dim in [{-ndim}, {ndim})."
            )
        size = (param.to_local() if isinstance(param, DTensor) else param).size(dim)
        world_size = mesh_info.shard_world_size
        if dim > 0 and size % world_size:
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {dim}: {fqn!r} has size {size} "
                f"there (shape {tuple(param.shape)}), which does not split evenly over "
                f"{world_size} ranks. Only dim 0 may be uneven: shard it on a dim whose size "
                f"{world_size} divides, or on dim 0."
            )
        placements.append((dim, mesh_info))
    return placements


def check_param_over_replicas(
    fqn: str, param: nn.Parameter, dim: int, info: MeshInfo, default: MeshInfo, extends: bool
) -> None:
    """A parameter that ``shard_optimizer_over_replicas`` splits again across the
    replicas (not one kept whole by ``min_numel_to_shard``)."""
    unsupported = "fully_shard(shard_optimizer_over_replicas=True) does not support"
    if isinstance(param, DTensor):
        raise ValueError(
            f"{unsupported} parameters that are already DTensors (tensor parallelism): "
            f"{fqn!r} is placed {param.placements}. Use plain HSDP (leave the option off)."
        )
    if info is not default or dim != 0:
        raise ValueError(
            f"{unsupported} shard_placement_fn placing {fqn!r} on dim {dim} or on another "
            "mesh: parameters are sharded on dim 0 of the mesh passed to fully_shard. Return "
            "None from shard_placement_fn, or shard that module with plain HSDP."
        )
    if extends:
        raise ValueError(
            f"{unsupported} tensor subclasses that all-gather themselves: {fqn!r} is a "
            f"{type(param.data).__name__} with fsdp_pre_all_gather. Use plain HSDP for it."
        )
    rows, replicas, shards = param.size(0), info.replicate_world_size, info.shard_world_size
    if not strided_layout_matches(rows, replicas, shards):
        raise ValueError(
            f"{unsupported} {fqn!r} on this mesh: its dim 0 of {rows} rows, chunked over "
            f"{shards} shards and each chunk over {replicas} replicas, is not a layout "
            f"DTensor can describe ((_StridedShard(0, split_factor={shards}), Shard(0)) "
            "places its rows differently, so full_tensor() and checkpoints would be wrong). "
            f"Pad dim 0 to a multiple of {replicas * shards}, keep it whole with "
            "min_numel_to_shard, or shard its module with plain HSDP."
        )
