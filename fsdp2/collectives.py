"""The two collectives of a param group, with their copy-in and copy-out.

Layouts (W = shard world size, see [Note: the padded layout] in param.py):

- all-gather: ``all_gather_output`` is 1D, ``W * shard_numel`` long, rank k's
  block at ``k * shard_numel``; inside a block, parameter i's slot is
  ``padded_shard_numel_i`` long at the same offset on every rank.
  ``all_gather_input`` is this rank's block of the output (gathered in place).
- reduce-scatter: ``reduce_scatter_input`` is ``(W, shard_numel)``, row k
  holding chunk k of every gradient, padded; ``reduce_scatter_output`` is this
  rank's row after the sum.
- replicated parameters (``min_numel_to_shard``) are not all-gathered; their
  gradients follow the reduce-scatter output in the same buffer and are
  all-reduced there, so the all-reduce across HSDP replicas covers both.

How a reduction averages (which ops, which divisions) is ``divide_plan``'s
choice, per backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from .comm import CommContext, InFlight
from .compressed import (
    GradientWire,
    Int8Rows,
    all_gather_row,
    all_reduce_sent_bytes,
    copy_out_int8,
    encode_rows,
    exchange,
)
from .compressed import all_reduce as compressed_all_reduce
from .custom_comm import AllGather, ReduceScatter, allocate
from .primitives import Collectives, ReduceOp, Waitable
from .private_api import chunk_cat_, foreach_copy_, premul_sum, profiled

if TYPE_CHECKING:
    from .param import FSDPParam


class DividePlan(NamedTuple):
    """Where a gradient reduction divides: before, inside (the collectives'
    ops) or after its collectives."""

    pre_divisor: float | None  # of the reduce-scatter input (and replicated grads)
    # Of the reduce-scatter and of the replicated grads' all-reduce over the shard group.
    reduce_scatter_op: ReduceOp
    all_reduce_op: ReduceOp  # HSDP: across replicas
    post_divisor: float | None  # of the output, after the last collective
    # The post-division stands in for an averaging op the backend lacks (gloo):
    # made before the all-reduce hook, which then sees what an averaging
    # collective gives. Else (NCCL) it follows the hook, as torch's does.
    divides_before_hook: bool = False


def divide_plan(
    backend: str,
    reduce_dtype: torch.dtype,
    shard_world_size: int,
    replicate_world_size: int = 1,
    factor: float | None = None,
    force_sum: bool = False,
    one_rank_collectives: bool = False,
) -> DividePlan:
    """How a group's gradients are averaged over its ``shard_world_size *
    replicate_world_size`` ranks, or divided by ``factor``
    (``set_gradient_divide_factor``), on ``backend``: torch's fully_shard's
    choice on NCCL, summing collectives elsewhere.

    - NCCL, fp32 or bf16 (no overflow risk), unless ``force_sum``
      (``set_force_sum_reduction_for_comms``): the collectives divide.
      ``ReduceOp.AVG`` for both (``SUM`` over a single rank); with a factor,
      a reduce-scatter that multiplies by ``1 / factor`` before summing
      (``PREMUL_SUM``, ``AVG`` if the factor is the shard group's size), then
      a summing all-reduce. Over one rank the input is divided by the
      factor instead: the reduce-scatter does not run, and where it is forced
      to, NCCL's one-rank path leaves PREMUL_SUM's factor out (an H100,
      NCCL 2.28.9: ``make gpu-check``'s arithmetic row).
    - NCCL otherwise: sums; fp32 and bf16 divided after, other dtypes (fp16)
      by a power of two near the divisor's square root before the sum and by
      the rest after, so that neither the sum nor the quotients leave fp16's
      range.
    - Other backends (gloo has neither ``AVG`` nor ``PREMUL_SUM``): sums;
      16-bit dtypes divided before the sum (it cannot overflow), others after.

    A division by 1 is left out. ``one_rank_collectives``
    (``CommContext.force_collectives``): on NCCL, a world of one still averages
    in its collectives (``AVG``), as a larger one would.
    """
    ranks = shard_world_size * replicate_world_size
    divisor = float(ranks if factor is None else factor)
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    if backend != "nccl":
        if reduce_dtype.itemsize < 4:
            return DividePlan(_unless_one(divisor), SUM, SUM, None)
        return DividePlan(None, SUM, SUM, _unless_one(divisor), divides_before_hook=True)
    no_overflow_risk = reduce_dtype in (torch.float32, torch.bfloat16)
    if no_overflow_risk and not force_sum:
        if factor is None:
            op = SUM if ranks == 1 and not one_rank_collectives else AVG
            return DividePlan(None, op, op, None)
        if factor == shard_world_size:
            return DividePlan(None, AVG, SUM, None)
        if shard_world_size == 1:  # forced too: a one-rank PREMUL_SUM drops its factor
            return DividePlan(factor, SUM, SUM, None)
        return DividePlan(None, premul_sum(1 / factor), SUM, None)
    if no_overflow_risk:
        return DividePlan(None, SUM, SUM, _unless_one(divisor))
    pre = 1
    while divisor % pre == 0 and divisor / pre > pre:
        pre *= 2
    return DividePlan(_unless_one(pre), SUM, SUM, _unless_one(divisor / pre))


def _unless_one(divisor: float) -> float | None:
    return None if divisor == 1 else divisor


class AllGatherInFlight(NamedTuple):
    all_gather_output: torch.Tensor  # 1D, world_size * sum(slot_numels)
    in_flight: InFlight
    int8: Int8Rows | None = None  # int8 weights: the layout of each rank's row of bytes


class ReduceInFlight(NamedTuple):
    """A gradient reduction between two of its stages (reduce-scatter, then the
    all-reduce across replicas for HSDP)."""

    fsdp_params: list[FSDPParam]  # those whose gradients are reduced, in buffer order
    buffers: tuple[torch.Tensor, ...]  # read or written by the collective: kept until waited
    # 1D, in reduce dtype: this rank's reduce-scattered shard_numel, then the
    # replicated parameters' whole gradients.
    output: torch.Tensor
    plan: DividePlan  # the ops of its collectives, the division left after them
    in_flight: tuple[InFlight, ...]  # the collectives of this stage
    # Accelerators, HSDP: the all-reduce across replicas, issued right after the
    # reduce-scatter (ordered after its event), waited for at the end of backward.
    all_reduce: InFlight | None = None
    # shard_optimizer_over_replicas: ``output`` holds the pieces (replica.py's
    # slots), reduce-scattered across replicas, not the shard group's chunks.
    across_replicas: bool = False

    def wait(self) -> None:
        for in_flight in self.in_flight:
            in_flight.wait()


# Dtypes the all-gather buffer may have when every slot shares it; anything
# else (float8, integer data of quantized weights, a mix of dtypes) travels as
# bytes. gloo has no float8 at all, and moving bytes is all an all-gather does.
_TYPED_BUFFER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def all_gather_dtype(slot_dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype of a group's all-gather buffer: its slots' if they share a
    common float dtype, else ``torch.uint8`` (slots counted in bytes)."""
    dtypes = set(slot_dtypes)
    if len(dtypes) == 1 and (dtype := dtypes.pop()) in _TYPED_BUFFER_DTYPES:
        return dtype
    return torch.uint8


def as_buffer_dtype(tensor: torch.Tensor, buffer_dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` seen in the buffer's units: itself, or its bytes."""
    if buffer_dtype is torch.uint8 and tensor.dtype is not torch.uint8:
        return tensor.view(torch.uint8)
    return tensor


@torch.no_grad()
def all_gather(
    inputs: list[torch.Tensor],
    slots: list[tuple[int, torch.dtype]],
    buffer_dtype: torch.dtype,
    collectives: Collectives,
    rank: int,
    world_size: int,
    comm: CommContext,
    group_name: str = "",
    custom: AllGather | None = None,
    int8: Int8Rows | None = None,
    kind: str = "all_gather",
) -> AllGatherInFlight:
    """Copies ``inputs`` (flat, each at most its slot's ``(elements, dtype)``
    long) into this rank's block of one flat buffer of ``buffer_dtype``, casting
    each to its slot's dtype, and starts the all-gather (``custom``'s, if set;
    ``kind`` names it for ``comm_stats``). ``int8``: the inputs are first
    quantized into one row of bytes (compressed.py), which is what this rank's
    block holds."""
    if int8 is not None and inputs:
        inputs = [all_gather_row(inputs, int8, comm.device)]
        slots, buffer_dtype = [(int8.row_bytes, torch.uint8)], torch.uint8
    if buffer_dtype is torch.uint8:
        inputs = [
            as_buffer_dtype(x.to(dtype), buffer_dtype)
            for x, (_, dtype) in zip(inputs, slots, strict=True)
        ]
        slot_numels = [numel * dtype.itemsize for numel, dtype in slots]
    else:
        slot_numels = [numel for numel, _ in slots]
    shard_numel = sum(slot_numels)
    all_gather_output = allocate(custom, world_size * shard_numel, buffer_dtype, comm.device)
    if not inputs:  # every parameter of the group is replicated
        return AllGatherInFlight(all_gather_output, comm.done_here(), int8)
    all_gather_input = all_gather_output.narrow(0, rank * shard_numel, shard_numel)
    split_sizes = []  # alternating [data, padding]: the padding slots are never read
    for x, slot_numel in zip(inputs, slot_numels, strict=True):
        split_sizes += [x.numel(), slot_numel - x.numel()]
    # Accelerators: from pinned CPU shards (offload) the copy does not block the host.
    foreach_copy_(
        all_gather_input.split_with_sizes(split_sizes)[::2], inputs, non_blocking=comm.uses_streams
    )
    if world_size == 1 and not comm.force_collectives:
        # The input is the whole output: nothing to exchange.
        return AllGatherInFlight(all_gather_output, comm.done_here(), int8)
    in_flight = comm.issue(
        kind,
        group_name,
        all_gather_output.numel() * all_gather_output.element_size(),
        lambda async_op: _all_gather(
            custom, all_gather_output, all_gather_input, collectives, async_op
        ),
        stream="all_gather",  # whatever kind (the all-gather across replicas too)
    )
    return AllGatherInFlight(all_gather_output, in_flight, int8)


@torch.no_grad()
def copy_out(result: AllGatherInFlight, outputs: list[torch.Tensor]) -> None:
    """Scatters a finished all-gather into ``outputs``, each rank-major
    (``FSDPParam.rank_major``): rank k's slot goes to row k."""
    if not outputs:
        return
    if result.int8 is not None:
        copy_out_int8(result.all_gather_output, result.int8, outputs)
        return
    buffer_dtype = result.all_gather_output.dtype
    outputs = [as_buffer_dtype(out, buffer_dtype) for out in outputs]
    world_size = outputs[0].size(0)
    gathered = result.all_gather_output.view(world_size, -1)
    slot_numels = [out.numel() // world_size for out in outputs]
    # One fused copy. A parameter sharded on a dim > 0 has a strided (W, pre,
    # chunk, post) view, which the fused copy cannot write: it gets a (W, slot)
    # buffer of its own, copied into the view after (the others stay fused).
    staged = [
        out if out.dim() == 2 else out.new_empty(world_size, n)
        for out, n in zip(outputs, slot_numels, strict=True)
    ]
    torch.split_with_sizes_copy(gathered, slot_numels, dim=1, out=staged)
    for stage, out in zip(staged, outputs, strict=True):
        if stage is not out:
            out.copy_(stage.view(out.shape))


@torch.no_grad()
def reduce_scatter(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    collectives: Collectives,
    world_size: int,
    plan: DividePlan,
    comm: CommContext,
    group_name: str = "",
    custom: ReduceScatter | None = None,
    wire: GradientWire | None = None,
) -> ReduceInFlight:
    """Packs the gradients (unsharded-shaped) rank-major and starts the
    reduce-scatter (``custom``'s, if set) with ``plan``'s op, dividing the
    input first if ``plan`` says so; replicated parameters' gradients are
    packed after it and all-reduced with the same op.

    The gradients may be in the parameters' dtype: packing casts them to the
    reduce dtype, so no reduce-dtype copy of a whole gradient is made (with
    bf16 parameters and fp32 reduction: 2 + 4 bytes per element at the peak,
    not 4 + 4). The caller drops its references to ``unsharded_grads``
    afterwards: the packed copies are all the collectives need.

    ``wire`` (compressed gradients): the rows go by one all-to-all, compressed,
    and are added in fp32 by their receiver (compressed.py); the output is
    then fp32.
    """
    reduce_dtype = fsdp_params[0].reduce_dtype
    if len({g.dtype for g in unsharded_grads}) > 1:
        # The fused copy-in takes one dtype (e.g. a zero gradient next to others).
        unsharded_grads = [g.to(reduce_dtype) for g in unsharded_grads]
    pairs = list(zip(fsdp_params, unsharded_grads, strict=True))
    sharded = [(p, g) for p, g in pairs if not p.replicated]
    replicated = [(p, g) for p, g in pairs if p.replicated]
    shard_numel = sum(p.padded_shard_numel for p, _ in sharded)
    replicated_numel = sum(g.numel() for _, g in replicated)
    device = unsharded_grads[0].device
    reduce_scatter_input = allocate(custom, world_size * shard_numel, reduce_dtype, device).view(
        world_size, shard_numel
    )
    # A world of one exchanges nothing: the input is the whole output, unless
    # replicated gradients must follow it.
    exchanges = world_size > 1 or comm.force_collectives
    input_is_output = not exchanges and not replicated
    output_dtype = torch.float32 if wire is not None else reduce_dtype
    if input_is_output:
        output = reduce_scatter_input.view(-1)
    else:
        output = allocate(custom, shard_numel + replicated_numel, output_dtype, device)
    # Empty gradients have empty slots; the fused copy rejects them. It pads and
    # chunks dim 0: a gradient sharded on another dim goes in as its rank-major view.
    nonempty = [g if p.shard_dim == 0 else p.rank_major(g, world_size) for p, g in sharded]
    nonempty = [g for g in nonempty if g.numel() > 0]
    if nonempty:
        with profiled("reduce_scatter_copy_in", group_name):
            chunk_cat_(nonempty, world_size, out=reduce_scatter_input)
            if plan.pre_divisor is not None:
                reduce_scatter_input.div_(plan.pre_divisor)
    in_flight = []
    buffers: tuple[torch.Tensor, ...] = (reduce_scatter_input,)
    if sharded and exchanges and wire is not None:
        slot_numels = [p.padded_shard_numel for p, _ in sharded]
        sent = encode_rows(reduce_scatter_input, wire.setting, slot_numels, wire.block_size)
        buffers = (reduce_scatter_input, sent)
        in_flight.append(
            comm.issue(
                "reduce_scatter",
                group_name,
                sent.numel() * sent.element_size(),
                lambda async_op: exchange(
                    output.narrow(0, 0, shard_numel),
                    sent,
                    wire,
                    slot_numels,
                    collectives,
                    async_op,
                ),
            )
        )
    elif sharded and exchanges:
        in_flight.append(
            comm.issue(
                "reduce_scatter",
                group_name,
                reduce_scatter_input.numel() * reduce_scatter_input.element_size(),
                lambda async_op: _reduce_scatter(
                    custom,
                    output.narrow(0, 0, shard_numel),
                    reduce_scatter_input.view(-1),
                    collectives,
                    plan.reduce_scatter_op,
                    async_op,
                ),
            )
        )
    elif not input_is_output:
        output.narrow(0, 0, shard_numel).copy_(reduce_scatter_input.view(-1))
    if replicated:
        tail = output.narrow(0, shard_numel, replicated_numel)
        if tail.dtype == reduce_dtype:
            torch.cat([g.reshape(-1) for _, g in replicated], out=tail)
        else:  # compressed gradients: an fp32 output
            tail.copy_(torch.cat([g.reshape(-1) for _, g in replicated]))
        if plan.pre_divisor is not None:
            tail.div_(plan.pre_divisor)
        if exchanges:
            op = plan.reduce_scatter_op
            in_flight.append(
                comm.issue(
                    "all_reduce",
                    group_name,
                    tail.numel() * tail.element_size(),
                    lambda async_op: collectives.all_reduce(tail, op, async_op),
                )
            )
    return ReduceInFlight(
        [p for p, _ in sharded + replicated],
        buffers,
        output,
        plan,
        tuple(in_flight),
    )


def _all_gather(
    custom: AllGather | None,
    output: torch.Tensor,
    input: torch.Tensor,
    collectives: Collectives,
    async_op: bool,
) -> Waitable | None:
    if custom is None:
        return collectives.all_gather(output, input, async_op)
    return custom(output, input, group=collectives.process_group, async_op=async_op)


def _reduce_scatter(
    custom: ReduceScatter | None,
    output: torch.Tensor,
    input: torch.Tensor,
    collectives: Collectives,
    op: ReduceOp,
    async_op: bool,
) -> Waitable | None:
    if custom is None:
        return collectives.reduce_scatter(output, input, op, async_op)
    return custom(
        output_tensor=output,
        input_tensor=input,
        group=collectives.process_group,
        op=op,
        async_op=async_op,
    )


@torch.no_grad()
def all_reduce(
    reduced: ReduceInFlight,
    collectives: Collectives,
    comm: CommContext,
    group_name: str = "",
    after: tuple[InFlight, ...] = (),
    wire: GradientWire | None = None,
) -> ReduceInFlight:
    """Starts reducing a reduce-scatter's output across replicas (HSDP) with
    its plan's op: a waited one, or on accelerators one still in flight
    (``after``: its collectives). ``wire``: compressed, summed in fp32
    (compressed.py; the plan's op is then SUM)."""
    output, op = reduced.output, reduced.plan.all_reduce_op
    if wire is not None:
        slots = [p.padded_shard_numel for p in reduced.fsdp_params]
        num_ranks = collectives.process_group.size()
        in_flight = comm.issue(
            "all_reduce",
            group_name,
            all_reduce_sent_bytes(slots, wire, num_ranks),
            lambda async_op: compressed_all_reduce(output, slots, wire, collectives, async_op),
            after,
        )
        return reduced._replace(buffers=(), in_flight=(in_flight,))
    in_flight = comm.issue(
        "all_reduce",
        group_name,
        output.numel() * output.element_size(),
        lambda async_op: collectives.all_reduce(output, op, async_op),
        after,
    )
    return reduced._replace(buffers=(), in_flight=(in_flight,))
