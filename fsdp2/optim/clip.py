"""Gradient clipping over parameters sharded on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one
DTensor, which fails as soon as two gradients live on different meshes (e.g.
MoE experts on an HSDP mesh, the rest on a 1D one): "All operands in
aten.stack.default must have the same mesh". With ``norm_type=inf`` it also
fails on a rank whose shard of some gradient is empty (``torch.chunk`` gives
fewer chunks than ranks), and that rank's peers then wait in the collective.

Here the norm is computed from the local shards: gradients are grouped by mesh
and by the mesh axes that shard them; each group's local sum of ``|g|^p`` (or
max of ``|g|``) is all-reduced over those axes only, so a shard counts once and
a replica is not counted again; the groups' results are combined on every rank.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from ..base.private_api import foreach_mul_
from ..base.private_dist import dtensor_specs, local_tensor, locals_in_place, shards_tensor
from ..comm.primitives import collectives_for
from ..comm.timeouts import naming_failures
from ..engine.reduction import ReductionPipeline
from ..engine.sharded_grads import whole_buffers

# (mesh, mesh axes the gradient is sharded over); (None, ()) for plain tensors.
_GroupKey = tuple[DeviceMesh | None, tuple[int, ...]]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips gradients in place to a total norm of at most ``max_norm``, like
    ``torch.nn.utils.clip_grad_norm_``, also when they are DTensors on different
    meshes.

    The total norm is that of all gradients concatenated, each counted once:
    a ``Shard`` placement contributes every rank's shard, a ``Replicate`` one a
    single copy. Plain (non-DTensor) gradients are taken as they are on this
    rank, as identical on every rank. Every gradient is multiplied by
    ``min(1, max_norm / (total_norm + 1e-6))``.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is
            clipped; those without a gradient are skipped. Every rank must pass
            the same parameters in the same order (the norm takes one
            all-reduce per group of gradients, issued in that order).
        max_norm: the largest total norm allowed.
        norm_type: p of the p-norm, positive, or ``float("inf")`` for the
            largest absolute value. (Default: 2.0)
        error_if_nonfinite: raise if the total norm is NaN or infinite
            (on every rank, since every rank computes the same total).
            (Default: False)
        foreach: use the multi-tensor kernels to compute local norms and
            scale gradients; ``None`` uses them where the device supports them.
            (Default: None)

    Returns:
        The total norm before clipping: a plain scalar tensor (not a DTensor),
        the same on every rank, on the device of the first gradient, in
        float32 (float64 if any gradient is float64).

    Raises:
        ValueError: if ``norm_type`` is not positive, or a gradient has a
            placement other than ``Shard`` or ``Replicate`` (e.g. ``Partial``).
        RuntimeError: if ``error_if_nonfinite`` and the total norm is not finite.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if ReductionPipeline.left_in_flight:  # set_is_last_backward(False): every gradient first
        ReductionPipeline.finish_left_in_flight()
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(
            f"clip_grad_norm_ takes a positive norm_type or float('inf'), got {norm_type}"
        )
    # One read of each .grad (on a DTensor parameter it costs several times a
    # plain one's), and everything after it one C-level pass per list.
    grads = list(filter(_IS_GRAD, map(_GRAD, parameters)))
    if not grads:
        return torch.tensor(0.0)
    groups = group_by_mesh(grads)
    total = total_norm(groups, norm_type, foreach, grads[0].device, error_if_nonfinite)
    # Scaling needs no communication: each rank scales its own shards, as plain
    # tensors (one multi-tensor call; on DTensors each op would be dispatched
    # through sharding propagation, and refused across meshes).
    scale([t for locals_ in groups.values() for t in locals_], max_norm, total, foreach)
    return total


class UnsupportedPlacement(ValueError):
    """A gradient placed other than ``Shard`` or ``Replicate`` (e.g.
    ``Partial``): its norm needs a reduction of its own."""


# torch's, bound at import: install_as_torch_fsdp() may route the public name
# to fsdp2 (torch_clipping.py), which calls back here for the local norms.
_TORCH_TOTAL_NORM = torch.nn.utils.get_total_norm
_GRAD = operator.attrgetter("grad")
_IS_GRAD = functools.partial(operator.is_not, None)
_MESH = operator.attrgetter("mesh")
_PLACEMENTS = operator.attrgetter("placements")
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")


def scale(
    grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None
) -> None:
    """Multiplies ``grads`` by ``min(1, max_norm / (total + 1e-6))``, as
    ``torch.nn.utils.clip_grads_with_norm_`` does (the same factor, so the same
    bits), one multi-tensor call per device and dtype."""
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    kinds = set(zip(map(_DEVICE, grads), map(_DTYPE, grads), strict=True))
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    if len(kinds) == 1:
        by_kind[kinds.pop()] = grads
    else:
        for grad in grads:
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), same in by_kind.items():
        device_coef = coef.to(device)
        if foreach is False:
            for grad in same:
                grad.mul_(device_coef)
        else:
            foreach_mul_(same, device_coef)


def group_by_mesh(
    grads: list[torch.Tensor], buffers: bool = True
) -> dict[_GroupKey, list[torch.Tensor]]:
    """The gradients' local tensors by (mesh, sharded axes). Insertion order
    follows the gradients, the same on every rank, so the groups' all-reduces
    pair up across ranks. ``buffers``: a group's gradients that fsdp2 keeps in
    one buffer go in as that buffer (one norm for them; False: one per gradient,
    as torch's clipping takes them).

    Raises:
        UnsupportedPlacement: if a gradient is placed other than ``Shard`` or
            ``Replicate``.
    """
    whole = whole_buffers(grads) if buffers else {}
    specs = dtensor_specs(grads)
    if specs:
        # Usually every gradient has one mesh and one placement: two counts
        # (identity first, so mostly no __eq__) say so without a key per gradient.
        first = specs[0]
        count = len(specs)
        if (
            list(map(_MESH, specs)).count(first.mesh) == count
            and list(map(_PLACEMENTS, specs)).count(first.placements) == count
        ):
            locals_ = list(grads)
            locals_in_place(locals_)
            key = _group_key(first.mesh, first.placements, grads[0], 0)
            return {key: with_buffers(locals_, whole)}
    groups: dict[_GroupKey, list[torch.Tensor]] = {}
    for index, grad in enumerate(grads):
        if isinstance(grad, DTensor):
            key = _group_key(grad.device_mesh, grad.placements, grad, index)
            tensor = whole[index] if index in whole else local_tensor(grad)
        else:
            key, tensor = (None, ()), grad
        group = groups.setdefault(key, [])
        if tensor is not None:
            group.append(tensor)
    return groups


def with_buffers(
    tensors: list[torch.Tensor], whole: dict[int, torch.Tensor | None]
) -> list[torch.Tensor]:
    """``tensors`` (the gradients' local tensors) with each buffer of
    ``whole_buffers`` in place of its gradients."""
    if not whole:
        return tensors
    found = [whole.get(index, tensor) for index, tensor in enumerate(tensors)]
    return [tensor for tensor in found if tensor is not None]


def _group_key(
    mesh: DeviceMesh, placements: Sequence[Placement], grad: torch.Tensor, index: int
) -> _GroupKey:
    sharded_axes = []
    for axis, placement in enumerate(placements):
        if shards_tensor(placement):
            sharded_axes.append(axis)
        elif not isinstance(placement, Replicate):
            raise UnsupportedPlacement(
                f"clip_grad_norm_: the gradient of parameter #{index} (global shape "
                f"{tuple(grad.shape)}) is placed {placement!r} on mesh axis {axis}; only Shard "
                "and Replicate gradients have a norm without communication of their own. "
                "Redistribute it first, e.g. grad.redistribute(placements=[Replicate()])."
            )
    return mesh, tuple(sharded_axes)


def total_norm(
    groups: dict[_GroupKey, list[torch.Tensor]],
    norm_type: float,
    foreach: bool | None,
    device: torch.device,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """The total ``norm_type``-norm of the gradients in ``groups`` (from
    ``group_by_mesh``): one all-reduce per group and sharded mesh axis, the
    result the same on every rank, on ``device``."""
    total = _combined_norm(groups, norm_type, foreach, device)
    if error_if_nonfinite:
        check_finite(total, norm_type)
    return total


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """Raises if the total norm is not finite (``error_if_nonfinite=True``)."""
    if not torch.isfinite(total).item():
        raise RuntimeError(
            f"clip_grad_norm_: the total {norm_type}-norm of the gradients is {total.item()}, "
            "so clipping would make them NaN or zero. Pass error_if_nonfinite=False to clip "
            "anyway, or find the parameter whose gradient is not finite."
        )


def _combined_norm(
    groups: dict[_GroupKey, list[torch.Tensor]],
    norm_type: float,
    foreach: bool | None,
    device: torch.device,
) -> torch.Tensor:
    dtypes = {dtype for locals_ in groups.values() for dtype in set(map(_DTYPE, locals_))}
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    per_group = []
    for (mesh, sharded_axes), locals_ in groups.items():
        value = _local_norm(locals_, norm_type, foreach).to(dtype)
        if not math.isinf(norm_type):
            value = value**norm_type
        per_group.append(reduce_over_shards(value, mesh, sharded_axes, norm_type).to(device))
    stacked = torch.stack(per_group)
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.sum() ** (1.0 / norm_type)


def reduce_over_shards(
    value: torch.Tensor, mesh: DeviceMesh | None, sharded_axes: tuple[int, ...], norm_type: float
) -> torch.Tensor:
    """``value`` (local sums of ``|g|^p``, or maxima of ``|g|`` for the inf norm)
    summed (maxed) over the mesh axes that shard its gradients, in place where
    it is on the mesh's device."""
    if mesh is None or not sharded_axes:
        return value
    value = value.to(_mesh_device(mesh))
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for axis in sharded_axes:
        group = collectives_for(mesh.get_group(axis), mesh.device_type, _role(mesh, axis))
        with naming_failures("all-reduce of the gradients' norm (clip_grad_norm_)", group):
            group.all_reduce(value, op)
    return value


def _local_norm(
    tensors: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> torch.Tensor:
    # An empty shard adds nothing to a p-norm (0), but the inf norm of an
    # empty tensor raises (max has no identity): there, leave them out.
    if math.isinf(norm_type):
        tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros(())
    return _TORCH_TOTAL_NORM(tensors, norm_type, foreach=foreach)


def _role(mesh: DeviceMesh, axis: int) -> str:
    name = mesh.mesh_dim_names[axis] if mesh.mesh_dim_names else str(axis)
    return f"group of mesh axis {name!r}"


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    # The collective runs on the mesh's backend, which may not take tensors of
    # the gradients' device (CPU-offloaded gradients on an accelerator mesh).
    return torch.device(mesh.device_type)
