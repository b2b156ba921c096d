"""Where collectives run, and how their completion is waited for.

[Note: two devices, one protocol]
Every collective is *issued* by :meth:`CommContext.issue` and *waited* by
:meth:`InFlight.wait`; nothing else in the engine knows which kind of device
it runs on.

- CPU (gloo): the collective is issued with ``async_op=True`` and runs on
  gloo's worker thread while the Python thread goes on computing; ``wait()``
  blocks on the returned work handle.
- Accelerators (CUDA and the like, through the device-agnostic ``torch.Stream``
  and ``torch.accelerator`` APIs): the comm stream first waits for the current
  stream (so it sees the copy-in), the collective runs on that high-priority
  stream, and an event is recorded; ``wait()`` makes the then-current stream
  wait on the event, without blocking the CPU.

Buffers a collective reads or writes are allocated on the current stream and
referenced by their in-flight record until ``wait()`` has returned, after
which the current stream is ordered after the collective: freeing them then is
safe, so no ``record_stream`` is needed.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist


class InFlight(NamedTuple):
    """A collective that has been issued but not yet waited for."""

    work: dist.Work | None  # CPU: gloo's async work handle
    event: torch.Event | None  # accelerator: recorded on the comm stream after the collective

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.event is not None:
            torch.accelerator.current_stream(self.event.device).wait_event(self.event)


class CommContext:
    """The comm streams shared by every param group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type != "cpu"
        self._streams: dict[str, torch.Stream] = {}

    def _stream(self, name: str) -> torch.Stream:
        if name not in self._streams:
            # Negative priority = high: communication must not queue behind compute kernels.
            self._streams[name] = torch.Stream(device=self.device, priority=-1)
        return self._streams[name]

    def issue(self, stream_name: str, collective: Callable[[bool], dist.Work | None]) -> InFlight:
        """Runs ``collective(async_op)`` on the comm stream ``stream_name`` ("all_gather"
        or "reduce_scatter") on accelerators, or asynchronously on CPU."""
        if not self.uses_streams:
            return InFlight(work=collective(True), event=None)
        stream = self._stream(stream_name)
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            collective(False)
            event = stream.record_event()
        return InFlight(work=None, event=event)
