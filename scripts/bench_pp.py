"""Benchmark: a pipeline-parallel step, fsdp2 stages against torch's fully_shard.

4 gloo ranks as ("pp", "dp") = (2, 2). Every rank builds every contender (the
same transformer, the same weights and data, its blocks and stages sharded on
the dp axis and driven by one torch.distributed.pipelining schedule) and runs
their steps interleaved, rotating the order every round. fsdp2 runs installed
under torch's names (``install_as_torch_fsdp``), torch's with them undone, so
pipelining sees each contender's own FSDP. Reported per contender: median step
time (slowest rank), its ratio to torch's fully_shard with the same
``reshard_after_forward``, and the peak tensor memory of one step on pp rank 0
(``StepPeak``, a dispatch-mode tracker: storage allocated
and resized during the step).

The zero-bubble schedules with ``reshard_after_forward=True`` train wrong under
torch's own fully_shard on torch 2.13 (docs/usage.md, "Pipeline
parallelism"): that row is marked, and fsdp2's is compared with torch's
``reshard_after_forward=False`` as well.

    python scripts/bench_pp.py                  # 1F1B and ZBV, ~2 minutes
    python scripts/bench_pp.py --schedules ScheduleGPipe --dim 512 --rounds 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["Schedule1F1B", "ScheduleZBVZeroBubble"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8, help="in the whole model")
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args(argv)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stage(nn.Module):
    def __init__(self, dim: int, vocab: int, n_blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim) if first else None
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Contender:
    """One schedule over one FSDP implementation's stages on this rank."""

    def __init__(
        self, args: argparse.Namespace, schedule: str, impl: str, raf: bool, mesh: Any
    ) -> None:
        import torch.distributed.pipelining as pipelining

        self.impl, self.raf, self.schedule_name = impl, raf, schedule
        self.name = f"{impl}, reshard_after_forward={raf}"
        pp_rank = mesh["pp"].get_local_rank()
        if schedule in SINGLE_STAGE:
            indices, n_stages = [pp_rank], 2
        elif schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
            indices, n_stages = [pp_rank, 3 - pp_rank], 4
        else:
            indices, n_stages = [pp_rank, pp_rank + 2], 4
        shard = _fully_shard(impl)
        stages = []
        self.modules: list[nn.Module] = []
        for index in indices:
            torch.manual_seed(index)
            module = Stage(
                args.dim, VOCAB, args.blocks // n_stages, index == 0, index == n_stages - 1
            )
            for block in module.blocks:
                shard(block, mesh=mesh["dp"], reshard_after_forward=raf)
            shard(module, mesh=mesh["dp"], reshard_after_forward=raf)
            self.modules.append(module)
            stages.append(
                pipelining.PipelineStage(
                    module, index, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()
                )
            )
        self.first, self.last = 0 in indices, n_stages - 1 in indices
        schedule_cls = getattr(pipelining, schedule)
        self.schedule = schedule_cls(
            stages[0] if schedule in SINGLE_STAGE else stages,
            n_microbatches=args.microbatches,
            loss_fn=loss_fn,
        )
        self.optim = torch.optim.AdamW([p for m in self.modules for p in m.parameters()], lr=1e-3)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        kwargs = {"target": targets} if self.last else {}
        if self.first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.optim.step()
        self.optim.zero_grad()


VOCAB = 512
_installed: Any = None


def _use(impl: str) -> None:
    """fsdp2 under torch's names for fsdp2's contenders, torch's for torch's."""
    global _installed
    import fsdp2

    if impl == "fsdp2" and _installed is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _installed = fsdp2.install_as_torch_fsdp()
    elif impl == "torch" and _installed is not None:
        _installed.undo()
        _installed = None


def _fully_shard(impl: str) -> Any:
    if impl == "fsdp2":
        import fsdp2

        return fsdp2.fully_shard
    from torch.distributed.fsdp import fully_shard

    return fully_shard


class StepPeak(TorchDispatchMode):
    """Peak bytes of tensor storage allocated during the ``with`` above what
    was allocated at its start: every storage an op's output brings that none
    of its inputs had, tracked until it is freed, and every
    ``UntypedStorage.resize_`` (how both FSDPs free and refill unsharded
    parameters). torch's MemTracker cannot follow a split backward
    (``autograd.grad`` breaks its module hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a tracked storage -> its bytes
        self._refs: dict[int, weakref.ref] = {}
        self._resize = torch.UntypedStorage.resize_

    def _moved(self, delta: int) -> None:
        self.now += delta
        self.peak = max(self.peak, self.now)

    def _freed(self, key: int) -> None:
        self._refs.pop(key, None)
        self._moved(-self._sizes.pop(key, 0))

    def __enter__(self) -> StepPeak:
        tracker, resize = self, self._resize

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            result = resize(storage, size)
            if id(storage) in tracker._sizes:
                tracker._sizes[id(storage)] = storage.nbytes()
            tracker._moved(storage.nbytes() - before)
            return result

        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in known and key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))
                    self._moved(storage.nbytes())
        return out


def _peak_bytes(contender: Contender, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    gc.collect()
    with StepPeak() as tracker:
        contender.step(inputs, targets)
    return tracker.peak


def worker(rank: int, args: argparse.Namespace, store: str, result_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh["dp"].get_local_rank()
    tokens = torch.randint(
        VOCAB, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    inputs, targets = (t.chunk(2)[dp_rank] for t in (tokens[:, :-1], tokens[:, 1:]))
    results: dict[str, Any] = {}
    for schedule in args.schedules:
        contenders = []
        for impl in ("fsdp2", "torch"):
            for raf in (True, False):
                _use(impl)
                contenders.append(Contender(args, schedule, impl, raf, mesh))
        times: dict[str, list[float]] = {c.name: [] for c in contenders}
        peaks: dict[str, int] = {}
        for c in contenders:
            _use(c.impl)
            for _ in range(args.warmup):
                c.step(inputs, targets)
            peaks[c.name] = _peak_bytes(c, inputs, targets)
        for round_ in range(args.rounds):
            order = contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]
            for c in order:
                _use(c.impl)
                dist.barrier()
                start = time.perf_counter()
                c.step(inputs, targets)
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
                times[c.name].append(elapsed.item())
        results[schedule] = {
            name: {"median_ms": 1e3 * statistics.median(ts), "peak_mib_pp0": peaks[name] / 2**20}
            for name, ts in times.items()
        }
        del contenders
        gc.collect()
    _use("torch")
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)
    gc.collect()
    dist.destroy_process_group()


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"pipeline step, 4 gloo ranks (pp 2 x dp 2), dim {args.dim}, {args.blocks} blocks, "
        f"batch {args.batch} x {args.seq_len}, {args.microbatches} microbatches, {args.rounds} rounds"
    )
    for schedule, rows in results.items():
        print(f"\n{schedule}")
        print(f"  {'contender':<36} {'step ms':>9} {'/ torch':>8} {'peak MiB (pp 0)':>16}")
        for name, row in rows.items():
            impl, _, raf = name.partition(", ")
            torch_row = rows[f"torch, {raf}"]
            ratio = row["median_ms"] / torch_row["median_ms"]
            wrong = impl == "torch" and schedule in ZERO_BUBBLE and raf.endswith("True")
            mark = "  (trains wrong: torch's split backward)" if wrong else ""
            print(
                f"  {name:<36} {row['median_ms']:9.1f} {ratio:8.2f} {row['peak_mib_pp0']:16.2f}{mark}"
            )
        if schedule in ZERO_BUBBLE:
            right = rows["torch, reshard_after_forward=False"]["median_ms"]
            ours = rows["fsdp2, reshard_after_forward=True"]["median_ms"]
            print(
                f"  fsdp2 (reshard_after_forward=True) / torch's right run (False): {ours / right:.2f}"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), result_path), nprocs=4, join=True)
        with open(result_path) as f:
            results = json.load(f)
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
