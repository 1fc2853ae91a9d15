"""``gpufleet serve mock``: a mock OpenAI-compatible LLM server with known TTFT, ITL and a
continuous-batching queue (docs/serve-mock.md). ``batching`` is the model, ``server`` speaks HTTP."""

from gpufleet.serve._lazy import attach

__getattr__, __all__ = attach(
    __name__,
    {
        "batching": ["FailMode", "TokenRule", "BatchScheduler", "MockConfig", "count_tokens"],
        "server": ["MockServer"],
    },
)
