"""``FSDPModule``: the methods ``fully_shard`` adds to a module, and the
module-level functions that act on sharded modules."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..base.policy import check_bool, check_bools
from ..engine.param_group import FSDPParamGroup
from .reduction_setters import ReductionSetters
from .state import FSDPState
from .torch_internals import ModuleReadByTorch


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` makes the
    unsharded parameters usable."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        # Which all-gather each group had in flight when the handle was made, by
        # number: the handle must not keep the buffer alive after forward used it.
        self._all_gathers = [
            (group, group.all_gathers_started) for group in groups if group.all_gather_in_flight
        ]

    def wait(self) -> None:
        """Idempotent, and a no-op once the module's forward has used the all-gathers."""
        all_gathers, self._all_gathers = self._all_gathers, []
        for group, number in all_gathers:
            if group.all_gather_in_flight and group.all_gathers_started == number:
                group.wait_for_unshard()


class FSDPModule(ModuleReadByTorch, ReductionSetters):
    """Mixed into every module passed to ``fully_shard``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A new module of a generated ``FSDP<Name>`` class (e.g. ``model[:2]`` of a
        sharded ``nn.Sequential``, which builds ``type(model)(...)``) is a plain
        ``<Name>``: it went through no ``fully_shard`` call, so it has no state."""
        orig_cls = original_class(cls)
        module = orig_cls.__new__(orig_cls)
        orig_cls.__init__(module, *args, **kwargs)
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
        async_op = check_bool("unshard", "async_op", async_op)
        # No lazy init: called on a block before the first forward, that would
        # make the block a root. The group's own context serves until then.
        groups = self._fsdp_state.param_groups
        for group in groups:
            group.unshard()
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Frees the unsharded parameters, leaving the sharded ones on the module."""
        for group in self._fsdp_state.param_groups:
            group.reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Sets whether to free the unsharded parameters after forward.

        Args:
            reshard_after_forward: the new policy.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        check_bool(
            "set_reshard_after_forward",
            "reshard_after_forward",
            reshard_after_forward,
            hint=" Resharding to a smaller group is chosen in fully_shard(reshard_after_forward=N).",
            strict=True,  # as torch's
        )
        recurse = check_bool("set_reshard_after_forward", "recurse", recurse)
        for module in self._fsdp_modules(recurse):
            state = module._fsdp_state
            state.reshard_after_forward_arg = reshard_after_forward
            for group in state.param_groups:
                group.choose_reshard_after_forward(reshard_after_forward)

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
        reshard_after_backward, recurse = check_bools(
            "set_reshard_after_backward",
            reshard_after_backward=reshard_after_backward,
            recurse=recurse,
        )
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
        requires_gradient_sync, recurse = check_bools(
            "set_requires_gradient_sync",
            requires_gradient_sync=requires_gradient_sync,
            recurse=recurse,
        )
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
        requires_all_reduce, recurse = check_bools(
            "set_requires_all_reduce", requires_all_reduce=requires_all_reduce, recurse=recurse
        )
        for group in self._param_groups(recurse):
            group.configure(requires_all_reduce=requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. If
        not, its last reduce-scatter is left in flight at the end of backward
        (finished by the next backward's), overlapping the next forward."""
        is_last_backward = check_bool("set_is_last_backward", "is_last_backward", is_last_backward)
        self._fsdp_state.root_ctx.reductions.is_last_backward = is_last_backward

    def reset_iter_state(self) -> None:
        """Recovers from an exception raised in the middle of forward or backward:
        waits for in-flight collectives, reshards every group under this root,
        discards the interrupted iteration's gradients and returns every state to
        idle, so the next iteration starts clean. Call it on the root, on every
        rank."""
        self._fsdp_state.root_ctx.reset()

    def set_check_execution_order(self, enabled: bool = True) -> None:
        """Checks on the first iteration that all ranks communicate the same
        groups in the same order, raising on every rank if not; later iterations
        warn once if a rank deviates from its first. Call it on the root, on every
        rank (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns it on too). See
        [Note: why order matters] in execution_order.py."""
        enabled = check_bool("set_check_execution_order", "enabled", enabled)
        self._fsdp_state.root_ctx.enable_order_check(enabled)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules`` as soon as this module's forward starts. This
        replaces the default, which prefetches the module whose forward followed
        this one's in the previous iteration; ``[]`` turns forward prefetch off."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "forward") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gathers ``modules`` as soon as this module's backward starts,
        replacing the default (the module that ran just before it in forward)."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "backward") for m in modules]

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """Accelerators: makes the current stream wait for ``event`` (recorded
        after an optimizer step on another stream) before the next forward's
        first copy-in reads the shards; it applies to the whole model. Call it
        on the root with a new event every iteration. The gradients that step
        read must stay referenced until then (e.g. ``zero_grad()`` after the
        next forward), or their memory may be reused while it runs."""
        comm = self._fsdp_state.root_ctx.comm
        if event is None:  # no event to wait for (torch's meaning)
            comm.post_optim_event = None
            return
        if not comm.uses_streams:
            raise ValueError(
                "set_post_optim_event needs an accelerator (events and streams); on CPU the "
                "all-gathers run after the optimizer step in program order."
            )
        comm.post_optim_event = event

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``model.to(dtype)``, ``model.double()``...: converts the sharded
        parameters (resharding first, so that the modules hold them) and makes the
        group follow their new dtype."""
        groups = self._fsdp_state.param_groups
        for group in groups:
            group.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in groups:
            group.reset_sharded_params()
        return result

    def _param_groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [g for m in self._fsdp_modules(recurse) for g in m._fsdp_state.param_groups]

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


def original_class(cls: type) -> Any:
    """The user's class behind a generated ``FSDP<Name>`` class (or a subclass
    of one): the first ``nn.Module`` class in its MRO that is not fsdp2's."""
    return next(
        c for c in cls.__mro__[1:] if issubclass(c, nn.Module) and not issubclass(c, FSDPModule)
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


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Makes several roots (e.g. the model chunks of pipeline stages) use one
    set of communication streams and one reduce-scatter queue instead of one
    each: the memory of their collectives stays in one place on accelerators,
    and ``set_reduce_scatter_max_input_buffers``' bound holds for them all
    together (each root's own bound decides when it makes room)."""
    if not modules:
        return
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"share_comm_ctx expects modules passed to fully_shard, got {type(module).__name__}."
            )
    shared = modules[0]._fsdp_state.root_ctx
    for module in modules[1:]:
        root_ctx = module._fsdp_state.root_ctx
        root_ctx.comm = shared.comm
        root_ctx.reductions.reduce_scatters = shared.reductions.reduce_scatters
