"""Helpers shared by the real-Ray tests: the cluster .ci/ray.sh starts (a head + 2 worker nodes here).

``source .ci/state/ray.env`` exports ``GPUFLEET_TEST_RAY_ADDRESS``. Without it the tests skip, except
under CI (``CI=true``), where a missing cluster must fail loudly rather than skip.
"""

from __future__ import annotations

import os

import pytest

ADDRESS = os.environ.get("GPUFLEET_TEST_RAY_ADDRESS", "")

requires_ray = pytest.mark.skipif(
    not ADDRESS and os.environ.get("CI") != "true",
    reason="needs a real Ray cluster: run `.ci/ray.sh start && source .ci/state/ray.env` (.ci/run does)",
)


def ray_address() -> str:
    assert ADDRESS, "GPUFLEET_TEST_RAY_ADDRESS is unset: .ci/ray.sh start && source .ci/state/ray.env"
    return ADDRESS
