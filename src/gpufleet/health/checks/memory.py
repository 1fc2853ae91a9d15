"""Memory bandwidth: device-to-device copy per GPU (HBM), memcpy on CPU, and host<->device copies."""

from __future__ import annotations

from gpufleet.health.checks import Context, register, result
from gpufleet.health.checks.measure import calibrate, injected_slowdown, per_device, timed
from gpufleet.health.results import CheckResult, Status

HINT = "low memory bandwidth: check HBM/DIMM errors, clocks and NUMA placement; compare with peers"
H2D_HINT = "slow host<->device copies: check the PCIe link (gen/width), NUMA affinity and IOMMU settings"


@register("memory.bandwidth", component="memory", timeout_s=60)
def bandwidth(ctx: Context) -> list[CheckResult]:
    """Copy bandwidth (bytes read + written per second): HBM on each GPU, memcpy on the CPU."""
    import torch

    seconds = float(ctx.param("seconds", 0.5))
    reps = max(1, int(ctx.param("reps", 3)))
    values: dict[str, float] = {}
    if ctx.gpu:
        if not torch.cuda.is_available():
            return [
                result("memory.bandwidth", Status.INCOMPLETE, "profile expects GPUs; torch.cuda unavailable")
            ]
        nbytes = int(float(ctx.param("mb", 2048)) * 2**20)
        for i in range(torch.cuda.device_count()):
            src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}")
            dst = torch.empty_like(src)

            def work(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                dst.copy_(src)

            def sync(i: int = i) -> None:
                torch.cuda.synchronize(i)

            iters = calibrate(work, sync, seconds / reps)
            slow = injected_slowdown("memory.bandwidth", f"gpu{i}", ctx.env)
            best = min(timed(work, sync, iters, slow) for _ in range(reps))
            values[f"gpu{i}"] = 2.0 * nbytes * iters / best
            del src, dst
        return per_device(ctx, "memory.bandwidth", "memory.copy", values, HINT)
    nbytes = int(float(ctx.param("cpu_mb", 64)) * 2**20)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def cpu_work() -> None:
        dst.copy_(src)

    def nosync() -> None:
        return None

    iters = calibrate(cpu_work, nosync, seconds / reps)
    slow = injected_slowdown("memory.bandwidth", "cpu", ctx.env)
    best = min(timed(cpu_work, nosync, iters, slow) for _ in range(reps))
    return per_device(ctx, "memory.bandwidth", "memory.copy", {"cpu": 2.0 * nbytes * iters / best}, HINT)


@register("memory.h2d", component="gpu", timeout_s=60, requires_gpu=True)
def host_device(ctx: Context) -> list[CheckResult]:
    """Host->device and device->host copy bandwidth per GPU from pinned host memory."""
    import torch

    if not torch.cuda.is_available():
        return [result("memory.h2d", Status.INCOMPLETE, "profile expects GPUs; torch.cuda unavailable")]
    seconds = float(ctx.param("seconds", 0.5))
    reps = max(1, int(ctx.param("reps", 3)))
    nbytes = int(float(ctx.param("mb", 1024)) * 2**20)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h2d: dict[str, float] = {}
    d2h: dict[str, float] = {}
    for i in range(torch.cuda.device_count()):
        dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}")

        def up(dev: torch.Tensor = dev) -> None:
            dev.copy_(host, non_blocking=True)

        def down(dev: torch.Tensor = dev) -> None:
            host.copy_(dev, non_blocking=True)

        def sync(i: int = i) -> None:
            torch.cuda.synchronize(i)

        for name, fn, out in (("h2d", up, h2d), ("d2h", down, d2h)):
            iters = calibrate(fn, sync, seconds / reps)
            slow = injected_slowdown(f"memory.{name}", f"gpu{i}", ctx.env)
            out[f"gpu{i}"] = nbytes * iters / min(timed(fn, sync, iters, slow) for _ in range(reps))
        del dev
    res = per_device(ctx, "memory.h2d", "memory.h2d", h2d, H2D_HINT)
    for r in per_device(ctx, "memory.h2d", "memory.d2h", d2h, H2D_HINT):
        r.device = f"{r.device}:d2h"
        res.append(r)
    return res
