"""Vocabulary trimming keeps the tokenizer consistent with the cut embedding: the trimmed tokenizer
emits only kept tokens, decodes every text back unchanged, tokenizes the domain text it was trimmed
on exactly as before (renumbered), and the model's logits for kept tokens are the dense ones."""

from __future__ import annotations

import torch

from gpufleet.compress import prune
from unit.compress.tinyllama import tiny_texts


def test_trimmed_tokenizer_is_consistent(tiny, tiny_tokenizer):
    domain = tiny_texts()[0]
    used = sorted(set(tiny_tokenizer(domain, add_special_tokens=False)["input_ids"]))
    dense_logits_model = __import__("copy").deepcopy(tiny)
    new_tok, kept = prune.trim_vocab(tiny, tiny_tokenizer, used)
    n = len(kept)
    assert len(new_tok) == n == tiny.config.vocab_size < len(tiny_tokenizer)
    assert tiny.get_input_embeddings().weight.shape[0] == n
    assert tiny.get_output_embeddings().weight is tiny.get_input_embeddings().weight  # still tied
    assert set(used) <= set(kept)
    # special tokens survive and keep their meaning
    assert new_tok.convert_ids_to_tokens(new_tok.eos_token_id) == "<|im_end|>"
    assert kept[new_tok.eos_token_id] == tiny_tokenizer.eos_token_id

    # the domain text tokenizes exactly as before, renumbered
    old = tiny_tokenizer(domain, add_special_tokens=False)["input_ids"]
    new = new_tok(domain, add_special_tokens=False)["input_ids"]
    assert [kept[i] for i in new] == old

    # any text: only kept ids, lossless round trip
    other = tiny_texts()[2] + "\nZebra quartz jackdaw: émigré ünïcode ✓\n"
    ids = new_tok(other, add_special_tokens=False)["input_ids"]
    assert max(ids) < n
    assert new_tok.decode(ids) == other

    # logits of the trimmed model are the dense model's, restricted to the kept ids
    x_new = torch.tensor([new[:32]])
    x_old = torch.tensor([old[:32]])
    with torch.no_grad():
        a = tiny(input_ids=x_new).logits
        b = dense_logits_model(input_ids=x_old).logits[..., kept]
    assert torch.allclose(a, b, atol=1e-5)


def test_untied_head_is_trimmed_too(tiny_tokenizer):
    from unit.compress.tinyllama import make_tiny

    m = make_tiny(len(tiny_tokenizer), tied=False)
    _, kept = prune.trim_vocab(m, tiny_tokenizer, [40, 50, 60])
    assert m.lm_head.weight.shape == (len(kept), 96)
    assert m.lm_head.weight is not m.get_input_embeddings().weight
