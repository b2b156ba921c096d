"""fsdp2 next to the rest of PyTorch: composable DDP (``replicate``) over a
model with sharded blocks, explicit ``unshard(async_op=True)`` between a
module's own collectives, an optimizer step inside backward
(``register_post_accumulate_grad_hook``), ``model.to(dtype)`` after sharding,
dataclass inputs and outputs, ``torch.func.jvp``, and ``state_dict`` of a
module kept unsharded after forward. Each is compared with an unsharded
reference (DDP math) or with torch's ``fully_shard`` on the same model and data.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, recorded, run_ranks
from error_model import EXACT, REF_TOL
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
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import fsdp2

WORLD_SIZE = 2  # against torch's fully_shard: the same bits (tests/error_model.py)


# -- replicate over sharded blocks, unshard(async_op=True) ------------------------


class ReduceLayer(nn.Module):
    """A layer that starts its own (non-differentiable) all-reduce of its output
    and returns the work for the caller to wait on."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
        y = F.relu(x @ self.weight)
        return y, dist.all_reduce(y, async_op=True)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))

    def forward(self, ys: list[torch.Tensor], works: list[dist.Work]) -> torch.Tensor:
        out = 0
        for block, y, work in zip(self.blocks, ys, works, strict=True):
            work.wait()
            out = out + block(y)
        return out


class ReduceModel(nn.Module):
    """Three layers with their own all-reduce, then three blocks; the blocks'
    all-gathers are started (when sharded) while the all-reduces are in flight."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.reduce_layers = nn.ModuleList(ReduceLayer(dim) for _ in range(3))
        self.tail = Blocks(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys, works = [], []
        for layer, block in zip(self.reduce_layers, self.tail.blocks, strict=True):
            y, work = layer(x)
            ys.append(y)
            works.append(work)
            if isinstance(block, fsdp2.FSDPModule):
                block.unshard(async_op=True)
        return self.tail(ys, works)


def _replicate_over_sharded_blocks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = ReduceModel()
    ref = replicate(copy.deepcopy(model))  # torch's composable DDP, unsharded
    for block in model.tail.blocks:
        fsdp2.fully_shard(block, reshard_after_forward=False)
    fsdp2.fully_shard(model.tail)
    replicate(model)  # DDP for the reduce layers; must leave the sharded blocks alone
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) == name.startswith("tail."), name
    optims = [make_optimizer(m) for m in (ref, model)]
    torch.manual_seed(1 + rank)
    x = torch.randn(2, 8)
    for step in range(6):
        losses = []
        for m, optim in zip((ref, model), optims, strict=True):
            loss = m(x).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        assert_close(losses[1], losses[0], **REF_TOL, msg=lambda m, s=step: f"step {s}: {m}")
    ref_params = dict(ref.named_parameters())
    for name, param in full_params(model).items():
        assert_close(param, ref_params[name], **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
def test_replicate_over_sharded_blocks_with_async_unshard(tmp_path: Path) -> None:
    """``replicate(model)`` (DDP) over a model whose blocks are sharded trains
    like DDP of the unsharded model, with each block's all-gather started by
    ``unshard(async_op=True)`` while the model's own all-reduces are in flight.
    (Before fsdp2 marked its modules where ``replicate`` looks, DDP also
    all-reduced the blocks' shard gradients, adding different shards together.)"""
    run_ranks(_replicate_over_sharded_blocks, WORLD_SIZE, tmp_path)


# -- optimizer in backward, model.to(dtype) -----------------------------------------


def _optimizer_in_backward(rank: int, world_size: int) -> None:
    ref = build_model("mlp")
    model = shard_model(build_model("mlp"))
    ref_optim = make_optimizer(ref)
    # One optimizer per sharded parameter, stepped by its post-accumulate-grad
    # hook as soon as the reduced gradient is assigned.
    optims = {p: make_optimizer([p]) for p in model.parameters()}
    stepped: list[str] = []
    names = {p: n for n, p in model.named_parameters()}

    def step_in_backward(param: nn.Parameter) -> None:
        assert isinstance(param.grad, DTensor), names[param]
        optims[param].step()
        optims[param].zero_grad()
        stepped.append(names[param])

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    for step in range(3):
        batch = global_batch("mlp", step)
        ref_loss = mean_loss(ref, *batch)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        stepped.clear()
        loss = mean_loss(model, *local_batch(batch, rank, world_size))
        loss.backward()
        assert sorted(stepped) == sorted(names.values()), f"step {step}: hooks ran for {stepped}"
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        for name, param in model.named_parameters():
            assert param.grad is None, f"{name}: the hook's zero_grad ran before the grad was kept"
    for name, param in full_params(model).items():
        assert_close(param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")


def _cast_after_sharding(rank: int, world_size: int) -> None:
    f64 = torch.float64
    with labelled("to(float64) after fully_shard"):
        ref = build_model("mlp").to(f64)
        model = shard_model(build_model("mlp")).to(f64)
        for name, param in model.named_parameters():
            assert param.dtype == param.to_local().dtype == f64, name
        optims = [make_optimizer(m) for m in (ref, model)]
        for step in range(3):
            inputs, targets = (t.to(f64) for t in global_batch("mlp", step))
            ref_loss = mean_loss(ref, inputs, targets)
            ref_loss.backward()
            loss = mean_loss(model, *local_batch((inputs, targets), rank, world_size))
            loss.backward()
            assert loss.dtype == f64
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
            for name, param in model.named_parameters():
                assert param.dtype == param.grad.dtype == param.grad.to_local().dtype == f64, name
            for optim in optims:
                optim.step()
                optim.zero_grad()
        for name, param in full_params(model).items():
            assert_close(param, ref.get_parameter(name), **REF_TOL, msg=lambda m, n=name: n)
    with labelled("built in bf16, to(float32) after fully_shard, bf16 mixed precision"):
        bf16 = torch.bfloat16
        policy = fsdp2.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
        model = shard_model(build_model("mlp").to(bf16), mp_policy=policy).to(torch.float32)
        with recorded("reduce_scatter") as calls:
            inputs, targets = local_batch(global_batch("mlp", 0), rank, world_size)
            mean_loss(model, inputs, targets).backward()
        reduced_dtypes = [call.input.dtype for call in calls]
        assert set(reduced_dtypes) == {bf16}, reduced_dtypes
        for name, param in model.named_parameters():
            assert param.dtype == param.grad.dtype == torch.float32, name


@pytest.mark.distributed
def test_optimizer_in_backward_and_cast_after_sharding(tmp_path: Path) -> None:
    """Hooks from ``register_post_accumulate_grad_hook`` on the sharded
    parameters run once per backward with the reduced DTensor gradient (an
    optimizer step in backward trains like the reference); ``model.to(float64)``
    after ``fully_shard`` makes shards, unsharded parameters and gradients
    float64 and trains like a float64 reference; a model built in bf16 and cast
    to float32 keeps its bf16 reduce-scatter."""
    run_ranks(_optimizer_in_backward, WORLD_SIZE, tmp_path / "hooks")
    run_ranks(_cast_after_sharding, WORLD_SIZE, tmp_path / "cast")


# -- structured activations, jvp, state_dict after forward ------------------------


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Nested:
    pair: Pair
    z: torch.Tensor


class Triple(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor
    z: torch.Tensor


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> Nested:
        return Nested(Pair(x, x.clone()), x.clone())


class OnEach(nn.Module):
    """Applies one Linear to every tensor of a ``Nested`` or ``Triple``."""

    def __init__(self, dim: int, out: type) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.out = out

    def forward(self, inp: Nested | Triple) -> Nested | Triple:
        x, y, z = (inp.pair.x, inp.pair.y, inp.z) if isinstance(inp, Nested) else inp
        if self.out is Nested:
            return Nested(Pair(self.lin(x), self.lin(y)), self.lin(z))
        return Triple(self.lin(x), self.lin(y), self.lin(z))


class Join(nn.Module):
    def forward(self, inp: Triple) -> torch.Tensor:
        return inp.x + inp.y * inp.z


def _structured_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Split(), OnEach(16, Nested), OnEach(16, Triple), Join())


def _structured_activations(rank: int, world_size: int) -> None:
    bf16 = torch.bfloat16
    for param_dtype in (None, bf16):
        with labelled(f"param_dtype={param_dtype}"):
            models = []
            for shard, policy_cls in (
                (fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
                (torch_fully_shard, TorchMixedPrecisionPolicy),
            ):
                model = _structured_model()
                policy = policy_cls(param_dtype=param_dtype, reduce_dtype=torch.float32)
                for module in model:
                    shard(module, mp_policy=policy)
                shard(model, mp_policy=policy)
                models.append(model)
            ref = _structured_model()
            optims = [make_optimizer(m) for m in (*models, ref)]
            gen = torch.Generator().manual_seed(1)
            for _ in range(4):
                batch = torch.rand(2 * world_size, 16, generator=gen)
                local = local_batch((batch,), rank, world_size)[0]
                losses = [m(local).float().sum() for m in models]
                for loss in losses:
                    loss.backward()
                assert_close(losses[0], losses[1], **EXACT)
                if param_dtype is None:
                    ref_loss = ref(batch).sum() / world_size
                    ref_loss.backward()
                    assert_close(global_mean(losses[0], world_size), ref_loss, **REF_TOL)
                for optim in optims:
                    optim.step()
                    optim.zero_grad()
            torch_params = dict(models[1].named_parameters())
            for name, param in models[0].named_parameters():
                assert_close(param.to_local(), torch_params[name].to_local(), **EXACT)
                if param_dtype is None:
                    assert_close(param.full_tensor(), ref.get_parameter(name), **REF_TOL)


def _jvp_and_state_dict(rank: int, world_size: int) -> None:
    bf16 = torch.bfloat16
    with labelled("torch.func.jvp"):
        torch.manual_seed(0)
        enc, dec = nn.Linear(32, 64, bias=False), nn.Linear(64, 48, bias=False)
        ref_enc, ref_dec = copy.deepcopy(enc).to(bf16), copy.deepcopy(dec).to(bf16)
        policy = fsdp2.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for module in (enc, dec):
            fsdp2.fully_shard(module, mp_policy=policy, reshard_after_forward=False)
        x = torch.randn(32, dtype=bf16)
        primal, tangent = torch.randn(48, dtype=bf16), torch.randn(48, dtype=bf16)
        hidden = enc(x)

        def fn(_unused: torch.Tensor) -> torch.Tensor:
            return dec(hidden)

        output, tangent_out = torch.func.jvp(fn, (primal,), (tangent,))
        assert output.dtype == bf16
        assert_close(output, ref_dec(ref_enc(x)), rtol=0, atol=0)
        assert_close(tangent_out, torch.zeros_like(output), rtol=0, atol=0)
    with labelled("state_dict after a forward that kept the parameters unsharded"):
        model = shard_model(build_model("mlp"), reshard_after_forward=False)
        before = {k: v.full_tensor() for k, v in model.state_dict().items()}
        model(local_batch(global_batch("mlp", 0), rank, world_size)[0])
        state = model.state_dict()
        assert before.keys() == state.keys()
        for key, value in state.items():
            assert isinstance(value, DTensor), f"{key} is a {type(value).__name__}"
            assert_close(value.full_tensor(), before[key], rtol=0, atol=0)
        model.load_state_dict(state)  # loads into the shards, also when unsharded before


@pytest.mark.distributed
def test_structured_activations_jvp_and_state_dict(tmp_path: Path) -> None:
    """Dataclass (frozen, nested) and namedtuple inputs and outputs between
    sharded modules train like torch's fully_shard in fp32 and bf16 and like
    the reference in fp32; ``torch.func.jvp`` runs through a sharded module
    (bf16, kept unsharded); ``state_dict()`` after a forward that kept the
    parameters unsharded returns the shards."""
    run_ranks(_structured_activations, WORLD_SIZE, tmp_path / "structured")
    run_ranks(_jvp_and_state_dict, WORLD_SIZE, tmp_path / "jvp")


# -- single process -----------------------------------------------------------------


def test_slice_of_sharded_sequential_is_plain() -> None:
    with fake_world(2):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        fsdp2.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        head = model[:2]
        assert type(head) is nn.Sequential, type(head)
        assert not isinstance(head, fsdp2.FSDPModule)
        assert isinstance(model, fsdp2.FSDPModule)


def test_state_and_composable_registry() -> None:
    from torch.distributed._composable.replicate import _is_fully_sharded

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fsdp2.fully_shard([model[0], model[1]], mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        state = fsdp2.fully_shard.state(model)
        assert state is model._fsdp_state
        assert fsdp2.fully_shard.state(model[0]) is fsdp2.fully_shard.state(model[1])
        assert fsdp2.fully_shard.state(model[0]) is not state
        assert fsdp2.fully_shard.state(nn.Linear(2, 2)) is None
        assert all(_is_fully_sharded(m) for m in model.modules())


class _Pair(NamedTuple):
    first: torch.Tensor
    second: object


@dataclasses.dataclass
class _Batch:
    ids: torch.Tensor
    mask: torch.Tensor | None


def test_module_call_trees_walked_as_pytree_walks_them() -> None:
    """The hooks walk every module call's inputs and outputs (``map_tensors``,
    ``tensors_in``); plain tuples, lists and dicts of tensors and scalars are
    walked without pytree, and must come out as pytree's walk gives them;
    anything else (namedtuples, OrderedDicts, torch.Size, dataclasses) goes
    through pytree."""
    from collections import OrderedDict

    import torch.utils._pytree as pytree

    from fsdp2.base.private_api import map_tensors, tensors_in

    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    trees = [
        ((a,), {}),
        ((a, None, 3, 0.5, True, "s"), {"mask": b, "z": None, "y": [c, (a,)]}),
        [],
        a,
        {"b": b, "a": a},
        ((_Pair(a, 1),), {"d": OrderedDict(x=b)}),
        (torch.Size([2, 3]), [c]),
    ]
    for tree in trees:
        leaves, spec = pytree.tree_flatten(tree)
        expected = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        assert [id(t) for t in tensors_in(tree)] == [id(t) for t in expected], tree
        doubled = map_tensors(tree, lambda t: t * 2)
        by_pytree = pytree.tree_unflatten(
            [leaf * 2 if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
        )
        assert pytree.tree_structure(doubled) == pytree.tree_structure(by_pytree), tree
        pairs = zip(pytree.tree_leaves(doubled), pytree.tree_leaves(by_pytree), strict=True)
        for got, want in pairs:
            assert type(got) is type(want), tree
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    # Dataclasses (not registered with pytree): copied with their tensors mapped.
    batch = _Batch(a, None)
    assert tensors_in(((batch,), {})) == [a]
    (mapped,), _ = map_tensors(((batch,), {}), lambda t: t + 1)
    assert type(mapped) is _Batch and mapped is not batch and torch.equal(mapped.ids, a + 1)
