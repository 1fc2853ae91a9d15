"""The in-memory checkpoint tier: the keeper's budget, eviction and verified copies, and restore's order
(memory, then local disk), with the engine's real DCP checkpoints."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.checkpoint.manifest import FileEntry, Manifest, list_committed, step_dirname, write_manifest
from gpufleet.checkpoint.storage.memory import MemoryKeeper, keeper_dir, release
from gpufleet.checkpoint.verify import hash_file
from gpufleet.core import events as E
from gpufleet.core.errors import ConfigError
from gpufleet.core.ledger import Ledger, read_events
from gpufleet.core.settings import RunSettings, parse_size

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def fake_ckpt(root: Path, step: int, size: int) -> tuple[Path, Manifest]:
    """A committed checkpoint directory (two files + manifest) of ``size`` payload bytes."""
    d = root / step_dirname(step)
    d.mkdir(parents=True)
    files = {}
    for name, n in ((".metadata", 100), ("__0_0.distcp", size - 100)):
        (d / name).write_bytes(bytes((step * 7 + i) % 251 for i in range(n)))
        files[name] = FileEntry(*hash_file(d / name))
    m = Manifest(step=step, time=1.0, world_size=1, files=files)
    write_manifest(d, m)
    return d, m


def test_keeps_verified_copies_and_evicts_the_oldest_within_budget(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    keeper = MemoryKeeper(tmp_path / "mem", budget_bytes=25_000)
    results = [keeper.keep(*fake_ckpt(disk, s, 10_000)) for s in (1, 2, 3)]
    assert [r.kept for r in results] == [True, True, True]
    assert results[0].evicted == [] and results[1].evicted == [] and results[2].evicted == [1]
    assert keeper.steps() == [3, 2]
    for r in results:
        assert r.used_bytes <= keeper.budget_bytes and r.bytes > 10_000  # files + manifest
    assert keeper.used_bytes() == results[2].used_bytes == results[1].bytes + results[2].bytes
    for p, m in keeper.committed():  # byte-identical to disk, same manifest
        for name in m.files:
            assert (p / name).read_bytes() == (disk / p.name / name).read_bytes()


def test_a_checkpoint_larger_than_the_budget_is_not_kept_and_evicts_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    keeper = MemoryKeeper(tmp_path / "mem", budget_bytes=12_000)
    assert keeper.keep(*fake_ckpt(disk, 1, 5_000)).kept
    r = keeper.keep(*fake_ckpt(disk, 2, 20_000))
    assert not r.kept and "larger than the memory tier budget" in r.reason and r.evicted == []
    assert keeper.steps() == [1]  # the older copy is still there to restore from


def test_a_copy_that_does_not_match_the_manifest_is_not_kept(tmp_path: Path) -> None:
    d, m = fake_ckpt(tmp_path / "disk", 4, 10_000)
    with open(d / "__0_0.distcp", "r+b") as f:  # the disk copy rotted after its commit
        f.seek(5000)
        f.write(b"\xff")
    keeper = MemoryKeeper(tmp_path / "mem", budget_bytes=1 << 20)
    r = keeper.keep(d, m)
    assert not r.kept and "does not match the manifest" in r.reason and "xxh3" in r.reason
    assert keeper.steps() == [] and keeper.used_bytes() == 0  # nothing half-copied is left


def test_torn_copies_are_invisible_and_swept_and_a_resaved_step_replaces_its_copy(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    mem = tmp_path / "mem"
    keeper = MemoryKeeper(mem, budget_bytes=1 << 20)
    keeper.keep(*fake_ckpt(disk, 1, 4_000))
    # a copy killed midway: a temp dir, and a step dir whose manifest was never written
    (mem / "step_00000002.tmp").mkdir()
    (mem / "step_00000002.tmp" / "x").write_bytes(b"y" * 1000)
    (mem / "step_00000003").mkdir()
    assert [m.step for _, m in list_committed(mem)] == [1]
    d, m = fake_ckpt(tmp_path / "disk2", 1, 6_000)  # step 1 again, other contents (after a rollback)
    r = keeper.keep(d, m)
    assert r.kept and sorted(p.name for p in mem.iterdir()) == ["step_00000001"]
    assert (mem / "step_00000001" / "__0_0.distcp").read_bytes() == (d / "__0_0.distcp").read_bytes()


def test_keeper_dir_is_per_checkpoint_dir_and_release_frees_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GPUFLEET_MEMORY_TIER_DIR", str(tmp_path / "shm"))
    a, b = keeper_dir(tmp_path / "run1" / "checkpoints"), keeper_dir(tmp_path / "run2" / "checkpoints")
    assert a != b and a.parent == b.parent and a.is_relative_to(tmp_path / "shm")
    assert keeper_dir(str(tmp_path / "run1" / "x" / ".." / "checkpoints")) == a  # same directory, same keeper
    monkeypatch.delenv("GPUFLEET_MEMORY_TIER_DIR")
    assert str(keeper_dir("/x")).startswith("/dev/shm/")
    monkeypatch.setenv("GPUFLEET_MEMORY_TIER_DIR", str(tmp_path / "shm"))
    a.mkdir(parents=True)
    (a / "f").write_bytes(b"1")
    release(tmp_path / "run1" / "checkpoints")
    assert not a.exists() and not a.parent.exists()


def test_percent_n_in_the_tier_dir_is_this_nodes_name(tmp_path: Path, monkeypatch) -> None:
    """Nodes sharing one host's /dev/shm (the CI's one-host Slurm cluster) each get their own keeper."""
    monkeypatch.setenv("GPUFLEET_MEMORY_TIER_DIR", str(tmp_path / "shm" / "%n"))
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    n2 = keeper_dir(tmp_path / "ckpt")
    assert n2.is_relative_to(tmp_path / "shm" / "n2")
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert keeper_dir(tmp_path / "ckpt").is_relative_to(tmp_path / "shm" / "n3")
    monkeypatch.delenv("SLURMD_NODENAME")
    assert keeper_dir(tmp_path / "ckpt").is_relative_to(tmp_path / "shm" / socket.gethostname())
    n2.mkdir(parents=True)
    release(tmp_path / "ckpt")  # this node's own keeper only
    assert n2.exists()


@pytest.mark.parametrize(
    "raw, expect",
    [("2GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("512mib", 512 << 20), ("0", 0), (4096, 4096)],
)
def test_sizes(raw: Any, expect: int) -> None:
    assert parse_size(raw) == expect
    assert RunSettings.load({"GPUFLEET_MEMORY_TIER": str(raw)}).memory_tier == expect


@pytest.mark.parametrize("raw", ["lots", "-1GiB", "2 parsecs", "1e9", ""])
def test_bad_sizes_name_the_variable(raw: str) -> None:
    if raw == "":  # "" is unset
        assert RunSettings.load({"GPUFLEET_MEMORY_TIER": raw}).memory_tier == 0
        return
    with pytest.raises(ConfigError, match="GPUFLEET_MEMORY_TIER=.*invalid size; use a size such as"):
        RunSettings.load({"GPUFLEET_MEMORY_TIER": raw})


# ------------------------------------------------------------------ through the engine (real DCP)
class Sink:
    """A real ledger in its own directory; ``of(kind)``: the records of that kind."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.ledger = Ledger(d, session="t")
        self.emit = self.ledger.emit

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.dir) if e["ev"] == ev]


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(7, generator=g)},
        "step": seed,
    }


def blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(256, 1024), "b": torch.zeros(7)}, "step": -1}


def engine(tmp_path: Path, budget: int, sink: Sink | None = None) -> CheckpointEngine:
    cfg = CheckpointConfig(dir=str(tmp_path / "ck"), memory_bytes=budget, memory_dir=str(tmp_path / "mem"))
    return CheckpointEngine(cfg, sink=sink)


def test_engine_restores_from_memory_first_then_disk_when_the_copy_is_corrupt(tmp_path: Path) -> None:
    sink = Sink(tmp_path / "l1")
    eng = engine(tmp_path, 4 << 20, sink)
    for s in (1, 2):
        assert eng.save(s, state(s))
        eng.wait()
    kept = sink.of(E.CkptMemory.kind)
    assert [k["step"] for k in kept] == [1, 2] and all(k["kept"] for k in kept)
    assert kept[1].get("peer") is None and "no peer" in kept[1]["reason"]
    # A restarted process: the memory copy is chosen, verified like disk, and loaded bit-exact.
    sink2 = Sink(tmp_path / "l2")
    out = blank()
    res = engine(tmp_path, 4 << 20, sink2).load(out)
    assert res is not None and res.step == 2 and res.source == "memory"
    assert res.path == str(tmp_path / "mem" / "step_00000002")
    assert torch.equal(out["model"]["w"], state(2)["model"]["w"]) and out["step"] == 2
    assert sink2.of(E.CkptVerified.kind)[0]["source"] == "memory"
    # Corrupt the memory copy: rejected by its checksum, the same step comes from disk.
    shard = max((tmp_path / "mem" / "step_00000002").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        x = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([x[0] ^ 1]))
    sink3 = Sink(tmp_path / "l3")
    out = blank()
    res = engine(tmp_path, 4 << 20, sink3).load(out)
    assert res is not None and res.step == 2 and res.source == "local"
    (rej,) = sink3.of(E.RestoreRejected.kind)
    assert rej["path"] == str(tmp_path / "mem" / "step_00000002") and "checksum mismatch" in rej["reason"]
    assert torch.equal(out["model"]["w"], state(2)["model"]["w"])


def test_engine_over_budget_says_so_and_saves_go_on(tmp_path: Path, capfd) -> None:
    sink = Sink(tmp_path / "l1")
    eng = engine(tmp_path, 100_000, sink)  # a checkpoint is ~1 MB
    assert eng.save(1, state(1))
    eng.wait()
    assert "warning: step 1 not kept in memory" in capfd.readouterr().err
    (m,) = sink.of(E.CkptMemory.kind)
    assert not m["kept"] and m["bytes"] > m["budget_bytes"] == 100_000 and "larger than" in m["reason"]
    assert len(sink.of(E.CkptCommitted.kind)) == 1
    res = engine(tmp_path, 100_000).load(blank())
    assert res is not None and res.source == "local"


def test_memory_tier_off_by_default_touches_no_memory(tmp_path: Path) -> None:
    sink = Sink(tmp_path / "l1")
    eng = CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck")), sink=sink)
    assert eng.save(1, state(1))
    eng.wait()
    assert sink.of(E.CkptMemory.kind) == [] and eng.load(blank()).source == "local"
    with pytest.raises(ConfigError, match="memory_bytes"):
        CheckpointConfig(dir="x", memory_bytes=-1)


def test_memory_copy_without_its_disk_commit_is_never_restored(tmp_path: Path) -> None:
    eng = engine(tmp_path, 4 << 20)
    for s in (1, 2):
        assert eng.save(s, state(s))
        eng.wait()
    # A skip rollback moves step 2 to checkpoints/abandoned/: its memory copy must not come back.
    abandoned = tmp_path / "ck" / "abandoned"
    abandoned.mkdir()
    (tmp_path / "ck" / "step_00000002").rename(abandoned / "step_00000002.rollback1")
    out = blank()
    res = engine(tmp_path, 4 << 20).load(out)
    assert res is not None and res.step == 1 and res.source == "memory"
    assert torch.equal(out["model"]["w"], state(1)["model"]["w"])
    # A run directory started over: no disk commits, stale memory copies are ignored.
    for p in (tmp_path / "ck").glob("step_*"):
        (p / "manifest.json").unlink()
    assert engine(tmp_path, 4 << 20).load(blank()) is None
