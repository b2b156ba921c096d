"""What a user can see of a sharded run: ``fsdp2.summary``, ``fsdp2.comm_stats``,
the profiler labels of the collectives and the "fsdp2" logger's DEBUG records.

Expected numbers are derived from the *unsharded* model's parameter shapes
(``torch.chunk`` sharding on dim 0, every rank's slot padded to the largest
chunk), never from the engine's own bookkeeping. Single-process tests use a
"fake" process group of world size 8 (this process is rank 0); the
distributed ones run 2 gloo ranks.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from dist import fake_world, labelled, run_ranks
from models import (
    build_model,
    expected_shard,
    global_batch,
    local_batch,
    make_optimizer,
    mean_loss,
    shard_model,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.api.summary import print_summary
from fsdp2.comm.stats import KINDS

KIND = "transformer_untied"
N_LAYERS = 2
GROUPS = ("", *(f"layers.{i}" for i in range(N_LAYERS)))  # the root takes what the blocks leave
DEFAULT_RESHARD = {group: str(group != "") for group in GROUPS}  # all but the root's
FAKE_WORLD_SIZE = 8
WORLD_SIZE = 2


@dataclass(frozen=True)
class ExpectedGroup:
    num_params: int
    numel: int
    padded_numel: int  # of the all-gather (and reduce-scatter) buffer: world size * slot sum
    shard_numel: int  # this rank's, unpadded


def group_of(name: str) -> str:
    """The group owning parameter ``name`` of the unsharded model."""
    return next((g for g in GROUPS[1:] if name.startswith(f"{g}.")), "")


def expected_groups(ref: nn.Module, rank: int, world_size: int) -> dict[str, ExpectedGroup]:
    params: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
    for name, param in ref.named_parameters():
        params[group_of(name)].append(param.detach())
    return {
        group: ExpectedGroup(
            num_params=len(ps),
            numel=sum(p.numel() for p in ps),
            padded_numel=world_size
            * sum(math.ceil(p.size(0) / world_size) * p[0].numel() for p in ps),
            shard_numel=sum(expected_shard(p, rank, world_size).numel() for p in ps),
        )
        for group, ps in params.items()
    }


def check_rows(
    rows: list[fsdp2.GroupSummary],
    expected: dict[str, ExpectedGroup],
    reshard: dict[str, str],
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype | None = None,
    mesh: str,
) -> None:
    assert [r.module for r in rows] == list(GROUPS), [r.module for r in rows]
    itemsize = param_dtype.itemsize
    for row in rows:
        exp = expected[row.module]
        where = f"group {row.module!r}"
        assert row.num_params == exp.num_params, f"{where}: {row}"
        assert row.numel == exp.numel, f"{where}: {row}"
        assert row.unsharded_bytes == exp.numel * itemsize, f"{where}: {row}"
        # Shards stay in the original dtype (fp32 here) whatever the compute dtype.
        assert row.shard_bytes == exp.shard_numel * 4, f"{where}: {row}"
        assert row.padding_bytes == (exp.padded_numel - exp.numel) * itemsize, f"{where}: {row}"
        assert row.placements == "(Shard(dim=0),)", f"{where}: {row}"
        assert row.mesh == mesh, f"{where}: {row}"
        assert row.reshard_after_forward == reshard[row.module], f"{where}: {row}"
        assert row.param_dtype == str(param_dtype).removeprefix("torch."), f"{where}: {row}"
        reduce = str(reduce_dtype or param_dtype).removeprefix("torch.")
        assert row.reduce_dtype == reduce, f"{where}: {row}"


# -- single process: summary before the first step, meta models, policies -----


@pytest.fixture(scope="module")
def fake_mesh() -> Iterator[DeviceMesh]:
    with fake_world(FAKE_WORLD_SIZE):
        yield init_device_mesh("cpu", (FAKE_WORLD_SIZE,))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_summary_before_first_step(fake_mesh: DeviceMesh, device: str) -> None:
    """Before any forward (and on a model built on the meta device) the rows
    hold the sizes of the unsharded model; whether a group reshards after
    forward is shown as lazy init will decide it: off for the root, on for the rest."""
    with torch.device(device):
        model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=fake_mesh)
    rows = fsdp2.summary(model, print_table=False)
    expected = expected_groups(build_model(KIND, n_layers=N_LAYERS), 0, FAKE_WORLD_SIZE)
    check_rows(rows, expected, DEFAULT_RESHARD, mesh="(8,) cpu")
    # Every dim is padded at world size 8 (18 rows -> 3 per rank, 33 -> 5, 9 -> 2).
    assert all(row.padding_bytes > 0 for row in rows)


def test_summary_policies(fake_mesh: DeviceMesh) -> None:
    """Mixed precision: unsharded and padding bytes in the compute dtype, shard
    bytes in the original one; reshard_after_forward given explicitly shows as
    given, an int as the size of the resharding group."""
    model = build_model(KIND, n_layers=N_LAYERS)
    mp_policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp2.fully_shard(model.layers[0], mesh=fake_mesh, mp_policy=mp_policy, reshard_after_forward=2)
    fsdp2.fully_shard(model.layers[1], mesh=fake_mesh, mp_policy=mp_policy)
    fsdp2.fully_shard(model, mesh=fake_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    rows = fsdp2.summary(model, print_table=False)
    expected = expected_groups(build_model(KIND, n_layers=N_LAYERS), 0, FAKE_WORLD_SIZE)
    reshard = {"": "False", "layers.0": "to 2 ranks", "layers.1": "True"}
    check_rows(
        rows,
        expected,
        reshard,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        mesh="(8,) cpu",
    )


def test_summary_prints_table(fake_mesh: DeviceMesh, capsys: pytest.CaptureFixture) -> None:
    model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=fake_mesh)
    fsdp2.summary(model, print_table=False)
    assert capsys.readouterr().out == ""
    rows = fsdp2.summary(model)
    out = capsys.readouterr().out
    assert f"fsdp2 {fsdp2.__version__} param groups (torch " in out, out
    for row in rows:
        line = next(line for line in out.splitlines() if f" {row.module or '(root)'} " in line)
        assert f"{row.numel:,}" in line and "(Shard(dim=0),)" in line, line
    assert "unsharded" in out and "on this rank" in out, out  # the totals caption
    # Off a terminal (captured here) no column is cut, however wide the table.
    long_name = "model." + ".".join(f"block_{i}" for i in range(30))
    print_summary([replace(rows[0], module=long_name)])
    assert f" {long_name} " in capsys.readouterr().out


def test_summary_of_unsharded_model_is_empty(fake_mesh: DeviceMesh) -> None:
    assert fsdp2.summary(build_model(KIND), print_table=False) == []


def test_comm_stats_rejects_unsharded_module(fake_mesh: DeviceMesh) -> None:
    with (
        pytest.raises(ValueError, match=r"comm_stats expects the root sharded module.*got Linear"),
        fsdp2.comm_stats(nn.Linear(2, 2)),
    ):
        pass


def test_comm_stats_on_non_root_before_first_forward_fails_at_lazy_init(
    fake_mesh: DeviceMesh,
) -> None:
    """Before the first forward no state knows it is not the root; lazy init does,
    and refuses rather than silently recording nothing."""
    model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=fake_mesh)
    with (
        fsdp2.comm_stats(model.layers[0]),
        pytest.raises(RuntimeError, match=r"comm_stats was applied to 'layers\.0'.*not the root"),
    ):
        model._fsdp_state.lazy_init()


def test_comm_stats_table_never_cuts_its_headers() -> None:
    """Every column, the replicas' included, and a long group name, in full."""
    stats = fsdp2.CommStats()
    groups = ("layers.0", "layers.1.attention.wq, layers.1.attention.wk, layers.1.output")
    for group in groups:
        for kind in KINDS:
            record = stats.record(group, kind)
            record.count, record.bytes = 123_456, 123_456_789_012
    stats.end_step()
    out = str(stats)
    assert "…" not in out, out
    header = next(line for line in out.splitlines() if "group" in line)
    for name in ("all-gathers", "reduce-scatters", "all-reduces", "replica all-gathers"):
        assert f" {name} " in header, header
    assert " replica reduce-scatters " in header and " ready when waited " in header, header
    for group in groups:
        assert f" {group} " in out, out
    assert "totals over 1 backward\n" in out, out


def test_comm_stats_prints_how_to_record_then_its_table(
    fake_mesh: DeviceMesh, capsys: pytest.CaptureFixture
) -> None:
    model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=fake_mesh)
    recording = fsdp2.comm_stats(model)
    print(recording)
    out = capsys.readouterr().out
    assert out.startswith("fsdp2.comm_stats(model) has recorded nothing: it records inside a"), out
    assert "`with fsdp2.comm_stats(model) as stats:`" in out, out
    assert "not used yet" in repr(recording)
    comm = model._fsdp_state.root_ctx.comm
    with recording as stats:
        assert comm.stats is stats and recording.stats is stats
        with pytest.raises(RuntimeError, match=r"already open: open each one once at a time"):
            recording.__enter__()
        stats.record("layers.0", "all_gather").count = 3  # as a collective would
    assert comm.stats is None
    print(recording)
    out = capsys.readouterr().out
    assert "fsdp2 communication, totals over 0 backwards" in out, out
    assert "reduce-scatters" in out and " layers.0 " in out, out
    assert str(recording) == str(stats)


def test_debug_records_carry_the_rank(
    fake_mesh: DeviceMesh, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each record says whose it is: "[rank N] " (and ``record.rank``) once
    torch.distributed is initialised; no prefix before."""
    model = fsdp2.fully_shard(nn.Linear(16, 16), mesh=fake_mesh)
    caplog.set_level(logging.DEBUG, logger="fsdp2")
    model.unshard()
    model.reshard()
    records = [r for r in caplog.records if r.name == "fsdp2"]
    assert [r.getMessage() for r in records] == [
        "[rank 0] Linear: all-gather issued (SHARDED)",
        "[rank 0] Linear: unsharded",
        "[rank 0] Linear: resharded",
    ]
    assert all(r.rank == 0 for r in records)  # type: ignore[attr-defined]
    assert "[rank 0] Linear: unsharded" in caplog.text

    caplog.clear()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    model.unshard()
    assert [r.getMessage() for r in caplog.records][-1] == "Linear: unsharded"
    monkeypatch.undo()
    model.reshard()


# -- distributed: summary after lazy init, comm_stats --------------------------


def _check_step_stats(
    step: dict[str, fsdp2.comm.stats.GroupStats],
    expected: dict[str, ExpectedGroup],
    all_gathers: dict[str, int],
    rows: list[fsdp2.GroupSummary],
) -> None:
    """One training step's statistics against the sizes of the groups."""
    # comm_stats names the root group "(root)"; the summary's module path is "".
    step = {("" if name == "(root)" else name): stats for name, stats in step.items()}
    assert set(step) == set(GROUPS), sorted(step)
    itemsize = 4
    for group, stats in step.items():
        exp = expected[group]
        ag, rs = stats.all_gather, stats.reduce_scatter
        assert ag.count == all_gathers[group], f"{group!r}: {ag}"
        # Every call gathers the whole padded buffer: world size * slot sum.
        assert ag.bytes == ag.count * exp.padded_numel * itemsize, f"{group!r}: {ag}"
        assert rs.count == 1, f"{group!r}: {rs}"  # every parameter has a gradient
        assert rs.bytes == exp.padded_numel * itemsize, f"{group!r}: {rs}"
        for kind in (ag, rs):
            assert kind.wait_seconds >= 0.0, f"{group!r}: {kind}"
            assert 0 <= kind.ready_when_waited <= kind.count, f"{group!r}: {kind}"
    # The bytes all-gathered in a step: the model's parameter bytes times the
    # all-gathers of each group, plus the dim-0 padding summary() reports.
    padding = {row.module: row.padding_bytes for row in rows}
    volume = sum(all_gathers[g] * expected[g].numel * itemsize for g in GROUPS)
    overhead = sum(all_gathers[g] * padding[g] for g in GROUPS)
    assert sum(s.all_gather.bytes for s in step.values()) == volume + overhead
    assert overhead > 0, "the root's 33- and 9-row embeddings are padded at world size 2"


def _summary_and_comm_stats(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    ref = build_model(KIND, n_layers=N_LAYERS)
    expected = expected_groups(ref, rank, world_size)
    model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=mesh)
    optim = make_optimizer(model)
    mesh_str = "(2,) cpu"

    def train_step(step: int) -> None:
        loss = mean_loss(model, *local_batch(global_batch(KIND, step), rank, world_size))
        loss.backward()
        optim.step()
        optim.zero_grad()

    with labelled("summary before the first step"):
        rows = fsdp2.summary(model, print_table=False)
        check_rows(rows, expected, DEFAULT_RESHARD, mesh=mesh_str)
        # This rank's shard bytes are what its local shards hold.
        for row in rows:
            local = sum(
                p.to_local().numel() * p.element_size()
                for name, p in model.named_parameters()
                if group_of(name) == row.module
            )
            assert row.shard_bytes == local, f"{row.module!r}: {row.shard_bytes} vs {local}"

    with fsdp2.comm_stats(model) as stats:
        for step in range(2):
            train_step(step)
        with labelled("comm_stats over two steps"):
            assert len(stats.steps) == 2, stats.steps
            all_gathers = {"": 1, **{g: 2 for g in GROUPS[1:]}}  # blocks reshard after forward
            for step_stats in stats.steps:
                _check_step_stats(step_stats, expected, all_gathers, rows)
        with labelled("a forward without backward goes into the open step"):
            model.eval()
            with torch.no_grad():
                model(local_batch(global_batch(KIND, 9), rank, world_size)[0])
            model.train()
            assert len(stats.steps) == 2, stats.steps
            totals = {("" if k == "(root)" else k): v for k, v in stats.totals().items()}
            for group in GROUPS:
                ag = totals[group].all_gather
                assert ag.count == 2 * all_gathers[group] + 1, f"{group!r}: {ag}"
                assert ag.bytes == ag.count * expected[group].padded_numel * 4, f"{group!r}: {ag}"
                assert totals[group].reduce_scatter.count == 2, f"{group!r}: {totals[group]}"

    with labelled("closed: records nothing more"):
        train_step(2)
        assert len(stats.steps) == 2, stats.steps

    with (
        labelled("comm_stats on a non-root module"),
        pytest.raises(ValueError, match=r"expects the root sharded module.*TransformerBlock"),
        fsdp2.comm_stats(model.layers[0]),
    ):
        pass

    with labelled("summary after lazy init, printed on rank 0 only"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rows = fsdp2.summary(model)
        reshard = {"": "False", **{g: "True" for g in GROUPS[1:]}}
        check_rows(rows, expected, reshard, mesh=mesh_str)
        if rank == 0:
            assert f"fsdp2 {fsdp2.__version__} param groups" in out.getvalue(), out.getvalue()
            assert "layers.1" in out.getvalue(), out.getvalue()
        else:
            assert out.getvalue() == "", out.getvalue()


# -- distributed: profiler labels and DEBUG records -----------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@contextlib.contextmanager
def fsdp2_records(level: int) -> Iterator[_Records]:
    """The "fsdp2" logger's records at ``level`` (caplog cannot reach a spawned rank)."""
    logger = logging.getLogger("fsdp2")
    handler = _Records()
    old_level = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _labels_and_log(rank: int, world_size: int, mesh: DeviceMesh) -> None:
    model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=mesh)
    optim = make_optimizer(model)
    n_block_params = sum(1 for name, _ in model.named_parameters() if name.startswith("layers.0."))

    def train_step(step: int) -> None:
        loss = mean_loss(model, *local_batch(global_batch(KIND, step), rank, world_size))
        loss.backward()
        optim.step()
        optim.zero_grad()

    with labelled("nothing logged at the default level"), fsdp2_records(logging.INFO) as quiet:
        train_step(0)
        assert not quiet.records, quiet.messages()

    with labelled("DEBUG records"), fsdp2_records(logging.DEBUG) as log:
        train_step(1)
        assert all(r.levelno == logging.DEBUG and r.name == "fsdp2" for r in log.records)
        prefix = f"[rank {rank}] "  # each rank's lines say whose they are
        assert all(m.startswith(prefix) for m in log.messages()), log.messages()
        messages = [m.removeprefix(prefix) for m in log.messages()]
        block0 = [m for m in messages if m.startswith("layers.0: ")]
        assert block0 == [
            # forward
            "layers.0: all-gather issued (SHARDED)",
            "layers.0: unsharded",
            "layers.0: resharded",
            # backward: prefetched by layers.1's pre-backward
            "layers.0: all-gather issued (SHARDED)",
            "layers.0: unsharded",
            "layers.0: resharded",
            f"layers.0: reduce-scatter issued for {n_block_params} grads",
        ], block0
        # The root's inputs need no gradient, so its post-backward runs from the
        # final callback, last.
        final = messages.index("final callback: finishing backward")
        root_params = sum(1 for name, _ in model.named_parameters() if group_of(name) == "")
        assert messages[-1].endswith(f"reduce-scatter issued for {root_params} grads"), messages
        assert len(messages) - final == 3, messages[final:]  # resharded, reduce-scatter issued

    with (
        labelled("profiler labels"),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        train_step(2)
    names = {event.name for event in prof.events()}
    fsdp2_names = sorted(n for n in names if n.startswith("fsdp2::"))
    for group in GROUPS[1:]:
        for label in ("all_gather", "reduce_scatter", "all_gather_copy_out", "post_backward"):
            assert f"fsdp2::{label} ({group})" in names, f"{label} ({group}): {fsdp2_names}"
    assert "fsdp2::final_callback" in names, fsdp2_names
    # One label per group (the root's too) for each collective.
    for label in ("all_gather", "reduce_scatter", "all_gather_copy_out"):
        labelled_groups = [n for n in fsdp2_names if n.startswith(f"fsdp2::{label} (")]
        assert len(labelled_groups) == len(GROUPS), (label, fsdp2_names)


def _observability(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    _summary_and_comm_stats(rank, world_size, mesh)
    _labels_and_log(rank, world_size, mesh)


@pytest.mark.distributed
def test_summary_comm_stats_profiler_labels_and_log(tmp_path: Path) -> None:
    """One spawn, two models.

    summary() rows match the model's sizes before the first step and after lazy
    init (the root then does not reshard after forward) and print on rank 0
    only. comm_stats over 2 steps: per step and group, 2 all-gathers per block
    and 1 for the root, each of world size * padded slot bytes, and one
    reduce-scatter of the same size; the bytes of a step are the parameter bytes
    times the all-gathers plus the padding summary() reports. A forward without
    backward goes into the open step; once closed nothing is recorded; a
    non-root module raises.

    Under torch.profiler each group's all-gather, copy-out, post-backward and
    reduce-scatter, and the final callback, are named ranges; the "fsdp2"
    logger says nothing at INFO and at DEBUG traces every state transition of a
    block through a step, in order."""
    run_ranks(_observability, WORLD_SIZE, tmp_path)


def test_internal_errors_carry_the_versions(fake_mesh: DeviceMesh) -> None:
    """An engine state that should never be reached says which fsdp2 and torch
    ran, and that it is a bug to report."""
    model = shard_model(build_model(KIND, n_layers=N_LAYERS), mesh=fake_mesh)
    group = fsdp2.fully_shard.state(model.layers[0]).param_groups[0]
    with pytest.raises(
        AssertionError, match=r"wait_for_unshard\(\) without an all-gather in flight"
    ) as e:
        group.wait_for_unshard()
    message = str(e.value)
    assert f"fsdp2 {fsdp2.__version__}, torch {torch.__version__} (tested with " in message, message
    assert "please report it" in message, message
