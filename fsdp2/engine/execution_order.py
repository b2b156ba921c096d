"""Execution-order check: catch ranks that run sharded modules in different orders.

[Note: why order matters]
Every rank issues one all-gather per group and one reduce-scatter per group,
and collectives pair up by position, not by name. If rank 1 runs its blocks in
another order than rank 0 (data-dependent control flow, a skipped module), its
all-gather of block 2 pairs with rank 0's all-gather of block 3: with
same-shaped blocks nothing fails, the ranks just swap weights silently;
otherwise the run hangs or aborts with a size mismatch.

When on (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or ``set_check_execution_order``
on the root), every collective is preceded by a tiny all-gather of (kind,
group index, numel) over the same process group, and all ranks raise together
when they disagree, until the first *training iteration* has been seen whole:
forwards with grad enabled and the backward that follows, up to a final
callback in which gradients were reduce-scattered. The order in which that
iteration *used* all-gathers and issued reductions (the modules' execution
order, whatever prefetching guessed) is the reference. Later training
iterations cost nothing across ranks: each rank compares its use order with
the reference and warns once if it deviates. Forwards without grad and
backwards without gradient sync are not compared (they legitimately differ
from a training iteration).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..base.private_dist import unseen_by_dispatch_modes
from ..comm.primitives import Collectives
from ..comm.timeouts import naming_failures

_KINDS = ("all-gather", "reduce-scatter", "all-reduce")


class ExecutionOrderCheck:
    """Of the groups under one root, named by ``names`` and told apart by their
    position in it (pre-order from the root: the same on every rank)."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self._names = names
        self._device = device
        # The first synced training iteration's sequence of (kind, group index).
        self._reference: list[tuple[int, int]] | None = None
        self._current: list[tuple[int, int]] = []
        self._warned = False

    def end_iteration(self) -> None:
        """At the end of a backward: the first synced iteration becomes the
        reference; later ones must not have run fewer collectives than it."""
        current, self._current = self._current, []
        synced = any(kind == _KINDS.index("reduce-scatter") for kind, _ in current)
        if not synced:
            return
        if self._reference is None:
            self._reference = current
        elif len(current) < len(self._reference):
            self._warn(
                f"this rank ran {len(current)} collectives in this iteration, but "
                f"{len(self._reference)} in the reference one"
            )

    def discard_iteration(self) -> None:
        """Forgets an iteration that an exception interrupted."""
        self._current = []

    def before_collective(
        self, kind: str, group_position: int, collectives: Collectives, numel: int
    ) -> None:
        """Until the reference exists: all ranks must be issuing the same collective."""
        if self._reference is None:
            position = len(self._current)
            entry = (_KINDS.index(kind), group_position)
            self._check_across_ranks(entry, position, collectives, numel)

    def record(self, kind: str, group_position: int, in_training: bool) -> None:
        """A collective's result is used (an all-gather) or one is issued (a
        reduction). Recorded in use order, which follows the modules' execution
        order and so does not depend on how far ahead prefetching guessed.
        ``in_training``: by a forward with grad enabled, or by a backward."""
        if not in_training:
            return
        entry = (_KINDS.index(kind), group_position)
        position = len(self._current)
        self._current.append(entry)
        reference = self._reference
        if reference is not None and (position >= len(reference) or reference[position] != entry):
            expected = (
                self._describe(reference[position]) if position < len(reference) else "nothing"
            )
            self._warn(
                f"this rank's collective #{position} of the iteration is the "
                f"{self._describe(entry)}, but in the reference iteration it was {expected}"
            )

    def _warn(self, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"fsdp2 execution order check (rank {dist.get_rank()}): {what}. Unless every rank "
            "deviates the same way, ranks are exchanging the wrong groups. (Warned once.)",
            stacklevel=2,
        )

    def _check_across_ranks(
        self,
        entry: tuple[int, int],
        position: int,
        collectives: Collectives,
        numel: int,
    ) -> None:
        process_group = collectives.process_group
        world_size = dist.get_world_size(process_group)
        mine = torch.tensor([*entry, numel], dtype=torch.int64, device=self._device)
        everyone = torch.empty(world_size * 3, dtype=torch.int64, device=self._device)
        what = f"execution order check's all-gather before the {self._describe(entry)}"
        with naming_failures(what, collectives), unseen_by_dispatch_modes():
            collectives.all_gather(everyone, mine)
        rows = everyone.view(world_size, 3).tolist()
        if all(row == rows[0] for row in rows):
            return
        ranks = dist.get_process_group_ranks(process_group)
        lines = "\n".join(
            f"  rank {rank}: {self._describe((kind, index))} ({n} elements)"
            for rank, (kind, index, n) in zip(ranks, rows, strict=True)
        )
        raise RuntimeError(
            f"fsdp2 execution order check: at collective #{position} of the iteration the "
            f"ranks are about to communicate different groups:\n{lines}\n"
            "Every rank must run the same sharded modules in the same order (no data-dependent "
            "skipping or reordering of modules). Without this check those collectives would pair "
            "up anyway: a hang, or groups silently exchanging each other's weights."
        )

    def _describe(self, entry: tuple[int, int]) -> str:
        kind, index = entry
        return f"{_KINDS[kind]} of {self._names[index]!r}"
