"""The setters of how a sharded module reduces its gradients and runs its
collectives: divide factors, sum-only reductions, hooks after the reduction,
bounded and separate reduce-scatter queues, custom collectives. A mixin of
``FSDPModule`` (module.py), which holds the rest of its methods."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..base.policy import check_bool, check_bools
from ..base.private_dist import group_timeout
from ..comm.custom_comm import AllGather, ReduceScatter, check_custom_collective
from ..comm.primitives import Collectives, collectives_for

if TYPE_CHECKING:
    from ..engine.param_group import FSDPParamGroup
    from .state import FSDPState


class ReductionSetters:
    """``FSDPModule``'s methods that set how its gradients are reduced and how
    its collectives run."""

    if TYPE_CHECKING:  # FSDPModule's

        @property
        def _fsdp_state(self) -> FSDPState: ...

        def _param_groups(self, recurse: bool) -> list[FSDPParamGroup]: ...

    # -- gradient reduction -------------------------------------------------

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """Divides this module's reduced gradients by ``factor`` instead of the
        number of ranks averaged over, e.g. 1 when the loss is already a sum
        normalised by a global token count (torchtitan). Not recursive.

        Args:
            factor: a positive number (a Python or numpy number, or a one-element
                tensor), or None for the default again (the ranks averaged over).
        """
        if factor is not None:
            factor = _positive_number(factor)
        for group in self._param_groups(recurse=False):
            group.gradient_divide_factor = factor
            group.clear_divide_plan()

    def set_reduce_scatter_divide_factor(self, factor: float | None) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in torch)."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor.",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Makes this module's gradient collectives reduce with ``ReduceOp.SUM``
        only, dividing before or after them instead (e.g. for NCCL's zero-copy
        collectives, which sum only). It changes the ops on NCCL alone: there,
        by default, fp32 and bf16 gradients are averaged by the collectives
        (``AVG``, or ``PREMUL_SUM`` with ``set_gradient_divide_factor``), as by
        torch's fully_shard; other backends always sum. Not recursive.

        Args:
            enable: whether to sum only. (Default: False)
        """
        enable = check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for group in self._param_groups(recurse=False):
            group.force_sum_reduction_for_comms = enable
            group.clear_divide_plan()

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce-scatters zeros for parameters that got no gradient in a
        backward, like DDP's ``find_unused_parameters``. Needed when ranks use
        different parameters (mixture of experts, multimodal inputs): every
        rank must reduce-scatter the same buffer, or the collectives mismatch.

        Args:
            reduce_scatter_unused_params: include zero gradients for unused
                trainable parameters.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        reduce_scatter_unused_params, recurse = check_bools(
            "set_reduce_scatter_unused_params",
            reduce_scatter_unused_params=reduce_scatter_unused_params,
            recurse=recurse,
        )
        for group in self._param_groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None] | None, *, stream: torch.Stream | None = None
    ) -> None:
        """Calls ``hook(reduce_output)`` on each finished gradient reduction of
        this module, before the sharded gradients are assigned from it: the
        averaged reduce-scatter output (FSDP), or the output of the all-reduce
        across replicas (HSDP). E.g. an all-reduce of your own over a mesh axis
        that fsdp2 does not know. Not recursive.

        Args:
            hook: changes the flat output in place; returns None. None removes
                the hook set before.
            stream: accelerators, FSDP only: the stream to run the hook on.
                (Default: None, the current stream)
        """
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}.")
        state = self._fsdp_state
        if isinstance(stream, torch.cpu.Stream) or getattr(stream, "device_type", None) == "cpu":
            stream = None  # the CPU's one stream: where the reduction finishes anyway
        if stream is not None:
            if not state.root_ctx.comm.uses_streams:
                raise ValueError(
                    "set_all_reduce_hook(stream=...) needs an accelerator; on CPU the hook runs "
                    "where the reduction finished. Leave stream=None."
                )
            if state.mesh_info.replicate_group is not None:
                raise ValueError(
                    "stream cannot be set when using native HSDP: the hook runs after fsdp2's "
                    "all-reduce across replicas, on its stream."
                )
        for group in self._only_group("set_all_reduce_hook"):
            group.all_reduce_hook = hook
            group.all_reduce_hook_stream = stream

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatters may be in flight at once (1 by default). Each
        holds an input buffer the size of its group's gradients; more than one
        lets backward go on while a slow reduce-scatter finishes, for that
        memory. The largest value set under a root applies to all its groups.

        Args:
            max_input_buffers: an int >= 1.
            recurse: apply to every sharded submodule too. (Default: True)
        """
        recurse = check_bool("set_reduce_scatter_max_input_buffers", "recurse", recurse)
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._param_groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers
        root_ctx = self._fsdp_state.root_ctx
        if root_ctx.states:  # after lazy init: the root's context applies it
            root_ctx.reductions.max_input_buffers = max(
                g.reduce_scatter_max_input_buffers for g in root_ctx.groups
            )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Runs gradient reduce-scatters on a process group of their own over the
        same ranks, so that they progress alongside the all-gathers instead of
        queueing behind them on one communicator (gloo and NCCL both run one
        process group's collectives in order). Creates the group: call it on
        every rank of the shard group, in the same order.

        Args:
            enable: a separate group (True) or the shard group again (False).
            recurse: apply to every sharded submodule too. (Default: True)
        """
        enable, recurse = check_bools(
            "set_separate_reduce_scatter_group", enable=enable, recurse=recurse
        )
        created: dict[tuple[int, ...], Collectives] = {}  # one per set of ranks
        for group in self._param_groups(recurse):
            info = group.mesh_info
            if not enable:
                group.configure(reduce_scatter_collectives=None)
                continue
            ranks = tuple(dist.get_process_group_ranks(info.shard_group))
            if ranks not in created:
                device_type = info.mesh.device_type
                process_group = dist.new_group(
                    list(ranks),
                    # The shard group's: it carries the same collectives' gradients.
                    timeout=group_timeout(info.shard_group, device_type),
                    use_local_synchronization=True,
                )
                created[ranks] = collectives_for(
                    process_group, device_type, "separate reduce-scatter group"
                )
            group.configure(reduce_scatter_collectives=created[ranks])

    # -- communication --------------------------------------------------------

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this module's parameters again. Off for a
        module whose backward never reads them (an embedding: the gradient of a
        lookup needs only the indices) saves that all-gather; the gradients are
        reduce-scattered as usual. Not recursive."""
        unshard_in_backward = check_bool(
            "set_unshard_in_backward", "unshard_in_backward", unshard_in_backward
        )
        for group in self._param_groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """All-gathers this module's parameters with ``comm`` (its ``allocate``
        gives the buffer, its ``__call__`` runs the collective; see
        custom_comm.py). Not recursive."""
        check_custom_collective(comm, "set_custom_all_gather")
        for group in self._only_group("set_custom_all_gather"):
            group.configure(custom_all_gather=comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Reduce-scatters this module's gradients with ``comm`` (its ``allocate``
        gives the buffers, its ``__call__`` runs the collective; see
        custom_comm.py). Not recursive."""
        check_custom_collective(comm, "set_custom_reduce_scatter")
        for group in self._only_group("set_custom_reduce_scatter"):
            group.configure(custom_reduce_scatter=comm)  # refused with compressed gradients

    def _only_group(self, method: str) -> list[FSDPParamGroup]:
        """This module's group, for settings that name one collective or hook."""
        groups = self._param_groups(recurse=False)
        if len(groups) > 1:
            raise ValueError(
                f"{method} is not supported for a module whose parameters are sharded over "
                f"{len(groups)} meshes (shard_placement_fn's ShardPlacementResult): one "
                "collective or hook would serve groups of different process groups."
            )
        return groups


def _positive_number(factor: object) -> float:
    """A divide factor as a float: a Python or numpy number, or a one-element
    tensor (torch's fully_shard takes those), if positive."""
    if isinstance(factor, torch.Tensor) and factor.numel() == 1:
        factor = factor.item()
    if isinstance(factor, numbers.Real) and float(factor) > 0:  # True: 1, as torch reads it
        return float(factor)
    raise ValueError(
        f"set_gradient_divide_factor expects a positive number or None, got {factor!r}."
    )
