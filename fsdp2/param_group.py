"""FSDPParamGroup: the parameters of one ``fully_shard`` call, communicated together.

A group moves between sharded states with one collective each way:

    SHARDED --unshard()--> (all-gather in flight) --wait_for_unshard()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED
    UNSHARDED --post_forward, reshard_after_forward=<int>--> SHARDED_POST_FORWARD
    SHARDED_POST_FORWARD --unshard() (all-gather in the small group)--> ... UNSHARDED

and through four training states per iteration, driven by the hooks in
state.py:

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE
         --pre_backward--> PRE_BACKWARD --post_backward--> POST_BACKWARD
         --finalize_backward (end of backward)--> IDLE

A group of several modules (``fully_shard([a, b])``) gets one ``pre_forward``
per module call and one ``post_forward`` once they have all run; see
[Note: one group, several modules] in state.py.

See docs/design.md for the whole picture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .collectives import (
    AllGatherInFlight,
    ReduceInFlight,
    all_gather,
    all_gather_dtype,
    as_buffer_dtype,
    backend_for,
    copy_out,
    divide_plan,
    output_slots,
    reduce_scatter,
)
from .common import MeshInfo, ShardedState, TrainingState, eager_hook
from .custom_comm import AllGather, ReduceScatter
from .param import FSDPParam
from .private_api import (
    functorch_transforms_active,
    map_tensors,
    outside_functorch,
    profiled,
    tensors_in,
)

if TYPE_CHECKING:
    from .state import RootContext

logger = logging.getLogger("fsdp2")


class FSDPParamGroup:
    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        modules: list[nn.Module],
        mesh_info: MeshInfo,
        ctx: RootContext,
        reshard_after_forward: bool,
        post_forward_mesh_info: MeshInfo | None,
    ) -> None:
        self.fsdp_params = fsdp_params
        # All-gathered, vs. kept whole on every rank (min_numel_to_shard).
        self.sharded_params = [p for p in fsdp_params if not p.replicated]
        self.replicated_params = [p for p in fsdp_params if p.replicated]
        self.modules = tuple(modules)  # the modules passed to fully_shard
        self.mesh_info = mesh_info
        self.ctx = ctx  # replaced by the root's context at lazy init
        self.reshard_after_forward = reshard_after_forward
        # Set: after forward, keep a shard over this smaller group instead.
        self.post_forward_mesh_info = post_forward_mesh_info if self.sharded_params else None
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: across replicas
        # Set by FSDPModule methods (module.py), each named after its setter.
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.gradient_divide_factor: float | None = None  # None: the ranks averaged over
        self.force_sum_reduction_for_comms = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: torch.Stream | None = None
        self.all_gather_comm: AllGather | None = None  # None: all_gather_single
        self.reduce_scatter_comm: ReduceScatter | None = None  # None: reduce_scatter_single
        self.reduce_scatter_max_input_buffers = 1
        # The shard group's ranks, or a process group of their own for the
        # reduce-scatter (set_separate_reduce_scatter_group).
        self.reduce_scatter_group = mesh_info.shard_group
        # SHARDED_POST_FORWARD: this rank's block of every parameter over the
        # small group, flat (post-forward slot of each parameter, in order).
        self._post_forward_shard: torch.Tensor | None = None
        # Accelerators: recorded after it was written, waited for by its copy-in.
        self._post_forward_shard_written: torch.Event | None = None
        self.fqn = ""  # module path from the root, set at lazy init
        # For messages: the path(s) from the root, or "(root)"; see lazy init.
        self.name = ", ".join(type(m).__name__ for m in modules)
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherInFlight | None = None
        self.all_gathers_started = 0  # tells one all-gather from the next (UnshardHandle)
        # Positions of this group in ctx.post_forward_order, one per forward call.
        self._post_forward_indices: list[int] = []
        # The PostBackward nodes of the forward in progress (see pre_forward).
        self._post_backward_count: PostBackwardCount | None = None

    def _fail(self, message: str) -> AssertionError:
        return AssertionError(f"[rank {self.mesh_info.shard_rank}] group {self.name!r}: {message}")

    # -- sharded state ----------------------------------------------------

    @property
    def all_gather_in_flight(self) -> bool:
        return self._all_gather is not None

    @outside_functorch
    def unshard(self) -> None:
        """Starts the all-gather, unless it is in flight or the group is unsharded."""
        if self._all_gather is not None or self.sharded_state is ShardedState.UNSHARDED:
            return
        with profiled("all_gather_copy_in", self.name):
            self._start_all_gather()

    def _start_all_gather(self) -> None:
        comm = self.ctx.comm
        if comm.ops is None:
            self._copy_in_and_issue()
            return
        # The copy-in, an extension's pre_all_gather included, off the compute stream.
        written = self._post_forward_shard_written
        if self.sharded_state is not ShardedState.SHARDED_POST_FORWARD:
            written = None
        with comm.copy_in(written):
            self._copy_in_and_issue()

    def _copy_in_and_issue(self) -> None:
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            info = self._post_forward_info()
            shard = self._post_forward_shard
            if shard is None:
                raise self._fail("SHARDED_POST_FORWARD without its shard")
            inputs, slots = [shard], [(shard.numel(), shard.dtype)]
        else:
            info = self.mesh_info
            for fsdp_param in self.sharded_params:
                fsdp_param.check_not_replaced()
            inputs = [x for p in self.sharded_params for x in p.all_gather_inputs()]
            slots = self._all_gather_slots()
        buffer_dtype = all_gather_dtype([dtype for _, dtype in slots])
        if (check := self.ctx.order_check) is not None:
            numel = sum(
                n * (dtype.itemsize if buffer_dtype is torch.uint8 else 1) for n, dtype in slots
            )
            check.before_collective("all-gather", self, info.shard_group, numel)
        logger.debug("%s: all-gather issued (%s)", self.name, self.sharded_state.name)
        self.all_gathers_started += 1
        self._all_gather = all_gather(
            inputs,
            slots,
            buffer_dtype,
            info.shard_group,
            info.shard_rank,
            info.shard_world_size,
            self.ctx.comm,
            self.name,
            self.all_gather_comm,
        )

    def _all_gather_slots(self) -> list[tuple[int, torch.dtype]]:
        return [slot for p in self.sharded_params for slot in p.all_gather_slots]

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Finishes the all-gather and puts the unsharded parameters on the modules."""
        if self._all_gather is None:
            if self.sharded_state is not ShardedState.UNSHARDED:
                raise self._fail("wait_for_unshard() without an all-gather in flight")
            return
        world_size = self._unshard_world_size()
        # Wait before allocating: if the collective fails, nothing is left allocated.
        self._all_gather.in_flight.wait()
        if (check := self.ctx.order_check) is not None:
            in_training = torch.is_grad_enabled() or self.ctx.final_callback_queued
            check.record("all-gather", self, in_training)
        with profiled("all_gather_copy_out", self.name):
            outputs = [out for p in self.sharded_params for out in p.all_gather_outputs(world_size)]
            copy_out(self._all_gather, outputs)
            self.ctx.comm.copied_out(self._all_gather.all_gather_output)
            for fsdp_param in self.sharded_params:
                fsdp_param.finish_unshard()
            if self.replicated_params:
                self.ctx.comm.wait_for_optimizer()
            for fsdp_param in self.replicated_params:
                fsdp_param.copy_replicated()
        self._all_gather = None
        self._post_forward_shard = None
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_unsharded()
        logger.debug("%s: unsharded", self.name)
        self.sharded_state = ShardedState.UNSHARDED

    def _unshard_world_size(self) -> int:
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            return self._post_forward_info().shard_world_size
        return self.mesh_info.shard_world_size

    def _post_forward_info(self) -> MeshInfo:
        if self.post_forward_mesh_info is None:
            raise self._fail("resharding to a smaller group without one")
        return self.post_forward_mesh_info

    @outside_functorch
    def reshard(self) -> None:
        """Puts the sharded parameters back on the modules and frees the unsharded storage."""
        self.cancel_unshard()
        self._post_forward_shard = None
        if self.sharded_state is ShardedState.UNSHARDED:
            self._to_sharded()
            logger.debug("%s: resharded", self.name)
        self.sharded_state = ShardedState.SHARDED

    def _reshard_post_forward(self) -> None:
        """Keeps this rank's block of the small group (copied out of the unsharded
        parameters), then frees them."""
        info = self._post_forward_info()
        # In the all-gather buffer's units (bytes when the parameters' dtypes differ).
        buffer_dtype = all_gather_dtype([dtype for _, dtype in self._all_gather_slots()])
        blocks = [
            as_buffer_dtype(out[info.shard_rank].reshape(-1), buffer_dtype)
            for p in self.sharded_params
            for out in p.all_gather_outputs(info.shard_world_size)
        ]
        self._post_forward_shard = torch.cat(blocks)
        self._post_forward_shard_written = self.ctx.comm.shard_written()
        self._to_sharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reset_sharded_params(self) -> None:
        """After ``nn.Module._apply`` changed the sharded parameters (see
        ``FSDPParam.reset_sharded_param``)."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.reset_sharded_param(self.ctx.comm.ops)

    def _to_sharded(self) -> None:
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
            fsdp_param.free_unsharded()

    # -- forward ----------------------------------------------------------

    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Unshards and wraps the inputs in ``PostBackward``. Called once per module
        call: a group of several modules is called again, still in FORWARD, for
        each further module, until ``post_forward`` ends its forward."""
        if self.training_state is not TrainingState.FORWARD:
            self._post_backward_count = PostBackwardCount()
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def unshard_for_recomputation(self) -> None:
        """A forward recomputed inside backward (activation checkpointing) needs
        the parameters, possibly after this group's post-backward resharded them
        (a module called twice); the training state stays as backward set it,
        and post-backward or the final callback reshards."""
        self.unshard()
        self.wait_for_unshard()

    def post_forward(self) -> None:
        if torch.is_grad_enabled():
            self._post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)
        if not torch.is_grad_enabled():
            # No backward follows a forward without grad: nothing to keep unsharded for.
            self.reshard()
        elif self.post_forward_mesh_info is not None:
            self._reshard_post_forward()
        elif self.reshard_after_forward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        count = self._post_backward_count
        if count is None:
            raise self._fail("forward inputs registered outside a forward")
        if not inputs:
            # Post-backward then runs from the final callback (see state.py).
            count.final_callback_only = True
            return args, kwargs
        count.registered += 1
        function = TransformablePostBackward if functorch_transforms_active() else PostBackward
        outputs = function.apply(self, count, *inputs)
        wrapped = {id(t): out for t, out in zip(inputs, outputs, strict=True)}
        return map_tensors((args, kwargs), lambda t: wrapped.get(id(t), t))

    # -- backward ---------------------------------------------------------

    def pre_backward(self, prefetch_previous: bool) -> bool:
        """Unshards for backward; returns False if this iteration already did."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False  # one hook per output tensor: only the first acts
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()  # no-op when resharding after forward is off or it was prefetched
            self.wait_for_unshard()
        if prefetch_previous:
            self._prefetch_previous_in_forward()
        return True

    def _prefetch_previous_in_forward(self) -> None:
        """Implicit backward prefetch: backward runs forward's order in reverse,
        so the group that finished forward just before this one is next."""
        if not self._post_forward_indices:
            return
        index = self._post_forward_indices.pop()
        if index > 0:
            target = self.ctx.post_forward_order[index - 1]
            if target.training_state is not TrainingState.POST_BACKWARD:
                target.prefetch_for_backward()

    def prefetch_for_backward(self) -> None:
        if self.unshard_in_backward:
            self.unshard()

    def post_backward(self) -> None:
        """Reduce-scatters the gradients of this backward (or keeps them, without
        gradient sync) and reshards."""
        self.training_state = TrainingState.POST_BACKWARD
        with profiled("post_backward", self.name):
            if not self.requires_gradient_sync:
                for fsdp_param in self.fsdp_params:
                    fsdp_param.keep_unsynced_grad()
                if self.reshard_after_backward:
                    self.reshard()
                return
            reduced, grads = [], []
            for fsdp_param in self.fsdp_params:
                grad = fsdp_param.take_unsharded_grad(cast=False)
                if (
                    grad is None
                    and fsdp_param.requires_grad
                    and (
                        # Unused on this rank, perhaps used on others: every rank must
                        # reduce-scatter the same buffer (MoE, multimodal models).
                        self.reduce_scatter_unused_params
                        # Kept from an earlier backward without all-reduce: it must
                        # join this reduction even though this backward gave no grad.
                        or (fsdp_param.partial_grad is not None and self.requires_all_reduce)
                    )
                ):
                    grad = fsdp_param.zero_unsharded_grad()
                if grad is not None:
                    reduced.append(fsdp_param)
                    grads.append(grad)
            if self.reshard_after_backward:
                self.reshard()
            # Each reduce-scatter in flight holds an input buffer the size of its
            # group's gradients: at most reduce_scatter_max_input_buffers of them.
            self.ctx.make_room_for_reduce_scatter()
            if grads:
                info = self.mesh_info
                if (check := self.ctx.order_check) is not None:
                    numel = sum(p.padded_shard_numel for p in reduced) * info.shard_world_size
                    check.before_collective(
                        "reduce-scatter", self, self.reduce_scatter_group, numel
                    )
                    check.record("reduce-scatter", self, in_training=True)
                logger.debug("%s: reduce-scatter issued for %d grads", self.name, len(grads))
                plan = divide_plan(
                    backend_for(self.reduce_scatter_group, self.ctx.device),
                    reduced[0].reduce_dtype,
                    info.shard_world_size,
                    info.replicate_world_size,
                    self.gradient_divide_factor,
                    self.force_sum_reduction_for_comms,
                    one_rank_collectives=self.ctx.comm.force_collectives,
                )
                reduction = reduce_scatter(
                    reduced,
                    grads,
                    self.reduce_scatter_group,
                    info.shard_world_size,
                    plan,
                    self.ctx.comm,
                    self.name,
                    self.reduce_scatter_comm,
                )
                reduction = self.ctx.start_all_reduce_early(self, reduction)
                self.ctx.reduce_scatters_in_flight.append((self, reduction))

    def keep_partial_grads(self, reduced: ReduceInFlight) -> None:
        """HSDP without all-reduce: keep the shard-group sums for a later all-reduce."""
        for fsdp_param, local_grad in zip(reduced.fsdp_params, output_slots(reduced), strict=True):
            if fsdp_param.partial_grad is None:
                fsdp_param.partial_grad = local_grad.clone()
            else:
                fsdp_param.partial_grad.add_(local_grad)

    def add_partial_grads(self, reduced: ReduceInFlight) -> None:
        for fsdp_param, local_grad in zip(reduced.fsdp_params, output_slots(reduced), strict=True):
            if fsdp_param.partial_grad is not None:
                local_grad.add_(fsdp_param.partial_grad)
                fsdp_param.partial_grad = None

    @property
    def needs_post_backward(self) -> bool:
        """Whether the final callback must run post-backward for this group: it
        was prepared for backward or holds parameters from forward, but no
        PostBackward node ran (its inputs did not require grad, or its outputs
        were unused)."""
        return self.training_state is TrainingState.PRE_BACKWARD or (
            self.training_state is not TrainingState.POST_BACKWARD
            and self.sharded_state is not ShardedState.SHARDED
        )

    def cancel_unshard(self) -> None:
        """Drops an all-gather that was started but will not be used (a prefetch
        whose module did not run): every rank issued it, so it is waited for."""
        if self._all_gather is not None:
            self._all_gather.in_flight.wait()
            self.ctx.comm.copied_out(self._all_gather.all_gather_output)
            self._all_gather = None

    def reset(self) -> None:
        """After an exception: drop in-flight and partial work, reshard, go idle.
        Gradients of the interrupted iteration are discarded, sharded ones included."""
        try:
            self.cancel_unshard()
        except RuntimeError:
            self._all_gather = None
            logger.warning("fsdp2: %s: dropping a failed all-gather while resetting", self.name)
        self.reshard()
        for fsdp_param in self.fsdp_params:
            fsdp_param.free_unsharded()  # also what a failed copy-out left allocated
            fsdp_param.drop_unsharded_grads()
            fsdp_param.partial_grad = None
            fsdp_param.sharded_param.grad = None
        self._post_forward_indices.clear()
        self._post_backward_count = None
        self.training_state = TrainingState.IDLE

    def finalize_backward(self) -> None:
        self._post_forward_indices.clear()
        self.training_state = TrainingState.IDLE

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.name!r}, {len(self.fsdp_params)} params)"


class PostBackwardCount:
    """The ``PostBackward`` nodes of one forward of a group: one per module call
    whose inputs required grad (a group of several modules has one call per
    module). Only when all of them have run is every gradient of that forward
    accumulated, so the last one runs post-backward. A call with no such input
    has no node to say when its gradients are done: the final callback runs
    post-backward instead."""

    def __init__(self) -> None:
        self.registered = 0
        self.ran = 0
        self.final_callback_only = False

    def node_ran(self) -> bool:
        """Counts one node's backward; True if it was the last of the forward."""
        self.ran += 1
        if self.ran < self.registered:
            return False
        self.ran = 0  # a second backward through the same graph counts again
        return not self.final_callback_only


class PostBackward(torch.autograd.Function):
    """Identity on a group's forward inputs whose backward runs the group's post-backward.

    The gradient with respect to the inputs is computed after every parameter
    gradient of the module has been accumulated (the engine runs
    AccumulateGrad nodes first), so the module's gradients are complete here;
    the group's are once every module call of the forward has got here
    (``PostBackwardCount``).

    Written in the style where ``forward`` takes ``ctx``: ``Function.apply``
    then calls it directly, while a Function with ``setup_context`` has its
    arguments bound through ``inspect.signature`` on every call (once per
    module call here). Under functorch transforms ``TransformablePostBackward``
    runs instead.
    """

    @staticmethod
    def forward(ctx, group: FSDPParamGroup, count: PostBackwardCount, *inputs: torch.Tensor):
        ctx.group, ctx.count = group, count
        return inputs

    @staticmethod
    @eager_hook
    def backward(ctx, *grads: torch.Tensor):
        if ctx.count.node_ran():
            ctx.group.post_backward()
        return (None, None, *grads)


class TransformablePostBackward(torch.autograd.Function):
    """``PostBackward`` for a forward under functorch transforms (``torch.func.jvp``
    through a sharded module): ``setup_context``, ``jvp`` and the generated vmap
    rule are what those transforms require of a Function."""

    generate_vmap_rule = True

    @staticmethod
    def forward(group: FSDPParamGroup, count: PostBackwardCount, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:
        ctx.group, ctx.count = inputs[0], inputs[1]

    backward = staticmethod(PostBackward.backward)

    @staticmethod
    def jvp(ctx, group_tangent: None, count_tangent: None, *input_tangents: torch.Tensor):
        # Forward-mode: an identity; post-backward belongs to reverse mode only.
        return input_tangents
