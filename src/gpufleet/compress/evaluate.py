"""Quality, size and speed of a compressed model against its dense parent.

Perplexity is per *reference* token: the summed negative log-likelihood of a text under the model's
own tokenizer, divided by the number of tokens the dense tokenizer makes of the same text. For a
model with the dense vocabulary this is the usual perplexity; for a trimmed vocabulary it stays
comparable (the trimmed tokenizer splits the text into more, shorter tokens).

Selectivity = (general ppl ratio - 1) / (domain ppl ratio - 1): how much more the general domain
lost than the target domain (above 1: pruning was selective).
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["nll", "perplexity", "selectivity", "llama_cpp_speed", "file_size"]


def nll(
    model: Any, ids: list[int], *, seq_len: int = 512, batch_size: int = 4, dtype: Any = None
) -> tuple[float, int]:
    """(summed NLL in nats, predicted tokens) of ``ids`` cut into non-overlapping ``seq_len`` windows."""
    import torch

    n = len(ids) // seq_len
    rows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    tail = ids[n * seq_len :]
    if len(tail) > 1:
        rows.append(tail)
    total, count = 0.0, 0
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else _null()
    with torch.no_grad(), ctx:
        for b in range(0, len(rows), batch_size):
            group = rows[b : b + batch_size]
            same = [r for r in group if len(r) == len(group[0])]
            for part in (same, [r for r in group if len(r) != len(group[0])]):
                if not part:
                    continue
                x = torch.tensor(part, dtype=torch.long)
                logits = model(input_ids=x, use_cache=False).logits.float()
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
                )
                total += float(loss)
                count += x[:, 1:].numel()
    return total, count


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def perplexity(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    ref_tokens: int | None = None,
    seq_len: int = 512,
    bf16: bool = True,
) -> float:
    """exp(NLL / reference tokens) of ``text`` (see the module docstring)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    import torch

    total, count = nll(model, ids, seq_len=seq_len, dtype=torch.bfloat16 if bf16 else None)
    if ref_tokens is not None and count:
        # the model predicted `count` of its own len(ids) tokens; scale the reference count alike
        count = ref_tokens * count / len(ids)
    return math.exp(total / max(count, 1))


def selectivity(domain_ratio: float, general_ratio: float) -> float | None:
    """(general ppl ratio - 1) / (domain ppl ratio - 1); None when the domain did not degrade."""
    if domain_ratio <= 1.0:
        return None
    return (general_ratio - 1.0) / (domain_ratio - 1.0)


def file_size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def llama_cpp_speed(
    gguf_path: Path, *, prompt_tokens: int = 256, decode_tokens: int = 64, repeats: int = 3, threads: int = 2
) -> dict[str, float]:
    """Prefill and decode tokens/s of ``gguf_path`` in llama.cpp (llama-cpp-python), medians of
    ``repeats``. Loads with ``use_extra_bufts=False`` (the AMX buffer types die with SIGILL on some VMs)."""
    from llama_cpp import Llama

    kw: dict[str, Any] = dict(
        n_ctx=prompt_tokens + decode_tokens + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=prompt_tokens,
        verbose=False,
    )
    try:
        llm = Llama(str(gguf_path), use_extra_bufts=False, **kw)
    except TypeError:  # an older llama-cpp-python without the flag
        llm = Llama(str(gguf_path), **kw)
    n_vocab = llm.n_vocab()
    prompt = [(17 + 7919 * i) % (n_vocab - 20) + 20 for i in range(prompt_tokens)]
    pre, dec = [], []
    try:
        for _ in range(repeats):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            pre.append(prompt_tokens / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for j in range(decode_tokens):
                llm.eval([prompt[j]])
            dec.append(decode_tokens / (time.perf_counter() - t0))
    finally:
        llm.close() if hasattr(llm, "close") else None
    return {
        "prefill_tok_s": round(statistics.median(pre), 2),
        "decode_tok_s": round(statistics.median(dec), 2),
    }
