"""fsdp2's reduce-scatter replaced by one that sums the ranks in another order
(what another backend or machine may do) or wrongly (a bug the parity tests
must catch), to check that the tolerances of tests/error_model.py hold on
machines we do not have and still fail on real bugs.

Set ``FSDP2_TEST_REDUCTION`` in the environment of the test run; every rank of
``dist.run_ranks`` installs it before the test body. Used by
tests/test_error_model.py and by hand, e.g.
``FSDP2_TEST_REDUCTION=reverse pytest tests/test_parity.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp2.comm.primitives import Collectives, GlooCollectives

ENV = "FSDP2_TEST_REDUCTION"


def _in_order(order: list[int]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def total(rows: list[torch.Tensor]) -> torch.Tensor:
        out = rows[order[0]].clone()
        for r in order[1:]:
            out += rows[r]
        return out

    return total


def _tree(rows: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise, as a tree reduction: (r0 + r1) + (r2 + r3) + ..."""
    while len(rows) > 1:
        rows = [sum(rows[i : i + 2]) for i in range(0, len(rows), 2)]  # type: ignore[misc]
    return rows[0]


def _reduction(mode: str, world_size: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    forward = list(range(world_size))
    if mode == "reverse":  # benign: the ranks summed last to first
        return _in_order(forward[::-1])
    if mode == "tree":  # benign: pairwise, as NCCL's tree all-reduce
        return _tree
    if mode == "drop_rank":  # a bug: the last rank's gradient is lost
        return _in_order(forward[:-1]) if world_size > 1 else (lambda rows: rows[0] * 0)
    if mode == "scale":  # a bug: averaged over W - 1 ranks' worth
        return lambda rows: _in_order(forward)(rows) * ((world_size - 1) / world_size)
    raise ValueError(f"{ENV}={mode!r}: expected reverse, tree, drop_rank or scale")


class _Done:
    """The work handle of a reduce-scatter that has already finished."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def install_from_environment() -> None:
    """Replaces fsdp2's reduce-scatter (of every collectives class, for the rest
    of this process) if ``FSDP2_TEST_REDUCTION`` is set."""
    mode = os.environ.get(ENV)
    if not mode:
        return

    def reduce_scatter(
        self: Collectives,
        output: torch.Tensor,
        input: torch.Tensor,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> _Done | None:
        assert op == dist.ReduceOp.SUM, op  # gloo: fsdp2 sums and divides
        group = self.process_group
        world_size, rank = group.size(), group.rank()
        gathered = input.new_empty(world_size * input.numel())
        dist.all_gather_single(gathered, input.reshape(-1), group=group)
        rows = [block.view(world_size, -1)[rank] for block in gathered.chunk(world_size)]
        output.view(-1).copy_(_reduction(mode, world_size)(rows))
        return _Done() if async_op else None

    for cls in (Collectives, GlooCollectives):
        cls.reduce_scatter = reduce_scatter  # type: ignore[method-assign]
