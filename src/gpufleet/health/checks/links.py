"""Link checks: NVLink (NVML), PCIe link and replays (NVML), InfiniBand and RoCE ports (sysfs).

Error counters count since the driver loaded (NVML) or the port came up (sysfs). With ``window_s > 0``
a check takes a second reading that many seconds later and judges the rate per minute too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpufleet.core.env import Env
from gpufleet.health.checks import Context, register, result
from gpufleet.health.nvml import GpuReading, NvmlUnavailable, read_gpus
from gpufleet.health.results import CheckResult, Status, worst

Problems = list[tuple[Status, str]]


def judge(ctx: Context, metric: str, value: float, what: str, problems: Problems) -> None:
    """Append (status, text) when ``value`` (in the threshold's unit) breaks the profile's ``metric``."""
    th = ctx.profile.threshold(metric)
    if th is None:
        return
    st, limit = th.judge(value)
    if st is not Status.OK:
        problems.append((st, f"{what} {value:g} {th.unit} (limit {limit:g})"))


def readings(
    ctx: Context, default_window: float = 0.0
) -> tuple[list[GpuReading], list[GpuReading] | None, float]:
    """(first, second or None, seconds between them): a second NVML reading when the plan's
    ``window_s`` (else ``default_window``) is > 0."""
    first = read_gpus()
    window = float(ctx.param("window_s", default_window))
    if window <= 0:
        return first, None, 0.0
    t0 = time.monotonic()
    time.sleep(max(0.0, min(window, ctx.remaining() - 2.0)))
    second = read_gpus()
    return first, second, time.monotonic() - t0


def per_gpu(
    check: str, gpus: list[GpuReading], judged: dict[int, Problems], ok_detail: dict[int, str], hint: str
) -> list[CheckResult]:
    out = []
    for g in gpus:
        if g.index not in judged:
            continue
        problems = judged[g.index]
        st = worst([p[0] for p in problems]) if problems else Status.OK
        detail = "; ".join(p[1] for p in problems) if problems else ok_detail.get(g.index, "ok")
        out.append(
            result(
                check,
                st,
                detail,
                value=len(problems),
                unit="problems",
                threshold=0,
                device=f"gpu{g.index}",
                hint=hint if st is not Status.OK else "",
                data={"pci": g.pci},
            )
        )
    return out


def _nvml_or_incomplete(check: str, ctx: Context) -> tuple[tuple[Any, ...] | None, list[CheckResult]]:
    try:
        return readings(ctx), []
    except NvmlUnavailable as e:
        return None, [result(check, Status.INCOMPLETE, str(e), hint="NVML is needed to read this")]


# --------------------------------------------------------------------------------------- NVLink
_NVLINK_KINDS = {"crc": ("crc_flit", "crc_data"), "replay": ("replay",), "recovery": ("recovery",)}


@register("nvlink.state", component="gpu", timeout_s=20, requires_gpu=True)
def nvlink(ctx: Context) -> list[CheckResult]:
    """Per GPU: NVLinks up, their count and speed against the platform's, CRC/replay/recovery errors."""
    got, bad = _nvml_or_incomplete("nvlink.state", ctx)
    if got is None:
        return bad
    first, second, elapsed = got
    later = {g.index: g for g in (second or [])}
    judged: dict[int, Problems] = {}
    ok: dict[int, str] = {}
    for g in first:
        links = g.values.get("nvlink")
        if not links:
            continue
        problems: Problems = []
        down = [str(x["link"]) for x in links if not x["active"]]
        if down:
            problems.append((Status.FAIL, f"NVLink link(s) {', '.join(down)} down"))
        active = sum(1 for x in links if x["active"])
        judge(ctx, "nvlink.links_active", active, "active NVLinks", problems)
        speed = g.values.get("nvlink_speed_mbps")
        if speed is not None:
            th = ctx.profile.threshold("nvlink.link_speed")
            judge(ctx, "nvlink.link_speed", th.scale(speed * 1e6) if th else 0, "NVLink speed", problems)
        for kind, keys in _NVLINK_KINDS.items():
            for x in links:
                n = sum(int(x.get(k, 0)) for k in keys)
                judge(ctx, f"nvlink.{kind}_errors", n, f"link {x['link']} {kind} errors", problems)
            g2 = later.get(g.index)
            if g2 is not None and elapsed > 0:
                links2 = {x["link"]: x for x in g2.values.get("nvlink", [])}
                for x in links:
                    y = links2.get(x["link"])
                    if y is None:
                        continue
                    delta = sum(int(y.get(k, 0)) - int(x.get(k, 0)) for k in keys)
                    judge(
                        ctx,
                        f"nvlink.{kind}_rate",
                        delta * 60.0 / elapsed,
                        f"link {x['link']} {kind}/min",
                        problems,
                    )
        judged[g.index] = problems
        rate = f", rates over {elapsed:.1f} s" if second is not None else ""
        spd = f" at {speed / 1000:.1f} GB/s" if speed is not None else ""
        ok[g.index] = f"{active}/{len(links)} links up{spd}, error counters within limits{rate}"
    out = per_gpu(
        "nvlink.state",
        first,
        judged,
        ok,
        "drain the node; reset the GPU (nvidia-smi -r) and re-check; links that stay down or keep "
        "erroring need the GPU baseboard or NVSwitch tray serviced",
    )
    if not out:
        return [
            result(
                "nvlink.state",
                Status.INCOMPLETE if ctx.profile.threshold("nvlink.links_active") else Status.OK,
                "NVML reports no NVLinks on any GPU",
                hint="a profile that expects NVLink found none: check Fabric Manager and the driver",
            )
        ]
    return out


# ----------------------------------------------------------------------------------------- PCIe
@register("pcie.link", component="gpu", timeout_s=20, requires_gpu=True)
def pcie(ctx: Context) -> list[CheckResult]:
    """Per GPU: PCIe replay counter (count, and rate with two readings), link width and generation
    against the link's maximum."""
    got, bad = _nvml_or_incomplete("pcie.link", ctx)
    if got is None:
        return bad
    first, second, elapsed = got
    later = {g.index: g for g in (second or [])}
    judged: dict[int, Problems] = {}
    ok: dict[int, str] = {}
    for g in first:
        v = g.values
        problems: Problems = []
        seen = False
        if "pcie_replays" in v:
            seen = True
            judge(ctx, "pcie.replays", v["pcie_replays"], "PCIe replays", problems)
            g2 = later.get(g.index)
            if g2 is not None and elapsed > 0 and "pcie_replays" in g2.values:
                rate = (g2.values["pcie_replays"] - v["pcie_replays"]) * 60.0 / elapsed
                judge(ctx, "pcie.replay_rate", rate, "PCIe replays/min", problems)
        if "pcie_width" in v and "pcie_width_max" in v:
            seen = True
            if v["pcie_width"] < v["pcie_width_max"]:
                problems.append((Status.FAIL, f"PCIe link x{v['pcie_width']} of x{v['pcie_width_max']}"))
        if "pcie_gen_curr" in v and "pcie_gen" in v:
            seen = True
            idle = bool(int(v.get("throttle", 0)) & 0x1)  # an idle GPU lowers its link speed to save power
            if v["pcie_gen_curr"] < v["pcie_gen"] and not idle:
                problems.append(
                    (Status.WARN, f"PCIe gen{v['pcie_gen_curr']} of gen{v['pcie_gen']} while busy")
                )
        if not seen:
            continue
        judged[g.index] = problems
        ok[g.index] = (
            f"gen{v.get('pcie_gen_curr', '?')}/{v.get('pcie_gen', '?')} "
            f"x{v.get('pcie_width', '?')}/{v.get('pcie_width_max', '?')}, "
            f"{v.get('pcie_replays', '?')} replays"
        )
    out = per_gpu(
        "pcie.link",
        first,
        judged,
        ok,
        "a narrow or slow link or replays point at the slot, riser or retimer: reseat the GPU, "
        "check the BIOS PCIe settings, then service the board",
    )
    return out or [result("pcie.link", Status.INCOMPLETE, "NVML reads no PCIe link state for any GPU")]


# ------------------------------------------------------------------------ InfiniBand and RoCE
def sysfs_root(ctx: Context) -> Path:
    """The sysfs root: the plan's ``sysfs_root``, else ``$GPUFLEET_SYSFS_ROOT`` (default ``/sys``)."""
    return Path(ctx.param("sysfs_root", Env.SYSFS_ROOT.get(ctx.env)))


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def read_ib_ports(root: Path) -> list[dict[str, Any]]:
    """Every port under ``<root>/class/infiniband/*/ports/*``: state, phys_state, rate (Gb/s),
    link_layer, link_downed and link_error_recovery."""
    out = []
    for port in sorted((root / "class" / "infiniband").glob("*/ports/*")):
        rate_text = _read(port / "rate") or ""
        try:
            rate = float(rate_text.split()[0])
        except (IndexError, ValueError):
            rate = None
        out.append(
            {
                "port": f"{port.parent.parent.name}/{port.name}",
                "state": (_read(port / "state") or "?").split(":")[-1].strip(),
                "phys_state": (_read(port / "phys_state") or "?").split(":")[-1].strip(),
                "rate_gbps": rate,
                "rate_text": rate_text,
                "link_layer": _read(port / "link_layer") or "InfiniBand",
                "link_downed": _int(_read(port / "counters" / "link_downed")),
                "link_error_recovery": _int(_read(port / "counters" / "link_error_recovery")),
            }
        )
    return out


@register("net.ib", component="network", timeout_s=10, requires_gpu=True)
def infiniband(ctx: Context) -> list[CheckResult]:
    """InfiniBand and RoCE ports (sysfs): state, rate against the profile's, link flaps and recoveries."""
    root = sysfs_root(ctx)
    ports = read_ib_ports(root)
    only = ctx.param("ports", None)
    if only:
        ports = [p for p in ports if p["port"] in only or p["port"].split("/")[0] in only]
    expect = int(ctx.param("expect_ports", 0))
    if not ports:
        st = Status.FAIL if expect > 0 else Status.OK
        return [
            result(
                "net.ib",
                st,
                f"no InfiniBand or RoCE ports under {root}/class/infiniband"
                + (f"; expected {expect}" if expect else " (set expect_ports to require them)"),
                value=0,
                unit="ports",
                threshold=expect,
                hint="load the mlx5/ib drivers or check the HCAs" if st is not Status.OK else "",
            )
        ]
    out = []
    for p in ports:
        problems: Problems = []
        if p["state"] != "ACTIVE" or p["phys_state"] != "LinkUp":
            problems.append((Status.FAIL, f"port {p['state']} / {p['phys_state']}"))
        elif p["rate_gbps"] is not None:
            th = ctx.profile.threshold("net.ib_rate")
            judge(ctx, "net.ib_rate", th.scale(p["rate_gbps"] * 1e9) if th else 0, "rate", problems)
        if p["link_downed"] is not None:
            judge(ctx, "net.ib_link_downed", p["link_downed"], "link went down", problems)
        if p["link_error_recovery"] is not None:
            judge(
                ctx, "net.ib_link_error_recovery", p["link_error_recovery"], "link error recoveries", problems
            )
        st = worst([x[0] for x in problems]) if problems else Status.OK
        detail = (
            "; ".join(x[1] for x in problems)
            if problems
            else f"{p['link_layer']} {p['state']}, {p['rate_text'] or 'rate ?'}, {p['link_downed']} flaps"
        )
        out.append(
            result(
                "net.ib",
                st,
                detail,
                value=p["rate_gbps"],
                unit="Gb/s",
                device=p["port"],
                hint=(
                    "check the cable, transceiver and switch port (ibstat, mlxlink); a port that flaps "
                    "or trains below its rate needs the cable or optic replaced"
                )
                if st is not Status.OK
                else "",
                data={
                    k: p[k]
                    for k in ("link_layer", "state", "phys_state", "link_downed", "link_error_recovery")
                },
            )
        )
    if expect and len(ports) < expect:
        out.append(
            result(
                "net.ib",
                Status.FAIL,
                f"{len(ports)} ports, expected {expect}",
                value=len(ports),
                unit="ports",
                threshold=expect,
                hint="an HCA is missing: check lspci and the mlx5 driver",
            )
        )
    return out
