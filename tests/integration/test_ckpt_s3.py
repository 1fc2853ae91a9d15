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
    assert [u["step"] for u in sink.of(E.CkptUploaded.kind)] == [1, 2, 3]
    assert all(u["bytes"] > 0 and u["url"].startswith(s3_url) for u in sink.of(E.CkptUploaded.kind))
    infos = eng.list()
    assert [(i.step, i.location) for i in infos] == [(3, "local"), (2, "local"), (3, "s3"), (2, "s3")]

    # The local copy of step 3 is corrupt: restore takes the S3 copy of the same step.
    shard = max((root / "step_00000003").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(b"garbage")
    sd = state(0)
    r = eng.load(sd)
    assert r is not None and r.step == 3 and r.source == "s3" and r.meta == {"pos": 3}
    assert torch.equal(sd["model"]["w"], torch.full((128, 128), 3.0)) and sd["step"] == 3
    assert sink.of(E.RestoreRejected.kind)[0]["step"] == 3

    # A new machine: nothing local at all.
    shutil.rmtree(root)
    eng2 = CheckpointEngine(CheckpointConfig(dir=str(root), upload_url=s3_url), sink=sink)
    sd = state(0)
    r = eng2.load(sd, max_step=2)
    assert r is not None and r.step == 2 and r.source == "s3" and sd["step"] == 2


def test_shards_stream_to_s3_while_written_through_a_flaky_s3(tmp_path: Path, s3_url: str, s3_server) -> None:
    """The engine's shards go up as multipart uploads fed by the writer (never sent whole again),
    the manifest last; injected 5xx on a fifth of the requests are retried; S3 alone restores it."""
    from support.flaky_proxy import FlakyProxy

    g = torch.Generator().manual_seed(3)
    sd = {"model": {f"w{i}": torch.rand(1024, 1024, generator=g) for i in range(6)}, "step": 5}  # 24 MiB
    sink = Sink()
    with FlakyProxy(s3_server.endpoint, error_rate=0.2, seed=1) as proxy:  # seed 1: the 1st fails
        # One shard file (io_threads=1): 24 MiB streams as a 16 MiB part, then the last 8 MiB.
        cfg = CheckpointConfig(
            dir=str(tmp_path / "ck"), upload_url=s3_url, s3_endpoint=proxy.endpoint, io_threads=1
        )
        eng = CheckpointEngine(cfg, sink=sink)
        assert eng.save(5, sd)
        eng.wait()
        log, stats = proxy.request_log(), proxy.stats()
    assert stats["injected"] > 0 and not sink.of(E.CkptFailed.kind)
    assert [u["step"] for u in sink.of(E.CkptUploaded.kind)] == [5]
    ok = [e for e in log if e["status"] == 200]
    shard_puts = [e for e in ok if e["method"] == "PUT" and ".distcp" in e["path"]]
    assert len(shard_puts) == 2 and all("partNumber=" in e["path"] for e in shard_puts)
    manifest = [e for e in ok if e["method"] == "PUT" and e["path"].split("?")[0].endswith("/manifest.json")]
    assert len(manifest) == 1 and manifest[0]["start"] >= max(e["end"] for e in shard_puts)

    out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    r = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "fresh"), upload_url=s3_url)).load(out)
    assert r is not None and r.source == "s3" and r.step == 5 and out["step"] == 5
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())
