"""``share_comm_ctx`` shares the reduce-scatter queue as well as the streams:
V roots with a queue of K hold K reduce-scatter input buffers, not V x K
(issue 19, defect 12)."""

from __future__ import annotations

import torch
from dist import fake_world
from models import build_model, shard_model

import fsdp2


def _in_flight(*roots: torch.nn.Module) -> int:
    queues = {id(q): q for q in (r._fsdp_state.root_ctx.reductions.reduce_scatters for r in roots)}
    return sum(len(q) for q in queues.values())


def test_shared_roots_share_the_reduce_scatter_queue() -> None:
    with fake_world(2):
        first, second = shard_model(build_model("mlp")), shard_model(build_model("mlp"))
        fsdp2.share_comm_ctx([first, second])
        for root in (first, second):
            # Pipeline stages: each backward leaves its last reduce-scatter in flight.
            root.set_is_last_backward(False)
            root(torch.randn(4, 17)).sum().backward()
        # A queue of 1: the second root's backward finished the first's.
        assert _in_flight(first, second) == 1
        grads = [p.grad for p in first.parameters()]
        assert all(g is not None for g in grads), "the first root's reduction was finished"
