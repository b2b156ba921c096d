"""torch.compile with fsdp2, torchtitan's way: each block compiled, each block
its own group, then the root.

Blocks are compiled before ``fully_shard`` (``block.compile()``, or
``torch.compile(block)`` put back in ``model.layers``, which is then sharded)
or after it, or the whole sharded model is compiled. Each run trains a few
SGD steps and is compared with an uncompiled, unsharded copy trained on the
global batch (DDP math): the losses of every step and every parameter at the
end. In bf16 the reference is torch's ``fully_shard`` under the same compile.

Each run also checks what dynamo did: the block's forward compiled into one
graph with no graph break inside it (fsdp2's hooks run eagerly at the block's
boundary), and nothing compiled after the first step.

The bug these guard against: dynamo used to trace the hooks, and the traced
``buffer.narrow(...).data`` that builds an unsharded parameter came back from
the compiled graph as a view of the buffer, sharing its version counter, so
every all-gather's copy-out bumped the version that backward checks
(see [Note: hooks under torch.compile] in fsdp2/engine/states.py).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import labelled, run_ranks
from error_model import EXACT, REF_TOL
from models import global_mean, local_batch, make_optimizer, transformer_args
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.testing import assert_close
from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

import fsdp2
from fsdp2.engine.states import EAGER_HOOK_REASON

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import llama  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 8
SEQ_LEN = 16

# How the blocks are compiled, relative to fully_shard.
BEFORE_METHOD = "block.compile(), then fully_shard"
BEFORE_WRAP = "torch.compile(block), then fully_shard"
AFTER_METHOD = "fully_shard, then block.compile()"
AFTER_WRAP = "fully_shard, then torch.compile(block)"
WHOLE = "fully_shard, then torch.compile(model)"


@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "transformer"  # "transformer" (torch's test model), "llama" (scripts/), "hf_llama"
    how: str = BEFORE_METHOD
    backend: str = "aot_eager"
    tied: bool = True
    reshard: bool | int = True
    checkpoint: str | None = None  # "inside compile" (checkpoint_wrapper) or "around blocks"
    bf16: bool = False
    fullgraph: bool = False  # of the blocks' compiles

    def __str__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)]
        return ", ".join(fields)


# -- models -------------------------------------------------------------------


def _vocab(case: Case) -> int:
    return {"transformer": 33, "llama": 64, "hf_llama": 128}[case.model]


def _build(case: Case) -> nn.Module:
    """The same freshly initialised model on every rank, uncompiled and unsharded."""
    torch.manual_seed(0)
    if case.model == "transformer":
        args = transformer_args(weight_tying=case.tied, n_layers=2)
        args = dataclasses.replace(args, max_seq_len=SEQ_LEN)
        if case.checkpoint == "around blocks":
            args = dataclasses.replace(args, checkpoint_activations=True)
        return Transformer(args)
    if case.model == "llama":
        config = llama.LlamaConfig(
            vocab_size=_vocab(case),
            dim=32,
            n_layers=2,
            n_heads=2,
            max_seq_len=SEQ_LEN,
            tie_embeddings=case.tied,
        )
        model = llama.Llama(config)
        llama.init_weights(model, seed=0)
        return model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=_vocab(case),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=case.tied,
    )
    return LlamaForCausalLM(config)


def _blocks(model: nn.Module) -> nn.ModuleList:
    inner = model.model if hasattr(model, "model") else model  # Hugging Face: model.model.layers
    return inner.layers


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens)
    return output if isinstance(output, torch.Tensor) else output.logits


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = _logits(model, tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _global_batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    shape = (GLOBAL_BATCH, SEQ_LEN)
    return (
        torch.randint(_vocab(case), shape, generator=gen),
        torch.randint(_vocab(case), shape, generator=gen),
    )


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' ``_orig_mod.`` / ``_checkpoint_wrapped_module.``."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        _plain_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }


# -- compiling and sharding ---------------------------------------------------


def _compiled_and_sharded(case: Case, fully_shard, mp_policy, backend) -> nn.Module:
    """``case.model`` with activation checkpointing, compiled and sharded as ``case.how`` says."""
    model = _build(case)
    blocks = _blocks(model)
    if case.checkpoint == "inside compile":  # torchtitan: checkpoint, compile, shard
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    options = {"backend": backend, "fullgraph": case.fullgraph}
    if case.how == BEFORE_METHOD:
        for block in blocks:
            block.compile(**options)
    elif case.how == BEFORE_WRAP:
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, **options)
    shard = {"reshard_after_forward": case.reshard, "mp_policy": mp_policy}
    for block in blocks:
        fully_shard(block, **shard)
    fully_shard(model, **shard)
    if case.how == AFTER_METHOD:
        for block in blocks:
            block.compile(**options)
    elif case.how == AFTER_WRAP:
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, **options)
    elif case.how == WHOLE:
        model = torch.compile(model, backend=backend)
    return model


class Compiled:
    """What dynamo did during one run: graphs compiled (through a counting
    backend) and graph breaks (dynamo's counters), per step."""

    def __init__(self, backend: str) -> None:
        torch._dynamo.reset()
        counters.clear()
        self.backend = CompileCounterWithBackend(backend)
        self.graphs_after_step: list[int] = []

    def end_step(self) -> None:
        self.graphs_after_step.append(self.backend.frame_count)

    def check(self, case: Case, n_blocks: int) -> None:
        graphs = self.graphs_after_step
        assert graphs[0] >= 1, "nothing was compiled"
        assert graphs == [graphs[0]] * len(graphs), f"compiled after the first step: {graphs}"
        breaks = dict(counters["graph_break"])
        if case.how == WHOLE:
            # The model's graph breaks where it calls a block, at fsdp2's hooks
            # only; none counted when the blocks are called in a loop (dynamo then
            # runs the loop eagerly, as under torch's: test_compiles_like_torch).
            assert all(EAGER_HOOK_REASON in reason for reason in breaks), breaks
        else:
            # Each block's forward is one graph (blocks may share one).
            assert not breaks, f"graph breaks in a compiled block: {breaks}"
            assert graphs[0] <= n_blocks, f"{graphs[0]} graphs for {n_blocks} blocks"


def _check_versions_untouched(model: nn.Module) -> None:
    """No copy-out bumped the version counter of an unsharded parameter: autograd
    (eager or compiled) saves it in forward and checks it in backward."""
    states = {fsdp2.fully_shard.state(m) for m in model.modules()} - {None}
    for state in states:
        for fsdp_param in (p for group in state.param_groups for p in group.fsdp_params):
            version = fsdp_param.unsharded_param._version
            assert version == 0, f"{fsdp_param.fqn}: unsharded parameter at version {version}"


# -- training -----------------------------------------------------------------


def _train(rank: int, world_size: int, case: Case) -> None:
    compiled = Compiled(case.backend)
    if case.bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # The reference is torch's fully_shard under the same compile: the same
        # bf16 graphs, so the same rounding.
        torch_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ref = _compiled_and_sharded(case, fully_shard, torch_policy, case.backend)
        policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        tol = EXACT  # 2 ranks, the same graphs: tests/error_model.py, point 2
    else:
        ref = _build(case)
        policy = fsdp2.MixedPrecisionPolicy()
        tol = REF_TOL
    model = _compiled_and_sharded(case, fsdp2.fully_shard, policy, compiled.backend)
    optims = [make_optimizer(ref), make_optimizer(model)]
    for step in range(STEPS):
        batch = _global_batch(case, step)
        mine = local_batch(batch, rank, world_size)
        ref_loss = _loss(ref, *(mine if case.bf16 else batch))
        ref_loss.backward()
        if case.bf16:
            ref_loss = global_mean(ref_loss, world_size)
        loss = _loss(model, *mine)
        loss.backward()
        compiled.end_step()
        _check_versions_untouched(model)
        assert_close(
            global_mean(loss, world_size),
            ref_loss.detach(),
            **tol,
            msg=lambda m, s=step: f"step {s}: {m}",
        )
        for optim in optims:
            optim.step()
            optim.zero_grad()
    expected = _full_params(ref)
    got = _full_params(model)
    assert got.keys() == expected.keys()
    for name, param in got.items():
        assert_close(param, expected[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    compiled.check(case, len(_blocks(model)))


def _cases(rank: int, world_size: int, cases: list[Case]) -> None:
    for case in cases:
        with labelled(str(case)):
            _train(rank, world_size, case)


@pytest.mark.distributed
def test_every_way_to_compile_the_blocks(tmp_path: Path) -> None:
    """Blocks compiled before or after fully_shard, by their method or wrapped,
    or the whole sharded model compiled: each trains like the eager reference;
    with fullgraph=True too (torchtitan compiles its blocks so, then shards)."""
    cases = [Case(how=how) for how in (BEFORE_METHOD, BEFORE_WRAP, AFTER_METHOD, AFTER_WRAP, WHOLE)]
    cases.append(Case(how=BEFORE_METHOD, tied=False, reshard=False))
    cases += [Case(how=how, fullgraph=True) for how in (BEFORE_WRAP, BEFORE_METHOD)]
    run_ranks(_cases, 2, tmp_path, cases)


@pytest.mark.distributed
def test_llama_and_activation_checkpointing(tmp_path: Path) -> None:
    """The demo's Llama, tied and untied; checkpointing inside the compiled block
    (torchtitan's order: checkpoint_wrapper, compile, shard) and around the
    compiled sharded blocks (recomputed through fsdp2's hooks in backward)."""
    cases = [
        Case(model="llama", tied=False),
        Case(model="llama", how=WHOLE, reshard=False),
        Case(model="llama", checkpoint="inside compile"),
        Case(model="transformer", how=AFTER_METHOD, checkpoint="around blocks"),
    ]
    run_ranks(_cases, 2, tmp_path, cases)


@pytest.mark.distributed
def test_reshard_after_forward_to_pairs_of_ranks(tmp_path: Path) -> None:
    """reshard_after_forward=2 on 4 ranks: backward all-gathers inside each pair."""
    run_ranks(_cases, 4, tmp_path, [Case(model="transformer", reshard=2)])


@pytest.mark.distributed
def test_bf16_like_torch_fully_shard(tmp_path: Path) -> None:
    """bf16 compute, fp32 reduction: the same losses and parameters as torch's
    fully_shard with the same policy under the same compile."""
    run_ranks(_cases, 2, tmp_path, [Case(model="llama", bf16=True)])


@pytest.mark.distributed
def test_hugging_face_llama(tmp_path: Path) -> None:
    """LlamaForCausalLM (tiny, tied embeddings): torch.compile on each decoder
    layer, then fully_shard on each, as torchtitan does; and the whole sharded
    model compiled (its forward compiles around the layers' hooks)."""
    cases = [Case(model="hf_llama", how=BEFORE_WRAP), Case(model="hf_llama", how=WHOLE)]
    run_ranks(_cases, 2, tmp_path, cases)


@pytest.mark.distributed
def test_inductor(tmp_path: Path) -> None:
    """The issue's recipe with inductor, on the demo's Llama and Hugging Face's:
    block.compile() on each block, then fully_shard."""
    cases = [Case(model="llama", backend="inductor"), Case(model="hf_llama", backend="inductor")]
    run_ranks(_cases, 2, tmp_path, cases)


def _compiled_step(rank: int, world_size: int) -> None:
    case = Case(model="transformer")
    ref = _build(case)
    model = _build(case)
    for block in _blocks(model):
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    compiled = Compiled("aot_eager")

    def forward_backward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, tokens, targets)
        loss.backward()
        return loss.detach()

    forward_backward = torch.compile(forward_backward, backend=compiled.backend)
    optims = [make_optimizer(ref), make_optimizer(model)]
    for step in range(STEPS):
        batch = _global_batch(case, step)
        ref_loss = _loss(ref, *batch)
        ref_loss.backward()
        loss = forward_backward(*local_batch(batch, rank, world_size))
        compiled.end_step()
        _check_versions_untouched(model)
        assert_close(global_mean(loss, world_size), ref_loss.detach(), **REF_TOL)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    got, expected = _full_params(model), _full_params(ref)
    for name, param in got.items():
        assert_close(param, expected[name], **REF_TOL, msg=lambda m, n=name: f"{n}: {m}")
    graphs = compiled.graphs_after_step
    assert graphs[0] >= 1 and graphs == [graphs[0]] * STEPS, f"graphs per step: {graphs}"
    # Dynamo breaks the step where it calls a hook and where it calls backward(),
    # which it cannot trace; the backward hooks the engine then calls on this
    # thread must not be traced either (they would break on every collective).
    breaks = dict(counters["graph_break"])
    assert any(EAGER_HOOK_REASON in reason for reason in breaks), breaks
    others = [r for r in breaks if EAGER_HOOK_REASON not in r]
    assert all(r.startswith("Unsupported Tensor.backward() call") for r in others), others


@pytest.mark.distributed
def test_compiled_training_step(tmp_path: Path) -> None:
    """torch.compile of a function that runs forward and backward: every hook,
    backward's included, still runs eagerly, and the model trains like the reference."""
    run_ranks(_compiled_step, 2, tmp_path)


# -- many block classes --------------------------------------------------------

N_CLASSES = 10  # over dynamo's recompile_limit (8)


def _block_classes() -> list[type[nn.Module]]:
    """``N_CLASSES`` block classes, each with a forward of its own (its own
    code object), as a model's distinct block types have."""
    classes = []
    for i in range(N_CLASSES):
        namespace: dict[str, object] = {"nn": nn, "F": F}
        exec(
            f"class Block{i}(nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.fc = nn.Linear(8, 8)\n"
            "    def forward(self, x):\n"
            f"        return x + F.gelu(self.fc(x)) * {i + 1}\n",
            namespace,
        )
        classes.append(namespace[f"Block{i}"])  # type: ignore[arg-type]
    return classes


def _many_classes_run(shard: object, classes: list[type[nn.Module]]) -> tuple[int, list[str]]:
    """Three steps of one block of each class, each ``block.compile()``-d
    after ``shard``; the sequence length changes at the second step (one
    recompile per class). Returns the frames compiled and dynamo's warnings."""
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    torch.manual_seed(0)
    model = nn.Sequential(*(cls() for cls in classes))
    for block in model:
        shard(block)  # type: ignore[operator]
    shard(model)  # type: ignore[operator]
    for block in model:
        block.compile(backend=backend)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        for seq_len in (4, 6, 6):
            model(torch.randn(2, seq_len, 8)).sum().backward()
    finally:
        logger.removeHandler(handler)
    return backend.frame_count, messages


class _Straight(nn.Module):
    """Blocks called one after the other in forward's code."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.c(self.b(self.a(x))))

    def blocks(self) -> list[nn.Module]:
        return [self.a, self.b, self.c]


class _Looped(nn.Module):
    """Blocks called in a for loop, torchtitan's way."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)


def _whole_model_run(shard: object, model_cls: type[nn.Module]) -> tuple[int, int, list[float]]:
    """Two steps of ``torch.compile(model)`` over blocks sharded by ``shard``:
    the frames compiled, dynamo's graph breaks and the losses."""
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    torch.manual_seed(0)
    model = model_cls()
    for block in model.blocks():  # type: ignore[operator]
        shard(block)  # type: ignore[operator]
    shard(model)  # type: ignore[operator]
    compiled = torch.compile(model, backend=backend)
    losses = []
    for step in range(2):
        loss = compiled(torch.full((2, 8), float(step + 1))).square().mean()
        loss.backward()
        losses.append(loss.item())
    return backend.frame_count, sum(counters["graph_break"].values()), losses


def _compiles_like_torch(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    classes = _block_classes()
    torch_frames, _ = _many_classes_run(torch_fully_shard, classes)
    frames, messages = _many_classes_run(fsdp2.fully_shard, classes)
    limit_hits = [m for m in messages if "recompile_limit" in m]
    assert not limit_hits, limit_hits
    # Every class compiled for both sequence lengths (the second dynamic): none
    # fell back to eager.
    assert frames == torch_frames == 2 * N_CLASSES, (frames, torch_frames)

    for model_cls in (_Straight, _Looped):
        with labelled(model_cls.__name__):
            theirs = _whole_model_run(torch_fully_shard, model_cls)
            ours = _whole_model_run(fsdp2.fully_shard, model_cls)
            assert ours == theirs, f"(frames, graph breaks, losses): fsdp2 {ours}, torch {theirs}"


@pytest.mark.distributed
def test_compiles_like_torch(tmp_path: Path) -> None:
    """What dynamo compiles equals torch's fully_shard's:
    - 10 sharded block classes, each block.compile()-d, the sequence length
      changing at step 2: every class compiles twice and dynamo never hits its
      recompile limit (a compiled block starts at its own forward);
    - torch.compile(model) over blocks called in straight-line code and in a
      loop: the same frames, the same graph breaks (fsdp2's checked forward
      adds none) and the same losses."""
    run_ranks(_compiles_like_torch, 2, tmp_path)


# -- compiled autograd ---------------------------------------------------------


def _compiled_autograd_refused(rank: int, world_size: int) -> None:
    from torch._dynamo import compiled_autograd

    case = Case(model="transformer")
    model = _build(case)
    for block in _blocks(model):
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    batch = local_batch(_global_batch(case, 0), rank, world_size)

    def step() -> None:
        _loss(model, *batch).backward()

    refused = r"runs under compiled autograd .* Compile the forward instead"
    with (
        pytest.raises(RuntimeError, match=refused),
        compiled_autograd._enable(torch.compile(backend="aot_eager")),
    ):
        step()
    model.reset_iter_state()
    torch._dynamo.reset()
    torch._dynamo.config.compiled_autograd = True
    try:
        with pytest.raises(RuntimeError, match=refused):
            torch.compile(step, backend="aot_eager")()
    finally:
        torch._dynamo.config.compiled_autograd = False


@pytest.mark.distributed
def test_compiled_autograd_is_refused(tmp_path: Path) -> None:
    """Compiled autograd drops the engine callback that ends fsdp2's backward
    (its blocks' gradients stayed None, silently; torch's fully_shard trains
    wrong under it): the first compiled backward raises, saying what to do
    instead, under compiled_autograd._enable and under the config flag in a
    compiled step."""
    run_ranks(_compiled_autograd_refused, 2, tmp_path)
