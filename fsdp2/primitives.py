"""The all-gather and the reduce-scatter that every fsdp2 collective goes through.

``all_gather_single`` and ``reduce_scatter_single`` take torch's arguments and
run torch's collectives, except for CPU tensors on a gloo group, where they are
built from gloo's cheaper collectives. Tests record fsdp2's collectives by
replacing these two names (the callers look them up at call time).

[Note: collectives on gloo]
gloo (torch's CPU backend) has no reduce-scatter of its own. torch's
``reduce_scatter_single`` on gloo clones the whole input on the calling
thread, all-reduces the clone, and copies this rank's rows out when waited:
the bytes of an all-reduce (twice a reduce-scatter's) plus a full-size copy
and allocation. Its ``all_gather_single`` gathers into a temporary buffer the
size of the output and copies that into the output on gloo's thread. On a
CPU, every one of those copies comes out of the cores that compute.

For CPU tensors on a gloo group fsdp2 runs instead:

- reduce-scatter = row k of the input sent to rank k (point to point), the
  rows received straight into the output (the first) and a buffer of
  ``W - 2`` rows (the others: none on 2 ranks), then, when waited, this rank's
  own row and the buffered ones added to the output: a reduce-scatter's bytes,
  no clone;
- all-gather = one broadcast per rank, rank k's from its own block of the
  output (the all-gather input is that block), each written in place by gloo:
  no temporary, no copy.

Every rank must take the same path for the same call, or the ranks would
wait for different messages: the choice depends only on the group's backend,
the tensors' device, the environment variable ``FSDP2_TORCH_COLLECTIVES=1``
(torch's collectives everywhere, for tools that must see them) and whether
``dist.all_gather_single`` / ``dist.reduce_scatter_single`` have been
replaced (then the replacement is called, as torch's fully_shard would:
torch's test helpers delay or count collectives that way, on every rank). It
never depends on what a rank alone observes. What a rank's dispatch modes
(``CommDebugMode`` among them) see is the collective it implements, one
``c10d._allgather_base_`` or ``c10d._reduce_scatter_base_``, as with torch's
(``private_api.run_as_collective``); ``fsdp2.comm_stats`` counts both too.

Per rank on 2 ranks, 12 MiB (3.1 M float32, a dim-512 block), CPU time of all
of the process's threads: reduce-scatter 10.8 ms -> 5.8 ms, all-gather
6.3 ms -> 4.0 ms; on 4 ranks 14.7-16.3 -> 4.5 and 7.6 -> 4.3 ms (see
docs/performance.md). Everywhere else (NCCL and other backends, custom
collectives, accelerator tensors on a gloo group) the backend's own
collectives run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from .private_api import run_as_collective


class Waitable(Protocol):
    """What an asynchronous collective returns: a ``dist.Work``, or a
    ``JoinedWork`` on gloo."""

    def is_completed(self) -> bool: ...

    def wait(self) -> bool: ...


# torch's, as imported: a tool or test that replaces them (to count or delay
# collectives) gets its replacement called.
_TORCH_ALL_GATHER = dist.all_gather_single
_TORCH_REDUCE_SCATTER = dist.reduce_scatter_single
# Set in the environment of every rank: torch's collectives on gloo too.
_TORCH_COLLECTIVES_ONLY = os.environ.get("FSDP2_TORCH_COLLECTIVES", "0") == "1"


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> Waitable | None:
    """Gathers every rank's ``input`` into ``output`` (1D or rank-major along
    dim 0), as ``dist.all_gather_single``."""
    if dist.all_gather_single is _TORCH_ALL_GATHER and _own_path(group, output):
        return run_as_collective(
            lambda: _finish(_gloo_all_gather(output, input, group), async_op),
            "all_gather",
            output,
            input,
            group,
        )
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = False,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> Waitable | None:
    """Reduces ``input`` (1D, rank-major) over the ranks with ``op`` and leaves
    this rank's block in ``output``, as ``dist.reduce_scatter_single``."""
    own = op == dist.ReduceOp.SUM and _own_path(group, input)  # gloo's: a sum
    if dist.reduce_scatter_single is _TORCH_REDUCE_SCATTER and own:
        return run_as_collective(
            lambda: _finish(_gloo_reduce_scatter(output, input, group), async_op),
            "reduce_scatter",
            output,
            input,
            group,
        )
    return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def _own_path(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """CPU tensors on a gloo group, unless ``FSDP2_TORCH_COLLECTIVES=1``."""
    if tensor.device.type != "cpu" or _TORCH_COLLECTIVES_ONLY:
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


# Point-to-point messages are matched by (peer, tag) in issue order: a tag of
# fsdp2's own keeps a user's sends on the same group from matching its rows.
_TAG = 0x46534450


class JoinedWork:
    """Several gloo works waited as one, then ``finish`` (run once, on the
    waiting thread). Waiting again returns at once: gloo's point-to-point
    works must be waited exactly once (a second wait blocks until timeout)."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None) -> None:
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
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> JoinedWork:
    """One broadcast per rank, each into its block of ``output``."""
    world_size, rank = group.size(), group.rank()
    blocks = output.view(-1).chunk(world_size)
    if blocks[rank].data_ptr() != input.data_ptr():
        blocks[rank].copy_(input)
    works = [
        dist.broadcast(block, group=group, group_src=src, async_op=True)
        for src, block in enumerate(blocks)
    ]
    return JoinedWork(works)


def _gloo_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
) -> JoinedWork:
    """Row k of ``input`` sent to rank k; the first peer's row received into
    ``output``, the others' into a buffer; when waited, this rank's own row and
    the buffered ones added to ``output``."""
    world_size, rank = group.size(), group.rank()
    rows = input.view(world_size, -1)
    if world_size == 1:
        output.copy_(rows[0])
        return JoinedWork([])
    peers = [(rank + i) % world_size for i in range(1, world_size)]
    # 2 ranks (the common CPU case) need no buffer at all.
    received = [output, *torch.empty_like(rows[2:]).unbind(0)]
    works = [
        _issued(dist.isend(rows[peer], group=group, group_dst=peer, tag=_TAG)) for peer in peers
    ]
    works += [
        _issued(dist.irecv(into, group=group, group_src=peer, tag=_TAG))
        for peer, into in zip(peers, received, strict=True)
    ]

    def add_rows() -> None:  # the same order on every run
        output.add_(rows[rank])
        for row in received[1:]:
            output.add_(row)

    return JoinedWork(works, add_rows)


def _issued(work: dist.Work | None) -> dist.Work:
    # torch returns None to ranks outside the group, which never get here.
    if work is None:
        raise AssertionError("a point-to-point call on a rank of its group returned no work")
    return work


def _finish(work: JoinedWork, async_op: bool) -> JoinedWork | None:
    if async_op:
        return work
    work.wait()
    return None
