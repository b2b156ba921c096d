"""fsdp2's logger: records of the "fsdp2" logger, each message prefixed with
``[rank N] `` once torch.distributed is initialised (the global rank, also
on the record as ``record.rank``), so that the interleaved DEBUG lines of
several ranks say whose they are. Nothing is installed on the "fsdp2"
logger itself: the prefix is added by fsdp2's calls, and only for records
its level lets through."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import torch.distributed as dist


class RankAdapter(logging.LoggerAdapter):
    """Prefixes each message with the caller's global rank."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        if not (dist.is_available() and dist.is_initialized()):
            return msg, kwargs
        rank = dist.get_rank()
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "rank": rank}
        return f"[rank {rank}] {msg}", kwargs


logger = RankAdapter(logging.getLogger("fsdp2"))
