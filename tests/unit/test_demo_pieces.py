"""Unit tests for the demo's model, data and weight comparison (no supervisor, no process group)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from gpufleet.checkpoint.manifest import FileEntry, Manifest, write_manifest
from gpufleet.checkpoint.verify import hash_file
from gpufleet.demo.compare import compare_runs, digest, latest_checkpoint
from gpufleet.demo.data import CharCorpus, CharVocab, load_text
from gpufleet.demo.model import GPTConfig, TinyGPT
from gpufleet.demo.train_lm import WarmupCosine


def test_shipped_text_loads_and_is_reasonable() -> None:
    text = load_text()
    assert 50_000 <= len(text.encode()) <= 150_000
    assert "MENENIUS" in text
    with pytest.raises(FileNotFoundError, match="shakespeare.txt"):
        load_text("nope.txt")
    with pytest.raises(ValueError):
        load_text("../pyproject.toml")


def test_vocab_round_trip_and_unknown_char() -> None:
    v = CharVocab("hello world")
    assert v.chars == sorted(set("hello world"))
    ids = v.encode("world hello")
    assert ids.dtype == torch.long
    assert v.decode(ids) == "world hello"
    with pytest.raises(ValueError, match="'z'"):
        v.encode("z")


def test_corpus_batches_are_shifted_windows() -> None:
    text = load_text()
    c = CharCorpus.from_text(text, context=16, stride=4)
    x, y = c.batch([0, 3, c.num_samples - 1])
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert c.vocab.decode(x[0]) == text[:16]
    assert c.vocab.decode(x[1]) == text[12:28]
    with pytest.raises(IndexError):
        c.batch([c.num_samples])
    vb = c.val_batches(batch_size=8, max_batches=2)
    assert len(vb) == 2 and vb[0][0].shape == (8, 16)


def _train_a_bit(seed: int, steps: int = 5) -> TinyGPT:
    torch.manual_seed(seed)
    c = CharCorpus.from_text(load_text(), context=32, stride=32)
    m = TinyGPT(GPTConfig(len(c.vocab), context=32, d_model=32, n_layers=1, n_heads=2, dropout=0.1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = c.batch(list(range(s * 4, s * 4 + 4)))
        m(x, y).backward()
        opt.step()
        opt.zero_grad()
    return m


def test_model_is_deterministic_with_dropout() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        a, b, c = _train_a_bit(0), _train_a_bit(0), _train_a_bit(1)
    finally:
        torch.use_deterministic_algorithms(False)
    da, db, dc = (digest(dict(m.state_dict())) for m in (a, b, c))
    assert da == db
    assert da != dc


def test_model_rejects_bad_config_and_long_input() -> None:
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=10, d_model=30, n_heads=4)
    m = TinyGPT(GPTConfig(vocab_size=10, context=8, d_model=16, n_heads=2))
    assert m(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 10)
    with pytest.raises(ValueError, match="context"):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_warmup_cosine_schedule() -> None:
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(110) == pytest.approx(0.1)
    assert f(60) == pytest.approx(0.55)


def _fake_run(tmp: Path, name: str, model: torch.nn.Module, steps: tuple[int, ...]) -> Path:
    import torch.distributed.checkpoint as dcp

    run_dir = tmp / name
    for step in steps:
        d = run_dir / "checkpoints" / f"step_{step:08d}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model.state_dict(), "step": step}, checkpoint_id=str(d), no_dist=True)
        files = {f.name: FileEntry(*hash_file(f)) for f in d.iterdir()}
        write_manifest(d, Manifest(step=step, time=0.0, world_size=1, files=files))
    (run_dir / "checkpoints" / "step_00000099").mkdir()  # no manifest: does not exist for restore
    return run_dir


def test_compare_runs_identical_and_different(tmp_path: Path) -> None:
    m1 = _train_a_bit(0, steps=1)
    m2 = _train_a_bit(1, steps=1)
    a = _fake_run(tmp_path, "a", m1, (5, 10))
    b = _fake_run(tmp_path, "b", m1, (10,))
    c = _fake_run(tmp_path, "c", m2, (10,))
    assert latest_checkpoint(a)[0] == 10
    newest = a / "checkpoints" / "step_00000010"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))  # bit flip: fails verification, falls back to step 5
    assert latest_checkpoint(a)[0] == 5
    same = compare_runs(a, b)
    assert same.identical and same.max_abs_diff == 0.0 and same.a.sha256 == same.b.sha256
    diff = compare_runs(a, c)
    assert not diff.identical and diff.max_abs_diff > 0 and diff.mismatched


def test_demo_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from gpufleet.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["demo", "--steps", "50"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps" in err


def test_fault_plan_scales_with_the_run() -> None:
    from gpufleet.demo.runner import fault_plan

    assert fault_plan(400, 25) == [
        "ckpt_corrupt:step=100",
        "kill:rank=1,step=112,settle=1",
        "hang:rank=0,step=212,settle=1",
        "nan:step=312",
    ]
    small = fault_plan(200, 20, nproc=1)
    assert small[1] == "kill:rank=0,step=70,settle=1"
