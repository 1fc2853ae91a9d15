"""``serve profile --url`` against the batching mock: the other side of the one-at-a-time test that
tests/integration/test_serve_plan_llama.py runs against llama.cpp."""

from __future__ import annotations

from gpufleet.serve.plan import profile as pm


def test_profile_sweep_sees_a_batching_server(serve_mock) -> None:  # type: ignore[no-untyped-def]
    mock = serve_mock("--ttft", "20ms", "--itl", "5ms", "--max-batch", "8", "--prefill-per-token", "0.2ms")
    pre, dec, max_batch = pm.measure(
        mock.url, "mock", inputs=[16, 64, 128], decode_inputs=[16], output=12, concurrency=[1, 2], requests=3
    )
    assert max_batch == 2  # generations overlapped at concurrency 2: a batching server
    assert {p[0] for p in pre} == {16.0, 64.0, 128.0}
    assert {p[1] for p in dec} == {1.0, 2.0}  # decode points at both batch sizes
    # (the fitted coefficients are timings on a shared host: their accuracy is benchmarks' business)
