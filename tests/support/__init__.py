"""Test services that run as real separate processes on loopback (test-only: not shipped in the
``gpufleet`` package; pytest puts tests/ on ``sys.path`` (``pythonpath`` in pyproject.toml), and
``.ci/*.sh`` and the benchmarks do the same).

- :mod:`support.seaweed`: start and stop a SeaweedFS S3 server (``weed server -s3``).
- :mod:`support.flaky_proxy`: an HTTP reverse proxy that answers a deterministic fraction
  of requests with S3 errors (503 SlowDown, 500 InternalError) instead of forwarding them.
- :mod:`support.llama`: a real llama.cpp server (``llama-cpp-python[server]``) and
  ``gpufleet serve mock`` as child processes.
- :mod:`support.process`: the plumbing they share (free ports, stop by PID, pid/env files).

What users run stays in the package: ``gpufleet serve mock``, the null endpoint, ``health/fakes``.
"""
