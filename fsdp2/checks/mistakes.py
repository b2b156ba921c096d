"""One-time checks for mistakes that would otherwise train silently wrong.

- The optimizer was built before ``fully_shard``: it holds the original
  parameters, which the model no longer uses (``check_optimizer``, at each
  optimizer's first ``step()``, local).
- The root was not sharded: its own parameters stay plain tensors that no one
  synchronizes, so each rank trains its own copy (``check_optimizer``, at the
  first ``step()`` of an optimizer holding both sharded and plain trainable
  parameters: one tiny collective, raising only if they differ across ranks).
- The data-parallel ranks hold different models: built differently, loaded
  on some ranks only, HSDP replicas or the whole copies of
  ``min_numel_to_shard`` that differ (same_model.py, at the root's lazy init:
  one tiny all-reduce per data-parallel mesh).

The optimizer checks run from optimizer_hooks.py's pre-step hook until they
pass, then never again for that optimizer; see "Mistakes fsdp2 stops" in
docs/usage.md for why these are errors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..base.markers import DATA_PARALLEL, IGNORED, SHARDED, SHARDED_AS, UNSHARDED
from ..base.private_dist import unseen_by_dispatch_modes
from ..comm.mesh_info import MeshInfo, device_from_mesh
from ..comm.timeouts import naming_failures
from .same_model import check_same_model, checksums, data_parallel_size, differ, some

if TYPE_CHECKING:
    from ..engine.param_group import FSDPParamGroup


def mark_ignored(params: Iterable[nn.Parameter]) -> None:
    """``fully_shard(..., ignored_params=...)``: these stay plain on purpose."""
    for param in params:
        param.__dict__[IGNORED] = True


def at_lazy_init(groups: list[FSDPParamGroup]) -> None:
    """The root's one-time checks (one small collective per data-parallel
    mesh, the same path on every rank)."""
    for group in groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param.sharded_param.__dict__[DATA_PARALLEL] = group.mesh_info
    check_same_model(groups)


def check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """The first-step checks of an optimizer (optimizer_hooks.py runs them
    before its steps): raises on a mistake; returns whether the checks are
    done (False before the first forward, when there is nothing to compare
    yet)."""
    named = _named_params(optimizer)
    _refuse_replaced(named)
    _refuse_unsharded(named)
    sharded = [p for _, p in named if p.__dict__.get(SHARDED)]
    plain = [
        (name, p)
        for name, p in named
        if not isinstance(p, DTensor) and p.requires_grad and not p.__dict__.get(IGNORED)
    ]
    if sharded and plain:
        infos = [info for p in sharded if (info := p.__dict__.get(DATA_PARALLEL)) is not None]
        if not infos and all(p.grad is None for _, p in named):
            return False  # before the first forward: nothing trained yet
        if infos:
            _check_plain_params_agree(plain, max(infos, key=data_parallel_size))
    return True


def _named_params(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every parameter with a name for messages: the optimizer's own
    (``AdamW(model.named_parameters())``), else its position and shape."""
    named = []
    for g, param_group in enumerate(optimizer.param_groups):
        names = param_group.get("param_names")
        for i, param in enumerate(param_group["params"]):
            name = (
                repr(names[i])
                if names is not None
                else f"param_groups[{g}]['params'][{i}] {tuple(param.shape)}"
            )
            named.append((name, param))
    return named


def _holding(named: list[tuple[str, torch.Tensor]], marker: str) -> list[str]:
    """The optimizer's parameters that carry ``marker``, each by the optimizer's
    name for it, else by what the marker says (where it went, its name)."""
    return [
        name if name.startswith("'") else (repr(value) if isinstance(value, str) else str(value))
        for name, p in named
        if (value := p.__dict__.get(marker)) is not None
    ]


def _refuse_replaced(named: list[tuple[str, torch.Tensor]]) -> None:
    replaced = _holding(named, SHARDED_AS)
    if replaced:
        raise RuntimeError(
            f"fsdp2: the optimizer holds {len(replaced)} parameters that fully_shard replaced "
            f"with sharded ones: {some(replaced)}. It would step the old tensors, which the "
            "model no longer uses, so training would change nothing. Build the optimizer after "
            "fully_shard: fully_shard each block, then the root, then "
            "torch.optim.AdamW(model.parameters())."
        )


def _refuse_unsharded(named: list[tuple[str, torch.Tensor]]) -> None:
    unsharded = _holding(named, UNSHARDED)
    if unsharded:
        raise RuntimeError(
            f"fsdp2: the optimizer holds {len(unsharded)} unsharded parameters: "
            f"{some(unsharded)}. It was built while their modules were unsharded (after a "
            "forward with reshard_after_forward=False, or between unshard() and reshard()); "
            "the model trains its sharded parameters, and these are freed at reshard, so "
            "training would change nothing. Build the optimizer while the model is sharded: "
            "right after fully_shard, or after calling reshard() on each FSDPModule."
        )


def _check_plain_params_agree(plain: list[tuple[str, torch.Tensor]], info: MeshInfo) -> None:
    """Plain trainable parameters next to sharded ones must be the same on every
    data-parallel rank, values and gradients (synchronized by DDP/``replicate``
    or by the user): else each rank trains its own copy."""
    if data_parallel_size(info) == 1:
        return
    stats = checksums([p for _, p in plain])
    grads = checksums([p.grad if p.grad is not None else p.new_zeros(0) for _, p in plain])
    local = torch.stack([torch.cat(pair) for pair in zip(stats, grads, strict=True)])
    gathered = _gather(local.to(device_from_mesh(info.mesh)), info).cpu()
    ranks = gathered.flatten(0, 1)  # (ranks, params, 8)
    apart = differ(ranks[..., :4], dim=0) | differ(ranks[..., 4:], dim=0)
    names = [name for (name, _), bad in zip(plain, apart.tolist(), strict=True) if bad]
    if names:
        # fsdp2 never saw the module that holds them (they are outside every sharded
        # module): only the optimizer's own names, if it has them, say where they are.
        unnamed = not names[0].startswith("'")
        where = (
            " (by their place in the optimizer; build it from model.named_parameters() to see "
            "their names here)"
            if unnamed
            else ""
        )
        raise RuntimeError(
            "fsdp2: call fully_shard(model) on the root after its blocks: these parameters are "
            f"not sharded and will not be synchronized: {some(names)}{where}. The optimizer holds "
            "them next to sharded ones, and at its first step their values or gradients differ "
            f"across the {data_parallel_size(info)} data-parallel ranks, so each rank would "
            "train its own copy. Shard the module that holds them (fully_shard(model) last), "
            "or synchronize them (torch's replicate/DDP); to synchronize them yourself later "
            "in the step, pass them to fully_shard's ignored_params or to an optimizer of "
            "their own."
        )


def _gather(local: torch.Tensor, info: MeshInfo) -> torch.Tensor:
    """``local`` of every rank of the data-parallel mesh: (shard ranks,
    replicate ranks, *local.shape), the same on every rank."""
    out = local
    for collectives, size in (
        (info.replicate_collectives, info.replicate_world_size),
        (info.shard_collectives, info.shard_world_size),
    ):
        if collectives is None:
            out = out.unsqueeze(0)
            continue
        # Filled with this rank's values first: a "fake" process group moves no data.
        gathered = out.flatten().repeat(size)
        with (
            naming_failures(
                "all-gather of the unsharded parameters' check (first step)", collectives
            ),
            unseen_by_dispatch_modes(),
        ):
            collectives.all_gather(gathered, out.flatten())
        out = gathered.view(size, *out.shape)
    return out
