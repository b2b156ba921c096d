"""How far apart two correct computations of the same training step may be,
and the tolerances every parity test takes from that.

[Note: the error model]
A parity test compares fsdp2 with one of two references, and each comparison
has its own source of rounding:

1. The unsharded reference (DDP math) trained on the global batch. It sums the
   batch's per-sample contributions in one matmul; the ranks sum their slices
   and then average over ranks: the same terms, associated differently. Any
   order of summing n terms is within ``gamma(n) * sum|terms|`` of the exact
   sum (Higham, Accuracy and Stability of Numerical Algorithms, 4.2), and the
   matmul kernels of another CPU (AVX2 or AVX-512, Intel or AMD) block them
   differently again. Here n is at most a global batch of 8 x 9 tokens and a
   term is one token's contribution to a mean loss's gradient, so
   ``gamma(72) * sum|terms|`` is about 4.3e-6 for a sum|terms| of order one:
   ``REF_TOL`` (1e-5 absolute and relative) holds with a margin of two.

2. torch's fully_shard on the same model and local batch, from the *same*
   parameters. Both run the same kernels on the same values in one process
   (one thread per rank), so each rank's local loss and local gradients agree
   exactly; only the sum of the W ranks' gradients is ordered differently
   (fsdp2 on gloo adds the rows in rank order, torch's gloo reduce-scatter is a
   ring all-reduce, NCCL a tree). Two orders of summing W values and one
   rounded division by W differ by at most ``2 * gamma(W) * S / W`` per
   element, where S is the sum over ranks of |local gradient| at that element
   (``rank_sum_bounds`` measures S with a plain copy of the model). No constant
   tolerance can replace that: near-cancelling sums need S, not the result.
   On one or two ranks the bound is zero: a + b = b + a, and halving is
   exact, so fsdp2 and torch agree bit for bit (``EXACT``). On more ranks,
   to keep the second reference at the same parameters, torch's model takes
   fsdp2's local shards before every step (``copy_local_shards``), so the
   comparison covers each step's forward and backward, never an accumulated
   drift.

3. Parameter trajectories. AdamW divides each gradient by its running RMS: an
   element whose gradient is near zero moves by about +-lr whatever its last
   bits, so a last-bit difference can move a parameter by 2 * lr, and no
   tolerance separates that from a bug. The parity tests therefore train with
   SGD with momentum (``models.make_optimizer``): its update is linear in the
   gradient, so a gradient error eps moves a parameter by at most
   ``lr / (1 - momentum) * eps`` per step, 0.1 * eps here, and parameters
   after up to 10 steps stay within the gradients' ``REF_TOL`` (weight decay
   only contracts; the loss's curvature feeds a parameter difference back into
   the next gradient at second order, ``lr * |Hessian|`` per step, small at
   this step size). Tests that need AdamW (its states in a state dict, a
   client's own recipe) compare parameters after a single step, or with eps
   large enough that the update is Lipschitz in the gradient.

A tolerance that does not follow from this has its reason written beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

# Unit roundoff: half the distance from 1 to the next number of the dtype.
UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}

# fsdp2 against the unsharded reference, fp32 (point 1 of the note).
REF_TOL = {"rtol": 1e-5, "atol": 1e-5}

# fsdp2 against torch's fully_shard on at most two ranks, or a computation
# without a sum over ranks against a plain model's: the sum of two values does
# not depend on their order (a + b = b + a in IEEE arithmetic) and halving is
# exact, so the same bits, every step, whatever the optimizer (point 2).
EXACT = {"rtol": 0.0, "atol": 0.0}

# models.make_optimizer's SGD (point 3 of the note).
LR = 1e-2
MOMENTUM = 0.9
WEIGHT_DECAY = 0.01


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n = n u / (1 - n u): summing n + 1 terms in any order is
    within gamma_n * sum|terms| of the exact sum."""
    nu = n * UNIT_ROUNDOFF[dtype]
    return nu / (1 - nu)


def rank_mean_bound(
    abs_sum: torch.Tensor, world_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Elementwise bound on the difference between two means over
    ``world_size`` ranks of the same values summed in two orders, each in
    ``dtype`` (the reduce dtype); ``abs_sum`` is the sum over ranks of
    |value|. Each result is within gamma(W - 1) * S / W of the exact mean, plus
    one rounding of the division: gamma(W) * S / W. Twice that apart, plus the
    smallest normal number for a flush to zero."""
    tiny = torch.finfo(dtype).tiny
    return 2 * gamma(world_size, dtype) * abs_sum / world_size + tiny


def assert_within(
    actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str
) -> None:
    """Every element of ``actual`` within ``bound`` of ``expected``."""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    excess = (actual.double() - expected.double()).abs() - bound.double()
    if excess.numel() and (worst := excess.max()) > 0:
        index = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements beyond the "
            f"error model's bound; worst at {index}: {actual[index].item()!r} vs "
            f"{expected[index].item()!r}, bound {bound[index].item():.3e} (exceeded by "
            f"{worst.item():.3e})"
        )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def copy_local_shards(src: nn.Module, dst: nn.Module) -> None:
    """Sets each parameter's local shard in ``dst`` (torch's fully_shard) to
    ``src``'s (fsdp2's, the same name and placements), in place as an
    optimizer step would: the next step of both starts from equal parameters."""
    dst_params = dict(dst.named_parameters())
    for name, param in src.named_parameters():
        mine, theirs = param, dst_params[name]
        if isinstance(mine, DTensor):
            if mine.placements != theirs.placements:
                raise AssertionError(f"{name}: placements {mine.placements}, {theirs.placements}")
            mine, theirs = mine.to_local(), theirs.to_local()
        if mine.shape != theirs.shape:
            raise AssertionError(f"{name}: local shard {mine.shape}, torch's {theirs.shape}")
        theirs.copy_(mine)


def rank_sum_bounds(
    replica: nn.Module,
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    local_batch: tuple[torch.Tensor, ...],
    world_size: int,
    reduce_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Per parameter name: the bound of ``rank_mean_bound`` on how far two
    correct reductions of this step's gradients may be apart, from S = the sum
    over ranks of |local gradient|. ``replica`` is a plain, unsharded copy of
    the model (in the dtype the sharded model computes in) that takes
    ``model``'s current parameters and runs ``local_loss`` on this rank's batch."""
    full = {name: _full(param.detach()) for name, param in model.named_parameters()}
    with torch.no_grad():
        for name, param in replica.named_parameters():
            param.copy_(full[name])
    replica.zero_grad(set_to_none=True)
    loss_fn(replica, *local_batch).backward()
    bounds = {}
    for name, param in replica.named_parameters():
        if param.grad is None:
            continue
        abs_sum = param.grad.detach().abs().float()
        dist.all_reduce(abs_sum)
        bounds[name] = rank_mean_bound(abs_sum, world_size, reduce_dtype)
    return bounds


def check_grads_against_torch(
    model: nn.Module, torch_model: nn.Module, bounds: dict[str, torch.Tensor], when: str
) -> None:
    """fsdp2's sharded grads against torch's fully_shard's, gathered, within
    ``bounds`` (``rank_sum_bounds``), both from the same parameters."""
    torch_params = dict(torch_model.named_parameters())
    for name, param in model.named_parameters():
        theirs = torch_params[name].grad
        if param.grad is None or theirs is None:
            if (param.grad is None) != (theirs is None):
                raise AssertionError(f"{when}: {name}.grad is {param.grad}, torch's {theirs}")
            continue
        if param.grad.dtype != theirs.dtype:
            raise AssertionError(
                f"{when}: {name}.grad is {param.grad.dtype}, torch's {theirs.dtype}"
            )
        assert_within(
            _full(param.grad),
            _full(theirs),
            bounds[name],
            f"{when}: {name}.grad vs torch fully_shard",
        )


def check_losses_equal(loss: torch.Tensor, torch_loss: torch.Tensor, when: str) -> None:
    """The local losses of fsdp2 and torch's fully_shard from equal parameters:
    the same kernels on the same values, so the same bits (point 2 of the note)."""
    if not torch.equal(loss.detach(), torch_loss.detach()):
        raise AssertionError(
            f"{when}: local loss {loss.item()!r}, torch fully_shard's {torch_loss.item()!r}"
        )
