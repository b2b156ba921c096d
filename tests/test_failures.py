"""A dead or stuck rank never hangs the others, on any mesh (docs/usage.md,
"When a peer dies or hangs"): 4 ranks train with a short default-group
timeout, one misbehaves in step 1, and every other rank must raise fsdp2's
error, naming the collective, the module and the group, within the timeout
plus ``MARGIN_S`` of the moment it misbehaved.

Not ``run_ranks``: there any failing rank fails the test. Here each rank
writes what it raised and when to a file and leaves with ``os._exit`` (a
group with a dead peer can hang at teardown); the misbehaving rank writes
when it misbehaved; the parent kills what is left once the others are done.
The stuck case on HSDP is the one that hung before fsdp2 aligned the
timeouts (an HSDP mesh's groups had gloo's default 30 min; torch's
fully_shard still hangs there). Run as a script, this file is the job of
``test_torchrun_ends_the_job``.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist import _context as rank_processes  # run_ranks' fork server: torch imported once
from models import build_model, global_batch, local_batch, make_optimizer, mean_loss
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.base.private_dist import group_timeout

WORLD_SIZE = 4
# The job's timeout: the default group's, set by init_process_group. Short, for
# the test's time, but longer than ranks drift apart on a loaded 2-core machine.
TIMEOUT = timedelta(seconds=6)
# A survivor raises within TIMEOUT + MARGIN_S of the failure: the timeout runs
# from when its blocked collective started, a moment after the failure, and a
# loaded machine delays the wake-up (measured: under 1 s past the timeout).
MARGIN_S = 5.0
JOIN_S = 90.0  # fork, mesh and model, two steps, the timeout: far below on this machine
STEPS = 4  # step 0 runs on every rank; the failure is in step 1
# torchrun: from the survivors' errors to the end of the job (their exits, the
# agent stopping the stuck rank).
TEARDOWN_S = 15.0


# -- the job ------------------------------------------------------------------------


def _build(mesh_kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    if mesh_kind == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mesh_kind == "hsdp_compressed":
        kwargs["compression"] = fsdp2.CompressionPolicy(weights="int8", gradients="bf16")
    if mesh_kind == "hsdp_over_replicas":
        kwargs["shard_optimizer_over_replicas"] = True
    model = build_model("mlp")
    for layer in model.layers:
        fsdp2.fully_shard(layer, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    return model, make_optimizer(model)


def _failure_point(out_dir: Path) -> None:
    (out_dir / "failed_at").write_text(repr(time.time()))


def _sigkill(*_args: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _misbehave(fault: str, out_dir: Path, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Arms ``fault`` for the step about to run (on the misbehaving rank)."""

    def act(*_args: Any) -> None:
        _failure_point(out_dir)
        if fault.startswith("kill"):
            _sigkill()
        elif fault == "raise in backward":
            raise RuntimeError("injected: this rank raises mid-backward")

    if fault == "kill in forward":
        # Prepended: before fsdp2's pre-forward hook, so layers.1 is never all-gathered here.
        model.layers[1].register_forward_pre_hook(act, prepend=True)
    elif fault in ("kill in backward", "raise in backward"):

        def on_output(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            # In backward, once layers.2's reductions are issued.
            output.register_hook(act)

        model.layers[1].register_forward_hook(on_output)
    elif fault == "kill in step":
        optim.register_step_pre_hook(act)
    elif fault == "stop calling forward":
        _failure_point(out_dir)
        time.sleep(JOIN_S)  # the parent (or torchrun) ends this rank


def run_job(rank: int, scenario: str, out_dir: Path) -> None:
    """Trains ``STEPS`` steps; the rank named by ``scenario`` misbehaves in step 1.
    Every other rank writes what it raised (or that it raised nothing) and when."""
    mesh_kind, fault, bad_rank = _SCENARIOS[scenario]
    model, optim = _build(mesh_kind)
    result: dict[str, Any] = {"type": None, "message": ""}
    try:
        for step in range(STEPS):
            if step == 1 and rank == bad_rank:
                _misbehave(fault, out_dir, model, optim)
            inputs, targets = local_batch(global_batch("mlp", step), rank, WORLD_SIZE)
            mean_loss(model, inputs, targets).backward()
            optim.step()
            optim.zero_grad()
    except Exception as error:
        result = {"type": type(error).__name__, "message": str(error)}
        raise
    finally:
        result["raised_at"] = time.time()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        if rank == bad_rank and fault == "raise in backward":
            # The rank stays alive (it caught the error, or hangs in teardown):
            # its peers must not count on its connections closing.
            time.sleep(JOIN_S)


# scenario id: (mesh, fault, misbehaving rank). Every fault and every mesh once.
_SCENARIOS = {
    "fsdp-kill-in-forward": ("fsdp", "kill in forward", 1),
    "hsdp-compressed-kill-in-backward": ("hsdp_compressed", "kill in backward", 3),
    "hsdp-over-replicas-kill-in-step": ("hsdp_over_replicas", "kill in step", 2),
    "hsdp-raise-in-backward": ("hsdp", "raise in backward", 1),
    "hsdp-stop-calling-forward": ("hsdp", "stop calling forward", 3),
}


def _start_together(rank: int, out_dir: Path) -> None:
    """Returns once every rank got here: init_process_group's rendezvous waits
    for the others with the short TIMEOUT too, and ranks can start seconds
    apart on a loaded machine (under torchrun each imports torch itself)."""
    (out_dir / f"started{rank}").touch()
    deadline = time.monotonic() + JOIN_S
    while not all((out_dir / f"started{r}").exists() for r in range(WORLD_SIZE)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not start in {JOIN_S} s")
        time.sleep(0.05)


def _rank_process(rank: int, scenario: str, out_dir: Path) -> None:
    with open(out_dir / f"rank{rank}.stacks", "w") as stacks:
        # Where a rank that never raised was blocked, for the hang's message.
        faulthandler.dump_traceback_later(JOIN_S - 10, file=stacks)
        torch.set_num_threads(1)
        _start_together(rank, out_dir)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out_dir}/store",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=TIMEOUT,
        )
        try:
            run_job(rank, scenario, out_dir)
        except BaseException:
            (out_dir / f"rank{rank}.traceback").write_text(traceback.format_exc())
            os._exit(1)
    os._exit(0)


# -- the checks ---------------------------------------------------------------------


def _outcomes(out_dir: Path, bad_rank: int) -> tuple[float, dict[int, dict[str, Any]]]:
    failed_at = out_dir / "failed_at"
    if not failed_at.exists():
        tracebacks = [p.read_text() for p in sorted(out_dir.glob("rank*.traceback"))]
        raise AssertionError(
            f"rank {bad_rank} never reached its failure point; the ranks' tracebacks:\n"
            + "\n".join(tracebacks)
        )
    outcomes = {}
    for rank in range(WORLD_SIZE):
        if rank == bad_rank:
            continue
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            stacks = out_dir / f"rank{rank}.stacks"
            where = stacks.read_text() if stacks.exists() else ""
            raise AssertionError(f"rank {rank} neither raised nor finished: a hang\n{where}")
        outcomes[rank] = json.loads(path.read_text())
    return float(failed_at.read_text()), outcomes


# fsdp2's error: the collective, the module, the group with its ranks and timeout.
_MESSAGE = re.compile(
    r"fsdp2 \(rank (?P<rank>\d)\): the (?P<collective>[a-z-]+) of module '(?P<module>[^']*)' "
    r"on the (?P<group>[a-z ]+ group) \(ranks (?P<ranks>\[[0-9, ]+\]), "
    r"timeout (?P<timeout>[0-9:]+)\) failed or timed out: "
)


def _check(scenario: str, out_dir: Path) -> dict[int, re.Match]:
    """Every survivor raised fsdp2's error in time; returns each one's match."""
    _, fault, bad_rank = _SCENARIOS[scenario]
    failed_at, outcomes = _outcomes(out_dir, bad_rank)
    matches = {}
    for rank, outcome in outcomes.items():
        assert outcome["type"] == "RuntimeError", (rank, outcome)
        match = _MESSAGE.match(outcome["message"])
        assert match is not None, (rank, outcome["message"])
        assert int(match["rank"]) == rank, outcome["message"]
        assert match["module"] in ("layers.0", "layers.1", "layers.2"), outcome["message"]
        # Every group the job communicates on has the job's timeout.
        assert match["timeout"] == str(TIMEOUT), outcome["message"]
        assert "A peer rank may have died" in outcome["message"]
        elapsed = outcome["raised_at"] - failed_at
        assert elapsed < TIMEOUT.total_seconds() + MARGIN_S, (
            f"rank {rank} raised {elapsed:.1f} s after the failure: {outcome['message']}"
        )
        if fault in ("stop calling forward", "raise in backward"):
            # Nobody died: every survivor waited for a timeout, no shorter.
            assert elapsed > 0.8 * TIMEOUT.total_seconds(), (rank, elapsed, outcome["message"])
        matches[rank] = match
    return matches


def _launch(scenario: str, out_dir: Path) -> None:
    """Runs the 4 ranks; returns once every rank but the misbehaving one has
    exited (it is killed then), or after ``JOIN_S``."""
    _, _, bad_rank = _SCENARIOS[scenario]
    ctx = rank_processes()
    procs = [
        ctx.Process(target=_rank_process, args=(rank, scenario, out_dir), name=f"rank{rank}")
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_S
    try:
        while (
            survivors := [p for r, p in enumerate(procs) if r != bad_rank and p.is_alive()]
        ) and (time.monotonic() < deadline):
            wait([p.sentinel for p in survivors], timeout=0.5)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", [s for s in _SCENARIOS if s != "hsdp-stop-calling-forward"])
def test_survivors_raise_in_time(scenario: str, tmp_path: Path) -> None:
    """A rank killed (SIGKILL) in forward, backward or the optimizer step, or
    raising mid-backward and staying alive: the others raise fsdp2's error
    within the timeout, on 1-D FSDP, HSDP, HSDP with compression and HSDP
    with the optimizer sharded over the replicas."""
    _launch(scenario, tmp_path)
    matches = _check(scenario, tmp_path)
    _, fault, _ = _SCENARIOS[scenario]
    if fault == "raise in backward":
        # Rank 1's replica, rank 3, is left alone on the replicate group [1, 3].
        assert (matches[3]["group"], matches[3]["ranks"]) == ("replicate group", "[1, 3]")
    if fault == "kill in forward":
        # Rank 1 never joined layers.1's all-gather (its peers may have moved on
        # to the prefetched layers.2's).
        assert all(m["collective"] == "all-gather" for m in matches.values()), matches


@pytest.mark.distributed
def test_torchrun_ends_the_job(tmp_path: Path) -> None:
    """The case that hung before: on HSDP, rank 3 stops calling forward (alive,
    its connections open). Under torchrun, every other rank raises fsdp2's
    error once the job's timeout has passed, not gloo's default 30 min, the
    error ends its process, torchrun ends the stuck rank, and the job exits
    nonzero."""
    scenario = "hsdp-stop-calling-forward"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={WORLD_SIZE}", __file__, scenario, str(tmp_path)]
    root = str(Path(__file__).parent.parent)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    job = subprocess.run(
        command,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=JOIN_S,
    )
    ended_at = time.time()
    assert job.returncode != 0, job.stderr[-3000:]
    matches = _check(scenario, tmp_path)
    # The stuck rank's shard peer times out on the shard group, its replica on
    # the replicate group (the one whose timeout was gloo's 30 min before).
    assert (matches[2]["group"], matches[2]["ranks"]) == ("shard group", "[2, 3]"), matches
    assert (matches[1]["group"], matches[1]["ranks"]) == ("replicate group", "[1, 3]"), matches
    failed_at = float((tmp_path / "failed_at").read_text())
    # Then the job ends: the survivors' errors end their processes, torchrun the stuck one.
    assert ended_at - failed_at < TIMEOUT.total_seconds() + MARGIN_S + TEARDOWN_S, (
        ended_at - failed_at,
        job.stderr[-3000:],
    )


if __name__ == "__main__":
    # The job of test_torchrun_ends_the_job, on each rank torchrun starts.
    _start_together(int(os.environ["RANK"]), Path(sys.argv[2]))
    dist.init_process_group("gloo", timeout=TIMEOUT)
    run_job(dist.get_rank(), sys.argv[1], Path(sys.argv[2]))


# -- which groups fsdp2 changes -----------------------------------------------------


def test_timeouts_aligned_at_lazy_init(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A world of one: the groups of an HSDP mesh (gloo's default 30 min) take
    the default group's timeout at the first forward, with one INFO line; a
    group created with a timeout of its own keeps it, and so does the group
    of set_separate_reduce_scatter_group (the shard group's)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=TIMEOUT
    )
    try:
        # As init_device_mesh builds an HSDP mesh's groups on more ranks: no timeout given.
        groups = [dist.new_group([0]), dist.new_group([0])]
        mesh = DeviceMesh.from_group(
            groups, "cpu", mesh=[[0]], mesh_dim_names=("replicate", "shard")
        )
        chosen = dist.new_group([0], timeout=timedelta(minutes=45))
        own = DeviceMesh.from_group(chosen, "cpu")
        before = [group_timeout(g, "cpu") for g in [*groups, chosen]]
        assert before == [timedelta(minutes=30)] * 2 + [timedelta(minutes=45)], before
        caplog.set_level(logging.INFO, logger="fsdp2")
        separate = []
        for model_mesh in (mesh, own):
            model = fsdp2.fully_shard(nn.Linear(4, 4), mesh=model_mesh)
            model(torch.ones(2, 4)).sum().backward()
            model.set_separate_reduce_scatter_group()
            (param_group,) = fsdp2.fully_shard.state(model).param_groups
            separate.append(param_group.settings.reduce_scatter_collectives.process_group)
        after = [group_timeout(g, "cpu") for g in [*groups, chosen, *separate]]
        kept = timedelta(minutes=45)
        assert after == [TIMEOUT, TIMEOUT, kept, TIMEOUT, kept], after
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.name == "fsdp2" and r.levelno == logging.INFO
        ]
        assert lines == [
            "[rank 0] timeouts lowered to the default group's 0:00:06, so that a stuck peer "
            "fails them in time: the shard group (ranks [0]) from 0:30:00; the replicate "
            "group (ranks [0]) from 0:30:00. Create a group with a timeout of its own to keep it."
        ], lines
    finally:
        dist.destroy_process_group()
