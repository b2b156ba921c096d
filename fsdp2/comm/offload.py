"""CPU offload on an accelerator: sharded grads copied to pinned host memory
without blocking the host, and the one host sync per backward that makes them
readable.

Each reduced grad is copied on the current stream into a new pinned buffer
(``copy_to_host``). Once the host has waited, that buffer becomes the sharded
grad, or is added to the existing one (accumulation): ``.grad`` never shows
bytes still in flight. ``HostGradCopies`` remembers the event after the latest
copy and what to do with each copy; its ``wait`` runs once, at the end of
backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..base.device_ops import DeviceOps


class HostCopy(NamedTuple):
    """A sharded grad on its way to pinned host memory: a non-blocking copy on
    the current stream, which the host reads only after ``HostGradCopies.wait``."""

    copy: torch.Tensor  # pinned, shaped like the local shard, in the parameter's dtype
    # Once the host has waited: the grad ``copy`` is added to, or what makes it the grad.
    add_to: torch.Tensor | Callable[[torch.Tensor], None]


def copy_to_host(
    local_grad: torch.Tensor,
    dtype: torch.dtype,
    add_to: torch.Tensor | Callable[[torch.Tensor], None],
    ops: DeviceOps,
) -> HostCopy:
    """Starts copying ``local_grad`` (on the device) into new pinned host memory."""
    host = ops.pinned_empty(local_grad.shape, dtype)
    host.copy_(local_grad, non_blocking=True)
    return HostCopy(host, add_to)


class HostGradCopies:
    """The host copies of one backward, waited for once at its end."""

    def __init__(self) -> None:
        self._event: torch.Event | None = None  # after the latest copy
        self._copies: list[HostCopy] = []

    def add(self, copies: list[HostCopy], ops: DeviceOps) -> None:
        """``copies`` were just issued on the current stream."""
        if copies:
            self._event = ops.current_stream().record_event()
            self._copies += copies

    def wait(self, discard: bool = False) -> None:
        """The host waits for every copy, then adds each to its grad or makes
        it the grad; ``discard`` (a reset): the copies are dropped instead."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if not discard:
            for copy, add_to in self._copies:
                if isinstance(add_to, torch.Tensor):
                    add_to.add_(copy)
                else:
                    add_to(copy)
        self._copies.clear()
