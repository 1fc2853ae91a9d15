"""``gpufleet serve bench`` end to end against the null endpoint (a real subprocess server)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the serve extra (aiohttp) is not installed")

from gpufleet.core.ports import free_port  # noqa: E402
from gpufleet.serve.bench.findmax import Level, search_max_rate  # noqa: E402
from gpufleet.serve.bench.null_endpoint import NullEndpoint, start_null_endpoint  # noqa: E402

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


@pytest.fixture(scope="module")
def null() -> Iterator[NullEndpoint]:
    with start_null_endpoint(workers=1) as ne:
        yield ne


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUFLEET, "serve", "bench", "--no-progress", *args], capture_output=True, text=True, timeout=timeout
    )


def test_rate_run_writes_results(null, tmp_path):
    out = tmp_path / "r"
    p = bench(
        "--url",
        null.url,
        "--rate",
        "40",
        "--arrival",
        "constant",
        "--requests",
        "80",
        "--workload",
        "in=fixed:16;out=fixed:2",
        "--slo",
        "ttft=2s,e2e=5s",
        "--warmup",
        "5",
        "--out",
        str(out),
        "--max-lag-ms",
        "1000",
    )
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
    p = bench(
        "--url",
        null.url,
        "--concurrency",
        "4",
        "--requests",
        "60",
        "--processes",
        "2",
        "--workload",
        "short",
        "--out",
        str(out),
        "--no-plot",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["load"]["mode"] == "concurrency" and s["load"]["processes"] == 2
    assert s["requests"]["ok"] == 60


def test_trace_replay(null, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 50 * i, "input_length": 600, "output_length": 2, "hash_ids": [1, i]})
            + "\n"
            for i in range(20)
        )
    )
    out = tmp_path / "t"
    p = bench("--url", null.url, "--workload", str(trace), "--out", str(out), "--no-plot")
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["workload"]["kind"] == "mooncake_trace" and s["requests"]["ok"] == 20
    assert s["rate"]["scheduled_per_s"] == pytest.approx(20, rel=0.01)


def test_find_max_rate_writes_capacity(null, tmp_path):
    # Whether a level passes depends on this host as well as on the server: a level must send at
    # >= 95% of its scheduled rate, and 15 requests at 40/s span 0.35 s, so an 18 ms scheduler
    # hiccup on a loaded CI host fails it. So this test checks the search contract for whatever
    # outcomes the levels had, not which rate a given host reaches: the levels are the doubling
    # (then bisection and re-check) that search_max_rate makes of those outcomes, and capacity.json
    # and the level folders agree with them. On an idle host every level passes: 10, 20, 40, 40.
    out = tmp_path / "f"
    p = bench(
        "--url",
        null.url,
        "--find-max-rate",
        "--attainment",
        "0.9",
        "--rate",
        "10",
        "--max-rate",
        "40",
        "--requests",
        "15",
        "--slo",
        "ttft=1s",
        "--workload",
        "short",
        "--out",
        str(out),
        "--max-lag-ms",
        "1000",
    )
    assert p.returncode == 0, p.stderr
    cap = json.loads((out / "capacity.json").read_text())
    assert cap["schema"] == "gpufleet.serve.capacity" and cap["version"] == 1
    assert cap["target_attainment"] == 0.9 and cap["slo_ms"] == {"ttft": 1000.0}
    assert not cap["interrupted"] and cap["target"]["model"] == "null"
    points = cap["points"]
    summaries = [json.loads((d / "summary.json").read_text()) for d in sorted((out / "levels").iterdir())]
    assert len(summaries) == len(points) >= 2
    for pt, s in zip(points, summaries, strict=True):
        assert pt["offered_rate"] == s["load"]["rate"] <= 40
        # The null endpoint answers every request, whatever the load: only timing can fail a level.
        assert pt["requests"] == s["requests"] and s["requests"]["ok"] == s["requests"]["measured"] == 15
        assert pt["attainment"] == s["slo"]["attainment"] == s["requests"]["good"] / 15
        assert pt["client_valid"] == s["client"]["valid"] == (not s["client"]["invalid_reasons"])
        assert pt["queue_growing"] == s["queue_growing"]

    def passed(s):
        steady = not (s["queue_growing"] or s["falling_behind"])
        return s["valid"] and steady and s["slo"]["attainment"] >= 0.9

    # Replay the search on the outcomes the levels had: it must ask for exactly these rates and
    # reach the result capacity.json reports.
    asked = iter(summaries)

    def measure(rate):
        s = next(asked)
        assert s["load"]["rate"] == rate
        return Level(
            rate,
            s["slo"]["attainment"],
            client_valid=s["valid"],
            stable=not (s["queue_growing"] or s["falling_behind"]),
            summary=s,
        )

    res = search_max_rate(measure, 0.9, 10, max_rate=40)
    assert next(asked, None) is None  # no level ran that the search did not ask for
    assert [pt["recheck"] for pt in points] == [lv.recheck for lv in res.levels]
    assert (cap["max_rate"], cap["limited_by"], cap["stable"]) == (res.max_rate, res.limited_by, res.stable)
    # The contract, stated directly: doubling from --rate, capped at --max-rate, while levels pass;
    # limited_by names what stopped the search; a stable result is a passing re-run of max_rate.
    rates = [pt["offered_rate"] for pt in points]
    first_fail = next((i for i, s in enumerate(summaries[:3]) if not passed(s)), 3)
    assert rates[: first_fail + 1][:3] == [10, 20, 40][: first_fail + 1]
    if first_fail == 3:  # 10, 20 and 40 passed: the search stops at --max-rate and re-checks it
        assert cap["limited_by"] == "max_rate" and rates[:4] == [10, 20, 40, 40] and points[3]["recheck"]
        if passed(summaries[3]):
            assert cap["max_rate"] == 40 and cap["stable"] and len(points) == 4
    else:
        assert cap["limited_by"] != "max_rate"
    if cap["limited_by"] == "client":  # blamed on the client only when a level's client was invalid
        assert not all(s["valid"] for s in summaries)
    if cap["stable"]:
        assert points[-1]["recheck"] and rates[-1] == cap["max_rate"] and passed(summaries[-1])
    assert (out / "capacity.png").is_file()
    if cap["max_rate"]:  # the top-level summary.json is the best level's
        assert json.loads((out / "summary.json").read_text())["load"]["rate"] == cap["max_rate"]


def _free_port() -> int:
    return free_port()


def test_unreachable_url_counts_failures(tmp_path):
    out = tmp_path / "u"
    p = bench(
        "--url",
        f"http://127.0.0.1:{_free_port()}",
        "--rate",
        "20",
        "--requests",
        "10",
        "--out",
        str(out),
        "--no-plot",
    )
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert "all 10 requests failed (connect: 10)" in p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["errors"] == {"connect": 10} and s["slo"]["attainment"] == 0.0


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--rate", "-3"], "--rate must be > 0"),
        (["--rate", "5", "--slo", "ttft=fast"], "--slo"),
        (["--rate", "5", "--workload", "in=zipf:3"], "unknown distribution"),
        (["--rate", "5", "--concurrency", "3"], "not both"),
        (["--rate", "5", "--arrival", "bursty"], "--arrival"),
        (["--rate", "5", "--tokenizer", "gpt2"], "not a local path"),
    ],
)
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


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_DONE = re.compile(r"\bdone\s+(\d+)\s+failed\s+(\d+)\s")


def test_ctrl_c_writes_partial_results(null, tmp_path):
    # Ctrl-C once the bench's own live view shows N requests done (not after a fixed sleep: on a
    # loaded host start-up can take seconds, and a SIGINT before the handlers are installed ends
    # in a traceback). The view is drawn only on a terminal, so the child is told it has one.
    n = 20
    out = tmp_path / "i"
    env = {**os.environ, "TTY_COMPATIBLE": "1", "FORCE_COLOR": "1", "TERM": "xterm"}
    proc = subprocess.Popen(
        [
            *GPUFLEET,
            "serve",
            "bench",
            "--progress",
            "--url",
            null.url,
            "--rate",
            "20",
            "--duration",
            "60",
            "--workload",
            "short",
            "--out",
            str(out),
            "--no-plot",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    assert proc.stderr is not None
    chunks: list[bytes] = []
    pump = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: proc.stderr.read1(65536), b"")), daemon=True
    )
    pump.start()

    def ok_so_far() -> int:  # done minus failed in the latest frame of the live view
        frames = _DONE.findall(_ANSI.sub("", b"".join(chunks).decode(errors="replace")))
        return int(frames[-1][0]) - int(frames[-1][1]) if frames else 0

    deadline = time.monotonic() + 50
    while (seen := ok_so_far()) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if seen < n:
        proc.kill()
        proc.wait()
        pytest.fail(f"the live view never showed {n} requests done: {b''.join(chunks)[-2000:]!r}")
    os.killpg(proc.pid, signal.SIGINT)  # like Ctrl-C in a terminal: the whole process group
    proc.wait(timeout=30)
    pump.join(timeout=10)
    err = _ANSI.sub("", b"".join(chunks).decode(errors="replace"))
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted: partial results written" in err
    s = json.loads((out / "summary.json").read_text())
    # Every request the view counted as done was kept: Ctrl-C cancels only those in flight.
    assert s["interrupted"] and seen <= s["requests"]["ok"] < s["load"]["planned"]
    assert Path(out / "requests.csv").is_file()
