"""The engine's in-process snapshot of its newest commit (checkpoint/snapshot.py), and what a rank of an
in-place round holds (train/held.py): kept only for a commit, dropped by the next staging, verified per
buffer, refused when it does not fit the live objects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.checkpoint.manifest import step_dirname
from gpufleet.checkpoint.snapshot import SnapshotMismatch
from gpufleet.checkpoint.staging import within_half
from gpufleet.train.held import Held, Preloader, agree, commit_bytes, newest_commit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
        "opt": {"state": {"m": torch.randn(256, 64, generator=g), "step": torch.tensor(float(step))}},
        "loader": {"position": step * 10, "order": [3, 1, 2]},
    }


def engine(root: Path, **kw: Any) -> CheckpointEngine:
    return CheckpointEngine(CheckpointConfig(dir=str(root / "ck"), **kw))


def test_a_commit_is_kept_whole_and_copies_back_into_the_live_objects(tmp_path: Path) -> None:
    eng = engine(tmp_path, keep_snapshot=True)
    live = state(3)
    assert eng.save(3, live, meta={"epoch": 1})
    eng.wait()
    snap = eng.snapshot()
    assert snap is not None and snap.step == 3 and snap.meta == {"epoch": 1}
    assert snap.path == str(tmp_path / "ck" / step_dirname(3))
    assert snap.verify() is None
    # Training goes on: the live objects change, the snapshot does not.
    with torch.no_grad():
        live["model"]["w"].add_(1.0)
        live["opt"]["state"]["step"].fill_(99.0)
    live["loader"]["position"] = 12345
    w = live["model"]["w"]
    out = snap.copy_into(live)
    assert out["model"]["w"] is w  # copied into, as a DCP load does
    for key in ("w", "b"):
        assert torch.equal(live["model"][key], state(3)["model"][key])
    assert torch.equal(live["opt"]["state"]["m"], state(3)["opt"]["state"]["m"])
    assert live["opt"]["state"]["step"].item() == 3.0
    assert out["loader"] == {"position": 30, "order": [3, 1, 2]}
    assert eng.snapshot(max_step=2) is None  # a rollback bound below it: not this one


def test_the_next_staging_drops_it_and_only_a_commit_makes_one(tmp_path: Path) -> None:
    eng = engine(tmp_path, keep_snapshot=True)
    assert eng.save(1, state(1))
    eng.wait()
    assert eng.snapshot() is not None
    assert eng.save(2, state(2), fault="fail")  # staged over the buffers, then never committed
    with pytest.raises(Exception, match="failed"):
        eng.wait()
    assert eng.snapshot() is None


def test_off_by_default(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    assert eng.save(1, state(1))
    eng.wait()
    assert eng.snapshot() is None


def test_a_buffer_changed_after_the_commit_fails_verification(tmp_path: Path) -> None:
    eng = engine(tmp_path, keep_snapshot=True)
    assert eng.save(4, state(4))
    eng.wait()
    snap = eng.snapshot()
    assert snap is not None
    snap.staged["opt"]["state"]["m"][7, 7] += 1.0
    reason = snap.verify()
    assert reason is not None and "opt.state.m" in reason


@pytest.mark.parametrize("change", ["shape", "missing", "dtype"])
def test_a_template_that_does_not_fit_is_refused_before_any_copy(tmp_path: Path, change: str) -> None:
    eng = engine(tmp_path, keep_snapshot=True)
    assert eng.save(2, state(2))
    eng.wait()
    snap = eng.snapshot()
    assert snap is not None
    live = state(7)
    if change == "shape":
        live["model"]["b"] = torch.zeros(65)
    elif change == "missing":
        del live["opt"]["state"]["m"]
    else:
        live["model"]["b"] = live["model"]["b"].double()
    before = live["model"]["w"].clone()
    with pytest.raises(SnapshotMismatch):
        snap.copy_into(live)
    assert torch.equal(live["model"]["w"], before)


def test_the_next_rounds_engine_takes_over_buffers_and_snapshot(tmp_path: Path) -> None:
    old = engine(tmp_path, keep_snapshot=True)
    assert old.save(5, state(5))
    old.wait()
    snap = old.snapshot()
    new = CheckpointEngine(old.config, previous=old)
    assert new.snapshot() is snap and snap is not None and snap.verify() is None
    assert new.save(6, state(6))  # the same buffers, staged again: the old snapshot is gone
    new.wait()
    assert new.snapshot() is not None and new.snapshot().step == 6  # type: ignore[union-attr]


def test_a_read_only_engine_leaves_a_save_in_flight_alone(tmp_path: Path) -> None:
    tmp = tmp_path / "ck" / (step_dirname(9) + ".tmp")
    tmp.mkdir(parents=True)
    CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck"), read_only=True))
    assert tmp.exists()
    CheckpointEngine(CheckpointConfig(dir=str(tmp_path / "ck")))
    assert not tmp.exists()  # a writer's engine sweeps killed saves' temp dirs


def test_newest_commit_respects_the_rollback_bound(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    assert newest_commit(tmp_path / "ck") is None
    for s in (2, 4):
        assert eng.save(s, state(s))
        eng.wait()
    assert newest_commit(tmp_path / "ck") == 4
    assert newest_commit(tmp_path / "ck", max_step=3) == 2
    assert newest_commit(tmp_path / "ck", max_step=1) is None
    # a spare sizes its first preload by the commit's files, before it allocates anything
    sizes = [sum(f.stat().st_size for f in (tmp_path / "ck" / step_dirname(s)).iterdir()) for s in (2, 4)]
    manifest = [(tmp_path / "ck" / step_dirname(s) / "manifest.json").stat().st_size for s in (2, 4)]
    assert [commit_bytes(tmp_path / "ck", s) for s in (2, 4)] == [
        a - b for a, b in zip(sizes, manifest, strict=True)
    ]
    assert commit_bytes(tmp_path / "ck", 3) is None


def test_a_preloader_follows_commits_and_a_failed_load_holds_nothing(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    loads: list[int] = []

    def load(step: int) -> Held:
        loads.append(step)
        if step == 4:
            raise OSError("disk went away")
        return Held(step=step, path="p", source="local", meta={})

    pre = Preloader(tmp_path / "ck", None, load)
    assert pre.catch_up(None) is None and loads == []  # nothing committed yet
    assert eng.save(2, state(2))
    eng.wait()
    assert pre.catch_up(None) is not None and pre.held.step == 2  # type: ignore[union-attr]
    assert pre.catch_up(None).step == 2 and loads == [2]  # type: ignore[union-attr]  # not loaded twice
    assert eng.save(4, state(4))
    eng.wait()
    assert pre.catch_up(None) is None and pre.error == "OSError: disk went away"
    assert pre.catch_up(3) is not None and pre.held.step == 2  # type: ignore[union-attr]


def test_a_preloader_thread_stops_when_told(tmp_path: Path) -> None:
    eng = engine(tmp_path)
    assert eng.save(1, state(1))
    eng.wait()
    pre = Preloader(tmp_path / "ck", None, lambda s: Held(step=s, path="p", source="local", meta={}))
    pre.start()
    held = None
    for _ in range(200):  # the thread looks every 0.1 s; the load here is instant
        held = pre.held
        if held is not None:
            break
        import time

        time.sleep(0.01)
    assert pre.stop() is not None and held is not None and held.step == 1
    assert not pre._thread.is_alive()


@pytest.fixture
def group(tmp_path: Path) -> Any:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "held,newest,fast",
    [(5, 5, True), (None, 5, False), (4, 5, False), (None, None, False), (0, 0, True)],
)
def test_agree_needs_the_newest_commit_held(
    group: Any, held: int | None, newest: int | None, fast: bool
) -> None:
    assert agree(held, newest, group) is fast


@pytest.mark.parametrize(
    "each,ranks,available,held,fits",
    [
        (4, 2, 16, 0, True),  # 8 of 16: exactly half
        (5, 2, 16, 0, False),
        (5, 2, 12, 0, False),
        (5, 2, 12, 4, True),  # what they hold now counts: 10 <= (12 + 2 * 4) / 2
        (8, 2, 16, 8, True),  # held whole already: still half at most of what could be used
        (8, 2, 4, 8, False),  # ... else given back (deduplicated staging frees it)
        (2**30, 10**9, 2**40, 0, False),
        (10**12, 2, None, 0, True),  # no /proc/meminfo: nothing to go by
    ],
)
def test_within_half_of_the_memory_the_nodes_ranks_could_use(
    each: int, ranks: int, available: int | None, held: int, fits: bool
) -> None:
    assert within_half(each, ranks, available, held) is fits
