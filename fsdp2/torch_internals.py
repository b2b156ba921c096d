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

Every other name pipelining uses is public (``FSDPModule.unshard``,
``reshard``, ``set_requires_gradient_sync``, ``set_reshard_after_backward``,
``set_is_last_backward``, ``UnshardHandle.wait``). docs/usage.md, "What
torch's libraries read of FSDP", lists the other torch readers of FSDP2
internals and what fsdp2 does for each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .root import RootContext


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


class StateReadByTorch:
    """The names torch's libraries read on a ``FSDPState`` (state.py)."""

    root_ctx: RootContext
    param_groups: list[Any]

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
        self.root_ctx.end_backward()


class ParamGroupView:
    """One group as torch's libraries see it: ``post_backward()``."""

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

    def __repr__(self) -> str:
        return f"ParamGroupView({self._group!r})"
