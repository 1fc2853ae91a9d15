"""MTTR load phase from the in-memory tier vs from local disk (``--memory-tier``), side by side.

One checkpoint (default 76 MB of parameters + Adam state, as benchmark P3) is saved once with the
memory tier on, so the same step is on disk and in this node's keeper (/dev/shm). Then each trial
starts a fresh process (a restarted worker) that builds its blank state (not timed) and times only
``CheckpointEngine.load``: choose + read + verify every checksum + copy into the tensors, i.e. the
load phase of the MTTR breakdown. Three sources, interleaved in rotating order:

- ``memory``: the keeper's copy (restore's first choice with --memory-tier);
- ``disk_cold``: the disk copy, its pages evicted first (posix_fadvise DONTNEED on our files only),
  as after a restart when the engine wrote with O_DIRECT;
- ``disk_warm``: the disk copy with every page in the page cache (the best case for disk).

Medians over trials; the 1-minute load average is recorded before and after.
Run: ``flock /tmp/gpufleet_heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_memtier.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import blank_like, make_state, median, print_table, state_bytes, write_json  # noqa: E402

MODES = ("memory", "disk_cold", "disk_warm")


def _engine(work: Path, memory: bool) -> Any:
    from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine

    cfg = CheckpointConfig(
        dir=str(work / "ck"),
        memory_bytes=(4 << 30) if memory else 0,
        memory_dir=str(work / "keeper") if memory else None,
    )
    return CheckpointEngine(cfg)


def child(work: Path, mode: str, mb: float) -> None:
    blank = blank_like(make_state(mb / 1000, hidden=1024))
    eng = _engine(work, memory=mode == "memory")
    t0 = time.perf_counter()
    res = eng.load(blank)
    load_s = time.perf_counter() - t0
    assert res is not None
    print(json.dumps({"mode": mode, "load_s": load_s, "source": res.source, "step": res.step}))


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


def _evict(d: Path) -> None:
    for p in _files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(d: Path) -> None:
    for p in _files(d):
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=76.0, help="state size, MB")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument(
        "--work", type=Path, default=None, help="disk directory for the checkpoint (default: a temp dir)"
    )
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.work, args.child, args.mb)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_memtier_", dir="/var/tmp"))
    keeper = Path(tempfile.mkdtemp(prefix="bench_memtier_", dir="/dev/shm"))
    (work / "keeper").unlink(missing_ok=True)
    (work / "keeper").symlink_to(keeper)  # the keeper lives in /dev/shm, as in a run
    try:
        state = make_state(args.mb / 1000, hidden=1024)
        nbytes = state_bytes(state)
        eng = _engine(work, memory=True)
        assert eng.save(1, state)
        eng.wait()
        del state, eng
        load0 = os.getloadavg()[0]
        trials: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.trials):
            for mode in MODES[i % 3 :] + MODES[: i % 3]:
                if mode == "disk_cold":
                    _evict(work / "ck")
                elif mode == "disk_warm":
                    _warm(work / "ck")
                cmd = [sys.executable, __file__, "--child", mode, "--work", str(work), "--mb", str(args.mb)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                rec = json.loads(out.strip().splitlines()[-1])
                want = "memory" if mode == "memory" else "local"
                assert rec["source"] == want, rec
                trials[mode].append(rec["load_s"])
        load1 = os.getloadavg()[0]
    finally:
        shutil.rmtree(keeper, ignore_errors=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    med = {m: median(v) for m, v in trials.items()}
    rows = [[m, med[m], min(trials[m]), max(trials[m]), med[m] / med["memory"]] for m in MODES]
    print_table(
        f"load phase, {nbytes / 1e6:.0f} MB state, median of {args.trials} "
        f"(load avg {load0:.1f} -> {load1:.1f})",
        ["source", "median_s", "min_s", "max_s", "x memory"],
        rows,
    )
    path = write_json(
        f"memtier_{args.mb:g}MB.json",
        {
            "bench": "memtier_load",
            "state_bytes": nbytes,
            "trials": trials,
            "median_s": med,
            "disk_cold_over_memory": med["disk_cold"] / med["memory"],
            "disk_warm_over_memory": med["disk_warm"] / med["memory"],
            "loadavg_1m": [load0, load1],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
