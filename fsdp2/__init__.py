"""fsdp2: composable per-parameter fully sharded data parallelism on DTensor.

The public API mirrors ``torch.distributed.fsdp.fully_shard``.
"""

from .fully_shard import FSDPModule, UnshardHandle, fully_shard

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]
