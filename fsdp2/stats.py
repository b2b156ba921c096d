"""The records of ``fsdp2.comm_stats``: what each group sent, and how long
compute waited for it.

A *step* ends when a backward ends (the final callback), so ``steps`` has one
entry per backward; collectives of a forward without backward (e.g.
evaluation) go into the step still open.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class CollectiveStats:
    """One kind of collective of one group."""

    count: int = 0
    bytes: int = 0  # of the full (gathered, or to-be-reduced) buffer, padding included
    # Time the training thread was blocked waiting for it: exposed communication.
    # On accelerators waiting is asynchronous, so this is only host-side time.
    wait_seconds: float = 0.0
    # Finished by the time they were waited for: fully hidden behind compute.
    ready_when_waited: int = 0


@dataclass
class GroupStats:
    all_gather: CollectiveStats = field(default_factory=CollectiveStats)
    reduce_scatter: CollectiveStats = field(default_factory=CollectiveStats)
    # Across HSDP replicas, and of replicated parameters' gradients (min_numel_to_shard).
    all_reduce: CollectiveStats = field(default_factory=CollectiveStats)

    def of(self, kind: str) -> CollectiveStats:
        return getattr(self, kind)


class CommStats:
    """Per-step, per-group statistics recorded by ``comm_stats``."""

    def __init__(self) -> None:
        self.steps: list[dict[str, GroupStats]] = []
        self._current: dict[str, GroupStats] = defaultdict(GroupStats)

    def record(self, group: str, kind: str) -> CollectiveStats:
        return self._current[group].of(kind)

    def end_step(self) -> None:
        self.steps.append(dict(self._current))
        self._current = defaultdict(GroupStats)

    def totals(self) -> dict[str, GroupStats]:
        """Sums over every step (the open one included), per group."""
        total: dict[str, GroupStats] = defaultdict(GroupStats)
        for step in [*self.steps, self._current]:
            for group, stats in step.items():
                for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                    into, add = total[group].of(kind), stats.of(kind)
                    into.count += add.count
                    into.bytes += add.bytes
                    into.wait_seconds += add.wait_seconds
                    into.ready_when_waited += add.ready_when_waited
        return dict(total)
