"""The records of ``fsdp2.comm_stats``: what each group sent, and how long
compute waited for it.

A *step* ends when a backward ends (the final callback), so ``steps`` has one
entry per backward; collectives of a forward without backward (e.g.
evaluation) go into the step still open.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
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


# Every kind of collective a group records.
KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "replica_all_gather",
    "replica_reduce_scatter",
)


@dataclass
class GroupStats:
    all_gather: CollectiveStats = field(default_factory=CollectiveStats)
    reduce_scatter: CollectiveStats = field(default_factory=CollectiveStats)
    # Across HSDP replicas, and of whole parameters' gradients (min_numel_to_shard).
    all_reduce: CollectiveStats = field(default_factory=CollectiveStats)
    # shard_optimizer_over_replicas: across the replicas, of the shard group's chunks.
    replica_all_gather: CollectiveStats = field(default_factory=CollectiveStats)
    replica_reduce_scatter: CollectiveStats = field(default_factory=CollectiveStats)

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
                for kind in KINDS:
                    into, add = total[group].of(kind), stats.of(kind)
                    into.count += add.count
                    into.bytes += add.bytes
                    into.wait_seconds += add.wait_seconds
                    into.ready_when_waited += add.ready_when_waited
        return dict(total)

    def __str__(self) -> str:
        """A table of :meth:`totals`, one row per group: what ``print(stats)`` shows."""
        return format_table(self.totals(), steps=len(self.steps))

    def __repr__(self) -> str:
        return f"CommStats(steps={len(self.steps)}, groups={list(self.totals())})"


def format_table(totals: dict[str, GroupStats], steps: int) -> str:
    """Per group: the count and bytes of each collective, the time the training
    thread waited for them and how many were done when waited for (hidden)."""
    plural = "" if steps == 1 else "s"  # a step is one backward: see the module's docstring
    headers = [
        "group",
        "all-gathers",
        "bytes",
        "reduce-scatters",
        "bytes",
        "all-reduces",
        "bytes",
        "wait",
        "ready when waited",
    ]
    # shard_optimizer_over_replicas: its collectives across replicas, when there are any.
    replicas = any(
        stats.replica_all_gather.count or stats.replica_reduce_scatter.count
        for stats in totals.values()
    )
    if replicas:
        headers[-2:-2] = ["replica all-gathers", "bytes", "replica reduce-scatters", "bytes"]
    rows = []
    waited = 0.0
    for group, stats in totals.items():
        kinds = [stats.all_gather, stats.reduce_scatter, stats.all_reduce]
        if replicas:
            kinds += [stats.replica_all_gather, stats.replica_reduce_scatter]
        wait = sum(k.wait_seconds for k in kinds)
        waited += wait
        counts = [c for k in kinds for c in (f"{k.count:,}", human_bytes(k.bytes))]
        ready = sum(k.ready_when_waited for k in kinds)
        rows.append(
            [
                group,
                *counts,
                f"{wait * 1e3:.1f} ms",
                f"{ready:,} of {sum(k.count for k in kinds):,}",
            ]
        )
    per_step = f", {waited / steps * 1e3:.1f} ms per backward" if steps else ""
    return render_table(
        f"fsdp2 communication, totals over {steps} backward{plural}",
        [(name, "left" if name == "group" else "right") for name in headers],
        rows,
        f"waited {waited * 1e3:.1f} ms in all{per_step} (exposed communication)",
    )


def human_bytes(nbytes: int) -> str:
    """``nbytes`` for people: B, KiB, MiB or GiB."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# The text tables of ``summary`` and ``comm_stats``: box-drawn, each column as
# wide as its widest cell (nothing is cut or wrapped, whatever the terminal),
# the title above and the caption below, centred; plain Python, so that the
# package needs only torch and numpy.
def render_table(
    title: str,
    columns: Sequence[tuple[str, str]],
    rows: Sequence[Sequence[str]],
    caption: str = "",
) -> str:
    """``columns`` are ``(header, "left" | "right")``; each row has one cell per column."""
    widths = [
        max([len(header), *(len(row[i]) for row in rows)]) for i, (header, _) in enumerate(columns)
    ]

    def line(cells: Sequence[str], justify: Sequence[str]) -> str:
        padded = [
            cell.ljust(width) if side == "left" else cell.rjust(width)
            for cell, width, side in zip(cells, widths, justify, strict=True)
        ]
        return "│ " + " │ ".join(padded) + " │"

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * (width + 2) for width in widths) + right

    sides = [side for _, side in columns]
    body = [
        rule("┌", "┬", "┐"),
        line([header for header, _ in columns], sides),
        rule("├", "┼", "┤"),
        *(line(row, sides) for row in rows),
        rule("└", "┴", "┘"),
    ]
    width = len(body[0])
    lines = [title.center(width).rstrip(), *body]
    if caption:
        lines.append(caption.center(width).rstrip())
    return "\n".join(lines)
