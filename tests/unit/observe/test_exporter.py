"""The exporter's sources and exposition on synthetic ledgers (reliability.synth) and real files."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.core.ledger import LEDGER_NAME, read_events
from gpufleet.observe.sources import SPECS, Sources
from gpufleet.observe.tail import LedgerTail
from gpufleet.reliability.metrics import summarize
from gpufleet.reliability.synth import LedgerBuilder
from support.cli import gpufleet

pytest.importorskip("prometheus_client", reason="the observe extra")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpufleet.observe.exporter import exposition, parse_listen  # noqa: E402


def _run(b: LedgerBuilder | None = None) -> LedgerBuilder:
    b = b or LedgerBuilder()
    b.start(init_s=2.0).steps(10, dt=0.5).checkpoint(stall_s=0.2, persist_s=1.5).steps(5, dt=0.5)
    b.fail("crash", detect_s=0.5, teardown_s=1.0).recover(init_s=2.0, load_s=1.0).steps(8, dt=0.5)
    b.fail("spike").recover(rollback="replay").steps(4, dt=0.5)
    return b


def scrape(sources: Sources) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(exposition(sources).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_run_metrics_equal_the_report(tmp_path: Path) -> None:
    run = tmp_path / "r1"
    _run().end("completed").write(run)
    rep = summarize(read_events(run))
    s = scrape(Sources([run]))
    assert get(s, "gpufleet_train_goodput_ratio", run="r1") == pytest.approx(rep["goodput"], rel=1e-12)
    assert sum(v for (n, _), v in s.items() if n == "gpufleet_train_restarts_total") == rep["restarts"] == 2
    # synth writes reason="failure" (the supervisor writes the cause): free text becomes "other"
    assert get(s, "gpufleet_train_restarts_total", run="r1", cause="other") == 2
    assert get(s, "gpufleet_train_restarts_total", run="r1", cause="crash") == 0
    assert get(s, "gpufleet_train_failures_total", run="r1", cause="spike") == 1
    assert get(s, "gpufleet_train_failures_total", run="r1", cause="hang") == 0
    assert get(s, "gpufleet_train_rollbacks_total", run="r1", mode="replay") == rep["rollbacks"] == 1
    assert get(s, "gpufleet_train_mttr_seconds", run="r1") == pytest.approx(rep["mttr"]["mean_s"])
    for phase, mean in rep["mttr"]["phases_mean_s"].items():
        assert get(s, "gpufleet_train_mttr_phase_seconds", run="r1", phase=phase) == pytest.approx(mean)
    for cat, v in rep["badput"].items():
        assert get(s, "gpufleet_train_time_seconds", run="r1", category=cat) == pytest.approx(v["s"])
    assert get(s, "gpufleet_train_steps_total", run="r1") == rep["steps"]["executed"]
    assert get(s, "gpufleet_train_step_duration_seconds_count", run="r1") == rep["steps"]["executed"]
    assert (
        get(s, "gpufleet_checkpoints_total", run="r1", outcome="committed") == rep["checkpoints"]["committed"]
    )
    assert get(s, "gpufleet_checkpoint_persist_seconds_sum", run="r1") == pytest.approx(1.5)
    assert get(s, "gpufleet_run_status", run="r1", status="completed") == 1
    assert get(s, "gpufleet_run_running", run="r1") == 0
    assert get(s, "gpufleet_run_attempt", run="r1") == 2


def test_incremental_reads_match_a_fresh_read(tmp_path: Path) -> None:
    """A live run read scrape by scrape ends with the numbers of one read of the finished ledger."""
    run = tmp_path / "live"
    b = _run()
    b.end("completed")
    lines = [json.dumps(e) + "\n" for e in b.events]
    run.mkdir()
    live = Sources(runs=[run])
    assert (
        scrape(live)[("gpufleet_exporter_sources", (("kind", "run"),))] == 1
    )  # no ledger yet: no run samples
    with open(run / LEDGER_NAME, "w") as f:
        for i, line in enumerate(lines):
            if i % 7 == 3:  # a torn line: half now, the rest at the next scrape
                f.write(line[: len(line) // 2])
                f.flush()
                scrape(live)
                f.write(line[len(line) // 2 :])
            else:
                f.write(line)
            f.flush()
            if i % 5 == 0:
                mid = scrape(live)
                assert get(mid, "gpufleet_run_running", run="live") == 1

    def steady(samples: dict) -> dict:
        return {k: v for k, v in samples.items() if k[0] != "gpufleet_exporter_collect_seconds"}

    assert steady(scrape(live)) == steady(scrape(Sources([run])))


def test_tail_survives_truncation_and_skips_garbage(tmp_path: Path) -> None:
    b = LedgerBuilder().start().steps(3)
    b.write(tmp_path / "r")
    p = tmp_path / "r" / LEDGER_NAME
    tail = LedgerTail(tmp_path / "r")
    assert len(tail.poll()) == len(b.events)
    with open(p, "a") as f:
        f.write("not json\n{}\n")
    assert tail.poll() == []
    p.write_text("")
    assert tail.poll() == [] and tail.events == [] and tail.generation == 1


def test_counters_never_go_down_and_gauges_of_time_are_gauges() -> None:
    for spec in SPECS.values():
        assert spec.name.startswith("gpufleet_")
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        assert "step" not in spec.labels and "reason" not in spec.labels and "command" not in spec.labels
    assert SPECS["gpufleet_train_time_seconds"].kind == "gauge"  # rollbacks move time out of productive


def test_fleet_metrics_match_gpufleet_nodes(tmp_path: Path) -> None:
    from gpufleet.health.nodes import node_table, record_state

    fleet = tmp_path / "fleet"
    t0 = 1_700_000_000.0
    for k in range(3):
        record_state("a1", "healthy", "ok", fleet=fleet, t=t0 + k * 100)
        record_state(
            "a1", "drained", "xid", component="gpu", check="gpu.xid", fleet=fleet, t=t0 + k * 100 + 10
        )
    record_state("a2", "healthy", "ok", fleet=fleet, t=t0)
    s = scrape(Sources(fleet_dir=fleet))
    rows = {r.node: r for r in node_table(fleet)}
    assert get(s, "gpufleet_node_state", node="a1", state="drained") == 1
    assert get(s, "gpufleet_node_state", node="a1", state="healthy") == 0
    assert get(s, "gpufleet_node_failures_total", node="a1", component="gpu") == rows["a1"].failures == 3
    assert get(s, "gpufleet_node_lemon", node="a1") == float(rows["a1"].lemon)
    assert get(s, "gpufleet_node_state_info", node="a1", component="gpu", by="gpufleet", check="gpu.xid") == 1
    assert get(s, "gpufleet_node_state_since_timestamp_seconds", node="a1", state="drained") == t0 + 210
    assert ("gpufleet_node_state_info", (("by", "gpufleet"), ("check", ""), ("component", "unknown"),
                                         ("node", "a2"))) in s  # fmt: skip


def test_serve_summary_and_capacity(tmp_path: Path) -> None:
    d = tmp_path / "bench1"
    d.mkdir()
    summary = {
        "schema": "gpufleet.serve.summary", "created_unix": 1.7e9, "valid": True,
        "requests": {"ok": 10, "failed": 1, "good": 9},
        "latency_ms": {"ttft": {"p50": 100.0, "p90": 150.0, "p99": 300.0}, "itl": {"p50": 5.0}},
        "slo": {"limits_ms": {"ttft": 200.0}, "attainment": 0.9, "goodput_per_s": 4.5},
        "rate": {"request_throughput_per_s": 5.0, "offered_per_s": 6.0},
        "tokens": {"output_throughput_per_s": 80.0},
    }  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    cap = {"max_rate": 7.5, "target_attainment": 0.9,
           "points": [{"offered_rate": 5.0, "attainment": 1.0, "goodput_per_s": 5.0},
                      {"offered_rate": 10.0, "attainment": 0.5, "goodput_per_s": 5.0}]}  # fmt: skip
    (d / "capacity.json").write_text(json.dumps(cap))
    s = scrape(Sources([d]))
    assert get(s, "gpufleet_serve_latency_seconds", bench="bench1", metric="ttft", percentile="p99") == 0.3
    assert get(s, "gpufleet_serve_slo_limit_seconds", bench="bench1", metric="ttft") == 0.2
    assert get(s, "gpufleet_serve_slo_attainment_ratio", bench="bench1") == 0.9
    assert get(s, "gpufleet_serve_requests", bench="bench1", outcome="failed") == 1
    assert get(s, "gpufleet_serve_capacity_max_rate_requests_per_second", bench="bench1") == 7.5
    assert get(s, "gpufleet_serve_capacity_attainment_ratio", bench="bench1", offered_rate="10") == 0.5


def test_roots_pick_up_new_runs_and_names_stay_unique(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    LedgerBuilder().start().steps(2).write(root / "a")
    src = Sources([root, tmp_path / "other"])
    assert get(scrape(src), "gpufleet_exporter_sources", kind="run") == 1
    LedgerBuilder().start().steps(2).write(root / "b")
    LedgerBuilder().start().steps(2).write(tmp_path / "other" / "a")
    s = scrape(src)
    assert get(s, "gpufleet_exporter_sources", kind="run") == 3
    assert {dict(k[1])["run"] for k in s if k[0] == "gpufleet_run_running"} == {"a", "b", "other/a"}


def test_parse_listen() -> None:
    assert parse_listen("9400") == parse_listen("127.0.0.1:9400")
    assert parse_listen("9400").loopback
    assert not parse_listen("0.0.0.0:9400").loopback
    assert parse_listen("[::1]:0").host == "::1"
    for bad in ("x", "1.2.3.4:99999", "example.com:80", ""):
        with pytest.raises(UsageError):
            parse_listen(bad)


@pytest.mark.skipif(shutil.which("promtool") is None and os.environ.get("CI") != "true", reason="promtool")
def test_exposition_passes_promtool(tmp_path: Path) -> None:
    _run().end("max_restarts", exit_code=4).write(tmp_path / "r")
    text = exposition(Sources([tmp_path / "r"]))
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert p.returncode == 0, p.stderr.decode()
    assert not math.isnan(float(text.decode().split("gpufleet_train_goodput_ratio{")[1].split()[1]))


def test_cli_show_and_textfile(tmp_path: Path) -> None:
    _run().end("completed").write(tmp_path / "r")
    p = gpufleet("metrics", "show", tmp_path / "r", "--no-fleet")
    assert p.returncode == 0 and 'gpufleet_run_running{run="r"} 0.0' in p.stdout
    out = tmp_path / "tf" / "gpufleet.prom"
    p = gpufleet("metrics", "textfile", tmp_path / "r", "--no-fleet", "-o", out)
    assert p.returncode == 0, p.stderr
    assert "gpufleet_train_steps_total" in out.read_text()
    for args, msg in (
        (["metrics", "show", str(tmp_path / "missing")], "not a directory"),
        (["metrics", "textfile", str(tmp_path / "r"), "-o", str(tmp_path / "x.txt")], ".prom"),
        (["metrics", "serve", str(tmp_path / "r"), "--listen", "nope"], "[ADDR:]PORT"),
        (["metrics", "show", "--no-fleet"], "nothing to export"),
    ):
        p = gpufleet(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_run_metrics_flag_errors_before_anything_starts(tmp_path: Path) -> None:
    import socket

    cmd = ["run", "--run-dir", str(tmp_path / "r"), "--no-progress"]
    job = ["--", sys.executable, "-c", "pass"]
    p = gpufleet(*cmd, "--metrics", "host:port", *job)
    assert p.returncode == 2 and "--metrics 'host:port'" in p.stderr and "Traceback" not in p.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = gpufleet(*cmd, "--metrics", str(port), *job)
    assert p.returncode == 2 and "cannot listen on 127.0.0.1" in p.stderr, p.stderr
    assert not (tmp_path / "r" / LEDGER_NAME).exists()  # nothing started


def test_an_expensive_walk_is_rate_limited_but_single_event_counters_are_not(tmp_path: Path) -> None:
    from gpufleet.observe.sources import RunSource

    b = LedgerBuilder().start().steps(5)
    b.write(tmp_path / "r")
    src = RunSource(tmp_path / "r", "r")
    src.refresh()
    assert src.derived["scalars"]["gpufleet_train_steps_total"] == 5
    src._derive_cost = 10.0  # pretend the walk took 10 s: the next one waits 200 s
    more = LedgerBuilder(t0=b.t).start().steps(3).events
    append = [json.dumps(e) + "\n" for e in more if e["ev"] == "step"]
    with open(tmp_path / "r" / LEDGER_NAME, "a") as f:
        f.writelines(append)
    src.refresh()
    assert src.step_hist.cumulative()[-1][1] == 8  # the histogram saw the new steps at once
    assert src.derived["scalars"]["gpufleet_train_steps_total"] == 5  # the walk waits
    src._derive_at -= 201.0
    src.refresh()  # nothing new in the file, but the walk is due
    assert src.derived["scalars"]["gpufleet_train_steps_total"] == 8
