# ruff: noqa: E501
"""P10 (GPU): checkpointing state that lives on a GPU, gpufleet's engine against DCP's own savers.

What a training loop pays for a checkpoint of GPU-resident model + Adam state, side by side in one run
(interleaved, medians), each with a fresh checkpoint directory on the same local disk:

* ``gpufleet``        ``CheckpointEngine.save`` as ``Run`` calls it: parameters and optimizer state
                      deferred (copied device->host into reused pinned buffers on a side stream while
                      the caller goes on), persisted and verified (xxh3 manifest) in the background.
* ``dcp-async``       ``dcp.async_save`` with torch's default stager.
* ``dcp-async-pinned`` ``dcp.async_save`` with ``DefaultStager(StagingOptions(use_pinned_memory=True,
                      use_async_staging=True, use_non_blocking_copy=True))``, reused across saves:
                      torch's recommended fast path where this torch has it.
* ``dcp-sync``        ``dcp.save``: the loop waits for the whole write.

Per save: ``blocked`` (the call's own time: what the loop cannot overlap), ``staged`` (until the
snapshot is in host memory: the GPU state may change after that), ``durable`` (until committed on
disk). The first save of each saver (buffer allocation, pinning) is reported apart from the steady
state. Then the restore of the newest checkpoint into GPU tensors: gpufleet's verified load against
``dcp.load``, page cache dropped before each. Reference: a plain device->host copy into pinned and
into pageable memory.

``python benchmarks/bench_gpu_ckpt.py [--sizes 1,8] [--repeats 3] [--deadline 240]``; JSON to
benchmarks/results/p10_gpu_ckpt.json. Needs a CUDA GPU; ``--device cpu`` runs the same pipeline
without one (a dry run of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import blank_like, drop_caches, median, print_table, state_bytes, write_json  # noqa: E402
from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine  # noqa: E402

SAVERS = ("gpufleet", "dcp-async", "dcp-async-pinned", "dcp-sync")


def gpu_state(size_gb: float, device: str, hidden: int = 8192) -> dict[str, Any]:
    """Parameters + Adam moments of an MLP, ~size_gb in fp32, on ``device``."""
    per_layer = 3 * hidden * hidden * 4
    layers = max(1, round(size_gb * 1e9 / per_layer))
    model, state = {}, {}
    for i in range(layers):
        w = f"layers.{i}.weight"
        model[w] = torch.empty(hidden, hidden, device=device).uniform_(-0.01, 0.01)
        state[i] = {
            "step": torch.tensor(10.0),
            "exp_avg": torch.full_like(model[w], 1e-3),
            "exp_avg_sq": torch.full_like(model[w], 1e-6),
        }
    groups = [{"lr": 1e-3, "params": list(range(layers))}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "step": 10}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def has_pinned_stager() -> bool:
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    except ImportError:
        return False
    return True


def pinned_stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=True,
        )
    )


class Savers:
    """One instance of each saver, kept across saves as a training job keeps them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.engine: CheckpointEngine | None = None
        self.stager: Any = None  # torch's pinned stager, made on first use and kept
        self.n = 0

    def fresh_dir(self, name: str) -> Path:
        """A new directory for DCP's next save; its older ones are deleted (the disk holds one each)."""
        for old in self.dirs(name):
            shutil.rmtree(old)
        self.n += 1
        d = self.root / f"{name}-{self.n}"
        d.mkdir(parents=True)
        return d

    def save(self, name: str, sd: dict[str, Any], device: str) -> dict[str, float]:
        """Time one save of ``sd``; returns blocked/staged/durable seconds."""
        sync(device)
        if name == "gpufleet":
            if self.engine is None:  # one engine for the whole run, as Run keeps one (its buffers too)
                self.engine = CheckpointEngine(CheckpointConfig(dir=str(self.root / name), keep_last=1))
            t0 = time.perf_counter()
            self.n += 1
            assert self.engine.save(self.n, sd, deferred=lambda k: k.startswith(("model", "optim")))
            blocked = time.perf_counter() - t0
            self.engine.wait_staged()
            staged = time.perf_counter() - t0
            self.engine.wait()
            return {"blocked": blocked, "staged": staged, "durable": time.perf_counter() - t0}
        path = self.fresh_dir(name)
        t0 = time.perf_counter()
        if name == "dcp-sync":
            dcp.save(sd, checkpoint_id=str(path), no_dist=True)
            t = time.perf_counter() - t0
            return {"blocked": t, "staged": t, "durable": t}
        kwargs: dict[str, Any] = {"checkpoint_id": str(path), "no_dist": True}
        if name == "dcp-async-pinned":
            if self.stager is None:
                self.stager = pinned_stager()
            kwargs["async_stager"] = self.stager
        out = dcp.async_save(sd, **kwargs)
        blocked = time.perf_counter() - t0
        staging = getattr(out, "staging_completion", None)
        upload = getattr(out, "upload_completion", out)
        if staging is not None:
            staging.result()
        staged = time.perf_counter() - t0
        upload.result()
        return {"blocked": blocked, "staged": staged, "durable": time.perf_counter() - t0}

    def newest(self, name: str) -> Path:
        if name == "gpufleet":
            return self.root / name
        return max(self.dirs(name), key=lambda p: int(p.name.rsplit("-", 1)[1]))

    def dirs(self, name: str) -> list[Path]:
        """This saver's directories (``dcp-async-3``, not ``dcp-async-pinned-3``)."""
        return [p for p in self.root.glob(f"{name}-*") if p.name[len(name) + 1 :].isdigit()]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.stager is not None:
            self.stager.close()


def attempt(savers: Savers, name: str, sd: dict[str, Any], device: str, failed: dict[str, str]) -> Any:
    """One save's timings, or None when the saver failed (reported in ``failed``, not fatal)."""
    try:
        return savers.save(name, sd, device)
    except Exception as e:  # noqa: BLE001
        failed[name] = f"{type(e).__name__}: {e}"
        print(f"  {name} failed: {failed[name]}")
        return None


def copy_reference(sd: dict[str, Any], device: str) -> dict[str, float]:
    """GB/s of a plain device->host copy of every tensor, into pinned and into pageable memory."""
    tensors = [t for t in sd["model"].values()]
    out = {}
    for kind in ("pinned", "pageable"):
        pin = kind == "pinned" and device.startswith("cuda")
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        for b, t in zip(bufs, tensors, strict=True):  # fault the pages in first
            b.copy_(t)
        sync(device)
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors, strict=True):
            b.copy_(t, non_blocking=pin)
        sync(device)
        out[kind] = sum(t.nbytes for t in tensors) / (time.perf_counter() - t0) / 1e9
        del bufs
    return out


def restore(name: str, savers: Savers, sd: dict[str, Any], device: str) -> float:
    path = savers.newest(name)
    blank = blank_like(sd)
    drop_caches([path])
    sync(device)
    t0 = time.perf_counter()
    if name == "gpufleet":
        engine = CheckpointEngine(CheckpointConfig(dir=str(path)))
        got = engine.load(blank)
        engine.close()
        assert got is not None
    else:
        dcp.load(blank, checkpoint_id=str(path), no_dist=True)
    sync(device)
    took = time.perf_counter() - t0
    first = next(iter(sd["model"]))
    assert torch.equal(blank["model"][first], sd["model"][first]), f"{name}: restored weights differ"
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,8", help="state sizes in GB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="steady-state saves per saver and size")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temp dir on local disk)")
    ap.add_argument("--deadline", type=float, default=600.0, help="stop starting new work after this many s")
    ap.add_argument("--out", default="p10_gpu_ckpt.json")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu_ckpt: no CUDA GPU here (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    root = Path(args.dir or tempfile.mkdtemp(prefix="p10-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    # torch's pinned, non-blocking stager needs an accelerator (and a torch that has it)
    on_gpu = args.device.startswith("cuda")
    savers_names = [s for s in SAVERS if s != "dcp-async-pinned" or (on_gpu and has_pinned_stager())]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none"
    print(f"P10: {gpu}, torch {torch.__version__}, savers {', '.join(savers_names)}, root {root}")
    results: dict[str, Any] = {"gpu": gpu, "device": args.device, "sizes": {}, "loadavg": os.getloadavg()}
    try:
        for size in [float(s) for s in args.sizes.split(",")]:
            sd = gpu_state(size, args.device)
            nbytes = state_bytes(sd)
            ref = copy_reference(sd, args.device)
            savers = Savers(root / f"{size:g}gb")
            failed: dict[str, str] = results.setdefault("failed", {})
            first = {n: r for n in savers_names if (r := attempt(savers, n, sd, args.device, failed))}
            savers_names = [n for n in savers_names if n not in failed]
            runs: dict[str, list[dict[str, float]]] = {n: [] for n in savers_names}
            for _ in range(args.repeats):
                if time.monotonic() - t_start > args.deadline:
                    break
                for n in list(savers_names):  # interleaved: host noise hits every saver alike
                    if (r := attempt(savers, n, sd, args.device, failed)) is not None:
                        runs[n].append(r)
                    else:
                        savers_names.remove(n)
            loads = {n: restore(n, savers, sd, args.device) for n in savers_names}
            savers.close()
            rows, entry = [], {"bytes": nbytes, "copy_gbps": ref, "savers": {}}
            for n in savers_names:
                med = {k: median([r[k] for r in runs[n]]) for k in ("blocked", "staged", "durable")}
                entry["savers"][n] = {
                    "first": first[n],
                    "steady": runs[n],
                    "median": med,
                    "restore_s": loads[n],
                }
                rows.append([n, first[n]["blocked"], med["blocked"], med["staged"], med["durable"],
                             nbytes / 1e9 / med["durable"], loads[n]])  # fmt: skip
            results["sizes"][f"{size:g}"] = entry
            print_table(
                f"{nbytes / 1e9:.2f} GB on {args.device}; device->host copy {ref['pinned']:.1f} GB/s pinned, "
                f"{ref['pageable']:.1f} GB/s pageable; {len(runs[savers_names[0]])} steady saves each",
                ["saver", "first blocked s", "blocked s", "staged s", "durable s", "GB/s", "restore s"],
                rows,
            )
            g = entry["savers"]["gpufleet"]["median"]
            for n in savers_names[1:]:
                o = entry["savers"][n]["median"]
                print(f"  gpufleet / {n}: blocked {g['blocked'] / o['blocked']:.3f}x, durable "
                      f"{g['durable'] / o['durable']:.3f}x, restore "
                      f"{loads['gpufleet'] / loads[n]:.3f}x")  # fmt: skip
            del sd
            shutil.rmtree(savers.root, ignore_errors=True)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    out = write_json(args.out, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
