"""``fully_shard``'s arguments, resolved and checked in one pass
(``resolve_call``) into one record, ``ShardingCall``, before anything is
built: user mistakes fail here, naming the fix, and nothing has changed.

The pass, in order: the modules, the plain arguments' types, the mesh and
its data-parallel axes (``MeshInfo``), compression on that mesh, the
call's parameters (those no nested call took, none tied to one) and each
one's checks (param_checks.py), its mesh and dim (``shard_placement_fn``),
``reshard_after_forward`` on that mesh, and its ``ShardLayout``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..base.policy import (
    CompressionPolicy,
    MixedPrecisionArg,
    MixedPrecisionPolicy,
    OffloadArg,
    OffloadPolicy,
    check_bool,
    from_torch_policy,
    full_type_name,
)
from ..base.torch_fsdp import check_no_torch_fsdp_inside
from ..comm.layout import ShardLayout
from ..comm.mesh_info import MeshInfo, device_from_mesh, post_forward_mesh_info
from ..comm.variants import CommSettings
from .call_modules import (
    check_no_param_shared_with_nested_group,
    module_list,
    named_submodules,
    nested_states,
    unowned_params,
)
from .mesh import (
    DataParallelMeshDims,
    MeshInfos,
    ShardPlacementResult,
    resolve_mesh,
    spmd_mesh_info,
)
from .param_checks import (
    check_all_gather_extension,
    check_param_over_replicas,
    check_params,
    shard_placements,
)
from .state import FSDPState

PlacementFn = Callable[[nn.Parameter], Shard | ShardPlacementResult | None]


class PostForward(NamedTuple):
    """What a group does after forward: reshard (True), keep the unsharded
    parameters (False), decide at lazy init (None: off for the root), and the
    small group to reshard to (``reshard_after_forward=<int>``)."""

    reshard: bool | None
    small_group: MeshInfo | None


class ParamPlan(NamedTuple):
    """One parameter of the call: its name in the call, the mesh it is sharded
    over and its layout."""

    fqn: str
    param: nn.Parameter
    mesh_info: MeshInfo
    layout: ShardLayout
    sharded_as: str  # where, for messages: its name in the module that holds it


@dataclass(frozen=True)
class ShardingCall:
    """A ``fully_shard`` call, resolved and checked."""

    modules: list[nn.Module]
    mesh_info: MeshInfo  # of the call's own mesh
    device: torch.device
    reshard_after_forward: bool | None  # the state's: on the call's own mesh
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    comm_settings: CommSettings
    ignored: set[nn.Parameter]
    params: list[ParamPlan]  # in the order of the modules' named_parameters()
    post_forward: dict[int, PostForward]  # by id of each MeshInfo of the params
    nested_states: list[FSDPState]  # of earlier calls on submodules


def resolve_call(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionArg,
    ignored_params: set[nn.Parameter] | None,
    offload_policy: OffloadArg,
    shard_placement_fn: PlacementFn | None,
    dp_mesh_dims: DataParallelMeshDims | None,
    min_numel_to_shard: int,
    compression: CompressionPolicy,
    shard_optimizer_over_replicas: bool,
) -> ShardingCall:
    """``fully_shard``'s arguments (see its docstring) as a ``ShardingCall``;
    raises on the first mistake, before anything is changed."""
    modules = module_list(module)
    check_no_torch_fsdp_inside(named_submodules(modules))
    mp_policy, offload_policy = check_policies(mp_policy, offload_policy)
    check_min_numel_to_shard(min_numel_to_shard)
    over_replicas = check_bool(
        "fully_shard", "shard_optimizer_over_replicas", shard_optimizer_over_replicas
    )
    mesh = resolve_mesh(mesh, full_spmd_mesh=dp_mesh_dims is not None)
    if over_replicas:
        check_shard_over_replicas_mesh(mesh, dp_mesh_dims)
    if dp_mesh_dims is None:
        mesh_info = MeshInfo.from_mesh(mesh)
    else:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims)
        if not isinstance(reshard_after_forward, bool | None):
            raise NotImplementedError(
                f"reshard_after_forward={reshard_after_forward} (an int) is not supported with "
                "dp_mesh_dims: pass True or False."
            )
    check_compression(compression, mesh_info, over_replicas)
    post_forward = {id(mesh_info): _post_forward(reshard_after_forward, mesh_info)}
    device = device_from_mesh(mesh)
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError(
            "fully_shard(ignored_params=...) takes a set of parameters, got one "
            f"{type(ignored_params).__name__} of shape {tuple(ignored_params.shape)}: pass "
            "{param}, e.g. ignored_params={model.embed.weight}."
        )
    ignored = set(ignored_params or ())
    named_params = [(fqn, p) for fqn, p in unowned_params(modules) if p not in ignored]
    check_no_param_shared_with_nested_group(modules)
    check_params(named_params, mesh, device, mp_policy, mesh_info.spmd)
    placements = shard_placements(named_params, shard_placement_fn, MeshInfos(mesh_info), device)
    params = []
    for (fqn, param), (dim, info) in zip(named_params, placements, strict=True):
        if id(info) not in post_forward:
            post_forward[id(info)] = _post_forward(reshard_after_forward, info)
        to_group = reshard_after_forward if post_forward[id(info)].small_group else None
        extends = check_all_gather_extension(fqn, param, dim, to_group)
        # A subclass that all-gathers itself is always sharded.
        whole = not extends and _local_numel(param) < min_numel_to_shard
        if over_replicas and not whole:
            check_param_over_replicas(fqn, param, dim, info, mesh_info, extends)
        layout = ShardLayout.of(param, info, dim, whole, over_replicas)
        params.append(ParamPlan(fqn, param, info, layout, _sharded_as(modules, fqn)))
    return ShardingCall(
        modules=modules,
        mesh_info=mesh_info,
        device=device,
        reshard_after_forward=post_forward[id(mesh_info)].reshard,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        comm_settings=CommSettings(compression=compression, over_replicas=over_replicas),
        ignored=ignored,
        params=params,
        post_forward=post_forward,
        nested_states=nested_states(modules),
    )


def _sharded_as(modules: list[nn.Module], fqn: str) -> str:
    """A parameter's name in the module that holds it (a list's names start
    with the module's position, see ``_named_members``)."""
    member = modules[0]
    if len(modules) > 1:
        index, fqn = fqn.split(".", 1)
        member = modules[int(index)]
    return f"{fqn!r} of {type(member).__name__}"


def _post_forward(value: bool | int | None, mesh_info: MeshInfo) -> PostForward:
    """``reshard_after_forward`` on one of the call's meshes: (bool or None, the
    small group's MeshInfo for an int)."""
    check_reshard_after_forward(value, mesh_info.shard_world_size)
    if value is None or isinstance(value, bool):
        return PostForward(value, None)
    if value == 1:
        return PostForward(False, None)  # each rank would keep everything: that is not resharding
    if value == mesh_info.shard_world_size:
        return PostForward(True, None)
    check_mesh_spans_world(mesh_info.mesh, value)
    return PostForward(True, post_forward_mesh_info(mesh_info.mesh, value))


def _local_numel(param: nn.Parameter) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


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


def check_mesh_spans_world(mesh: DeviceMesh, value: int) -> None:
    """``reshard_after_forward=<int>`` builds its small groups with every rank of
    the world taking part (process groups are created collectively), which
    only a mesh over the whole world can describe."""
    if mesh.mesh.numel() != dist.get_world_size():
        raise ValueError(
            f"reshard_after_forward={value} needs a mesh over every rank of the world, but "
            f"the mesh has {mesh.mesh.numel()} of {dist.get_world_size()} ranks (a slice such "
            "as mesh['dp'] next to tensor parallelism, or a sub-mesh). Pass True or False "
            "for this module."
        )


def check_policies(
    mp_policy: object, offload_policy: object
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as fsdp2's own (torch's FSDP2 policies are converted, field
    for field; ``offload_policy=None`` is no offload, as for torch); anything
    else is refused."""
    mp_policy = from_torch_policy(mp_policy)
    if offload_policy is None:
        # torch's fully_shard offloads only for a CPUOffloadPolicy (an isinstance
        # test), so None means no offload there; verl's engines pass it.
        offload_policy = OffloadPolicy()
    offload_policy = from_torch_policy(offload_policy)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "mp_policy must be an fsdp2.MixedPrecisionPolicy (or torch.distributed.fsdp's "
            f"MixedPrecisionPolicy), got {full_type_name(mp_policy)}. Pass e.g. "
            "mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be fsdp2.OffloadPolicy() or fsdp2.CPUOffloadPolicy() (or "
            f"torch.distributed.fsdp's), got {full_type_name(offload_policy)}. Pass e.g. "
            "offload_policy=fsdp2.CPUOffloadPolicy()."
        )
    return mp_policy, offload_policy


def check_compression(compression: object, mesh_info: MeshInfo, over_replicas: bool) -> None:
    """``compression`` is a ``CompressionPolicy`` this mesh can use."""
    if not isinstance(compression, CompressionPolicy):
        raise TypeError(
            "compression must be an fsdp2.CompressionPolicy, got "
            f"{type(compression).__name__}. Pass e.g. "
            "compression=CompressionPolicy(weights='int8', gradients='bf16')."
        )
    if compression.across != "replicate":
        return
    if mesh_info.replicate_group is None:
        raise ValueError(
            "CompressionPolicy(across='replicate') compresses only the collectives across HSDP "
            "replicas, but this mesh has no replicate axis (a 1D mesh). Pass a 2D mesh "
            "(replicate, shard), or across='all'."
        )
    if compression.weights is not None and not over_replicas:
        raise ValueError(
            f"CompressionPolicy(weights={compression.weights!r}, across='replicate'): the "
            "all-gather runs inside one replica, never across replicas, so across='replicate' "
            "has no weights to compress. Pass weights=None, or across='all' (or "
            "shard_optimizer_over_replicas=True, whose all-gather across replicas it compresses)."
        )
    if not compression.enabled:
        raise ValueError(
            "CompressionPolicy(across='replicate') without gradients=... compresses nothing. "
            "Pass gradients='bf16' or 'int8'."
        )


def check_min_numel_to_shard(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"min_numel_to_shard must be an int (a number of elements), got {value!r}.")
    if value < 0:
        raise ValueError(f"min_numel_to_shard must be >= 0, got {value}. 0 shards every parameter.")


def check_shard_over_replicas_mesh(mesh: DeviceMesh, dp_mesh_dims: object) -> None:
    """``shard_optimizer_over_replicas`` needs an HSDP mesh passed as ``mesh``."""
    if dp_mesh_dims is not None:
        raise ValueError(
            "fully_shard(shard_optimizer_over_replicas=True) does not support dp_mesh_dims "
            "(parameters that are already DTensors on a larger mesh). Pass a 2D "
            "(replicate, shard) mesh as mesh without dp_mesh_dims, or leave "
            "shard_optimizer_over_replicas off."
        )
    if mesh.ndim != 2:
        raise ValueError(
            "fully_shard(shard_optimizer_over_replicas=True) needs a 2D (replicate, shard) "
            f"mesh (HSDP), got a {mesh.ndim}D mesh of shape {tuple(mesh.shape)}. A 1D mesh "
            "already shards parameters and optimizer state over every rank: leave "
            "shard_optimizer_over_replicas off, or pass init_device_mesh(device, (R, S), "
            'mesh_dim_names=("replicate", "shard")).'
        )
    replicas = mesh.get_group(0)
    if _is_torchft_group(replicas):
        raise ValueError(
            "fully_shard(shard_optimizer_over_replicas=True) cannot split the optimizer across "
            f"torchft's replica groups (the mesh's replicate axis is {dist.get_backend(replicas)!r}, "
            "a torchft process group): a replica group that fails would take its pieces of the "
            "parameters and optimizer state with it, and torchft heals the group replacing it "
            "by copying a live group's state, which does not hold them. Keep torchft outside "
            "the mesh: shard inside each replica group (1D, or HSDP with this option over the "
            "group's own ranks) and all-reduce across the groups with set_all_reduce_hook "
            '(docs/usage.md, "Fault-tolerant HSDP with torchft"), or leave '
            "shard_optimizer_over_replicas off."
        )


def _is_torchft_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is one of torchft's process groups (its replicas come
    and go; fsdp2 does not import torchft): by its backend's name, which
    torchft registers as "torchft-<backend>:<name>", or by its class."""
    backend = str(dist.get_backend(group))
    return backend.startswith("torchft") or type(group).__module__.startswith("torchft.")
