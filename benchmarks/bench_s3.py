"""S3 tier throughput on loopback: gpufleet against plain boto3 and DCP's own fsspec/S3 storage.

Starts its own SeaweedFS (or uses GPUFLEET_TEST_S3_* if set) and a model state dict of about
--size-mib MiB (an MLP with Adam state, as the other checkpoint benchmarks use). Each repeat runs
every variant once, in a rotating order, so other load on the host hits them all alike:

state dict <-> S3 (what a user sees):
- ``gpufleet``: ``CheckpointEngine.save`` + ``wait`` with ``upload_url`` (write the checkpoint
  locally, commit, upload: durable in S3), and ``load`` by a fresh engine with an empty local
  directory (list S3, download, verify every file against the manifest, load);
- ``DCP fsspec``: ``dcp.save`` / ``dcp.load`` with DCP's ``FsspecWriter`` / ``FsspecReader`` on
  s3fs, defaults (storage_options only carry the endpoint and keys).

files <-> S3 (the files of the checkpoint gpufleet wrote):
- ``S3Store``: ``upload_dir`` / ``download_dir`` (parallel ranged GETs into preallocated files);
- ``boto3 default``: ``upload_file`` / ``download_file`` per file, boto3's default TransferConfig.

Prints medians of --repeats (seconds and MiB/s), the ratios the goals are about and the load
average, and writes benchmarks/results/s3.json.

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the SeaweedFS service
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from common import blank_like, make_state, median, print_table, state_bytes, write_json  # noqa: E402
from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine  # noqa: E402
from gpufleet.checkpoint.storage.s3 import S3Store  # noqa: E402
from support.seaweed import SeaweedServer  # noqa: E402

MiB = 1024 * 1024
UP, DOWN = "up", "down"
MEASURES = ("s", "cpu_s", "server_cpu_s")  # wall, this process's CPU, the S3 server's CPU
WILLIAMS = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))  # balanced 4x4 Latin square


class Meter:
    """Wall seconds, this process's CPU seconds and (when known) the S3 server's CPU seconds."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.last: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def server_cpu(self) -> float:
        if self.server_pid is None:
            return float("nan")
        fields = Path(f"/proc/{self.server_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @contextmanager
    def __call__(self) -> Iterator[None]:
        w0, c0, s0 = time.perf_counter(), time.process_time(), self.server_cpu()
        yield
        self.last = (time.perf_counter() - w0, time.process_time() - c0, self.server_cpu() - s0)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def files_of(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


class Bench:
    """The four variants, each a pair of (upload, download) steps on repeat ``i``. Each step meters
    the transfer alone (setup, clean-up and the correctness check are outside ``self.meter``)."""

    def __init__(
        self,
        tmp: Path,
        endpoint: str,
        bucket: str,
        access: str,
        secret: str,
        sd: Any,
        meter: Meter,
        fresh_engine: bool = False,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.tmp, self.bucket, self.sd, self.meter = tmp, bucket, sd, meter
        self.base = f"bench-{os.getpid()}"
        self.url = f"s3://{bucket}/{self.base}"
        self.store = S3Store(f"{self.url}/files")
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"})
        )
        self.fsspec_options = {"key": access, "secret": secret, "client_kwargs": {"endpoint_url": endpoint}}
        self.ckpt_dir: Path | None = None  # a checkpoint the engine wrote: the files variants move it
        self.fresh_engine = fresh_engine
        self.engine: CheckpointEngine | None = None
        self.t0 = 0.0
        self.upload_s: list[float] = []  # the engine's upload time after its commit (CKPT_UPLOADED)
        self.commit_s: list[float] = []  # engine.save to the local commit (shards already streaming)
        self.blocked_s: list[float] = []  # engine.save + wait_staged: the training's stall

    # --------------------------------------------------------------------- gpufleet engine
    def _engine(self, i: int) -> CheckpointEngine:
        """The engine a save goes through: one for the whole benchmark, as a training run keeps one
        engine for every checkpoint (its staging buffers, threads and S3 client are made once, in
        the warm-up round, like DCP fsspec's cached s3fs filesystem); with --fresh-engine, a new one
        per save (what the first checkpoint of a run costs)."""
        bench = self

        class Sink:
            def emit(self, event: Any, /, **fields: Any) -> None:
                if getattr(event, "kind", "") == "ckpt_committed":  # the local copy is durable
                    bench.commit_s.append(time.perf_counter() - bench.t0)
                if getattr(event, "kind", "") == "ckpt_uploaded":
                    bench.upload_s.append(event.upload_s)
                if getattr(event, "kind", "") == "ckpt_failed":
                    raise SystemExit(f"gpufleet checkpoint failed: {event.reason}")

        if self.engine is not None and not self.fresh_engine:
            return self.engine
        root = self.tmp / "engine-up"
        shutil.rmtree(root, ignore_errors=True)
        url = f"{self.url}/engine-{i}" if self.fresh_engine else f"{self.url}/engine"
        # Retention off (keep every save), as no other variant deletes anything in S3 while measured.
        config = CheckpointConfig(dir=str(root), upload_url=url, keep_last=1_000_000)
        self.engine = CheckpointEngine(config, sink=Sink())
        return self.engine

    def engine_up(self, i: int) -> None:
        eng = self._engine(i)
        step = i + 2  # the warm-up is i = -1: steps 1, 2, 3, ... (the engine's steps must increase)
        self.t0 = time.perf_counter()
        with self.meter():
            eng.save(step, self.sd)
            eng.wait_staged()
            self.blocked_s.append(time.perf_counter() - self.t0)  # what the training loop waits for
            eng.wait()
        if self.fresh_engine:
            eng.close()
            self.engine = None
        if self.ckpt_dir is None:  # keep the first one (the same bytes every time) for the files variants
            self.ckpt_dir = self.tmp / "files"
            shutil.copytree(self.tmp / "engine-up" / f"step_{step:08d}", self.ckpt_dir)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def engine_down(self, i: int) -> None:
        root = self.tmp / "engine-down"
        shutil.rmtree(root, ignore_errors=True)
        url = f"{self.url}/engine-{i}" if self.fresh_engine else f"{self.url}/engine"
        eng = CheckpointEngine(CheckpointConfig(dir=str(root), upload_url=url))  # a new run's engine
        target = blank_like(self.sd)
        with self.meter():
            got = eng.load(target)
        eng.close()
        if got is None or got.source != "s3" or got.step != i + 2 or not same(target, self.sd):
            raise SystemExit(f"gpufleet restore from S3 went wrong: {got}")

    # --------------------------------------------------------------------- DCP fsspec
    def dcp_up(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(f"{self.url}/dcp-{i}", **self.fsspec_options)
        with self.meter():
            dcp.save(self.sd, storage_writer=writer, no_dist=True)

    def dcp_down(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        target = blank_like(self.sd)
        with self.meter():
            reader = FsspecReader(f"{self.url}/dcp-{i}", **self.fsspec_options)
            dcp.load(target, storage_reader=reader, no_dist=True)
        if not same(target, self.sd):
            raise SystemExit("DCP fsspec restore went wrong")

    # --------------------------------------------------------------------- files
    def store_up(self, i: int) -> None:
        assert self.ckpt_dir is not None
        with self.meter():
            self.store.upload_dir(self.ckpt_dir, f"s-{i}")

    def store_down(self, i: int) -> None:
        dst = self.tmp / "store-down"
        shutil.rmtree(dst, ignore_errors=True)
        with self.meter():
            self.store.download_dir(f"s-{i}", dst)
        self.check_files(dst)

    def boto_up(self, i: int) -> None:
        src = self.ckpt_dir
        assert src is not None
        with self.meter():
            for p in files_of(src):
                rel = p.relative_to(src).as_posix()
                self.client.upload_file(str(p), self.bucket, f"{self.base}/boto-{i}/{rel}")

    def boto_down(self, i: int) -> None:
        assert self.ckpt_dir is not None
        dst = self.tmp / "boto-down"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        with self.meter():
            for p in files_of(self.ckpt_dir):
                rel = p.relative_to(self.ckpt_dir).as_posix()
                self.client.download_file(self.bucket, f"{self.base}/boto-{i}/{rel}", str(dst / rel))
        self.check_files(dst)

    def check_files(self, dst: Path) -> None:
        assert self.ckpt_dir is not None
        for p in files_of(self.ckpt_dir):
            if (dst / p.relative_to(self.ckpt_dir)).read_bytes() != p.read_bytes():
                raise SystemExit(f"downloaded {p.name} differs")
        shutil.rmtree(dst)

    def cleanup(self) -> None:
        for key, _, _ in self.store.list_objects(self.base + "/"):
            self.client.delete_object(Bucket=self.bucket, Key=key)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="state dict size, MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=8, help="a multiple of 4 keeps the order balanced")
    ap.add_argument("--out", default="s3.json", help="file name under benchmarks/results/")
    ap.add_argument(
        "--fresh-engine",
        action="store_true",
        help="a new gpufleet engine for every save (a run's first checkpoint); default: one engine "
        "for every save, as a training run has",
    )
    args = ap.parse_args()
    if args.size_mib < 1 or args.repeats < 1:
        print("bench_s3: --size-mib and --repeats must be >= 1", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

    sd = make_state(args.size_mib * MiB / 1e9, hidden=1024)
    size = state_bytes(sd)
    loads: list[float] = [os.getloadavg()[0]]
    variants = ("gpufleet", "DCP fsspec", "S3Store", "boto3 default")
    # variant -> direction -> measure ("s", "cpu_s", "server_cpu_s") -> one value per repeat
    runs: dict[str, dict[str, dict[str, list[float]]]] = {
        v: {d: {m: [] for m in MEASURES} for d in (UP, DOWN)} for v in variants
    }
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        tmpd = Path(tmp)
        server = None
        if os.environ.get("GPUFLEET_TEST_S3_ENDPOINT"):
            endpoint = os.environ["GPUFLEET_TEST_S3_ENDPOINT"]
            access = os.environ["GPUFLEET_TEST_S3_ACCESS_KEY"]
            secret = os.environ["GPUFLEET_TEST_S3_SECRET_KEY"]
            bucket = os.environ.get("GPUFLEET_TEST_S3_BUCKET", "gpufleet-test")
        else:
            server = SeaweedServer(tmpd / "weed").start()
            endpoint, access, secret, bucket = (
                server.endpoint,
                server.access_key,
                server.secret_key,
                server.bucket,
            )
        os.environ.update(
            AWS_ACCESS_KEY_ID=access,
            AWS_SECRET_ACCESS_KEY=secret,
            AWS_ENDPOINT_URL=endpoint,
            AWS_DEFAULT_REGION="us-east-1",
        )
        meter = Meter(server.pid if server is not None else None)
        b = Bench(tmpd, endpoint, bucket, access, secret, sd, meter, args.fresh_engine)
        steps: dict[str, tuple[Callable[[int], None], Callable[[int], None]]] = {
            "gpufleet": (b.engine_up, b.engine_down),
            "DCP fsspec": (b.dcp_up, b.dcp_down),
            "S3Store": (b.store_up, b.store_down),
            "boto3 default": (b.boto_up, b.boto_down),
        }

        def run(name: str, direction: str, i: int) -> None:
            steps[name][direction == DOWN](i)
            for m, value in zip(MEASURES, meter.last, strict=True):
                runs[name][direction][m].append(value)

        try:
            for name in variants:  # warm-up, not recorded: imports, first connections, the files
                steps[name][0](-1)
                steps[name][1](-1)
            b.upload_s.clear()
            b.blocked_s.clear()
            b.commit_s.clear()
            for i in range(args.repeats):
                # Every upload of the repeat, then every restore, each in the order of row i of a
                # balanced Latin square: over 4 repeats each variant runs once in each position and
                # right after each other variant once (what ran just before skews a run on this host).
                order = [variants[k] for k in WILLIAMS[i % len(WILLIAMS)]]
                for name in order:
                    run(name, UP, i)
                for name in order:
                    run(name, DOWN, i)
                loads.append(os.getloadavg()[0])
                print(f"repeat {i + 1}/{args.repeats} done, load {loads[-1]:.1f}", flush=True)
            b.close()
            b.cleanup()
        finally:
            if server is not None:
                server.stop()

    secs = {v: {d: runs[v][d]["s"] for d in (UP, DOWN)} for v in variants}
    med = {v: {d: median(secs[v][d]) for d in (UP, DOWN)} for v in variants}
    cpu = {v: {d: {m: median(runs[v][d][m]) for m in MEASURES[1:]} for d in (UP, DOWN)} for v in variants}
    mibs = {v: {d: size / MiB / med[v][d] for d in (UP, DOWN)} for v in variants}
    ratio = {
        "gpufleet_vs_dcp_fsspec": {d: med["DCP fsspec"][d] / med["gpufleet"][d] for d in (UP, DOWN)},
        "s3store_vs_boto3_default": {d: med["boto3 default"][d] / med["S3Store"][d] for d in (UP, DOWN)},
    }
    load = f"load avg (1 min) {min(loads):.1f}..{max(loads):.1f}, median {median(loads):.1f}"
    load += f" on {os.cpu_count()} CPUs"
    rows = [
        [v, med[v][UP], mibs[v][UP], med[v][DOWN], mibs[v][DOWN]]
        + [cpu[v][d][m] for d in (UP, DOWN) for m in MEASURES[1:]]
        for v in variants
    ]
    print_table(
        f"S3 on loopback (SeaweedFS), {size / MiB:.0f} MiB state, median of {args.repeats}; {load}",
        ["variant", "upload s", "MiB/s", "restore s", "MiB/s"]
        + ["up cpu s", "up server cpu s", "restore cpu s", "restore server cpu s"],
        rows,
    )
    g, s = ratio["gpufleet_vs_dcp_fsspec"], ratio["s3store_vs_boto3_default"]
    print(f"\ngpufleet vs DCP fsspec:  upload {g[UP]:.2f}x  restore {g[DOWN]:.2f}x  (goal >= 1.5x)")
    print(f"S3Store vs boto3 default: upload {s[UP]:.2f}x  restore {s[DOWN]:.2f}x  (goal: restore >= 1.0x)")
    blocked = median(b.blocked_s)
    print(
        f"gpufleet save: training blocked {blocked:.2f} s (DCP fsspec save blocks "
        f"{med['DCP fsspec'][UP]:.2f} s: {med['DCP fsspec'][UP] / blocked:.0f}x); local commit at "
        f"{median(b.commit_s):.2f} s (shards streaming to S3 meanwhile), then {median(b.upload_s):.2f} s "
        "more until the manifest is in S3"
    )
    out = write_json(
        args.out,
        {
            "benchmark": "s3_loopback",
            "server": "SeaweedFS (weed server -s3) on 127.0.0.1",
            "size_mib": round(size / MiB, 1),
            "repeats": args.repeats,
            "engine": "fresh per save" if args.fresh_engine else "one engine for every save",
            # other work on the host skews these figures: the 1-minute load before and after each repeat
            "loadavg_1m": loads,
            "runs": runs,
            "median_s": med,
            "median_cpu_s": cpu,
            "mib_per_s": mibs,
            "ratio": ratio,
            "engine_upload_s": b.upload_s,
            "engine_commit_s": b.commit_s,
            "engine_blocked_s": b.blocked_s,
            "versions": _versions(),
        },
    )
    print(f"wrote {out}")
    return 0


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("boto3", "botocore", "s3fs", "fsspec", "aiobotocore", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
