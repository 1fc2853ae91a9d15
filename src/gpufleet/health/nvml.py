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

__all__ = ["load_nvml", "GpuReading", "read_gpus", "NvmlUnavailable", "NVLINK_COUNTERS", "VIOLATIONS"]

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


# NVLink error counters (nvmlNvLinkErrorCounter_t): reading key -> counter id.
NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS
# NVLink per-link speed fields (nvmlDeviceGetFieldValues): NVML_FI_DEV_NVLINK_SPEED_MBPS_L0..L11,
# then the speed every link shares (NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON), in MB/s.
NVLINK_SPEED_COMMON_FIELD = 90
# Violation (throttle time) counters (nvmlPerfPolicyType_t): reading key -> policy id.
VIOLATIONS = {
    "power": 0,
    "thermal": 1,
    "sync_boost": 2,
    "board_limit": 3,
    "low_utilization": 4,
    "reliability": 5,
}
NVML_PAGE_RETIREMENT_CAUSE_SBE = 0
NVML_PAGE_RETIREMENT_CAUSE_DBE = 1


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
            _read_more(nvml, r, h)
            out.append(r)
        return out
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _read_more(nvml: ModuleType, r: GpuReading, h: Any) -> None:
    """ECC corrected counts, retired pages, PCIe current vs max and replays, power, throttle time,
    NVLink state, speed and error counters, driver and VBIOS versions."""
    cor = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    _call(nvml, r, "ecc_sbe_volatile", "nvmlDeviceGetTotalEccErrors", h, cor, nvml.NVML_VOLATILE_ECC)
    _call(nvml, r, "ecc_sbe_aggregate", "nvmlDeviceGetTotalEccErrors", h, cor, nvml.NVML_AGGREGATE_ECC)
    for key, cause in (
        ("retired_sbe", NVML_PAGE_RETIREMENT_CAUSE_SBE),
        ("retired_dbe", NVML_PAGE_RETIREMENT_CAUSE_DBE),
    ):
        pages = _call(nvml, r, key, "nvmlDeviceGetRetiredPages", h, cause)
        if pages is not None:
            r.values[key] = len(pages)
    _call(nvml, r, "retired_pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
    _call(nvml, r, "pcie_gen_curr", "nvmlDeviceGetCurrPcieLinkGeneration", h)
    _call(nvml, r, "pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", h)
    _call(nvml, r, "pcie_replays", "nvmlDeviceGetPcieReplayCounter", h)
    _call(nvml, r, "power_mw", "nvmlDeviceGetPowerUsage", h)
    _call(nvml, r, "power_limit_mw", "nvmlDeviceGetEnforcedPowerLimit", h)
    violations: dict[str, list[int]] = {}
    for key, policy in VIOLATIONS.items():
        v = _call(nvml, r, f"violation_{key}", "nvmlDeviceGetViolationStatus", h, policy)
        r.values.pop(f"violation_{key}", None)
        if v is not None:
            violations[key] = [int(v.referenceTime), int(v.violationTime)]  # us timestamp, ns throttled
    if violations:
        r.values["violations"] = violations
    for key, fn in (("driver", "nvmlSystemGetDriverVersion"), ("vbios", "nvmlDeviceGetVbiosVersion")):
        v = _call(nvml, r, key, fn, *(() if key == "driver" else (h,)))
        if isinstance(v, bytes):
            r.values[key] = v.decode()
    links: list[dict[str, Any]] = []
    for link in range(NVLINK_MAX_LINKS):
        try:
            active = nvml.nvmlDeviceGetNvLinkState(h, link)
        except nvml.NVMLError:
            break  # past the GPU's last link (or no NVLink at all)
        except AttributeError:
            r.unsupported.append("nvlink")
            break
        entry: dict[str, Any] = {"link": link, "active": bool(active)}
        for name, counter in NVLINK_COUNTERS.items():
            try:
                entry[name] = int(nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
            except (nvml.NVMLError, AttributeError):
                pass
        links.append(entry)
    if links:
        r.values["nvlink"] = links
        speed = _nvlink_speed(nvml, h)
        if speed is not None:
            r.values["nvlink_speed_mbps"] = speed


def _nvlink_speed(nvml: ModuleType, h: Any) -> float | None:
    """The speed every NVLink of the GPU runs at (MB/s, one direction), from NVML's field values."""
    fn = getattr(nvml, "nvmlDeviceGetFieldValues", None)
    if fn is None:
        return None
    try:
        (fv,) = fn(h, [NVLINK_SPEED_COMMON_FIELD])
    except nvml.NVMLError:
        return None
    if getattr(fv, "nvmlReturn", 0) != 0:
        return None
    return float(fv.value.uiVal)


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]
