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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist


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
        ``collectives.divide_plan``)."""


def check_custom_collective(collective: object, method: str) -> None:
    if not (callable(collective) and callable(getattr(collective, "allocate", None))):
        raise TypeError(
            f"{method} expects a collective with allocate(size, *, dtype, device) and "
            f"__call__(output_tensor, input_tensor, group, ...) (e.g. a subclass of "
            f"fsdp2.AllGather or fsdp2.ReduceScatter), got {type(collective).__name__}."
        )


def allocate(
    custom: Comm | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A flat buffer, from the custom collective ``custom`` if one is set."""
    if custom is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return custom.allocate((numel,), dtype=dtype, device=device)
