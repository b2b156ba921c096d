"""Custom collectives for ``set_custom_all_gather`` / ``set_custom_reduce_scatter``.

torch's fully_shard contract: a collective object says where its buffers
live (``allocate``, e.g. from a memory pool registered with the network) and
runs the collective (``__call__``). fsdp2 allocates the all-gather output,
and the reduce-scatter input and output, through ``allocate``, and calls the
object instead of ``all_gather_single`` / ``reduce_scatter_single`` (with
``async_op=True`` on CPU, where fsdp2 overlaps through gloo's threads, and on
the all-gather / reduce-scatter stream on accelerators). Any object with these
two methods works, subclasses of torch's own ``AllGather`` / ``ReduceScatter``
included.

A custom collective takes the place of fsdp2's in the ``Collectives`` a
variant holds (``WithCustomAllGather``, ``WithCustomReduceScatter``): the
variant (variants.py) does not know it is there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .primitives import Collectives, ReduceOp, Waitable


class Comm(ABC):
    @abstractmethod
    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A buffer for the collective (e.g. ``torch.empty(size, ...)`` inside a
        memory pool)."""


class AllGather(Comm):
    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Gathers every rank's ``input_tensor`` into ``output_tensor`` (rank order)."""


class ReduceScatter(Comm):
    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduces ``input_tensor`` over the ranks with ``op`` and leaves this
        rank's block in ``output_tensor``. fsdp2 passes ``ReduceOp.SUM``, or on
        NCCL ``AVG`` / ``PREMUL_SUM`` as torch's fully_shard does (see
        divide.py)."""


def check_custom_collective(collective: object, method: str) -> None:
    if not (callable(collective) and callable(getattr(collective, "allocate", None))):
        raise TypeError(
            f"{method} expects a collective with allocate(size, *, dtype, device) and "
            f"__call__(output_tensor, input_tensor, group, ...) (e.g. a subclass of "
            f"fsdp2.AllGather or fsdp2.ReduceScatter), got {type(collective).__name__}."
        )


class WithCustomAllGather(Collectives):
    """``base``'s collectives, with the user's all-gather and its buffers."""

    def __init__(self, base: Collectives, comm: AllGather) -> None:
        super().__init__(base.process_group, base.backend, base.device_type, base.role)
        self.base = base
        self.comm = comm

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate((numel,), dtype=dtype, device=device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Waitable | None:
        return self.comm(output, input, group=self.process_group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Waitable | None:
        return self.base.reduce_scatter(output, input, op, async_op)


class WithCustomReduceScatter(Collectives):
    """``base``'s collectives, with the user's reduce-scatter and its buffers."""

    def __init__(self, base: Collectives, comm: ReduceScatter) -> None:
        super().__init__(base.process_group, base.backend, base.device_type, base.role)
        self.base = base
        self.comm = comm

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate((numel,), dtype=dtype, device=device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Waitable | None:
        return self.base.all_gather(output, input, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Waitable | None:
        return self.comm(
            output_tensor=output,
            input_tensor=input,
            group=self.process_group,
            op=op,
            async_op=async_op,
        )
