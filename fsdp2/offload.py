"""CPU offload on an accelerator: sharded grads copied to pinned host memory
without blocking the host, and the one host sync per backward that makes them
readable.

Each reduced grad is copied on the current stream into a new pinned buffer
(``copy_to_host``). That buffer becomes the sharded grad, or is added to the
existing one (accumulation) once the host has waited. ``HostGradCopies``
remembers the event after the latest copy and the additions still to make;
its ``wait`` runs once, at the end of backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .device_ops import DeviceOps


class HostCopy(NamedTuple):
    """A sharded grad on its way to pinned host memory: a non-blocking copy on
    the current stream, which the host reads only after ``HostGradCopies.wait``."""

    copy: torch.Tensor  # pinned, shaped like the local shard, in the parameter's dtype
    add_to: torch.Tensor | None  # the grad it is added to then; None: it is the grad


def copy_to_host(
    local_grad: torch.Tensor, dtype: torch.dtype, add_to: torch.Tensor | None, ops: DeviceOps
) -> HostCopy:
    """Starts copying ``local_grad`` (on the device) into new pinned host memory."""
    host = ops.pinned_empty(local_grad.shape, dtype)
    host.copy_(local_grad, non_blocking=True)
    return HostCopy(host, add_to)


class HostGradCopies:
    """The host copies of one backward, waited for once at its end."""

    def __init__(self) -> None:
        self._event: torch.Event | None = None  # after the latest copy
        self._additions: list[tuple[torch.Tensor, torch.Tensor]] = []  # (grad, copy)

    def add(self, copies: list[HostCopy], ops: DeviceOps) -> None:
        """``copies`` were just issued on the current stream."""
        if copies:
            self._event = ops.current_stream().record_event()
            self._additions += [(c.add_to, c.copy) for c in copies if c.add_to is not None]

    def wait(self) -> None:
        """The host waits for every copy, then adds those that accumulate."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        for grad, copy in self._additions:
            grad.add_(copy)
        self._additions.clear()
