"""GGUF export of tiny random Llama models (pruned: fewer layers, narrower MLP, fewer heads, trimmed
vocabulary): the metadata describes the cut model, the tensors read back to the same logits (F16
tight, Q8_0 within quantization error), and llama.cpp itself computes the same logits, which checks
the Q/K reordering against the real consumer rather than against our own reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpufleet.compress import export, importance, prune
from gpufleet.core.errors import UsageError


def _pruned(tiny, tok, ids):
    imp = importance.measure(tiny, ids)
    prune.prune_heads(tiny, imp.heads, 2)
    prune.drop_layers(tiny, [1])
    prune.shrink_mlp(tiny, imp.channels[[0, 2, 3]], 64)
    used = sorted(set(ids.flatten().tolist()))
    tok, _ = prune.trim_vocab(tiny, tok, used)
    return tiny, tok


def test_permutation_is_inverted():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    p = export._permute(w, 4)  # noqa: SLF001
    assert not np.array_equal(p, w)
    assert np.array_equal(export._unpermute(p, 4), w)  # noqa: SLF001


@pytest.mark.parametrize("qtype,tol", [("f16", 0.02), ("q8_0", 0.25)])
def test_gguf_round_trip(tiny, tiny_tokenizer, ids, tmp_path, qtype, tol):
    import gguf

    model, tok = _pruned(tiny, tiny_tokenizer, ids)
    path = export.write_gguf(model, tok, tmp_path / f"m-{qtype}.gguf", qtype=qtype)
    r = gguf.GGUFReader(str(path))

    def kv(key):
        return r.fields[key].contents()

    assert kv("general.architecture") == "llama"
    assert (kv("llama.block_count"), kv("llama.feed_forward_length")) == (3, 64)
    assert (kv("llama.attention.head_count"), kv("llama.attention.head_count_kv")) == (4, 2)
    assert kv("llama.attention.key_length") == 16 and kv("llama.embedding_length") == 96
    assert len(kv("tokenizer.ggml.tokens")) == model.config.vocab_size == len(tok)
    assert kv("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert len(r.tensors) == 2 + 3 * 9  # embedding, final norm (tied: no output.weight), 9 per layer
    back = export.read_gguf_model(path, model.config)
    x = torch.tensor([tok(" def f(x):\n    return x", add_special_tokens=False)["input_ids"]])
    diff = export.max_logit_diff(model, back, x)
    assert 0.0 < diff < tol


def test_tokenizer_mismatch_is_refused(tiny, tiny_tokenizer, tmp_path):
    prune.trim_vocab(tiny, tiny_tokenizer, [50, 60])  # the model is trimmed, the tokenizer is not
    with pytest.raises(UsageError, match="tokenizer mismatch"):
        export.write_gguf(tiny, tiny_tokenizer, tmp_path / "x.gguf")


def test_llama_cpp_reads_the_gguf_to_the_same_logits(llm_extra, tiny, tiny_tokenizer, ids, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    model, tok = _pruned(tiny, tiny_tokenizer, ids)
    path = export.write_gguf(model, tok, tmp_path / "m.gguf", qtype="f16")
    toks = tok(" def f(x):\n    return x + 1", add_special_tokens=False)["input_ids"][:12]
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, use_extra_bufts=False
    )
    llm.eval(toks)
    got = np.array(llm.scores[: len(toks)], dtype=np.float32)
    llm.close()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([toks])).logits[0].numpy()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < 0.05 * max(1.0, float(np.abs(ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
