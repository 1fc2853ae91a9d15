"""The packer: capacity, P/D groups in one NVLink domain, anti-affinity, co-location, optimality,
infeasibility, the FFD fallback with a stated gap, determinism (gpufleet.serve.pack.solver)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ortools", reason="the pack extra (ortools) is not installed")

from gpufleet.serve.common.racks import Domain, parse_nodes, parse_racks  # noqa: E402
from gpufleet.serve.pack import solver as pack_mod  # noqa: E402
from gpufleet.serve.pack.plans import Workload, items_of, parse_plan  # noqa: E402
from gpufleet.serve.pack.solver import PackInfeasible, capacity_bound, ffd, pack  # noqa: E402


def agg(name: str, *gpus: int, **extra: Any) -> Workload:
    return parse_plan(
        {"workload": name, "groups": [{"id": f"r{i}", "gpus": g} for i, g in enumerate(gpus)], **extra}, name
    )


def pd(name: str, *groups: tuple[int, int]) -> Workload:
    """P/D groups, each (prefill GPUs, decode GPUs)."""
    gs = []
    for k, (p, d) in enumerate(groups):
        gs += [
            {"id": f"p{k}", "role": "prefill", "gpus": p, "pd_group": f"pd{k}"},
            {"id": f"d{k}", "role": "decode", "gpus": d, "pd_group": f"pd{k}"},
        ]
    return parse_plan({"workload": name, "groups": gs}, name)


def domains_of(r: Any) -> dict[str, list[str]]:
    """workload → domain of each placed instance."""
    out: dict[str, list[str]] = {}
    for p in r.to_json()["placements"]:
        out.setdefault(p["workload"], []).append(p["domain"])
    return out


def test_capacity_respected_and_everything_placed():
    wls = [agg("a", 8, 8, 4, 4, 2, 1), agg("b", 4, 4, 4, 2, 2), pd("c", (2, 4), (1, 2))]
    r = pack(wls, parse_nodes("8x10"))
    assert r.status == "OPTIMAL"
    assert all(ld <= d.gpus for ld, d in zip(r.loads(), r.fleet, strict=True))
    doc = r.to_json()
    assert sum(p["gpus"] for p in doc["placements"]) == sum(w.gpus for w in wls) == 52
    assert r.cost == 7 == r.bound  # 52 GPUs on 8-GPU nodes: ceil(52/8) = 7
    for d in doc["domains"]:  # slots inside a domain do not overlap
        spans = sorted(p["slots"] for p in doc["placements"] if p["domain"] == d["name"])
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert not spans or spans[-1][1] <= d["gpus"]


def test_pd_group_stays_in_one_domain():
    # 3 P/D groups of 1+4 = 5 GPUs and 3 lone TP1 replicas on 8-GPU nodes: splitting a group
    # would let two nodes suffice, keeping groups whole needs three
    wls = [pd("chat", (1, 4), (1, 4), (1, 4)), agg("x", 1, 1, 1)]
    r = pack(wls, parse_nodes("8x4"))
    assert r.status == "OPTIMAL" and r.cost == 3
    groups: dict[str, set[str]] = {}
    for p in r.to_json()["placements"]:
        if p["pd_group"]:
            groups.setdefault(p["pd_group"], set()).add(p["domain"])
    assert len(groups) == 3 and all(len(v) == 1 for v in groups.values())


def test_pd_group_too_big_for_any_domain():
    with pytest.raises(
        PackInfeasible,
        match=r"P/D group 'pd0' of workload 'big' needs 12 GPUs in one "
        r"NVLink domain; the largest domain has 8",
    ):
        pack([pd("big", (4, 8))], parse_nodes("8x4"))


def test_anti_affinity_spreads_replicas():
    wls = [agg("a", 2, 2, 2)]
    assert pack(wls, parse_racks("nvl36:3")).cost == 1  # all on one rack without it
    r = pack(wls, parse_racks("nvl36:3"), anti_affinity=True)
    assert r.status == "OPTIMAL" and r.cost == 3
    assert sorted(domains_of(r)["a"]) == ["nvl36-0", "nvl36-1", "nvl36-2"]
    # per plan, from the file: only that workload is spread
    r2 = pack([agg("a", 2, 2, 2, anti_affinity=True), agg("b", 2, 2)], parse_racks("nvl36:3"))
    assert len(set(domains_of(r2)["a"])) == 3 and r2.cost == 3


def test_anti_affinity_short_of_domains():
    with pytest.raises(
        PackInfeasible,
        match=r"workload 'a' has 4 replica instances but only 3 domains.*"
        r"short by 1 domain",
    ):
        pack([agg("a", 1, 1, 1, 1)], parse_nodes("8x3"), anti_affinity=True)


def test_co_location_of_workloads():
    r = pack([agg("a", 8, 8), pd("b", (4, 8)), agg("c", 16)], parse_racks("nvl72:3"))
    assert r.cost == 1 and {d for ds in domains_of(r).values() for d in ds} == {"nvl72-0"}
    assert r.to_json()["domains"][0]["workloads"] == {"a": 16, "b": 12, "c": 16}


def test_optimal_where_ffd_uses_one_more_node():
    # sizes 4,3,3,2,2,2 on 8-GPU nodes: optimum {4,2,2} {3,3,2} = 2 nodes; FFD: {4,3} {3,2,2} {2} = 3
    wls = [agg("a", 4, 2, 2, 2), pd("b", (1, 2), (1, 2))]
    items = items_of(wls)
    fleet = parse_nodes("8x4")
    anti = [False] * len(items)
    f = ffd(items, fleet, anti)
    assert f is not None and len(set(f)) == 3
    r = pack(wls, fleet)
    assert (r.status, r.method, r.cost, r.bound, r.ffd_cost) == ("OPTIMAL", "cp-sat", 2, 2, 3)
    assert r.gap == 0 and r.ffd_gap == pytest.approx(0.5)
    assert r.to_json()["cpsat"]["status"] == "OPTIMAL"


def test_per_domain_cost_picks_the_cheaper_racks():
    fleet = parse_racks("nvl72:2,nvl36:2@0.55")
    r30 = pack([agg("a", 8, 8, 8, 6)], fleet)  # 30 GPUs: one NVL36 (0.55) beats one NVL72 (1.0)
    assert r30.cost == pytest.approx(0.55) and set(domains_of(r30)["a"]) == {"nvl36-0"}
    r40 = pack([agg("a", 8, 8, 8, 8, 8)], fleet)  # 40 GPUs: one NVL72 (1.0) beats two NVL36 (1.1)
    assert r40.cost == pytest.approx(1.0) and set(domains_of(r40)["a"]) == {"nvl72-0"}
    assert r40.status == "OPTIMAL" and r40.bound == pytest.approx(1.0)


def test_fragmentation_tie_break():
    # 4,4,2,2 on 8-GPU nodes: two nodes either way; {4,4} {2,2} leaves one partly free node, not two
    r = pack([agg("a", 4, 4, 2, 2)], parse_nodes("8x3"))
    assert r.cost == 2 and r.fragmentation == 1
    assert sorted(x for x in r.loads() if x) == [4, 8]


def test_not_enough_capacity_says_what_is_short():
    with pytest.raises(PackInfeasible, match=r"need 80 GPUs, the fleet has 72 .*short by 8 GPUs"):
        pack([agg("a", *[8] * 10)], parse_racks("nvl72:1"))


def test_infeasible_by_shape_reports_the_shortfall():
    # three 5-GPU replicas, 16 GPUs in two nodes: enough GPUs, no packing
    with pytest.raises(PackInfeasible, match=r"no placement fits .*1 more hgx8 domain"):
        pack([agg("a", 5, 5, 5)], parse_nodes("8x2"))


def test_tiny_time_limit_falls_back_to_ffd_with_a_gap():
    wls = [agg("a", 4, 2, 2, 2), pd("b", (1, 2), (1, 2))]
    r = pack(wls, parse_nodes("8x4"), time_limit=1e-6, workers=1)
    assert r.status == "FEASIBLE" and r.method == "ffd" and r.cpsat["status"] == "UNKNOWN"
    assert (r.cost, r.bound) == (3, 2) and r.gap == pytest.approx(0.5)
    assert any("time limit" in n for n in r.notes) and any("first-fit" in n for n in r.notes)
    doc = r.to_json()
    assert doc["gap"] == pytest.approx(0.5) and doc["ffd"]["gap"] == pytest.approx(0.5)


def test_fallback_keeps_a_cheaper_cp_sat_solution(monkeypatch):
    wls = [agg("a", 4, 2, 2, 2), pd("b", (1, 2), (1, 2))]
    real = pack_mod._solve

    def stopped(*args: Any, **kw: Any) -> Any:
        st, assign, bound, info = real(*args, **kw)
        return "FEASIBLE", assign, 1.0, {**info, "status": "FEASIBLE"}

    monkeypatch.setattr(pack_mod, "_solve", stopped)
    r = pack(wls, parse_nodes("8x4"))
    assert (r.status, r.method, r.cost, r.ffd_cost) == ("FEASIBLE", "cp-sat", 2, 3)
    assert r.bound == 2  # the capacity bound beats CP-SAT's weaker reported bound
    assert r.gap == 0


def test_ffd_solver_only():
    r = pack([agg("a", 4, 2, 2, 2), pd("b", (1, 2), (1, 2))], parse_nodes("8x4"), solver="ffd")
    assert (r.status, r.method, r.cost, r.bound) == ("FFD", "ffd", 3, 2)
    assert r.cpsat == {} and r.params["solver"] == "ffd"


def test_deterministic():
    wls = [agg("a", 4, 4, 2, 2, 1, 1, 1), pd("b", (1, 2), (2, 4), (1, 1)), agg("c", 8, 2, 2)]
    docs = [pack(wls, parse_nodes("8x8"), workers=4).to_json() for _ in range(3)]
    assert docs[0]["placements"] == docs[1]["placements"] == docs[2]["placements"]


def test_capacity_bound_heterogeneous():
    items = items_of([agg("a", 40)])
    assert capacity_bound(items, [Domain("x", "big", 72, 1.0)]) == 1.0
    fleet = [Domain("s", "nvl36", 36, 0.36), Domain("b", "nvl72", 72, 1.0)]
    # cheapest per GPU first: all 36 of the NVL36 (0.36) + 4/72 of the NVL72
    assert capacity_bound(items, fleet) == pytest.approx(0.36 + 4 / 72)


def test_no_items_and_empty_fleet():
    with pytest.raises(PackInfeasible, match="empty"):
        pack([agg("a", 1)], [])
    with pytest.raises(ValueError, match="solver"):
        pack([agg("a", 1)], parse_nodes("8x1"), solver="glpk")
