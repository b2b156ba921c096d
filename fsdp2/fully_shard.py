"""``fully_shard`` and the ``FSDPModule`` methods it adds to a module."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .common import MeshInfo, device_from_mesh
from .param import FSDPParam, ModuleSlot
from .param_group import FSDPParamGroup
from .state import FSDPState, get_fsdp_state
from .validate import check_module, check_params, check_reshard_after_forward, resolve_mesh

# Generated FSDP<Name> classes, one per original class, so that type checks
# see one class however many modules of that class are sharded.
_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
) -> FSDPModule:
    """Shards ``module``'s parameters over ``mesh`` and communicates them as one group.

    Call it bottom-up: each call takes the parameters of ``module`` that no
    earlier call on a submodule took. Afterwards every such parameter is an
    ``nn.Parameter`` holding a ``Shard(0)`` DTensor; forward all-gathers the
    group just before ``module`` runs and backward reduce-scatters its
    gradients, averaged over ranks as DDP does.

    Args:
        module: the module whose parameters form one group. Its class is
            swapped in place to ``FSDP<Name>``, a subclass of ``FSDPModule``
            and the original class, and the same object is returned.
        mesh: a 1D DeviceMesh to shard over. (Default: a mesh over the whole
            world on the current accelerator, or CPU)
        reshard_after_forward: free the unsharded parameters after forward and
            all-gather them again in backward (True), or keep them until
            backward ends (False). (Default: None, which is True for every
            group but the root's)

    Returns:
        The same module, now an ``FSDPModule``.
    """
    check_module(module)
    mesh = resolve_mesh(mesh)
    check_reshard_after_forward(reshard_after_forward)
    device = device_from_mesh(mesh)
    mesh_info = MeshInfo.from_mesh(mesh)

    named_params = _unowned_params(module)
    check_params(named_params, device)
    _check_no_param_shared_with_nested_group(module)
    state = FSDPState(module, mesh_info, device, reshard_after_forward)
    if named_params:
        slots = _module_slots(module, named_params)
        fsdp_params = [
            FSDPParam(param, fqn, slots[id(param)], mesh_info, device)
            for fqn, param in named_params
        ]
        state.param_group = FSDPParamGroup(
            fsdp_params,
            module,
            mesh_info,
            state.ctx,
            reshard_after_forward=reshard_after_forward is not False,
        )
    module.__dict__["_fsdp_state"] = state
    _swap_class(module)
    return module  # type: ignore[return-value]


def _nested_states(module: nn.Module) -> list[FSDPState]:
    return [
        state
        for submodule in module.modules()
        if submodule is not module and (state := get_fsdp_state(submodule)) is not None
    ]


def _unowned_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters of ``module`` that no nested ``fully_shard`` call took, with their names."""
    owned = {
        id(fsdp_param.sharded_param)
        for state in _nested_states(module)
        if state.param_group is not None
        for fsdp_param in state.param_group.fsdp_params
    }
    return [(fqn, p) for fqn, p in module.named_parameters() if id(p) not in owned]


def _module_slots(
    module: nn.Module, named_params: list[tuple[str, nn.Parameter]]
) -> dict[int, list[ModuleSlot]]:
    """Every ``(submodule, name)`` that holds each parameter, so tied parameters stay tied."""
    slots: dict[int, list[ModuleSlot]] = {id(p): [] for _, p in named_params}
    for submodule in module.modules():
        for name, param in submodule._parameters.items():
            if param is not None and id(param) in slots:
                slots[id(param)].append(ModuleSlot(submodule, name))
    return slots


def _check_no_param_shared_with_nested_group(module: nn.Module) -> None:
    """A parameter owned by a nested group must not also be registered outside it:
    that module would compute with the sharded DTensor (tied after sharding) or
    shard a second copy (tied before sharding, so it still holds the original)."""
    nested = _nested_states(module)
    inside_nested = {id(m) for state in nested for m in state.module.modules()}
    paths = {id(m): name for name, m in module.named_modules()}
    owner_of = {}
    for state in nested:
        if state.param_group is None:
            continue
        for fsdp_param in state.param_group.fsdp_params:
            owner = f"{paths[id(state.module)]}.{fsdp_param.fqn}"
            owner_of[id(fsdp_param.sharded_param)] = owner
            if (orig := fsdp_param.orig_param_ref()) is not None:
                owner_of[id(orig)] = owner
    for module_name, submodule in module.named_modules():
        if id(submodule) in inside_nested:
            continue
        for name, param in submodule._parameters.items():
            if param is not None and id(param) in owner_of:
                where = f"{module_name}.{name}" if module_name else name
                raise ValueError(
                    f"fully_shard: parameter {where!r} is the same Parameter as "
                    f"{owner_of[id(param)]!r}, which an earlier fully_shard call on a submodule "
                    "already sharded. A parameter shared by two groups is not supported: "
                    "untie them, or shard the modules that share it in one call (the common "
                    "parent)."
                )


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _FSDP_CLASSES[cls]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` makes the
    unsharded parameters usable."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into every module passed to ``fully_shard``."""

    @property
    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters ahead of its forward.

        Args:
            async_op: return a handle whose ``wait()`` finishes the all-gather
                instead of waiting here. (Default: False)
        """
        state = self._fsdp_state
        state.lazy_init()
        group = state.param_group
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
        check_reshard_after_forward(reshard_after_forward)
        for module in self._fsdp_modules(recurse):
            state = module._fsdp_state
            state.reshard_after_forward_arg = reshard_after_forward
            if state.param_group is not None:
                state.param_group.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules`` as soon as this module's forward starts, instead
        of when each one's own forward starts."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "forward") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules`` as soon as this module's backward starts,
        replacing the default (the module that ran just before it in forward)."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "backward") for m in modules]

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise RuntimeError(
            f"copy.deepcopy of a sharded module ({type(self).__name__}) is not supported: the "
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
