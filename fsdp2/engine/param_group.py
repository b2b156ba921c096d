"""FSDPParamGroup: the parameters of one ``fully_shard`` call, communicated together.

A group moves between sharded states with one collective each way:

    SHARDED --unshard()--> (all-gather in flight) --wait_for_unshard()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED
    UNSHARDED --post_forward, reshard_after_forward=<int>--> SHARDED_POST_FORWARD
    SHARDED_POST_FORWARD --unshard() (all-gather in the small group)--> ... UNSHARDED

and through four training states per iteration, driven by the hooks in
state.py and the reduction pipeline (reduction.py):

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE
         --pre_backward--> PRE_BACKWARD --post_backward--> POST_BACKWARD
         --finalize_backward (end of backward)--> IDLE

A group of several modules (``fully_shard([a, b])``) gets one ``pre_forward``
per module call and one ``post_forward`` once they have all run; see
[Note: one group, several modules] in state.py.

See docs/design.md for the whole picture.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ..base.log import logger
from ..base.private_api import module_parameters, outside_functorch, profiled
from ..base.version import versions
from ..comm.all_gather import AllGatherInFlight, AllGatherInputs, all_gather_dtype, as_buffer_dtype
from ..comm.context import CommContext
from ..comm.divide import DividePlan, divide_plan
from ..comm.mesh_info import MeshInfo
from ..comm.variants import CommSettings, GroupComms, choose_comms
from .execution_order import ExecutionOrderCheck
from .param import FSDPParam
from .post_backward import PostBackwardCount
from .sharded_grads import GroupGrads
from .states import ShardedState, TrainingState
from .unsharded import UnshardedStorages

_SHARDED_PARAM = operator.attrgetter("sharded_param")


class GroupContext(Protocol):
    """What a group reads of the context of its root (``RootContext``, root.py)."""

    comm: CommContext
    order_check: ExecutionOrderCheck | None
    backward_running: bool  # between the first pre-backward hook and the final callback


class FSDPParamGroup:
    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        modules: list[nn.Module],
        mesh_info: MeshInfo,
        root_ctx: GroupContext,
        reshard_after_forward: bool,
        post_forward_mesh_info: MeshInfo | None,
        settings: CommSettings,
    ) -> None:
        self.fsdp_params = fsdp_params
        # All-gathered, vs. kept whole on every rank (min_numel_to_shard).
        self.sharded_params = [p for p in fsdp_params if not p.layout.whole]
        self.whole_params = [p for p in fsdp_params if p.layout.whole]
        # Those whose unsharded parameter an all-gather extension builds after the copy-out.
        self._extended = [p for p in self.sharded_params if p.extension is not None]
        self.modules = tuple(modules)  # the modules passed to fully_shard
        self.mesh_info = mesh_info
        self.root_ctx = root_ctx  # replaced by the root's context at lazy init
        self.reshard_after_forward = reshard_after_forward
        # False when the user chose to keep the parameters (reshard_after_forward=False,
        # or a setter): a forward without grad keeps them then too, as torch's does (a
        # generate loop all-gathers once). The root's automatic False (lazy init) stays
        # True here: without grad no backward follows to need them.
        self.reshard_after_no_grad_forward = reshard_after_forward
        # Set: after forward, keep a shard over this smaller group instead.
        self.post_forward_mesh_info = post_forward_mesh_info if self.sharded_params else None
        self.reshard_after_backward = True
        # Kept unsharded through forwards: a pipeline's split backward has
        # weight halves to run (torch_internals.py, [Note: split backward]).
        self.held_for_weight_grads = False
        # The communication variants (comm/variants.py), chosen again when a setting changes.
        self.settings = settings
        self.comms = self._choose_comms(settings, previous=None)
        self.requires_gradient_sync = True
        # Set by FSDPModule methods (module.py), each named after its setter.
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.gradient_divide_factor: float | None = None  # None: the ranks averaged over
        self.force_sum_reduction_for_comms = False
        # Made at the first reduce-scatter; dropped by what changes it (clear_divide_plan).
        self._divide_plan: tuple[torch.dtype, DividePlan] | None = None  # (sum dtype, plan)
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: torch.Stream | None = None
        self.reduce_scatter_max_input_buffers = 1
        # SHARDED_POST_FORWARD: this rank's block of every parameter over the
        # small group, flat (post-forward slot of each parameter, in order).
        self._post_forward_shard: torch.Tensor | None = None
        # Accelerators: recorded after it was written, waited for by its copy-in.
        self._post_forward_shard_written: torch.Event | None = None
        self.position = 0  # in the root's pre-order, set at lazy init (order check)
        # For messages: the path(s) from the root, or "(root)"; see lazy init.
        self.name = ", ".join(type(m).__name__ for m in modules)
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherInFlight | None = None
        self.all_gathers_started = 0  # tells one all-gather from the next (UnshardHandle)
        # The PostBackward nodes of the forward in progress (see pre_forward).
        self.post_backward_count: PostBackwardCount | None = None
        # The sharded grads, made once and reused (sharded_grads.py); not with
        # CPU offload, whose grads go to pinned host memory.
        offload = any(p.offload for p in fsdp_params)
        self.sharded_grads: GroupGrads | None = None if offload else GroupGrads()
        # Where each parameter sits on the modules (tied ones on several), as
        # (the module's parameter dict, name, index in fsdp_params): unshard
        # and reshard swap them all, twice a step.
        self._module_slots = [
            (module_parameters(r.module), r.name, i)
            for i, p in enumerate(fsdp_params)
            for r in p.registrations
        ]
        self._unsharded = UnshardedStorages(self.sharded_params)
        # The sharded parameters that sit on a module, and where each sits first:
        # the module must still hold it there at each all-gather (``_check_not_replaced``).
        self._held = [p for p in self.sharded_params if p.registrations]
        self._first_slots = (
            [module_parameters(p.registrations[0].module) for p in self._held],
            [p.registrations[0].name for p in self._held],
        )

    def configure(self, **changes: object) -> None:
        """Changes the communication settings (``CommSettings``' fields) and
        chooses the variants again; raises, changing nothing, if the new
        settings do not go together."""
        settings = self.settings.replace(**changes)
        self.comms = self._choose_comms(settings, previous=self.comms)
        self.settings = settings
        self.clear_divide_plan()

    def _choose_comms(self, settings: CommSettings, previous: GroupComms | None) -> GroupComms:
        layouts = [p.layout for p in self.sharded_params]
        return choose_comms(
            self.mesh_info, self.post_forward_mesh_info, layouts, settings, previous
        )

    def process_groups(self) -> list[tuple[str, dist.ProcessGroup]]:
        """Every process group this group communicates on, by role (timeouts.py)."""
        groups = self.mesh_info.process_groups()
        if self.post_forward_mesh_info is not None:
            groups += self.post_forward_mesh_info.process_groups()
        if (separate := self.settings.reduce_scatter_collectives) is not None:
            groups.append((separate.role, separate.process_group))
        return groups

    def fail(self, message: str) -> AssertionError:
        """An internal error (a state the engine should never reach): with the
        versions a bug report needs."""
        return AssertionError(
            f"[rank {self.mesh_info.shard_rank}] group {self.name!r}: {message} ({versions()}; "
            "an fsdp2 bug: please report it with this message)"
        )

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
        comm = self.root_ctx.comm
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
        comm = self.root_ctx.comm
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            info = self._post_forward_info()
            shard, variant = self._post_forward_shard, self.comms.post_forward_all_gather
            if shard is None or variant is None:
                raise self.fail("SHARDED_POST_FORWARD without its shard")
            inputs = AllGatherInputs([shard], [(shard.numel(), shard.dtype)], (False,))
        else:
            info, variant = self.mesh_info, self.comms.all_gather
            self._check_not_replaced()
            inputs = variant.inputs(self.sharded_params, comm, self.name)
        if (check := self.root_ctx.order_check) is not None:
            check.before_collective(
                "all-gather", self.position, info.shard_collectives, inputs.block_numel
            )
        logger.debug("%s: all-gather issued (%s)", self.name, self.sharded_state.name)
        self.all_gathers_started += 1
        self._all_gather = variant.gather(inputs, comm, self.name)

    def _check_not_replaced(self) -> None:
        """``FSDPParam.check_not_replaced`` of every sharded parameter, as one
        comparison of lists while none was replaced."""
        dicts, names = self._first_slots
        held = map(operator.getitem, dicts, names)
        if not all(map(operator.is_, held, map(_SHARDED_PARAM, self._held))):
            for fsdp_param in self._held:
                fsdp_param.check_not_replaced()

    def _all_gather_slots(self) -> list[tuple[int, torch.dtype]]:
        return [slot for p in self.sharded_params for slot in p.all_gather_slots]

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Finishes the all-gather and puts the unsharded parameters on the modules."""
        if self._all_gather is None:
            if self.sharded_state is not ShardedState.UNSHARDED:
                raise self.fail("wait_for_unshard() without an all-gather in flight")
            return
        world_size = self._unshard_world_size()
        # Wait before allocating: if the collective fails, nothing is left allocated.
        self._all_gather.in_flight.wait()
        if (check := self.root_ctx.order_check) is not None:
            in_training = torch.is_grad_enabled() or self.root_ctx.backward_running
            check.record("all-gather", self.position, in_training)
        with profiled("all_gather_copy_out", self.name):
            self._all_gather.copy_out(self._unsharded.outputs(world_size))
            self.root_ctx.comm.copied_out(self._all_gather.all_gather_output)
            for fsdp_param in self._extended:
                fsdp_param.finish_unshard()
            if self.whole_params:
                self.root_ctx.comm.wait_for_optimizer()
            for fsdp_param in self.whole_params:
                fsdp_param.copy_whole()
        self._all_gather = None
        self._post_forward_shard = None
        self._put_on_modules([p.unsharded_param for p in self.fsdp_params])
        logger.debug("%s: unsharded", self.name)
        self.sharded_state = ShardedState.UNSHARDED

    def _unshard_world_size(self) -> int:
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            return self._post_forward_info().shard_world_size
        return self.mesh_info.shard_world_size

    def _post_forward_info(self) -> MeshInfo:
        if self.post_forward_mesh_info is None:
            raise self.fail("resharding to a smaller group without one")
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
            for out in self._unsharded.outputs(info.shard_world_size)
        ]
        self._post_forward_shard = torch.cat(blocks)
        self._post_forward_shard_written = self.root_ctx.comm.shard_written()
        self._to_sharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reset_sharded_params(self) -> None:
        """After ``nn.Module._apply`` changed the sharded parameters (see
        ``FSDPParam.reset_sharded_param``)."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.reset_sharded_param(self.root_ctx.comm.ops)
        self._unsharded.forget()
        self.comms.all_gather.forget_kept()
        if self.comms.post_forward_all_gather is not None:
            self.comms.post_forward_all_gather.forget_kept()
        self.clear_divide_plan()  # the reduce dtype may have changed

    def _to_sharded(self) -> None:
        self._put_on_modules([p.sharded_param for p in self.fsdp_params])
        self._unsharded.free()
        for fsdp_param in self.whole_params:
            fsdp_param.free_unsharded()

    def _put_on_modules(self, params: list[nn.Parameter | None]) -> None:
        """``params[i]`` (one per ``fsdp_params[i]``) where that parameter sits."""
        for module_params, name, index in self._module_slots:
            module_params[name] = params[index]

    # -- forward ----------------------------------------------------------

    def pre_forward(self) -> None:
        """Unshards for a module call. A group of several modules is called again,
        still in FORWARD, for each further module, until ``post_forward`` ends
        its forward; the first call starts counting its ``PostBackward`` nodes."""
        if self.training_state is not TrainingState.FORWARD:
            self.post_backward_count = PostBackwardCount()
            if self.sharded_grads is not None:
                self.sharded_grads.release()  # dropped by zero_grad(): no memory through forward
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()

    def unshard_for_recomputation(self) -> None:
        """A forward recomputed inside backward (activation checkpointing) needs
        the parameters, possibly after this group's post-backward resharded them
        (a module called twice); the training state stays as backward set it,
        and post-backward or the final callback reshards."""
        self.unshard()
        self.wait_for_unshard()

    def choose_reshard_after_forward(self, reshard: bool) -> None:
        """The user's choice after fully_shard (``set_reshard_after_forward``, or
        torch's encoding of it set by a client): True or False, also without grad;
        a smaller group is chosen in fully_shard only."""
        self.reshard_after_forward = self.reshard_after_no_grad_forward = reshard
        if not reshard:
            self.post_forward_mesh_info = None

    def post_forward(self) -> None:
        if self.held_for_weight_grads:
            pass  # a split backward's weight half needs them: [Note: split backward]
        elif not torch.is_grad_enabled() and self.reshard_after_no_grad_forward:
            self.reshard()
        elif self.post_forward_mesh_info is not None:
            self._reshard_post_forward()
        elif self.reshard_after_forward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    # -- backward ---------------------------------------------------------

    def pre_backward(self) -> bool:
        """Unshards for backward; returns False if this iteration already did."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False  # one hook per output tensor: only the first acts
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()  # no-op when resharding after forward is off or it was prefetched
            self.wait_for_unshard()
        return True

    def prefetch_for_backward(self) -> None:
        if self.unshard_in_backward:
            self.unshard()

    def divide_plan(self, sum_dtype: torch.dtype) -> DividePlan:
        """How this group's reductions divide (divide.py), made once: the
        setters that change it call ``clear_divide_plan``."""
        if self._divide_plan is None or self._divide_plan[0] is not sum_dtype:
            info, settings = self.mesh_info, self.settings
            plan = divide_plan(
                self.comms.reduce_scatter.collectives.backend,
                sum_dtype,
                info.shard_world_size,
                info.replicate_world_size,
                self.gradient_divide_factor,
                # A compressed reduction sums: no AVG or PREMUL_SUM on either stage.
                self.force_sum_reduction_for_comms or settings.compression.gradients is not None,
                one_rank_collectives=settings.one_rank_collectives,
            )
            self._divide_plan = (sum_dtype, plan)
        return self._divide_plan[1]

    def clear_divide_plan(self) -> None:
        self._divide_plan = None

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
        whose module did not run): see ``CommContext.dropped``."""
        if self._all_gather is not None:
            all_gather, self._all_gather = self._all_gather, None
            self.root_ctx.comm.dropped(all_gather.all_gather_output, all_gather.in_flight)

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
        self.post_backward_count = None
        self.held_for_weight_grads = False
        self.training_state = TrainingState.IDLE

    def finalize_backward(self) -> None:
        self.training_state = TrainingState.IDLE

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.name!r}, {len(self.fsdp_params)} params)"
