"""What keeps a sharded run from going silently wrong, and how it recovers.

- The execution-order check (execution_order.py): ranks that run sharded modules in
  different orders raise together on the first iteration; later deviations warn
  once; switched off, it costs no collective.
- Clear errors for deepcopy and for loading a state dict of the wrong shape.
- ``reset_iter_state`` after an exception in forward or backward.
- A dead or hung peer: the survivor fails within the process-group timeout with
  an error naming the collective it was waiting for, and can still reset.

The distributed tests run at world size 2 on ``Net``: same-shaped residual
blocks whose order a rank can change (``net.order``) and in which a failure can
be injected (``block.fail_in``). The single-process tests use a "fake" world of
8, or a one-rank mesh inside it where the engine's collectives must be exact.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import traceback
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, recorded, run_ranks
from error_model import REF_TOL
from models import global_mean, local_batch, make_optimizer, unsharded_bytes
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import fsdp2
from fsdp2.comm.all_gather import AllGatherComm
from fsdp2.engine.states import ShardedState, TrainingState

WORLD_SIZE = 2
D_IN, DIM, D_OUT = 7, 9, 5  # 9 rows: 5 + 4 at world size 2, so the buffers are padded
N_BLOCKS = 3
GLOBAL_BATCH_SIZE = 8
# Per step with the root owning parameters and every block resharding after
# forward: each block is all-gathered twice, the root once; one reduce-scatter
# per group.
ALL_GATHERS_PER_STEP = 2 * N_BLOCKS + 1
REDUCE_SCATTERS_PER_STEP = N_BLOCKS + 1


class InjectedError(RuntimeError):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise InjectedError("injected failure in backward")


class Block(nn.Module):
    """``x + tanh(lin(norm(x)))``: residual, so a rank can skip it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)
        # "forward": raise at the start of forward; "backward": raise in the
        # middle of this block's backward (after its pre-backward, before its
        # post-backward).
        self.fail_in: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_in == "forward":
            raise InjectedError("injected failure in forward")
        h = self.lin(self.norm(x))
        if self.fail_in == "backward":
            h = _RaiseInBackward.apply(h)
        return x + torch.tanh(h)


class Net(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(N_BLOCKS))
        self.out = nn.Linear(dim, D_OUT)
        self.order: list[int] | None = None  # indices of the blocks to run (None: all)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in range(len(self.layers)) if self.order is None else self.order:
            x = self.layers[i](x)
        return self.out(x)


def build_net() -> Net:
    torch.manual_seed(0)
    return Net()


def shard_net(net: Net, mesh: DeviceMesh, **kwargs) -> Net:
    for block in net.layers:
        fsdp2.fully_shard(block, mesh=mesh, **kwargs)
    fsdp2.fully_shard(net, mesh=mesh, **kwargs)
    return net


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(GLOBAL_BATCH_SIZE, D_IN, generator=gen),
        torch.randn(GLOBAL_BATCH_SIZE, D_OUT, generator=gen),
    )


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def ref_step(
    ref: Net, optim: torch.optim.Optimizer, step: int, orders: list[list[int] | None]
) -> torch.Tensor:
    """The reference (DDP math) for ranks that run ``orders[rank]`` on their
    slices: the global mean loss is the mean of the slices' mean losses."""
    batch = global_batch(step)
    losses = []
    for rank, order in enumerate(orders):
        ref.order = order
        inputs, targets = local_batch(batch, rank, len(orders))
        losses.append(F.mse_loss(ref(inputs), targets))
    loss = torch.stack(losses).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    ref.order = None
    return loss.detach()


def assert_params_close(model: nn.Module, ref: nn.Module) -> None:
    for name, param in model.named_parameters():
        assert_close(
            param.full_tensor(),
            ref.get_parameter(name),
            **REF_TOL,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def params_close(model: nn.Module, ref: nn.Module) -> bool:
    return all(
        torch.allclose(param.full_tensor(), ref.get_parameter(name), **REF_TOL)
        for name, param in model.named_parameters()
    )


def fsdp2_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fsdp2")]


# -- execution order ----------------------------------------------------------


def _order_error_on_first_iteration(
    rank: int, world_size: int, mesh: DeviceMesh, orders: list[list[int]], how: str
) -> None:
    """Rank r runs ``orders[r]``: every rank must raise naming what each rank
    was about to all-gather; after reset_iter_state, agreeing ranks train."""
    model = build_net()
    if how == "env":
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        shard_net(model, mesh)
        if how == "method":
            model.set_check_execution_order(True)
        model.order = orders[rank]
        batch = local_batch(global_batch(0), rank, world_size)
        with (
            recorded("all_gather") as count,
            pytest.raises(RuntimeError, match="execution order check") as error,
        ):
            train_step(model, make_optimizer(model), batch)
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    message = str(error.value)
    # The root and layers.0 agree (each preceded by a check), the third
    # collective is where the ranks part.
    assert "collective #2 of the iteration" in message, message
    first_apart = [order[1] for order in orders]
    for r, block in enumerate(first_apart):
        assert f"rank {r}: all-gather of 'layers.{block}'" in message, message
    # 3 checks + 2 all-gathers (root, layers.0): nothing was gathered after the mismatch.
    assert len(count) == 5, f"{len(count)} all_gather_single calls"

    # The error left the iteration half done; after a reset the next iteration
    # is checked as a first one again and passes when the ranks agree.
    model.reset_iter_state()
    model.order = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(model, make_optimizer(model), batch)
    assert not fsdp2_warnings(caught), fsdp2_warnings(caught)


def _execution_order(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    in_order = list(range(N_BLOCKS))
    swapped = [0, 2, 1]

    for label, orders, how in [
        ("swap, set_check_execution_order", [in_order, swapped], "method"),
        ("skip, set_check_execution_order", [in_order, [0, 2]], "method"),
        ("swap, TORCH_DISTRIBUTED_DEBUG=DETAIL", [in_order, swapped], "env"),
    ]:
        with labelled(label):
            _order_error_on_first_iteration(rank, world_size, mesh, orders, how)

    with labelled("no check: the same swap runs silently with wrong weights"):
        for orders, matches in [([swapped, swapped], True), ([in_order, swapped], False)]:
            ref = build_net()
            model = shard_net(build_net(), mesh)
            model.order = orders[rank]
            optims = [make_optimizer(m) for m in (ref, model)]
            ref_loss = ref_step(ref, optims[0], 0, orders)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = train_step(model, optims[1], local_batch(global_batch(0), rank, world_size))
            assert not fsdp2_warnings(caught), fsdp2_warnings(caught)  # silent
            loss = global_mean(loss, world_size)
            # Control: when the ranks agree (here: both swapped) the result is right.
            assert torch.allclose(loss, ref_loss, **REF_TOL) is matches, (orders, loss, ref_loss)
            assert params_close(model, ref) is matches, orders

    ref = build_net()
    model = shard_net(build_net(), mesh)
    model.set_check_execution_order(True)
    optims = [make_optimizer(m) for m in (ref, model)]
    skip = [0, 2]

    def step(i: int, order: list[int] | None, expected_all_gathers: int) -> None:
        model.order = order
        ref_loss = ref_step(ref, optims[0], i, [order] * world_size)
        with recorded("all_gather") as count:
            loss = train_step(model, optims[1], local_batch(global_batch(i), rank, world_size))
        assert_close(global_mean(loss, world_size), ref_loss, **REF_TOL)
        assert len(count) == expected_all_gathers, f"step {i}: {len(count)} all_gather_single calls"

    with labelled("check on: later iterations warn once on deviation"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # First iteration: one check before each all-gather and reduce-scatter.
            step(0, None, ALL_GATHERS_PER_STEP + ALL_GATHERS_PER_STEP + REDUCE_SCATTERS_PER_STEP)
            step(1, None, ALL_GATHERS_PER_STEP)  # later: no collective of its own
            assert not fsdp2_warnings(caught), fsdp2_warnings(caught)
            # Every rank skips layers.1 (so the collectives stay paired), twice. The
            # first time, layers.0 still prefetches layers.1 (last iteration's
            # successor): one all-gather is drained unused.
            step(2, skip, ALL_GATHERS_PER_STEP - 1)
            step(3, skip, ALL_GATHERS_PER_STEP - 2)
            step(4, None, ALL_GATHERS_PER_STEP)
        messages = fsdp2_warnings(caught)
        assert len(messages) == 1, messages
        assert re.search(
            r"rank \d\): this rank's collective #\d+ of the iteration is the .*, but in the "
            r"reference iteration it was .*'layers\.1'.*\(Warned once\.\)",
            messages[0],
        ), messages[0]
        assert_params_close(model, ref)

    with labelled("check off: no extra collective, no warning"):
        model.set_check_execution_order(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(5, None, ALL_GATHERS_PER_STEP)
            step(6, skip, ALL_GATHERS_PER_STEP - 1)  # one unused forward prefetch
        assert not fsdp2_warnings(caught), fsdp2_warnings(caught)

    with labelled("check on again: only the deviating rank warns"):
        model.set_check_execution_order(True)  # a fresh check: step 7 is its first iteration
        step(7, None, ALL_GATHERS_PER_STEP + ALL_GATHERS_PER_STEP + REDUCE_SCATTERS_PER_STEP)
        # Rank 1 alone swaps two same-shaped blocks: the collectives still pair
        # up (silently exchanging the wrong blocks), and only rank 1 can notice.
        model.order = swapped if rank == 1 else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                train_step(model, optims[1], local_batch(global_batch(8), rank, world_size))
        messages = fsdp2_warnings(caught)
        if rank == 1:
            assert len(messages) == 1, messages
            assert re.search(
                r"collective #2 of the iteration is the all-gather of 'layers\.2', but in the "
                r"reference iteration it was all-gather of 'layers\.1'.*\(Warned once\.\)",
                messages[0],
            ), messages[0]
        else:
            assert not messages, messages


@pytest.mark.distributed
def test_execution_order_check(tmp_path: Path) -> None:
    """Turned on by set_check_execution_order(True) or TORCH_DISTRIBUTED_DEBUG=DETAIL,
    a rank that swaps two same-shaped blocks or skips one makes every rank raise
    on the first iteration, naming what each rank was about to all-gather (and
    reset_iter_state makes the model usable again). Without the check the same
    swap runs silently and the weights no longer match the reference. On later
    iterations a deviation warns once, on the rank that deviates; with the check
    off there is no extra collective and no warning."""
    run_ranks(_execution_order, WORLD_SIZE, tmp_path)


# -- single process: clear errors, the check's switch and reference, reset ------


@pytest.fixture(scope="module")
def fake_mesh() -> Iterator[DeviceMesh]:
    with fake_world(8):
        yield init_device_mesh("cpu", (8,))


def test_root_forward_called_directly_raises(fake_mesh: DeviceMesh) -> None:
    """model.forward(x) skips the root's hooks, so a block's forward would run
    first and become a root of its own: refused, saying what to call instead."""
    model = shard_net(build_net(), _one_rank_mesh())
    with pytest.raises(RuntimeError, match=r"FSDPNet\.forward ran without fully_shard's hooks"):
        model.forward(global_batch(0)[0])
    with pytest.raises(
        RuntimeError, match=r"FSDPBlock ran before the forward of FSDPNet.*not a submodule"
    ):
        model.layers[0](torch.randn(2, DIM))
    model.reset_iter_state()
    model(global_batch(0)[0])  # the right call works


def test_block_that_ran_as_its_own_root_raises(fake_mesh: DeviceMesh) -> None:
    """A block that ran forward before its parent was sharded became a root of
    its own; the parent's first forward refuses to adopt it, naming both."""
    model = build_net()
    mesh = _one_rank_mesh()
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    model.layers[0](torch.randn(2, DIM))
    fsdp2.fully_shard(model, mesh=mesh)
    with pytest.raises(
        RuntimeError, match=r"'layers\.0' already ran forward as its own root before FSDPNet did"
    ):
        model(global_batch(0)[0])


def test_deepcopy_raises(fake_mesh: DeviceMesh) -> None:
    model = shard_net(build_net(), fake_mesh)
    for module in (model, model.layers[1]):
        with pytest.raises(
            AssertionError,
            match=r"deepcopy of a sharded module \(FSDP\w+\).*load model\.state_dict",
        ):
            copy.deepcopy(module)


def test_load_state_dict_names_key_and_shapes(fake_mesh: DeviceMesh) -> None:
    model = shard_net(build_net(), fake_mesh)
    ref = Net()  # another initialisation, unsharded

    # A full tensor of the right shape is cut to this rank's shard.
    model.load_state_dict(ref.state_dict())
    for name, param in model.named_parameters():
        expected = torch.chunk(ref.get_parameter(name).detach(), 8)[0]
        assert torch.equal(param.to_local(), expected), name

    # A full tensor of the wrong shape: the key and both shapes.
    state_dict = ref.state_dict()
    state_dict["layers.1.lin.weight"] = torch.zeros(3, DIM)
    with pytest.raises(
        RuntimeError,
        match=r"size mismatch for layers\.1\.lin\.weight: copying a param with shape "
        r"torch\.Size\(\[3, 9\]\) from checkpoint, the shape in current model is "
        r"torch\.Size\(\[9, 9\]\)",
    ):
        model.load_state_dict(state_dict)

    # A sharded state dict of a differently sized model (dim 12 instead of 9).
    other = shard_net(Net(dim=12), fake_mesh)
    with pytest.raises(
        RuntimeError,
        match=r"size mismatch for inp\.weight: copying a param with shape "
        r"torch\.Size\(\[12, 7\]\) from checkpoint, the shape in current model is "
        r"torch\.Size\(\[9, 7\]\)",
    ):
        model.load_state_dict(other.state_dict())
    assert isinstance(model.inp.weight, DTensor)


def test_order_check_is_off_by_default(fake_mesh: DeviceMesh) -> None:
    assert os.environ.get("TORCH_DISTRIBUTED_DEBUG", "") != "DETAIL"
    model = shard_net(build_net(), fake_mesh)
    model._fsdp_state.lazy_init()
    assert model._fsdp_state.root_ctx.order_check is None


def test_debug_env_set_before_first_forward_turns_check_on(
    fake_mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = shard_net(build_net(), fake_mesh)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    model._fsdp_state.lazy_init()  # what the first forward does first
    assert model._fsdp_state.root_ctx.order_check is not None


def _one_rank_mesh() -> DeviceMesh:
    """A world of one inside the fake world: the engine's collectives are then
    exact (the all-gather input is the whole output) and the first iteration's
    cross-rank check trivially agrees, so only this rank's own comparison of
    later iterations with its first is exercised."""
    return DeviceMesh("cpu", torch.arange(1))


def _train(model: Net, optim: torch.optim.Optimizer, step: int) -> None:
    train_step(model, optim, global_batch(step))


def _eval_forward(model: Net, optim: torch.optim.Optimizer, step: int) -> None:
    with torch.no_grad():
        model(global_batch(step)[0])


def _no_sync_backward(model: Net, optim: torch.optim.Optimizer, step: int) -> None:
    """The first micro-batch of gradient accumulation."""
    inputs, targets = global_batch(step)
    model.set_requires_gradient_sync(False)
    F.mse_loss(model(inputs), targets).backward()
    model.set_requires_gradient_sync(True)


def _two_forwards_one_backward(model: Net, optim: torch.optim.Optimizer, step: int) -> None:
    inputs, targets = global_batch(step)
    (F.mse_loss(model(inputs), targets) + F.mse_loss(model(2 * inputs), targets)).backward()
    optim.step()
    optim.zero_grad()


_WRONG_REFERENCE = (
    "the check takes whatever ran first as the reference iteration, so identical training "
    "steps after it warn (once: a real deviation later goes unreported)"
)


@pytest.mark.parametrize(
    "iterations",
    [
        pytest.param([_train] * 4, id="training-steps"),
        pytest.param(
            [_eval_forward] + [_train] * 3,
            id="eval-forward-first",
        ),
        pytest.param(
            [_no_sync_backward] + [_train] * 3,
            id="no-sync-backward-first",
        ),
        pytest.param(
            [_two_forwards_one_backward] * 4,
            id="two-forwards-per-backward",
        ),
    ],
)
def test_order_check_no_false_warning(fake_mesh: DeviceMesh, iterations: list) -> None:
    """Legitimate iterations other than plain training steps (an evaluation
    forward, the first micro-batch of accumulation without sync, two forwards
    per backward) must not make the identical iterations after them warn."""
    model = shard_net(build_net(), _one_rank_mesh())
    model.set_check_execution_order(True)
    optim = make_optimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, iteration in enumerate(iterations):
            iteration(model, optim, step)
    assert not fsdp2_warnings(caught), fsdp2_warnings(caught)


def test_reset_after_failed_all_gather_frees_unsharded_storage(
    fake_mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The all-gather of layers.1 fails while being waited for (as with a dead
    peer): after reset_iter_state no group may keep its unsharded storage."""
    model = shard_net(build_net(), _one_rank_mesh())
    copy_out = AllGatherComm.copy_out

    target = model.layers[1]._fsdp_state.param_groups[0].fsdp_params[0]

    def failing_copy_out(variant, output, outputs) -> None:
        # The unsharded storage is allocated by now: a failure here must not leak it.
        buffer = target._unsharded_padded  # allocated just before this copy-out
        if buffer is not None and outputs[0].data_ptr() == buffer.data_ptr():
            raise RuntimeError("fsdp2: the all-gather of 'layers.1' failed or timed out: injected")
        copy_out(variant, output, outputs)

    monkeypatch.setattr(AllGatherComm, "copy_out", failing_copy_out)
    with pytest.raises(RuntimeError, match="all-gather of 'layers.1'"):
        model(global_batch(0)[0])
    monkeypatch.setattr(AllGatherComm, "copy_out", copy_out)
    model.reset_iter_state()
    _check_idle_and_sharded(model)


# -- recovery -------------------------------------------------------------------


def _groups(model: nn.Module) -> list:
    return [
        m._fsdp_state.param_groups[0]
        for m in model.modules()
        if isinstance(m, fsdp2.FSDPModule) and m._fsdp_state.param_groups
    ]


def _has_grads(group) -> bool:
    return any(
        p.sharded_param.grad is not None
        or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
        or p.unsynced_grad is not None
        for p in group.fsdp_params
    )


def _check_idle_and_sharded(model: nn.Module, *, storage: bool = True) -> None:
    """Every group SHARDED and IDLE, nothing in flight, no gradient anywhere and
    (``storage``) no unsharded storage held."""
    for group in _groups(model):
        where = f"group {group.name!r}"
        assert group.sharded_state is ShardedState.SHARDED, f"{where}: {group.sharded_state}"
        assert group.training_state is TrainingState.IDLE, f"{where}: {group.training_state}"
        assert not group.all_gather_in_flight, f"{where}: all-gather in flight"
        assert not _has_grads(group), f"{where}: gradients left"
        for p in group.fsdp_params:
            assert not storage or unsharded_bytes(p) == 0, f"{p} holds unsharded storage"
    assert not model._fsdp_state.root_ctx.reductions.reduce_scatters, "reduce-scatter in flight"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}"
        assert param.grad is None, f"{name} has a gradient"


def _check_left_over(model: nn.Module, phase: str, block: int) -> None:
    """What the interrupted iteration left behind (so the reset has work to do)."""
    groups = {g.name: g for g in _groups(model)}
    assert groups["(root)"].sharded_state is ShardedState.UNSHARDED, "root resharded"
    if phase == "forward":
        # The failing block was unsharded by its pre-forward hook.
        assert groups[f"layers.{block}"].training_state is TrainingState.FORWARD
        assert groups[f"layers.{block}"].sharded_state is ShardedState.UNSHARDED
        return
    assert groups[f"layers.{block}"].training_state is TrainingState.PRE_BACKWARD
    # The block after it in forward was reduce-scattered: still in flight.
    assert model._fsdp_state.root_ctx.reductions.reduce_scatters
    if block == 1:
        # Its pre-backward prefetched layers.0.
        assert groups["layers.0"].all_gather_in_flight
    if block == 0:
        # layers.1's post-backward finished layers.2's reduce-scatter.
        assert groups["layers.2"].fsdp_params[0].sharded_param.grad is not None
    assert _has_grads(groups["(root)"]), "the root's gradients were not accumulated"


def _recovery(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    num_steps = 5
    # (phase, block, step that fails, execution-order check on)
    cases = [
        ("forward", 2, 2, False),
        ("backward", 1, 2, False),
        # The interrupted iteration is the very first one: the check must
        # discard it, check the next one across ranks and then not warn.
        ("backward", 0, 0, True),
    ]
    for phase, block, fail_step, check_order in cases:
        ref = build_net()
        model = shard_net(build_net(), mesh)
        model.set_check_execution_order(check_order)
        optims = [make_optimizer(m) for m in (ref, model)]
        label = f"failure in {phase} of layers.{block} at step {fail_step}"
        with labelled(label), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(num_steps):
                batch = global_batch(step)
                if step == fail_step:
                    model.layers[block].fail_in = phase
                    with pytest.raises(InjectedError, match=f"injected failure in {phase}"):
                        train_step(model, optims[1], local_batch(batch, rank, world_size))
                    model.layers[block].fail_in = None
                    _check_left_over(model, phase, block)
                    model.reset_iter_state()
                    _check_idle_and_sharded(model)
                    continue  # the reference never sees this batch
                ref_loss = ref_step(ref, optims[0], step, [None] * world_size)
                loss = train_step(model, optims[1], local_batch(batch, rank, world_size))
                assert_close(global_mean(loss, world_size), ref_loss, **REF_TOL)
            assert_params_close(model, ref)
            _check_idle_and_sharded(model)
            assert not fsdp2_warnings(caught), fsdp2_warnings(caught)


@pytest.mark.distributed
def test_reset_iter_state_after_exception(tmp_path: Path) -> None:
    """An exception raised on every rank in the forward of layers.2, or in the
    backward of layers.1 (an all-gather prefetched, a reduce-scatter in flight)
    or layers.0 (sharded gradients already reduced): after reset_iter_state
    every group is SHARDED and IDLE with nothing in flight and no gradients, and
    training goes on in parity with a reference that never saw the failed step."""
    run_ranks(_recovery, WORLD_SIZE, tmp_path)


# -- a dead peer ----------------------------------------------------------------

# The process group fsdp2 communicates over has a short timeout; the default
# group (only used to set things up) keeps a long one, so that ranks starting
# seconds apart on a loaded machine do not time out before the test begins.
FSDP_GROUP_TIMEOUT = timedelta(seconds=5)
SETUP_TIMEOUT = timedelta(seconds=60)
MARGIN_S = 5.0
JOIN_S = 120.0  # spawn + imports + the timeout, on a loaded machine


def _exit_now(*_args) -> None:
    os._exit(1)


def _hang(*_args) -> None:
    time.sleep(JOIN_S)  # the parent kills this rank once rank 0 is done


def _dead_peer_worker(rank: int, world_size: int, tmp_dir: Path, fault: str) -> None:
    """Rank 1 dies or hangs mid-step; rank 0 records what it raised and how long
    it took. Never returns normally: ``os._exit`` skips the teardown of a
    process group with a dead peer."""
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp_dir}/store",
            rank=rank,
            world_size=world_size,
            timeout=SETUP_TIMEOUT,
        )
        group = dist.new_group(timeout=FSDP_GROUP_TIMEOUT)
        mesh = DeviceMesh.from_group(group, "cpu")
        # Backward case: no all-gather in backward, so the first collective
        # rank 0 waits for there is a reduce-scatter.
        kwargs = {"reshard_after_forward": False} if fault == "exit in backward" else {}
        model = shard_net(build_net(), mesh, **kwargs)
        optim = make_optimizer(model)
        train_step(model, optim, local_batch(global_batch(0), rank, world_size))
        inputs, targets = local_batch(global_batch(1), rank, world_size)
        if rank == 1 and fault in ("exit in forward", "hang in forward"):
            # Prepended after fully_shard: runs before fsdp2's pre-forward
            # hook, so rank 1 never joins the all-gather of layers.1.
            hook = _exit_now if fault == "exit in forward" else _hang
            model.layers[1].register_forward_pre_hook(hook, prepend=True)
        start = time.monotonic()
        try:
            output = model(inputs)
            if rank == 1 and fault == "exit in backward":
                output.register_hook(_exit_now)  # before any collective of backward
            F.mse_loss(output, targets).backward()
        except Exception as error:
            outcome = {"type": type(error).__name__, "message": str(error)}
        else:
            outcome = {"type": None, "message": ""}
        outcome["elapsed"] = time.monotonic() - start
        if rank == 0:
            # The survivor can still clean up and read its shards (e.g. to save them).
            start = time.monotonic()
            try:
                model.reset_iter_state()
                # Storage: see test_reset_after_failed_all_gather_frees_unsharded_storage.
                _check_idle_and_sharded(model, storage=False)
                shards = [v.to_local().shape for v in model.state_dict().values()]
                outcome["reset"] = f"clean, {len(shards)} shards"
            except Exception as error:
                outcome["reset"] = f"{type(error).__name__}: {error}"
            outcome["reset_seconds"] = time.monotonic() - start
        (tmp_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    except BaseException:
        (tmp_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        code = 2
    finally:
        os._exit(code)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("fault", "collective", "gloo_says"),
    [
        # layers.1's all-gather was prefetched before rank 1 left: whether it
        # finished in time is a race, so rank 0 fails on it or on the next one.
        pytest.param(
            "exit in forward", r"all-gather of module 'layers\.[12]'", "", id="exit-in-forward"
        ),
        pytest.param(
            "exit in backward",
            r"reduce-scatter of module 'layers\.2'",
            "",
            id="exit-in-backward",
        ),
        # gloo's words depend on which of the all-gather's transfers gives up first.
        pytest.param(
            "hang in forward",
            r"all-gather of module 'layers\.[12]'",
            "Timed out|Application timeout",
            id="hang",
        ),
    ],
)
def test_dead_peer_fails_within_timeout(
    fault: str, collective: str, gloo_says: str, tmp_path: Path
) -> None:
    """Rank 1 calls os._exit(1) in the middle of a step (before layers.1's
    forward, or as backward starts), or hangs before layers.1's forward: rank 0
    raises a RuntimeError naming the collective it was waiting for, within the
    process group's timeout, instead of hanging; then reset_iter_state returns
    promptly and leaves its shards readable. Spawned by hand: run_ranks treats a
    rank that exits as the failure."""
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_dead_peer_worker, args=(rank, WORLD_SIZE, tmp_path, fault))
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    try:
        procs[0].join(JOIN_S)
        if not fault.startswith("hang"):
            procs[1].join(max(1.0, JOIN_S - 60))
        hung = [proc.name for proc in procs if proc.is_alive()]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    for rank in range(WORLD_SIZE):
        if (error := tmp_path / f"rank{rank}.error").exists():
            raise AssertionError(f"rank {rank} failed outside the step:\n{error.read_text()}")
    if fault.startswith("hang"):
        assert hung == [procs[1].name], f"{hung}: only the hanging rank should be left"
        assert procs[0].exitcode == 0, procs[0].exitcode
    else:
        assert not hung, f"{hung} did not exit within {JOIN_S:.0f} s"
        assert [proc.exitcode for proc in procs] == [0, 1], [proc.exitcode for proc in procs]

    if not (result := tmp_path / "rank0.json").exists():
        raise AssertionError(f"rank 0 left no result (exit codes {[p.exitcode for p in procs]})")
    outcome = json.loads(result.read_text())
    assert outcome["type"] == "RuntimeError", outcome
    assert re.search(
        rf"fsdp2 \(rank 0\): the {collective} on the shard group \(ranks \[0, 1\], "
        r"timeout 0:00:05\) failed or timed out",
        outcome["message"],
    ), outcome
    assert "A peer rank may have died" in outcome["message"], outcome
    assert re.search(gloo_says, outcome["message"]), outcome["message"]
    timeout = FSDP_GROUP_TIMEOUT.total_seconds()
    assert outcome["elapsed"] < timeout + MARGIN_S, f"rank 0 took {outcome['elapsed']:.1f} s"
    n_params = len(list(build_net().parameters()))
    assert outcome["reset"] == f"clean, {n_params} shards", outcome
    assert outcome["reset_seconds"] < MARGIN_S, outcome
    if fault.startswith("hang"):
        # It waited for the group's timeout, not some other one.
        assert outcome["elapsed"] > 0.8 * timeout, (
            f"rank 0 gave up after {outcome['elapsed']:.1f} s"
        )


# -- what the checks' communication shows ----------------------------------------


def _counted_first_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> list:
    """``CommDebugMode``'s collective counts of the first forward and of the
    first backward."""
    from torch.distributed.tensor.debug import CommDebugMode

    counts = []
    with CommDebugMode() as forward:
        loss = F.mse_loss(model(batch[0]), batch[1])
    counts.append(dict(forward.get_comm_counts()))
    with CommDebugMode() as backward:
        loss.backward()
    counts.append(dict(backward.get_comm_counts()))
    return counts


def _checks_unseen(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    batch = local_batch(global_batch(0), rank, world_size)
    theirs = build_net()
    for block in theirs.layers:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    expected = _counted_first_step(theirs, batch)
    assert sum(expected[0].values()) and sum(expected[1].values()), expected
    # fsdp2's same-model check all-reduces in the first forward, the
    # execution order check (when on) all-gathers before each group's
    # all-gather: neither counts.
    variants = {
        "default": ({}, False),
        "execution order check on": ({}, True),
    }
    for label, (kwargs, order_check) in variants.items():
        with labelled(label):
            model = shard_net(build_net(), mesh, **kwargs)
            model.set_check_execution_order(order_check)
            assert _counted_first_step(model, batch) == expected, label
    with labelled("min_numel_to_shard keeps the norms whole"):
        # The same-model check then also compares the whole parameters (their
        # gradients are all-reduced, so only the forward is torch's).
        model = shard_net(build_net(), mesh, min_numel_to_shard=2 * DIM + 1)
        whole = [
            p
            for p in model.parameters()
            if isinstance(p, DTensor) and p.placements[0].is_replicate()
        ]
        assert whole, "no parameter kept whole"
        assert _counted_first_step(model, batch)[0] == expected[0]


@pytest.mark.distributed
def test_checks_add_no_counted_collective(tmp_path: Path) -> None:
    """CommDebugMode counts the same collectives in fsdp2's first forward and
    first backward as in torch's fully_shard's (the same model and data): the
    same-model check's all-reduce and the execution order check's all-gathers
    run unseen by dispatch modes."""
    run_ranks(_checks_unseen, WORLD_SIZE, tmp_path)
