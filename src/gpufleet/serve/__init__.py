"""Serving pillar: ``gpufleet serve bench/mock/profile/plan/pack``.

Nothing here is imported by ``import gpufleet``, and ``import gpufleet.serve`` imports nothing else.
The subpackages follow the data flow (docs/serve-*.md):

* :mod:`gpufleet.serve.common`: what more than one of them uses: the SLO type and its ``--slo``
  grammar, workloads and length distributions, rack types, the plan-file format and its modes.
* :mod:`gpufleet.serve.bench`: the SLA benchmark of an OpenAI-compatible endpoint (load loop,
  metrics, max-rate search, client calibration against the null endpoint).
* :mod:`gpufleet.serve.mock`: the mock OpenAI server with known latencies (continuous batching).
* :mod:`gpufleet.serve.plan`: latency profiles, the batching simulator and the capacity planner.
* :mod:`gpufleet.serve.pack`: placing plans' engine instances into racks and nodes.

Each subpackage re-exports its public names lazily (``__all__``).
"""
