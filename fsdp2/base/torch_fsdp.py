"""torch's own FSDP (``torch.distributed.fsdp``), recognised without importing it.

fsdp2 and torch's implementation cannot share a model: each takes the other's
sharded DTensor parameters for tensor-parallel ones, so fsdp2 blocks under a
torch root or torch blocks under an fsdp2 root fail deep inside the other
implementation, or with a misleading diagnosis. fsdp2 refuses the mix where
its own code first sees it:

- at ``fully_shard``: the module, or a module inside it, is managed by
  torch's FSDP (torch's blocks under an fsdp2 root, or torch's root applied
  first);
- at the root's lazy init: torch's ``fully_shard`` was applied to a module
  containing fsdp2's modules after them. With two ranks or more, torch's own
  ``fully_shard`` call fails first, inside torch, before any fsdp2 code runs
  (docs/usage.md lists its messages).

torch's modules are recognised by their class (torch's ``FSDPModule`` in the
MRO, by name and module) and by the markers torch's FSDP sets on every module
it manages; fsdp2 sets neither.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

TORCH_FSDP = "torch.distributed.fsdp"
# Set (to True) together by torch's fully_shard on each
# module whose parameters it manages, for dynamo. Libraries set the first alone
# on a model they sharded with whichever fully_shard they were given
# (transformers' FSDP loading, on the root): the pair is torch's.
_TORCH_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")

USE_ONE = (
    "Use one implementation for the whole model: fsdp2.fully_shard on every block and on "
    "the root (import fully_shard from fsdp2 wherever the model is sharded), or "
    "torch.distributed.fsdp.fully_shard on every module."
)


def torch_fsdp_class(module: nn.Module) -> type | None:
    """The class of torch's FSDP that ``module``'s class derives from
    (``FSDPModule``, or FSDP1's wrapper), or None."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith(TORCH_FSDP) and cls.__name__ in (
            "FSDPModule",
            "FullyShardedDataParallel",
        ):
            return cls
    return None


def managed_by_torch_fsdp(module: nn.Module) -> bool:
    """Whether torch's FSDP shards ``module``'s parameters (applied to it or to
    a module containing it)."""
    if torch_fsdp_class(module) is not None:
        return True
    marks = module.__dict__
    return all(marks.get(name) is True for name in _TORCH_MARKS)


def check_no_torch_fsdp_inside(named_modules: Iterable[tuple[str, nn.Module]]) -> None:
    """``fully_shard``'s check: none of the call's modules (each with its name
    in the call, ``""`` for the module itself) is managed by torch's FSDP."""
    for name, module in named_modules:
        if not managed_by_torch_fsdp(module):
            continue
        where = f"{name!r} ({type(module).__name__})" if name else type(module).__name__
        how = "" if torch_fsdp_class(module) is not None else ", applied to a module containing it"
        raise ValueError(
            f"fully_shard: {where} is already sharded by torch's own fully_shard "
            f"(torch.distributed.fsdp){how}. fsdp2 and torch's implementation cannot be mixed "
            "in one model: each takes the other's sharded parameters for tensor-parallel "
            f"ones. {USE_ONE}"
        )


def check_not_under_torch_fsdp(modules: Iterable[nn.Module], names: str) -> None:
    """The root's lazy-init check: torch's ``fully_shard`` was not applied,
    after fsdp2's, to a module containing ``modules`` (``names``: theirs, for
    the message)."""
    if any(managed_by_torch_fsdp(module) for module in modules):
        raise RuntimeError(
            f"fsdp2: {names} was sharded by fsdp2.fully_shard, and then torch's own "
            "fully_shard (torch.distributed.fsdp) was applied to a module containing it. "
            "fsdp2 and torch's implementation cannot be mixed in one model: torch's takes "
            f"fsdp2's sharded parameters for tensor-parallel ones. {USE_ONE}"
        )
