"""Collective: all_reduce bus bandwidth with real torch.distributed processes (NCCL on GPU, gloo on CPU).

busbw = algbw x 2(n-1)/n, algbw = message bytes / time per all_reduce (the nccl-tests definitions).
The workers are subprocesses of this module (``python -m gpufleet.health.checks.collective``) with a
timeout; rank 0 prints one JSON line. Multi-node pairs and the bad-node search: :mod:`..pairwise`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from gpufleet.core.env import Platform
from gpufleet.core.ports import free_port
from gpufleet.health.checks import Context, measured, register, result
from gpufleet.health.results import CheckResult, Status

HINT = "slow all_reduce: check NVLink/NVSwitch (nvidia-smi nvlink -s), fabric manager, NCCL env and IB links"


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests all_reduce bus bandwidth in bytes/s."""
    if n < 1 or seconds <= 0:
        raise ValueError("need n >= 1 and a positive time")
    return nbytes / seconds * 2.0 * (n - 1) / n


@register("collective.allreduce", component="network", timeout_s=120)
def allreduce(ctx: Context) -> list[CheckResult]:
    """all_reduce busbw within the node: one process per GPU (NCCL), or 2 local processes (gloo)."""
    if ctx.gpu:
        import torch

        if not torch.cuda.is_available():
            return [
                result(
                    "collective.allreduce", Status.INCOMPLETE, "profile expects GPUs; torch.cuda unavailable"
                )
            ]
        world, backend, mb = torch.cuda.device_count(), "nccl", float(ctx.param("mb", 1024))
        if world < 2:
            return [result("collective.allreduce", Status.OK, "1 GPU: no intra-node collective to test")]
    else:
        world, backend, mb = int(ctx.param("cpu_procs", 2)), "gloo", float(ctx.param("cpu_mb", 8))
    iters = int(ctx.param("iters", 5))
    port = free_port()
    timeout = ctx.remaining()
    rendezvous = {Platform.MASTER_ADDR: "127.0.0.1", Platform.MASTER_PORT: Platform.MASTER_PORT.format(port)}
    env = {**ctx.env, **rendezvous, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpufleet.health.checks.collective",
                str(r),
                str(world),
                backend,
                str(mb),
                str(iters),
                str(int(timeout)),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs: list[tuple[str, str]] = []
    try:
        end = time.monotonic() + timeout
        for p in procs:
            outs.append(p.communicate(timeout=max(0.1, end - time.monotonic())))
    except subprocess.TimeoutExpired:
        return [
            result(
                "collective.allreduce",
                Status.INCOMPLETE,
                f"all_reduce workers timed out after {timeout:.0f} s",
                hint=HINT,
            )
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [
        (r, p.returncode, outs[r][1].strip().splitlines()[-1:] if r < len(outs) else [])
        for r, p in enumerate(procs)
        if p.returncode != 0
    ]
    if bad:
        r, rc, tail = bad[0]
        return [
            result(
                "collective.allreduce",
                Status.FAIL,
                f"rank {r} exited {rc}: {' '.join(tail)[:160]}",
                hint=HINT,
            )
        ]
    try:
        rec = json.loads(outs[0][0].strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return [result("collective.allreduce", Status.INCOMPLETE, "rank 0 printed no result")]
    return [
        measured(
            ctx,
            "collective.allreduce",
            "collective.busbw",
            rec["busbw"],
            hint=HINT,
            device=f"{backend}x{world}",
            detail=f"{mb:g} MiB, {world} ranks, algbw {rec['algbw'] / 1e9:.3g} GB/s",
            data=rec,
        )
    ]


def _worker(rank: int, world: int, backend: str, mb: float, iters: int, timeout_s: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        n = int(mb * 2**20) // 4
        x = torch.ones(n, dtype=torch.float32, device=dev)

        def sync() -> None:
            if backend == "nccl":
                torch.cuda.synchronize(rank)

        dist.all_reduce(x)  # warm-up
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        dt = (time.perf_counter() - t0) / iters
        t = torch.tensor([dt], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank defines the time
        if rank == 0:
            nbytes, sec = n * 4, float(t.item())
            out = {"bytes": nbytes, "time_s": sec, "algbw": nbytes / sec, "busbw": busbw(nbytes, sec, world)}
            print(json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    os.environ.setdefault(Platform.GLOO_SOCKET_IFNAME, "lo")
    _worker(int(a[0]), int(a[1]), a[2], float(a[3]), int(a[4]), int(a[5]))
