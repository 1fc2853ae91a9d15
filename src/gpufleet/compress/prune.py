"""Structured pruning of a ``LlamaForCausalLM`` in place: layers, MLP channels, attention heads,
vocabulary; plus the baselines (random layer drop, Wanda unstructured).

Widths stay uniform across layers (the llama GGUF format has one width per model), and query heads
are kept in whole GQA groups: every key/value group keeps the same number of query heads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from gpufleet.core.errors import UsageError

__all__ = [
    "drop_layers",
    "shrink_mlp",
    "prune_heads",
    "drop_kv_groups",
    "trim_vocab",
    "wanda",
    "random_layers",
    "lowest",
]


def lowest(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` smallest scores (ties: lower index first)."""
    return sorted(sorted(range(len(scores)), key=lambda i: (scores[i], i))[:k])


def drop_layers(model: Any, drop: Sequence[int]) -> None:
    """Remove decoder layers ``drop`` and renumber the rest (``layer_idx`` for the KV cache)."""
    import torch

    layers = model.model.layers
    drop_set = set(drop)
    if not drop_set <= set(range(len(layers))) or len(drop_set) >= len(layers):
        raise UsageError(f"cannot drop layers {sorted(drop_set)} of {len(layers)}")
    kept = [layer for i, layer in enumerate(layers) if i not in drop_set]
    model.model.layers = torch.nn.ModuleList(kept)
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [t for i, t in enumerate(model.config.layer_types) if i not in drop_set]


def random_layers(n_layers: int, k: int, seed: int = 0) -> list[int]:
    """``k`` layer indices drawn at random (the baseline), never the first or the last layer."""
    return sorted(random.Random(seed).sample(range(1, n_layers - 1), k))


def _slice_linear(lin: Any, *, out_idx: Any = None, in_idx: Any = None) -> Any:
    import torch

    w = lin.weight.data
    if out_idx is not None:
        w = w.index_select(0, out_idx)
    if in_idx is not None:
        w = w.index_select(1, in_idx)
    bias = lin.bias is not None
    new = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias, dtype=w.dtype)
    new.weight.data = w.contiguous()
    if bias:
        b = lin.bias.data
        new.bias.data = (b.index_select(0, out_idx) if out_idx is not None else b).contiguous()
    return new


def shrink_mlp(model: Any, channels: Any, keep: int) -> list[Any]:
    """Keep the ``keep`` most important MLP channels of every layer (``channels``: [layer, inter]).
    Returns the kept channel indices of every layer (sorted LongTensors)."""
    import torch

    cfg = model.config
    if not 0 < keep <= cfg.intermediate_size:
        raise UsageError(f"MLP width {keep} outside 1..{cfg.intermediate_size}")
    kept = []
    for i, layer in enumerate(model.model.layers):
        idx = torch.topk(channels[i], keep).indices.sort().values
        kept.append(idx)
        mlp = layer.mlp
        mlp.gate_proj = _slice_linear(mlp.gate_proj, out_idx=idx)
        mlp.up_proj = _slice_linear(mlp.up_proj, out_idx=idx)
        mlp.down_proj = _slice_linear(mlp.down_proj, in_idx=idx)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = keep
    cfg.intermediate_size = keep
    return kept


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rows(heads: Sequence[int], head_dim: int) -> Any:
    import torch

    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def _apply_heads(model: Any, q_heads: list[list[int]], kv_heads: list[list[int]]) -> list[Any]:
    """Keep query heads ``q_heads[layer]`` and key/value heads ``kv_heads[layer]`` (same counts per layer).
    Returns the kept ``o_proj`` input rows of every layer."""
    cfg = model.config
    hd = _head_dim(cfg)
    if cfg.hidden_size % len(q_heads[0]):
        raise UsageError(
            f"{len(q_heads[0])} query heads do not divide the hidden size {cfg.hidden_size} "
            "(transformers rejects such a config)"
        )
    o_rows = []
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        q_rows, kv_rows = _rows(q_heads[i], hd), _rows(kv_heads[i], hd)
        o_rows.append(q_rows)
        att.q_proj = _slice_linear(att.q_proj, out_idx=q_rows)
        att.k_proj = _slice_linear(att.k_proj, out_idx=kv_rows)
        att.v_proj = _slice_linear(att.v_proj, out_idx=kv_rows)
        att.o_proj = _slice_linear(att.o_proj, in_idx=q_rows)
        att.num_key_value_groups = len(q_heads[i]) // len(kv_heads[i])
        for name, value in (("num_heads", len(q_heads[i])), ("num_key_value_heads", len(kv_heads[i]))):
            if hasattr(att, name):
                setattr(att, name, value)
    cfg.head_dim = hd
    cfg.num_attention_heads = len(q_heads[0])
    cfg.num_key_value_heads = len(kv_heads[0])
    return o_rows


def prune_heads(model: Any, heads: Sequence[Sequence[float]], per_group: int) -> list[Any]:
    """Keep the ``per_group`` most important query heads inside every key/value group, in every layer.
    Returns the kept ``o_proj`` input rows of every layer."""
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    rep = n_heads // n_kv
    if not 0 < per_group <= rep:
        raise UsageError(f"query heads per group {per_group} outside 1..{rep}")
    q_heads = []
    for row in heads:
        keep: list[int] = []
        for g in range(n_kv):
            members = list(range(g * rep, (g + 1) * rep))
            best = sorted(members, key=lambda h: (-row[h], h))[:per_group]
            keep.extend(sorted(best))
        q_heads.append(keep)
    return _apply_heads(model, q_heads, [list(range(n_kv))] * len(q_heads))


def drop_kv_groups(model: Any, groups: Sequence[Sequence[float]], keep: int) -> list[Any]:
    """Keep the ``keep`` most important key/value groups (each with all its query heads) per layer.
    Returns the kept ``o_proj`` input rows of every layer."""
    cfg = model.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    rep = n_heads // n_kv
    if not 0 < keep <= n_kv:
        raise UsageError(f"key/value groups {keep} outside 1..{n_kv}")
    kv = [sorted(sorted(range(n_kv), key=lambda g: (-row[g], g))[:keep]) for row in groups]
    q = [[g * rep + r for g in row for r in range(rep)] for row in kv]
    return _apply_heads(model, q, kv)


def wanda(model: Any, input_norms: dict[str, Any], sparsity: float) -> int:
    """Zero the ``sparsity`` fraction of each output row with the lowest ``|W| * ||X||`` (Wanda), in
    every linear layer of the decoder. Returns the number of weights zeroed (no speed-up: unstructured)."""
    import torch

    zeroed = 0
    for name, mod in model.named_modules():
        if name not in input_norms or not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight.data
        score = w.abs() * input_norms[name].to(w.dtype).unsqueeze(0)
        k = int(w.shape[1] * sparsity)
        if k == 0:
            continue
        idx = torch.topk(score, k, dim=1, largest=False).indices
        w.scatter_(1, idx, 0.0)
        zeroed += idx.numel()
    return zeroed


# ---------------------------------------------------------------------------------------- vocabulary
def _merge_pair(m: Any) -> tuple[str, str]:
    if isinstance(m, str):
        a, b = m.split(" ", 1)
        return a, b
    return m[0], m[1]


def trim_vocab(model: Any, tokenizer: Any, used_ids: Sequence[int]) -> tuple[Any, list[int]]:
    """Drop the tokens the domain never uses from the embedding, the LM head and the tokenizer.

    Kept: ``used_ids``, every special/added token, every base token (one that no merge produces),
    and, closed under merges, both parts of every kept token's merge, so the trimmed BPE tokenizer can
    still build every kept token and never emits a dropped one. Ids are renumbered in the old order.
    Returns (new tokenizer, kept old ids)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    bpe = spec["model"]
    if bpe.get("type") != "BPE":
        raise UsageError(f"vocabulary trimming supports BPE tokenizers only, not {bpe.get('type')!r}")
    vocab: dict[str, int] = bpe["vocab"]
    inv = {i: t for t, i in vocab.items()}
    merges = [_merge_pair(m) for m in bpe["merges"]]
    produced = {a + b: (a, b) for a, b in reversed(merges)}  # first (highest-priority) merge wins
    keep_tok = {inv[i] for i in used_ids if i in inv}
    keep_tok |= {t for t in vocab if t not in produced}
    added = {a["content"]: a["id"] for a in spec.get("added_tokens", [])}
    keep_tok |= {t for t in added if t in vocab}
    stack = list(keep_tok)
    while stack:
        t = stack.pop()
        for part in produced.get(t, ()):
            if part not in keep_tok and part in vocab:
                keep_tok.add(part)
                stack.append(part)
    keep_ids = sorted(vocab[t] for t in keep_tok)
    extra_added = sorted(i for t, i in added.items() if t not in vocab)
    keep_ids = sorted(set(keep_ids) | set(extra_added))
    remap = {old: new for new, old in enumerate(keep_ids)}
    bpe["vocab"] = {inv[old]: remap[old] for old in keep_ids if old in inv}
    kept_merges = [(a, b) for a, b in merges if a in keep_tok and b in keep_tok and a + b in keep_tok]
    bpe["merges"] = [[a, b] for a, b in kept_merges]
    for a in spec.get("added_tokens", []):
        a["id"] = remap[a["id"]]
    post = spec.get("post_processor") or {}
    for st in (post.get("special_tokens") or {}).values():
        st["ids"] = [remap[i] for i in st.get("ids", [])]
    new_backend = Tokenizer.from_str(json.dumps(spec))
    special = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    new_tok = PreTrainedTokenizerFast(
        tokenizer_object=new_backend, **{k: v for k, v in special.items() if v is not None}
    )
    if getattr(tokenizer, "chat_template", None):
        new_tok.chat_template = tokenizer.chat_template

    idx = torch.tensor(keep_ids, dtype=torch.long)
    emb = model.get_input_embeddings()
    new_emb = torch.nn.Embedding(len(keep_ids), emb.weight.shape[1], dtype=emb.weight.dtype)
    new_emb.weight.data = emb.weight.data.index_select(0, idx).contiguous()
    model.set_input_embeddings(new_emb)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    if tied:
        head.weight = new_emb.weight
    else:
        head.weight = torch.nn.Parameter(head.weight.data.index_select(0, idx).contiguous())
    head.out_features = len(keep_ids)
    cfg = model.config
    cfg.vocab_size = len(keep_ids)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            setattr(cfg, key, remap.get(v))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(gen, key, None)
            if isinstance(v, int):
                setattr(gen, key, remap.get(v))
    return new_tok, keep_ids
