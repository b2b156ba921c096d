"""Tensor subclasses that all-gather themselves: ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``.

[Note: all-gather extensions]
A parameter whose local shard is a tensor subclass defining both methods
(torchao's float8 training weights, int8 quantized-training weights, NF4) is
not all-gathered as itself but as what the subclass asks for, torch's
fully_shard contract:

    inputs, metadata = shard.fsdp_pre_all_gather(mesh, outer_size, outer_stride,
                                                 module, mp_policy)
    # (or shard.fsdp_pre_all_gather(mesh), the older one-argument form)
    tensor, inner_tensors = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)
    shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded_param)

- ``inputs`` are any number of tensors of any dtypes (e.g. float8 data, or
  int8 data and a float scale). Each gets a slot of its own in the group's
  all-gather buffer, like a parameter; ``outputs[i]`` is input i gathered
  from every rank in rank order, shaped ``(W * rows_i, *inputs[i].shape[1:])``.
- On an uneven shard a rank's inputs are shorter than others'. The slot of an
  input is the largest of its sizes over the ranks (agreed once, by a small
  all-gather of the sizes at the first unshard), and a shorter input is
  padded with zeros; the unsharded tensor is cut back to the parameter's rows.
- The first unshard builds the unsharded parameter from the tensor
  ``fsdp_post_all_gather`` returns. Later ones pass ``out=`` the same
  parameter: the subclass refreshes it in place (its inner tensors usually
  *are* the outputs, whose storage is refilled).
- Resharding frees the storage of the outputs and of the inner tensors
  (resized to 0, as plain unsharded parameters are); unsharding reallocates
  them before the copy-out.

Gradients are plain tensors and are reduce-scattered like any other.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..base.policy import MixedPrecisionPolicy
from ..comm.primitives import Collectives
from ..comm.timeouts import naming_failures

PRE_ALL_GATHER = "fsdp_pre_all_gather"
POST_ALL_GATHER = "fsdp_post_all_gather"


def uses_all_gather_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter, or a DTensor's local tensor) defines the protocol."""
    return hasattr(tensor, PRE_ALL_GATHER)


def _resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class AllGatherExtension:
    """The all-gather of one parameter whose shard is such a subclass (see
    [Note: all-gather extensions]): calls the two methods, owns the outputs and
    the metadata passed from one to the other."""

    def __init__(
        self,
        shard: torch.Tensor,
        mesh: DeviceMesh,
        device: torch.device,
        unsharded_rows: int,
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.mesh = mesh  # the shard axis
        self.device = device
        self.unsharded_rows = unsharded_rows
        self.module = module
        self.mp_policy = mp_policy
        self.legacy = len(inspect.signature(getattr(shard, PRE_ALL_GATHER)).parameters) == 1
        # Per input, fixed by the first pre-all-gather: elements of its slot and dtype.
        self.slot_numels: list[int] | None = None
        self.slot_dtypes: list[torch.dtype] = []
        self._input_shapes: list[torch.Size] = []
        self._metadata: Any = None
        self._outputs: list[torch.Tensor] = []  # 1D, W * slot numel each: persistent
        self._inner_tensors: list[torch.Tensor] = []

    def pre_all_gather(
        self,
        shard: torch.Tensor,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        collectives: Collectives,
    ) -> list[torch.Tensor]:
        """This rank's inputs, flat and each as long as its slot."""
        pre_all_gather = getattr(shard, PRE_ALL_GATHER)
        if self.legacy:
            inputs, self._metadata = pre_all_gather(self.mesh)
        else:
            inputs, self._metadata = pre_all_gather(
                self.mesh, outer_size, outer_stride, self.module, self.mp_policy
            )
        inputs = [t.contiguous() for t in inputs]
        if self.slot_numels is None:
            self._init_slots(inputs, collectives)
        self._input_shapes = [t.shape for t in inputs]
        flat = []
        for t, numel in zip(inputs, self.slots, strict=True):
            t = t.view(-1)
            if t.numel() < numel:  # the short shard of an uneven parameter
                t = torch.cat([t, t.new_zeros(numel - t.numel())])
            flat.append(t)
        return flat

    def _init_slots(self, inputs: list[torch.Tensor], collectives: Collectives) -> None:
        numels = [t.numel() for t in inputs]
        world_size = dist.get_world_size(collectives.process_group)
        if self.unsharded_rows % world_size:
            # Uneven: ranks' inputs differ in size. Agree on the largest, once.
            device = inputs[0].device if inputs else torch.device("cpu")
            local = torch.tensor(numels, dtype=torch.int64, device=device)
            gathered = torch.empty(world_size * len(numels), dtype=torch.int64, device=device)
            with naming_failures("all-gather of the extension's slot sizes", collectives):
                collectives.all_gather(gathered, local)
            numels = gathered.view(world_size, -1).amax(dim=0).tolist()
        self.slot_numels = numels
        self.slot_dtypes = [t.dtype for t in inputs]

    @property
    def slots(self) -> list[int]:
        """Elements of each input's slot (after the first ``pre_all_gather``)."""
        if self.slot_numels is None:
            raise AssertionError("the all-gather slots are known after the first pre-all-gather")
        return self.slot_numels

    def alloc_outputs(self, world_size: int) -> list[torch.Tensor]:
        """The outputs, their storage (re)allocated, each seen as ``(W, slot)``."""
        if not self._outputs:
            self._outputs = [
                torch.empty(world_size * numel, dtype=dtype, device=self.device)
                for numel, dtype in zip(self.slots, self.slot_dtypes, strict=True)
            ]
        for t in (*self._outputs, *self._inner_tensors):
            _resize_storage(t, t.numel() * t.element_size())
        return [t.view(world_size, -1) for t in self._outputs]

    def post_all_gather(
        self,
        shard: torch.Tensor,
        param_dtype: torch.dtype,
        unsharded_param: nn.Parameter | None,
        requires_grad: bool,
    ) -> nn.Parameter:
        """The unsharded parameter: built by the first call, refreshed in place after."""
        # Seen through ``.data``: a version counter apart from the buffers the
        # copy-out refills in place at every unshard, as a plain unsharded
        # parameter's is (docs/design.md, "Under torch.compile"). A counter
        # shared with them would make autograd refuse a backward that saved an
        # inner tensor (torchao's MX training weights hand theirs out of a
        # custom Function, as a view).
        outputs = tuple(
            t.data.view(-1, *shape[1:])
            for t, shape in zip(self._outputs, self._input_shapes, strict=True)
        )
        metadata, self._metadata = self._metadata, None
        post_all_gather = getattr(shard, POST_ALL_GATHER)
        if unsharded_param is not None:
            post_all_gather(outputs, metadata, param_dtype, out=unsharded_param)
            return unsharded_param
        tensor, inner_tensors = post_all_gather(outputs, metadata, param_dtype)
        self._inner_tensors = list(inner_tensors)
        if tensor.size(0) != self.unsharded_rows:  # padded rows of an uneven parameter
            tensor = tensor.narrow(0, 0, self.unsharded_rows)
        return nn.Parameter(tensor, requires_grad=requires_grad)

    def free(self) -> None:
        for t in (*self._outputs, *self._inner_tensors):
            _resize_storage(t, 0)
