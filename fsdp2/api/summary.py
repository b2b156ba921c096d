"""What a user sees of a sharded model: ``summary(model)``, one row per param
group (how it is sharded), and ``comm_stats(model)``, what each group sent
and how long compute waited for it.

    with fsdp2.comm_stats(model) as stats:    # model: the root
        for batch in batches:
            train_step(batch)
    print(stats.steps[-1]["layers.0"].all_gather.bytes)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..base.version import TESTED_TORCH, __version__
from ..comm.stats import CommStats, human_bytes, render_table
from ..engine.param_group import FSDPParamGroup
from .state import FSDPState, get_fsdp_state


@dataclass(frozen=True)
class GroupSummary:
    module: str  # path from the model ("" for the model itself); "norm, output" for a list
    num_params: int  # parameters (tensors) in the group
    numel: int  # elements, unsharded
    unsharded_bytes: int  # of the all-gathered parameters, in the compute dtype
    shard_bytes: int  # this rank's shards, in the original dtype
    padding_bytes: int  # added to the all-gather buffer by uneven dim-0 sizes
    placements: str
    mesh: str
    reshard_after_forward: str
    param_dtype: str  # the compute dtype (MixedPrecisionPolicy.param_dtype)
    reduce_dtype: str
    storage_dtype: str = ""  # of the shards (the parameters' own dtype)


class Summary(list[GroupSummary]):
    """What ``summary`` returns: its rows, one per group, a list that prints as
    one line (the table is what ``summary`` prints on rank 0)."""

    def __repr__(self) -> str:
        return f"fsdp2.Summary({len(self)} param groups; fsdp2.summary(model) prints the table)"


def summary(model: nn.Module, *, print_table: bool = True) -> Summary:
    """Describes every param group under ``model``; works before the first step
    and on meta-device models (it reads only shapes and dtypes).

    Args:
        model: a sharded model (or any module containing sharded modules).
        print_table: print the rows as a table, on global rank 0 only.
            (Default: True)

    Returns:
        A ``Summary``: one ``GroupSummary`` per group, in module order. It
        prints as one line, so ``print(summary(model))`` shows the table once.
    """
    paths: dict[FSDPState, list[str]] = {}  # module paths of each state; a list's has several
    for path, module in model.named_modules():
        state = get_fsdp_state(module)
        if state is not None and state.param_groups:
            paths.setdefault(state, []).append(path)
    rows = []
    groups = [
        (state, state_paths, g) for state, state_paths in paths.items() for g in state.param_groups
    ]
    for state, state_paths, group in groups:
        params = group.fsdp_params
        world_size = group.mesh_info.shard_world_size
        # Whole parameters (min_numel_to_shard) are never padded.
        gathered_bytes = sum(
            p.layout.slot_numel * p.param_dtype.itemsize * (1 if p.layout.whole else world_size)
            for p in params
        )
        numel = sum(p.layout.unsharded_size.numel() for p in params)  # TP: this rank's part
        unsharded_bytes = sum(
            p.layout.unsharded_size.numel() * p.param_dtype.itemsize for p in params
        )
        param_dtypes = dict.fromkeys(str(p.param_dtype).removeprefix("torch.") for p in params)
        rows.append(
            GroupSummary(
                module=", ".join(state_paths),
                num_params=len(params),
                numel=numel,
                unsharded_bytes=unsharded_bytes,
                shard_bytes=sum(p.layout.local_numel * p.orig_dtype.itemsize for p in params),
                padding_bytes=gathered_bytes - unsharded_bytes,
                # Distinct ones: TP, shard_placement_fn and replication mix them.
                placements=" | ".join(dict.fromkeys(str(p.layout.placements) for p in params)),
                mesh=f"{tuple(group.mesh_info.mesh.shape)} {group.mesh_info.mesh.device_type}",
                reshard_after_forward=_reshard_policy(state, group, is_root=model in state.modules),
                param_dtype=" | ".join(param_dtypes),
                reduce_dtype=str(params[0].reduce_dtype).removeprefix("torch."),
                storage_dtype=" | ".join(
                    dict.fromkeys(str(p.orig_dtype).removeprefix("torch.") for p in params)
                ),
            )
        )
    if print_table and (not dist.is_initialized() or dist.get_rank() == 0):
        print_summary(rows)
    return Summary(rows)


def _reshard_policy(state: FSDPState, group: FSDPParamGroup, is_root: bool) -> str:
    if group.post_forward_mesh_info is not None:
        return f"to {group.post_forward_mesh_info.shard_world_size} ranks"
    if state.is_root is None and state.reshard_after_forward_arg is None:
        return str(not is_root)  # what lazy init will decide: off for the root only
    return str(group.reshard_after_forward)


def print_summary(rows: list[GroupSummary]) -> None:
    # The byte columns are in different dtypes: the all-gathered parameters in the
    # compute dtype, the shards in their own (storage) one.
    headers = (
        "module",
        "params",
        "numel",
        "unsharded, compute dtype",
        "shard (this rank), storage dtype",
        "padding",
        "placements",
        "mesh",
        "reshard",
        "compute",
        "storage",
        "reduce",
    )
    cells = [
        [
            r.module or "(root)",
            str(r.num_params),
            f"{r.numel:,}",
            human_bytes(r.unsharded_bytes),
            human_bytes(r.shard_bytes),
            human_bytes(r.padding_bytes),
            r.placements,
            r.mesh,
            r.reshard_after_forward,
            r.param_dtype,
            r.storage_dtype,
            r.reduce_dtype,
        ]
        for r in rows
    ]
    totals = (sum(r.unsharded_bytes for r in rows), sum(r.shard_bytes for r in rows))
    title = (
        f"fsdp2 {__version__} param groups (torch {torch.__version__}; tested with {TESTED_TORCH})"
    )
    left = ("module", "placements", "mesh")
    print(
        render_table(
            title,
            [(name, "left" if name in left else "right") for name in headers],
            cells,
            f"total: {human_bytes(totals[0])} unsharded, {human_bytes(totals[1])} on this rank",
        )
    )


class CommStatsRecording:
    """What ``comm_stats(root)`` returns: ``with`` it, the collectives of every
    group under ``root`` are recorded into ``stats``, the ``CommStats`` that
    ``as`` binds. Printed, it shows the table of what it recorded, or how to
    record if it has not been used as a ``with`` yet."""

    def __init__(self, state: FSDPState) -> None:
        self.stats = CommStats()
        self._state = state
        self._entered = False
        self._outer: list[CommStats | None] = []  # while open: the recorder it replaced

    def __enter__(self) -> CommStats:
        if self._outer:
            raise RuntimeError(
                "This comm_stats recording is already open: open each one once at a time, "
                "e.g. `with fsdp2.comm_stats(model) as stats:` around the steps to count."
            )
        comm = self._state.root_ctx.comm
        self._outer.append(comm.stats)
        comm.stats = self.stats
        self._entered = True
        return self.stats

    def __exit__(self, *exc_info: object) -> None:
        # Nested: the outer recorder takes over again.
        self._state.root_ctx.comm.stats = self._outer.pop()

    def __str__(self) -> str:
        if not self._entered:
            return (
                "fsdp2.comm_stats(model) has recorded nothing: it records inside a `with`, e.g. "
                "`with fsdp2.comm_stats(model) as stats:` around the training steps; then "
                "print(stats) shows the table."
            )
        return str(self.stats)

    def __repr__(self) -> str:
        state = "not used yet" if not self._entered else repr(self.stats)
        return f"CommStatsRecording({state})"


def comm_stats(root: nn.Module) -> CommStatsRecording:
    """Records the collectives of every group under ``root`` while its ``with``
    is open: ``with fsdp2.comm_stats(model) as stats:``, then ``print(stats)``.

    Args:
        root: the outermost sharded module (the one whose forward you call).

    Returns:
        A context manager whose ``with`` binds the ``CommStats`` it records into.
    """
    state = get_fsdp_state(root)
    if state is None or state.is_root is False:
        raise ValueError(
            "comm_stats expects the root sharded module (the outermost module passed to "
            f"fully_shard), got {type(root).__name__}."
        )
    return CommStatsRecording(state)
