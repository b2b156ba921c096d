"""Fault-tolerant HSDP with torchft, wired as torchtitan wires it.

Each replica group is a world of its own (its default process group is the
shard group fsdp2 shards over); the replicas are torchft's: a ``Manager`` per
rank agrees with the other groups, through torchft's lighthouse, on who takes
part in each step, all-reduces the gradients across the groups that do (the
all-reduce hook below), lets a group that failed drop out while the others
keep stepping, and heals a group that joins late by copying a live peer's
state dict (torchft's HTTP checkpoint transport).

docs/usage.md ("Fault-tolerant HSDP with torchft") quotes these functions and
tests/test_torchft.py runs them, on 2 replica groups x 2 CPU ranks, with
fsdp2's ``fully_shard`` and with torch's, through a replica group killed
mid-step and its replacement.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torchft import Manager, ProcessGroupGloo
from torchft.process_group import ManagedProcessGroup

DIM = 16


class Net(nn.Module):
    """Two residual MLP blocks and a head: one ``fully_shard`` group per block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def shard(
    model: Net, fully_shard: Callable[..., Any], mesh: DeviceMesh | None = None
) -> list[nn.Module]:
    """Shards ``model`` with ``fully_shard`` (fsdp2's or torch's) over this
    replica group (its default group), or over ``mesh``, a mesh of the
    replica group's ranks; returns the sharded modules."""
    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return [*model.blocks, model]


def sync_across_replica_groups(sharded: list[nn.Module], manager: Manager) -> None:
    """Each sharded module's reduce-scattered gradients are averaged across the
    replica groups of the current quorum by torchft: an all-reduce on its
    ``ManagedProcessGroup`` is ``Manager.allreduce``, which waits for the
    quorum, and reports a failed peer to the manager instead of raising (the
    step is then not committed)."""
    replicas = ManagedProcessGroup(manager)
    replicas.register("replicate")

    def all_reduce(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicas, op=dist.ReduceOp.AVG)

    for module in sharded:
        module.set_all_reduce_hook(all_reduce)  # type: ignore[operator]


def make_manager(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    replica_id: str,
    lighthouse: str,
    store_port: int,
) -> Manager:
    """This rank's torchft manager. ``store_port``: the replica group's
    TCPStore on localhost; its rank 0 also runs the group's manager server."""

    # torchft reads the state dict on its quorum thread, while this thread may be
    # in forward: a module's state_dict() there would run the sharding's
    # state-dict hook (a reshard) under the running forward. Taken once, here,
    # it holds the live sharded parameters (as torchtitan's cached state dict).
    model_state = model.state_dict()

    def state_dict() -> dict[str, Any]:
        return {"model": model_state, "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=replica_id,
        lighthouse_addr=lighthouse,
        store_addr="localhost",
        store_port=store_port,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        init_sync=False,  # every rank builds the model from the same seed
        timeout=timedelta(seconds=30),
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    manager: Manager,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[float, bool]:
    """One step; returns the local loss and whether the step was committed
    (the optimizer stepped). A step that is not committed is retried by the
    caller with the same batch (``manager.current_step()`` did not move)."""
    manager.start_quorum()  # agreed on in the background while forward runs
    optimizer.zero_grad()
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()  # the hooks all-reduce across the replica groups in the quorum
    committed = manager.should_commit()  # False on every group rank if any failed
    if committed:
        optimizer.step()
    return loss.item(), committed


def batch(replica: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` of replica group ``replica`` at ``step``: a
    function of the three alone, so a retried step sees the same data."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * replica + rank)
    return torch.randn(4, DIM, generator=generator), torch.randn(4, 3, generator=generator)
