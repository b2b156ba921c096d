"""A group's mesh as the collectives see it (``MeshInfo``: the shard and
replicate axes, their process groups and collectives), and the arithmetic of
cutting rows into chunks."""

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from .primitives import Collectives, collectives_for


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel axes of a mesh, resolved once: the axis parameters are
    sharded over and, for HSDP, the axis they are replicated over."""

    mesh: DeviceMesh
    shard_axis: int
    shard_group: dist.ProcessGroup
    shard_world_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None = None  # HSDP only
    replicate_world_size: int = 1
    # dp_mesh_dims: the full mesh the parameters live on, and which of its axes
    # are the data-parallel ones this info describes (see mesh.py).
    spmd: "SpmdAxes | None" = None
    shard_role: str = "shard group"  # for messages: the post-forward group's differs

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> "MeshInfo":
        """1D: shard over it. 2D (HSDP): replicate over axis 0, shard over axis 1."""
        shard_axis = mesh.ndim - 1
        replicate = mesh.ndim == 2
        return cls(
            mesh=mesh,
            shard_axis=shard_axis,
            shard_group=mesh.get_group(shard_axis),
            shard_world_size=mesh.size(shard_axis),
            shard_rank=mesh.get_local_rank(shard_axis),
            replicate_group=mesh.get_group(0) if replicate else None,
            replicate_world_size=mesh.size(0) if replicate else 1,
        )

    @functools.cached_property
    def shard_collectives(self) -> Collectives:
        return collectives_for(self.shard_group, self.mesh.device_type, self.shard_role)

    @functools.cached_property
    def replicate_collectives(self) -> Collectives | None:
        if self.replicate_group is None:
            return None
        return collectives_for(self.replicate_group, self.mesh.device_type, "replicate group")

    def process_groups(self) -> list[tuple[str, dist.ProcessGroup]]:
        """Every group of these axes, and of the other axes of the meshes the
        parameters live on (``clip_grad_norm_`` reduces over those), by role."""
        groups = [(self.shard_role, self.shard_group)]
        if self.replicate_group is not None:
            groups.append(("replicate group", self.replicate_group))
        meshes = [self.mesh] if self.spmd is None else [self.spmd.mesh, self.spmd.sharded_mesh]
        for mesh in meshes:
            names = mesh.mesh_dim_names or tuple(str(axis) for axis in range(mesh.ndim))
            for name, group in zip(names, mesh.get_all_groups(), strict=True):
                groups.append((f"group of mesh axis {name!r}", group))
        return groups

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Of the sharded parameters and gradients."""
        if self.replicate_group is None:
            return (Shard(0),)
        return (Replicate(), Shard(0))


@dataclass(frozen=True)
class SpmdAxes:
    """``fully_shard(mesh, dp_mesh_dims=...)``: parameters are DTensors on
    ``mesh`` (all its axes, e.g. dp and tp), ``Replicate()`` on the
    data-parallel axes, which fsdp2 then shards (``shard``, several flattened
    into one) and replicates over (``replicate``, HSDP)."""

    mesh: DeviceMesh
    shard: tuple[int, ...]  # mesh axes, in mesh order
    replicate: tuple[int, ...]
    # The mesh the sharded parameters live on: ``mesh`` with the shard axes
    # flattened into one (itself when there is one shard axis).
    sharded_mesh: DeviceMesh

    @property
    def data_parallel(self) -> frozenset[int]:
        return frozenset(self.shard + self.replicate)


def chunk_rows(dim0: int, world_size: int) -> int:
    """Rows per rank in the padded layout: ``torch.chunk``'s chunk size."""
    return math.ceil(dim0 / world_size) if dim0 > 0 else 0


def chunk_sizes(rows: int, chunks: int) -> list[int]:
    """Rows of each of ``chunks`` chunks under ``torch.chunk`` (0 past the last)."""
    size = chunk_rows(rows, chunks)
    return [max(0, min(size, rows - i * size)) for i in range(chunks)]


def strided_layout_matches(rows: int, replicas: int, shards: int) -> bool:
    """Whether ``(_StridedShard(0, split_factor=shards), Shard(0))`` on a
    ``(replicas, shards)`` mesh places a dim of ``rows`` like nested
    ``torch.chunk`` (over ``shards``, then each chunk over ``replicas``).
    DTensor splits into ``shards`` chunks, each into ``replicas``, joins the
    r-th pieces of all chunks and chunks that over ``shards`` again: the same
    rows exactly when each join re-chunks into its own pieces."""
    pieces = [chunk_sizes(n, replicas) for n in chunk_sizes(rows, shards)]
    for r in range(replicas):
        mine = [pieces[s][r] for s in range(shards)]
        if chunk_sizes(sum(mine), shards) != mine:
            return False
    return True


def device_from_mesh(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def post_forward_mesh_info(mesh: DeviceMesh, group_size: int) -> MeshInfo:
    """The groups of ``group_size`` consecutive ranks of ``mesh``, for resharding
    after forward to a smaller world (every rank builds every group)."""
    ranks = mesh.mesh.view(-1, group_size)
    small_mesh = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("outer", "post_forward"))
    return MeshInfo(
        mesh=small_mesh,
        shard_axis=1,
        shard_group=small_mesh.get_group(1),
        shard_world_size=group_size,
        shard_rank=small_mesh.get_local_rank(1),
        shard_role="post-forward group",
    )


def shard_axis(mesh: DeviceMesh) -> DeviceMesh:
    """The 1D mesh of the shard axis (the last) of a FSDP or HSDP mesh."""
    if mesh.ndim == 1:
        return mesh
    if mesh.mesh_dim_names is None:  # fully_shard refuses a 2D mesh without names
        raise AssertionError(f"an HSDP mesh without axis names: {mesh}")
    return mesh[mesh.mesh_dim_names[-1]]
