"""Owner assignment: which rank of a shard group orthogonalizes which matrix.

Newton-Schulz on an (m, n) matrix costs about ``m * n * min(m, n)`` multiply-adds
per iteration (the Gram matrix and the two products all scale so). Owners are
chosen greedily, most expensive matrix first, each to the rank with the least
work so far (ties: the matrix earlier in parameter order, the lower rank). The
inputs are the same on every rank (parameter order and global shapes), so every
rank computes the same assignment without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def newton_schulz_cost(shape: torch.Size | Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix of ``shape``, up to a constant."""
    rows, cols = shape
    return rows * cols * min(rows, cols)


def assign_owners(costs: Sequence[int], num_ranks: int) -> list[int]:
    """The owner rank (0 .. ``num_ranks`` - 1) of each matrix, balanced by cost.

    Args:
        costs: one cost per matrix, in parameter order.
        num_ranks: the size of the shard group.

    Returns:
        ``owners[i]`` is the rank that orthogonalizes matrix ``i``.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    loads = [0] * num_ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def owner_loads(costs: Sequence[int], owners: Sequence[int], num_ranks: int) -> list[int]:
    """The total cost each rank owns under ``owners``."""
    loads = [0] * num_ranks
    for cost, owner in zip(costs, owners, strict=True):
        loads[owner] += cost
    return loads
