"""``install_as_torch_fsdp``: fsdp2's objects under torch's public FSDP2 names, for
libraries that look those names up when they run (accelerate, transformers),
and torch's gradient clipping routed to fsdp2's (torch_clipping.py).

The one place where fsdp2 touches torch's FSDP: it writes names into torch's
namespaces and never calls torch's implementation. torch's modules are
imported here, at call time, so that ``import fsdp2`` keeps not importing them.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType, TracebackType

from ..base.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..optim.torch_clipping import route_torch_clipping
from .fully_shard import fully_shard
from .mesh import DataParallelMeshDims
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .torch_internals import adapt_pipelining, adapt_state_lookup

# torch's public FSDP2 names whose fsdp2 object has the same meaning.
FSDP2_OBJECTS: dict[str, object] = {
    "fully_shard": fully_shard,
    "FSDPModule": FSDPModule,
    "UnshardHandle": UnshardHandle,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "share_comm_ctx": share_comm_ctx,
    "DataParallelMeshDims": DataParallelMeshDims,
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "CPUOffloadPolicy": CPUOffloadPolicy,
    "OffloadPolicy": OffloadPolicy,
}
# torch's policies given to fsdp2 are converted (policy.from_torch_policy): a
# library holding them needs no warning.
_CONVERTED = {"MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy"}

# The namespaces that re-export torch's FSDP2 names. The modules that define
# them (_fully_shard._fully_shard, _fsdp_api) keep torch's objects: torch's
# fully_shard reads FSDPModule from its module's globals to build its classes.
TORCH_NAMESPACES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
# torch's FSDP itself, which holds torch's objects by design.
_TORCH_FSDP_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable")


class TorchFSDPNames:
    """What ``install_as_torch_fsdp`` replaced. ``undo()`` (or leaving the
    ``with`` block) puts torch's objects back."""

    def __init__(self, replaced: list[tuple[ModuleType | type, str, object, object]]) -> None:
        self._replaced = replaced  # (namespace, name, torch's object, fsdp2's)

    @property
    def replaced(self) -> list[str]:
        """The names replaced, as ``module.name``."""
        return [f"{_qualified(owner)}.{name}" for owner, name, _, _ in self._replaced]

    def undo(self) -> None:
        """Puts torch's objects back under the names this install replaced
        (a name set to something else since is left as it is). Idempotent."""
        for module, name, original, installed in reversed(self._replaced):
            if getattr(module, name, None) is installed:
                setattr(module, name, original)
        self._replaced = []

    def __enter__(self) -> TorchFSDPNames:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.undo()


def _qualified(owner: ModuleType | type) -> str:
    """A namespace's name, or a class's with its module's."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return owner.__name__


def install_as_torch_fsdp(*, clipping: bool = True) -> TorchFSDPNames:
    """Puts fsdp2's ``fully_shard``, ``FSDPModule``, ``UnshardHandle``,
    ``register_fsdp_forward_method``, ``share_comm_ctx``,
    ``DataParallelMeshDims`` and policies under the same names in
    ``torch.distributed.fsdp`` (and ``torch.distributed._composable.fsdp``), so
    a library that looks them up when it runs shards with fsdp2 and recognises
    fsdp2's modules (accelerate's FSDP2 path: ``isinstance(m, FSDPModule)``).

    Call it before importing such a library: a module that bound torch's names
    at its own import keeps torch's, and is named in a warning. Process-wide
    until undone; calling it again changes nothing.

    Args:
        clipping: also route ``torch.nn.utils.clip_grad_norm_``,
            ``get_total_norm`` and ``clip_grads_with_norm_`` over DTensor
            gradients to fsdp2's local norms (torch_clipping.py): the same
            clipping at the speed of plain tensors or faster, the norm a ``Replicate``
            DTensor where torch's is a partial one. (Default: True)

    Returns:
        A ``TorchFSDPNames``: ``undo()`` restores torch's names, and ``with
        fsdp2.install_as_torch_fsdp():`` installs for the block only.
    """
    # All imported before any is changed: one imported later would bind fsdp2's
    # objects from the start, and undo() would not give it torch's.
    modules = [importlib.import_module(namespace) for namespace in TORCH_NAMESPACES]
    # Imported now, so that it binds torch's names and gets fsdp2's from the
    # rebinding below (undone with the rest): torch_internals.py.
    importlib.import_module("torch.distributed.pipelining")
    replaced: list[tuple[ModuleType | type, str, object, object]] = []
    for module in modules:
        for name, fsdp2_object in FSDP2_OBJECTS.items():
            original = getattr(module, name, fsdp2_object)
            if original is not fsdp2_object:
                replaced.append((module, name, original, fsdp2_object))
                setattr(module, name, fsdp2_object)
    originals = {name: original for _, name, original, _ in replaced}
    replaced += _rebind_torch_libraries(originals)
    replaced += adapt_pipelining()
    replaced += adapt_state_lookup()
    _warn_about_early_bindings(originals)
    if clipping:
        replaced += route_torch_clipping()
    return TorchFSDPNames(replaced)


def _rebind_torch_libraries(
    originals: dict[str, object],
) -> list[tuple[ModuleType | type, str, object, object]]:
    """torch's own libraries imported before the install (``torch.distributed.
    pipelining`` binds ``FSDPModule``, ``fully_shard`` and ``UnshardHandle`` at
    its import) get fsdp2's objects under the names they bound; ``undo()``
    gives them torch's back. A user's module is only warned about."""
    rebound: list[tuple[ModuleType | type, str, object, object]] = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("torch.") or module_name.startswith(_TORCH_FSDP_PACKAGES):
            continue
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, original in originals.items():
            if name not in _CONVERTED and names.get(name) is original:
                rebound.append((module, name, original, FSDP2_OBJECTS[name]))
                setattr(module, name, FSDP2_OBJECTS[name])
    return rebound


def _warn_about_early_bindings(originals: dict[str, object]) -> None:
    """Warns about modules that hold torch's objects in their globals (bound by
    ``from torch.distributed.fsdp import ...`` at their import): the install
    does not reach them."""
    watched = {id(obj): name for name, obj in originals.items() if name not in _CONVERTED}
    holders: list[str] = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(_TORCH_FSDP_PACKAGES):
            continue
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        held = sorted({watched[id(v)] for v in list(names.values()) if id(v) in watched})
        if held:
            holders.append(f"{module_name} ({', '.join(held)})")
    if holders:
        warnings.warn(
            "fsdp2.install_as_torch_fsdp(): these modules imported torch's FSDP2 names "
            f"before it and keep torch's: {'; '.join(holders)}. Call "
            "install_as_torch_fsdp() before importing them.",
            stacklevel=3,
        )
