"""One SLO type and one ``--slo`` grammar for every serve command (bench, plan).

``--slo`` is a comma-separated list of ``METRIC=DURATION`` items, each in one of two forms:

* plain, ``ttft=200ms``: a request meets the limit when its TTFT is at most 200 ms;
* percentile, ``ttft_p90=200ms``: the same per-request limit, and the 90th percentile of TTFT
  over the measured requests must be at most 200 ms too.

Metrics are ``ttft``, ``tpot`` and ``e2e``; a command may accept fewer (``serve plan`` simulates
``ttft`` and ``tpot``). A request *meets the SLO* when it meets every limit; *attainment* is the
share of requests that do (a failed request never does). Durations need a unit (``us``, ``ms``,
``s``, ``m``, ...: :func:`gpufleet.core.units.parse_duration`). Where a command evaluates
percentiles for every limit (``serve plan``), a plain limit counts as ``p90`` there.
Every bad string is one line: a :class:`~gpufleet.core.errors.UsageError` naming the valid keys.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from gpufleet.core.errors import ConfigError, UsageError
from gpufleet.core.units import parse_duration

__all__ = ["Metric", "METRICS", "Limit", "SLO", "parse_slo", "DEFAULT_PERCENTILE"]

Metric = Literal["ttft", "tpot", "e2e"]
METRICS: tuple[Metric, ...] = get_args(Metric)
DEFAULT_PERCENTILE = 90.0  # what a plain limit means where percentiles are evaluated (serve plan)
_KEY = re.compile(r"^(?P<metric>[a-z0-9]+?)(?:_p(?P<pct>[0-9]*\.?[0-9]+))?$")


@dataclass(frozen=True)
class Limit:
    """At most ``seconds`` per request; with ``percentile``, the percentile must be within it too."""

    seconds: float
    percentile: float | None = None

    def key(self, metric: str) -> str:
        """The ``--slo`` key: ``ttft`` or ``ttft_p90``."""
        return metric if self.percentile is None else f"{metric}_p{self.percentile:g}"


@dataclass(frozen=True)
class SLO:
    """Limits by metric, and the share of requests that must meet every one (``attainment``)."""

    limits: Mapping[Metric, Limit] = field(default_factory=dict)
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for m, lim in self.limits.items():
            if m not in METRICS:
                raise ConfigError(f"SLO metric {m!r} unknown; valid: {', '.join(METRICS)}")
            if not (math.isfinite(lim.seconds) and lim.seconds > 0):
                raise ConfigError(f"SLO {m}: limit must be > 0 seconds (got {lim.seconds!r})")
            if lim.percentile is not None and not 0 < lim.percentile < 100:
                raise ConfigError(f"SLO {m}: percentile must be in (0, 100) (got {lim.percentile!r})")
        if not 0 < self.attainment <= 1:
            raise ConfigError(f"SLO attainment must be in (0, 1] (got {self.attainment!r})")

    @classmethod
    def of(
        cls,
        *,
        ttft: float | None = None,
        tpot: float | None = None,
        e2e: float | None = None,
        percentile: float | None = None,
        attainment: float = 0.9,
    ) -> SLO:
        """``SLO.of(ttft=0.4, tpot=0.04, percentile=90)``: limits in seconds, one percentile for all."""
        given = {"ttft": ttft, "tpot": tpot, "e2e": e2e}
        return cls({m: Limit(s, percentile) for m, s in given.items() if s is not None}, attainment)  # type: ignore[misc]

    def seconds(self, metric: Metric) -> float | None:
        lim = self.limits.get(metric)
        return None if lim is None else lim.seconds

    @property
    def ttft(self) -> float | None:
        return self.seconds("ttft")

    @property
    def tpot(self) -> float | None:
        return self.seconds("tpot")

    @property
    def e2e(self) -> float | None:
        return self.seconds("e2e")

    def __bool__(self) -> bool:
        return bool(self.limits)

    def as_dict(self) -> dict[str, float]:
        """``{metric: seconds}`` in ``METRICS`` order."""
        return {m: self.limits[m].seconds for m in METRICS if m in self.limits}

    def percentile(self, metric: Metric) -> float:
        """The percentile evaluated for ``metric`` where every limit has one (plain: p90)."""
        q = self.limits[metric].percentile
        return DEFAULT_PERCENTILE if q is None else q

    def only(self, metric: Metric) -> SLO:
        """This SLO restricted to one metric (same attainment)."""
        return SLO({m: v for m, v in self.limits.items() if m == metric}, self.attainment)

    def __str__(self) -> str:
        return (
            ",".join(
                f"{self.limits[m].key(m)}={self.limits[m].seconds * 1000:g}ms"
                for m in METRICS
                if m in self.limits
            )
            or "none"
        )

    def met(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """Every limit holds for one request. A missing measurement against a set limit fails it."""
        for m, value in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
            lim = self.limits.get(m)  # type: ignore[call-overload]
            if lim is not None and (value is None or value > lim.seconds):
                return False
        return True


def parse_slo(
    text: str | None,
    *,
    metrics: tuple[Metric, ...] = METRICS,
    attainment: float = 0.9,
    flag: str = "--slo",
) -> SLO:
    """``ttft=500ms,tpot_p90=50ms,e2e=10s`` → :class:`SLO`. Empty or None: no limits.

    ``metrics`` are the keys this command accepts; an error lists them, in one line."""
    if not 0 < attainment <= 1:
        raise UsageError(f"--attainment must be in (0, 1] (got {attainment:g})")
    valid = ", ".join([*metrics, *(f"{m}_pNN" for m in metrics)])
    limits: dict[Metric, Limit] = {}
    for item in (x.strip() for x in (text or "").split(",")):
        if not item:
            if text and text.strip():
                raise UsageError(f"{flag}: empty item in {text!r}; valid keys: {valid}")
            continue
        key, sep, value = item.partition("=")
        m = _KEY.match(key.strip().lower())
        metric = m["metric"] if m else ""
        if not sep or metric not in metrics:
            raise UsageError(
                f"{flag}: bad item {item!r}; expected KEY=DURATION with KEY one of {valid} "
                f"(e.g. ttft=500ms or ttft_p90=500ms)"
            )
        pct = float(m["pct"]) if m and m["pct"] else None
        if pct is not None and not 0 < pct < 100:
            raise UsageError(
                f"{flag}: the percentile of {key.strip()!r} must be in (0, 100); valid keys: {valid}"
            )
        if metric in limits:
            raise UsageError(f"{flag}: {metric} given twice")
        seconds = parse_duration(value.strip(), f"{flag} {key.strip()}", unit_required=True, allow_zero=False)
        limits[metric] = Limit(seconds, pct)  # type: ignore[index]
    t, e = limits.get("ttft"), limits.get("e2e")
    if t is not None and e is not None and t.seconds > e.seconds:
        raise UsageError(f"{flag}: ttft limit is larger than the e2e limit; no request could meet it")
    return SLO(limits, attainment)
