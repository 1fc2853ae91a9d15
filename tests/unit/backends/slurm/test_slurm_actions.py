"""Slurm node actions: drain/resume ownership and the circuit breaker, with Slurm faked at the
subprocess boundary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.backends.slurm import actions as S
from gpufleet.core import events as E
from gpufleet.core.ledger import read_events
from gpufleet.health.actions import Breaker

# Recorded `sinfo -h -N -o '%N|%T|%E'` output (Slurm 22.05): n2 admin-drained, n3 drained by gpufleet.
SINFO = """n1|idle|none
n2|drained|admin: replacing DIMM, ticket 4711
n3|drained|gpufleet: health: xid 79 on gpu 3
n4|allocated|none
n4|allocated|none
"""


_REAL_RUN = subprocess.run


class FakeSlurm:
    def __init__(self, sinfo: str = SINFO) -> None:
        self.rows = {r.name: r for r in S.parse_sinfo_nodes(sinfo)}
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kw):  # subprocess.run
        assert kw.get("timeout"), "every Slurm command needs a timeout"
        self.calls.append(list(argv))
        if argv[0] == "sinfo":
            names = [argv[argv.index("-n") + 1]] if "-n" in argv else list(self.rows)
            out = "".join(f"{n}|{self.rows[n].state}|{self.rows[n].reason or 'none'}\n" for n in names)
            return subprocess.CompletedProcess(argv, 0, out, "")
        if argv[:2] == ["scontrol", "update"]:
            node = argv[2].split("=", 1)[1]
            if argv[3] == "state=drain":
                self.rows[node] = S.NodeInfo(node, "drained", argv[4].split("=", 1)[1])
            else:
                self.rows[node] = S.NodeInfo(node, "idle", "")
            return subprocess.CompletedProcess(argv, 0, "", "")
        return _REAL_RUN(argv, **kw)  # the health check itself runs for real

    def updates(self) -> list[list[str]]:
        return [c for c in self.calls if c[:2] == ["scontrol", "update"]]


@pytest.fixture
def fake(monkeypatch, tmp_path) -> FakeSlurm:
    f = FakeSlurm()
    monkeypatch.setattr(S.subprocess, "run", f)
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path / "fleet"))
    return f


def test_parse_sinfo_dedups_and_keeps_reason_text():
    rows = S.parse_sinfo_nodes(SINFO)
    assert [r.name for r in rows] == ["n1", "n2", "n3", "n4"]
    assert rows[1].drained and not rows[1].owned
    assert rows[2].drained and rows[2].owned and rows[2].reason.endswith("gpu 3")
    assert not rows[0].drained and rows[0].reason == ""
    assert S.NodeInfo("x", "draining", "").drained and S.NodeInfo("x", "drained*", "").drained


def test_drain_uses_owned_prefix_and_records_state(fake, tmp_path):
    assert S.SlurmActions().isolate("n1", "health", "matmul 20%\nbelow peers", component="gpu")
    (cmd,) = fake.updates()
    reason = "reason=gpufleet: health: matmul 20% below peers"
    assert cmd == ["scontrol", "update", "nodename=n1", "state=drain", reason]
    evs = read_events(tmp_path / "fleet")
    assert [e["ev"] for e in evs] == ["node_action", "node_state"]
    assert (evs[0]["platform"], evs[0]["action"], evs[0]["result"]) == ("slurm", "isolate", "done")
    assert evs[1]["state"] == "drained" and evs[1]["component"] == "gpu"


def test_admin_drain_is_never_overwritten_or_resumed(fake, tmp_path):
    acts = S.SlurmActions()
    assert acts.isolate("n2", "health", "x") is False
    assert acts.release("n2") is False
    assert fake.updates() == []
    assert fake.rows["n2"].reason.startswith("admin:")
    skipped = [e for e in read_events(tmp_path / "fleet") if e["ev"] == "node_action"]
    assert [(e["action"], e["result"]) for e in skipped] == [("isolate", "refused"), ("release", "refused")]


def test_resume_only_owned_and_only_check(fake):
    acts = S.SlurmActions()
    assert acts.release("n3", only_check="node-lost") is False  # drained for another check
    assert acts.release("n3", only_check="health") is True
    assert fake.updates() == [["scontrol", "update", "nodename=n3", "state=resume"]]
    assert acts.release("n1") is False  # not drained at all: nothing to do


def test_breaker_refuses_past_half_of_the_fleet_and_alerts(fake, tmp_path, capsys):
    acts = S.SlurmActions(breaker=Breaker(E.NodePlatform.SLURM, max_fraction=0.5, window_s=300))
    assert acts.isolate("n1", "health", "a")  # 1/4
    assert acts.isolate("n4", "health", "b")  # 2/4 = 50%: not more than
    assert acts.isolate("n1", "health", "again")  # same node again: still 2 hit
    fake.rows["n2"] = S.NodeInfo("n2", "idle", "")
    assert acts.isolate("n2", "health", "c") is False  # 3/4 > 50%: alert instead
    assert "circuit breaker open" in capsys.readouterr().err
    assert fake.rows["n2"].state == "idle"
    opened = [e for e in read_events(tmp_path / "fleet") if e.get("hit") is not None]
    assert opened and opened[0]["hit"] == 3 and opened[0]["total"] == 4
    assert (opened[0]["ev"], opened[0]["result"], opened[0]["node"]) == ("node_action", "refused", "n2")


def test_breaker_window_forgets_old_hits(tmp_path):
    b = Breaker(E.NodePlatform.SLURM, tmp_path, max_fraction=0.5, window_s=60)
    from gpufleet.core.ledger import Ledger

    def isolated(node: str, t: float, platform: str = E.NodePlatform.SLURM) -> E.NodeAction:
        done, isolate = E.ActionResult.DONE, E.NodeActionKind.ISOLATE
        return E.NodeAction(t=t, node=node, platform=platform, action=isolate, result=done, reason="x")

    with Ledger(tmp_path) as led:
        led.emit(isolated("a", 1000.0))
        led.emit(isolated("b", 1050.0))
        led.emit(isolated("k", 1050.0, platform=E.NodePlatform.K8S))  # another platform: not counted
    assert b.allows("c", 4, now=1055.0) == (False, 3)
    assert b.allows("c", 4, now=1100.0) == (True, 2)  # a is out of the window
    assert b.allows("c", 4, held={"d"}, now=1100.0) == (False, 3)  # a platform's held nodes count too


def test_timeouts_and_missing_binaries_are_slurm_errors(monkeypatch):
    def slow(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(S.subprocess, "run", slow)
    with pytest.raises(S.SlurmError, match="timed out"):
        S.node_info("n1", timeout=1)
    monkeypatch.setattr(S.subprocess, "run", _REAL_RUN)
    with pytest.raises(S.SlurmError, match="not found"):
        S.run_slurm(["/nonexistent/sinfo"])


def test_healthcheck_drains_on_1_resumes_on_0_ignores_unknown(fake, tmp_path: Path):
    script = tmp_path / "check.sh"
    script.write_text("#!/bin/sh\necho 'fake: ecc errors'\nexit ${RC}\n")
    script.chmod(0o755)
    for rc in ("2",):
        assert S.healthcheck("n1", ["env", f"RC={rc}", str(script)]) == 2
    assert fake.updates() == []
    assert S.healthcheck("n1", ["env", "RC=1", str(script)]) == 1
    assert fake.rows["n1"].reason == "gpufleet: health: fake: ecc errors"
    assert S.healthcheck("n1", ["env", "RC=0", str(script)]) == 0
    assert fake.rows["n1"].state == "idle"
    assert S.healthcheck("n2", ["env", "RC=0", str(script)]) == 0  # admin drain stays
    assert fake.rows["n2"].state == "drained"
