"""Node state log: record_state, node_table (MTBF/MTTR/components/lemons), exclude_list."""

from __future__ import annotations

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.core.ledger import read_events
from gpufleet.health.nodes import exclude_list, fleet_dir, node_table, record_state

H = 3600.0


def test_fleet_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUFLEET_FLEET_DIR", raising=False)
    assert str(fleet_dir()) == ".gpufleet/fleet"
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path))
    assert fleet_dir() == tmp_path
    assert fleet_dir("x").name == "x"


def test_record_state_writes_node_state_event(tmp_path):
    record_state("n1", "suspect", "gpu.ecc: 3 uncorrected", component="gpu", check="gpu.ecc", fleet=tmp_path)
    (e,) = read_events(tmp_path)
    assert e["ev"] == "node_state"
    assert (e["node"], e["state"], e["component"], e["check"], e["by"]) == (
        "n1",
        "suspect",
        "gpu",
        "gpu.ecc",
        "gpufleet",
    )


@pytest.mark.parametrize(
    "kw", [{"state": "broken"}, {"state": "healthy", "component": "cpu"}, {"state": "healthy", "by": "bob"}]
)
def test_record_state_rejects_unknown_values(tmp_path, kw):
    with pytest.raises(UsageError, match="valid:"):
        record_state("n1", reason="r", fleet=tmp_path, **kw)


def test_mtbf_mttr_components_and_exclude(tmp_path):
    f = tmp_path
    # n1: in service 10 h, fails (gpu), drained, repaired, validated after 4 h total; in service 10 h more.
    record_state("n1", "in_service", "admitted", fleet=f, t=0)
    record_state("n1", "suspect", "xid 79", component="gpu", fleet=f, t=10 * H)
    record_state("n1", "drained", "xid 79", component="gpu", fleet=f, t=10.5 * H)  # same failure
    record_state("n1", "repaired", "gpu swapped", by="admin", fleet=f, t=13 * H)
    record_state("n1", "validated", "acceptance ok", fleet=f, t=14 * H)
    record_state("n1", "suspect", "storage slow", component="storage", fleet=f, t=24 * H)
    # n2: healthy all along.
    record_state("n2", "healthy", "quick ok", fleet=f, t=0)
    rows = {r.node: r for r in node_table(f, now=30 * H)}
    n1, n2 = rows["n1"], rows["n2"]
    assert n1.failures == 2 and n1.repairs == 1
    assert n1.mttr_s == pytest.approx(4 * H)
    assert n1.mtbf_s == pytest.approx(20 * H / 2)  # 10 h + 10 h good time
    assert n1.failures_by_component == {"gpu": 1, "storage": 1}
    assert n1.state == "suspect" and n1.since == 24 * H
    assert n2.failures == 0 and n2.mtbf_s is None and n2.mttr_s is None
    assert exclude_list(f, now=30 * H) == ["n1"]


def test_lemon_flag_window_and_setting(tmp_path, monkeypatch):
    f = tmp_path
    for i in range(3):
        record_state("n3", "suspect", "x", component="gpu", fleet=f, t=i * 10 * H)
        record_state("n3", "healthy", "ok", fleet=f, t=i * 10 * H + H)
    (row,) = node_table(f, now=30 * H)
    assert row.lemon and row.state == "healthy"
    assert exclude_list(f, now=30 * H) == ["n3"]  # healthy now but a repeat offender
    assert not node_table(f, now=30 * H, lemon_failures=4)[0].lemon
    assert not node_table(f, now=30 * H, lemon_window_days=0.5)[0].lemon  # only one failure in 12 h
    monkeypatch.setenv("GPUFLEET_LEMON_FAILURES", "5")
    assert not node_table(f, now=30 * H)[0].lemon


def test_empty_fleet(tmp_path):
    assert node_table(tmp_path / "none") == [] and exclude_list(tmp_path / "none") == []
