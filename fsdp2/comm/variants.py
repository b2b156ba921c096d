"""The one place a param group's communication variants are chosen: from its
mesh, its parameters' layouts and its ``CommSettings`` (what ``fully_shard``
and the setters ask for), when the group is built and again whenever a
setting changes. The engine then calls the variants without asking which
they are.

| variant | chosen from | choices |
| --- | --- | --- |
| all-gather (all_gather.py) | compression, over replicas, custom all-gather | plain, int8, kept chunks (values or codes) |
| reduce-scatter (reduce_scatter.py) | compression, custom reduce-scatter, separate group | plain, all-to-all of compressed rows (``wire``) |
| replica stage (replica_stage.py) | mesh, over replicas, compression, ``requires_all_reduce`` | none, keep partial, all-reduce (plain or compressed), reduce-scatter across replicas (plain or compressed) |

A custom collective (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)
replaces the ``Collectives`` a variant holds (custom_comm.py), not the variant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from ..base.policy import CompressionPolicy
from .all_gather import AllGatherComm, Int8AllGather
from .compressed import GradientWire
from .context import REPLICA_ALL_GATHER
from .custom_comm import AllGather, ReduceScatter, WithCustomAllGather, WithCustomReduceScatter
from .layout import ShardLayout
from .mesh_info import MeshInfo
from .over_replicas import ChunkAllGather, KeptChunks, ReduceScatterAcrossReplicas
from .primitives import Collectives
from .reduce_scatter import ReduceScatterComm
from .replica_stage import AllReduceAcrossReplicas, KeepPartial, ReplicaStage


@dataclass(frozen=True)
class CommSettings:
    """What a group's variants are chosen from, besides its mesh and layouts."""

    compression: CompressionPolicy = CompressionPolicy()  # noqa: RUF009 (frozen)
    over_replicas: bool = False  # shard_optimizer_over_replicas
    custom_all_gather: AllGather | None = None
    custom_reduce_scatter: ReduceScatter | None = None
    # set_separate_reduce_scatter_group: a process group of the shard group's ranks.
    reduce_scatter_collectives: Collectives | None = None
    requires_all_reduce: bool = True  # HSDP: set_requires_all_reduce
    # For checks, not users (check_switches.py): a world of one issues its
    # collectives all the same.
    one_rank_collectives: bool = False

    def replace(self, **changes: object) -> CommSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class GroupComms(NamedTuple):
    all_gather: AllGatherComm  # of the sharded parameters, inside the shard group
    # reshard_after_forward=<int>: of the post-forward shard, inside the small group.
    post_forward_all_gather: AllGatherComm | None
    reduce_scatter: ReduceScatterComm
    replica_stage: ReplicaStage
    # Sharded over replicas: the chunks the all-gather reads, carried over when
    # the variants are chosen again.
    kept_chunks: KeptChunks | None


def choose_comms(
    mesh_info: MeshInfo,
    post_forward_mesh_info: MeshInfo | None,
    layouts: list[ShardLayout],
    settings: CommSettings,
    previous: GroupComms | None = None,
) -> GroupComms:
    """The variants of a group whose sharded parameters have ``layouts``;
    ``previous``: the variants chosen before, whose kept chunks carry over."""
    compression, forced = settings.compression, settings.one_rank_collectives
    world_size = mesh_info.shard_world_size
    exchanges = world_size > 1 or forced
    gathering = _with_custom_all_gather(mesh_info.shard_collectives, settings)
    kept_chunks = None
    if settings.over_replicas:
        kept_chunks = _kept_chunks(mesh_info, layouts, settings, exchanges, previous)
        all_gather: AllGatherComm = ChunkAllGather(
            gathering, mesh_info.shard_rank, world_size, exchanges, kept_chunks
        )
    elif compression.weights == "int8" and compression.across == "all" and exchanges:
        all_gather = Int8AllGather(
            gathering, mesh_info.shard_rank, world_size, exchanges, compression.block_size
        )
    else:
        all_gather = AllGatherComm(gathering, mesh_info.shard_rank, world_size, exchanges)
    post_forward = None
    if (small := post_forward_mesh_info) is not None:
        collectives = _with_custom_all_gather(small.shard_collectives, settings)
        post_forward = AllGatherComm(collectives, small.shard_rank, small.shard_world_size, True)
    return GroupComms(
        all_gather,
        post_forward,
        _reduce_scatter(mesh_info, settings, exchanges),
        _replica_stage(mesh_info, settings),
        kept_chunks,
    )


def _with_custom_all_gather(collectives: Collectives, settings: CommSettings) -> Collectives:
    if settings.custom_all_gather is None:
        return collectives
    return WithCustomAllGather(collectives, settings.custom_all_gather)


def _gradient_wire(compression: CompressionPolicy) -> GradientWire | None:
    if compression.gradients is None:
        return None
    return GradientWire(compression.gradients, compression.block_size)


def _reduce_scatter(
    mesh_info: MeshInfo, settings: CommSettings, exchanges: bool
) -> ReduceScatterComm:
    collectives = settings.reduce_scatter_collectives or mesh_info.shard_collectives
    compression, world_size = settings.compression, mesh_info.shard_world_size
    wire = _gradient_wire(compression)
    if wire is not None and compression.across == "all":
        if settings.custom_reduce_scatter is not None:
            raise ValueError(
                "set_custom_reduce_scatter is not supported with compressed gradients "
                f"(fully_shard(compression=CompressionPolicy(gradients={wire.setting!r}))): "
                "they travel by an all-to-all, not a reduce-scatter. Drop one of the two, or "
                "pass across='replicate' (HSDP) to keep the reduce-scatter uncompressed."
            )
        return ReduceScatterComm(collectives, world_size, exchanges, wire)
    if settings.custom_reduce_scatter is not None:
        collectives = WithCustomReduceScatter(collectives, settings.custom_reduce_scatter)
    return ReduceScatterComm(collectives, world_size, exchanges)


def _replica_stage(mesh_info: MeshInfo, settings: CommSettings) -> ReplicaStage:
    replicate = mesh_info.replicate_collectives
    wire = _gradient_wire(settings.compression)
    if replicate is None:
        return ReplicaStage()
    if not settings.requires_all_reduce:
        return KeepPartial()
    if settings.over_replicas:
        return ReduceScatterAcrossReplicas(replicate, wire)
    return AllReduceAcrossReplicas(replicate, wire)


def _kept_chunks(
    mesh_info: MeshInfo,
    layouts: list[ShardLayout],
    settings: CommSettings,
    exchanges: bool,
    previous: GroupComms | None,
) -> KeptChunks:
    """[Note: compression over replicas] in over_replicas.py: int8 pieces
    across the replicas only, codes kept for both all-gathers, or plain."""
    replicate = mesh_info.replicate_collectives
    if replicate is None:
        raise AssertionError("shard_optimizer_over_replicas without a replicate axis")
    compression = settings.compression
    replicas = mesh_info.replicate_world_size
    across_exchanges = replicas > 1 or settings.one_rank_collectives
    replica_rank = mesh_info.mesh.get_local_rank(0)
    int8 = compression.weights == "int8"
    if int8 and compression.across == "replicate" and across_exchanges:
        gather: AllGatherComm = Int8AllGather(
            replicate, replica_rank, replicas, True, compression.block_size, REPLICA_ALL_GATHER
        )
    else:
        gather = AllGatherComm(
            replicate, replica_rank, replicas, across_exchanges, REPLICA_ALL_GATHER
        )
    codes = int8 and compression.across == "all" and (across_exchanges or exchanges)
    chosen = KeptChunks(layouts, gather, compression.block_size if codes else None)
    kept = previous.kept_chunks if previous is not None else None
    return kept if kept is not None and kept.same_format(chosen) else chosen
