"""Builders of tiny random Llama models (GQA: 6 query heads in 2 key/value groups) and of a byte-level
BPE tokenizer trained offline on a few kilobytes of Python source (unit and integration tests)."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def tiny_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / n).read_text()[:6000] for n in ("textwrap.py", "fnmatch.py", "shlex.py", "bisect.py")]


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(tiny_texts(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )


def make_tiny(vocab: int, *, layers: int = 4, tied: bool = True, seed: int = 0, kv_heads: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random init is too flat to tell pruning choices apart: widen it
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model
