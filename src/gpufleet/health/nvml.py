"""Loading NVML lazily, with a fake at the import boundary for tests.

``GPUFLEET_NVML_MODULE`` names the module to import instead of ``pynvml`` (nvidia-ml-py, the ``gpu``
extra), e.g. ``gpufleet.health.fakes.fake_nvml``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from gpufleet.core.env import Env

__all__ = ["load_nvml", "GpuReading", "read_gpus", "NvmlUnavailable"]

# Clock event (throttle) reason bits, as in nvml.h.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
BAD_THROTTLE = {"hw_slowdown": "fail", "hw_power_brake": "fail", "hw_thermal": "warn", "sw_thermal": "warn"}


class NvmlUnavailable(Exception):
    """NVML could not be imported (``missing=True``) or initialised (driver not loaded)."""

    def __init__(self, message: str, missing: bool) -> None:
        super().__init__(message)
        self.missing = missing


def load_nvml() -> ModuleType:
    name = Env.NVML_MODULE.get()
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise NvmlUnavailable(f"cannot import {name} ({e}); install gpufleet[gpu]", missing=True) from None


@dataclass
class GpuReading:
    index: int
    name: str
    pci: str
    values: dict[str, Any] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)


def _call(nvml: ModuleType, reading: GpuReading, key: str, fn_name: str, *args: Any) -> Any:
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        reading.unsupported.append(key)
        return None
    try:
        v = fn(*args)
    except nvml.NVMLError:
        reading.unsupported.append(key)
        return None
    reading.values[key] = v
    return v


def read_gpus() -> list[GpuReading]:
    """Inventory and state of every GPU NVML sees. Raises :class:`NvmlUnavailable`."""
    nvml = load_nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML init failed: {e}", missing=False) from None
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            pci = nvml.nvmlDeviceGetPciInfo(h).busId
            r = GpuReading(i, name, pci.decode() if isinstance(pci, bytes) else str(pci))
            unc = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            _call(nvml, r, "ecc_volatile", "nvmlDeviceGetTotalEccErrors", h, unc, nvml.NVML_VOLATILE_ECC)
            _call(nvml, r, "ecc_aggregate", "nvmlDeviceGetTotalEccErrors", h, unc, nvml.NVML_AGGREGATE_ECC)
            _call(nvml, r, "remapped", "nvmlDeviceGetRemappedRows", h)
            events = "nvmlDeviceGetCurrentClocksEventReasons"
            if not hasattr(nvml, events):
                events = "nvmlDeviceGetCurrentClocksThrottleReasons"
            _call(nvml, r, "throttle", events, h)
            _call(nvml, r, "sm_clock", "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)
            _call(nvml, r, "sm_clock_max", "nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM)
            _call(nvml, r, "temperature", "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
            _call(nvml, r, "pcie_gen", "nvmlDeviceGetMaxPcieLinkGeneration", h)
            _call(nvml, r, "pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", h)
            out.append(r)
        return out
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]
