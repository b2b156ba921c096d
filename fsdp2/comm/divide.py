"""How a group's gradient reduction divides: ``divide_plan``, a pure choice
from the backend, the dtype the ranks' gradients are summed in, the world
sizes and the group's settings (docs/design.md, "Gradients")."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..base.private_dist import premul_sum
from .primitives import ReduceOp


class DividePlan(NamedTuple):
    """Where a gradient reduction divides: before, inside (the collectives'
    ops) or after its collectives."""

    pre_divisor: float | None  # of the reduce-scatter input (and whole parameters' grads)
    # Of the reduce-scatter and of the whole parameters' all-reduce over the shard group.
    reduce_scatter_op: ReduceOp
    all_reduce_op: ReduceOp  # HSDP: of the stage across replicas
    post_divisor: float | None  # of the output, after the last collective
    # The post-division stands in for an averaging op the backend lacks (gloo):
    # made before the all-reduce hook, which then sees what an averaging
    # collective gives. Else (NCCL) it follows the hook, as torch's does.
    divides_before_hook: bool = False


def divide_plan(
    backend: str,
    reduce_dtype: torch.dtype,
    shard_world_size: int,
    replicate_world_size: int = 1,
    factor: float | None = None,
    force_sum: bool = False,
    one_rank_collectives: bool = False,
) -> DividePlan:
    """How a group's gradients are averaged over its ``shard_world_size *
    replicate_world_size`` ranks, or divided by ``factor``
    (``set_gradient_divide_factor``), on ``backend``: torch's fully_shard's
    choice on NCCL, summing collectives elsewhere.

    - NCCL, fp32 or bf16 (no overflow risk), unless ``force_sum``
      (``set_force_sum_reduction_for_comms``): the collectives divide.
      ``ReduceOp.AVG`` for both (``SUM`` over a single rank); with a factor,
      a reduce-scatter that multiplies by ``1 / factor`` before summing
      (``PREMUL_SUM``, ``AVG`` if the factor is the shard group's size), then
      a summing all-reduce. Over one rank the input is divided by the
      factor instead: the reduce-scatter does not run, and where it is forced
      to, NCCL's one-rank path leaves PREMUL_SUM's factor out (an H100,
      NCCL 2.28.9: ``make gpu-check``'s arithmetic row).
    - NCCL otherwise: sums; fp32 and bf16 divided after, other dtypes (fp16)
      by a power of two near the divisor's square root before the sum and by
      the rest after, so that neither the sum nor the quotients leave fp16's
      range.
    - Other backends (gloo has neither ``AVG`` nor ``PREMUL_SUM``): sums;
      16-bit dtypes divided before the sum (it cannot overflow), others after.

    A division by 1 is left out. ``one_rank_collectives`` (a switch for
    checks, check_switches.py): on NCCL, a world of one still averages in its
    collectives (``AVG``), as a larger one would.
    """
    ranks = shard_world_size * replicate_world_size
    divisor = float(ranks if factor is None else factor)
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    if backend != "nccl":
        if reduce_dtype.itemsize < 4:
            return DividePlan(_unless_one(divisor), SUM, SUM, None)
        return DividePlan(None, SUM, SUM, _unless_one(divisor), divides_before_hook=True)
    no_overflow_risk = reduce_dtype in (torch.float32, torch.bfloat16)
    if no_overflow_risk and not force_sum:
        if factor is None:
            op = SUM if ranks == 1 and not one_rank_collectives else AVG
            return DividePlan(None, op, op, None)
        if factor == shard_world_size:
            return DividePlan(None, AVG, SUM, None)
        if shard_world_size == 1:  # forced too: a one-rank PREMUL_SUM drops its factor
            return DividePlan(factor, SUM, SUM, None)
        return DividePlan(None, premul_sum(1 / factor), SUM, None)
    if no_overflow_risk:
        return DividePlan(None, SUM, SUM, _unless_one(divisor))
    pre = 1
    while divisor % pre == 0 and divisor / pre > pre:
        pre *= 2
    return DividePlan(_unless_one(pre), SUM, SUM, _unless_one(divisor / pre))


def _unless_one(divisor: float) -> float | None:
    return None if divisor == 1 else divisor
