"""Measured vs expected per check, from a `gpufleet health check --json` report (gpu_acceptance.sh).

``python -m gpufleet.health.acceptance REPORT.json`` prints one line per result with the profile's
expectation (warn floor, fail floor or ceiling), then the headline figures (matmul, HBM copy, host<->device).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from gpufleet.core.exitcodes import ExitCode
from gpufleet.health.profiles import Threshold, get_profile
from gpufleet.health.results import CheckResult, Status
from gpufleet.health.runner import metric_of  # the one mapping from a result to its profile metric

HEADLINES = {
    "compute.matmul": "matmul (bf16 on GPU, fp32 on CPU)",
    "memory.copy": "HBM / memory copy bandwidth",
    "memory.h2d": "host->device copy",
    "memory.d2h": "device->host copy",
    "collective.busbw": "all_reduce busbw",
}


def expected(th: Threshold | None) -> str:
    if th is None:
        return "-"
    if th.fail_below is not None or th.warn_below is not None:
        good = th.warn_below if th.warn_below is not None else th.fail_below
        return (
            f">= {good:g} {th.unit} (fail < {th.fail_below:g})"
            if th.fail_below is not None
            else f">= {good:g}"
        )
    good = th.warn_above if th.warn_above is not None else th.fail_above
    return f"<= {good:g} {th.unit}" + (f" (fail > {th.fail_above:g})" if th.fail_above is not None else "")


def render(report: dict[str, Any]) -> str:
    profile = get_profile(report["profile"])
    lines = [
        f"gpufleet acceptance: node {report['node']}, profile {profile.name}, plan {report['plan']}, "
        f"{report['duration_s']:.0f} s, status {report['status']} (exit {report['exit_code']})",
        "",
    ]
    rows = [("check", "device", "status", "measured", "expected")]
    heads: dict[str, list[str]] = {}
    for d in report["results"]:
        r = CheckResult(**{**d, "status": Status(d["status"])})
        metric = metric_of(r)
        th = profile.threshold(metric) if metric else None
        val = "-" if r.value is None else f"{r.value:.4g} {r.unit}".strip()
        rows.append(
            (r.check, r.device or "", str(r.status), val, expected(th) if th else (r.detail[:50] or "-"))
        )
        if metric in HEADLINES and r.value is not None:
            heads.setdefault(metric, []).append(f"{r.device}={r.value:.4g}")
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append("")
    for metric, title in HEADLINES.items():
        if metric in heads:
            th = profile.threshold(metric)
            lines.append(
                f"{title}: {', '.join(heads[metric])} {th.unit if th else ''}; expected {expected(th)}"
            )
    bad = [d for d in report["results"] if d["status"] in ("FAIL", "INCOMPLETE")]
    for d in bad:
        lines.append(
            f"{d['status']}: {d['check']} {d.get('device') or ''}: {d['detail']}  {d.get('hint', '')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpufleet.health.acceptance REPORT.json", file=sys.stderr)
        return ExitCode.USAGE
    with open(args[0]) as f:
        report = json.load(f)
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
