"""`gpufleet report`: the command registered on a bare Typer app, its JSON form and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from gpufleet.cli import report
from gpufleet.core.errors import UsageError
from gpufleet.reliability import metrics
from gpufleet.reliability.render import fmt_bytes, fmt_s
from gpufleet.reliability.synth import LedgerBuilder


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    report.register(app)

    @app.callback()
    def _cb() -> None:  # keep `report` a subcommand
        pass

    return app


def _run_dir(tmp_path: Path) -> Path:
    b = LedgerBuilder(t0=0.0)
    b.start(init_s=2.0)
    b.interval(policy="auto", model="bootstrap", every_steps=5)
    b.steps(5).checkpoint(stall_s=0.1, persist_s=0.8).steps(4)
    b.interval(policy="auto", model="daly", every_steps=12, every_s=12.0, delta_s=0.1, mtbf_s=600.0)
    b.fail("crash", detect_s=0.2, teardown_s=0.5, rejoin_s=0.1, abort_s=0.02)  # rank 0 stays in place
    b.recover(init_s=1.0, load_s=0.3, path="in_process", source="peer_memory").steps(8).checkpoint(
        stall_s=0.1, commit=False
    ).steps(3)
    b.fail("hang", detect_s=10.0, teardown_s=2.0)
    b.recover(init_s=1.0, load_s=0.3).steps(10).end()
    rd = tmp_path / "run"
    b.write(rd)
    return rd


def test_report_rich_and_png(tmp_path: Path) -> None:
    rd = _run_dir(tmp_path)
    res = CliRunner().invoke(_app(), ["report", str(rd)])
    assert res.exit_code == 0, res.output
    words = ("goodput", "MTBF", "MTTR", "checkpoint stall", "recompute", "crash", "hang", "daly")
    in_place = (
        "In-process recoveries (1)",
        "stop the lost rank",
        "re-rendezvous",
        "restore (peer transfer 1)",
    )
    for word in words + in_place:
        assert word in res.output, word
    png = rd / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_json(tmp_path: Path) -> None:
    rd = _run_dir(tmp_path)
    out = tmp_path / "plots" / "t.png"
    res = CliRunner().invoke(_app(), ["report", str(rd), "--json", "--plot", str(out)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["schema"] == metrics.SCHEMA and s["timeline_png"] == str(out) and out.exists()
    assert s["failures"]["by_cause"] == {"crash": 1, "hang": 1}
    assert s["checkpoints"]["failed"] == 1 and s["checkpoints"]["committed"] == 1
    assert [d["model"] for d in s["interval"]] == ["bootstrap", "daly"]
    assert sum(v["s"] for v in s["badput"].values()) == pytest.approx(s["wall_s"])
    assert 0.0 < s["goodput"] < 1.0
    # --json alone writes no PNG
    rd2 = _run_dir(tmp_path / "b")
    res = CliRunner().invoke(_app(), ["report", str(rd2), "--json"])
    assert res.exit_code == 0 and not (rd2 / "timeline.png").exists()
    assert "timeline_png" not in json.loads(res.output)


@pytest.mark.parametrize("kind", ["missing", "no_ledger", "empty"])
def test_report_bad_dir(tmp_path: Path, kind: str) -> None:
    rd = tmp_path / "rd"
    if kind != "missing":
        rd.mkdir()
    if kind == "empty":
        (rd / "ledger.jsonl").write_text("")
    res = CliRunner().invoke(_app(), ["report", str(rd)])
    assert res.exit_code != 0
    assert isinstance(res.exception, UsageError)
    assert "\n" not in str(res.exception)


def test_main_maps_usage_error_to_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from gpufleet.cli import main as cli_main

    # A fresh app with only this command: other command modules may not exist yet.
    monkeypatch.setattr(cli_main, "app", _app())
    monkeypatch.setattr(cli_main, "_register", lambda: None)
    with pytest.raises(SystemExit) as ei:
        cli_main.main(["report", str(tmp_path / "nope")])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gpufleet: error: run directory ") and "no such directory" in err
    assert err.count("\n") == 1


def test_formatters() -> None:
    assert fmt_s(None) == "—" and fmt_s(0.25) == "250 ms" and fmt_s(12.34) == "12.3 s"
    assert fmt_s(245) == "4 m 05 s" and fmt_s(3 * 3600 + 7 * 60) == "3 h 07 m"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 * 1024**3) == "3.0 GiB"
