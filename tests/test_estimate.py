"""The scale simulator, scripts/estimate.py: against real runs at world sizes 2
and 4, against the bench's measured bytes and published parameter counts, and
its traffic model (which link each collective crosses, what HSDP and
``shard_optimizer_over_replicas`` send, what bf16 and activation
checkpointing change).

The real run trains the same model for one step on gloo ranks and measures
rank 0's peak tensor memory (MemTracker) and the bytes it passes to the
all-gather and reduce-scatter.
"""

import dataclasses
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
import bench  # noqa: E402
import estimate  # noqa: E402
import llama  # noqa: E402
from estimator.memory import measure_activations  # noqa: E402

import fsdp2  # noqa: E402

CONFIG = estimate.PRESETS["small"]
BATCH, SEQ = 4, 64
# A model whose rows divide over 2 x 8 (no padding): vocab 1024, dim 256, hidden 704.
EVEN = llama.LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, max_seq_len=64)
MiB = 2**20
H100_NODES = estimate.Links()  # the defaults: 8 GPUs a node, NVLink-class and IB-class links


def _measure(rank: int, world_size: int, out: str, param_dtype: str, checkpointing: bool) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = llama.Llama(CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    mp = fsdp2.MixedPrecisionPolicy(
        param_dtype=estimate.DTYPES[param_dtype], reduce_dtype=torch.float32
    )
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, mp_policy=mp)
    fsdp2.fully_shard(model, mesh=mesh, mp_policy=mp)
    if checkpointing:
        estimate.checkpoint_blocks(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
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


MEASURED_SETUPS = [(dtype, ac) for dtype in ("fp32", "bf16") for ac in (False, True)]


def _measure_each(rank: int, world_size: int, out: str) -> None:
    """Every setup of MEASURED_SETUPS in one spawn of the ranks."""
    for index, (param_dtype, checkpointing) in enumerate(MEASURED_SETUPS):
        _measure(rank, world_size, f"{out}.{index}", param_dtype, checkpointing)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_matches_measured(world_size: int, tmp_path: Path) -> None:
    """fp32 and bf16 parameters, with and without activation checkpointing."""
    out = tmp_path / "measured.json"
    run_ranks(_measure_each, world_size, tmp_path, str(out))
    for index, (param_dtype, checkpointing) in enumerate(MEASURED_SETUPS):
        what = f"{param_dtype}, checkpointing={checkpointing}"
        measured = json.loads(Path(f"{out}.{index}").read_text())
        setup = estimate.Setup(
            world_size, param_dtype=param_dtype, activation_checkpointing=checkpointing
        )
        predicted = estimate.estimate(CONFIG, setup, BATCH, SEQ)
        assert not dist.is_initialized()  # the fake group is gone again
        # Communication is exact: fsdp2's own padded sizes.
        assert predicted.all_gather_bytes == measured["all_gather"], what
        assert predicted.reduce_scatter_bytes == measured["reduce_scatter"], what
        ratio = predicted.peak_bytes / measured["peak"]
        assert abs(ratio - 1) <= 0.05, (
            f"{what}: estimated {predicted.peak_bytes}, measured {measured['peak']}"
        )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_bench_bytes_are_the_measured(world_size: int, param_dtype: str) -> None:
    """scripts/bench.py's default model: its measured bytes (docs/performance.md:
    40.23 MiB all-gathered, 22.18 reduce-scattered per rank and step in fp32 at 2
    and 4 ranks; 20.12 all-gathered with bf16) are the estimate's, and the bench
    counts them equal to its ``theoretical_bytes``."""
    args = bench.parse_args(["--world-size", str(world_size)])
    model = bench.build_model(args)
    config = estimate.PRESETS["bench"]
    assert [p.shape for p in estimate.build_model(config).parameters()] == [
        p.shape for p in model.parameters()
    ]
    setup = estimate.Setup(world_size, param_dtype=param_dtype)
    colls = {c.name: c for c in estimate.collectives(estimate.shard_sizes(config, setup), setup)}
    itemsize = estimate.DTYPES[param_dtype].itemsize
    theory = bench.theoretical_bytes(model, "default", itemsize)
    assert colls["all_gather"].buffer_bytes == theory["all_gather_single"]
    assert colls["reduce_scatter"].buffer_bytes == theory["reduce_scatter_single"]
    documented = {"fp32": 40.23, "bf16": 20.12}[param_dtype]
    assert round(colls["all_gather"].buffer_bytes / MiB, 2) == documented
    assert round(colls["reduce_scatter"].buffer_bytes / MiB, 2) == 22.18
    # On the ring a rank sends (W - 1) / W of them: 31.2 MiB per step at 2 ranks in fp32.
    sent = colls["all_gather"].sent_bytes + colls["reduce_scatter"].sent_bytes
    total = colls["all_gather"].buffer_bytes + colls["reduce_scatter"].buffer_bytes
    assert sent == total * (world_size - 1) // world_size


@pytest.mark.parametrize("name", sorted(estimate.PUBLISHED_PARAMS))
def test_presets_have_published_parameter_counts(name: str) -> None:
    count = estimate.param_count(estimate.PRESETS[name])
    published = estimate.PUBLISHED_PARAMS[name]
    assert abs(count / published - 1) <= 0.005, f"{name}: {count / 1e9:.3f} B"


def _priced(
    setup: estimate.Setup, links: estimate.Links = H100_NODES, config=EVEN
) -> dict[str, estimate.Priced]:
    colls = estimate.collectives(estimate.shard_sizes(config, setup), setup)
    return {p.collective.name: p for p in estimate.price(colls, setup, links)}


def _seconds(priced: dict[str, estimate.Priced]) -> float:
    return sum(p.seconds for p in priced.values())


def test_three_hsdp_setups_differ_where_the_wire_does() -> None:
    """16 ranks on 2 nodes of 8: FSDP's groups span both nodes; HSDP 2 x 8 keeps
    the shard group inside a node and sends only the replica traffic between
    nodes; the option replaces the all-reduce by a reduce-scatter and an
    all-gather of the same bytes per rank on a ring with fp32 parameters (the
    same time), fewer with bf16 parameters (less time)."""
    for dtype in ("fp32", "bf16"):
        fsdp = _priced(estimate.Setup(16, param_dtype=dtype))
        hsdp = _priced(estimate.Setup(16, replicas=2, param_dtype=dtype))
        option = _priced(
            estimate.Setup(16, replicas=2, shard_optimizer_over_replicas=True, param_dtype=dtype)
        )
        assert set(fsdp) == {"all_gather", "reduce_scatter"}
        assert {p.link for p in fsdp.values()} == {"inter-node"}
        assert set(hsdp) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert set(option) == {
            "all_gather",
            "reduce_scatter",
            "replica_reduce_scatter",
            "replica_all_gather",
        }
        for setup in (hsdp, option):
            links = {name: p.link for name, p in setup.items()}
            assert links["all_gather"] == links["reduce_scatter"] == "intra-node"
            assert {v for k, v in links.items() if k not in ("all_gather", "reduce_scatter")} == {
                "inter-node"
            }
            assert setup["all_gather"].collective == hsdp["all_gather"].collective
        hsdp_across = hsdp["all_reduce"].collective.sent_bytes
        option_across = sum(
            option[name].collective.sent_bytes
            for name in ("replica_reduce_scatter", "replica_all_gather")
        )
        assert _seconds(hsdp) < _seconds(fsdp) / 5  # the shard group's traffic on NVLink
        if dtype == "fp32":  # docs/performance.md: equal on a ring, 8·p/S·(R-1)/R each
            assert option_across == hsdp_across
            assert _seconds(option) == pytest.approx(_seconds(hsdp))
        else:  # the all-gather moves bf16 pieces: 6·p/S against 8·p/S
            assert option_across * 4 == hsdp_across * 3
            assert _seconds(option) < _seconds(hsdp)


def test_replica_buffers_are_counted_once_not_twice() -> None:
    """Whole buffers across replicas: the all-reduce's is the shard group's chunk
    (the reduce-scatter's output); the option's two are that chunk each."""
    hsdp = _priced(estimate.Setup(16, replicas=2, param_dtype="fp32"))
    option = _priced(
        estimate.Setup(16, replicas=2, shard_optimizer_over_replicas=True, param_dtype="fp32")
    )
    chunk = hsdp["reduce_scatter"].collective.buffer_bytes // 8
    assert hsdp["all_reduce"].collective.buffer_bytes == chunk
    assert option["replica_reduce_scatter"].collective.buffer_bytes == chunk
    assert option["replica_all_gather"].collective.buffer_bytes == chunk


def test_each_bandwidth_prices_only_its_own_traffic() -> None:
    base = H100_NODES
    faster_inside = dataclasses.replace(base, intra_node_gbps=2 * base.intra_node_gbps)
    faster_between = dataclasses.replace(base, inter_node_gbps=2 * base.inter_node_gbps)
    # One node: nothing crosses nodes.
    one_node = estimate.Setup(8)
    assert _seconds(_priced(one_node, faster_between)) == _seconds(_priced(one_node))
    assert _seconds(_priced(one_node, faster_inside)) == pytest.approx(
        _seconds(_priced(one_node)) / 2
    )
    # HSDP 2 x 8: the shard group inside a node, the replicas between nodes.
    hsdp = estimate.Setup(16, replicas=2)
    plain, inside, between = (
        _priced(hsdp, links) for links in (base, faster_inside, faster_between)
    )
    for name in plain:
        halved = plain[name].link == "intra-node"
        assert inside[name].seconds == pytest.approx(plain[name].seconds / (2 if halved else 1))
        assert between[name].seconds == pytest.approx(plain[name].seconds / (1 if halved else 2))
    # Fewer GPUs per node: the shard group of 8 now spans nodes.
    small_nodes = dataclasses.replace(base, gpus_per_node=4)
    assert _priced(hsdp, small_nodes)["all_gather"].link == "inter-node"


def test_ring_bytes() -> None:
    gather = estimate.Collective("all_gather", "shard", 8, 1, 800)
    reduce = estimate.Collective("all_reduce", "replicate", 4, 1, 800)
    assert gather.sent_bytes == 700  # (n-1)/n
    assert reduce.sent_bytes == 1200  # 2(n-1)/n
    assert gather.seconds(0.7e-6) == pytest.approx(1.0)  # 700 bytes at 700 B/s


def test_bf16_halves_the_all_gathers_only() -> None:
    fp32 = _priced(estimate.Setup(8, param_dtype="fp32"))
    bf16 = _priced(estimate.Setup(8, param_dtype="bf16"))
    assert (
        bf16["all_gather"].collective.buffer_bytes * 2 == fp32["all_gather"].collective.buffer_bytes
    )
    assert bf16["reduce_scatter"].collective == fp32["reduce_scatter"].collective  # fp32 reduce
    both = _priced(estimate.Setup(8, param_dtype="bf16", reduce_dtype="bf16"))
    assert both["reduce_scatter"].collective.buffer_bytes * 2 == (
        fp32["reduce_scatter"].collective.buffer_bytes
    )


def test_bf16_and_activation_checkpointing_lower_the_peak() -> None:
    config = dataclasses.replace(EVEN, n_layers=4)
    peaks = {
        (dtype, ac): estimate.estimate(
            config, estimate.Setup(8, param_dtype=dtype, activation_checkpointing=ac), 8, 64
        ).memory
        for dtype in ("fp32", "bf16")
        for ac in (False, True)
    }
    for dtype in ("fp32", "bf16"):
        assert peaks[dtype, True].activations < peaks[dtype, False].activations
        assert peaks[dtype, True].peak < peaks[dtype, False].peak
        # Checkpointing leaves the parameters' share alone.
        assert peaks[dtype, True].sharded_state == peaks[dtype, False].sharded_state
    assert peaks["bf16", False].peak < peaks["fp32", False].peak
    assert peaks["bf16", False].sharded_state == peaks["fp32", False].sharded_state  # fp32 master
    assert peaks["bf16", False].root_params * 2 == peaks["fp32", False].root_params


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ac"])
def test_activations_extrapolated_over_blocks_are_the_measured(checkpointing: bool) -> None:
    """The blocks are alike: measured with 2 and 3 blocks, extrapolated to 6,
    every peak is the one measured with 6, to the byte."""
    config = dataclasses.replace(CONFIG, n_layers=6)
    for dtype in (torch.float32, torch.bfloat16):
        assert estimate.activation_bytes(
            config, BATCH, SEQ, dtype, checkpointing
        ) == measure_activations(config, BATCH, SEQ, dtype, checkpointing)


def test_output_says_what_it_assumed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    estimate.main(
        ["--model", "small", "--world-size", "16", "--replicas", "2", "--json", str(out)]
        + ["--shard-optimizer-over-replicas", "--inter-node-gbps", "25"]
    )
    text = capsys.readouterr().out
    for words in (
        "HSDP 2 x 8, optimizer over replicas",
        "450 GB/s per GPU inside a node",
        "25 GB/s between nodes",
        "ring",
        "(n-1)/n",
        "computed in bf16, gradients reduced in fp32",
        "replica_reduce_scatter",
        "inter-node 25 GB/s",
        "intra-node 450 GB/s",
    ):
        assert words in text, words
    written = json.loads(out.read_text())
    assert written["setup"]["replicas"] == 2 and written["assumed"] and written["comm_s"] > 0


def test_wire_bytes_uncompressed_is_the_estimate() -> None:
    """The compression table's uncompressed row counts what ``estimate`` counts
    (the compressed rows are checked against real runs in
    test_compression_training.py)."""
    groups = estimate.group_shapes(estimate.build_model(CONFIG))
    for world_size in (2, 4):
        for dtype in ("fp32", "bf16"):
            setup = estimate.Setup(world_size, param_dtype=dtype)
            colls = {
                c.name: c.buffer_bytes
                for c in estimate.collectives(estimate.shard_sizes(CONFIG, setup), setup)
            }
            itemsize = estimate.DTYPES[dtype].itemsize
            assert estimate.wire_bytes(
                groups, world_size, itemsize=itemsize, reduce_itemsize=4
            ) == (
                colls["all_gather"],
                colls["reduce_scatter"],
            )


def test_compression_grid_prints_each_setting(capsys: pytest.CaptureFixture[str]) -> None:
    estimate.main(["--compression-grid", "--inter-node-gbps", "25"])
    out = capsys.readouterr().out
    for name in ("llama3-8b", "llama3-70b", "weights int8", "gradients bf16", "both int8", "1024"):
        assert name in out, name
