"""`gpufleet health check/watch` and `gpufleet nodes` end to end, as subprocesses, on this CPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.health.fakes import FAKE_NVML_MODULE, data_path

ROOT = Path(__file__).resolve().parents[2]
FAST = {"samples": 80, "cpu_mb": 8, "seconds": 0.1}


def gf(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def write_plan(path: Path, *checks: str, params: dict | None = None) -> str:
    lines = ['name = "itest"', "budget_s = 60", "valid_s = 600"]
    for c in checks:
        lines += ["[[checks]]", f'name = "{c}"']
        if params and c in params:
            lines.append(
                "params = " + "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in params[c].items()) + " }"
            )
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def fleet(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "fleet"
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(d))
    monkeypatch.setenv("GPUFLEET_HEALTH_PATHS", str(tmp_path))
    return d


def test_quick_plan_on_cpu_json_and_ledger(fleet):
    p = gf("health", "check", "--json", "--node", "cpu-1")
    # Real measurements on a shared 2-core CI box: a busy neighbour can make one CPU lane look slow
    # (a correct FAIL of the relative check), so this test checks the contract, not the verdict.
    assert p.returncode in (0, 1), p.stdout + p.stderr
    rep = json.loads(p.stdout)
    assert (
        rep["schema"] == "gpufleet.health/1" and rep["profile"] == "CPU" and rep["exit_code"] == p.returncode
    )
    assert (rep["counts"]["FAIL"] > 0) == (p.returncode == 1) and rep["counts"]["INCOMPLETE"] == 0
    assert {"host.resources", "compute.matmul", "memory.bandwidth", "storage.throughput"} <= {
        r["check"] for r in rep["results"]
    }
    for r in rep["results"]:
        assert set(r) >= {"check", "status", "value", "unit", "threshold", "duration_s", "hint", "detail"}
    evs = [json.loads(x) for x in (fleet / "ledger.jsonl").read_text().splitlines()]
    assert len(evs) == len(rep["results"]) and all(e["ev"] == "health_result" for e in evs)


def test_table_output_names_the_bad_gpu_and_exits_1(fleet):
    env = {
        "GPUFLEET_NVML_MODULE": FAKE_NVML_MODULE,
        "GPUFLEET_FAKE_NVML": str(data_path("nvml_h100_bad_gpu3.json")),
        "GPUFLEET_KERNEL_LOG": str(data_path("kern_xid79.log")),
        "COLUMNS": "200",
    }
    plan = write_plan(fleet.parent / "gpu.toml", "gpu.inventory", "gpu.state", "gpu.xid")
    p = gf("health", "check", "--plan", plan, env=env)  # profile detected from the fake NVML: H100
    assert p.returncode == 1, p.stdout + p.stderr
    assert "profile H100" in p.stdout and "gpu3" in p.stdout and "FAIL" in p.stdout and "xid 79" in p.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--plan", "nope"], "valid: quick, postfail, acceptance"),
        (["--profile", "V100"], "valid: CPU, H100, H200, GB200, B200, A100"),
        (["--plan", "__BAD__"], "unknown check 'gpu.frob'; valid:"),
    ],
)
def test_bad_input_is_one_line_exit_2(fleet, args, needle):
    bad = fleet.parent / "bad.toml"
    bad.write_text('name = "b"\nbudget_s = 5\n[[checks]]\nname = "gpu.frob"\n')
    args = [str(bad) if a == "__BAD__" else a for a in args]
    p = gf("health", "check", *args)
    assert p.returncode == 2 and needle in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_incomplete_only_exits_3(fleet):
    plan = write_plan(
        fleet.parent / "clock.toml", "host.clock", params={"host.clock": {"clock_command": "no-chronyc x"}}
    )
    p = gf("health", "check", "--plan", plan, "--json")
    assert p.returncode == 3 and json.loads(p.stdout)["status"] == "INCOMPLETE"


def test_gloo_allreduce_two_processes(fleet):
    plan = write_plan(
        fleet.parent / "coll.toml",
        "collective.allreduce",
        params={"collective.allreduce": {"cpu_mb": 1, "iters": 3}},
    )
    p = gf("health", "check", "--plan", plan, "--json", "--no-record")
    rep = json.loads(p.stdout)
    (r,) = rep["results"]
    assert r["status"] == "OK", r
    assert r["device"] == "gloox2" and r["data"]["busbw"] == pytest.approx(
        r["data"]["algbw"] * 2 * (2 - 1) / 2
    )


def nvml(recording: str) -> dict[str, str]:
    """Environment selecting the shipped fake NVML module and one of its recordings."""
    return {"GPUFLEET_NVML_MODULE": FAKE_NVML_MODULE, "GPUFLEET_FAKE_NVML": str(data_path(recording))}


def test_watch_moves_node_to_suspect_and_back_and_nodes_shows_it(fleet):
    # Recorded NVML state, not measurements, so every round's verdict is fixed: gpu3 of the bad
    # recording fails gpu.state (ECC, row remapping, throttling), the OK recording passes.
    plan = write_plan(fleet.parent / "gpu.toml", "gpu.state")
    watch = ("health", "watch", "--plan", plan, "--interval", "0", "--node", "w1", "--json")
    p = gf(*watch, "--count", "2", env=nvml("nvml_h100_bad_gpu3.json"))
    assert p.returncode == 0, p.stderr
    rounds = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(rounds) == 2 and [r["status"] for r in rounds] == ["FAIL", "FAIL"]
    assert rounds[0]["transition"]["state"] == "suspect"
    assert rounds[0]["transition"]["reason"].startswith("gpufleet: gpu.state [gpu3]: ")
    assert rounds[1]["transition"] is None  # still failing: no new transition
    p = gf(*watch, "--count", "1", env=nvml("nvml_h100_ok.json"))  # the GPU was repaired
    assert p.returncode == 0, p.stderr
    (repaired,) = [json.loads(x) for x in p.stdout.splitlines()]
    assert repaired["status"] == "OK" and repaired["transition"]["state"] == "healthy"
    p = gf("nodes", "--json")
    out = json.loads(p.stdout)
    (row,) = out["nodes"]
    assert row["node"] == "w1" and row["state"] == "healthy" and row["failures"] == 1 and row["repairs"] == 1
    assert row["failures_by_component"] == {"gpu": 1} and out["exclude"] == []
    p = gf("nodes", "--lemon-failures", "1", env={"COLUMNS": "200"})
    assert p.returncode == 0 and "LEMON" in p.stdout and "exclude list: w1" in p.stdout


def test_acceptance_script_dry_run(tmp_path, fleet):
    out = tmp_path / "acc.json"
    plan = write_plan(
        tmp_path / "acc.toml",
        "host.resources",
        "gpu.inventory",
        "compute.matmul",
        "memory.bandwidth",
        # The dry run tests the script's flow; the peer rule on two shared CPU cores is load-dependent.
        params={"compute.matmul": {**FAST, "peer_rule": False}, "memory.bandwidth": FAST},
    )
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_acceptance.sh"), "--dry-run", "--plan", plan, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GPUFLEET_PYTHON": sys.executable},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text())["profile"] == "CPU"
    assert "measured" in p.stdout and "expected" in p.stdout
    assert "matmul (bf16 on GPU, fp32 on CPU): cpu" in p.stdout and "expected >= 5 GFLOPS" in p.stdout
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_acceptance.sh"), "--bogus"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2


def test_watch_acts_on_an_allowed_xid_class_only(fleet, tmp_path):
    """`watch --act reboot` drains the node for XID 79 through Slurm (stand-in sinfo/scontrol on
    PATH); a bad class is one line on stderr, exit 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/sh\nprintf 'x1|idle|none\\nx2|idle|none\\nx3|idle|none\\n'\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {bin_dir}/scontrol.args\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**nvml("nvml_h100_ok.json"), "GPUFLEET_KERNEL_LOG": str(data_path("kern_xid79.log"))}
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    plan = write_plan(fleet.parent / "xid.toml", "gpu.xid")
    watch = ("health", "watch", "--plan", plan, "--interval", "0", "--node", "x1", "--json", "--count", "1")
    p = gf(*watch, "--act", "frob", env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "unknown action class frob" in p.stderr
    p = gf(*watch, env=env)  # no --act: a recommendation only
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["remedy"] == {"action": "reboot", "outcome": "not allowed"}
    assert not (bin_dir / "scontrol.args").exists()
    p = gf(*watch, "--act", "reboot,reset_gpu", env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["remedy"] == {"action": "reboot", "outcome": "isolated"}
    assert "state=drain reason=gpufleet: gpu.xid: reboot: xid 79" in (bin_dir / "scontrol.args").read_text()
