"""Every data-parallel rank holds the same model at the first forward.

Each rank builds the model and keeps one piece of each sharded parameter:
pieces of models built differently (a seed per rank) or loaded on some ranks
only (``if rank == 0: model.load_state_dict(sd)``) make one model stitched
from several, which trains without an error. Checked once, at the root's
lazy init, with one all-reduce (MAX) of a few float64 numbers per parameter
and mesh (two for HSDP, one per axis), for every data-parallel mesh of more
than one rank, whatever the parameters hold (so that no rank can skip it):

- *as built*: ``remember`` (at ``fully_shard``, while every rank still holds
  each parameter whole, no communication) takes ``fingerprints`` of it, of
  a TP parameter its TP-local tensor; those of the ranks whose piece did not
  change since must agree.
- *changed on some ranks only*: a parameter whose piece changed since
  ``fully_shard`` (its checksums, taken there too) on some data-parallel
  ranks while on others it was not even written (its version counters
  unmoved, the same object): a load on some ranks only. A rank whose piece
  was written with the values it held (a checkpoint equal there to the
  initialization) counts for neither, as does an empty piece.
- *redundant copies*: HSDP replicas (but pieces over replicas, which have
  none) and the whole copies of ``min_numel_to_shard`` are compared as they
  are at lazy init.

Meta parameters have no checksums (initialized after ``to_empty``, or
loaded: nothing to compare with), nor have tensor subclasses (float8, NF4).
Ranks that are threads of one process (torch's "threaded" test backend)
share one random generator, so their models differ unless built under one
lock: they are not checked. ``check_switches.skip_same_model_check`` turns
the check off. See "Mistakes fsdp2 stops" in docs/usage.md.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..base.markers import BUILT_AS
from ..base.private_dist import local_tensor, unseen_by_dispatch_modes
from ..comm.mesh_info import MeshInfo, device_from_mesh
from ..comm.primitives import Collectives, backend_for
from ..comm.timeouts import naming_failures

if TYPE_CHECKING:
    from ..engine.param import FSDPParam
    from ..engine.param_group import FSDPParamGroup

# Checksums of identical tensors may differ in the last bits when ranks sum them
# in other orders (thread counts, GPU models); different values differ by far more.
_RTOL = 1e-9
_NAMES_SHOWN = 5
_CHUNK = 1 << 22  # elements checksummed at a time: 32 MiB in float64
_SAMPLE = 1 << 14  # elements a fingerprint reads at most
_REPLACED = object()  # no record: the sharded parameter was replaced since fully_shard

# A parameter's row in the all-reduce (see _rows): the checksums of its local tensor
# now and the fingerprint of the whole parameter at fully_shard, each as (v, -v);
# whether its piece changed, whether it stayed untouched; whether its copies on the
# replicas differ (HSDP, set between the two all-reduces).
_NOW, _BUILT = slice(0, 8), slice(8, 12)
_CHANGED, _UNTOUCHED, _REPLICAS_APART = 12, 13, 14
_WIDTH = 15
# How much two ranks' checksums may differ by rounding: relative to the sum of |x|,
# the sum of squares to itself (see checksums and fingerprint: the same prefix).
_SCALE = (1.0, 1.0, 0.0, 127.0)
_PLAIN = (torch.Tensor, nn.Parameter)  # not a subclass (float8, NF4): no checksum


class BuiltAs(NamedTuple):
    """What ``fully_shard`` took of a parameter, kept on its sharded parameter
    until lazy init: the ``fingerprint`` of the whole tensor and of this
    rank's piece (None: on meta, a subclass, or kept whole, which is compared
    as it is), and the sharded parameter's local tensor and version counters."""

    whole: torch.Tensor | None  # (2,) float64, on the parameter's device
    piece: torch.Tensor | None  # (2,) float64, on the piece's device
    local: torch.Tensor
    versions: tuple[int, int]  # the DTensor's, its local tensor's


def remember(taken: list[tuple[nn.Parameter, FSDPParam]]) -> None:
    """At ``fully_shard``: each parameter is still whole (its ``FSDPParam`` just
    made the sharded parameter). The fingerprints of all of them at once."""
    checked: dict[int, bool] = {}  # by mesh: _checked, once
    kept: list[tuple[FSDPParam, torch.Tensor, tuple[int, int]]] = []
    summed: list[tuple[int, torch.Tensor]] = []  # (index in kept, the whole tensor)
    for param, fsdp_param in taken:
        info = fsdp_param.mesh_info
        if id(info) not in checked:
            checked[id(info)] = _checked(info)
        if not checked[id(info)]:
            continue
        sharded = fsdp_param.sharded_param
        local = local_tensor(sharded)
        kept.append((fsdp_param, local, (sharded._version, local._version)))
        whole = local_tensor(param) if isinstance(param, DTensor) else param
        if not fsdp_param.layout.whole and not whole.is_meta and type(whole) in _PLAIN:
            summed.append((len(kept) - 1, whole))
    prints = fingerprints([w for _, w in summed] + [kept[i][1] for i, _ in summed])
    of = {i: (prints[n], prints[len(summed) + n]) for n, (i, _) in enumerate(summed)}
    for i, (fsdp_param, local, versions) in enumerate(kept):
        whole_print, piece_print = of.get(i, (None, None))
        record = BuiltAs(whole_print, piece_print, local, versions)
        fsdp_param.sharded_param.__dict__[BUILT_AS] = record


def skip(fsdp_params: list[FSDPParam]) -> None:
    """Leaves these parameters out of the check (check_switches.py)."""
    for fsdp_param in fsdp_params:
        fsdp_param.sharded_param.__dict__[BUILT_AS] = None


def check_same_model(groups: list[FSDPParamGroup]) -> None:
    """The check at lazy init (see the module's docstring): raises on every
    rank of a mesh, or on none."""
    by_mesh: dict[tuple[int, int], tuple[MeshInfo, list[FSDPParam], list[object]]] = {}
    for group in groups:
        info = group.mesh_info
        for p in group.fsdp_params:
            # Kept no longer than this; none on a parameter replaced since fully_shard.
            record = p.sharded_param.__dict__.pop(BUILT_AS, _REPLACED)
            if record is None or not _checked(info):
                continue
            key = (id(info.shard_group), id(info.replicate_group))
            _, params, records = by_mesh.setdefault(key, (info, [], []))
            params.append(p)
            records.append(record)
    for info, params, records in by_mesh.values():
        device = device_from_mesh(info.mesh)
        _compare(info, params, _rows(params, records, info, device))


def _checked(info: MeshInfo) -> bool:
    """Whether the ranks of ``info`` are compared: more than one, processes."""
    if data_parallel_size(info) == 1:
        return False
    return backend_for(info.shard_group, info.mesh.device_type) != "threaded"


def _rows(
    params: list[FSDPParam], records: list[object], info: MeshInfo, device: torch.device
) -> torch.Tensor:
    """This rank's numbers, a row per parameter (see _NOW...), each value as
    (v, -v) so that MAX gives the highest and (negated) the lowest; -inf
    where it has none. Per parameter only its checksums; the rest at once."""
    none = torch.full((8,), float("-inf"), dtype=torch.float64, device=device)
    zeros = torch.zeros(2, dtype=torch.float64, device=device)
    now, built, piece_then, piece_now = [], [], [], []
    compared, written, replaced = [], [], []
    for p, record in zip(params, records, strict=True):
        local = local_tensor(p.sharded_param)
        copies = _has_copies(p, info) and type(local) is torch.Tensor
        now.append(local if copies else None)
        taken = record if isinstance(record, BuiltAs) and not p.layout.whole else None
        whole = taken.whole if taken is not None else None
        piece = taken.piece if taken is not None else None
        built.append(_both(whole.to(device)) if whole is not None else none[:4])
        compared.append(piece is not None and local.numel() > 0)  # an empty one holds nothing
        piece_then.append(piece.to(device) if piece is not None else zeros)
        piece_now.append(local)
        versions = (p.sharded_param._version, local._version)
        written.append(
            taken is not None and (taken.local is not local or taken.versions != versions)
        )
        replaced.append(record is _REPLACED and not p.layout.whole and local.numel() > 0)
    sums = iter(checksums([x for x in now if x is not None]))
    now_rows = [_both(next(sums).to(device)) if x is not None else none for x in now]
    prints = iter(fingerprints([x for x, c in zip(piece_now, compared, strict=True) if c]))
    piece_now = [next(prints).to(device) if c else zeros for c in compared]
    flags = torch.tensor([compared, written, replaced], device=device)
    changed = flags[0] & differ(torch.stack([torch.stack(piece_then), torch.stack(piece_now)]), 0)
    untouched = flags[0] & ~changed & ~flags[1]
    changed |= flags[2]  # a new parameter since fully_shard: loaded
    # The fingerprints of the wholes where the piece is still as built.
    built_rows = torch.stack(built).masked_fill(changed[:, None], float("-inf"))
    columns = [torch.stack(now_rows), built_rows, changed, untouched, torch.zeros_like(changed)]
    return torch.cat([c.to(torch.float64).reshape(len(params), -1) for c in columns], dim=1)


def _has_copies(p: FSDPParam, info: MeshInfo) -> bool:
    """Whole on every rank, or a shard with copies on the other replicas."""
    return p.layout.whole or (info.replicate_group is not None and p.layout.piece is None)


def _both(values: torch.Tensor) -> torch.Tensor:
    return torch.cat([values, -values])


def _compare(info: MeshInfo, params: list[FSDPParam], rows: torch.Tensor) -> None:
    """``rows`` (params, _WIDTH) reduced with MAX over the replicas, then over
    the shard group: the same on every rank afterwards, so every rank raises
    or none."""
    replicas = info.replicate_collectives
    if replicas is not None and info.replicate_world_size > 1:
        _max_over(rows, replicas)
        # Shards with copies on the other replicas: compared before the shard group's
        # values mix in, the verdict carried through the second all-reduce.
        copies = [_has_copies(p, info) and not p.layout.whole for p in params]
        apart = _apart(rows[:, _NOW]) & torch.tensor(copies, device=rows.device)
        rows[:, _REPLICAS_APART] = apart.to(rows.dtype)
    if info.shard_world_size > 1:
        _max_over(rows, info.shard_collectives)
    rows = rows.cpu()
    whole = torch.tensor([p.layout.whole for p in params])
    copies_apart = (whole & _apart(rows[:, _NOW])) | (rows[:, _REPLICAS_APART] > 0)
    if copies_apart.any():
        raise RuntimeError(_copies_message(info, _names(params, copies_apart)))
    built_apart = ~whole & _apart(rows[:, _BUILT])
    if built_apart.any():
        raise RuntimeError(
            f"fsdp2: the {data_parallel_size(info)} data-parallel ranks built different "
            f"models: {some(_names(params, built_apart))} differed when fully_shard took them "
            "whole, and each rank keeps only its piece, so the model is stitched from "
            "pieces of different initializations. Build the same model on every rank: "
            "torch.manual_seed(0) (one seed for all ranks) before building it (a seed per rank "
            "only afterwards, for data), or load the same checkpoint on every rank before the "
            "first forward."
        )
    some_changed = ~whole & (rows[:, _CHANGED] > 0) & (rows[:, _UNTOUCHED] > 0)
    if some_changed.any():
        raise RuntimeError(
            f"fsdp2: {some(_names(params, some_changed))} changed since fully_shard on some "
            f"of the {data_parallel_size(info)} data-parallel ranks and were not even written "
            "on others (e.g. a checkpoint loaded under `if rank == 0:`), so the model is "
            "stitched: some of its pieces hold the new values, the others what each rank "
            "built. Load on every rank, before the first forward: "
            "model.load_state_dict(sd) or set_model_state_dict(model, sd) on all ranks (to "
            "read the file on rank 0 only, pass options=StateDictOptions(full_state_dict=True, "
            "broadcast_from_rank0=True) to set_model_state_dict, still on every rank)."
        )


def _copies_message(info: MeshInfo, names: list[str]) -> str:
    who = (
        f"the HSDP replicas hold different parameters ({info.replicate_world_size} replicas)"
        if info.replicate_group is not None
        else "the ranks hold different copies of parameters that min_numel_to_shard keeps "
        f"whole on each of the {info.shard_world_size} ranks"
    )
    return (
        f"fsdp2: {who}: {some(names)} differ at the first forward. Gradients are averaged, "
        "so copies that start different stay different, each rank training another model. "
        "Build the same model on every rank: torch.manual_seed(0) (one seed for all ranks) "
        "before building it, or load the same checkpoint on every rank before the first "
        "forward."
    )


def _max_over(rows: torch.Tensor, collectives: Collectives) -> None:
    """In place: the highest of each value over the ranks of ``collectives``
    (a "fake" process group leaves this rank's)."""
    with (
        naming_failures("all-reduce of the same-model check (first forward)", collectives),
        unseen_by_dispatch_modes(),
    ):
        collectives.all_reduce(rows, op=dist.ReduceOp.MAX)


def _names(params: list[FSDPParam], mask: torch.Tensor) -> list[str]:
    return [repr(p.fqn) for p, bad in zip(params, mask.tolist(), strict=True) if bad]


def data_parallel_size(info: MeshInfo) -> int:
    return info.shard_world_size * info.replicate_world_size


def checksums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's (sum, sum of |x|, sum of squares, position-weighted sum) in
    float64, on its device (a DTensor's: of its local tensor): equal for equal
    tensors, different for differently initialised or reordered ones."""
    with torch.no_grad():
        flats = [_flat(local_tensor(t) if isinstance(t, DTensor) else t) for t in tensors]
        return _summed(flats, positions=True)


def fingerprints(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's (sum, sum of |x|) in float64, on its device, of at most
    ``_SAMPLE`` elements spread evenly over it: what tells tensors built or
    loaded apart (a seed or a checkpoint changes every element) at a cost
    that does not grow with the tensor (a full pass over a model on the CPU
    took 24 times fully_shard's own time, docs/performance.md)."""
    with torch.no_grad():
        return _summed([_sample(t) for t in tensors], positions=False)


def _summed(flats: list[torch.Tensor], positions: bool) -> list[torch.Tensor]:
    """``_sums`` of each of ``flats``. Those of one device and dtype are summed
    together, a few ops for thousands of tensors (one at a time, 20k tensors
    took a third of fully_shard's time), in batches of at most ``_CHUNK``
    elements (a bounded float64 copy); a larger tensor alone, in chunks."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(flats):
        by_kind.setdefault((x.device, x.dtype), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(flats)
    for indices in by_kind.values():
        start = 0
        while start < len(indices):
            end, numel = start + 1, flats[indices[start]].numel()
            while end < len(indices) and numel + flats[indices[end]].numel() <= _CHUNK:
                numel += flats[indices[end]].numel()
                end += 1
            batch = indices[start:end]
            if numel > _CHUNK:  # one tensor
                flat = flats[batch[0]]
                chunks = [
                    _sums([flat[i : i + _CHUNK]], positions, i) for i in range(0, numel, _CHUNK)
                ]
                out[batch[0]] = torch.stack(chunks).sum(dim=0)[0]
            else:
                for i, row in zip(
                    batch, _sums([flats[i] for i in batch], positions).unbind(0), strict=True
                ):
                    out[i] = row
            start = end
    return out


def _sums(xs: list[torch.Tensor], positions: bool, first: int = 0) -> torch.Tensor:
    """(len(xs), 2 or 4) in float64: the sum and the sum of |x| of each; with
    ``positions`` also the sum of squares and the sum weighted by the position
    in the tensor (``first`` plus the index in ``x``, modulo 127, plus 1)."""
    values = torch.cat(xs).to(torch.float64)
    numels = [x.numel() for x in xs]
    lengths = torch.tensor(numels, device=values.device)
    columns = [values, values.abs()]
    if positions:
        starts = torch.tensor([0, *itertools.accumulate(numels)][:-1], device=values.device)
        index = torch.arange(values.numel(), device=values.device)
        index = index - starts.repeat_interleave(lengths, output_size=values.numel()) + first
        columns += [values * values, values * (index % 127 + 1)]
    sums = [torch.segment_reduce(c, "sum", lengths=lengths, unsafe=True) for c in columns]
    return torch.stack(sums, dim=1)


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = _flat(tensor)
    step = -(-flat.numel() // _SAMPLE)
    return flat[::step] if step > 1 else flat


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().flatten()
    return torch.view_as_real(flat).flatten() if flat.is_complex() else flat


def differ(stats: torch.Tensor, dim: int) -> torch.Tensor:
    """Whether the checksums (..., 4) differ along ``dim`` beyond rounding."""
    return _apart(torch.cat([stats.amax(dim=dim), -stats.amin(dim=dim)], dim=-1))


def _apart(both: torch.Tensor) -> torch.Tensor:
    """Whether the highest and the lowest checksums over the ranks (..., 2k:
    the highest k, then the negated lowest k) differ beyond rounding; False
    where no rank had any (-inf)."""
    k = both.size(-1) // 2
    high, low = both[..., :k], -both[..., k:]
    scale = high[..., 1:2].abs() * torch.tensor(_SCALE[:k], dtype=both.dtype, device=both.device)
    if k > 2:
        scale[..., 2] = high[..., 2].abs()
    known = torch.isfinite(high).all(dim=-1) & torch.isfinite(low).all(dim=-1)
    return known & ((high - low) > _RTOL * scale).any(dim=-1)


def some(names: list[str]) -> str:
    """The first few names, and how many more."""
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")
