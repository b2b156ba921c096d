"""The private torch APIs fsdp2 relies on outside torch.distributed: the
autograd engine, dynamo and compiled autograd, the profiler, functorch,
pytree, foreach kernels and module internals. private_dist.py holds
torch.distributed's (DTensor's insides, meshes, c10d); the two files are the
only places fsdp2 reaches into torch.

Each wrapper says why no public API does the job; when torch grows a public
equivalent, only these files change. Three private names are used elsewhere,
as overrides rather than calls: ``FSDPModule._apply`` (api/module.py) extends
``nn.Module._apply``, which every ``model.to()``, ``.double()`` and
``to_empty()`` goes through, so the group adopts the converted shards;
``nn.Module._parameters`` is reached through ``module_parameters`` below; and
``Optimizer._init_group`` (optim/local_step.py) is replaced on torch's elementwise
optimizers, the one point between gathering a group's tensors and the math,
which no public hook sees (a step pre-hook swapping the lists would rebuild
every state entry twice per step and break ``optimizer.state`` between).
"""

import contextlib
import copy
import dataclasses
import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch.autograd import Variable

_T = TypeVar("_T")


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the autograd engine finishes the current backward.

    Why private: the autograd engine has no public "end of backward" hook. A
    hook on the loss or on parameters cannot tell when *every* gradient of the
    pass has been produced, and the final callback is where outstanding
    reduce-scatters are waited for and groups whose post-backward never ran are
    finished.
    """
    Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread, e.g.
    a forward recomputed for activation checkpointing.

    Why private: the engine exposes no public "am I inside backward" query;
    ``torch._C._current_graph_task_id`` is what torch's own fully_shard uses.
    """
    return torch._C._current_graph_task_id() != -1


def in_compiled_autograd() -> bool:
    """Whether this backward runs under compiled autograd
    (``torch._dynamo.config.compiled_autograd``, ``compiled_autograd._enable``).

    Why private: the flag lives only in ``torch._dynamo.compiled_autograd``;
    read from ``sys.modules`` so that asking never imports dynamo (compiled
    autograd has imported it whenever it is on).
    """
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(module.in_compiled_autograd_region)


def never_a_compiled_frame(function: Callable, *, nor_its_callees: bool = False) -> Callable:
    """Returns ``function``, marked so that dynamo never starts a compiled
    frame at it (nor, with ``nor_its_callees``, at what it calls); a compiled
    frame that calls it still inlines it. Why private: ``torch._dynamo.skip``
    also forbids the inlining and imports dynamo; this sets, through the C
    extension, the frame setting that ``skip`` writes."""
    callees = _FrameAction.SKIP if nor_its_callees else _FrameAction.DEFAULT
    set_code_exec_strategy(function.__code__, _FrameExecStrategy(_FrameAction.SKIP, callees))
    return function


_NOT_PROFILING = contextlib.nullcontext()


def profiled(what: str, detail: str = "") -> contextlib.AbstractContextManager:
    """A profiler range ``fsdp2::<what> (<detail>)``, only while a profiler runs.

    Why private: ``torch.profiler.record_function`` costs time even with no
    profiler running, and the engine opens a dozen ranges per group per step
    (docs/performance.md); ``torch._C._autograd._profiler_enabled`` tells
    whether anyone listens.
    """
    if not torch._C._autograd._profiler_enabled():
        return _NOT_PROFILING
    return torch.profiler.record_function(
        f"fsdp2::{what} ({detail})" if detail else f"fsdp2::{what}"
    )


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (``torch.func.jvp``, ``vmap``...) is active.

    Why private: torch has no public query for it; ``outside_functorch`` below
    needs the same one.
    """
    return torch._C._are_functorch_transforms_active()


def outside_functorch(method: Callable) -> Callable:
    """Runs ``method`` with functorch's transforms (``torch.func.jvp``, ``vmap``...)
    switched off: the all-gather and the parameter swaps are bookkeeping, not
    part of the function being transformed (inside a transform, even
    ``DTensor.to_local()`` would refuse to run).

    Why private: torch has no public way to step outside an active functorch
    transform; ``torch._C._DisableFuncTorch`` is what torch's own fully_shard uses.
    """

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return wrapper


def without_grad(function: Callable) -> Callable:
    """``function`` run with grad recording off, as under ``@torch.no_grad()``.

    Why private: ``torch.no_grad()`` as a decorator builds and enters a new
    context manager at every call (1.3 us on this CPU), and the collectives'
    per-step functions that need it run eight times per group per step;
    ``torch._C._set_grad_enabled`` is the switch that context manager sets
    (0.2 us).
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(enabled)

    return wrapper


def _is_plain_dataclass(x: Any) -> bool:
    """A dataclass instance that pytree does not know how to flatten."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and type(x) not in pytree.SUPPORTED_NODES
    )


# Leaves that hold no tensor, as in a module call's arguments (``x, mask=None``).
_SCALARS = frozenset({int, float, bool, str, type(None)})


class _NotPlain(Exception):
    """A tree the fast paths below leave to pytree (a namedtuple, a registered
    class, a dataclass, a subclass of a container...)."""


def _plain_tensors(tree: Any, into: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _plain_tensors(item, into)
    elif kind is dict:
        for item in tree.values():
            _plain_tensors(item, into)
    elif isinstance(tree, torch.Tensor):
        into.append(tree)
    elif kind not in _SCALARS:
        raise _NotPlain


def _plain_map(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    kind = type(tree)
    if kind is tuple:
        return tuple([_plain_map(item, fn) for item in tree])
    if kind is list:
        return [_plain_map(item, fn) for item in tree]
    if kind is dict:
        return {key: _plain_map(item, fn) for key, item in tree.items()}
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if kind not in _SCALARS:
        raise _NotPlain
    return tree


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with ``fn`` applied to every tensor in it: inside tuples, lists,
    dicts, namedtuples, the classes registered with pytree (e.g. Hugging Face's
    ``ModelOutput``) and dataclasses (copied, not changed in place).

    Trees of plain tuples, lists and dicts of tensors and scalars (most module
    calls: ``(args, kwargs)``) are walked here, as pytree would walk them (dicts
    in their order); pytree costs several microseconds per call, and the hooks
    map every module call's inputs.

    Why private: ``torch.utils._pytree`` is what torch's own modules use to walk
    arbitrary containers; there is no public one.
    """
    try:
        return _plain_map(tree, fn)
    except _NotPlain:  # what fn returned on the way is dropped: the callers' fns are pure
        pass
    leaves, spec = pytree.tree_flatten(tree, is_leaf=_is_plain_dataclass)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[i] = fn(leaf)
        elif _is_plain_dataclass(leaf):
            new = copy.copy(leaf)
            for field in dataclasses.fields(leaf):
                # object.__setattr__: a frozen dataclass refuses plain assignment.
                object.__setattr__(new, field.name, map_tensors(getattr(leaf, field.name), fn))
            leaves[i] = new
    return pytree.tree_unflatten(leaves, spec)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (the containers of :func:`map_tensors`), in order."""
    tensors: list[torch.Tensor] = []
    try:
        _plain_tensors(tree, tensors)
        return tensors
    except _NotPlain:
        tensors.clear()
    for leaf in pytree.tree_leaves(tree, is_leaf=_is_plain_dataclass):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif _is_plain_dataclass(leaf):
            tensors += tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return tensors


def chunk_cat_(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Writes ``tensors``, each padded on dim 0 and split into ``num_chunks``
    equal chunks, into ``out`` of shape ``(num_chunks, sum of padded chunk numels)``.

    Why private: this is the reduce-scatter copy-in (chunk k of every gradient
    goes to rank k's block) as one fused kernel; the public alternative is two
    copies per gradient (full chunks, then the short last chunk).
    """
    torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


def foreach_copy_(
    dsts: list[torch.Tensor] | tuple[torch.Tensor, ...],
    srcs: list[torch.Tensor],
    non_blocking: bool = False,
) -> None:
    """Copies each of ``srcs`` into the matching ``dsts``, casting.

    Why private: the all-gather copy-in as one fused kernel launch; the
    public alternative is one ``copy_`` per parameter.
    """
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiplies each of ``tensors`` in place by ``factor`` (a scalar tensor).

    Why private: gradient clipping's scaling as one fused kernel launch, as
    ``torch.nn.utils.clip_grads_with_norm_`` makes it, but on the local
    shards (that function takes parameters, and on DTensor gradients each
    multiplication goes through sharding propagation); the public
    alternative is one ``mul_`` per gradient.
    """
    torch._foreach_mul_(tensors, factor)


def foreach_norm(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each of ``tensors``' ``norm_type``-norm, in one multi-tensor call.

    Why private: gradient clipping's per-gradient norms, as
    ``torch.nn.utils.get_total_norm`` takes them, but returned one per tensor
    (that function returns only their total); the public alternative is one
    ``torch.linalg.vector_norm`` per gradient.
    """
    return list(torch._foreach_norm(tensors, norm_type))


def post_accumulate_grad_hooks(param: torch.Tensor) -> list[Callable]:
    """The hooks ``register_post_accumulate_grad_hook`` put on ``param``.

    Why private: autograd never accumulates into a sharded parameter (fsdp2
    assigns its gradient), so fsdp2 runs those hooks itself, and no public
    API lists them.
    """
    hooks = param._post_accumulate_grad_hooks
    return [] if hooks is None else list(hooks.values())


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``tensor``'s storage.

    Why private: a group's sharded grads are reused across iterations only if
    no tensor outside fsdp2 views their storage (sharded_grads.py); Python
    reference counts cannot see a view, and no public API counts them.
    """
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def module_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module``'s own parameters by name, the dict itself (writable).

    Why private: unsharding and resharding swap every parameter of every
    group twice a step; ``setattr`` would rerun ``nn.Module``'s checks each
    time, and ``named_parameters`` cannot say which module a tied one is on.
    """
    return module._parameters


def clip_grad_norm_helpers() -> tuple[ModuleType, tuple[str, str]]:
    """The module of ``torch.nn.utils.clip_grad_norm_`` and the names of the
    two functions it calls (the total norm, then the scaling).

    Why private: ``clip_grad_norm_`` looks these up in its module's globals at
    each call, so routing them reaches every caller, also one that bound
    ``clip_grad_norm_`` at its import; their public aliases
    (``torch.nn.utils.get_total_norm``, ``clip_grads_with_norm_``) are other
    bindings, which ``clip_grad_norm_`` does not read.
    """
    return torch.nn.utils.clip_grad, ("_get_total_norm", "_clip_grads_with_norm_")
