"""One command for a GPU (``make gpu-check``): the accelerator path, proved and measured.

Made for a machine with ONE GPU (a few minutes in all): at world size 1 the
engine is told to issue its collectives all the same
(``fsdp2.api.check_switches.force_one_rank_collectives``, a switch for checks), so the comm streams, the events, the copy-in stream,
NCCL's ``AVG``, the CPU-offload copies and an HSDP (1, 1) all-reduce run (a
one-rank communicator copies rather than runs kernels). With 2 GPUs or more
it also runs at that world size. Each world, in this order:

- the backend's reductions against the arithmetic (NCCL's one-rank
  ``PREMUL_SUM``, which fsdp2 does not use, shown apart);
- step time against torch's ``fully_shard`` (both models on the device,
  steps interleaved) and peak memory (``torch.cuda.max_memory_allocated``,
  each alone) on a 0.5 B Llama: fp32, bf16 with fp32 reduction, CPU offload;
- from a bf16 ``torch.profiler`` trace: communication time per step (what
  the collectives' host ops launched), the part of it no other kernel
  overlaps (exposed), and how long other kernels ran;
- parity on a small Llama (scripts/llama.py) after a few SGD steps, against
  torch's ``fully_shard`` and the unsharded model: fp32, bf16 (``param_dtype``
  bf16, ``reduce_dtype`` fp32), activation checkpointing, blocks compiled
  (inductor; eager in the rehearsal), HSDP averaged and with a divide factor,
  CPU offload and int8 compression (against the unsharded model only); and
  the collectives fsdp2 issued
  (``comm_stats``): none may be skipped;
- torch's clipping as ``install_as_torch_fsdp()`` routes it: its total norm
  bit for bit torch's own on the same DTensor gradients (fp32 and bf16);
- all of that parity training under torch's CUDA sanitizer
  (``torch.cuda._sanitizer``): its reports of unsynchronized accesses between
  streams, 0 expected; then a deliberate race (the all-gather's wait
  skipped), which must be reported. The sanitizer comes last: once made, its
  callbacks run on every allocation and event of the process.

Then torch's fake process group at world size 8: both run, shards shaped alike.
One table at the end, also written as JSON under runs/. On a machine with its
own torch and no package index: ``make gpu-check PY=python3``.

``--rehearse`` runs the same code on CPU (gloo for NCCL, world sizes 1 forced
and 2, a smaller Llama, and tests/stream_model.py's model of streams in place of
CUDA streams and of the sanitizer), so every line has run before it meets a
GPU (tests/test_gpu_check.py runs it). Without CUDA and without ``--rehearse``
it prints one line saying why and exits 0. ``--parity-only``: the arithmetic
and parity rows alone.
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
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from llama import Llama, LlamaConfig  # noqa: E402

import fsdp2  # noqa: E402
from fsdp2.api.check_switches import force_one_rank_collectives  # noqa: E402
from fsdp2.base.private_dist import premul_sum  # noqa: E402
from fsdp2.comm.context import InFlight  # noqa: E402
from fsdp2.comm.primitives import collectives_for  # noqa: E402

GPU_CONFIG = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
# Step time, memory and the profile: large enough that kernels, not Python, take the time.
GPU_TIMING_CONFIG = LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, max_seq_len=512)
REHEARSAL_CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=8)
FP32_TOL = 1e-4  # fsdp2 vs torch's fully_shard and vs the unsharded model, fp32


class Setting(NamedTuple):
    """Where the check runs: a GPU, or its rehearsal on CPU."""

    rehearse: bool
    device_type: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    config: LlamaConfig
    timing_config: LlamaConfig
    batch: int
    seq: int
    parity_steps: int
    timed_steps: int
    warmup: int
    parity_only: bool = False  # the arithmetic and parity rows only (a quick rerun)
    compile_backend: str = "inductor"  # "compiled": the rehearsal's is "eager" (no C++ builds)

    @classmethod
    def make(cls, rehearse: bool, parity_only: bool = False) -> Setting:
        if rehearse:
            setting = cls(True, "cpu", "gloo", REHEARSAL_CONFIG, REHEARSAL_CONFIG, 2, 8, 2, 2, 1)
            setting = setting._replace(compile_backend="eager")
        else:
            setting = cls(False, "cuda", "nccl", GPU_CONFIG, GPU_TIMING_CONFIG, 8, 128, 3, 10, 3)
        return setting._replace(parity_only=parity_only)


class Row(NamedTuple):
    name: str
    value: str
    verdict: str  # "ok", "FAIL", or "" (a measurement)


def check(name: str, value: str, good: bool) -> Row:
    return Row(name, value, "ok" if good else "FAIL")


def measured(name: str, value: str) -> Row:
    return Row(name, value, "")


# -- the stream check: CUDA's sanitizer, or the model of streams --------------


class StreamCheck:
    """Unsynchronized accesses between streams in fsdp2's training: on CUDA
    torch's sanitizer, in the rehearsal the model of streams. Both record
    every report and let training go on, so one run shows them all."""

    def __init__(self, setting: Setting) -> None:
        self.model: Any = None
        self.reports: list[str] = []
        if setting.rehearse:
            sys.path.insert(0, str(ROOT / "tests"))
            from stream_model import StreamModel

            self.model = StreamModel()
        self.mode: Any = self.model  # CUDA: the sanitizer, made when first watching

    def _mode(self) -> Any:
        if self.mode is None:
            self.mode = _sanitizer()
        return self.mode

    def plug(self, model: nn.Module) -> nn.Module:
        """Before the first forward: the model of streams runs fsdp2's streams."""
        if self.model is not None:
            self.model.plug_into(model)
        return model

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        before = len(self.model.violations if self.model is not None else _SANITIZER_REPORTS)
        try:
            with self._mode():
                yield
        finally:
            found = self.model.violations if self.model is not None else _SANITIZER_REPORTS
            self.reports += [str(r) for r in found[before:]]


_SANITIZER_REPORTS: list[Any] = []


@functools.cache
def _sanitizer() -> Any:
    """torch's CUDA sanitizer as a dispatch mode, one per process (each one
    made registers trace callbacks for good), that records its reports in
    ``_SANITIZER_REPORTS`` instead of raising at the first."""
    from torch.cuda._sanitizer import CUDASanitizerDispatchMode

    mode = CUDASanitizerDispatchMode()
    launch = mode.event_handler._handle_kernel_launch

    def recording(*args: Any, **kwargs: Any) -> list[Any]:
        _SANITIZER_REPORTS.extend(launch(*args, **kwargs))
        return []

    mode.event_handler._handle_kernel_launch = recording  # type: ignore[method-assign]
    return mode


# -- models and steps ---------------------------------------------------------


def build(
    setting: Setting, device: torch.device, timing: bool = False, checkpointed: bool = False
) -> nn.Module:
    """The Llama; ``checkpointed``: each block's activations recomputed in
    backward (non-reentrant activation checkpointing), fsdp2's hooks around it."""
    torch.manual_seed(0)
    model = Llama(setting.timing_config if timing else setting.config).to(device)
    if checkpointed:
        for block in model.layers:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def shard(model: nn.Module, fully_shard, forced: bool = False, **kwargs) -> nn.Module:
    """``forced``: fsdp2's groups issue their collectives over a world of one."""
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if forced and fully_shard is fsdp2.fully_shard:
        force_one_rank_collectives(model)
    return model


def torch_fully_shard():
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def torch_policies(bf16: bool, offload: bool, pin_memory: bool = True) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict = {}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if offload:
        # torch's pins at fully_shard, which needs an accelerator (not in the rehearsal).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    return kwargs


def fsdp2_policies(bf16: bool, offload: bool) -> dict:
    kwargs: dict = {}
    if bf16:
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if offload:
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy()
    return kwargs


def batch(setting: Setting, step: int, rank: int, device: torch.device, timing: bool = False):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    config = setting.timing_config if timing else setting.config
    seq = config.max_seq_len if timing else setting.seq
    tokens = torch.randint(config.vocab_size, (setting.batch, seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, inputs, targets, scale: float = 1.0
) -> torch.Tensor:
    logits = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    (loss * scale).backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter, gathered on its mesh's device: with CPU offload the
    local shard is on the CPU while the mesh (NCCL) is on the GPU."""
    if not isinstance(param, DTensor):
        return param
    local = param.to_local().to(param.device_mesh.device_type)
    mesh, placements = param.device_mesh, param.placements
    whole = DTensor.from_local(local, mesh, placements, shape=param.shape, stride=param.stride())
    return whole.full_tensor()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (full(p).detach().float() - full(q).detach().float()).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


class World(NamedTuple):
    setting: Setting
    rank: int
    size: int
    device: torch.device
    label: str  # e.g. "x1 forced"
    forced: bool  # fsdp2 issues its collectives at world size 1 too

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reference_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        everyone = [batch(self.setting, step, r, self.device) for r in range(self.size)]
        return torch.cat([i for i, _ in everyone]), torch.cat([t for _, t in everyone])


PARITY_CASES = (
    "fp32",
    "bf16",
    "checkpointed",
    "compiled",
    "HSDP",
    "HSDP, divide factor",
    "CPU offload",
    "int8 compression",
)


def reduction_ops(world: World) -> list[Row]:
    """The reductions fsdp2 asks of the backend, on rank-dependent inputs
    (rank r holds r + 1): each rank's block against the arithmetic, fp32 and
    bf16. On one NCCL rank these take NCCL's one-rank path, whose PREMUL_SUM
    fsdp2 does not use (an H100 showed it drop the factor): shown, not checked."""
    size, rank, device = world.size, world.rank, world.device
    total = size * (size + 1) / 2  # the sum over ranks of r + 1
    used = {"SUM": total, "AVG": total / size, "PREMUL_SUM(1/4)": total / 4}
    unused = {}
    if world.setting.backend != "nccl":  # gloo has neither AVG nor PREMUL_SUM
        used = {"SUM": total}
    elif size == 1:
        unused = {"PREMUL_SUM(1/4)": used.pop("PREMUL_SUM(1/4)")}
    collectives = collectives_for(dist.group.WORLD, device.type)

    def wrong_results(expected: dict[str, float]) -> list[str]:
        wrong = []
        for dtype in (torch.float32, torch.bfloat16):
            for name, want in expected.items():
                op = premul_sum(0.25) if name.startswith("PREMUL") else getattr(dist.ReduceOp, name)
                full = torch.full((size * 4,), rank + 1.0, dtype=dtype, device=device)
                out = torch.empty(4, dtype=dtype, device=device)
                collectives.reduce_scatter(out, full, op=op)
                if not torch.equal(out.float().cpu(), torch.full((4,), want)):
                    wrong.append(f"reduce-scatter {name} {dtype}: {out.tolist()} != {want}")
                both = torch.full((4,), rank + 1.0, dtype=dtype, device=device)
                collectives.all_reduce(both, op=op)
                if not torch.equal(both.float().cpu(), torch.full((4,), want)):
                    wrong.append(f"all-reduce {name} {dtype}: {both.tolist()} != {want}")
        return wrong

    backend, wrong = world.setting.backend, wrong_results(used)
    name = f"{world.label} {backend} {', '.join(used)}: wrong results"
    rows = [check(name, "; ".join(wrong) or "none", not wrong)]
    if unused:
        wrong = wrong_results(unused)
        name = f"{world.label} {backend} {', '.join(unused)} (not used by fsdp2): wrong results"
        rows.append(measured(name, "; ".join(wrong) or "none"))
    return rows


def parity(world: World, streams: StreamCheck, case: str) -> list[Row]:
    """fsdp2 and torch's fully_shard (not with CPU offload) from equal
    parameters, and the unsharded reference on every rank's batch (DDP
    math), after a few SGD steps. "checkpointed": activation checkpointing's
    recompute in backward; "compiled": every block compiled after sharding
    (all three models); "HSDP": mesh (replicas, 1), averaged (AVG on NCCL);
    "HSDP, divide factor": a divide factor of twice the world (PREMUL_SUM on
    NCCL over 2 ranks or more, divided before over one; the reference's loss
    halved); "CPU offload": the offload copies; "int8 compression": weights
    and gradients quantized on the wire (near the reference, not equal)."""
    setting, device, size = world.setting, world.device, world.size
    bf16, offload, hsdp = case == "bf16", case == "CPU offload", case.startswith("HSDP")
    factor = 2.0 * size if case.endswith("divide factor") else None
    checkpointed, compressed = case == "checkpointed", case == "int8 compression"
    mine_kwargs, torch_kwargs = fsdp2_policies(bf16, offload), torch_policies(bf16, False)
    if compressed:
        mine_kwargs["compression"] = fsdp2.CompressionPolicy(weights="int8", gradients="int8")
    if hsdp:
        mesh_shape, names = (size, 1), ("replicate", "shard")
        mesh = dist.device_mesh.init_device_mesh(
            setting.device_type, mesh_shape, mesh_dim_names=names
        )
        mine_kwargs["mesh"] = torch_kwargs["mesh"] = mesh
    mine = shard(
        build(setting, device, checkpointed=checkpointed),
        fsdp2.fully_shard,
        world.forced,
        **mine_kwargs,
    )
    models = {
        "fsdp2": streams.plug(mine),
        "reference": build(setting, device, checkpointed=checkpointed),
    }
    if not offload and not compressed:
        theirs = build(setting, device, checkpointed=checkpointed)
        models["torch"] = shard(theirs, torch_fully_shard(), **torch_kwargs)
    if case == "compiled":
        for model in models.values():
            for block in model.layers:
                block.compile(backend=setting.compile_backend)
    if factor is not None:
        for name in ("fsdp2", "torch"):
            for module in models[name].modules():
                if hasattr(module, "set_gradient_divide_factor"):  # not recursive
                    module.set_gradient_divide_factor(factor)
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    losses: dict[str, list[float]] = {k: [] for k in models}
    with fsdp2.comm_stats(mine) as stats:
        for step in range(setting.parity_steps):
            inputs, targets = batch(setting, step, world.rank, device)
            for name in ("fsdp2", "torch"):
                if name not in models:
                    continue
                with streams.watching() if name == "fsdp2" else contextlib.nullcontext():
                    loss = train_step(models[name], optims[name], inputs, targets)
                dist.all_reduce(loss)
                losses[name].append(loss.item() / size)
            ref, scale = models["reference"], 1.0 if factor is None else size / factor
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
            with autocast:
                loss = train_step(ref, optims["reference"], *world.reference_batch(step), scale)
            losses["reference"].append(loss.item())
    rows = []
    for other in [k for k in models if k != "fsdp2"]:
        what = "unsharded" if other == "reference" else "torch's fully_shard"
        loss_diff = max(abs(a - b) for a, b in zip(losses["fsdp2"], losses[other], strict=True))
        param_diff = max_param_diff(mine, models[other])
        name = f"{world.label} {case}: loss / param diff vs {what}"
        value = f"{loss_diff:.2g} / {param_diff:.2g}"
        if bf16 or compressed:
            rows.append(measured(name, value))
        else:
            rows.append(check(name, value, max(loss_diff, param_diff) < FP32_TOL))
    totals = stats.totals().values()
    # HSDP (replicas, 1) exchanges nothing in its shard groups, unless forced.
    sharding = not hsdp or size == 1 or world.forced
    kinds = (("all_gather", "reduce_scatter") if sharding else ()) + (
        ("all_reduce",) if hsdp else ()
    )
    counts = {k: sum(s.of(k).count for s in totals) for k in kinds}
    rows.append(
        check(
            f"{world.label} {case}: collectives issued",
            ", ".join(f"{k} {n}" for k, n in counts.items()),
            all(counts.values()),
        )
    )
    return rows


def routed_clipping(world: World) -> list[Row]:
    """torch's ``get_total_norm`` as ``install_as_torch_fsdp()`` routes it, against
    torch's own on the same DTensor gradients: the same bits (fp32 and bf16
    gradients; on CUDA the per-gradient norms are a loop, as torch's are)."""
    from fsdp2.optim.torch_clipping import get_total_norm as routed

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        setting = world.setting
        model = shard(build(setting, world.device).to(dtype), fsdp2.fully_shard, world.forced)
        inputs, targets = batch(setting, 0, world.rank, world.device)
        logits = model(inputs)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        ours, theirs = routed(grads).full_tensor(), torch.nn.utils.get_total_norm(grads)
        theirs = theirs.full_tensor() if isinstance(theirs, DTensor) else theirs
        rows.append(
            check(
                f"{world.label} routed clipping's norm, {str(dtype).removeprefix('torch.')} "
                "grads: torch's bits",
                f"{ours.item():.9g} vs {theirs.item():.9g}",
                torch.equal(ours, theirs),
            )
        )
    return rows


def deliberate_race(world: World) -> Row:
    """One wait skipped (the copy-out does not wait for the all-gather): the
    stream check must report it."""
    streams = StreamCheck(world.setting)
    model = streams.plug(shard(build(world.setting, world.device), fsdp2.fully_shard, world.forced))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    original = InFlight._wait

    def skipping(self: InFlight) -> None:
        if not self.label.startswith("all-gather"):
            original(self)

    InFlight._wait = skipping  # type: ignore[method-assign]
    try:
        with streams.watching():
            train_step(model, optim, *batch(world.setting, 0, world.rank, world.device))
    finally:
        InFlight._wait = original  # type: ignore[method-assign]
    world.synchronize()
    name = f"{world.label} deliberate race (all-gather wait skipped): reports"
    return check(name, str(len(streams.reports)), len(streams.reports) > 0)


def trained(world: World, fully_shard, policies: dict) -> tuple[nn.Module, Any]:
    """The timing model sharded, with its optimizer, after the warm-up steps."""
    setting = world.setting
    model = shard(build(setting, world.device, timing=True), fully_shard, world.forced, **policies)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(setting.warmup):
        train_step(model, optim, *batch(setting, step, world.rank, world.device, timing=True))
    return model, optim


def peak_bytes(world: World, fully_shard, policies: dict) -> int | None:
    """Bytes allocated at the peak of one step (CUDA), the model alone on the device."""
    gc.collect()  # the models measured before, and their memory, are gone
    if world.device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    model, optim = trained(world, fully_shard, policies)
    world.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, optim, *batch(world.setting, 0, world.rank, world.device, timing=True))
    return torch.cuda.max_memory_allocated()


def step_seconds(world: World, runs: dict[str, tuple[nn.Module, Any]]) -> dict[str, float]:
    """Median seconds of a step of each model, their steps interleaved (the
    order alternating) so that a machine's drift falls on all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(world.setting.timed_steps):
        order = list(runs) if step % 2 == 0 else list(reversed(runs))
        for name in order:
            model, optim = runs[name]
            inputs = batch(world.setting, step, world.rank, world.device, timing=True)
            world.synchronize()
            start = time.perf_counter()
            train_step(model, optim, *inputs)
            world.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def exposed_communication(trace: Path, steps: int) -> tuple[float, float, float]:
    """Per step: the device time of communication (kernels and copies launched
    inside a c10d collective's host op: a one-rank NCCL communicator copies
    rather than runs kernels), the part of it during which no other kernel
    ran, and the time some other kernel ran (µs); NaN without any (a CPU trace)."""
    events = json.loads(trace.read_text())["traceEvents"]
    collective_ops: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e["name"].startswith(("c10d::", "nccl:")):
            collective_ops.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    from_collective = {
        e["args"]["correlation"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
        and any(start <= e["ts"] <= end for start, end in collective_ops.get(e["tid"], ()))
    }
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm = [
        (e["ts"], e["ts"] + e["dur"])
        for e in device
        if e["args"].get("correlation") in from_collective
    ]
    compute = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in device
        if e["cat"] == "kernel" and e["args"].get("correlation") not in from_collective
    )
    merged: list[list[float]] = []
    for start, end in compute:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in comm)
    covered = sum(
        max(0.0, min(end, c_end) - max(start, c_start))
        for start, end in comm
        for c_start, c_end in merged
    )
    if not total:
        return float("nan"), float("nan"), float("nan")
    busy = sum(end - start for start, end in merged)
    return total / steps, (total - covered) / steps, busy / steps


def profile(world: World, trace: Path) -> Row:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    setting, steps = world.setting, 1 if world.setting.rehearse else 3
    model, optim = trained(world, fsdp2.fully_shard, fsdp2_policies(True, False))
    activities = [ProfilerActivity.CPU]
    if world.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        for step in range(steps):
            train_step(model, optim, *batch(setting, step, world.rank, world.device, timing=True))
        world.synchronize()
    name = f"{world.label} bf16 µs/step: comm, exposed, compute busy ({trace.name})"
    if world.rank != 0:
        return measured(name, "rank 0's")  # only rank 0's rows are kept
    prof.export_chrome_trace(str(trace))
    total, exposed, busy = exposed_communication(trace, steps)
    if total != total:  # NaN
        return measured(name, "n/a: no kernels in a CPU trace")
    return measured(name, f"{total:.0f}, {exposed:.0f}, {busy:.0f}")


def attempt(world: World, name: str, rows: Callable[..., list[Row]], *args: Any) -> list[Row]:
    """``rows(world, *args)``, or one failed row saying what it raised: at world size 1 the
    check goes on (one GPU-machine run shows every failure); with peers a rank
    that went on alone would leave them waiting, so it raises."""
    try:
        return rows(world, *args)
    except Exception as error:
        if world.size > 1:
            raise
        traceback.print_exc()
        return [Row(f"{world.label} {name}", f"raised {type(error).__name__}: {error}", "FAIL")]


def run_world(world: World, trace_dir: Path) -> list[Row]:
    rows = attempt(world, "collectives' arithmetic", reduction_ops)
    if not world.setting.parity_only:
        # Before the sanitizer: its trace callbacks, once made, run on every
        # allocation and event of the process, and would slow the host.
        rows += timings_and_profile(world, trace_dir)
    streams = StreamCheck(world.setting)
    for case in PARITY_CASES:
        rows += attempt(world, case, parity, streams, case)
    rows += attempt(world, "routed clipping", routed_clipping)
    checker = "model of streams" if world.setting.rehearse else "CUDA sanitizer"
    rows.append(
        check(
            f"{world.label} {checker}: reports in fsdp2's training",
            str(len(streams.reports))
            + (f" (first: {streams.reports[0]})" if streams.reports else ""),
            not streams.reports,
        )
    )
    if streams.reports and world.rank == 0:
        reports = trace_dir / f"stream_reports_x{world.size}.txt"
        reports.write_text("\n\n".join(streams.reports))
    if world.size == 1 and not world.setting.parity_only:  # a race must not leave peers waiting
        rows += attempt(world, "deliberate race", lambda world: [deliberate_race(world)])
    return rows


def timings_and_profile(world: World, trace_dir: Path) -> list[Row]:
    rows = []
    for what, bf16, offload in (
        ("fp32", False, False),
        ("bf16 (fp32 reduce)", True, False),
        ("CPU offload", False, True),
    ):
        rows += attempt(world, f"{what} timing", timing, what, bf16, offload)
    trace = trace_dir / f"gpu_check_trace_x{world.size}.json"
    return rows + attempt(world, "profile", lambda world: [profile(world, trace)])


def timing(world: World, what: str, bf16: bool, offload: bool) -> list[Row]:
    """Peak memory of each alone, then step time with both on the device."""
    pin_memory = world.device.type == "cuda"
    policies = {
        "fsdp2": (fsdp2.fully_shard, fsdp2_policies(bf16, offload)),
        "torch": (torch_fully_shard(), torch_policies(bf16, offload, pin_memory)),
    }
    peaks = {name: peak_bytes(world, *how) for name, how in policies.items()}
    gc.collect()
    seconds = step_seconds(world, {name: trained(world, *how) for name, how in policies.items()})
    rows = [
        measured(
            f"{world.label} {what}: step ms, fsdp2 / torch (interleaved)",
            f"{seconds['fsdp2'] * 1e3:.1f} / {seconds['torch'] * 1e3:.1f}",
        )
    ]
    if peaks["fsdp2"] is None or peaks["torch"] is None:
        rows.append(measured(f"{world.label} {what}: peak MiB", "n/a on CPU"))
    else:
        rows.append(
            measured(
                f"{world.label} {what}: peak MiB, fsdp2 / torch",
                f"{peaks['fsdp2'] / 2**20:.1f} / {peaks['torch'] / 2**20:.1f}",
            )
        )
    return rows


def worker(
    rank: int, world_size: int, forced: bool, setting: Setting, store_path: str, out: str
) -> None:
    if setting.device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(setting.backend, store=store, rank=rank, world_size=world_size)
    label = f"x{world_size}" + (" forced" if forced else "")
    try:
        world = World(setting, rank, world_size, device, label, forced)
        rows = run_world(world, Path(out).parent)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def fake_world_of_8(setting: Setting) -> list[Row]:
    """torch's fake process group at world size 8: no data moves, so only that
    both run and shard alike is checked."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        device = torch.device(setting.device_type, 0)
        mine = shard(build(setting, device), fsdp2.fully_shard)
        theirs = shard(build(setting, device), torch_fully_shard())
        for model in (mine, theirs):
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            train_step(model, optim, *batch(setting, 0, 0, device))
        same = all(
            p.to_local().shape == q.to_local().shape
            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True)
        )
    finally:
        dist.destroy_process_group()
    return [check("fake PG x8: a step runs, local shards shaped as torch's", str(same), same)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="on CPU, the same code")
    parser.add_argument("--out", type=Path, default=ROOT / "runs", help="JSON and traces")
    parser.add_argument(
        "--parity-only",
        action="store_true",
        help="the arithmetic and parity rows only: a quick rerun, e.g. under "
        "CUDA_LAUNCH_BLOCKING=1 (every kernel waited for) to tell a race from arithmetic",
    )
    args = parser.parse_args(argv)
    if not args.rehearse and not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False).")
        return 0
    setting = Setting.make(args.rehearse, args.parity_only)
    if args.rehearse:
        worlds, where = [(1, True), (2, False)], "CPU rehearsal (gloo, model of streams)"
    else:
        gpus = min(torch.cuda.device_count(), 8)
        worlds = [(1, True)] + ([(gpus, False)] if gpus > 1 else [])
        where = f"{torch.cuda.get_device_name(0)}, {gpus} GPU(s)"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out / f"gpu_check_{'rehearsal_' if args.rehearse else ''}{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, forced in worlds:
            result = out_dir / f"rows_x{size}.json"
            store = os.path.join(tmp, f"store_x{size}")
            try:
                mp.spawn(
                    worker,
                    args=(size, forced, setting, store, str(result)),
                    nprocs=size,
                    join=True,
                )
                rows += [Row(*r) for r in json.loads(result.read_text())]
            except Exception as error:  # the table still shows the other worlds
                traceback.print_exc()
                rows.append(Row(f"x{size}: the ranks", f"raised: {error}"[-300:], "FAIL"))
    try:
        rows += [] if setting.parity_only else fake_world_of_8(setting)
    except Exception as error:
        traceback.print_exc()
        rows.append(Row("fake PG x8", f"raised {type(error).__name__}: {error}", "FAIL"))
    if args.rehearse:
        rows.append(measured("CUDA sanitizer", "skipped on CPU: the model of streams stood in"))
    seconds = time.perf_counter() - started
    width = max(len(r.name) for r in rows)
    print(f"gpu-check on {where}, torch {torch.__version__}, {seconds:.0f} s")
    print("(ok: checked and passed; FAIL: checked and failed; info: a measurement, no verdict)")
    for row in rows:
        print(f"{row.name:<{width}}  {row.verdict or 'info':<4}  {row.value}")
    table = out_dir / "gpu_check.json"
    summary = {"where": where, "torch": torch.__version__, "seconds": seconds}
    table.write_text(json.dumps({**summary, "rows": [r._asdict() for r in rows]}, indent=1))
    print(f"table: {table}")
    return 1 if any(r.verdict == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
