"""Domain-selective compression of decoder LLMs: analyze, prune, heal, eval, export.

``gpufleet compress`` turns a dense Llama-family model into a smaller domain specialist:

* :mod:`.importance`: Block Influence per layer (ShortGPT), activation importance per attention head
  (respecting GQA key/value groups) and per MLP channel (Minitron), Wanda scores;
* :mod:`.prune`: depth, width (MLP channels, heads) and vocabulary pruning to a parameter target;
* :mod:`.heal`: distillation from the dense teacher (optionally LoRA), a gpufleet-supervised job;
* :mod:`.evaluate`: domain/general perplexity, selectivity, size, llama.cpp speed;
* :mod:`.export`: plain HF safetensors and GGUF (F16, Q8_0) with a round-trip check.

Every module imports torch/transformers lazily or at module level only where it is never reached by
``import gpufleet``; this package's ``__init__`` imports nothing heavy.
"""

from __future__ import annotations

__all__: list[str] = []
