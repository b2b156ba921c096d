"""When a group's gradients are complete: ``PostBackward``, an autograd
Function on the inputs of each module call of the group.

Its backward runs after every parameter gradient of the module has been
accumulated (the engine runs AccumulateGrad nodes as soon as they are
ready, ahead of ordinary nodes), so the module's gradients are complete
there; the group's are once every module call of its forward has got there
(``PostBackwardCount``). A call whose inputs need no grad has no node to
say so: the final callback runs the group's post-backward instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..base.private_api import functorch_transforms_active, map_tensors, tensors_in
from .states import eager_hook


class PostBackwardCount:
    """The ``PostBackward`` nodes of one forward of a group: one per module
    call whose inputs required grad (a group of several modules has one call
    per module). The last of them to run says the gradients are complete."""

    def __init__(self) -> None:
        self.registered = 0
        self.ran = 0
        self.final_callback_only = False

    def node_ran(self) -> bool:
        """Counts one node's backward; True if it was the last of the forward."""
        self.ran += 1
        if self.ran < self.registered:
            return False
        self.ran = 0  # a second backward through the same graph counts again
        return not self.final_callback_only


def register_post_backward(
    post_backward: Callable[[], None], count: PostBackwardCount, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """Wraps the inputs of one module call that require grad in ``PostBackward``,
    which runs ``post_backward`` once the last call of ``count`` has had its
    backward."""
    inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not inputs:
        count.final_callback_only = True  # post-backward runs from the final callback
        return args, kwargs
    count.registered += 1
    function = TransformablePostBackward if functorch_transforms_active() else PostBackward
    outputs = function.apply(post_backward, count, *inputs)
    wrapped = {id(t): out for t, out in zip(inputs, outputs, strict=True)}
    return map_tensors((args, kwargs), lambda t: wrapped.get(id(t), t))


class PostBackward(torch.autograd.Function):
    """Identity on a group's forward inputs whose backward runs the group's
    post-backward, once per forward (see ``PostBackwardCount``).

    ``forward`` takes ``ctx`` (the older style): ``Function.apply`` then calls
    it directly, where a Function with ``setup_context`` binds its arguments
    through ``inspect.signature`` on every module call.
    """

    @staticmethod
    def forward(ctx, post_backward, count: PostBackwardCount, *inputs: torch.Tensor):
        ctx.post_backward, ctx.count = post_backward, count
        return inputs

    @staticmethod
    @eager_hook
    def backward(ctx, *grads: torch.Tensor):
        if ctx.count.node_ran():
            ctx.post_backward()
        return (None, None, *grads)


class TransformablePostBackward(torch.autograd.Function):
    """``PostBackward`` under functorch transforms (``torch.func.jvp`` through a
    sharded module), which require ``setup_context``, ``jvp`` and a vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(post_backward, count: PostBackwardCount, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Any) -> None:
        ctx.post_backward, ctx.count = inputs[0], inputs[1]

    backward = staticmethod(PostBackward.backward)

    @staticmethod
    def jvp(ctx, post_backward_tangent: None, count_tangent: None, *input_tangents: torch.Tensor):
        # Forward-mode: an identity; post-backward belongs to reverse mode only.
        return input_tangents
