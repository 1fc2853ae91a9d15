"""Healing with LoRA, standalone (gpufleet.init() without a supervisor): adapters train, merge into
plain weights, and the healed model saves as a stock HF model closer to its teacher than before."""

from __future__ import annotations

import json

import torch

import gpufleet
from gpufleet.compress import heal, importance, prune
from gpufleet.compress.config import HealConfig
from gpufleet.compress.export import save_hf
from unit.compress.tinyllama import make_tiny, make_tokenizer, tiny_texts


def test_lora_heal_standalone(tmp_path):
    tok = make_tokenizer()
    teacher = make_tiny(len(tok))
    save_hf(teacher, tok, tmp_path / "teacher")
    ids = torch.tensor(tok("\n".join(tiny_texts()), add_special_tokens=False)["input_ids"][:512]).view(8, 64)
    imp = importance.measure(teacher, ids)
    prune.shrink_mlp(teacher, imp.channels, 32)
    save_hf(teacher, tok, tmp_path / "student", {"source": str(tmp_path / "teacher")})
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"f{i}.py").write_text(tiny_texts()[i % 4])
    cfg = HealConfig(
        student=tmp_path / "student",
        out=tmp_path / "healed",
        domain=str(corpus),
        steps=12,
        batch=2,
        seq_len=32,
        lr=5e-3,
        lora=4,
        seed=0,
    )
    assert heal.check(cfg) == str(tmp_path / "teacher")
    job = heal.prepare(cfg)
    trainable = sum(p.numel() for p in job.student.parameters() if p.requires_grad)
    total = sum(p.numel() for p in job.student.parameters())
    assert 0 < trainable < total / 5  # adapters only
    probe = job.pool  # the mean over the whole pool: one batch's loss varies more than 12 steps move it
    with torch.no_grad():
        before = float(job.loss(probe))
    run = gpufleet.init(run_dir=str(tmp_path / "run"), checkpoint_every="100")
    res = heal.train(run, job)
    with torch.no_grad():
        after = float(job.loss(probe))
    assert after < before
    assert res["resumed_at"] == 0 and len(res["losses"]) == 12
    from transformers import AutoModelForCausalLM

    healed = AutoModelForCausalLM.from_pretrained(tmp_path / "healed")
    assert not any("lora" in k for k in healed.state_dict())
    assert json.loads((tmp_path / "healed" / "compress.json").read_text())["heal"]["lora"] == 4
    assert json.loads((tmp_path / "run" / "heal_result.json").read_text())["sha256"] == res["sha256"]
