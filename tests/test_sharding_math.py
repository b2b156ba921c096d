"""Sharding arithmetic and buffer layouts, checked without communication.

Every rank of a world is simulated in this one process: the FSDPParams of rank
r are built from the same original tensors with a ``MeshInfo`` whose
``shard_rank`` is r, and the engine's own copy-in/copy-out code runs for each.
The collective itself is replaced by a few lines that do what it would do to
the per-rank buffers. A "fake" process group (world size 8, this process is
rank 0) provides real 1D meshes of sizes 1..8 for ``DTensor.from_local``; its
collectives move no data, so they are never relied on here.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist import fake_world
from error_model import assert_within, rank_mean_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2 import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from fsdp2.base.private_api import chunk_cat_
from fsdp2.comm.all_gather import AllGatherComm, params_inputs
from fsdp2.comm.context import CommKind, InFlight
from fsdp2.comm.divide import divide_plan
from fsdp2.comm.layout import ShardLayout
from fsdp2.comm.mesh_info import MeshInfo, chunk_rows
from fsdp2.comm.primitives import collectives_for
from fsdp2.comm.reduce_scatter import ReduceInFlight, ReduceScatterComm
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.reduction import assign_sharded_grads, average

MAX_WORLD_SIZE = 8
CPU = torch.device("cpu")
NO_MP = MixedPrecisionPolicy()
NO_OFFLOAD = OffloadPolicy()


@pytest.fixture(scope="module")
def meshes() -> Iterator[dict[int, DeviceMesh]]:
    """A 1D mesh over ranks ``0..ws-1`` for every world size ``ws`` in 1..8."""
    with fake_world(MAX_WORLD_SIZE):
        yield {ws: DeviceMesh("cpu", torch.arange(ws)) for ws in range(1, MAX_WORLD_SIZE + 1)}


# -- helpers ---------------------------------------------------------------


def mesh_info(mesh: DeviceMesh, rank: int) -> MeshInfo:
    """The MeshInfo rank ``rank`` of ``mesh`` would resolve (this process is rank 0)."""
    return MeshInfo(
        mesh=mesh,
        shard_axis=0,
        shard_group=mesh.get_group(0),
        shard_world_size=mesh.size(0),
        shard_rank=rank,
    )


def build_param(orig: torch.Tensor, name: str, info: MeshInfo, whole: bool = False) -> FSDPParam:
    param = nn.Parameter(orig.clone())
    layout = ShardLayout.of(param, info, whole=whole)
    return FSDPParam(param, name, [], layout, info, CPU, NO_MP, NO_OFFLOAD)


def build_params(origs: list[torch.Tensor], mesh: DeviceMesh, rank: int) -> list[FSDPParam]:
    info = mesh_info(mesh, rank)
    return [build_param(t, f"p{i}", info) for i, t in enumerate(origs)]


def reduce_scatter(
    params: list[FSDPParam], grads: list[torch.Tensor], mesh: DeviceMesh, plan
) -> ReduceInFlight:
    """The engine's reduce-scatter of ``grads``, run by one simulated rank."""
    world_size = mesh.size(0)
    variant = ReduceScatterComm(
        collectives_for(mesh.get_group(0), "cpu"), world_size, world_size > 1
    )
    return variant.start(params, grads, plan, SyncComm(), "")  # type: ignore[arg-type]


def chunk_of(t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """``torch.chunk(t, world_size)[rank]``, or no rows for ranks past the last chunk."""
    chunks = torch.chunk(t, world_size)
    return chunks[rank] if rank < len(chunks) else t[:0]


class SyncComm:
    """Stands in for ``CommContext``: runs the collective at once, leaves nothing in flight."""

    device = CPU
    ops = None
    uses_streams = False

    def done_here(self) -> InFlight:
        return InFlight.done()

    def issue(
        self,
        kind: CommKind,
        group_name: str,
        on: object,
        nbytes: int,
        collective: Callable[[bool], object],
        after: tuple = (),
    ) -> InFlight:
        collective(False)
        return InFlight(work=None, event=None, ops=None, label=kind.label, stats=None)


@contextmanager
def recording(name: str) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, object]]]:
    """Replaces ``dist.<name>`` with a no-op that records ``(output, input, group)``."""
    calls: list[tuple[torch.Tensor, torch.Tensor, object]] = []

    def fake(output, input, *, group=None, async_op=False, **kwargs):
        assert not async_op
        calls.append((output, input, group))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, name, fake)
        yield calls


def random_tensors(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int, integer_valued: bool = False
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if integer_valued:  # small integers: sums over ranks are exact in every dtype used
        return [torch.randint(-4, 5, s, generator=gen).to(dtype) for s in shapes]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def all_gather_round_trip(origs: list[torch.Tensor], mesh: DeviceMesh) -> list[list[FSDPParam]]:
    """Runs every rank's copy-in, simulates the all-gather, runs every rank's copy-out.

    Checks each rank's block of the all-gather buffer against the layout in
    all_gather.py's docstring; padding is overwritten with NaN before the
    exchange, so any padding that leaked into an unsharded parameter shows.
    """
    world_size = mesh.size(0)
    per_rank = [build_params(origs, mesh, rank) for rank in range(world_size)]
    collectives = collectives_for(mesh.get_group(0), "cpu")
    with recording("all_gather_single") as calls:
        results = [
            AllGatherComm(collectives, rank, world_size, world_size > 1).gather(
                params_inputs(params),
                SyncComm(),  # type: ignore[arg-type]
                "",
            )
            for rank, params in enumerate(per_rank)
        ]
    if world_size == 1:  # a world of one rank exchanges nothing: the input is the output
        assert calls == []
        results[0].copy_out([out for p in per_rank[0] for out in p.all_gather_outputs(1)])
        return per_rank
    assert len(calls) == world_size

    shard_numel = sum(p.layout.slot_numel for p in per_rank[0])
    blocks = []
    for rank, (output, input, group) in enumerate(calls):
        assert group is mesh.get_group(0)
        assert output is results[rank].all_gather_output
        assert output.shape == (world_size * shard_numel,)
        # Gathered in place: the input is this rank's block of the output.
        assert input.numel() == shard_numel
        assert input.data_ptr() == output.data_ptr() + rank * shard_numel * output.element_size()
        block, offset = input.clone(), 0
        for fsdp_param, orig in zip(per_rank[rank], origs, strict=True):
            local, padded = fsdp_param.layout.local_numel, fsdp_param.layout.slot_numel
            expected = chunk_of(orig, world_size, rank).flatten()
            assert torch.equal(block[offset : offset + local], expected)
            block[offset + local : offset + padded] = float("nan")
            offset += padded
        assert offset == shard_numel
        blocks.append(block)

    gathered = torch.stack(blocks)
    for rank, (output, _, _) in enumerate(calls):
        output.view(world_size, shard_numel).copy_(gathered)
        results[rank].copy_out(
            [out for p in per_rank[rank] for out in p.all_gather_outputs(world_size)]
        )
    return per_rank


# -- properties ------------------------------------------------------------

shapes = st.tuples(st.integers(0, 40), st.lists(st.integers(1, 5), max_size=2)).map(
    lambda dims: (dims[0], *dims[1])
)
nonempty_shapes = shapes.filter(lambda shape: shape[0] > 0)
world_sizes = st.integers(1, MAX_WORLD_SIZE)
float_dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])
seeds = st.integers(0, 2**31 - 1)


def test_chunk_rows_is_torch_chunk_size() -> None:
    """Exhaustive over dim0 in 0..40 and world sizes 1..8 (cheaper than sampling)."""
    for dim0 in range(41):
        t = torch.empty(dim0)
        for world_size in range(1, MAX_WORLD_SIZE + 1):
            rows = [chunk_of(t, world_size, rank).size(0) for rank in range(world_size)]
            assert sum(rows) == dim0
            slot = chunk_rows(dim0, world_size)
            assert all(r <= slot for r in rows)
            # The padded slot is torch.chunk's chunk size: no larger than needed.
            assert slot * world_size >= dim0
            assert (slot - 1) * world_size < dim0 or slot == 0


@settings(max_examples=50, deadline=None)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    world_size=world_sizes,
    dtype=float_dtypes,
    seed=seeds,
)
def test_sharded_param_is_torch_chunk(
    meshes: dict[int, DeviceMesh],
    shape_list: list[tuple[int, ...]],
    world_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    mesh = meshes[world_size]
    origs = random_tensors(shape_list, dtype, seed)
    for rank in range(world_size):
        for fsdp_param, orig in zip(build_params(origs, mesh, rank), origs, strict=True):
            param = fsdp_param.sharded_param
            assert isinstance(param, DTensor) and param.placements == (Shard(0),)
            assert param.shape == orig.shape and param.stride() == orig.stride()
            expected = chunk_of(orig, world_size, rank)
            assert torch.equal(param.to_local(), expected)
            assert fsdp_param.layout.local_numel == expected.numel()
            row_numel = math.prod(orig.shape[1:])
            slot = chunk_rows(orig.size(0), world_size) * row_numel
            assert fsdp_param.layout.slot_numel == slot


@settings(max_examples=50, deadline=None)
@given(
    shape_list=st.lists(shapes, min_size=1, max_size=4),
    world_size=world_sizes,
    dtype=float_dtypes,
    seed=seeds,
)
def test_all_gather_round_trip_is_exact(
    meshes: dict[int, DeviceMesh],
    shape_list: list[tuple[int, ...]],
    world_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    origs = random_tensors(shape_list, dtype, seed)
    for params in all_gather_round_trip(origs, meshes[world_size]):
        for fsdp_param, orig in zip(params, origs, strict=True):
            unsharded = fsdp_param.unsharded_param
            assert isinstance(unsharded, nn.Parameter) and not isinstance(unsharded, DTensor)
            assert unsharded.dtype == orig.dtype
            assert torch.equal(unsharded, orig)


@settings(max_examples=50, deadline=None)
@given(
    shape_list=st.lists(nonempty_shapes, min_size=1, max_size=4),
    world_size=world_sizes,
    dtype=float_dtypes,
    seed=seeds,
)
def test_chunk_cat_lays_out_chunk_k_in_row_k(
    meshes: dict[int, DeviceMesh],
    shape_list: list[tuple[int, ...]],
    world_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """dim0 >= 1 only: see test_reduce_scatter_with_zero_row_gradient."""
    mesh = meshes[world_size]
    grads = random_tensors(shape_list, dtype, seed)
    per_rank = [build_params(grads, mesh, rank) for rank in range(world_size)]
    padded = [p.layout.slot_numel for p in per_rank[0]]
    assert all([p.layout.slot_numel for p in params] == padded for params in per_rank)

    out = torch.full((world_size, sum(padded)), float("nan"), dtype=dtype)
    chunk_cat_(grads, world_size, out=out)
    for rank in range(world_size):
        slots = out[rank].split(padded)
        for fsdp_param, grad, slot in zip(per_rank[rank], grads, slots, strict=True):
            expected = chunk_of(grad, world_size, rank).flatten()
            assert torch.equal(slot[: fsdp_param.layout.local_numel], expected)


@settings(max_examples=50, deadline=None)
@given(
    shape_list=st.lists(nonempty_shapes, min_size=1, max_size=4),
    world_size=world_sizes,
    dtype=float_dtypes,
    seed=seeds,
)
def test_reduce_scatter_gives_each_rank_its_chunk_of_the_mean(
    meshes: dict[int, DeviceMesh],
    shape_list: list[tuple[int, ...]],
    world_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Rank r's sharded grad is ``torch.chunk(mean over ranks of the grads, W)[r]``."""
    mesh = meshes[world_size]
    origs = random_tensors(shape_list, dtype, seed)
    per_rank = [build_params(origs, mesh, rank) for rank in range(world_size)]
    grads_per_rank = [
        random_tensors(shape_list, dtype, seed + 1 + rank, integer_valued=True)
        for rank in range(world_size)
    ]
    plan = divide_plan("gloo", dtype, world_size)  # a mean over the ranks
    with recording("reduce_scatter_single") as calls:
        results = [
            reduce_scatter(params, grads, mesh, plan)
            for params, grads in zip(per_rank, grads_per_rank, strict=True)
        ]
    if world_size == 1:  # a world of one rank exchanges nothing: the input is the output
        assert calls == []
        average(results[0])
        assign_sharded_grads(results[0])
    else:
        assert [group for _, _, group in calls] == [mesh.get_group(0)] * world_size
        # The collective: rank r receives the sum over ranks of row r.
        inputs = [input.view(world_size, -1) for _, input, _ in calls]
        for rank, (output, _, _) in enumerate(calls):
            total = inputs[0][rank].clone()
            for input in inputs[1:]:
                total += input[rank]
            output.copy_(total)
            average(results[rank])
            assign_sharded_grads(results[rank])

    for i, orig in enumerate(origs):
        total = grads_per_rank[0][i].clone()
        for grads in grads_per_rank[1:]:
            total += grads[i]
        mean = total / world_size
        # Low precision is divided before the sum (no overflow), the expected mean
        # after it: two orders of the same terms (tests/error_model.py). Integer
        # values in fp32 sum exactly, so there the bound is the floor only.
        abs_sum = sum(grads[i].float().abs() for grads in grads_per_rank)
        bound = rank_mean_bound(abs_sum, world_size, dtype) if dtype.itemsize < 4 else None
        for rank in range(world_size):
            grad = per_rank[rank][i].sharded_param.grad
            assert isinstance(grad, DTensor) and grad.placements == (Shard(0),)
            assert grad.shape == orig.shape
            expected = chunk_of(mean, world_size, rank)
            if bound is None:
                assert torch.equal(grad.to_local(), expected)
            else:
                local = grad.to_local().float()
                assert_within(local, expected.float(), chunk_of(bound, world_size, rank), "grad")


# -- edge cases ------------------------------------------------------------


def test_reduce_scatter_with_zero_row_gradient(meshes: dict[int, DeviceMesh]) -> None:
    mesh = meshes[4]
    shapes_ = [(0, 3), (5, 3)]
    params = build_params(random_tensors(shapes_, torch.float32, 0), mesh, 0)
    grads = random_tensors(shapes_, torch.float32, 1)
    plan = divide_plan("gloo", torch.float32, 4)
    with recording("reduce_scatter_single") as calls:
        result = reduce_scatter(params, grads, mesh, plan)
    output, input, _ = calls[0]
    output.copy_(input.view(4, -1)[0] * 4)  # every rank sent the same gradients
    average(result)
    assign_sharded_grads(result)
    assert params[0].sharded_param.grad.to_local().shape == (0, 3)
    assert torch.equal(params[1].sharded_param.grad.to_local(), grads[1][:2])


class TwoParams(nn.Module):
    def __init__(self, first: torch.dtype, second: torch.dtype) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(6, 3, dtype=torch.float64).to(first))
        self.b = nn.Parameter(torch.randn(5, dtype=torch.float64).to(second))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_unshard_round_trip_float64(meshes: dict[int, DeviceMesh]) -> None:
    """World size 1, so the in-place all-gather needs no data from other ranks."""
    model = TwoParams(torch.float64, torch.float64)
    origs = [model.a.detach().clone(), model.b.detach().clone()]
    fully_shard(model, mesh=meshes[1])
    model.unshard()
    assert torch.equal(model.a, origs[0]) and torch.equal(model.b, origs[1])
    assert model.a.dtype == model.b.dtype == torch.float64


def test_mixed_dtypes_in_one_group(meshes: dict[int, DeviceMesh]) -> None:
    """Parameters of different dtypes are all-gathered together (as bytes) and
    come back in their own dtypes, bit for bit; trainable ones must reduce in
    one dtype."""
    model = TwoParams(torch.float32, torch.float64)
    with pytest.raises(ValueError, match=r"one dtype.*'a' in torch.float32.*'b' in torch.float64"):
        fully_shard(model, mesh=meshes[1])
    model.b.requires_grad_(False)  # frozen: nothing to reduce
    origs = [model.a.detach().clone(), model.b.detach().clone()]
    fully_shard(model, mesh=meshes[1])
    model.unshard()
    assert (model.a.dtype, model.b.dtype) == (torch.float32, torch.float64)
    assert torch.equal(model.a, origs[0]) and torch.equal(model.b, origs[1])
    # A common reduce dtype makes both trainable.
    other = TwoParams(torch.float32, torch.float64)
    fully_shard(other, mesh=meshes[1], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))


def test_whole_gradients_follow_the_sharded_ones_in_a_world_of_one(
    meshes: dict[int, DeviceMesh],
) -> None:
    """With min_numel_to_shard, a world of one still packs the whole
    parameter's gradient after the sharded ones (no collective) and assigns both."""
    mesh = meshes[1]
    info = mesh_info(mesh, 0)
    origs = random_tensors([(5, 3), (4,)], torch.float32, 0)
    params = [build_param(t, f"p{i}", info, whole=i == 1) for i, t in enumerate(origs)]
    assert params[1].sharded_param.placements == (Replicate(),)
    grads = random_tensors([(5, 3), (4,)], torch.float32, 1)
    plan = divide_plan("gloo", torch.float32, 1)
    with recording("reduce_scatter_single") as calls:
        result = reduce_scatter(params, grads, mesh, plan)
    assert calls == []
    assert result.output.numel() == 5 * 3 + 4
    average(result)
    assign_sharded_grads(result)
    for param, grad in zip(params, grads, strict=True):
        assert torch.equal(param.sharded_param.grad.to_local(), grad)
