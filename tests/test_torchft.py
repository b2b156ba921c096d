"""torchft with fsdp2, as with torch's fully_shard: 2 replica groups x 2 CPU
ranks, one group killed in the middle of a step, a replacement that heals from
the live one (scripts/torchft_hsdp.py, the example docs/usage.md quotes).

The scenario is made deterministic by gates: a rank waits at the top of a
step for a file the test writes, and the test releases a group only once the
lighthouse's status page shows what the next quorum must contain. Steps:

- 0-2: groups A and B, both in every quorum.
- 3: B joins the quorum, runs its forward and stops before backward; the
  test SIGKILLs both of its ranks. A's all-reduce with B fails, torchft reports it, A's step 3 is
  not committed; A retries it alone once the lighthouse stops hearing from B.
- 4: A alone; the test starts C, B's replacement (replica 1 again).
- 5: A and C: C heals from A (torchft's HTTP checkpoint transport) and does
  not take part in the gradient; both commit.
- 6-7: A and C.

The same scenario runs with fsdp2's fully_shard, with torch's, and with
fsdp2's shard_optimizer_over_replicas inside each group: every rank's losses,
commits and quorum sizes must match torch's bit for bit, and at the end A and
C must hold equal parameters and optimizer states. The three runs take 20-43 s
on 2 shared CPU cores (about 13 s each: process starts, and the 3 s after the
kill before the lighthouse drops B).
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import re
import sys
import time
import traceback
import urllib.request
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import dist as dist_harness
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only
from torch.distributed.tensor import DTensor

import fsdp2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from torchft_hsdp import (  # noqa: E402
    Net,
    batch,
    make_manager,
    shard,
    sync_across_replica_groups,
    train_step,
)

STEPS = 8
KILL_STEP = 3
JOIN_STEP = 5
# The lighthouse drops a replica it has not heard from for this long. A live
# replica's manager heartbeats every 0.1 s from a thread of its own: 3 s is a
# 30x margin for a loaded machine, paid once, when B is killed.
HEARTBEAT_TIMEOUT_MS = 3000
SCENARIO_TIMEOUT_S = 120.0
# group name -> (replica index, steps gated at their top)
GROUPS = {"A": (0, (0, JOIN_STEP)), "B": (1, (0,)), "C": (1, (0,))}


def _rank(impl: str, name: str, rank: int, store_port: int, lighthouse: str, out: Path) -> None:
    try:
        _train(impl, name, rank, store_port, lighthouse, out)
    except BaseException:
        (out / f"{name}{rank}.error").write_text(f"{time.time_ns()}\n{traceback.format_exc()}")
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/dist.py's ranks: no interpreter finalization with gloo threads


def _train(impl: str, name: str, rank: int, store_port: int, lighthouse: str, out: Path) -> None:
    replica, gates = GROUPS[name]
    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", store_port, is_master=False)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("world", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    torch.manual_seed(0)
    model = Net()
    if impl == "torch":
        sharded = shard(model, torch_fully_shard)
    elif impl == "fsdp2":
        sharded = shard(model, fsdp2.fully_shard)
    else:  # inside the replica group, HSDP (2 replicas x 1) with the optimizer over both
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        sharded = shard(model, partial(fsdp2.fully_shard, shard_optimizer_over_replicas=True), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = make_manager(model, optimizer, f"replica{replica}", lighthouse, store_port)
    sync_across_replica_groups(sharded, manager)
    log = out / f"{name}{rank}.jsonl"
    while (step := manager.current_step()) < STEPS:
        (out / f"at-{name}{rank}-{step}").touch()
        if step in gates:
            _wait_for(out / f"go-{name}-{step}")
        inputs, targets = batch(replica, rank, step)
        if name == "B" and step == KILL_STEP:
            manager.start_quorum()
            manager.wait_quorum()  # A's step 3 is with B, whose ranks die in it
            model(inputs)  # forward, then killed before backward
            (out / f"stopped-{name}{rank}").touch()
            time.sleep(SCENARIO_TIMEOUT_S)
        loss, committed = train_step(model, optimizer, manager, inputs, targets)
        # "step": the step that was committed (or tried): a healing group starts
        # at 0 and is at its peer's step once it committed.
        done = manager.current_step()
        record = {"step": done - 1 if committed else step, "loss": loss, "committed": committed}
        record["participants"] = manager.num_participants()
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
    full = {k: _full(v) for k, v in model.state_dict().items()}
    optim = optimizer.state_dict()["state"]
    optim = {i: {k: _full(v) for k, v in s.items()} for i, s in optim.items()}
    torch.save({"model": full, "optim": optim}, out / f"{name}{rank}.pt")
    manager.shutdown(wait=False)
    gc.collect()  # as tests/dist.py: no gloo thread left holding tensors at exit
    dist.destroy_process_group()


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _wait_for(path: Path, timeout: float = SCENARIO_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {path.name}")
        time.sleep(0.02)


class _Scenario:
    def __init__(self, impl: str, out: Path) -> None:
        from torchft.coordination import LighthouseServer

        self.impl, self.out = impl, out
        out.mkdir()
        self.lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=1,
            join_timeout_ms=60_000,  # never reached: the gates decide who joins when
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
        port = self.lighthouse.address().rsplit(":", 1)[1]
        self.status_url = f"http://localhost:{port}/status"
        self.stores: list[dist.TCPStore] = []
        self.procs: dict[str, list[Any]] = {}
        self.deadline = time.monotonic() + SCENARIO_TIMEOUT_S

    def start(self, name: str) -> None:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.stores.append(store)
        ctx = dist_harness._context()
        self.procs[name] = [
            ctx.Process(
                target=_rank,
                args=(self.impl, name, rank, store.port, self.lighthouse.address(), self.out),
            )
            for rank in range(2)
        ]
        for proc in self.procs[name]:
            proc.start()

    def wait(self, *names: str) -> None:
        for name in names:
            while not (self.out / name).exists():
                self._check()
                time.sleep(0.02)

    def wait_status(self, pattern: str) -> None:
        """Until the lighthouse's next quorum is in the state ``pattern`` describes."""
        while True:
            self._check()
            with urllib.request.urlopen(self.status_url, timeout=10) as page:
                if re.search(pattern, page.read().decode()):
                    return
            time.sleep(0.05)

    def release(self, name: str, step: int) -> None:
        (self.out / f"go-{name}-{step}").touch()

    def kill(self, name: str) -> None:
        for proc in self.procs[name]:
            proc.kill()  # SIGKILL
            proc.join()

    def join(self, *names: str) -> None:
        for name in names:
            for proc in self.procs[name]:
                while proc.is_alive():
                    self._check()
                    proc.join(0.1)
        self._check()

    def _check(self) -> None:
        errors = sorted(p.read_text().partition("\n")[::2] for p in self.out.glob("*.error"))
        if errors:
            raise AssertionError(f"[{self.impl}] a rank failed first:\n{errors[0][1]}")
        if time.monotonic() > self.deadline:
            raise AssertionError(f"[{self.impl}] the scenario ran past {SCENARIO_TIMEOUT_S} s")

    def close(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        self.lighthouse.shutdown()


def _run(impl: str, out: Path) -> dict[str, Any]:
    scenario = _Scenario(impl, out)
    try:
        scenario.start("A")
        scenario.start("B")
        # Both managers heartbeat before either asks for a quorum: B alone would
        # otherwise make a quorum of one, and A would heal from it.
        scenario.wait_status(r"\[0/0 participants healthy\]\[2 heartbeating\]")
        scenario.release("B", 0)
        scenario.wait_status(r"\[1/1 participants healthy\]")
        scenario.release("A", 0)
        scenario.wait("stopped-B0", "stopped-B1")
        scenario.kill("B")
        scenario.wait("at-A0-4", "at-A1-4")  # A's quorum without B is made
        scenario.start("C")
        scenario.wait(f"at-A0-{JOIN_STEP}", f"at-A1-{JOIN_STEP}")
        scenario.wait_status(r"\[0/0 participants healthy\]\[2 heartbeating\]")
        scenario.release("C", 0)
        scenario.wait_status(r"\[1/1 participants healthy\]")  # C waits for A's quorum
        scenario.release("A", JOIN_STEP)
        scenario.join("A", "C")
    finally:
        scenario.close()
    logs = {
        path.stem: [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob("*.jsonl"))
    }
    states = {path.stem: torch.load(path) for path in sorted(out.glob("*.pt"))}
    return {"logs": logs, "states": states}


def _assert_same_state(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["model"].keys() == b["model"].keys(), what
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"{what}: {key}"
    assert a["optim"].keys() == b["optim"].keys(), what
    for index, state in a["optim"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optim"][index][key]), f"{what}: optim {index} {key}"


@pytest.mark.distributed
def test_kill_and_heal_as_torch(tmp_path: Path) -> None:
    ours = _run("fsdp2", tmp_path / "fsdp2")
    logs = ours["logs"]
    steps = [r["step"] for r in logs["A0"]]
    assert steps == [0, 1, 2, 3, 3, 4, 5, 6, 7]
    # Step 3 failed with B (its all-reduce peers died), then A went on alone
    # until C joined at step 5, healing (not counted in that step's gradient).
    assert [r["committed"] for r in logs["A0"]] == [True] * 3 + [False] + [True] * 5
    assert [r["participants"] for r in logs["A0"]] == [2, 2, 2, 2, 1, 1, 1, 2, 2]
    assert [r["step"] for r in logs["B0"]] == [0, 1, 2]
    assert [r["step"] for r in logs["C0"]] == [5, 6, 7]
    assert all(r["committed"] for r in logs["C0"])
    for rank in range(2):
        assert logs[f"A{rank}"][:3] != logs[f"B{rank}"], "replicas 0 and 1 saw the same data"
        _assert_same_state(
            ours["states"][f"A{rank}"], ours["states"][f"C{rank}"], f"A{rank} vs C{rank}"
        )

    reference = _run("torch", tmp_path / "torch")
    assert logs == reference["logs"]
    for name, state in ours["states"].items():
        _assert_same_state(state, reference["states"][name], f"{name}: fsdp2 vs torch")

    # shard_optimizer_over_replicas inside each replica group: every group still
    # holds a whole copy, so C heals from A's pieces; 2 replicas x 1 sums what
    # 1D FSDP over 2 ranks sums, so the curves are torch's to the bit.
    pieces = _run("over_replicas", tmp_path / "over_replicas")
    assert pieces["logs"] == reference["logs"]
    for name, state in pieces["states"].items():
        _assert_same_state(state, reference["states"][name], f"{name}: over replicas vs torch")


def test_usage_quotes_the_example() -> None:
    """docs/usage.md ("Fault-tolerant HSDP with torchft") shows the code the
    scenario runs."""
    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    for function in (shard, sync_across_replica_groups, make_manager, train_step):
        assert inspect.getsource(function) in usage, f"docs/usage.md lacks {function.__name__}"


def test_over_replicas_refuses_torchft_replicas() -> None:
    """shard_optimizer_over_replicas across torchft's replica groups (a mesh
    whose replicate axis is torchft's process group) is refused in fully_shard."""
    from torchft.process_group import ProcessGroupGloo

    with dist_harness.fake_world(1):
        replicas = ProcessGroupGloo().register("test_over_replicas_refuses_torchft")
        mesh = DeviceMesh.from_group(
            [replicas, dist.group.WORLD],
            "cpu",
            mesh=torch.tensor([[0]]),
            mesh_dim_names=("replicate", "shard"),
        )
        with pytest.raises(ValueError, match="cannot split the optimizer across torchft's"):
            fsdp2.fully_shard(Net(), mesh=mesh, shard_optimizer_over_replicas=True)
