"""Where a parameter is sharded: ``shard_placement_fn``'s results, resolved
into one ``MeshInfo`` per mesh (each mesh's parameters form a group of their
own, see [Note: groups of one call])."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .common import MeshInfo


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
