"""The unsharded storages of a group's parameters, allocated and freed together.

Every unshard gives each sharded parameter its padded unsharded storage back
and every reshard frees it (``FSDPParam.alloc_unsharded``,
``free_unsharded``), and the copy-out writes through each parameter's
rank-major view (``FSDPParam.all_gather_outputs``). Asked of each parameter,
that is a few method calls per parameter twice a step: on blocks of many
small parameters a large part of what the hooks cost above the math
(docs/performance.md, "The hooks' per-parameter work, kept per group").

``UnshardedStorages`` keeps, once every parameter of the group has had
its storage, the storages with their full sizes and the copy-out's views per
world size, so that an unshard is one loop of resizes and a reshard one loop
of frees. Nothing here is new state: it is what the parameters hold, listed.
The group drops it when its parameters change (``reset_sharded_params``); a
group with an all-gather extension (a subclass that gathers into outputs of
its own) keeps asking each parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from .param import FSDPParam


class UnshardedStorages:
    """The padded unsharded storages of ``params`` and their copy-out views."""

    def __init__(self, params: Sequence[FSDPParam]) -> None:
        self.params = params
        # (storage, its full size in bytes), once every parameter has allocated.
        self._storages: list[tuple[torch.UntypedStorage, int]] | None = None
        # Per world size: the copy-out's outputs, every parameter's views in order.
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._listable = all(p.extension is None for p in params)

    def outputs(self, world_size: int) -> list[torch.Tensor]:
        """Every parameter's storage allocated (again, if freed); the outputs
        the copy-out writes for an all-gather over ``world_size`` ranks."""
        outputs = self._outputs.get(world_size)
        if outputs is None or self._storages is None:
            outputs = [out for p in self.params for out in p.all_gather_outputs(world_size)]
            if self._listable:
                self._outputs[world_size] = outputs
                allocated = [p.padded_storage for p in self.params]  # each one: just allocated
                self._storages = cast("list[tuple[torch.UntypedStorage, int]]", allocated)
            return outputs
        for storage, nbytes in self._storages:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        return outputs

    def free(self) -> None:
        if self._storages is None:
            for param in self.params:
                param.free_unsharded()
            return
        for storage, _ in self._storages:
            storage.resize_(0)

    def forget(self) -> None:
        """The parameters changed (dtype, adopted tensors): ask them again."""
        self._storages = None
        self._outputs.clear()
