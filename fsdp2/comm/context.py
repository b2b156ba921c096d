"""Where collectives run, and how their completion is waited for.

[Note: two devices, one protocol]
Every collective is *issued* by :meth:`CommContext.issue` and *waited* by
:meth:`InFlight.wait`; the engine reaches streams and events through these
two and the copy-in stream (``CommContext.copy_in``), and checks
``uses_streams`` only where accelerators may do more (start a reduction
early, copy gradients to the host without blocking).

- CPU (gloo): the collective is issued with ``async_op=True`` and runs on
  gloo's worker thread while the Python thread goes on computing; ``wait()``
  blocks on the returned work handle.
- Accelerators (CUDA and the like, through the comm context's ``DeviceOps``,
  see device_ops.py): the comm stream first waits for the current
  stream (so it sees the copy-in), the collective runs on that high-priority
  stream, and an event is recorded; ``wait()`` makes the then-current stream
  wait on the event, without blocking the CPU.

Buffers a collective reads or writes are allocated on the current stream and
referenced by their in-flight record until ``wait()`` has returned, after
which the current stream is ordered after the collective: freeing them then is
safe, so no ``record_stream`` is needed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ..base.device_ops import DeviceOps
from ..base.private_api import profiled
from .offload import HostGradCopies
from .primitives import Collectives, Waitable
from .stats import CollectiveStats, CommStats
from .timeouts import collective_failed


class CommKind(NamedTuple):
    """What a collective is: its ``comm_stats`` bucket (stats.py's ``KINDS``,
    also its name in messages) and the comm stream it runs on (accelerators)."""

    stats: str
    stream: str

    @property
    def label(self) -> str:
        return self.stats.replace("_", "-")


ALL_GATHER = CommKind("all_gather", "all_gather")
REDUCE_SCATTER = CommKind("reduce_scatter", "reduce_scatter")
ALL_REDUCE = CommKind("all_reduce", "all_reduce")
# shard_optimizer_over_replicas: across the replicas, on the streams of the
# all-gather and of the all-reduce that plain HSDP runs there.
REPLICA_ALL_GATHER = CommKind("replica_all_gather", "all_gather")
REPLICA_REDUCE_SCATTER = CommKind("replica_reduce_scatter", "all_reduce")


class InFlight(NamedTuple):
    """A collective that has been issued but not yet waited for."""

    work: Waitable | None  # CPU: the async work handle
    event: torch.Event | None  # accelerator: recorded on the comm stream after the collective
    ops: DeviceOps | None  # accelerator: whose current stream waits on ``event``
    label: str  # e.g. "all-gather of module 'layers.3'", for errors
    stats: CollectiveStats | None  # where to record the wait, when recording
    on: Collectives | None = None  # whose group it runs on, for errors

    @classmethod
    def done(cls) -> InFlight:
        """Nothing to wait for (a world of one rank exchanges nothing)."""
        return cls(None, None, None, "", None)

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
                raise collective_failed(self.label, self.on, error) from error
        if self.event is not None and self.ops is not None:
            self.ops.current_stream().wait_event(self.event)
        if self.stats is not None:
            self.stats.wait_seconds += time.perf_counter() - start
            self.stats.ready_when_waited += ready


class CommContext:
    """The comm streams shared by every param group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Streams and events: none on CPU, where gloo's threads run the collectives.
        self.ops: DeviceOps | None = DeviceOps(device) if device.type != "cpu" else None
        self._streams: dict[str, torch.Stream] = {}
        self.stats: CommStats | None = None  # set while ``comm_stats`` is open
        # Accelerators: ``set_post_optim_event``'s event, waited for by the next copy-in.
        self.post_optim_event: torch.Event | None = None
        # Accelerators, see [Note: the copy-in stream]: whether the copy-in stream
        # has caught up with the shards' writers since the last forward or backward
        # ended, and the all-gather buffers copied out since the last copy-in, with
        # the event after the latest copy-out (the current stream orders the others).
        self._copy_in_synced = False
        self._copied_out: list[torch.Tensor] = []
        self._copied_out_event: torch.Event | None = None
        # The events after all-gathers dropped unread (``dropped``): their buffers,
        # among ``_copied_out``, go once the copy-in stream has waited for them.
        self._dropped_events: list[torch.Event] = []
        # Where the whole parameters are copied (the current stream): it waits
        # for the post-optimizer event once too.
        self._whole_params_event: torch.Event | None = None
        # CPU offload: grads being copied to the host, waited for at the end of backward.
        self.grads_to_host = HostGradCopies()

    @property
    def uses_streams(self) -> bool:
        return self.ops is not None

    def use_device_ops(self, ops: DeviceOps | None) -> None:
        """Runs the streams and events through ``ops`` from now on, or none
        (CPU): see check_switches.py."""
        self.ops = ops
        self._streams.clear()

    def _stream(self, ops: DeviceOps, name: str) -> torch.Stream:
        if name not in self._streams:
            self._streams[name] = ops.new_stream(name)
        return self._streams[name]

    def issue(
        self,
        kind: CommKind,
        group_name: str,
        on: Collectives,
        nbytes: int,
        collective: Callable[[bool], Waitable | None],
        after: tuple[InFlight, ...] = (),
    ) -> InFlight:
        """Runs ``collective(async_op)``, one of ``on``'s: on the comm stream of
        ``kind`` on accelerators, asynchronously on CPU. ``nbytes`` (of the
        full buffer) is for the statistics. ``after``: accelerators, collectives
        in flight whose output this one reads (ordered after their events)."""
        label = f"{kind.label} of module {group_name!r}"
        stats = None
        if self.stats is not None:
            stats = self.stats.record(group_name, kind.stats)
            stats.count += 1
            stats.bytes += nbytes
        try:  # not a context manager: this runs for every collective
            with profiled(kind.stats, group_name):
                ops = self.ops
                if ops is None:
                    return InFlight(collective(True), None, None, label, stats, on)
                comm_stream = self._stream(ops, kind.stream)
                # The copy-in ran on the current stream.
                comm_stream.wait_stream(ops.current_stream())
                for earlier in after:
                    if earlier.event is not None:
                        comm_stream.wait_event(earlier.event)
                with comm_stream:
                    work = collective(False)
                    if work is not None:
                        # A custom collective may return a handle even so: on an
                        # accelerator its wait() orders this stream after it.
                        work.wait()
                    event = comm_stream.record_event()
        except RuntimeError as error:  # e.g. a dead peer's connection, at issue
            raise collective_failed(label, on, error) from error
        return InFlight(None, event, ops, label, stats, on)

    @contextlib.contextmanager
    def copy_in(self, written: torch.Event | None = None) -> Iterator[None]:
        """Accelerators: runs an all-gather's copy-in (and its buffer's
        allocation) on the copy-in stream. [Note: the copy-in stream]

        The copy-in stream waits for the current stream (or for
        ``set_post_optim_event``'s event instead) once after each forward and
        backward, since the shards may have been written then, and before each
        copy-in for the event recorded after the latest all-gather buffer was
        copied out, then drops the buffers copied out until then: they were
        allocated on this stream, and their bytes may be reused here only once
        the copy-outs have read them. An all-gather is thus not ordered after the compute of
        the group before it, and the copy-in runs off the compute stream.
        ``written``: the event after the current stream wrote the shard this
        copy-in reads since the catch-up (``shard_written``), waited for too.
        """
        ops = self.ops
        if ops is None:
            raise AssertionError("copy_in() without streams")
        stream = self._stream(ops, "all_gather_copy_in")
        if not self._copy_in_synced:
            self._copy_in_synced = True
            if (event := self.post_optim_event) is not None:
                stream.wait_event(event)  # the optimizer step has written the shards
                self._whole_params_event, self.post_optim_event = event, None
            else:
                stream.wait_stream(ops.current_stream())
        if written is not None:
            stream.wait_event(written)
        self._release_copied_out(stream)
        with stream:
            yield

    def shard_written(self) -> torch.Event | None:
        """Accelerators: the event after the current stream wrote a shard that a
        later copy-in reads (the post-forward shard, written in forward after
        the copy-in stream caught up: a module run twice in one forward reads
        it then); that copy-in waits for it (``copy_in(written=...)``)."""
        return None if self.ops is None else self.ops.current_stream().record_event()

    def copied_out(self, buffer: torch.Tensor) -> None:
        """Accelerators: the current stream has read (or dropped) ``buffer``, an
        all-gather buffer; it is kept until the next copy-in has waited."""
        if self.ops is not None:
            self._copied_out.append(buffer)
            self._copied_out_event = self.ops.current_stream().record_event()

    def dropped(self, buffer: torch.Tensor, in_flight: InFlight) -> None:
        """An all-gather into ``buffer`` will not be read (a prefetch whose module
        did not run). Every rank issued it, so it must complete: on CPU it is
        waited for; on accelerators the compute stream does not wait for it,
        the buffer is held until the copy-in stream (where its bytes return)
        has waited for the collective's event."""
        if self.ops is None or in_flight.event is None:
            in_flight.wait()
            self.copied_out(buffer)
            return
        self._copied_out.append(buffer)
        self._dropped_events.append(in_flight.event)

    def release_copied_out(self) -> None:
        """The end of backward (or of a reset), or this context is being
        replaced (lazy init): the copy-in stream waits for the buffers still
        held, which can then go (else the last block's backward buffer would
        live through the optimizer step)."""
        if self.ops is not None:
            self._release_copied_out(self._stream(self.ops, "all_gather_copy_in"))

    def _release_copied_out(self, copy_in_stream: torch.Stream) -> None:
        if self._copied_out_event is not None:
            copy_in_stream.wait_event(self._copied_out_event)
            self._copied_out_event = None
        for event in self._dropped_events:
            copy_in_stream.wait_event(event)
        self._dropped_events.clear()
        self._copied_out.clear()

    def shards_may_change(self) -> None:
        """A forward or backward ended: the next copy-in waits for the current
        stream (an optimizer step, a load) again."""
        self._copy_in_synced = False

    def done_here(self) -> InFlight:
        """An all-gather with nothing to exchange (a world of one): on
        accelerators the copy-out still waits for the copy-in stream."""
        if self.ops is None:
            return InFlight.done()
        event = self.ops.current_stream().record_event()
        return InFlight(None, event, self.ops, "", None)

    def wait_for_optimizer(self) -> None:
        """Before the current stream reads the shards (the whole parameters'
        copy): it waits for ``set_post_optim_event``'s event once."""
        if self.ops is not None:
            event = self._whole_params_event or self.post_optim_event
            if event is not None:
                self.ops.current_stream().wait_event(event)
            self._whole_params_event = None

    def run_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        tensor: torch.Tensor,
        stream: torch.Stream | None,
    ) -> torch.Event | None:
        """Runs a user hook on a finished reduction (``set_all_reduce_hook``): on
        ``stream`` if one was given (accelerators), ordered after the reduction.
        Returns None if it ran on the current stream, else the event after it,
        which the current stream must wait for (``wait_event``) before it reads
        or frees ``tensor``: in between, compute overlaps the hook. If the hook
        raises, the current stream waits for it here (``tensor`` is about to be
        freed)."""
        if stream is None or self.ops is None:
            hook(tensor)
            return None
        current = self.ops.current_stream()
        stream.wait_stream(current)
        try:
            with stream:
                hook(tensor)
        except BaseException:
            current.wait_stream(stream)
            raise
        return stream.record_event()

    def wait_event(self, event: torch.Event) -> None:
        """Orders the current stream after ``event`` (accelerators)."""
        if self.ops is not None:
            self.ops.current_stream().wait_event(event)
