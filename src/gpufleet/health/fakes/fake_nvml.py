"""A fake ``pynvml`` for tests and CPU-only CI: the subset of the NVML API gpufleet calls.

Select it with ``GPUFLEET_NVML_MODULE=gpufleet.health.fakes.fake_nvml`` and point
``GPUFLEET_FAKE_NVML`` at a JSON recording (see ``fakes/data/*.json``)::

    {"init_error": null,
     "devices": [{"name": "NVIDIA H100 80GB HBM3", "pci": "00000000:18:00.0",
                  "ecc_volatile": 0, "ecc_aggregate": 0, "remapped": [0, 0, false, false],
                  "throttle": 0, "sm_clock": 1980, "sm_clock_max": 1980, "temperature": 41,
                  "pcie_gen": 5, "pcie_width": 16, "unsupported": ["ecc"]}]}

Optional device keys (a key a recording lacks reads as NVML_ERROR_NOT_SUPPORTED): ``ecc_sbe_volatile``,
``ecc_sbe_aggregate``, ``retired_sbe``/``retired_dbe`` (page counts), ``retired_pending``,
``pcie_gen_curr``, ``pcie_width_max``, ``pcie_replays``, ``power_mw``, ``power_limit_mw``,
``violations`` ({policy: [reference time us, violation time ns]}, policies as in
:data:`gpufleet.health.nvml.VIOLATIONS`), ``vbios``, ``nvlink`` (one entry per link: ``active`` and
the error counters ``replay``, ``recovery``, ``crc_flit``, ``crc_data``), ``nvlink_speed_mbps``; at
the top level ``driver``. ``GPUFLEET_FAKE_NVML`` may name several recordings separated by
``os.pathsep``: each ``nvmlInit`` reads the next one (and stays on the last), so a check that takes
two readings sees two recordings.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

from gpufleet.core.env import Env

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9


class NVMLError(Exception):
    def __init__(self, value: int, msg: str = "") -> None:
        super().__init__(msg or f"NVML error {value}")
        self.value = value


_state: dict[str, Any] = {}
_inits: dict[str, int] = {}  # recording list -> nvmlInit calls so far
_POLICIES = {
    0: "power",
    1: "thermal",
    2: "sync_boost",
    3: "board_limit",
    4: "low_utilization",
    5: "reliability",
}


def nvmlInit() -> None:  # noqa: N802 (the NVML API's names)
    path = Env.FAKE_NVML.get()
    if not path:
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded (GPUFLEET_FAKE_NVML unset)")
    paths = [p for p in path.split(os.pathsep) if p]
    n = _inits.get(path, 0)
    _inits[path] = n + 1
    with open(paths[min(n, len(paths) - 1)]) as f:
        data = json.load(f)
    if data.get("init_error"):
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED, str(data["init_error"]))
    _state["devices"] = data.get("devices", [])
    _state["driver"] = data.get("driver")


def nvmlShutdown() -> None:  # noqa: N802
    _state.clear()


def _dev(handle: int, key: str) -> Any:
    d = _state["devices"][handle]
    if (
        key not in d
        or key in d.get("unsupported", [])
        or (key.startswith("ecc") and "ecc" in d.get("unsupported", []))
    ):
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
    kind = "ecc_sbe_" if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED else "ecc_"
    return int(_dev(h, kind + ("volatile" if counter_type == NVML_VOLATILE_ECC else "aggregate")))


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


def nvmlDeviceGetCurrPcieLinkGeneration(h: int) -> int:  # noqa: N802
    return int(_dev(h, "pcie_gen_curr"))


def nvmlDeviceGetMaxPcieLinkWidth(h: int) -> int:  # noqa: N802
    return int(_dev(h, "pcie_width_max"))


def nvmlDeviceGetPcieReplayCounter(h: int) -> int:  # noqa: N802
    return int(_dev(h, "pcie_replays"))


def nvmlDeviceGetRetiredPages(h: int, cause: int) -> list[int]:  # noqa: N802
    n = int(_dev(h, "retired_sbe" if cause == 0 else "retired_dbe"))
    return [0x1000 * (i + 1) for i in range(n)]


def nvmlDeviceGetRetiredPagesPendingStatus(h: int) -> int:  # noqa: N802
    return int(_dev(h, "retired_pending"))


def nvmlDeviceGetPowerUsage(h: int) -> int:  # noqa: N802
    return int(_dev(h, "power_mw"))


def nvmlDeviceGetEnforcedPowerLimit(h: int) -> int:  # noqa: N802
    return int(_dev(h, "power_limit_mw"))


def nvmlDeviceGetViolationStatus(h: int, policy: int) -> Any:  # noqa: N802
    table = _dev(h, "violations")
    name = _POLICIES.get(policy, "")
    if name not in table:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
    ref, viol = table[name]
    return SimpleNamespace(referenceTime=int(ref), violationTime=int(viol))


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    if not _state.get("driver"):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
    return str(_state["driver"])


def nvmlDeviceGetVbiosVersion(h: int) -> str:  # noqa: N802
    return str(_dev(h, "vbios"))


def _link(h: int, link: int) -> dict[str, Any]:
    links = _dev(h, "nvlink")
    if not 0 <= link < len(links):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument")
    return dict(links[link])


def nvmlDeviceGetNvLinkState(h: int, link: int) -> int:  # noqa: N802
    return int(bool(_link(h, link)["active"]))


def nvmlDeviceGetNvLinkErrorCounter(h: int, link: int, counter: int) -> int:  # noqa: N802
    key = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}.get(counter, "")
    entry = _link(h, link)
    if key not in entry:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
    return int(entry[key])


def nvmlDeviceGetFieldValues(h: int, field_ids: list[int]) -> list[Any]:  # noqa: N802
    out = []
    for fid in field_ids:
        d = _state["devices"][h]
        if fid == 90 and "nvlink_speed_mbps" in d:
            out.append(
                SimpleNamespace(
                    fieldId=fid, nvmlReturn=0, value=SimpleNamespace(uiVal=int(d["nvlink_speed_mbps"]))
                )
            )
        else:
            out.append(
                SimpleNamespace(
                    fieldId=fid, nvmlReturn=NVML_ERROR_NOT_SUPPORTED, value=SimpleNamespace(uiVal=0)
                )
            )
    return out
