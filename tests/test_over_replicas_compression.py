"""``compression=`` together with ``shard_optimizer_over_replicas=True`` (see
[Note: compression over replicas] in fsdp2/comm/over_replicas.py), on 2 x 2 gloo
ranks; 2 x 4 is in test_hsdp_replica_sharding.py's 8-rank test.

References:

- weights: what forward computes with is, bit for bit, every rank's piece
  quantized once on its own and dequantized (the wire arithmetic, applied
  here to the full parameters): with ``across="all"`` (codes kept, moved by
  both all-gathers) and ``across="replicate"`` (int8 across replicas only)
  alike, before and after an optimizer step. Nothing is quantized twice: a
  second rounding would not give these bits.
- bf16 gradients, against the mean of a plain copy's per-rank gradients at the
  same parameters (the unsharded reference): each rounding is off by at most
  u = 2**-8 relative, so ``across="all"`` (each rank's gradient rounded into
  the shard group, each shard group's sum rounded across the replicas) is
  within 2 u S / W, ``across="replicate"`` within u S / W (S = sum_k |g_k|),
  plus the fp32 summation bound (tests/error_model.py).
- int8 everywhere: training stays near the uncompressed option's.
- bytes: ``comm_stats`` per step equals the formula from the shapes.
- a DCP checkpoint of the compressed option loads into 1D FSDP and back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from checkpoints import check_state, full_state, load, perturbed, save
from dist import labelled, run_ranks
from models import (
    build_model,
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from test_compression_training import _check_bf16_grads, _unsharded_weights
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import CompressionPolicy
from fsdp2.comm.wire import dequantize_rows, quantize_rows, rows_wire_bytes

pytestmark = pytest.mark.distributed

KIND = "mlp"
BLOCK = 64  # smaller than the default, so that several blocks share a slot


def _nested_chunks(full: torch.Tensor, replicas: int, shards: int) -> list[list[torch.Tensor]]:
    """``[s][r]``: torch.chunk over the shards, then each chunk over the replicas."""
    chunks = [_chunk(full, shards, s) for s in range(shards)]
    return [[_chunk(chunk, replicas, r) for r in range(replicas)] for chunk in chunks]


def _chunk(t: torch.Tensor, n: int, i: int) -> torch.Tensor:
    chunks = torch.chunk(t, n) if t.size(0) else ()
    return chunks[i] if i < len(chunks) else t[:0]


def _rounded_once(full: torch.Tensor, replicas: int, shards: int) -> torch.Tensor:
    """Every piece quantized blockwise on its own, from its first value, and
    dequantized: the unsharded parameter compressed weights give."""
    pieces = []
    for row in _nested_chunks(full, replicas, shards):
        for piece in row:
            n = piece.numel()
            if n == 0:
                pieces.append(piece)
                continue
            wire = quantize_rows(piece.reshape(1, n).float(), [n], BLOCK)
            (values,) = dequantize_rows(wire, [n], BLOCK, full.dtype)
            pieces.append(values.view(piece.shape))
    return torch.cat(pieces)


def _expected_stats(
    model: nn.Module, replicas: int, shards: int, policy: CompressionPolicy
) -> dict[str, dict[str, tuple[int, int]]]:
    """Per group and kind of collective, on this rank, from the parameters'
    shapes (fp32): the calls in a training step after the first, and the
    bytes of each. Forward and backward all-gather inside the shard group;
    the chunks are gathered across the replicas once per step (the pieces
    changed once); nothing is reduced across replicas where this rank's
    chunks are all empty, nor gathered unless codes are kept."""
    s = dist.get_rank() % shards
    out = {}
    for i, layer in enumerate(model.layers):
        chunk_slots, piece_slots, largest = [], [], []
        for param in layer.parameters():
            rows = param.size(0)
            row_numel = param[0].numel()
            chunk_rows = -(-rows // shards)
            mine = max(0, min(chunk_rows, rows - s * chunk_rows))
            chunk_slots.append(chunk_rows * row_numel)
            piece_slots.append(-(-mine // replicas) * row_numel)
            largest.append(-(-chunk_rows // replicas) * row_numel)
        codes = sum(rows_wire_bytes([n], BLOCK) for n in largest)
        weights, gradients = policy.weights, policy.gradients
        across_all = policy.across == "all"
        gathered = replicas * codes if weights and across_all else 4 * sum(chunk_slots)
        if weights and across_all:
            replica_gathered = codes
        elif weights:
            replica_gathered = rows_wire_bytes(piece_slots, BLOCK)
        else:
            replica_gathered = 4 * sum(piece_slots)
        empty = sum(piece_slots) == 0
        out[f"layers.{i}"] = {
            "all_gather": (2, shards * gathered),
            "replica_all_gather": (
                int(not empty or bool(weights and across_all)),
                replicas * replica_gathered,
            ),
            "reduce_scatter": (1, shards * _sent(chunk_slots, gradients if across_all else None)),
            "replica_reduce_scatter": (int(not empty), replicas * _sent(piece_slots, gradients)),
            "all_reduce": (0, 0),
        }
    return out


def check_stats(stats: fsdp2.CommStats, expected: dict[str, dict[str, tuple[int, int]]]) -> None:
    for step, groups in enumerate(stats.steps):
        for group, kinds in expected.items():
            for kind, (count, nbytes) in kinds.items():
                recorded = groups[group].of(kind)
                got = (recorded.count, recorded.bytes)
                assert got == (count, count * nbytes), (step, group, kind, got, nbytes)


def _sent(slots: list[int], gradients: str | None) -> int:
    """One row of a reduction's input as sent: fp32, bf16, or int8 rows of slots."""
    if gradients == "int8":
        return rows_wire_bytes(slots, BLOCK)
    return sum(slots) * (2 if gradients == "bf16" else 4)


def _build(mesh, policy: CompressionPolicy) -> nn.Module:
    return shard_model(
        build_model(KIND), mesh=mesh, shard_optimizer_over_replicas=True, compression=policy
    )


def _weights_and_bytes(rank: int, world_size: int, across: str) -> None:
    """int8 weights (and bf16 gradients, for the bytes): two steps, the
    weights forward used checked bit for bit at each."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    policy = CompressionPolicy(weights="int8", gradients="bf16", block_size=BLOCK, across=across)
    model = _build(mesh, policy)
    optim = make_optimizer(model)
    used = _unsharded_weights(model)
    expected = _expected_stats(model, 2, 2, policy)
    with fsdp2.comm_stats(model) as stats:
        for step in range(2):
            params = full_params(model)
            mean_loss(model, *local_batch(global_batch(KIND, step), rank, world_size)).backward()
            for name, full in params.items():
                assert torch.equal(used[name], _rounded_once(full, 2, 2)), f"step {step}: {name}"
                assert not torch.equal(used[name], full), f"{name} not quantized"
            optim.step()
            optim.zero_grad()
    check_stats(stats, expected)


def _gradients(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for across, roundings in (("all", 2), ("replicate", 1)):
        with labelled(f"bf16 gradients, across={across!r}"):
            model = _build(mesh, CompressionPolicy(gradients="bf16", across=across))
            params = full_params(model)
            mean_loss(model, *local_batch(global_batch(KIND, 0), rank, world_size)).backward()
            _check_bf16_grads(model, build_model(KIND), params, world_size, roundings)


def _near_uncompressed(rank: int, world_size: int) -> None:
    """int8 weights and gradients everywhere: the losses of 3 steps stay within
    2 % of the uncompressed option's, and they differ from them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    losses = {}
    for name, policy in {
        "off": CompressionPolicy(),
        "int8": CompressionPolicy(weights="int8", gradients="int8", block_size=BLOCK),
    }.items():
        model = _build(mesh, policy)
        optim = make_optimizer(model)
        losses[name] = []
        for step in range(3):
            loss = mean_loss(model, *local_batch(global_batch(KIND, step), rank, world_size))
            loss.backward()
            losses[name].append(global_mean(loss, world_size).item())
            optim.step()
            optim.zero_grad()
    for off, compressed in zip(losses["off"], losses["int8"], strict=True):
        assert abs(off - compressed) <= 0.02 * abs(off), losses
    assert losses["off"] != losses["int8"], "compression changed nothing"


def _checkpoint(rank: int, world_size: int, path: Path) -> None:
    """The compressed option's DCP checkpoint into 1D FSDP over the 4 ranks,
    and 1D FSDP's back into the compressed option: full states bit for bit."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    policy = CompressionPolicy(weights="int8", gradients="int8", block_size=BLOCK)
    model = _build(mesh, policy)
    optim = make_optimizer(model)
    for step in range(2):
        mean_loss(model, *local_batch(global_batch(KIND, step), rank, world_size)).backward()
        optim.step()
        optim.zero_grad()
    expected = full_state(model, optim)
    save(model, optim, path / "compressed")
    flat = init_device_mesh("cpu", (world_size,))
    fsdp = shard_model(perturbed(KIND), mesh=flat)
    fsdp_optim = make_optimizer(fsdp)
    load(fsdp, fsdp_optim, path / "compressed")
    check_state(full_state(fsdp, fsdp_optim), expected, "into 1D FSDP")
    save(fsdp, fsdp_optim, path / "fsdp")
    back = _build(mesh, policy)
    back_optim = make_optimizer(back)
    load(back, back_optim, path / "fsdp")
    check_state(full_state(back, back_optim), expected, "back into the compressed option")


def _all(rank: int, world_size: int, path: Path) -> None:
    for across in ("all", "replicate"):
        with labelled(f"int8 weights, across={across!r}"):
            _weights_and_bytes(rank, world_size, across)
    _gradients(rank, world_size)
    with labelled("int8 everywhere, near the uncompressed option"):
        _near_uncompressed(rank, world_size)
    with labelled("checkpoint"):
        _checkpoint(rank, world_size, path)


def test_compression_over_replicas_2x2(tmp_path: Path) -> None:
    """On 2 x 2 (uneven MLP): int8 weights rounded once per piece, bit for bit,
    with across="all" and "replicate"; comm_stats bytes per step equal the
    formula; bf16 gradients within two roundings (across="all") or one
    ("replicate") of the unsharded reference; int8 everywhere near the
    uncompressed option; a DCP checkpoint to 1D FSDP and back."""
    (tmp_path / "ckpt").mkdir()
    run_ranks(_all, 4, tmp_path / "ranks", tmp_path / "ckpt")
