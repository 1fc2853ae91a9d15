"""A fake ``pynvml`` for tests and CPU-only CI: the subset of the NVML API gpufleet calls.

Select it with ``GPUFLEET_NVML_MODULE=gpufleet.health.fakes.fake_nvml`` and point
``GPUFLEET_FAKE_NVML`` at a JSON recording (see ``fakes/data/*.json``)::

    {"init_error": null,
     "devices": [{"name": "NVIDIA H100 80GB HBM3", "pci": "00000000:18:00.0",
                  "ecc_volatile": 0, "ecc_aggregate": 0, "remapped": [0, 0, false, false],
                  "throttle": 0, "sm_clock": 1980, "sm_clock_max": 1980, "temperature": 41,
                  "pcie_gen": 5, "pcie_width": 16, "unsupported": ["ecc"]}]}
"""

from __future__ import annotations

import json
from typing import Any

from gpufleet.core.env import Env

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9


class NVMLError(Exception):
    def __init__(self, value: int, msg: str = "") -> None:
        super().__init__(msg or f"NVML error {value}")
        self.value = value


_state: dict[str, Any] = {}


def nvmlInit() -> None:  # noqa: N802 (the NVML API's names)
    path = Env.FAKE_NVML.get()
    if not path:
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded (GPUFLEET_FAKE_NVML unset)")
    with open(path) as f:
        data = json.load(f)
    if data.get("init_error"):
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED, str(data["init_error"]))
    _state["devices"] = data.get("devices", [])


def nvmlShutdown() -> None:  # noqa: N802
    _state.clear()


def _dev(handle: int, key: str) -> Any:
    d = _state["devices"][handle]
    if key in d.get("unsupported", []) or (key.startswith("ecc") and "ecc" in d.get("unsupported", [])):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
    return d[key]


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_state["devices"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:  # noqa: N802
    if not 0 <= i < len(_state["devices"]):
        raise NVMLError(2, "Invalid Argument")
    return i


def nvmlDeviceGetName(h: int) -> str:  # noqa: N802
    return str(_dev(h, "name"))


def nvmlDeviceGetPciInfo(h: int) -> Any:  # noqa: N802
    class _Pci:
        busId = str(_dev(h, "pci"))  # noqa: N815

    return _Pci()


def nvmlDeviceGetTotalEccErrors(h: int, error_type: int, counter_type: int) -> int:  # noqa: N802
    return int(_dev(h, "ecc_volatile" if counter_type == NVML_VOLATILE_ECC else "ecc_aggregate"))


def nvmlDeviceGetRemappedRows(h: int) -> tuple[int, int, int, int]:  # noqa: N802
    corr, unc, pending, failed = _dev(h, "remapped")
    return int(corr), int(unc), int(bool(pending)), int(bool(failed))


def nvmlDeviceGetCurrentClocksEventReasons(h: int) -> int:  # noqa: N802
    return int(_dev(h, "throttle"))


def nvmlDeviceGetClockInfo(h: int, clock: int) -> int:  # noqa: N802
    return int(_dev(h, "sm_clock"))


def nvmlDeviceGetMaxClockInfo(h: int, clock: int) -> int:  # noqa: N802
    return int(_dev(h, "sm_clock_max"))


def nvmlDeviceGetTemperature(h: int, sensor: int) -> int:  # noqa: N802
    return int(_dev(h, "temperature"))


def nvmlDeviceGetMaxPcieLinkGeneration(h: int) -> int:  # noqa: N802
    return int(_dev(h, "pcie_gen"))


def nvmlDeviceGetCurrPcieLinkWidth(h: int) -> int:  # noqa: N802
    return int(_dev(h, "pcie_width"))
