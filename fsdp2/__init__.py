"""fsdp2: composable per-parameter fully sharded data parallelism on DTensor.

The public API mirrors ``torch.distributed.fsdp.fully_shard``.
"""

from .api.fully_shard import fully_shard
from .api.mesh import DataParallelMeshDims, ShardPlacementResult
from .api.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .api.summary import GroupSummary, Summary, comm_stats, summary
from .api.torch_names import TorchFSDPNames, install_as_torch_fsdp
from .base.policy import CompressionPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .base.version import __version__
from .comm.custom_comm import AllGather, Comm, ReduceScatter
from .comm.stats import CommStats
from .optim.clip import clip_grad_norm_

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

# The public objects name the package, not the file that defines them (as
# torch's do: ``torch.distributed.fsdp``), so that pickles (a policy in a
# saved config), reprs and messages stay the same whatever the package's
# layout.
for _name in __all__:
    if _name != "__version__":
        globals()[_name].__module__ = __name__
del _name
