"""P2: persist and restore throughput, gpufleet vs the disk's raw sequential I/O vs DCP defaults.

Per repeat, on the same directory, in this order (so every method sees the same disk state):
- raw write: files of exactly the sizes gpufleet wrote last time (same count, one thread per file,
  like gpufleet), each written in 64 MiB chunks then fsync'd, once buffered and once with O_DIRECT;
  raw read: those files read back cold, buffered and O_DIRECT. "raw" is the faster of the two
  modes (median over repeats), i.e. the best this disk did, not the mode gpufleet happens to use;
- gpufleet persist: ``persist_s`` of CKPT_COMMITTED (plan + write + fsync + checksums + manifest);
- DCP persist: ``dcp.save`` with ``FileSystemWriter`` defaults (1 thread, fsync on);
- gpufleet restore: ``CheckpointEngine.load`` (one pass: read each file once while hashing it, then
  copy into the tensors) from a cold cache, on the engine that saved (staging buffers exist);
- gpufleet restart-style restores, each with a fresh engine (a new process has no staging buffers):
  cold cache (``ours_fresh``); right after the O_DIRECT save, no cache drop (``ours_restart``); and
  right after a buffered save (``direct_io=False``), no cache drop (``ours_buffered_restart``), the
  page-cache trade-off; the buffered persist time is ``write_s.ours_buffered``;
- DCP restore: ``dcp.load`` with ``FileSystemReader`` from a cold cache.
Restores go into pre-touched tensors (an initialised model/optimizer), so first-touch page faults of
the destination, which raw reads into one reused buffer never pay, are not counted for anyone.
The page cache is dropped before every read (``/proc/sys/vm/drop_caches`` as root, otherwise
``posix_fadvise(DONTNEED)`` per file); the method used is printed and stored in the JSON.

Usage: .venv/bin/python benchmarks/bench_throughput.py --size-gb 2 --repeats 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from common import blank_like, drop_caches, make_state, median, print_table, state_bytes, write_json
from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.core import events as E
from gpufleet.core.ledger import as_event

warnings.simplefilter("ignore")
CHUNK = 64 << 20


class Sink:
    def __init__(self) -> None:
        self.last: dict[str, dict[str, Any]] = {}

    def emit(self, event: E.Event | str, /, **fields: Any) -> None:
        ev = as_event(event, fields)  # the engine emits typed events
        self.last[ev.kind] = ev.to_record()


def _raw_write_one(path: Path, nbytes: int, buf: memoryview, direct: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    left = nbytes
    while left > 0:
        n = min(CHUNK, left)
        left -= os.write(fd, buf[: n + (-n % 4096 if direct else 0)])
    if direct:
        os.ftruncate(fd, nbytes)
    os.fsync(fd)
    os.close(fd)


def raw_write(paths: list[Path], sizes: list[int], bufs: list[memoryview], direct: bool) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(_raw_write_one, paths, sizes, bufs, [direct] * len(paths)))
    return time.perf_counter() - t0


def _raw_read_one(path: Path, buf: memoryview, direct: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)


def raw_read(paths: list[Path], bufs: list[memoryview], direct: bool) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(_raw_read_one, paths, bufs, [direct] * len(paths)))
    return time.perf_counter() - t0


def touched_like(sd: Any) -> Any:
    out = blank_like(sd)
    for t in _tensors(out):
        t.zero_()  # first touch now, not inside the timed load
    return out


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def timed_load(root: Path, sd: Any, drop: bool) -> float:
    """Restore with a fresh engine (a restarted process) into pre-touched tensors."""
    eng = CheckpointEngine(CheckpointConfig(dir=str(root), keep_last=1))
    blank = touched_like(sd)
    if drop:
        drop_caches([root])
    t0 = time.perf_counter()
    res = eng.load(blank)
    dt = time.perf_counter() - t0
    assert res is not None and torch.equal(blank["model"]["layers.0.weight"], sd["model"]["layers.0.weight"])
    return dt


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
    print(f"state: {nbytes / 1e9:.2f} GB, {args.repeats} repeats, dir {base}")
    sink = Sink()
    eng = CheckpointEngine(
        CheckpointConfig(dir=str(base / "ours"), keep_last=1, io_threads=args.io_threads), sink=sink
    )
    eng.save(-1, sd)  # warm-up: staging buffers allocated, file sizes known
    eng.wait()
    names = ("raw_buffered", "raw_direct", "ours", "dcp")
    w: dict[str, list[float]] = {k: [] for k in (*names, "ours_buffered")}
    r: dict[str, list[float]] = {
        k: [] for k in (*names, "ours_fresh", "ours_restart", "ours_buffered_restart")
    }
    how = ""
    gb = nbytes / 1e9
    noise = bytes(os.urandom(1 << 20)) * (CHUNK >> 20)  # 64 MiB, incompressible
    verify_s: list[float] = []
    for i in range(args.repeats):
        ours_dir = Path(sink.last[E.CkptCommitted.kind]["path"])
        sizes = sorted((p.stat().st_size for p in ours_dir.glob("*.distcp")), reverse=True)
        raws = [base / f"raw_{j}.bin" for j in range(len(sizes))]
        mms = [mmap.mmap(-1, CHUNK) for _ in sizes]
        bufs = [memoryview(m) for m in mms]
        for b in bufs:
            b[:] = noise
        for mode, direct in (("raw_buffered", False), ("raw_direct", True)):
            w[mode].append(raw_write(raws, sizes, bufs, direct))
            how = drop_caches(raws)
            r[mode].append(raw_read(raws, bufs, direct))
            for p in raws:
                p.unlink()

        eng.save(i, sd)
        eng.wait()
        w["ours"].append(sink.last[E.CkptCommitted.kind]["persist_s"])
        ours_dir = Path(sink.last[E.CkptCommitted.kind]["path"])
        blank = touched_like(sd)
        drop_caches([ours_dir])
        t0 = time.perf_counter()
        res = eng.load(blank)
        r["ours"].append(time.perf_counter() - t0)
        verify_s.append(sink.last[E.CkptVerified.kind]["verify_s"])
        assert res is not None and torch.equal(
            blank["model"]["layers.0.weight"], sd["model"]["layers.0.weight"]
        )

        # A restart: a fresh engine (no staging buffers yet), cold cache.
        r["ours_fresh"].append(timed_load(base / "ours", sd, drop=True))
        # A restart right after the save, no cache drop: O_DIRECT writes left nothing cached.
        r["ours_restart"].append(timed_load(base / "ours", sd, drop=False))
        # The same with buffered writes (direct_io=False): the newest checkpoint is in the page cache.
        bsink = Sink()
        beng = CheckpointEngine(
            CheckpointConfig(
                dir=str(base / "ours_buf"), keep_last=1, io_threads=args.io_threads, direct_io=False
            ),
            sink=bsink,
        )
        beng.save(i, sd)
        beng.wait()
        beng.close()
        w["ours_buffered"].append(bsink.last[E.CkptCommitted.kind]["persist_s"])
        del beng
        r["ours_buffered_restart"].append(timed_load(base / "ours_buf", sd, drop=False))
        shutil.rmtree(base / "ours_buf")

        ddir = base / f"dcp_{i}"
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ddir)), no_dist=True)
        w["dcp"].append(time.perf_counter() - t0)
        blank = touched_like(sd)
        drop_caches([ddir])
        t0 = time.perf_counter()
        dcp.load(blank, storage_reader=dcp.FileSystemReader(str(ddir)), no_dist=True)
        r["dcp"].append(time.perf_counter() - t0)
        shutil.rmtree(ddir)
        del blank
        print(
            f"repeat {i}: write GB/s "
            + " ".join(f"{k}={gb / w[k][-1]:.3f}" for k in names)
            + "; read GB/s "
            + " ".join(f"{k}={gb / r[k][-1]:.3f}" for k in names)
            + f"; ours read+verify {verify_s[-1]:.2f}s of {r['ours'][-1]:.2f}s"
            + "; restart restores GB/s "
            + " ".join(
                f"{k}={gb / r[k][-1]:.3f}" for k in ("ours_fresh", "ours_restart", "ours_buffered_restart")
            )
            + f"; buffered persist {gb / w['ours_buffered'][-1]:.3f}",
            flush=True,
        )
    eng.close()

    wm = {k: gb / median(v) for k, v in w.items()}
    rm = {k: gb / median(v) for k, v in r.items()}
    wm["raw"] = max(wm["raw_buffered"], wm["raw_direct"])
    rm["raw"] = max(rm["raw_buffered"], rm["raw_direct"])
    rows = [
        ["persist/write", wm["raw"], wm["ours"], wm["dcp"], wm["ours"] / wm["raw"], wm["ours"] / wm["dcp"]],
        ["restore/read", rm["raw"], rm["ours"], rm["dcp"], rm["ours"] / rm["raw"], rm["ours"] / rm["dcp"]],
    ]
    print(
        f"raw modes, GB/s: write buffered {wm['raw_buffered']:.3f} direct {wm['raw_direct']:.3f}; "
        f"read buffered {rm['raw_buffered']:.3f} direct {rm['raw_direct']:.3f}"
    )
    print(
        "restart-style restores (fresh engine), GB/s: cold "
        f"{rm['ours_fresh']:.3f}; right after an O_DIRECT save {rm['ours_restart']:.3f}; right after a "
        f"buffered save {rm['ours_buffered_restart']:.3f} (buffered persist {wm['ours_buffered']:.3f})"
    )
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
            "ours_verify_s": verify_s,
            "raw_files": len(sizes),
            "write_gbps_median": wm,
            "read_gbps_median": rm,
        },
    )
    print(f"wrote {out}")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
