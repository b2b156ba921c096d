"""FSDPParam: one parameter, sharded on dim 0 of the data-parallel axis.

[Note: the padded layout]
A parameter of ``dim0`` rows is cut like ``torch.chunk(param, world_size)``:
every rank owns ``chunk_rows = ceil(dim0 / world_size)`` rows except the tail,
which may own fewer or none. The sharded DTensor holds exactly those rows, with
no padding, so ``full_tensor()`` returns the original bit for bit. Padding lives
only in communication buffers: in the all-gather buffer and in the
reduce-scatter buffer every rank's slot for this parameter is
``chunk_rows * row_numel`` elements, whatever it really owns.
"""

import math
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .common import MeshInfo, chunk_rows, local_rows
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .private_api import dtensor_from_local_no_grad, dtensor_spec


class ModuleSlot(NamedTuple):
    """One place the parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


def _contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for dim in reversed(size):
        strides.append(running)
        running *= dim
    return tuple(reversed(strides))


class FSDPParam:
    """Owns a parameter's sharded DTensor and its unsharded storage.

    ``sharded_param`` is what the optimizer and ``state_dict`` see.
    ``unsharded_param`` is what the module computes with between unshard and
    reshard: a view of ``unsharded_padded`` whose storage is freed on reshard
    and reallocated on unshard, so the object (and autograd's references to it)
    stays the same across iterations.
    """

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        slots: list[ModuleSlot],
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ) -> None:
        self.fqn = fqn  # from the root after lazy init; from the sharded module before
        self.slots = slots
        # The parameter before sharding, only to recognise it if it was tied to
        # a module outside this group (see fully_shard.py).
        self.orig_param_ref = weakref.ref(param)
        self.mesh_info = mesh_info
        self.device = device
        self.orig_size = param.size()
        self.orig_dtype = param.dtype
        # Dtype of the all-gather and of the unsharded parameter.
        self.param_dtype = mp_policy.param_dtype or param.dtype
        # Dtype of the reduce-scatter and of gradients accumulated without sync.
        self.reduce_dtype = mp_policy.reduce_dtype or self.param_dtype
        self.requires_grad = param.requires_grad
        world_size, rank = mesh_info.shard_world_size, mesh_info.shard_rank
        self.row_numel = math.prod(self.orig_size[1:])
        self.chunk_rows = chunk_rows(param.size(0), world_size)
        # Elements of one rank's slot in the communication buffers (padded).
        self.padded_shard_numel = self.chunk_rows * self.row_numel
        rows = local_rows(param.size(0), world_size, rank)
        start = min(rank * self.chunk_rows, param.size(0))
        # Where the shard lives: the compute device, or the CPU when offloading.
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else device
        with torch.no_grad():
            local = param.detach().narrow(0, start, rows)
            # Meta parameters stay on meta until ``module.to_empty(device=...)``.
            # Clone: the full tensor must not be kept alive by its shard.
            local = (local if param.is_meta else local.to(self.shard_device)).clone()
            if self.offload and offload_policy.pin_memory and device.type != "cpu":
                local = local.pin_memory()
        self._local_start = start
        self.sharded_param = nn.Parameter(
            self._as_dtensor(local), requires_grad=param.requires_grad
        )
        self.local_numel = local.numel()
        self.local_shape = local.shape
        self._unsharded_padded: torch.Tensor | None = None
        self._grad_spec = None  # DTensorSpec of the sharded grad, built on first use
        self.unsharded_param: nn.Parameter | None = None
        # Sum of unsharded gradients of backwards run without gradient sync.
        self.unsynced_grad: torch.Tensor | None = None
        # HSDP: reduce-scattered but not yet all-reduced across replicas (local
        # shard shape, reduce dtype), from backwards run without all-reduce.
        self.partial_grad: torch.Tensor | None = None
        self._set_on_modules(self.sharded_param)

    def shard_like(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of ``full`` (shaped like the parameter) as a DTensor."""
        local = full.detach().narrow(0, self._local_start, self.local_shape[0])
        return self._as_dtensor(local.to(self.sharded_param.device))

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local,
            self.mesh_info.mesh,
            self.mesh_info.placements,
            run_check=False,
            shape=self.orig_size,
            stride=_contiguous_strides(self.orig_size),
        )

    def _as_sharded_grad(self, local: torch.Tensor) -> DTensor:
        if self._grad_spec is None:
            self._grad_spec = dtensor_spec(
                self.mesh_info.mesh, self.mesh_info.placements, self.orig_size, self.orig_dtype
            )
        return dtensor_from_local_no_grad(local, self._grad_spec)

    # -- all-gather -------------------------------------------------------

    @property
    def all_gather_input(self) -> torch.Tensor:
        """This rank's shard as a flat tensor (unpadded), read by the copy-in."""
        return self.sharded_param.to_local().view(-1)

    def alloc_unsharded(self) -> torch.Tensor:
        """Returns the (world_size, padded_shard_numel) destination of the copy-out.

        Writes through it do not bump ``unsharded_param``'s version counter:
        the parameter was built from ``.data``, which has a counter of its own.
        That is what lets backward reuse activations saved in forward after a
        reshard and a fresh all-gather refilled the same storage.
        """
        world_size = self.mesh_info.shard_world_size
        padded_size = (world_size * self.chunk_rows, *self.orig_size[1:])
        if self._unsharded_padded is None:
            self._unsharded_padded = torch.empty(
                padded_size, dtype=self.param_dtype, device=self.device
            )
            self.unsharded_param = nn.Parameter(
                self._unsharded_padded[: self.orig_size[0]].data,
                requires_grad=self.requires_grad,
            )
        else:
            storage = self._unsharded_padded.untyped_storage()
            nbytes = self._unsharded_padded.numel() * self._unsharded_padded.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
        return self._unsharded_padded.view(world_size, self.padded_shard_numel)

    def free_unsharded(self) -> None:
        if self._unsharded_padded is not None:
            self._unsharded_padded.untyped_storage().resize_(0)

    @property
    def unsharded_storage_bytes(self) -> int:
        """Bytes currently held by the unsharded parameter (0 when resharded)."""
        if self._unsharded_padded is None:
            return 0
        return self._unsharded_padded.untyped_storage().size()

    # -- module registration ----------------------------------------------

    def to_sharded(self) -> None:
        self._set_on_modules(self.sharded_param)

    def to_unsharded(self) -> None:
        self._set_on_modules(self.unsharded_param)

    def _set_on_modules(self, param: nn.Parameter | None) -> None:
        # Assign through ``_parameters`` directly: ``setattr`` would re-run
        # nn.Module's checks every unshard and reshard of every step.
        for slot in self.slots:
            slot.module._parameters[slot.name] = param

    # -- gradients --------------------------------------------------------

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Detaches the gradient of this backward (plus any unsynced ones) from
        the unsharded parameter, in ``reduce_dtype``."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        if grad is not None:
            self.unsharded_param.grad = None
            grad = grad.to(self.reduce_dtype)
        if self.unsynced_grad is not None:
            grad = self.unsynced_grad if grad is None else grad.add_(self.unsynced_grad)
            self.unsynced_grad = None
        return grad

    def zero_unsharded_grad(self) -> torch.Tensor:
        return torch.zeros(self.orig_size, dtype=self.reduce_dtype, device=self.device)

    def keep_unsynced_grad(self) -> None:
        """Gradient accumulation without sync: adds this backward's unsharded
        gradient to ``unsynced_grad`` instead of reduce-scattering it."""
        self.unsynced_grad = self.take_unsharded_grad()

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Adds this rank's reduced rows (unpadded, shaped like the local shard)."""
        local_grad = local_grad.to(self.shard_device, self.orig_dtype)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = self._as_sharded_grad(local_grad)
        else:
            self.sharded_param.grad.to_local().add_(local_grad)  # no_grad: the local tensor itself

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, size={tuple(self.orig_size)})"
