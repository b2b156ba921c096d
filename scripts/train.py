"""Demo training job: a small Llama-style model learns the King James Genesis
byte by byte, sharded with fsdp2.

    make demo                                    # 2 CPU ranks on gloo, about two minutes
    python scripts/train.py --nproc 2            # the same without make (spawns its ranks)
    torchrun --nproc-per-node 8 scripts/train.py --device cuda --bf16
    torchrun --nproc-per-node 8 scripts/train.py --device cuda --bf16 --compile
    torchrun --nnodes 2 --nproc-per-node 8 ... scripts/train.py --replicate 2   # HSDP
    python scripts/train.py --resume --run-dir runs/20260101-120000 --steps 600

Every transformer block is its own ``fully_shard`` group and the root holds
the embeddings, final norm and head; the model is built on the meta device and
only this rank's shards are ever allocated. AdamW with warm-up and cosine
decay, optional bf16 compute (``--bf16``), gradient accumulation without
gradient sync on all but the last micro-batch (``--grad-accum``) and
``torch.compile`` of each block before it is sharded (``--compile``); HSDP
with ``--replicate R`` (R replicas, each sharded over world size / R ranks).

The run folder (``--run-dir``, default ``runs/<timestamp>``) receives
``config.json``, ``metrics.jsonl`` (one line per step), ``loss.png``,
``sample.txt`` and ``checkpoints/step_NNNNNN/`` (torch.distributed.checkpoint,
loadable at any world size and mesh). A checkpoint is written as
``step_NNNNNN.partial/`` and renamed once every rank has written its part, so a
run killed mid-save leaves the previous one complete (step_checkpoints.py).
``--resume`` continues from the latest complete checkpoint (removing unfinished
ones) with the same losses as an uninterrupted run: the batch of step ``s`` is
a function of ``(seed, s)`` alone, and each rank takes its slice of it.

Without torchrun the script spawns ``--nproc`` ranks itself (a ``file://``
store, no ports); under torchrun it uses the ``env://`` variables torchrun sets.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2

# For `llama` and `step_checkpoints` when this file is imported by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_checkpoints  # noqa: E402
from llama import Llama, LlamaConfig, init_weights  # noqa: E402
from step_checkpoints import latest_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "data" / "kjv.txt"

# Saved in config.json. On --resume, any of them not given on the command line
# is taken from the run; the model-shape ones must match the checkpoint.
SHAPE_KEYS = ("dim", "layers", "heads", "ffn_dim", "tie_embeddings", "seq_len")
RUN_KEYS = (
    *SHAPE_KEYS,
    *("data", "global_batch", "grad_accum", "seed", "steps", "lr", "min_lr_ratio", "warmup"),
    *("weight_decay", "max_grad_norm", "bf16", "ckpt_every"),
    *("compress_weights", "compress_grads", "compress_block_size"),
)


# -- arguments ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    launch = p.add_argument_group("launch")
    launch.add_argument(
        "--nproc",
        type=int,
        help="ranks to spawn when not under torchrun (default: 2 on cpu, every GPU on cuda)",
    )
    launch.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    launch.add_argument(
        "--threads", type=int, default=1, help="torch threads per CPU rank (default: 1)"
    )
    launch.add_argument("--timeout", type=float, default=300, help="process group timeout, seconds")
    launch.add_argument(
        "--replicate",
        type=int,
        default=1,
        metavar="R",
        help="HSDP: R replicas of the model, each sharded over world size / R ranks; the "
        "all-gathers stay inside a replica (default: 1, every rank shards one copy)",
    )

    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=128)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--ffn-dim", type=int, help="SwiGLU hidden size (default: ~8/3 dim)")
    model.add_argument(
        "--tie-embeddings", action="store_true", help="output head shares the token embedding"
    )

    train = p.add_argument_group("training")
    train.add_argument("--data", default=str(DEFAULT_DATA), help="a text file, read as bytes")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--seq-len", type=int, default=128)
    train.add_argument(
        "--global-batch",
        type=int,
        default=16,
        help="sequences per step over all ranks; must divide by world size x --grad-accum",
    )
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    train.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    train.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    train.add_argument(
        "--bf16", action="store_true", help="compute in bf16, reduce gradients in fp32"
    )
    train.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile each block before fully_shard, with this backend (default when "
        "given: inductor; aot_eager compiles faster). The first step includes compiling; "
        "sampling runs eagerly",
    )
    train.add_argument("--seed", type=int, default=0, help="model init, data order, sampling")
    train.add_argument(
        "--compress-weights",
        choices=("int8",),
        help="all-gather the weights as blockwise int8 (fsdp2.CompressionPolicy(weights=...))",
    )
    train.add_argument(
        "--compress-grads",
        choices=("bf16", "int8"),
        help="reduce gradients as bf16 or blockwise int8, summed in fp32 (gradients=...)",
    )
    train.add_argument(
        "--compress-block-size", type=int, default=256, help="values per int8 block (one scale)"
    )

    run = p.add_argument_group("run folder")
    run.add_argument("--run-dir", help="default: runs/<timestamp>")
    run.add_argument("--ckpt-every", type=int, default=100, help="0: only at the end")
    run.add_argument(
        "--resume", action="store_true", help="continue from the run dir's latest checkpoint"
    )
    run.add_argument("--log-every", type=int, default=25, help="print a line every N steps")

    sample = p.add_argument_group("sample")
    sample.add_argument("--prompt", default="And God said")
    sample.add_argument("--sample-tokens", type=int, default=200, help="0: no sample")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks everything a run needs before any process group
    starts; a mistake exits with status 2 and a message saying what to change."""
    p = build_parser()
    args = p.parse_args(argv)
    explicit = _explicit_dests(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(
            "--device cuda: CUDA is not available here (a CPU build of torch?); use --device cpu"
        )
    args.world_size = _world_size(args, p)
    if args.resume:
        _merge_saved_config(args, explicit, p)
    elif args.run_dir is None and not launched_by_torchrun():
        args.run_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        # Under torchrun rank 0 picks the name and tells the others (see Trainer).
    elif args.run_dir is not None and latest_checkpoint(Path(args.run_dir)) is not None:
        p.error(
            f"--run-dir {args.run_dir} already holds checkpoints: add --resume to continue "
            "that run, or choose another --run-dir"
        )

    for name in (
        *("steps", "seq_len", "global_batch", "grad_accum", "threads", "dim", "layers"),
        *("log_every", "replicate"),
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("ckpt_every", "warmup", "sample_tokens", "weight_decay", "max_grad_norm"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    try:
        model_config(args)
    except ValueError as e:
        p.error(f"--dim {args.dim} / --heads {args.heads}: {e}")
    if args.world_size % args.replicate:
        p.error(
            f"--replicate {args.replicate} does not divide world size {args.world_size}: "
            "every replica shards the model over the same number of ranks"
        )
    per_step = args.world_size * args.grad_accum
    if args.global_batch % per_step:
        up = per_step * math.ceil(args.global_batch / per_step)
        p.error(
            f"--global-batch {args.global_batch} does not divide by world size "
            f"{args.world_size} x --grad-accum {args.grad_accum} = {per_step}: every rank takes "
            f"an equal slice of each step's batch and splits it into equal micro-batches. "
            f"Use a multiple of {per_step}, e.g. --global-batch {up}."
        )
    data = Path(args.data)
    if not data.is_file():
        p.error(f"--data {data}: no such file")
    if data.stat().st_size < args.seq_len + 2:
        p.error(f"--data {data} has {data.stat().st_size} bytes, fewer than --seq-len + 2")
    if not args.prompt:
        p.error("--prompt must not be empty")
    return args


def _explicit_dests(argv: list[str] | None) -> set[str]:
    """The options given on the command line (not left at their defaults)."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _world_size(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if launched_by_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world_size:
            p.error(
                f"--nproc {args.nproc} under torchrun, which started {world_size} ranks: "
                "drop --nproc (torchrun's --nproc-per-node and --nnodes decide)"
            )
        local_rank = int(os.environ["LOCAL_RANK"])
        if args.device == "cuda" and local_rank >= torch.cuda.device_count():
            p.error(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs: lower "
                "torchrun's --nproc-per-node"
            )
        return world_size
    if args.nproc is None:
        return torch.cuda.device_count() if args.device == "cuda" else 2
    if args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        p.error(
            f"--nproc {args.nproc} with --device cuda but only {torch.cuda.device_count()} GPUs; "
            "for several nodes use torchrun"
        )
    return args.nproc


def _merge_saved_config(
    args: argparse.Namespace, explicit: set[str], p: argparse.ArgumentParser
) -> None:
    if args.run_dir is None:
        p.error("--resume needs --run-dir, the run folder to continue (e.g. runs/20260101-120000)")
    run_dir = Path(args.run_dir)
    if latest_checkpoint(run_dir) is None:
        unfinished = step_checkpoints.partial_checkpoints(run_dir)
        p.error(
            f"--resume: no complete checkpoint in {run_dir / 'checkpoints'} (a complete one "
            "is a step_NNNNNN folder with a .metadata file"
            + (f"; {', '.join(f.name for f in unfinished)} did not finish" if unfinished else "")
            + "). Check --run-dir, or drop --resume to start a new run."
        )
    config_file = run_dir / "config.json"
    saved = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for key in RUN_KEYS:
        if key not in saved:
            continue
        if key not in explicit:
            setattr(args, key, saved[key])
        elif key in SHAPE_KEYS and getattr(args, key) != saved[key]:
            flag = "--" + key.replace("_", "-")
            p.error(
                f"--resume: {flag} {getattr(args, key)} but the checkpoints in {run_dir} have "
                f"{flag} {saved[key]}; drop {flag} to use the run's value"
            )


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_dim=args.ffn_dim,
        max_seq_len=args.seq_len,
        tie_embeddings=args.tie_embeddings,
    )


# -- launching ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if launched_by_torchrun():
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        run(args, rank, local_rank, init_method="env://")
        return
    with tempfile.TemporaryDirectory(prefix="fsdp2-demo-") as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        if args.world_size == 1:
            threads = torch.get_num_threads()
            try:
                run(args, 0, 0, init_method=store)
            finally:
                torch.set_num_threads(threads)
        else:
            # On CPU the ranks are forked: they inherit the imported modules instead of
            # importing torch again (seconds each on a small machine). As a script this
            # process has run no torch op and started no process group by now; like
            # DataLoader workers, each rank sets its own thread count. CUDA is spawned.
            start_method = "spawn" if args.device == "cuda" else "fork"
            mp.start_processes(
                _spawned_rank, args=(args, store), nprocs=args.world_size, start_method=start_method
            )


def _spawned_rank(rank: int, args: argparse.Namespace, store: str) -> None:
    run(args, rank, rank, init_method=store)


def run(args: argparse.Namespace, rank: int, local_rank: int, init_method: str) -> None:
    """One rank: starts the process group, trains, and tears it down."""
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        Trainer(args, device).train()
    finally:
        gc.collect()  # gloo threads may still hold tensors: see STYLE.md
        dist.destroy_process_group()


# -- data, schedule, memory ---------------------------------------------------


class Corpus:
    """Byte-level tokens (vocabulary 256) of a text file, sampled as windows.

    The global batch of step ``s`` is a function of ``(seed, s)`` only, so a
    resumed run sees the batches an uninterrupted one would, and at any world
    size: rank ``r`` of ``W`` takes rows ``[r * B/W, (r + 1) * B/W)``.
    """

    def __init__(self, path: Path, seq_len: int, global_batch: int, seed: int) -> None:
        self.tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed

    def batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each (global_batch / world_size, seq_len) int64."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        last_start = self.tokens.numel() - self.seq_len - 1
        starts = torch.randint(0, last_start + 1, (self.global_batch,), generator=generator)
        rows = self.global_batch // world_size
        starts = starts[rank * rows : (rank + 1) * rows]
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for step ``step`` (0-based): linear warm-up, then
    cosine decay to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated tensor memory. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def comm_bytes(steps: list[dict[str, fsdp2.comm.stats.GroupStats]]) -> dict[str, int]:
    """Bytes of fsdp2's all-gathers, reduce-scatters and all-reduces, summed over groups."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    return {
        kind: sum(group.of(kind).bytes for step in steps for group in step.values())
        for kind in kinds
    }


def exposed_comm_seconds(steps: list[dict[str, fsdp2.comm.stats.GroupStats]]) -> float:
    """Time the training thread waited for fsdp2 collectives, summed over groups."""
    return sum(
        group.all_gather.wait_seconds + group.reduce_scatter.wait_seconds
        for step in steps
        for group in step.values()
    )


# -- run folder -----------------------------------------------------------------


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [m["loss"] for m in metrics], color="tab:blue", linewidth=1, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)", color="tab:blue")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [m["lr"] for m in metrics], color="tab:orange", linewidth=1, alpha=0.7)
    lr_ax.set_ylabel("learning rate", color="tab:orange")
    ax.set_title("fsdp2 demo: byte-level Llama on KJV Genesis")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# -- training ---------------------------------------------------------------------


class Trainer:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_main = self.rank == 0
        self.run_dir = Path(self._agree_on_run_dir(args.run_dir))
        self.corpus = Corpus(Path(args.data), args.seq_len, args.global_batch, args.seed)
        self.mesh = self._build_mesh(args.replicate)
        self.model = self._build_model(self.mesh)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]  # norm weights
        self.optim = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=args.weight_decay,
        )
        schedule = partial(
            lr_factor, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optim, schedule)
        self.step = 0  # optimizer steps done
        self.console = None
        if self.is_main:
            from rich.console import Console

            self.console = Console()
            if not self.console.is_terminal:
                self.console = Console(width=160)  # logs and pipes: one line per step record

    def _agree_on_run_dir(self, run_dir: str | None) -> str:
        if run_dir is None:  # under torchrun: rank 0's clock names it
            name = [str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))]
            dist.broadcast_object_list(name, src=0)
            run_dir = name[0]
        return run_dir

    def _build_mesh(self, replicate: int) -> DeviceMesh:
        """1D: every rank shards the model. 2D (HSDP): ``replicate`` copies, each
        sharded over world size / replicate ranks (consecutive ranks: one node)."""
        if replicate == 1:
            return init_device_mesh(self.device.type, (self.world_size,))
        return init_device_mesh(
            self.device.type,
            (replicate, self.world_size // replicate),
            mesh_dim_names=("replicate", "shard"),
        )

    def _build_model(self, mesh: DeviceMesh) -> Llama:
        """Meta-device construction, per-block groups plus the root, then this rank's
        shards allocated and initialised (parameters and rotary buffers)."""
        with torch.device("meta"):
            model = Llama(model_config(self.args))
        mp_policy = fsdp2.MixedPrecisionPolicy()
        if self.args.bf16:
            mp_policy = fsdp2.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        compression = fsdp2.CompressionPolicy(
            weights=self.args.compress_weights,
            gradients=self.args.compress_grads,
            block_size=self.args.compress_block_size,
        )
        for block in model.layers:
            if self.args.compile:
                # torchtitan's order: each block's forward becomes one graph;
                # fsdp2's hooks run eagerly around it.
                block.compile(backend=self.args.compile)
            fsdp2.fully_shard(block, mesh=mesh, mp_policy=mp_policy, compression=compression)
        fsdp2.fully_shard(model, mesh=mesh, mp_policy=mp_policy, compression=compression)
        model.to_empty(device=self.device)
        init_weights(model, self.args.seed)  # also recomputes the non-persistent rotary tables
        fsdp2.register_fsdp_forward_method(model, "generate")
        return model

    # -- checkpoints --

    def _trainer_state(self) -> dict[str, Any]:
        """Everything but model and optimizer that an exact resume needs. The data
        position is the step (batches are a function of it); RNG states are
        gathered from every rank so all ranks save the same object."""
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        local_rng = (
            torch.get_rng_state().numpy().tobytes(),
            cuda_rng.numpy().tobytes() if cuda_rng is not None else b"",
        )
        rng: list[Any] = [None] * self.world_size
        dist.all_gather_object(rng, local_rng)
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "data": {"seed": self.args.seed, "global_batch": self.args.global_batch},
            "rng": rng,  # a list of tuples: one leaf for DCP, whatever the world size
        }

    def _checkpoint_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "trainer": self._trainer_state()}

    def save_checkpoint(self) -> Path:
        return step_checkpoints.save(self._checkpoint_state(), self.run_dir, self.step)

    def load_checkpoint(self, path: Path) -> None:
        state = self._checkpoint_state()  # the template dcp.load fills in place
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        trainer = state["trainer"]
        self.step = trainer["step"]
        self.scheduler.load_state_dict(trainer["scheduler"])
        saved_batch = trainer["data"]["global_batch"]
        if saved_batch != self.args.global_batch and self.is_main:
            self._print(
                f"[yellow]note: --global-batch {self.args.global_batch} differs from the "
                f"checkpoint's {saved_batch}; batches from here on differ from the original run"
            )
        # A rank that did not exist when saving (resuming at a larger world size)
        # borrows a saved state; nothing in training draws from these generators.
        cpu_rng, cuda_rng = trainer["rng"][self.rank % len(trainer["rng"])]
        torch.set_rng_state(torch.frombuffer(bytearray(cpu_rng), dtype=torch.uint8))
        if cuda_rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(
                torch.frombuffer(bytearray(cuda_rng), dtype=torch.uint8), self.device
            )
        self.optim.zero_grad(set_to_none=True)

    # -- output (rank 0) --

    def _print(self, *objects: Any) -> None:
        if self.console is not None:
            self.console.print(*objects)

    def _prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The settings of the latest start: a later --resume defaults to them.
        config = {key: getattr(self.args, key) for key in RUN_KEYS}
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # -- the loop --

    def train(self) -> None:
        args = self.args
        resume_from = [None]
        if self.is_main:
            self._prepare_run_dir()
            resume_from = [latest_checkpoint(self.run_dir) if args.resume else None]
            for folder in step_checkpoints.remove_partial(self.run_dir):
                self._print(f"[yellow]removed {folder}[/]: a save that did not finish")
        # Rank 0 picks the checkpoint for all (a shared file system may lag on
        # some nodes); the broadcast also orders every write after the mkdir
        # and the removal of unfinished saves.
        dist.broadcast_object_list(resume_from, src=0)
        self._print_header()
        fsdp2.summary(self.model)  # prints on rank 0 only
        if resume_from[0] is not None:
            self.load_checkpoint(resume_from[0])
            self._print(f"resumed from {resume_from[0]} (step {self.step})")
            if self.step >= args.steps:
                self._print(f"nothing to train: raise --steps above {self.step} to continue")

        metrics_file = self.run_dir / "metrics.jsonl"
        if self.is_main:  # drop steps an interrupted run logged after its last checkpoint
            kept = [m for m in read_metrics(metrics_file) if m["step"] <= self.step]
            metrics_file.write_text("".join(json.dumps(m) + "\n" for m in kept))

        start = time.perf_counter()
        start_step = self.step
        with fsdp2.comm_stats(self.model) as stats, self._progress() as progress:
            task = progress.add_task("train", total=args.steps, completed=self.step, metrics="")
            while self.step < args.steps:
                record = self.train_step(stats)
                if self.is_main:
                    with metrics_file.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    progress.update(task, completed=self.step, metrics=self._brief(record))
                    if self.step % args.log_every == 0 or self.step == args.steps:
                        progress.console.print(self._log_line(record))
                last = self.step == args.steps
                if (args.ckpt_every and self.step % args.ckpt_every == 0) or last:
                    path = self.save_checkpoint()
                    if self.is_main:
                        progress.console.print(f"[dim]checkpoint: {path}")
        elapsed = time.perf_counter() - start

        sample = self._sample()
        if self.is_main:
            self._finish(sample, elapsed, self.step - start_step)

    def train_step(self, stats: fsdp2.CommStats) -> dict[str, Any]:
        args = self.args
        start = time.perf_counter()
        waits_before = len(stats.steps)
        inputs, targets = self.corpus.batch(self.step, self.rank, self.world_size)
        micro_inputs = inputs.to(self.device).chunk(args.grad_accum)
        micro_targets = targets.to(self.device).chunk(args.grad_accum)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(micro_inputs, micro_targets, strict=True)):
            # Reduce-scatter only after the last micro-batch; before it, gradients
            # accumulate unsharded and locally.
            self.model.set_requires_gradient_sync(i == args.grad_accum - 1)
            logits = self.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = float("nan")
        if args.max_grad_norm > 0:
            # fsdp2's: a plain tensor, and right also for gradients on several meshes.
            grad_norm = float(fsdp2.clip_grad_norm_(self.model.parameters(), args.max_grad_norm))
        lr = self.optim.param_groups[0]["lr"]
        self.optim.step()
        self.scheduler.step()
        self.optim.zero_grad(set_to_none=True)
        self.step += 1
        step_time = time.perf_counter() - start

        step_stats = stats.steps[waits_before:]
        exposed = exposed_comm_seconds(step_stats)
        local = torch.tensor(
            [loss_sum.item(), step_time, exposed, peak_memory_bytes(self.device)],
            dtype=torch.float64,
            device=self.device,
        )
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        per_rank = torch.stack(gathered).cpu()  # (world_size, 4)
        slowest = per_rank[:, 1].max().item()
        return {
            "step": self.step,
            # Each rank's loss is the mean over its equal share of the batch.
            "loss": per_rank[:, 0].mean().item(),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": args.global_batch * args.seq_len / slowest,
            "step_time_s": slowest,
            "exposed_comm_s": per_rank[:, 2].max().item(),
            "exposed_comm_s_per_rank": per_rank[:, 2].tolist(),
            # This rank's bytes of the step's collectives (comm_stats' definition).
            "comm_bytes": comm_bytes(step_stats),
            "memory_bytes_per_rank": [int(m) for m in per_rank[:, 3].tolist()],
        }

    def _sample(self) -> str | None:
        """Generates on every rank (each forward all-gathers); the same seed and the
        same logits give the same text everywhere."""
        if not self.args.sample_tokens:
            return None
        prompt = torch.tensor([list(self.args.prompt.encode())], device=self.device)
        generator = torch.Generator().manual_seed(self.args.seed)
        # no_grad: every group, root included, reshards right after each forward.
        # force_eager: under --compile, each new context length would compile the blocks again.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            tokens = self.model.generate(
                prompt,
                self.args.sample_tokens,
                temperature=self.args.temperature,
                generator=generator,
            )
        text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
        # An undertrained model can emit control bytes: keep them off the terminal.
        return "".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in text)

    # -- rank 0's display --

    def _progress(self):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        return Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=self.console,
            # A live bar needs a terminal; elsewhere the log lines carry the progress.
            disable=self.console is None or not self.console.is_terminal,
        )

    def _print_header(self) -> None:
        args = self.args
        n_params = sum(p.numel() for p in self.model.parameters())
        r = args.replicate
        hsdp = f" (HSDP: {r} replicas x {self.world_size // r} shards)" if r > 1 else ""
        self._print(
            f"[bold]fsdp2 demo[/]: Llama {args.layers}x{args.dim} ({args.heads} heads, "
            f"{n_params / 1e6:.2f}M params{', tied head' if args.tie_embeddings else ''}) on "
            f"{Path(args.data).name} ({self.corpus.tokens.numel():,} bytes), "
            f"{self.world_size} x {self.device.type} ranks{hsdp}, "
            f"{args.global_batch} x {args.seq_len} tokens per step"
            f"{f' in {args.grad_accum} micro-batches' if args.grad_accum > 1 else ''}, "
            f"{'bf16' if args.bf16 else 'fp32'}, "
            f"{f'blocks compiled ({args.compile}), ' if args.compile else ''}{args.steps} steps\n"
            f"run folder: {self.run_dir}"
        )

    @staticmethod
    def _brief(record: dict[str, Any]) -> str:
        memory = "/".join(f"{m / 2**20:.0f}" for m in record["memory_bytes_per_rank"])
        return (
            f"loss {record['loss']:.3f}  {record['tokens_per_s'] / 1e3:.1f}k tok/s  "
            f"{record['step_time_s'] * 1e3:.0f} ms/step  "
            f"comm {record['exposed_comm_s'] * 1e3:.0f} ms  mem {memory} MiB"
        )

    def _log_line(self, record: dict[str, Any]) -> str:
        return f"step {record['step']:>5}  lr {record['lr']:.2e}  {self._brief(record)}"

    def _finish(self, sample: str | None, elapsed: float, steps_run: int) -> None:
        from rich.panel import Panel

        metrics = read_metrics(self.run_dir / "metrics.jsonl")
        outputs = ["metrics.jsonl"]
        try:
            plot_loss(metrics, self.run_dir / "loss.png")
            outputs.append("loss.png")
        except ImportError:
            self._print("[yellow]no loss.png: matplotlib is missing (pip install -e '.[demo]')")
        if sample is not None:
            (self.run_dir / "sample.txt").write_text(sample + "\n")
            outputs.append("sample.txt")
            self._print(Panel(sample, title=f"sample (temperature {self.args.temperature})"))
        where = f"Output: {self.run_dir}/ ({', '.join(outputs)}, checkpoints/)"
        if not metrics:
            self._print(f"[bold green]done[/]. {where}")
            return
        first, last = metrics[0], metrics[-1]
        tail = metrics[-10:]
        tail_loss = sum(m["loss"] for m in tail) / len(tail)
        peak = max(max(m["memory_bytes_per_rank"]) for m in metrics)
        self._print(
            f"[bold green]done[/]: final loss {last['loss']:.3f} at step {last['step']} "
            f"(mean of the last {len(tail)}: {tail_loss:.3f}; {first['loss']:.3f} at step "
            f"{first['step']}), {steps_run} steps in {elapsed:.0f} s, peak memory "
            f"{_human_bytes(peak)} per rank. {where}"
        )


if __name__ == "__main__":
    main()
