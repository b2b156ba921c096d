"""FSDPParamGroup: the parameters of one ``fully_shard`` call, communicated together.

A group moves between two sharded states with one collective each way:

    SHARDED --unshard()--> (all-gather in flight) --wait_for_unshard()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED

and through four training states per iteration, driven by the hooks in
state.py:

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE
         --pre_backward--> PRE_BACKWARD --post_backward--> POST_BACKWARD
         --finalize_backward (end of backward)--> IDLE

See docs/design.md for the whole picture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .collectives import AllGatherInFlight, all_gather, copy_out, reduce_scatter
from .common import MeshInfo, ShardedState, TrainingState
from .param import FSDPParam
from .private_api import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .state import RootContext


class FSDPParamGroup:
    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        module: nn.Module,
        mesh_info: MeshInfo,
        ctx: RootContext,
        reshard_after_forward: bool,
    ) -> None:
        self.fsdp_params = fsdp_params
        self.module = module
        self.mesh_info = mesh_info
        self.ctx = ctx  # replaced by the root's context at lazy init
        self.reshard_after_forward = reshard_after_forward
        self.fqn = ""  # module path from the root, set at lazy init
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherInFlight | None = None
        # Positions of this group in ctx.post_forward_order, one per forward call.
        self._post_forward_indices: list[int] = []

    def _fail(self, message: str) -> AssertionError:
        return AssertionError(f"[rank {self.mesh_info.shard_rank}] group {self.fqn!r}: {message}")

    # -- sharded state ----------------------------------------------------

    @property
    def all_gather_in_flight(self) -> bool:
        return self._all_gather is not None

    def unshard(self) -> None:
        """Starts the all-gather, unless it is in flight or the group is unsharded."""
        if self._all_gather is not None or self.sharded_state is ShardedState.UNSHARDED:
            return
        info = self.mesh_info
        with torch.profiler.record_function(f"fsdp2::all_gather ({self.fqn})"):
            self._all_gather = all_gather(
                self.fsdp_params,
                info.shard_group,
                info.shard_rank,
                info.shard_world_size,
                self.ctx.comm,
            )

    def wait_for_unshard(self) -> None:
        """Finishes the all-gather and puts the unsharded parameters on the modules."""
        if self._all_gather is None:
            if self.sharded_state is not ShardedState.UNSHARDED:
                raise self._fail("wait_for_unshard() without an all-gather in flight")
            return
        with torch.profiler.record_function(f"fsdp2::all_gather_copy_out ({self.fqn})"):
            copy_out(self._all_gather, self.fsdp_params, self.mesh_info.shard_world_size)
        self._all_gather = None
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Puts the sharded parameters back on the modules and frees the unsharded storage."""
        if self._all_gather is not None:
            # Prefetched but never used (e.g. the module did not run): finish the
            # collective every rank issued, then drop its buffer.
            self._all_gather.in_flight.wait()
            self._all_gather = None
        if self.sharded_state is ShardedState.SHARDED:
            return
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
            fsdp_param.free_unsharded()
        self.sharded_state = ShardedState.SHARDED

    # -- forward ----------------------------------------------------------

    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Forward recomputed inside backward (activation checkpointing).
            self.unshard()
            self.wait_for_unshard()
            return args, kwargs
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        if torch.is_grad_enabled():
            self._post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            # No backward follows a forward without grad: nothing to keep unsharded for.
            self.reshard()
        self.training_state = TrainingState.IDLE

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not positions:
            # Post-backward then runs from the final callback (see state.py).
            return args, kwargs
        outputs = PostBackward.apply(self, *(leaves[i] for i in positions))
        for i, output in zip(positions, outputs, strict=True):
            leaves[i] = output
        return tree_unflatten(leaves, spec)

    # -- backward ---------------------------------------------------------

    def pre_backward(self, prefetch_previous: bool) -> bool:
        """Unshards for backward; returns False if this iteration already did."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False  # one hook per output tensor: only the first acts
        self.training_state = TrainingState.PRE_BACKWARD
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
                target.unshard()

    def post_backward(self) -> None:
        """Reduce-scatters the gradients of this backward and reshards."""
        self.training_state = TrainingState.POST_BACKWARD
        with torch.profiler.record_function(f"fsdp2::post_backward ({self.fqn})"):
            reduced, grads = [], []
            for fsdp_param in self.fsdp_params:
                grad = fsdp_param.take_unsharded_grad()
                if grad is not None:
                    reduced.append(fsdp_param)
                    grads.append(grad)
            self.reshard()
            # At most one reduce-scatter in flight: its input buffer is the size
            # of a whole group's gradients.
            self.ctx.finish_reduce_scatter()
            if grads:
                info = self.mesh_info
                with torch.profiler.record_function(f"fsdp2::reduce_scatter ({self.fqn})"):
                    self.ctx.reduce_scatter_in_flight = reduce_scatter(
                        reduced, grads, info.shard_group, info.shard_world_size, self.ctx.comm
                    )

    @property
    def needs_post_backward(self) -> bool:
        """Whether the final callback must finish this group: it was unsharded or
        prepared for backward, but no PostBackward node ran (its inputs did not
        require grad, or its outputs were unused), or a prefetch went unused."""
        return (
            self.training_state is TrainingState.PRE_BACKWARD
            or self.sharded_state is ShardedState.UNSHARDED
            or self.all_gather_in_flight
        )

    def finalize_backward(self) -> None:
        self._post_forward_indices.clear()
        self.training_state = TrainingState.IDLE

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.fqn!r}, {len(self.fsdp_params)} params)"


class PostBackward(torch.autograd.Function):
    """Identity on a group's forward inputs whose backward runs the group's post-backward.

    The gradient with respect to the inputs is computed after every parameter
    gradient of the module has been accumulated (the engine runs
    AccumulateGrad nodes first), so the group's gradients are complete here.
    """

    @staticmethod
    def forward(ctx, group: FSDPParamGroup, *inputs: torch.Tensor):
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.group.post_backward()
        return (None, *grads)
