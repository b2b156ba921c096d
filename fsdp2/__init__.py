"""fsdp2: composable per-parameter fully sharded data parallelism on DTensor.

The public API mirrors ``torch.distributed.fsdp.fully_shard``.
"""

from .clip import clip_grad_norm_
from .custom_comm import AllGather, Comm, ReduceScatter
from .fully_shard import fully_shard
from .mesh import DataParallelMeshDims, ShardPlacementResult
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .policy import CompressionPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .stats import CommStats
from .summary import GroupSummary, Summary, comm_stats, summary
from .torch_names import TorchFSDPNames, install_as_torch_fsdp
from .version import __version__

__all__ = [
    "__version__",
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "CommStats",
    "CompressionPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GroupSummary",
    "Summary",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "ShardPlacementResult",
    "TorchFSDPNames",
    "UnshardHandle",
    "clip_grad_norm_",
    "comm_stats",
    "fully_shard",
    "install_as_torch_fsdp",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "summary",
]
