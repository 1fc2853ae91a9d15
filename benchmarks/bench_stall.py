"""P1: training-blocking time per checkpoint, gpufleet vs torch.save (sync) vs DCP async_save.

Each repeat runs one fake training iteration around each method:
    t0 -> checkpoint call -> fixed forward/backward work -> (ours: wait_staged) -> optimizer step
The stall is the time the training thread is blocked by checkpointing: for gpufleet, the time in
save() plus the time blocked in wait_staged(); for torch.save, the whole call; for DCP async_save,
the time until it returns (its staging copy). The forward/backward is a fixed amount of matmul work
(calibrated once, alone), so a background copy that steals CPU shows up as a slower iteration,
which is reported too ("iter_overhead_s").

Usage: .venv/bin/python benchmarks/bench_stall.py --size-gb 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from common import make_state, median, print_table, state_bytes, write_json
from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine

warnings.simplefilter("ignore")


def calibrate(compute_s: float) -> int:
    a = torch.randn(512, 512)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < compute_s:
        a = torch.tanh(a @ a)
        n += 1
    return n


def fwd_bwd(n: int) -> None:
    a = torch.randn(512, 512)
    for _ in range(n):
        a = torch.tanh(a @ a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compute-s", type=float, default=1.0, help="fake forward/backward duration")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under ./benchmarks)")
    args = ap.parse_args()

    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_stall_", dir=Path(__file__).parent))
    base.mkdir(parents=True, exist_ok=True)
    sd = make_state(args.size_gb)
    nbytes = state_bytes(sd)
    print(f"state: {nbytes / 1e9:.2f} GB, {args.repeats} repeats, fwd/bwd ~{args.compute_s}s, dir {base}")
    n_work = calibrate(args.compute_s)
    eng = CheckpointEngine(CheckpointConfig(dir=str(base / "ours"), keep_last=1))
    deferred = lambda k: k.startswith(("model.", "optim.state."))  # noqa: E731
    eng.save(0, sd, deferred=deferred)  # warm-up: allocates the reusable staging buffers
    eng.wait()

    res: dict[str, list[float]] = {"ours": [], "torch_save": [], "dcp_async": []}
    iters: dict[str, list[float]] = {k: [] for k in res}
    plain: list[float] = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        fwd_bwd(n_work)  # an iteration without any checkpoint, measured in the same noise
        plain.append(time.perf_counter() - t0)

        # ours
        t0 = time.perf_counter()
        eng.save(r + 1, sd, deferred=deferred)
        in_save = time.perf_counter() - t0
        fwd_bwd(n_work)
        blocked = eng.wait_staged()
        iters["ours"].append(time.perf_counter() - t0)
        res["ours"].append(in_save + blocked)
        eng.wait()
        os.sync()

        # torch.save, synchronous
        t0 = time.perf_counter()
        torch.save(sd, base / f"torch_{r}.pt")
        res["torch_save"].append(time.perf_counter() - t0)
        fwd_bwd(n_work)
        iters["torch_save"].append(time.perf_counter() - t0)
        (base / f"torch_{r}.pt").unlink()
        os.sync()

        # DCP async_save: blocking part = until it returns
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=str(base / f"dcp_{r}"))
        res["dcp_async"].append(time.perf_counter() - t0)
        fwd_bwd(n_work)
        iters["dcp_async"].append(time.perf_counter() - t0)
        fut.result()
        shutil.rmtree(base / f"dcp_{r}")
        os.sync()
        print(f"repeat {r}: stall " + ", ".join(f"{k}={v[-1]:.4f}s" for k, v in res.items()), end="; ")
        its = ", ".join(f"{k}={v[-1]:.3f}s" for k, v in iters.items())
        print(f"iteration {its}, none={plain[-1]:.3f}s")
    eng.close()

    base_iter = median(plain)
    med = {k: median(v) for k, v in res.items()}
    rows = [
        [k, med[k], median(iters[k]) - base_iter, med[k] / med["torch_save"], med[k] / med["dcp_async"]]
        for k in res
    ]
    print_table(
        f"P1 stall per checkpoint of {nbytes / 1e9:.2f} GB (median of {args.repeats}); "
        f"iteration without checkpoint {base_iter:.3f}s",
        ["method", "stall_s", "iter_overhead_s", "x_torch_save", "x_dcp_async"],
        rows,
    )
    ratio_ts, ratio_dcp = med["ours"] / med["torch_save"], med["ours"] / med["dcp_async"]
    print(f"goal ours <= 10% of torch.save: {ratio_ts:.3%} -> {'MET' if ratio_ts <= 0.10 else 'NOT MET'}")
    print(f"goal ours <= 0.5x DCP async:    {ratio_dcp:.3f}x -> {'MET' if ratio_dcp <= 0.5 else 'NOT MET'}")
    out = write_json(
        "p1_stall.json",
        {
            "bytes": nbytes,
            "repeats": args.repeats,
            "iter_without_ckpt_s": plain,
            "stall_s": res,
            "iter_s": iters,
            "median_stall_s": med,
            "ours_over_torch_save": ratio_ts,
            "ours_over_dcp_async": ratio_dcp,
        },
    )
    print(f"wrote {out}")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
