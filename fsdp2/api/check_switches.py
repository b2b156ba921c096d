"""Switches for checks, not for training: what scripts/gpu_check.py and the
tests' model of streams turn on, explicitly, on the models they build.
Nothing else (no environment variable, no global) changes how the engine
communicates or divides.

- ``use_device_ops``: the streams and events of every comm context under a
  model go through ``ops``, e.g. tests/stream_model.py's model of streams on
  CPU ranks.
- ``force_one_rank_collectives``: a world of one rank issues its
  collectives all the same (on a one-rank communicator), so that one GPU
  exercises the comm streams, events and copy-in stream; on NCCL a reduction
  then averages in its collectives (``AVG``) as it would on more ranks.
- ``skip_same_model_check``: the ranks may hold different models at the
  first forward (same_model.py's check of the checksums ``fully_shard``
  took, of loads on some ranks only, of HSDP replicas and whole copies is
  left out, and its all-reduce): for a check that builds a model of its
  own on each rank on purpose. Call it on every rank.

Call any of them on a sharded model before its first forward.
"""

from __future__ import annotations

import torch.nn as nn

from ..base.device_ops import DeviceOps
from ..checks.same_model import skip
from .state import FSDPState, get_fsdp_state


def use_device_ops(model: nn.Module, ops: DeviceOps | None) -> None:
    """Runs the streams and events of ``model``'s sharded modules through
    ``ops`` (None: none, as on CPU)."""
    for state in _states(model):
        state.root_ctx.comm.use_device_ops(ops)


def force_one_rank_collectives(model: nn.Module, enabled: bool = True) -> None:
    """Makes ``model``'s groups issue their collectives over a world of one."""
    for state in _states(model):
        for group in state.param_groups:
            group.configure(one_rank_collectives=enabled)


def skip_same_model_check(model: nn.Module) -> None:
    """Leaves ``model``'s parameters out of the check, on this rank."""
    for state in _states(model):
        for group in state.param_groups:
            skip(group.fsdp_params)


def _states(model: nn.Module) -> list[FSDPState]:
    states = (get_fsdp_state(module) for module in model.modules())
    return list(dict.fromkeys(state for state in states if state is not None))
