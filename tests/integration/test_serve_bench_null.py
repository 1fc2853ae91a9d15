"""``gpufleet serve bench`` end to end against the null endpoint (a real subprocess server)."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the serve extra (aiohttp) is not installed")

from gpufleet.serve.null_endpoint import NullEndpoint, start_null_endpoint  # noqa: E402

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


@pytest.fixture(scope="module")
def null() -> Iterator[NullEndpoint]:
    with start_null_endpoint(workers=1) as ne:
        yield ne


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUFLEET, "serve", "bench", "--no-progress", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_rate_run_writes_results(null, tmp_path):
    out = tmp_path / "r"
    p = bench("--url", null.url, "--rate", "40", "--arrival", "constant", "--requests", "80",
              "--workload", "in=fixed:16;out=fixed:2", "--slo", "ttft=2s,e2e=5s", "--warmup", "5",
              "--out", str(out), "--max-lag-ms", "1000")
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["schema"] == "gpufleet.serve.summary" and s["version"] == 1
    assert s["target"]["model"] == "null"  # detected from /v1/models
    assert s["requests"] == {"measured": 75, "ok": 75, "failed": 0, "good": 75, "warmup": 5}
    assert s["tokens"]["source"] == "usage" and s["tokens"]["output_total"] == 150
    assert s["rate"]["achieved_send_per_s"] == pytest.approx(40, rel=0.2)
    assert s["slo"]["attainment"] == 1.0 and s["client"]["valid"]
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 80 and sum(r["warmup"] == "1" for r in rows) == 5
    assert (out / "latency_cdf.png").stat().st_size > 1000


def test_concurrency_and_processes(null, tmp_path):
    out = tmp_path / "c"
    p = bench("--url", null.url, "--concurrency", "4", "--requests", "60", "--processes", "2",
              "--workload", "short", "--out", str(out), "--no-plot", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["load"]["mode"] == "concurrency" and s["load"]["processes"] == 2
    assert s["requests"]["ok"] == 60


def test_trace_replay(null, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 50 * i, "input_length": 600, "output_length": 2,
                                         "hash_ids": [1, i]}) + "\n" for i in range(20)))
    out = tmp_path / "t"
    p = bench("--url", null.url, "--workload", str(trace), "--out", str(out), "--no-plot")
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["workload"]["kind"] == "mooncake_trace" and s["requests"]["ok"] == 20
    assert s["rate"]["scheduled_per_s"] == pytest.approx(20, rel=0.01)


def test_find_max_rate_writes_capacity(null, tmp_path):
    out = tmp_path / "f"
    p = bench("--url", null.url, "--find-max-rate", "--attainment", "0.9", "--rate", "10",
              "--max-rate", "40", "--requests", "15", "--slo", "ttft=1s", "--workload", "short",
              "--out", str(out), "--max-lag-ms", "1000")
    assert p.returncode == 0, p.stderr
    cap = json.loads((out / "capacity.json").read_text())
    assert cap["schema"] == "gpufleet.serve.capacity" and cap["version"] == 1
    assert cap["max_rate"] == 40 and cap["limited_by"] == "max_rate" and cap["stable"]
    assert [pt["offered_rate"] for pt in cap["points"]] == [10, 20, 40, 40]
    assert all(pt["attainment"] == 1.0 for pt in cap["points"])
    assert (out / "capacity.png").is_file() and (out / "summary.json").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url_counts_failures(tmp_path):
    out = tmp_path / "u"
    p = bench("--url", f"http://127.0.0.1:{_free_port()}", "--rate", "20", "--requests", "10",
              "--out", str(out), "--no-plot")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert "all 10 requests failed (connect: 10)" in p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["errors"] == {"connect": 10} and s["slo"]["attainment"] == 0.0


@pytest.mark.parametrize("args,msg", [
    (["--rate", "-3"], "--rate must be > 0"),
    (["--rate", "5", "--slo", "ttft=fast"], "--slo"),
    (["--rate", "5", "--workload", "in=zipf:3"], "unknown distribution"),
    (["--rate", "5", "--concurrency", "3"], "not both"),
    (["--rate", "5", "--arrival", "bursty"], "--arrival"),
    (["--rate", "5", "--tokenizer", "gpt2"], "not a local path"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, msg):
    p = bench("--url", "http://127.0.0.1:9", "--out", str(tmp_path / "x"), *args)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_bad_trace_is_one_line_exit_2(tmp_path):
    t = tmp_path / "bad.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": "x"}\n')
    p = bench("--url", "http://127.0.0.1:9", "--workload", str(t), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "line 2" in p.stderr and "Traceback" not in p.stderr


def test_ctrl_c_writes_partial_results(null, tmp_path):
    out = tmp_path / "i"
    proc = subprocess.Popen([*GPUFLEET, "serve", "bench", "--no-progress", "--url", null.url, "--rate", "20",
                             "--duration", "60", "--workload", "short", "--out", str(out), "--no-plot"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(3.0)
    os.killpg(proc.pid, signal.SIGINT)  # like Ctrl-C in a terminal: the whole process group
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] and 10 < s["requests"]["ok"] < 1200
    assert Path(out / "requests.csv").is_file()
