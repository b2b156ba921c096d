"""A model of accelerator streams on CPU ranks, to check fsdp2's stream protocol.

fsdp2's accelerator path orders work between streams with events and waits;
a missing wait is a race that no CPU test sees, since CPU kernels run in
program order. ``StreamModel`` is handed to the engine through its one seam
(``fsdp2.api.check_switches.use_device_ops``, see fsdp2/base/device_ops.py) in place of CUDA's
streams, and, as a ``TorchDispatchMode``, sees every op:

- clocks: each stream keeps a vector clock (stream -> ticks seen). Every op
  ticks the current stream; ``wait_stream`` / ``wait_event`` merge the
  other stream's clock (or the event's snapshot, taken by ``record_event``)
  into the waiting stream's. Access A is ordered before a point of stream s
  when s's clock holds A's stream at A's tick or later.
- accesses: each op reads and writes byte ranges of storages, as its schema
  says (``alias_info.is_write`` on an argument: written; other tensor
  arguments: read; a fresh output: allocated and written on the current
  stream). c10d's schemas carry no alias info: their ``output_tensor`` /
  ``tensors`` arguments are written (``send`` only reads), ``input_tensor``
  read.
- frees: a storage's deallocation (a weak finalizer) is where the caching
  allocator may hand its bytes to the next allocation on the stream that
  allocated it, so every access to it must be ordered before that point of
  the allocating stream. (Frees through ``untyped_storage().resize_(0)`` are
  not seen: fsdp2 frees that way only the unsharded parameters, which the
  current stream allocates, writes and reads.)

A violation is an access not ordered after a conflicting earlier one (either
of them a write) on another stream, or a free not ordered after a use on
another stream.

Collectives: gloo's collectives run while ``issue`` holds the comm stream
current, with ``async_op=False`` as on accelerators, so their reads and
writes count as ops of that stream; their completion is what the event
recorded after them says, and ``InFlight.wait`` makes the current stream wait
on it, as on CUDA. (gloo itself has finished them when they return: the model
orders by the events and waits, never by that.)

Host memory: ``pinned_empty`` and ``pin`` (CPU offload) are faked with plain
CPU memory and counted, as are ``copy_(..., non_blocking=True)`` (copies the
host does not wait for; recorded as the op ``copy_(non_blocking)``) and
``event.synchronize()`` (the host waits).

Negative control: ``waits=False`` makes every wait a no-op; the same training
must then report violations.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp2.api.check_switches import use_device_ops

Clock = dict[int, int]


class Access(NamedTuple):
    stream: int
    tick: int
    start: int  # bytes into the storage
    end: int
    write: bool
    op: str


# The all-gather buffers: first written by one cat of a group's kept inputs, or
# by a copy slot by slot (offload, extensions, mixed dtypes, a post-forward shard).
ALL_GATHER_COPY_INS = ("cat(out=)", "_foreach_copy_")
# Ops whose buffers are counted together (``peak_alive``, ``alive``).
KINDS = (ALL_GATHER_COPY_INS,)


class Buffer:
    """What the model knows of one storage: who allocated it, who used it."""

    def __init__(self, alloc_stream: int) -> None:
        self.alloc_stream = alloc_stream
        self.accesses: list[Access] = []
        self.first_write: str | None = None  # the first op writing it after allocation
        self.storage: weakref.ref | None = None  # set when its allocation was seen
        self.written_on: set[int] = set()
        self.read_on: set[int] = set()


class History(NamedTuple):
    """One buffer's life, by stream name (see docs/design.md, the stream table)."""

    first_write: str | None
    allocated_on: str
    written_on: frozenset[str]
    read_on: frozenset[str]


class FakeEvent:
    def __init__(self, model: StreamModel, clock: Clock) -> None:
        self._model = model
        self.clock = clock
        self.device = torch.device("cpu")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._model.host_waits(self.clock)


class FakeStream:
    def __init__(self, model: StreamModel, index: int, name: str) -> None:
        self._model = model
        self.index = index
        self.name = name

    def wait_stream(self, other: FakeStream) -> None:
        self._model.merge(self.index, self._model.clocks[other.index])

    def wait_event(self, event: FakeEvent) -> None:
        self._model.merge(self.index, event.clock)

    def record_event(self) -> FakeEvent:
        return FakeEvent(self._model, dict(self._model.clocks[self.index]))

    def __enter__(self) -> FakeStream:
        self._model.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._model.stack.pop()

    def __repr__(self) -> str:
        return f"stream {self.name!r}"


class StreamModel(TorchDispatchMode):
    """Device ops for the engine (``current_stream``, ``new_stream``) and the
    dispatch mode that records and checks every access; see the module doc."""

    def __init__(self, *, waits: bool = True) -> None:
        super().__init__()
        self.waits = waits
        self.streams: list[FakeStream] = []
        self.clocks: list[Clock] = []
        self.compute = self._add_stream("current")
        self.stack: list[FakeStream] = [self.compute]
        self.buffers: dict[int, Buffer] = {}  # by storage data pointer
        self.violations: list[str] = []
        self.histories: list[History] = []  # of the buffers freed so far
        # The most buffers of a kind (the ops first writing them, see KINDS)
        # alive at once.
        self.peak_alive: dict[tuple[str, ...], int] = {}
        self.ops_by_stream: dict[str, int] = {}
        # Every c10d op: (name, the clock of its stream when it ran).
        self.collectives: list[tuple[str, Clock]] = []
        self.host_clock: Clock = {}  # what the host has synchronized with
        self.host_syncs = 0  # event.synchronize() calls: the host blocked
        self.pinned = 0  # pinned_empty() calls
        self.non_blocking_copies = 0  # copy_(..., non_blocking=True): the host does not wait
        self._pinned_by_pin: list[torch.Tensor] = []  # pin()'s copies

    # -- device ops (the engine's seam) ------------------------------------

    def current_stream(self) -> FakeStream:
        return self.stack[-1]

    def new_stream(self, name: str = "user") -> FakeStream:
        """fsdp2's comm streams are named by use ("all_gather"...); a test's own
        (an optimizer's, a hook's) are "user" streams."""
        return self._add_stream(name)

    def _add_stream(self, name: str) -> FakeStream:
        stream = FakeStream(self, len(self.streams), name)
        self.streams.append(stream)
        self.clocks.append({stream.index: 0})
        return stream

    def pinned_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for non-blocking copies (plain CPU memory here), counted."""
        self.pinned += 1
        return torch.empty(shape, dtype=dtype)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked memory, faked: a copy of ``tensor`` that ``is_pinned``
        knows (``tensor`` itself if it is one)."""
        if self.is_pinned(tensor):
            return tensor
        pinned = tensor.clone()
        self._pinned_by_pin.append(pinned)
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage came from ``pin``."""
        storage = tensor.untyped_storage()
        return any(p.untyped_storage() is storage for p in self._pinned_by_pin)

    def merge(self, index: int, clock: Clock) -> None:
        if not self.waits:
            return
        mine = self.clocks[index]
        for stream, tick in clock.items():
            if mine.get(stream, 0) < tick:
                mine[stream] = tick

    def host_waits(self, clock: Clock) -> None:
        self.host_syncs += 1
        for stream, tick in clock.items():
            if self.host_clock.get(stream, 0) < tick:
                self.host_clock[stream] = tick

    def host_may_read(self, tensor: torch.Tensor) -> bool:
        """Whether every non-blocking copy into ``tensor``'s bytes (a device's
        write to host memory) is ordered before what the host has synchronized
        with: only then may host code read it."""
        span = _byte_span(tensor)
        if span is None or (buffer := self.buffers.get(span[0])) is None:
            return True
        _, start, end = span
        return all(
            self.host_clock.get(a.stream, 0) >= a.tick
            for a in buffer.accesses
            if a.op == "copy_(non_blocking)" and a.start < end and start < a.end
        )

    def plug_into(self, model: nn.Module) -> None:
        """Makes every sharded module of ``model`` (before its first forward)
        run its streams and events through this model."""
        use_device_ops(model, self)  # type: ignore[arg-type]

    # -- points, for overlap -------------------------------------------------

    def point(self) -> tuple[int, int]:
        """Where the current stream is: (stream, ticks), the last op run on it."""
        index = self.current_stream().index
        return index, self.clocks[index][index]

    @staticmethod
    def clock_after(clock: Clock, point: tuple[int, int]) -> bool:
        """Whether an op that ran with ``clock`` was ordered after ``point``."""
        stream, tick = point
        return clock.get(stream, 0) >= tick

    def after(self, point: tuple[int, int]) -> bool:
        """Whether the current stream is ordered after ``point`` (its next op
        cannot start before the op at ``point`` has finished)."""
        stream, tick = point
        return self.clocks[self.current_stream().index].get(stream, 0) >= tick

    # -- the record --------------------------------------------------------

    def _ordered(self, access: Access, stream: int) -> bool:
        return access.stream == stream or self.clocks[stream].get(access.stream, 0) >= access.tick

    def _access(
        self,
        tensor: torch.Tensor,
        write: bool,
        op: str,
        stream: int,
        tick: int,
        allocation: bool = False,
    ) -> None:
        span = _byte_span(tensor)
        if span is None:
            return
        key, start, end = span
        buffer = self.buffers.get(key)
        if buffer is not None and _moved(buffer, key):
            # Its storage was resized to nothing (unseen) and the bytes went to
            # this one, whose allocation (a resize too) was not seen either.
            del self.buffers[key]
            self._forget(buffer)
            buffer = None
        if buffer is None:
            # First seen here, its allocation unseen (before the model, or a
            # storage resize): its storage is still watched, so that once it dies
            # or moves, bytes reused at its address start a history of their own.
            buffer = self.buffers[key] = Buffer(stream)
            buffer.storage = weakref.ref(tensor.untyped_storage())
        new = Access(stream, tick, start, end, write, op)
        for old in buffer.accesses:
            if (
                (old.write or write)
                and old.start < end
                and start < old.end
                and not self._ordered(old, stream)
            ):
                self.violations.append(
                    f"{op} {'writes' if write else 'reads'} on {self.streams[stream]} bytes "
                    f"[{start}, {end}) that {old.op} {'wrote' if old.write else 'read'} on "
                    f"{self.streams[old.stream]}, without waiting for it"
                )
        if write:
            buffer.written_on.add(stream)
            if buffer.first_write is None and not allocation:
                buffer.first_write = op
                kind = next((k for k in KINDS if op in k), (op,))
                alive = self._alive(kind)
                ceiling = max(2, self.peak_alive.get(kind, 0))
                if alive > ceiling:
                    # A new peak: not counting cyclic garbage that the collector
                    # has not reached yet (seen once in a while, source unknown),
                    # nor, for a few milliseconds, a finished collective's buffer
                    # that gloo's worker thread drops just after wait() returned
                    # (see ``alive``; seen once, HSDP, checkpointed,
                    # reshard_after_forward=2). Short: a real peak waits each time.
                    gc.collect()
                    alive = self._alive(kind)
                    for _ in range(5):
                        if alive <= ceiling:
                            break
                        time.sleep(0.002)
                        alive = self._alive(kind)
                self.peak_alive[kind] = max(self.peak_alive.get(kind, 0), alive)
        else:
            buffer.read_on.add(stream)
        if write:  # later accesses conflict with this one: older ones within it are implied
            buffer.accesses = [
                a for a in buffer.accesses if not (start <= a.start and a.end <= end)
            ]
        buffer.accesses.append(new)

    def _allocated(self, tensor: torch.Tensor, op: str, stream: int, tick: int) -> None:
        span = _byte_span(tensor)
        if span is None:
            return
        key = span[0]
        if (stale := self.buffers.get(key)) is not None:
            # Its storage was resized to nothing (unseen) and the bytes reused.
            self._forget(stale)
        buffer = self.buffers[key] = Buffer(stream)
        storage = tensor.untyped_storage()
        buffer.storage = weakref.ref(storage)
        weakref.finalize(storage, self._freed, key, buffer)
        self._access(tensor, True, op, stream, tick, allocation=True)

    def _freed(self, key: int, buffer: Buffer) -> None:
        if self.buffers.get(key) is not buffer:
            return  # already replaced by a storage at the same address
        del self.buffers[key]
        self._forget(buffer)
        for access in buffer.accesses:
            if not self._ordered(access, buffer.alloc_stream):
                self.violations.append(
                    f"a buffer allocated on {self.streams[buffer.alloc_stream]} was freed while "
                    f"{access.op} on {self.streams[access.stream]} may still "
                    f"{'write' if access.write else 'read'} it"
                )

    def _forget(self, buffer: Buffer) -> None:
        self.histories.append(self._history(buffer))

    def alive(self, *kind: str) -> int:
        """Buffers of ``kind`` (the first op writing them) alive now, after a
        collection (cyclic garbage the collector has not reached is not held).
        A count above 0 is read again for up to a second: gloo's worker thread
        may drop its references to a finished collective's tensors a moment
        after ``wait()`` returned (seen once, after an exception's reset); a
        buffer fsdp2 itself holds stays counted."""
        deadline = time.monotonic() + 1.0
        while True:
            gc.collect()
            count = self._alive(kind)
            if count == 0 or time.monotonic() > deadline:
                return count
            time.sleep(0.01)

    def _alive(self, kind: tuple[str, ...]) -> int:
        """Buffers of ``kind`` whose storage still holds bytes (a storage
        resized to nothing, or freed and not yet finalized, does not count)."""
        count = 0
        for buffer in self.buffers.values():
            if buffer.first_write in kind and buffer.storage is not None:
                storage = buffer.storage()
                count += storage is not None and storage.nbytes() > 0
        return count

    def _history(self, buffer: Buffer) -> History:
        def names(streams: set[int]) -> frozenset[str]:
            return frozenset(self.streams[s].name for s in streams)

        return History(
            buffer.first_write,
            self.streams[buffer.alloc_stream].name,
            names(buffer.written_on),
            names(buffer.read_on),
        )

    def all_histories(self) -> list[History]:
        """Of every buffer seen: freed, and still alive."""
        return self.histories + [self._history(b) for b in self.buffers.values()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **kwargs)  # DTensor's sharding propagation: no data
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            return NotImplemented  # a subclass unwraps itself; its ops come back here
        stream = self.current_stream()
        index = stream.index
        self.clocks[index][index] += 1
        tick = self.clocks[index][index]
        self.ops_by_stream[stream.name] = self.ops_by_stream.get(stream.name, 0) + 1
        op = str(func.overloadpacket.__name__)
        if func is torch.ops.aten.copy_.default and kwargs.get(
            "non_blocking", len(args) > 2 and args[2]
        ):
            op = "copy_(non_blocking)"  # between host and device, the host does not wait
            self.non_blocking_copies += 1
        if func is torch.ops.aten.cat.out:
            op = "cat(out=)"  # into a given buffer (the all-gather's copy-in), not a new one
        if not func.is_view:  # a view reads no bytes
            for tensor, write in _arguments(func, args, kwargs):
                self._access(tensor, write, op, index, tick)
        if func.namespace == "c10d":
            self.collectives.append((op, dict(self.clocks[index])))
        out = func(*args, **kwargs)
        for tensor in _fresh_outputs(func, out):
            self._allocated(tensor, op, index, tick)
        return out


def _moved(buffer: Buffer, key: int) -> bool:
    """Whether ``buffer``'s storage (if its allocation was seen) no longer
    holds the bytes at ``key``."""
    if buffer.storage is None:
        return False
    storage = buffer.storage()
    return storage is None or storage.nbytes() == 0 or storage.data_ptr() != key


def _byte_span(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    size = tensor.element_size()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.storage_offset() * size
    return storage.data_ptr(), start, start + (last + 1) * size


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return (x for x in leaves if isinstance(x, torch.Tensor))


def _arguments(func, args: tuple, kwargs: dict) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, written) for each tensor argument, as the op's schema says."""
    schema = func._schema
    c10d = func.namespace == "c10d"
    name = func.overloadpacket.__name__
    for i, argument in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        if c10d:
            write = argument.name == "output_tensor" or (
                argument.name == "tensors" and name != "send"
            )
        else:
            write = argument.alias_info is not None and argument.alias_info.is_write
        for tensor in _tensors(value):
            yield tensor, write


def _fresh_outputs(func, out: Any) -> Iterator[torch.Tensor]:
    """The outputs that are new storages (a return without alias info)."""
    if func.namespace == "c10d":
        return
    returns = func._schema.returns
    outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    for ret, value in zip(returns, outs, strict=False):
        if ret.alias_info is None:
            yield from _tensors(value)
