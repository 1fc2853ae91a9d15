"""Fakes at the process boundary: a fake NVML module and recorded tool output (``data/``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["data_path", "FAKE_NVML_MODULE"]

FAKE_NVML_MODULE = "gpufleet.health.fakes.fake_nvml"


def data_path(name: str) -> Path:
    """Path of a recorded fixture shipped in ``gpufleet/health/fakes/data``."""
    return Path(str(resources.files("gpufleet.health.fakes").joinpath("data", name)))
