"""The error model of tests/error_model.py, checked: its bound holds for sums
in any order, and the parity test at 4 ranks passes with the ranks' gradients
summed in other orders and with another CPU's kernels, and fails on a lost
rank or a wrong average (tests/perturb.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from dist import run_ranks
from error_model import assert_within, rank_mean_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from perturb import ENV
from test_parity import _train_against_reference_and_torch


@settings(max_examples=200, deadline=None)
@given(
    world_size=st.integers(1, 16),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_rank_mean_bound_holds_for_any_order(world_size: int, seed: int, dtype: torch.dtype):
    """Means over ranks of nearly cancelling values, summed in two random orders
    in ``dtype``, are within rank_mean_bound of each other."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(world_size, 64, generator=gen, dtype=torch.float64)
    values = (big - big.mean(0) + 1e-6 * torch.randn(world_size, 64, generator=gen)).to(dtype)
    rng = random.Random(seed)

    def mean_in_random_order() -> torch.Tensor:
        order = list(range(world_size))
        rng.shuffle(order)
        total = values[order[0]].clone()
        for r in order[1:]:
            total += values[r]
        return total / world_size

    bound = rank_mean_bound(values.float().abs().sum(0), world_size, dtype)
    assert_within(mean_in_random_order().float(), mean_in_random_order().float(), bound, "means")


def test_assert_within_fails_beyond_the_bound():
    with pytest.raises(AssertionError, match=r"1 of 3 elements beyond .* worst at \(1,\)"):
        assert_within(
            torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0]), torch.full((3,), 0.1), "x"
        )


# Another CPU's kernels: torch's vectorised ops and MKL's matmul limited to AVX2
# (this combination reproduced, on an AVX-512 machine, the last-bit failure a
# constant tolerance had on an Intel Xeon).
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "reduction, kernels",
    [("reverse", {}), ("tree", {}), ("", AVX2), ("reverse", AVX2)],
    ids=["reverse", "tree", "avx2", "reverse-avx2"],
)
def test_parity_holds_under_benign_perturbations(
    reduction: str, kernels: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, reduction)
    for name, value in kernels.items():
        monkeypatch.setenv(name, value)  # read by the spawned ranks at start
    run_ranks(_train_against_reference_and_torch, 4, tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize("bug", ["drop_rank", "scale"])
def test_parity_catches_real_bugs(bug: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV, bug)
    with pytest.raises(AssertionError, match=r"step 0.*\.grad vs (the reference|torch)"):
        run_ranks(_train_against_reference_and_torch, 4, tmp_path)
