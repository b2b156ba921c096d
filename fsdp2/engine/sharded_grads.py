"""A group's sharded gradients as views of one flat buffer, kept across
iterations.

Making a gradient costs more than adding one on models with many small
tensors: per parameter and step, a view of the reduction's output, a
narrow, a reshape and a ``DTensor`` around it (Megatron-LM#7264: 174 of 178 ms
of AccumulateGrad were such rebuilds). So a group's ``sharded_grad`` DTensors
are made once, as views of one flat buffer laid out like the reduction's
output (slot by slot, padding included), and each backward lands in them with
one ``copy_`` (the grads are None) or one ``add_`` (they are still these ones).

The buffer is reused only when nothing but this object refers to its
tensors: a gradient someone kept after ``zero_grad()`` (a DTensor, its local
tensor, a view of it) keeps its values; the group then makes a new buffer and
leaves that one to its holder, as autograd does when it cannot steal a
gradient. Its storage is freed at the group's first forward after the grads
were dropped, and allocated again at the next reduction, so between
``zero_grad()`` and backward it holds no memory, as torch's fully_shard.

    FREE --fill (grads None)--> ASSIGNED --add (grads still ours)--> ASSIGNED
    ASSIGNED --grads dropped, pre-forward: release()--> FREE
    any --a tensor of it held elsewhere--> retired: the group makes another

Not for CPU offload (the grads go to pinned host memory, offload.py): the
group keeps the per-parameter path there, and wherever the grads are neither
all None nor all this buffer's (a user assigned some).

Gradient clipping reads the buffer too (``whole_buffers``): given all of a
buffer's grads, and no padding in it, their norm is the buffer's and scaling
them is scaling it, one op for the group where the grads take one each.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..base.private_api import post_accumulate_grad_hooks, storage_use_count
from ..base.private_dist import dtensor_specs, local_tensor, locals_in_place

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from .param import FSDPParam


def _refcounts(tensors: Sequence[torch.Tensor]) -> list[int]:
    return list(map(sys.getrefcount, tensors))


class GroupGrads:
    """A group's current ``ShardedGrads``, made again when the reduction's
    parameters, slots or dtype change, or when its tensors are held elsewhere."""

    def __init__(self) -> None:
        self.buffer: ShardedGrads | None = None

    def accumulate(
        self,
        fsdp_params: list[FSDPParam],
        slots: list[tuple[int, torch.Size]],
        output: torch.Tensor,
        dtype: torch.dtype,
    ) -> bool:
        """Adds a divided reduction (``output``, 1D, slot by slot) into the
        sharded grads; False if they are someone else's (the caller's
        per-parameter path must)."""
        buffer = self.buffer
        if buffer is None or buffer.key != (tuple(fsdp_params), tuple(slots), dtype):
            buffer = self.buffer = ShardedGrads(fsdp_params, slots, dtype, output.device)
        done = buffer.accumulate(output)
        if done is False:  # held elsewhere: theirs now
            buffer = self.buffer = ShardedGrads(fsdp_params, slots, dtype, output.device)
            done = buffer.accumulate(output)
        return bool(done)

    def release(self) -> None:
        """At a forward: frees the storage of grads that were dropped."""
        if self.buffer is not None and not self.buffer.release():
            self.buffer = None


class ShardedGrads:
    """The sharded grads of ``fsdp_params`` (one reduction's, in its order),
    slot ``i`` holding the local shape ``slots[i][1]`` in its first elements."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        slots: list[tuple[int, torch.Size]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.key = (tuple(fsdp_params), tuple(slots), dtype)
        self.fsdp_params = fsdp_params
        self.flat = torch.empty(sum(numel for numel, _ in slots), dtype=dtype, device=device)
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.locals: list[torch.Tensor] = []
        offset = 0
        for numel, shape in slots:
            self.locals.append(self.flat.narrow(0, offset, shape.numel()).view(shape))
            offset += numel
        self.grads: list[DTensor] = [
            p.as_sharded_grad(local) for p, local in zip(fsdp_params, self.locals, strict=True)
        ]
        # Clipping may take the buffer for the grads: it holds nothing else,
        # and they have one mesh and placements (so one group of clipping's).
        specs = dtensor_specs(self.grads) or []
        self.clippable = sum(shape.numel() for _, shape in slots) == self.flat.numel() and (
            len({(spec.mesh, spec.placements) for spec in specs}) == 1
        )
        self._grad_ids = frozenset(map(id, self.grads))
        _name_owner(self.grads, self)
        # What the counts are while nothing else refers to the tensors (so no
        # local variable here holds one).
        self._alone = self._counts()

    def _counts(self) -> tuple[set[int], set[int], int]:
        return (
            set(_refcounts(self.grads)),
            set(_refcounts(self.locals)),
            storage_use_count(self.flat),
        )

    def _held_elsewhere(self) -> bool:
        return self._counts() != self._alone

    def _ours(self, grads: list[torch.Tensor | None]) -> bool:
        return all(map(operator.is_, grads, self.grads)) and all(
            map(operator.is_, map(local_tensor, self.grads), self.locals)
        )

    def accumulate(self, output: torch.Tensor) -> bool | None:
        """Adds ``output`` (1D, this buffer's layout) into the grads: True if
        done; False if the grads are None but this buffer is held elsewhere (a
        new one must take it); None if the grads are someone else's (the
        per-parameter path must take it)."""
        params = [p.sharded_param for p in self.fsdp_params]
        grads = [p.grad for p in params]
        if self._ours(grads):
            # Cast, then add, as torch's accumulation rounds (the reduction cast to
            # the parameters' dtype, then added in it): the same bits as torch's.
            self.flat.add_(output.to(self.flat.dtype))
        elif all(g is None for g in grads):
            if self._held_elsewhere():
                return False
            storage = self.flat.untyped_storage()
            if storage.size() != self.nbytes:
                storage.resize_(self.nbytes)
            self.flat.copy_(output)
            for param, grad in zip(params, self.grads, strict=True):
                param.grad = grad
        else:
            return None
        # Autograd never accumulates into a sharded parameter: its
        # post-accumulate-grad hooks run here, once its gradient is complete.
        for param in params:
            for hook in post_accumulate_grad_hooks(param):
                hook(param)
        return True

    def release(self) -> bool:
        """Frees the storage if the grads were dropped (``zero_grad()``) and no
        one else holds them; returns False if someone does (the buffer is
        theirs now: the group forgets it)."""
        if self.flat.untyped_storage().size() == 0:
            return True
        if any(p.sharded_param.grad is not None for p in self.fsdp_params):
            return True
        if self._held_elsewhere():
            return False
        self.flat.untyped_storage().resize_(0)
        return True

    def whole(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` (tensors that name this buffer as theirs) are all
        of this buffer's grads, each once, still views of it: then the buffer
        stands for them."""
        if not (self.clippable and len(grads) == len(self.grads)):
            return False
        if set(map(id, grads)) != self._grad_ids:  # e.g. deep copies, which keep the name
            return False
        locals_ = list(self.grads)
        locals_in_place(locals_)
        return all(map(operator.is_, locals_, self.locals)) and (
            self.flat.untyped_storage().size() == self.nbytes
        )


_OWNER = "_fsdp2_sharded_grads"


def _name_owner(grads: list[DTensor], buffer: ShardedGrads) -> None:
    owner = weakref.ref(buffer)  # a grad does not keep its buffer alive
    for grad in grads:
        setattr(grad, _OWNER, owner)


def whole_buffers(grads: Sequence[torch.Tensor]) -> dict[int, torch.Tensor | None]:
    """For gradient clipping: where in ``grads`` all of a ``ShardedGrads``'
    grads are (each once), its flat buffer at the first of their positions,
    and None at the others. The buffer's norm is theirs (it holds nothing
    else), and scaling it scales them."""
    positions: dict[ShardedGrads, list[int]] = {}
    for index, grad in enumerate(grads):
        owner = getattr(grad, _OWNER, None)
        buffer = owner() if owner is not None else None
        if buffer is not None:
            positions.setdefault(buffer, []).append(index)
    found: dict[int, torch.Tensor | None] = {}
    for buffer, indices in positions.items():
        if buffer.whole([grads[i] for i in indices]):
            found[indices[0]] = buffer.flat
            found.update(dict.fromkeys(indices[1:]))
    return found
