"""Step checkpoints of a run folder that appear whole or not at all.

``save`` writes a DCP checkpoint into ``checkpoints/step_NNNNNN.partial/`` and,
once every rank has written its part, rank 0 renames the folder to
``step_NNNNNN``: a rename within one file system is atomic, so a rank killed
mid-save leaves a ``.partial`` folder and the previous checkpoint untouched.
``latest_checkpoint`` picks the highest complete step and never a ``.partial``
one; ``remove_partial`` deletes what interrupted saves left behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

PARTIAL_SUFFIX = ".partial"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _step(folder: Path) -> int | None:
    """The step of a ``step_NNNNNN`` folder; None for any other name."""
    digits = folder.name.removeprefix("step_")
    return int(digits) if folder.name.startswith("step_") and digits.isdigit() else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint of the highest step: a ``step_NNNNNN`` folder (only
    ``save``'s rename makes one) with DCP's ``.metadata`` file."""
    folders = (m.parent for m in run_dir.glob("checkpoints/step_*/.metadata"))
    steps = {f: step for f in folders if (step := _step(f)) is not None}
    return max(steps, key=steps.__getitem__, default=None)


def partial_checkpoints(run_dir: Path) -> list[Path]:
    """Folders of saves that did not finish (their writer was killed or failed)."""
    return sorted(run_dir.glob(f"checkpoints/step_*{PARTIAL_SUFFIX}"))


def remove_partial(run_dir: Path) -> list[Path]:
    """Deletes the folders of unfinished saves and returns them. Call it on one
    rank, before any rank saves again (an unfinished save of the same step
    would otherwise mix its files with the new save's)."""
    partial = partial_checkpoints(run_dir)
    for folder in partial:
        shutil.rmtree(folder)
    return partial


def save(state: dict[str, Any], run_dir: Path, step: int) -> Path:
    """Saves ``state`` as the checkpoint of ``step`` and returns its folder; a
    collective, like ``dcp.save``. When it returns on any rank, the checkpoint
    is complete and visible under its final name."""
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    # dcp.save returns once rank 0 (its coordinator) has written .metadata,
    # which it does only after every rank reported its files written.
    dcp.save(state, checkpoint_id=partial)
    if dist.get_rank() == 0:
        _fsync_dir(partial)  # the files' names, before the folder that holds them is renamed
        os.rename(partial, final)
        _fsync_dir(final.parent)  # the rename itself, through a power loss
    dist.barrier()  # no rank goes on (or reports the path) before the rename
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
