"""The dashboard and rules name only exported metrics; the MCP helpers on synthetic ledgers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpufleet.core import events as E
from gpufleet.core.ledger import read_events
from gpufleet.observe.rules import RULES, rules_yaml
from gpufleet.observe.sources import SPECS
from gpufleet.reliability.synth import LedgerBuilder

METRIC = re.compile(r"\bgpufleet_[a-z_]+\b")


def _known(name: str) -> bool:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return name in SPECS or (base in SPECS and SPECS[base].kind == "histogram")


def test_rules_name_only_exported_metrics_and_pass_promtool(tmp_path: Path) -> None:
    for r in RULES:
        names = METRIC.findall(r.expr) + METRIC.findall(r.reads)
        assert names and all(_known(n) for n in names), (r.name, names)
    text = rules_yaml()
    f = tmp_path / "rules.yml"
    f.write_text(text)
    if shutil.which("promtool"):
        p = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"SUCCESS: {len(RULES)} rules found" in p.stdout


def test_dashboard_panels_name_only_exported_metrics() -> None:
    pytest.importorskip("grafana_foundation_sdk")
    from gpufleet.observe.dashboard import PANELS, ROWS, export_json, queries

    doc = json.loads(export_json())
    assert doc["uid"] == "gpufleet-overview"
    titles = [p["title"] for p in doc["panels"]]
    assert [t for t in titles if t in ROWS] == list(ROWS)  # fleet, training, serving rows
    qs = queries(doc)
    assert len(qs) == sum(len(p.targets) for p in PANELS)
    for title, expr in qs:
        names = METRIC.findall(expr)
        assert names and all(_known(n) for n in names), (title, names)
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "run", "node", "bench"}


def test_explain_failures_and_redaction(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from gpufleet.observe.mcp_server import explain_failures, redacted_ledger

    b = LedgerBuilder().start().steps(5).checkpoint().steps(3)
    b.fail("crash", rank=1).recover().steps(4).fail("hang", rank=0)
    b.end("max_restarts", exit_code=4)
    b.write(tmp_path / "r")
    why = explain_failures(read_events(tmp_path / "r"))
    assert why["failures_by_cause"] == {"crash": 1, "hang": 1} and why["unrecovered"] == 1
    assert [i["cause"] for i in why["incidents"]] == ["crash", "hang"]
    assert why["incidents"][0]["recovered"] and not why["incidents"][1]["recovered"]
    assert why["sessions"][0]["status"] == "max_restarts"
    assert "crash of rank 1" in why["summary"] and "not recovered" in why["summary"]
    rs = E.RunStart(world_size=2, backend="local", command=("python", "t.py", "--token=s3cr3t"),
                    config={"upload_url": "s3://b"})  # fmt: skip
    from gpufleet.core.ledger import Ledger

    with Ledger(tmp_path / "x") as led:
        led.emit(rs)
    text = redacted_ledger(tmp_path / "x" / "ledger.jsonl")
    assert "s3cr3t" not in text and "upload_url" not in text and json.loads(text)["ev"] == "run_start"


def test_drain_keeps_admin_drains_and_owned_reasons(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from gpufleet.health.nodes import current_state, record_state
    from gpufleet.observe.mcp_server import _drain

    fleet = tmp_path / "fleet"
    record_state("a", "drained", "maintenance", by="admin", fleet=fleet)
    result, detail = _drain(fleet, "a", "bad gpu", "alice", actions=None)
    assert result == E.ActionResult.REFUSED and "admin" in detail
    assert current_state("a", fleet)["by"] == "admin"
    result, _ = _drain(fleet, "b", "bad gpu", "alice", actions=None)
    assert result == E.ActionResult.DONE
    st = current_state("b", fleet)
    assert st["state"] == "drained" and st["reason"] == "gpufleet: mcp: bad gpu (asked by alice via MCP)"
    assert _drain(fleet, "b", "again", "bob", actions=None)[0] == E.ActionResult.DONE  # idempotent
    assert len([e for e in read_events(fleet) if e.get("node") == "b"]) == 1
