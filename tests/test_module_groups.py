"""``fully_shard([a, b])``: several modules that the model calls separately form
one group (here a transformer's final norm and output head, and with tied
embeddings the token embedding too).

Distributed tests (gloo, 2 and 4 ranks) train against an unsharded reference
(DDP math, see tests/models.py) and count collectives; single-process tests
use a "fake" process group of world size 8 (this process is rank 0) for
argument checks and what a call leaves behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, labelled, recorded, run_ranks
from error_model import (
    REF_TOL,
    check_grads_against_torch,
    check_losses_equal,
    copy_local_shards,
    rank_sum_bounds,
)
from models import (
    full_params,
    global_batch,
    global_mean,
    local_batch,
    make_optimizer,
    transformer_args,
    unsharded_bytes,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor
from torch.testing import assert_close
from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

import fsdp2
from fsdp2 import FSDPModule, fully_shard
from fsdp2.engine.states import ShardedState

TOKENS = "transformer_untied"  # global_batch(): token ids and targets
NUM_STEPS = 4
FAKE_WORLD_SIZE = 8


class LM(Transformer):
    """torch's test Transformer (whose forward calls ``self.norm`` and
    ``self.output`` one after the other), with two ways to leave a module of the
    head out of the forward: ``skip_norm``, and ``head=False``, which returns the
    hidden states so that the loss can call ``self.output`` itself (chunked loss)."""

    def __init__(self, *, weight_tying: bool, checkpoint: bool = False) -> None:
        args = transformer_args(weight_tying=weight_tying)
        super().__init__(dataclasses.replace(args, checkpoint_activations=checkpoint))
        self.skip_norm = False

    def forward(self, tokens: torch.Tensor, head: bool = True) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + self.pos_embeddings(torch.arange(tokens.size(1)))
        for layer in self.layers:
            if self.checkpoint_activations:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        if not self.skip_norm:
            h = self.norm(h)
        return self.output(h) if head else h


def build_lm(*, weight_tying: bool, checkpoint: bool = False) -> LM:
    torch.manual_seed(0)  # the same model on every rank and for the reference
    return LM(weight_tying=weight_tying, checkpoint=checkpoint)


def head_modules(model: LM) -> list[nn.Module]:
    """The head group: final norm and output; with tied embeddings the token
    embedding too, so that the tied weight is owned by one group."""
    head = [model.norm, model.output]
    if model.output.weight is model.tok_embeddings.weight:
        head.insert(0, model.tok_embeddings)
    return head


def shard_lm(model: LM, mesh: DeviceMesh, shard=fully_shard) -> list[nn.Module]:
    """One group per block, one for the head (a list), then the root. ``shard`` is
    fsdp2's or torch's fully_shard."""
    for layer in model.layers:
        shard(layer, mesh=mesh)
    head = head_modules(model)
    returned = shard(head, mesh=mesh)
    assert returned is head, "fully_shard(list) must return the same list"
    shard(model, mesh=mesh)
    return head


def lm_loss(model: LM, tokens: torch.Tensor, targets: torch.Tensor, chunks: int = 0):
    """Mean cross-entropy; with ``chunks`` the head runs outside the model's
    forward, once per chunk of the sequence (a chunked loss)."""
    if not chunks:
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    hidden = model(tokens, head=False)
    losses = [
        F.cross_entropy(model.output(h).flatten(0, 1), t.flatten(), reduction="sum")
        for h, t in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1), strict=True)
    ]
    return sum(losses) / targets.numel()


def check_grads(model: nn.Module, ref: nn.Module, when: str) -> None:
    """Sharded grads equal the reference's; a parameter without a reference grad
    (its module did not run) has none either."""
    for name, param in model.named_parameters():
        ref_grad = ref.get_parameter(name).grad
        if ref_grad is None:
            assert param.grad is None, f"{when}: {name} has a grad, the reference none"
            continue
        assert isinstance(param.grad, DTensor), f"{when}: {name}.grad is {type(param.grad)}"
        assert_close(
            param.grad.full_tensor(),
            ref_grad,
            **REF_TOL,
            msg=lambda m, n=name: f"{when}: {n}.grad vs the reference: {m}",
        )


def check_params(model: nn.Module, ref: nn.Module, when: str) -> None:
    ref_params = dict(ref.named_parameters())
    params = full_params(model)
    assert list(params) == list(ref_params), f"{when}: parameter names changed"
    for name, value in params.items():
        assert_close(
            value, ref_params[name].detach(), **REF_TOL, msg=lambda m, n=name: f"{when}: {n}: {m}"
        )


def check_resharded(module: FSDPModule, when: str) -> None:
    """The module's group is sharded, with nothing in flight or left unsharded, and
    its forward is not left open."""
    state = module._fsdp_state
    assert not state.modules_to_run, f"{when}: {state.modules_to_run} left to run"
    for group in state.param_groups:
        assert group.sharded_state is ShardedState.SHARDED, (
            f"{when}: group {group.name!r} is {group.sharded_state.name}"
        )
        assert not group.all_gather_in_flight, f"{when}: group {group.name!r} all-gathering"
        for fsdp_param in group.fsdp_params:
            assert unsharded_bytes(fsdp_param) == 0, f"{when}: {fsdp_param} unsharded"


def check_all_resharded(model: nn.Module, when: str) -> None:
    """Every group resharded, and the modules hold the DTensors again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            check_resharded(module, when)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{when}: {name} is a {type(param).__name__}"


# -- parity ----------------------------------------------------------------

# (label, weight_tying, activation checkpointing of the blocks)
PARITY_CASES = [
    ("untied: [norm, output]", False, False),
    ("tied: [tok_embeddings, norm, output]", True, False),
    ("untied, checkpointed blocks", False, True),
]


def _parity(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for label, tied, checkpoint in PARITY_CASES:
        with labelled(label):
            _train_against_reference(rank, world_size, mesh, tied, checkpoint)


def _train_against_reference(
    rank: int, world_size: int, mesh: DeviceMesh, tied: bool, checkpoint: bool
) -> None:
    ref = build_lm(weight_tying=tied, checkpoint=checkpoint)
    model = build_lm(weight_tying=tied, checkpoint=checkpoint)
    torch_model = build_lm(weight_tying=tied, checkpoint=checkpoint)
    head = shard_lm(model, mesh)
    shard_lm(torch_model, mesh, torch_fully_shard)
    state = model.norm._fsdp_state
    assert all(m._fsdp_state is state for m in head), "the head modules do not share one state"
    root_params = {p.fqn for p in model._fsdp_state.param_groups[0].fsdp_params}
    assert root_params == {"pos_embeddings.weight"} | (set() if tied else {"tok_embeddings.weight"})
    replica = build_lm(weight_tying=tied, checkpoint=checkpoint)
    optims = [make_optimizer(m) for m in (ref, model)]
    for step in range(NUM_STEPS):
        when = f"step {step}"
        batch = global_batch(TOKENS, step)
        local = local_batch(batch, rank, world_size)
        # torch's model from fsdp2's parameters: tests/error_model.py, point 2.
        copy_local_shards(model, torch_model)
        bounds = rank_sum_bounds(replica, model, lm_loss, local, world_size)
        ref_loss = lm_loss(ref, *batch)
        ref_loss.backward()
        loss = lm_loss(model, *local)
        loss.backward()
        torch_loss = lm_loss(torch_model, *local)
        torch_loss.backward()
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        check_losses_equal(loss, torch_loss, when)
        check_grads(model, ref, when)
        check_grads_against_torch(model, torch_model, bounds, when)
        check_all_resharded(model, f"{when}, after backward")
        for optim in optims:
            optim.step()
            optim.zero_grad()
        torch_model.zero_grad()
    if tied:
        assert model.tok_embeddings.weight is model.output.weight, "no longer tied"
    check_params(model, ref, f"after {NUM_STEPS} steps")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_module_group_training_parity(world_size: int, tmp_path: Path) -> None:
    """A transformer with one group per block, fully_shard([norm, output]) (with
    tied embeddings: [tok_embeddings, norm, output]) and the root: losses and
    sharded grads at every step and parameters after 4 SGD steps match the
    unsharded reference (1e-5); from the same parameters, losses equal torch's
    fully_shard's with the same list and grads are within the error model's
    bound (tests/error_model.py); also with activation checkpointing of the
    blocks. Everything is resharded after every backward."""
    run_ranks(_parity, world_size, tmp_path)


# -- collectives per step ----------------------------------------------------


def _collective_counts(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for tied in (False, True):
        model = build_lm(weight_tying=tied)
        head = shard_lm(model, mesh)
        name = "tok_embeddings, norm, output" if tied else "norm, output"  # its module paths
        optim = make_optimizer(model)
        n_layers = len(model.layers)
        for step in range(2):
            with (
                labelled(f"tied={tied}, step {step}"),
                fsdp2.comm_stats(model) as stats,
                recorded("all_gather") as all_gathers,
            ):
                loss = lm_loss(model, *local_batch(global_batch(TOKENS, step), rank, world_size))
                forward = stats.totals()[name]
                assert forward.all_gather.count == 1, f"forward: {forward}"
                assert not head[0]._fsdp_state.modules_to_run
                loss.backward()
                assert set(stats.steps[0]) == {name, "layers.0", "layers.1", "(root)"}
                group = stats.steps[0][name]
                assert group.all_gather.count == 2, f"forward + backward: {group}"
                assert group.reduce_scatter.count == 1, f"backward: {group}"
                # Each block twice, the head group twice, the root once.
                assert len(all_gathers) == 2 * n_layers + 2 + 1, len(all_gathers)
            check_all_resharded(model, f"tied={tied}, step {step}")
            optim.step()
            optim.zero_grad()


@pytest.mark.distributed
def test_module_group_all_gathered_once_per_forward_and_backward(tmp_path: Path) -> None:
    """On 2 ranks, the head group is all-gathered once in forward (although
    norm and output run separately) and once in backward, and reduce-scattered
    once; 2 * n_layers + 3 all-gathers in all per step."""
    run_ranks(_collective_counts, 2, tmp_path)


# -- modules of the group that do not run ------------------------------------------


def _partial_group(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    ref, model = build_lm(weight_tying=False), build_lm(weight_tying=False)
    shard_lm(model, mesh)
    _error_between_group_modules(rank, world_size, model)
    optims = [make_optimizer(m) for m in (ref, model)]
    # (what the step does, skip the norm, chunks of the loss computed outside forward)
    steps = [
        ("norm skipped", True, 0),
        ("all modules", False, 0),
        ("norm skipped", True, 0),
        ("head called per chunk after forward", False, 3),
        ("norm skipped, head per chunk", True, 2),
    ]
    for step, (label, skip_norm, chunks) in enumerate(steps):
        with labelled(f"step {step}: {label}"):
            ref.skip_norm = model.skip_norm = skip_norm
            batch = global_batch(TOKENS, step)
            ref_loss = lm_loss(ref, *batch, chunks=chunks)
            ref_loss.backward()
            loss = lm_loss(model, *local_batch(batch, rank, world_size), chunks=chunks)
            check_resharded(model.output, "after forward")  # whether or not norm ran
            loss.backward()
            assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
            check_grads(model, ref, "after backward")
            if skip_norm:
                assert model.norm.weight.grad is None, "the skipped norm got a grad"
            check_all_resharded(model, "after backward")
            for optim in optims:
                optim.step()
                optim.zero_grad()
            check_all_resharded(model, "after the optimizer step")
    check_params(model, ref, f"after {len(steps)} steps")


def _error_between_group_modules(rank: int, world_size: int, model: LM) -> None:
    """An error after norm ran and before output did leaves the head group's
    forward open; reset_iter_state closes it (on every rank, as documented)."""

    def fail(*_args) -> None:
        raise RuntimeError("injected between norm and output")

    handle = model.output.register_forward_pre_hook(fail)  # after fsdp2's (prepended) hook
    with pytest.raises(RuntimeError, match="injected"):
        lm_loss(model, *local_batch(global_batch(TOKENS, 99), rank, world_size))
    handle.remove()
    assert model.norm._fsdp_state.modules_to_run, "the group's forward should be left open"
    model.reset_iter_state()
    check_all_resharded(model, "after reset_iter_state")
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.distributed
def test_module_group_with_modules_that_do_not_run(tmp_path: Path) -> None:
    """With fully_shard([norm, output]) on 2 ranks: steps that skip the norm,
    and steps whose loss calls the output head per chunk after the model's
    forward, train like the reference (the skipped norm gets no grad, as in the
    reference), and every group is resharded after forward, after backward and
    after the optimizer step. Before them, an error raised between norm and
    output is recovered by reset_iter_state."""
    run_ranks(_partial_group, 2, tmp_path)


# -- single process: argument checks and what a call leaves behind ------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_world(FAKE_WORLD_SIZE):
        yield init_device_mesh("cpu", (FAKE_WORLD_SIZE,))


def assert_untouched(*modules: nn.Module) -> None:
    """A failed call must leave every module as it found it."""
    for module in modules:
        assert not isinstance(module, FSDPModule), f"{type(module).__name__} was swapped"
        assert "_fsdp_state" not in module.__dict__
        for name, param in module.named_parameters():
            assert not isinstance(param, DTensor), f"{name} was sharded"


def test_empty_list_raises(mesh: DeviceMesh) -> None:
    with pytest.raises(ValueError, match=r"got an empty list.*fully_shard\(\[model\.norm, model"):
        fully_shard([], mesh=mesh)


def test_list_with_a_non_module_raises(mesh: DeviceMesh) -> None:
    linear = nn.Linear(4, 4)
    with pytest.raises(
        TypeError, match=r"element 1 of the list is a Tensor\. Put only nn\.Modules in the list"
    ):
        fully_shard([linear, torch.ones(3)], mesh=mesh)  # type: ignore[list-item]
    assert_untouched(linear)


def test_list_with_a_duplicate_raises(mesh: DeviceMesh) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(
        ValueError, match=r"same Linear twice \(elements 0 and 2\)\. List each module once"
    ):
        fully_shard([a, b, a], mesh=mesh)
    assert_untouched(a, b)


def test_list_with_a_module_inside_another_raises(mesh: DeviceMesh) -> None:
    model = build_lm(weight_tying=False)
    with pytest.raises(
        ValueError,
        match=r"element 1 of the list \(LayerNorm\) is inside element 0 \(LM, as 'norm'\).*"
        r"Remove element 1 from the list",
    ):
        fully_shard([model, model.norm], mesh=mesh)
    assert_untouched(model)


def test_list_with_an_already_sharded_module_raises(mesh: DeviceMesh) -> None:
    model = build_lm(weight_tying=False)
    fully_shard(model.output, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"element 1 of the list: this Linear is already sharded by the fully_shard call "
        r"at \S*test_module_groups\.py:\d+, and a module.*Leave it out of the list",
    ):
        fully_shard([model.norm, model.output], mesh=mesh)
    assert_untouched(model.norm)


def test_list_with_a_container_without_forward_raises(mesh: DeviceMesh) -> None:
    model = build_lm(weight_tying=False)
    with pytest.raises(
        ValueError, match=r"containers that do not implement forward: ModuleList has none"
    ):
        fully_shard([model.norm, model.layers], mesh=mesh)
    assert_untouched(model)


def test_weight_tied_between_list_and_root_raises(mesh: DeviceMesh) -> None:
    """With tied embeddings, [norm, output] takes the tied weight, which the root's
    tok_embeddings still holds: rejected at the root's call, naming both."""
    model = build_lm(weight_tying=True)
    fully_shard([model.norm, model.output], mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"'tok_embeddings\.weight' is the same Parameter as 'output\.weight'.*"
        r"fully_shard\(\[model\.tok_embeddings, model\.output\]\)",
    ):
        fully_shard(model, mesh=mesh)
    assert not isinstance(model, FSDPModule)


def test_weight_tied_between_list_and_sibling_raises(mesh: DeviceMesh) -> None:
    """The tied weight taken by [norm, output] is refused by a later call on
    tok_embeddings (a sibling, not a parent), naming the module that took it."""
    model = build_lm(weight_tying=True)
    fully_shard([model.norm, model.output], mesh=mesh)
    with pytest.raises(
        ValueError, match=r"'weight' is the same Parameter as 'weight' of Linear.*already sharded"
    ):
        fully_shard(model.tok_embeddings, mesh=mesh)
    assert_untouched(model.tok_embeddings)


def test_list_forms_one_group_under_the_root(mesh: DeviceMesh) -> None:
    model = build_lm(weight_tying=True)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    head = [model.tok_embeddings, model.norm, model.output]
    assert fully_shard(head, mesh=mesh) is head
    fully_shard(model, mesh=mesh)

    state = model.norm._fsdp_state
    for module, cls in zip(head, ("Embedding", "LayerNorm", "Linear"), strict=True):
        assert type(module).__name__ == f"FSDP{cls}" and isinstance(module, FSDPModule)
        assert module._fsdp_state is state
    # The tied weight stays one parameter, in the head group, not the root's.
    assert model.tok_embeddings.weight is model.output.weight
    (group,) = state.param_groups
    assert [len(p.registrations) for p in group.fsdp_params] == [2, 1, 1]
    assert [p.fqn for p in model._fsdp_state.param_groups[0].fsdp_params] == [
        "pos_embeddings.weight"
    ]
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert torch.equal(param.to_local(), torch.chunk(full[name], FAKE_WORLD_SIZE)[0]), name

    # Before lazy init, parameters are named by position in the list; after, by path.
    assert [p.fqn for p in group.fsdp_params] == ["0.weight", "1.weight", "1.bias"]
    model._fsdp_state.lazy_init()  # what the first forward does first
    assert [p.fqn for p in group.fsdp_params] == [
        "tok_embeddings.weight",
        "norm.weight",
        "norm.bias",
    ]
    assert group.name == "tok_embeddings, norm, output"
    assert len(model._fsdp_state.root_ctx.groups) == 4, "the head group must be counted once"

    rows = fsdp2.summary(model, print_table=False)
    assert [r.module for r in rows] == [
        "",
        "tok_embeddings, norm, output",
        "layers.0",
        "layers.1",
    ]
    head_row = rows[1]
    assert head_row.num_params == 3
    assert head_row.numel == sum(
        full[n].numel() for n in ("tok_embeddings.weight", "norm.weight", "norm.bias")
    )
    assert head_row.reshard_after_forward == "True"

    # FSDPModule methods on any module of the list act on the one group.
    model.output.set_reshard_after_forward(False, recurse=False)
    assert group.reshard_after_forward is False
    model.tok_embeddings.set_requires_gradient_sync(False, recurse=False)
    assert group.requires_gradient_sync is False


def test_list_without_an_enclosing_root_raises_at_first_forward(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard([model[0], model[2]], mesh=mesh)
    with pytest.raises(
        RuntimeError, match=r"\(FSDPLinear, FSDPLinear\).*needs one root.*fully_shard"
    ):
        model(torch.ones(2, 4))


def test_load_full_state_dict_into_a_list_group(mesh: DeviceMesh) -> None:
    """Full tensors loaded into the model (or into one module of the list) are
    cut to this rank's shard, tied weight included."""
    model = build_lm(weight_tying=True)
    shard_lm(model, mesh)
    torch.manual_seed(1)
    other = LM(weight_tying=True)
    full = other.state_dict()
    model.load_state_dict(full)
    for name, param in model.named_parameters():
        assert torch.equal(param.to_local(), torch.chunk(full[name], FAKE_WORLD_SIZE)[0]), name
    assert model.tok_embeddings.weight is model.output.weight

    norm_sd = {"weight": torch.full((18,), 3.0), "bias": torch.full((18,), -1.0)}
    model.norm.load_state_dict(norm_sd)
    assert torch.equal(model.norm.weight.to_local(), torch.full((3,), 3.0))
    assert torch.equal(model.norm.bias.to_local(), torch.full((3,), -1.0))
