"""The collectives of one process group: torch's, or on gloo fsdp2's own.

Every all-gather, reduce-scatter and all-reduce fsdp2 makes goes through a
``Collectives`` object bound to one process group, chosen once per group by
``collectives_for`` from the group's backend for the device: on a CPU gloo
group ``GlooCollectives``, everywhere else torch's (``Collectives``).

[Note: collectives on gloo]
gloo has no reduce-scatter: torch's clones the input, all-reduces the clone
(twice a reduce-scatter's bytes) and copies this rank's rows out; its
all-gather goes through a temporary the size of the output. On a CPU those
copies come out of the cores that compute. ``GlooCollectives`` instead

- reduce-scatters by sending row k of the input to rank k (point to point),
  receiving the rows straight into the output (the first) and a buffer of
  ``W - 2`` rows, and adding them when waited: a reduce-scatter's bytes;
- all-gathers with one broadcast per rank into its block of the output.

Every rank takes the same path for the same group (the choice depends on the
group alone), or ranks would wait for different messages. Dispatch modes
(``CommDebugMode``, the tests' stream model) still see the one c10d
collective each call implements (``private_dist.run_as_collective``); the
gain is measured in docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from ..base.private_dist import group_timeout, run_as_collective

ReduceOp = dist.ReduceOp | dist.ReduceOp.RedOpType


class Waitable(Protocol):
    """What an asynchronous collective returns: a ``dist.Work``, or a
    ``JoinedWork`` on gloo."""

    def is_completed(self) -> bool: ...

    def wait(self) -> bool: ...


def backend_for(process_group: dist.ProcessGroup, device_type: str) -> str:
    """The backend that runs ``process_group``'s collectives on ``device_type``:
    "nccl" from ``dist.get_backend``'s "nccl" or "cpu:gloo,cuda:nccl"."""
    backend = str(dist.get_backend(process_group))
    for part in backend.split(","):
        part_device, _, name = part.rpartition(":")
        if part_device == device_type:
            return name
    return backend


class Collectives:
    """torch's collectives on one process group (``backend``: its backend for
    ``device_type``, the device the engine's tensors are on; ``role``: what
    the group is to fsdp2, e.g. "replicate group", for messages)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        backend: str,
        device_type: str = "cpu",
        role: str = "process group",
    ) -> None:
        self.process_group = process_group
        self.backend = backend
        self.device_type = device_type
        self.role = role

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer for one of these collectives (custom_comm.py's come
        from the user's collective)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Waitable | None:
        """Gathers every rank's ``input`` into ``output`` (rank-major along dim 0)."""
        gather = _torch_collective("all_gather_single", "all_gather_into_tensor")
        return gather(output, input, group=self.process_group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Waitable | None:
        """Reduces ``input`` (rank-major) over the ranks with ``op``; this rank's
        block lands in ``output``."""
        scatter = _torch_collective("reduce_scatter_single", "reduce_scatter_tensor")
        return scatter(output, input, op=op, group=self.process_group, async_op=async_op)

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = dist.ReduceOp.SUM, async_op: bool = False
    ) -> Waitable | None:
        return dist.all_reduce(tensor, op=op, group=self.process_group, async_op=async_op)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Waitable | None:
        """Sends block k of ``input`` (dim 0 split in W) to rank k; block k of
        ``output`` receives rank k's (compressed gradients, compressed.py)."""
        return dist.all_to_all_single(output, input, group=self.process_group, async_op=async_op)


def _torch_collective(name: str, before_2_13: str) -> Callable[..., Waitable | None]:
    """``torch.distributed.<name>``, looked up at call time; torch before 2.13
    (e.g. a GPU machine's own build) has it only under its older name."""
    return getattr(dist, name, None) or getattr(dist, before_2_13)


class GlooCollectives(Collectives):
    """fsdp2's all-gather and summing reduce-scatter on a CPU gloo group (see
    [Note: collectives on gloo]); other ops are torch's."""

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Waitable | None:
        process_group = self.process_group
        return run_as_collective(
            lambda: _finish(_gloo_all_gather(output, input, process_group), async_op),
            "all_gather",
            output,
            input,
            process_group,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Waitable | None:
        if op != dist.ReduceOp.SUM:
            return super().reduce_scatter(output, input, op, async_op)
        process_group = self.process_group
        return run_as_collective(
            lambda: _finish(_gloo_reduce_scatter(output, input, process_group), async_op),
            "reduce_scatter",
            output,
            input,
            process_group,
        )


def collectives_for(
    process_group: dist.ProcessGroup, device_type: str, role: str = "process group"
) -> Collectives:
    """The collectives of ``process_group`` for tensors on ``device_type``;
    ``role`` names the group in messages (e.g. "shard group")."""
    backend = backend_for(process_group, device_type)
    if device_type == "cpu" and backend == "gloo":
        return GlooCollectives(process_group, backend, device_type, role)
    return Collectives(process_group, backend, device_type, role)


# Point-to-point messages are matched by (peer, tag) in issue order: a tag of
# fsdp2's own keeps a user's sends on the same group from matching its rows.
_TAG = 0x46534450


class JoinedWork:
    """Several gloo works waited as one, then ``finish`` (run once, on the
    waiting thread). Waiting again returns at once: gloo's point-to-point
    works must be waited exactly once (a second wait blocks until timeout)."""

    def __init__(self, works: Sequence[Waitable], finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._finish = finish
        self._done = False

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)

    def wait(self) -> bool:
        if self._done:
            return True
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True
        return True


def _gloo_all_gather(
    output: torch.Tensor, input: torch.Tensor, process_group: dist.ProcessGroup
) -> JoinedWork:
    """One broadcast per rank, each into its block of ``output``."""
    world_size, rank = process_group.size(), process_group.rank()
    blocks = output.view(-1).chunk(world_size)
    if blocks[rank].data_ptr() != input.data_ptr():
        blocks[rank].copy_(input)
    works = [
        dist.broadcast(block, group=process_group, group_src=src, async_op=True)
        for src, block in enumerate(blocks)
    ]
    return JoinedWork(works)


def _gloo_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, process_group: dist.ProcessGroup
) -> JoinedWork:
    """Row k of ``input`` sent to rank k; the first peer's row received into
    ``output``, the others' into a buffer; when waited, this rank's own row and
    the buffered ones added to ``output``."""
    world_size, rank = process_group.size(), process_group.rank()
    rows = input.view(world_size, -1)
    if world_size == 1:
        output.copy_(rows[0])
        return JoinedWork([])
    peers = [(rank + i) % world_size for i in range(1, world_size)]
    # 2 ranks (the common CPU case) need no buffer at all.
    received = [output, *torch.empty_like(rows[2:]).unbind(0)]
    works = [
        _issued(dist.isend(rows[peer], group=process_group, group_dst=peer, tag=_TAG))
        for peer in peers
    ]
    works += [
        _issued(dist.irecv(into, group=process_group, group_src=peer, tag=_TAG))
        for peer, into in zip(peers, received, strict=True)
    ]

    def add_rows() -> None:  # the same order on every run
        output.add_(rows[rank])
        for row in received[1:]:
            output.add_(row)

    timeout = group_timeout(process_group, "cpu")
    return JoinedWork([_PointToPoint(work, timeout) for work in works], add_rows)


def _issued(work: dist.Work | None) -> dist.Work:
    # torch returns None to ranks outside the group, which never get here.
    if work is None:
        raise AssertionError("a point-to-point call on a rank of its group returned no work")
    return work


class _PointToPoint:
    """A gloo send or receive, waited with its group's timeout: without one
    its wait() never gives up, and a peer that stopped (alive, sending
    nothing) would block this rank forever where a collective times out."""

    def __init__(self, work: dist.Work, timeout: timedelta | None) -> None:
        self._work = work
        self._timeout = timeout

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> bool:
        if self._timeout is None:
            return self._work.wait()
        return self._work.wait(self._timeout)


def _finish(work: JoinedWork, async_op: bool) -> JoinedWork | None:
    if async_op:
        return work
    work.wait()
    return None
