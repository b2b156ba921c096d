"""State dicts of sharded modules: always the sharded parameters.

``model.state_dict()`` returns what the modules hold, the sharded DTensor
parameters, and ``load_state_dict`` of DTensors copies shard to shard. Both
first reshard the group (a pre-hook), so a module kept unsharded after forward
(``reshard_after_forward=False``) still saves and loads its shards. A *full*
tensor (e.g. from a single-device checkpoint) is cut to this rank's shard by
the load pre-hook. A tensor whose shape differs is left as it is, so that
``load_state_dict`` reports the key and both shapes. ``load_state_dict(...,
assign=True)`` (e.g. sharded tensors for a meta-device model) registers new
parameter objects; a load post-hook makes the group adopt them.
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .param_group import FSDPParamGroup


def register_state_dict_hooks(module: nn.Module, group: FSDPParamGroup) -> None:
    fsdp_params = group.fsdp_params
    paths = {id(m): path for path, m in module.named_modules(remove_duplicate=False)}
    by_key = {
        (f"{paths[id(module)]}.{name}" if paths[id(module)] else name): p
        for p in fsdp_params
        for module, name in p.registrations
        if id(module) in paths
    }

    def reshard(*_args) -> None:
        group.reshard()

    def shard_full_tensors(_module, state_dict, prefix, *_args) -> None:
        group.reshard()
        for key, fsdp_param in by_key.items():
            value = state_dict.get(prefix + key)
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and value.shape == fsdp_param.layout.orig_size
            ):
                state_dict[prefix + key] = fsdp_param.shard_like(value)

    def adopt_assigned_params(*_args) -> None:
        # load_state_dict(..., assign=True) registered new parameter objects.
        group.reset_sharded_params()

    module.register_state_dict_pre_hook(reshard)
    module.register_load_state_dict_pre_hook(shard_full_tensors)
    module.register_load_state_dict_post_hook(adopt_assigned_params)
