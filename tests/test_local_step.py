"""Elementwise torch optimizers step the local tensors of fsdp2's parameters
(fsdp2/optim/local_step.py), and nothing a user can see changes.

The reference is torch's fully_shard on the same model, data and optimizer:
its optimizer runs every op on DTensors (today's path), so after each step
fsdp2's parameters must equal its bit for bit, and so must
``optimizer.state_dict()`` and DCP's ``get_optimizer_state_dict`` (values and
types: states stay DTensors). A dispatch mode counts the DTensor ops each
optimizer step runs: after the first (which makes the states) none on
fsdp2's local path, many on torch's, so the test cannot pass by both taking
the same path.
"""

from __future__ import annotations

import collections
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from dist import fake_world, labelled, run_ranks
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from fsdp2.base.private_dist import step_local_tensors
from fsdp2.optim.local_step import ELEMENTWISE, LocalInitGroup, _step_locally

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
STEPS = 3

# (label, optimizer class, keyword arguments): every class in ELEMENTWISE,
# and the foreach, fused and single-tensor implementations of the common ones.
ELEMENTWISE_CASES = [
    ("AdamW foreach", torch.optim.AdamW, {"foreach": True}),
    ("AdamW fused", torch.optim.AdamW, {"fused": True}),
    ("Adam amsgrad single-tensor", torch.optim.Adam, {"amsgrad": True, "foreach": False}),
    ("SGD nesterov foreach", torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "foreach": True}),
    ("SGD momentum single-tensor", torch.optim.SGD, {"momentum": 0.9, "foreach": False}),
    ("SGD plain", torch.optim.SGD, {}),
    ("Adagrad", torch.optim.Adagrad, {}),
    ("Adamax", torch.optim.Adamax, {}),
    ("NAdam", torch.optim.NAdam, {}),
    ("RAdam", torch.optim.RAdam, {}),
    ("RMSprop centered", torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
    ("Adadelta", torch.optim.Adadelta, {}),
    ("ASGD", torch.optim.ASGD, {}),
]


class _DTensorOps(TorchDispatchMode):
    """Counts the ops dispatched with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Model(nn.Module):
    """Uneven rows at world size 2 (7 and 5: 4 + 3, 3 + 2), and a parameter
    left out of sharding (``extra``, a plain tensor)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 5)) for _ in range(2)]
        )
        self.extra = nn.Parameter(torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).square().mean() + self.extra.square().sum()


def _model() -> _Model:
    return _Model()


def _shard(model: _Model, shard_fn: Any, **kwargs: Any) -> _Model:
    for block in model.blocks:
        shard_fn(block, **kwargs)
    shard_fn(model, ignored_params={model.extra}, **kwargs)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(
    model: _Model, make: Any, rank: int, scaler: torch.amp.GradScaler | None
) -> tuple[torch.optim.Optimizer, list[int], list[dict[str, Any]]]:
    """STEPS steps with a scheduler and, without a scaler, a second param group
    added after the first (the plain parameter: an optimizer over sharded and
    plain tensors; the scaler's unscaling refuses that mix on torch's side).
    Returns the optimizer, the DTensor ops of each ``optimizer.step()`` and
    the state dicts."""
    optim = make(model.blocks.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    counts, state_dicts = [], []
    # Counted inside the step only (after fsdp2's global pre-hook): a scaler's
    # unscaling of DTensor gradients is not the optimizer's.
    ops = _DTensorOps()
    optim.register_step_pre_hook(lambda *_: None if ops.__enter__() else None)
    optim.register_step_post_hook(lambda *_: ops.__exit__(None, None, None))
    for step in range(STEPS):
        ops.count = 0
        loss = model(_batch(rank, step))
        if scaler is None:
            loss.backward()
            optim.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
        counts.append(ops.count)
        schedule.step()
        # Zeroing in place once, before the plain parameter joins (torch's
        # foreach zeroing refuses a mix of DTensors and plain tensors).
        optim.zero_grad(set_to_none=step > 0)
        if step == 0 and scaler is None:
            optim.add_param_group({"params": [model.extra]})
        state_dicts.append(optim.state_dict())
    return optim, counts, state_dicts


def _check_same_tensor(actual: Any, expected: Any, what: str) -> None:
    assert type(actual) is type(expected), (
        f"{what}: {type(actual).__name__}, torch's path gives {type(expected).__name__}"
    )
    if isinstance(actual, DTensor):
        assert actual.placements == expected.placements, f"{what}: {actual.placements}"
        actual, expected = actual.to_local(), expected.to_local()
    if isinstance(actual, torch.Tensor):
        assert torch.equal(actual, expected), f"{what}: differs from torch's path"
    else:
        assert actual == expected, f"{what}: {actual} vs {expected}"


def _check_same_state(actual: dict, expected: dict, what: str) -> None:
    assert actual["param_groups"] == expected["param_groups"], f"{what}: param groups"
    assert actual["state"].keys() == expected["state"].keys(), f"{what}: state keys"
    for index, state in actual["state"].items():
        assert state.keys() == expected["state"][index].keys(), f"{what}: state {index} keys"
        for key, value in state.items():
            _check_same_tensor(value, expected["state"][index][key], f"{what}: state {index} {key}")


def _run_pair(rank: int, label: str, make: Any, **options: Any) -> None:
    """fsdp2 with the local step against torch's fully_shard."""
    offload, scaled = options.get("offload", False), options.get("scaled", False)
    ours = _shard(
        _model(),
        fsdp2.fully_shard,
        **({"offload_policy": fsdp2.CPUOffloadPolicy()} if offload else {}),
    )
    # torch's offload pins memory, which needs an accelerator: without one its
    # model keeps the shards where they are (the same numbers on a CPU mesh).
    theirs = _shard(_model(), torch_fully_shard)
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) if scaled else None for _ in range(2)]
    our_optim, our_counts, our_states = _train(ours, make, rank, scalers[0])
    their_optim, their_counts, their_states = _train(theirs, make, rank, scalers[1])

    assert isinstance(our_optim.__dict__.get("_init_group"), LocalInitGroup), label
    # The first step makes the states from the DTensor parameters (so they are
    # DTensors); after it, no op sees a DTensor.
    assert our_counts[1:] == [0] * (STEPS - 1), f"{label}: DTensor ops per step {our_counts}"
    assert min(their_counts) > 0, f"{label}: the counter saw no DTensor op on torch's path"
    assert our_counts[0] < their_counts[0], f"{label}: {our_counts} vs torch's {their_counts}"
    for (name, param), theirs_param in zip(
        ours.named_parameters(), theirs.parameters(), strict=True
    ):
        _check_same_tensor(param, theirs_param, f"{label}: {name}")
    for step, (actual, expected) in enumerate(zip(our_states, their_states, strict=True)):
        _check_same_state(actual, expected, f"{label}: state_dict() after step {step}")
    ours_dcp = get_optimizer_state_dict(ours, our_optim)
    theirs_dcp = get_optimizer_state_dict(theirs, their_optim)
    _check_same_state(ours_dcp, theirs_dcp, f"{label}: get_optimizer_state_dict")


# Steps that raise on DTensors (Rprop's masked assignment and fused SGD have no
# sharding strategy) and run locally.
LOCAL_ONLY_CASES = [
    ("Rprop", torch.optim.Rprop, {}),
    ("SGD momentum fused", torch.optim.SGD, {"momentum": 0.9, "fused": True}),
]


def _run_against_unsharded(rank: int, label: str, make: Any) -> None:
    """The sharded step equals the unsharded one fed the same (gathered)
    gradients, bit for bit."""
    model = _shard(_model(), fsdp2.fully_shard)
    ref = _model()
    optim, ref_optim = make(model.parameters()), make(ref.parameters())
    for step in range(STEPS):
        model(_batch(rank, step)).backward()
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            grad = param.grad
            ref_param.grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        optim.step()
        ref_optim.step()
        optim.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(full, ref_param.detach()), f"{label}: {name}"


class _TrustRatioSGD(torch.optim.SGD):
    """LARS-like: each parameter's step scaled by its norm over its
    gradient's, a subclass whose math is not elementwise."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    ratio = param.norm() / (param.grad.norm() + 1e-6)
                    param.grad.mul_(ratio)
        return super().step(closure)


def _run_not_elementwise(rank: int) -> None:
    """torch's Muon (on the matrices) and a subclass of SGD keep the DTensor
    path, and equal torch's fully_shard."""
    makers = {
        "Muon": lambda model: torch.optim.Muon(
            [p for p in model.blocks.parameters() if p.ndim == 2], lr=0.01
        ),
        "SGD subclass": lambda model: _TrustRatioSGD(model.blocks.parameters(), lr=0.01),
    }
    for label, make in makers.items():
        ours = _shard(_model(), fsdp2.fully_shard)
        theirs = _shard(_model(), torch_fully_shard)
        optims = [make(model) for model in (ours, theirs)]
        for step in range(STEPS):
            for model, optim in zip((ours, theirs), optims, strict=True):
                model(_batch(rank, step)).backward()
                optim.step()
                optim.zero_grad()
        assert "_init_group" not in optims[0].__dict__, label
        for param, their_param in zip(ours.parameters(), theirs.parameters(), strict=True):
            _check_same_tensor(param, their_param, label)


def _run_fallback(rank: int) -> None:
    """A gradient the user set with other placements (Replicate), after two
    steps whose layouts were checked once and then remembered, keeps its
    group on DTensors for that step; every step is still the reference's."""
    ours = _shard(_model(), fsdp2.fully_shard)
    theirs = _shard(_model(), torch_fully_shard)
    optims = [torch.optim.AdamW(m.blocks.parameters(), foreach=True) for m in (ours, theirs)]
    counts = []
    for step in range(3):
        for model, optim in zip((ours, theirs), optims, strict=True):
            model(_batch(rank, step)).backward()
            if step == 2:
                first = model.blocks[0][0].weight
                first.grad = first.grad.redistribute(placements=[Replicate()])
            with _DTensorOps() as ops:
                optim.step()
            optim.zero_grad()
            counts.append(ops.count)
        for param, their_param in zip(ours.parameters(), theirs.parameters(), strict=True):
            _check_same_tensor(param, their_param, f"fallback, step {step}")
    ours_counts = counts[::2]
    assert ours_counts[1] == 0 and ours_counts[2] > 0, f"DTensor ops per step {ours_counts}"


def _run_refill(rank: int) -> None:
    """After a step, an optimizer's lists are read again from where its own
    ``_init_group`` took them (local_step._Refill), without running it, until
    something it would see differently: a state loaded anew, a gradient
    missing; a model.to() that gives the parameters new local tensors is
    stepped through them. Every step equals torch's fully_shard's."""
    for label, make in (
        ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True)),
        ("SGD", lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=True)),
    ):
        ours = _shard(_model(), fsdp2.fully_shard)
        theirs = _shard(_model(), torch_fully_shard)
        optims = [make(m.blocks.parameters()) for m in (ours, theirs)]
        calls: list[int] = []
        now = [0]  # the step running
        for step in range(6):
            now[0] = step
            for model, optim in zip((ours, theirs), optims, strict=True):
                model(_batch(rank, step)).backward()
                if step == 2:  # new state tensors, the same values
                    optim.load_state_dict(copy.deepcopy(optim.state_dict()))
                if step == 3:  # read by the math, not by _init_group
                    optim.param_groups[0]["lr"] = 0.02
                if step == 4:
                    model.blocks[1][2].bias.grad = None
                if optim is optims[0] and step == 1:  # installed at the first step
                    local = optim.__dict__["_init_group"]
                    counted = local._init_group
                    local._init_group = lambda *a, c=calls, n=now, f=counted: (
                        c.append(n[0]) or f(*a)
                    )
                with _DTensorOps() as ops:
                    optim.step()
                optim.zero_grad()
                if optim is optims[0] and step > 1:
                    assert ops.count == 0, f"{label}, step {step}: {ops.count} DTensor ops"
            for param, their_param in zip(ours.parameters(), theirs.parameters(), strict=True):
                _check_same_tensor(param, their_param, f"{label} refill, step {step}")
        # SGD's momentum buffers appear at its first step, so its lists are
        # learnt at the second; load_state_dict makes new param groups (step
        # 2), and a missing gradient (step 4) and the step after it (learning
        # again) run the optimizer's own.
        expected = ([1] if label == "SGD" else []) + [2, 4, 5]
        assert calls == expected, f"{label}: _init_group ran at steps {calls}"
        # model.to() through nn.Module._apply gives each parameter a new local
        # tensor (rounded through fp16 here): the next steps step the new ones,
        # as torch's fully_shard does (stepping the old ones would leave the
        # parameters as converted).
        for model in (ours, theirs):
            model.to(torch.float16).to(torch.float32)
        converted = [p.to_local().clone() for p in ours.blocks.parameters()]
        for step in (6, 7):
            for model, optim in zip((ours, theirs), optims, strict=True):
                model(_batch(rank, step)).backward()
                optim.step()
                optim.zero_grad()
            for param, their_param in zip(ours.parameters(), theirs.parameters(), strict=True):
                _check_same_tensor(param, their_param, f"{label} after model.to(), step {step}")
        stepped = [p.to_local() for p in ours.blocks.parameters()]
        assert not any(map(torch.equal, stepped, converted)), label
        # No state entry is made per parameter per step (SGD writes its buffers
        # back under the local tensors' keys: those entries are made ahead).
        optim = optims[0]
        optim.state = _MissCounting(dict, optim.state)
        ours(_batch(rank, 8)).backward()
        optim.step()
        assert optim.state.misses == 0, f"{label}: {optim.state.misses} state entries made"
        assert set(optim.state) == set(ours.blocks.parameters()), label


class _MissCounting(collections.defaultdict):
    """A state dict that counts the entries made by reading a missing key."""

    misses = 0

    def __missing__(self, key: Any) -> Any:
        self.misses += 1
        return super().__missing__(key)


def _run(rank: int, world_size: int) -> None:
    for label, cls, kwargs in ELEMENTWISE_CASES:
        with labelled(label):
            _run_pair(rank, label, lambda params, c=cls, k=kwargs: c(params, lr=0.01, **k))
    with labelled("GradScaler, AdamW fused"):
        make = lambda params: torch.optim.AdamW(params, lr=0.01, fused=True)  # noqa: E731
        _run_pair(rank, "GradScaler", make, scaled=True)
    with labelled("CPU offload, AdamW"):
        make = lambda params: torch.optim.AdamW(params, lr=0.01)  # noqa: E731
        _run_pair(rank, "CPU offload", make, offload=True)
    for label, cls, kwargs in LOCAL_ONLY_CASES:
        with labelled(label):
            _run_against_unsharded(rank, label, lambda ps, c=cls, k=kwargs: c(ps, lr=0.01, **k))
    with labelled("not elementwise"):
        _run_not_elementwise(rank)
    with labelled("fallback"):
        _run_fallback(rank)
    with labelled("refill"):
        _run_refill(rank)


def test_elementwise_optimizers_step_local_tensors_like_torchs_path(tmp_path: Path) -> None:
    assert {cls for _, cls, _ in ELEMENTWISE_CASES + LOCAL_ONLY_CASES} == ELEMENTWISE
    run_ranks(_run, WORLD_SIZE, tmp_path)


@pytest.mark.parametrize(
    "spoil",
    ["placements", "plain full tensor", "list length"],
)
def test_step_local_tensors_is_all_or_nothing(spoil: str) -> None:
    """Single process, a fake world of 2: one row that is not laid out like
    its parameter leaves every list as it was."""
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        params = [DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]) for _ in range(2)]
        grads = [DTensor.from_local(torch.full((2, 3), 2.0), mesh, [Shard(0)]) for _ in range(2)]
        steps = [torch.tensor(1.0), torch.tensor(1.0)]
        lists = (list(params), list(grads), list(steps))
        assert step_local_tensors(lists)
        assert all(type(t) is torch.Tensor for t in lists[0] + lists[1])
        assert lists[1][0] is grads[0].to_local() or torch.equal(lists[1][0], grads[0].to_local())
        assert lists[2] == steps

        spoiled = list(grads)
        if spoil == "placements":
            spoiled[1] = DTensor.from_local(torch.ones(4, 3), mesh, [Replicate()])
        elif spoil == "plain full tensor":
            spoiled[1] = torch.ones(4, 3)
        else:
            spoiled = spoiled[:1]
        lists = (list(params), spoiled, list(steps))
        assert not step_local_tensors(lists)
        assert lists[0] == params and lists[1] == spoiled


def test_a_group_mixing_plain_and_dtensor_parameters_is_checked_every_step() -> None:
    """The remembered layouts are for groups of DTensor parameters only: in a
    mixed group a DTensor in a plain parameter's row stays a DTensor, at the
    second step as at the first."""
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        sharded = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
        states = [DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)]) for _ in range(2)]
        checked: dict = {}
        for _ in range(2):
            lists = ([sharded, torch.ones(4, 3)], list(states))
            assert _step_locally(lists, checked, key=0)
            assert type(lists[1][0]) is torch.Tensor and lists[1][1] is states[1]
        assert checked == {}
