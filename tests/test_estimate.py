"""The scale simulator, scripts/estimate.py, against real runs at world sizes 2 and 4.

The estimate shards a meta-device model over a fake process group in this
process; the real run trains the same model for one step on gloo ranks and
measures rank 0's peak tensor memory (MemTracker) and the bytes it passes to
the all-gather and reduce-scatter.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist import run_ranks, wrapped_collectives
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402
import llama  # noqa: E402

import fsdp2  # noqa: E402

CONFIG = estimate.PRESETS["small"]
BATCH, SEQ = 4, 64


def _measure(rank: int, world_size: int, out: str) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = llama.Llama(CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()

    step()  # optimizer states exist from here on, as in every later step
    sent = {"all_gather": 0, "reduce_scatter": 0}

    def counting(name):
        def wrap(original):
            def collective(self, output, input, *args, **kwargs):
                big = output if name == "all_gather" else input
                sent[name] += big.numel() * big.element_size()
                return original(self, output, input, *args, **kwargs)

            return collective

        return wrap

    tracker = MemTracker()
    tracker.track_external(model, optim)
    with (
        wrapped_collectives("all_gather", counting("all_gather")),
        wrapped_collectives("reduce_scatter", counting("reduce_scatter")),
        tracker,
    ):
        step()
    peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    if rank == 0:
        Path(out).write_text(json.dumps({"peak": int(peak), **sent}))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_matches_measured(world_size: int, tmp_path: Path) -> None:
    out = tmp_path / "measured.json"
    run_ranks(_measure, world_size, tmp_path, str(out))
    measured = json.loads(out.read_text())
    predicted = estimate.estimate(CONFIG, world_size, BATCH, SEQ)
    assert not dist.is_initialized()  # the fake group is gone again
    # Communication is exact: fsdp2's own padded sizes.
    assert predicted.all_gather_bytes == measured["all_gather"]
    assert predicted.reduce_scatter_bytes == measured["reduce_scatter"]
    ratio = predicted.peak_bytes / measured["peak"]
    assert abs(ratio - 1) <= 0.05, f"estimated {predicted.peak_bytes}, measured {measured['peak']}"


def test_wire_bytes_uncompressed_is_the_estimate() -> None:
    """The compression table's fp32 row counts what ``estimate`` counts (the
    compressed rows are checked against real runs in test_compression_training.py)."""
    groups = estimate.group_shapes(estimate.build_model(CONFIG))
    for world_size in (2, 4):
        predicted = estimate.estimate(CONFIG, world_size, BATCH, SEQ)
        assert estimate.wire_bytes(groups, world_size) == (
            predicted.all_gather_bytes,
            predicted.reduce_scatter_bytes,
        )


def test_compression_grid_prints_each_setting(capsys: pytest.CaptureFixture[str]) -> None:
    estimate.main(["--compression-grid", "--link-gbps", "25"])
    out = capsys.readouterr().out
    for name in ("llama-7b", "llama-70b", "weights int8", "gradients bf16", "both int8", "1024"):
        assert name in out, name
