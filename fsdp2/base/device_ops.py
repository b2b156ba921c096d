"""DeviceOps: the engine's only way to an accelerator's streams and events.

The comm context holds one (``CommContext.ops``) on accelerators and none on
CPU, where gloo's worker threads take the place of streams. Everything in
fsdp2 that orders work between streams goes through it: which stream is
current, a new stream, pinned host memory for copies that do not block the
host (new buffers, and CPU-offloaded shards pinned again), and through the streams and events it returns,
``wait_stream``, ``wait_event``, ``record_event``, ``with stream:`` and
``event.synchronize()``. A test can hand the engine another object with the
same methods (tests/stream_model.py: a model of streams on CPU ranks that
checks every access is ordered) without patching torch.
"""

from __future__ import annotations

import torch


class DeviceOps:
    """Streams and events of ``device``, through the device-agnostic
    ``torch.Stream`` / ``torch.accelerator`` APIs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def new_stream(self, name: str) -> torch.Stream:
        """A high-priority stream (communication must not queue behind compute
        kernels); ``name`` (its use, e.g. "all_gather") is for tools."""
        return torch.Stream(device=self.device, priority=-1)

    def pinned_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory: a device-to-host copy into it with
        ``non_blocking=True`` does not block the host."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the CPU) in page-locked memory: itself if it is there
        already, else a pinned copy."""
        return tensor.pin_memory()
