"""DCGM diagnostics (``dcgmi diag -r 1|2|3 -j``) as acceptance-stage checks, where DCGM is installed.

Level 1 takes seconds (software, deployment), level 2 about two minutes (adds PCIe, memory, short
stress), level 3 tens of minutes (targeted stress and power). Each level is its own check:
``dcgm.diag_r1``, ``dcgm.diag_r2``, ``dcgm.diag_r3``. Without ``dcgmi`` on PATH the check is not
applicable (the report says so); DCGM's host engine not running is INCOMPLETE.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from gpufleet.health.checks import Context, NotApplicable, register, result
from gpufleet.health.results import CheckResult, Status

_STATUS = {"pass": Status.OK, "warn": Status.WARN, "fail": Status.FAIL}


def _message(entry: dict[str, Any]) -> str:
    w = entry.get("warnings", entry.get("info", ""))
    if isinstance(w, list):
        parts = [str(x.get("warning", x.get("message", x))) if isinstance(x, dict) else str(x) for x in w]
        return "; ".join(parts)
    return str(w or "")


def parse_diag(text: str) -> list[dict[str, Any]]:
    """One row per (test, GPU) of a ``dcgmi diag -j`` report: category, test, gpu, status, message.
    Raises ValueError on text that is not such a report."""
    data = json.loads(text)
    body = data.get("DCGM GPU Diagnostic", data) if isinstance(data, dict) else None
    if not isinstance(body, dict) or "test_categories" not in body:
        raise ValueError("no 'test_categories' in dcgmi output")
    rows = []
    for cat in body["test_categories"]:
        for test in cat.get("tests", []):
            for r in test.get("results", []):
                gpu = r.get("gpu_id", r.get("gpu_ids", r.get("entity_id")))
                rows.append(
                    {
                        "category": str(cat.get("category", "")),
                        "test": str(test.get("name", "")),
                        "gpu": None if gpu in (None, "") else str(gpu),
                        "status": str(r.get("status", "")).strip(),
                        "message": _message(r),
                    }
                )
    return rows


def diag(ctx: Context, level: int) -> list[CheckResult]:
    name = f"dcgm.diag_r{level}"
    exe = str(ctx.param("dcgmi", "dcgmi"))
    path = shutil.which(exe, path=ctx.env.get("PATH"))
    if path is None:
        raise NotApplicable(f"{exe} not found: DCGM is not installed")
    try:
        p = subprocess.run(
            [path, "diag", "-r", str(level), "-j"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=ctx.remaining(),
            env=ctx.env,
        )
    except subprocess.TimeoutExpired:
        return [result(name, Status.INCOMPLETE, f"dcgmi diag -r {level} timed out", hint="raise the timeout")]
    try:
        rows = parse_diag(p.stdout)
    except ValueError as e:
        err = (p.stderr or p.stdout).strip().splitlines()
        return [
            result(
                name,
                Status.INCOMPLETE,
                f"dcgmi diag -r {level} exit {p.returncode}: {err[-1][:120] if err else e}",
                hint="start DCGM's host engine (systemctl start nvidia-dcgm) and retry",
            )
        ]
    bad = [r for r in rows if _STATUS.get(r["status"].lower()) in (Status.FAIL, Status.WARN)]
    ran = [r for r in rows if r["status"].lower() in _STATUS]
    if not ran:
        return [result(name, Status.INCOMPLETE, f"dcgmi diag -r {level}: every test skipped", value=0)]
    st = Status.FAIL if any(_STATUS[r["status"].lower()] is Status.FAIL for r in bad) else Status.OK
    if st is Status.OK and bad:
        st = Status.WARN
    detail = (
        "; ".join(
            f"{r['test']}{' gpu' + r['gpu'] if r['gpu'] else ''} {r['status'].upper()}"
            + (f": {r['message'][:100]}" if r["message"] else "")
            for r in bad
        )
        if bad
        else f"{len(ran)} test results passed ({len(rows) - len(ran)} skipped)"
    )
    return [
        result(
            name,
            st,
            detail,
            value=len([r for r in bad if r["status"].lower() == "fail"]),
            unit="failed",
            threshold=0,
            hint="drain the node; follow DCGM's message for the failed test (a GPU or memory failure "
            "needs the GPU serviced)"
            if st is not Status.OK
            else "",
            data={"results": rows[:100]},
        )
    ]


@register("dcgm.diag_r1", component="gpu", timeout_s=120, requires_gpu=True)
def diag_r1(ctx: Context) -> list[CheckResult]:
    """DCGM diagnostic level 1 (dcgmi diag -r 1 -j): software and deployment, seconds."""
    return diag(ctx, 1)


@register("dcgm.diag_r2", component="gpu", timeout_s=600, requires_gpu=True)
def diag_r2(ctx: Context) -> list[CheckResult]:
    """DCGM diagnostic level 2 (dcgmi diag -r 2 -j): adds PCIe, memory and a short stress, minutes."""
    return diag(ctx, 2)


@register("dcgm.diag_r3", component="gpu", timeout_s=3600, requires_gpu=True)
def diag_r3(ctx: Context) -> list[CheckResult]:
    """DCGM diagnostic level 3 (dcgmi diag -r 3 -j): targeted stress and power, tens of minutes."""
    return diag(ctx, 3)
