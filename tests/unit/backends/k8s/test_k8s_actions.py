"""Cordon/taint through the real `kubernetes` client, against recorded API exchanges at the HTTP boundary
(replay.py; exchanges/*.json, written from the API's shapes: no API server can run here).

The contract, as for Slurm drains: gpufleet's cordon carries an owned reason (annotation) and a taint
and a bad-reputation label in one strategic-merge patch; an administrator's cordon is never touched
(not tainted, never uncordoned); a circuit breaker refuses to isolate more than half the cluster within
its window; every decision is a `node_action` event in the fleet ledger, and a cordon/release a
`node_state`.
"""

from __future__ import annotations

import time

import pytest

from gpufleet.core import events as E
from gpufleet.core.ledger import Ledger, read_events

from .replay import Replay

pytest.importorskip("kubernetes")

from gpufleet.backends.k8s.actions import K8sActions, node_ready  # noqa: E402

DETAIL = "gpu3 xid 79 (fallen off the bus)"
REASON = f"gpufleet: gpu.state: {DETAIL}"


def k8s_events(fleet) -> list[dict]:
    return [e for e in read_events(fleet) if e["ev"] in ("node_action", "node_state")]


def cordoned(node: str, t: float) -> E.NodeAction:
    """A past cordon by gpufleet, as the fleet ledger holds it."""
    done, isolate = E.ActionResult.DONE, E.NodeActionKind.ISOLATE
    return E.NodeAction(t=t, node=node, platform=E.NodePlatform.K8S, action=isolate, result=done, reason="x")


def run(name: str, fleet, call):
    with Replay.load(name) as api:
        result = call(K8sActions(api.core(), fleet=fleet))
    assert not api.mismatches, api.mismatches
    assert not api.exchanges, f"unused exchanges: {api.exchanges}"
    return result, api


def test_cordon_is_one_patch_with_owned_reason_taint_and_label(tmp_path):
    ok, api = run("cordon_healthy", tmp_path, lambda a: a.isolate("gpu-2", "gpu.state", DETAIL))
    assert ok
    patch = api.seen[-1]
    assert patch["method"] == "PATCH" and patch["content_type"] == "application/strategic-merge-patch+json"
    assert patch["body"]["metadata"]["annotations"] == {"gpufleet.io/cordon-reason": REASON}
    evs = k8s_events(tmp_path)
    assert [(e["ev"], e.get("action"), e.get("result"), e.get("state")) for e in evs] == [
        ("node_action", "isolate", "done", None),
        ("node_state", None, None, "drained"),
    ]
    assert evs[0]["reason"] == REASON and evs[0]["check"] == "gpu.state"


def test_a_node_gpufleet_cordoned_already_is_not_patched_again(tmp_path):
    ok, api = run("cordon_again", tmp_path, lambda a: a.isolate("gpu-2", "gpu.state", "again"))
    assert ok and [s["method"] for s in api.seen] == ["GET"] and k8s_events(tmp_path) == []


def test_an_admin_cordon_is_left_alone(tmp_path):
    ok, api = run("cordon_admin", tmp_path, lambda a: a.isolate("gpu-3", "gpu.state", "xid 79"))
    assert not ok and [s["method"] for s in api.seen] == ["GET"]  # no taint, no annotation, no patch
    (ev,) = k8s_events(tmp_path)
    assert (ev["action"], ev["result"]) == ("isolate", "refused") and "someone else" in ev["reason"]
    ok, api = run("release_admin", tmp_path, lambda a: a.release("gpu-3"))
    assert not ok and [s["method"] for s in api.seen] == ["GET"]  # never uncordoned by gpufleet
    assert k8s_events(tmp_path)[-1]["result"] == "refused"


def test_release_undoes_only_gpufleets_own_cordon(tmp_path):
    ok, api = run("release_owned", tmp_path, lambda a: a.release("gpu-2", "health check passes again"))
    assert ok
    body = api.seen[-1]["body"]
    delete = {"$patch": "delete", "key": "gpufleet.io/unhealthy"}
    assert body["spec"] == {"unschedulable": None, "taints": [delete]}
    assert body["metadata"]["annotations"] == {"gpufleet.io/cordon-reason": None}
    evs = k8s_events(tmp_path)
    assert [(e["ev"], e.get("result"), e.get("state")) for e in evs] == [
        ("node_action", "done", None),
        ("node_state", None, "repaired"),
    ]
    assert evs[0]["previous"] == REASON  # the cordon it undid


def test_release_of_another_checks_cordon_is_refused(tmp_path):
    # the same recorded node (cordoned for gpu.state), asked to release only gpu.xid's cordons
    with Replay.load("cordon_again") as api:
        ok = K8sActions(api.core(), fleet=tmp_path).release("gpu-2", only_check="gpu.xid")
    assert not ok and not api.mismatches
    assert k8s_events(tmp_path)[-1]["result"] == "refused"


def test_circuit_breaker_refuses_past_half_the_cluster(tmp_path, capsys):
    now = time.time()
    with Ledger(tmp_path) as fl:  # two of four nodes isolated within the window already
        for n in ("gpu-1", "gpu-2"):
            fl.emit(cordoned(n, now - 60))
    ok, api = run("cordon_breaker", tmp_path, lambda a: a.isolate("gpu-4", "gpu.state", "xid 79"))
    assert not ok and [s["method"] for s in api.seen] == ["GET", "GET"]  # read, count, no patch
    ev = k8s_events(tmp_path)[-1]
    assert (ev["node"], ev["result"]) == ("gpu-4", "refused") and "circuit breaker open: 3/4" in ev["reason"]
    assert "ALERT" in capsys.readouterr().err


def test_breaker_window_forgets_old_cordons(tmp_path):
    with Ledger(tmp_path) as fl:  # the same two, but an hour ago: outside the 300 s window
        for n in ("gpu-1", "gpu-3"):
            fl.emit(cordoned(n, time.time() - 3600))
    ok, _ = run("cordon_healthy", tmp_path, lambda a: a.isolate("gpu-2", "gpu.state", DETAIL))
    assert ok


def test_api_error_is_recorded_as_failed(tmp_path):
    ok, _ = run("cordon_forbidden", tmp_path, lambda a: a.isolate("gpu-2", "gpu.state", DETAIL))
    assert not ok
    (ev,) = k8s_events(tmp_path)
    assert (ev["result"], ev["reason"]) == ("failed", "API 403: Forbidden")


def test_node_ready_reads_the_ready_condition(tmp_path):
    with Replay.load("ready_checks") as api:
        core = api.core()
        assert [node_ready(core, n) for n in ("gpu-1", "gpu-2", "gpu-9")] == [True, False, False]
    assert not api.mismatches and not api.exchanges
