"""How gradient reductions average, per backend (issue 19, defect 9's
reduction op): on NCCL the ops and divisions torch's fully_shard chooses
(``ReduceOp.AVG``, ``PREMUL_SUM`` with a divide factor, no division pass), on
gloo sums and fsdp2's own division, as before. ``divide_plan`` is checked
against torch's rule; the engine is checked to use its plan (ops handed to
the collectives, divisions done) on a fake world whose backend is made to
read as NCCL."""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist import fake_world
from models import build_model, shard_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
import fsdp2.comm.primitives
from fsdp2.comm.divide import DividePlan, divide_plan
from fsdp2.comm.primitives import backend_for

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _op(op: Any) -> tuple[str, float | None]:
    """An op by value: PREMUL_SUM's factor counts (``==`` ignores it)."""
    if op == dist.ReduceOp.PREMUL_SUM:
        return "PREMUL_SUM", op.factor
    return str(op), None


def _plan(plan: DividePlan) -> tuple:
    return plan.pre_divisor, _op(plan.reduce_scatter_op), _op(plan.all_reduce_op), plan.post_divisor


class Group(NamedTuple):
    ranks: int

    def size(self) -> int:
        return self.ranks


def _torch_plan(
    dtype: torch.dtype, shard: int, replicate: int, factor: float | None, force_sum: bool
) -> tuple:
    """torch's choice, in ``_plan``'s form (a division by 1 is none)."""
    pre, post, scatter, reduce = _get_gradient_divide_factors(
        Group(shard), Group(replicate) if replicate > 1 else None, dtype, "cuda", factor, force_sum
    )
    pre, post = (None if d is None or d == 1 else d for d in (pre, post))
    return pre, _op(scatter), _op(reduce), post


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("force_sum", [False, True])
def test_nccl_plan_is_torchs(dtype: torch.dtype, force_sum: bool) -> None:
    """Over shard and replicate sizes (FSDP, HSDP) and divide factors: the same
    ops and divisions as torch's fully_shard on NCCL. (A reduce-scatter over
    one rank with a factor: below.)"""
    for shard, replicate, factor in itertools.product(
        (2, 4, 8), (1, 2, 3), (None, 1.0, 2.0, 3.0, 4.0, 24.0)
    ):
        case = (dtype, shard, replicate, factor, force_sum)
        plan = divide_plan("nccl", dtype, shard, replicate, factor, force_sum)
        assert _plan(plan) == _torch_plan(*case[:4], force_sum), case


def test_nccl_plan_examples() -> None:
    """The cases spelled out: fp32/bf16 averaged by the collectives, fp16
    divided around the sum by powers of two, force_sum dividing after."""
    premul = ("PREMUL_SUM", 1 / 3)
    examples = [
        # (dtype, shard, replicate, factor, force_sum) -> (pre, rs op, ar op, post)
        ((torch.float32, 4, 1, None, False), (None, _op(AVG), _op(AVG), None)),
        ((torch.bfloat16, 2, 2, None, False), (None, _op(AVG), _op(AVG), None)),
        ((torch.float32, 1, 1, None, False), (None, _op(SUM), _op(SUM), None)),
        ((torch.float32, 4, 2, 4.0, False), (None, _op(AVG), _op(SUM), None)),
        ((torch.float32, 4, 2, 3.0, False), (None, premul, _op(SUM), None)),
        ((torch.float32, 4, 2, None, True), (None, _op(SUM), _op(SUM), 8.0)),
        ((torch.float16, 8, 1, None, False), (4, _op(SUM), _op(SUM), 2.0)),
        ((torch.float16, 4, 4, None, False), (4, _op(SUM), _op(SUM), 4.0)),
        # One rank per shard group: no reduce-scatter runs, its input is divided.
        ((torch.float32, 1, 2, 3.0, False), (3.0, _op(SUM), _op(SUM), None)),
        ((torch.float32, 1, 2, 1.0, False), (None, _op(AVG), _op(SUM), None)),
    ]
    for case, expected in examples:
        assert _plan(divide_plan("nccl", *case)) == expected, case


@pytest.mark.parametrize("backend", ["gloo", "fake"])
def test_other_backends_sum_and_divide_as_before(backend: str) -> None:
    """gloo (no AVG, no PREMUL_SUM) and any other backend: sums; 16-bit
    dtypes divided before the sum, wider ones after; force_sum changes nothing."""
    for dtype, shard, replicate, factor, force_sum in itertools.product(
        DTYPES, (1, 2, 4), (1, 2), (None, 1.0, 3.0), (False, True)
    ):
        divisor = shard * replicate if factor is None else factor
        division = None if divisor == 1 else divisor
        before = dtype.itemsize < 4
        expected = (
            division if before else None,
            _op(SUM),
            _op(SUM),
            None if before else division,
        )
        plan = divide_plan(backend, dtype, shard, replicate, factor, force_sum)
        assert _plan(plan) == expected, (dtype, shard, replicate, factor, force_sum)


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("gloo", "cpu", "gloo"),
    ],
)
def test_backend_for_the_device(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: str, expected: str
) -> None:
    """The backend of the group's collectives on the device, also when the
    group has one backend per device type (``init_process_group()`` on CUDA)."""
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    assert backend_for(None, device) == expected  # type: ignore[arg-type]


class RecordingReduceScatter(fsdp2.ReduceScatter):
    """Records the op of each reduce-scatter; moves no data (a fake world)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, float | None]] = []

    def allocate(self, size, *, dtype, device):
        return torch.zeros(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ops.append(_op(op))


class Divisions(TorchDispatchMode):
    """Counts in-place divisions (fsdp2's division passes)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten.div_
        return func(*args, **(kwargs or {}))


def _backward_ops(
    setting: str, backend: str, monkeypatch: pytest.MonkeyPatch, hsdp: bool = False
) -> tuple[list, list, int]:
    """One backward of the MLP on a fake world whose backend reads as
    ``backend``: the reduce-scatters' ops, the all-reduces' ops, the divisions."""
    monkeypatch.setattr(fsdp2.comm.primitives, "backend_for", lambda group, device_type: backend)
    all_reduces: list = []
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, op=SUM, group=None, async_op=False):
        all_reduces.append(_op(op))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)
    with fake_world(4 if hsdp else 2):
        kwargs: dict = {}
        if hsdp:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            kwargs["mesh"] = mesh
        model = shard_model(build_model("mlp"), **kwargs)
        scatter = RecordingReduceScatter()
        for module in (*model.layers, model):
            module.set_custom_reduce_scatter(scatter)
            if setting == "factor":
                module.set_gradient_divide_factor(3.0)
            elif setting == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
        loss = model(torch.randn(4, 17)).sum()
        all_reduces.clear()  # backward's only: not the same-model check's at lazy init
        with Divisions() as divisions:
            loss.backward()
    return scatter.ops, all_reduces, divisions.count


@pytest.mark.parametrize(
    ("setting", "backend", "hsdp", "scatter_op", "all_reduce_op", "divides"),
    [
        ("default", "nccl", False, _op(AVG), None, False),
        ("factor", "nccl", False, ("PREMUL_SUM", 1 / 3), None, False),
        ("force_sum", "nccl", False, _op(SUM), None, True),
        ("default", "nccl", True, _op(AVG), _op(AVG), False),
        ("factor", "nccl", True, ("PREMUL_SUM", 1 / 3), _op(SUM), False),
        ("default", "gloo", False, _op(SUM), None, True),
        ("default", "gloo", True, _op(SUM), _op(SUM), True),
    ],
)
def test_engine_reduces_as_planned(
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    backend: str,
    hsdp: bool,
    scatter_op: tuple,
    all_reduce_op: tuple | None,
    divides: bool,
) -> None:
    """The engine hands its plan's ops to the reduce-scatter (a custom one here)
    and to the all-reduce across replicas, and divides only when the plan
    says so: on NCCL, by default or with a factor, not at all."""
    scatters, all_reduces, divisions = _backward_ops(setting, backend, monkeypatch, hsdp)
    assert scatters == [scatter_op] * 3, scatters  # one per layer; the root has no parameters
    assert all_reduces == ([all_reduce_op] * 3 if hsdp else []), all_reduces
    assert (divisions > 0) == divides, divisions


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        # torch's order: the hook sees the sums, the post-division follows.
        ("nccl", ["hook", "divide"]),
        # gloo's division stands in for an averaging op: the hook sees the mean.
        ("gloo", ["divide", "hook"]),
    ],
)
def test_all_reduce_hook_sees_what_torchs_would(
    monkeypatch: pytest.MonkeyPatch, backend: str, expected: list[str]
) -> None:
    """With set_force_sum_reduction_for_comms on NCCL the reduction divides
    after its collectives: the all-reduce hook runs before that division, as
    torch's fully_shard runs it."""
    monkeypatch.setattr(fsdp2.comm.primitives, "backend_for", lambda group, device_type: backend)
    log: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.div_:
                log.append("divide")
            return func(*args, **(kwargs or {}))

    with fake_world(2):
        model = shard_model(build_model("mlp"))
        for layer in model.layers:
            layer.set_custom_reduce_scatter(RecordingReduceScatter())
            layer.set_force_sum_reduction_for_comms(True)
            layer.set_all_reduce_hook(lambda output: log.append("hook"))
        loss = model(torch.randn(4, 17)).sum()
        with Log():
            loss.backward()
    assert log == expected * len(model.layers), log


def test_divide_plan_is_made_once_per_group_until_a_setter_changes_it() -> None:
    """The plan is cached on the group; set_gradient_divide_factor and
    set_force_sum_reduction_for_comms make the next reduction plan again."""
    with fake_world(2):
        model = shard_model(build_model("mlp"))
        group = model.layers[0]._fsdp_state.param_groups[0]
        first = group.divide_plan(torch.float32)
        assert group.divide_plan(torch.float32) is first
        model.layers[0].set_gradient_divide_factor(4.0)
        assert group.divide_plan(torch.float32).post_divisor == 4.0
        model.layers[0].set_force_sum_reduction_for_comms(True)
        cached = group.divide_plan(torch.float32)
        assert group.divide_plan(torch.float32) is cached
        assert group.divide_plan(torch.bfloat16).pre_divisor == 4.0  # another dtype: planned anew


def test_unused_params_zeros_need_no_cast_copy() -> None:
    """With mixed precision and set_reduce_scatter_unused_params, an unused
    parameter's zeros are made in the dtype of the other gradients (bf16), so
    the reduce-scatter packs them without a full-size cast of every gradient."""
    casts: list[tuple[int, ...]] = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to):
                casts.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_world(2):
        model = fsdp2.fully_shard(Unused(), mp_policy=mp)
        model.set_reduce_scatter_unused_params(True)
        pipeline = model._fsdp_state.root_ctx.reductions  # the root's: kept at lazy init
        post_backward = pipeline.post_backward

        def counted(group):
            with Casts():
                post_backward(group)

        pipeline.post_backward = counted  # type: ignore[method-assign]
        model(torch.randn(4, 8)).sum().backward()
    unsharded = {(8, 8), (8,)}
    assert not [shape for shape in casts if shape in unsharded], casts
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_premul_sum_before_torch_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch before 2.13 (the GPU machine's 2.11): ``ReduceOp.PREMUL_SUM`` is a
    plain member, not callable; the op then comes from ``_make_nccl_premul_sum``,
    with the same factor."""
    from fsdp2.base.private_dist import premul_sum

    class ReduceOpBefore213:
        PREMUL_SUM = "PREMUL_SUM"  # a member: calling it would raise

    make = dist._make_nccl_premul_sum  # type: ignore[attr-defined]
    monkeypatch.setattr(dist, "ReduceOp", ReduceOpBefore213)
    op = premul_sum(0.25)
    monkeypatch.undo()
    assert _op(op) == _op(make(0.25)) == ("PREMUL_SUM", 0.25)
    assert _op(premul_sum(0.25)) == ("PREMUL_SUM", 0.25)  # 2.13's public constructor
