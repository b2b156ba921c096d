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
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import primitives
from .comm import CommContext, HostCopy, InFlight
from .custom_comm import AllGather, ReduceScatter, allocate
from .device_ops import DeviceOps
from .param import FSDPParam
from .primitives import Waitable
from .private_api import chunk_cat_, profiled


class AllGatherInFlight(NamedTuple):
    all_gather_output: torch.Tensor  # 1D, world_size * sum(slot_numels)
    in_flight: InFlight


class ReduceInFlight(NamedTuple):
    """A gradient reduction between two of its stages (reduce-scatter, then the
    all-reduce across replicas for HSDP)."""

    fsdp_params: list[FSDPParam]  # those whose gradients are reduced, in buffer order
    buffers: tuple[torch.Tensor, ...]  # read or written by the collective: kept until waited
    # 1D, in reduce dtype: this rank's reduce-scattered shard_numel, then the
    # replicated parameters' whole gradients.
    output: torch.Tensor
    divisor: float  # the ranks averaged over, or set_gradient_divide_factor's
    in_flight: tuple[InFlight, ...]  # the collectives of this stage
    # Accelerators, HSDP: the all-reduce across replicas, issued right after the
    # reduce-scatter (ordered after its event), waited for at the end of backward.
    all_reduce: InFlight | None = None

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
    group: dist.ProcessGroup,
    rank: int,
    world_size: int,
    comm: CommContext,
    group_name: str = "",
    custom: AllGather | None = None,
) -> AllGatherInFlight:
    """Copies ``inputs`` (flat, each at most its slot's ``(elements, dtype)``
    long) into this rank's block of one flat buffer of ``buffer_dtype``, casting
    each to its slot's dtype, and starts the all-gather (``custom``'s, if set)."""
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
        return AllGatherInFlight(all_gather_output, comm.done_here())
    all_gather_input = all_gather_output.narrow(0, rank * shard_numel, shard_numel)
    split_sizes = []  # alternating [data, padding]: the padding slots are never read
    for x, slot_numel in zip(inputs, slot_numels, strict=True):
        split_sizes += [x.numel(), slot_numel - x.numel()]
    # Accelerators: from pinned CPU shards (offload) the copy does not block the host.
    torch._foreach_copy_(
        all_gather_input.split_with_sizes(split_sizes)[::2], inputs, non_blocking=comm.uses_streams
    )
    if world_size == 1:  # the input is the whole output: nothing to exchange
        return AllGatherInFlight(all_gather_output, comm.done_here())
    in_flight = comm.issue(
        "all_gather",
        group_name,
        all_gather_output.numel() * all_gather_output.element_size(),
        lambda async_op: (primitives.all_gather_single if custom is None else custom)(
            all_gather_output, all_gather_input, group=group, async_op=async_op
        ),
    )
    return AllGatherInFlight(all_gather_output, in_flight)


@torch.no_grad()
def copy_out(result: AllGatherInFlight, outputs: list[torch.Tensor]) -> None:
    """Scatters a finished all-gather into ``outputs``, each rank-major
    (``FSDPParam.rank_major``): rank k's slot goes to row k."""
    if not outputs:
        return
    buffer_dtype = result.all_gather_output.dtype
    outputs = [as_buffer_dtype(out, buffer_dtype) for out in outputs]
    world_size = outputs[0].size(0)
    gathered = result.all_gather_output.view(world_size, -1)
    slot_numels = [out.numel() // world_size for out in outputs]
    if all(out.dim() == 2 for out in outputs):  # every parameter sharded on dim 0
        torch.split_with_sizes_copy(gathered, slot_numels, dim=1, out=outputs)
        return
    for src, out in zip(gathered.split_with_sizes(slot_numels, dim=1), outputs, strict=True):
        out.copy_(src.view(out.shape))


@torch.no_grad()
def reduce_scatter(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    group: dist.ProcessGroup,
    world_size: int,
    divisor: float,
    comm: CommContext,
    group_name: str = "",
    custom: ReduceScatter | None = None,
) -> ReduceInFlight:
    """Packs the gradients (unsharded-shaped) rank-major and starts the
    (summing) reduce-scatter (``custom``'s, if set); replicated parameters'
    gradients are packed after it and all-reduced.

    The gradients may be in the parameters' dtype: packing casts them to the
    reduce dtype, so no reduce-dtype copy of a whole gradient is made (with
    bf16 parameters and fp32 reduction: 2 + 4 bytes per element at the peak,
    not 4 + 4). The caller drops its references to ``unsharded_grads``
    afterwards: the packed copies are all the collectives need.
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
    # bf16/fp16: average before the sum so that it cannot overflow.
    pre_divide = reduce_dtype.itemsize < 4
    reduce_scatter_input = allocate(custom, world_size * shard_numel, reduce_dtype, device).view(
        world_size, shard_numel
    )
    # A world of one exchanges nothing: the input is the whole output, unless
    # replicated gradients must follow it.
    input_is_output = world_size == 1 and not replicated
    if input_is_output:
        output = reduce_scatter_input.view(-1)
    else:
        output = allocate(custom, shard_numel + replicated_numel, reduce_dtype, device)
    # Empty gradients have empty slots; the fused copy rejects them. It pads and
    # chunks dim 0: a gradient sharded on another dim goes in as its rank-major view.
    nonempty = [g if p.shard_dim == 0 else p.rank_major(g, world_size) for p, g in sharded]
    nonempty = [g for g in nonempty if g.numel() > 0]
    if nonempty:
        with profiled("reduce_scatter_copy_in", group_name):
            chunk_cat_(nonempty, world_size, out=reduce_scatter_input)
            if pre_divide:
                reduce_scatter_input.div_(divisor)
    in_flight = []
    if sharded and world_size > 1:
        in_flight.append(
            comm.issue(
                "reduce_scatter",
                group_name,
                reduce_scatter_input.numel() * reduce_scatter_input.element_size(),
                lambda async_op: _reduce_scatter(
                    custom,
                    output.narrow(0, 0, shard_numel),
                    reduce_scatter_input.view(-1),
                    group,
                    async_op,
                ),
            )
        )
    elif not input_is_output:
        output.narrow(0, 0, shard_numel).copy_(reduce_scatter_input.view(-1))
    if replicated:
        tail = output.narrow(0, shard_numel, replicated_numel)
        torch.cat([g.reshape(-1) for _, g in replicated], out=tail)
        if pre_divide:
            tail.div_(divisor)
        if world_size > 1:
            in_flight.append(
                comm.issue(
                    "all_reduce",
                    group_name,
                    tail.numel() * tail.element_size(),
                    lambda async_op: dist.all_reduce(tail, group=group, async_op=async_op),
                )
            )
    return ReduceInFlight(
        [p for p, _ in sharded + replicated],
        (reduce_scatter_input,),
        output,
        divisor,
        tuple(in_flight),
    )


def _reduce_scatter(
    custom: ReduceScatter | None,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool,
) -> Waitable | None:
    if custom is None:
        return primitives.reduce_scatter_single(output, input, group, async_op)
    return custom(
        output_tensor=output,
        input_tensor=input,
        group=group,
        op=dist.ReduceOp.SUM,
        async_op=async_op,
    )


@torch.no_grad()
def all_reduce(
    reduced: ReduceInFlight,
    group: dist.ProcessGroup,
    comm: CommContext,
    group_name: str = "",
    after: tuple[InFlight, ...] = (),
) -> ReduceInFlight:
    """Starts summing a reduce-scatter's output across replicas (HSDP): a waited
    one, or on accelerators one still in flight (``after``: its collectives)."""
    output = reduced.output
    in_flight = comm.issue(
        "all_reduce",
        group_name,
        output.numel() * output.element_size(),
        lambda async_op: dist.all_reduce(output, group=group, async_op=async_op),
        after,
    )
    return reduced._replace(buffers=(), in_flight=(in_flight,))


def output_slots(reduced: ReduceInFlight) -> list[torch.Tensor]:
    """Each reduced parameter's rows of the output, shaped like its local shard."""
    slots = reduced.output.split_with_sizes([p.padded_shard_numel for p in reduced.fsdp_params])
    return [
        slot[: p.local_numel].view(p.local_shape)
        for p, slot in zip(reduced.fsdp_params, slots, strict=True)
    ]


@torch.no_grad()
def average(reduced: ReduceInFlight) -> None:
    """Divides a finished reduction's sums by the divisor (by default the ranks
    averaged over, as DDP does); 16-bit ones were divided before the sum."""
    if reduced.output.dtype.itemsize >= 4 and reduced.divisor != 1:
        reduced.output.div_(reduced.divisor)


@torch.no_grad()
def assign_sharded_grads(reduced: ReduceInFlight, ops: DeviceOps | None = None) -> list[HostCopy]:
    """Accumulates an averaged reduction into the sharded grads; returns those
    still being copied to the host (see ``FSDPParam.accumulate_sharded_grad``)."""
    copies = []
    for fsdp_param, local_grad in zip(reduced.fsdp_params, output_slots(reduced), strict=True):
        if (copy := fsdp_param.accumulate_sharded_grad(local_grad, ops)) is not None:
            copies.append(copy)
    return copies
