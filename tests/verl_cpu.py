"""verl on CPU ranks: a device plugin of verl's own kind (``verl.plugin.platform``).

verl asks its platform for the device, the device module and the collective
backend; its built-in platforms are accelerators only. This one answers "cpu"
and gloo, so verl's FSDP2 code runs on the gloo ranks of the suite unchanged.
``use()`` makes it verl's platform and registers verl's FSDP engine for it;
call it in each rank before verl's code runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform


def _empty_cache() -> None:
    """CPU tensors go back to the allocator when freed: nothing is cached."""


# What verl calls on its device module (torch.cuda's names) that torch.cpu lacks.
_DEVICE_MODULE = SimpleNamespace(
    **{name: getattr(torch.cpu, name) for name in ("synchronize", "is_available", "device_count")},
    current_device=lambda: "cpu",
    get_device_name=lambda *args: "CPU",
    empty_cache=_empty_cache,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state,  # the host generator is this device's
    set_rng_state=torch.set_rng_state,
    memory_allocated=lambda *args, **kwargs: 0,
    memory_reserved=lambda *args, **kwargs: 0,
    max_memory_allocated=lambda *args, **kwargs: 0,
    max_memory_reserved=lambda *args, **kwargs: 0,
    mem_get_info=lambda *args, **kwargs: (0, 0),
    reset_peak_memory_stats=lambda *args, **kwargs: None,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The host as verl's device: tensors on "cpu", collectives on gloo."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        # verl passes this to `.to(...)`: an int would mean a CUDA device.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def use() -> None:
    """Make the CPU platform verl's for this process, and let its FSDP engine
    (registered for accelerators only) run on it, as a vendor's plugin
    registers the engines for its device."""
    set_platform(PlatformCPU())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    registry = EngineRegistry._engines["language_model"]["fsdp2"]
    if "cpu" not in registry:
        EngineRegistry.register("language_model", "fsdp2", device="cpu")(FSDPEngineWithLMHead)
