"""GPU checks over NVML (inventory, ECC, remapped rows, throttling, clocks, temperature, PCIe) and XIDs."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from gpufleet.core.env import Env
from gpufleet.health.checks import Context, register, result
from gpufleet.health.nvml import BAD_THROTTLE, NvmlUnavailable, read_gpus, throttle_names
from gpufleet.health.results import CheckResult, Status, worst
from gpufleet.health.xid import (
    XidClass,
    classify,
    classify_sxid,
    parse_sxids,
    parse_xids,
    repeat_suspects,
    worst_action,
)


@register("gpu.inventory", component="gpu", timeout_s=15)
def inventory(ctx: Context) -> list[CheckResult]:
    """GPU count (NVML) against the expected count; all GPUs of the profile's model."""
    want = ctx.expect_gpus
    try:
        gpus = read_gpus()
    except NvmlUnavailable as e:
        if want == 0:
            return [
                result("gpu.inventory", Status.OK, "no GPUs expected", value=0, unit="count", threshold=0)
            ]
        status = Status.INCOMPLETE if e.missing else Status.FAIL
        return [
            result(
                "gpu.inventory",
                status,
                str(e),
                value=None,
                unit="count",
                threshold=want,
                hint="load the NVIDIA driver (nvidia-smi must work) or reboot the node",
            )
        ]
    n = len(gpus)
    names = sorted({g.name for g in gpus})
    odd = [g.name for g in gpus if ctx.profile.match and not any(m in g.name for m in ctx.profile.match)]
    detail = f"{n} GPU(s): {', '.join(names) or 'none'}"
    if n != want:
        return [
            result(
                "gpu.inventory",
                Status.FAIL,
                f"{detail}; expected {want}",
                value=n,
                unit="count",
                threshold=want,
                hint="a GPU is missing (fallen off the bus?): reset or reboot, then reseat or replace",
                data={"names": names},
            )
        ]
    if odd:
        return [
            result(
                "gpu.inventory",
                Status.WARN,
                f"{detail}; not {ctx.profile.name}: {odd[0]}",
                value=n,
                unit="count",
                threshold=want,
                hint="pass --profile for this hardware",
            )
        ]
    return [result("gpu.inventory", Status.OK, detail, value=n, unit="count", threshold=want)]


def _judge(ctx: Context, metric: str, value: float, what: str, problems: list[tuple[Status, str]]) -> None:
    th = ctx.profile.threshold(metric)
    if th is None:
        return
    st, limit = th.judge(value)
    if st is not Status.OK:
        problems.append((st, f"{what} {value:g} (limit {limit:g})"))


# The readings gpu.state judges (the other checks report their own unreadable values).
STATE_KEYS = frozenset(
    {"ecc_volatile", "ecc_aggregate", "remapped", "throttle", "sm_clock", "sm_clock_max", "temperature"}
    | {"pcie_gen", "pcie_width"}
)


@register("gpu.state", component="gpu", timeout_s=15, requires_gpu=True)
def state(ctx: Context) -> list[CheckResult]:
    """Per GPU: ECC volatile/aggregate, remapped rows (NVML call), throttle reasons, temperature, PCIe."""
    try:
        gpus = read_gpus()
    except NvmlUnavailable as e:
        return [result("gpu.state", Status.INCOMPLETE, str(e), hint="NVML is needed to read GPU state")]
    out: list[CheckResult] = []
    for g in gpus:
        v, problems = g.values, []
        if "ecc_volatile" in v:
            _judge(
                ctx, "gpu.ecc_uncorrected_volatile", v["ecc_volatile"], "volatile uncorrected ECC", problems
            )
        if "ecc_aggregate" in v:
            _judge(
                ctx,
                "gpu.ecc_uncorrected_aggregate",
                v["ecc_aggregate"],
                "aggregate uncorrected ECC",
                problems,
            )
        if "remapped" in v:
            _corr, unc, pending, failed = v["remapped"]
            if failed:
                problems.append((Status.FAIL, "row remapping failed"))
            elif pending:
                problems.append((Status.WARN, "row remap pending (needs a GPU reset)"))
            _judge(
                ctx,
                "gpu.remapped_rows_uncorrectable",
                unc,
                "rows remapped for uncorrectable errors",
                problems,
            )
        for reason in throttle_names(int(v.get("throttle", 0))):
            if reason in BAD_THROTTLE:
                problems.append(
                    (
                        Status.FAIL if BAD_THROTTLE[reason] == "fail" else Status.WARN,
                        f"clocks throttled: {reason}",
                    )
                )
        if "temperature" in v:
            _judge(ctx, "gpu.temperature", v["temperature"], "temperature C", problems)
        if "pcie_gen" in v:
            _judge(ctx, "gpu.pcie_gen", v["pcie_gen"], "PCIe max link gen", problems)
        if "pcie_width" in v:
            _judge(ctx, "gpu.pcie_width", v["pcie_width"], "PCIe link width", problems)
        st = worst([p[0] for p in problems]) if problems else Status.OK
        if st is Status.OK:
            detail = (
                f"{v.get('temperature', '?')} C, gen{v.get('pcie_gen', '?')} x{v.get('pcie_width', '?')}, "
                f"SM {v.get('sm_clock', '?')}/{v.get('sm_clock_max', '?')} MHz"
            )
        else:
            detail = "; ".join(p[1] for p in problems if p[0] is not Status.OK)
        unreadable = sorted(set(g.unsupported) & STATE_KEYS)
        if unreadable:
            detail += f" (not readable: {', '.join(unreadable)})"
        hint = (
            (
                "drain the node; reset the GPU (row remap pending) or replace it (ECC, remap failure, "
                "link width, hardware slowdown)"
            )
            if st is not Status.OK
            else ""
        )
        out.append(
            result(
                "gpu.state",
                st,
                detail,
                value=len(problems),
                unit="problems",
                threshold=0,
                device=f"gpu{g.index}",
                hint=hint,
                data={"pci": g.pci, **{k: (list(x) if isinstance(x, tuple) else x) for k, x in v.items()}},
            )
        )
    return out or [result("gpu.state", Status.INCOMPLETE, "NVML reports no GPUs")]


def kernel_log(ctx: Context) -> tuple[str | None, str]:
    """(text, where) of the kernel log: plan ``kernel_log`` file or $GPUFLEET_KERNEL_LOG, else a command."""
    f = ctx.param("kernel_log", Env.KERNEL_LOG.get(ctx.env))
    if f:
        try:
            return Path(f).read_text(errors="replace"), str(f)
        except OSError as e:
            return None, f"cannot read {f}: {e.strerror}"
    errors = []
    for cmd in ctx.param("kernel_log_commands", ["dmesg", "journalctl -k -b --no-pager -q"]):
        argv = shlex.split(cmd)
        if shutil.which(argv[0]) is None:
            errors.append(f"{argv[0]}: not found")
            continue
        try:
            p = subprocess.run(
                argv, capture_output=True, text=True, errors="replace", timeout=min(15.0, ctx.remaining())
            )
        except subprocess.TimeoutExpired:
            errors.append(f"{argv[0]}: timed out")
            continue
        if p.returncode == 0:
            return p.stdout, cmd
        errors.append(f"{argv[0]}: exit {p.returncode} {p.stderr.strip()[:60]}")
    return None, "; ".join(errors)


@register("gpu.xid", component="gpu", timeout_s=20, requires_gpu=True)
def xid(ctx: Context) -> list[CheckResult]:
    """XID events in the kernel log, classified by the data table (data/xid.toml) into actions."""
    text, where = kernel_log(ctx)
    if text is None:
        return [_no_log("gpu.xid", where)]
    events = parse_xids(text)
    fatal, warns, apps = [], [], []
    for e in events:
        c = classify(e.code)
        {"fatal": fatal, "warn": warns, "app": apps}[c.severity].append((e, c))
    suspects = repeat_suspects(events)
    lines = [f"xid {c.code} on {e.pci} ({c.name or 'unnamed'}): {c.action}" for e, c in fatal + warns]
    lines += [f"xid 13/31 repeating on {pci} only: hardware suspect" for pci in suspects]
    if fatal:
        st = Status.FAIL
    elif warns or suspects:
        st = Status.WARN
    else:
        st = Status.OK
    if not lines:
        lines = [f"{len(apps)} application XID(s), no hardware XIDs" if apps else "no XIDs"]
    judged = fatal + warns
    action = worst_action([c.action for _e, c in judged] + (["drain"] if suspects else []))
    data = {
        "source": where,
        "action": action,
        "events": [{"pci": e.pci, "xid": e.code} for e in events[:50]],
        "classes": {str(c.code): {"action": c.action, "reason": c.reason, "url": c.url} for _e, c in judged},
    }
    return [
        result(
            "gpu.xid",
            st,
            "; ".join(dict.fromkeys(lines)),
            value=len(fatal),
            unit="fatal XIDs",
            threshold=0,
            data=data,
            hint=_action_hint(action, [c for _e, c in judged]) if st is not Status.OK else "",
        )
    ]


def _no_log(check: str, where: str) -> CheckResult:
    return result(
        check,
        Status.INCOMPLETE,
        f"no kernel log: {where}",
        hint="run as root or with CAP_SYSLOG, or set kernel_log in the plan",
    )


def _action_hint(action: str, classes: list[XidClass]) -> str:
    worst = next((c for c in classes if c.action == action), None)
    if worst is None:
        return f"{action}: XID 13/31 repeating on one GPU points at the hardware"
    return f"{action}: {worst.reason} (see {worst.url})"


@register("gpu.sxid", component="gpu", timeout_s=20, requires_gpu=True)
def sxid(ctx: Context) -> list[CheckResult]:
    """SXID (NVSwitch) events in the kernel log, classified by data/xid.toml into actions."""
    text, where = kernel_log(ctx)
    if text is None:
        return [_no_log("gpu.sxid", where)]
    events = parse_sxids(text)
    classes = [(e, classify_sxid(e.code, e.fatal)) for e in events]
    fatal = [(e, c) for e, c in classes if c.severity == "fatal"]
    lines = [
        f"sxid {c.code} on {e.switch} ({'fatal' if c.severity == 'fatal' else 'non-fatal'}: "
        f"{e.text[:60] or 'no text'}): {c.action}"
        for e, c in classes
    ]
    st = Status.FAIL if fatal else (Status.WARN if classes else Status.OK)
    action = worst_action([c.action for _e, c in classes])
    data = {
        "source": where,
        "action": action,
        "events": [{"switch": e.switch, "pci": e.pci, "sxid": e.code} for e in events[:50]],
        "classes": {str(c.code): {"action": c.action, "reason": c.reason, "url": c.url} for _e, c in classes},
    }
    return [
        result(
            "gpu.sxid",
            st,
            "; ".join(dict.fromkeys(lines)) or "no SXIDs",
            value=len(fatal),
            unit="fatal SXIDs",
            threshold=0,
            data=data,
            hint=_action_hint(action, [c for _e, c in classes]) if st is not Status.OK else "",
        )
    ]


# ------------------------------------------------------------ memory errors, throttling, power
@register("gpu.ecc", component="memory", timeout_s=15, requires_gpu=True)
def ecc(ctx: Context) -> list[CheckResult]:
    """Per GPU: single-bit (corrected) ECC counts and retired pages, pending retirement (double-bit
    ECC and row remapping are gpu.state's)."""
    from gpufleet.health.checks.links import judge, per_gpu

    try:
        gpus = read_gpus()
    except NvmlUnavailable as e:
        return [result("gpu.ecc", Status.INCOMPLETE, str(e), hint="NVML is needed to read ECC counters")]
    judged: dict[int, list[tuple[Status, str]]] = {}
    ok: dict[int, str] = {}
    for g in gpus:
        v, problems = g.values, []
        keys = ("ecc_sbe_volatile", "ecc_sbe_aggregate", "retired_sbe", "retired_dbe", "retired_pending")
        if not any(k in v for k in keys):
            continue
        if "ecc_sbe_volatile" in v:
            judge(
                ctx, "gpu.ecc_corrected_volatile", v["ecc_sbe_volatile"], "volatile corrected ECC", problems
            )
        if "ecc_sbe_aggregate" in v:
            judge(
                ctx,
                "gpu.ecc_corrected_aggregate",
                v["ecc_sbe_aggregate"],
                "aggregate corrected ECC",
                problems,
            )
        retired = int(v.get("retired_sbe", 0)) + int(v.get("retired_dbe", 0))
        judge(ctx, "gpu.retired_pages", retired, "retired pages", problems)
        if v.get("retired_pending"):
            problems.append((Status.WARN, "page retirement pending (reset the GPU or reload the driver)"))
        judged[g.index] = problems
        ok[g.index] = f"{v.get('ecc_sbe_volatile', '?')} corrected ECC (volatile), {retired} retired pages"
    out = per_gpu(
        "gpu.ecc",
        gpus,
        judged,
        ok,
        "reset the GPU when idle to apply pending retirements; many retired pages or a climbing corrected "
        "count mean the HBM is wearing: plan the GPU's replacement",
    )
    return out or [
        result("gpu.ecc", Status.INCOMPLETE, "NVML reads no ECC counters (ECC off or unsupported)")
    ]


@register("gpu.throttle", component="gpu", timeout_s=30, requires_gpu=True)
def throttle(ctx: Context) -> list[CheckResult]:
    """Per GPU: the share of the window each reason (power, thermal, reliability, board limit)
    held the clocks down, from NVML's violation time counters read twice ``window_s`` apart."""
    from gpufleet.health.checks.links import judge, per_gpu, readings

    try:
        first, second, _elapsed = readings(ctx, default_window=1.0)
    except NvmlUnavailable as e:
        return [
            result("gpu.throttle", Status.INCOMPLETE, str(e), hint="NVML is needed to read throttle time")
        ]
    later = {g.index: g for g in (second or [])}
    judged: dict[int, list[tuple[Status, str]]] = {}
    ok: dict[int, str] = {}
    for g in first:
        a, b = g.values.get("violations"), later.get(g.index, g).values.get("violations")
        if not a or not b:
            continue
        problems: list[tuple[Status, str]] = []
        shares = []
        for reason in ("power", "thermal", "reliability", "board_limit"):
            if reason not in a or reason not in b:
                continue
            window_ns = (b[reason][0] - a[reason][0]) * 1000.0  # the device's own timestamps, us
            if window_ns <= 0:
                continue
            share = 100.0 * (b[reason][1] - a[reason][1]) / window_ns
            shares.append(f"{reason} {share:.1f}%")
            judge(ctx, f"gpu.throttle_{reason}", round(share, 3), f"throttled by {reason}", problems)
        if not shares:
            continue
        judged[g.index] = problems
        ok[g.index] = "throttled: " + ", ".join(shares)
    out = per_gpu(
        "gpu.throttle",
        first,
        judged,
        ok,
        "thermal: check airflow, fans and the inlet temperature; reliability or board limit: check the "
        "power supplies and the BMC's event log; power: the job runs at its power cap",
    )
    return out or [
        result(
            "gpu.throttle",
            Status.INCOMPLETE,
            "no throttle time measured: NVML reads no violation counters, or the window was empty",
            hint="set window_s > 0 in the plan; needs a driver with nvmlDeviceGetViolationStatus",
        )
    ]


@register("gpu.power", component="gpu", timeout_s=15, requires_gpu=True)
def power(ctx: Context) -> list[CheckResult]:
    """Per GPU: power draw against the enforced limit, and that limit against the profile's."""
    from gpufleet.health.checks.links import judge, per_gpu

    try:
        gpus = read_gpus()
    except NvmlUnavailable as e:
        return [result("gpu.power", Status.INCOMPLETE, str(e), hint="NVML is needed to read power")]
    judged: dict[int, list[tuple[Status, str]]] = {}
    ok: dict[int, str] = {}
    for g in gpus:
        v = g.values
        if "power_mw" not in v or not v.get("power_limit_mw"):
            continue
        problems: list[tuple[Status, str]] = []
        draw, limit = v["power_mw"] / 1000.0, v["power_limit_mw"] / 1000.0
        judge(ctx, "gpu.power_draw", round(100.0 * draw / limit, 1), "power draw, % of the limit,", problems)
        judge(ctx, "gpu.power_limit", limit, "enforced power limit", problems)
        judged[g.index] = problems
        ok[g.index] = f"{draw:.0f} W of {limit:.0f} W"
    out = per_gpu(
        "gpu.power",
        gpus,
        judged,
        ok,
        "a draw above the limit means power capping does not hold (service the board); a limit below "
        "the profile's was set by someone (nvidia-smi -pl) or by the BMC: restore it or check the PSUs",
    )
    return out or [result("gpu.power", Status.INCOMPLETE, "NVML reads no power draw or limit")]


@register("gpu.versions", component="software", timeout_s=15, requires_gpu=True)
def versions(ctx: Context) -> list[CheckResult]:
    """The node's driver, VBIOS and HCA firmware versions (compared across a job's nodes by
    gpufleet.health.agreement); WARN when this node's own GPUs run different VBIOS versions."""
    from gpufleet.health.agreement import node_inventory

    try:
        gpus = read_gpus()
    except NvmlUnavailable as e:
        return [result("gpu.versions", Status.INCOMPLETE, str(e), hint="NVML is needed to read versions")]
    from gpufleet.health.checks.links import sysfs_root

    inv = node_inventory(gpus, sysfs_root(ctx))
    if not inv:
        return [result("gpu.versions", Status.INCOMPLETE, "NVML reads no driver or VBIOS version")]
    vbios = sorted({str(g.values["vbios"]) for g in gpus if "vbios" in g.values})
    detail = ", ".join(f"{k} {v}" for k, v in inv.items())
    if len(vbios) > 1:
        return [
            result(
                "gpu.versions",
                Status.WARN,
                f"GPUs of this node run different VBIOS versions: {', '.join(vbios)}",
                hint="flash one VBIOS on every GPU (nvflash, or the vendor's firmware bundle)",
                data={"inventory": inv},
            )
        ]
    return [result("gpu.versions", Status.OK, detail, data={"inventory": inv})]
