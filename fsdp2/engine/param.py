"""FSDPParam: one parameter's life while sharded: its sharded DTensor, the
unsharded storage it is all-gathered into, where it is registered on
modules, and its gradients. Where its elements sit is its ``ShardLayout``
(layout.py, with [Note: the padded layout])."""

import weakref
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..base.device_ops import DeviceOps
from ..base.markers import SHARDED, UNSHARDED
from ..base.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..base.private_api import module_parameters, post_accumulate_grad_hooks
from ..base.private_dist import (
    DTensorSpec,
    dtensor_from_local_no_grad,
    dtensor_spec,
    local_tensor,
    set_local_tensor,
)
from ..comm.layout import ShardLayout, TPLayout, contiguous_strides
from ..comm.mesh_info import MeshInfo, shard_axis
from ..comm.offload import HostCopy, copy_to_host
from .extension import AllGatherExtension, uses_all_gather_extension


class Registration(NamedTuple):
    """One place the parameter is registered on a module, under ``name``."""

    module: nn.Module
    name: str


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
        registrations: list[Registration],
        layout: ShardLayout,
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        ops: DeviceOps | None = None,
    ) -> None:
        self.fqn = fqn  # from the root after lazy init; from the sharded module before
        self.registrations = registrations
        # The parameter before sharding, only to recognise it if it was tied to
        # a module outside this group (see fully_shard.py).
        self.orig_param_ref = weakref.ref(param)
        self.layout = layout
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self._init_dtypes(param.dtype)
        self.requires_grad = param.requires_grad
        # Where the shard lives: the compute device, or the CPU when offloading.
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.shard_device = torch.device("cpu") if self.offload else device
        self.pin_memory = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
        data = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            local = layout.local_of(data.detach())
            # Meta parameters stay on meta until ``module.to_empty(device=...)``.
            local = local if data.is_meta else self._pinned(local.to(self.shard_device), ops)
        self.sharded_param = nn.Parameter(
            self._as_dtensor(local), requires_grad=param.requires_grad
        )
        self.sharded_param.__dict__[SHARDED] = layout
        self._unsharded_padded: torch.Tensor | None = None
        # Its storage and full size, kept: every unshard and reshard resizes it.
        self.padded_storage: tuple[torch.UntypedStorage, int] | None = None
        # (unsharded_padded, world size, its rank-major view): a view stays valid
        # across the storage's frees and reallocations.
        self._rank_major: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._grad_spec: DTensorSpec | None = None  # of the sharded grad, built on first use
        self.unsharded_param: nn.Parameter | None = None
        # Sum of unsharded gradients of backwards run without gradient sync.
        self.unsynced_grad: torch.Tensor | None = None
        # HSDP: reduced inside the shard group, not yet across replicas (reduce
        # dtype, shaped like the chunk), from backwards run without all-reduce.
        self.partial_grad: torch.Tensor | None = None
        # A subclass that all-gathers itself (see [Note: all-gather extensions]).
        self.extension: AllGatherExtension | None = None
        if uses_all_gather_extension(local):
            self.extension = AllGatherExtension(
                local,
                shard_axis(mesh_info.mesh),
                device,
                layout.unsharded_size[0],
                registrations[0].module,
                mp_policy,
            )
        self._set_on_modules(self.sharded_param)

    def _init_dtypes(self, orig_dtype: torch.dtype) -> None:
        self.orig_dtype = orig_dtype
        # Dtype of the all-gather and of the unsharded parameter. Mixed precision
        # casts floating-point parameters only (not e.g. integer buffers-as-params).
        cast = self.mp_policy.param_dtype if orig_dtype.is_floating_point else None
        self.param_dtype = cast or orig_dtype
        # Dtype of the reduce-scatter and of gradients accumulated without sync.
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.param_dtype

    def reset_sharded_param(self, ops: DeviceOps | None = None) -> None:
        """Adopts the parameter the module now holds, if it is not the sharded
        one: what ``nn.Module._apply`` left (``model.to(torch.float64)``,
        changed in place by ``swap_tensors``, or a new one), what
        ``load_state_dict(assign=True)`` registered, or what the user assigned
        between ``fully_shard`` and the first forward (a loader filling a
        meta-device model: ``setattr(module, name, new_param)``). A DTensor
        sharded like this parameter is adopted as it is, the very object, so
        an optimizer built on ``model.parameters()`` steps it; the dtype the
        unsharded parameter and the gradients follow is the new one. With CPU
        offload the new shard must be on the CPU (or still on meta) and is
        pinned again (``ops``: the comm context's device ops). Called with the
        group sharded."""
        first = self.registrations[0]
        param = module_parameters(first.module)[first.name]
        if param is not self.sharded_param:
            param = self._adoptable(param)
            param.__dict__[SHARDED] = self.layout
            self.sharded_param = param
            self.requires_grad = param.requires_grad
            self._set_on_modules(param)
        if param.dtype != self.orig_dtype:
            self._init_dtypes(param.dtype)
            # Rebuilt in the new dtype at the next unshard.
            self._unsharded_padded = None
            self.padded_storage = None
            self.unsharded_param = None
            self._grad_spec = None
        local = local_tensor(param)
        if self.offload and not local.is_meta:
            self._check_offloaded(local)
            if (pinned := self._pinned(local, ops)) is not local:
                set_local_tensor(param, pinned)

    def _pinned(self, local: torch.Tensor, ops: DeviceOps | None) -> torch.Tensor:
        """``local``, a CPU shard, in page-locked memory if CPU offload asks for
        it on an accelerator (``ops``), so that copies between it and the
        device need not block the host."""
        return ops.pin(local) if self.pin_memory and ops is not None else local

    def _check_offloaded(self, local: torch.Tensor) -> None:
        if local.device.type != "cpu":
            raise ValueError(
                f"fsdp2: {self.fqn!r} is on {local.device}, but with CPUOffloadPolicy the "
                "sharded parameters (and their gradients and optimizer state) stay on the "
                "CPU; fsdp2 copies them to the accelerator for each forward and backward. "
                'Materialize the model with model.to_empty(device="cpu") (or load CPU '
                "tensors) after fully_shard, and do not move it to the accelerator."
            )

    def check_not_replaced(self) -> None:
        """Raises if the module no longer holds the sharded parameter: replaced
        after the first forward, the new one would be overwritten by the next
        unshard. Called with the group sharded."""
        if not self.registrations:
            return
        first = self.registrations[0]
        if module_parameters(first.module)[first.name] is not self.sharded_param:
            raise RuntimeError(
                f"fsdp2: {self.fqn!r} was replaced on its module after the first forward; "
                "the replacement would be overwritten by the next all-gather. Assign new "
                "parameters before the first forward, or copy values into the existing one "
                "in place (with torch.no_grad(): param.copy_(...), or load_state_dict)."
            )

    def _adoptable(self, param: torch.Tensor | None) -> nn.Parameter:
        """``param`` as a sharded parameter of this layout, or a ValueError
        saying why it cannot be one."""
        if isinstance(param, DTensor):
            local = local_tensor(param)
            layout = self.layout
            if (
                local.shape == layout.local_shape
                and param.placements == layout.placements
                and param.device_mesh == layout.mesh
            ):
                if isinstance(param, nn.Parameter):
                    return param
                return nn.Parameter(param, requires_grad=param.requires_grad)
            got = f"a {tuple(local.shape)} shard placed {param.placements} on {param.device_mesh}"
        elif isinstance(param, torch.Tensor):
            got = f"a {type(param).__name__} of shape {tuple(param.shape)}"
        else:
            got = repr(param)
        layout = self.layout
        raise ValueError(
            f"fsdp2: {self.fqn!r} was replaced by {got}, but it is "
            f"{tuple(layout.orig_size)} sharded as a {tuple(layout.local_shape)} shard placed "
            f"{layout.placements} on {layout.mesh}. Assign a DTensor sharded like it "
            "(distribute_tensor(full, param.device_mesh, param.placements)), or load full "
            "tensors with model.load_state_dict(...), which shards them in place. (A plain "
            "tensor cannot be adopted as the same Parameter object, and an optimizer "
            "holding it would silently never update it.)"
        )

    def shard_like(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of ``full`` (shaped like the parameter) as a DTensor."""
        layout = self.layout
        data = full.detach() if layout.tp is None else layout.tp.local(full.detach())
        dim = layout.shard_dim
        local = data.narrow(dim, layout.local_start, layout.local_shape[dim])
        return self._as_dtensor(local.to(self.sharded_param.device).contiguous())

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        """The sharded parameter around ``local``, which stays where it is:
        ``DTensor.from_local`` would move a CPU-offloaded shard to the mesh's
        device (the GPU found it; a CPU mesh cannot show it)."""
        layout = self.layout
        spec = dtensor_spec(layout.mesh, layout.placements, layout.orig_size, local.dtype)
        return dtensor_from_local_no_grad(local, spec)

    def _assign_sharded_grad(self, local: torch.Tensor) -> None:
        self.sharded_param.grad = self.as_sharded_grad(local)

    def as_sharded_grad(self, local: torch.Tensor) -> DTensor:
        """``local`` (shaped like the local shard) as this parameter's sharded grad."""
        if self._grad_spec is None:
            layout = self.layout
            self._grad_spec = dtensor_spec(
                layout.mesh, layout.placements, layout.orig_size, self.orig_dtype
            )
        return dtensor_from_local_no_grad(local, self._grad_spec)

    def _tp_layout(self) -> TPLayout:
        """Of a parameter that is a DTensor (TP, or dp_mesh_dims)."""
        if self.layout.tp is None:
            raise AssertionError(f"{self.fqn!r} is not a DTensor parameter")
        return self.layout.tp

    # -- all-gather -------------------------------------------------------

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """This rank's inputs to the group's all-gather, flat, each at most its
        slot long: the local shard (cast to ``param_dtype`` by the copy-in), or
        what the subclass's ``fsdp_pre_all_gather`` returns."""
        local = local_tensor(self.sharded_param)
        if self.extension is None:
            return [local.view(-1)]
        if self.offload:
            local = local.to(self.device, non_blocking=True)
        orig_size = self.layout.orig_size
        return self.extension.pre_all_gather(
            local,
            orig_size,
            contiguous_strides(orig_size),
            self.mesh_info.shard_collectives,
        )

    @property
    def all_gather_slots(self) -> list[tuple[int, torch.dtype]]:
        """``(elements, dtype)`` of each of this parameter's slots in a rank's block
        of the all-gather buffer (an extension's: known after its first inputs)."""
        if self.extension is None:
            return [(self.layout.slot_numel, self.param_dtype)]
        return list(zip(self.extension.slots, self.extension.slot_dtypes, strict=True))

    def all_gather_outputs(self, world_size: int) -> list[torch.Tensor]:
        """Where the copy-out writes, storage allocated, one per slot, rank-major
        (row k receives rank k's slot; see ``rank_major``)."""
        if self.extension is None:
            padded = self.alloc_unsharded()
            kept = self._rank_major
            if kept is None or kept[0] is not padded or kept[1] != world_size:
                kept = self._rank_major = (
                    padded,
                    world_size,
                    self.layout.rank_major(padded, world_size),
                )
            return [kept[2]]
        return self.extension.alloc_outputs(world_size)

    def finish_unshard(self) -> None:
        """After the copy-out: an extension builds (or refreshes) the unsharded
        parameter from the outputs."""
        if self.extension is not None:
            self.unsharded_param = self.extension.post_all_gather(
                local_tensor(self.sharded_param),
                self.param_dtype,
                self.unsharded_param,
                self.requires_grad,
            )
            self.unsharded_param.__dict__[UNSHARDED] = self.fqn

    def alloc_unsharded(self) -> torch.Tensor:
        """Returns the padded unsharded tensor, its storage (re)allocated.

        Writes through it do not bump ``unsharded_param``'s version counter:
        the parameter was built from ``.data``, which has a counter of its own.
        That is what lets backward reuse activations saved in forward after a
        reshard and a fresh all-gather refilled the same storage. It holds
        because this runs eagerly, never traced (see [Note: hooks under
        torch.compile] in engine/states.py).
        """
        if self._unsharded_padded is None:
            layout = self.layout
            padded = self._unsharded_padded = torch.empty(
                layout.padded_unsharded_size, dtype=self.param_dtype, device=self.device
            )
            self.padded_storage = (
                padded.untyped_storage(),
                padded.numel() * padded.element_size(),
            )
            dim = layout.shard_dim
            data = self._unsharded_padded.narrow(dim, 0, layout.unsharded_size[dim]).data
            if (tp := layout.tp) is not None:
                spec = dtensor_spec(tp.mesh, tp.placements, layout.orig_size, self.param_dtype)
                data = dtensor_from_local_no_grad(data, spec)
            self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)
            self.unsharded_param.__dict__[UNSHARDED] = self.fqn
        else:
            storage, nbytes = self.padded_storage  # type: ignore[misc]
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        return self._unsharded_padded

    @torch.no_grad()
    def copy_whole(self) -> None:
        """Unshards a parameter kept whole: its local tensor is all of it."""
        self.alloc_unsharded().copy_(local_tensor(self.sharded_param))

    def free_unsharded(self) -> None:
        if self.padded_storage is not None:
            self.padded_storage[0].resize_(0)
        if self.extension is not None:
            self.extension.free()

    # -- module registration ----------------------------------------------

    def _set_on_modules(self, param: nn.Parameter | None) -> None:
        for module, name in self.registrations:
            module_parameters(module)[name] = param

    # -- gradients --------------------------------------------------------

    def take_unsharded_grad(self, *, cast: bool = True) -> torch.Tensor | None:
        """Detaches the gradient of this backward (plus any unsynced ones) from
        the unsharded parameter, in ``reduce_dtype`` (``cast=False``: as it is,
        unless unsynced ones were added; the reduce-scatter copy-in casts while
        packing, so no reduce-dtype copy of the whole gradient is made)."""
        param = self.unsharded_param
        grad = None if param is None else param.grad
        if param is not None and grad is not None:
            param.grad = None
            if isinstance(grad, DTensor):
                target = self._grad_placements(grad)
                if grad.placements != target:
                    grad = grad.redistribute(placements=target)
                grad = grad.to_local()
            if cast:
                grad = grad.to(self.reduce_dtype)
        if self.unsynced_grad is not None:
            # In reduce dtype, owned here: this backward's gradient is added into it.
            grad = self.unsynced_grad if grad is None else self.unsynced_grad.add_(grad)
            self.unsynced_grad = None
        return grad

    def _grad_placements(self, grad: DTensor) -> tuple:
        """Where a TP gradient must be before its reduction: the TP layout's
        placements (e.g. from Partial() after a sequence-parallel norm: reduced
        over TP first), the data-parallel axes of dp_mesh_dims left as they
        are (the reduce-scatter and all-reduce reduce over them)."""
        target = self._tp_layout().placements
        if (spmd := self.mesh_info.spmd) is not None:
            dp = spmd.data_parallel
            target = tuple(
                grad.placements[axis] if axis in dp else p for axis, p in enumerate(target)
            )
        return tuple(target)

    def drop_unsharded_grads(self) -> None:
        """Recovery (``reset_iter_state``): forgets the unsharded gradients of the
        interrupted iteration without computing anything from them (no
        redistribute, no cast)."""
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None
        self.unsynced_grad = None

    def zero_unsharded_grad(self, dtype: torch.dtype) -> torch.Tensor:
        """Zeros for a parameter unused in this backward, in ``dtype``: that of
        the group's other gradients, so that packing them needs no cast copy."""
        return torch.zeros(self.layout.unsharded_size, dtype=dtype, device=self.device)

    def keep_unsynced_grad(self, *, on_param: bool = False) -> None:
        """Gradient accumulation without sync: adds this backward's unsharded
        gradient to ``unsynced_grad`` instead of reduce-scattering it.
        ``on_param`` (a pipeline's split backward, whose weight half adds to
        ``.grad`` itself): a gradient in the reduce dtype stays on the
        unsharded parameter instead, so the microbatches' gradients are summed
        in the order torch's fully_shard sums them."""
        param = self.unsharded_param
        grad = None if param is None else param.grad
        if (
            on_param
            and grad is not None
            and self.unsynced_grad is None
            and grad.dtype == self.reduce_dtype
            and (not isinstance(grad, DTensor) or grad.placements == self._grad_placements(grad))
        ):
            return
        self.unsynced_grad = self.take_unsharded_grad()

    def accumulate_sharded_grad(
        self, local_grad: torch.Tensor, ops: DeviceOps | None = None
    ) -> HostCopy | None:
        """Adds this rank's reduced rows (unpadded, shaped like the local shard)
        to the sharded grad. With ``CPUOffloadPolicy`` on an accelerator they
        are copied to pinned host memory without blocking the host: returns
        the copy, which becomes the grad or is added to it once the host has
        waited for the current stream (``HostGradCopies.wait``, once at the end
        of backward): ``.grad`` never shows bytes still in flight."""
        grad = self.sharded_param.grad
        hooks = post_accumulate_grad_hooks(self.sharded_param)
        if self.offload and self.pin_memory and ops is not None and not hooks:
            add_to = self._assign_sharded_grad if grad is None else local_tensor(grad)
            return copy_to_host(local_grad, self.orig_dtype, add_to, ops)
        local_grad = local_grad.to(self.shard_device, self.orig_dtype)
        if grad is None:
            self.sharded_param.grad = self.as_sharded_grad(local_grad)
        else:
            local_tensor(grad).add_(local_grad)
        # Autograd never accumulates into the sharded parameter, so hooks registered
        # with register_post_accumulate_grad_hook (an optimizer step in backward)
        # run here, once its gradient is complete (on the host: not copied above).
        for hook in hooks:
            hook(self.sharded_param)
        return None

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, size={tuple(self.layout.orig_size)})"
