"""The ``cpu`` platform for verl's platform registry (``verl.plugin.platform``).

verl 0.9.1 resolves its device once per process through ``get_platform()``; without a CPU platform
it falls back to ``nvidia`` and every ``get_device_name()`` says ``cuda``. This class is registered
under the name ``cpu`` and selected with ``VERL_PLATFORM=cpu`` (set by :func:`verl_ext.cpu.activate`);
it is never auto-detected (``is_platform_available`` is False), so a GPU machine cannot pick it
by accident.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase


class _CpuDeviceModule(ModuleType):
    """Stands in where verl expects ``torch.cuda``: ``torch.cpu`` where it has the function, else a no-op.

    verl calls ``get_torch_device().<fn>()`` for memory statistics, cache clearing, RNG state and
    synchronisation (e.g. ``engine_workers.py`` ``max_memory_allocated``); on CPU none of these
    has an effect worth reporting, so unknown names return 0.
    """

    def __init__(self) -> None:
        super().__init__("verl_ext_cpu_device")

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *args, **kwargs: 0


class PlatformCPU(PlatformBase):
    """verl's platform interface on a CPU-only host (gloo collectives, no accelerator)."""

    _device_module = _CpuDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # only ever chosen explicitly (VERL_PLATFORM=cpu), never auto-detected

    def current_device(self) -> torch.device:
        # verl passes get_device_id() to .to(...) and device=...; an integer there means cuda:<index>
        # (e.g. transformer_impl.py `micro_batch.to(get_device_id())`), so return the CPU device itself.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # verl exports this name in every worker (Worker.env_keys); it must not be CUDA_VISIBLE_DEVICES.
        return "VERL_EXT_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        # verl's ResourcePoolManager counts Ray "GPU" resources (ray_trainer / single_controller), so a
        # CPU run declares logical GPUs (ray_init.num_gpus) that only drive placement.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
