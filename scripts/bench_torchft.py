"""What torchft adds to a step of scripts/torchft_hsdp.py on CPU: 2 replica
groups x 2 gloo ranks, healthy, fsdp2's fully_shard.

    python scripts/bench_torchft.py --steps 40

Prints, per step (median over the steps after the first 5, on group 0's
rank 0): the quorum (``start_quorum`` then ``wait_quorum``, timed apart from
the step: in training it runs on torchft's thread while forward runs), the
all-reduces across the groups made by the hooks (one per sharded module,
``Manager.allreduce`` through torchft's ``ManagedProcessGroup``),
``should_commit``, and the whole step; then the step of the same model
and batches on fsdp2's own HSDP over the 4 ranks (2 x 2), without torchft.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchft_hsdp as example
from torch.distributed.device_mesh import init_device_mesh
from torchft.coordination import LighthouseServer

import fsdp2


def _rank(
    replica: int, rank: int, store_port: int, lighthouse: str, steps: int, queue: Any
) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", store_port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = example.Net()
    sharded = example.shard(model, fsdp2.fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = example.make_manager(model, optimizer, f"replica{replica}", lighthouse, store_port)
    spent = {"all_reduce": 0.0}
    example.sync_across_replica_groups(sharded, manager)
    all_reduce = dist.all_reduce  # the hooks' (fsdp2's own collectives on gloo are others)

    def timed_all_reduce(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = all_reduce(*args, **kwargs)
        spent["all_reduce"] += time.perf_counter() - start
        return result

    dist.all_reduce = timed_all_reduce
    rows = []
    for step in range(steps):
        inputs, targets = example.batch(replica, rank, step)
        start = time.perf_counter()
        manager.start_quorum()
        manager.wait_quorum()
        quorum = time.perf_counter() - start
        spent["all_reduce"] = 0.0
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        before_commit = time.perf_counter()
        committed = manager.should_commit()
        commit = time.perf_counter() - before_commit
        if committed:
            optimizer.step()
        total = time.perf_counter() - start
        rows.append((quorum, spent["all_reduce"], commit, total))
    if replica == 0 and rank == 0:
        queue.put(rows)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _native_rank(rank: int, store_port: int, steps: int, queue: Any) -> None:
    """The same model and batches on fsdp2's own HSDP over the 4 ranks (2 x 2),
    without torchft: the step to compare with."""
    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", store_port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = example.Net()
    example.shard(model, fsdp2.fully_shard, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    times = []
    for step in range(steps):
        inputs, targets = example.batch(rank // 2, rank % 2, step)
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def _native(steps: int) -> list[float]:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_native_rank, args=(rank, store.port, steps, queue)) for rank in range(4)
    ]
    for proc in procs:
        proc.start()
    times = queue.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    stores = [
        dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) for _ in range(2)
    ]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank,
            args=(replica, rank, stores[replica].port, lighthouse.address(), args.steps, queue),
        )
        for replica in range(2)
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    lighthouse.shutdown()
    kept = rows[5:]
    names = ("quorum (start + wait)", "hooks' all-reduces", "should_commit", "step (no quorum)")
    for i, name in enumerate(names):
        print(f"{name:24s} {1e3 * statistics.median(r[i] for r in kept):7.2f} ms")
    native = statistics.median(_native(args.steps)[5:])
    print(f"{'fsdp2 HSDP 2 x 2 step':24s} {1e3 * native:7.2f} ms")


if __name__ == "__main__":
    main()
