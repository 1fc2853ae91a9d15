"""Traffic for the planner: a mean rate, input/output length distributions and burstiness, or a
Mooncake trace.

* spec: ``rate=12;in=lognormal:512,0.6;out=lognormal:192,0.6;cv=1.5`` (``;``-separated; ``in``/
  ``out`` take the ``serve bench`` distributions ``fixed:N``, ``uniform:A-B``,
  ``lognormal:MEDIAN,SIGMA``; ``cv`` is the coefficient of variation of the inter-arrival gaps:
  gamma gaps with shape 1/cv², cv=1 is Poisson, 0 is constant; a preset name ``chat``,
  ``reasoning`` or ``short`` sets ``in`` and ``out``);
* a JSON file ``{"rate": 12, "input": "lognormal:512,0.6", "output": "fixed:128", "cv": 1}``;
* a Mooncake ``.jsonl`` trace: its own arrival times (rescaled to a rate when asked) and lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpufleet.core.errors import UsageError
from gpufleet.core.paths import read_json
from gpufleet.serve.common.workload import PRESETS, LengthDist, load_mooncake, parse_dist
from gpufleet.serve.plan.sim import Requests

__all__ = ["Traffic", "parse_traffic", "load_traffic"]


@dataclass(frozen=True)
class Traffic:
    rate: float
    inp: LengthDist | None
    out: LengthDist | None
    cv: float = 1.0
    source: str = "spec"
    trace_offsets: np.ndarray | None = None  # seconds, from a trace
    trace_inp: np.ndarray | None = None
    trace_out: np.ndarray | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "rate_per_s": round(self.rate, 6),
            "input": str(self.inp) if self.inp else "trace",
            "output": str(self.out) if self.out else "trace",
            "cv": round(self.cv, 4),
            "source": self.source,
        }

    def mean_lengths(self) -> tuple[float, float]:
        if self.trace_inp is not None and self.trace_out is not None:
            return float(self.trace_inp.mean()), float(self.trace_out.mean())
        assert self.inp is not None and self.out is not None
        return self.inp.mean(), self.out.mean()

    def unit(self, n: int, seed: int = 0) -> Requests:
        key = (n, seed)
        cache = self.__dict__.setdefault("_units", {})
        if key not in cache:
            cache[key] = self._unit(n, seed)
        return cache[key]

    def _unit(self, n: int, seed: int) -> Requests:
        """``n`` requests at rate 1/s (scale ``arrival`` by 1/rate for another rate): common random
        numbers, so that a bisection over the rate sees the same requests."""
        if self.trace_offsets is not None and self.trace_inp is not None and self.trace_out is not None:
            m = len(self.trace_offsets)
            reps = -(-n // m)
            span = float(self.trace_offsets[-1]) + (1.0 / self.rate if self.rate > 0 else 1.0)
            arr = np.concatenate([self.trace_offsets + r * span for r in range(reps)])[:n] * self.rate
            inp = np.tile(self.trace_inp, reps)[:n]
            out = np.tile(self.trace_out, reps)[:n]
            return Requests(arr, inp, out)
        assert self.inp is not None and self.out is not None
        rng = np.random.default_rng(seed)
        if self.cv <= 0:
            gaps = np.ones(n)
        else:
            k = 1.0 / (self.cv * self.cv)
            gaps = rng.gamma(k, 1.0 / k, size=n)
        arr = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        r = random.Random(seed)
        inp = np.array([self.inp.sample(r) for _ in range(n)], dtype=np.int64)
        out = np.array([self.out.sample(r) for _ in range(n)], dtype=np.int64)
        return Requests(arr, inp, out)


MAX_RATE = 1e6
"""The highest request rate the planner plans for (req/s): far above any one deployment, and low enough
that its simulation stays short."""


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"traffic rate {text!r} is not a number") from None
    if not math.isfinite(v) or not 0 < v <= MAX_RATE:
        raise UsageError(f"traffic rate must be > 0 and <= {MAX_RATE:g} req/s (got {text})")
    return v


def _cv(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"traffic cv {text!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or v > 20:
        raise UsageError(f"traffic cv must be in 0..20 (got {text})")
    return v


def parse_traffic(text: str) -> Traffic:
    fields: dict[str, str] = {}
    for item in (x.strip() for x in text.split(";")):
        if not item:
            continue
        if "=" not in item:
            if item not in PRESETS:
                raise UsageError(
                    f"traffic: unknown item {item!r} (rate=, in=, out=, cv= or a preset: "
                    f"{', '.join(sorted(PRESETS))})"
                )
            for sub in PRESETS[item].split(";"):
                k, _, v = sub.partition("=")
                fields[k.strip()] = v.strip()
            continue
        k, _, v = item.partition("=")
        k = k.strip().lower()
        if k not in ("rate", "in", "out", "cv"):
            raise UsageError(f"traffic: unknown key {k!r} (rate, in, out, cv)")
        fields[k] = v.strip()
    if "rate" not in fields:
        raise UsageError("traffic needs rate=<req/s>")
    return Traffic(
        _rate(fields["rate"]),
        parse_dist(fields.get("in", "lognormal:512,0.6"), "traffic in"),
        parse_dist(fields.get("out", "lognormal:192,0.6"), "traffic out"),
        _cv(fields.get("cv", "1")),
    )


def load_traffic(text: str, rate: float | None = None) -> Traffic:
    """A spec, a ``.json`` traffic file or a Mooncake ``.jsonl`` trace; ``rate`` overrides the rate."""
    p = Path(text)
    if text.endswith(".jsonl"):
        if not p.is_file():
            raise UsageError(f"trace file not found: {text}")
        tw = load_mooncake(p)
        ts = np.array([e.timestamp_ms for e in tw.entries]) / 1000.0
        ts = ts - ts[0]
        if len(ts) < 2 or ts[-1] <= 0:
            raise UsageError(f"trace {p.name}: needs at least 2 requests at different times")
        gaps = np.diff(ts)
        t = Traffic(
            (len(ts) - 1) / float(ts[-1]),
            None,
            None,
            float(gaps.std() / gaps.mean()),
            f"mooncake:{p.name}",
            ts,
            np.array([e.input_length for e in tw.entries]),
            np.array([e.output_length for e in tw.entries]),
        )
    elif text.endswith(".json"):
        d = read_json(p, "traffic file")
        if not isinstance(d, dict) or "rate" not in d:
            raise UsageError(f"traffic {p}: needs an object with rate, input, output[, cv]")
        t = Traffic(
            _rate(str(d["rate"])),
            parse_dist(str(d.get("input", "lognormal:512,0.6")), "traffic input"),
            parse_dist(str(d.get("output", "lognormal:192,0.6")), "traffic output"),
            _cv(str(d.get("cv", 1))),
            f"file:{p.name}",
        )
    else:
        t = parse_traffic(text)
    if rate is not None:
        t = Traffic(_rate(str(rate)), t.inp, t.out, t.cv, t.source, t.trace_offsets, t.trace_inp, t.trace_out)
    return t
