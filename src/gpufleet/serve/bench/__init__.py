"""``gpufleet serve bench``: an honest SLA benchmark of OpenAI-compatible streaming endpoints
(docs/serve-bench.md): arrivals, one request (client, sse), the multi-process load loop (runner),
metrics, the max-rate search (findmax), one level or a search (levels), output files and plots, the
live view, and the client's own capacity measured against the null endpoint (calibrate)."""

from gpufleet.serve._lazy import attach

__getattr__, __all__ = attach(
    __name__,
    {
        "arrivals": ["Arrival", "ArrivalKind", "parse_arrival", "schedule"],
        "calibrate": ["max_sustainable_rate", "calibrate", "cached_capacity"],
        "client": ["Api", "ClientConfig", "RequestRecord", "endpoint_url", "send"],
        "findmax": [
            "LimitedBy",
            "Level",
            "SearchResult",
            "search_max_rate",
            "queue_growing",
            "falling_behind",
        ],
        "levels": ["BenchOptions", "detect_model", "run_level", "find_max"],
        "live": ["LiveView", "summary_table"],
        "metrics": ["percentiles", "summarize_records"],
        "null_endpoint": ["NullEndpoint", "start_null_endpoint"],
        "runner": ["LoadPlan", "LoadResult", "Progress", "run_load"],
        "sse": ["StreamState"],
        "tokens": ["LocalTokenizer", "load_tokenizer"],
    },
)
