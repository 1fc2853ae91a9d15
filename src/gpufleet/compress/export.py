"""Export a (pruned) ``LlamaForCausalLM``: HF safetensors, and GGUF (F16 or Q8_0) for llama.cpp.

The GGUF writer follows llama.cpp's ``convert_hf_to_gguf.py`` for the llama architecture: tensor
names ``blk.N.*``, Q and K rows permuted for llama.cpp's rotary layout, tokenizer metadata from the
HF tokenizer (``gpt2`` BPE: tokens, merges, token types, special ids). Widths are uniform across
layers, so one ``feed_forward_length`` / ``head_count`` describes the model. :func:`gguf_logits`
reads a GGUF back (dequantized, Q/K un-permuted) into a ``LlamaForCausalLM`` for the round-trip check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from gpufleet.core.errors import UsageError

__all__ = ["save_hf", "write_gguf", "read_gguf_model", "max_logit_diff", "GgufType"]

GgufType = Literal["f16", "q8_0"]


def save_hf(model: Any, tokenizer: Any, out: Path, provenance: dict[str, Any] | None = None) -> Path:
    """Plain HF directory (config.json, model.safetensors, tokenizer files, compress.json)."""
    from gpufleet.compress.model import PROVENANCE

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if provenance is not None:
        (out / PROVENANCE).write_text(json.dumps(provenance, indent=2, default=str) + "\n")
    return out


def _permute(w: Any, n_head: int) -> Any:
    """llama.cpp's rotary layout: interleave the two halves of each head (convert_hf_to_gguf)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: Any, n_head: int) -> Any:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_meta(tokenizer: Any) -> tuple[list[str], list[str], list[int]]:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    bpe = spec["model"]
    if bpe.get("type") != "BPE":
        raise UsageError("GGUF export supports byte-level BPE tokenizers only")
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    size = max([*bpe["vocab"].values(), *added]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED until filled
    for t, i in bpe["vocab"].items():
        tokens[i], types[i] = t, 1  # NORMAL
    for i, a in added.items():
        tokens[i], types[i] = a["content"], 3 if a.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in bpe["merges"]]
    return tokens, merges, types


def _source_kv(source: str | None) -> dict[str, Any]:
    """Fields worth copying from the dense model's GGUF (pre-tokenizer, chat template, names)."""
    if not source or not source.endswith(".gguf") or not Path(source).is_file():
        return {}
    import gguf

    r = gguf.GGUFReader(source)
    out = {}
    for key in (
        "tokenizer.ggml.pre",
        "tokenizer.chat_template",
        "general.name",
        "llama.context_length",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
    ):
        f = r.fields.get(key)
        if f is not None:
            out[key] = f.contents()
    return out


def write_gguf(
    model: Any, tokenizer: Any, out: Path, *, qtype: GgufType = "q8_0", source: str | None = None
) -> Path:
    """Write ``model`` as a llama GGUF file readable by llama.cpp."""
    import gguf
    import numpy as np

    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    src = _source_kv(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(str(src.get("general.name", "gpufleet-compressed")))
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    w.add_file_type(ftype)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(int(src.get("llama.context_length", cfg.max_position_embeddings)))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    tokens, merges, types = _tokenizer_meta(tokenizer)
    if len(tokens) != cfg.vocab_size:
        raise UsageError(
            f"tokenizer has {len(tokens)} tokens but the model {cfg.vocab_size}: tokenizer mismatch"
        )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(src.get("tokenizer.ggml.pre", "default")))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, fn in (
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("unk_token_id", w.add_unk_token_id),
        ("pad_token_id", w.add_pad_token_id),
    ):
        v = getattr(tokenizer, key, None)
        if isinstance(v, int):
            fn(v)
    w.add_add_bos_token(bool(src.get("tokenizer.ggml.add_bos_token", False)))
    if "tokenizer.ggml.add_space_prefix" in src:
        w.add_add_space_prefix(bool(src["tokenizer.ggml.add_space_prefix"]))
    template = getattr(tokenizer, "chat_template", None) or src.get("tokenizer.chat_template")
    if template:
        w.add_chat_template(str(template))

    def put(name: str, t: Any, *, quantize: bool = True) -> None:
        a = t.detach().float().cpu().numpy()
        if a.ndim == 1 or not quantize:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            if a.shape[-1] % 32:
                raise UsageError(f"{name}: row size {a.shape[-1]} is not a multiple of 32 (Q8_0 blocks)")
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not getattr(cfg, "tie_word_embeddings", False):
        put("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, n_head)
            elif gg == "attn_k":
                t = _permute(t, n_kv)
            put(f"blk.{i}.{gg}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def read_gguf_model(path: Path, config: Any) -> Any:
    """A ``LlamaForCausalLM`` with ``config`` and the (dequantized, un-permuted) weights of ``path``."""
    import gguf
    import torch
    from transformers import LlamaForCausalLM

    r = gguf.GGUFReader(str(path))
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    inv = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    sd: dict[str, Any] = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
        shape = [int(x) for x in reversed(t.shape)]
        a = a.reshape(shape)
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        else:
            _, i, kind, _ = name.split(".")
            if kind == "attn_q":
                a = _unpermute(a, n_head)
            elif kind == "attn_k":
                a = _unpermute(a, n_kv)
            key = f"model.layers.{i}.{inv[kind]}.weight"
        sd[key] = torch.from_numpy(a.copy())
    model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if k != "lm_head.weight"]
    if bad or unexpected:
        raise UsageError(
            f"{path}: GGUF tensors do not match the config (missing {bad[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    return model


def max_logit_diff(a: Any, b: Any, ids: Any) -> float:
    """Largest absolute difference of the two models' logits on ``ids`` ([1, T])."""
    import torch

    with torch.no_grad():
        la = a(input_ids=ids).logits.float()
        lb = b(input_ids=ids).logits.float()
    return float((la - lb).abs().max())
