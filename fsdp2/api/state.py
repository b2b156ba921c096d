"""FSDPState: the hooks of one ``fully_shard`` call, and lazy init of the root.

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
- final callback (queued on the autograd engine, root.py): finish groups
  whose post-backward never ran, wait for the last reduce-scatter, reset.

A ``fully_shard([a, b])`` state puts the same hooks on each of its modules;
see [Note: one group, several modules].
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..base.log import logger
from ..base.markers import SHARDED_AS, ShardedAs
from ..base.policy import MixedPrecisionPolicy
from ..base.private_api import in_backward, in_compiled_autograd, map_tensors, profiled, tensors_in
from ..base.private_dist import local_tensor
from ..base.torch_fsdp import check_not_under_torch_fsdp
from ..checks.mistakes import at_lazy_init
from ..comm.mesh_info import MeshInfo
from ..comm.timeouts import align_timeouts
from ..engine.param_group import FSDPParamGroup
from ..engine.post_backward import register_post_backward
from ..engine.root import RootContext
from ..engine.states import ShardedState, arm_eager_hooks, eager_hook
from ..optim.optimizer_hooks import install_optimizer_hooks
from .torch_internals import StateReadByTorch

# Compiled autograd drops the autograd engine's final callback that ends
# fsdp2's backward (its gradient reductions), and traces the hooks with
# it: the sharded gradients would be missing or wrong, silently. torch's own
# fully_shard trains wrong under it too (torch 2.13).
COMPILED_AUTOGRAD_REFUSED = (
    "fsdp2: this backward runs under compiled autograd "
    "(torch._dynamo.config.compiled_autograd=True or compiled_autograd._enable), "
    "which fsdp2 does not support: it skips the callback that reduces the "
    "gradients, so the sharded gradients would be missing or wrong. Compile the "
    "forward instead (torch.compile on the model, its blocks or the step) and run "
    "backward with compiled autograd off."
)


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


class FSDPState(StateReadByTorch):
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
    ``PostBackward`` has (see ``PostBackwardCount`` in post_backward.py). A
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
        arm_eager_hooks()  # before this state binds and registers its hooks
        self.modules = tuple(modules)
        self.call_site = ""  # the user's file:line of the fully_shard call, for messages
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        # None: resharding after forward is decided at lazy init (off for the root).
        self.reshard_after_forward_arg = reshard_after_forward
        self.root_ctx = RootContext(device)
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
        check_not_under_torch_fsdp(self.modules, self.module_names)
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
        root_ctx = self.root_ctx
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
            root_ctx.states.append(state)
            if state.root_ctx.comm is not root_ctx.comm:
                state.root_ctx.comm.release_copied_out()  # e.g. unshard() before this forward
            state.root_ctx = root_ctx
            for group in state.param_groups:
                group.root_ctx = root_ctx
        module_paths = {id(m): name for name, m in root_module.named_modules()}
        for state, names in paths.items():
            for i, group in enumerate(state.param_groups):
                _name_from_root(group, names, module_paths, i)
        for position, group in enumerate(root_ctx.groups):
            group.position = position
        for group in root_ctx.groups:
            # Parameters assigned since fully_shard (a loader filling a meta model);
            # a group unsharded before the first forward holds its unsharded ones.
            if group.sharded_state is ShardedState.SHARDED:
                group.reset_sharded_params()
        _check_materialized(root_ctx.groups)
        install_optimizer_hooks()
        # Before the first collective: a stuck peer fails every group in the job's time.
        align_timeouts(
            (g for group in root_ctx.groups for g in group.process_groups()), root_ctx.device.type
        )
        at_lazy_init(root_ctx.groups)  # mistakes.py: the ranks hold the same model
        if self.reshard_after_forward_arg is None:
            # The root's parameters are needed again first thing in backward.
            for group in self.param_groups:
                group.reshard_after_forward = False
        detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
        root_ctx.enable_order_check(root_ctx.check_execution_order or detail)
        root_ctx.reductions.max_input_buffers = max(
            (g.reduce_scatter_max_input_buffers for g in root_ctx.groups), default=1
        )
        logger.debug("lazy init: root %s with %d groups", self.module_names, len(root_ctx.groups))

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
        root_ctx = self.root_ctx
        if root_ctx.forward_root is None:
            root_ctx.forward_root = self
            root_ctx.start_forward()
            if self.device.type != "cpu":
                # Blocking, as DDP: the caller may refill a pinned staging buffer next.
                args, kwargs = map_tensors((args, kwargs), lambda t: t.to(self.device))
        args, kwargs = self._cast_inputs(args, kwargs)
        if not self.param_groups:
            return args, kwargs
        for group in self.param_groups:  # all-gathers started together, then waited
            group.unshard()
        for group in self.param_groups:
            group.pre_forward()
            if torch.is_grad_enabled():
                count = group.post_backward_count
                if count is None:
                    raise group.fail("forward inputs registered outside a forward")
                post_backward = functools.partial(root_ctx.reductions.post_backward, group)
                args, kwargs = register_post_backward(post_backward, count, args, kwargs)
        if self.modules_to_run:
            return args, kwargs  # a further module of the group's forward in progress
        self.modules_to_run.update(self.modules)
        root_ctx.pre_forward_order += self.param_groups
        root_ctx.forward_started.update(self.param_groups)
        if self.forward_prefetch is None:
            # Implicit: the group that ran next last iteration (see [Note: forward prefetch]),
            # unless it already ran in this forward (the order changed).
            target = root_ctx.next_in_forward.get(self.param_groups[-1])
            if target is not None and target not in root_ctx.forward_started:
                root_ctx.guess_next(target)
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
        root_ctx = self.root_ctx
        is_forward_root = root_ctx.forward_root is self
        if is_forward_root:
            root_ctx.finish_partial_forwards(self)
        if self.param_groups:
            self.modules_to_run.discard(module)
            if is_forward_root:
                self.modules_to_run.clear()  # its other modules did not run
            if not self.modules_to_run:
                for group in self.param_groups:
                    root_ctx.end_forward_of(group)
        if torch.is_grad_enabled():
            _register_tensor_hooks(output, self._pre_backward)
        if is_forward_root:
            root_ctx.forward_root = None
            root_ctx.comm.shards_may_change()
            # A forward prefetch whose module did not run this time must not be
            # used later: the optimizer may change the shards in between.
            for other in root_ctx.groups:
                if other.sharded_state is not ShardedState.UNSHARDED:
                    other.cancel_unshard()
            # The last block's all-gather buffer would otherwise live through the
            # loss and into backward, where the peak is (+1 block on an H100).
            root_ctx.comm.release_copied_out()
        return self._cast_output(output)

    # -- backward ---------------------------------------------------------

    @eager_hook
    @_profiled("pre_backward")
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if in_compiled_autograd():
            raise RuntimeError(COMPILED_AUTOGRAD_REFUSED)
        self.root_ctx.queue_final_callback()
        explicit = bool(self.backward_prefetch)
        started = []
        for group in self.param_groups:
            started.append(group.pre_backward())
            if started[-1] and not explicit:
                self.root_ctx.prefetch_previous(group)
        if any(started) and explicit:
            for target in self.backward_prefetch:
                for group in target.param_groups:
                    group.prefetch_for_backward()


def _name_from_root(
    group: FSDPParamGroup, paths: list[str], module_paths: dict[int, str], index: int
) -> None:
    """Names a group and its parameters by their paths from the root (lazy init);
    a call's further groups (on other meshes) get their mesh's shape too."""
    group.name = ", ".join(paths) or "(root)"
    if index > 0:
        group.name += f" [mesh {tuple(group.mesh_info.mesh.shape)}, #{index}]"
    for fsdp_param in group.fsdp_params:
        if len(group.modules) == 1:
            fsdp_param.fqn = f"{paths[0]}.{fsdp_param.fqn}" if paths[0] else fsdp_param.fqn
        elif (path := module_paths.get(id(fsdp_param.registrations[0].module))) is not None:
            # Named by position in the list until now; where it sits is clearer.
            name = fsdp_param.registrations[0].name
            fsdp_param.fqn = f"{path}.{name}" if path else name
        original = fsdp_param.orig_param_ref()
        if original is not None and isinstance(
            where := original.__dict__.get(SHARDED_AS), ShardedAs
        ):
            where.path = fsdp_param.fqn  # an optimizer still holding it is told this name


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
    root_ctx = state.root_ctx
    made = [
        what
        for what, is_set in (
            ("comm_stats", root_ctx.comm.stats is not None),
            ("set_check_execution_order", root_ctx.check_execution_order),
            ("set_is_last_backward", not root_ctx.reductions.is_last_backward),
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
