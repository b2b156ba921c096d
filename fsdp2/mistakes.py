"""One-time checks for three mistakes that would otherwise train silently wrong.

- The optimizer was built before ``fully_shard``: it holds the original
  parameters, which the model no longer uses (``check_optimizer``, at each
  optimizer's first ``step()``, local).
- The root was not sharded: its own parameters stay plain tensors that no one
  synchronizes, so each rank trains its own copy (``check_optimizer``, at the
  first ``step()`` of an optimizer holding both sharded and plain trainable
  parameters: one tiny collective, raising only if they differ across ranks).
- HSDP replicas (or the whole copies ``min_numel_to_shard`` keeps on every
  rank) were built differently (``check_replicas``, at the root's lazy init:
  one tiny collective per mesh, none for plain FSDP).

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

from .common import MeshInfo, device_from_mesh
from .markers import DATA_PARALLEL, IGNORED, SHARDED, SHARDED_AS
from .private_api import local_tensor

if TYPE_CHECKING:
    from .param_group import FSDPParamGroup

# Checksums of identical tensors may differ in the last bits when ranks sum them
# in other orders (thread counts, GPU models); different values differ by far more.
_RTOL = 1e-9
_NAMES_SHOWN = 5
_CHUNK = 1 << 22  # elements checksummed at a time: 32 MiB in float64


def mark_ignored(params: Iterable[nn.Parameter]) -> None:
    """``fully_shard(..., ignored_params=...)``: these stay plain on purpose."""
    for param in params:
        param.__dict__[IGNORED] = True


def at_lazy_init(groups: list[FSDPParamGroup]) -> None:
    """The root's one-time checks (collective where HSDP or whole
    parameters exist, the same path on every rank)."""
    for group in groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param.sharded_param.__dict__[DATA_PARALLEL] = group.mesh_info
    check_replicas(groups)


def check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """The first-step checks of an optimizer (optimizer_hooks.py runs them
    before its steps): raises on a mistake; returns whether the checks are
    done (False before the first forward, when there is nothing to compare
    yet)."""
    named = _named_params(optimizer)
    _refuse_replaced(named)
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
            _check_plain_params_agree(plain, max(infos, key=_data_parallel_size))
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


def _refuse_replaced(named: list[tuple[str, torch.Tensor]]) -> None:
    replaced = [
        name if name.startswith("'") else owner  # the optimizer's name, else where it was
        for name, p in named
        if (owner := p.__dict__.get(SHARDED_AS)) is not None
    ]
    if replaced:
        raise RuntimeError(
            f"fsdp2: the optimizer holds {len(replaced)} parameters that fully_shard replaced "
            f"with sharded ones: {_some(replaced)}. It would step the old tensors, which the "
            "model no longer uses, so training would change nothing. Build the optimizer after "
            "fully_shard: fully_shard each block, then the root, then "
            "torch.optim.AdamW(model.parameters())."
        )


def _data_parallel_size(info: MeshInfo) -> int:
    return info.shard_world_size * info.replicate_world_size


def _check_plain_params_agree(plain: list[tuple[str, torch.Tensor]], info: MeshInfo) -> None:
    """Plain trainable parameters next to sharded ones must be the same on every
    data-parallel rank, values and gradients (synchronized by DDP/``replicate``
    or by the user): else each rank trains its own copy."""
    if _data_parallel_size(info) == 1:
        return
    stats = [_checksums(p) for _, p in plain]
    grads = [_checksums(p.grad if p.grad is not None else p.new_zeros(0)) for _, p in plain]
    local = torch.stack([torch.cat(pair) for pair in zip(stats, grads, strict=True)])
    gathered = _gather(local.to(device_from_mesh(info.mesh)), info).cpu()
    ranks = gathered.flatten(0, 1)  # (ranks, params, 8)
    differ = _differ(ranks[..., :4], dim=0) | _differ(ranks[..., 4:], dim=0)
    names = [name for (name, _), bad in zip(plain, differ.tolist(), strict=True) if bad]
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
            f"not sharded and will not be synchronized: {_some(names)}{where}. The optimizer holds "
            "them next to sharded ones, and at its first step their values or gradients differ "
            f"across the {_data_parallel_size(info)} data-parallel ranks, so each rank would "
            "train its own copy. Shard the module that holds them (fully_shard(model) last), "
            "or synchronize them (torch's replicate/DDP); to synchronize them yourself later "
            "in the step, pass them to fully_shard's ignored_params or to an optimizer of "
            "their own."
        )


def check_replicas(groups: list[FSDPParamGroup]) -> None:
    """HSDP replicas must start from the same parameters, and the whole copies
    of ``min_numel_to_shard`` must be the same on every rank: gradients are
    averaged, so copies that start different stay different."""
    by_mesh: dict[tuple[int, int], list[tuple[MeshInfo, str, torch.Tensor, bool]]] = {}
    for group in groups:
        info = group.mesh_info
        for p in group.fsdp_params:
            whole, piece = p.layout.whole, p.layout.piece
            if not whole and (info.replicate_group is None or piece is not None):
                continue  # a shard (or a piece across replicas) of its own: nothing to agree with
            local = local_tensor(p.sharded_param)
            if type(local) is not torch.Tensor:
                continue  # a subclass (float8, NF4) may not sum: not checked
            key = (id(info.shard_group), id(info.replicate_group))
            by_mesh.setdefault(key, []).append((info, p.fqn, local, whole))
    for params in by_mesh.values():
        info = params[0][0]
        local = torch.stack([_checksums(t) for _, _, t, _ in params])
        gathered = _gather(local.to(device_from_mesh(info.mesh)), info).cpu()  # (S, R, n, 4)
        differ = [
            bool(_differ(gathered.flatten(0, 1)[:, i], dim=0))
            if whole
            else bool(_differ(gathered[:, :, i], dim=1).any())
            for i, (_, _, _, whole) in enumerate(params)
        ]
        names = [repr(fqn) for (_, fqn, _, _), bad in zip(params, differ, strict=True) if bad]
        if not names:
            continue
        hsdp = info.replicate_group is not None
        who = (
            f"the HSDP replicas hold different parameters ({info.replicate_world_size} replicas)"
            if hsdp
            else "the ranks hold different copies of parameters that min_numel_to_shard keeps "
            f"whole on each of the {info.shard_world_size} ranks"
        )
        raise RuntimeError(
            f"fsdp2: {who}: {_some(names)} differ at the first forward. Gradients are averaged, "
            "so copies that start different stay different, each rank training another model. "
            "Build the same model on every rank: torch.manual_seed(0) (one seed for all ranks) "
            "before building it, or load the same checkpoint on every rank before the first "
            "forward."
        )


def _checksums(tensor: torch.Tensor) -> torch.Tensor:
    """(sum, sum of |x|, sum of squares, position-weighted sum) in float64: equal
    for equal tensors, different for differently initialised ones. In chunks,
    so a large shard costs a bounded float64 copy."""
    if isinstance(tensor, DTensor):
        tensor = local_tensor(tensor)
    with torch.no_grad():
        flat = tensor.detach().flatten()
        if flat.is_complex():
            flat = torch.view_as_real(flat).flatten()
        total = torch.zeros(4, dtype=torch.float64, device=flat.device)
        for start in range(0, flat.numel(), _CHUNK):
            x = flat[start : start + _CHUNK].to(torch.float64)
            index = torch.arange(start, start + x.numel(), dtype=torch.float64, device=x.device)
            weights = index % 127 + 1
            total += torch.stack([x.sum(), x.abs().sum(), (x * x).sum(), (x * weights).sum()])
        return total.cpu()


def _differ(stats: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether the checksums (..., 4) differ along ``dim`` beyond rounding."""
    high, low = stats.amax(dim=dim), stats.amin(dim=dim)
    scale = high[..., 1:2].abs() * torch.tensor([1.0, 1.0, 0.0, 127.0], dtype=stats.dtype)
    scale[..., 2] = high[..., 2].abs()
    return ((high - low) > _RTOL * scale).any(dim=-1)


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
        collectives.all_gather(gathered, out.flatten())
        out = gathered.view(size, *out.shape)
    return out


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")
