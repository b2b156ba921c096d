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

A ``fully_shard([a, b])`` state puts the same hooks on each of its modules;
see [Note: one group, several modules].
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .collectives import ReduceInFlight, all_reduce, assign_sharded_grads, average
from .comm import CommContext
from .common import MeshInfo, ShardedState, eager_hook
from .order import ExecutionOrderCheck
from .param_group import FSDPParamGroup
from .policy import MixedPrecisionPolicy
from .private_api import (
    in_backward,
    local_tensor,
    map_tensors,
    profiled,
    queue_backward_callback,
    tensors_in,
)

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
        # The implicit forward prefetch in flight: dropped if another group starts first.
        self.forward_guess: FSDPParamGroup | None = None
        # Gradient reduction in flight, oldest first (see make_room_for_reduce_scatter):
        # up to reduce_scatter_max_input_buffers reduce-scatters (the queue shared by
        # the roots of share_comm_ctx), and all-reduces across replicas (HSDP): one
        # on CPU, every group's on accelerators (waited for at the end of backward).
        self.reduce_scatters_in_flight: deque[tuple[FSDPParamGroup, ReduceInFlight]] = deque()
        self.all_reduces_in_flight: deque[tuple[FSDPParamGroup, ReduceInFlight]] = deque()
        # Reductions whose all-reduce hook runs on a stream of its own: assigned
        # once the current stream has waited for the event after the hook.
        self.hooks_in_flight: deque[tuple[ReduceInFlight, torch.Event]] = deque()
        # The largest of the groups' set_reduce_scatter_max_input_buffers (at lazy init).
        self.reduce_scatter_max_input_buffers = 1
        self.forward_root: FSDPState | None = None  # the state whose forward is running outermost
        self.final_callback_queued = False
        # False: the end of this backward leaves its last reduce-scatter in flight
        # (set_is_last_backward, for micro-batch and pipeline schedules).
        self.is_last_backward = True
        self.check_execution_order = False  # or TORCH_DISTRIBUTED_DEBUG=DETAIL at lazy init
        self.order_check: ExecutionOrderCheck | None = None  # made at lazy init when asked for

    @property
    def groups(self) -> list[FSDPParamGroup]:
        return [g for s in self.states for g in s.param_groups]

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
        # The queue may be shared with other roots (share_comm_ctx): only this
        # root's reductions are dropped.
        queue = self.reduce_scatters_in_flight
        in_flight = [(g, r) for g, r in queue if g.ctx is self]
        others = [(g, r) for g, r in queue if g.ctx is not self]
        in_flight += self.all_reduces_in_flight
        for _, reduced in in_flight:
            try:
                reduced.wait()
            except RuntimeError:
                logger.warning("fsdp2: dropping a failed gradient reduction while resetting")
        queue.clear()
        queue.extend(others)
        self.all_reduces_in_flight.clear()
        for _, event in self.hooks_in_flight:
            self.comm.wait_event(event)  # a stream wait, then the buffers can go
        self.hooks_in_flight.clear()
        self.comm.wait_grads_on_host(discard=True)  # this iteration's grads are dropped
        self.comm.release_copied_out()
        for state in self.states:
            state.modules_to_run.clear()
        self.forward_root = None
        self.post_forward_order.clear()
        self.pre_forward_order.clear()
        self.forward_started.clear()
        self.forward_guess = None
        self.final_callback_queued = False
        self.comm.shards_may_change()
        if self.order_check is not None:
            self.order_check.discard_iteration()

    @property
    def reduce_scatter_in_flight(self) -> bool:
        return bool(self.reduce_scatters_in_flight)

    def make_room_for_reduce_scatter(self) -> None:
        """Finishes the oldest reduce-scatters in flight until another may start
        (``set_reduce_scatter_max_input_buffers``, 1 by default): each holds an
        input buffer the size of its group's gradients. One in flight already
        overlaps a group's reduction with the next group's backward; more help
        only when the reduce-scatters are slower than the backward."""
        while len(self.reduce_scatters_in_flight) >= self.reduce_scatter_max_input_buffers:
            self._finish_oldest_reduce_scatter()

    def finish_reduce_scatters(self) -> None:
        while self.reduce_scatters_in_flight:
            self._finish_oldest_reduce_scatter()

    def _finish_oldest_reduce_scatter(self) -> None:
        """Waits for the oldest reduce-scatter, then assigns its gradients, or
        (HSDP) starts their all-reduce across replicas, or keeps them for a later
        one (``set_requires_all_reduce(False)``). One all-reduce is in flight:
        starting the next finishes the previous."""
        group, reduced = self.reduce_scatters_in_flight.popleft()
        group.ctx.finish_reduce_scatter(group, reduced)

    def finish_reduce_scatter(self, group: FSDPParamGroup, reduced: ReduceInFlight) -> None:
        """The rest of ``_finish_oldest_reduce_scatter``, by the root of ``group``
        (which, with ``share_comm_ctx``, may not be the root whose queue it was in)."""
        reduced.wait()
        if reduced.all_reduce is not None:  # issued with the reduce-scatter (accelerators)
            self.all_reduces_in_flight.append(
                (group, reduced._replace(buffers=(), in_flight=(reduced.all_reduce,)))
            )
            return
        replicate_group = group.mesh_info.replicate_group
        if replicate_group is None:
            self._assign(group, reduced)
        elif not group.requires_all_reduce:
            group.keep_partial_grads(reduced)
        else:
            group.add_partial_grads(reduced)
            self.finish_all_reduces()
            self._check_all_reduce(group, reduced)
            self.all_reduces_in_flight.append(
                (group, all_reduce(reduced, replicate_group, self.comm, group.name))
            )

    def start_all_reduce_early(
        self, group: FSDPParamGroup, reduced: ReduceInFlight
    ) -> ReduceInFlight:
        """Accelerators, HSDP: issues the all-reduce across replicas right after
        the reduce-scatter, ordered after its event only, so that it overlaps the
        next groups' backward (on CPU, gloo would block the host on the
        reduce-scatter first: it waits until the reduce-scatter is finished).
        Partial sums kept from a backward without all-reduce are added on the
        current stream after the reduce-scatter instead, the CPU way."""
        replicate_group = group.mesh_info.replicate_group
        if (
            not self.comm.uses_streams
            or replicate_group is None
            or not group.requires_all_reduce
            or any(p.partial_grad is not None for p in reduced.fsdp_params)
        ):
            return reduced
        self._check_all_reduce(group, reduced)
        early = all_reduce(reduced, replicate_group, self.comm, group.name, reduced.in_flight)
        return reduced._replace(all_reduce=early.in_flight[0])

    def _check_all_reduce(self, group: FSDPParamGroup, reduced: ReduceInFlight) -> None:
        if (check := self.order_check) is not None and group.mesh_info.replicate_group:
            numel = reduced.output.numel()
            check.before_collective("all-reduce", group, group.mesh_info.replicate_group, numel)
            check.record("all-reduce", group, in_training=True)

    def finish_all_reduces(self) -> None:
        while self.all_reduces_in_flight:
            group, reduced = self.all_reduces_in_flight.popleft()
            reduced.wait()
            self._assign(group, reduced)

    def _assign(self, group: FSDPParamGroup, reduced: ReduceInFlight) -> None:
        """Averages a finished reduction, runs the group's all-reduce hook on it
        (``set_all_reduce_hook``) and accumulates the sharded gradients."""
        with profiled("assign_grads", group.name):
            average(reduced)
            if group.all_reduce_hook is not None:
                hook, stream = group.all_reduce_hook, group.all_reduce_hook_stream
                event = self.comm.run_hook(hook, reduced.output, stream)
                if event is not None:
                    # The hook's stream overlaps the rest of backward: assigned at its end.
                    # The reduce-scatter input is done with: only the output is kept.
                    self.hooks_in_flight.append((reduced._replace(buffers=()), event))
                    return
            self.comm.grads_to_host(assign_sharded_grads(reduced, self.comm.ops))

    def finish_hooks(self) -> None:
        while self.hooks_in_flight:
            reduced, event = self.hooks_in_flight.popleft()
            self.comm.wait_event(event)
            self.comm.grads_to_host(assign_sharded_grads(reduced, self.comm.ops))

    def start_forward(self) -> None:
        """A new iteration's forward begins (the outermost forward pre-hook).

        [Note: forward prefetch]
        Forward runs the groups in the same order every iteration unless the
        model branches on data, so the group that followed G last time is
        all-gathered as soon as G's forward starts, overlapping its compute. A
        wrong guess costs one all-gather, dropped when the next guess is made
        (``guess_next``): one guess is alive at a time. (Dropping it as soon as
        another group starts would all-gather it again if it runs later, and
        on one rank only when the ranks' orders differ.)
        """
        order = self.pre_forward_order
        if order:
            self.next_in_forward = dict(zip(order, order[1:], strict=False))
            self.pre_forward_order = []
        self.forward_started.clear()
        self.forward_guess = None

    def guess_next(self, target: FSDPParamGroup) -> None:
        """Implicit forward prefetch of ``target``. The previous guess, if its
        forward has not started, was wrong: its all-gather output is freed
        first, so one guess at most is alive next to the running group."""
        guess, self.forward_guess = self.forward_guess, target
        if guess is not None and guess is not target and guess not in self.forward_started:
            guess.cancel_unshard()
        target.unshard()

    def finish_partial_forwards(self, forward_root: FSDPState) -> None:
        """End of the outermost forward: a group of several modules of which only
        some ran ends its forward now (see [Note: one group, several modules])."""
        for state in reversed(self.states):  # innermost first, as post-hooks unwind
            if state is not forward_root and state.modules_to_run:
                state.modules_to_run.clear()
                for group in state.param_groups:
                    group.post_forward()

    def queue_final_callback(self) -> None:
        """Once per backward: run :meth:`_final_callback` when the engine is done."""
        if not self.final_callback_queued:
            self.final_callback_queued = True
            queue_backward_callback(self._final_callback)

    @eager_hook
    def _final_callback(self) -> None:
        logger.debug("final callback: finishing backward")
        with profiled("final_callback"):
            # Reverse pre-order approximates backward order for the stragglers.
            for state in reversed(self.states):
                # Empty unless a forward was left open: the outermost forward closes them.
                state.modules_to_run.clear()
                for group in reversed(state.param_groups):
                    if group.needs_post_backward:
                        group.post_backward()
                    elif group.reshard_after_backward:
                        # Unsharded again after its post-backward, for a recomputation.
                        group.reshard()
                    group.cancel_unshard()
            if self.is_last_backward:
                self.finish_reduce_scatters()
                self.finish_all_reduces()
                self.finish_hooks()
            # CPU offload: one host sync per backward, for every grad copied to the host.
            self.comm.wait_grads_on_host()
            # The last all-gather buffers go now, not at the next forward's copy-in.
            self.comm.release_copied_out()
            for group in self.groups:
                group.finalize_backward()
            self.post_forward_order.clear()
            if self.order_check is not None:
                self.order_check.end_iteration()
            self.final_callback_queued = False
            self.comm.shards_may_change()
            if self.comm.stats is not None:
                self.comm.stats.end_step()


def _profiled(name: str) -> Callable[[Callable], Callable]:
    """Runs a hook inside a profiler range (``fsdp2::pre_forward`` ...) while a
    profiler runs, so that profiles show the hooks' own time."""

    def decorate(hook: Callable) -> Callable:
        @functools.wraps(hook)
        def in_range(*args: Any, **kwargs: Any) -> Any:
            with profiled(name):
                return hook(*args, **kwargs)

        return in_range

    return decorate


def get_fsdp_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get("_fsdp_state")


class FSDPState:
    """The hooks of one ``fully_shard`` call, on each of its modules.

    [Note: one group, several modules]
    ``fully_shard([norm, output])`` makes one state and one group for several
    modules that the model may call separately, and hooks each of them. The
    group's forward starts with whichever of them runs first (all-gather,
    prefetch) and ends when all of them have run (reshard): ``modules_to_run``
    holds the ones still to come. If only some run, the group's forward ends at
    the end of the outermost forward instead (``finish_partial_forwards``).
    Every module call wraps its inputs in ``PostBackward`` and hooks its
    outputs for pre-backward, so backward unshards at whichever module's
    gradient arrives first, and post-backward runs once every module's
    ``PostBackward`` has (see ``PostBackwardCount`` in param_group.py). A
    single module is the case of one.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        mesh_info: MeshInfo,
        device: torch.device,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = tuple(modules)
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        # None: resharding after forward is decided at lazy init (off for the root).
        self.reshard_after_forward_arg = reshard_after_forward
        self.ctx = RootContext(device)
        # One per mesh the call's parameters are sharded over (usually one;
        # shard_placement_fn may put some on another, e.g. MoE experts); none if
        # the modules have no parameters of their own.
        self.param_groups: list[FSDPParamGroup] = []
        self.is_root: bool | None = None  # decided at lazy init
        # The state of the closest enclosing fully_shard call, once there is one.
        self.parent: FSDPState | None = None
        # None: prefetch implicitly, the group that ran next in the previous forward.
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] = []
        # The modules whose forward is still to come in the group's current forward.
        self.modules_to_run: set[nn.Module] = set()
        for module in self.modules:
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=False)

    @property
    def module_names(self) -> str:
        """For messages: the class names of the modules."""
        return ", ".join(type(m).__name__ for m in self.modules)

    # -- lazy init --------------------------------------------------------

    def lazy_init(self) -> None:
        """Makes this state the root of every state below it (first forward only)."""
        if self.is_root is not None:
            return
        if self.parent is not None:
            raise RuntimeError(
                f"fsdp2: the forward of a sharded {self.module_names} ran before the "
                f"forward of {self.parent.module_names}, the sharded module that "
                "contains it. Call the outermost sharded module as model(...) for the first "
                "forward, not model.forward(...) (that skips its hooks) and not a submodule."
            )
        if len(self.modules) > 1:
            raise RuntimeError(
                f"fsdp2: the modules sharded together by fully_shard([...]) ({self.module_names}) "
                "ran forward without a sharded module containing them, but a model needs one "
                "root. Also call fully_shard on the module that contains them all (e.g. "
                "fully_shard(model) last), and call that module."
            )
        self.is_root = True
        ctx = self.ctx
        root_module = self.modules[0]
        paths: dict[FSDPState, list[str]] = {}  # module paths of each state, in pre-order
        for name, module in root_module.named_modules():
            state = get_fsdp_state(module)
            if state is None:
                continue
            if state in paths:  # a further module of a fully_shard([...]) group
                paths[state].append(name)
                continue
            paths[state] = [name]
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"fully_shard: {name!r} already ran forward as its own root before "
                        f"{self.module_names} did. Run the first forward through the "
                        "outermost sharded module (the root), not a submodule."
                    )
                state.is_root = False
            if state is not self:
                _check_root_only_settings(state, name)
            ctx.states.append(state)
            if state.ctx.comm is not ctx.comm:
                state.ctx.comm.release_copied_out()  # e.g. unshard() before this forward
            state.ctx = ctx
            for group in state.param_groups:
                group.ctx = ctx
        module_paths = {id(m): name for name, m in root_module.named_modules()}
        for state, names in paths.items():
            for i, group in enumerate(state.param_groups):
                _name_from_root(group, names, module_paths, i)
        for group in ctx.groups:
            # Parameters assigned since fully_shard (a loader filling a meta model);
            # a group unsharded before the first forward holds its unsharded ones.
            if group.sharded_state is ShardedState.SHARDED:
                group.reset_sharded_params()
        _check_materialized(ctx.groups)
        if self.reshard_after_forward_arg is None:
            # The root's parameters are needed again first thing in backward.
            for group in self.param_groups:
                group.reshard_after_forward = False
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        ctx.enable_order_check(ctx.check_execution_order or detail)
        ctx.reduce_scatter_max_input_buffers = max(
            (g.reduce_scatter_max_input_buffers for g in ctx.groups), default=1
        )
        logger.debug("lazy init: root %s with %d groups", self.module_names, len(ctx.groups))

    # -- forward ----------------------------------------------------------

    @eager_hook
    @_profiled("pre_forward")
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        if in_backward():
            # A forward recomputed inside backward (activation checkpointing): only
            # the parameters and the input casts of forward are needed. (Recomputation
            # may stop early, without the post-hook: nothing here must need it.)
            for group in self.param_groups:
                group.unshard_for_recomputation()
            return self._cast_inputs(args, kwargs)
        if self.ctx.forward_root is None:
            self.ctx.forward_root = self
            self.ctx.start_forward()
            if self.device.type != "cpu":
                # Blocking, as DDP: the caller may refill a pinned staging buffer next.
                args, kwargs = map_tensors((args, kwargs), lambda t: t.to(self.device))
        args, kwargs = self._cast_inputs(args, kwargs)
        if not self.param_groups:
            return args, kwargs
        for group in self.param_groups:  # all-gathers started together, then waited
            group.unshard()
        for group in self.param_groups:
            args, kwargs = group.pre_forward(args, kwargs)
        if self.modules_to_run:
            return args, kwargs  # a further module of the group's forward in progress
        self.modules_to_run.update(self.modules)
        self.ctx.pre_forward_order += self.param_groups
        self.ctx.forward_started.update(self.param_groups)
        if self.forward_prefetch is None:
            # Implicit: the group that ran next last iteration (see [Note: forward prefetch]),
            # unless it already ran in this forward (the order changed).
            target = self.ctx.next_in_forward.get(self.param_groups[-1])
            if target is not None and target not in self.ctx.forward_started:
                self.ctx.guess_next(target)
        else:
            for state in self.forward_prefetch:
                for target in state.param_groups:
                    target.unshard()
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if (dtype := self.mp_policy.param_dtype) is not None and self.mp_policy.cast_forward_inputs:
            return map_tensors((args, kwargs), _float_caster(dtype))
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if (dtype := self.mp_policy.output_dtype) is not None:
            return map_tensors(output, _float_caster(dtype))
        return output

    @eager_hook
    @_profiled("post_forward")
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():  # recomputation: the group reshards after its backward
            return self._cast_output(output)
        is_forward_root = self.ctx.forward_root is self
        if is_forward_root:
            self.ctx.finish_partial_forwards(self)
        if self.param_groups:
            self.modules_to_run.discard(module)
            if is_forward_root:
                self.modules_to_run.clear()  # its other modules did not run
            if not self.modules_to_run:
                for group in self.param_groups:
                    group.post_forward()
        if torch.is_grad_enabled():
            _register_tensor_hooks(output, self._pre_backward)
        if is_forward_root:
            self.ctx.forward_root = None
            self.ctx.comm.shards_may_change()
            # A forward prefetch whose module did not run this time must not be
            # used later: the optimizer may change the shards in between.
            for other in self.ctx.groups:
                if other.sharded_state is not ShardedState.UNSHARDED:
                    other.cancel_unshard()
        return self._cast_output(output)

    # -- backward ---------------------------------------------------------

    @eager_hook
    @_profiled("pre_backward")
    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.ctx.queue_final_callback()
        explicit = bool(self.backward_prefetch)
        started = [
            group.pre_backward(prefetch_previous=not explicit) for group in self.param_groups
        ]
        if any(started) and explicit:
            for target in self.backward_prefetch:
                for group in target.param_groups:
                    group.prefetch_for_backward()


def _name_from_root(
    group: FSDPParamGroup, paths: list[str], module_paths: dict[int, str], index: int
) -> None:
    """Names a group and its parameters by their paths from the root (lazy init);
    a call's further groups (on other meshes) get their mesh's shape too."""
    group.fqn = ", ".join(paths)
    group.name = group.fqn or "(root)"
    if index > 0:
        group.name += f" [mesh {tuple(group.mesh_info.mesh.shape)}, #{index}]"
    for fsdp_param in group.fsdp_params:
        if len(group.modules) == 1:
            fsdp_param.fqn = f"{paths[0]}.{fsdp_param.fqn}" if paths[0] else fsdp_param.fqn
        elif (path := module_paths.get(id(fsdp_param.slots[0].module))) is not None:
            # Named by position in the list until now; where it sits is clearer.
            fsdp_param.fqn = (
                f"{path}.{fsdp_param.slots[0].name}" if path else fsdp_param.slots[0].name
            )


def _check_materialized(groups: list[FSDPParamGroup]) -> None:
    """Parameters built on the meta device must be materialized (``to_empty`` and
    initialised, or loaded) before the first forward: sharded meta tensors hold
    no values to compute with."""
    on_meta = [
        [p.fqn for p in group.fsdp_params if local_tensor(p.sharded_param).is_meta]
        for group in groups
    ]
    on_meta = [names for names in on_meta if names]
    if on_meta:
        more = sum(len(names) for names in on_meta[1:])
        raise RuntimeError(
            "FSDP parameters should be materialized from meta device before training, but "
            f"the following were still on meta device: {on_meta[0]}"
            + (f" and {more} more in other groups" if more else "")
            + ". Call model.to_empty(device=...) and initialise them (e.g. each module's "
            "reset_parameters()), or load a checkpoint, before the first forward."
        )


def _register_tensor_hooks(output: Any, hook) -> None:
    for tensor in tensors_in(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)


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


def _float_caster(dtype: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast
