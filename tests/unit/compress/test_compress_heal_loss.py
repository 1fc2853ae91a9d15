"""The healing loss: pure distillation at ``ce_weight=0``, the domain text's own next-token
cross-entropy at 1 (the same figure as transformers' causal-LM loss), their convex mix between, and
training on it lowers the student's cross-entropy on the domain text."""

from __future__ import annotations

import pytest
import torch

import gpufleet
from gpufleet.compress import heal, importance, prune
from gpufleet.compress.config import HealConfig
from gpufleet.compress.export import save_hf
from unit.compress.tinyllama import make_tiny, make_tokenizer, tiny_texts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("heal_loss")
    tok = make_tokenizer()
    teacher = make_tiny(len(tok))
    save_hf(teacher, tok, root / "teacher")
    ids = torch.tensor(tok("\n".join(tiny_texts()), add_special_tokens=False)["input_ids"][:512]).view(8, 64)
    prune.shrink_mlp(teacher, importance.measure(teacher, ids).channels, 32)
    save_hf(teacher, tok, root / "student", {"source": str(root / "teacher")})
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"f{i}.py").write_text(tiny_texts()[i % 4])
    return root, corpus


def _job(models, weight: float, **kw) -> heal.HealJob:
    root, corpus = models
    cfg = HealConfig(
        student=root / "student", out=root / f"healed{weight}", domain=str(corpus),
        steps=kw.get("steps", 4), batch=2, seq_len=32, lr=5e-3, ce_weight=weight, bf16=False, seed=0,
    )  # fmt: skip
    return heal.prepare(cfg)


def test_the_loss_mixes_distillation_and_the_domain_texts_own_cross_entropy(models):
    jobs = {w: _job(models, w) for w in (0.0, 0.25, 1.0)}
    ids = jobs[0.0].batch(7)
    with torch.no_grad():
        kl, mixed, ce = (float(jobs[w].loss(ids)) for w in (0.0, 0.25, 1.0))
        hf_ce = float(jobs[1.0].student(input_ids=ids, labels=ids).loss)
    assert kl > 0 and ce > 0 and abs(ce - kl) > 1e-3  # two different figures
    assert ce == pytest.approx(hf_ce, rel=1e-5)  # the causal-LM loss, targets shifted by one
    assert mixed == pytest.approx(0.75 * kl + 0.25 * ce, rel=1e-5)


def test_healing_with_the_cross_entropy_lowers_it(models, tmp_path):
    job = _job(models, 1.0, steps=12)
    probe = job.batch(10_000)  # another draw from the domain pool than the 12 steps'
    with torch.no_grad():
        before = float(job.loss(probe))
    heal.train(gpufleet.init(run_dir=str(tmp_path / "run"), checkpoint_every="100"), job)
    with torch.no_grad():
        after = float(job.loss(probe))
    assert after < before
