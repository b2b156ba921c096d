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
the optimizer's math runs on them, ``private_dist.step_local_tensors`` puts
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

The optimizer's own ``_init_group`` costs more on DTensor parameters than on
plain ones (each ``.grad``, ``is_complex``, ``is_sparse`` on a tensor
subclass), about twice the elementwise math on small tensors. So after it
has run once on a group whose parameters are all DTensors, a ``_Refill``
keeps where each of its lists came from (the parameter, its gradient, or a
key of its state; no tensor) and the next steps fill the lists from there
with one ``map`` per list, without it, while what it would see is the same:
the same parameters (their specs the same objects, so the same dtypes), each
with a gradient, each state holding the keys, and the same option flags
(``_options``: numbers by being zero, as SGD's momentum). Anything else (a
gradient missing, a state not made yet or dropped, new param groups from
``load_state_dict``) runs the optimizer's own again and learns again. The
lists are read anew every step, so states loaded in place or replaced are
seen.

Only the classes in ``ELEMENTWISE`` (exact classes: a subclass may override
``step`` with math that is not elementwise, as LARS does over SGD). Others
(Adafactor, torch's Muon, LBFGS, anything of the user's) keep the DTensor
path; so do compiled steps and ``differentiable=True``.

SGD writes its momentum buffers back into its state after its math, from the
lists it stepped, so under the local tensors' keys (made before the step,
one dict shared by all: a new dict per parameter per step costs more than the
write-back): ``restore_state`` then drops those entries, and wraps the
buffers a step made as DTensors under the parameters' keys (the buffers it
already had are DTensors there, updated in place through their local
tensors).
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, NamedTuple

import torch

from ..base.private_dist import (
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


# Where a list of _init_group's comes from, row by row: the parameter, its
# gradient, or an entry of its optimizer state (by key).
_PARAM = "<parameter>"
_GRAD = "<grad>"
_GRAD_OF = operator.attrgetter("grad")
_NOT_NONE = functools.partial(operator.is_not, None)


class _Refill(NamedTuple):
    """What the optimizer's ``_init_group`` put in a param group's lists, as
    sources to read again: it holds no tensor, only where each came from."""

    sources: tuple[str | None, ...]  # per list: _PARAM, _GRAD, a state key; None if empty
    options: tuple[Any, ...]  # the group's options that _init_group branches on
    param_specs: list[Any]  # the parameters' DTensor specs (so their dtypes)
    result: Any  # what _init_group returned (has_complex, has_sparse_grad)


def _option_kind(value: Any) -> Any:
    """What of an option's value an ``_init_group`` can branch on: flags as
    they are, numbers by being zero (SGD's and RMSprop's momentum), tensors
    by identity (a tensor ``lr`` refused with foreach)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, (tuple, list)):
        return tuple(map(_option_kind, value))
    if isinstance(value, torch.Tensor):
        return id(value)
    return type(value)


def _options(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple((k, _option_kind(v)) for k, v in group.items() if k != "params")


def _learn(
    lists: tuple[list[Any], ...], state: dict[Any, Any], options: tuple[Any, ...], result: Any
) -> _Refill | None:
    """The sources of ``lists`` as ``_init_group`` just filled them (DTensors,
    before the swap), or None if a list is not read the same way in every row
    or a parameter is not a DTensor."""
    params = lists[0]
    param_specs = dtensor_specs(params)
    if not params or param_specs is None:
        return None
    dicts = [state.get(p) for p in params]
    sources: list[str | None] = []
    for index, tensors in enumerate(lists):
        if not tensors:
            sources.append(None)
            continue
        if index == 0:
            sources.append(_PARAM)
            continue
        if len(tensors) != len(params):
            return None
        first = tensors[0]
        if first is not None and first is params[0].grad:
            source: str | None = _GRAD
            again = list(map(_GRAD_OF, params))
        else:
            source = next(
                (k for k, v in (dicts[0] or {}).items() if v is first and first is not None), None
            )
            if source is None:
                return None
            try:
                again = list(map(operator.itemgetter(source), dicts))  # type: ignore[arg-type]
            except (KeyError, TypeError):
                return None
        if not all(map(operator.is_, again, tensors)):
            return None
        sources.append(source)
    return _Refill(tuple(sources), options, param_specs, result)


def _refill(
    refill: _Refill, group: dict[str, Any], lists: tuple[list[Any], ...], state: Any
) -> bool:
    """Fills ``lists`` from ``refill``'s sources, as ``_init_group`` would
    (False, lists untouched, where it might not: a parameter changed or has
    no gradient, a state it lacks)."""
    params = group["params"]
    specs = dtensor_specs(params)
    if (
        specs is None
        or len(specs) != len(refill.param_specs)
        or not all(map(operator.is_, specs, refill.param_specs))
    ):
        return False
    grads = list(map(_GRAD_OF, params))
    if not all(map(_NOT_NONE, grads)):
        return False
    dicts = list(map(state.get, params))
    filled: list[list[Any]] = []
    for source in refill.sources:
        if source is None:
            filled.append([])
        elif source is _PARAM:
            filled.append(list(params))
        elif source is _GRAD:
            filled.append(grads)
        else:
            try:
                filled.append(list(map(operator.itemgetter(source), dicts)))
            except (KeyError, TypeError):  # a state missing (None) or without this entry
                return False
    for tensors, values in zip(lists, filled, strict=True):
        tensors[:] = values
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
        # Per param group (by id): where _init_group's lists come from.
        self._refills: dict[int, _Refill] = {}

    def __call__(self, group: dict[str, Any], *lists: list[Any]) -> Any:
        optimizer = self._optimizer()
        assert optimizer is not None  # it is calling this
        if group.get("differentiable") or torch.compiler.is_compiling():
            return self._init_group(optimizer, group, *lists)
        key = id(group)
        options = _options(group)
        refill = self._refills.get(key)
        if (
            refill is not None
            and refill.options == options
            and _refill(refill, group, lists, optimizer.state)
        ):
            result = refill.result
        else:
            result = self._init_group(optimizer, group, *lists)
            refill = _learn(lists, optimizer.state, options, result)
            if refill is None:
                self._refills.pop(key, None)
            else:
                self._refills[key] = refill
        index = self._written_back[0] if self._written_back is not None else None
        if index is None or not lists[index]:  # SGD without momentum has no buffers
            _step_locally(lists, self._checked, key)
            return result
        params, before = list(lists[0]), list(lists[index])
        if _step_locally(lists, self._checked, key):
            self._to_restore.append((params, lists[0], before, lists[index]))
            if not any(map(operator.is_, params, lists[0])):
                # The write-back's entries, made ahead as one dict they all share:
                # a dict made per parameter per step (the state's default) costs
                # more than the write-back, and sets off the garbage collector.
                optimizer.state.update(zip(lists[0], itertools.repeat({})))
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
            if any(map(operator.is_, params, stepped)):  # plain ones keep theirs
                for param, local in zip(params, stepped, strict=True):
                    if local is not param:
                        state.pop(local, None)
            else:
                list(map(state.pop, stepped, itertools.repeat(None)))
            if not all(map(_NOT_NONE, before)):  # buffers the step made
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
