"""``shard_optimizer_over_replicas``: the two collectives across the replicas
and the chunks a rank keeps between them (see [Note: sharded over replicas]
in layout.py for the layout of the pieces).

A rank keeps, per parameter, its shard group's chunk (``KeptChunks``), the
input of the all-gather inside the shard group (``ChunkAllGather``). The
chunk is rebuilt by one all-gather across the replicas, batched for a
group's parameters, when a piece changed since it was last built: the piece
was stepped by an optimizer (optimizer_hooks.py's post-step hook: a
``foreach`` step on DTensors bumps no version counter), its version counters (the DTensor's and
its local tensor's: other in-place updates, ``load_state_dict``, ``copy_``)
or the piece itself (a new tensor adopted) differ. Every replica runs the
same program, so all of them see the same pieces change and issue the same
all-gathers. Backward reduce-scatters inside the shard group as plain HSDP
does, then reduce-scatters the result across the replicas onto the pieces
(``ReduceScatterAcrossReplicas``, instead of an all-reduce).

[Note: compression over replicas]
Weights are rounded once, on the links ``CompressionPolicy.across`` names:

- ``across="replicate"``: the all-gather across replicas moves int8 pieces
  (``Int8AllGather``), dequantized into the kept chunks (``param_dtype``);
  the all-gather inside the shard group moves the chunks as they are.
- ``across="all"``: each piece is quantized once, after it changed; the
  all-gather across replicas moves its codes, the rank keeps them (*codes*:
  a quarter of an fp32 chunk), and the all-gather inside the shard group
  moves them again; the copy-out dequantizes every piece into the unsharded
  parameter. Nothing is quantized twice.

Gradients: the reduce-scatter across replicas becomes an all-to-all of
compressed rows summed in fp32 (compressed.py's ``exchange``), the whole
parameters' all-reduce a compressed one; the reduce-scatter inside the
shard group is compressed too with ``across="all"``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard

from ..base.markers import KEPT_CHUNK
from ..base.private_api import chunk_cat_
from ..base.private_dist import is_strided_shard, local_tensor, redistribute_logger
from .all_gather import AllGatherComm, AllGatherInputs
from .compressed import GradientWire
from .context import REPLICA_REDUCE_SCATTER, CommContext, InFlight
from .layout import CommParam, PieceLayout, ShardLayout
from .mesh_info import chunk_sizes
from .primitives import Collectives
from .reduce_scatter import ReduceInFlight, reduce_rows
from .replica_stage import ReplicaStage, add_partial_grads, all_reduce_across
from .wire import dequantize_rows, quantize_rows, rows_wire_bytes


class KeptChunk:
    """One parameter's kept chunk and what it was built from."""

    def __init__(self) -> None:
        # Values: (R, slot) rows in param_dtype, the chunk first. Codes: (R,
        # piece bytes) rows of uint8, each piece's scales then codes.
        self.rows: torch.Tensor | None = None
        # The sharded parameter, its local tensor and their version counters (an
        # in-place op on the DTensor bumps the DTensor's only).
        self._built_from: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
        # Stepped by an optimizer since it was built (optimizer_hooks.py's post-step hook).
        self.stepped = False

    def stale(self, param: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the piece (or the dtype) changed since the chunk was built."""
        built = self._built_from
        if self.stepped or built is None or self.rows is None:
            return True
        piece = local_tensor(param)
        return (
            built[0] is not param
            or built[1] is not piece
            or built[2:] != (param._version, piece._version)
            or (self.rows.dtype is not torch.uint8 and self.rows.dtype != dtype)
        )

    def built(self, param: torch.Tensor) -> None:
        piece = local_tensor(param)
        self._built_from = (param, piece, param._version, piece._version)
        self.stepped = False
        param.__dict__[KEPT_CHUNK] = self


class KeptChunks:
    """The kept chunks of one group's sharded parameters (``layouts``, in group
    order). ``gather``: the all-gather across the replicas (plain, or int8 for
    ``across="replicate"``). ``block_size``: codes (``across="all"``, see
    [Note: compression over replicas]), else None."""

    def __init__(
        self, layouts: list[ShardLayout], gather: AllGatherComm, block_size: int | None
    ) -> None:
        self.layouts = layouts
        self.gather = gather
        self.block_size = block_size
        self.kept = [KeptChunk() for _ in layouts]

    @property
    def nbytes(self) -> int:
        """Held by the kept chunks (values, or codes)."""
        return sum(k.rows.numel() * k.rows.element_size() for k in self.kept if k.rows is not None)

    def same_format(self, other: KeptChunks) -> bool:
        """Whether ``other`` keeps its chunks as these would (the variants were
        chosen again, e.g. by a setter: the chunks kept so far stay valid)."""
        mine, theirs = self.gather, other.gather
        return (type(mine), mine.exchanges, self.block_size) == (
            type(theirs),
            theirs.exchanges,
            other.block_size,
        )

    @torch.no_grad()
    def refresh(self, params: Sequence[CommParam], comm: CommContext, name: str) -> None:
        """Rebuilds the chunks whose pieces changed with one all-gather across
        the replicas (nothing when none did)."""
        stale = [
            i
            for i, (p, kept) in enumerate(zip(params, self.kept, strict=True))
            if kept.stale(p.sharded_param, p.param_dtype)
        ]
        if not stale:
            return
        pieces = [local_tensor(params[i].sharded_param) for i in stale]
        if any(piece.is_meta for piece in pieces):
            return  # not materialized yet: rebuilt once it is
        if self.block_size is None:
            slots = [(_piece(self.layouts[i]).slot_numel, params[i].param_dtype) for i in stale]
            inputs = [
                piece.to(comm.device, non_blocking=comm.uses_streams).view(-1) for piece in pieces
            ]
        else:
            inputs = [
                self._codes(i, piece, self.block_size, comm.device)
                for i, piece in zip(stale, pieces, strict=True)
            ]
            slots = [(x.numel(), torch.uint8) for x in inputs]
        outputs = []
        for i, (numel, dtype) in zip(stale, slots, strict=True):
            kept = self.kept[i]
            if kept.rows is None or kept.rows.dtype != dtype:
                kept.rows = torch.empty(
                    self.gather.world_size, numel, dtype=dtype, device=comm.device
                )
            outputs.append(kept.rows)
        # Every chunk of this shard group empty (the same on its whole replica group).
        if sum(numel for numel, _ in slots) > 0:
            plain = (True,) * len(inputs)
            gathered = self.gather.gather(AllGatherInputs(inputs, slots, plain), comm, name)
            gathered.in_flight.wait()
            gathered.copy_out(outputs)
        for i in stale:  # only once the chunks hold what they were built from
            self.kept[i].built(params[i].sharded_param)

    def _codes(
        self, i: int, piece: torch.Tensor, block_size: int, device: torch.device
    ) -> torch.Tensor:
        """Piece ``i``'s scales and codes, in a slot of its parameter's largest
        piece (the same size on every rank of the shard group)."""
        slot_numel = self._largest_piece(i)
        values = torch.zeros(1, slot_numel, dtype=torch.float32, device=device)
        values[0, : piece.numel()].copy_(piece.reshape(-1))
        return quantize_rows(values, [slot_numel], block_size).view(-1)

    def _largest_piece(self, i: int) -> int:
        """Elements of parameter ``i``'s largest piece over its shard group."""
        layout = self.layouts[i]
        piece = _piece(layout)
        return -(-layout.chunk_rows // piece.replicas) * piece.row_numel

    def inputs(self) -> AllGatherInputs:
        """The chunks as the inputs of the all-gather inside the shard group."""
        tensors, slots = [], []
        for layout, kept in zip(self.layouts, self.kept, strict=True):
            if kept.rows is None:
                raise AssertionError("a kept chunk was never built")
            if self.block_size is None:
                tensors.append(kept.rows.view(-1).narrow(0, 0, _piece(layout).chunk_numel))
                slots.append((layout.slot_numel, kept.rows.dtype))
            else:
                tensors.append(kept.rows.view(-1))
                slots.append((kept.rows.numel(), torch.uint8))
        return AllGatherInputs(tensors, slots, (False,) * len(tensors))

    @torch.no_grad()
    def decode(self, all_gather_output: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """Codes: every rank's pieces of every parameter, dequantized into the
        rank-major unsharded outputs ((S, chunk slot) each)."""
        block_size = self.block_size
        if block_size is None:
            raise AssertionError("the kept chunks hold values, not codes")
        shards = outputs[0].size(0)
        rows = all_gather_output.view(shards, -1)
        column = 0
        for i, (layout, out) in enumerate(zip(self.layouts, outputs, strict=True)):
            slot_numel = self._largest_piece(i)
            piece = _piece(layout)
            nbytes = piece.replicas * rows_wire_bytes([slot_numel], block_size)
            wire = rows[:, column : column + nbytes].reshape(shards * piece.replicas, -1)
            column += nbytes
            (values,) = dequantize_rows(wire, [slot_numel], block_size, out.dtype)
            values = values.reshape(shards, piece.replicas, slot_numel)
            # Whole chunks: their pieces fill their slots, so the chunk is the first
            # rows of the R slots together (a shorter chunk's rows are fixed below).
            out.copy_(values.reshape(shards, -1)[:, : out.size(1)])
            _place_short_pieces(values, out, layout.unsharded_size[0], piece)


def _place_short_pieces(
    values: torch.Tensor, out: torch.Tensor, rows: int, piece: PieceLayout
) -> None:
    """The chunks of the shard ranks whose pieces are shorter than the largest
    (uneven dims): each piece copied to its rows of the chunk."""
    shards, replicas, row_numel = out.size(0), piece.replicas, piece.row_numel
    largest = values.size(2) // max(row_numel, 1)
    for s, chunk_rows in enumerate(chunk_sizes(rows, shards)):
        piece_rows = chunk_sizes(chunk_rows, replicas)
        if not chunk_rows or piece_rows[0] == largest:
            continue
        start = 0
        for r, n in enumerate(piece_rows):
            out[s, start * row_numel : (start + n) * row_numel].copy_(values[s, r, : n * row_numel])
            start += n


def _piece(layout: ShardLayout) -> PieceLayout:
    if layout.piece is None:
        raise AssertionError("a parameter kept whole has no piece across replicas")
    return layout.piece


class ChunkAllGather(AllGatherComm):
    """The all-gather inside the shard group, of the kept chunks (rebuilt
    first where their pieces changed)."""

    def __init__(
        self,
        collectives: Collectives,
        rank: int,
        world_size: int,
        exchanges: bool,
        chunks: KeptChunks,
    ) -> None:
        super().__init__(collectives, rank, world_size, exchanges)
        self.chunks = chunks

    def inputs(self, params: Sequence[CommParam], comm: CommContext, name: str) -> AllGatherInputs:
        self.chunks.refresh(params, comm, name)
        return self.chunks.inputs()

    def copy_out(self, all_gather_output: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        if self.chunks.block_size is None:
            super().copy_out(all_gather_output, outputs)
        else:
            self.chunks.decode(all_gather_output, outputs)


class ReduceScatterAcrossReplicas(ReplicaStage):
    """The shard-group sums of the chunks reduce-scattered across the replicas
    onto the pieces (the whole parameters' gradients all-reduced), with the
    plan's op; ``wire``: compressed, summed in fp32."""

    communicates = True

    def __init__(self, collectives: Collectives, wire: GradientWire | None) -> None:
        self.collectives = collectives
        self.wire = wire

    @torch.no_grad()
    def start(
        self,
        reduced: ReduceInFlight,
        comm: CommContext,
        name: str,
        after: tuple[InFlight, ...] = (),
    ) -> ReduceInFlight | None:
        add_partial_grads(reduced)
        collectives, wire, op = self.collectives, self.wire, reduced.plan.all_reduce_op
        replicas = collectives.process_group.size()
        params = reduced.fsdp_params  # the sharded ones, then the whole ones
        pieces = [p.layout.piece for p in params if p.layout.piece is not None]
        views = reduced.views()  # the chunks, then the whole gradients
        chunks, whole = views[: len(pieces)], views[len(pieces) :]
        # The same on every rank of a replica group (one chunk of the shard group).
        slot_numels = [piece.slot_numel for piece in pieces]
        block_numel = sum(slot_numels)
        whole_numel = sum(g.numel() for g in whole)
        dtype = torch.float32 if wire is not None else reduced.output.dtype
        output = reduced.output.new_empty(block_numel + whole_numel, dtype=dtype)
        reduce_scatter_input = reduced.output.new_empty(replicas, block_numel)
        nonempty = [c for c in chunks if c.numel() > 0]
        if nonempty:
            chunk_cat_(nonempty, replicas, out=reduce_scatter_input)
        in_flight: list[InFlight] = []
        buffers: tuple[torch.Tensor, ...] = (reduce_scatter_input,)
        if block_numel > 0:  # every chunk of this shard group empty: nothing to exchange
            mine = output.narrow(0, 0, block_numel)
            issued, buffers = reduce_rows(
                REPLICA_REDUCE_SCATTER,
                mine,
                reduce_scatter_input,
                slot_numels,
                op,
                wire,
                collectives,
                comm,
                name,
            )
            in_flight.append(issued)
        if whole:
            tail = output.narrow(0, block_numel, whole_numel)
            tail.copy_(torch.cat([g.reshape(-1) for g in whole]))
            numels = [g.numel() for g in whole]
            in_flight.append(all_reduce_across(tail, numels, op, wire, collectives, comm, name))
        sharded = zip(params[: len(pieces)], pieces, strict=True)
        slots = [(piece.slot_numel, p.layout.local_shape) for p, piece in sharded]
        slots += [(p.layout.slot_numel, p.layout.local_shape) for p in params[len(pieces) :]]
        return reduced._replace(
            slots=slots, buffers=buffers, output=output, in_flight=tuple(in_flight)
        )


# [Note: two all-gathers for a full tensor]
# DTensor gathers a (_StridedShard(0, S), Shard(0)) parameter (full_tensor(), the full
# state dicts of torch.distributed.checkpoint.state_dict) with two all-gathers, inside
# the shard group and then across the replicas, and logs once per mesh and process that
# "2 sequential all_gather operations ... may give inconsistent results between ranks
# due to different reduction orders". An all-gather reduces nothing: every rank gets
# the same bits, whatever the order. The two cannot be one: that would need a
# flattened mesh ordering the ranks shard-major, and DeviceMesh flattens axes only in
# their order. So fsdp2 drops exactly that notice (all-gathers out of this layout);
# DTensor's other notices, those about reductions included, stay.


class _TwoAllGathersNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5):
            return True
        src, _dst, _count, collective, _reason = args
        over_replicas_layout = (
            isinstance(src, tuple | list)
            and len(src) == 2
            and is_strided_shard(src[0])
            and type(src[1]) is Shard
            and src[0].dim == src[1].dim
        )
        return not (collective == "all_gather" and over_replicas_layout)


_NOTICE_FILTER = _TwoAllGathersNotice()


def quiet_two_all_gathers_notice() -> None:
    """Drops DTensor's notice about the two all-gathers of a full tensor of this
    layout (see [Note: two all-gathers for a full tensor]); once per process."""
    redistribute_logger().addFilter(_NOTICE_FILTER)  # a no-op when already there
