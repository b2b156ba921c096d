"""Mistakes that used to train silently wrong now stop at the first forward or
optimizer step (fsdp2/checks/mistakes.py, fsdp2/checks/same_model.py), and the legitimate
uses that look like them run without an error or a warning:

- a root left unsharded (its parameters trained apart on each rank),
- an optimizer built before fully_shard (stepping the replaced parameters),
- ranks that hold different models: built with a seed per rank (FSDP, HSDP,
  HSDP over replicas), a checkpoint loaded on some ranks only, HSDP replicas
  or min_numel_to_shard's whole copies that differ.

One spawn per world size: 2 ranks for FSDP, 4 for HSDP and TP (2 x 2).

A model mixing fsdp2 with torch's own fully_shard stops with one error from
fsdp2 that says to use one implementation (fsdp2/base/torch_fsdp.py): in one
process, on a 1-rank gloo group.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from dist import labelled, run_ranks
from models import (
    SEQ_LEN,
    VOCAB_SIZE,
    build_model,
    global_batch,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
    transformer_args,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import fsdp2
import fsdp2.checks.mistakes
import fsdp2.checks.same_model
from fsdp2.api.check_switches import skip_same_model_check

KIND = "transformer_untied"  # a root with parameters of its own: embeddings, norm, head
THRESHOLD = 100  # min_numel_to_shard: biases and norm weights stay whole on every rank


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Fails on any warning but torch's own deprecation notices."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    ours = [w for w in caught if "/torch/" not in w.filename]
    assert not ours, [f"{w.category.__name__}: {w.message}" for w in ours]


@contextlib.contextmanager
def counted_checks() -> Iterator[list[int]]:
    """Counts the checks' collectives while active: the optimizer check's
    (``fsdp2.checks.mistakes._gather``) and the lazy init's all-reduces
    (``fsdp2.checks.same_model._max_over``)."""
    calls = [0]
    patched = [(fsdp2.checks.mistakes, "_gather"), (fsdp2.checks.same_model, "_max_over")]
    originals = [getattr(module, name) for module, name in patched]

    def counting(original):
        def counted(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        return counted

    for (module, name), original in zip(patched, originals, strict=True):
        setattr(module, name, counting(original))
    try:
        yield calls
    finally:
        for (module, name), original in zip(patched, originals, strict=True):
            setattr(module, name, original)


def train(model: nn.Module, optims: list[torch.optim.Optimizer], rank: int, world: int) -> None:
    """Two steps on this rank's slice of the global batch (different on each rank)."""
    for step in range(2):
        mean_loss(model, *local_batch(global_batch(KIND, step), rank, world)).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()


def built_on_rank(rank: int) -> nn.Module:
    """The model built with a seed of this rank's own: other values on each rank."""
    torch.manual_seed(rank)
    return Transformer(transformer_args(weight_tying=False))


def blocks_only(model: nn.Module, **kwargs) -> nn.Module:
    for layer in model.layers:
        fsdp2.fully_shard(layer, **kwargs)
    return model


# -- 2 ranks: the mistakes ---------------------------------------------------------


def _mistakes(rank: int, world: int) -> None:
    batch = local_batch(global_batch(KIND, 0), rank, world)
    with labelled("the root is not sharded"):
        model = blocks_only(build_model(KIND))
        optim = make_optimizer(model)
        mean_loss(model, *batch).backward()
        with pytest.raises(
            RuntimeError,
            match=r"call fully_shard\(model\) on the root after its blocks: these parameters "
            r"are not sharded and will not be synchronized: param_groups\[0\]\['params'\]\[0\] "
            r"\(33, 18\), .* \(by their place in the optimizer; build it from "
            r"model\.named_parameters\(\) to see their names here\)\. The optimizer holds",
        ):
            optim.step()
    with labelled("the root is not sharded, named parameters"):
        model = blocks_only(build_model(KIND))
        optim = torch.optim.AdamW(model.named_parameters())
        mean_loss(model, *batch).backward()
        with pytest.raises(RuntimeError, match=r"synchronized: 'tok_embeddings.weight', ") as e:
            optim.step()
        assert "by their place in the optimizer" not in str(e.value)
    with labelled("the optimizer is built before fully_shard"):
        model = build_model(KIND)
        optim = make_optimizer(model)
        shard_model(model)
        mean_loss(model, *batch).backward()
        with pytest.raises(
            RuntimeError,
            match=r"the optimizer holds \d+ parameters that fully_shard replaced with sharded "
            r"ones: 'tok_embeddings.weight', 'pos_embeddings.weight', 'layers.0.attention_norm"
            r".* Build the optimizer after fully_shard",
        ):
            optim.step()
    with labelled("ranks seeded apart"):
        model = shard_model(built_on_rank(rank))
        with pytest.raises(
            RuntimeError,
            match=r"the 2 data-parallel ranks built different models: 'tok_embeddings.weight', "
            r".* \(and \d+ more\) differed when fully_shard took them whole, .* Build the same "
            r"model on every rank: torch.manual_seed\(0\)",
        ):
            model(batch[0])
    with labelled("ranks seeded apart, the check switched off"), counted_checks() as checks:
        model = shard_model(built_on_rank(rank))
        skip_same_model_check(model)  # on every rank
        model(batch[0])
        assert checks[0] == 0, f"no all-reduce: {checks}"
    with labelled("a checkpoint loaded on rank 0 only"):
        checkpoint = built_on_rank(7).state_dict()
        model = shard_model(build_model(KIND))
        if rank == 0:
            model.load_state_dict(checkpoint)
        with pytest.raises(
            RuntimeError,
            match=r"'tok_embeddings.weight', .* changed since fully_shard on some of the 2 "
            r"data-parallel ranks and were not even written on others .* Load on every rank, "
            r"before the first forward",
        ):
            model(batch[0])
    with labelled("min_numel_to_shard copies differ"):
        torch.manual_seed(rank)  # a seed per rank
        model = shard_model(TwoLayers(), min_numel_to_shard=THRESHOLD)
        with pytest.raises(
            RuntimeError,
            match=r"the ranks hold different copies of parameters that min_numel_to_shard keeps "
            r"whole on each of the 2 ranks: 'layers.0.bias', 'layers.1.weight', 'layers.1.bias' "
            r"differ at the "
            r"first forward\. .*torch.manual_seed\(0\)",
        ):
            model(torch.randn(2, 4))


class TwoLayers(nn.Module):
    """4 -> 40 -> 2: below THRESHOLD elements, all but the first weight stay whole."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 40), nn.Linear(40, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


# -- 2 ranks: what looks like them but is right ---------------------------------------


def _legitimate(rank: int, world: int, tmp: Path) -> None:
    with labelled("a root without parameters of its own"), no_warnings():
        model = shard_model(build_model("mlp"))
        optim = make_optimizer(model)
        with counted_checks() as checks:
            for step in range(3):
                mean_loss(model, *local_batch(global_batch("mlp", step), rank, world)).backward()
                optim.step()
                optim.zero_grad()
                assert checks[0] == 1, f"step {step}: one all-reduce at lazy init, {checks[0]}"
    with labelled("two roots on purpose, sharing a comm context"), no_warnings():
        first, second = shard_model(build_model(KIND)), shard_model(build_model(KIND))
        fsdp2.share_comm_ctx([first, second])
        optim = make_optimizer([*first.parameters(), *second.parameters()])
        for step in range(2):
            batch = local_batch(global_batch(KIND, step), rank, world)
            (mean_loss(first, *batch) + mean_loss(second, *batch)).backward()
            optim.step()
            optim.zero_grad()
    with labelled("another optimizer over plain parameters"), no_warnings():
        model = shard_model(build_model(KIND))
        head = nn.Linear(18, 1)  # this rank's own, trained on its own data
        optims = [make_optimizer(model), make_optimizer(head)]
        for step in range(2):
            batch = local_batch(global_batch(KIND, step), rank, world)
            mean_loss(model, *batch).backward()
            head(torch.randn(3, 18)).sum().backward()
            for optim in optims:
                optim.step()
                optim.zero_grad()
    with labelled("frozen and ignored parameters of an unsharded root"), no_warnings():
        model = build_model(KIND)
        for param in (model.tok_embeddings.weight, model.pos_embeddings.weight):
            param.requires_grad_(False)
        ignored = {model.norm.weight, model.norm.bias, model.output.weight}
        shard_model(model, ignored_params=ignored)
        train(model, [make_optimizer(model)], rank, world)
    with labelled("plain parameters the user synchronizes"), no_warnings():
        model = blocks_only(build_model(KIND))
        optim = make_optimizer(model)
        with counted_checks() as checks:
            for step in range(3):
                mean_loss(model, *local_batch(global_batch(KIND, step), rank, world)).backward()
                for param in model.parameters():  # the root's, as DDP would
                    if not isinstance(param, DTensor) and param.grad is not None:
                        dist.all_reduce(param.grad)
                        param.grad /= world
                optim.step()
                optim.zero_grad()
        # Each block is a root of its own: one all-reduce at each lazy init, one
        # all-gather at the first step, then none.
        assert checks[0] == len(model.layers) + 1, checks
    with labelled("min_numel_to_shard, loaded after fully_shard"), no_warnings():
        # Other values on each rank: the load makes them equal.
        model = shard_model(built_on_rank(rank), min_numel_to_shard=THRESHOLD)
        model.load_state_dict(build_model(KIND).state_dict())  # full tensors, the same
        train(model, [make_optimizer(model)], rank, world)
        dcp.save(get_model_state_dict(model), checkpoint_id=tmp / "dcp")
    with labelled("min_numel_to_shard, loaded by DCP"), no_warnings():
        model = shard_model(built_on_rank(rank), min_numel_to_shard=THRESHOLD)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=tmp / "dcp")
        set_model_state_dict(model, state)
        train(model, [make_optimizer(model)], rank, world)
    with labelled("a full state dict for rank 0 (docs/usage.md)"), no_warnings():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)  # on every rank: a collective
        if rank == 0:
            assert full.keys() == model.state_dict().keys()
            expected = {name: p.full_tensor() for name, p in model.named_parameters()}
            for name, tensor in full.items():
                assert not isinstance(tensor, DTensor) and tensor.device.type == "cpu", name
                assert torch.equal(tensor, expected[name]), name
        else:
            assert not full, "cpu_offload=True: a full model on rank 0 only"
            for p in model.parameters():
                p.full_tensor()  # rank 0's full_tensor() calls, matched
    with labelled("meta init, then initialised on the sharded parameters"), no_warnings():
        with torch.device("meta"):
            model = shard_model(build_model(KIND))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        torch.manual_seed(rank)  # for data only, after the model is built
        model(torch.randint(VOCAB_SIZE, (2, SEQ_LEN)))
    with labelled("a full checkpoint read on rank 0, broadcast"), no_warnings():
        full = build_model(KIND).state_dict() if rank == 0 else {}
        with torch.device("meta"):
            model = shard_model(build_model(KIND))
        model.to_empty(device="cpu")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        train(model, [make_optimizer(model)], rank, world)


@pytest.mark.distributed
def test_mistakes_and_legitimate_uses_at_2(tmp_path: Path) -> None:
    """Each mistake raises on every rank with what is wrong and the fix; the
    legitimate uses next to them run without an error or a warning."""
    run_ranks(_mistakes, 2, tmp_path / "mistakes")
    run_ranks(_legitimate, 2, tmp_path / "legitimate", tmp_path)


# -- 4 ranks: HSDP --------------------------------------------------------------------


def _hsdp(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with labelled("replicas built with a seed per rank"):
        model = shard_model(built_on_rank(rank), mesh=mesh)
        with pytest.raises(
            RuntimeError,
            match=r"the HSDP replicas hold different parameters \(2 replicas\): "
            r"'tok_embeddings.weight', .* \(and \d+ more\) differ at the first forward\. .*"
            r"torch.manual_seed\(0\)",
        ):
            model(global_batch(KIND, 0)[0])
    with labelled("one shard of one replica differs: every rank raises"):
        model = shard_model(build_model(KIND), mesh=mesh)
        if rank == 0:
            with torch.no_grad():
                model.layers[1].feed_forward.w2.weight.to_local().add_(1e-3)
        with pytest.raises(RuntimeError, match=r"replicas hold .*: 'layers.1.feed_forward.w2"):
            model(global_batch(KIND, 0)[0])
    batch = global_batch(KIND, 0)[0]
    checkpoint = built_on_rank(7).state_dict()  # the same on every rank
    with labelled("a checkpoint loaded on shard 0 of each replica: copies alike, stitched"):
        model = shard_model(build_model(KIND), mesh=mesh)
        if mesh.get_local_rank("shard") == 0:
            model.load_state_dict(checkpoint)
        with pytest.raises(RuntimeError, match=r"changed since fully_shard on some of the 4 "):
            model(batch)
    over_replicas = {"mesh": mesh, "shard_optimizer_over_replicas": True}
    with labelled("over replicas, a seed per rank"):
        model = shard_model(built_on_rank(rank), **over_replicas)
        with pytest.raises(
            RuntimeError,
            match=r"the 4 data-parallel ranks built different models: 'tok_embeddings.weight', "
            r".* differed when fully_shard took them whole",
        ):
            model(batch)
    with labelled("over replicas, a checkpoint loaded on one replica only"):
        model = shard_model(build_model(KIND), **over_replicas)
        if rank < world // 2:
            model.load_state_dict(checkpoint)
        with pytest.raises(
            RuntimeError,
            match=r"'tok_embeddings.weight', .* changed since fully_shard on some of the 4 "
            r"data-parallel ranks and were not even written on others",
        ):
            model(batch)
    replicas = mesh.get_group("replicate")
    source = dist.get_process_group_ranks(replicas)[0]
    for label, load in (("overwritten", False), ("loaded", True)):
        with labelled(f"replica 1 {label}, then replica 0 broadcast"), no_warnings():
            # torch's recipe for replicas made alike after fully_shard (its
            # test_hsdp_broadcast_across_replicas): a broadcast bumps no version counter.
            model = shard_model(build_model(KIND), mesh=mesh)
            if mesh.get_local_rank("replicate") > 0:
                with torch.no_grad():
                    for param in model.parameters():
                        param.to_local().fill_(1337)
            elif load:
                model.load_state_dict(checkpoint)
            for param in model.parameters():
                dist.broadcast(param.to_local(), src=source, group=replicas)
            model(batch)
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tokens = torch.randint(34, (2, 10), generator=torch.Generator().manual_seed(0))
    with labelled("TP: the same model, TP-local tensors apart over tp only"), no_warnings():
        tensor_parallel(0, tp)(tokens)
    with labelled("TP: a seed per rank"):
        model = tensor_parallel(rank, tp)
        with pytest.raises(
            RuntimeError,
            match=r"the 2 data-parallel ranks built different models: 'tok_embeddings.weight'",
        ):
            model(tokens)
    with labelled("the same model on every rank"), no_warnings():
        model = shard_model(build_model(KIND), mesh=mesh, min_numel_to_shard=THRESHOLD)
        train(model, [make_optimizer(model)], rank, world)
    with labelled("over replicas, a seed per rank, a checkpoint loaded on every rank"):
        with no_warnings(), counted_checks() as checks:
            model = shard_model(built_on_rank(rank), **over_replicas)
            model.load_state_dict(checkpoint)
            train(model, [make_optimizer(model)], rank, world)
        assert checks[0] == 2, f"one all-reduce per mesh axis at lazy init, none after: {checks}"


def tensor_parallel(seed: int, mesh: DeviceMesh) -> nn.Module:
    """Built with ``seed``, parallelized over mesh["tp"] (each rank's TP-local
    tensors from its tp group's first rank), sharded over mesh["dp"]."""
    torch.manual_seed(seed)
    args = ModelArgs(n_layers=1, vocab_size=34, max_seq_len=10, dim=16, n_heads=4, dropout_p=0)
    model = Transformer(args)
    Transformer.parallelize(model, mesh["tp"], use_seq_parallel=False, local_output_for_attn=True)
    return shard_model(model, mesh=mesh["dp"])


@pytest.mark.distributed
def test_hsdp_replicas_that_differ(tmp_path: Path) -> None:
    """Each rank of a 2 x 2 mesh (HSDP, or dp x tp) raises, and the same model
    trains."""
    run_ranks(_hsdp, 4, tmp_path)


# -- torch's own fully_shard mixed in: one process, 1 rank --------------------------

USE_ONE = (
    r"fsdp2 and torch's implementation cannot be mixed in one model: .* Use one implementation for the whole model: "
    r"fsdp2\.fully_shard on every block and on the root .*, or "
    r"torch\.distributed\.fsdp\.fully_shard on every module\."
)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = tmp_path_factory.mktemp("one_rank") / "store"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


def _mesh(named: bool = True) -> DeviceMesh:
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp",) if named else None)


def _torch_block_fsdp2_root(model: Blocks) -> object:
    torch_fully_shard(model.layers[0], mesh=_mesh())
    return fsdp2.fully_shard(model, mesh=_mesh())


def _torch_root_first(model: Blocks) -> object:
    torch_fully_shard(model, mesh=_mesh())
    return fsdp2.fully_shard(model.layers[0], mesh=_mesh())


def _the_same_module(model: Blocks) -> object:
    torch_fully_shard(model.layers[0], mesh=_mesh())
    return fsdp2.fully_shard(model.layers[0], mesh=_mesh())


def _in_a_list(model: Blocks) -> object:
    torch_fully_shard(model.out, mesh=_mesh())
    return fsdp2.fully_shard([model.layers[0], model.out], mesh=_mesh())


SHARDED_BY_TORCH = r"is already sharded by torch's own fully_shard \(torch\.distributed\.fsdp\)"


@pytest.mark.parametrize(
    ("mix", "head"),
    [
        (_torch_block_fsdp2_root, rf"'layers\.0' \(FSDPLinear\) {SHARDED_BY_TORCH}\. "),
        (_torch_root_first, rf"Linear {SHARDED_BY_TORCH}, applied to a module containing it\. "),
        (_the_same_module, rf"FSDPLinear {SHARDED_BY_TORCH}\. "),
        (_in_a_list, rf"'1' \(FSDPLinear\) {SHARDED_BY_TORCH}\. "),
    ],
    ids=["torch_block_fsdp2_root", "torch_root_first", "the_same_module", "in_a_list"],
)
def test_torch_fully_shard_inside_raises_at_fully_shard(one_rank: None, mix, head: str) -> None:
    """torch's blocks under an fsdp2 root (once diagnosed as tensor parallelism),
    or torch's root applied first: fsdp2's fully_shard refuses, changing nothing."""
    model = Blocks()
    with pytest.raises(ValueError, match=rf"^fully_shard: {head}{USE_ONE}"):
        mix(model)
    assert not any(isinstance(m, fsdp2.FSDPModule) for m in model.modules())
    assert not any("_fsdp_state" in m.__dict__ for m in model.modules())


def test_fsdp2_blocks_under_a_torch_root_raise_at_the_first_forward(one_rank: None) -> None:
    """torch's fully_shard applied to the root after fsdp2's on the blocks: the
    first forward raises fsdp2's error. (Where torch's fully_shard fails first,
    inside torch, fsdp2 never runs: an unnamed mesh here, any mesh over two
    ranks or more; docs/usage.md names both messages.)"""
    model = Blocks()
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=_mesh())
    torch_fully_shard(model, mesh=_mesh())
    with pytest.raises(
        RuntimeError,
        match=r"^fsdp2: FSDPLinear was sharded by fsdp2\.fully_shard, and then torch's own "
        r"fully_shard \(torch\.distributed\.fsdp\) was applied to a module containing it\. "
        + USE_ONE,
    ):
        model(torch.randn(2, 4))

    model = Blocks()
    fsdp2.fully_shard(model.layers[0], mesh=_mesh(named=False))
    with pytest.raises(TypeError, match="Invariant encountered: value was None"):
        torch_fully_shard(model, mesh=_mesh(named=False))


def test_an_fsdp2_model_beside_a_torch_one(one_rank: None) -> None:
    """The legitimate neighbour: torch's fully_shard on a copy (a reference),
    fsdp2's on the model, each on every module of its own: no error or warning,
    the same outputs and gradients."""
    torch.manual_seed(0)
    model = Blocks()
    ref = copy.deepcopy(model)
    for layers, shard in ((model.layers, fsdp2.fully_shard), (ref.layers, torch_fully_shard)):
        for layer in layers:
            shard(layer, mesh=_mesh())
    fsdp2.fully_shard(model, mesh=_mesh())
    torch_fully_shard(ref, mesh=_mesh())
    x = torch.randn(3, 4)
    with no_warnings():
        losses = [m(x).sum() for m in (model, ref)]
        for loss in losses:
            loss.backward()
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name


# -- print(stats) ---------------------------------------------------------------------


def test_comm_stats_prints_a_table() -> None:
    stats = fsdp2.CommStats()
    gathered = stats.record("layers.0", "all_gather")
    gathered.count, gathered.bytes, gathered.wait_seconds, gathered.ready_when_waited = (
        2,
        3 * 1024,
        0.004,
        1,
    )
    stats.record("(root)", "all_reduce").count = 1
    stats.end_step()
    text = str(stats)
    assert text.splitlines()[0].strip() == "fsdp2 communication, totals over 1 backward"
    for header in ("all-gathers", "reduce-scatters", "all-reduces", "bytes", "wait", "ready"):
        assert header in text, text
    row = next(line for line in text.splitlines() if "layers.0" in line)
    assert "3.0 KiB" in row and "4.0 ms" in row and "1 of 2" in row, row
    assert stats.steps[0]["layers.0"].all_gather.count == 2  # the fields stay
    assert stats.totals()["(root)"].all_reduce.count == 1
