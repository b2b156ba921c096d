"""The collectives of a step, the links they cross and their time; the
compression table (1D FSDP, from the shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp2.comm.mesh_info import chunk_rows
from fsdp2.comm.wire import rows_wire_bytes

from .sizes import DTYPES, GroupSizes, ModelConfig, Setup, build_model


@dataclass(frozen=True)
class Links:
    """Bandwidth per GPU and direction, GB/s (1e9 bytes per second)."""

    intra_node_gbps: float = 450.0  # NVLink-class: H100 SXM's NVLink 4, 900 GB/s both ways
    inter_node_gbps: float = 50.0  # IB-class: one 400 Gb/s NIC (InfiniBand NDR) per GPU
    gpus_per_node: int = 8

    def of(self, ranks: range) -> tuple[str, float]:
        """The link a ring over ``ranks`` is bound by, and its GB/s."""
        if len({rank // self.gpus_per_node for rank in ranks}) == 1:
            return "intra-node", self.intra_node_gbps
        return "inter-node", self.inter_node_gbps


# -- communication ----------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One kind of collective, summed over a step's groups, on rank 0."""

    name: str  # comm_stats's: all_gather, reduce_scatter, all_reduce, replica_*
    axis: str  # "shard" or "replicate"
    ranks: int
    calls: int  # per step
    buffer_bytes: int  # per step: whole buffers, padded (comm_stats's bytes)

    @property
    def sent_bytes(self) -> int:
        """What this rank sends (and receives) of the buffers on a ring."""
        hops = 2 * (self.ranks - 1) if self.name == "all_reduce" else self.ranks - 1
        return self.buffer_bytes * hops // self.ranks

    def seconds(self, gbps: float) -> float:
        return self.sent_bytes / (gbps * 1e9)


def collectives(groups: list[GroupSizes], setup: Setup) -> list[Collective]:
    """The collectives of one step (see the module docstring); none over one rank."""
    param = DTYPES[setup.param_dtype].itemsize
    reduce = DTYPES[setup.reduce_dtype].itemsize
    shards, replicas = setup.shards, setup.replicas
    slots = sum(g.shard_slots for g in groups)
    gathered = sum(g.shard_slots * (1 if g.root else 2) for g in groups)
    blocks = sum(not g.root for g in groups)
    out = []
    if shards > 1:
        out.append(
            Collective(
                "all_gather", "shard", shards, len(groups) + blocks, shards * gathered * param
            )
        )
        out.append(
            Collective("reduce_scatter", "shard", shards, len(groups), shards * slots * reduce)
        )
    if replicas > 1 and not setup.shard_optimizer_over_replicas:
        out.append(Collective("all_reduce", "replicate", replicas, len(groups), slots * reduce))
    elif replicas > 1:
        pieces = sum(g.replica_slots for g in groups)
        out.append(
            Collective(
                "replica_reduce_scatter",
                "replicate",
                replicas,
                len(groups),
                replicas * pieces * reduce,
            )
        )
        out.append(
            Collective(
                "replica_all_gather", "replicate", replicas, len(groups), replicas * pieces * param
            )
        )
    return out


@dataclass(frozen=True)
class Priced:
    collective: Collective
    link: str  # "intra-node" or "inter-node"
    gbps: float
    seconds: float


def price(colls: list[Collective], setup: Setup, links: Links) -> list[Priced]:
    """Each collective at the bandwidth of the link its group crosses."""
    priced = []
    for c in colls:
        link, gbps = links.of(setup.ranks(c.axis))
        priced.append(Priced(c, link, gbps, c.seconds(gbps)))
    return priced


# -- compression (1D FSDP, from the shapes) ---------------------------------------------

# CompressionPolicy settings compared: (weights, gradients).
COMPRESSION_SETTINGS = {
    "off": (None, None),
    "weights int8": ("int8", None),
    "gradients bf16": (None, "bf16"),
    "gradients int8": (None, "int8"),
    "both int8": ("int8", "int8"),
}


def group_shapes(model: nn.Module) -> list[list[torch.Size]]:
    """The parameter shapes of each group of the sharding above (one group per
    block of ``model.layers``, then the root with the rest), root first."""
    block_params = {id(p) for block in model.layers for p in block.parameters()}
    root = [p.shape for p in model.parameters() if id(p) not in block_params]
    return [root, *([p.shape for p in block.parameters()] for block in model.layers)]


def _slot_numels(shapes: list[torch.Size], world_size: int) -> list[int]:
    """Each parameter's padded slot (``ShardLayout.slot_numel``, dim 0)."""
    return [chunk_rows(s[0], world_size) * (s.numel() // max(s[0], 1)) for s in shapes]


def wire_bytes(
    groups: list[list[torch.Size]],
    world_size: int,
    weights: str | None = None,
    gradients: str | None = None,
    block_size: int = 256,
    itemsize: int = 4,
    reduce_itemsize: int | None = None,
) -> tuple[int, int]:
    """Per step and rank, the buffers ``comm_stats`` counts (whole): the
    all-gathers (the root once, the other groups in forward and in backward)
    in ``itemsize`` (the param dtype's) and the gradient reductions in
    ``reduce_itemsize`` (the reduce dtype's; default ``itemsize``), or as the
    compression setting sends them."""
    reduce_itemsize = itemsize if reduce_itemsize is None else reduce_itemsize
    all_gather = reduce = 0
    for i, shapes in enumerate(groups):
        slots = _slot_numels(shapes, world_size)
        if not sum(slots):
            continue
        if weights == "int8":
            gathered = world_size * rows_wire_bytes(slots, block_size)
        else:
            gathered = world_size * sum(slots) * itemsize
        all_gather += gathered * (1 if i == 0 else 2)
        if gradients == "bf16":
            reduce += world_size * sum(slots) * 2
        elif gradients == "int8":
            reduce += world_size * rows_wire_bytes(slots, block_size)
        else:
            reduce += world_size * sum(slots) * reduce_itemsize
    return all_gather, reduce


def compression_table(
    config: ModelConfig,
    world_sizes: list[int],
    links: Links,
    param_dtype: str = "bf16",
    reduce_dtype: str = "fp32",
) -> list[dict[str, object]]:
    """Per world size (1D FSDP) and setting: buffers and seconds per step."""
    groups = group_shapes(build_model(config))
    rows = []
    for world_size in world_sizes:
        link, gbps = links.of(range(world_size))
        for name, (weights, gradients) in COMPRESSION_SETTINGS.items():
            ag, rs = wire_bytes(
                groups,
                world_size,
                weights,
                gradients,
                itemsize=DTYPES[param_dtype].itemsize,
                reduce_itemsize=DTYPES[reduce_dtype].itemsize,
            )
            sent = (ag + rs) * (world_size - 1) / world_size
            rows.append(
                {
                    "world_size": world_size,
                    "setting": name,
                    "all_gather_bytes": ag,
                    "reduce_bytes": rs,
                    "link": link,
                    "comm_s": sent / (gbps * 1e9),
                }
            )
    return rows
