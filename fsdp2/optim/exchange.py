"""The owner exchange: row blocks of each matrix's update go to its owner, which
orthogonalizes the whole matrix, and the row blocks of the result come back.

One ``all_to_all_single`` each way per shard group and step, whatever the number
of matrices. Both directions carry bfloat16, Newton-Schulz's own input and
output dtype, so casting before sending changes no bit of the result.
See docs/design.md, "Muon: owners and the exchange".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base.private_dist import shards_tensor
from ..comm.primitives import collectives_for
from ..comm.timeouts import naming_failures
from .newton_schulz import orthogonalize
from .owners import assign_owners, newton_schulz_cost

WIRE_DTYPE = torch.bfloat16


class ShardGroup(NamedTuple):
    """The ranks holding the row blocks of a sharded parameter (one mesh axis)."""

    process_group: dist.ProcessGroup | None  # None: a group of one, nothing to exchange
    rank: int  # this rank's index on the axis
    size: int


class NewtonSchulzArgs(NamedTuple):
    coefficients: tuple[float, float, float]
    steps: int
    eps: float


def shard_group_of(param: DTensor, name: str = "parameter") -> ShardGroup:
    """The shard group of a parameter sharded on dim 0 along one mesh axis (FSDP,
    or HSDP's shard axis with replicas elsewhere); a clear error otherwise."""
    shard_axes = []
    if any(shards_tensor(p) and type(p) is not Shard for p in param.placements):
        raise ValueError(
            f"fsdp2.optim.Muon supports parameters sharded along one mesh axis, but {name} is "
            f"placed {tuple(param.placements)}: chunks of chunks, split along two axes, as "
            "fully_shard(shard_optimizer_over_replicas=True) (or FSDP over tensor parallelism) "
            "places them. Shard that model with plain HSDP (leave the option off) to use Muon, "
            "or optimize it with torch.optim.Muon."
        )
    for axis, placement in enumerate(param.placements):
        if type(placement) is Shard and placement.dim == 0:
            shard_axes.append(axis)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"fsdp2.optim.Muon supports parameters sharded on dim 0 along one mesh axis "
                f"(FSDP's and HSDP's Shard(0)), but {name} has placements "
                f"{tuple(param.placements)} on mesh {param.device_mesh}. Shard it on dim 0 "
                "(the default shard_placement_fn) and without tensor parallelism, or "
                "optimize it with torch.optim.Muon."
            )
    if len(shard_axes) > 1:
        raise ValueError(
            f"fsdp2.optim.Muon supports a parameter sharded along one mesh axis, but {name} "
            f"is sharded on dim 0 along axes {shard_axes} of {param.device_mesh}."
        )
    if not shard_axes:  # replicated only: every rank holds the whole matrix
        return ShardGroup(None, 0, 1)
    axis = shard_axes[0]
    mesh = param.device_mesh
    return ShardGroup(mesh.get_group(axis), mesh.get_local_rank(axis), mesh.size(axis))


def rows_per_rank(rows: int, num_chunks: int) -> list[int]:
    """Rows of each rank's block under ``torch.chunk`` (Shard(0)'s split); the
    last blocks may be short or empty."""
    per_chunk = -(-rows // num_chunks)
    return [max(0, min(per_chunk, rows - r * per_chunk)) for r in range(num_chunks)]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=WIRE_DTYPE)


def orthogonalize_row_blocks(
    blocks: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    ns_args: Sequence[NewtonSchulzArgs],
    shard_group: ShardGroup,
) -> list[torch.Tensor]:
    """Newton-Schulz of whole matrices, given and returned as this rank's row blocks.

    Args:
        blocks: this rank's rows of each matrix's update (any float dtype).
        shapes: each matrix's global (rows, cols), the same on every rank.
        ns_args: each matrix's Newton-Schulz arguments (from its param group).
        shard_group: the ranks that hold the other row blocks.

    Returns:
        This rank's rows of each orthogonalized matrix (bfloat16, contiguous).
    """
    me, size = shard_group.rank, shard_group.size
    if size == 1 or shard_group.process_group is None:
        return [orthogonalize(b, *a) for b, a in zip(blocks, ns_args, strict=True)]
    owners = assign_owners([newton_schulz_cost(s) for s in shapes], size)
    rows = [rows_per_rank(s[0], size) for s in shapes]
    numel = [[r * s[1] for r in rs] for rs, s in zip(rows, shapes, strict=True)]
    owned = [i for i, owner in enumerate(owners) if owner == me]

    # Out: to each owner in rank order, this rank's block of each matrix it owns.
    by_owner: list[list[int]] = [[] for _ in range(size)]
    for i, owner in enumerate(owners):
        by_owner[owner].append(i)
    send = _cat([blocks[i].to(WIRE_DTYPE).reshape(-1) for d in range(size) for i in by_owner[d]])
    send_splits = [sum(numel[i][me] for i in by_owner[d]) for d in range(size)]
    recv_splits = [sum(numel[i][s] for i in owned) for s in range(size)]
    recv = send.new_empty(sum(recv_splits))  # 1D: from each rank, its blocks of my matrices
    group = collectives_for(shard_group.process_group, send.device.type, "shard group")
    what = f"Muon's all-to-all of {len(shapes)} matrices' row blocks"
    with naming_failures(f"{what} to their owners", group):
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group.process_group)

    from_rank = [
        seg.split([numel[i][s] for i in owned]) for s, seg in enumerate(recv.split(recv_splits))
    ]
    results = {}
    for k, i in enumerate(owned):
        cols = shapes[i][1]
        full = torch.cat([from_rank[s][k].view(rows[i][s], cols) for s in range(size)])
        results[i] = orthogonalize(full, *ns_args[i])
    # The peak is the way back's: the results, send_back and back (docs/design.md).
    del send, recv, from_rank

    # Back: to each rank in rank order, its rows of each matrix this rank owns.
    starts = [[sum(rs[:r]) for r in range(size)] for rs in rows]
    send_back = _cat(
        [
            results[i][starts[i][d] : starts[i][d] + rows[i][d]].reshape(-1)
            for d in range(size)
            for i in owned
        ]
    )
    back_splits = [sum(numel[i][me] for i in by_owner[s]) for s in range(size)]
    back = send_back.new_empty(sum(back_splits))
    with naming_failures(f"{what} back from their owners", group):
        dist.all_to_all_single(back, send_back, back_splits, recv_splits, group=group.process_group)

    out: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
    for s, seg in enumerate(back.split(back_splits)):
        for i, block in zip(
            by_owner[s], seg.split([numel[i][me] for i in by_owner[s]]), strict=True
        ):
            out[i] = block.view(rows[i][me], shapes[i][1])
    return out
