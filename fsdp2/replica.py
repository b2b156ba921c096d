"""``shard_optimizer_over_replicas``: HSDP whose sharded parameters are split
again across the replicas.

[Note: sharded over replicas]
On a 2D mesh ``(replicate=R, shard=S)`` the rank at ``(r, s)`` holds, as its
sharded parameter (what the optimizer, ``clip_grad_norm_`` and state dicts
see), ``torch.chunk(torch.chunk(param, S)[s], R)[r]``: a piece of its shard
group's chunk, 1/(R*S) of the parameter. DTensor calls that layout
``(_StridedShard(0, split_factor=S), Shard(0))``: "chunk over S first, then
each chunk over R", as FSDP over tensor parallelism does. For uneven dims
torch's ``_StridedShard`` places rows like nested ``torch.chunk`` only for
some sizes (for R = 2 every size checked, up to 3000 rows and S = 32; not
e.g. 7 rows on R=3 x S=2 or 9 rows on R=4 x S=2):
``strided_layout_matches`` tells, and ``fully_shard`` refuses the others.

Besides its piece a rank keeps its shard group's chunk in ``param_dtype``
(``ReplicaShard.all_gather_input``), the input of the all-gather inside the
shard group. It is rebuilt by one all-gather across the replicas, batched
for a group's parameters, when a piece changed since it was last built: the
piece was stepped by an optimizer (a global step post-hook: a ``foreach``
step on DTensors bumps no version counter), its version counters (the
DTensor's and its local tensor's: other in-place updates, ``load_state_dict``,
``copy_``) or the piece itself (a new tensor adopted) differ. Every replica runs the same program, so all of them see the same
pieces change and issue the same all-gathers. Backward reduce-scatters
inside the shard group as plain HSDP does, then reduce-scatters the result
across the replicas (instead of all-reducing it) onto the pieces.

Slots: in the buffers across replicas a parameter's slot is ``piece_rows *
row_numel`` elements on every rank of a replica group (``piece_rows =
ceil(chunk rows / R)``; the chunk has the same rows on every rank of a
replica group), padded like [Note: the padded layout] in param.py.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .collectives import ReduceInFlight, all_gather, all_gather_dtype, copy_out
from .comm import CommContext
from .common import MeshInfo, chunk_rows, eager_hook
from .primitives import Collectives
from .private_api import chunk_cat_, local_tensor

if TYPE_CHECKING:
    from .param import FSDPParam


# On a sharded parameter split across replicas: its ReplicaShard.
REPLICA = "_fsdp2_replica"


@functools.cache
def install_step_hook() -> Any:
    """Registers :func:`pieces_stepped` for every optimizer, once per process."""
    return register_optimizer_step_post_hook(pieces_stepped)


@eager_hook
def pieces_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global optimizer step post-hook: the pieces an optimizer stepped are
    changed. Version counters miss it: a ``foreach`` step on DTensors (the
    default on accelerators) bumps neither the DTensor's nor its local tensor's."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if (replica := param.__dict__.get(REPLICA)) is not None:
                replica.stepped = True


class ReplicaShard:
    """Where one parameter's piece sits in its shard group's chunk, and the
    chunk kept as the all-gather input (see [Note: sharded over replicas])."""

    def __init__(self, chunk_shape: torch.Size, replicas: int, replica_rank: int) -> None:
        self.chunk_shape = chunk_shape  # the shard group's chunk (dim 0 sharded)
        self.row_numel = chunk_shape[1:].numel()
        rows = chunk_shape[0]
        self.piece_rows = chunk_rows(rows, replicas)
        self.slot_numel = self.piece_rows * self.row_numel  # per replica, padded
        self.start = min(replica_rank * self.piece_rows, rows)  # in the chunk
        self.rows = min(self.piece_rows, rows - self.start)
        # 1D, replicas * slot_numel, param_dtype: the chunk, then padding.
        self.all_gather_input: torch.Tensor | None = None
        # What it was built from: the sharded parameter, its local tensor and their
        # version counters (an in-place op on the DTensor bumps the DTensor's only).
        self._built_from: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
        self.stepped = False  # by an optimizer since it was built (pieces_stepped)

    def piece_of(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk.narrow(0, self.start, self.rows)

    def stale(self, param: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the piece changed (or the dtype) since the chunk was built."""
        if self.stepped or self.all_gather_input is None or self.all_gather_input.dtype != dtype:
            return True
        built = self._built_from
        piece = local_tensor(param)
        return (
            built is None
            or built[0] is not param
            or built[1] is not piece
            or built[2:] != (param._version, piece._version)
        )

    def built_from(self, param: torch.Tensor) -> None:
        piece = local_tensor(param)
        self._built_from = (param, piece, param._version, piece._version)
        self.stepped = False

    def mark(self, param: torch.Tensor) -> None:
        """``param`` is the sharded parameter holding this piece."""
        param.__dict__[REPLICA] = self
        install_step_hook()

    def chunk(self) -> torch.Tensor:
        """The shard group's chunk, flat, for the all-gather inside the group."""
        if self.all_gather_input is None:
            raise AssertionError("the replica all-gather input was never built")
        return self.all_gather_input.narrow(0, 0, self.chunk_shape.numel())

    def drop(self) -> None:
        self.all_gather_input = None
        self._built_from = None


@torch.no_grad()
def refresh_all_gather_inputs(
    fsdp_params: list[FSDPParam], info: MeshInfo, comm: CommContext, group_name: str
) -> None:
    """Rebuilds the chunks of the parameters whose pieces changed with one
    all-gather across the replicas (nothing when none did)."""
    stale = [
        p
        for p in fsdp_params
        if (replica := p.replica) is not None and replica.stale(p.sharded_param, p.param_dtype)
    ]
    collectives = info.replicate_collectives
    if not stale or collectives is None:
        return
    pieces = [local_tensor(p.sharded_param) for p in stale]
    if any(piece.is_meta for piece in pieces):
        return  # not materialized yet: rebuilt once it is
    slots = [(_replica(p).slot_numel, p.param_dtype) for p in stale]
    device = comm.device
    outputs = []
    for p in stale:
        replica = _replica(p)
        if replica.all_gather_input is None or replica.all_gather_input.dtype != p.param_dtype:
            replica.all_gather_input = torch.empty(
                info.replicate_world_size * replica.slot_numel, dtype=p.param_dtype, device=device
            )
        outputs.append(replica.all_gather_input.view(info.replicate_world_size, -1))
        replica.built_from(p.sharded_param)
    # Every chunk of this shard group empty (the same on its whole replica group).
    if sum(numel for numel, _ in slots) > 0:
        inputs = [piece.to(device, non_blocking=comm.uses_streams).view(-1) for piece in pieces]
        gathered = all_gather(
            inputs,
            slots,
            all_gather_dtype([dtype for _, dtype in slots]),
            collectives,
            _replica_rank(info),
            info.replicate_world_size,
            comm,
            group_name,
            kind="replica_all_gather",
        )
        gathered.in_flight.wait()
        copy_out(gathered, outputs)


@torch.no_grad()
def reduce_scatter_across_replicas(
    reduced: ReduceInFlight, info: MeshInfo, comm: CommContext, group_name: str
) -> ReduceInFlight:
    """Starts reducing a finished reduce-scatter's output (the shard group's
    chunks, then the replicated parameters' whole gradients) across the
    replicas with its plan's op: the chunks reduce-scattered onto the pieces,
    the whole gradients all-reduced."""
    collectives = _collectives(info)
    replicas, op = info.replicate_world_size, reduced.plan.all_reduce_op
    sharded = [p for p in reduced.fsdp_params if p.replica is not None]
    replicated = [p for p in reduced.fsdp_params if p.replica is None]
    slots = reduced.output.split_with_sizes([p.padded_shard_numel for p in reduced.fsdp_params])
    chunks = [
        slot[: _replica(p).chunk_shape.numel()].view(_replica(p).chunk_shape)
        for p, slot in zip(sharded, slots[: len(sharded)], strict=True)
    ]
    # The same on every rank of a replica group (one chunk of the shard group).
    shard_numel = sum(_replica(p).slot_numel for p in sharded)
    tail = torch.cat([slot.view(-1) for slot in slots[len(sharded) :]]) if replicated else None
    output = reduced.output.new_empty(shard_numel + (tail.numel() if tail is not None else 0))
    reduce_scatter_input = output.new_empty(replicas, shard_numel)
    nonempty = [c for c in chunks if c.numel() > 0]
    if nonempty:
        chunk_cat_(nonempty, replicas, out=reduce_scatter_input)
    in_flight = []
    if shard_numel > 0:  # every chunk of this shard group empty: nothing to exchange
        in_flight.append(
            comm.issue(
                "replica_reduce_scatter",
                group_name,
                reduce_scatter_input.numel() * reduce_scatter_input.element_size(),
                lambda async_op: collectives.reduce_scatter(
                    output.narrow(0, 0, shard_numel), reduce_scatter_input.view(-1), op, async_op
                ),
                stream="all_reduce",  # where plain HSDP's all-reduce across replicas runs
            )
        )
    if tail is not None:
        whole = output.narrow(0, shard_numel, tail.numel())
        whole.copy_(tail)
        in_flight.append(
            comm.issue(
                "all_reduce",
                group_name,
                whole.numel() * whole.element_size(),
                lambda async_op: collectives.all_reduce(whole, op, async_op),
            )
        )
    return reduced._replace(
        fsdp_params=sharded + replicated,
        buffers=(reduce_scatter_input,),
        output=output,
        in_flight=tuple(in_flight),
        across_replicas=True,
    )


def _collectives(info: MeshInfo) -> Collectives:
    if info.replicate_collectives is None:
        raise AssertionError("shard_optimizer_over_replicas without a replicate axis")
    return info.replicate_collectives


def _replica_rank(info: MeshInfo) -> int:
    return info.mesh.get_local_rank(0)


def _replica(p: FSDPParam) -> ReplicaShard:
    if p.replica is None:
        raise AssertionError(f"{p.fqn!r} is not sharded over replicas")
    return p.replica
