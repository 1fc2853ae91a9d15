"""P2: persist and restore throughput, gpufleet vs the disk's raw sequential I/O vs DCP defaults.

Per repeat, on the same directory:
- raw write: the state's byte count written with os.write in 64 MiB chunks, then fsync;
- raw read: that file read back with readinto after evicting the page cache;
- gpufleet persist: ``persist_s`` of CKPT_COMMITTED (plan + write + fsync + checksums + manifest);
- DCP persist: ``dcp.save`` with ``FileSystemWriter`` defaults (1 thread, fsync on);
- gpufleet restore: ``CheckpointEngine.load`` (verify every checksum, then DCP load) from a cold cache;
- DCP restore: ``dcp.load`` with ``FileSystemReader`` from a cold cache.
The page cache is dropped before every read (``/proc/sys/vm/drop_caches`` as root, otherwise
``posix_fadvise(DONTNEED)`` per file); the method used is printed and stored in the JSON.

Usage: .venv/bin/python benchmarks/bench_throughput.py --size-gb 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from common import blank_like, drop_caches, make_state, median, print_table, state_bytes, write_json
from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.core import events as E

warnings.simplefilter("ignore")
CHUNK = 64 << 20


class Sink:
    def __init__(self) -> None:
        self.last: dict[str, dict[str, Any]] = {}

    def emit(self, ev: str, **fields: Any) -> None:
        self.last[ev] = fields


def raw_write(path: Path, nbytes: int, buf: memoryview) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[: min(CHUNK, left)])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: Path) -> float:
    buf = bytearray(CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under ./benchmarks)")
    args = ap.parse_args()

    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_tput_", dir=Path(__file__).parent))
    base.mkdir(parents=True, exist_ok=True)
    sd = make_state(args.size_gb)
    nbytes = state_bytes(sd)
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)  # 64 MiB, incompressible
    print(f"state: {nbytes / 1e9:.2f} GB, {args.repeats} repeats, dir {base}")
    sink = Sink()
    eng = CheckpointEngine(
        CheckpointConfig(dir=str(base / "ours"), keep_last=1, io_threads=args.io_threads), sink=sink
    )
    w = {k: [] for k in ("raw", "ours", "dcp")}
    r = {k: [] for k in ("raw", "ours", "dcp")}
    how = ""
    for i in range(args.repeats):
        raw = base / "raw.bin"
        w["raw"].append(raw_write(raw, nbytes, buf))
        how = drop_caches([raw])
        r["raw"].append(raw_read(raw))
        raw.unlink()

        eng.save(i, sd)
        eng.wait()
        w["ours"].append(sink.last[E.CKPT_COMMITTED]["persist_s"])
        ours_dir = Path(sink.last[E.CKPT_COMMITTED]["path"])
        drop_caches([ours_dir])
        blank = blank_like(sd)
        t0 = time.perf_counter()
        res = eng.load(blank)
        r["ours"].append(time.perf_counter() - t0)
        assert res is not None and torch.equal(
            blank["model"]["layers.0.weight"], sd["model"]["layers.0.weight"]
        )

        ddir = base / f"dcp_{i}"
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ddir)), no_dist=True)
        w["dcp"].append(time.perf_counter() - t0)
        drop_caches([ddir])
        blank = blank_like(sd)
        t0 = time.perf_counter()
        dcp.load(blank, storage_reader=dcp.FileSystemReader(str(ddir)), no_dist=True)
        r["dcp"].append(time.perf_counter() - t0)
        shutil.rmtree(ddir)
        del blank
        gb = nbytes / 1e9
        print(
            f"repeat {i}: write GB/s raw={gb / w['raw'][-1]:.3f} ours={gb / w['ours'][-1]:.3f} "
            f"dcp={gb / w['dcp'][-1]:.3f}; read GB/s raw={gb / r['raw'][-1]:.3f} "
            f"ours={gb / r['ours'][-1]:.3f} dcp={gb / r['dcp'][-1]:.3f}"
        )
    eng.close()

    gb = nbytes / 1e9
    wm = {k: gb / median(v) for k, v in w.items()}
    rm = {k: gb / median(v) for k, v in r.items()}
    rows = [
        ["persist/write", wm["raw"], wm["ours"], wm["dcp"], wm["ours"] / wm["raw"], wm["ours"] / wm["dcp"]],
        ["restore/read", rm["raw"], rm["ours"], rm["dcp"], rm["ours"] / rm["raw"], rm["ours"] / rm["dcp"]],
    ]
    print_table(
        f"P2 throughput, GB/s, {gb:.2f} GB (median of {args.repeats}; cold reads via {how})",
        ["phase", "raw", "ours", "dcp", "ours/raw", "ours/dcp"],
        rows,
    )
    for name, row in (("persist", rows[0]), ("restore", rows[1])):
        ok = row[4] >= 0.8 and row[5] >= 1.5
        verdict = "MET" if ok else "NOT MET"
        print(f"goal {name}: >=80% raw ({row[4]:.0%}) and >=1.5x DCP ({row[5]:.2f}x) -> {verdict}")
    out = write_json(
        "p2_throughput.json",
        {
            "bytes": nbytes,
            "repeats": args.repeats,
            "io_threads": args.io_threads,
            "cold_read_method": how,
            "write_s": w,
            "read_s": r,
            "write_gbps_median": wm,
            "read_gbps_median": rm,
        },
    )
    print(f"wrote {out}")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
