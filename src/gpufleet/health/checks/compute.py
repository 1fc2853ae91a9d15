"""Compute: matmul throughput per device (bf16 on GPU, fp32 on CPU cores), absolute and relative."""

from __future__ import annotations

import os

from gpufleet.health.checks import Context, register, result
from gpufleet.health.checks.measure import calibrate, injected_slowdown, min_of_samples, per_device, timed
from gpufleet.health.results import CheckResult, Status

HINT = "slow compute: check clocks/throttling and power (GPU) or CPU frequency scaling; compare with peers"


def cpu_lanes(ctx: Context) -> list[int]:
    """CPU cores the CPU fallback measures, one "device" each (param ``cpu_devices``, default 2)."""
    cores = sorted(os.sched_getaffinity(0))
    want = max(1, int(ctx.param("cpu_devices", 2)))
    step = max(1, len(cores) // want)
    return cores[::step][:want]


@register("compute.matmul", component="gpu", timeout_s=60)
def matmul(ctx: Context) -> list[CheckResult]:
    """Dense matmul throughput per device against the profile and against the node's other devices."""
    import torch

    seconds = float(ctx.param("seconds", 0.5))
    reps = max(1, int(ctx.param("reps", 3)))
    values: dict[str, float] = {}
    if ctx.gpu:
        if not torch.cuda.is_available():
            return [
                result("compute.matmul", Status.INCOMPLETE, "profile expects GPUs; torch.cuda unavailable")
            ]
        n = int(ctx.param("n", 8192))
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

            def work(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
                torch.mm(a, b)

            def sync(i: int = i) -> None:
                torch.cuda.synchronize(i)

            iters = calibrate(work, sync, seconds / reps)
            slow = injected_slowdown("compute.matmul", f"gpu{i}", ctx.env)
            best = min(timed(work, sync, iters, slow) for _ in range(reps))
            values[f"gpu{i}"] = 2.0 * n**3 * iters / best
            del a, b
        return per_device(ctx, "compute.matmul", "compute.matmul", values, HINT)
    n = int(ctx.param("cpu_n", 256))
    samples = max(1, int(ctx.param("samples", 150)))
    pin = bool(ctx.param("pin", True))
    lanes = cpu_lanes(ctx)
    a, b = torch.randn(n, n), torch.randn(n, n)

    def cpu_work(lane: str) -> None:
        if pin:
            os.sched_setaffinity(0, {int(lane[3:])})
        torch.mm(a, b)

    names = [f"cpu{c}" for c in lanes]
    slow = {d: injected_slowdown("compute.matmul", d, ctx.env) for d in names}
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm-up
        best = min_of_samples(names, cpu_work, samples, slow)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)
    values = {d: 2.0 * n**3 / t for d, t in best.items()}
    return per_device(ctx, "compute.matmul", "compute.matmul", values, HINT)
