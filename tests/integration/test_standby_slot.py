"""A real standby interpreter keeps its slot once promoted: the local backend starts it for the slot
(here slot 0 was dropped, so local rank 0 is slot 1's GPU; tests/unit/train/test_standby_gpu.py checks
the environment it starts with), and the script it then runs, in that same process, sees the slot's
devices and local rank, and none of the standby's own variables. On this CPU host the CUDA warm-up
leaves CUDA untouched."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gpufleet.backends import LaunchSpec
from gpufleet.backends.local import LocalBackend

pytestmark = pytest.mark.slow

PROBE = """
import json, os, sys
import torch
keys = ("LOCAL_RANK", "RANK", "CUDA_VISIBLE_DEVICES", "GPUFLEET_STANDBY_GPU")
out = {"pid": os.getpid(), "cuda_initialized": torch.cuda.is_initialized()}
out.update({k: os.environ.get(k) for k in keys})
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""


def test_a_promoted_standby_keeps_the_slot_devices_and_local_rank_it_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("GPUFLEET_STANDBY_CUDA", raising=False)
    script, out = tmp_path / "probe.py", tmp_path / "out.json"
    script.write_text(PROBE)
    backend = LocalBackend(min_nproc=1, host_store=False)
    backend.active_slots(LaunchSpec(["true"], nproc_per_node=2))
    backend.slots, backend.dropped = [1], [0]  # as after_failure leaves them once slot 0 is dropped
    spec = LaunchSpec([sys.executable, str(script), str(out)], nproc_per_node=1)
    try:
        backend.prepare(spec, eager=True)
        (sb,) = backend._standbys
        attempt = backend.start(spec)
        deadline = time.monotonic() + 240  # a guard against a wedged standby, not a timing assertion
        while attempt.poll()[0] is None:
            assert time.monotonic() < deadline, "the promoted standby did not finish"
            time.sleep(0.05)
        assert attempt.poll()[0] == 0
    finally:
        backend.close()
    got = json.loads(out.read_text())
    assert got["pid"] == sb.proc.pid  # the standby ran it: promoted, not a fresh process
    assert (got["LOCAL_RANK"], got["RANK"], got["CUDA_VISIBLE_DEVICES"]) == ("0", "0", "1")
    assert got["GPUFLEET_STANDBY_GPU"] is None  # the standby's own variable stays its own
    assert got["cuda_initialized"] is False  # no CUDA here: the warm-up did nothing
