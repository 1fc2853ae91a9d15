# ruff: noqa: E501
"""The exporter's cost: training step time with and without ``gpufleet run --metrics``, and the time
to scrape 100 run directories.

1. **Step time, side by side.** ``gpufleet run -n 2`` of the GRU language model of P9
   (benchmarks/scripts/p9_gru.py, no checkpoints), with and without ``--metrics``; with it, a scraper
   thread reads ``/metrics`` every ``--scrape-every`` seconds (1 s: 15 times Prometheus's default
   rate) while the run goes on. The variants alternate (the order flips each repeat) so machine noise
   hits both alike. Per trial: rank 0's median and mean step time (``step.dt`` of the ledger) after
   ``--warmup`` steps. The ratio is on/off of the medians over repeats. Goal: within noise (<= 1 %).
2. **Scrape 100 run directories.** ``--runs`` synthetic ledgers (reliability.synth: ``--steps``
   steps each, a checkpoint every 50 steps, two failures with recoveries, one spike rollback), read by
   one :class:`~gpufleet.observe.sources.Sources` as ``gpufleet metrics serve`` does:
   * ``cold``: the first scrape after the exporter starts (every ledger parsed);
   * ``warm``: a scrape with nothing new (what most scrapes of finished runs are);
   * ``live_all``: every run appended 10 steps since the last scrape (100 live runs);
   * ``live_10``: 10 of the runs did.
   Medians over ``--repeats``. Goal: under 1 s.

``python benchmarks/bench_metrics.py [--repeats 5] [--steps 150] [--runs 100]``; JSON to
benchmarks/results/observe_metrics.json. The load average is recorded before each trial.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from gpufleet.core.ledger import read_events
from gpufleet.core.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scripts" / "p9_gru.py"
RESULTS = ROOT / "benchmarks" / "results"


def load() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------------- step time
class Scraper(threading.Thread):
    """Reads /metrics every ``every`` seconds, as Prometheus would, until stopped."""

    def __init__(self, url: str, every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.stop = threading.Event()
        self.times: list[float] = []
        self.sizes: list[int] = []

    def run(self) -> None:
        while not self.stop.wait(self.every):
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:  # noqa: S310 - loopback
                    self.sizes.append(len(r.read()))
                self.times.append(time.perf_counter() - t0)
            except OSError:
                pass


def trial(metrics: bool, args: argparse.Namespace, work: Path, k: int) -> dict[str, Any]:
    run_dir = work / f"{'on' if metrics else 'off'}-{k}"
    out = work / f"out-{k}-{int(metrics)}"
    out.mkdir()
    port = free_port()
    flags = ["--metrics", f"127.0.0.1:{port}"] if metrics else []
    cmd = [sys.executable, "-m", "gpufleet.cli.main", "run", "-n", "2", "--run-dir", str(run_dir), "--no-progress",
           *flags, "--", sys.executable, str(SCRIPT), "--launcher", "gpufleet", "--steps", str(args.steps)]  # fmt: skip
    la = load()
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics", args.scrape_every) if metrics else None
    t0 = time.perf_counter()
    errf = open(work / f"err-{k}-{int(metrics)}.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, env={**os.environ, "BENCH_OUT": str(out)}, stdout=subprocess.DEVNULL, stderr=errf
    )
    if scraper is not None:
        scraper.start()
    _, status, ru = os.wait4(proc.pid, 0)  # CPU of gpufleet run and the workers it waited for
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if scraper is not None:
        scraper.stop.set()
        scraper.join()
    errf.seek(0)
    err = errf.read()
    errf.close()
    if proc.returncode != 0:
        raise SystemExit(f"trial failed ({proc.returncode}): {err[-2000:]}")
    dts = [float(e["dt"]) for e in read_events(run_dir) if e["ev"] == "step" and e["step"] >= args.warmup]
    row: dict[str, Any] = {
        "metrics": metrics,
        "load_before": round(la, 2),
        "wall_s": round(wall, 2),
        "steps": len(dts),
        "median_step_s": statistics.median(dts),
        "mean_step_s": statistics.fmean(dts),
        "cpu_s": ru.ru_utime + ru.ru_stime,  # the supervisor process and its workers
    }
    if scraper is not None:
        row["scrape_cpu_ms"] = replay_scrape_cpu(run_dir) * 1e3
        row["scrapes"] = len(scraper.times)
        row["scrape_median_s"] = statistics.median(scraper.times) if scraper.times else None
        row["exposition_bytes"] = scraper.sizes[-1] if scraper.sizes else None
    return row


def replay_scrape_cpu(run_dir: Path) -> float:
    """Median CPU seconds of one live scrape of this run: its ledger replayed into a fresh exporter in
    1-second slices (by event time), one scrape per slice, as ``--metrics`` saw it at 1 scrape/s."""
    from gpufleet.core.ledger import LEDGER_NAME
    from gpufleet.observe.exporter import exposition
    from gpufleet.observe.sources import Sources

    lines = (run_dir / LEDGER_NAME).read_bytes().splitlines(keepends=True)
    with tempfile.TemporaryDirectory(prefix="replay_") as tmp:
        d = Path(tmp) / run_dir.name
        d.mkdir()
        src = Sources(runs=[d])
        costs: list[float] = []
        slice_end = None
        with open(d / LEDGER_NAME, "wb") as f:
            for line in lines:
                t = json.loads(line)["t"]
                if slice_end is None:
                    slice_end = t + 1.0
                if t > slice_end:
                    f.flush()
                    c0 = time.process_time()
                    exposition(src)
                    costs.append(time.process_time() - c0)
                    slice_end = t + 1.0
                f.write(line)
        return statistics.median(costs) if costs else 0.0


def bench_step_time(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_metrics_") as tmp:
        for k in range(args.repeats):
            order = (False, True) if k % 2 == 0 else (True, False)
            for m in order:
                r = trial(m, args, Path(tmp), k)
                rows.append(r)
                print(f"  repeat {k} metrics={'on ' if m else 'off'} median {r['median_step_s'] * 1e3:7.2f} ms "
                      f"mean {r['mean_step_s'] * 1e3:7.2f} ms  cpu {r['cpu_s']:6.1f} s  load {r['load_before']:.2f}"
                      + (f"  scrapes {r['scrapes']} ({(r['scrape_median_s'] or 0) * 1e3:.1f} ms, "
                         f"{r['scrape_cpu_ms']:.2f} ms CPU)" if m else ""),
                      flush=True)  # fmt: skip
    on = [r for r in rows if r["metrics"]]
    off = [r for r in rows if not r["metrics"]]
    med_on = statistics.median(r["median_step_s"] for r in on)
    med_off = statistics.median(r["median_step_s"] for r in off)
    mean_on = statistics.median(r["mean_step_s"] for r in on)
    mean_off = statistics.median(r["mean_step_s"] for r in off)
    pairs = [a["median_step_s"] / b["median_step_s"] for a, b in zip(on, off, strict=True)]
    cpu_on = statistics.median(r["cpu_s"] for r in on)
    cpu_off = statistics.median(r["cpu_s"] for r in off)
    scrape_cpu = statistics.median(r["scrape_cpu_ms"] for r in on)
    wall_on = statistics.median(r["wall_s"] for r in on)
    return {
        "cpu_s": {"on": cpu_on, "off": cpu_off, "ratio": cpu_on / cpu_off},
        "scrape_cpu_ms_median": scrape_cpu,
        # the exporter's CPU per second of training at this scrape rate, as a share of what the run used
        "exporter_cpu_share": (scrape_cpu / 1e3 / args.scrape_every) / (cpu_on / wall_on),
        "trials": rows,
        "median_step_s": {"on": med_on, "off": med_off, "ratio": med_on / med_off},
        "mean_step_s": {"on": mean_on, "off": mean_off, "ratio": mean_on / mean_off},
        "pair_ratios": pairs,
        "goal": "ratio <= 1.01 (within noise)",
    }


# ---------------------------------------------------------------------------------- scraping
def synth_run(run_dir: Path, steps: int, session: str) -> Any:
    from gpufleet.reliability.synth import LedgerBuilder

    b = LedgerBuilder(session=session)
    b.start(init_s=2.0)
    done = 0
    for k in range(steps // 50):
        b.steps(50, dt=0.2)
        done += 50
        b.checkpoint(stall_s=0.05, persist_s=0.5)
        if k in (3, 7):
            b.fail("crash", rank=1).recover(init_s=2.0, load_s=0.5)
        if k == 5:
            b.fail("spike").recover(rollback="replay")
    b.write(run_dir)
    return b


def append_steps(b: Any, run_dir: Path, n: int) -> None:
    from gpufleet.core.ledger import LEDGER_NAME

    before = len(b.events)
    b.steps(n, dt=0.2)
    with open(run_dir / LEDGER_NAME, "a") as f:
        for e in b.events[before:]:
            f.write(json.dumps(e) + "\n")


def bench_scrape(args: argparse.Namespace) -> dict[str, Any]:
    from gpufleet.observe.exporter import exposition
    from gpufleet.observe.sources import Sources

    out: dict[str, list[float]] = {"cold": [], "warm": [], "live_all": [], "live_10": []}
    events = 0
    size = 0
    with tempfile.TemporaryDirectory(prefix="bench_scrape_") as tmp:
        root = Path(tmp) / "runs"
        builders = {}
        for i in range(args.runs):
            d = root / f"run{i:03d}"
            builders[d] = synth_run(d, args.run_steps, f"s{i}")
        events = sum(len(b.events) for b in builders.values())
        for _ in range(args.repeats):
            la = load()
            src = Sources([root])
            t0 = time.perf_counter()
            body = exposition(src)
            out["cold"].append(time.perf_counter() - t0)
            size = len(body)
            t0 = time.perf_counter()
            exposition(src)
            out["warm"].append(time.perf_counter() - t0)
            for d, b in builders.items():
                append_steps(b, d, 10)
            t0 = time.perf_counter()
            exposition(src)
            out["live_all"].append(time.perf_counter() - t0)
            for d, b in list(builders.items())[:10]:
                append_steps(b, d, 10)
            t0 = time.perf_counter()
            exposition(src)
            out["live_10"].append(time.perf_counter() - t0)
            print(f"  runs {args.runs} ({events} events) load {la:.2f}: "
                  + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in out.items()), flush=True)  # fmt: skip
    return {
        "runs": args.runs,
        "events_total": events,
        "exposition_bytes": size,
        "seconds": out,
        "median_s": {k: statistics.median(v) for k, v in out.items()},
        "goal": "< 1 s per scrape",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150, help="training steps per trial")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--scrape-every", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--run-steps", type=int, default=1000, help="steps per synthetic run ledger")
    ap.add_argument("--only", choices=("step", "scrape"), default=None)
    args = ap.parse_args()
    res: dict[str, Any] = {"args": vars(args), "load_start": load()}
    if args.only in (None, "scrape"):
        print("scraping run directories", flush=True)
        res["scrape"] = bench_scrape(args)
    if args.only in (None, "step"):
        print("step time with and without --metrics", flush=True)
        res["step_time"] = bench_step_time(args)
    res["load_end"] = load()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "observe_metrics.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **res, "time": time.time(), "cpus": os.cpu_count()}, indent=1) + "\n")
    if "scrape" in res:
        m = res["scrape"]["median_s"]
        print(f"scrape {args.runs} runs: cold {m['cold']:.3f} s, warm {m['warm']:.4f} s, "
              f"live_all {m['live_all']:.3f} s, live_10 {m['live_10']:.3f} s")  # fmt: skip
    if "step_time" in res:
        st = res["step_time"]
        print(
            f"step time on/off: median {st['median_step_s']['ratio']:.4f}x, mean {st['mean_step_s']['ratio']:.4f}x; "
            f"CPU on/off {st['cpu_s']['ratio']:.4f}x; one scrape {st['scrape_cpu_ms_median']:.2f} ms CPU = "
            f"{st['exporter_cpu_share']:.3%} of the run's CPU at 1 scrape per {args.scrape_every:g} s"
        )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
