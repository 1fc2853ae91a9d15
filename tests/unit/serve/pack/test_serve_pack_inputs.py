"""Bad inputs of the packer (plans, rack types, fleet grammar) and the renderers (gpufleet.serve.pack_*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.serve.common.racks import RACK_TYPES, build_fleet, parse_nodes, parse_racks, rack_type
from gpufleet.serve.pack.plans import items_of, load_plan, load_plans, parse_plan

GOOD = {
    "schema": "gpufleet.serve.plan",
    "version": 1,
    "workload": "w",
    "config": {"mode": "disaggregated"},
    "gpus": 4,
    "groups": [
        {"id": "p0", "role": "prefill", "tp": 1, "gpus": 1, "pd_group": "pd0"},
        {"id": "d0", "role": "decode", "tp": 1, "gpus": 1, "pd_group": "pd0"},
        {"id": "r0", "role": "decode", "tp": 2, "gpus": 2, "pd_group": None},
    ],
}


def test_plan_v1_reads_groups_and_pd_items():
    w = parse_plan(GOOD, "g.json")
    assert (w.name, w.mode, w.gpus, len(w.groups)) == ("w", "disaggregated", 4, 3)
    items = items_of([w])
    assert [(i.role, i.key, i.gpus) for i in items] == [("pd", "pd0", 2), ("decode", "r0", 2)]


@pytest.mark.parametrize(
    "doc, match",
    [
        ([1, 2], "expected a JSON object"),
        ({**GOOD, "schema": "gpufleet.serve.summary"}, "is not a plan"),
        ({**GOOD, "version": 2}, "version 2 is not supported"),
        ({**GOOD, "workload": ""}, "'workload' must be a non-empty string"),
        ({**GOOD, "groups": []}, "'groups' must be a non-empty list"),
        ({**GOOD, "groups": [{"gpus": 0}]}, r"groups\[0\].gpus must be an integer >= 1"),
        ({**GOOD, "groups": [{"gpus": "2"}]}, r"groups\[0\].gpus must be an integer"),
        ({**GOOD, "groups": [{"gpus": True}]}, r"groups\[0\].gpus must be an integer"),
        ({**GOOD, "groups": ["x"]}, r"groups\[0\] must be an object"),
        ({**GOOD, "groups": [{"id": "a", "gpus": 1}, {"id": "a", "gpus": 1}]}, "'a' appears twice"),
        ({**GOOD, "gpus": 5}, "'gpus' is 5 but its groups hold 4 GPUs"),
        ({**GOOD, "config": {"mode": "hybrid"}}, "mode must be one of aggregated, disaggregated"),
        ({**GOOD, "anti_affinity": "yes"}, "'anti_affinity' must be true or false"),
        ({**GOOD, "groups": [{"gpus": 1, "pd_group": [1]}]}, "pd_group must be a string"),
    ],
)
def test_malformed_plans_are_one_line_usage_errors(doc, match):
    with pytest.raises(UsageError, match=match) as e:
        parse_plan(doc, "p.json")
    assert "\n" not in str(e.value) and "plan p.json" in str(e.value)


def test_plan_files(tmp_path: Path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_plan(tmp_path / "bad.json")
    with pytest.raises(UsageError, match="cannot read it"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    ws = load_plans([tmp_path / "a.json", tmp_path / "a.json"])  # the same plan twice: renamed
    assert [w.name for w in ws] == ["w", "w-2"] and {g.workload for g in ws[1].groups} == {"w-2"}


def test_minimal_hand_written_plan_infers_mode():
    assert parse_plan({"workload": "x", "groups": [{"gpus": 2}]}, "x").mode == "aggregated"
    assert parse_plan({"workload": "x", "groups": [{"gpus": 2, "pd_group": 0}]}, "x").mode == "disaggregated"
    assert parse_plan({**GOOD, "feasible": False}, "x").feasible is False


def test_rack_types_registry():
    assert {k: t.gpus for k, t in RACK_TYPES.items()} == {"nvl72": 72, "nvl36": 36, "hgx8": 8}
    with pytest.raises(
        UsageError,
        match=r"unknown rack type 'dgx9'; valid: nvl72 \(72 GPUs\), nvl36 "
        r"\(36 GPUs\), hgx8 \(8 GPUs\)",
    ):
        rack_type("dgx9")
    assert rack_type("NVL72").gpus == 72


def test_fleet_grammar():
    f = parse_racks("nvl72:2,nvl36:1@0.55,nvl72:1")
    assert [(d.name, d.gpus, d.cost) for d in f] == [
        ("nvl72-0", 72, 1.0),
        ("nvl72-1", 72, 1.0),
        ("nvl36-0", 36, 0.55),
        ("nvl72-2", 72, 1.0),
    ]
    n = parse_nodes("8x16")
    assert len(n) == 16 and {(d.type, d.gpus) for d in n} == {("hgx8", 8)} and n[3].name == "node-3"
    assert parse_nodes("4x2@2.5")[0].type == "node4" and parse_nodes("4x2@2.5")[0].cost == 2.5
    for bad, match in [
        ("nvl72", "TYPE:COUNT"),
        ("nvl72:0", "count must be"),
        ("nvl72:2@0", "cost must be"),
        ("foo:2", "unknown rack type 'foo'"),
        ("nvl72:x", "TYPE:COUNT"),
    ]:
        with pytest.raises(UsageError, match=match):
            parse_racks(bad)
    for bad, match in [("8by16", "GPUSxCOUNT"), ("0x4", "GPUs per node"), ("8x0", "count must be")]:
        with pytest.raises(UsageError, match=match):
            parse_nodes(bad)
    with pytest.raises(UsageError, match="exactly one"):
        build_fleet("nvl72:1", "8x2")
    with pytest.raises(UsageError, match="exactly one"):
        build_fleet(None, None)


def test_render_headline_tables_png(tmp_path: Path):
    pytest.importorskip("ortools")
    from gpufleet.serve.pack.render import headline, plot_racks, tables
    from gpufleet.serve.pack.solver import pack

    r = pack(
        [parse_plan(GOOD, "g"), parse_plan({"workload": "x", "groups": [{"gpus": 8}]}, "x")],
        parse_nodes("8x3"),
    )
    line = headline(r)
    assert line.startswith("OPTIMAL: cost 2 (2/3 domains") and "gap 0.0%" in line and "\n" not in line
    dt, wt = tables(r)
    assert dt.row_count == 2 and wt.row_count == 2 and dt.caption == "1 domain(s) unused"
    pytest.importorskip("matplotlib")
    png = plot_racks(r, tmp_path / "racks.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
