"""The two states of a param group (its training state and what its modules
hold), and the mark that keeps fsdp2's hooks eager under ``torch.compile``."""

import functools
import sys
from collections.abc import Callable
from enum import Enum, auto
from typing import Any

import torch

# How dynamo's graph-break reports name a call to a hook marked by ``eager_hook``.
EAGER_HOOK_REASON = "fsdp2 hooks run eagerly"


_EAGER_HOOKS: list[Callable] = []  # marked by eager_hook, wrapped by arm_eager_hooks


def eager_hook(hook: Callable) -> Callable:
    """Marks one of fsdp2's hooks to run eagerly under ``torch.compile``, as
    torch's fully_shard does: a compiled block calls it as an opaque function.

    [Note: hooks under torch.compile]
    Traced, the hooks would guard graphs on state that changes every step, and
    the unsharded parameter would share its buffer's version counter, so the
    backward all-gather would trip autograd's in-place check. docs/design.md,
    "Under torch.compile", tells the whole story.

    The mark takes effect when the first ``FSDPState`` is made
    (``arm_eager_hooks``): ``torch.compiler.disable`` imports dynamo, half a
    second that ``import fsdp2`` should not cost a process that never shards.
    """
    _EAGER_HOOKS.append(hook)
    return hook


@functools.cache
def arm_eager_hooks() -> None:
    """Replaces every hook marked by ``eager_hook``, on its class or module,
    by the hook wrapped in ``torch.compiler.disable``: once, before the first
    state registers any hook (registrations bind the wrapped ones)."""
    for hook in _EAGER_HOOKS:
        owner_path, _, name = hook.__qualname__.rpartition(".")
        owner: Any = sys.modules[hook.__module__]
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part)
        disabled: Any = torch.compiler.disable(hook, reason=EAGER_HOOK_REASON)
        if isinstance(vars(owner).get(name), staticmethod):
            disabled = staticmethod(disabled)
        setattr(owner, name, disabled)


class TrainingState(Enum):
    """Where a param group is in the current iteration."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedState(Enum):
    """What the owning modules hold: sharded DTensors or unsharded views.

    SHARDED_POST_FORWARD: resharded after forward over a smaller group
    (``reshard_after_forward=<int>``); the modules hold the sharded DTensors and
    the group keeps a bigger shard so backward all-gathers only inside that group.
    """

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()
