"""Where one training step's time goes, from torch.profiler ranges.

``scripts/bench.py --profile`` profiles a few steps of fsdp2 and of DDP and
splits each step's wall time into the phases the benchmark marks
(``bench::forward``, ``bench::loss``, ``bench::backward``, ``bench::optimizer``)
and, inside them, the ranges fsdp2 emits around its own work
(``fsdp2::all_gather_copy_in``, ``fsdp2::wait (...)``, ...). A range counts its
own time: nested fsdp2 ranges and tensor allocations (``aten::empty*``,
anywhere, the model's included) are counted in their own rows. Compute is what is left of a phase
once fsdp2's ranges are taken out; "unexplained" is the step's wall time no
phase covers. Communication itself runs on the backend's threads (gloo) or
streams: what the training thread sees of it are the waits, and compute
slowed down by sharing the cores with it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

PHASES = ("forward", "loss", "backward", "optimizer")
# fsdp2 range (its name without the group) -> row of the budget.
ROWS = {
    "fsdp2::pre_forward": "hooks: pre-forward",
    "fsdp2::post_forward": "hooks: post-forward",
    "fsdp2::pre_backward": "hooks: pre-backward",
    "fsdp2::post_backward": "post-backward (grads taken, reshard)",
    "fsdp2::final_callback": "hooks: final callback",
    "fsdp2::all_gather_copy_in": "all-gather copy-in",
    "fsdp2::all_gather": "all-gather issue",
    "fsdp2::all_gather_copy_out": "all-gather copy-out",
    "fsdp2::reduce_scatter_copy_in": "reduce-scatter copy-in (+ 16-bit divide)",
    "fsdp2::reduce_scatter": "reduce-scatter issue",
    "fsdp2::all_reduce": "all-reduce issue",
    "fsdp2::assign_grads": "grad division and accumulation",
    "fsdp2::wait (all-gather": "exposed wait: all-gather",
    "fsdp2::wait (reduce-scatter": "exposed wait: reduce-scatter",
    "fsdp2::wait (all-reduce": "exposed wait: all-reduce",
}
ALLOCATIONS = "allocations (aten::empty*, all)"
_GROUP = re.compile(r" \(.*\)$")


def _row(name: str) -> str | None:
    if name.startswith("fsdp2::wait ("):
        kind = name.split("(", 1)[1].split(" of ", 1)[0]
        return ROWS.get(f"fsdp2::wait ({kind}")
    return ROWS.get(_GROUP.sub("", name))


def profile_budget(run_step: Callable[[int], None], steps: int) -> dict[str, float]:
    """Milliseconds per step by row, from ``steps`` calls of ``run_step(i)``,
    which must mark its phases with ``torch.profiler.record_function("bench::...")``."""
    import time

    wall = 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            start = time.perf_counter()
            run_step(i)
            wall += time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)  # microseconds

    def own_time(event) -> float:
        """The event's time, less that of fsdp2 ranges and allocations nested in it
        (each counted in its own row)."""
        nested = 0.0
        for child in event.cpu_children:
            if _row(child.name) is not None:
                nested += child.cpu_time_total
                account(child)
            elif child.name.startswith("aten::empty"):
                nested += child.cpu_time_total
                totals[ALLOCATIONS] += child.cpu_time_total
            else:  # compute: only what fsdp2 and allocations took inside it is taken out
                nested += child.cpu_time_total - own_time(child)
        return event.cpu_time_total - nested

    def account(event) -> None:
        totals[_row(event.name)] += own_time(event)

    for event in prof.events():
        if event.cpu_parent is None and event.name.startswith("bench::"):
            totals[event.name.removeprefix("bench::")] += own_time(event)
    budget = {row: us / 1e3 / steps for row, us in totals.items()}
    budget["step"] = 1e3 * wall / steps
    budget["unexplained"] = budget["step"] - sum(
        v for k, v in budget.items() if k not in ("step", "unexplained")
    )
    return budget


def print_budget(budgets: dict[str, dict[str, float]], title: str) -> None:
    """One column per contender, one row per part of the step (ms per step)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("ms per step", justify="left")
    for name in budgets:
        table.add_column(name, justify="right")
    rows = [
        ("forward compute", "forward"),
        ("loss", "loss"),
        ("backward compute", "backward"),
        ("optimizer step", "optimizer"),
        *((label, label) for label in dict.fromkeys(ROWS.values())),
        (ALLOCATIONS, ALLOCATIONS),
        ("unexplained", "unexplained"),
    ]
    for label, key in rows:
        if any(key in b for b in budgets.values()):
            table.add_row(label, *(f"{b.get(key, 0.0):.1f}" for b in budgets.values()))
    table.add_row("step (wall)", *(f"{b['step']:.1f}" for b in budgets.values()), style="bold")
    Console(width=120).print(table)


def record(phase: str):
    """``with record("forward"):`` marks a phase of a benchmarked step."""
    return torch.profiler.record_function(f"bench::{phase}")
