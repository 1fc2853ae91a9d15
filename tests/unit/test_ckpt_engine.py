"""Unit tests of the checkpoint engine: commit protocol, verification, fallback, staging, policy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.checkpoint.manifest import FileEntry, Manifest, read_manifest, write_manifest
from gpufleet.core import events as E
from gpufleet.core.errors import CheckpointError, ConfigError
from gpufleet.core.ledger import as_event

# Single-process DCP calls pass no_dist=True on purpose; DCP warns regardless.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: E.Event | str, /, **fields: Any) -> None:
        e = as_event(event, fields)
        self.events.append((e.kind, e.to_record()))

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [f for e, f in self.events if e == ev]


def make_state(seed: int = 0, n: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(n, n, generator=g), "b": torch.randn(n, generator=g)},
        "optim": {
            "state": {0: {"exp_avg": torch.randn(n, n, generator=g), "step": torch.tensor(float(seed))}},
            "param_groups": [{"lr": 0.1 * (seed + 1), "params": [0]}],
        },
        "step": seed,
        "data": {"epoch": 1, "pos": seed * 10},
        "rng": torch.get_rng_state(),
    }


def blank_state(n: int = 64) -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(n, n), "b": torch.zeros(n)},
        "optim": {
            "state": {0: {"exp_avg": torch.zeros(n, n), "step": torch.tensor(0.0)}},
            "param_groups": [{"lr": 0.0, "params": [0]}],
        },
        "step": -1,
        "data": {"epoch": 0, "pos": 0},
        "rng": torch.zeros_like(torch.get_rng_state()),
    }


def engine(tmp_path: Path, **kw: Any) -> tuple[CheckpointEngine, Sink]:
    sink = Sink()
    return CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck"), **kw), sink=sink), sink


def save_steps(eng: CheckpointEngine, steps: list[int]) -> None:
    for s in steps:
        assert eng.save(s, make_state(s), meta={"epoch": 1, "pos": s})
        eng.wait()


def shard(path: str | Path) -> Path:
    return max(Path(path).glob("*.distcp"), key=lambda p: p.stat().st_size)


# ----------------------------------------------------------------------------- config and manifest


def test_config_validation_one_line() -> None:
    for bad in (
        {"dir": ""},
        {"dir": "x", "keep_last": 0},
        {"dir": "x", "upload_url": "http://b"},
        {"dir": "x", "io_threads": 0},
        {"dir": "x", "keep_window_steps": -1},
        {"dir": "s3://b/x"},
    ):
        with pytest.raises(ConfigError) as ei:
            CheckpointConfig(**bad)
        assert "\n" not in str(ei.value)


def test_manifest_round_trip(tmp_path: Path) -> None:
    d = tmp_path / "step_00000007"
    d.mkdir()
    m = Manifest(
        step=7, time=123.5, world_size=2, files={"a.distcp": FileEntry(10, "00ff" * 4)}, meta={"pos": 3}
    )
    write_manifest(d, m)
    back = read_manifest(d)
    assert back == m and back.total_bytes == 10
    assert not list(d.glob(".*tmp"))


@pytest.mark.parametrize("damage", ["torn", "missing", "garbage", "wrong_step"])
def test_bad_manifest_makes_checkpoint_invisible(tmp_path: Path, damage: str) -> None:
    eng, _ = engine(tmp_path)
    save_steps(eng, [1, 2])
    mf = tmp_path / "ck" / "step_00000002" / "manifest.json"
    if damage == "torn":
        mf.write_bytes(mf.read_bytes()[:40])
    elif damage == "missing":
        mf.unlink()
    elif damage == "garbage":
        mf.write_text(json.dumps({"format": "gpufleet-ckpt/1", "files": {}}))
    else:
        d = json.loads(mf.read_text())
        d["step"] = 5
        mf.write_text(json.dumps(d))
    assert [c.step for c in eng.list()] == [1]
    st = blank_state()
    r = eng.load(st)
    assert r is not None and r.step == 1 and st["step"] == 1


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_and_plain_dcp(tmp_path: Path) -> None:
    eng, sink = engine(tmp_path)
    src = make_state(3)
    assert eng.save(3, src, meta={"epoch": 1, "pos": 30})
    eng.wait()
    (committed,) = sink.of(E.CkptCommitted.kind)
    assert committed["step"] == 3 and committed["files"] >= 2 and committed["bytes"] > 0
    (staged,) = sink.of(E.CkptStaged.kind)
    assert staged["bytes"] > 0 and staged["stall_s"] >= 0
    st = blank_state()
    r = eng.load(st)
    assert r is not None and r.step == 3 and r.source == "local" and r.meta == {"epoch": 1, "pos": 30}
    assert r.state_dict is st
    assert torch.equal(st["model"]["w"], src["model"]["w"])
    assert torch.equal(st["optim"]["state"][0]["exp_avg"], src["optim"]["state"][0]["exp_avg"])
    assert st["optim"]["param_groups"] == src["optim"]["param_groups"]
    assert st["step"] == 3 and st["data"] == {"epoch": 1, "pos": 30}
    assert torch.equal(st["rng"], src["rng"])
    assert sink.of(E.CkptVerified.kind)[0]["step"] == 3
    # plain torch, no gpufleet in the loop
    plain = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}, "step": 0}
    dcp.load(plain, checkpoint_id=r.path)
    assert torch.equal(plain["model"]["w"], src["model"]["w"]) and plain["step"] == 3


def test_nothing_to_load_returns_none(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path)
    assert eng.load(blank_state()) is None
    assert eng.list() == []


def test_a_template_function_is_called_only_when_there_is_something_to_load(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path, keep_last=5)
    made: list[int] = []

    def template() -> dict:
        made.append(1)
        return blank_state()

    assert eng.load(template) is None and made == []  # nothing saved: no template made
    save_steps(eng, [1, 2])
    assert eng.load(template, max_step=0) is None and made == []  # none at or below max_step
    r = eng.load(template, max_step=1)
    assert r is not None and r.step == 1 and made == [1]
    assert r.state_dict["step"] == 1  # loaded into the template it made


def test_max_step(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path, keep_last=5)
    save_steps(eng, [1, 2, 3])
    r = eng.load(blank_state(), max_step=2)
    assert r is not None and r.step == 2


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "missing", "extra_bytes"])
def test_damaged_shard_rejected_with_fallback(tmp_path: Path, damage: str) -> None:
    eng, sink = engine(tmp_path)
    save_steps(eng, [1, 2])
    f = shard(tmp_path / "ck" / "step_00000002")
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        i = len(data) // 2
        f.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])
    elif damage == "missing":
        f.unlink()
    else:
        f.write_bytes(data + b"x")
    st = blank_state()
    r = eng.load(st)
    assert r is not None and r.step == 1 and st["step"] == 1
    assert torch.equal(st["model"]["w"], make_state(1)["model"]["w"])
    (rej,) = sink.of(E.RestoreRejected.kind)
    assert rej["step"] == 2 and rej["path"].endswith("step_00000002")
    word = {"truncate": "size", "bitflip": "checksum", "missing": "missing", "extra_bytes": "size"}[damage]
    assert word in rej["reason"]


def test_all_corrupt_means_fresh_start(tmp_path: Path) -> None:
    eng, sink = engine(tmp_path)
    save_steps(eng, [1])
    shard(tmp_path / "ck" / "step_00000001").unlink()
    assert eng.load(blank_state()) is None
    assert len(sink.of(E.RestoreRejected.kind)) == 1


def test_fault_corrupt_is_detected(tmp_path: Path) -> None:
    eng, sink = engine(tmp_path)
    save_steps(eng, [1])
    assert eng.save(2, make_state(2), fault="corrupt")
    eng.wait()
    r = eng.load(blank_state())
    assert r is not None and r.step == 1
    assert "checksum" in sink.of(E.RestoreRejected.kind)[0]["reason"]


def test_fault_fail_reports_and_training_continues(tmp_path: Path) -> None:
    eng, sink = engine(tmp_path)
    save_steps(eng, [1])
    assert eng.save(2, make_state(2), fault="fail")
    with pytest.raises(CheckpointError) as ei:
        eng.wait()
    assert "step 2" in str(ei.value) and "\n" not in str(ei.value)
    assert "injected" in sink.of(E.CkptFailed.kind)[0]["reason"]
    assert not list((tmp_path / "ck").glob("*.tmp")) and not (tmp_path / "ck" / "step_00000002").exists()
    save_steps(eng, [3])
    assert [c.step for c in eng.list()] == [3, 1]


def test_resave_same_step_replaces(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path)
    save_steps(eng, [4])
    s = make_state(9)
    assert eng.save(4, s)
    eng.wait()
    st = blank_state()
    eng.load(st)
    assert torch.equal(st["model"]["w"], s["model"]["w"])
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000004"]


def test_stale_temp_dir_is_ignored_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    (root / "step_00000009.tmp").mkdir(parents=True)
    (root / "step_00000009.tmp" / "__0_0.distcp").write_bytes(b"junk")
    eng, _ = engine(tmp_path)
    assert not (root / "step_00000009.tmp").exists()
    assert eng.load(blank_state()) is None


# ----------------------------------------------------------------------------- retention


def test_retention_keep_last_and_window(tmp_path: Path) -> None:
    eng, sink = engine(tmp_path, keep_last=2, keep_window_steps=25)
    save_steps(eng, [10, 20, 30, 40, 50])
    # newest 2 = 50, 40; the look-back is the newest with step <= 50-25=25 that survived: 10 (the
    # oldest is kept while nothing is old enough, so at step 40 it was 10 that stayed, not 20)
    assert [c.step for c in eng.list()] == [50, 40, 10]
    assert sorted(d["step"] for d in sink.of(E.CkptDeleted.kind)) == [20, 30]


def test_retention_pure_rules() -> None:
    from gpufleet.checkpoint.retention import select_deletions

    assert select_deletions([1, 2, 3, 4], keep_last=2) == [1, 2]
    assert select_deletions([1, 2, 3, 4], keep_last=1, keep_window_steps=2) == [1, 3]
    assert select_deletions([2, 3, 4], keep_last=1, keep_window_steps=5) == [3]
    assert select_deletions([1, 2, 3, 4], keep_last=1, protect={2}) == [1, 3]
    assert select_deletions([5], keep_last=1, keep_window_steps=100) == []
    assert select_deletions([], keep_last=3) == []


# ----------------------------------------------------------------------------- staging


def test_staging_buffers_are_reused(tmp_path: Path) -> None:
    eng, _ = engine(tmp_path)
    s = make_state(1)
    eng.save(1, s)
    eng.wait()
    ptrs = {k: b.data_ptr() for k, b in eng._stager.buffers.items()}
    s["model"]["w"].add_(1)
    eng.save(2, s)
    eng.wait()
    assert {k: b.data_ptr() for k, b in eng._stager.buffers.items()} == ptrs
    assert ptrs and "model.w" in ptrs and "optim.state.0.exp_avg" in ptrs


def test_deferred_copy_overlaps_and_completes(tmp_path: Path) -> None:
    eng, sink = engine(tmp_path)
    big = torch.ones(4096, 4096)  # 64 MiB: the copy takes a while
    small = torch.zeros(8)
    sd = {"model": {"w": big}, "extra": {"v": small}}
    job_started = eng.save(1, sd, deferred=lambda k: k.startswith("model"))
    assert job_started
    job = eng._job
    assert job is not None
    # the non-deferred tensor was copied before save() returned
    small.fill_(5)
    blocked = eng.wait_staged()
    assert blocked >= 0 and job.stage.done.is_set()
    staged = eng._stager.buffers["model.w"]
    assert torch.equal(staged, big)  # complete after wait_staged
    big.fill_(7)  # the optimizer step may run now: must not leak into the checkpoint
    eng.wait()
    st = {"model": {"w": torch.zeros(4096, 4096)}, "extra": {"v": torch.ones(8)}}
    eng.load(st)
    assert torch.equal(st["model"]["w"], torch.ones(4096, 4096)) and torch.equal(
        st["extra"]["v"], torch.zeros(8)
    )
    (ev,) = sink.of(E.CkptStaged.kind)
    assert ev["bytes"] == big.nbytes + small.nbytes


def test_deferred_copy_not_visible_before_wait_staged(tmp_path: Path) -> None:
    """Hold the background copy on a lock (via a slow tensor's copy) and look at the buffer."""
    import threading

    from gpufleet.checkpoint import staging

    gate = threading.Event()
    orig_run = staging.StageJob._run

    def gated_run(self: staging.StageJob) -> None:
        gate.wait(10)
        orig_run(self)

    eng, _ = engine(tmp_path)
    sd = {"model": {"w": torch.full((256,), 3.0)}}
    eng.save(1, sd, deferred=lambda k: True)  # allocates the buffer; copy completes
    eng.wait()
    sd["model"]["w"].fill_(4.0)
    staging.StageJob._run = gated_run  # type: ignore[method-assign]
    try:
        eng.save(2, sd, deferred=lambda k: True)
        assert torch.equal(eng._stager.buffers["model.w"], torch.full((256,), 3.0))  # not copied yet
        assert not eng._job.stage.done.is_set()  # type: ignore[union-attr]
        gate.set()
        eng.wait_staged()
        assert torch.equal(eng._stager.buffers["model.w"], torch.full((256,), 4.0))
    finally:
        staging.StageJob._run = orig_run  # type: ignore[method-assign]
        gate.set()
    eng.wait()


def test_skip_policy_and_force(tmp_path: Path) -> None:
    import threading

    from gpufleet.checkpoint.storage.local import writer

    gate = threading.Event()
    orig = writer.SummingWriter.write_data

    def slow(self, plan, planner):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return orig(self, plan, planner)

    eng, sink = engine(tmp_path, keep_last=5)
    writer.SummingWriter.write_data = slow  # type: ignore[method-assign]
    try:
        assert eng.save(1, make_state(1))
        assert eng.save(2, make_state(2)) is False  # in flight: skipped
        assert sink.of(E.CkptSkipped.kind)[0]["step"] == 2
        threading.Timer(0.2, gate.set).start()
        assert eng.save(3, make_state(3), force=True)  # waits, then saves
    finally:
        gate.set()
        writer.SummingWriter.write_data = orig  # type: ignore[method-assign]
    eng.wait()
    assert [c.step for c in eng.list()] == [3, 1]


# ----------------------------------------------------------------------------- disk full


def _enospc_checks(eng: CheckpointEngine, sink: Sink, root: Path) -> None:
    with pytest.raises(CheckpointError) as ei:
        eng.wait()
    msg = str(ei.value)
    assert "disk full" in msg and "\n" not in msg
    assert "ENOSPC" in sink.of(E.CkptFailed.kind)[0]["reason"]
    assert not list(root.glob("*.tmp"))
    assert [c.step for c in eng.list()] == [1]
    st = {"w": torch.zeros(1024)}
    r = eng.load(st)
    assert r is not None and r.step == 1 and torch.equal(st["w"], torch.ones(1024))


def test_disk_full_on_real_tiny_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the os.write-boundary test covers ENOSPC")
    try:
        sink = Sink()
        eng = CheckpointEngine(CheckpointConfig(dir=str(mnt / f"ck-{uuid.uuid4().hex[:6]}")), sink=sink)
        assert eng.save(1, {"w": torch.ones(1024)})
        eng.wait()
        assert eng.save(2, {"w": torch.ones(1024 * 1024)})  # 4 MiB > 2 MiB tmpfs
        _enospc_checks(eng, sink, Path(eng.config.dir))
        eng.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_at_write_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Portable variant: the file write raises ENOSPC (as os.write would) half-way through."""
    from gpufleet.checkpoint.storage.local import writer

    eng, sink = engine(tmp_path)
    assert eng.save(1, {"w": torch.ones(1024)})
    eng.wait()
    orig = writer._HashingStream.write

    def write(self, b):  # type: ignore[no-untyped-def]
        if self.tell() > 4096:
            raise OSError(28, os.strerror(28))
        return orig(self, b)

    monkeypatch.setattr(writer._HashingStream, "write", write)
    assert eng.save(2, {"w": torch.ones(1024 * 1024)})
    _enospc_checks(eng, sink, tmp_path / "ck")


# ----------------------------------------------------------------------------- CLI


def test_cli_list_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from typer.testing import CliRunner

    from gpufleet.cli.ckpt import app

    eng, _ = engine(tmp_path)
    save_steps(eng, [1, 2])
    root = str(tmp_path / "ck")
    runner = CliRunner()
    out = runner.invoke(app, ["list", root])
    assert out.exit_code == 0 and "2" in out.output and "pos=2" in out.output
    out = runner.invoke(app, ["verify", root])
    assert out.exit_code == 0 and out.output.count("OK") == 2
    shard(tmp_path / "ck" / "step_00000002").write_bytes(b"x")
    out = runner.invoke(app, ["verify", root])
    assert out.exit_code == 1 and "REJECTED" in out.output
    out = runner.invoke(app, ["verify", root, "--step", "1"])
    assert out.exit_code == 0
    from gpufleet.core.errors import UsageError

    out = runner.invoke(app, ["list", str(tmp_path / "nope")])
    assert isinstance(out.exception, UsageError)
    out = runner.invoke(app, ["verify", root, "--step", "77"])
    assert isinstance(out.exception, UsageError)
    shutil.rmtree(root)


# ----------------------------------------------------------------------------- aligned direct writes


@pytest.mark.parametrize("direct", [True, False])
def test_large_tensors_written_aligned_and_load_with_plain_dcp(tmp_path: Path, direct: bool) -> None:
    """Large items go out page-aligned (O_DIRECT where supported); plain DCP still reads them."""
    g = torch.Generator().manual_seed(3)
    sd = {
        "model": {
            "w": torch.randn(1031, 517, generator=g),  # 2.1 MB, not a multiple of 4 KiB
            "h": torch.randn(700, 1500, generator=g).to(torch.bfloat16),
            "small": torch.randn(7, generator=g),
        },
        "step": 5,
    }
    eng, _ = engine(tmp_path, direct_io=direct, io_threads=2)
    assert eng.save(5, sd)
    eng.wait()
    path = eng.list()[0].path
    md = dcp.FileSystemReader(path).read_metadata()
    sizes = {name: os.path.getsize(Path(path) / name) for name in os.listdir(path)}
    for info in md.storage_data.values():
        assert info.offset + info.length <= sizes[info.relative_path]
    plain: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    dcp.load(plain, checkpoint_id=path, storage_reader=dcp.FileSystemReader(path))
    for k, v in sd["model"].items():
        assert torch.equal(plain["model"][k], v), k
    assert plain["step"] == 5
    st: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    assert eng.load(st) is not None and all(torch.equal(st["model"][k], v) for k, v in sd["model"].items())
