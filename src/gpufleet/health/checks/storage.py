"""Storage: sequential write/read throughput and fsync latency per path, and a checkpoint-shaped write.

Files go to a private directory under each configured path (plan ``paths``, $GPUFLEET_HEALTH_PATHS, or
the scratch directory) and are removed afterwards. Reads come after ``posix_fadvise(DONTNEED)`` so they
hit the device rather than the page cache where the kernel honours it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpufleet.health.checks import Context, measured, register, result
from gpufleet.health.checks.host import storage_paths
from gpufleet.health.results import CheckResult, Status

BLOCK = 4 * 2**20
HINT = "slow storage: check the filesystem's health and load, network links to it, and its free space"


def _write(path: Path, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        n = 0
        while chunk := os.read(fd, BLOCK):
            n += len(chunk)
        return n
    finally:
        os.close(fd)


def _fsync_latencies(path: Path, samples: int) -> list[float]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    out = []
    try:
        for _ in range(samples):
            os.write(fd, b"x" * 4096)
            t0 = time.perf_counter()
            os.fsync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return out


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


@register("storage.throughput", component="storage", timeout_s=120)
def throughput(ctx: Context) -> list[CheckResult]:
    """Sequential write (with fsync) and read throughput, and p99 fsync latency, on each path."""
    nbytes = int(float(ctx.param("mb", 64)) * 2**20)
    samples = int(ctx.param("fsync_samples", 20))
    block = os.urandom(BLOCK)
    out: list[CheckResult] = []
    for root in storage_paths(ctx):
        dev = str(root)
        try:
            work = Path(tempfile.mkdtemp(prefix=".gpufleet-health-", dir=root))
        except OSError as e:
            out.append(
                result(
                    "storage.throughput",
                    Status.FAIL,
                    f"cannot write to {root}: {e.strerror}",
                    device=dev,
                    hint="the path is missing, read-only or full",
                )
            )
            continue
        try:
            f = work / "seq.bin"
            t0 = time.perf_counter()
            _write(f, nbytes, block)
            wr = nbytes / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = _read(f)
            rd = got / (time.perf_counter() - t0)
            lat = _fsync_latencies(work / "fsync.bin", samples)
        except OSError as e:
            out.append(result("storage.throughput", Status.FAIL, f"{root}: {e}", device=dev, hint=HINT))
            continue
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out.append(measured(ctx, "storage.throughput", "storage.write", wr, hint=HINT, device=f"{dev}:write"))
        out.append(measured(ctx, "storage.throughput", "storage.read", rd, hint=HINT, device=f"{dev}:read"))
        out.append(
            measured(
                ctx,
                "storage.throughput",
                "storage.fsync_p99",
                _p99(lat),
                hint=HINT,
                device=f"{dev}:fsync_p99",
            )
        )
    return out


@register("storage.checkpoint", component="storage", timeout_s=300)
def checkpoint(ctx: Context) -> list[CheckResult]:
    """Checkpoint-shaped write: many large files written in parallel, each fsynced; aggregate MB/s."""
    files = int(ctx.param("files", 8))
    nbytes = int(float(ctx.param("file_mb", 32)) * 2**20)
    block = os.urandom(BLOCK)
    out: list[CheckResult] = []
    for root in storage_paths(ctx):
        try:
            work = Path(tempfile.mkdtemp(prefix=".gpufleet-ckpt-", dir=root))
        except OSError as e:
            out.append(
                result(
                    "storage.checkpoint",
                    Status.FAIL,
                    f"cannot write to {root}: {e.strerror}",
                    device=str(root),
                    hint="the path is missing, read-only or full",
                )
            )
            continue
        try:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=files) as pool:
                shards = [work / f"shard{k}.bin" for k in range(files)]
                list(pool.map(_write, shards, [nbytes] * files, [block] * files))
            dirfd = os.open(work, os.O_RDONLY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)
            rate = files * nbytes / (time.perf_counter() - t0)
        except OSError as e:
            out.append(result("storage.checkpoint", Status.FAIL, f"{root}: {e}", device=str(root), hint=HINT))
            continue
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out.append(
            measured(
                ctx,
                "storage.checkpoint",
                "storage.checkpoint",
                rate,
                hint=HINT,
                device=str(root),
                detail=f"{files} x {nbytes / 2**20:.0f} MiB in parallel, fsynced",
            )
        )
    return out


# ------------------------------------------------------------------------------------ NVMe SMART
def _smart_int(data: dict[str, object], *keys: str) -> int | None:
    for k in keys:
        v = data.get(k)
        if isinstance(v, dict):  # nvme-cli 2.x writes some fields as {"value": n, ...}
            v = v.get("value")
        if isinstance(v, int | float) and not isinstance(v, bool):
            return int(v)
    return None


def parse_smart_log(text: str) -> dict[str, int | None]:
    """The health fields of ``nvme smart-log -o json``. Raises ValueError on other text."""
    import json

    data = json.loads(text)
    if not isinstance(data, dict) or "critical_warning" not in data:
        raise ValueError("no critical_warning in nvme smart-log output")
    return {
        "critical_warning": _smart_int(data, "critical_warning"),
        "percent_used": _smart_int(data, "percent_used", "percentage_used"),
        "media_errors": _smart_int(data, "media_errors"),
        "available_spare": _smart_int(data, "avail_spare", "available_spare"),
        "spare_threshold": _smart_int(data, "spare_thresh", "available_spare_threshold"),
    }


# critical_warning bits (NVMe base specification, SMART / Health Information log)
_CRITICAL = {
    0x1: "available spare below threshold",
    0x2: "temperature out of range",
    0x4: "reliability degraded (media or internal errors)",
    0x8: "media in read-only mode",
    0x10: "volatile memory backup failed",
    0x20: "persistent memory region read-only",
}


@register("storage.nvme", component="storage", timeout_s=30)
def nvme(ctx: Context) -> list[CheckResult]:
    """Per NVMe controller: SMART critical warning, wear (percent used), media errors, spare vs threshold
    (``nvme smart-log -o json``)."""
    import subprocess

    from gpufleet.health.checks.links import judge, sysfs_root

    root = sysfs_root(ctx)
    ctrls = ctx.param("nvme_devices", None) or [
        f"/dev/{p.name}" for p in sorted((root / "class" / "nvme").glob("nvme*"))
    ]
    if not ctrls:
        from gpufleet.health.checks import NotApplicable

        raise NotApplicable(f"no NVMe controllers under {root}/class/nvme")
    exe = shutil.which(str(ctx.param("nvme", "nvme")), path=ctx.env.get("PATH"))
    if exe is None:
        return [
            result(
                "storage.nvme",
                Status.INCOMPLETE,
                f"{len(ctrls)} NVMe controller(s) but the nvme command is not installed",
                hint="install nvme-cli (apt install nvme-cli) to read SMART health",
            )
        ]
    out = []
    for dev in ctrls:
        try:
            p = subprocess.run(
                [exe, "smart-log", dev, "-o", "json"],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=min(15.0, ctx.remaining()),
                env=ctx.env,
            )
            smart = parse_smart_log(p.stdout)
        except subprocess.TimeoutExpired:
            out.append(result("storage.nvme", Status.INCOMPLETE, "nvme smart-log timed out", device=dev))
            continue
        except ValueError:
            err = (p.stderr or p.stdout).strip().splitlines()
            out.append(
                result(
                    "storage.nvme",
                    Status.INCOMPLETE,
                    f"nvme smart-log exit {p.returncode}: {err[-1][:100] if err else 'no output'}",
                    device=dev,
                    hint="run as root (reading SMART needs CAP_SYS_ADMIN)",
                )
            )
            continue
        problems: list[tuple[Status, str]] = []
        cw = smart["critical_warning"] or 0
        for bit, what in _CRITICAL.items():
            if cw & bit:
                problems.append((Status.FAIL, f"critical warning: {what}"))
        if smart["percent_used"] is not None:
            judge(ctx, "storage.nvme_percent_used", smart["percent_used"], "wear", problems)
        if smart["media_errors"] is not None:
            judge(ctx, "storage.nvme_media_errors", smart["media_errors"], "media errors", problems)
        spare, thresh = smart["available_spare"], smart["spare_threshold"]
        if spare is not None and thresh is not None and spare <= thresh and not cw & 0x1:
            problems.append((Status.FAIL, f"available spare {spare}% at or below its threshold {thresh}%"))
        st = max((x[0] for x in problems), key=[Status.OK, Status.WARN, Status.FAIL].index, default=Status.OK)
        out.append(
            result(
                "storage.nvme",
                st,
                "; ".join(x[1] for x in problems)
                if problems
                else f"{smart['percent_used']}% used, {smart['media_errors']} media errors, spare {spare}%",
                value=smart["percent_used"],
                unit="%",
                device=dev,
                hint="back up and replace the drive; move checkpoints and caches off it"
                if st is not Status.OK
                else "",
                data=smart,
            )
        )
    return out
