"""``FSDPModule``: the methods ``fully_shard`` adds to a module, and the
module-level functions that act on sharded modules."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .param_group import FSDPParamGroup
from .state import FSDPState


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
