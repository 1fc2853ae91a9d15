"""Settings: the worker contract (RunSettings), the supervisor's config, the variable table, durations."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from gpufleet.core.env import Env, Var, declared, read_env
from gpufleet.core.errors import ConfigError, UsageError
from gpufleet.core.exitcodes import ExitCode
from gpufleet.core.settings import SETTING_ENV, RollbackPlan, RunSettings
from gpufleet.core.units import parse_duration, parse_interval
from gpufleet.train.settings import SupervisorConfig


# -- layering: environment over init() keywords over defaults -------------------------------------
def test_defaults_when_nothing_is_set():
    s = RunSettings.load({})
    assert (s.checkpoint_every, s.keep_last, s.spike_window, s.overlap_staging) == ("auto", 3, 50, True)
    assert s.rollback == RollbackPlan() and s.control_fd is None and s.attempt == 0


def test_environment_beats_init_keywords_beats_defaults(tmp_path):
    env = {"GPUFLEET_CKPT_EVERY": "7", "GPUFLEET_OVERLAP": "no", "GPUFLEET_KEEP_LAST": ""}  # "" is unset
    s = RunSettings.load(env, run_dir=str(tmp_path), checkpoint_every=100, keep_last=2, spike_window=9)
    assert s.checkpoint_every == "7"  # environment wins
    assert s.keep_last == 2 and s.spike_window == 9  # keywords win over defaults
    assert s.overlap_staging is False and s.spike_threshold == 8.0
    assert s.ckpt_dir == tmp_path / "checkpoints"


def test_load_reads_os_environ_and_the_supervisor_plumbing(monkeypatch):
    plan = RollbackPlan(max_step=3, skip=((1, 4),))
    monkeypatch.setenv("GPUFLEET_KEEP_LAST", "5")
    monkeypatch.setenv("GPUFLEET_ROLLBACK", plan.to_env())
    monkeypatch.setenv("GPUFLEET_ATTEMPT", "2")
    monkeypatch.setenv("GPUFLEET_CONTROL_FD", "9")
    s = RunSettings.load(keep_last=1)
    assert s.keep_last == 5 and s.rollback == plan and s.attempt == 2 and s.control_fd == 9


def test_rollback_plan_round_trips_through_its_variable():
    plan = RollbackPlan(max_step=20, skip=((20, 43), (50, 61)))
    assert RollbackPlan.from_env(plan.to_env()) == plan
    assert RunSettings.load({"GPUFLEET_ROLLBACK": plan.to_env()}).rollback == plan
    with pytest.raises(ValidationError, match="frozen"):
        plan.max_step = 3  # type: ignore[misc]


def test_supervisor_flags_beat_the_inherited_environment():
    env = {"GPUFLEET_KEEP_LAST": "0", "GPUFLEET_SPIKE_WINDOW": "12"}
    s = RunSettings.for_workers({"keep_last": 4, "mtbf_s": None}, env)
    assert s.keep_last == 4 and s.spike_window == 12 and s.mtbf_s is None


def test_to_env_names_every_setting_by_its_variable():
    out = RunSettings.to_env(
        {"keep_last": 3, "overlap_staging": False, "mtbf_s": None, "upload_url": "s3://b/p"}
    )
    assert out == {"GPUFLEET_KEEP_LAST": "3", "GPUFLEET_OVERLAP": "0", "GPUFLEET_UPLOAD": "s3://b/p"}
    assert RunSettings.load(out).overlap_staging is False  # what the supervisor writes, the worker reads
    assert set(SETTING_ENV.values()) <= set(declared())


# -- every bad value: ConfigError, one line, naming where the value came from ----------------------
BAD_ENV = [
    ("GPUFLEET_KEEP_LAST", "many", "integer"),
    ("GPUFLEET_KEEP_LAST", "0", ">= 1"),
    ("GPUFLEET_SPIKE_WINDOW", "2", ">= 3"),
    ("GPUFLEET_SPIKE_THRESHOLD", "-1", "> 0"),
    ("GPUFLEET_MTBF", "0", "> 0"),
    ("GPUFLEET_MTBF", "nan", "finite"),
    ("GPUFLEET_MTBF", "soon", "number"),
    ("GPUFLEET_CKPT_EVERY", "often", "invalid checkpoint interval"),
    ("GPUFLEET_CKPT_EVERY", "0", "invalid checkpoint interval"),
    ("GPUFLEET_UPLOAD", "http://x", "s3://bucket/prefix"),
    ("GPUFLEET_UPLOAD", "s3://", "s3://bucket/prefix"),
    ("GPUFLEET_S3_ENDPOINT", "localhost:9000", "http"),
    ("GPUFLEET_OVERLAP", "maybe", "true or false"),
    ("GPUFLEET_ATTEMPT", "-1", ">= 0"),
    ("GPUFLEET_CONTROL_FD", "x", "integer"),
    ("GPUFLEET_ROLLBACK", "{nope", "JSON"),
    ("GPUFLEET_ROLLBACK", '{"skip": [[5, 2]]}', "start < end"),
    ("GPUFLEET_ROLLBACK", '{"max_step": 1, "extra": 2}', "extra"),
]


@pytest.mark.parametrize("var, value, needle", BAD_ENV)
def test_bad_environment_value_is_one_line_naming_the_variable(var, value, needle):
    with pytest.raises(ConfigError) as e:
        RunSettings.load({var: value})
    msg = str(e.value)
    assert msg.startswith(f"{var}={value!r}: ") and needle in msg and "\n" not in msg


BAD_KWARGS = [
    ({"keep_last": 0}, ">= 1"),
    ({"keep_last": "x"}, "integer"),
    ({"spike_window": 1}, ">= 3"),
    ({"mtbf_s": -5.0}, "> 0"),
    ({"mtbf_s": math.inf}, "finite"),
    ({"checkpoint_every": "sometimes"}, "invalid checkpoint interval"),
    ({"checkpoint_every": True}, "invalid checkpoint interval"),
    ({"upload_url": "/tmp/bucket"}, "s3://"),
    ({"run_dir": ""}, "empty"),
]


@pytest.mark.parametrize("kwargs, needle", BAD_KWARGS)
def test_bad_init_keyword_is_one_line_naming_the_keyword(kwargs, needle):
    ((name, value),) = kwargs.items()
    with pytest.raises(ConfigError) as e:
        RunSettings.load({}, **kwargs)
    msg = str(e.value)
    assert msg.startswith(f"gpufleet.init({name}={value!r}): ") and needle in msg and "\n" not in msg


def test_unknown_init_keyword_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown gpufleet.init.. option 'checkpoint_evry'; valid: run_dir"):
        RunSettings.load({}, checkpoint_evry="5")
    with pytest.raises(ConfigError, match="unknown"):
        RunSettings.load({}, attempt=3)  # set by the supervisor only


# -- the supervisor's config validates what workers will, before anything starts ----------------------
BAD_CONFIG = [
    ({"command": []}, "no training command"),
    ({"nproc": 0}, "--nproc-per-node 0: must be >= 1"),
    ({"max_restarts": -1}, "--max-restarts -1: must be >= 0"),
    ({"max_no_progress": -2}, "--max-no-progress"),
    ({"max_rollbacks": -1}, "--max-rollbacks"),
    ({"hang_timeout_floor": 0}, "--hang-timeout 0: must be > 0"),
    ({"init_timeout": -3}, "--init-timeout"),
    ({"checkpoint_every": "often"}, "--checkpoint-every 'often': invalid checkpoint interval"),
    ({"keep_last": 0}, "--keep-last 0: must be >= 1"),
    ({"upload_url": "http://x"}, "--upload 'http://x': must look like s3://bucket/prefix"),
    ({"s3_endpoint": "minio:9000"}, "--s3-endpoint 'minio:9000'"),
    ({"mtbf_s": 0.0}, "--mtbf 0.0: must be > 0"),
    ({"inject": ["boom:step=1"]}, "unknown fault kind"),
    ({"colour": "red"}, "colour"),
]


@pytest.mark.parametrize("fields, needle", BAD_CONFIG)
def test_bad_supervisor_config_is_one_line_naming_the_flag(fields, needle):
    with pytest.raises(UsageError) as e:
        SupervisorConfig(**{"command": ["python", "t.py"], **fields})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_supervisor_config_sees_the_environment_workers_will_inherit(monkeypatch):
    monkeypatch.setenv("GPUFLEET_SPIKE_WINDOW", "1")
    with pytest.raises(ConfigError, match="GPUFLEET_SPIKE_WINDOW='1': must be >= 3"):
        SupervisorConfig(command=["python", "t.py"])
    monkeypatch.setenv("GPUFLEET_SPIKE_WINDOW", "20")
    monkeypatch.setenv("GPUFLEET_KEEP_LAST", "0")
    cfg = SupervisorConfig(command=["python", "t.py"], keep_last=2, checkpoint_every=50)  # the flag wins
    assert cfg.worker.keep_last == 2 and cfg.worker.spike_window == 20
    assert cfg.worker_env() == {"GPUFLEET_CKPT_EVERY": "50", "GPUFLEET_KEEP_LAST": "2"}


def test_supervisor_config_parses_its_drills_and_records_itself():
    cfg = SupervisorConfig(command=["python", "t.py"], nproc=2, inject=["kill:rank=1,step=4", "nan:step=9"])
    assert [f.kind for f in cfg.faults] == ["kill", "nan"]
    pub = cfg.public()
    assert pub["inject"] == ["kill:rank=1,step=4", "nan:step=9"] and "faults" not in pub


# -- the variable table ---------------------------------------------------------------------------------
def test_read_env_casts_defaults_and_names_the_variable():
    assert read_env(Env.BREAKER_FRACTION, float, 0.5, {}) == 0.5
    assert read_env(Env.BREAKER_FRACTION, float, 0.5, {"GPUFLEET_BREAKER_FRACTION": "0.25"}) == 0.25
    assert read_env(Env.NODE, str, None, {"GPUFLEET_NODE": ""}) is None
    with pytest.raises(ConfigError, match="GPUFLEET_LEMON_FAILURES='lots' is not a valid int"):
        read_env(Env.LEMON_FAILURES, int, 3, {"GPUFLEET_LEMON_FAILURES": "lots"})
    with pytest.raises(ConfigError, match="finite"):
        read_env(Env.BREAKER_WINDOW_S, float, 300.0, {"GPUFLEET_BREAKER_WINDOW_S": "inf"})
    assert all(v.startswith("GPUFLEET_") for v in vars(Env).values() if isinstance(v, Var))


# -- one duration grammar ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, seconds",
    [
        ("200ms", 0.2),
        ("0.5s", 0.5),
        ("150us", 150e-6),
        ("2m", 120.0),
        ("1.5min", 90.0),
        ("1h", 3600.0),
        ("2hr", 7200.0),
        ("12sec", 12.0),
        ("3", 3.0),
        (" 4 s ", 4.0),
        ("1e3ms", 1.0),
        (2.5, 2.5),
        ("0", 0.0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "-1ms", "nanms", "inf", "5parsecs", "", "1.2.3s", True])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError) as e:
        parse_duration(text, "--ttft")
    assert str(e.value).startswith("--ttft: ") and "\n" not in str(e.value)


def test_parse_duration_options():
    with pytest.raises(ConfigError, match="with a unit"):
        parse_duration("500", "ttft", unit_required=True)
    with pytest.raises(ConfigError, match="> 0"):
        parse_duration("0ms", "ttft", allow_zero=False)
    assert parse_duration("0ms", "delay") == 0.0


def test_parse_interval_forms():
    assert parse_interval("100").every_steps == 100 and parse_interval("25steps").mode == "steps"
    assert parse_interval("90s").every_s == 90.0 and parse_interval("5m").every_s == 300.0
    assert parse_interval("AUTO").mode == "auto"
    for bad in ("0", "0s", "often", "-5", "5 parsecs"):
        with pytest.raises(ConfigError, match="invalid checkpoint interval"):
            parse_interval(bad)


def test_exit_codes_keep_their_numbers():
    assert (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.NO_PROGRESS) == (0, 1, 2, 3)
    assert (ExitCode.MAX_RESTARTS, ExitCode.MAX_ROLLBACKS, ExitCode.INTERRUPTED) == (4, 5, 130)
    assert (ExitCode.WORKER_SPIKE, ExitCode.WORKER_CONFIG) == (75, 78)
