"""A group's sharded grads are made once and reused (fsdp2/engine/sharded_grads.py),
and nothing a user can see changes.

The reference is torch's fully_shard on the same model and data, driven
through the same sequence: after every backward each fsdp2 grad equals torch's
bit for bit, through ``zero_grad()`` to None and to zeros, accumulation across
backwards (also of bf16 parameters reduced in fp32, where the rounding of the
sum is torch's), a grad the user keeps past ``zero_grad()`` (its values stay its
own), a grad the user assigns, and ``register_post_accumulate_grad_hook``.
Then what the reuse is for: the grads are the same DTensors at every step, a
dropped buffer holds no memory through forward, and the ops fsdp2 adds to a
step do not grow with the parameters in a group (a dispatch mode counts them
against the plain model's).
"""

from __future__ import annotations

import collections
import functools
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2


def _build(per_block: int) -> nn.Sequential:
    """Three blocks of ``per_block`` Linear(5, 7) + Linear(7, 5): 7 and 5 rows
    shard unevenly over 2 ranks (4 + 3, 3 + 2), so every slot has padding."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(
                *[m for _ in range(per_block) for m in (nn.Linear(5, 7), nn.Linear(7, 5))]
            )
            for _ in range(3)
        ]
    )


def _shard(model: nn.Sequential, shard: object, mesh: object) -> nn.Sequential:
    for block in model:
        shard(block, mesh=mesh)  # type: ignore[operator]
    return shard(model, mesh=mesh)  # type: ignore[operator,no-any-return]


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]


def _same(mine: nn.Module, theirs: nn.Module, when: str) -> None:
    for i, (a, b) in enumerate(zip(_grads(mine), _grads(theirs), strict=True)):
        assert (a is None) == (b is None), (when, i, a, b)
        if a is not None:
            assert torch.equal(a, b), (when, i, (a - b).abs().max())


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops_fsdp2_adds(per_block: int, mesh: object, x: torch.Tensor) -> collections.Counter[str]:
    """The ops of a steady forward+backward under fsdp2, minus the plain model's."""
    counts = []
    for model in (_shard(_build(per_block), fsdp2.fully_shard, mesh), _build(per_block)):
        for _ in range(2):
            model(x).sum().backward()
            model.zero_grad()
        with _Ops() as mode:
            model(x).sum().backward()
        counts.append(mode.ops)
    added = counts[0].copy()
    added.subtract(counts[1])
    return added


def _sharded_grads(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    mine = _shard(_build(2), fsdp2.fully_shard, mesh)
    theirs = _shard(_build(2), torch_fully_shard, mesh)
    torch.manual_seed(1 + rank)
    batches = [torch.randn(3, 5) for _ in range(8)]
    hook_calls = collections.Counter[str]()
    for name, model in (("mine", mine), ("theirs", theirs)):
        first = next(model.parameters())
        first.register_post_accumulate_grad_hook(lambda p, name=name: hook_calls.update([name]))

    def backward(x: torch.Tensor) -> None:
        for model in (mine, theirs):
            model(x).square().sum().backward()

    def zero_grad(set_to_none: bool) -> None:
        for model in (mine, theirs):
            model.zero_grad(set_to_none=set_to_none)

    backward(batches[0])
    _same(mine, theirs, "first backward")
    assert all(isinstance(p.grad, DTensor) for p in mine.parameters())
    made = [weakref.ref(p.grad) for p in mine.parameters()]  # holding them would keep them

    zero_grad(True)
    backward(batches[1])
    _same(mine, theirs, "after zero_grad()")
    # Made once: the same DTensors at every step.
    assert all(p.grad is g() for p, g in zip(mine.parameters(), made, strict=True))

    # Kept by the user past zero_grad(): a DTensor, and a view of another's local tensor.
    params = list(mine.parameters())
    kept, kept_values = params[0].grad, params[0].grad.to_local().clone()
    view = params[9].grad.to_local()[1:]  # in another group: shares the storage only
    view_values = view.clone()
    zero_grad(True)
    backward(batches[2])
    _same(mine, theirs, "with grads kept past zero_grad()")
    assert torch.equal(kept.to_local(), kept_values)
    assert torch.equal(view, view_values)
    assert params[0].grad is not kept

    # Zeros instead of None, then accumulation across two backwards.
    zero_grad(False)
    backward(batches[3])
    _same(mine, theirs, "after zero_grad(set_to_none=False)")
    backward(batches[4])
    _same(mine, theirs, "accumulated over two backwards")

    # A grad the user assigned: every grad is still right.
    zero_grad(True)
    for model in (mine, theirs):
        p = list(model.parameters())[5]
        p.grad = torch.full_like(p, 0.5)
    backward(batches[5])
    _same(mine, theirs, "with a grad the user assigned")

    # Dropped grads hold no memory through forward; the next backward brings them back.
    zero_grad(True)
    groups = [g for block in mine for g in block._fsdp_state.param_groups]
    buffers = [g.sharded_grads.buffer for g in groups]
    assert all(b is not None and b.flat.untyped_storage().size() > 0 for b in buffers)
    with torch.no_grad():
        mine(batches[6])
    assert all(b.flat.untyped_storage().size() == 0 for b in buffers)
    backward(batches[6])
    _same(mine, theirs, "after the storage was freed")
    assert [g.sharded_grads.buffer for g in groups] == buffers  # reused, not remade

    backwards = 7
    assert hook_calls == {"mine": backwards, "theirs": backwards}, hook_calls

    # bf16 parameters reduced in fp32, accumulated over two backwards: each
    # reduction is cast to bf16 and then added, as torch's rounds it.
    mine = _shard(
        _build(2).bfloat16(),
        functools.partial(
            fsdp2.fully_shard, mp_policy=fsdp2.MixedPrecisionPolicy(reduce_dtype=torch.float32)
        ),
        mesh,
    )
    theirs = _shard(
        _build(2).bfloat16(),
        functools.partial(
            torch_fully_shard, mp_policy=TorchMixedPrecisionPolicy(reduce_dtype=torch.float32)
        ),
        mesh,
    )
    for x in batches[:2]:
        backward(x.bfloat16())
    _same(mine, theirs, "bf16 grads reduced in fp32, accumulated over two backwards")

    # The ops fsdp2 adds to a step: per group, not per parameter.
    x = batches[7]
    small, large = _ops_fsdp2_adds(1, mesh, x), _ops_fsdp2_adds(4, mesh, x)
    assert +small == +large, (small, large)
    assert sum(small.values()) <= 25 * 3, small  # 3 groups (and an empty root)


def test_sharded_grads_are_made_once_and_match_torchs(tmp_path: Path) -> None:
    run_ranks(_sharded_grads, WORLD_SIZE, tmp_path)
