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

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .primitives import Waitable
from .private_api import profiled
from .stats import CollectiveStats, CommStats


class InFlight(NamedTuple):
    """A collective that has been issued but not yet waited for."""

    work: Waitable | None  # CPU: the async work handle
    event: torch.Event | None  # accelerator: recorded on the comm stream after the collective
    label: str  # e.g. "all-gather of 'layers.3'", for errors
    stats: CollectiveStats | None  # where to record the wait, when recording

    @classmethod
    def done(cls) -> InFlight:
        """Nothing to wait for (a world of one rank exchanges nothing)."""
        return cls(None, None, "", None)

    def is_completed(self) -> bool:
        if self.work is not None:
            return self.work.is_completed()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.work is None and self.event is None:
            return  # nothing was issued (a world of one)
        with profiled("wait", self.label):
            self._wait()

    def _wait(self) -> None:
        start = time.perf_counter() if self.stats is not None else 0.0
        ready = self.stats is not None and self.is_completed()
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as error:
                # Name the collective: gloo's own message only says which socket failed.
                raise RuntimeError(
                    f"fsdp2 (rank {dist.get_rank()}): the {self.label} failed or timed out: "
                    f"{error}. A peer rank may have died, raised, or run a different sequence "
                    "of collectives."
                ) from error
        if self.event is not None:
            torch.accelerator.current_stream(self.event.device).wait_event(self.event)
        if self.stats is not None:
            self.stats.wait_seconds += time.perf_counter() - start
            self.stats.ready_when_waited += ready


class CommContext:
    """The comm streams shared by every param group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type != "cpu"
        self._streams: dict[str, torch.Stream] = {}
        self.stats: CommStats | None = None  # set while ``comm_stats`` is open
        # Accelerators: ``set_post_optim_event``'s event, waited for by the next all-gather.
        self.post_optim_event: torch.Event | None = None

    def _stream(self, name: str) -> torch.Stream:
        if name not in self._streams:
            # Negative priority = high: communication must not queue behind compute kernels.
            self._streams[name] = torch.Stream(device=self.device, priority=-1)
        return self._streams[name]

    def issue(
        self,
        kind: str,
        group_name: str,
        nbytes: int,
        collective: Callable[[bool], Waitable | None],
    ) -> InFlight:
        """Runs ``collective(async_op)``: on the comm stream of ``kind``
        ("all_gather" or "reduce_scatter") on accelerators, asynchronously on CPU.
        ``nbytes`` (of the full buffer) is for the statistics."""
        label = f"{kind.replace('_', '-')} of {group_name!r}"
        stats = None
        if self.stats is not None:
            stats = self.stats.record(group_name, kind)
            stats.count += 1
            stats.bytes += nbytes
        with profiled(kind, group_name):
            if not self.uses_streams:
                return InFlight(collective(True), None, label, stats)
            stream = self._stream(kind)
            if kind == "all_gather" and (event := self.post_optim_event) is not None:
                stream.wait_event(event)  # the optimizer step has written the shards
                self.post_optim_event = None
            # The copy-in ran on the current stream.
            stream.wait_stream(torch.accelerator.current_stream(self.device))
            with stream:
                collective(False)
                event = stream.record_event()
        return InFlight(None, event, label, stats)

    def run_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        tensor: torch.Tensor,
        stream: torch.Stream | None,
    ) -> None:
        """Runs a user hook on a finished reduction (``set_all_reduce_hook``): on
        ``stream`` if one was given (accelerators), ordered after the reduction
        and before anything that reads ``tensor`` next."""
        if stream is None:
            hook(tensor)
            return
        current = torch.accelerator.current_stream(self.device)
        stream.wait_stream(current)
        with stream:
            hook(tensor)
        current.wait_stream(stream)
