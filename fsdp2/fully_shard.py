"""``fully_shard`` and the ``FSDPModule`` methods it adds to a module."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .common import MeshInfo, ShardedState, device_from_mesh, post_forward_mesh_info
from .param import FSDPParam, ModuleSlot
from .param_group import FSDPParamGroup
from .policy import MixedPrecisionPolicy, OffloadPolicy
from .private_api import in_backward, mark_composable_api
from .state import FSDPState, get_fsdp_state
from .state_dict import register_state_dict_hooks
from .validate import (
    SHARDED_AS,
    check_all_gather_extension,
    check_mesh_spans_world,
    check_min_numel_to_shard,
    check_module,
    check_params,
    check_policies,
    check_reshard_after_forward,
    resolve_mesh,
    shard_dims,
)

# Generated FSDP<Name> classes, one per original class, so that type checks
# see one class however many modules of that class are sharded.
_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen)
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    min_numel_to_shard: int = 0,
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
            expert weight whose dim 0 is small). Dims other than 0 must split
            evenly over the mesh. (Default: None, every parameter on dim 0)
        min_numel_to_shard: parameters with fewer elements (of their TP-local
            part, for a DTensor) are not sharded but kept whole on every rank
            as ``Replicate()`` DTensors, and their gradients all-reduced: for
            norm weights and biases, whose tiny shards cost padding and
            per-parameter copies for no memory saved. (Default: 0, shard all)

    Parameters that are already DTensors (tensor parallelism, from
    ``parallelize_module`` on ``mesh["tp"]`` of the mesh whose ``mesh["dp"]``
    is passed here) are sharded over ``mesh`` too and become DTensors on the
    joined ``(dp, tp)`` mesh; forward computes with their TP layout.

    Returns:
        The same module, now an ``FSDPModule`` (or the same list of them).
    """
    modules = _module_list(module)
    mesh = resolve_mesh(mesh)
    check_policies(mp_policy, offload_policy)
    mesh_info = MeshInfo.from_mesh(mesh)
    reshard_arg = reshard_after_forward
    reshard_after_forward, post_forward_mesh_info = _resolve_reshard_after_forward(
        reshard_after_forward, mesh_info
    )
    device = device_from_mesh(mesh)
    ignored = set(ignored_params or ())
    named_params = [(fqn, p) for fqn, p in _unowned_params(modules) if p not in ignored]
    _check_no_param_shared_with_nested_group(modules)
    check_params(named_params, mesh, device, mp_policy)
    dims = shard_dims(named_params, shard_placement_fn, mesh_info.shard_world_size)
    check_min_numel_to_shard(min_numel_to_shard)

    state = FSDPState(modules, mesh_info, device, reshard_after_forward, mp_policy)
    for nested in _nested_states(modules):
        if nested.parent is None:
            nested.parent = state
    extended = [
        check_all_gather_extension(
            fqn, param, dim, reshard_arg if post_forward_mesh_info is not None else None
        )
        for (fqn, param), dim in zip(named_params, dims, strict=True)
    ]
    if named_params:
        slots = _module_slots(modules, named_params)
        fsdp_params = [
            FSDPParam(
                param,
                fqn,
                slots[id(param)],
                mesh_info,
                device,
                mp_policy,
                offload_policy,
                shard_dim=dim,
                # A subclass that all-gathers itself is always sharded.
                replicated=not extends and _local_numel(param) < min_numel_to_shard,
            )
            for (fqn, param), dim, extends in zip(named_params, dims, extended, strict=True)
        ]
        _mark_sharded(modules, named_params)
        state.param_group = FSDPParamGroup(
            fsdp_params,
            modules,
            mesh_info,
            state.ctx,
            reshard_after_forward=reshard_after_forward is not False,
            post_forward_mesh_info=post_forward_mesh_info,
        )
        for member in modules:
            register_state_dict_hooks(member, state.param_group)
    for member in modules:
        member.__dict__["_fsdp_state"] = state
        mark_composable_api(member, "fully_shard")
        _swap_class(member)
    return module  # type: ignore[return-value]


def _state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state of the ``fully_shard`` call that
    took ``module`` (shared by the modules of a list), or None."""
    return get_fsdp_state(module)


fully_shard.state = _state  # type: ignore[attr-defined]


def _resolve_reshard_after_forward(
    value: bool | int | None, mesh_info: MeshInfo
) -> tuple[bool | None, MeshInfo | None]:
    """Maps the argument to (bool or None, the small group's MeshInfo for an int)."""
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


def _module_slots(
    modules: list[nn.Module], named_params: list[tuple[str, nn.Parameter]]
) -> dict[int, list[ModuleSlot]]:
    """Every ``(submodule, name)`` that holds each parameter, so tied parameters stay tied."""
    slots: dict[int, list[ModuleSlot]] = {id(p): [] for _, p in named_params}
    submodules = dict.fromkeys(m for member in modules for m in member.modules())
    for submodule in submodules:
        for name, param in submodule._parameters.items():
            if param is not None and id(param) in slots:
                slots[id(param)].append(ModuleSlot(submodule, name))
    return slots


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
        if state.param_group is None:
            continue
        for fsdp_param in state.param_group.fsdp_params:
            slot = fsdp_param.slots[0]
            owner = fsdp_param.fqn
            if (path := paths.get(id(slot.module))) is not None:
                owner = f"{path}.{slot.name}" if path else slot.name
            owner_of[id(fsdp_param.sharded_param)] = owner
            if (orig := fsdp_param.orig_param_ref()) is not None:
                owner_of[id(orig)] = owner
    for prefix, member in _named_members(modules):
        for module_name, submodule in member.named_modules():
            if id(submodule) in inside_nested:
                continue
            for name, param in submodule._parameters.items():
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
        group = state.param_group
        in_forward = state.ctx.forward_root is not None or in_backward()  # or recomputing
        if not in_forward or (
            group is not None and group.sharded_state is not ShardedState.UNSHARDED
        ):
            raise RuntimeError(
                f"fsdp2: {type(self).__name__}.forward ran without fully_shard's hooks, so its "
                "parameters are still sharded. Call the module, model(...), not "
                "model.forward(...); for another method than forward, use "
                "register_fsdp_forward_method."
            )
        return forward(self, *args, **kwargs)

    return checked


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` makes the
    unsharded parameters usable."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group
        # The all-gather this handle is for; None if there was nothing to start.
        self._all_gather = group._all_gather if group is not None else None

    def wait(self) -> None:
        """Idempotent, and a no-op once the module's forward has used the all-gather."""
        group, self._group = self._group, None
        if (
            group is not None
            and self._all_gather is not None
            and group._all_gather is self._all_gather
        ):
            group.wait_for_unshard()


class FSDPModule:
    """Mixed into every module passed to ``fully_shard``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A new module of a generated ``FSDP<Name>`` class (e.g. ``model[:2]`` of a
        sharded ``nn.Sequential``, which builds ``type(model)(...)``) is a plain
        ``<Name>``: it went through no ``fully_shard`` call, so it has no state."""
        orig_cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
        module = orig_cls.__new__(orig_cls)
        module.__init__(*args, **kwargs)
        return module

    @property
    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters ahead of its forward.

        Args:
            async_op: return a handle whose ``wait()`` finishes the all-gather
                instead of waiting here. (Default: False)
        """
        # No lazy init: called on a block before the first forward, that would
        # make the block a root. The group's own context serves until then.
        group = self._fsdp_state.param_group
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Frees the unsharded parameters, leaving the sharded ones on the module."""
        if (group := self._fsdp_state.param_group) is not None:
            group.reshard()

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Sets whether to free the unsharded parameters after forward.

        Args:
            reshard_after_forward: the new policy.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}; "
                "resharding to a smaller group is chosen in fully_shard(reshard_after_forward=N)."
            )
        for module in self._fsdp_modules(recurse):
            state = module._fsdp_state
            state.reshard_after_forward_arg = reshard_after_forward
            if (group := state.param_group) is not None:
                group.reshard_after_forward = reshard_after_forward
                if not reshard_after_forward:
                    group.post_forward_mesh_info = None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Sets whether to free the unsharded parameters after backward. Off, the
        next forward needs no all-gather (e.g. between micro-batches); call
        ``reshard()`` when done.

        Args:
            reshard_after_backward: the new policy.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        for group in self._param_groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Turns gradient reduction on or off (gradient accumulation).

        Off, backward adds each unsharded gradient to a local sum (in
        ``reduce_dtype``) with no communication; the next backward with sync on
        reduce-scatters the sum. This trades memory (an unsharded gradient per
        parameter kept between micro-batches) for communication (one
        reduce-scatter per step instead of one per micro-batch); leaving sync
        on and accumulating sharded gradients is the other way round.

        Args:
            requires_gradient_sync: whether the next backwards reduce gradients.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        for group in self._param_groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: turns the all-reduce across replicas on or off. Off, gradients are
        still reduce-scattered inside each shard group, and the sums are kept
        (one shard per parameter) until a backward with it on all-reduces them:
        gradient accumulation that communicates only inside the shard group.

        Args:
            requires_all_reduce: whether the next backwards all-reduce.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        for group in self._param_groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. If
        not, its last reduce-scatter is left in flight at the end of backward
        (finished by the next backward's), overlapping the next forward."""
        self._fsdp_state.ctx.is_last_backward = is_last_backward

    def reset_iter_state(self) -> None:
        """Recovers from an exception raised in the middle of forward or backward:
        waits for in-flight collectives, reshards every group under this root,
        discards the interrupted iteration's gradients and returns every state to
        idle, so the next iteration starts clean. Call it on the root, on every
        rank."""
        self._fsdp_state.ctx.reset()

    def set_check_execution_order(self, enabled: bool = True) -> None:
        """Checks on the first iteration that all ranks communicate the same
        groups in the same order, raising on every rank if not; later iterations
        warn once if a rank deviates from its first. Call it on the root, on every
        rank (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns it on too). See
        [Note: why order matters] in order.py."""
        self._fsdp_state.ctx.enable_order_check(enabled)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules`` as soon as this module's forward starts. This
        replaces the default, which prefetches the module whose forward followed
        this one's in the previous iteration; ``[]`` turns forward prefetch off."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "forward") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules`` as soon as this module's backward starts,
        replacing the default (the module that ran just before it in forward)."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "backward") for m in modules]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``model.to(dtype)``, ``model.double()``...: converts the sharded
        parameters (resharding first, so that the modules hold them) and makes the
        group follow their new dtype."""
        group = self._fsdp_state.param_group
        if group is not None:
            group.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if group is not None:
            group.reset_sharded_params()
        return result

    def _param_groups(self, recurse: bool) -> list[FSDPParamGroup]:
        groups = (m._fsdp_state.param_group for m in self._fsdp_modules(recurse))
        return [g for g in groups if g is not None]

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # AssertionError, as torch's fully_shard raises, so code that catches it works.
        raise AssertionError(
            f"FSDP does not support deepcopy of a sharded module ({type(self).__name__}): the "
            "copy would share process groups and hooks with the original. Build a new model "
            "and load model.state_dict() into it instead."
        )


def _state_of(module: Any, direction: str) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise TypeError(
            f"set_modules_to_{direction}_prefetch expects modules passed to fully_shard, got "
            f"{type(module).__name__}."
        )
    return module._fsdp_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` unshard and reshard like ``forward``, for
    methods called instead of forward (e.g. ``generate``). No-op if ``module``
    is not sharded.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)
    state = module._fsdp_state

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward(module, args, output)

    setattr(module, method_name, wrapped)
