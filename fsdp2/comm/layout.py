"""ShardLayout: where one parameter's elements sit, on this rank and in the
communication buffers. Computed once, at ``fully_shard``, from the
parameter's shape, its shard dim and its mesh; nothing in it changes after.

[Note: the padded layout]
A parameter of ``dim0`` rows is cut like ``torch.chunk(param, world_size)``:
every rank owns ``chunk_rows = ceil(dim0 / world_size)`` rows except the tail,
which may own fewer or none. The sharded DTensor holds exactly those rows, with
no padding, so ``full_tensor()`` returns the original bit for bit. Padding lives
only in communication buffers: in the all-gather buffer and in the
reduce-scatter buffer every rank's *slot* for this parameter is
``chunk_rows * row_numel`` elements (``slot_numel``), whatever it really owns.

A parameter sharded on a dim ``d > 0`` (``shard_placement_fn``) must split
evenly. Its slot is this rank's chunk, contiguous, shaped ``(pre, chunk, post)``
(``pre``/``post``: the products of the sizes before and after ``d``); the
unsharded parameter seen *rank-major*, ``view(pre, W, chunk, post)`` with the
first two dims swapped, lines up with the ``(W, slot)`` rows of the buffers.

[Note: FSDP over tensor parallelism]
A parameter that is already a DTensor on a TP mesh is sharded as above, but
what is sharded (and all-gathered, and reduce-scattered) is its TP-local
tensor. The sharded parameter is a DTensor on the mesh that joins the
data-parallel axes and the TP axes, placed ``(*dp placements, *tp placements)``.
When both shard the same dim, the data-parallel chunk is a chunk *of the TP
chunk*: ``_StridedShard(d, split_factor=<TP shards of d>)`` says so, so that
``full_tensor()``, ``redistribute`` and checkpoints see the right rows. The
unsharded parameter is a DTensor with the original TP layout again.

[Note: sharded over replicas]
With ``shard_optimizer_over_replicas`` on a 2D mesh ``(replicate=R,
shard=S)`` the rank at ``(r, s)`` holds, as its sharded parameter,
``torch.chunk(torch.chunk(param, S)[s], R)[r]``: a *piece* of its shard
group's *chunk*, 1/(R*S) of the parameter. DTensor calls that layout
``(_StridedShard(0, split_factor=S), Shard(0))``: "chunk over S first, then
each chunk over R", as FSDP over tensor parallelism does. For uneven dims
torch's ``_StridedShard`` places rows like nested ``torch.chunk`` only for
some sizes (for R = 2 every size checked, up to 3000 rows and S = 32; not
e.g. 7 rows on R=3 x S=2 or 9 rows on R=4 x S=2):
``mesh_info.strided_layout_matches`` tells, and ``fully_shard`` refuses the
others. In the buffers across replicas a piece's slot is ``piece_rows *
row_numel`` elements on every rank of a replica group (``piece_rows =
ceil(chunk rows / R)``: the chunk has the same rows on every rank of a
replica group), padded as above. How the pieces travel: over_replicas.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..base.private_dist import concatenate_meshes, strided_shard
from .mesh_info import MeshInfo, SpmdAxes, chunk_rows


class TPLayout(NamedTuple):
    """Where tensor parallelism put a parameter: its mesh and (Shard/Replicate) placements."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` under this layout, as a view."""
        local = full
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                coordinate = self.mesh.get_local_rank(axis)
                local = _chunk(local, self.mesh.size(axis), placement.dim, coordinate)
        return local


class PieceLayout(NamedTuple):
    """Where this rank's piece sits in its shard group's chunk (see [Note:
    sharded over replicas])."""

    chunk_shape: torch.Size  # the shard group's chunk on this rank (dim 0 sharded)
    replicas: int  # R
    replica_rank: int  # r
    piece_rows: int  # ceil(chunk rows / R): the slot's rows in the buffers across replicas
    start: int  # first row of the piece in the chunk
    rows: int  # rows of the piece (fewer than piece_rows at the tail, maybe 0)

    @classmethod
    def of(cls, chunk_shape: torch.Size, replicas: int, replica_rank: int) -> PieceLayout:
        rows = chunk_shape[0]
        piece_rows = chunk_rows(rows, replicas)
        start = min(replica_rank * piece_rows, rows)
        return cls(
            chunk_shape, replicas, replica_rank, piece_rows, start, min(piece_rows, rows - start)
        )

    @property
    def row_numel(self) -> int:
        return self.chunk_shape[1:].numel()

    @property
    def slot_numel(self) -> int:
        """One replica's slot in the buffers across replicas (padded)."""
        return self.piece_rows * self.row_numel

    @property
    def chunk_numel(self) -> int:
        return self.chunk_shape.numel()


class ShardLayout(NamedTuple):
    """One parameter's layout: this rank's local tensor, its slot in the
    buffers, and the sharded DTensor's mesh and placements."""

    orig_size: torch.Size  # global, as full_tensor() returns it
    unsharded_size: torch.Size  # what the group all-gathers: the whole, or the TP-local part
    shard_dim: int
    # Kept whole on every rank (``min_numel_to_shard``): not all-gathered, its
    # gradient all-reduced, a "shard" over a world of one.
    whole: bool
    world_size: int  # of the shard group (1 when whole)
    rank: int  # in the shard group (0 when whole)
    chunk_rows: int  # along shard_dim: ceil(unsharded rows / world_size)
    slot_numel: int  # one rank's slot in the buffers of the shard group (padded)
    local_start: int  # of this rank's local tensor along shard_dim, in the unsharded tensor
    local_shape: torch.Size  # of the sharded parameter's local tensor
    mesh: DeviceMesh  # of the sharded DTensor
    placements: tuple[Placement, ...]
    tp: TPLayout | None  # TP (or dp_mesh_dims): the unsharded parameter's layout
    piece: PieceLayout | None  # sharded over replicas: where the local tensor sits in the chunk

    @classmethod
    def of(
        cls,
        param: torch.Tensor,
        mesh_info: MeshInfo,
        shard_dim: int = 0,
        whole: bool = False,
        over_replicas: bool = False,
    ) -> ShardLayout:
        tp = (
            TPLayout(param.device_mesh, tuple(param.placements))
            if isinstance(param, DTensor)
            else None
        )
        unsharded_size = param.to_local().size() if isinstance(param, DTensor) else param.size()
        world_size, rank = (1, 0) if whole else (mesh_info.shard_world_size, mesh_info.shard_rank)
        dim_size = unsharded_size[shard_dim]
        rows = chunk_rows(dim_size, world_size)
        start = min(rank * rows, dim_size)
        local_shape = list(unsharded_size)
        local_shape[shard_dim] = min(rows, dim_size - start)
        piece = None
        if over_replicas and not whole:
            replicas, replica_rank = (
                mesh_info.replicate_world_size,
                mesh_info.mesh.get_local_rank(0),
            )
            piece = PieceLayout.of(torch.Size(local_shape), replicas, replica_rank)
            start += piece.start
            local_shape[0] = piece.rows
        mesh, placements = _sharded_placements(mesh_info, tp, shard_dim, whole, over_replicas)
        placements = _INTERNED.setdefault(placements, placements)
        return cls(
            orig_size=param.size(),
            unsharded_size=unsharded_size,
            shard_dim=shard_dim,
            whole=whole,
            world_size=world_size,
            rank=rank,
            chunk_rows=rows,
            slot_numel=rows * (unsharded_size.numel() // max(dim_size, 1)),
            local_start=start,
            local_shape=torch.Size(local_shape),
            mesh=mesh,
            placements=placements,
            tp=tp,
            piece=piece,
        )

    @property
    def local_numel(self) -> int:
        return self.local_shape.numel()

    @property
    def chunk_shape(self) -> torch.Size:
        """The shard group's chunk on this rank: the local tensor, unless it is a
        piece of the chunk (sharded over replicas)."""
        return self.local_shape if self.piece is None else self.piece.chunk_shape

    @property
    def padded_unsharded_size(self) -> torch.Size:
        """Of the unsharded buffer the copy-out fills: ``world_size`` slots."""
        size = list(self.unsharded_size)
        size[self.shard_dim] = self.world_size * self.chunk_rows
        return torch.Size(size)

    def local_of(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor of ``data`` (unsharded-shaped) as a new
        contiguous tensor, so that ``data`` is not kept alive by it (and a shard
        on dim > 0 is laid out as its slot). A tensor subclass is cut and
        copied through its own ``chunk``, ``new_zeros`` and ``copy_``."""
        shard = _chunk(data, self.world_size, self.shard_dim, self.rank)
        if self.piece is not None:
            shard = shard.narrow(0, self.piece.start, self.piece.rows)
        if type(data) in (torch.Tensor, nn.Parameter):
            return shard.clone(memory_format=torch.contiguous_format)
        local = shard.new_zeros(shard.shape)
        local.copy_(shard)
        return local

    def rank_major(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        """``tensor`` (unsharded-shaped, padded for dim 0) seen as ``world_size``
        rows, row k holding rank k's slot: ``(W, slot)`` for dim 0, ``(W, pre,
        chunk, post)`` (a strided view) for a dim > 0. See [Note: the padded layout]."""
        if self.shard_dim == 0:
            return tensor.view(world_size, -1)
        size = self.unsharded_size
        pre, post = math.prod(size[: self.shard_dim]), math.prod(size[self.shard_dim + 1 :])
        return tensor.view(pre, world_size, -1, post).transpose(0, 1)


def _chunk(data: torch.Tensor, chunks: int, dim: int, index: int) -> torch.Tensor:
    """``torch.chunk(data, chunks, dim)[index]``, empty past the last chunk
    (like DTensor's)."""
    pieces = torch.chunk(data, chunks, dim) if data.size(dim) else (data,)
    if index < len(pieces):
        return pieces[index]
    return data.narrow(dim, data.size(dim), 0)


# One tuple object per distinct placements, shared by every parameter (and
# gradient) placed alike: clip.py asks whether thousands of gradients share
# their placements, and the same object answers without an ``__eq__`` each.
_INTERNED: dict[tuple[Placement, ...], tuple[Placement, ...]] = {}


def _sharded_placements(
    mesh_info: MeshInfo, tp: TPLayout | None, shard_dim: int, whole: bool, over_replicas: bool
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of the sharded parameter (see [Note: FSDP over
    tensor parallelism] and [Note: sharded over replicas])."""
    dp_placements = list(mesh_info.placements)
    dp_placements[-1] = Replicate() if whole else Shard(shard_dim)
    if over_replicas and not whole:  # chunked over the shard axis first
        dp_placements[0] = strided_shard(0, mesh_info.shard_world_size)
    if tp is None:
        return mesh_info.mesh, tuple(dp_placements)
    if (spmd := mesh_info.spmd) is not None:
        return _spmd_placements(spmd, tp, shard_dim, dp_placements[-1])
    tp_shards = math.prod(
        tp.mesh.size(axis)
        for axis, p in enumerate(tp.placements)
        if isinstance(p, Shard) and p.dim == shard_dim
    )
    if tp_shards > 1 and not whole:
        dp_placements[-1] = strided_shard(shard_dim, tp_shards)
    mesh = concatenate_meshes([mesh_info.mesh, tp.mesh])
    return mesh, (*dp_placements, *tp.placements)


def _spmd_placements(
    spmd: SpmdAxes, tp: TPLayout, dim: int, dp_placement: Placement
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """``dp_mesh_dims``: the parameter's own placements on the full mesh, its
    data-parallel shard axes (flattened into one) placed ``dp_placement``,
    or ``_StridedShard`` when axes after them shard the same dim (the data-
    parallel chunk is then a chunk of theirs), replicate axes ``Replicate()``."""
    placements = list(tp.placements)
    split = math.prod(  # the parameter's own placements: Shard or Replicate
        spmd.mesh.size(axis)
        for axis, p in enumerate(placements)
        if axis > spmd.shard[-1] and isinstance(p, Shard) and p.dim == dim
    )
    if split > 1 and isinstance(dp_placement, Shard):
        dp_placement = strided_shard(dim, split)
    placements[spmd.shard[0]] = dp_placement
    del placements[spmd.shard[0] + 1 : spmd.shard[-1] + 1]  # flattened into the first
    return spmd.sharded_mesh, tuple(placements)


def contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size``."""
    strides, running = [], 1
    for dim in reversed(size):
        strides.append(running)
        running *= dim
    return tuple(reversed(strides))


class CommParam(Protocol):
    """What the collectives read and write of one parameter: its layout, its
    sharded tensor and dtypes, its all-gather slots and inputs, and the
    shard-group sums a replica stage keeps. The engine's ``FSDPParam``
    (engine/param.py) is one; this layer names no class above it."""

    layout: ShardLayout
    sharded_param: nn.Parameter
    partial_grad: torch.Tensor | None  # written by the replica stage that keeps sums

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def reduce_dtype(self) -> torch.dtype: ...

    @property
    def offload(self) -> bool: ...

    @property
    def extension(self) -> object | None: ...  # a subclass's all-gather hooks, if any

    @property
    def all_gather_slots(self) -> list[tuple[int, torch.dtype]]: ...

    def all_gather_inputs(self) -> list[torch.Tensor]: ...
