"""From a measured compression speed-up to a serving plan: scale a latency profile of the dense
model (``gpufleet serve profile`` / ``serve plan`` format) into one for the compressed model.

Prefill latency coefficients (a, b, c) are divided by the measured prefill speed-up, decode
coefficients by the decode speed-up, and the KV-cache bytes per token (and so the KV capacity) by
the ratio of KV widths (layers x KV heads x head size) the pruning kept. ``serve plan`` then plans
GPUs for the same traffic and SLO with both profiles, side by side.
"""

from __future__ import annotations

import copy
from typing import Any

from gpufleet.core.errors import UsageError

__all__ = ["scaled_profile"]


def scaled_profile(
    profile: dict[str, Any],
    *,
    prefill_speedup: float,
    decode_speedup: float,
    kv_ratio: float = 1.0,
    name: str | None = None,
    note: str = "",
) -> dict[str, Any]:
    """A copy of ``profile`` for a model ``prefill_speedup``/``decode_speedup`` times faster whose KV
    cache per token is ``kv_ratio`` of the dense one."""
    if profile.get("schema") != "gpufleet.serve.profile":
        raise UsageError("not a gpufleet.serve.profile JSON")
    if prefill_speedup <= 0 or decode_speedup <= 0 or not 0 < kv_ratio <= 1.0:
        raise UsageError("speed-ups must be positive and the KV ratio in (0, 1]")
    out = copy.deepcopy(profile)
    out["model"] = name or f"{profile.get('model', 'model')}-compressed"
    out["source"] = "compress-scaled"
    scaled = f"prefill x{prefill_speedup:.3f}, decode x{decode_speedup:.3f}, KV per token x{kv_ratio:.3f}"
    out["source_note"] = f"{profile.get('model')} scaled by measured compression speed-ups: {scaled}. {note}"
    if "kv_bytes_per_token" in out:
        out["kv_bytes_per_token"] = int(round(out["kv_bytes_per_token"] * kv_ratio))
    for entry in out.get("tp", []):
        for key, s in (("prefill", prefill_speedup), ("decode", decode_speedup)):
            for coef in ("a", "b", "c"):
                if coef in entry.get(key, {}):
                    entry[key][coef] = entry[key][coef] / s
        if "kv_capacity_tokens" in entry:
            entry["kv_capacity_tokens"] = int(entry["kv_capacity_tokens"] / kv_ratio)
    return out
