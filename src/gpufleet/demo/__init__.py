"""The demo job (a tiny char-level GPT on shipped text) and ``gpufleet demo``'s orchestration.

See docs/demo.md. Nothing here is imported by ``import gpufleet``.
"""
