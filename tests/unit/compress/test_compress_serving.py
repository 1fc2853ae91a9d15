"""A measured compression speed-up scales a dense latency profile; `serve plan` reads the result."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from gpufleet.compress.serving import scaled_profile
from gpufleet.core.errors import UsageError


def _dense() -> dict:
    ref = resources.files("gpufleet.serve.plan") / "data" / "profiles" / "llama3-8b-h100.json"
    return json.loads(ref.read_text())


def test_scaled_profile_divides_latency_and_kv():
    dense = _dense()
    fast = scaled_profile(dense, prefill_speedup=1.5, decode_speedup=1.25, kv_ratio=0.75, name="m-c")
    assert fast["model"] == "m-c" and fast["schema"] == dense["schema"]
    for d, f in zip(dense["tp"], fast["tp"], strict=True):
        assert f["prefill"]["b"] == pytest.approx(d["prefill"]["b"] / 1.5)
        assert f["decode"]["a"] == pytest.approx(d["decode"]["a"] / 1.25)
        assert f["kv_capacity_tokens"] == int(d["kv_capacity_tokens"] / 0.75)
    assert fast["kv_bytes_per_token"] == int(round(dense["kv_bytes_per_token"] * 0.75))
    assert dense["tp"][0]["decode"]["a"] != fast["tp"][0]["decode"]["a"]  # the input is not modified


def test_scaled_profile_plans_fewer_gpus(tmp_path):
    import subprocess
    import sys

    fast = scaled_profile(_dense(), prefill_speedup=1.5, decode_speedup=1.5, kv_ratio=0.75)
    (tmp_path / "fast.json").write_text(json.dumps(fast))
    gpus = {}
    for name, prof in (("dense", "llama3-8b-h100"), ("fast", str(tmp_path / "fast.json"))):
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpufleet.cli.main",
                "serve",
                "plan",
                "--profile",
                prof,
                "--traffic",
                "rate=200;in=fixed:512;out=fixed:128",
                "--mode",
                "aggregated",
                "--sim-requests",
                "300",
                "--out",
                str(tmp_path / name),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        gpus[name] = json.loads(p.stdout)
    assert gpus["fast"]["feasible"] and gpus["dense"]["feasible"]
    assert gpus["fast"]["gpus"] < gpus["dense"]["gpus"]
    assert gpus["fast"]["predicted"]["goodput_per_gpu"] > gpus["dense"]["predicted"]["goodput_per_gpu"]


def test_bad_inputs():
    with pytest.raises(UsageError):
        scaled_profile({"schema": "x"}, prefill_speedup=1, decode_speedup=1)
    with pytest.raises(UsageError):
        scaled_profile(_dense(), prefill_speedup=0, decode_speedup=1)
