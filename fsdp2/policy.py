"""User-facing policies passed to ``fully_shard``."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; sharded parameters and optimizer
    state keep their original dtype.

    Args:
        param_dtype: dtype of the all-gather and of the unsharded parameters
            the module computes with. (Default: None, the original dtype)
        reduce_dtype: dtype of the gradient reduce-scatter (and of gradients
            accumulated without sync). Reduced gradients are cast back to the
            sharded parameter's dtype. (Default: None, ``param_dtype``)
        output_dtype: cast floating-point forward outputs to this dtype.
            (Default: None, no cast)
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``. (Default: True)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state live on
    the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients (and so optimizer state) live on the CPU.

    Each unshard copies the shard to the device before the all-gather, and
    each reduced gradient is copied back to the CPU; the optimizer steps on the
    CPU. On a CPU mesh this changes nothing.

    Args:
        pin_memory: pin the CPU shards so host-to-device copies can run
            asynchronously. (Default: True)
    """

    pin_memory: bool = True
