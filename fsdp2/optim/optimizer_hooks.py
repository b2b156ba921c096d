"""The one pair of process-wide optimizer hooks fsdp2 registers (at the first
root's lazy init), and what it keeps on each optimizer.

At an optimizer's first step, and again when its parameters change
(``add_param_group``), the pre-hook works out a ``StepPlan`` and keeps it on
the optimizer: whether mistakes.py's first-step checks have passed, and
which of its parameters are pieces sharded over replicas (their kept chunks
are stale once stepped: over_replicas.py), and, for an elementwise torch
optimizer that holds fsdp2 parameters, the ``LocalInitGroup`` that makes it
step their local tensors (local_step.py). After that a step costs each hook
one lookup and a count of the parameters per param group, plus one
attribute per piece; an optimizer that holds no fsdp2 parameter pays nothing
else.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..base.markers import KEPT_CHUNK, SHARDED
from ..checks.mistakes import check_optimizer
from ..engine.reduction import ReductionPipeline
from ..engine.states import eager_hook
from .local_step import LocalInitGroup, install_local_step

# On an optimizer: its StepPlan.
_PLAN = "_fsdp2_step_plan"


class StepPlan(NamedTuple):
    sizes: tuple[int, ...]  # parameters per param group when the plan was made
    checked: bool  # mistakes.py's first-step checks passed
    pieces: tuple[torch.Tensor, ...]  # parameters sharded over replicas
    local: LocalInitGroup | None  # steps the local tensors (local_step.py)


@functools.cache
def install_optimizer_hooks() -> None:
    """Registers the pair for every optimizer, once per process."""
    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)


def _sizes(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(len(group["params"]) for group in optimizer.param_groups)


@eager_hook
def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if ReductionPipeline.left_in_flight:  # set_is_last_backward(False), then a step
        ReductionPipeline.finish_left_in_flight()
    plan = optimizer.__dict__.get(_PLAN)
    sizes = _sizes(optimizer)
    if plan is not None and plan.checked and plan.sizes == sizes:
        return
    checked = (plan is not None and plan.checked) or check_optimizer(optimizer)
    holds_fsdp2 = any(SHARDED in p.__dict__ for g in optimizer.param_groups for p in g["params"])
    pieces = tuple(
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if (layout := p.__dict__.get(SHARDED)) is not None and layout.piece is not None
    )
    local = install_local_step(optimizer) if holds_fsdp2 else None
    optimizer.__dict__[_PLAN] = StepPlan(sizes, checked, pieces, local)


@eager_hook
def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The pieces this optimizer stepped are changed: version counters miss it
    (a ``foreach`` step on DTensors, the default on accelerators, bumps
    neither the DTensor's nor its local tensor's)."""
    plan = optimizer.__dict__.get(_PLAN)
    if plan is None:
        return
    if plan.local is not None:
        plan.local.restore_state()
    for piece in plan.pieces:
        if (kept := piece.__dict__.get(KEPT_CHUNK)) is not None:
            kept.stepped = True
