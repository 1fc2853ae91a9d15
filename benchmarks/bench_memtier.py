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

``--nodes 2``: the same state in a 2-rank gloo job whose ranks sit on two simulated nodes (one rank
each, ``GROUP_RANK`` set, one keeper directory per node on /dev/shm), the peer-replicated tier
(checkpoint/storage/peer.py). Each trial is a fresh 2-process job timing ``load`` on every rank (the slower
rank is the job's load phase), sources interleaved in rotating order:

- ``memory``: every node holds both parts (its own + its peer's replica): no transfer;
- ``peer_memory``: node 0's keeper is gone (a lost node): node 0 receives both parts from node 1
  over the leaders' gloo group (loopback TCP here), hashing on receipt; node 1 links its own;
- ``disk_cold`` / ``disk_warm``: no keeper on either node, as above.

Run: ``flock /tmp/gpufleet_heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_memtier.py [--nodes 2]``.
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
PEER_MODES = ("memory", "peer_memory", "disk_cold", "disk_warm")


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


def peer_child(work: Path, mode: str, mb: float) -> None:
    """One rank of the 2-node job: ``save`` once, or time one load (``mode``)."""
    import torch.distributed as dist

    from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    state = make_state(mb / 1000, hidden=1024)
    from gpufleet.core.ledger import Ledger, read_events

    cfg = CheckpointConfig(dir=str(work / "ck"), memory_bytes=8 << 30)
    sink = Ledger(work / "ledger", session="bench") if mode == "save" else None
    eng = CheckpointEngine(cfg, rank=rank, world_size=2, sink=sink)
    if mode == "save":
        assert eng.save(1, state)
        eng.wait()
        # each leader's own copy + exchange (send its part, receive its peer's), off the training path
        out: dict[str, Any] = {"rank": rank}
        if rank == 0:
            evs = read_events(work / "ledger")
            (kept,) = [e for e in evs if e["ev"] == "ckpt_memory" and e["node"].startswith("node 0")]
            assert kept["kept"] and kept.get("peer"), kept
            out["replicate_s"] = kept["copy_s"]
    else:
        blank = blank_like(state)
        del state
        dist.barrier()
        t0 = time.perf_counter()
        res = eng.load(blank)
        load_s = time.perf_counter() - t0
        assert res is not None
        out = {"rank": rank, "mode": mode, "load_s": load_s, "source": res.source}
    eng.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out))


def _peer_job(work: Path, shm: Path, mode: str, mb: float) -> list[dict[str, Any]]:
    from gpufleet.core.ports import free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
               "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "GPUFLEET_MEMORY_TIER_DIR": str(shm / f"node{rank}")}  # fmt: skip
        cmd = [sys.executable, __file__, "--peer-child", mode, "--work", str(work), "--mb", str(mb)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        so, _ = p.communicate(timeout=600)
        assert p.returncode == 0, (mode, p.returncode)
        outs.append(json.loads(so.strip().splitlines()[-1]))
    return outs


def peer_main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_memtier_peer_", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bench_memtier_peer_", dir="/dev/shm"))
    away = shm / "away"
    away.mkdir()
    try:
        replicate_s = _peer_job(work, shm, "save", args.mb)[0]["replicate_s"]
        nbytes = sum(p.stat().st_size for p in _files(work / "ck") if p.suffix == ".distcp")
        load0 = os.getloadavg()[0]
        trials: dict[str, list[float]] = {m: [] for m in PEER_MODES}
        n = len(PEER_MODES)
        for i in range(args.trials):
            for mode in PEER_MODES[i % n :] + PEER_MODES[: i % n]:
                hide = {"memory": [], "peer_memory": [0]}.get(mode, [0, 1])
                for node in hide:  # a lost node's memory, out of sight for this trial
                    (shm / f"node{node}").rename(away / f"node{node}")
                try:
                    if mode == "disk_cold":
                        _evict(work / "ck")
                    elif mode == "disk_warm":
                        _warm(work / "ck")
                    outs = _peer_job(work, shm, mode, args.mb)
                finally:
                    for node in hide:  # what the trial rebuilt there (an emptied keeper) goes
                        shutil.rmtree(shm / f"node{node}", ignore_errors=True)
                        (away / f"node{node}").rename(shm / f"node{node}")
                want = mode if mode in ("memory", "peer_memory") else "local"
                assert all(o["source"] == want for o in outs), outs
                trials[mode].append(max(o["load_s"] for o in outs))
        load1 = os.getloadavg()[0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    med = _table(
        f"load phase, 2 ranks on 2 nodes, {nbytes / 1e6:.0f} MB checkpoint, slower rank, median of "
        f"{args.trials} (load avg {load0:.1f} -> {load1:.1f})",
        trials,
    )
    path = write_json(
        f"memtier_peer_{args.mb:g}MB.json",
        {
            "bench": "memtier_peer_load",
            "nodes": 2,
            "checkpoint_bytes": nbytes,
            "trials": trials,
            "median_s": med,
            "replicate_s": replicate_s,
            "peer_memory_over_memory": med["peer_memory"] / med["memory"],
            "disk_cold_over_peer_memory": med["disk_cold"] / med["peer_memory"],
            "disk_warm_over_peer_memory": med["disk_warm"] / med["peer_memory"],
            "loadavg_1m": [load0, load1],
        },
    )
    print(f"replication at save (rank 0: own part copied, sent, peer's part received): {replicate_s:.3f} s")
    print(f"wrote {path}")
    return 0


def _table(title: str, trials: dict[str, list[float]]) -> dict[str, float]:
    """Print medians, min, max and the ratio to memory per source; the medians."""
    med = {m: median(v) for m, v in trials.items()}
    rows = [[m, med[m], min(v), max(v), med[m] / med["memory"]] for m, v in trials.items()]
    print_table(title, ["source", "median_s", "min_s", "max_s", "x memory"], rows)
    return med


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
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: the peer tier across 2 nodes")
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer-child", choices=(*PEER_MODES, "save"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.work, args.child, args.mb)
        return 0
    if args.peer_child:
        peer_child(args.work, args.peer_child, args.mb)
        return 0
    if args.nodes == 2:
        return peer_main(args)
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
    med = _table(
        f"load phase, {nbytes / 1e6:.0f} MB state, median of {args.trials} "
        f"(load avg {load0:.1f} -> {load1:.1f})",
        trials,
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
