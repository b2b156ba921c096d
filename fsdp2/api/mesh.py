"""Where parameters are sharded: the mesh passed to ``fully_shard`` (or the
default one), ``dp_mesh_dims`` (the data-parallel axes of a full SPMD mesh)
and ``shard_placement_fn``'s results, resolved into one ``MeshInfo`` per mesh
(each mesh's parameters form a group of their own)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from ..base.private_dist import concatenate_meshes, flatten_axes
from ..comm.mesh_info import MeshInfo, SpmdAxes


def resolve_mesh(mesh: DeviceMesh | None, full_spmd_mesh: bool = False) -> DeviceMesh:
    """``mesh`` checked (or the default); with ``dp_mesh_dims`` (``full_spmd_mesh``)
    it may have any number of axes."""
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "fully_shard(mesh=None) builds a mesh over the default process group, but "
                "torch.distributed is not initialised. Call "
                "torch.distributed.init_process_group() first, or pass mesh=..."
            )
        # Runtime check too: a CUDA build on a host without a GPU shards on the CPU.
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        device_type = accelerator.type if accelerator is not None else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}. Build "
            "one with torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))."
        )
    if full_spmd_mesh:
        return mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}, {mesh.ndim}D with shape "
            f"{tuple(mesh.shape)}: 1D shards over it (FSDP), 2D replicates over axis 0 and "
            "shards over axis 1 (HSDP). Pass the data-parallel sub-mesh, e.g. mesh['dp'] or "
            "mesh['dp_replicate', 'dp_shard']."
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        # AssertionError, as torch's fully_shard raises for this.
        raise AssertionError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
            "init_device_mesh(device_type, (replicas, shards), mesh_dim_names=('replicate', "
            "'shard')): the names say which axis replicates and which shards."
        )
    names = mesh.mesh_dim_names
    if names is not None and len(names) == 2 and _named_backwards(names):
        first, second = names
        warnings.warn(
            f"fully_shard: the 2D mesh's axes are named ({first!r}, {second!r}), but a 2D "
            "mesh is taken by position: axis 0 replicates and axis 1 shards, so parameters "
            f"are replicated over {first!r} and sharded over {second!r}. If that is not "
            f"what you meant, pass mesh[{second!r}, {first!r}] (replicate first, then shard).",
            stacklevel=3,
        )
    return mesh


def _named_backwards(names: tuple[str, ...]) -> bool:
    """Whether a 2D mesh's names say shard first and replicate second."""
    first, second = (name.lower() for name in names)
    return "shard" in first and "replicate" not in first and "replicate" in second


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Names the data-parallel axes of the full mesh passed to ``fully_shard``
    when the parameters are already DTensors on all of it (e.g. TP on ``"tp"``
    and ``Replicate()`` on ``"dp"``): fsdp2 shards them over ``shard`` and, for
    HSDP, replicates them over ``replicate``. Several names of one kind are
    flattened into one axis.

    Args:
        shard: the axis name(s) to shard over.
        replicate: the axis name(s) to replicate over (HSDP). (Default: None)
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims, e.g. "
                "DataParallelMeshDims(shard='dp')."
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def spmd_mesh_info(mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
    """The data-parallel axes of ``mesh`` named by ``dims``, as the ``MeshInfo``
    of a 1D (FSDP) or 2D (HSDP) mesh over them, with the full mesh kept."""
    if type(dims).__name__ == "DataParallelMeshDims" and type(dims).__module__.startswith(
        "torch.distributed.fsdp"
    ):  # torch's own, field for field
        dims = DataParallelMeshDims(shard=dims.shard, replicate=dims.replicate)
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(
            f"dp_mesh_dims must be an fsdp2.DataParallelMeshDims, got {type(dims).__name__}."
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided: build it with "
            "init_device_mesh(..., mesh_dim_names=(...)) and name the axes in dp_mesh_dims."
        )
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(
                f"Mesh dim name {name!r} not found in mesh.mesh_dim_names {names}; "
                "dp_mesh_dims names the mesh's data-parallel axes."
            )
    if not dims.shard_names:
        raise NotImplementedError(
            "dp_mesh_dims with replicate axes only (DDP) is not supported by fsdp2: name the "
            "axes to shard over too, or use torch's replicate() for pure data parallelism."
        )
    shard = tuple(sorted(names.index(n) for n in dims.shard_names))
    if shard != tuple(range(shard[0], shard[0] + len(shard))):
        raise ValueError(
            f"dp_mesh_dims.shard {dims.shard_names} must be adjacent axes of the mesh "
            f"{names}: they are flattened into one."
        )
    replicate = tuple(sorted(names.index(n) for n in dims.replicate_names))
    shard_mesh = _one_axis(mesh, dims.shard_names)
    sharded_mesh = mesh
    if len(shard) > 1:  # the sharded parameters live on the mesh with those axes as one
        axes = [mesh[names[i]] for i in range(shard[0])]
        axes += [shard_mesh] + [mesh[names[i]] for i in range(shard[-1] + 1, mesh.ndim)]
        sharded_mesh = concatenate_meshes(axes)
    dp_mesh = shard_mesh
    if replicate:
        dp_mesh = concatenate_meshes([_one_axis(mesh, dims.replicate_names), shard_mesh])
    spmd = SpmdAxes(mesh, shard, replicate, sharded_mesh)
    return dataclasses.replace(MeshInfo.from_mesh(dp_mesh), spmd=spmd)


def _one_axis(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    return mesh[names[0]] if len(names) == 1 else flatten_axes(mesh, names)


@dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to shard a parameter over another
    mesh than the one passed to ``fully_shard`` (e.g. MoE experts on an
    expert-parallel mesh), possibly on another dim.

    Args:
        placement: ``Shard(dim)``, or None for ``Shard(0)``.
        mesh: a 1D mesh (FSDP) or a 2D ``(replicate, shard)`` one (HSDP), like
            ``fully_shard``'s ``mesh``.
    """

    placement: Shard | None
    mesh: DeviceMesh


class MeshInfos:
    """One ``MeshInfo`` per distinct mesh of a ``fully_shard`` call, the call's
    own first, so that the parameters of one mesh share one object (and group)."""

    def __init__(self, default: MeshInfo) -> None:
        self.default = default
        self._by_groups: dict[tuple[int, int], MeshInfo] = {self._key(default): default}

    @staticmethod
    def _key(info: MeshInfo) -> tuple[int, int]:
        # Meshes over the same process groups shard alike: one group for both.
        return id(info.shard_group), id(info.replicate_group)

    def of(self, mesh: DeviceMesh) -> MeshInfo:
        info = MeshInfo.from_mesh(mesh)
        return self._by_groups.setdefault(self._key(info), info)
