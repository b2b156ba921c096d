"""The other axes of torchtitan's 4D recipes, as its trainer composes them with
FSDP, on 4 gloo ranks: context parallel (CP) and expert parallel (EP).

**Context parallel.** The world mesh is ``("dp_shard", "cp") = (2, 2)``; each
rank holds half the sequences (by its ``dp_shard`` rank) and, of those, half
the positions (by its ``cp`` rank). FSDP shards every parameter over the
flattened ``dp_shard_cp`` mesh (all 4 ranks): every rank computes with every
parameter, on different tokens, so the gradients are averaged over all four.
torch's own context parallel (``torch.distributed.tensor.experimental.
context_parallel``) cannot run on CPU in torch 2.13: its SDPA path has no rule
for ``aten._scaled_dot_product_flash_attention_for_cpu`` ("does not have a
sharding strategy registered") and FlexAttention has no CPU backward; and
torchtitan 0.3's language models accept only flex, flex_flash and varlen
attention. So the attention here exchanges keys and values as torch's CP
does with its all-gather rotation: each rank all-gathers the sequence's keys
and values over ``cp`` and attends with its own queries, causally.

**Expert parallel.** The world mesh is ``("dp_shard_mod_ep", "ep") = (2, 2)``.
The dense layers are sharded over both dims flattened (``dp_shard``); the
experts' weights are first distributed ``Shard(0)`` (by expert) over ``ep``,
then ``fully_shard``-ed over ``dp_shard_mod_ep`` with torchtitan's
``shard_placement_fn`` (``Shard(1)`` when the experts are fewer than
``dp_shard_mod_ep * ep``) and its gradient divide factor (the whole data
parallel degree, 4: an expert's gradient sums the tokens of its ``ep`` group,
its replicas are averaged over ``dp_shard_mod_ep``). Tokens are routed top-1;
each ``ep`` group all-gathers its tokens, each rank runs its own experts, and
the outputs are summed back to their tokens' ranks (an all-gather dispatcher).

Each case trains an unsharded model on the global batch (the reference,
tests/error_model.py point 1) and fsdp2's, with torch's fully_shard in
lockstep from fsdp2's parameters (point 2): the same layouts and local
losses as torch's, gradients within the error model's bounds of torch's
(four ranks sum in another order on gloo), losses and trained parameters
within ``REF_TOL`` of the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import labelled, run_ranks
from error_model import (
    REF_TOL,
    check_grads_against_torch,
    check_losses_equal,
    copy_local_shards,
    rank_mean_bound,
)
from models import make_optimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2

VOCAB, DIM, HEADS, GLOBAL_BATCH, SEQ_LEN, STEPS = 32, 16, 2, 8, 8, 3
N_BLOCKS = 2


class _GatherOverGroup(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; the backward sums every rank's
    gradient of the gathered tensor and keeps this rank's slice (an
    all-reduce: gloo has no reduce-scatter of uneven layouts)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), ctx.dim)[rank], None, None


class _SumToOwners(torch.autograd.Function):
    """The transpose of ``_GatherOverGroup``: sums every rank's ``x`` (laid out
    like the gathered tensor) and keeps this rank's slice along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        rank = dist.get_rank(group)
        return total.chunk(dist.get_world_size(group), dim)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, ctx.dim), None, None


class Attention(nn.Module):
    """Causal self-attention; with a ``cp`` group set, this rank's queries are
    its slice of the sequence and the keys and values are all-gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.cp_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        first = 0
        if self.cp_group is not None:
            first = dist.get_rank(self.cp_group) * seq
            k = _GatherOverGroup.apply(k, 2, self.cp_group)
            v = _GatherOverGroup.apply(v, 2, self.cp_group)
        positions = torch.arange(first, first + seq)
        mask = positions[:, None] >= torch.arange(k.size(2))[None, :]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
        attention = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.out(attention.transpose(1, 2).reshape(batch, seq, DIM))


class Experts(nn.Module):
    """``N`` two-layer experts as two stacked weights (torchtitan's grouped
    experts); with an ``ep`` group set, the weights are DTensors ``Shard(0)``
    over it and each rank runs its own experts on its group's tokens."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, DIM, 2 * DIM) / math.sqrt(DIM))
        self.w2 = nn.Parameter(torch.randn(n_experts, 2 * DIM, DIM) / math.sqrt(2 * DIM))
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        w1, w2, first = self.w1, self.w2, 0
        if self.ep_group is not None:
            x = _GatherOverGroup.apply(x, 0, self.ep_group)
            expert = _GatherOverGroup.apply(expert, 0, self.ep_group)
            w1, w2 = self.w1.to_local(), self.w2.to_local()
            first = dist.get_rank(self.ep_group) * w1.size(0)
        out = torch.zeros_like(x)
        for local in range(w1.size(0)):
            chosen = expert == first + local
            out = out.index_put((chosen,), F.gelu(x[chosen] @ w1[local]) @ w2[local])
        if self.ep_group is not None:
            out = _SumToOwners.apply(out, 0, self.ep_group)
        return out


class MoE(nn.Module):
    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, n_experts, bias=False)
        self.experts = Experts(n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        probs = self.router(tokens).softmax(-1)
        weight, expert = probs.max(-1)
        return (weight[:, None] * self.experts(tokens, expert)).view_as(x)


class Block(nn.Module):
    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn: nn.Module = (
            MoE(n_experts)
            if n_experts
            else nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Model(nn.Module):
    def __init__(self, n_experts: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(n_experts) for _ in range(N_BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """The mean over this rank's tokens times ``scale`` (its share of all tokens
    times the data-parallel degree the gradients are averaged over): the
    reference's mean over all tokens, as torchtitan's global token count."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) * scale


# Top-1 routing is discontinuous: the sharded runs may route a token like the
# reference only if its best expert leads the second by far more than the
# rounding differences between them (about 1e-6 here). With these seeds the
# smallest lead is 8.7e-5 (4 experts) and 5.6e-4 (2).
MIN_ROUTING_LEAD = 1e-5


def _reference(n_experts: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Model(n_experts)
    leads: list[float] = []
    for block in model.blocks if n_experts else ():
        block.ffn.router.register_forward_hook(
            lambda module, args, logits: leads.append(_lead(logits))
        )
    optimizer = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        loss = _loss(model(inputs), targets, 1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    assert not leads or min(leads) > MIN_ROUTING_LEAD, f"a token's routing is a near tie: {leads}"
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _lead(logits: torch.Tensor) -> float:
    """The smallest lead of a token's best expert over its second, in probability."""
    best, second = logits.detach().softmax(-1).topk(2, -1).values.unbind(-1)
    return (best - second).min().item()


def _local_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    share = inputs.numel() / (GLOBAL_BATCH * SEQ_LEN)
    return _loss(model(inputs), targets, share * dist.get_world_size())


def _bounds(
    replica: nn.Module, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """tests/error_model.py point 2 with the CP and EP exchanges in the loss:
    ``replica`` is the model wired for CP or EP but not sharded; it takes
    ``model``'s parameters and gives this rank's unreduced gradients, whose
    sums over the 4 ranks bound fsdp2's and torch's reductions apart. The
    experts' gradients are summed over two ranks (``dp_shard_mod_ep``) and
    divided by 4: the same bits in any order (bound zero)."""
    with torch.no_grad():
        for name, param in replica.named_parameters():
            full = model.get_parameter(name).full_tensor()
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)
    replica.zero_grad(set_to_none=True)
    _local_loss(replica, *batch).backward()
    bounds = {}
    for name, param in replica.named_parameters():
        if isinstance(param, DTensor):
            bounds[name] = torch.zeros(param.shape)
            continue
        abs_sum = param.grad.abs()
        dist.all_reduce(abs_sum)
        bounds[name] = rank_mean_bound(abs_sum, dist.get_world_size())
    return bounds


def _train_and_compare(
    n_experts: int,
    setup: Callable[[Model, Any], None],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """STEPS steps of fsdp2's model, torch's fully_shard's in lockstep from
    fsdp2's parameters (grads within the error model's bounds, local losses
    equal) and losses and trained parameters against the reference."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ref_losses, ref_params = _reference(n_experts)
    models = {}
    for shard in (fsdp2.fully_shard, torch_fully_shard, None):
        torch.manual_seed(0)
        models[shard] = Model(n_experts)
        setup(models[shard], shard)
    model, torch_model, replica = models.values()
    for name, param in model.named_parameters():
        theirs = torch_model.get_parameter(name)
        assert (param.device_mesh, param.placements) == (theirs.device_mesh, theirs.placements), (
            f"{name}: {param.placements} on {param.device_mesh}, torch's {theirs.placements}"
        )
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        when = f"step {step}"
        batch = tuple(local(t) for t in global_batch(step))
        copy_local_shards(model, torch_model)
        bounds = _bounds(replica, model, batch)
        loss, torch_loss = _local_loss(model, *batch), _local_loss(torch_model, *batch)
        loss.backward()
        torch_loss.backward()
        check_losses_equal(loss, torch_loss, when)
        check_grads_against_torch(model, torch_model, bounds, when)
        optimizer.step()
        optimizer.zero_grad()
        torch_model.zero_grad()
        total = loss.detach() / dist.get_world_size()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref_losses[step], **REF_TOL, msg=f"{when} loss")
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), ref_params[name], **REF_TOL, msg=name)


def _context_parallel() -> tuple[Callable, Callable]:
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    dp_shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    cp_group = world["cp"].get_group()

    def setup(model: Model, shard: Any) -> None:
        for block in model.blocks:
            block.attention.cp_group = cp_group
            if shard is not None:
                shard(block, mesh=dp_shard_cp)
        if shard is not None:
            shard(model, mesh=dp_shard_cp)

    def local(t: torch.Tensor) -> torch.Tensor:
        rows = t.chunk(2, 0)[world["dp_shard"].get_local_rank()]
        return rows.chunk(2, 1)[world["cp"].get_local_rank()]

    return setup, local


def _expert_parallel(n_experts: int) -> tuple[Callable, Callable]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dp_shard = world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    ep, dp_mod_ep = world["ep"], world["dp_shard_mod_ep"]

    def setup(model: Model, shard: Any) -> None:
        for block in model.blocks:
            experts = block.ffn.experts
            experts.ep_group = ep.get_group()
            for name, param in list(experts.named_parameters()):
                full = param.detach()
                experts.register_parameter(
                    name, nn.Parameter(distribute_tensor(full, ep, [Shard(0)]))
                )
            if shard is None:
                continue
            # torchtitan: shard the experts' dim 1 once they are fewer than
            # the ranks over which they would be split.
            if dp_mod_ep.size() * ep.size() > n_experts:

                def placement_fn(param):
                    return Shard(1)
            else:
                placement_fn = None
            shard(experts, mesh=dp_mod_ep, shard_placement_fn=placement_fn)
            experts.set_gradient_divide_factor(float(dp_shard.size()))
            if shard is torch_fully_shard:
                # torch's reduce-scatter with a divide factor is PREMUL_SUM,
                # which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with
                # Gloo"); summed, it divides after, as fsdp2 does on gloo.
                experts.set_force_sum_reduction_for_comms(True)
            shard(block, mesh=dp_shard)
        if shard is not None:
            shard(model, mesh=dp_shard)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(dp_shard.size(), 0)[dp_shard.get_local_rank()]

    return setup, local


CASES = {
    "context parallel 2 x dp_shard 2": (0, _context_parallel),
    "expert parallel 2, 2 experts (Shard(1))": (2, lambda: _expert_parallel(2)),
    "expert parallel 2, 4 experts (Shard(0))": (4, lambda: _expert_parallel(4)),
}


def _cases(rank: int, world_size: int) -> None:
    for label, (n_experts, build) in CASES.items():
        with labelled(label):
            _train_and_compare(n_experts, *build())


@pytest.mark.distributed
def test_context_and_expert_parallel_match_torch(tmp_path: Path) -> None:
    """CP 2 x dp_shard 2 with FSDP over the flattened dp_shard_cp mesh, and EP
    2 x dp_shard_mod_ep 2 with the experts Shard(1) (2 experts) and Shard(0)
    (4 experts) under FSDP: three steps each; every step's local losses equal
    to torch's fully_shard's and gradients within the error model's bounds of
    them (the experts' bit for bit), losses and trained parameters equal to
    the reference within REF_TOL."""
    run_ranks(_cases, 4, tmp_path)
