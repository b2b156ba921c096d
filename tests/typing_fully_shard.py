"""Checked by mypy in ``make lint``, never run: ``fully_shard``'s overloads are
typed as torch's (a module in, an ``FSDPModule`` out; a list in, a list out)."""

from typing import assert_type

import torch.nn as nn

import fsdp2
from fsdp2 import FSDPModule
from fsdp2.state import FSDPState


def sharded_types(module: nn.Module, modules: list[nn.Module]) -> None:
    assert_type(fsdp2.fully_shard(module), FSDPModule)
    assert_type(fsdp2.fully_shard(modules), list[FSDPModule])
    assert_type(fsdp2.fully_shard.state(module), FSDPState | None)
