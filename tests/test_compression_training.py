"""Compressed communication on 2 gloo ranks: the bytes on the wire, and the
gradients and weights each setting gives against a reference that applies the
same rounding to an unsharded model (see [Note: wire formats] in
fsdp2/comm/wire.py and [Note: the error model] in tests/error_model.py).

How the references are built, per setting (W ranks, g_k = rank k's local
gradient of a plain copy of the model, at the parameters the sharded model
computed with):

- bf16 gradients: mean_k fp32(bf16(g_k)). fsdp2 sums the same W terms in fp32
  in rank order; the reference sums them in another order: point 2 of the
  note, ``rank_mean_bound`` with S = sum_k |bf16(g_k)|; at W = 2 the same
  bits (a + b = b + a, halving is exact: ``EXACT``), asserted so.
- int8 gradients: every term is off by at most half a step of its block,
  absmax / 254, and a block lies inside one rank's slot of one parameter
  (torch.chunk's rows j): |error| <= sum_k absmax_j(g_k) / (254 W), plus the
  same summation bound.
- int8 weights: the unsharded parameter is each rank's shard quantized and
  dequantized: within absmax / 254 of the shard, per rank's rows; the sharded
  parameters themselves are untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist import labelled, run_ranks
from error_model import rank_mean_bound
from models import (
    build_model,
    full_params,
    global_batch,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import fsdp2
from fsdp2 import CompressionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402

pytestmark = pytest.mark.distributed

KIND = "mlp"
WORLD_SIZE = 2
# fp32 rounding of x / scale and of q * scale, relative to absmax (test_compression.py).
ROUNDING_SLACK = 4 * torch.finfo(torch.float32).eps

SETTINGS = {
    "off": CompressionPolicy(),
    "weights_int8": CompressionPolicy(weights="int8"),
    "gradients_bf16": CompressionPolicy(gradients="bf16"),
    "gradients_int8": CompressionPolicy(gradients="int8"),
}


def _local_grads(
    replica: nn.Module, params: dict[str, torch.Tensor], world_size: int, step: int
) -> list[dict[str, torch.Tensor]]:
    """Each rank's local gradients of a plain copy at ``params``."""
    with torch.no_grad():
        for name, p in replica.named_parameters():
            p.copy_(params[name])
    grads = []
    for k in range(world_size):
        replica.zero_grad(set_to_none=True)
        mean_loss(replica, *local_batch(global_batch(KIND, step), k, world_size)).backward()
        grads.append({n: p.grad.detach().clone() for n, p in replica.named_parameters()})
    return grads


def _chunk_absmax(grad: torch.Tensor, world_size: int) -> torch.Tensor:
    """Each element's bound source: the absmax over the rows of torch.chunk's
    piece it belongs to (a rank's slot, which holds all of its blocks)."""
    out = torch.empty_like(grad)
    for rows, dst in zip(grad.chunk(world_size), out.chunk(world_size), strict=True):
        dst.fill_(rows.abs().max())
    return out


def _unsharded_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Registers hooks that keep what each layer computed with."""
    seen: dict[str, torch.Tensor] = {}

    def keep(prefix: str):
        def hook(module, args, output):
            for name, p in module.named_parameters(recurse=False):
                seen[f"{prefix}.{name}"] = p.detach().clone()

        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(keep(f"layers.{i}"), prepend=True)  # before resharding
    return seen


def _run(rank: int, world_size: int, setting: str, steps: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    model = shard_model(build_model(KIND), mesh=mesh, compression=SETTINGS[setting])
    replica = build_model(KIND)
    optim = make_optimizer(model)
    computed_with = _unsharded_weights(model)
    result = {"losses": [], "grads_checked": 0}
    with fsdp2.comm_stats(model) as stats:
        for step in range(steps):
            params = full_params(model)
            loss = mean_loss(model, *local_batch(global_batch(KIND, step), rank, world_size))
            loss.backward()
            result["losses"].append(loss.item())
            with labelled(f"{setting}, step {step}"):
                _check_step(model, replica, params, computed_with, setting, world_size, step)
            result["grads_checked"] += 1
            optim.step()
            optim.zero_grad()
    step_stats = stats.steps[-1]
    result["all_gather"] = sum(g.all_gather.bytes for g in step_stats.values())
    result["reduce_scatter"] = sum(g.reduce_scatter.bytes for g in step_stats.values())
    result["all_reduce"] = sum(g.all_reduce.bytes for g in step_stats.values())
    result["params"] = full_params(model)
    return result


def _check_step(
    model: nn.Module,
    replica: nn.Module,
    params: dict[str, torch.Tensor],
    computed_with: dict[str, torch.Tensor],
    setting: str,
    world_size: int,
    step: int,
) -> None:
    if setting == "weights_int8":
        for name, full in params.items():
            used = computed_with[name]
            bound = _chunk_absmax(full, world_size) * (1 / 254 + ROUNDING_SLACK)
            assert ((used - full).abs() <= bound).all(), name
            assert not torch.equal(used, full) or full.abs().max() == 0, f"{name} not quantized"
        # The sharded parameters stay full precision: forward left them as they were.
        for name, now in full_params(model).items():
            assert torch.equal(now, params[name]), name
        return
    if setting == "off":
        return
    # The gradients of a plain copy, per rank, at the same parameters.
    local = _local_grads(replica, params, world_size, step)
    for name, p in model.named_parameters():
        got = p.grad.full_tensor()
        terms = [g[name] for g in local]
        if setting == "gradients_bf16":
            rounded = [t.bfloat16().float() for t in terms]
            expected = sum(rounded) / world_size
            bound = rank_mean_bound(sum(t.abs() for t in rounded), world_size)
            if world_size <= 2:  # a + b = b + a and halving is exact: EXACT
                bound = torch.zeros_like(bound)
        else:
            expected = sum(terms) / world_size
            half_steps = sum(_chunk_absmax(t, world_size) for t in terms) / (254 * world_size)
            bound = half_steps * (1 + 254 * ROUNDING_SLACK) + rank_mean_bound(
                sum(t.abs() for t in terms), world_size
            )
        excess = (got - expected).abs() - bound
        assert (excess <= 0).all(), f"{name}: worst excess {excess.max().item():.3e}"


def _bytes_and_training(rank: int, world_size: int) -> None:
    results = {setting: _run(rank, world_size, setting, steps=2) for setting in SETTINGS}
    off = results["off"]
    with labelled("bytes per step against uncompressed fp32"):
        weights = results["weights_int8"]["all_gather"] / off["all_gather"]
        bf16 = results["gradients_bf16"]["reduce_scatter"] / off["reduce_scatter"]
        int8 = results["gradients_int8"]["reduce_scatter"] / off["reduce_scatter"]
        assert weights <= 0.27, weights
        assert bf16 <= 0.5, bf16
        assert int8 <= 0.27, int8
        # scripts/estimate.py's arithmetic is the engine's, to the byte.
        groups = estimate.group_shapes(build_model(KIND))
        for setting, policy in SETTINGS.items():
            predicted = estimate.wire_bytes(groups, world_size, policy.weights, policy.gradients)
            measured = (results[setting]["all_gather"], results[setting]["reduce_scatter"])
            assert predicted == measured, (setting, predicted, measured)
        # Each setting leaves the other collective as it was.
        assert results["weights_int8"]["reduce_scatter"] == off["reduce_scatter"]
        assert results["gradients_bf16"]["all_gather"] == off["all_gather"]
        assert off["all_reduce"] == 0
    with labelled("compression off changes nothing"):
        mesh = init_device_mesh("cpu", (world_size,))
        plain = shard_model(build_model(KIND), mesh=mesh)
        optim = make_optimizer(plain)
        for step in range(2):
            mean_loss(plain, *local_batch(global_batch(KIND, step), rank, world_size)).backward()
            optim.step()
            optim.zero_grad()
        for name, param in full_params(plain).items():
            assert torch.equal(param, off["params"][name]), name


def test_bytes_and_gradients_per_setting(tmp_path: Path) -> None:
    run_ranks(_bytes_and_training, WORLD_SIZE, tmp_path)


def _composition(rank: int, world_size: int) -> None:
    """Every setting at once with mixed precision, CPU offload, gradient
    accumulation without sync, an int reshard_after_forward, unused parameters
    reduce-scattered and compiled blocks: trains, and stays near the
    uncompressed run."""
    mesh = init_device_mesh("cpu", (world_size,))
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = fsdp2.CPUOffloadPolicy(pin_memory=False)
    losses = {}
    for name, compression in {
        "off": CompressionPolicy(),
        "all": CompressionPolicy(weights="int8", gradients="int8", block_size=64),
    }.items():
        model = build_model("transformer_untied")
        for layer in model.layers:
            layer.compile(backend="aot_eager")
            fsdp2.fully_shard(
                layer,
                mesh=mesh,
                mp_policy=mp,
                offload_policy=offload,
                compression=compression,
                reshard_after_forward=1,
            )
        fsdp2.fully_shard(
            model, mesh=mesh, mp_policy=mp, offload_policy=offload, compression=compression
        )
        model.set_reduce_scatter_unused_params(True)
        optim = make_optimizer(model)
        losses[name] = []
        weights = _forward_and_backward_weights(model.layers[0])
        for step in range(3):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                batch = local_batch(global_batch("transformer_untied", 2 * step + micro), rank, 2)
                loss = mean_loss(model, *batch)
                loss.backward()
                losses[name].append(loss.item())
                # Backward computes with the weights forward used: the post-forward
                # shard (reshard_after_forward=1) was kept as gathered, not
                # quantized a second time.
                for key, forward in weights["forward"].items():
                    assert torch.equal(weights["backward"][key], forward), key
            for p in model.parameters():
                assert p.grad is not None and p.grad.dtype is torch.float32
            optim.step()
            optim.zero_grad()
    with labelled("compressed training stays near uncompressed"):
        for off, compressed in zip(losses["off"], losses["all"], strict=True):
            assert abs(off - compressed) <= 0.02 * abs(off), (losses["off"], losses["all"])
    with labelled("custom reduce-scatter and compressed gradients"):
        model = shard_model(
            build_model(KIND), mesh=mesh, compression=CompressionPolicy(gradients="bf16")
        )
        with pytest.raises(ValueError, match=r"set_custom_reduce_scatter is not supported.*bf16"):
            model.layers[0].set_custom_reduce_scatter(_NoReduceScatter())
    with labelled("a subclass that all-gathers itself is left as it is"):
        _extension_left_alone(mesh)


def _forward_and_backward_weights(block: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """What ``block`` computes with in forward (before it reshards) and in
    backward (when its output's gradient arrives, after fsdp2 unsharded it)."""
    seen: dict[str, dict[str, torch.Tensor]] = {"forward": {}, "backward": {}}

    def keep(when: str) -> None:
        for name, p in block.named_parameters():
            seen[when][name] = p.detach().clone()

    def hook_output(module, args, output) -> None:
        output.register_hook(lambda grad: keep("backward"))

    block.register_forward_hook(lambda m, args, out: keep("forward"), prepend=True)
    block.register_forward_hook(hook_output)  # after fsdp2's: its pre-backward runs first
    return seen


class _NoReduceScatter(fsdp2.ReduceScatter):
    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        raise AssertionError("never called")


def _extension_left_alone(mesh) -> None:
    """A frozen int8 row-quantized weight (tests/quantized.py) next to plain
    parameters in one group: its own bytes travel as they are, the bias is
    quantized."""
    from quantized import RowQuantized

    torch.manual_seed(0)
    layer = nn.Linear(12, 7)
    layer.weight = nn.Parameter(RowQuantized.quantize(layer.weight), requires_grad=False)
    original_weight = layer.weight.dequantize().clone()
    original_bias = layer.bias.detach().clone()
    seen = {}
    layer.register_forward_hook(
        lambda m, args, out: seen.update(w=m.weight.dequantize(), b=m.bias.detach().clone()),
        prepend=True,
    )
    fsdp2.fully_shard(layer, mesh=mesh, compression=CompressionPolicy(weights="int8"))
    layer(torch.randn(3, 12)).sum().backward()
    assert torch.equal(seen["w"], original_weight)
    bound = _chunk_absmax(original_bias, mesh.size()) * (1 / 254 + ROUNDING_SLACK)
    assert ((seen["b"] - original_bias).abs() <= bound).all()
    assert not torch.equal(seen["b"], original_bias)


def test_composes_with_the_other_features(tmp_path: Path) -> None:
    run_ranks(_composition, WORLD_SIZE, tmp_path)


BF16_UNIT_ROUNDOFF = 2.0**-8


def _hsdp(rank: int, world_size: int) -> None:
    """HSDP (2 replicas x 2 shards): compressing everything, or only the
    all-reduce across replicas. Each bf16 rounding is off by at most u = 2**-8
    relative: with across="all" each rank's gradient is rounded once (u S, S =
    sum_k |g_k|), each replica's partial sum once on its way out and the total
    once on its way back (2 u S at most), so 3 u S / W, plus the fp32
    summation bound; across="replicate" rounds only the last two."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    policies = {
        "off": CompressionPolicy(),
        "all bf16": CompressionPolicy(gradients="bf16"),
        "replicate bf16": CompressionPolicy(gradients="bf16", across="replicate"),
        "replicate int8": CompressionPolicy(gradients="int8", across="replicate"),
    }
    sent = {}
    for name, policy in policies.items():
        with labelled(f"HSDP, {name}"):
            model = shard_model(build_model(KIND), mesh=mesh, compression=policy)
            replica = build_model(KIND)
            with fsdp2.comm_stats(model) as stats:
                params = full_params(model)
                loss = mean_loss(model, *local_batch(global_batch(KIND, 0), rank, world_size))
                loss.backward()
            sent[name] = {
                kind: sum(g.of(kind).bytes for g in stats.steps[-1].values())
                for kind in ("reduce_scatter", "all_reduce")
            }
            if name == "replicate int8":
                continue  # bytes only: the bound of two int8 roundings is below
            _check_bf16_grads(model, replica, params, world_size, 0 if name == "off" else 3)
    with labelled("HSDP bytes"):  # + 64: each slot padded to R pieces for the all-to-all
        off, everywhere = sent["off"], sent["all bf16"]
        assert everywhere["reduce_scatter"] * 2 == off["reduce_scatter"], sent
        assert everywhere["all_reduce"] * 2 <= off["all_reduce"] + 64, sent
        replicate = sent["replicate bf16"]
        assert replicate["reduce_scatter"] == off["reduce_scatter"], sent
        assert replicate["all_reduce"] * 2 <= off["all_reduce"] + 64, sent
        assert sent["replicate int8"]["all_reduce"] <= 0.27 * off["all_reduce"] + 64, sent


def _check_bf16_grads(
    model: nn.Module,
    replica: nn.Module,
    params: dict[str, torch.Tensor],
    world_size: int,
    roundings: int,
) -> None:
    """Every gradient within ``roundings`` bf16 roundings (each at most u S / W,
    S = sum_k |g_k|) and the fp32 summation bound of the ranks' mean."""
    terms = _local_grads(replica, params, world_size, 0)
    for pname, p in model.named_parameters():
        got = p.grad.full_tensor()
        local = [g[pname] for g in terms]
        abs_sum = sum(t.abs() for t in local)
        expected = sum(local) / world_size
        bound = roundings * 1.01 * BF16_UNIT_ROUNDOFF * abs_sum / world_size
        bound = bound + rank_mean_bound(abs_sum, world_size)
        excess = (got - expected).abs() - bound
        assert (excess <= 0).all(), f"{pname}: worst excess {excess.max().item():.3e}"


def _dp_mesh_dims(rank: int, world_size: int) -> None:
    """HSDP over named axes of a (dpr, dps) mesh (dp_mesh_dims), parameters
    already replicated DTensors on it: bf16 gradients within the same bound
    as native HSDP's (three roundings), uncompressed within the summation
    bound alone; the DTensor path sends half the reduce-scatter bytes too."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dpr", "dps"))
    dims = fsdp2.DataParallelMeshDims(shard="dps", replicate="dpr")
    replicated = [Replicate(), Replicate()]
    sent = {}
    policies = {"off": CompressionPolicy(), "all bf16": CompressionPolicy(gradients="bf16")}
    for name, policy in policies.items():
        with labelled(f"dp_mesh_dims, {name}"):
            model = build_model(KIND)
            for module in model.modules():
                for pname, p in list(module.named_parameters(recurse=False)):
                    dtensor = distribute_tensor(p.detach(), mesh, replicated)
                    setattr(module, pname, nn.Parameter(dtensor))
            shard_model(model, mesh=mesh, dp_mesh_dims=dims, compression=policy)
            with fsdp2.comm_stats(model) as stats:
                params = full_params(model)
                batch = local_batch(global_batch(KIND, 0), rank, world_size)
                inputs, targets = (DTensor.from_local(t, mesh, replicated) for t in batch)
                mean_loss(model, inputs, targets).backward()
            sent[name] = sum(g.of("reduce_scatter").bytes for g in stats.steps[-1].values())
            roundings = 0 if name == "off" else 3
            _check_bf16_grads(model, build_model(KIND), params, world_size, roundings)
    assert sent["all bf16"] * 2 == sent["off"], sent


def _tensor_parallel(rank: int, world_size: int) -> None:
    """FSDP over TP on a (dp 2, tp 2) mesh: the TP-local shards are what is
    quantized and gathered; training stays near the uncompressed run."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    losses = {}
    for name, policy in {
        "off": CompressionPolicy(),
        "int8": CompressionPolicy(weights="int8", gradients="int8"),
    }.items():
        torch.manual_seed(0)  # 4 heads of 4: even over tp (models.py's 3 heads are not)
        args = ModelArgs(n_layers=2, vocab_size=34, max_seq_len=10, dim=16, n_heads=4)
        model = Transformer(args)
        Transformer.parallelize(
            model, mesh["tp"], use_seq_parallel=False, local_output_for_attn=True
        )
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=mesh["dp"], compression=policy)
        fsdp2.fully_shard(model, mesh=mesh["dp"], compression=policy)
        optim = make_optimizer(model)
        losses[name] = []
        dp_rank = mesh["dp"].get_local_rank()
        for step in range(3):
            batch = local_batch(global_batch("transformer_untied", step), dp_rank, 2)
            loss = mean_loss(model, *batch)
            loss.backward()
            losses[name].append(loss.item())
            optim.step()
            optim.zero_grad()
    for off, compressed in zip(losses["off"], losses["int8"], strict=True):
        assert abs(off - compressed) <= 0.02 * abs(off), losses
    assert losses["off"] != losses["int8"], "compression changed nothing"


def _four_ranks(rank: int, world_size: int) -> None:
    with labelled("HSDP"):
        _hsdp(rank, world_size)
    with labelled("HSDP over dp_mesh_dims"):
        _dp_mesh_dims(rank, world_size)
    with labelled("FSDP over TP"):
        _tensor_parallel(rank, world_size)


def test_hsdp_and_tensor_parallel(tmp_path: Path) -> None:
    """HSDP: compressing everywhere, or only across replicas; HSDP over
    dp_mesh_dims axes; FSDP over TP."""
    run_ranks(_four_ranks, 4, tmp_path)
