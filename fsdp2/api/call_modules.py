"""The modules and parameters one ``fully_shard`` call takes: a module, or a
list of them (a group of several), each refused when it cannot be hooked or
is sharded already, and the parameters no nested call took, refused where
one is shared with a nested group."""

from __future__ import annotations

import torch.nn as nn

from ..base.private_api import module_parameters
from .module import original_class
from .state import FSDPState, get_fsdp_state


def check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"fully_shard expects an nn.Module, got {type(module).__name__}. "
            "Pass the module whose parameters should form one communication group."
        )
    # An instance attribute counts: torch.compile(module) sets its forward that way.
    if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:
        raise ValueError(
            "fully_shard does not support containers that do not implement forward: "
            f"{type(module).__name__} has none, so its hooks would never run. Call "
            "fully_shard on each child instead (e.g. `for block in model.layers: "
            "fully_shard(block)`) and then on the parent."
        )
    if "_fsdp_state" in module.__dict__:
        raise ValueError(
            f"{_already_sharded(module)}. Call fully_shard once per module, bottom-up "
            "(children first, then the root)."
        )


def _already_sharded(module: nn.Module) -> str:
    """For messages: which sharded module, and the user's call that sharded it."""
    state = module.__dict__["_fsdp_state"]
    cls = original_class(type(module))
    named = ""
    if state.is_root is not None:  # the root's lazy init named its groups
        names = {group.name for group in state.param_groups}
        named = f" ({', '.join(sorted(names))} from the root)" if names else ""
    return f"this {cls.__name__}{named} is already sharded by the fully_shard call at {state.call_site}"


def module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules of one call, checked: ``[module]``, or the list's modules."""
    if not isinstance(module, list | tuple):
        check_module(module)
        return [module]
    if not module:
        raise ValueError(
            "fully_shard got an empty list. Pass a module, or a list of the modules whose "
            "parameters should form one group, e.g. fully_shard([model.norm, model.output])."
        )
    index: dict[int, int] = {}  # id(module) -> position in the list
    for i, member in enumerate(module):
        if not isinstance(member, nn.Module):
            raise TypeError(
                f"fully_shard expects a module or a list of modules, but element {i} of the "
                f"list is a {type(member).__name__}. Put only nn.Modules in the list."
            )
        if id(member) in index:
            raise ValueError(
                f"fully_shard: the list holds the same {type(member).__name__} twice (elements "
                f"{index[id(member)]} and {i}). List each module once."
            )
        index[id(member)] = i
    for i, member in enumerate(module):
        for name, submodule in member.named_modules():
            if submodule is not member and (j := index.get(id(submodule))) is not None:
                raise ValueError(
                    f"fully_shard: element {j} of the list ({type(submodule).__name__}) is "
                    f"inside element {i} ({type(member).__name__}, as {name!r}), whose "
                    f"parameters already include it. Remove element {j} from the list."
                )
    for i, member in enumerate(module):
        if "_fsdp_state" in member.__dict__:
            raise ValueError(
                f"fully_shard: element {i} of the list: {_already_sharded(member)}, and a "
                "module belongs to one group. Leave it out of the list, or drop the earlier call."
            )
        check_module(member)
    return list(module)


def _named_members(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Each module of the call with the prefix of its names in this call: none for a
    single module, its position in the list (``"1."``) for a list."""
    if len(modules) == 1:
        return [("", modules[0])]
    return [(f"{i}.", member) for i, member in enumerate(modules)]


def named_submodules(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every submodule of the modules of the call with its path, as named in this call."""
    return [
        (f"{prefix}{name}".removesuffix("."), submodule)
        for prefix, member in _named_members(modules)
        for name, submodule in member.named_modules()
    ]


def _module_paths(modules: list[nn.Module]) -> dict[int, str]:
    """Path, as named in this call, of every submodule of the modules of the call."""
    return {id(submodule): path for path, submodule in named_submodules(modules)}


def nested_states(modules: list[nn.Module]) -> list[FSDPState]:
    """States of earlier calls on submodules, each once (a list's state is on each of its modules)."""
    states = (
        get_fsdp_state(submodule)
        for member in modules
        for submodule in member.modules()
        if submodule is not member
    )
    return list(dict.fromkeys(state for state in states if state is not None))


def unowned_params(modules: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of ``modules`` outside every nested ``fully_shard``'d module, with
    their names: what a nested call took or chose to ignore is not ours. A parameter
    tied between two modules of a list is listed once."""
    nested = {
        id(p)
        for state in nested_states(modules)
        for nested_module in state.modules
        for p in nested_module.parameters()
    }
    seen = set()
    params = []
    for prefix, member in _named_members(modules):
        for fqn, p in member.named_parameters():
            if id(p) not in nested and id(p) not in seen:
                seen.add(id(p))
                params.append((prefix + fqn, p))
    return params


def check_no_param_shared_with_nested_group(modules: list[nn.Module]) -> None:
    """A parameter owned by a nested group must not also be registered outside it:
    that module would compute with the sharded DTensor (tied after sharding) or
    shard a second copy (tied before sharding, so it still holds the original)."""
    nested = nested_states(modules)
    inside_nested = {
        id(m)
        for state in nested
        for nested_module in state.modules
        for m in nested_module.modules()
    }
    paths = _module_paths(modules)
    owner_of = {}
    for state in nested:
        for fsdp_param in (p for group in state.param_groups for p in group.fsdp_params):
            first = fsdp_param.registrations[0]
            owner = fsdp_param.fqn
            if (path := paths.get(id(first.module))) is not None:
                owner = f"{path}.{first.name}" if path else first.name
            owner_of[id(fsdp_param.sharded_param)] = owner
            if (orig := fsdp_param.orig_param_ref()) is not None:
                owner_of[id(orig)] = owner
    for prefix, member in _named_members(modules):
        for module_name, submodule in member.named_modules():
            if id(submodule) in inside_nested:
                continue
            for name, param in module_parameters(submodule).items():
                if param is not None and id(param) in owner_of:
                    where = f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}"
                    raise ValueError(
                        f"fully_shard: parameter {where!r} is the same Parameter as "
                        f"{owner_of[id(param)]!r}, which an earlier fully_shard call on a "
                        "submodule already sharded. A parameter shared by two groups is not "
                        "supported: untie them, or shard the modules that share it in one call "
                        "(the common parent, or a list of modules such as "
                        "fully_shard([model.tok_embeddings, model.output]))."
                    )
