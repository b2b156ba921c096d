"""The wire formats of ``CompressionPolicy``: the quantizers, as plain torch ops.

[Note: wire formats]
Only what travels is compressed; sharded parameters, gradients and optimizer
state keep their dtype.

- Blockwise int8 (``quantize_blockwise``): a 1D run of ``n`` values is cut into
  blocks of ``block_size`` (the last one may be shorter); each block is sent
  as its fp32 scale ``absmax / 127`` and one int8 per value,
  ``round(x / scale)`` in [-127, 127]. Dequantized, ``q * scale`` is within
  ``absmax / 254`` of ``x`` (half a step), and an all-zero block is exact
  (scale 0). A non-finite value (nan, +-inf) is sent as the code -128 and comes
  back as nan, element by element: its block is scaled by the absmax of its
  finite values, so one nan never spreads over a block, and an inf gradient
  still reaches a grad scaler's check (as a nan).
- A row of several slots (one per parameter: a rank's block of the all-gather
  buffer, a row of the reduce-scatter input) is quantized slot by slot, so a
  block never mixes two parameters' magnitudes (a norm's 1.0 next to a
  weight's 0.02). One row on the wire, in bytes: every slot's scales (fp32,
  ``ceil(n_i / block_size)`` each), then every slot's int8 codes (``n_i``
  each): ``4 * sum(ceil(n_i / B)) + sum(n_i)`` bytes, about ``0.25 + 1 / B``
  of fp32 (``rows_wire_bytes``).
- bf16 gradients: the row cast to bf16, summed in fp32 by its receiver.

Everything here is elementwise work and reductions over a block: torch.compile
fuses it, and a GPU runs it at memory bandwidth (about 6 bytes touched per
fp32 value quantized).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

NONFINITE_CODE = -128  # int8 code of a nan or inf value; the others use [-127, 127]


def num_blocks(numel: int, block_size: int) -> int:
    return math.ceil(numel / block_size)


def quantize_blockwise(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes the last dim of ``x`` in blocks of ``block_size`` (the last
    block may be shorter): returns ``(codes, scales)``, ``codes`` int8 shaped
    like ``x``, ``scales`` fp32 ``(*x.shape[:-1], ceil(n / block_size))``. See
    [Note: wire formats]."""
    n = x.size(-1)
    blocks = num_blocks(n, block_size)
    x = x.float()
    if blocks * block_size != n:
        x = torch.nn.functional.pad(x, (0, blocks * block_size - n))  # zeros: absmax unchanged
    x = x.unflatten(-1, (blocks, block_size))  # (..., blocks, block_size)
    magnitudes = x.abs()
    # nan < inf is False: one comparison finds both (isfinite makes four passes).
    nonfinite = torch.lt(magnitudes, float("inf")).logical_not_()
    absmax = magnitudes.masked_fill_(nonfinite, 0.0).amax(dim=-1)  # of the finite values
    scales = absmax / 127.0  # 0 for an all-zero block
    # A divide, not a multiply by 127 / absmax: that overflows for subnormal blocks.
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(-1)
    codes = torch.div(x, divisor).round_().clamp_(-127, 127).masked_fill_(nonfinite, NONFINITE_CODE)
    return codes.to(torch.int8).flatten(-2)[..., :n], scales


def dequantize_blockwise(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of ``quantize_blockwise``, in ``dtype``: nan where a value
    was not finite."""
    n = codes.size(-1)
    blocks = scales.size(-1)
    values = codes.float()
    if blocks * block_size != n:
        values = torch.nn.functional.pad(values, (0, blocks * block_size - n))
    values = values.unflatten(-1, (blocks, block_size)).mul_(scales.unsqueeze(-1))
    values = values.flatten(-2)[..., :n].masked_fill_(codes == NONFINITE_CODE, float("nan"))
    return values.to(dtype)


def rows_wire_bytes(slot_numels: list[int], block_size: int) -> int:
    """Bytes of one row of slots on the wire (scales, then codes)."""
    scales = sum(num_blocks(n, block_size) for n in slot_numels)
    return 4 * scales + sum(slot_numels)


def quantize_rows(
    rows: torch.Tensor, slot_numels: list[int], block_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``rows`` (R, sum(slot_numels)), float, quantized slot by slot into
    ``out`` (R, ``rows_wire_bytes``) uint8 (allocated if None)."""
    num_rows = rows.size(0)
    scale_counts = [num_blocks(n, block_size) for n in slot_numels]
    num_scales = sum(scale_counts)
    if out is None:
        out = torch.empty(
            num_rows,
            rows_wire_bytes(slot_numels, block_size),
            dtype=torch.uint8,
            device=rows.device,
        )
    scales = torch.empty(num_rows, num_scales, dtype=torch.float32, device=rows.device)
    codes = out[:, 4 * num_scales :].view(torch.int8)
    for (start, end), (scale_start, scale_end) in slot_ranges(slot_numels, block_size):
        q, s = quantize_blockwise(rows[:, start:end], block_size)
        codes[:, start:end] = q
        scales[:, scale_start:scale_end] = s
    out[:, : 4 * num_scales] = scales.view(torch.uint8)
    return out


def dequantize_rows(
    wire: torch.Tensor, slot_numels: list[int], block_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``wire`` (R, ``rows_wire_bytes``) uint8 back to one (R, n_i) tensor of
    ``dtype`` per slot."""
    scales, codes = split_wire(wire, slot_numels, block_size)
    return [
        dequantize_blockwise(
            codes[:, start:end], scales[:, scale_start:scale_end], block_size, dtype
        )
        for (start, end), (scale_start, scale_end) in slot_ranges(slot_numels, block_size)
    ]


def split_wire(
    wire: torch.Tensor, slot_numels: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``wire`` (R, ``rows_wire_bytes``) uint8 seen as its scales (R, S) fp32
    and its codes (R, sum(slot_numels)) int8."""
    num_scales = sum(num_blocks(n, block_size) for n in slot_numels)
    # A copy: the scales' bytes in a row need not sit at a multiple of 4.
    scales = torch.empty(wire.size(0), num_scales, dtype=torch.float32, device=wire.device)
    scales.view(torch.uint8).copy_(wire[:, : 4 * num_scales])
    return scales, wire[:, 4 * num_scales :].view(torch.int8)


def slot_ranges(
    slot_numels: list[int], block_size: int
) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """Each slot's (start, end) among a row's codes and among its scales."""
    start = scale_start = 0
    for n in slot_numels:
        blocks = num_blocks(n, block_size)
        yield (start, start + n), (scale_start, scale_start + blocks)
        start += n
        scale_start += blocks
