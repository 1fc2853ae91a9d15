"""The sbatch script (golden file), job submission parsing, srun argv, and the slurm-config snippets."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpufleet.backends.slurm import sbatch as B
from gpufleet.backends.slurm.srun import SrunBackend
from gpufleet.cli.health import slurm as H
from gpufleet.core.errors import ConfigError, UsageError

GOLDEN = Path(__file__).resolve().parents[3] / "golden" / "slurm"


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


def spec(**kw) -> B.SbatchSpec:
    base = dict(
        command=["python", "train.py", "--steps", "100"],
        run_dir="/shared/runs/exp1",
        nodes=4,
        spare_nodes=1,
        min_nodes=3,
        nproc_per_node=8,
        partition="gpu",
        time="12:00:00",
        job_name="exp1",
        exclude=["gpu-17", "gpu-03", "gpu-17"],
        supervisor_flags=["--checkpoint-every", "auto", "--max-restarts", "20"],
        python="/opt/venv/bin/python",
        workdir="/home/alice/proj",
    )
    base.update(kw)
    return B.SbatchSpec(**base)


def test_sbatch_golden_full():
    golden("full.sbatch", B.render_sbatch(spec()))


def test_sbatch_golden_minimal():
    s = spec(
        spare_nodes=0,
        min_nodes=None,
        partition=None,
        time=None,
        exclude=[],
        supervisor_flags=[],
        nodes=2,
        nproc_per_node=1,
        job_name="gpufleet",
    )
    golden("minimal.sbatch", B.render_sbatch(s))


def test_sbatch_script_is_valid_bash(tmp_path):
    p = tmp_path / "job.sbatch"
    p.write_text(B.render_sbatch(spec()))
    assert subprocess.run(["bash", "-n", str(p)]).returncode == 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(nodes=0),
        dict(min_nodes=5),
        dict(time="tomorrow"),
        dict(command=[]),
        dict(spare_nodes=-1),
        dict(time="2"),
        dict(time="1:30", signal_s=120),  # USR1 would come at once: a requeue loop
    ],
)
def test_sbatch_spec_rejects_bad_values(bad):
    with pytest.raises(ConfigError):
        spec(**bad)


@pytest.mark.parametrize(
    "value,seconds",
    [("30", 1800), ("2:30", 150), ("12:00:00", 43200), ("1-0", 86400), ("1-2:30", 95400), ("1-2:3:5", 93785)],
)
def test_time_limit_seconds(value, seconds):
    assert B.time_limit_s(value) == seconds


def test_parse_jobid():
    assert B.parse_jobid("1234\n") == "1234"
    assert B.parse_jobid("1234;cluster2\n") == "1234"
    with pytest.raises(UsageError):
        B.parse_jobid("sbatch: error: Batch job submission failed\n")


def test_cli_dry_run_writes_script_with_supervisor_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(tmp_path / "fleet"))
    monkeypatch.setenv("PATH", "/nonexistent")  # no sinfo: exclusions come from the log only
    from gpufleet.health.nodes import record_state

    record_state("gpu-9", "drained", "xid 79", fleet=tmp_path / "fleet")
    p = subprocess.run(
        [
            os.sys.executable,
            "-m",
            "gpufleet.cli.main",
            "run",
            "--backend",
            "slurm",
            "--dry-run",
            "--nodes",
            "2",
            "-n",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "--hang-timeout",
            "7",
            "--no-standby",
            "--inject",
            "kill:rank=1,step=5",
            "--",
            "python",
            "t.py",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": os.environ["PATH"]},
    )
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "run" / "job.sbatch").read_text()
    assert "#SBATCH --exclude=gpu-9" in text
    for part in ("--hang-timeout 7.0", "--no-standby", "--inject kill:rank=1,step=5", "-- python t.py &"):
        assert part in text
    assert "--backend srun --nodes 2 --min-nodes 2 --nproc-per-node 2" in text


def test_srun_argv_and_node_bounds():
    b = SrunBackend(nodes=2, min_nodes=1, nodelist=["n1", "n2", "n3"], python="/py")
    assert b.argv("n2") == [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n2",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--job-name=gpufleet-agent-n2",
        "/py",
        "-m",
        "gpufleet.backends.agent",
    ]
    with pytest.raises(ConfigError):
        SrunBackend(nodes=4, nodelist=["n1", "n2"])
    with pytest.MonkeyPatch.context() as m:
        for k in list(os.environ):
            if k.startswith("SLURM_"):
                m.delenv(k)
        with pytest.raises(ConfigError, match="inside a Slurm allocation"):
            SrunBackend()


def test_slurm_config_snippets_golden():
    out = H.render(
        slurm_conf="/etc/slurm/slurm.conf",
        script_dir="/etc/slurm",
        interval=300,
        gpufleet="/opt/venv/bin/gpufleet",
        python="/opt/venv/bin/python",
        fleet_dir="/shared/fleet",
        path="/opt/venv/bin:/usr/bin:/bin",
    )
    golden("slurm-config.txt", "".join(f"# ---- {k}\n{v}" for k, v in out.items()))
    assert "scontrol" not in out["gpufleet-prolog.sh"]  # no Slurm commands in a prolog
    for name in ("gpufleet-healthcheck.sh", "gpufleet-prolog.sh", "gpufleet-epilog.sh"):
        assert "export SLURM_CONF=" in out[name] and "export PATH=" in out[name]


def test_install_replaces_its_block_and_refuses_foreign_settings(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    scripts = H.render(slurm_conf=str(conf), script_dir=str(tmp_path), interval=5, python="/py")
    H.install(str(conf), scripts)
    H.install(str(conf), scripts)  # idempotent
    text = conf.read_text()
    assert text.count("HealthCheckProgram=") == 1 and "Prolog=" not in text
    assert os.access(tmp_path / "gpufleet-healthcheck.sh", os.X_OK)
    H.install(str(conf), scripts, with_prolog=True)
    assert "Prolog=" in conf.read_text()
    conf.write_text("HealthCheckProgram=/usr/sbin/nhc\n")
    with pytest.raises(UsageError, match="HealthCheckProgram"):
        H.install(str(conf), scripts)
