"""Elementwise torch optimizers step the local tensors of sharded parameters.

An elementwise optimizer (Adam, AdamW, SGD...) computes each element of a
parameter from the same element of its gradient and of its state, so running
its math on this rank's local tensors is the whole step. On DTensors every
``foreach`` op goes through dispatch and sharding propagation once per op per
list: several times the math on models with many small tensors
(pytorch#134191, #109477; docs/performance.md, "Host time").

How: at an optimizer's first step, optimizer_hooks.py puts a
``LocalInitGroup`` in place of the optimizer's ``_init_group`` (an override,
not a call: private_api.py says why). The optimizer's own ``_init_group``
gathers the parameters, gradients and states as it always does; states are
made from the DTensor parameters, so they stay DTensors and
``state_dict()``, DCP and checkpoints see what they saw before. Then, before
the optimizer's math runs on them, ``private_api.step_local_tensors`` puts
each DTensor in those lists by its local tensor, all or nothing per param
group: a row whose DTensors are not laid out like its parameter (a Partial
gradient, a state loaded with other placements) keeps the whole group on
DTensors for that step, which is right, only slower.

Checking each row costs more than an elementwise step on small tensors, so a
group of DTensor parameters whose lists hold the same layouts as at a step
before (its DTensors' specs are the same objects, its plain scalars the same
tensors) skips it: that comparison, and the swap, are each one ``map`` over
a list. A group that mixes plain and DTensor parameters is checked every
step.

Only the classes in ``ELEMENTWISE`` (exact classes: a subclass may override
``step`` with math that is not elementwise, as LARS does over SGD). Others
(Adafactor, torch's Muon, LBFGS, anything of the user's) keep the DTensor
path; so do compiled steps and ``differentiable=True``.

SGD writes its momentum buffers back into its state after its math, from the
lists it stepped, so under the local tensors' keys: ``restore_state`` then
drops those entries, and wraps the buffers a step made as DTensors under the
parameters' keys (the buffers it already had are DTensors there, updated in
place through their local tensors).
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch

from .private_api import (
    dtensor_from_local_no_grad,
    dtensor_spec_of,
    dtensor_specs,
    locals_in_place,
    step_local_tensors,
)

ELEMENTWISE: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Adadelta,
        torch.optim.ASGD,
        torch.optim.Rprop,
    }
)

# The optimizers whose step writes one of the lists _init_group filled back
# into their state: (that list's position among _init_group's lists, the key).
_WRITTEN_BACK: dict[type[torch.optim.Optimizer], tuple[int, str]] = {
    torch.optim.SGD: (2, "momentum_buffer"),
}


# What a group's lists held when they were last checked, per list: the specs
# of its DTensors, the scalars themselves, or None (an empty list).
_Layouts = list[tuple[bool, list[Any]] | None]


def _layouts(lists: tuple[list[Any], ...]) -> _Layouts:
    layouts: _Layouts = []
    for tensors in lists:
        if not tensors:
            layouts.append(None)
        elif (specs := dtensor_specs(tensors)) is not None:
            layouts.append((True, specs))
        else:
            layouts.append((False, list(tensors)))
    return layouts


def _same(now: _Layouts, before: _Layouts) -> bool:
    if len(now) != len(before):
        return False
    for a, b in zip(now, before, strict=True):
        if a is None or b is None:
            if a is not b:
                return False
        elif a[0] != b[0] or len(a[1]) != len(b[1]) or not all(map(operator.is_, a[1], b[1])):
            return False
    return True


def _step_locally(lists: tuple[list[Any], ...], checked: dict[int, _Layouts], key: int) -> bool:
    """``step_local_tensors``, skipping its checks where they passed before."""
    layouts = _layouts(lists)
    before = checked.get(key)
    if before is not None and _same(layouts, before):
        for tensors, layout in zip(lists, layouts, strict=True):
            if layout is not None and layout[0]:
                locals_in_place(tensors)
        return True
    if not step_local_tensors(lists):
        checked.pop(key, None)
        return False
    if layouts[0] is not None and layouts[0][0]:  # every parameter a DTensor
        checked[key] = layouts
    return True


class LocalInitGroup:
    """Stands in for an elementwise optimizer's ``_init_group``: the
    optimizer's own, then its lists made local."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # A weak reference: the optimizer holds this object.
        self._optimizer = weakref.ref(optimizer)
        self._init_group = type(optimizer)._init_group  # type: ignore[attr-defined]
        self._written_back = _WRITTEN_BACK.get(type(optimizer))
        # Per group stepped locally this step, for restore_state: its
        # parameters as DTensors and as the step saw them, and the written-back
        # list before (DTensors) and as the step left it.
        self._to_restore: list[tuple[list[Any], list[Any], list[Any], list[Any]]] = []
        # Per param group (by id): the layouts its lists had when last checked.
        self._checked: dict[int, _Layouts] = {}

    def __call__(self, group: dict[str, Any], *lists: list[Any]) -> Any:
        optimizer = self._optimizer()
        result = self._init_group(optimizer, group, *lists)
        if group.get("differentiable") or torch.compiler.is_compiling():
            return result
        index = self._written_back[0] if self._written_back is not None else None
        if index is None or not lists[index]:  # SGD without momentum has no buffers
            _step_locally(lists, self._checked, id(group))
            return result
        params, before = list(lists[0]), list(lists[index])
        if _step_locally(lists, self._checked, id(group)):
            self._to_restore.append((params, lists[0], before, lists[index]))
        return result

    def restore_state(self) -> None:
        """After the step: the written-back state entries are DTensors again."""
        if not self._to_restore:
            return
        optimizer = self._optimizer()
        assert self._written_back is not None and optimizer is not None
        _, key = self._written_back
        state = optimizer.state
        for params, stepped, before, after in self._to_restore:
            # The entries the step made under the local tensors' keys; the
            # parameters' own entries still hold their DTensors.
            for param, local in zip(params, stepped, strict=True):
                if local is not param:
                    state.pop(local, None)
            if any(old is None for old in before):  # buffers the step made
                for param, local, old, new in zip(params, stepped, before, after, strict=True):
                    if old is None and new is not None and local is not param:
                        wrapped = dtensor_from_local_no_grad(new, dtensor_spec_of(param))
                        state[param][key] = wrapped
        self._to_restore.clear()


def install_local_step(optimizer: torch.optim.Optimizer) -> LocalInitGroup | None:
    """The optimizer's LocalInitGroup, put in place at the first call (None
    for an optimizer that is not elementwise)."""
    current = optimizer.__dict__.get("_init_group")
    if isinstance(current, LocalInitGroup):
        return current
    if type(optimizer) not in ELEMENTWISE or current is not None:
        return None
    local = LocalInitGroup(optimizer)
    optimizer.__dict__["_init_group"] = local
    return local
