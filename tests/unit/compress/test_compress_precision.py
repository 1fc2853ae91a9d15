"""bf16 autocast by default only where the CPU computes it natively: on an AVX2-only host torch
emulates bf16 matrix products, several times slower than fp32 (docs/compress.md)."""

from __future__ import annotations

import pytest

from gpufleet.compress import model as cm


def test_an_explicit_setting_wins():
    assert cm.use_bf16(True) is True
    assert cm.use_bf16(False) is False


@pytest.mark.parametrize("native", [True, False])
def test_the_default_follows_the_cpu(monkeypatch, native):
    monkeypatch.setattr(cm, "native_bf16", lambda: native)
    assert cm.use_bf16(None) is native
