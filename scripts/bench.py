"""Benchmark: fsdp2 against torch's fully_shard, DDP and the no-communication floor.

Every rank holds the four contenders (same model, same initial weights, same
data) and runs their training steps interleaved, rotating the order every
round, so drift of this shared machine hits all of them alike. Reported per
contender: median step time (slowest rank) and its ratios to torch's
fully_shard, DDP and the floor, peak tensor memory of a step (a dispatch-mode
tracker, which works on CPU; the least of ``PEAK_STEPS`` steps), bytes
all-gathered / reduce-scattered per step against the theoretical volume, and
fsdp2's exposed communication (time the training thread waited for a
collective, from fsdp2.comm_stats; torch's fully_shard has no such counter).

    python scripts/bench.py                    # defaults: 2 gloo ranks, ~1 minute
    python scripts/bench.py --json out.json --dim 512 --layers 8
    python scripts/bench.py --mp bf16 --prefetch explicit
    python scripts/bench.py --torch-collectives  # + fsdp2 on torch's gloo collectives
    python scripts/bench.py --optim muon         # Muon's optimizer step alone (bench_muon.py)
    python scripts/bench.py --compression weights-int8 grads-bf16 grads-int8 all-int8
                                               # + fsdp2 with each CompressionPolicy setting
    python scripts/bench.py --compile inductor   # + both FSDPs with each block compiled
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from budget import print_budget, profile_budget, record  # noqa: E402 (the script's folder)

CONTENDERS = ("fsdp2", "torch", "ddp", "floor")
# --torch-collectives: fsdp2's engine with torch's own all-gather and
# reduce-scatter on gloo instead of its own ([Note: collectives on gloo]).
TORCH_COLLECTIVES = "fsdp2, torch colls"
# --compile: both FSDPs again, each block compiled after fully_shard (torchtitan's recipe).
COMPILED = ("fsdp2, compiled", "torch, compiled")
# --compression: fsdp2 with a CompressionPolicy, one contender per setting.
COMPRESSION_SETTINGS = {
    "weights-int8": {"weights": "int8"},
    "grads-bf16": {"gradients": "bf16"},
    "grads-int8": {"gradients": "int8"},
    "all-int8": {"weights": "int8", "gradients": "int8"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per-rank batch size")
    p.add_argument("--steps", type=int, default=12, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--reshard-after-forward",
        type=reshard_policy,
        default="default",
        help="policy for both FSDP contenders: default (True except the root), true, false, "
        "or an int N (reshard to groups of N ranks; 1 < N < world size, dividing it)",
    )
    p.add_argument(
        "--mp",
        choices=("none", "bf16"),
        default="none",
        help="bf16: both FSDPs compute and all-gather in bf16 and reduce in fp32; DDP and "
        "the floor run under CPU autocast to bf16",
    )
    p.add_argument(
        "--prefetch",
        choices=("default", "explicit"),
        default="default",
        help="default: each FSDP's own (torch: backward only); explicit: both get the "
        "same lists, block i prefetches block i+1 in forward and i-1 in backward",
    )
    p.add_argument(
        "--foreach",
        choices=("default", "true"),
        default="default",
        help="AdamW's implementation for every contender: default (a loop over the "
        "parameters on CPU) or foreach=True (one multi-tensor op per update)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile fsdp2 and DDP and print where a step's time goes (slowest rank)",
    )
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument(
        "--torch-collectives",
        action="store_true",
        help=f"also run '{TORCH_COLLECTIVES}': fsdp2 calling torch's all-gather and "
        "reduce-scatter on gloo, to compare with fsdp2's own in the same interleaved run",
    )
    p.add_argument(
        "--optim",
        choices=("adamw", "muon"),
        default="adamw",
        help="adamw: the training-step benchmark above; muon: the optimizer step of "
        "fsdp2.optim.Muon against torch.optim.Muon, sharded and unsharded, on --layers x "
        "Linear(--dim, --dim) (scripts/bench_muon.py)",
    )
    p.add_argument(
        "--compression",
        nargs="*",
        choices=sorted(COMPRESSION_SETTINGS),
        default=[],
        help="also run fsdp2 with these CompressionPolicy settings (contenders 'fsdp2, "
        "<setting>'; on CPU the cores that compute also quantize)",
    )
    p.add_argument(
        "--compile",
        choices=("inductor", "aot_eager"),
        help=f"also run {' and '.join(repr(c) for c in COMPILED)}: each block "
        "block.compile(backend=...)-d after fully_shard; the warm-up steps compile",
    )
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    n = args.reshard_after_forward
    if isinstance(n, int) and not (1 < n < args.world_size and args.world_size % n == 0):
        p.error(
            f"--reshard-after-forward {n} must divide --world-size {args.world_size} and lie "
            "strictly between 1 and it"
        )
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    return args


def reshard_policy(value: str) -> str | int:
    if value in ("default", "true", "false"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected default, true, false or an int"
        ) from None


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    model_args = ModelArgs(
        n_layers=args.layers,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        dim=args.dim,
        n_heads=args.heads,
        dropout_p=0.0,
        weight_tying=False,
    )
    return Transformer(model_args)


def shard(
    model: nn.Module, fully_shard, mesh, args: argparse.Namespace, mp_policy, compression=None
) -> nn.Module:
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if compression is not None:
        kwargs["compression"] = compression
    policy = args.reshard_after_forward
    if policy != "default":
        kwargs["reshard_after_forward"] = policy if isinstance(policy, int) else policy == "true"
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if args.prefetch == "explicit":
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0) : i])
    return model


@contextlib.contextmanager
def replaced(wrap) -> Iterator[None]:
    """Replaces torch's ``all_gather_single`` and ``reduce_scatter_single`` and
    the ``all_gather`` and ``reduce_scatter`` of fsdp2's collectives (torch's
    and gloo's, fsdp2/comm/primitives.py) by ``wrap(name, original)`` while active;
    ``name`` is torch's, the original takes torch's arguments."""
    from fsdp2.comm.primitives import Collectives, GlooCollectives

    with contextlib.ExitStack() as stack:
        for name in ("all_gather_single", "reduce_scatter_single"):
            stack.enter_context(mock.patch.object(dist, name, wrap(name, getattr(dist, name))))
            method = name.removesuffix("_single")
            for cls in (Collectives, GlooCollectives):
                stack.enter_context(
                    mock.patch.object(
                        cls, method, _wrapped_method(wrap, name, getattr(cls, method))
                    )
                )
        yield


def _wrapped_method(wrap, name, original):
    def method(self, output, input, *args, **kwargs):
        return wrap(name, functools.partial(original, self))(output, input, *args, **kwargs)

    return method


def count_bytes(run) -> dict[str, int]:
    """Bytes passed to the all-gathers (output) and reduce-scatters (input)
    of ``run()``: torch.distributed's for torch's fully_shard, those of
    fsdp2's collectives for fsdp2 (on gloo built from other collectives)."""
    counted: dict[str, int] = defaultdict(int)

    def wrap(name, original):
        def counting(output, input, *args, **kwargs):
            big = output if name == "all_gather_single" else input
            counted[name] += big.numel() * big.element_size()
            return original(output, input, *args, **kwargs)

        return counting

    with replaced(wrap):
        run()
    return dict(counted)


def theoretical_bytes(
    model: nn.Module, reshard_after_forward: str | int, gather_itemsize: int
) -> dict[str, int]:
    """Unpadded volume of one step: every parameter all-gathered in forward (in
    ``gather_itemsize`` bytes per element), the blocks' again in backward when
    they reshard (the root never does by default; with an int, from the
    smaller groups), every gradient reduce-scattered (in the parameters' dtype)."""
    root = block = 0
    for fqn, param in model.named_parameters():
        if fqn.startswith("layers."):
            block += param.numel()
        else:
            root += param.numel()
    policy = "true" if isinstance(reshard_after_forward, int) else reshard_after_forward
    regathered = {"default": block, "true": block + root, "false": 0}[policy]
    return {
        "all_gather_single": (root + block + regathered) * gather_itemsize,
        "reduce_scatter_single": (root + block) * 4,
    }


def step_transient_bytes(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """What one step of the unsharded model, computing in ``dtype`` (as FSDP's
    unsharded parameters do), holds at its peak beyond its parameters: the
    activations, the backward's temporaries and the gradients alive then."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = build_model(args).to(dtype)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        start = sum(d["Total"] for d in tracker.get_tracker_snapshot("current").values())
        out = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(out.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    return int(peak - start)


def implied_peak_bytes(
    model: nn.Module, transient: int, args: argparse.Namespace, param_dtype: torch.dtype
) -> int:
    """The least memory an FSDP step can peak at, from the sizes. The peak is in
    the head's backward, when every activation is alive:

        this rank's shards of the parameters and AdamW's two states (fp32)
      + unsharded parameters that must be held then (in ``param_dtype``): the
        root's (kept from forward, or gathered again for the head), and with
        reshard False every block's, with an int N the blocks' post-forward
        shards (1/N of them)
      + the unsharded model's step transient (``step_transient_bytes``).

    With reshard True or an int the root is sharded again while the loss is
    computed, so the peak may be that moment's, up to ~2% below this.
    """
    itemsize = param_dtype.itemsize
    block = sum(p.numel() for p in model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    blocks = block * len(model.layers)
    policy = args.reshard_after_forward
    held_blocks = {"false": blocks}.get(policy, 0) if isinstance(policy, str) else blocks // policy
    held = (total - blocks + held_blocks) * itemsize
    return 3 * total * 4 // args.world_size + held + transient


class PhaseClock:
    """One training step by the wall clock, phase by phase, and the CPU time the
    process spent in it: on the training thread, and on all its other threads
    (gloo's transport and worker threads). No profiler: it only reads clocks."""

    COLUMNS = ("forward", "backward", "optimizer", "thread_cpu", "other_cpu")

    def __init__(self) -> None:
        self._lap = time.perf_counter()
        self._thread = time.thread_time()
        self._process = time.process_time()
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._lap
        self._lap = now

    def stop(self) -> dict[str, float]:
        thread = time.thread_time() - self._thread
        self.seconds["thread_cpu"] = thread
        self.seconds["other_cpu"] = time.process_time() - self._process - thread
        return self.seconds


def worker(rank: int, args: argparse.Namespace, store: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=300),
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp2
    from fsdp2.comm.primitives import Collectives, GlooCollectives

    mesh = init_device_mesh("cpu", (args.world_size,))
    bf16 = args.mp == "bf16"
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    policies = (
        (fsdp2.MixedPrecisionPolicy(**mp), TorchMixedPrecisionPolicy(**mp))
        if bf16
        else (None, None)
    )
    contenders = list(CONTENDERS)
    models = {
        "fsdp2": shard(build_model(args), fsdp2.fully_shard, mesh, args, policies[0]),
        "torch": shard(build_model(args), torch_fully_shard, mesh, args, policies[1]),
        "ddp": nn.parallel.DistributedDataParallel(build_model(args)),
        "floor": build_model(args),
    }
    if args.torch_collectives:
        contenders.insert(1, TORCH_COLLECTIVES)
        models[TORCH_COLLECTIVES] = shard(
            build_model(args), fsdp2.fully_shard, mesh, args, policies[0]
        )
    compressed = {f"fsdp2, {name}": name for name in args.compression}
    for i, (contender, setting) in enumerate(compressed.items()):
        contenders.insert(1 + i, contender)
        policy = fsdp2.CompressionPolicy(**COMPRESSION_SETTINGS[setting])
        models[contender] = shard(
            build_model(args), fsdp2.fully_shard, mesh, args, policies[0], policy
        )
    if args.compile:
        for contender, fully_shard, policy in zip(
            COMPILED, (fsdp2.fully_shard, torch_fully_shard), policies, strict=True
        ):
            contenders.append(contender)
            models[contender] = shard(build_model(args), fully_shard, mesh, args, policy)
            for block in models[contender].layers:
                block.compile(backend=args.compile)
    foreach = True if args.foreach == "true" else None
    optims = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=foreach) for k, m in models.items()
    }
    loss_fn = nn.CrossEntropyLoss()

    phases: dict[str, list[dict[str, float]]] = defaultdict(list)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step(name: str, step: int) -> float:
        if name != TORCH_COLLECTIVES:
            return run_step(name, step)
        # fsdp2's engine, torch's collectives on the gloo group.
        with (
            mock.patch.object(GlooCollectives, "all_gather", Collectives.all_gather),
            mock.patch.object(GlooCollectives, "reduce_scatter", Collectives.reduce_scatter),
        ):
            return run_step(name, step)

    def run_step(name: str, step: int) -> float:
        clock = PhaseClock()
        x, y = batch(step)
        autocast = bf16 and name in ("ddp", "floor")
        with record("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = models[name](x)
        with record("loss"):
            loss = loss_fn(out.float().reshape(-1, out.size(-1)), y.reshape(-1))
        clock.lap("forward")
        with record("backward"):
            loss.backward()
        clock.lap("backward")
        with record("optimizer"):
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
        clock.lap("optimizer")
        phases[name].append(clock.stop())
        return loss.item()

    # Warm-up, then one step per contender counted for bytes.
    for step in range(args.warmup):
        for name in contenders:
            train_step(name, step)
    comm_bytes = {
        "fsdp2": count_bytes(lambda: train_step("fsdp2", 0)),
        "torch": count_bytes(lambda: train_step("torch", 0)),
    }
    for contender in compressed:
        # Compressed gradients travel by all-to-all: fsdp2's own count (comm_stats).
        with fsdp2.comm_stats(models[contender]) as counted:
            train_step(contender, 0)
        groups = counted.steps[-1].values()
        comm_bytes[contender] = {
            "all_gather_single": sum(g.all_gather.bytes for g in groups),
            "reduce_scatter_single": sum(g.reduce_scatter.bytes for g in groups),
        }

    times: dict[str, list[float]] = {k: [] for k in contenders}
    losses: dict[str, list[float]] = {k: [] for k in contenders}
    phases.clear()  # only the timed steps'
    with fsdp2.comm_stats(models["fsdp2"]) as stats:
        for step in range(args.steps):
            shift = step % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                dist.barrier()
                start = time.perf_counter()
                losses[name].append(train_step(name, args.warmup + step))
                times[name].append(time.perf_counter() - start)
    # Per step, the time fsdp2's training thread waited for collectives.
    waits = [
        sum(c.wait_seconds for g in step.values() for c in (g.all_gather, g.reduce_scatter))
        for step in stats.steps
    ]

    # Slowest rank per step, for the step and for each of its phases.
    slowest = {}
    slowest_phases = {}
    for name in contenders:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()
        per_phase = torch.tensor(
            [[step[k] for k in PhaseClock.COLUMNS] for step in phases[name]], dtype=torch.float64
        )
        dist.all_reduce(per_phase, op=dist.ReduceOp.MAX)
        # quantile 0.5: the median as statistics.median takes it (the mean of the
        # middle two), not torch.median's lower one.
        median = torch.quantile(per_phase, 0.5, dim=0).tolist()
        slowest_phases[name] = dict(zip(PhaseClock.COLUMNS, median, strict=True))

    peak = {name: peak_memory(train_step, name, models[name], optims[name]) for name in contenders}

    budgets = {}
    if args.profile:
        for name in ("fsdp2", "ddp"):
            dist.barrier()
            mine = profile_budget(lambda i, n=name: train_step(n, i), args.profile_steps)
            every = [None] * args.world_size
            dist.all_gather_object(every, mine)
            budgets[name] = max(every, key=lambda b: b["step"])  # the slowest rank's

    expected = theoretical_bytes(models["floor"], args.reshard_after_forward, 2 if bf16 else 4)
    exposed = torch.tensor([statistics.median(waits)], dtype=torch.float64)
    dist.all_reduce(exposed, op=dist.ReduceOp.MAX)
    param_dtype = torch.bfloat16 if bf16 else torch.float32
    transient = step_transient_bytes(args, param_dtype)
    implied = implied_peak_bytes(models["floor"], transient, args, param_dtype)
    if rank == 0:
        result = {
            "args": vars(args),
            "step_time_s": {k: statistics.median(v) for k, v in slowest.items()},
            "phase_s": slowest_phases,
            "peak_memory_bytes": peak,
            "implied_peak_bytes": implied,
            "comm_bytes": comm_bytes,
            "fsdp2_exposed_comm_s": exposed.item(),
            "theoretical_comm_bytes": expected,
            "final_loss": {k: v[-1] for k, v in losses.items()},
            "budget_ms": budgets,
        }
        with open(result_path, "w") as f:
            json.dump(result, f)
    gc.collect()
    dist.destroy_process_group()


# Steps whose peak is measured; the least is reported. On gloo a tensor can
# outlive its last use by a moment another thread decides (the tiny model of
# test_bench saw 17 KiB of temporaries more in 1 of 40 steps of fsdp2 and 2-4
# of 40 of torch's fully_shard, with the other core busy), so one step's peak
# compared two FSDPs' luck; the least of a few is the step's own.
PEAK_STEPS = 3


def peak_memory(train_step, name: str, model: nn.Module, optim) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    peaks = []
    for _ in range(PEAK_STEPS):
        tracker = MemTracker()
        tracker.track_external(model, optim)
        with tracker:
            train_step(name, 0)
        snapshot = tracker.get_tracker_snapshot("peak")
        peaks.append(int(sum(per_device["Total"] for per_device in snapshot.values())))
    return min(peaks)


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    times, peak = result["step_time_s"], result["peak_memory_bytes"]
    comm, expected = result["comm_bytes"], result["theoretical_comm_bytes"]
    a = result["args"]
    table = Table(
        title=f"{a['world_size']} gloo ranks, transformer dim {a['dim']} x {a['layers']} layers, "
        f"batch {a['batch']}x{a['seq']} per rank, {a['steps']} interleaved steps, "
        f"mp {a['mp']}, prefetch {a['prefetch']}, reshard after forward {a['reshard_after_forward']}, "
        f"AdamW foreach {a['foreach']}"
    )
    for col in (
        "contender",
        "step (ms)",
        "/ torch",
        "/ DDP",
        "/ floor",
        "peak MiB",
        "/ torch",
        "AG MiB",
        "RS MiB",
    ):
        table.add_column(col, justify="right")
    for name in times:  # the run's contenders, in order
        row_comm = comm.get(name, {})
        table.add_row(
            name,
            f"{1e3 * times[name]:.1f}",
            f"{times[name] / times['torch']:.3f}",
            f"{times[name] / times['ddp']:.3f}",
            f"{times[name] / times['floor']:.3f}",
            f"{peak[name] / 2**20:.1f}",
            f"{peak[name] / peak['torch']:.3f}",
            f"{row_comm.get('all_gather_single', 0) / 2**20:.2f}" if row_comm else "-",
            f"{row_comm.get('reduce_scatter_single', 0) / 2**20:.2f}" if row_comm else "-",
        )
    console = Console(width=120)
    console.print(table)
    console.print(phase_table(result))
    implied = result["implied_peak_bytes"]
    console.print(
        f"peak memory implied by the sizes: {implied / 2**20:.1f} MiB; fsdp2 / implied = "
        f"{peak['fsdp2'] / implied:.3f}, torch / implied = {peak['torch'] / implied:.3f}"
    )
    exposed_ms = 1e3 * result["fsdp2_exposed_comm_s"]
    console.print(
        f"fsdp2 exposed communication (median per step, slowest rank): {exposed_ms:.1f} ms "
        f"= {exposed_ms / (1e3 * times['fsdp2']):.1%} of its step"
    )
    console.print(
        f"theoretical per step (unpadded): all-gather "
        f"{expected['all_gather_single'] / 2**20:.2f} MiB, reduce-scatter "
        f"{expected['reduce_scatter_single'] / 2**20:.2f} MiB"
    )


def phase_table(result: dict):
    """Where each contender's step goes, from clocks read around its phases
    (no profiler): per column, the median over steps of the slowest rank's
    value; the CPU time is the rank's process's, on its training thread and
    on its other threads."""
    from rich.table import Table

    phases, floor = result["phase_s"], result["phase_s"]["floor"]
    table = Table(
        title="where a step goes, without a profiler (ms, median per step of the slowest "
        "rank in each column; in brackets: above the floor's)"
    )
    for col in (
        "contender",
        "forward+loss",
        "backward",
        "optimizer",
        "CPU: training thread",
        "CPU: other threads",
    ):
        table.add_column(col, justify="right")
    for name, ph in phases.items():
        table.add_row(
            name,
            *(
                f"{1e3 * ph[k]:.1f}"
                + ("" if name == "floor" else f" ({1e3 * (ph[k] - floor[k]):+.1f})")
                for k in PhaseClock.COLUMNS
            ),
        )
    return table


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.optim == "muon":
        import bench_muon

        bench_muon.main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(
            worker,
            args=(args, os.path.join(tmp, "store"), result_path),
            nprocs=args.world_size,
            join=True,
        )
        with open(result_path) as f:
            result = json.load(f)
    report(result)
    if result["budget_ms"]:
        print_budget(
            result["budget_ms"],
            f"where a step goes: {args.profile_steps} profiled steps, the slowest rank of each "
            "(profiling slows every row)",
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
