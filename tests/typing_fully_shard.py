"""Checked by mypy in ``make lint``, never run: ``fully_shard``'s overloads are
typed as torch's (a module in, an ``FSDPModule`` out; a list in, a list out),
and torch's own FSDP2 policies are accepted where fsdp2's are."""

from typing import assert_type

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import fsdp2
from fsdp2 import FSDPModule
from fsdp2.api.state import FSDPState


def sharded_types(module: nn.Module, modules: list[nn.Module]) -> None:
    assert_type(fsdp2.fully_shard(module), FSDPModule)
    assert_type(fsdp2.fully_shard(modules), list[FSDPModule])
    assert_type(fsdp2.fully_shard.state(module), FSDPState | None)


def torchs_policies(module: nn.Module) -> None:
    mp_policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    offload_policy = torch_fsdp.CPUOffloadPolicy(pin_memory=False)
    sharded = fsdp2.fully_shard(module, mp_policy=mp_policy, offload_policy=offload_policy)
    assert_type(sharded, FSDPModule)
    fsdp2.fully_shard([module], offload_policy=torch_fsdp.OffloadPolicy())
