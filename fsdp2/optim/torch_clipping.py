"""torch's gradient clipping routed to fsdp2's local norms, for code that calls
``torch.nn.utils.clip_grad_norm_`` (Lightning, accelerate, the Hugging Face
Trainer) or ``get_total_norm`` and ``clip_grads_with_norm_`` (torchtitan).

On DTensor gradients torch's functions run every op through DTensor: one
norm per gradient wrapped in a DTensor, a ``torch.stack`` of them (whose
sharding propagation grows faster than the gradient count), and a
multiplication dispatched per list: 2-3x the time of the same call on plain
tensors. The functions here compute torch's norm from the local tensors, to
the last bit (each gradient's norm made whole over the ranks that shard it,
one all-reduce for a group's norms, then the norm of norms: ``_torchs_total``),
scale the local tensors as ``fsdp2.clip_grad_norm_`` does, and give back what
torch's give: the total norm in the gradients' promoted dtype, a DTensor when the first gradient is one
(``Replicate``: already the total on every rank, so ``.full_tensor()`` is free),
a plain tensor otherwise. Anything they do not take (no DTensor among the
tensors, a ``Partial`` gradient, a ``norm_type`` that is not positive) goes
to torch's own.

``install_as_torch_fsdp()`` installs them; ``route_torch_clipping`` lists
what it replaces.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..base.private_api import clip_grad_norm_helpers, foreach_norm
from ..base.private_dist import dtensor_specs, local_tensor, locals_in_place
from ..engine.sharded_grads import whole_buffers
from .clip import (
    _GRAD,
    _IS_GRAD,
    UnsupportedPlacement,
    check_finite,
    group_by_mesh,
    reduce_over_shards,
    scale,
    with_buffers,
)

# torch's, bound at import (before any routing), for what is not routed.
_TORCH_CLIP_GRAD_NORM = torch.nn.utils.clip_grad_norm_
_TORCH_TOTAL_NORM = torch.nn.utils.get_total_norm
_TORCH_CLIP_WITH_NORM = torch.nn.utils.clip_grads_with_norm_
_DTYPE = operator.attrgetter("dtype")


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, from the local tensors of DTensor
    gradients (each ``.grad`` read once: on a DTensor parameter a read costs
    several times a plain one's)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = list(filter(_IS_GRAD, map(_GRAD, params)))
    total = _total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if total is None:
        # An exhausted generator still is one: torch's warns that nothing is clipped.
        return _TORCH_CLIP_GRAD_NORM(
            params or parameters, max_norm, norm_type, error_if_nonfinite, foreach
        )
    _scale(grads, max_norm, total, foreach)
    return _like_torchs(total, grads[0])


@torch.no_grad()
def get_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm``, from the local tensors of DTensors."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    total = _total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    if total is None:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    return _like_torchs(total, tensors[0])


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``, on the local tensors of
    DTensor gradients (any placement: scaling by a factor the same on every
    rank commutes with each)."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = list(filter(_IS_GRAD, map(_GRAD, parameters)))
    if not any(isinstance(g, DTensor) for g in grads):
        _TORCH_CLIP_WITH_NORM(parameters, max_norm, total_norm, foreach)
        return
    if isinstance(total_norm, DTensor):
        if all(isinstance(p, Replicate) for p in total_norm.placements):
            total_norm = local_tensor(total_norm)
        else:  # torch's own norm (its placement is partial): reduce it once
            total_norm = total_norm.full_tensor()
    _scale(grads, max_norm, total_norm, foreach)


def _total_norm(
    tensors: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool, foreach: bool | None
) -> torch.Tensor | None:
    """The total norm, a plain tensor the same on every rank in the dtype
    torch's would have; None for what torch's own should compute (no DTensor,
    a placement other than Shard or Replicate, a norm_type not positive)."""
    norm_type = float(norm_type)
    if not (norm_type > 0 and any(isinstance(t, DTensor) for t in tensors)):
        return None
    try:
        groups = group_by_mesh(tensors, buffers=False)
    except UnsupportedPlacement:
        return None
    total = _torchs_total(groups, norm_type, foreach, tensors[0].device)
    if error_if_nonfinite:
        check_finite(total, norm_type)
    # torch's norm has the dtype its per-tensor norms promote to.
    return total.to(functools.reduce(torch.promote_types, set(map(_DTYPE, tensors))))


def _torchs_total(
    groups: dict[Any, list[torch.Tensor]],
    norm_type: float,
    foreach: bool | None,
    device: torch.device,
) -> torch.Tensor:
    """The total norm as torch's computes it on DTensors, to the last bit: each
    gradient's norm is its local norm reduced over the ranks that shard it (a
    DTensor's partial norm made whole: ``**p``, sum, ``**(1/p)``), and the total
    is the norm of those norms, stacked by dtype in the gradients' order (group
    by group where they differ in mesh or sharded axes). Here a group's norms
    are reduced together, one all-reduce per dtype and mesh axis
    where torch's makes one per gradient. torch takes each norm in a loop on
    DTensors (its multi-tensor kernels do not take them) unless told
    ``foreach=True``; on the CPU the multi-tensor norm runs that same kernel
    per tensor (the same bits, a sixth of the time of a Python loop), so it is
    taken there too."""
    infinite = math.isinf(norm_type)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for (mesh, sharded_axes), locals_ in groups.items():
        for dtype in dict.fromkeys(map(_DTYPE, locals_)):
            same = [t for t in locals_ if t.dtype == dtype]
            if infinite:  # an empty shard's is its peers' (max has no identity)
                same = [t if t.numel() else t.new_zeros(1) for t in same]
            if foreach or (foreach is None and same[0].device.type == "cpu"):
                norms = foreach_norm(same, norm_type)
            else:
                norms = [torch.linalg.vector_norm(t, norm_type) for t in same]
            local = torch.stack(norms)
            if not infinite:
                local = local**norm_type
            whole = reduce_over_shards(local, mesh, sharded_axes, norm_type)
            if not infinite:
                whole = whole ** (1.0 / norm_type)
            by_dtype.setdefault(dtype, []).append(whole.to(device))
    return torch.linalg.vector_norm(
        torch.cat([norms for per_dtype in by_dtype.values() for norms in per_dtype]), norm_type
    )


def _scale(
    grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None
) -> None:
    if dtensor_specs(grads) is not None:
        locals_ = list(grads)
        locals_in_place(locals_)
    else:
        locals_ = [local_tensor(g) if isinstance(g, DTensor) else g for g in grads]
    scale(with_buffers(locals_, whole_buffers(grads)), max_norm, total, foreach)


def _like_torchs(total: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """A DTensor when the first tensor is one, as torch's result; Replicate,
    since ``total`` already is the total on every rank."""
    if not isinstance(first, DTensor):
        return total
    mesh = first.device_mesh
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def route_torch_clipping() -> list[tuple[ModuleType, str, object, object]]:
    """Routes ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
    ``clip_grads_with_norm_`` here, and the two functions torch's
    ``clip_grad_norm_`` calls, for callers that bound it before.

    Returns:
        ``(module, name, torch's object, fsdp2's object)`` for each name
        replaced (none already routed).
    """
    module, (total_name, scale_name) = clip_grad_norm_helpers()
    routes = [
        (torch.nn.utils, "clip_grad_norm_", clip_grad_norm_),
        (module, "clip_grad_norm_", clip_grad_norm_),
        (module, total_name, get_total_norm),
        (module, scale_name, clip_grads_with_norm_),
        (torch.nn.utils, "get_total_norm", get_total_norm),
        (torch.nn.utils, "clip_grads_with_norm_", clip_grads_with_norm_),
    ]
    replaced: list[tuple[ModuleType, str, object, object]] = []
    for namespace, name, routed in routes:
        original = getattr(namespace, name)
        if original is not routed:
            replaced.append((namespace, name, original, routed))
            setattr(namespace, name, routed)
    return replaced
