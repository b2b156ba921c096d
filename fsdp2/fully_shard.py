"""``fully_shard``: finding a call's parameters, sharding them, and the class swap
that makes each module an ``FSDPModule`` (whose methods are in module.py)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol, cast, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .checks import mark_ignored
from .common import MeshInfo, ShardedState, device_from_mesh, post_forward_mesh_info
from .compression import CompressionPolicy
from .mesh import DataParallelMeshDims, MeshInfos, ShardPlacementResult, spmd_mesh_info
from .module import FSDPModule
from .param import FSDPParam, Registration
from .param_group import FSDPParamGroup
from .policy import MixedPrecisionPolicy, OffloadPolicy
from .private_api import in_backward, mark_composable_api, module_parameters
from .state import FSDPState, get_fsdp_state
from .state_dict import register_state_dict_hooks
from .validate import (
    SHARDED_AS,
    check_all_gather_extension,
    check_compression,
    check_mesh_spans_world,
    check_min_numel_to_shard,
    check_module,
    check_param_over_replicas,
    check_params,
    check_policies,
    check_reshard_after_forward,
    check_shard_over_replicas_mesh,
    resolve_mesh,
    shard_placements,
)

# Generated FSDP<Name> classes, one per original class, so that type checks
# see one class however many modules of that class are sharded.
_FSDP_CLASSES: dict[type, type] = {}

PlacementFn = Callable[[nn.Parameter], Shard | ShardPlacementResult | None]


class FullyShard(Protocol):
    """The type of ``fully_shard``: a module in gives an ``FSDPModule``, a list
    a list of them; ``fully_shard.state(module)`` is the call's state."""

    @overload
    def __call__(
        self,
        module: nn.Module,
        *,
        mesh: DeviceMesh | None = ...,
        reshard_after_forward: bool | int | None = ...,
        mp_policy: MixedPrecisionPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        offload_policy: OffloadPolicy = ...,
        shard_placement_fn: PlacementFn | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
        min_numel_to_shard: int = ...,
        compression: CompressionPolicy = ...,
        shard_optimizer_over_replicas: bool = ...,
    ) -> FSDPModule: ...

    @overload
    def __call__(
        self,
        module: list[nn.Module],
        *,
        mesh: DeviceMesh | None = ...,
        reshard_after_forward: bool | int | None = ...,
        mp_policy: MixedPrecisionPolicy = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        offload_policy: OffloadPolicy = ...,
        shard_placement_fn: PlacementFn | None = ...,
        dp_mesh_dims: DataParallelMeshDims | None = ...,
        min_numel_to_shard: int = ...,
        compression: CompressionPolicy = ...,
        shard_optimizer_over_replicas: bool = ...,
    ) -> list[FSDPModule]: ...

    def state(self, module: nn.Module) -> FSDPState | None: ...


def _with_state(fn: Callable[..., Any]) -> FullyShard:
    """Gives ``fully_shard`` its ``state(module)`` (as torch's has), typed."""
    setattr(fn, "state", get_fsdp_state)  # noqa: B010 (a function's attribute)
    return cast(FullyShard, fn)


@_with_state
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen)
    shard_placement_fn: PlacementFn | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    min_numel_to_shard: int = 0,
    compression: CompressionPolicy = CompressionPolicy(),  # noqa: B008 (frozen)
    shard_optimizer_over_replicas: bool = False,
) -> FSDPModule | list[FSDPModule]:
    """Shards ``module``'s parameters over ``mesh`` and communicates them as one group.

    Call it bottom-up: each call takes the parameters of ``module`` that no
    earlier call on a submodule took. Afterwards every such parameter is an
    ``nn.Parameter`` holding a ``Shard(0)`` DTensor; forward all-gathers the
    group just before ``module`` runs and backward reduce-scatters its
    gradients, averaged over ranks as DDP does.

    A list of modules forms one group for modules that the model calls
    separately, e.g. ``fully_shard([model.norm, model.output])``: their
    parameters are all-gathered once, when the first of them runs, and
    resharded when all of them have run (or, if some do not run, at the end of
    the model's forward). Backward all-gathers and reduce-scatters the group
    once too. A module of the list must not contain another; the parameters
    of all of them are taken together, so a parameter tied between them stays
    tied. Each module gets the class swap and shares the group, so the
    ``FSDPModule`` methods of any of them act on the whole group. A list is
    never the root: shard a module containing them all afterwards.

    Args:
        module: the module whose parameters form one group, or a list of
            modules whose parameters form one group together. Its class (each
            one's) is swapped in place to ``FSDP<Name>``, a subclass of
            ``FSDPModule`` and the original class, and the same object (the
            same list) is returned.
        mesh: a 1D DeviceMesh to shard over, or a 2D one ``(replicate,
            shard)`` for HSDP: sharded over axis 1, replicated over axis 0,
            gradients reduce-scattered inside the shard group then all-reduced
            across replicas. (Default: a 1D mesh over the whole world on the
            current accelerator, or CPU)
        reshard_after_forward: free the unsharded parameters after forward and
            all-gather them again in backward (True), or keep them until
            backward ends (False). An int N (a divisor of the mesh size) keeps
            a shard over groups of N consecutive ranks, so that backward's
            all-gather stays inside them (e.g. inside a node). (Default: None,
            which is True for every group but the root's)
        mp_policy: compute, communication and output dtypes; see
            ``MixedPrecisionPolicy``. (Default: no mixed precision)
        ignored_params: parameters to leave alone: not sharded, not
            all-gathered, not reduced. (Default: None)
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded parameters,
            gradients and optimizer state on the CPU. (Default: no offload)
        shard_placement_fn: called with each parameter; returns the
            ``Shard(dim)`` to shard it on, or None for ``Shard(0)`` (e.g. an
            expert weight whose dim 0 is small), or a
            ``ShardPlacementResult(placement, mesh)`` to shard it over another
            mesh (e.g. experts on an expert-parallel mesh): each mesh's
            parameters form a group of their own. Dims other than 0 must split
            evenly over the mesh. (Default: None, every parameter on dim 0)
        dp_mesh_dims: the parameters are already DTensors on all of ``mesh``
            (e.g. tensor parallel on ``"tp"``, ``Replicate()`` on ``"dp"``):
            shard them over the axes named ``shard`` and, for HSDP, replicate
            over ``replicate``. ``mesh`` is then the full mesh and may have
            any number of axes. (Default: None, ``mesh`` is the data-parallel
            mesh)
        min_numel_to_shard: parameters with fewer elements (of their TP-local
            part, for a DTensor) are not sharded but kept whole on every rank
            as ``Replicate()`` DTensors, and their gradients all-reduced: for
            norm weights and biases, whose tiny shards cost padding and
            per-parameter copies for no memory saved. (Default: 0, shard all)
        compression: what travels compressed: int8 weights in the all-gather,
            bf16 or int8 gradients in the reduce-scatter (an all-to-all summed
            in fp32); see ``CompressionPolicy`` and docs/usage.md. Sharded
            parameters, gradients and optimizer state keep their dtype.
            (Default: nothing compressed)
        shard_optimizer_over_replicas: HSDP only (a 2D ``mesh``): split each
            sharded parameter again across the replicas, so that the
            optimizer's parameters, gradients and state are 1/(R*S) of it
            (placed ``(_StridedShard(0, split_factor=S), Shard(0))``), while
            all-gathers stay inside the shard group: a rank keeps its shard
            group's chunk in ``param_dtype``, gathered across the replicas
            again after each optimizer step, and gradients are
            reduce-scattered (not all-reduced) across the replicas. See
            docs/usage.md. (Default: False)

    Parameters that are already DTensors (tensor parallelism, from
    ``parallelize_module`` on ``mesh["tp"]`` of the mesh whose ``mesh["dp"]``
    is passed here) are sharded over ``mesh`` too and become DTensors on the
    joined ``(dp, tp)`` mesh; forward computes with their TP layout.

    Returns:
        The same module, now an ``FSDPModule`` (or the same list of them).
    """
    modules = _module_list(module)
    mesh = resolve_mesh(mesh, full_spmd_mesh=dp_mesh_dims is not None)
    check_policies(mp_policy, offload_policy)
    if shard_optimizer_over_replicas:
        check_shard_over_replicas_mesh(mesh, dp_mesh_dims)
    if dp_mesh_dims is None:
        mesh_info = MeshInfo.from_mesh(mesh)
        if shard_optimizer_over_replicas:
            mesh_info = dataclasses.replace(mesh_info, shard_over_replicas=True)
    else:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims)
        if not isinstance(reshard_after_forward, bool | None):
            raise NotImplementedError(
                f"reshard_after_forward={reshard_after_forward} (an int) is not supported with "
                "dp_mesh_dims: pass True or False."
            )
    check_compression(compression, mesh_info)
    resharding = _resolve_reshard_after_forward(reshard_after_forward, mesh_info)[0]
    device = device_from_mesh(mesh)
    ignored = set(ignored_params or ())
    named_params = [(fqn, p) for fqn, p in _unowned_params(modules) if p not in ignored]
    _check_no_param_shared_with_nested_group(modules)
    check_params(named_params, mesh, device, mp_policy, mesh_info.spmd)
    placements = shard_placements(named_params, shard_placement_fn, MeshInfos(mesh_info), device)
    check_min_numel_to_shard(min_numel_to_shard)
    # After forward: per mesh, resharding (or not) and the smaller group to reshard to.
    post_forward = {
        id(info): _resolve_reshard_after_forward(reshard_after_forward, info)
        for info in {id(info): info for _, info in placements}.values()
    }
    extended = [
        check_all_gather_extension(
            fqn, param, dim, reshard_after_forward if post_forward[id(info)][1] else None
        )
        for (fqn, param), (dim, info) in zip(named_params, placements, strict=True)
    ]
    if shard_optimizer_over_replicas:
        for (fqn, param), (dim, info), extends in zip(
            named_params, placements, extended, strict=True
        ):
            if extends or _local_numel(param) >= min_numel_to_shard:
                check_param_over_replicas(fqn, param, dim, info, mesh_info, extends)

    mark_ignored(ignored)  # plain on purpose: not "a root left unsharded" (checks.py)
    state = FSDPState(modules, mesh_info, device, resharding, mp_policy)
    for nested in _nested_states(modules):
        if nested.parent is None:
            nested.parent = state
    if named_params:
        registrations = _registrations(modules, named_params)
        by_mesh: dict[int, list[FSDPParam]] = {}  # [Note: groups of one call]
        for (fqn, param), (dim, info), extends in zip(
            named_params, placements, extended, strict=True
        ):
            by_mesh.setdefault(id(info), []).append(
                FSDPParam(
                    param,
                    fqn,
                    registrations[id(param)],
                    info,
                    device,
                    mp_policy,
                    offload_policy,
                    shard_dim=dim,
                    # A subclass that all-gathers itself is always sharded.
                    replicated=not extends and _local_numel(param) < min_numel_to_shard,
                    ops=state.root_ctx.comm.ops,
                )
            )
        _mark_sharded(modules, named_params)
        for fsdp_params in by_mesh.values():
            info = fsdp_params[0].mesh_info
            reshard, small_group = post_forward[id(info)]
            group = FSDPParamGroup(
                fsdp_params,
                modules,
                info,
                state.root_ctx,
                reshard_after_forward=reshard is not False,
                post_forward_mesh_info=small_group,
                compression=compression,
            )
            state.param_groups.append(group)
            for member in modules:
                register_state_dict_hooks(member, group)
    for member in modules:
        member.__dict__["_fsdp_state"] = state
        mark_composable_api(member, "fully_shard")
        _swap_class(member)
    return module  # type: ignore[return-value]


def _resolve_reshard_after_forward(
    value: bool | int | None, mesh_info: MeshInfo
) -> tuple[bool | None, MeshInfo | None]:
    """Maps the argument to (bool or None, the small group's MeshInfo for an int)
    on one of the call's meshes."""
    check_reshard_after_forward(value, mesh_info.shard_world_size)
    if value is None or isinstance(value, bool):
        return value, None
    if value == 1:
        return False, None  # each rank would keep everything: that is not resharding
    if value == mesh_info.shard_world_size:
        return True, None
    check_mesh_spans_world(mesh_info.mesh, value)
    return True, post_forward_mesh_info(mesh_info.mesh, value)


def _local_numel(param: nn.Parameter) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def _module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules of one call, checked: ``[module]``, or the list's modules."""
    if not isinstance(module, list | tuple):
        check_module(module)
        return [module]
    if not module:
        raise ValueError(
            "fully_shard got an empty list. Pass a module, or a list of the modules whose "
            "parameters should form one group, e.g. fully_shard([model.norm, model.output])."
        )
    index: dict[int, int] = {}  # id(module) -> position in the list
    for i, member in enumerate(module):
        if not isinstance(member, nn.Module):
            raise TypeError(
                f"fully_shard expects a module or a list of modules, but element {i} of the "
                f"list is a {type(member).__name__}. Put only nn.Modules in the list."
            )
        if id(member) in index:
            raise ValueError(
                f"fully_shard: the list holds the same {type(member).__name__} twice (elements "
                f"{index[id(member)]} and {i}). List each module once."
            )
        index[id(member)] = i
    for i, member in enumerate(module):
        for name, submodule in member.named_modules():
            if submodule is not member and (j := index.get(id(submodule))) is not None:
                raise ValueError(
                    f"fully_shard: element {j} of the list ({type(submodule).__name__}) is "
                    f"inside element {i} ({type(member).__name__}, as {name!r}), whose "
                    f"parameters already include it. Remove element {j} from the list."
                )
    for i, member in enumerate(module):
        if "_fsdp_state" in member.__dict__:
            raise ValueError(
                f"fully_shard: element {i} of the list ({type(member).__name__}) is already "
                "sharded by an earlier fully_shard call, and a module belongs to one group. "
                "Leave it out of the list, or drop the earlier call."
            )
        check_module(member)
    return list(module)


def _named_members(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Each module of the call with the prefix of its names in this call: none for a
    single module, its position in the list (``"1."``) for a list."""
    if len(modules) == 1:
        return [("", modules[0])]
    return [(f"{i}.", member) for i, member in enumerate(modules)]


def _module_paths(modules: list[nn.Module]) -> dict[int, str]:
    """Path, as named in this call, of every submodule of the modules of the call."""
    return {
        id(submodule): f"{prefix}{name}".removesuffix(".")
        for prefix, member in _named_members(modules)
        for name, submodule in member.named_modules()
    }


def _nested_states(modules: list[nn.Module]) -> list[FSDPState]:
    """States of earlier calls on submodules, each once (a list's state is on each of its modules)."""
    states = (
        get_fsdp_state(submodule)
        for member in modules
        for submodule in member.modules()
        if submodule is not member
    )
    return list(dict.fromkeys(state for state in states if state is not None))


def _unowned_params(modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of ``modules`` outside every nested ``fully_shard``'d module, with
    their names: what a nested call took or chose to ignore is not ours. A parameter
    tied between two modules of a list is listed once."""
    nested = {
        id(p)
        for state in _nested_states(modules)
        for nested_module in state.modules
        for p in nested_module.parameters()
    }
    seen = set()
    params = []
    for prefix, member in _named_members(modules):
        for fqn, p in member.named_parameters():
            if id(p) not in nested and id(p) not in seen:
                seen.add(id(p))
                params.append((prefix + fqn, p))
    return params


def _registrations(
    modules: list[nn.Module], named_params: list[tuple[str, nn.Parameter]]
) -> dict[int, list[Registration]]:
    """Every ``(submodule, name)`` that holds each parameter, so tied parameters stay tied."""
    found: dict[int, list[Registration]] = {id(p): [] for _, p in named_params}
    submodules = dict.fromkeys(m for member in modules for m in member.modules())
    for submodule in submodules:
        for name, param in module_parameters(submodule).items():
            if param is not None and id(param) in found:
                found[id(param)].append(Registration(submodule, name))
    return found


def _mark_sharded(modules: list[nn.Module], named_params: list[tuple[str, nn.Parameter]]) -> None:
    """Labels each original parameter with where it was sharded (see ``SHARDED_AS``),
    by its name in the module that holds it (a list's names start with the
    module's position, see ``_named_members``)."""
    for fqn, param in named_params:
        member = modules[0]
        if len(modules) > 1:
            index, fqn = fqn.split(".", 1)
            member = modules[int(index)]
        param.__dict__[SHARDED_AS] = f"{fqn!r} of {type(member).__name__}"


def _check_no_param_shared_with_nested_group(modules: list[nn.Module]) -> None:
    """A parameter owned by a nested group must not also be registered outside it:
    that module would compute with the sharded DTensor (tied after sharding) or
    shard a second copy (tied before sharding, so it still holds the original)."""
    nested = _nested_states(modules)
    inside_nested = {
        id(m)
        for state in nested
        for nested_module in state.modules
        for m in nested_module.modules()
    }
    paths = _module_paths(modules)
    owner_of = {}
    for state in nested:
        for fsdp_param in (p for group in state.param_groups for p in group.fsdp_params):
            first = fsdp_param.registrations[0]
            owner = fsdp_param.fqn
            if (path := paths.get(id(first.module))) is not None:
                owner = f"{path}.{first.name}" if path else first.name
            owner_of[id(fsdp_param.sharded_param)] = owner
            if (orig := fsdp_param.orig_param_ref()) is not None:
                owner_of[id(orig)] = owner
    for prefix, member in _named_members(modules):
        for module_name, submodule in member.named_modules():
            if id(submodule) in inside_nested:
                continue
            for name, param in module_parameters(submodule).items():
                if param is not None and id(param) in owner_of:
                    where = f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}"
                    raise ValueError(
                        f"fully_shard: parameter {where!r} is the same Parameter as "
                        f"{owner_of[id(param)]!r}, which an earlier fully_shard call on a "
                        "submodule already sharded. A parameter shared by two groups is not "
                        "supported: untie them, or shard the modules that share it in one call "
                        "(the common parent, or a list of modules such as "
                        "fully_shard([model.tok_embeddings, model.output]))."
                    )


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        namespace = {"forward": _checked_forward(cls.forward)}
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
    module.__class__ = _FSDP_CLASSES[cls]


def _checked_forward(forward):
    """``forward`` that refuses to run without fully_shard's forward pre-hook
    (``model.forward(x)`` instead of ``model(x)``): it would compute with the
    sharded DTensors and fail deep inside an operator, or worse."""

    @functools.wraps(forward)
    def checked(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # The hooks ran, eagerly, just before. Traced, the check would guard the
            # graph on fsdp2's state and, in a recomputation (activation
            # checkpointing), break it: the autograd engine query is not traceable.
            return forward(self, *args, **kwargs)
        state = self.__dict__["_fsdp_state"]
        in_forward = state.root_ctx.forward_root is not None or in_backward()  # or recomputing
        if not in_forward or any(
            group.sharded_state is not ShardedState.UNSHARDED for group in state.param_groups
        ):
            raise RuntimeError(
                f"fsdp2: {type(self).__name__}.forward ran without fully_shard's hooks, so its "
                "parameters are still sharded. Call the module, model(...), not "
                "model.forward(...); for another method than forward, use "
                "register_fsdp_forward_method."
            )
        return forward(self, *args, **kwargs)

    return checked
