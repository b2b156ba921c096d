"""fsdp2's all-gather and reduce-scatter on gloo ([Note: collectives on gloo]
in fsdp2/primitives.py) against torch's own, on 1 to 4 ranks.

Inputs are small integers, so every sum is exact in any order and the results
must be equal to torch's bit for bit; torch's collectives must not be called
(the gloo path is taken), and a user's point-to-point messages on the same
group while fsdp2's reduce-scatter is in flight must not be mixed up with its
rows.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import labelled, run_ranks
from torch.testing import assert_close

from fsdp2 import primitives

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 8, (numel,), generator=gen).to(dtype)


def _torch_forbidden(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"torch's {name} was called: the gloo path was not taken")

    return refuse


def _check_against_torch(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    shard_numel = 6  # per rank
    torch_all_gather, torch_reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single
    for salt, dtype in enumerate(DTYPES):
        for async_op in (True, False):
            with labelled(f"{dtype}, async_op={async_op}"):
                # All-gather: the input is this rank's block of the output (in
                # place, as the engine calls it) or a tensor of its own.
                expected = torch.empty(world_size * shard_numel, dtype=dtype)
                mine = _data(rank, shard_numel, dtype, salt)
                torch_all_gather(expected, mine, group=group)
                for in_place in (True, False):
                    output = torch.full_like(expected, 99)
                    if in_place:
                        input = output.narrow(0, rank * shard_numel, shard_numel)
                        input.copy_(mine)
                    else:
                        input = mine
                    dist.all_gather_single = _torch_forbidden("all_gather_single")
                    try:
                        work = primitives.all_gather_single(output, input, group, async_op)
                    finally:
                        dist.all_gather_single = torch_all_gather
                    assert (work is None) == (not async_op)
                    if work is not None:
                        work.wait()
                    assert_close(output, expected, rtol=0, atol=0)

                # Reduce-scatter (SUM).
                full = _data(rank, world_size * shard_numel, dtype, salt + 10)
                expected = torch.empty(shard_numel, dtype=dtype)
                torch_reduce_scatter(expected, full.clone(), group=group)
                output = torch.full_like(expected, 99)
                dist.reduce_scatter_single = _torch_forbidden("reduce_scatter_single")
                try:
                    work = primitives.reduce_scatter_single(output, full, group, async_op)
                finally:
                    dist.reduce_scatter_single = torch_reduce_scatter
                if work is not None:
                    assert isinstance(work.is_completed(), bool)
                    work.wait()
                    work.wait()  # a second wait adds nothing more
                assert_close(output, expected, rtol=0, atol=0)
                assert_close(full, _data(rank, world_size * shard_numel, dtype, salt + 10))

    with labelled("bytes: uint8 all-gather (fsdp2's buffer for float8 and mixed dtypes)"):
        mine = torch.arange(5, dtype=torch.uint8) + 10 * rank
        output = torch.empty(world_size * 5, dtype=torch.uint8)
        primitives.all_gather_single(output, mine, group)
        expected = torch.cat(
            [torch.arange(5, dtype=torch.uint8) + 10 * r for r in range(world_size)]
        )
        assert torch.equal(output, expected), output


def _user_messages_during_reduce_scatter(rank: int, world_size: int) -> None:
    """Rank 0 posts a receive from rank 1 (default tag) before fsdp2's
    reduce-scatter starts; rank 1 sends it after its reduce-scatter started.
    Messages are matched per peer and tag in issue order, so with a shared tag
    rank 0's receive would get fsdp2's row and fsdp2 the user's message."""
    group = dist.group.WORLD
    full = _data(rank, world_size * 4, torch.float32, 7)
    expected = torch.empty(4)
    dist.reduce_scatter_single(expected, full.clone(), group=group)
    output = torch.empty(4)
    message = torch.full((4,), 1000.0)
    if rank == 0:
        user = dist.irecv(message, src=1)
        work = primitives.reduce_scatter_single(output, full, group, async_op=True)
    else:
        work = primitives.reduce_scatter_single(output, full, group, async_op=True)
        user = dist.isend(message.add_(1), dst=0)
    user.wait()
    work.wait()
    assert_close(output, expected, rtol=0, atol=0)
    assert_close(message, torch.full((4,), 1001.0), rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gloo_collectives_equal_torch(world_size: int, tmp_path: Path) -> None:
    """fsdp2's all-gather (one broadcast per rank) and reduce-scatter (point to
    point, then local sums) give exactly torch's results, sync and async, in
    float32, bfloat16, float64 and bytes, without calling torch's."""
    run_ranks(_check_against_torch, world_size, tmp_path)


@pytest.mark.distributed
def test_user_point_to_point_does_not_match_fsdp2_rows(tmp_path: Path) -> None:
    """fsdp2's reduce-scatter sends with a tag of its own: a user's messages on
    the same group in the meantime reach the user."""
    run_ranks(_user_messages_during_reduce_scatter, 2, tmp_path)
