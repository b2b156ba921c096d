"""What a param group's gradient reduction does across HSDP replicas after
its reduce-scatter inside the shard group: a stage the group picks once
(variants.py) and the reduction pipeline (reduction.py) calls without asking
which it is.

- ``ReplicaStage``: nothing (FSDP, a 1D mesh).
- ``KeepPartial``: HSDP with ``set_requires_all_reduce(False)``: the
  shard-group sums are kept (``FSDPParam.partial_grad``) for a later
  reduction that adds them.
- ``AllReduceAcrossReplicas``: HSDP, plain or with compressed gradients
  (compressed.py).
- over_replicas.py's ``ReduceScatterAcrossReplicas``:
  ``shard_optimizer_over_replicas``.

``start`` returns the reduction after the stage, whose ``in_flight`` are the
stage's own collectives (none when it issues nothing), or None when nothing
is left to assign now.
"""

from __future__ import annotations

import torch

from ..base.private_api import without_grad
from .compressed import GradientWire, all_reduce_sent_bytes
from .compressed import all_reduce as compressed_all_reduce
from .context import ALL_REDUCE, CommContext, InFlight
from .primitives import Collectives, ReduceOp
from .reduce_scatter import ReduceInFlight


class ReplicaStage:
    """No replicas: the reduce-scatter's output is the gradient."""

    # Whether the stage issues collectives across the replicas (the pipeline
    # keeps one such stage in flight on CPU, and the order check sees it).
    communicates = False

    def can_start_early(self, reduced: ReduceInFlight) -> bool:
        """Accelerators: whether the stage may be issued right after the
        reduce-scatter, ordered after its event only."""
        return False

    def start(
        self,
        reduced: ReduceInFlight,
        comm: CommContext,
        name: str,
        after: tuple[InFlight, ...] = (),
    ) -> ReduceInFlight | None:
        return reduced._replace(in_flight=())


class KeepPartial(ReplicaStage):
    """HSDP without the reduction across replicas (``set_requires_all_reduce(False)``)."""

    @without_grad
    def start(
        self,
        reduced: ReduceInFlight,
        comm: CommContext,
        name: str,
        after: tuple[InFlight, ...] = (),
    ) -> ReduceInFlight | None:
        for fsdp_param, local_grad in zip(reduced.fsdp_params, reduced.views(), strict=True):
            if fsdp_param.partial_grad is None:
                fsdp_param.partial_grad = local_grad.clone()
            else:
                fsdp_param.partial_grad.add_(local_grad)
        return None


@without_grad
def add_partial_grads(reduced: ReduceInFlight) -> None:
    """Adds the shard-group sums kept by earlier backwards (``KeepPartial``)."""
    for fsdp_param, local_grad in zip(reduced.fsdp_params, reduced.views(), strict=True):
        if fsdp_param.partial_grad is not None:
            local_grad.add_(fsdp_param.partial_grad)
            fsdp_param.partial_grad = None


class AllReduceAcrossReplicas(ReplicaStage):
    """HSDP: the reduce-scatter's output all-reduced across the replicas with
    the plan's op; ``wire``: compressed gradients (``all_reduce_across``)."""

    communicates = True

    def __init__(self, collectives: Collectives, wire: GradientWire | None = None) -> None:
        self.collectives = collectives
        self.wire = wire

    def can_start_early(self, reduced: ReduceInFlight) -> bool:
        # Kept sums are added after the reduce-scatter, the CPU way.
        return all(p.partial_grad is None for p in reduced.fsdp_params)

    @without_grad
    def start(
        self,
        reduced: ReduceInFlight,
        comm: CommContext,
        name: str,
        after: tuple[InFlight, ...] = (),
    ) -> ReduceInFlight | None:
        add_partial_grads(reduced)
        slots = [numel for numel, _ in reduced.slots]
        in_flight = all_reduce_across(
            reduced.output,
            slots,
            reduced.plan.all_reduce_op,
            self.wire,
            self.collectives,
            comm,
            name,
            after,
        )
        return reduced._replace(buffers=(), in_flight=(in_flight,))


def all_reduce_across(
    tensor: torch.Tensor,
    slot_numels: list[int],
    op: ReduceOp,
    wire: GradientWire | None,
    collectives: Collectives,
    comm: CommContext,
    name: str,
    after: tuple[InFlight, ...] = (),
) -> InFlight:
    """Starts summing ``tensor`` (slots of ``slot_numels``) across the
    replicas in place: an all-reduce with ``op``, or with ``wire`` each slot
    cut in R pieces, summed in fp32 by its rank after an all-to-all, the sums
    compressed again and all-gathered (compressed.py; ``op`` is then SUM)."""
    if wire is None:
        return comm.issue(
            ALL_REDUCE,
            name,
            collectives,
            tensor.numel() * tensor.element_size(),
            lambda async_op: collectives.all_reduce(tensor, op, async_op),
            after,
        )
    return comm.issue(
        ALL_REDUCE,
        name,
        collectives,
        all_reduce_sent_bytes(slot_numels, wire, collectives.process_group.size()),
        lambda async_op: compressed_all_reduce(tensor, slot_numels, wire, collectives, async_op),
        after,
    )
