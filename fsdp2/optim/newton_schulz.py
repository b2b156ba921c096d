"""Muon's arithmetic on one whole matrix: Newton-Schulz orthogonalization and the
learning-rate adjustment, operation for operation as ``torch.optim.Muon`` does
them (torch 2.13), so the result on the same input is bitwise the same."""

from __future__ import annotations

import math

import torch

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def orthogonalize(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Newton-Schulz iterations on a whole 2-D ``update``, in bfloat16.

    ``update`` may already be bfloat16 (the wire format of the exchange); casting
    before or after sending is the same elementwise rounding. It must be
    contiguous with its rows in order: the norm and the products below then see
    the same memory layout as torch's, hence the same reduction order.

    Returns:
        A bfloat16 matrix of ``update``'s shape (a transposed view when it has
        more rows than columns).
    """
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    ortho = update.bfloat16()
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate for a matrix of (global) ``shape``: equal RMS across shapes."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio
