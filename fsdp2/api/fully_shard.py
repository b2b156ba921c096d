"""``fully_shard``: finding a call's parameters, sharding them, and the class swap
that makes each module an ``FSDPModule`` (whose methods are in module.py)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol, cast, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..base.markers import SHARDED_AS, ShardedAs
from ..base.policy import (
    CompressionPolicy,
    MixedPrecisionArg,
    MixedPrecisionPolicy,
    OffloadArg,
    OffloadPolicy,
)
from ..base.private_api import in_backward, module_parameters, never_a_compiled_frame
from ..base.private_dist import mark_composable_api
from ..checks.mistakes import mark_ignored
from ..checks.same_model import remember
from ..comm.over_replicas import quiet_two_all_gathers_notice
from ..engine.param import FSDPParam, Registration
from ..engine.param_group import FSDPParamGroup
from ..engine.state_dict import register_state_dict_hooks
from ..engine.states import ShardedState
from .arguments import ParamPlan, PlacementFn, resolve_call
from .mesh import DataParallelMeshDims
from .module import FSDPModule
from .state import FSDPState, get_fsdp_state

# Generated FSDP<Name> classes, one per original class, so that type checks
# see one class however many modules of that class are sharded.
_FSDP_CLASSES: dict[type, type] = {}


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
        mp_policy: MixedPrecisionArg = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        offload_policy: OffloadArg = ...,
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
        mp_policy: MixedPrecisionArg = ...,
        ignored_params: set[nn.Parameter] | None = ...,
        offload_policy: OffloadArg = ...,
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
    mp_policy: MixedPrecisionArg = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    offload_policy: OffloadArg = OffloadPolicy(),  # noqa: B008 (frozen)
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
            ``MixedPrecisionPolicy`` (torch.distributed.fsdp's is accepted
            too, with the same meaning). (Default: no mixed precision)
        ignored_params: parameters to leave alone: not sharded, not
            all-gathered, not reduced. (Default: None)
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded parameters,
            gradients and optimizer state on the CPU (torch.distributed.fsdp's
            policies are accepted too; None is no offload, as for torch).
            (Default: no offload)
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
            in fp32) and across HSDP replicas (with
            ``shard_optimizer_over_replicas``, the all-gather and the
            reduce-scatter across them too); see ``CompressionPolicy`` and
            docs/usage.md. Sharded parameters, gradients and optimizer state
            keep their dtype. (Default: nothing compressed)
        shard_optimizer_over_replicas: HSDP only (a 2D ``mesh``): split each
            sharded parameter again across the replicas, so that the
            optimizer's parameters, gradients and state are 1/(R*S) of it
            (placed ``(_StridedShard(0, split_factor=S), Shard(0))``), while
            all-gathers stay inside the shard group: a rank keeps its shard
            group's chunk in ``param_dtype``, gathered across the replicas
            again after each optimizer step, and gradients are
            reduce-scattered (not all-reduced) across the replicas. Refused
            across torchft's replica groups (a replicate axis that is a
            torchft process group). See docs/usage.md. (Default: False)

    Parameters that are already DTensors (tensor parallelism, from
    ``parallelize_module`` on ``mesh["tp"]`` of the mesh whose ``mesh["dp"]``
    is passed here) are sharded over ``mesh`` too and become DTensors on the
    joined ``(dp, tp)`` mesh; forward computes with their TP layout.

    Returns:
        The same module, now an ``FSDPModule`` (or the same list of them).
    """
    call = resolve_call(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        ignored_params=ignored_params,
        offload_policy=offload_policy,
        shard_placement_fn=shard_placement_fn,
        dp_mesh_dims=dp_mesh_dims,
        min_numel_to_shard=min_numel_to_shard,
        compression=compression,
        shard_optimizer_over_replicas=shard_optimizer_over_replicas,
    )
    modules = call.modules
    if call.comm_settings.over_replicas:
        quiet_two_all_gathers_notice()  # full tensors of this layout: harmless, see why there
    mark_ignored(call.ignored)  # plain on purpose: not "a root left unsharded" (mistakes.py)
    state = FSDPState(
        modules, call.mesh_info, call.device, call.reshard_after_forward, call.mp_policy
    )
    state.call_site = _user_call_site()
    for nested in call.nested_states:
        if nested.parent is None:
            nested.parent = state
    if call.params:
        registrations = _registrations(modules, call.params)
        # One group per mesh the call's parameters are sharded over, the call's own first.
        by_mesh: dict[int, list[FSDPParam]] = {}
        taken: list[tuple[nn.Parameter, FSDPParam]] = []
        for plan in call.params:
            fsdp_param = FSDPParam(
                plan.param,
                plan.fqn,
                registrations[id(plan.param)],
                plan.layout,
                plan.mesh_info,
                call.device,
                call.mp_policy,
                call.offload_policy,
                ops=state.root_ctx.comm.ops,
            )
            by_mesh.setdefault(id(plan.mesh_info), []).append(fsdp_param)
            taken.append((plan.param, fsdp_param))
            plan.param.__dict__[SHARDED_AS] = ShardedAs(plan.sharded_as)
        remember(taken)  # each still whole here: compared at lazy init
        for fsdp_params in by_mesh.values():
            info = fsdp_params[0].mesh_info
            reshard, small_group = call.post_forward[id(info)]
            group = FSDPParamGroup(
                fsdp_params,
                modules,
                info,
                state.root_ctx,
                reshard_after_forward=reshard is not False,
                post_forward_mesh_info=small_group,
                settings=call.comm_settings,
            )
            state.param_groups.append(group)
            for member in modules:
                register_state_dict_hooks(member, group)
    for member in modules:
        member.__dict__["_fsdp_state"] = state
        mark_composable_api(member, "fully_shard")
        _swap_class(member)
    return module  # type: ignore[return-value]


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_call_site() -> str:
    """``file:line`` of the first caller outside fsdp2 (the user's fully_shard call)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    filename = frame.f_code.co_filename
    if os.path.isabs(filename) and filename.startswith(os.getcwd() + os.sep):
        filename = os.path.relpath(filename)
    return f"{filename}:{frame.f_lineno}"


def _registrations(
    modules: list[nn.Module], params: list[ParamPlan]
) -> dict[int, list[Registration]]:
    """Every ``(submodule, name)`` that holds each parameter, so tied parameters stay tied."""
    found: dict[int, list[Registration]] = {id(plan.param): [] for plan in params}
    submodules = dict.fromkeys(m for member in modules for m in member.modules())
    for submodule in submodules:
        for name, param in module_parameters(submodule).items():
            if param is not None and id(param) in found:
                found[id(param)].append(Registration(submodule, name))
    return found


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        namespace = {"forward": _checked_forward(cls.forward)}
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
    module.__class__ = _FSDP_CLASSES[cls]


def _checked_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` that refuses to run without fully_shard's forward pre-hook
    (``model.forward(x)`` instead of ``model(x)``): it would compute with the
    sharded DTensors and fail deep inside an operator, or worse.

    [Note: the checked forward under torch.compile]
    Dynamo never starts a compiled frame at the wrapper nor at the check
    (``never_a_compiled_frame``): a compiled module or block is compiled from
    its own ``forward`` on, as under torch's fully_shard, so each class keeps
    its own cache and recompile limit, and no graph break is added. A
    compiled frame that calls the module inlines the wrapper; the hooks ran
    eagerly just before, and the check is skipped: traced, it would guard the
    graph on fsdp2's state and, in a recomputation (activation
    checkpointing), break it (the autograd engine query is not traceable).
    """

    @functools.wraps(forward)
    def checked(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            _check_hooks_ran(self)
        return forward(self, *args, **kwargs)

    return never_a_compiled_frame(checked)  # one code object: every class's wrapper


@functools.partial(never_a_compiled_frame, nor_its_callees=True)
def _check_hooks_ran(module: nn.Module) -> None:
    state = module.__dict__["_fsdp_state"]
    in_forward = state.root_ctx.forward_root is not None or in_backward()  # or recomputing
    if not in_forward or any(
        group.sharded_state is not ShardedState.UNSHARDED for group in state.param_groups
    ):
        raise RuntimeError(
            f"fsdp2: {type(module).__name__}.forward ran without fully_shard's hooks, so its "
            "parameters are still sharded. Call the module, model(...), not "
            "model.forward(...); for another method than forward, use "
            "register_fsdp_forward_method."
        )
