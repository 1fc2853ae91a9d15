"""`gpufleet compress heal` is a supervised gpufleet run: a tiny random Llama student distilled from
its tiny dense teacher, killed from outside (kill -9) after a committed checkpoint, resumes and ends
with weights bit-identical to an unkilled run; the ledger shows the crash, the restore and the
restart. Bad input (tokenizer mismatch, no config) is one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events
from unit.compress.tinyllama import make_tiny, make_tokenizer, tiny_texts

# two heal runs (the reference and the killed one), can pass 300 s on a loaded host
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("transformers")

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]
STEPS, EVERY = 24, 4


def _evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny dense teacher and its pruned student (HF dirs), and a small domain corpus dir."""
    from gpufleet.compress import importance, prune
    from gpufleet.compress.export import save_hf

    root = tmp_path_factory.mktemp("heal")
    tok = make_tokenizer()
    teacher = make_tiny(len(tok))
    save_hf(teacher, tok, root / "teacher")
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in (
        "textwrap.py",
        "fnmatch.py",
        "shlex.py",
        "bisect.py",
        "colorsys.py",
        "glob.py",
        "keyword.py",
    ):
        (corpus / name).write_text((stdlib / name).read_text())
    import torch

    ids = torch.tensor(tok("\n".join(tiny_texts()), add_special_tokens=False)["input_ids"][:512]).view(8, 64)
    imp = importance.measure(teacher, ids)
    prune.drop_layers(teacher, prune.lowest(imp.layers, 1))
    prune.shrink_mlp(teacher, imp.channels[[i for i in range(4) if i != prune.lowest(imp.layers, 1)[0]]], 32)
    save_hf(teacher, tok, root / "student", {"source": str(root / "teacher"), "method": "depth"})
    return {"root": root, "teacher": root / "teacher", "student": root / "student", "corpus": corpus}


def _heal(models: dict[str, Path], name: str, *extra: str) -> list[str]:
    out = models["root"] / name
    return [
        *GPUFLEET,
        "compress",
        "heal",
        str(models["student"]),
        "--out",
        str(out),
        "--domain",
        str(models["corpus"]),
        "--steps",
        str(STEPS),
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--lr",
        "3e-3",
        "--checkpoint-every",
        str(EVERY),
        "--run-dir",
        str(out) + ".run",
        *extra,
    ]


def _result(models: dict[str, Path], name: str) -> dict:
    return json.loads((models["root"] / f"{name}.run" / "heal_result.json").read_text())


def test_killed_heal_resumes_bit_identical(models: dict[str, Path]) -> None:
    ref = subprocess.run(_heal(models, "ref"), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = _result(models, "ref")
    assert r["resumed_at"] == 0 and len(r["losses"]) == STEPS
    first, last = (sum(v for _, v in part) / 8 for part in (r["losses"][:8], r["losses"][-8:]))
    assert last < first, (first, last)  # distillation makes progress
    assert (models["root"] / "ref" / "model.safetensors").is_file()

    run_dir = models["root"] / "killed.run"
    proc = subprocess.Popen(
        _heal(models, "killed", "--worker-sleep", "0.1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            committed = (
                [e["step"] for e in _evs(run_dir, "ckpt_committed")]
                if (run_dir / "ledger.jsonl").exists()
                else []
            )
            if committed and max(committed) >= 2 * EVERY:
                break
            assert proc.poll() is None, "the run ended before the kill"
            time.sleep(0.1)
        else:
            pytest.fail("no checkpoint committed")
        os.kill(_evs(run_dir, "attempt_start")[-1]["pids"][0], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert [(f["cause"], f["rank"]) for f in _evs(run_dir, "failure")] == [("crash", 0)]
    restores = _evs(run_dir, "restore")
    assert len(restores) == 2 and not restores[1]["fresh"] and restores[1]["step"] >= 2 * EVERY
    got = _result(models, "killed")
    assert got["resumed_at"] == restores[1]["step"]
    assert got["sha256"] == r["sha256"]
    # the loss curve after the resume is the reference's, step for step
    ref_losses = dict((s, v) for s, v in r["losses"])
    assert all(ref_losses[s] == v for s, v in got["losses"])


def test_heal_refuses_a_student_with_another_tokenizer(models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "student"
    shutil.copytree(models["student"], bad)
    spec = json.loads((bad / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, different ids: a different tokenizer
    (bad / "tokenizer.json").write_text(json.dumps(spec))
    cmd = _heal(models, "bad")
    cmd[cmd.index(str(models["student"]))] = str(bad)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "tokenizer mismatch" in p.stderr
