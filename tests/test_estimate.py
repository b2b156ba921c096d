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
from dist import run_ranks
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402
import llama  # noqa: E402

import fsdp2  # noqa: E402
import fsdp2.primitives  # noqa: E402

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
    sent = {"all_gather_single": 0, "reduce_scatter_single": 0}
    originals = {name: getattr(fsdp2.primitives, name) for name in sent}

    def counting(name):
        def collective(output, input, *args, **kwargs):
            big = output if name == "all_gather_single" else input
            sent[name] += big.numel() * big.element_size()
            return originals[name](output, input, *args, **kwargs)

        return collective

    for name in sent:
        setattr(fsdp2.primitives, name, counting(name))
    tracker = MemTracker()
    tracker.track_external(model, optim)
    try:
        with tracker:
            step()
    finally:
        for name, original in originals.items():
            setattr(fsdp2.primitives, name, original)
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
    assert predicted.all_gather_bytes == measured["all_gather_single"]
    assert predicted.reduce_scatter_bytes == measured["reduce_scatter_single"]
    ratio = predicted.peak_bytes / measured["peak"]
    assert abs(ratio - 1) <= 0.05, f"estimated {predicted.peak_bytes}, measured {measured['peak']}"
