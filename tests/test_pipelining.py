"""Pipeline parallelism: torch's ``torch.distributed.pipelining`` schedules
driving fsdp2 stages, on 4 gloo ranks as ("pp", "dp") = (2, 2).

Each schedule trains the same small transformer for two steps three ways: an
unsharded model on the global batch (the reference, tests/error_model.py
point 1), torch's fully_shard stages, and fsdp2's (installed under torch's
names after torch's run imported pipelining: the install reaches modules
imported before it). fsdp2 must equal torch's bit for bit (two data
parallel ranks: the sums over ranks are order-free, error model point 2) and
the reference within ``REF_TOL``; its stages must reduce each group's
gradients once per step, not once per microbatch, and what pipelining calls
at the step's end must be safe to call again.

With ``reshard_after_forward=True`` the zero-bubble schedules (a backward
split into an input half and a weight half) are wrong under torch's own
fully_shard on torch 2.13 (their weight halves find the blocks resharded and
drop or miss gradients); fsdp2's must equal torch's run with
``reshard_after_forward=False``, where torch's is right.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import time
import warnings
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist import run_ranks
from doc_scripts import ROOT, losses_under_torchrun, python_block
from error_model import REF_TOL
from models import make_optimizer
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2
from fsdp2.comm.stats import KINDS
from fsdp2.engine.states import ShardedState

VOCAB, DIM, N_BLOCKS, GLOBAL_BATCH, SEQ_LEN, MICROBATCHES, STEPS = 32, 16, 4, 16, 6, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Stage(nn.Module):
    """Blocks ``[first, last)`` of ``model``, with the embedding on the first
    stage and the norm and head on the last."""

    def __init__(self, model: Model, index: int, n_stages: int) -> None:
        super().__init__()
        per_stage = N_BLOCKS // n_stages
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[index * per_stage : (index + 1) * per_stage])
        last = index == n_stages - 1
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


class Case(NamedTuple):
    schedule: str
    reshard_after_forward: bool
    # torch's run the fsdp2 one must equal bit for bit (None: the same settings).
    torch_reshard_after_forward: bool | None = None
    accumulate: int = 1  # schedule steps per optimizer step


ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
CASES = [
    Case("ScheduleGPipe", True),
    Case("Schedule1F1B", True),
    Case("Schedule1F1B", False),
    Case("Schedule1F1B", True, accumulate=2),
    Case("ScheduleInterleaved1F1B", True),
    Case("ScheduleLoopedBFS", True),
    *(Case(name, True, torch_reshard_after_forward=False) for name in ZERO_BUBBLE),
]


def _stage_indices(schedule: str, pp_rank: int) -> tuple[list[int], int]:
    """This rank's stages and the number of stages: one per rank for the
    single-stage schedules, two otherwise (a V for ZBV and DualPipeV)."""
    if schedule in ("ScheduleGPipe", "Schedule1F1B"):
        return [pp_rank], 2
    if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [pp_rank, 3 - pp_rank], 4
    return [pp_rank, pp_rank + 2], 4


def _train(
    mesh: dict[str, DeviceMesh],
    case: Case,
    shard: Any,
    reshard_after_forward: bool,
    record: bool = False,
) -> tuple[dict[str, torch.Tensor], list[dict[str, int]]]:
    """Two pipeline steps with ``shard`` (a ``fully_shard``) on every block and
    stage; returns this rank's parameters, full, by name, and (``record``) the
    reduce-scatters of each group in each step."""
    # torch's runs import it first, before the install: the install must reach it.
    import torch.distributed.pipelining as pipelining

    mine, n_stages = _stage_indices(case.schedule, mesh["pp"].get_local_rank())
    torch.manual_seed(0)
    model = Model()
    stages, modules = [], []
    for index in mine:
        module = Stage(model, index, n_stages)
        for block in module.blocks:
            if "tp" in mesh:  # Megatron-style: fc1 column-wise, fc2 row-wise
                plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
                parallelize_module(block, mesh["tp"], plan)
            shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        shard(module, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        modules.append(module)
        stages.append(
            pipelining.PipelineStage(
                module, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    names = {id(p): n for n, p in model.named_parameters()}  # the sharded ones
    schedule_cls = getattr(pipelining, case.schedule)
    single = case.schedule in ("ScheduleGPipe", "Schedule1F1B")
    if case.accumulate == 1:
        kwargs: dict[str, Any] = {"loss_fn": loss_fn}
    else:
        # scale_grads divides the gradients accumulated by earlier step() calls
        # too: accumulating, the loss is scaled instead (the mean over a step's
        # microbatches), so that gradients add up over the calls like the
        # reference's over its backwards.
        kwargs = {"loss_fn": lambda *a: loss_fn(*a) / MICROBATCHES, "scale_grads": False}
    schedule = schedule_cls(stages[0] if single else stages, n_microbatches=MICROBATCHES, **kwargs)
    optimizer = make_optimizer([p for m in modules for p in m.parameters()])
    dp_size = mesh["dp"].size()
    dp_rank = (
        dist.get_rank() // mesh["tp"].size() % dp_size
        if "tp" in mesh
        else dist.get_rank() % dp_size
    )
    reduce_scatters: list[dict[str, int]] = []
    for step in range(STEPS * case.accumulate):
        inputs, targets = (t.chunk(dp_size)[dp_rank] for t in global_batch(step))
        targets_kw: dict[str, Any] = {"target": targets} if n_stages - 1 in mine else {}
        with contextlib.ExitStack() as recordings:
            stats = [recordings.enter_context(fsdp2.comm_stats(m)) for m in modules if record]
            if 0 in mine:
                schedule.step(inputs, **targets_kw)
            else:
                schedule.step(**targets_kw)
        for recorded in stats:
            counts: dict[str, int] = {}
            for groups in recorded.steps:  # one per backward: a microbatch's, then the reduction's
                for group, group_stats in groups.items():
                    counts[group] = counts.get(group, 0) + group_stats.reduce_scatter.count
            reduce_scatters.append(counts)
        if (step + 1) % case.accumulate:
            continue  # the next schedule step adds to the sharded gradients
        if record:
            _reduce_again(modules, shard)
        optimizer.step()
        optimizer.zero_grad()
    params = {names[id(p)]: p.full_tensor() for m in modules for p in m.parameters()}
    return params, reduce_scatters


def _torch_setting(case: Case) -> bool:
    """The reshard_after_forward of torch's run that fsdp2's must equal."""
    if case.torch_reshard_after_forward is None:
        return case.reshard_after_forward
    return case.torch_reshard_after_forward


def _reduce_again(modules: list[nn.Module], shard: Any) -> None:
    """What pipelining's REDUCE_GRAD calls, called again after the step (each
    group's post-backward twice, then the final callback): nothing changes,
    no collective runs, every group stays sharded."""
    grads = {id(p): p.grad.to_local().clone() for m in modules for p in m.parameters()}
    for module in modules:
        with fsdp2.comm_stats(module) as stats:
            state = shard.state(module)
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
                    group.post_backward()
            state._root_post_backward_final_callback()
        assert not any(g.of(k).count for step in stats.steps for g in step.values() for k in KINDS)
        for group in (g for each in state._state_ctx.all_states for g in each.param_groups):
            assert group.sharded_state is ShardedState.SHARDED, group
    for p in (p for m in modules for p in m.parameters()):
        assert torch.equal(p.grad.to_local(), grads[id(p)])


def _reference(accumulate: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    optimizer = make_optimizer(model)
    for step in range(STEPS * accumulate):
        inputs, targets = global_batch(step)
        loss_fn(model(inputs), targets).backward()
        if (step + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _schedules(rank: int, world_size: int, cases: list[Case]) -> None:
    if world_size == 4:
        meshes: list[dict[str, Any]] = [
            dict(_named(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))))
        ]
    else:
        # HSDP stages (each stage's dp mesh is (replicate, shard) = (2, 2)), then
        # FSDP over TP stages (dp 2, tp 2).
        hsdp = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))
        tp = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        meshes = [
            {"pp": hsdp["pp"], "dp": hsdp["replicate", "shard"]},
            {"pp": tp["pp"], "dp": tp["dp"], "tp": tp["tp"]},
        ]
    for mesh in meshes:
        _train_and_compare(mesh, cases)


def _named(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    return {name: mesh[name] for name in mesh.mesh_dim_names or ()}


def _train_and_compare(mesh: dict[str, Any], cases: list[Case]) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    references = {n: _reference(n) for n in {case.accumulate for case in cases}}
    torch_runs = {
        case: _train(mesh, case, torch_fully_shard, _torch_setting(case))[0] for case in CASES
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other test modules may hold torch's names
        installed = fsdp2.install_as_torch_fsdp()
    try:
        from torch.distributed.fsdp import fully_shard

        assert fully_shard is fsdp2.fully_shard
        for case in cases:
            params, reduce_scatters = _train(
                mesh, case, fully_shard, case.reshard_after_forward, record=True
            )
            what = str(case)
            for name, value in params.items():
                reference = references[case.accumulate][name]
                torch.testing.assert_close(value, reference, **REF_TOL, msg=f"{what} {name}")
                assert torch.equal(value, torch_runs[case][name]), (
                    f"{what} {name} differs from torch's fully_shard"
                )
            for counts in reduce_scatters:  # one per schedule step and stage
                assert counts and set(counts.values()) == {1}, (
                    f"{what} reduce-scatters per group: {counts}"
                )
    finally:
        installed.undo()


@pytest.mark.distributed
def test_every_schedule_drives_fsdp2_stages(tmp_path: Path) -> None:
    run_ranks(_schedules, 4, tmp_path, CASES)


@pytest.mark.distributed
def test_hsdp_and_tensor_parallel_stages(tmp_path: Path) -> None:
    """8 ranks: pp 2 x HSDP (2, 2) stages, then pp 2 x dp 2 x tp 2 (each block's
    fc1 column-wise, fc2 row-wise): 1F1B, and ZBV with
    reshard_after_forward=True, equal to torch's bit for bit (on four dp ranks
    HSDP still adds pairs: the shard group's two rows, then the two replicas)."""
    cases = [Case("Schedule1F1B", True), Case("ScheduleZBVZeroBubble", True, False)]
    run_ranks(_schedules, 8, tmp_path, cases)


@pytest.mark.distributed
def test_usage_example_runs_under_torchrun(tmp_path: Path) -> None:
    """The script docs/usage.md shows trains under torchrun on 4 CPU ranks
    (ZBV on a (2, 2) mesh) and its loss falls."""
    script = python_block(ROOT / "docs" / "usage.md", "## Pipeline parallelism")
    losses = losses_under_torchrun(script, 4, tmp_path, "pp.py")
    assert len(losses) == 10, losses
    assert losses[-1] < 0.8 * losses[0], losses


# -- a dead stage --------------------------------------------------------------------


def _dead_stage_job(rank: int, out_dir: Path) -> None:
    """1F1B on (pp, dp) = (2, 2) with a short job timeout; rank 3 (the second
    stage's second dp rank) is killed in step 1, in the forward of its second
    microbatch. Every rank writes what it raised, and when."""
    from test_failures import TIMEOUT, _failure_point, _sigkill, _start_together

    with open(out_dir / f"rank{rank}.stacks", "w") as stacks:
        faulthandler.dump_traceback_later(_DEAD_JOIN_S - 10, file=stacks)
        torch.set_num_threads(1)
        _start_together(rank, out_dir)
        dist.init_process_group(
            "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=4, timeout=TIMEOUT
        )
        result: dict[str, Any] = {"type": None, "messages": []}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fsdp2.install_as_torch_fsdp()
            import torch.distributed.pipelining as pipelining

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
            pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
            torch.manual_seed(0)
            module = Stage(Model(), pp_rank, 2)
            for block in module.blocks:
                fsdp2.fully_shard(block, mesh=mesh["dp"])
            fsdp2.fully_shard(module, mesh=mesh["dp"])
            stage = pipelining.PipelineStage(
                module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group()
            )
            schedule = pipelining.Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
            optimizer = make_optimizer(module)
            for step in range(3):
                if step == 1 and rank == 3:
                    calls = iter(range(MICROBATCHES))

                    def kill_at_second(*_args: Any, calls: Any = calls) -> None:
                        if next(calls) == 1:
                            _failure_point(out_dir)
                            _sigkill()

                    module.blocks[0].register_forward_pre_hook(kill_at_second, prepend=True)
                inputs, targets = (t.chunk(2)[dp_rank] for t in global_batch(step))
                if pp_rank == 0:
                    schedule.step(inputs)
                else:
                    schedule.step(target=targets)
                optimizer.step()
                optimizer.zero_grad()
        except Exception as error:
            # Pipelining re-raises a stage's error as its cause: keep the whole chain.
            chain: list[BaseException] = []
            cause: BaseException | None = error
            while cause is not None and cause not in chain:
                chain.append(cause)
                cause = cause.__cause__ or cause.__context__
            result = {"type": type(error).__name__, "messages": [str(e) for e in chain]}
        finally:
            result["raised_at"] = time.time()
            (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


_DEAD_JOIN_S = 90.0


@pytest.mark.distributed
def test_a_dead_stage_ends_the_job(tmp_path: Path) -> None:
    """A rank killed mid-schedule: its dp peer, blocked in an fsdp2 collective,
    raises fsdp2's error naming it; the other stage's ranks, blocked in
    pipelining's sends and receives or in collectives with those ranks, raise
    too; all within the job's timeout (tests/test_failures.py's bound)."""
    from dist import _context as rank_processes
    from test_failures import _MESSAGE, MARGIN_S, TIMEOUT

    ctx = rank_processes()
    procs = [ctx.Process(target=_dead_stage_job, args=(rank, tmp_path)) for rank in range(4)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + _DEAD_JOIN_S
    try:
        while (alive := [p for p in procs[:3] if p.is_alive()]) and time.monotonic() < deadline:
            wait([p.sentinel for p in alive], timeout=0.5)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    assert (tmp_path / "failed_at").exists(), "rank 3 never reached its failure point"
    failed_at = float((tmp_path / "failed_at").read_text())
    for rank in range(3):
        path = tmp_path / f"rank{rank}.json"
        stacks = tmp_path / f"rank{rank}.stacks"
        assert path.exists(), (
            f"rank {rank} neither raised nor finished: a hang\n{stacks.read_text()}"
        )
        outcome = json.loads(path.read_text())
        assert outcome["type"] is not None, f"rank {rank} finished training without its peer"
        elapsed = outcome["raised_at"] - failed_at
        assert elapsed < TIMEOUT.total_seconds() + MARGIN_S, (rank, elapsed, outcome)
        if rank == 2:  # rank 3's dp peer: fsdp2's error, naming the collective and module
            assert any(_MESSAGE.match(m) for m in outcome["messages"]), outcome["messages"]
