"""RootContext: what every state and group under one root shares.

Each state starts with a context of its own; the root's replaces them at lazy
init. It holds the comm context, the reduction pipeline, the order in which
groups ran forward (for prefetching, both ways), the execution-order check,
and the final callback queued once per backward.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from ..base.log import logger
from ..base.private_api import profiled, queue_backward_callback
from ..comm.context import CommContext
from .execution_order import ExecutionOrderCheck
from .param_group import FSDPParamGroup
from .reduction import ReductionPipeline
from .states import TrainingState, eager_hook


class RootedState(Protocol):
    """What a root reads of each state under it (``FSDPState``, state.py)."""

    param_groups: list[FSDPParamGroup]
    # The modules of a fully_shard([...]) call still to run in its group's forward.
    modules_to_run: set[nn.Module]


class RootContext:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.comm = CommContext(device)
        self.reductions = ReductionPipeline(self)
        self.states: list[RootedState] = []  # pre-order from the root
        # Backward prefetch: the groups in the order their forward ended, this
        # iteration's, and each group's positions in it (one per forward call).
        self.post_forward_order: list[FSDPParamGroup] = []
        self._post_forward_positions: dict[FSDPParamGroup, list[int]] = {}
        # Forward prefetch: groups in the order their forward started, this
        # iteration's, and the successor of each in the previous iteration's.
        self.pre_forward_order: list[FSDPParamGroup] = []
        self.next_in_forward: dict[FSDPParamGroup, FSDPParamGroup] = {}
        self.forward_started: set[FSDPParamGroup] = set()
        # The implicit forward prefetch in flight: dropped if another group starts first.
        self.forward_guess: FSDPParamGroup | None = None
        # The state whose forward is running outermost.
        self.forward_root: RootedState | None = None
        # Between the first pre-backward hook of a backward and its final callback.
        self.backward_running = False
        self.check_execution_order = False  # or TORCH_DISTRIBUTED_DEBUG=DETAIL at lazy init
        self.order_check: ExecutionOrderCheck | None = None  # made at lazy init when asked for

    @property
    def groups(self) -> list[FSDPParamGroup]:
        return [g for s in self.states for g in s.param_groups]

    def enable_order_check(self, enabled: bool) -> None:
        self.check_execution_order = enabled
        if not self.states:
            return  # lazy init makes it
        names = [g.name for g in self.groups]
        self.order_check = ExecutionOrderCheck(names, self.device) if enabled else None

    def reset(self) -> None:
        """Returns everything under the root to a clean, idle, sharded state after
        an exception interrupted forward or backward."""
        for group in self.groups:
            group.reset()
        self.reductions.reset()
        for state in self.states:
            state.modules_to_run.clear()
        self.forward_root = None
        self.post_forward_order.clear()
        self._post_forward_positions.clear()
        self.pre_forward_order.clear()
        self.forward_started.clear()
        self.forward_guess = None
        self.backward_running = False
        self.comm.shards_may_change()
        if self.order_check is not None:
            self.order_check.discard_iteration()

    # -- forward ------------------------------------------------------------

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

    def end_forward_of(self, group: FSDPParamGroup) -> None:
        """A group's forward ends: remembered for backward prefetch, then resharded."""
        if torch.is_grad_enabled():
            self._post_forward_positions.setdefault(group, []).append(len(self.post_forward_order))
            self.post_forward_order.append(group)
        group.post_forward()

    def finish_partial_forwards(self, forward_root: RootedState) -> None:
        """End of the outermost forward: a group of several modules of which only
        some ran ends its forward now (see [Note: one group, several modules])."""
        for state in reversed(self.states):  # innermost first, as post-hooks unwind
            if state is not forward_root and state.modules_to_run:
                state.modules_to_run.clear()
                for group in state.param_groups:
                    self.end_forward_of(group)

    # -- backward -----------------------------------------------------------

    def prefetch_previous(self, group: FSDPParamGroup) -> None:
        """Implicit backward prefetch: backward runs forward's order in reverse,
        so the group that finished forward just before ``group`` is next."""
        positions = self._post_forward_positions.get(group)
        if not positions:
            return
        position = positions.pop()
        if position > 0:
            target = self.post_forward_order[position - 1]
            if target.training_state is not TrainingState.POST_BACKWARD:
                target.prefetch_for_backward()

    def queue_final_callback(self) -> None:
        """Once per backward: run :meth:`end_backward` when the engine is done."""
        if not self.backward_running:
            self.backward_running = True
            queue_backward_callback(self.end_backward)

    @eager_hook
    def end_backward(self) -> None:
        """The final callback: finishes this backward's groups and reductions.
        A pipeline schedule also calls it once per step, after its last
        microbatch (torch_internals.py)."""
        logger.debug("final callback: finishing backward")
        with profiled("final_callback"):
            for state in self.states:
                # Empty unless a forward was left open: the outermost forward closes them.
                state.modules_to_run.clear()
            # Reverse pre-order approximates backward order for the stragglers.
            self.reductions.finish_backward(reversed(self.groups))
            self.post_forward_order.clear()
            self._post_forward_positions.clear()
            if self.order_check is not None:
                self.order_check.end_iteration()
            self.backward_running = False
            self.comm.shards_may_change()
            if self.comm.stats is not None:
                self.comm.stats.end_step()
