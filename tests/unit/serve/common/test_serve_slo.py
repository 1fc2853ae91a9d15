"""The one SLO type and the one ``--slo`` grammar: the plain form (``ttft=200ms``) and the percentile
form (``ttft_p90=200ms``), in the library and through every command that takes ``--slo``."""

from __future__ import annotations

import pytest

from gpufleet.cli.main import main
from gpufleet.core.errors import ConfigError, UsageError
from gpufleet.serve.bench.client import RequestRecord
from gpufleet.serve.bench.findmax import Level
from gpufleet.serve.bench.metrics import summarize_records
from gpufleet.serve.common.slo import SLO, Limit, parse_slo

BENCH_KEYS = "ttft, tpot, e2e, ttft_pNN, tpot_pNN, e2e_pNN"
PLAN_KEYS = "ttft, tpot, ttft_pNN, tpot_pNN"


def test_plain_and_percentile_forms() -> None:
    s = parse_slo("ttft=500ms,tpot_p90=50ms,E2E_P99.9=10s")
    assert s.limits == {"ttft": Limit(0.5), "tpot": Limit(0.05, 90.0), "e2e": Limit(10.0, 99.9)}
    assert s.as_dict() == {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}
    assert (s.ttft, s.tpot, s.e2e) == (0.5, 0.05, 10.0)
    assert str(s) == "ttft=500ms,tpot_p90=50ms,e2e_p99.9=10000ms"
    assert parse_slo(str(s)) == s  # the printed form parses back
    # where every limit is judged at a percentile (serve plan), a plain limit means p90
    assert (s.percentile("ttft"), s.percentile("tpot"), s.percentile("e2e")) == (90.0, 90.0, 99.9)
    assert s.only("tpot") == SLO({"tpot": Limit(0.05, 90.0)}, s.attainment)
    assert parse_slo("TTFT=200us").ttft == pytest.approx(2e-4) and parse_slo("tpot=1.5m").tpot == 90.0
    assert SLO.of(ttft=0.4, tpot=0.04, percentile=90) == parse_slo("ttft_p90=400ms,tpot_p90=40ms")


def test_per_request_check() -> None:
    s = parse_slo("ttft_p90=500ms,tpot=50ms,e2e=10s")
    assert s.met(0.4, 0.04, 9.0)
    assert not s.met(0.6, 0.04, 9.0)
    assert not s.met(0.4, None, 9.0)  # a missing measurement against a set limit fails it
    assert not parse_slo(None) and not parse_slo("  ") and parse_slo(None).met(None, None, None)
    assert str(parse_slo(None)) == "none"


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("ttft", "bad item 'ttft'"),
        ("foo=5ms", "bad item 'foo=5ms'"),
        ("ttft_p=5ms", "bad item"),
        ("ttft_px=5ms", "bad item"),
        ("ttft_p0=5ms", "percentile of 'ttft_p0' must be in (0, 100)"),
        ("ttft_p100=5ms", "must be in (0, 100)"),
        ("ttft=", "is not a duration with a unit"),
        ("ttft=500", "is not a duration with a unit"),
        ("ttft=-5ms", "is not a duration"),
        ("ttft=0ms", "must be a finite duration > 0"),
        ("ttft=5parsecs", "is not a duration"),
        ("tpot=nanms", "is not a duration"),
        ("ttft=5ms,ttft_p99=6ms", "ttft given twice"),
        ("ttft=20s,e2e=1s", "larger than the e2e limit"),
        ("ttft=5ms,,tpot=1ms", "empty item"),
    ],
)
def test_bad_strings_are_one_line(bad: str, why: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_slo(bad)
    assert why in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("--slo")


def test_command_keys_and_bad_attainment() -> None:
    with pytest.raises(UsageError, match=f"one of {PLAN_KEYS} "):
        parse_slo("e2e=1s", metrics=("ttft", "tpot"))
    with pytest.raises(UsageError, match="--attainment"):
        parse_slo("ttft=1s", attainment=1.5)
    with pytest.raises(ConfigError):
        SLO({"ttft": Limit(0.0)})
    with pytest.raises(ConfigError):
        SLO({"ttft": Limit(1.0, 100.0)})


def _rec(i: int, ttft: float | None, error: str = "") -> RequestRecord:
    return RequestRecord(
        i,
        float(i),
        sent_s=float(i),
        ttft_s=ttft,
        e2e_s=None if error else 1.0,
        output_tokens=None if error else 1,
        token_source="usage",
        error=error,
    )


def test_bench_judges_a_percentile_limit_over_every_request() -> None:
    # 10 requests: TTFT 0.1 .. 0.8 s, and two failed (they count as infinitely slow)
    recs = [_rec(i, (i + 1) / 10) for i in range(8)] + [_rec(8, None, "http_500"), _rec(9, None, "http_500")]
    plain = summarize_records(recs, parse_slo("ttft=500ms"))["slo"]
    assert plain["attainment"] == pytest.approx(0.5)
    assert plain["percentiles_ms"] == {} and plain["percentiles_met"] is True
    p50 = summarize_records(recs, parse_slo("ttft_p50=600ms"))["slo"]
    assert p50["attainment"] == pytest.approx(0.6)  # the per-request limit is the same
    assert p50["percentiles_ms"]["ttft_p50"] == pytest.approx(550.0) and p50["percentiles_met"] is True
    p90 = summarize_records(recs, parse_slo("ttft_p90=600ms"))["slo"]
    assert p90["percentiles_ms"] == {"ttft_p90": None}  # the failures make p90 infinite
    assert p90["percentiles_met"] is False
    # find-max-rate: a level whose percentile limit fails does not pass, whatever its attainment
    assert not Level(1.0, 1.0, percentiles_met=False).passes(0.5)
    assert Level(1.0, 1.0).passes(0.5)


@pytest.mark.parametrize("slo", ["ttft=200ms,tpot=20ms", "ttft_p90=200ms,tpot_p99=20ms"])
def test_every_command_accepts_both_forms(slo: str, capsys: pytest.CaptureFixture[str]) -> None:
    # serve bench: the --slo parses, so the command gets as far as asking for the server
    with pytest.raises(SystemExit) as e:
        main(["serve", "bench", "--slo", slo])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--url is required" in err and "--slo" not in err, err
    # serve plan: a whole plan with this SLO
    with pytest.raises(SystemExit) as e:
        main(
            [
                "serve",
                "plan",
                "--profile",
                "opt-13b-a100",
                "--traffic",
                "rate=1;in=fixed:128;out=fixed:32",
                "--mode",
                "aggregated",
                "--sim-requests",
                "200",
                "--max-gpus",
                "8",
                "--json",
                "--slo",
                slo,
            ]
        )
    out = capsys.readouterr().out
    assert e.value.code == 0 and '"slo": {' in out
    want = (
        ('"ttft_p90_ms": 200.0', '"tpot_p90_ms": 20.0')
        if "_p99" not in slo
        else ('"ttft_p90_ms": 200.0', '"tpot_p99_ms": 20.0')
    )
    assert all(w in out for w in want), out


@pytest.mark.parametrize(
    ("command", "keys"),
    [
        (["serve", "bench", "--url", "http://127.0.0.1:9"], BENCH_KEYS),
        (["serve", "plan", "--profile", "opt-13b-a100", "--traffic", "rate=1"], PLAN_KEYS),
    ],
)
@pytest.mark.parametrize("bad", ["latency=200ms", "ttft_p90", "e2e_p95=1s,queue=5s"])
def test_bad_slo_is_one_line_exit_2_listing_valid_keys(
    command: list[str], keys: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if bad.startswith("e2e") and "bench" in command:
        bad = "queue=5s"  # e2e is a bench key
    with pytest.raises(SystemExit) as e:
        main([*command, "--slo", bad])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("gpufleet: error: --slo: bad item") and f"one of {keys} " in err, err
