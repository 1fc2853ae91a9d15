"""Profiles: NNLS fit, table mode, file format and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpufleet.core.errors import UsageError
from gpufleet.serve.plan import profile as pm


def test_nnls_recovers_coefficients_and_clamps() -> None:
    rng = np.random.default_rng(0)
    L = rng.integers(16, 2048, size=40).astype(float)
    y = 12.0 + 0.1 * L + 2e-5 * L * L
    c, info = pm.fit_prefill([(v, v * v, t) for v, t in zip(L, y, strict=True)])
    assert c.a == pytest.approx(12.0, rel=1e-6) and c.b == pytest.approx(0.1, rel=1e-6)
    assert c.c == pytest.approx(2e-5, rel=1e-5) and info["r2"] == pytest.approx(1.0)
    # data whose unconstrained fit has a negative slope: clamped to >= 0
    c2, _ = pm.fit_decode([(100.0, 1.0, 10.0), (200.0, 1.0, 9.0), (300.0, 1.0, 8.5)])
    assert min(c2.a, c2.b, c2.c) >= 0.0


def test_table_round_trip(tmp_path: Path) -> None:
    rows = ["phase,tp,batch,input_len,context,time_ms"]
    for tp in (1, 2):
        for b in (1, 4):
            for n in (128, 512, 1024):
                rows.append(f"prefill,{tp},{b},{n},,{(10 + 0.1 * b * n + 1e-5 * b * n * n) / tp:.6f}")
                rows.append(f"decode,{tp},{b * 8},,{n},{(8 + 0.0005 * b * 8 * n + 0.05 * b * 8) / tp:.6f}")
    t = tmp_path / "t.csv"
    t.write_text("\n".join(rows))
    prof = pm.profile_from_table(t, "m", "gpu", kv_bytes_per_token=1000)
    assert sorted(prof.tps) == [1, 2]
    assert prof.tps[2].prefill.b == pytest.approx(0.05, rel=1e-4)
    assert prof.tps[1].decode_ms(1000, 10) == pytest.approx(8 + 0.5 + 0.5, rel=1e-4)
    out = tmp_path / "p.json"
    prof.save(out)
    back = pm.load_profile(str(out))
    assert back.tps[1].prefill == prof.tps[1].prefill and back.kv_bytes_per_token == 1000


@pytest.mark.parametrize(
    "content,msg",
    [
        ("{", "not valid JSON"),
        ('{"schema": "x"}', "not a gpufleet profile"),
        ('{"schema": "gpufleet.serve.profile", "version": 9, "tp": []}', "version"),
        (
            '{"schema": "gpufleet.serve.profile", "version": 1, "tp": [{"tp": 1,'
            ' "prefill": {"a": -1, "b": 0, "c": 0}, "decode": {"a": 1, "b": 0, "c": 0}}]}',
            "a must be a number >= 0",
        ),
    ],
)
def test_bad_profile_is_one_line(tmp_path: Path, content: str, msg: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(UsageError, match=msg):
        pm.load_profile(str(p))


def test_bad_table(tmp_path: Path) -> None:
    t = tmp_path / "t.csv"
    t.write_text("phase,tp,batch,input_len,context,time_ms\nprefill,1,1,10,,x\n")
    with pytest.raises(UsageError, match="line 2"):
        pm.profile_from_table(t, "m", "g")
    t.write_text("phase,tp,batch,input_len,context,time_ms\nprefill,1,1,10,,3\nprefill,1,1,20,,4\n")
    with pytest.raises(UsageError, match="needs both prefill and decode"):
        pm.profile_from_table(t, "m", "g")


def test_examples_ship_with_their_source() -> None:
    names = pm.example_profiles()
    assert {"opt-13b-a100", "llama3-8b-h100"} <= set(names)
    for n in names:
        p = pm.load_profile(n)
        assert p.source in ("measured", "published-derived") and p.source_note
        if p.source == "published-derived":
            assert "APPROXIMATION" in p.source_note
    with pytest.raises(UsageError, match="profile not found"):
        pm.load_profile("no-such-profile")
    assert json.loads(json.dumps(pm.load_profile("opt-13b-a100").to_json()))["version"] == 1


def test_overlap_share_tells_serial_from_batching_servers() -> None:
    from types import SimpleNamespace as R

    # one at a time: the second request's first token comes after the first's last one
    serial = [R(sent_s=0.0, ttft_s=0.1, e2e_s=1.0), R(sent_s=0.0, ttft_s=1.05, e2e_s=2.0)]
    assert pm.overlap_share(serial) == 0.0
    # batching: both stream at once
    batched = [R(sent_s=0.0, ttft_s=0.1, e2e_s=1.1), R(sent_s=0.05, ttft_s=0.1, e2e_s=1.1)]
    assert pm.overlap_share(batched) == pytest.approx(0.95 / 2.0)
    assert pm.overlap_share(serial) < pm.SERIAL_OVERLAP < pm.overlap_share(batched)
    assert pm.overlap_share([R(sent_s=0.0, ttft_s=None, e2e_s=None)]) == 0.0
