"""Execution-order check: catch ranks that run sharded modules in different orders.

[Note: why order matters]
Every rank issues one all-gather per group and one reduce-scatter per group,
and collectives pair up by position, not by name. If rank 1 runs its blocks in
another order than rank 0 (data-dependent control flow, a skipped module), its
all-gather of block 2 pairs with rank 0's all-gather of block 3: with
same-shaped blocks nothing fails, the ranks just swap weights silently;
otherwise the run hangs or aborts with a size mismatch.

When on (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or ``set_check_execution_order``
on the root), the first iteration precedes every all-gather and reduce-scatter
with a tiny all-gather of (kind, group index, numel) over the same process
group, and all ranks raise together when they disagree. Later iterations cost
nothing across ranks: each rank compares its sequence with its own first one
and warns once if it deviates.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .param_group import FSDPParamGroup

_KINDS = ("all-gather", "reduce-scatter", "all-reduce")


class ExecutionOrderCheck:
    def __init__(self, groups: list[FSDPParamGroup], device: torch.device) -> None:
        self._groups = groups  # pre-order from the root: the same on every rank
        self._index = {id(g): i for i, g in enumerate(groups)}
        self._device = device
        self._first: list[tuple[int, int]] | None = None  # the first iteration's sequence
        self._current: list[tuple[int, int]] = []
        self._warned = False

    def start_iteration(self) -> None:
        if self._current:
            if self._first is None:
                self._first = self._current
            self._current = []

    def discard_iteration(self) -> None:
        """Forgets an iteration that an exception interrupted."""
        self._current = []

    def before_collective(
        self, kind: str, group: FSDPParamGroup, process_group: dist.ProcessGroup, numel: int
    ) -> None:
        entry = (_KINDS.index(kind), self._index[id(group)])
        position = len(self._current)
        self._current.append(entry)
        if self._first is None:
            self._check_across_ranks(entry, position, process_group, numel)
        elif not self._warned and (position >= len(self._first) or self._first[position] != entry):
            self._warned = True
            expected = (
                self._describe(self._first[position]) if position < len(self._first) else "nothing"
            )
            warnings.warn(
                f"fsdp2: this rank's collective #{position} of the iteration is the "
                f"{self._describe(entry)}, but in the first iteration it was {expected}. If "
                "other ranks do not deviate the same way, they exchange the wrong groups. "
                "(Warned once.)",
                stacklevel=4,
            )

    def _check_across_ranks(
        self,
        entry: tuple[int, int],
        position: int,
        process_group: dist.ProcessGroup,
        numel: int,
    ) -> None:
        world_size = dist.get_world_size(process_group)
        mine = torch.tensor([*entry, numel], dtype=torch.int64, device=self._device)
        everyone = torch.empty(world_size * 3, dtype=torch.int64, device=self._device)
        dist.all_gather_single(everyone, mine, group=process_group)
        rows = everyone.view(world_size, 3).tolist()
        if all(row == rows[0] for row in rows):
            return
        ranks = dist.get_process_group_ranks(process_group)
        lines = "\n".join(
            f"  rank {rank}: {self._describe((kind, index))} ({n} elements)"
            for rank, (kind, index, n) in zip(ranks, rows, strict=True)
        )
        raise RuntimeError(
            f"fsdp2 execution order check: at collective #{position} of the first iteration the "
            f"ranks are about to communicate different groups:\n{lines}\n"
            "Every rank must run the same sharded modules in the same order (no data-dependent "
            "skipping or reordering of modules). Without this check those collectives would pair "
            "up anyway: a hang, or groups silently exchanging each other's weights."
        )

    def _describe(self, entry: tuple[int, int]) -> str:
        kind, index = entry
        return f"{_KINDS[kind]} of {self._groups[index].fqn!r}"
