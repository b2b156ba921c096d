"""``make gpu-check`` without a GPU, its rehearsal on CPU, and the engine's
switch it uses to run collectives at world size 1
(``fsdp2.api.check_switches.force_one_rank_collectives``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from error_model import REF_TOL
from models import build_model, full_params, global_batch, make_optimizer, mean_loss, shard_model
from torch.distributed.device_mesh import init_device_mesh
from torch.testing import assert_close

import fsdp2
from fsdp2.api.check_switches import force_one_rank_collectives
from fsdp2.comm.divide import divide_plan

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: no CUDA"), done.stdout


def test_one_rank_collectives_divide_in_nccl_ops() -> None:
    """Forced collectives at world size 1: NCCL's AVG runs, as it would on more
    ranks; without the switch a world of one sums. A divide factor is applied
    before the collective either way: NCCL's one-rank PREMUL_SUM left it out
    on an H100 (docs/performance.md), so the factor never rides on it; over
    two ranks or more it does."""
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    assert divide_plan("nccl", torch.float32, 1, 1).reduce_scatter_op == SUM
    forced = divide_plan("nccl", torch.float32, 1, 1, one_rank_collectives=True)
    assert (forced.reduce_scatter_op, forced.all_reduce_op) == (AVG, AVG)
    for forced in (True, False):
        factor = divide_plan("nccl", torch.float32, 1, 4, 4.0, one_rank_collectives=forced)
        assert (factor.pre_divisor, factor.reduce_scatter_op) == (4.0, SUM), factor
    two = divide_plan("nccl", torch.float32, 2, 1, 4.0, one_rank_collectives=True)
    op = two.reduce_scatter_op
    assert two.pre_divisor is None and op == dist.ReduceOp.PREMUL_SUM and op.factor == 0.25


def _forced(rank: int, world_size: int) -> None:
    hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    for mesh in (None, hsdp):
        ref = build_model("mlp")
        model = shard_model(build_model("mlp"), **({} if mesh is None else {"mesh": mesh}))
        force_one_rank_collectives(model)
        optims = make_optimizer(ref), make_optimizer(model)
        with fsdp2.comm_stats(model) as stats:
            for step in range(2):
                batch = global_batch("mlp", step)
                ref_loss = mean_loss(ref, *batch)
                ref_loss.backward()
                loss = mean_loss(model, *batch)
                loss.backward()
                assert_close(loss, ref_loss, **REF_TOL)
                for optim in optims:
                    optim.step()
                    optim.zero_grad()
        totals = stats.totals()
        for name in ("layers.0", "layers.1", "layers.2"):
            counts = [totals[name].of(k).count for k in ("all_gather", "reduce_scatter")]
            # Forward and backward all-gathers (resharded after forward), one reduction.
            assert counts == [4, 2], (name, counts)
            assert totals[name].all_reduce.count == (0 if mesh is None else 2), name
        for name, param in full_params(model).items():
            assert_close(param, ref.get_parameter(name), **REF_TOL)
    model = shard_model(build_model("mlp"))
    with fsdp2.comm_stats(model) as stats:
        mean_loss(model, *global_batch("mlp", 0)).backward()
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    counts = [s.of(k).count for s in stats.totals().values() for k in kinds]
    assert not any(counts), "without the switch a world of one issues no collective"


@pytest.mark.distributed
def test_forced_collectives_at_world_size_one(tmp_path: Path) -> None:
    """force_one_rank_collectives on one gloo rank: every all-gather and
    reduce-scatter (and HSDP (1, 1)'s all-reduce) is issued, and training
    matches the unsharded model."""
    run_ranks(_forced, 1, tmp_path)


@pytest.mark.distributed
def test_rehearsal_runs_every_check(tmp_path: Path) -> None:
    """``gpu_check.py --rehearse``: the GPU check's code on CPU (gloo, the model
    of streams, world sizes 1 forced and 2): every check passes, the
    deliberate race is reported, and the table is written as JSON."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rehearse", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (table,) = tmp_path.glob("gpu_check_rehearsal_*/gpu_check.json")
    rows = {r["name"]: r for r in json.loads(table.read_text())["rows"]}
    assert not [r for r in rows.values() if r["verdict"] == "FAIL"], rows
    for world in ("x1 forced", "x2"):
        assert rows[f"{world} model of streams: reports in fsdp2's training"]["value"] == "0"
        for case in ("fp32", "bf16", "HSDP", "CPU offload"):
            assert rows[f"{world} {case}: collectives issued"]["verdict"] == "ok", case
    race = rows["x1 forced deliberate race (all-gather wait skipped): reports"]
    assert race["verdict"] == "ok" and int(race["value"]) > 0, race
    assert "CUDA sanitizer" in rows and "table:" in done.stdout
    # Every printed row says what it is: ok, FAIL, or info (a measurement).
    lines = done.stdout.splitlines()
    for name in rows:
        line = next(line for line in lines if line.startswith(name))
        assert line[len(name) :].split()[0] in ("ok", "info"), line


def test_exposed_communication_from_a_trace(tmp_path: Path) -> None:
    """The profile row's arithmetic on a made-up trace: device work counts as
    communication when its launch falls inside a c10d collective's host op
    (a one-rank copy as much as an NCCL kernel); the part no other kernel
    overlaps is exposed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def launch(ts: float, correlation: int) -> dict:
        args = {"correlation": correlation}
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": ts, "args": args}

    def device(cat: str, ts: float, dur: float, correlation: int) -> dict:
        args = {"correlation": correlation, "stream": 7}
        return {"cat": cat, "name": cat, "ts": ts, "dur": dur, "args": args}

    events = [
        {"cat": "cpu_op", "name": "c10d::_reduce_scatter_base_", "tid": 1, "ts": 0, "dur": 10},
        launch(5, 1),  # inside the collective's host op: communication
        launch(20, 2),  # outside: compute
        launch(30, 3),
        device("gpu_memcpy", 100, 40, 1),  # 100..140
        device("kernel", 120, 10, 2),  # covers 120..130 of it
        device("kernel", 200, 50, 3),  # after it
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    total, exposed, busy = gpu_check.exposed_communication(trace, steps=2)
    assert (total, exposed, busy) == (20.0, 15.0, 30.0)
    trace.write_text(json.dumps({"traceEvents": events[1:]}))  # no collective: a CPU trace
    assert all(x != x for x in gpu_check.exposed_communication(trace, steps=2))
