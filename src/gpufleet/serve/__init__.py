"""Serving pillar: ``gpufleet serve bench``, an honest SLA benchmark for OpenAI-compatible endpoints.

Modules (import lazily; none is imported by ``import gpufleet``):
workload (prompts and lengths, Mooncake traces), arrivals, slo, sse (stream parsing), client (one
request), runner (the load loop, multi-process), metrics, findmax, bench (orchestration), calibrate
(client capacity), null_endpoint, output (files and plots), live (Rich view). See docs/serve-bench.md.
"""
