"""Healing: distil the dense teacher into the pruned student on domain text (optionally LoRA).

The loop takes a gpufleet run object (``gpufleet.init()``: restore, steps, log, finish) as an
argument, so it runs supervised (``gpufleet compress heal`` launches it under ``gpufleet run``) with
checkpoints, restarts, the loss-spike guard and the ledger, while this package stays below the
training layer. Batches are a pure function of (seed, step), so a killed run that resumes from a
checkpoint trains on exactly the batches it would have seen, and ends bit-identical. The pool is
read in seeded passes, each row once per pass (:func:`batch_rows`).

Loss: ``T^2 * KL(softmax(teacher/T) || softmax(student/T))`` per token; with a trimmed vocabulary,
the teacher's logits are restricted to the student's kept token ids (``vocab_ids.json``). With
``ce_weight`` w > 0 the loss is ``(1 - w) * KL + w * CE``, CE the next-token cross-entropy on the
domain text itself (the student's own token ids): distillation alone can at best give back the
teacher's domain perplexity, and the teacher is a generalist.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from gpufleet.compress import corpus
from gpufleet.compress.config import HealConfig
from gpufleet.compress.model import load, use_bf16
from gpufleet.core.errors import UsageError
from gpufleet.core.paths import read_json

__all__ = [
    "RunLike",
    "HealJob",
    "pool_tokens",
    "batch_rows",
    "check",
    "prepare",
    "train",
    "weights_sha256",
    "config_to_json",
    "config_from_json",
]

RESULT = "heal_result.json"


class RunLike(Protocol):
    """What the loop needs of ``gpufleet.init()``'s Run."""

    is_main: bool
    run_dir: Path

    def restore(self, state: dict[str, Any]) -> int: ...
    def steps(self, total: int, *, steps_per_epoch: int | None = None) -> Any: ...
    def log(self, **metrics: Any) -> float | None: ...
    def finish(self) -> None: ...


def config_to_json(cfg: HealConfig) -> str:
    return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()})


def config_from_json(text: str) -> HealConfig:
    return config_from_dict(json.loads(text))


def config_from_dict(d: dict[str, Any]) -> HealConfig:
    """The config ``config_to_json`` wrote, parsed back."""
    for k in ("student", "out"):
        d[k] = Path(d[k])
    return HealConfig(**d)


def pool_tokens(cfg: HealConfig) -> int:
    """Domain tokens the batches are drawn from: twice the tokens of the first 64 steps for short runs,
    and a batch of fresh tokens per step for long ones (a pool much smaller than what the run reads is
    seen many times over and over-fitted)."""
    return cfg.seq_len * cfg.batch * max(min(cfg.steps, 64) * 2, cfg.steps)


def batch_rows(seed: int, step: int, chunks: int, batch: int) -> list[int]:
    """The pool rows of ``step``'s batch: the pool is read in passes, each a seeded permutation of its
    ``chunks`` rows, ``batch`` rows a step, so every row is read once per pass.

    A pure function of (seed, step): a resumed run, or a spike guard's replay, draws exactly the batch
    the step drew before. (Drawing rows at random with replacement, as the first version did, reads
    only ~63% of a pool in a pass's worth of steps and some rows two or three times.)"""
    import torch

    if chunks < 1 or batch < 1:
        raise ValueError(f"a pool of {chunks} rows cannot give batches of {batch}")
    rows: list[int] = []
    pos = step * batch  # the first row of this step in the concatenation of all passes
    while len(rows) < batch:
        pass_no, offset = divmod(pos, chunks)
        g = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * pass_no + 1)
        perm = torch.randperm(chunks, generator=g)
        take = min(batch - len(rows), chunks - offset)
        rows.extend(perm[offset : offset + take].tolist())
        pos += take
    return rows


class HealJob:
    """Teacher, student, token pool and optimizer of one healing run."""

    def __init__(self, cfg: HealConfig) -> None:
        import torch

        self.cfg = cfg
        self.bf16 = use_bf16(cfg.bf16)
        torch.manual_seed(cfg.seed)
        student = load(cfg.student)
        teacher_src = cfg.teacher or student.provenance.get("source")
        if not teacher_src:
            raise UsageError(f"{cfg.student}: no teacher given and no source in its compress.json")
        teacher = load(teacher_src)
        vids_file = cfg.student / "vocab_ids.json"
        self.vocab_ids = read_json(vids_file, "vocabulary map") if vids_file.is_file() else None
        _check_vocab(teacher.tokenizer, student.tokenizer, self.vocab_ids)
        self.teacher = teacher.model.eval().requires_grad_(False)
        self.tokenizer = student.tokenizer
        self.provenance = student.provenance
        model = student.model
        model.config.use_cache = False
        if cfg.lora:
            from peft import LoraConfig, get_peft_model

            lcfg = LoraConfig(
                r=cfg.lora,
                lora_alpha=2 * cfg.lora,
                lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            )
            model = get_peft_model(model, lcfg)
        model.train()
        self.student = model
        need = pool_tokens(cfg)
        pool = corpus.tokens(self.tokenizer, cfg.domain, "train", need, per_file=cfg.pool_per_file)
        self.pool = corpus.chunks(pool, cfg.seq_len)
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel per step over all parameters (foreach makes several passes over the
        # ~100M weights and their Adam moments; measured in P8 v3, docs/benchmarks.md)
        self.optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)
        warm = max(1, cfg.steps // 20)

        def lr_at(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm))) * 0.9 + 0.1

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_at)
        self.vocab_index = torch.tensor(self.vocab_ids) if self.vocab_ids is not None else None
        if self.vocab_index is not None:
            w = self.teacher.get_output_embeddings().weight
            self.teacher_head = w.detach().index_select(0, self.vocab_index).contiguous()

    def batch(self, step: int) -> Any:
        import torch

        rows = batch_rows(self.cfg.seed, step, int(self.pool.shape[0]), self.cfg.batch)
        return self.pool[torch.tensor(rows)]

    def loss(self, ids: Any) -> Any:
        import torch
        import torch.nn.functional as F

        T, w = self.cfg.temperature, self.cfg.ce_weight
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else _Null()
        with ctx:
            t_logits = None if w == 1.0 else self._teacher_logits(ids)  # CE alone needs no teacher
            s_logits = self.student(input_ids=ids, use_cache=False).logits
        loss = 0.0
        if t_logits is not None:
            t = F.log_softmax(t_logits.float() / T, dim=-1)
            s = F.log_softmax(s_logits.float() / T, dim=-1)
            kl = (T * T) * F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")
            if not w:
                return kl
            loss = (1.0 - w) * kl
        # next-token targets: position i predicts token i + 1 (the last position has none)
        ce = F.cross_entropy(s_logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        return loss + w * ce

    def _teacher_logits(self, ids: Any) -> Any:
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            if self.vocab_index is None:
                return self.teacher(input_ids=ids, use_cache=False).logits
            # only the kept rows of the teacher's LM head: a quarter of its cost for 13k of 49k
            hidden = self.teacher.model(input_ids=self.vocab_index[ids], use_cache=False).last_hidden_state
            return F.linear(hidden, self.teacher_head)

    def merged(self) -> Any:
        return self.student.merge_and_unload() if self.cfg.lora else self.student


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _check_vocab(teacher_tok: Any, student_tok: Any, vocab_ids: list[int] | None) -> None:
    """The student's tokens must be the teacher's (or, trimmed, a subset at ``vocab_ids``)."""
    t_vocab = teacher_tok.get_vocab()
    s_vocab = student_tok.get_vocab()
    if vocab_ids is None:
        if t_vocab != s_vocab:
            raise UsageError("tokenizer mismatch: the student's tokenizer is not the teacher's")
        return
    t_inv = {i: tok for tok, i in t_vocab.items()}
    for tok, i in s_vocab.items():
        if i >= len(vocab_ids) or t_inv.get(vocab_ids[i]) != tok:
            raise UsageError(f"tokenizer mismatch: student token {tok!r} (id {i}) is not the teacher's")


def prepare(cfg: HealConfig) -> HealJob:
    return HealJob(cfg)


def _tokenizer_of(src: str) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def check(cfg: HealConfig) -> str:
    """Before launching: the student is a compressed HF model, the teacher exists and both tokenizers
    agree (UsageError otherwise). Returns the teacher's path."""
    from gpufleet.compress.model import PROVENANCE

    if not (cfg.student / "config.json").is_file():
        raise UsageError(f"{cfg.student}: not a Hugging Face model directory (no config.json)")
    prov_file = cfg.student / PROVENANCE
    prov = read_json(prov_file, "provenance file") if prov_file.is_file() else {}
    teacher = cfg.teacher or prov.get("source")
    if not teacher:
        raise UsageError(f"{cfg.student}: no --teacher given and no source in its {PROVENANCE}")
    if not Path(teacher).exists():
        raise UsageError(f"teacher not found: {teacher}")
    vids_file = cfg.student / "vocab_ids.json"
    vids = read_json(vids_file, "vocabulary map") if vids_file.is_file() else None
    _check_vocab(_tokenizer_of(teacher), _tokenizer_of(str(cfg.student)), vids)
    corpus.tokens(_tokenizer_of(str(cfg.student)), cfg.domain, "train", 16)  # empty corpus: UsageError
    return teacher


def weights_sha256(model: Any) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def train(run: RunLike, job: HealJob, *, log_every: int = 10, sleep: float = 0.0) -> dict[str, Any]:
    """The supervised loop: restore, distil ``cfg.steps`` steps, finish; rank 0 saves the healed model."""
    from gpufleet.compress.export import save_hf

    cfg = job.cfg
    state = {"model": job.student, "optim": job.optim, "sched": job.sched}
    start = run.restore(state)
    losses: list[tuple[int, float]] = []
    t0 = time.monotonic()
    for step in run.steps(cfg.steps):
        loss = job.loss(job.batch(step))
        loss.backward()
        mean = run.log(loss=loss.detach())
        job.optim.step()
        job.sched.step()
        job.optim.zero_grad(set_to_none=True)
        losses.append((step, float(mean if mean is not None else loss.item())))
        if run.is_main and (step % log_every == 0 or step == cfg.steps - 1):
            print(
                f"heal step {step + 1}/{cfg.steps} loss {losses[-1][1]:.4f} "
                f"({time.monotonic() - t0:.0f} s, resumed at {start})",
                flush=True,
            )
        if sleep:
            time.sleep(sleep)
    run.finish()
    result: dict[str, Any] = {
        "steps": cfg.steps,
        "resumed_at": start,
        "train_s": round(time.monotonic() - t0, 1),
        "precision": "bf16" if job.bf16 else "fp32",
        "losses": losses,
    }
    if run.is_main:
        model = job.merged()
        result["sha256"] = weights_sha256(model)
        prov = dict(job.provenance)
        prov["heal"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
        prov["heal"]["bf16"] = job.bf16  # what ran, not the setting (None: chosen by the CPU)
        save_hf(model, job.tokenizer, cfg.out, prov)
        if job.vocab_ids is not None:
            (cfg.out / "vocab_ids.json").write_text(json.dumps(job.vocab_ids))
        (Path(run.run_dir) / RESULT).write_text(json.dumps(result) + "\n")
    return result
