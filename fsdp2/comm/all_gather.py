"""The all-gather of a param group, as a variant the group picks once
(variants.py) and calls without asking which it is.

Layout (W = world size of the all-gather, see [Note: the padded layout] in
layout.py): ``all_gather_output`` is 1D, ``W * block_numel`` long, rank k's
*block* at ``k * block_numel``; inside a block, slot i is the i-th input's,
at the same offset on every rank. ``all_gather_input`` is this rank's block
of the output (gathered in place). A slot is ``(elements, dtype)``; when the
slots do not share a float dtype the buffer is ``uint8`` and every slot is
counted in bytes.

Variants:

- ``AllGatherComm``: the inputs copied (cast to their slots' dtypes) into
  this rank's block, all-gathered by the ``Collectives`` it holds (fsdp2's or
  torch's, or the user's from ``set_custom_all_gather``, custom_comm.py), and
  copied out with one fused split.
- ``Int8AllGather``: the inputs quantized into one row of bytes first
  (compressed.py), dequantized at the copy-out.
- over_replicas.py's ``ChunkAllGather``: the inputs are the chunks kept from
  an all-gather across the replicas.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..base.private_api import foreach_copy_, without_grad
from ..base.private_dist import local_tensor
from .compressed import Int8Rows, all_gather_row, copy_out_int8
from .context import ALL_GATHER, CommContext, CommKind, InFlight
from .layout import CommParam
from .primitives import Collectives

Slot = tuple[int, torch.dtype]  # (elements, dtype) of one input in a rank's block


class CopyIn(NamedTuple):
    """The copy-in of kept inputs: the inputs with the padding after each, in
    block order, concatenated (and cast) into this rank's block by one cat."""

    sources: list[torch.Tensor]
    buffer_dtype: torch.dtype
    block_numel: int


class AllGatherInputs(NamedTuple):
    """What this rank contributes to one all-gather."""

    tensors: list[torch.Tensor]  # flat, each at most its slot long
    slots: list[Slot]
    # Per slot: whether a compressed all-gather may round it (an extension's
    # inputs travel as their own bytes).
    plain: tuple[bool, ...]
    # Kept inputs (``KeptInputs``): one ``torch.cat`` writes this rank's block.
    copy_in: CopyIn | None = None

    @property
    def block_numel(self) -> int:
        """This rank's block, in the buffer's units (what the order check compares)."""
        if self.copy_in is not None:
            return self.copy_in.block_numel
        if all_gather_dtype([dtype for _, dtype in self.slots]) is torch.uint8:
            return sum(n * dtype.itemsize for n, dtype in self.slots)
        return sum(n for n, _ in self.slots)


class AllGatherInFlight(NamedTuple):
    all_gather_output: torch.Tensor  # 1D, W blocks
    in_flight: InFlight
    # The copy-out of the variant that issued it: (all_gather_output, outputs).
    copy_out_of: Callable[[torch.Tensor, list[torch.Tensor]], None]

    def copy_out(self, outputs: list[torch.Tensor]) -> None:
        """Scatters the finished all-gather into ``outputs`` (one per slot,
        rank-major: row k receives rank k's slot)."""
        if outputs:
            self.copy_out_of(self.all_gather_output, outputs)


# Dtypes the all-gather buffer may have when every slot shares it; anything
# else (float8, integer data of quantized weights, a mix of dtypes) travels as
# bytes. gloo has no float8 at all, and moving bytes is all an all-gather does.
_TYPED_BUFFER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def all_gather_dtype(slot_dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype of an all-gather buffer: its slots' if they share a common
    float dtype, else ``torch.uint8`` (slots counted in bytes)."""
    dtypes = set(slot_dtypes)
    if len(dtypes) == 1 and (dtype := dtypes.pop()) in _TYPED_BUFFER_DTYPES:
        return dtype
    return torch.uint8


def as_buffer_dtype(tensor: torch.Tensor, buffer_dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` seen in the buffer's units: itself, or its bytes."""
    if buffer_dtype is torch.uint8 and tensor.dtype is not torch.uint8:
        return tensor.view(torch.uint8)
    return tensor


class KeptInputs:
    """A group's all-gather inputs kept across iterations while its shards stay
    the same tensors: the flat views of the local shards, and what one
    ``torch.cat`` needs to write them into this rank's block (padding
    included, read from one spare buffer and never read back). Only for
    shards on the buffer's device in one typed buffer (no extension, no CPU
    offload): cat casts to the buffer's dtype as the slot-by-slot copy does."""

    def __init__(self, params: Sequence[CommParam], inputs: AllGatherInputs) -> None:
        self.locals = [local_tensor(p.sharded_param) for p in params]
        self.dtypes = [p.param_dtype for p in params]
        numels = [x.numel() for x in inputs.tensors]
        pads = [numel - x for (numel, _), x in zip(inputs.slots, numels, strict=True)]
        dtype = inputs.slots[0][1]
        spare = torch.empty(max(pads), dtype=dtype, device=inputs.tensors[0].device)
        sources = []
        for tensor, pad in zip(inputs.tensors, pads, strict=True):
            sources += [tensor, spare[:pad]] if pad else [tensor]
        block_numel = sum(numel for numel, _ in inputs.slots)
        self.inputs = inputs._replace(copy_in=CopyIn(sources, dtype, block_numel))

    @staticmethod
    def keepable(params: Sequence[CommParam], inputs: AllGatherInputs) -> bool:
        return (
            bool(params)
            and all(p.extension is None and not p.offload for p in params)
            and all_gather_dtype([dtype for _, dtype in inputs.slots]) is not torch.uint8
        )

    def still_of(self, params: Sequence[CommParam]) -> bool:
        return (
            len(params) == len(self.locals)
            and all(map(operator.is_, map(local_tensor, map(_sharded, params)), self.locals))
            and all(map(operator.is_, map(_param_dtype, params), self.dtypes))
        )


_sharded = operator.attrgetter("sharded_param")
_param_dtype = operator.attrgetter("param_dtype")


def params_inputs(params: Sequence[CommParam]) -> AllGatherInputs:
    """The parameters' own inputs: their local shards, or what an extension's
    ``fsdp_pre_all_gather`` returns."""
    tensors = [x for p in params for x in p.all_gather_inputs()]
    slots = [slot for p in params for slot in p.all_gather_slots]
    plain = tuple(p.extension is None for p in params for _ in p.all_gather_slots)
    return AllGatherInputs(tensors, slots, plain)


class AllGatherComm:
    """The plain all-gather over one process group (``collectives``), this rank
    being ``rank`` of ``world_size``. ``exchanges``: False for a world of one,
    whose input is the whole output (nothing is issued)."""

    def __init__(
        self,
        collectives: Collectives,
        rank: int,
        world_size: int,
        exchanges: bool,
        kind: CommKind = ALL_GATHER,
    ) -> None:
        self.collectives = collectives
        self.rank = rank
        self.world_size = world_size
        self.exchanges = exchanges
        self.kind = kind
        self._kept: KeptInputs | None = None
        # The outputs of the last copy-out (kept rank-major views, FSDPParam.all_gather_outputs)
        # and their slots' elements.
        self._kept_outputs: tuple[list[torch.Tensor], list[int]] | None = None

    def forget_kept(self) -> None:
        """Drops the kept inputs and outputs (after ``model.to()`` replaced the
        shards: the old ones' memory goes now, not at the next all-gather)."""
        self._kept = None
        self._kept_outputs = None

    def inputs(self, params: Sequence[CommParam], comm: CommContext, name: str) -> AllGatherInputs:
        """What this rank contributes for ``params`` (a group's sharded ones)."""
        kept = self._kept
        if kept is not None and kept.still_of(params):
            return kept.inputs
        inputs = params_inputs(params)
        self._kept = KeptInputs(params, inputs) if KeptInputs.keepable(params, inputs) else None
        return inputs if self._kept is None else self._kept.inputs

    @without_grad
    def gather(self, inputs: AllGatherInputs, comm: CommContext, name: str) -> AllGatherInFlight:
        """Copies the inputs into this rank's block of a new buffer and starts
        the all-gather."""
        if (copy_in := inputs.copy_in) is not None:
            all_gather_output = self.collectives.allocate(
                self.world_size * copy_in.block_numel, copy_in.buffer_dtype, comm.device
            )
            block = all_gather_output.narrow(
                0, self.rank * copy_in.block_numel, copy_in.block_numel
            )
            torch.cat(copy_in.sources, out=block)
            return self._issue(all_gather_output, block, comm, name)
        slots = inputs.slots
        buffer_dtype = all_gather_dtype([dtype for _, dtype in slots])
        tensors = inputs.tensors
        if buffer_dtype is torch.uint8:
            tensors = [
                as_buffer_dtype(x.to(dtype), buffer_dtype)
                for x, (_, dtype) in zip(tensors, slots, strict=True)
            ]
            slot_numels = [numel * dtype.itemsize for numel, dtype in slots]
        else:
            slot_numels = [numel for numel, _ in slots]
        block_numel = sum(slot_numels)
        all_gather_output = self.collectives.allocate(
            self.world_size * block_numel, buffer_dtype, comm.device
        )
        if not tensors:  # every parameter of the group is kept whole
            return AllGatherInFlight(all_gather_output, comm.done_here(), self.copy_out)
        all_gather_input = all_gather_output.narrow(0, self.rank * block_numel, block_numel)
        self._copy_in(tensors, slot_numels, all_gather_input, comm)
        return self._issue(all_gather_output, all_gather_input, comm, name)

    def _issue(
        self,
        all_gather_output: torch.Tensor,
        all_gather_input: torch.Tensor,
        comm: CommContext,
        name: str,
    ) -> AllGatherInFlight:
        if not self.exchanges:  # the input is the whole output
            return AllGatherInFlight(all_gather_output, comm.done_here(), self.copy_out)
        collectives = self.collectives
        in_flight = comm.issue(
            self.kind,
            name,
            collectives,
            all_gather_output.numel() * all_gather_output.element_size(),
            lambda async_op: collectives.all_gather(all_gather_output, all_gather_input, async_op),
        )
        return AllGatherInFlight(all_gather_output, in_flight, self.copy_out)

    @staticmethod
    def _copy_in(
        tensors: list[torch.Tensor],
        slot_numels: list[int],
        all_gather_input: torch.Tensor,
        comm: CommContext,
    ) -> None:
        split_sizes = []  # alternating [data, padding]: the padding slots are never read
        for x, slot_numel in zip(tensors, slot_numels, strict=True):
            split_sizes += [x.numel(), slot_numel - x.numel()]
        # Accelerators: from pinned CPU shards (offload) the copy does not block the host.
        foreach_copy_(
            all_gather_input.split_with_sizes(split_sizes)[::2],
            tensors,
            non_blocking=comm.uses_streams,
        )

    @without_grad
    def copy_out(self, all_gather_output: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """One fused copy of the W blocks into ``outputs``, each rank-major
        (``ShardLayout.rank_major``): rank k's slot goes to row k."""
        world_size = outputs[0].size(0)
        gathered = all_gather_output.view(world_size, -1)
        kept = self._kept_outputs
        if (
            kept is not None
            and len(outputs) == len(kept[0])
            and all(map(operator.is_, outputs, kept[0]))
        ):
            torch.split_with_sizes_copy(gathered, kept[1], dim=1, out=outputs)
            return
        buffer_dtype = all_gather_output.dtype
        outputs = [as_buffer_dtype(out, buffer_dtype) for out in outputs]
        slot_numels = [out.numel() // world_size for out in outputs]
        if buffer_dtype is not torch.uint8 and all(out.dim() == 2 for out in outputs):
            self._kept_outputs = (list(outputs), slot_numels)  # the same views next time
        # A parameter sharded on a dim > 0 has a strided (W, pre, chunk, post)
        # view, which the fused copy cannot write: it gets a (W, slot) buffer of
        # its own, copied into the view after (the others stay fused).
        staged = [
            out if out.dim() == 2 else out.new_empty(world_size, n)
            for out, n in zip(outputs, slot_numels, strict=True)
        ]
        torch.split_with_sizes_copy(gathered, slot_numels, dim=1, out=staged)
        for stage, out in zip(staged, outputs, strict=True):
            if stage is not out:
                out.copy_(stage.view(out.shape))


class Int8AllGather(AllGatherComm):
    """int8 weights (``CompressionPolicy(weights="int8")``): this rank's plain
    inputs quantized blockwise into one row of bytes (``Int8Rows``: scales,
    codes, then an extension's slots as they are), which the plain all-gather
    moves; the copy-out dequantizes each rank's row into the outputs, in
    their dtype."""

    def __init__(
        self,
        collectives: Collectives,
        rank: int,
        world_size: int,
        exchanges: bool,
        block_size: int,
        kind: CommKind = ALL_GATHER,
    ) -> None:
        super().__init__(collectives, rank, world_size, exchanges, kind)
        self.block_size = block_size

    @without_grad
    def gather(self, inputs: AllGatherInputs, comm: CommContext, name: str) -> AllGatherInFlight:
        if not inputs.tensors:
            return super().gather(inputs, comm, name)
        rows = Int8Rows(inputs.plain, tuple(inputs.slots), self.block_size)
        row = all_gather_row(inputs.tensors, rows, comm.device)
        gathered = super().gather(
            AllGatherInputs([row], [(rows.row_bytes, torch.uint8)], (False,)), comm, name
        )

        def copy_out(output: torch.Tensor, outputs: list[torch.Tensor]) -> None:
            copy_out_int8(output, rows, outputs)

        return gathered._replace(copy_out_of=copy_out)
