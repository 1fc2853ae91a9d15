"""S3 tier throughput on loopback: gpufleet's S3Store against plain boto3 defaults, side by side.

Starts its own SeaweedFS (or uses GPUFLEET_TEST_S3_* if set), then for a file of --size-mib MiB
measures upload_dir and download_dir (median of --repeats) for:

- ``S3Store``: our config (16 MiB parts, 8 parallel parts, the retry wrapper);
- ``boto3 default``: ``client.upload_file`` / ``download_file`` with boto3's default TransferConfig
  (8 MiB parts, 10 threads): the baseline.

Prints a table with the ratio and writes benchmarks/results/s3.json.

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the SeaweedFS service

from gpufleet.checkpoint.s3 import S3Store  # noqa: E402
from support.seaweed import SeaweedServer  # noqa: E402

MiB = 1024 * 1024


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "s3.json"))
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        tmpd = Path(tmp)
        server = None
        if os.environ.get("GPUFLEET_TEST_S3_ENDPOINT"):
            endpoint = os.environ["GPUFLEET_TEST_S3_ENDPOINT"]
            access, secret = (
                os.environ["GPUFLEET_TEST_S3_ACCESS_KEY"],
                os.environ["GPUFLEET_TEST_S3_SECRET_KEY"],
            )
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
        try:
            src = tmpd / "src"
            src.mkdir()
            with open(src / "shard.bin", "wb") as f:
                for _ in range(args.size_mib):
                    f.write(os.urandom(MiB))
            (src / "manifest.json").write_text("{}")
            size = (src / "shard.bin").stat().st_size + 2

            store = S3Store(f"s3://{bucket}/bench-{os.getpid()}")
            import boto3
            from botocore.config import Config

            client = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
            base_key = f"bench-{os.getpid()}/baseline"

            results: dict[str, dict[str, list[float]]] = {"S3Store": {"up": [], "down": []}}
            results["boto3 default"] = {"up": [], "down": []}
            for i in range(args.repeats):
                dst = tmpd / f"dst{i}"
                results["S3Store"]["up"].append(timed(lambda: store.upload_dir(src, "ckpt")))
                results["S3Store"]["down"].append(timed(lambda d=dst: store.download_dir("ckpt", d)))
                store.delete_prefix("ckpt")

                def up() -> None:
                    client.upload_file(str(src / "shard.bin"), bucket, f"{base_key}/shard.bin")
                    client.upload_file(str(src / "manifest.json"), bucket, f"{base_key}/manifest.json")

                def down(d: Path = tmpd / f"base{i}") -> None:
                    d.mkdir()
                    client.download_file(bucket, f"{base_key}/shard.bin", str(d / "shard.bin"))
                    client.download_file(bucket, f"{base_key}/manifest.json", str(d / "manifest.json"))

                results["boto3 default"]["up"].append(timed(up))
                results["boto3 default"]["down"].append(timed(down))
                for d in (dst, tmpd / f"base{i}"):
                    for p in d.rglob("*"):
                        if p.is_file():
                            p.unlink()
        finally:
            if server is not None:
                server.stop()

    mibs = {name: {k: size / MiB / statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    load = f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    print(f"\nS3 on loopback, {args.size_mib} MiB file, median of {args.repeats} (MiB/s); {load}")
    print(f"{'client':<16}{'upload':>10}{'download':>10}")
    for name, m in mibs.items():
        print(f"{name:<16}{m['up']:>10.0f}{m['down']:>10.0f}")
    ours, base = mibs["S3Store"], mibs["boto3 default"]
    print(f"{'ratio':<16}{ours['up'] / base['up']:>9.2f}x{ours['down'] / base['down']:>9.2f}x")
    out = {
        "benchmark": "s3_loopback",
        "size_mib": args.size_mib,
        "repeats": args.repeats,
        "server": "SeaweedFS (weed server -s3) on 127.0.0.1",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        # other work on the host skews these figures: record the 1-minute load around the run
        "loadavg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "seconds": results,
        "mib_per_s": mibs,
        "ratio_vs_boto3_default": {"up": ours["up"] / base["up"], "down": ours["down"] / base["down"]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
