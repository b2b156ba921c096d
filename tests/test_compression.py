"""The quantizers and CompressionPolicy, single process (see [Note: wire formats]
in fsdp2/comm/wire.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from dist import fake_world
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

from fsdp2 import CompressionPolicy, fully_shard
from fsdp2.comm.all_gather import Int8AllGather
from fsdp2.comm.wire import (
    NONFINITE_CODE,
    dequantize_blockwise,
    dequantize_rows,
    quantize_blockwise,
    quantize_rows,
    rows_wire_bytes,
)

# x / scale and q * scale are each rounded once in fp32: the half-step bound
# absmax / 254 may be exceeded by a few units in the last place of absmax.
ROUNDING_SLACK = 4 * torch.finfo(torch.float32).eps


def _bound_per_element(x: torch.Tensor, block_size: int) -> torch.Tensor:
    n = x.numel()
    blocks = math.ceil(n / block_size)
    padded = torch.nn.functional.pad(x.abs(), (0, blocks * block_size - n))
    absmax = padded.view(blocks, block_size).amax(dim=1)
    per_block = absmax / 254 + absmax * ROUNDING_SLACK
    return per_block.repeat_interleave(block_size)[:n]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 700),
    block_size=st.sampled_from([1, 7, 64, 256]),
    log_scale=st.floats(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_within_half_a_step(n, block_size, log_scale, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator) * math.exp(log_scale)
    codes, scales = quantize_blockwise(x, block_size)
    assert codes.dtype is torch.int8 and codes.shape == x.shape
    assert scales.shape == (math.ceil(n / block_size),)
    assert int(codes.min()) >= -127  # -128 is reserved for non-finite values
    y = dequantize_blockwise(codes, scales, block_size, torch.float32)
    assert ((y - x).abs() <= _bound_per_element(x, block_size)).all()


@pytest.mark.parametrize("magnitude", [1e-40, 1e-30, 1.0, 1e30, 3e38])
def test_extreme_magnitudes_within_half_a_step(magnitude):
    """Subnormal blocks (their scale is subnormal too) up to fp32's largest."""
    x = torch.linspace(-1, 1, 300) * magnitude
    codes, scales = quantize_blockwise(x, 256)
    y = dequantize_blockwise(codes, scales, 256, torch.float32)
    assert torch.isfinite(y).all()
    # Subnormal scales have fewer significant bits: one step of the smallest
    # subnormal (2**-149) per element on top.
    tiny = torch.finfo(torch.float32).smallest_normal * 2**-23
    assert ((y - x).abs() <= _bound_per_element(x, 256) + 127 * tiny).all()


def test_uneven_last_block_has_its_own_scale():
    x = torch.cat([torch.full((256,), 100.0), torch.tensor([0.5, -0.25, 0.125])])
    codes, scales = quantize_blockwise(x, 256)
    assert scales.tolist() == pytest.approx([100 / 127, 0.5 / 127])
    y = dequantize_blockwise(codes, scales, 256, torch.float32)
    assert (y[256:] - x[256:]).abs().max() <= 0.5 / 254 * (1 + ROUNDING_SLACK)


def test_all_zero_blocks_are_exact():
    x = torch.zeros(600)
    x[300:310] = torch.randn(10)
    codes, scales = quantize_blockwise(x, 256)
    assert scales[0] == 0 and scales[2] == 0
    y = dequantize_blockwise(codes, scales, 256, torch.float32)
    assert torch.equal(y[:256], x[:256]) and torch.equal(y[512:], x[512:])
    assert not y.isnan().any()


def test_nonfinite_values_stay_element_wise():
    x = torch.randn(512)
    x[3], x[100], x[300] = float("nan"), float("inf"), float("-inf")
    codes, scales = quantize_blockwise(x, 256)
    assert torch.isfinite(scales).all()
    assert codes[3] == NONFINITE_CODE and codes[100] == NONFINITE_CODE
    y = dequantize_blockwise(codes, scales, 256, torch.float32)
    assert y.isnan().nonzero().flatten().tolist() == [3, 100, 300]
    finite = torch.isfinite(x)
    bound = _bound_per_element(torch.where(finite, x, 0.0), 256)
    assert ((y - x).abs()[finite] <= bound[finite]).all()


def test_dequantize_into_bf16():
    x = torch.randn(1000)
    codes, scales = quantize_blockwise(x, 256)
    y = dequantize_blockwise(codes, scales, 256, torch.bfloat16)
    assert y.dtype is torch.bfloat16
    # Half a step, then one bf16 rounding (relative 2**-8) of the result.
    bound = _bound_per_element(x, 256) + x.abs().max() * 2**-8
    assert ((y.float() - x).abs() <= bound).all()


@pytest.mark.parametrize("block_size", [4, 256])
def test_rows_of_slots_round_trip(block_size):
    slot_numels = [5, 0, 300, 17]
    rows = torch.randn(3, sum(slot_numels))
    rows[:, :5] *= 1000  # a slot of large values does not coarsen its neighbours
    wire = quantize_rows(rows, slot_numels, block_size)
    assert wire.dtype is torch.uint8
    assert wire.shape == (3, rows_wire_bytes(slot_numels, block_size))
    slots = dequantize_rows(wire, slot_numels, block_size, torch.float32)
    for got, want in zip(slots, rows.split(slot_numels, dim=1), strict=True):
        assert got.shape == want.shape
        for row_got, row_want in zip(got, want, strict=True):
            bound = _bound_per_element(row_want, block_size)
            assert ((row_got - row_want).abs() <= bound).all()


def test_wire_bytes_ratio():
    # One fp32 scale per block: 0.25 + 1 / block_size of fp32's bytes.
    numel = 256 * 1000
    assert rows_wire_bytes([numel], 256) / (4 * numel) == pytest.approx(0.25 + 1 / 256)


def test_compile_fuses_the_quantizer():
    x = torch.randn(1000)
    compiled = torch.compile(quantize_blockwise, backend="eager", fullgraph=True)
    codes, scales = compiled(x, 256)
    eager_codes, eager_scales = quantize_blockwise(x, 256)
    assert torch.equal(codes, eager_codes) and torch.equal(scales, eager_scales)


def test_policy_validation():
    assert not CompressionPolicy().enabled
    assert CompressionPolicy(gradients="bf16").enabled
    with pytest.raises(ValueError, match=r"weights=.*must be one of \(None, 'int8'\), got 'fp8'"):
        CompressionPolicy(weights="fp8")
    with pytest.raises(ValueError, match=r"gradients=.*got 'int4'"):
        CompressionPolicy(gradients="int4")
    with pytest.raises(TypeError, match=r"gradients=.*got dtype"):
        CompressionPolicy(gradients=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"block_size=.*expects an int, got float"):
        CompressionPolicy(block_size=256.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_size=.*at least 1, got 0"):
        CompressionPolicy(block_size=0)
    with pytest.raises(ValueError, match=r"across=.*got 'shard'"):
        CompressionPolicy(across="shard")


def test_fully_shard_checks_the_policy():
    with fake_world(8):
        flat = init_device_mesh("cpu", (8,))
        hsdp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        with pytest.raises(TypeError, match=r"compression must be an fsdp2.CompressionPolicy, got"):
            fully_shard(nn.Linear(4, 4), mesh=flat, compression={"weights": "int8"})
        with pytest.raises(ValueError, match=r"across='replicate'.*no replicate axis.*2D mesh"):
            fully_shard(
                nn.Linear(4, 4),
                mesh=flat,
                compression=CompressionPolicy(gradients="bf16", across="replicate"),
            )
        with pytest.raises(ValueError, match=r"weights='int8', across='replicate'.*weights=None"):
            fully_shard(
                nn.Linear(4, 4),
                mesh=hsdp,
                compression=CompressionPolicy(weights="int8", gradients="bf16", across="replicate"),
            )
        with pytest.raises(ValueError, match=r"without gradients=.*compresses nothing"):
            fully_shard(
                nn.Linear(4, 4), mesh=hsdp, compression=CompressionPolicy(across="replicate")
            )
        layer = fully_shard(
            nn.Linear(4, 4),
            mesh=hsdp,
            compression=CompressionPolicy(gradients="int8", across="replicate"),
        )
        assert layer._fsdp_state.param_groups[0].settings.compression.gradients == "int8"
        # With the optimizer sharded over replicas the weights cross the replicas:
        # across="replicate" compresses their all-gather there, and chooses that variant.
        over = fully_shard(
            nn.Linear(4, 8),
            mesh=hsdp,
            shard_optimizer_over_replicas=True,
            compression=CompressionPolicy(weights="int8", across="replicate"),
        )
        kept = over._fsdp_state.param_groups[0].comms.kept_chunks
        assert isinstance(kept.gather, Int8AllGather) and kept.block_size is None
        with pytest.raises(TypeError, match=r"shard_optimizer_over_replicas=...\) takes True or"):
            fully_shard(nn.Linear(4, 8), mesh=hsdp, shard_optimizer_over_replicas="false")
