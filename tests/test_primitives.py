"""fsdp2's all-gather and reduce-scatter on gloo ([Note: collectives on gloo]
in fsdp2/comm/primitives.py) against torch's own, on 1 to 4 ranks.

Inputs are small integers, so every sum is exact in any order and the results
must be equal to torch's bit for bit; fsdp2's path is seen to run (W
broadcasts, W - 1 sends and receives), also under CommDebugMode on one rank,
which counts it as torch's all-gather and reduce-scatter; the choice
follows the group's backend, and torch's path calls ``torch.distributed``'s
functions (replaced ones too); and a user's point-to-point
messages on the same group while fsdp2's reduce-scatter is in flight are not
mixed up with its rows.
"""

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import labelled, run_ranks
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing import assert_close

from fsdp2.comm import primitives

c10d_ops = torch.ops.c10d

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 8, (numel,), generator=gen).to(dtype)


@contextlib.contextmanager
def _calls_of(*names: str) -> Iterator[dict[str, int]]:
    """Counts calls of ``torch.distributed.<name>`` (the building blocks of
    fsdp2's own path) while active."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _check_against_torch(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    collectives = primitives.collectives_for(group, "cpu")
    assert isinstance(collectives, primitives.GlooCollectives), type(collectives)
    shard_numel = 6  # per rank
    for salt, dtype in enumerate(DTYPES):
        for async_op in (True, False):
            with labelled(f"{dtype}, async_op={async_op}"):
                # All-gather: the input is this rank's block of the output (in
                # place, as the engine calls it) or a tensor of its own.
                expected = torch.empty(world_size * shard_numel, dtype=dtype)
                mine = _data(rank, shard_numel, dtype, salt)
                dist.all_gather_single(expected, mine, group=group)
                for in_place in (True, False):
                    output = torch.full_like(expected, 99)
                    if in_place:
                        input = output.narrow(0, rank * shard_numel, shard_numel)
                        input.copy_(mine)
                    else:
                        input = mine
                    with _calls_of("broadcast") as calls:
                        work = collectives.all_gather(output, input, async_op)
                    assert calls == {"broadcast": world_size}, calls
                    assert (work is None) == (not async_op)
                    if work is not None:
                        work.wait()
                    assert_close(output, expected, rtol=0, atol=0)

                # Reduce-scatter (SUM).
                full = _data(rank, world_size * shard_numel, dtype, salt + 10)
                expected = torch.empty(shard_numel, dtype=dtype)
                dist.reduce_scatter_single(expected, full.clone(), group=group)
                output = torch.full_like(expected, 99)
                with _calls_of("isend", "irecv") as calls:
                    work = collectives.reduce_scatter(output, full, async_op=async_op)
                peers = world_size - 1
                assert calls == {"isend": peers, "irecv": peers}, calls
                if work is not None:
                    assert isinstance(work.is_completed(), bool)
                    work.wait()
                    work.wait()  # a second wait adds nothing more
                assert_close(output, expected, rtol=0, atol=0)
                assert_close(full, _data(rank, world_size * shard_numel, dtype, salt + 10))

    with labelled("bytes: uint8 all-gather (fsdp2's buffer for float8 and mixed dtypes)"):
        mine = torch.arange(5, dtype=torch.uint8) + 10 * rank
        output = torch.empty(world_size * 5, dtype=torch.uint8)
        collectives.all_gather(output, mine)
        expected = torch.cat(
            [torch.arange(5, dtype=torch.uint8) + 10 * r for r in range(world_size)]
        )
        assert torch.equal(output, expected), output


def _observation_does_not_change_the_protocol(rank: int, world_size: int) -> None:
    """CommDebugMode on rank 0 only (a dispatch mode that torch's fully_shard
    does not care about) leaves fsdp2's path alone: the ranks still agree, and
    it counts one all-gather and one reduce-scatter, as torch's would."""
    group = dist.group.WORLD
    collectives = primitives.collectives_for(group, "cpu")
    full = torch.arange(2.0 * world_size) + rank
    expected = torch.empty(2)
    dist.reduce_scatter_single(expected, full.clone(), group=group)
    output, reduced = torch.empty(2 * world_size), torch.empty(2)
    with CommDebugMode() if rank == 0 else contextlib.nullcontext() as comm:
        collectives.all_gather(output, torch.full((2,), float(rank)))
        collectives.reduce_scatter(reduced, full)
    assert_close(output, torch.arange(world_size).repeat_interleave(2).float())
    assert_close(reduced, expected, rtol=0, atol=0)
    if rank == 0:  # what torch's collectives would show, not fsdp2's broadcasts and sends
        counts = comm.get_comm_counts()
        assert counts == {c10d_ops._allgather_base_: 1, c10d_ops._reduce_scatter_base_: 1}, counts


def _torch_collectives_on_gloo(rank: int, world_size: int) -> None:
    """torch's collectives on a gloo group (``Collectives``, what every other
    backend gets): ``torch.distributed``'s functions, looked up at call time,
    as CommDebugMode counts them."""
    group = dist.group.WORLD
    collectives = primitives.Collectives(group, "gloo")
    output, reduced = torch.empty(2 * world_size), torch.empty(2)
    with (
        _calls_of("all_gather_single", "reduce_scatter_single") as calls,
        CommDebugMode() as comm,
    ):
        collectives.all_gather(output, torch.full((2,), float(rank)))
        collectives.reduce_scatter(reduced, torch.ones(2 * world_size))
    assert calls == {"all_gather_single": 1, "reduce_scatter_single": 1}, calls
    counts = comm.get_comm_counts()
    assert counts[c10d_ops._allgather_base_] == 1, counts
    assert counts[c10d_ops._reduce_scatter_base_] == 1, counts
    assert counts[c10d_ops.broadcast_] == 0, counts
    assert_close(output, torch.arange(world_size).repeat_interleave(2).float())
    assert_close(reduced, torch.full((2,), float(world_size)))
    # torch before 2.13 (a GPU machine's own build) has only the older names.
    newer = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for name in newer:
        delattr(dist, name)
    try:
        older = ("all_gather_into_tensor", "reduce_scatter_tensor")
        with _calls_of(*older) as calls, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in 2.13
            collectives.all_gather(output, torch.full((2,), float(rank + 1)))
            collectives.reduce_scatter(reduced, torch.full((2 * world_size,), 2.0))
    finally:
        for name, function in newer.items():
            setattr(dist, name, function)
    assert calls == dict.fromkeys(older, 1), calls
    assert_close(output, torch.arange(1, world_size + 1).repeat_interleave(2).float())
    assert_close(reduced, torch.full((2,), 2.0 * world_size))


def _training_counts_equal_torch(rank: int, world_size: int) -> None:
    """One training step under CommDebugMode: fsdp2's counts, in total and per
    module and pass, are torch's fully_shard's (the same-model check's
    all-reduce in the root's first forward runs unseen by dispatch modes)."""
    from models import build_model, global_batch, local_batch, mean_loss, shard_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only

    import fsdp2

    mesh = init_device_mesh("cpu", (world_size,))
    batch = local_batch(global_batch("transformer_untied", 0), rank, world_size)
    seen = []
    for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
        model = shard_model(build_model("transformer_untied"), fully_shard, mesh=mesh)
        with CommDebugMode() as comm:
            mean_loss(model, *batch).backward()
        per_module = {
            name: {p: dict(counts) for p, counts in passes.items()}
            for name, passes in comm.comm_module_counts.items()
        }
        seen.append((dict(comm.get_comm_counts()), per_module))
    counts = seen[0][0]
    assert counts[c10d_ops._allgather_base_] > 0 and counts[c10d_ops._reduce_scatter_base_] > 0
    assert c10d_ops.allreduce_ not in counts, counts
    assert seen[0] == seen[1], seen


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
    collectives = primitives.collectives_for(group, "cpu")
    if rank == 0:
        user = dist.irecv(message, src=1)
        work = collectives.reduce_scatter(output, full, async_op=True)
    else:
        work = collectives.reduce_scatter(output, full, async_op=True)
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
def test_observation_does_not_change_the_protocol(tmp_path: Path) -> None:
    """A dispatch mode on one rank does not change fsdp2's collectives (the
    ranks would part)."""
    run_ranks(_observation_does_not_change_the_protocol, 2, tmp_path)


@pytest.mark.distributed
def test_comm_debug_mode_counts_training_as_torch(tmp_path: Path) -> None:
    """CommDebugMode over a forward and backward counts fsdp2's collectives as
    it counts torch's fully_shard's (2 ranks, every block sharded)."""
    run_ranks(_training_counts_equal_torch, 2, tmp_path)


@pytest.mark.distributed
def test_torch_collectives_on_a_gloo_group(tmp_path: Path) -> None:
    """torch's path calls torch.distributed's collectives (a replaced one too),
    as CommDebugMode counts them."""
    run_ranks(_torch_collectives_on_gloo, 2, tmp_path)


@pytest.mark.parametrize(
    ("backend", "device_type", "chosen", "backend_for_device"),
    [
        ("gloo", "cpu", "GlooCollectives", "gloo"),
        ("cpu:gloo,cuda:nccl", "cpu", "GlooCollectives", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "Collectives", "nccl"),
        ("nccl", "cuda", "Collectives", "nccl"),
        ("fake", "cpu", "Collectives", "fake"),
    ],
)
def test_collectives_chosen_from_the_backend(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    device_type: str,
    chosen: str,
    backend_for_device: str,
) -> None:
    """fsdp2's own collectives on a CPU gloo group only; torch's everywhere else."""
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    collectives = primitives.collectives_for(None, device_type)  # type: ignore[arg-type]
    assert type(collectives).__name__ == chosen
    assert collectives.backend == backend_for_device


@pytest.mark.distributed
def test_user_point_to_point_does_not_match_fsdp2_rows(tmp_path: Path) -> None:
    """fsdp2's reduce-scatter sends with a tag of its own: a user's messages on
    the same group in the meantime reach the user."""
    run_ranks(_user_messages_during_reduce_scatter, 2, tmp_path)
