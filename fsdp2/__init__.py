"""fsdp2: composable per-parameter fully sharded data parallelism on DTensor.

The public API mirrors ``torch.distributed.fsdp.fully_shard``.
"""

from .fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
