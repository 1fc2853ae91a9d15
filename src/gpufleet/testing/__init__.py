"""Test services that run as real separate processes on loopback.

- :mod:`gpufleet.testing.seaweed`: start and stop a SeaweedFS S3 server (``weed server -s3``).
- :mod:`gpufleet.testing.flaky_proxy`: an HTTP reverse proxy that answers a deterministic fraction
  of requests with S3 errors (503 SlowDown, 500 InternalError) instead of forwarding them.

Nothing here is imported by the library itself; these are for tests, CI and benchmarks.
"""
