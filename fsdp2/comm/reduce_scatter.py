"""The gradient reduce-scatter of a param group, as a variant the group picks
once (variants.py) and calls without asking which it is.

Layout (W = shard world size, see [Note: the padded layout] in layout.py):
``reduce_scatter_input`` is ``(W, block_numel)``, row k holding chunk k of
every gradient, padded to its slot; ``reduce_scatter_output`` is this rank's
row after the reduction, followed by the whole gradients of the parameters
kept whole (``min_numel_to_shard``), which are all-reduced there, so that a
stage across HSDP replicas (replica_stage.py) covers both.

The variant, ``ReduceScatterComm``: the rows reduce-scattered by the
``Collectives`` it holds (fsdp2's or torch's, or the user's from
``set_custom_reduce_scatter``) with the divide plan's op, or, with compressed
gradients (a ``GradientWire``), sent compressed by one all-to-all and added
in fp32 by their receiver (compressed.py); the output is then fp32.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..base.private_api import chunk_cat_, profiled, without_grad
from .compressed import GradientWire, encode_rows, exchange
from .context import ALL_REDUCE, REDUCE_SCATTER, CommContext, CommKind, InFlight
from .divide import DividePlan
from .layout import CommParam
from .primitives import Collectives, ReduceOp


class ReduceInFlight(NamedTuple):
    """A gradient reduction between two of its stages: the reduce-scatter
    inside the shard group, then the stage across HSDP replicas."""

    fsdp_params: Sequence[CommParam]  # those whose gradients are reduced, in buffer order
    # Per parameter: its slot's elements in ``output`` and the shape of its rows
    # there (the local shard's; the shard group's chunk before a stage that
    # splits it across replicas).
    slots: list[tuple[int, torch.Size]]
    buffers: tuple[torch.Tensor, ...]  # read or written by the collective: kept until waited
    output: torch.Tensor  # 1D, the slots in order
    plan: DividePlan  # the ops of its collectives, the division left after them
    in_flight: tuple[InFlight, ...]  # the collectives of this stage
    # Accelerators, HSDP: the stage across replicas, issued right after the
    # reduce-scatter (ordered after its event), waited for at the end of backward.
    across: ReduceInFlight | None = None

    def wait(self) -> None:
        for in_flight in self.in_flight:
            in_flight.wait()

    def views(self, output: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each parameter's rows of ``output`` (the reduction's own by default),
        unpadded and shaped."""
        output = self.output if output is None else output
        parts = output.split_with_sizes([numel for numel, _ in self.slots])
        return [
            part[: shape.numel()].view(shape)
            for part, (_, shape) in zip(parts, self.slots, strict=True)
        ]


class PackPlan(NamedTuple):
    """How a reduction's gradients are packed, worked out once per set of
    parameters (``ReduceScatterComm.pack_plan``): the sharded ones (their
    positions among the gradients) then the whole ones, with their slots."""

    fsdp_params: Sequence[CommParam]  # as given
    sharded: list[int]
    whole: list[int]
    slot_numels: list[int]  # of the sharded ones
    block_numel: int
    rank_major: list[bool]  # per sharded one: packed as its rank-major view (dim > 0)
    params: Sequence[CommParam]  # in the output's order: sharded, then whole
    slots: list[tuple[int, torch.Size]]


def _pack_plan(fsdp_params: Sequence[CommParam]) -> PackPlan:
    sharded = [i for i, p in enumerate(fsdp_params) if not p.layout.whole]
    whole = [i for i, p in enumerate(fsdp_params) if p.layout.whole]
    slot_numels = [fsdp_params[i].layout.slot_numel for i in sharded]
    params = [fsdp_params[i] for i in sharded + whole]
    return PackPlan(
        list(fsdp_params),
        sharded,
        whole,
        slot_numels,
        sum(slot_numels),
        [fsdp_params[i].layout.shard_dim != 0 for i in sharded],
        params,
        [(p.layout.slot_numel, p.layout.chunk_shape) for p in params],
    )


class ReduceScatterComm:
    """The reduce-scatter over the shard group (``collectives``) of
    ``world_size`` ranks; ``wire``: compressed gradients, by all-to-all.
    ``exchanges``: False for a world of one, whose input is the whole output
    (nothing is issued)."""

    def __init__(
        self,
        collectives: Collectives,
        world_size: int,
        exchanges: bool,
        wire: GradientWire | None = None,
    ) -> None:
        self.collectives = collectives
        self.world_size = world_size
        self.exchanges = exchanges
        self.wire = wire
        self._pack_plan: PackPlan | None = None  # of the last reduction

    def pack_plan(self, fsdp_params: Sequence[CommParam]) -> PackPlan:
        """The packing of these parameters' gradients, kept while they are the same."""
        plan = self._pack_plan
        if (
            plan is None
            or len(plan.fsdp_params) != len(fsdp_params)
            or not all(map(operator.is_, plan.fsdp_params, fsdp_params))
        ):
            plan = self._pack_plan = _pack_plan(fsdp_params)
        return plan

    def sum_dtype(self, reduce_dtype: torch.dtype) -> torch.dtype:
        """The dtype the ranks' gradients are summed in (the divide plan's):
        fp32 for compressed ones."""
        return reduce_dtype if self.wire is None else torch.float32

    @without_grad
    def start(
        self,
        fsdp_params: Sequence[CommParam],
        unsharded_grads: list[torch.Tensor],
        plan: DividePlan,
        comm: CommContext,
        name: str,
    ) -> ReduceInFlight:
        """Packs the gradients (unsharded-shaped) rank-major and starts the
        reduce-scatter with ``plan``'s op, dividing the input first if ``plan``
        says so; the whole parameters' gradients are packed after it and
        all-reduced with the same op.

        The gradients may be in the parameters' dtype: packing casts them to
        the reduce dtype, so no reduce-dtype copy of a whole gradient is made
        (with bf16 parameters and fp32 reduction: 2 + 4 bytes per element at
        the peak, not 4 + 4). The caller drops its references to
        ``unsharded_grads`` afterwards: the packed copies are all the
        collectives need.
        """
        reduce_dtype = fsdp_params[0].reduce_dtype
        if len({g.dtype for g in unsharded_grads}) > 1:
            # The fused copy-in takes one dtype (e.g. a zero gradient next to others).
            unsharded_grads = [g.to(reduce_dtype) for g in unsharded_grads]
        pack = self.pack_plan(fsdp_params)
        slot_numels, block_numel = pack.slot_numels, pack.block_numel
        whole_numel = sum(unsharded_grads[i].numel() for i in pack.whole)
        world_size, device = self.world_size, unsharded_grads[0].device
        reduce_scatter_input = self.collectives.allocate(
            world_size * block_numel, reduce_dtype, device
        ).view(world_size, block_numel)
        # A world of one exchanges nothing: the input is the whole output, unless
        # whole gradients must follow it.
        input_is_output = not self.exchanges and not pack.whole
        if input_is_output:
            output = reduce_scatter_input.view(-1)
        else:
            output = self.collectives.allocate(
                block_numel + whole_numel, self.sum_dtype(reduce_dtype), device
            )
        # Empty gradients have empty slots; the fused copy rejects them. It pads and
        # chunks dim 0: a gradient sharded on another dim goes in as its rank-major view.
        rows = [unsharded_grads[i] for i in pack.sharded]
        if any(pack.rank_major):
            rows = [
                fsdp_params[i].layout.rank_major(g, world_size) if rank_major else g
                for i, g, rank_major in zip(pack.sharded, rows, pack.rank_major, strict=True)
            ]
        rows = [g for g in rows if g.numel() > 0]
        if rows:
            with profiled("reduce_scatter_copy_in", name):
                chunk_cat_(rows, world_size, out=reduce_scatter_input)
                if plan.pre_divisor is not None:
                    reduce_scatter_input.div_(plan.pre_divisor)
        in_flight: list[InFlight] = []
        buffers: tuple[torch.Tensor, ...] = (reduce_scatter_input,)
        if pack.sharded and self.exchanges:
            issued, buffers = reduce_rows(
                REDUCE_SCATTER,
                output.narrow(0, 0, block_numel),
                reduce_scatter_input,
                slot_numels,
                plan.reduce_scatter_op,
                self.wire,
                self.collectives,
                comm,
                name,
            )
            in_flight.append(issued)
        elif not input_is_output:
            output.narrow(0, 0, block_numel).copy_(reduce_scatter_input.view(-1))
        if pack.whole:
            tail = output.narrow(0, block_numel, whole_numel)
            whole = [unsharded_grads[i].reshape(-1) for i in pack.whole]
            if tail.dtype == reduce_dtype:
                torch.cat(whole, out=tail)
            else:  # summed in fp32 (compressed gradients)
                tail.copy_(torch.cat(whole))
            if plan.pre_divisor is not None:
                tail.div_(plan.pre_divisor)
            if self.exchanges:
                collectives, op = self.collectives, plan.reduce_scatter_op
                in_flight.append(
                    comm.issue(
                        ALL_REDUCE,
                        name,
                        collectives,
                        tail.numel() * tail.element_size(),
                        lambda async_op: collectives.all_reduce(tail, op, async_op),
                    )
                )
        return ReduceInFlight(pack.params, pack.slots, buffers, output, plan, tuple(in_flight))


def reduce_rows(
    kind: CommKind,
    output: torch.Tensor,
    rows: torch.Tensor,
    slot_numels: list[int],
    op: ReduceOp,
    wire: GradientWire | None,
    collectives: Collectives,
    comm: CommContext,
    name: str,
) -> tuple[InFlight, tuple[torch.Tensor, ...]]:
    """Starts reducing ``rows`` (R, sum(slot_numels): row k for rank k) into
    ``output`` (this rank's row): a reduce-scatter with ``op``, or with
    ``wire`` the rows compressed, sent by one all-to-all and added in fp32 by
    their receiver, in rank order, when waited. Returns it with the buffers
    it reads until then."""
    if wire is None:
        issued = comm.issue(
            kind,
            name,
            collectives,
            rows.numel() * rows.element_size(),
            lambda async_op: collectives.reduce_scatter(output, rows.view(-1), op, async_op),
        )
        return issued, (rows,)
    sent = encode_rows(rows, wire.setting, slot_numels, wire.block_size)
    issued = comm.issue(
        kind,
        name,
        collectives,
        sent.numel() * sent.element_size(),
        lambda async_op: exchange(output, sent, wire, slot_numels, collectives, async_op),
    )
    return issued, (rows, sent)
