"""The gradient reduction pipeline of one root: from a group's post-backward
to the sharded gradients.

    post_backward(group)   take the unsharded grads, reshard, make room in
                           the queue, start the reduce-scatter (and, on
                           accelerators, the stage across replicas after it)
    oldest finished        the group's stage across replicas (replica_stage.py:
                           nothing, all-reduce, reduce-scatter, or keep the sums)
    assign                 divide what the plan left to divide, run the
                           all-reduce hook, accumulate the sharded grads
    finish_backward        the final callback's work: stragglers'
                           post-backward, drain the queues, one host sync

At most ``max_input_buffers`` reduce-scatters are in flight (each holds an
input buffer the size of its group's gradients), so a group's reduction
overlaps the next groups' backward while memory stays bounded. Roots joined by
``share_comm_ctx`` share the reduce-scatter queue; each entry names the
pipeline that finishes it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from ..base.device_ops import DeviceOps
from ..base.log import logger
from ..base.private_api import profiled, without_grad
from ..comm.context import InFlight
from ..comm.offload import HostCopy
from ..comm.reduce_scatter import ReduceInFlight
from .param_group import FSDPParamGroup, GroupContext
from .sharded_grads import GroupGrads
from .states import TrainingState

if TYPE_CHECKING:
    from .param import FSDPParam


class GradsToReduce(NamedTuple):
    """The gradients a group's post-backward took, in reduce-scatter order."""

    fsdp_params: list[FSDPParam]
    grads: list[torch.Tensor]


class QueuedReduction(NamedTuple):
    pipeline: ReductionPipeline  # whose root finishes it
    group: FSDPParamGroup
    reduced: ReduceInFlight


class ReductionPipeline:
    """The reductions in flight under one root, oldest first."""

    # Pipelines whose last backward left reductions in flight
    # (set_is_last_backward(False)): an optimizer step finishes them first
    # (optimizer_hooks.py), so that it steps every gradient, as after torch's.
    left_in_flight: weakref.WeakSet[ReductionPipeline] = weakref.WeakSet()

    def __init__(self, root_ctx: GroupContext) -> None:
        self.root_ctx = root_ctx  # its comm context and order check
        self.reduce_scatters: deque[QueuedReduction] = deque()  # shared by share_comm_ctx
        # Stages across replicas in flight: one on CPU, every group's on accelerators.
        self.across_replicas: deque[tuple[FSDPParamGroup, ReduceInFlight]] = deque()
        # Reductions whose all-reduce hook runs on a stream of its own: assigned
        # once the current stream has waited for the event after the hook.
        self.hooks: deque[tuple[FSDPParamGroup, ReduceInFlight, torch.Event]] = deque()
        # The largest of the groups' set_reduce_scatter_max_input_buffers (lazy init).
        self.max_input_buffers = 1
        # False: the end of this backward leaves its last reduce-scatter in flight
        # (set_is_last_backward, for micro-batch and pipeline schedules).
        self.is_last_backward = True

    def post_backward(self, group: FSDPParamGroup) -> None:
        """A group's gradients are complete: reduce-scatters them (or keeps
        them, without gradient sync) and reshards."""
        with profiled("post_backward", group.name):
            taken = take_grads(group)
            if taken is None:
                return
            self.make_room()
            if taken.grads:
                reduced = start_reduce_scatter(group, taken)
                stage = group.comms.replica_stage
                if self.root_ctx.comm.uses_streams and stage.can_start_early(reduced):
                    # Accelerators: ordered after the reduce-scatter's event only, it
                    # overlaps the next groups' backward (on CPU gloo would block the
                    # host on the reduce-scatter first).
                    across = start_across_replicas(group, reduced, after=reduced.in_flight)
                    reduced = reduced._replace(across=across)
                self.reduce_scatters.append(QueuedReduction(self, group, reduced))

    def make_room(self) -> None:
        """Finishes the oldest reduce-scatters until another may start."""
        while len(self.reduce_scatters) >= self.max_input_buffers:
            self._finish_oldest_reduce_scatter()

    def finish_reduce_scatters(self) -> None:
        while self.reduce_scatters:
            self._finish_oldest_reduce_scatter()

    def _finish_oldest_reduce_scatter(self) -> None:
        queued = self.reduce_scatters.popleft()
        queued.pipeline._finish_reduce_scatter(queued.group, queued.reduced)

    def _finish_reduce_scatter(self, group: FSDPParamGroup, reduced: ReduceInFlight) -> None:
        """Waits for a reduce-scatter, then starts its stage across replicas
        (one in flight: starting the next finishes the previous) or assigns
        its gradients."""
        reduced.wait()
        across = reduced.across  # issued with the reduce-scatter (accelerators)
        if across is None:
            if group.comms.replica_stage.communicates:
                self.finish_across_replicas()
            across = start_across_replicas(group, reduced)
        if across is None:
            return  # kept for a later reduction
        if across.in_flight:
            self.across_replicas.append((group, across))
        else:
            self._assign(group, across)

    def finish_across_replicas(self) -> None:
        while self.across_replicas:
            group, reduced = self.across_replicas.popleft()
            reduced.wait()
            self._assign(group, reduced)

    def _assign(self, group: FSDPParamGroup, reduced: ReduceInFlight) -> None:
        """Runs the group's all-reduce hook on a finished reduction
        (``set_all_reduce_hook``), divides it as its plan says (before or
        after the hook: ``DividePlan.divides_before_hook``) and accumulates
        the sharded gradients."""
        comm = self.root_ctx.comm
        with profiled("assign_grads", group.name):
            if reduced.plan.divides_before_hook:
                average(reduced)
            if group.all_reduce_hook is not None:
                hook, stream = group.all_reduce_hook, group.all_reduce_hook_stream
                event = comm.run_hook(hook, reduced.output, stream)
                if event is not None:
                    # The hook's stream overlaps the rest of backward: assigned at its end.
                    # The reduce-scatter input is done with: only the output is kept.
                    self.hooks.append((group, reduced._replace(buffers=()), event))
                    return
            self._accumulate(group, reduced)

    def _accumulate(self, group: FSDPParamGroup, reduced: ReduceInFlight) -> None:
        if not reduced.plan.divides_before_hook:
            average(reduced)
        comm = self.root_ctx.comm
        copies = assign_sharded_grads(reduced, comm.ops, group.sharded_grads)
        if copies and comm.ops is not None:
            comm.grads_to_host.add(copies, comm.ops)

    def finish_hooks(self) -> None:
        while self.hooks:
            group, reduced, event = self.hooks.popleft()
            self.root_ctx.comm.wait_event(event)
            self._accumulate(group, reduced)

    def finish_backward(self, groups: Iterable[FSDPParamGroup]) -> None:
        """The final callback's reductions (``groups`` innermost first): the
        post-backward of groups whose ``PostBackward`` never ran (inputs without
        grad, unused outputs, unused prefetches), resharding of groups unsharded
        again by a recomputation, then every reduction finished (unless this is
        not the last backward) and one host sync for CPU offload."""
        groups = list(groups)
        for group in groups:
            if group.needs_post_backward:
                self.post_backward(group)
            elif group.reshard_after_backward and not group.held_for_weight_grads:
                group.reshard()  # unsharded again after its post-backward, for a recomputation
            group.cancel_unshard()
        if self.is_last_backward:
            self.finish_all()
        else:
            ReductionPipeline.left_in_flight.add(self)
        self.root_ctx.comm.grads_to_host.wait()
        # The last all-gather buffers go now, not at the next forward's copy-in.
        self.root_ctx.comm.release_copied_out()
        for group in groups:
            group.finalize_backward()

    def finish_all(self) -> None:
        """Waits for every reduction in flight and assigns its gradients."""
        self.finish_reduce_scatters()
        self.finish_across_replicas()
        self.finish_hooks()
        ReductionPipeline.left_in_flight.discard(self)

    @staticmethod
    def finish_left_in_flight() -> None:
        """Before an optimizer step: the reductions a non-last backward left."""
        for pipeline in list(ReductionPipeline.left_in_flight):
            pipeline.finish_all()

    def reset(self) -> None:
        """Recovery: waits for this root's reductions in flight and drops them."""
        comm = self.root_ctx.comm
        # The queue may be shared with other roots (share_comm_ctx): only this
        # root's reductions are dropped.
        mine = [q.reduced for q in self.reduce_scatters if q.pipeline is self]
        others = [q for q in self.reduce_scatters if q.pipeline is not self]
        # A stage across replicas issued early is waited for too: it writes its output.
        early = [reduced.across for reduced in mine if reduced.across is not None]
        for reduced in mine + early + [reduced for _, reduced in self.across_replicas]:
            try:
                reduced.wait()
            except RuntimeError:
                logger.warning("fsdp2: dropping a failed gradient reduction while resetting")
        self.reduce_scatters.clear()
        self.reduce_scatters.extend(others)
        self.across_replicas.clear()
        for _, _, event in self.hooks:
            comm.wait_event(event)  # a stream wait, then the buffers can go
        self.hooks.clear()
        comm.grads_to_host.wait(discard=True)  # this iteration's grads are dropped
        comm.release_copied_out()


@without_grad
def average(reduced: ReduceInFlight) -> None:
    """Divides a finished reduction by what its plan left to divide after the
    collectives (by default the mean is over the ranks, as DDP's)."""
    if (divisor := reduced.plan.post_divisor) is not None:
        reduced.output.div_(divisor)


@without_grad
def assign_sharded_grads(
    reduced: ReduceInFlight, ops: DeviceOps | None = None, kept: GroupGrads | None = None
) -> list[HostCopy]:
    """Accumulates a divided reduction into the sharded grads (``kept``: the
    group's, made once, when they can take it); returns the copies still on
    their way to the host (CPU offload on an accelerator)."""
    output = reduced.output
    # The collectives hold the parameters as ``CommParam``s; these are the
    # FSDPParams this engine's groups handed to ``ReduceScatterComm.start``.
    fsdp_params = cast("list[FSDPParam]", reduced.fsdp_params)
    dtypes = {p.orig_dtype for p in fsdp_params}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        if kept is not None and kept.accumulate(fsdp_params, reduced.slots, output, dtype):
            return []
        if dtype != output.dtype:
            output = output.to(dtype)  # one flat cast to the parameters' dtype, not one each
    copies = []
    for fsdp_param, local_grad in zip(fsdp_params, reduced.views(output), strict=True):
        if (copy := fsdp_param.accumulate_sharded_grad(local_grad, ops)) is not None:
            copies.append(copy)
    return copies


def take_grads(group: FSDPParamGroup) -> GradsToReduce | None:
    """Post-backward's first half: takes this backward's gradients and
    reshards. Without gradient sync the gradients are kept instead, and
    None is returned; otherwise the gradients to reduce-scatter (a list
    that may be empty)."""
    group.training_state = TrainingState.POST_BACKWARD
    if not group.requires_gradient_sync:
        for fsdp_param in group.fsdp_params:
            fsdp_param.keep_unsynced_grad(on_param=group.held_for_weight_grads)
        if group.reshard_after_backward and not group.held_for_weight_grads:
            group.reshard()
        return None
    grads = [p.take_unsharded_grad(cast=False) for p in group.fsdp_params]
    # Zeros for the unused ones in the others' dtype: packing casts nothing whole.
    dtype = next((g.dtype for g in grads if g is not None), None)
    taken = GradsToReduce([], [])
    for fsdp_param, grad in zip(group.fsdp_params, grads, strict=True):
        if (
            grad is None
            and fsdp_param.requires_grad
            and (
                # Unused on this rank, perhaps used on others: every rank must
                # reduce-scatter the same buffer (MoE, multimodal models).
                group.reduce_scatter_unused_params
                # Kept from an earlier backward without all-reduce: it must
                # join this reduction even though this backward gave no grad.
                or (fsdp_param.partial_grad is not None and group.settings.requires_all_reduce)
            )
        ):
            grad = fsdp_param.zero_unsharded_grad(dtype or fsdp_param.param_dtype)
        if grad is not None:
            taken.fsdp_params.append(fsdp_param)
            taken.grads.append(grad)
    if group.reshard_after_backward:
        group.reshard()
    return taken


def start_reduce_scatter(group: FSDPParamGroup, taken: GradsToReduce) -> ReduceInFlight:
    """Post-backward's second half: starts the reduce-scatter of ``taken``."""
    variant = group.comms.reduce_scatter
    if (check := group.root_ctx.order_check) is not None:
        slots = sum(p.layout.slot_numel for p in taken.fsdp_params)
        numel = slots * group.mesh_info.shard_world_size
        check.before_collective("reduce-scatter", group.position, variant.collectives, numel)
        check.record("reduce-scatter", group.position, in_training=True)
    logger.debug("%s: reduce-scatter issued for %d grads", group.name, len(taken.grads))
    plan = group.divide_plan(variant.sum_dtype(taken.fsdp_params[0].reduce_dtype))
    return variant.start(taken.fsdp_params, taken.grads, plan, group.root_ctx.comm, group.name)


def start_across_replicas(
    group: FSDPParamGroup, reduced: ReduceInFlight, after: tuple[InFlight, ...] = ()
) -> ReduceInFlight | None:
    """Starts the replica stage (replica_stage.py) on a reduce-scatter's
    output: finished, or (``after``: its collectives) on accelerators still
    in flight. Returns what the stage left to assign, or None."""
    stage = group.comms.replica_stage
    check, replicate = group.root_ctx.order_check, group.mesh_info.replicate_collectives
    if stage.communicates and check is not None and replicate is not None:
        check.before_collective("all-reduce", group.position, replicate, reduced.output.numel())
        check.record("all-reduce", group.position, in_training=True)
    return stage.start(reduced, group.root_ctx.comm, group.name, after)
