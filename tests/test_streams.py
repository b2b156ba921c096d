"""The accelerator path's stream protocol, run on gloo ranks (2, and 4 for the
wide scenarios) under the stream model (tests/stream_model.py): every scenario
trains a few steps with fsdp2's streams and events going through the model,
which must report no access that is not ordered after a conflicting one and
no free before a use on another stream. The negative controls (waits
disabled; the post-forward shard's wait dropped) must report some."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import fake_world, run_ranks
from models import build_model, global_batch, local_batch, mean_loss, shard_model
from stream_model import ALL_GATHER_COPY_INS, StreamModel
from test_extension import DIM as EXTENSION_DIM
from test_extension import OUT
from test_extension import Model as ExtensionModel
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import fsdp2
from fsdp2.comm.context import CommContext

STEPS = 3

SCENARIOS = [
    "plain",
    "reshard_after_forward=False",
    "reshard_after_forward=1",
    "explicit prefetch",
    "no forward prefetch",
    "accumulation without sync",
    "accumulation without resharding",
    "mixed precision",
    "reduce-scatter queue of 2",
    "all-reduce hook on a stream",
    "all-reduce hook on a stream, raising",
    "optimizer on a side stream",
    "exception, reset_iter_state",
    "unshard(async_op=True)",
    "CPU offload",
    "CPU offload, accumulation",
    "HSDP",
    "HSDP, accumulation without all-reduce",
    "extension",
    "share_comm_ctx",
    "compression int8",
    "HSDP, compression bf16",
]

# Wider: (name, world size). A model whose middle layer runs twice in one
# forward, so twice in one backward (weights shared across depth), alone, with
# its calls checkpointed (recomputed in backward), with an int
# reshard_after_forward below the shard group's size (a post-forward shard over
# 2 of 4 ranks), with CPU offload and accumulation, and HSDP. (HSDP's int can
# only be 1 or the shard group's size below 8 ranks: 2 here, i.e. True.)
WIDE_SCENARIOS = [
    ("twice", 2),
    ("twice, checkpointed", 2),
    ("twice, reshard_after_forward=2", 4),
    ("twice, checkpointed, reshard_after_forward=2, CPU offload, accumulation", 4),
    ("HSDP (2, 2), twice, checkpointed, reshard_after_forward=2", 4),
    ("HSDP (2, 2), optimizer over replicas, twice, checkpointed, bf16, CPU offload", 4),
    # Codes kept and moved by both all-gathers, compressed reductions across replicas.
    ("HSDP (2, 2), optimizer over replicas, twice, compression int8", 4),
]


class SharedDepth(nn.Module):
    """The MLP's shape with its middle layer (33 -> 33) run twice per forward;
    ``checkpointed``: each of those calls is recomputed in backward."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(17, 33), nn.Linear(33, 33), nn.Linear(33, 7)])
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.layers[0](x))
        for _ in range(2):
            if self.checkpointed:
                x = checkpoint(self.layers[1], x, use_reentrant=False)
            else:
                x = self.layers[1](x)
            x = F.relu(x)
        return self.layers[2](x)


class HookFailed(Exception):
    pass


class Run:
    """One scenario's model of streams, and where its training is."""

    def __init__(self, streams: StreamModel) -> None:
        self.streams = streams
        self.step = 0
        self.raised = False  # the scenario's one exception has been raised
        self._optimizer_stream: Any = None
        self.hook_points: list[tuple[int, int]] = []  # this step's, where each hook ended
        self.joined_hooks: list[bool] = []  # per check: compute ordered after a hook?
        # HSDP: per step, (where layers.1's backward started, collectives before then),
        # and how many collectives had run when the step started.
        self.backward_points: list[tuple[tuple[int, int], int]] = []
        self.step_starts: list[int] = []
        self.params = 0  # of the models trained
        # CPU offload: per check (in backward, at the step), whether every grad
        # the host can see (``.grad``) has been waited for.
        self.grads_readable: list[bool] = []
        # At each optimizer step: all-gather buffers still alive (none should be).
        self.all_gather_buffers_at_step: list[int] = []
        # After each forward (the loss, the start of backward: where the peak is).
        self.all_gather_buffers_after_forward: list[int] = []

    @property
    def optimizer_stream(self) -> Any:
        if self._optimizer_stream is None:
            self._optimizer_stream = self.streams.new_stream()
        return self._optimizer_stream


def _shard(name: str) -> nn.Module:
    kwargs: dict = {}
    if name.startswith("HSDP (2, 2)"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kwargs["mesh"] = mesh
    if "reshard_after_forward=2" in name:
        kwargs["reshard_after_forward"] = 2
    if "CPU offload" in name:
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy()
    if "optimizer over replicas" in name:
        kwargs["shard_optimizer_over_replicas"] = True
    if "compression int8" in name:
        kwargs["compression"] = fsdp2.CompressionPolicy(weights="int8", gradients="int8")
    if "bf16" in name:
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if name.startswith(("twice", "HSDP (2, 2)")):
        return shard_model(SharedDepth(checkpointed="checkpointed" in name), **kwargs)
    if name == "reshard_after_forward=False":
        kwargs["reshard_after_forward"] = False
    elif name == "reshard_after_forward=1":
        kwargs["reshard_after_forward"] = 1
    elif name == "mixed precision":
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    elif name.startswith("HSDP") and "mesh" not in kwargs:
        kwargs["mesh"] = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    if name == "HSDP, compression bf16":
        kwargs["compression"] = fsdp2.CompressionPolicy(gradients="bf16", across="replicate")
    if name == "extension":
        return shard_model(ExtensionModel(trainable=True))
    return shard_model(build_model("mlp"), **kwargs)


def _check_grads_readable(model: nn.Module, run: Run) -> None:
    grads = [p.grad for p in model.parameters() if isinstance(p.grad, DTensor)]
    run.grads_readable.append(all(run.streams.host_may_read(g.to_local()) for g in grads))


def _configure(name: str, model: nn.Module, run: Run) -> None:
    layers = list(model.layers)
    if "CPU offload" in name:
        # By the first layer's backward the last layers' grads are reduced and
        # their params resharded: a hook (or a peer thread) may read their .grad.
        layers[0].register_full_backward_pre_hook(
            lambda module, grad_output: _check_grads_readable(model, run)
        )
    if name == "explicit prefetch":
        for before, after in zip(layers, layers[1:], strict=False):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    elif name == "no forward prefetch":
        for layer in layers:
            layer.set_modules_to_forward_prefetch([])

        def mark(module: nn.Module, args: Any, output: Any) -> None:
            point = run.streams.point()
            run.backward_points.append((point, len(run.streams.collectives)))

        layers[1].register_forward_hook(mark)
    elif name == "HSDP":

        def mark(module: nn.Module, grad_output: Any) -> None:
            point = run.streams.point()
            run.backward_points.append((point, len(run.streams.collectives)))

        layers[1].register_full_backward_pre_hook(mark)
    elif name == "reduce-scatter queue of 2":
        model.set_reduce_scatter_max_input_buffers(2)
    elif name.startswith("all-reduce hook on a stream"):
        side = run.streams.new_stream()
        raising = name.endswith("raising")

        def hook(output: torch.Tensor) -> None:
            output.mul_(1.0)
            run.hook_points.append(run.streams.point())
            if raising and not run.raised:
                run.raised = True
                raise HookFailed

        for layer in layers:
            layer.set_all_reduce_hook(hook, stream=side)

        def check_overlap(module: nn.Module, grad_output: Any) -> None:
            # The first layer's backward comes after the last layer's hook ran.
            run.joined_hooks += [run.streams.after(p) for p in run.hook_points]

        layers[0].register_full_backward_pre_hook(check_overlap)


def _batch(name: str, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    if name == "extension":
        gen = torch.Generator().manual_seed(step)
        return torch.randn(4, EXTENSION_DIM, generator=gen), torch.randn(4, OUT, generator=gen)
    return local_batch(global_batch("mlp", step), rank, world_size)


def _backward(
    name: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    step: int,
    rank: int,
    world_size: int,
    run: Run,
) -> None:
    inputs, targets = _batch(name, step, rank, world_size)
    if "accumulation" in name:
        half = inputs.size(0) // 2
        if name == "accumulation without sync":
            model.set_requires_gradient_sync(False)
        elif name == "accumulation without resharding":
            model.set_reshard_after_backward(False)
        elif name.endswith("without all-reduce"):
            model.set_requires_all_reduce(False)
        # Otherwise both backwards reduce: the second adds to the sharded grads.
        mean_loss(model, inputs[:half], targets[:half]).backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.set_requires_all_reduce(True)
        mean_loss(model, inputs[half:], targets[half:]).backward()
        return
    if name == "unshard(async_op=True)":
        handle = model.layers[0].unshard(async_op=True)
        assert handle is not None
        handle.wait()
    if name == "exception, reset_iter_state" and step == 1:
        with pytest.raises(HookFailed):
            mean_loss(model, inputs, targets).backward()
        model.reset_iter_state()
        return
    if name == "reshard_after_forward=False":
        # A forward without grad keeps the blocks' parameters (as torch's does):
        # the training forward below computes with them, no all-gather between.
        with torch.no_grad():
            model(inputs)
    loss = mean_loss(model, inputs, targets)
    run.all_gather_buffers_after_forward.append(all_gather_buffers(run.streams))
    if name == "optimizer on a side stream":
        # The gradients the side stream read are freed once forward has waited for
        # it (set_post_optim_event), not before: their memory would be reused
        # while the optimizer may still read it.
        optim.zero_grad()
    try:
        loss.backward()
    except HookFailed:
        model.reset_iter_state()


def _optimizer_step(name: str, model: nn.Module, optim: torch.optim.Optimizer, run: Run) -> None:
    run.all_gather_buffers_at_step.append(all_gather_buffers(run.streams))
    if "CPU offload" in name:
        _check_grads_readable(model, run)
    if name == "optimizer on a side stream":
        # As the docs of set_post_optim_event suggest: the step on its own stream.
        side = run.optimizer_stream
        side.wait_stream(run.streams.current_stream())
        with side:
            optim.step()
        model.set_post_optim_event(side.record_event())
        return
    optim.step()
    optim.zero_grad()


def _train(name: str, streams: StreamModel, rank: int, world_size: int) -> Run:
    run = Run(streams)
    if name == "share_comm_ctx":
        first, second = _shard("plain"), _shard("plain")
        streams.plug_into(first)
        streams.plug_into(second)
        fsdp2.share_comm_ctx([first, second])
        models = [first, second]
    else:
        model = _shard(name)
        streams.plug_into(model)
        _configure(name, model, run)
        models = [model]
    run.params = sum(len(list(m.parameters())) for m in models)
    if name == "exception, reset_iter_state":
        # Raises in backward of the second step, between two reduce-scatters.
        def fail_once(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if not run.raised and run.step == 1:
                run.raised = True
                raise HookFailed

        models[0].layers[1].register_full_backward_hook(fail_once)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    with streams:
        for step in range(STEPS):
            run.step = step
            run.hook_points.clear()
            run.step_starts.append(len(streams.collectives))
            for model, optim in zip(models, optims, strict=True):
                _backward(name, model, optim, step, rank, world_size, run)
                _optimizer_step(name, model, optim, run)
    return run


DESIGN = Path(__file__).parent.parent / "docs" / "design.md"
STREAM_NAMES = {
    "current": "current",
    "copy-in": "all_gather_copy_in",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-reduce": "all_reduce",
    "user": "user",
}


def all_gather_buffers(streams: StreamModel) -> int:
    return streams.alive(*ALL_GATHER_COPY_INS)


class TableRow(NamedTuple):
    buffer: str
    first_write: frozenset[str]
    allocated_on: frozenset[str]
    written_on: frozenset[str]
    read_on: frozenset[str]
    freed_on: frozenset[str]


def stream_table() -> list[TableRow]:
    """docs/design.md's table of which stream touches each buffer."""
    text = DESIGN.read_text()
    section = text[text.index("### Streams: who touches each buffer") :]
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    table = []
    for line in lines[first + 2 : end]:  # past the header and its rule
        cells = [c.strip() for c in line.strip("|").split("|")]
        ops = frozenset(op.strip(" `") for op in cells[1].split(","))

        def streams(cell: str) -> frozenset[str]:
            return frozenset(STREAM_NAMES[n.strip()] for n in cell.split(","))

        table.append(TableRow(cells[0], ops, *(streams(c) for c in cells[2:6])))
    return table


def _fits(history: Any, row: TableRow) -> bool:
    return (
        history.allocated_on in row.allocated_on
        and history.written_on <= row.written_on
        and history.read_on <= row.read_on
    )


def check_stream_table(streams: StreamModel, name: str) -> None:
    """Every buffer the table names (by the op that first writes it) was
    allocated, written and read only on the streams one of its rows says
    (freed: by the model's rule, on its allocating stream); scenario "plain"
    has every buffer but CPU offload's and shard_optimizer_over_replicas',
    "CPU offload" those of offload, the option's scenario the option's."""
    table = stream_table()
    assert len(table) == 7, table
    assert all(row.freed_on == row.allocated_on for row in table), table
    matched = set()
    for history in streams.all_histories():
        rows = [row for row in table if history.first_write in row.first_write]
        if not rows:
            continue
        fitting = [row for row in rows if _fits(history, row)]
        assert fitting, (rows, history)
        matched.update(row.buffer for row in fitting)
    offload = {row.buffer for row in table if "CPU offload" in row.buffer}
    over_replicas = {row.buffer for row in table if "over_replicas" in row.buffer}
    if name == "plain":
        assert matched == {row.buffer for row in table} - offload - over_replicas, matched
    elif name == "CPU offload":
        assert offload <= matched, matched
    elif "optimizer over replicas" in name:
        assert over_replicas <= matched, matched


def _scenario(rank: int, world_size: int, name: str) -> None:
    streams = StreamModel()
    run = _train(name, streams, rank, world_size)
    assert streams.violations == [], "\n".join(sorted(set(streams.violations))[:10])
    check_stream_table(streams, name)
    # Memory: at most two groups' all-gather buffers alive (the running group's
    # and one prefetch), and K reduce-scatter inputs with a queue of K.
    assert streams.peak_alive.get(ALL_GATHER_COPY_INS, 0) <= 2, streams.peak_alive
    # None outlives backward (the final callback releases them) into the step,
    # nor forward (the root's post-forward) into the loss and backward.
    assert not any(run.all_gather_buffers_at_step), run.all_gather_buffers_at_step
    assert not any(run.all_gather_buffers_after_forward), run.all_gather_buffers_after_forward
    if not name.startswith("HSDP"):  # there the input is the output, kept to the end
        queue = 2 if name == "reduce-scatter queue of 2" else 1
        assert streams.peak_alive.get(("_chunk_cat",), 0) == queue, streams.peak_alive
    # The collectives ran on comm streams, not on the compute stream.
    assert sum(n for s, n in streams.ops_by_stream.items() if s != "current") > 0
    if "CPU offload" in name:
        # Every reduced grad reaches the host through pinned memory by a copy that
        # does not block the host (added to the grad it accumulates into after
        # the sync), so none by a blocking copy; one host sync per backward.
        backwards = STEPS * (2 if name.endswith("accumulation") else 1)
        copies = (streams.pinned, streams.non_blocking_copies)
        assert copies == (run.params * backwards,) * 2, (copies, run.params, backwards)
        assert streams.host_syncs == backwards, streams.host_syncs
        # A grad becomes .grad only once the host has waited for its copy.
        assert len(run.grads_readable) == STEPS + backwards, run.grads_readable
        assert all(run.grads_readable), run.grads_readable
    else:
        assert streams.host_syncs == 0, streams.host_syncs
    if name == "no forward prefetch":
        # Without a prefetch the next group's all-gather is issued after the
        # group's forward, yet not ordered after its compute: it may overlap it.
        for point, before in run.backward_points:
            following = streams.collectives[before]
            assert not StreamModel.clock_after(following[1], point), (following, point)
    if name == "HSDP":
        # The last block's all-reduce across replicas overlaps the next block's
        # backward: it is not ordered after the start of layers.1's backward.
        for start, (point, _) in zip(run.step_starts, run.backward_points, strict=True):
            first = next(c for c in streams.collectives[start:] if c[0] == "allreduce_")
            assert not StreamModel.clock_after(first[1], point), (first, point)
    if "compression" in name:
        # The compressed gradients went by all-to-all, on a comm stream (checked above).
        assert any(c[0].startswith("alltoall") for c in streams.collectives), {
            c[0] for c in streams.collectives
        }
    if name == "all-reduce hook on a stream":
        # Backward goes on while the hooks run: no compute op waits for them.
        assert run.joined_hooks and not any(run.joined_hooks), run.joined_hooks


@pytest.mark.distributed
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_has_no_unordered_access(tmp_path: Path, name: str) -> None:
    run_ranks(_scenario, 2, tmp_path, name)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "world_size"), WIDE_SCENARIOS)
def test_wide_scenario_has_no_unordered_access(tmp_path: Path, name: str, world_size: int) -> None:
    run_ranks(_scenario, world_size, tmp_path, name)


def _without_waits(rank: int, world_size: int) -> None:
    streams = StreamModel(waits=False)
    _train("plain", streams, rank, world_size)
    # The copy-in written on the compute stream, read by the all-gather on its
    # stream; the all-gather output read by the copy-out; the gradients'
    # reduce-scatter buffers freed on the compute stream.
    assert len(streams.violations) > 0
    assert any("without waiting" in v for v in streams.violations), streams.violations[:5]
    assert any("freed" in v for v in streams.violations), streams.violations[:5]
    dist.barrier()


@pytest.mark.distributed
def test_negative_control_without_waits_reports_violations(tmp_path: Path) -> None:
    run_ranks(_without_waits, 2, tmp_path)


def _without_post_forward_shard_wait(rank: int, world_size: int) -> None:
    # The wait for the post-forward shard dropped: nothing else orders its write
    # (torch.cat on the compute stream) before the second call's copy-in reads it.
    CommContext.shard_written = lambda self: None  # type: ignore[method-assign]
    streams = StreamModel()
    _train("twice, reshard_after_forward=2", streams, rank, world_size)
    race = "_foreach_copy_ reads on stream 'all_gather_copy_in'"
    assert streams.violations, "the race went unreported"
    assert all(
        race in v and "that cat wrote on stream 'current'" in v for v in streams.violations
    ), sorted(set(streams.violations))[:5]
    dist.barrier()


@pytest.mark.distributed
def test_negative_control_without_the_post_forward_shard_wait(tmp_path: Path) -> None:
    """A module run twice in one forward with reshard_after_forward=2 of 4 ranks:
    without ``CommContext.shard_written`` the model reports the race, and only it."""
    run_ranks(_without_post_forward_shard_wait, 4, tmp_path)


def _reset_runs_nothing(rank: int, world_size: int) -> None:
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Kept unsharded after forward, as backward would find them.
    model = shard_model(build_model("mlp"), mp_policy=mp, reshard_after_forward=False)
    streams = StreamModel()
    streams.plug_into(model)
    inputs, _ = local_batch(global_batch("mlp", 0), rank, world_size)
    with streams:
        model(inputs)
        # As if backward had stopped after the root's gradients were computed.
        for param in model.parameters():
            assert not isinstance(param, DTensor)  # the unsharded parameters
            param.grad = torch.ones_like(param)
        ops = dict(streams.ops_by_stream)
        model.reset_iter_state()
    # Recovery only drops references: no cast, no redistribute, no collective.
    assert streams.ops_by_stream == ops, (ops, streams.ops_by_stream)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.distributed
def test_reset_iter_state_only_drops_references(tmp_path: Path) -> None:
    run_ranks(_reset_runs_nothing, 2, tmp_path)


class HandleReturningAllGather:
    """A custom all-gather that returns a work handle even with ``async_op=False``
    (as a backend's own collective may); records whether it was waited for."""

    def __init__(self) -> None:
        self.waited: list[bool] = []

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
        handle = self

        class Work:
            def wait(self) -> bool:
                handle.waited.append(async_op)
                return True

            def is_completed(self) -> bool:
                return True

        return Work()


def test_custom_all_gather_handle_is_waited_for() -> None:
    """Issue 19, defect 13: on an accelerator the handle is waited on the
    all-gather stream, as torch does."""
    with fake_world(2):
        model = shard_model(build_model("mlp"))
        streams = StreamModel()
        streams.plug_into(model)
        custom = HandleReturningAllGather()
        for layer in model.layers:
            layer.set_custom_all_gather(custom)
        with streams:
            model(torch.randn(4, 17)).sum().backward()
        # Forward and backward, one all-gather each per layer, every one waited.
        assert custom.waited == [False] * 6, custom.waited


@pytest.mark.parametrize(
    "change", ['to_empty(device="cpu")', "to(torch.float64)", "load_state_dict(assign=True)"]
)
def test_offloaded_shards_are_pinned_again(change: str) -> None:
    """Issue 19, defect 11: with ``CPUOffloadPolicy(pin_memory=True)`` on an
    accelerator, shards that ``nn.Module._apply`` or an assigning load replaced
    are on the CPU and pinned again (here by the model's pinning, a copy it
    knows; the shards are not pinned at fully_shard on a CPU mesh)."""
    with fake_world(2):
        offload = fsdp2.CPUOffloadPolicy(pin_memory=True)
        model = shard_model(build_model("mlp"), offload_policy=offload)
        streams = StreamModel()
        streams.plug_into(model)
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if change == 'to_empty(device="cpu")':
            model.to_empty(device="cpu")
        elif change == "to(torch.float64)":
            model.to(torch.float64)
        else:
            model.load_state_dict(loaded, assign=True)
        for name, param in model.named_parameters():
            shard = param.to_local()
            assert shard.device.type == "cpu" and streams.is_pinned(shard), name
            if change.startswith("load_state_dict"):
                assert torch.equal(shard, loaded[name].to_local()), name


@pytest.mark.parametrize("pin_memory", [True, False])
def test_offloaded_shards_moved_to_the_accelerator_are_refused(pin_memory: bool) -> None:
    """Issue 19, defect 11: with CPU offload, ``to_empty(device="cuda")`` after
    fully_shard raises at once, naming the parameter and the fix, instead of a
    CPU gradient meeting a CUDA parameter at the first backward. The CUDA
    memory is faked: under ``FakeTensorMode`` a CPU-only build runs the same
    ``to_empty`` (``nn.Module._apply``, fsdp2's reset of its shards) with
    tensors that have a device but no data."""
    with fake_world(2):
        offload = fsdp2.CPUOffloadPolicy(pin_memory=pin_memory)
        model = shard_model(build_model("mlp"), offload_policy=offload)
        expected = r"'weight' is on cuda:0, but with CPUOffloadPolicy.*to_empty\(device=\"cpu\"\)"
        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            pytest.raises(ValueError, match=expected),
        ):
            model.to_empty(device="cuda")
