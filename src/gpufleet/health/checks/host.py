"""Host checks: CPU count, memory, free disk, required mounts, clock offset."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from gpufleet.core.env import Env
from gpufleet.health.checks import Context, measured, register, result
from gpufleet.health.results import CheckResult, Status


def _mem_total_bytes() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def storage_paths(ctx: Context) -> list[Path]:
    """Storage/free-disk paths: plan ``paths``, else $GPUFLEET_HEALTH_PATHS, else the scratch dir."""
    raw = ctx.param("paths", None)
    if raw is None:
        raw = [p for p in Env.HEALTH_PATHS.get(ctx.env).split(os.pathsep) if p]
    return [Path(p) for p in raw] if raw else [ctx.scratch]


@register("host.resources", component="host", timeout_s=10)
def resources(ctx: Context) -> list[CheckResult]:
    """CPU count, memory and free disk against the profile."""
    out = [
        measured(
            ctx,
            "host.resources",
            "host.cpus",
            float(os.cpu_count() or 0),
            device="cpus",
            hint="the node shows fewer CPUs than expected: check BIOS/SMT settings and cgroups",
        ),
    ]
    mem = _mem_total_bytes()
    if mem is None:
        out.append(result("host.resources", Status.INCOMPLETE, "cannot read /proc/meminfo", device="mem"))
    else:
        out.append(
            measured(
                ctx,
                "host.resources",
                "host.mem",
                mem,
                device="mem",
                hint="memory is missing: check DIMMs (dmidecode, EDAC counters)",
            )
        )
    for p in storage_paths(ctx):
        try:
            free = shutil.disk_usage(p).free
        except OSError as e:
            out.append(
                result(
                    "host.resources",
                    Status.FAIL,
                    f"{p}: {e.strerror}",
                    device=f"disk:{p}",
                    hint="the configured path is missing or unreadable",
                )
            )
            continue
        out.append(
            measured(
                ctx,
                "host.resources",
                "host.free_disk",
                float(free),
                device=f"disk:{p}",
                hint=f"free space on {p}: clean old checkpoints and logs",
            )
        )
    return out


def _mounts() -> set[str]:
    try:
        return {line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if line.strip()}
    except OSError:
        return set()


@register("host.mounts", component="storage", timeout_s=10)
def mounts(ctx: Context) -> list[CheckResult]:
    """Required mount points are mounted (plan param ``mounts``)."""
    required = [str(m) for m in ctx.param("mounts", [])]
    if not required:
        return [result("host.mounts", Status.OK, "no mounts required by the plan", value=0, unit="count")]
    have = _mounts()
    missing = [m for m in required if m not in have and not os.path.ismount(m)]
    if missing:
        return [
            result(
                "host.mounts",
                Status.FAIL,
                f"not mounted: {', '.join(missing)}",
                value=len(missing),
                unit="count",
                threshold=0,
                hint="remount the shared filesystems (mount -a) or reboot",
            )
        ]
    return [result("host.mounts", Status.OK, f"{len(required)} mounted", value=0, unit="count", threshold=0)]


_CHRONY = re.compile(r"System time\s*:\s*([0-9.eE+-]+)\s+seconds\s+(fast|slow)", re.I)
_OFFSET = re.compile(r"offset[\s:=]+([+-]?[0-9.eE+-]+)\s*(ms|us|s)?", re.I)


def parse_clock_offset(text: str) -> float | None:
    """Clock offset in seconds from ``chronyc tracking`` or an ``offset ...`` line (ntpq/ntpstat-like)."""
    m = _CHRONY.search(text)
    if m:
        return abs(float(m.group(1)))
    m = _OFFSET.search(text)
    if m:
        scale = {"ms": 1e-3, "us": 1e-6, "s": 1.0}[(m.group(2) or "ms").lower()]
        return abs(float(m.group(1))) * scale
    return None


@register("host.clock", component="host", timeout_s=10)
def clock(ctx: Context) -> list[CheckResult]:
    """Clock offset from a reference (params ``clock_file`` or ``clock_command``, default chronyc)."""
    f = ctx.param("clock_file", Env.CLOCK_FILE.get(ctx.env))
    if f:
        try:
            text = Path(f).read_text()
        except OSError as e:
            return [result("host.clock", Status.INCOMPLETE, f"cannot read {f}: {e.strerror}")]
    else:
        cmd = shlex.split(str(ctx.param("clock_command", "chronyc -n tracking")))
        if shutil.which(cmd[0]) is None:
            return [
                result(
                    "host.clock",
                    Status.INCOMPLETE,
                    f"no clock reference: {cmd[0]} not found",
                    hint="install chrony, or set clock_command / clock_file in the plan",
                )
            ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(10.0, ctx.remaining()))
        except subprocess.TimeoutExpired:
            return [result("host.clock", Status.INCOMPLETE, f"{cmd[0]} timed out")]
        if p.returncode != 0:
            return [
                result(
                    "host.clock",
                    Status.INCOMPLETE,
                    f"{cmd[0]} exited {p.returncode}: {(p.stderr or p.stdout).strip()[:120]}",
                )
            ]
        text = p.stdout
    off = parse_clock_offset(text)
    if off is None:
        return [result("host.clock", Status.INCOMPLETE, "no offset found in the clock reference output")]
    return [
        measured(
            ctx,
            "host.clock",
            "host.clock_offset",
            off,
            hint="clock drift breaks timeouts and logs: check chronyd/ntpd and its servers",
        )
    ]
