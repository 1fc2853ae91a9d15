"""One-pass verified restore: each file read once while hashed, nothing unverified reaches the caller."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.core import events as E
from gpufleet.core.ledger import as_event

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: E.Event | str, /, **fields: Any) -> None:
        e = as_event(event, fields)
        self.events.append((e.kind, e.to_record()))

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [f for e, f in self.events if e == ev]


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(512, 1000, generator=g),  # 2 MB, data page-aligned in the file
            "odd": torch.randn(3, 100_003, generator=g),  # not a whole number of pages
            "b": torch.randn(10, generator=g),
        },
        "optim": {"state": {0: {"exp_avg": torch.randn(512, 1000, generator=g)}}},
        "step": seed,
    }


def blank(fill: float = 7.0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {
        "model": {
            "w": torch.full((512, 1000), fill, dtype=dtype),
            "odd": torch.full((3, 100_003), fill),
            "b": torch.full((10,), fill),
        },
        "optim": {"state": {0: {"exp_avg": torch.full((512, 1000), fill)}}},
        "step": -1,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(torch.equal(a["model"][k].float(), b["model"][k]) for k in b["model"])
        and torch.equal(a["optim"]["state"][0]["exp_avg"], b["optim"]["state"][0]["exp_avg"])
        and a["step"] == b["step"]
    )


def flip(path: Path, where: float) -> None:
    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(int(shard.stat().st_size * where))
        x = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([x[0] ^ 0x40]))


def saved(tmp_path: Path, steps: list[int], **kw: Any) -> CheckpointEngine:
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck"), **kw))
    for s in steps:
        assert eng.save(s, state(s))
        eng.wait()
    return eng


@pytest.mark.parametrize("fresh", [False, True])
def test_one_pass_round_trip_reads_into_staging_buffers(tmp_path: Path, fresh: bool) -> None:
    eng = saved(tmp_path, [1, 2])
    sink = Sink()
    if fresh:  # a restarted process: no staging buffers yet, they are created by the restore
        eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck")), sink=sink)
    else:
        eng._sink = sink
    out = blank()
    res = eng.load(out)
    assert res is not None and res.step == 2 and same(out, state(2))
    (v,) = sink.of(E.CkptVerified.kind)
    assert v["one_pass"] and v["in_buffers_bytes"] >= (2 * 512 * 1000 + 3 * 100_003) * 4 - 3 * 4096
    # The next save reuses the buffers the restore filled: nothing new is allocated.
    before = {k: t.data_ptr() for k, t in eng._stager.buffers.items()}
    assert eng.save(3, state(3))
    eng.wait()
    assert all(eng._stager.buffers[k].data_ptr() == p for k, p in before.items() if k in eng._stager.buffers)


@pytest.mark.parametrize("where", [0.01, 0.5, 0.999])
def test_corrupt_newest_falls_back_and_never_mixes(tmp_path: Path, where: float) -> None:
    saved(tmp_path, [1, 2])
    flip(tmp_path / "ck" / "step_00000002", where)
    sink = Sink()
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck")), sink=sink)
    out = blank()
    res = eng.load(out)
    assert res is not None and res.step == 1 and same(out, state(1))
    (rej,) = sink.of(E.RestoreRejected.kind)
    assert rej["step"] == 2 and "checksum mismatch" in rej["reason"]


def test_all_corrupt_leaves_caller_tensors_untouched(tmp_path: Path) -> None:
    saved(tmp_path, [1])
    flip(tmp_path / "ck" / "step_00000001", 0.5)
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck")))
    out = blank()
    assert eng.load(out) is None
    assert same(out, blank()) or all(bool((t == 7.0).all()) for t in out["model"].values())
    assert bool((out["optim"]["state"][0]["exp_avg"] == 7.0).all()) and out["step"] == -1


def test_dtype_change_takes_dcp_path_after_verification(tmp_path: Path) -> None:
    eng = saved(tmp_path, [4])
    out = blank(dtype=torch.float64)
    res = eng.load(out)
    assert res is not None and out["model"]["w"].dtype == torch.float64
    assert torch.equal(out["model"]["w"], state(4)["model"]["w"].double())
    assert torch.equal(out["model"]["odd"], state(4)["model"]["odd"])


def test_page_cached_checkpoint_is_read_buffered_and_scratch_is_reused(tmp_path: Path) -> None:
    sink = Sink()
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck"), direct_io=False), sink=sink)
    assert eng.save(5, state(5))
    eng.wait()
    out = blank()
    assert eng.load(out) is not None and same(out, state(5))
    chunks = eng._pool.allocated
    assert eng.load(blank()) is not None
    assert eng._pool.allocated == chunks  # the second restore allocates no new scratch
    assert sink.of(E.CkptVerified.kind)[0]["cached_files"] >= 1
