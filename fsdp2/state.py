"""FSDPState: the hooks of one ``fully_shard`` call, and the root's shared context.

Every sharded module gets an ``FSDPState`` holding its param group (if it
owns parameters) and four hooks:

- forward pre-hook: the first state to run forward in an iteration is the
  *forward root*; on the very first forward it becomes the *root* and
  lazily initialises everything below it. Then: unshard, register
  ``PostBackward`` on the inputs, start explicit forward prefetches.
- forward post-hook: reshard (or keep unsharded), register pre-backward
  hooks on the output tensors.
- pre-backward (a tensor hook on each output): queue the final callback once
  per backward, unshard, prefetch the next group of backward.
- final callback (queued on the autograd engine): finish groups whose
  post-backward never ran, wait for the last reduce-scatter, reset.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn as nn

from .collectives import ReduceInFlight, all_reduce, assign_sharded_grads
from .comm import CommContext
from .common import MeshInfo, ShardedState, TrainingState
from .order import ExecutionOrderCheck
from .param_group import FSDPParamGroup
from .policy import MixedPrecisionPolicy
from .private_api import queue_backward_callback, tree_flatten, tree_unflatten

logger = logging.getLogger("fsdp2")


class RootContext:
    """What every state and group under one root shares. Each state starts with
    a context of its own; the root's replaces them at lazy init."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.comm = CommContext(device)
        self.states: list[FSDPState] = []  # pre-order from the root
        self.post_forward_order: list[FSDPParamGroup] = []  # this iteration's, for prefetch
        # Implicit forward prefetch: groups in the order their forward started,
        # this iteration's, and the successor of each in the previous iteration's.
        self.pre_forward_order: list[FSDPParamGroup] = []
        self.next_in_forward: dict[FSDPParamGroup, FSDPParamGroup] = {}
        self.forward_started: set[FSDPParamGroup] = set()
        # Gradient reduction, at most one group per stage in flight (see finish_reduce_scatter).
        self.reduce_scatter_in_flight: tuple[FSDPParamGroup, ReduceInFlight] | None = None
        self.all_reduce_in_flight: ReduceInFlight | None = None
        self.forward_root: FSDPState | None = None  # the state whose forward is running outermost
        self.final_callback_queued = False
        # False: the end of this backward leaves its last reduce-scatter in flight
        # (set_is_last_backward, for micro-batch and pipeline schedules).
        self.is_last_backward = True
        self.check_execution_order = False  # or TORCH_DISTRIBUTED_DEBUG=DETAIL at lazy init
        self.order_check: ExecutionOrderCheck | None = None  # made at lazy init when asked for

    @property
    def groups(self) -> list[FSDPParamGroup]:
        return [s.param_group for s in self.states if s.param_group is not None]

    def enable_order_check(self, enabled: bool) -> None:
        self.check_execution_order = enabled
        if not self.states:
            return  # lazy init makes it
        self.order_check = ExecutionOrderCheck(self.groups, self.device) if enabled else None

    def reset(self) -> None:
        """Returns everything under the root to a clean, idle, sharded state after
        an exception interrupted forward or backward."""
        for group in self.groups:
            group.reset()
        in_flight = [self.all_reduce_in_flight]
        if self.reduce_scatter_in_flight is not None:
            in_flight.append(self.reduce_scatter_in_flight[1])
        for reduced in in_flight:
            if reduced is not None:
                try:
                    reduced.wait()
                except RuntimeError:
                    logger.warning("fsdp2: dropping a failed gradient reduction while resetting")
        self.reduce_scatter_in_flight = None
        self.all_reduce_in_flight = None
        self.forward_root = None
        self.post_forward_order.clear()
        self.pre_forward_order.clear()
        self.forward_started.clear()
        self.final_callback_queued = False
        if self.order_check is not None:
            self.order_check.discard_iteration()

    def finish_reduce_scatter(self) -> None:
        """Waits for the reduce-scatter in flight, then assigns its gradients, or
        (HSDP) starts their all-reduce across replicas, or keeps them for a later
        one (``set_requires_all_reduce(False)``).

        One reduction per stage is in flight: a group's reduce-scatter overlaps the
        next group's backward, its all-reduce the one after.
        """
        if self.reduce_scatter_in_flight is None:
            return
        group, reduced = self.reduce_scatter_in_flight
        self.reduce_scatter_in_flight = None
        reduced.wait()
        replicate_group = group.mesh_info.replicate_group
        if replicate_group is None:
            assign_sharded_grads(reduced)
        elif not group.requires_all_reduce:
            group.keep_partial_grads(reduced)
        else:
            group.add_partial_grads(reduced)
            self.finish_all_reduce()
            if (check := self.order_check) is not None:
                numel = reduced.output.numel()
                check.before_collective("all-reduce", group, replicate_group, numel)
                check.record("all-reduce", group, in_training=True)
            self.all_reduce_in_flight = all_reduce(reduced, replicate_group, self.comm, group.name)

    def finish_all_reduce(self) -> None:
        if self.all_reduce_in_flight is not None:
            self.all_reduce_in_flight.wait()
            assign_sharded_grads(self.all_reduce_in_flight)
            self.all_reduce_in_flight = None

    def start_forward(self) -> None:
        """A new iteration's forward begins (the outermost forward pre-hook).

        [Note: forward prefetch]
        Forward runs the groups in the same order every iteration unless the
        model branches on data, so the group that followed G last time is
        all-gathered as soon as G's forward starts, overlapping its compute. A
        wrong guess costs one all-gather, drained at the end of forward.
        """
        order = self.pre_forward_order
        if order:
            self.next_in_forward = dict(zip(order, order[1:], strict=False))
            self.pre_forward_order = []
        self.forward_started.clear()

    def queue_final_callback(self) -> None:
        """Once per backward: run :meth:`_final_callback` when the engine is done."""
        if not self.final_callback_queued:
            self.final_callback_queued = True
            queue_backward_callback(self._final_callback)

    def _final_callback(self) -> None:
        logger.debug("final callback: finishing backward")
        with torch.profiler.record_function("fsdp2::final_callback"):
            # Reverse pre-order approximates backward order for the stragglers.
            for state in reversed(self.states):
                group = state.param_group
                if group is None:
                    continue
                if group.needs_post_backward:
                    group.post_backward()
                group.cancel_unshard()
            if self.is_last_backward:
                self.finish_reduce_scatter()
                self.finish_all_reduce()
            for state in self.states:
                if state.param_group is not None:
                    state.param_group.finalize_backward()
            self.post_forward_order.clear()
            if self.order_check is not None:
                self.order_check.end_iteration()
            self.final_callback_queued = False
            if self.comm.stats is not None:
                self.comm.stats.end_step()


def get_fsdp_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get("_fsdp_state")


class FSDPState:
    def __init__(
        self,
        module: nn.Module,
        mesh_info: MeshInfo,
        device: torch.device,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.module = module
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        # None: resharding after forward is decided at lazy init (off for the root).
        self.reshard_after_forward_arg = reshard_after_forward
        self.ctx = RootContext(device)
        self.param_group: FSDPParamGroup | None = None
        self.is_root: bool | None = None  # decided at lazy init
        # The state of the closest enclosing fully_shard call, once there is one.
        self.parent: FSDPState | None = None
        # None: prefetch implicitly, the group that ran next in the previous forward.
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] = []
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    # -- lazy init --------------------------------------------------------

    def lazy_init(self) -> None:
        """Makes this state the root of every state below it (first forward only)."""
        if self.is_root is not None:
            return
        if self.parent is not None:
            raise RuntimeError(
                f"fsdp2: the forward of a sharded {type(self.module).__name__} ran before the "
                f"forward of {type(self.parent.module).__name__}, the sharded module that "
                "contains it. Call the outermost sharded module as model(...) for the first "
                "forward, not model.forward(...) (that skips its hooks) and not a submodule."
            )
        self.is_root = True
        ctx = self.ctx
        for name, module in self.module.named_modules():
            state = get_fsdp_state(module)
            if state is None:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"fully_shard: {name!r} already ran forward as its own root before "
                        f"{type(self.module).__name__} did. Run the first forward through the "
                        "outermost sharded module (the root), not a submodule."
                    )
                state.is_root = False
            if state is not self:
                _check_root_only_settings(state, name)
            ctx.states.append(state)
            state.ctx = ctx
            group = state.param_group
            if group is None:
                continue
            group.ctx = ctx
            group.fqn = name
            group.name = name or "(root)"
            for fsdp_param in group.fsdp_params:
                fsdp_param.fqn = f"{name}.{fsdp_param.fqn}" if name else fsdp_param.fqn
        if self.param_group is not None and self.reshard_after_forward_arg is None:
            # The root's parameters are needed again first thing in backward.
            self.param_group.reshard_after_forward = False
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        ctx.enable_order_check(ctx.check_execution_order or detail)
        logger.debug(
            "lazy init: root %s with %d groups", type(self.module).__name__, len(ctx.groups)
        )

    # -- forward ----------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        if self.ctx.forward_root is None:
            self.ctx.forward_root = self
            if not self.ctx.final_callback_queued:  # not a recomputation inside backward
                self.ctx.start_forward()
            if self.device.type != "cpu":
                args, kwargs = _map_tensors(
                    (args, kwargs), lambda t: t.to(self.device, non_blocking=True)
                )
        if (dtype := self.mp_policy.param_dtype) is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _map_tensors((args, kwargs), _float_caster(dtype))
        group = self.param_group
        if group is None:
            return args, kwargs
        if group.training_state is TrainingState.PRE_BACKWARD:
            return group.pre_forward(args, kwargs)  # recomputation inside backward
        args, kwargs = group.pre_forward(args, kwargs)
        self.ctx.pre_forward_order.append(group)
        self.ctx.forward_started.add(group)
        if self.forward_prefetch is None:
            # Implicit: the group that ran next last iteration (see [Note: forward prefetch]),
            # unless it already ran in this forward (the order changed).
            target = self.ctx.next_in_forward.get(group)
            if target is not None and target not in self.ctx.forward_started:
                target.unshard()
        else:
            for state in self.forward_prefetch:
                if state.param_group is not None:
                    state.param_group.unshard()
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        group = self.param_group
        in_backward = group is not None and group.training_state is TrainingState.PRE_BACKWARD
        if group is not None:
            group.post_forward()
        if torch.is_grad_enabled() and not in_backward:
            _register_tensor_hooks(output, self._pre_backward)
        if self.ctx.forward_root is self:
            self.ctx.forward_root = None
            # A forward prefetch whose module did not run this time must not be
            # used later: the optimizer may change the shards in between.
            for other in self.ctx.groups:
                if other.sharded_state is not ShardedState.UNSHARDED:
                    other.cancel_unshard()
        if (dtype := self.mp_policy.output_dtype) is not None:
            output = _map_tensors(output, _float_caster(dtype))
        return output

    # -- backward ---------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.ctx.queue_final_callback()
        group = self.param_group
        if group is None:
            return
        explicit = bool(self.backward_prefetch)
        if group.pre_backward(prefetch_previous=not explicit) and explicit:
            for target in self.backward_prefetch:
                if target.param_group is not None:
                    target.param_group.unshard()


def _register_tensor_hooks(output: Any, hook) -> None:
    leaves, _ = tree_flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(hook)


def _check_root_only_settings(state: FSDPState, name: str) -> None:
    """Settings made on a submodule's own context before the root was known
    would be silently dropped when the root's context replaces it."""
    ctx = state.ctx
    made = [
        what
        for what, is_set in (
            ("comm_stats", ctx.comm.stats is not None),
            ("set_check_execution_order", ctx.check_execution_order),
            ("set_is_last_backward", not ctx.is_last_backward),
        )
        if is_set
    ]
    if made:
        raise RuntimeError(
            f"fsdp2: {', '.join(made)} was applied to {name!r}, which is not the root: it applies "
            "to the whole model. Use it on the outermost sharded module (the one whose forward "
            "you call)."
        )


def _map_tensors(tree: Any, fn) -> Any:
    leaves, spec = tree_flatten(tree)
    leaves = [fn(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return tree_unflatten(leaves, spec)


def _float_caster(dtype: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast
