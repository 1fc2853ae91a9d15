"""Latency profiles: fitted models of one (model, hardware, tensor-parallel size).

* prefill time (ms) = a + b·ΣL + c·ΣL²  (ΣL: tokens in the prefill batch, ΣL²: Σ of each
  request's squared length, the attention term; DistServe OSDI'24 §4.2)
* decode step (ms)  = a + b·Σcontext + c·batch  (Σcontext: tokens in the KV cache of the batch)

Fitting is non-negative least squares (``nnls``: exact for three coefficients by trying every
subset of free coefficients with numpy ``lstsq`` and keeping the best non-negative one; scipy is
not a dependency). File format: docs/serve-plan.md ("Profile file"), ``schema:
"gpufleet.serve.profile"``, ``version: 1``.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.core.errors import UsageError

__all__ = [
    "SCHEMA",
    "VERSION",
    "Coeffs",
    "TpProfile",
    "Profile",
    "nnls",
    "fit_prefill",
    "fit_decode",
    "load_profile",
    "example_profiles",
    "profile_from_table",
    "measure",
    "overlap_share",
    "SERIAL_OVERLAP",
]

SCHEMA = "gpufleet.serve.profile"
VERSION = 1


@dataclass(frozen=True)
class Coeffs:
    a: float
    b: float
    c: float


@dataclass(frozen=True)
class TpProfile:
    """The fitted models for one TP size, plus its limits."""

    tp: int
    prefill: Coeffs
    decode: Coeffs
    max_batch: int = 256  # largest running batch the engine allows (1: serves one at a time)
    kv_capacity_tokens: int = 0  # KV-cache tokens per instance (0 = unlimited)
    prefill_max_tokens: int = 8192  # prefill batch token budget (max_num_batched_tokens)
    fit: dict[str, Any] = field(default_factory=dict)

    def prefill_ms(self, sum_l: float, sum_l2: float) -> float:
        p = self.prefill
        return p.a + p.b * sum_l + p.c * sum_l2

    def decode_ms(self, sum_ctx: float, batch: int) -> float:
        d = self.decode
        return d.a + d.b * sum_ctx + d.c * batch


@dataclass(frozen=True)
class Profile:
    model: str
    hardware: str
    source: str  # measured | published-derived | table
    source_note: str
    tps: dict[int, TpProfile]
    kv_bytes_per_token: float = 0.0  # for the P->D KV transfer
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "model": self.model,
            "hardware": self.hardware,
            "source": self.source,
            "source_note": self.source_note,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "units": {
                "prefill": "ms = a + b*sum_L + c*sum_L^2",
                "decode": "ms = a + b*sum_context + c*batch",
            },
            "tp": [
                {
                    "tp": t.tp,
                    "prefill": asdict(t.prefill),
                    "decode": asdict(t.decode),
                    "max_batch": t.max_batch,
                    "kv_capacity_tokens": t.kv_capacity_tokens,
                    "prefill_max_tokens": t.prefill_max_tokens,
                    "fit": t.fit,
                }
                for t in sorted(self.tps.values(), key=lambda x: x.tp)
            ],
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares for a few columns: every subset of free columns, best feasible."""
    n = x.shape[1]
    best: tuple[np.ndarray, float] | None = None
    for k in range(n, 0, -1):
        for cols in itertools.combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(n)
            coef[list(cols)] = sol
            err = float(np.sum((x @ coef - y) ** 2))
            if best is None or err < best[1] - 1e-12:
                best = (coef, err)
    if best is None:
        return np.zeros(n), float(np.sum(y**2))
    return best


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[Coeffs, dict[str, Any]]:
    if len(y) < 2:
        raise UsageError(f"need at least 2 measurements to fit, got {len(y)}")
    # scale the columns so that lstsq is well conditioned, then unscale
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coef, sse = nnls(x / scale, y)
    coef = coef / scale
    sst = float(np.sum((y - y.mean()) ** 2))
    pred = x @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    info = {
        "n": int(len(y)),
        "r2": round(1 - sse / sst, 4) if sst > 0 else 1.0,
        "max_rel_err": round(float(rel.max()), 4),
        "mean_rel_err": round(float(rel.mean()), 4),
    }
    return Coeffs(*(float(v) for v in coef)), info


def fit_prefill(points: list[tuple[float, float, float]]) -> tuple[Coeffs, dict[str, Any]]:
    """``points``: (ΣL, ΣL², ms)."""
    arr = np.asarray(points, dtype=float).reshape(-1, 3)
    x = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
    return _fit(x, arr[:, 2])


def fit_decode(points: list[tuple[float, float, float]]) -> tuple[Coeffs, dict[str, Any]]:
    """``points``: (Σcontext, batch, ms)."""
    arr = np.asarray(points, dtype=float).reshape(-1, 3)
    x = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
    return _fit(x, arr[:, 2])


def _num(obj: dict[str, Any], key: str, where: str, *, integer: bool = False, default: Any = None) -> Any:
    v = obj.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise UsageError(f"{where}: {key} must be a number >= 0, got {v!r}")
    if integer and (int(v) != v or v < 1):
        raise UsageError(f"{where}: {key} must be an integer >= 1, got {v!r}")
    return int(v) if integer else float(v)


def _coeffs(obj: Any, where: str) -> Coeffs:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected an object with a, b, c")
    return Coeffs(*(_num(obj, k, where) for k in "abc"))


def parse_profile(data: Any, where: str) -> Profile:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise UsageError(f"{where}: not a gpufleet profile (schema must be {SCHEMA!r})")
    if data.get("version") != VERSION:
        raise UsageError(
            f"{where}: profile version {data.get('version')!r} is not supported (need {VERSION})"
        )
    entries = data.get("tp")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: 'tp' must be a non-empty list")
    tps: dict[int, TpProfile] = {}
    for i, e in enumerate(entries):
        w = f"{where} tp[{i}]"
        if not isinstance(e, dict):
            raise UsageError(f"{w}: expected an object")
        tp = _num(e, "tp", w, integer=True)
        tps[tp] = TpProfile(
            tp,
            _coeffs(e.get("prefill"), w + ".prefill"),
            _coeffs(e.get("decode"), w + ".decode"),
            _num(e, "max_batch", w, integer=True, default=256),
            int(_num(e, "kv_capacity_tokens", w, default=0)),
            _num(e, "prefill_max_tokens", w, integer=True, default=8192),
            dict(e.get("fit") or {}),
        )
        t = tps[tp]
        if t.prefill_ms(1, 1) <= 0 or t.decode_ms(1, 1) <= 0:
            raise UsageError(f"{w}: prefill and decode times must be > 0")
    return Profile(
        str(data.get("model", "?")),
        str(data.get("hardware", "?")),
        str(data.get("source", "?")),
        str(data.get("source_note", "")),
        tps,
        _num(data, "kv_bytes_per_token", where, default=0.0),
    )


def example_profiles() -> list[str]:
    root = resources.files("gpufleet.serve.plan") / "data" / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(text: str) -> Profile:
    """A path to a profile JSON, or the name of a shipped example (``gpufleet serve profile --list``)."""
    p = Path(text)
    if not p.is_file():
        names = example_profiles()
        if text not in names:
            raise UsageError(f"profile not found: {text} (a file, or one of: {', '.join(names)})")
        raw = (resources.files("gpufleet.serve.plan") / "data" / "profiles" / f"{text}.json").read_text()
    else:
        try:
            raw = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read profile {p}: {e}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UsageError(f"profile {text}: not valid JSON ({e.msg} at line {e.lineno})") from None
    prof = parse_profile(data, f"profile {Path(text).name}")
    return Profile(
        prof.model,
        prof.hardware,
        prof.source,
        prof.source_note,
        prof.tps,
        prof.kv_bytes_per_token,
        str(p) if p.is_file() else f"example:{text}",
    )


TABLE_COLUMNS = ("phase", "tp", "batch", "input_len", "context", "time_ms")


def profile_from_table(
    path: Path,
    model: str,
    hardware: str,
    max_batch: int = 256,
    kv_capacity_tokens: int = 0,
    kv_bytes_per_token: float = 0.0,
) -> Profile:
    """A CSV with columns ``phase,tp,batch,input_len,context,time_ms``: ``prefill`` rows give the
    time of a batch of ``batch`` prompts of ``input_len`` tokens; ``decode`` rows the time of one
    step of ``batch`` requests each with ``context`` tokens in their KV cache."""
    try:
        rows = list(csv.DictReader(path.read_text().splitlines()))
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read table {path}: {e}") from None
    if not rows or any(c not in rows[0] for c in TABLE_COLUMNS):
        raise UsageError(f"table {path}: needs the columns {','.join(TABLE_COLUMNS)}")
    pre: dict[int, list[tuple[float, float, float]]] = {}
    dec: dict[int, list[tuple[float, float, float]]] = {}
    for n, r in enumerate(rows, 2):
        try:
            tp, batch = int(r["tp"]), int(r["batch"])
            inp, ctx, ms = float(r["input_len"] or 0), float(r["context"] or 0), float(r["time_ms"])
        except (TypeError, ValueError):
            raise UsageError(
                f"table {path.name} line {n}: tp, batch, input_len, context, time_ms must be numbers"
            ) from None
        if tp < 1 or batch < 1 or inp < 0 or ctx < 0 or not ms > 0:
            raise UsageError(f"table {path.name} line {n}: values out of range")
        phase = r["phase"].strip().lower()
        if phase == "prefill":
            pre.setdefault(tp, []).append((batch * inp, batch * inp * inp, ms))
        elif phase == "decode":
            dec.setdefault(tp, []).append((batch * ctx, batch, ms))
        else:
            raise UsageError(f"table {path.name} line {n}: phase must be prefill or decode, got {phase!r}")
    tps: dict[int, TpProfile] = {}
    for tp in sorted(set(pre) | set(dec)):
        if tp not in pre or tp not in dec:
            raise UsageError(f"table {path.name}: tp={tp} needs both prefill and decode rows")
        pc, pi = fit_prefill(pre[tp])
        dc, di = fit_decode(dec[tp])
        tps[tp] = TpProfile(tp, pc, dc, max_batch, kv_capacity_tokens, 8192, {"prefill": pi, "decode": di})
    return Profile(model, hardware, "table", f"fitted from {path.name}", tps, kv_bytes_per_token)


# Sweeping a live server lives in plan.sweep; re-exported here, where callers look for it.
from gpufleet.serve.plan.sweep import SERIAL_OVERLAP, measure, overlap_share  # noqa: E402
