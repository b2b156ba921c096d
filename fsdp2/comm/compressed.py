"""The compressed collectives: what ``CompressionPolicy`` changes in a step.

- int8 weights (``all_gather_row``, ``copy_out_int8``): this rank's shards
  become one row of bytes (``Int8Rows``: scales, then codes, then the slots
  left as they are), which the ordinary all-gather moves; the copy-out
  dequantizes each rank's row into the unsharded parameters, in their dtype.
- compressed gradients (``exchange``): the rows of the reduce-scatter input
  are sent, compressed, with one all-to-all (row k to rank k); the receiver
  decompresses the W rows it got and adds them in fp32, in rank order.
- the all-reduce across HSDP replicas (``all_reduce``): the same exchange
  over R replicas (each parameter's slot cut in R pieces, so a block never
  mixes parameters), then each replica's fp32 sum compressed again and
  all-gathered: two roundings, each a bf16 or int8 half step.

Wire formats: [Note: wire formats] in wire.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .primitives import Collectives, JoinedWork
from .wire import (
    dequantize_blockwise,
    dequantize_rows,
    quantize_rows,
    rows_wire_bytes,
    slot_ranges,
    split_wire,
)


class Int8Rows(NamedTuple):
    """The layout of one rank's row of an int8 all-gather: the quantized slots'
    scales and codes (``rows_wire_bytes``), then the other slots' bytes (an
    extension's inputs, left as they are)."""

    quantized: tuple[bool, ...]  # per slot, in group order
    slots: tuple[tuple[int, torch.dtype], ...]  # (elements, dtype) per slot
    block_size: int

    @property
    def quantized_numels(self) -> list[int]:
        return [n for (n, _), q in zip(self.slots, self.quantized, strict=True) if q]

    @property
    def quantized_bytes(self) -> int:
        return rows_wire_bytes(self.quantized_numels, self.block_size)

    @property
    def row_bytes(self) -> int:
        slots = zip(self.slots, self.quantized, strict=True)
        return self.quantized_bytes + sum(n * dtype.itemsize for (n, dtype), q in slots if not q)


@torch.no_grad()
def all_gather_row(
    inputs: list[torch.Tensor], layout: Int8Rows, device: torch.device
) -> torch.Tensor:
    """This rank's row of bytes (``layout.row_bytes``): its inputs (flat, each at
    most its slot long) quantized slot by slot, the padding of a slot zero (it
    shares the slot's last block), then the other slots' bytes."""
    row = torch.empty(layout.row_bytes, dtype=torch.uint8, device=device)
    numels = layout.quantized_numels
    values = torch.zeros(1, sum(numels), dtype=torch.float32, device=device)
    raw_at = layout.quantized_bytes
    quantized_inputs = iter(values.split(numels, dim=1))
    for x, (numel, dtype), quantized in zip(inputs, layout.slots, layout.quantized, strict=True):
        x = x.to(device, non_blocking=True)
        if quantized:
            next(quantized_inputs)[0, : x.numel()].copy_(x)
        else:
            nbytes = numel * dtype.itemsize
            data = x.to(dtype).view(torch.uint8)
            row.narrow(0, raw_at, data.numel()).copy_(data)
            raw_at += nbytes
    quantize_rows(values, numels, layout.block_size, out=row[: layout.quantized_bytes].view(1, -1))
    return row


@torch.no_grad()
def copy_out_int8(gathered: torch.Tensor, layout: Int8Rows, outputs: list[torch.Tensor]) -> None:
    """Dequantizes a finished int8 all-gather (``gathered``: W rows of bytes,
    flat) into ``outputs`` (one per slot, rank-major, see ``copy_out``)."""
    if not outputs:
        return
    world_size = outputs[0].size(0)
    rows = gathered.view(world_size, layout.row_bytes)
    # Each slot dequantized straight into its output: no full-size fp32 copy.
    slots = slot_ranges(layout.quantized_numels, layout.block_size)
    scales, codes = split_wire(
        rows[:, : layout.quantized_bytes], layout.quantized_numels, layout.block_size
    )
    raw_at = layout.quantized_bytes
    for out, (numel, dtype), q in zip(outputs, layout.slots, layout.quantized, strict=True):
        if q:
            (start, end), (scale_start, scale_end) = next(slots)
            values = dequantize_blockwise(
                codes[:, start:end], scales[:, scale_start:scale_end], layout.block_size, out.dtype
            )
            out.copy_(values.view(out.shape))
        else:
            nbytes = numel * dtype.itemsize
            src = rows[:, raw_at : raw_at + nbytes]
            out_bytes = out.view(torch.uint8) if out.dtype is not torch.uint8 else out
            out_bytes.copy_(src.reshape(out_bytes.shape))
            raw_at += nbytes


class GradientWire(NamedTuple):
    """How a group's gradient rows travel (``CompressionPolicy.gradients``)."""

    setting: str  # "bf16" or "int8"
    block_size: int


def encode_rows(
    rows: torch.Tensor, setting: str, slot_numels: list[int], block_size: int
) -> torch.Tensor:
    """The reduce-scatter input's rows as sent: bf16, or int8 rows of slots (uint8)."""
    if setting == "bf16":
        return rows.to(torch.bfloat16)
    return quantize_rows(rows, slot_numels, block_size)


def decode_rows(
    row: torch.Tensor, setting: str, slot_numels: list[int], block_size: int
) -> torch.Tensor:
    """Received rows (R, wire) back to fp32 (R, sum(slot_numels))."""
    if setting == "bf16":
        return row.float()
    return torch.cat(dequantize_rows(row, slot_numels, block_size, torch.float32), dim=1)


def exchange(
    output: torch.Tensor,
    sent: torch.Tensor,
    wire: GradientWire,
    slot_numels: list[int],
    collectives: Collectives,
    async_op: bool,
) -> JoinedWork | None:
    """The compressed reduce-scatter: ``sent`` (W, wire), row k to rank k, by
    one all-to-all; when waited, the W rows received decoded and added in
    fp32, in rank order, into ``output`` (1D, ``sum(slot_numels)``)."""
    setting, block_size = wire
    received = torch.empty_like(sent)
    work = collectives.all_to_all(received, sent, async_op)

    def add_rows() -> None:
        output.copy_(decode_rows(received[:1], setting, slot_numels, block_size).view(-1))
        for k in range(1, received.size(0)):
            output.add_(decode_rows(received[k : k + 1], setting, slot_numels, block_size).view(-1))

    joined = JoinedWork([] if work is None else [work], add_rows)
    if async_op:
        return joined
    joined.wait()
    return None


def all_reduce(
    output: torch.Tensor,
    slot_numels: list[int],
    wire: GradientWire,
    collectives: Collectives,
    async_op: bool,
) -> JoinedWork | None:
    """Sums ``output`` (1D, slots of ``slot_numels``) over the group, compressed:
    every slot cut in R pieces (``torch.chunk``'s, zero-padded), piece k of
    every slot to rank k by one all-to-all and summed there in fp32, then the
    sums compressed and all-gathered back into ``output``. When waited (on CPU
    the second collective runs then, blocking)."""
    setting, block_size = wire
    num_ranks = collectives.process_group.size()
    pieces = [-(-n // num_ranks) for n in slot_numels]  # per slot, elements per rank
    rows = torch.zeros(num_ranks, sum(pieces), dtype=torch.float32, device=output.device)
    for (start, end), column, piece in zip(
        _ranges(slot_numels), _starts(pieces), pieces, strict=True
    ):
        slot = torch.nn.functional.pad(
            output[start:end].float(), (0, num_ranks * piece - (end - start))
        )
        rows[:, column : column + piece] = slot.view(num_ranks, piece)
    sent = encode_rows(rows, setting, pieces, block_size)
    summed = torch.empty(sum(pieces), dtype=torch.float32, device=output.device)
    first = exchange(summed, sent, wire, pieces, collectives, async_op)

    def gather_sums() -> None:
        if first is not None:
            first.wait()
        mine = encode_rows(summed.view(1, -1), setting, pieces, block_size)
        gathered = torch.empty((num_ranks, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        collectives.all_gather(gathered.view(-1), mine.view(-1))
        values = decode_rows(gathered, setting, pieces, block_size)  # (R, sum(pieces))
        for (start, end), column, piece in zip(
            _ranges(slot_numels), _starts(pieces), pieces, strict=True
        ):
            whole = values[:, column : column + piece].reshape(-1)
            output[start:end].copy_(whole[: end - start])

    joined = JoinedWork([], gather_sums)
    if async_op:
        return joined
    joined.wait()
    return None


def all_reduce_sent_bytes(slot_numels: list[int], wire: GradientWire, num_ranks: int) -> int:
    """What ``comm_stats`` counts for a compressed all-reduce: its compressed
    buffer once, as it counts an uncompressed all-reduce's buffer once."""
    pieces = [-(-n // num_ranks) for n in slot_numels]
    if wire.setting == "bf16":
        return num_ranks * sum(pieces) * 2
    return num_ranks * rows_wire_bytes(pieces, wire.block_size)


def _ranges(numels: list[int]) -> list[tuple[int, int]]:
    starts = _starts(numels)
    return [(start, start + n) for start, n in zip(starts, numels, strict=True)]


def _starts(numels: list[int]) -> list[int]:
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += n
    return starts
