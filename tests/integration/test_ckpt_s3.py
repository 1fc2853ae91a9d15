"""The engine's S3 tier against a real S3-compatible server (SeaweedFS): upload, fallback, retention."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.core import events as E
from gpufleet.core.ledger import as_event

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: E.Event | str, /, **fields: Any) -> None:
        e = as_event(event, fields)
        self.events.append((e.kind, e.to_record()))

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [f for e, f in self.events if e == ev]


def state(v: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((128, 128), v)}, "step": int(v)}


def test_upload_then_restore_from_s3(tmp_path: Path, s3_url: str) -> None:
    sink = Sink()
    root = tmp_path / "ck"
    eng = CheckpointEngine(CheckpointConfig(dir=str(root), upload_url=s3_url, keep_last=2), sink=sink)
    for step in (1, 2, 3):
        assert eng.save(step, state(step), meta={"pos": step})
        eng.wait()
    assert [u["step"] for u in sink.of(E.CKPT_UPLOADED)] == [1, 2, 3]
    assert all(u["bytes"] > 0 and u["url"].startswith(s3_url) for u in sink.of(E.CKPT_UPLOADED))
    infos = eng.list()
    assert [(i.step, i.location) for i in infos] == [(3, "local"), (2, "local"), (3, "s3"), (2, "s3")]

    # The local copy of step 3 is corrupt: restore takes the S3 copy of the same step.
    shard = max((root / "step_00000003").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(b"garbage")
    sd = state(0)
    r = eng.load(sd)
    assert r is not None and r.step == 3 and r.source == "s3" and r.meta == {"pos": 3}
    assert torch.equal(sd["model"]["w"], torch.full((128, 128), 3.0)) and sd["step"] == 3
    assert sink.of(E.RESTORE_REJECTED)[0]["step"] == 3

    # A new machine: nothing local at all.
    shutil.rmtree(root)
    eng2 = CheckpointEngine(CheckpointConfig(dir=str(root), upload_url=s3_url), sink=sink)
    sd = state(0)
    r = eng2.load(sd, max_step=2)
    assert r is not None and r.step == 2 and r.source == "s3" and sd["step"] == 2
