"""What torch's own libraries read of torch FSDP2's private state, answered by fsdp2.

torch's ``fully_shard`` keeps its engine behind private names, and some of
torch's libraries reach for them. Once ``install_as_torch_fsdp()`` has put
fsdp2's ``fully_shard`` and ``FSDPModule`` under torch's names, those libraries
hold fsdp2's modules and read the same names there. This file is the whole of
that surface: each name below says which torch file and line reads it (torch
2.13) and what fsdp2 runs for it. The engine itself never uses these names.

``torch.distributed.pipelining`` (stage.py, ``perform_reduce_grad``, the
schedule's REDUCE_GRAD action once per step, after the last microbatch's
backward of a stage)::

    state = fully_shard.state(stage.submod)            # stage.py:1182
    for s in state._state_ctx.all_states:              # stage.py:1184
        for group in s._fsdp_param_groups:             # stage.py:1185
            group.post_backward()                      # stage.py:1186
    state._root_post_backward_final_callback()         # stage.py:1191

RL post-training clients (verl 0.9.1) read three more, once
``install_as_torch_fsdp()`` has made fsdp2's modules torch's:

- verl/utils/fsdp_utils.py:846-852, ``set_reshard_after_forward`` (verl's copy
  of torch's setter for torch < 2.8): ``module._get_fsdp_state()``, then
  ``state._auto_reshard_after_forward = False`` and, on
  ``state._fsdp_param_group``, ``post_forward_mesh_info = _get_post_forward_
  mesh_info(flag, group.mesh_info)`` (torch's function: the group's mesh info
  for True, None for False);
- verl/workers/engine/veomni/utils.py:59-67 and automodel/utils.py:201-209,
  the engines' model offload: torch's ``_fsdp_state._get_module_fsdp_state``
  (answered for fsdp2's modules by the install, ``get_module_fsdp_state``
  below), then ``state._fsdp_param_group._training_state =
  TrainingState.IDLE`` (torch's enum) before ``model.reshard()``.

Every other name pipelining uses is public (``FSDPModule.unshard``,
``reshard``, ``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``, ``UnshardHandle.wait``).

One thing pipelining does gives FSDP no hook at all: the zero-bubble
schedules' split backward (see [Note: split backward]). For it,
``install_as_torch_fsdp()`` wraps one method of pipelining's stage
(``adapt_pipelining``); it acts on fsdp2's stages only.

docs/usage.md, "What torch's libraries read of FSDP", lists the other torch
readers of FSDP2 internals and what fsdp2 does for each.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.root import RootContext


class StateContextView:
    """``state._state_ctx``: torch's object shared by every state under one
    root, of which torch's libraries read ``all_states`` only."""

    __slots__ = ("_root_ctx",)

    def __init__(self, root_ctx: RootContext) -> None:
        self._root_ctx = root_ctx

    @property
    def all_states(self) -> list[Any]:
        """The states under the root, the root's first (pre-order); empty
        before the root's first forward, when nothing ran to be reduced."""
        return list(self._root_ctx.states)


class ModuleReadByTorch:
    """The names clients read on an ``FSDPModule`` (module.py)."""

    def _get_fsdp_state(self) -> Any:  # verl/utils/fsdp_utils.py:846
        """The module's state, as torch's ``FSDPModule._get_fsdp_state``."""
        return self.__dict__["_fsdp_state"]


def get_module_fsdp_state(torch_lookup: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torch's ``_fsdp_state._get_module_fsdp_state`` (put in its place by
    ``install_as_torch_fsdp()``): the fsdp2 state of an fsdp2 module, else what
    torch's ``torch_lookup`` finds (its own states, or None)."""

    @functools.wraps(torch_lookup)
    def _get_module_fsdp_state(module: Any) -> Any:  # veomni/utils.py:62, automodel/utils.py:204
        state = getattr(module, "__dict__", {}).get("_fsdp_state")
        return state if isinstance(state, StateReadByTorch) else torch_lookup(module)

    return _get_module_fsdp_state


class StateReadByTorch:
    """The names torch's libraries and clients read on a ``FSDPState`` (state.py)."""

    root_ctx: RootContext
    param_groups: list[Any]
    reshard_after_forward_arg: bool | int | None

    @property
    def _fsdp_param_group(self) -> ParamGroupView | None:  # fsdp_utils.py:848, veomni/utils.py:65
        """The state's one group (None without parameters), as torch's property;
        an AssertionError, as torch's, where ``shard_placement_fn`` made several."""
        if len(self.param_groups) > 1:
            raise AssertionError(
                f"fsdp2: this fully_shard call made {len(self.param_groups)} param groups "
                "(shard_placement_fn put parameters on several meshes); read "
                "_fsdp_param_groups instead of _fsdp_param_group."
            )
        return self._fsdp_param_groups[0] if self.param_groups else None

    @property
    def _auto_reshard_after_forward(self) -> bool:  # verl/utils/fsdp_utils.py:847
        """Whether the root's rule decides (``fully_shard(reshard_after_forward=None)``:
        the root keeps its parameters after forward, the others reshard)."""
        return self.reshard_after_forward_arg is None

    @_auto_reshard_after_forward.setter
    def _auto_reshard_after_forward(self, auto: bool) -> None:
        if auto:
            self.reshard_after_forward_arg = None
        elif self.reshard_after_forward_arg is None:  # keep what the groups do now
            self.reshard_after_forward_arg = any(g.reshard_after_forward for g in self.param_groups)

    @property
    def _state_ctx(self) -> StateContextView:  # read at pipelining/stage.py:1184
        return StateContextView(self.root_ctx)

    @property
    def _fsdp_param_groups(self) -> list[ParamGroupView]:  # pipelining/stage.py:1185
        """The state's groups, each with torch's ``post_backward()``."""
        return [ParamGroupView(group, self.root_ctx) for group in self.param_groups]

    def _root_post_backward_final_callback(self) -> None:  # pipelining/stage.py:1191
        """The end of backward that the autograd engine runs after each
        backward (``RootContext.end_backward``): here called by a pipeline
        schedule after its last microbatch. It finishes every reduction still
        in flight and returns the groups to idle, sharded where they reshard
        after backward."""
        _weight_halves_to_run.pop(self, None)
        for group in self.root_ctx.groups:
            group.held_for_weight_grads = False
        self.root_ctx.end_backward()


class MeshInfoView:
    """A group's mesh info under torch's ``FSDPMeshInfo`` names: what torch's
    ``_get_post_forward_mesh_info`` reads (verl's setter passes it one)."""

    __slots__ = ("_info",)

    def __init__(self, info: Any) -> None:
        self._info = info

    mesh = property(lambda self: self._info.mesh)
    shard_mesh_dim = property(lambda self: self._info.shard_axis)
    shard_mesh_size = property(lambda self: self._info.shard_world_size)
    shard_mesh_rank = property(lambda self: self._info.shard_rank)
    shard_process_group = property(lambda self: self._info.shard_group)
    replicate_mesh_size = property(lambda self: self._info.replicate_world_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshInfoView) and other._info is self._info

    def __hash__(self) -> int:
        return id(self._info)


class ParamGroupView:
    """One group as torch's libraries and clients see it."""

    __slots__ = ("_group", "_root_ctx")

    def __init__(self, group: Any, root_ctx: RootContext) -> None:
        self._group = group
        self._root_ctx = root_ctx

    def post_backward(self, *unused: Any) -> None:  # pipelining/stage.py:1186
        """The group's post-backward (``ReductionPipeline.post_backward``): takes
        the gradients accumulated since the last reduction (the microbatches'
        unsynced sums), starts their reduce-scatter and reshards. Safe on a
        group that did not run (nothing to reduce) and a second time (the
        gradients were taken the first)."""
        self._root_ctx.reductions.post_backward(self._group)

    @property
    def mesh_info(self) -> MeshInfoView:  # verl/utils/fsdp_utils.py:850
        return MeshInfoView(self._group.mesh_info)

    @property
    def post_forward_mesh_info(self) -> MeshInfoView | None:
        """torch's encoding of ``reshard_after_forward``: the group's mesh info
        (True), the smaller group's (an int), or None (False)."""
        group = self._group
        if group.post_forward_mesh_info is not None:
            return MeshInfoView(group.post_forward_mesh_info)
        return self.mesh_info if group.reshard_after_forward else None

    @post_forward_mesh_info.setter
    def post_forward_mesh_info(self, value: Any) -> None:  # verl/utils/fsdp_utils.py:849
        group = self._group
        if value is None or value == self.mesh_info:
            group.choose_reshard_after_forward(value is not None)
            group.post_forward_mesh_info = None  # torch's encoding: not a smaller group
        elif value != self.post_forward_mesh_info:
            raise NotImplementedError(
                "fsdp2: a param group's post_forward_mesh_info can be set to its own "
                "mesh_info (reshard after forward) or None (keep unsharded); resharding "
                "to a smaller group is chosen in fully_shard(reshard_after_forward=N)."
            )

    @property
    def _training_state(self) -> Any:
        return self._group.training_state

    @_training_state.setter
    def _training_state(self, value: Any) -> None:  # verl/workers/engine/veomni/utils.py:67
        """Takes torch's ``TrainingState`` (or fsdp2's) by its name."""
        self._group.training_state = type(self._group.training_state)[value.name]

    def __repr__(self) -> str:
        return f"ParamGroupView({self._group!r})"


# [Note: split backward]
# The zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
# split a microbatch's backward in two. The input half is ``autograd.grad`` of
# the stage's inputs (stage_backward_input, pipelining/_backward.py): it runs
# fsdp2's hooks but accumulates no parameter gradient, and it looks up the
# gradient accumulators of ``stage.submod.parameters()`` before it starts.
# The weight half runs later, after other microbatches' forwards, from graph
# nodes the input half kept (stage_backward_weight): it runs none of fsdp2's
# hooks and sets ``.grad`` on the parameters the stage's modules hold then.
# Both halves therefore need the unsharded parameters on the modules when
# they begin (the same objects the graph saved, holding their data), while a
# group that reshards after forward would hold its sharded ones. So on a
# stage of fsdp2 modules, the input half starts with every group of the stage
# unsharded and held so (``FSDPParamGroup.held_for_weight_grads``: forwards do
# not reshard it) until the stage's last pending weight half has run; groups
# that reshard after forward are resharded then. The gradients both halves
# leave are summed without sync as for any microbatch and reduced once, at
# the schedule's REDUCE_GRAD. torch's own fully_shard has no such step: with
# reshard_after_forward=True its stages raise or silently drop weight
# gradients under these schedules.

# Weight halves still to run, per stage root state (input halves minus weight halves).
_weight_halves_to_run: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def adapt_state_lookup() -> list[tuple[Any, str, object, object]]:
    """Puts ``get_module_fsdp_state`` in place of torch's
    ``_fsdp_state._get_module_fsdp_state``, for clients that import it when
    they run (verl's engines); torch's own modules bound it at their import and
    keep torch's. Returns what it replaced, as ``adapt_pipelining`` does."""
    state_module: Any = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_state")
    original = state_module._get_module_fsdp_state
    if getattr(original, "__wrapped__", None) is not None:
        return []  # already replaced by an install not undone
    lookup = get_module_fsdp_state(original)
    state_module._get_module_fsdp_state = lookup
    return [(state_module, "_get_module_fsdp_state", original, lookup)]


def adapt_pipelining() -> list[tuple[Any, str, object, object]]:
    """Wraps ``_PipelineStageBase.backward_maybe_with_nosync`` (pipelining/
    stage.py:781, the one call every backward of a stage goes through) so
    that the halves of a split backward find an fsdp2 stage unsharded; see
    [Note: split backward]. Returns what it replaced, as
    ``(owner, name, torch's, fsdp2's)`` for ``TorchFSDPNames.undo``."""
    from torch.distributed.pipelining import stage as pipelining_stage

    owner = pipelining_stage._PipelineStageBase
    original = owner.backward_maybe_with_nosync
    if getattr(original, "__wrapped__", None) is not None:
        return []  # already wrapped by an install not undone
    wrapped = _split_backward_aware(original, pipelining_stage)
    owner.backward_maybe_with_nosync = wrapped  # type: ignore[method-assign]
    return [(owner, "backward_maybe_with_nosync", original, wrapped)]


def _split_backward_aware(original: Callable, pipelining_stage: Any) -> Callable:
    @functools.wraps(original)
    def backward_maybe_with_nosync(
        stage: Any, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        state = _fsdp2_state(stage.submod, pipelining_stage)
        if state is None or backward_type not in ("input", "weight"):
            return original(stage, backward_type, bwd_kwargs, last_backward)
        groups = state.root_ctx.groups
        for group in groups:  # all-gathers issued together, then waited for
            group.unshard()
        for group in groups:
            group.wait_for_unshard()
        if backward_type == "input":
            for group in groups:
                group.held_for_weight_grads = True
            _weight_halves_to_run[state] = _weight_halves_to_run.get(state, 0) + 1
            return original(stage, backward_type, bwd_kwargs, last_backward)
        result = original(stage, backward_type, bwd_kwargs, last_backward)
        left = _weight_halves_to_run.get(state, 1) - 1
        _weight_halves_to_run[state] = left
        if left <= 0:
            for group in groups:
                group.held_for_weight_grads = False
                if group.reshard_after_forward or group.post_forward_mesh_info is not None:
                    group.reshard()
        return result

    return backward_maybe_with_nosync


def _fsdp2_state(module: Any, pipelining_stage: Any) -> StateReadByTorch | None:
    """The fsdp2 state of a stage's module, found as pipelining finds torch's
    (its ``FSDPModule`` and ``fully_shard``, which the install made fsdp2's)."""
    if not isinstance(module, pipelining_stage.FSDPModule):
        return None
    state = pipelining_stage.fully_shard.state(module)
    return state if isinstance(state, StateReadByTorch) else None
