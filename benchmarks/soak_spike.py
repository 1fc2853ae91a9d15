"""Soak: a converging model under ``gpufleet run -n 2`` for a long time, a worker killed every 2 minutes.

A converged GRU language model trips a linear robust-z spike rule on ordinary batch-to-batch
variation, and a lifetime rollback cap then ends a healthy run with exit 5. This
runs ``benchmarks/scripts/gru_lm.py`` (plain PyTorch, a shuffled DataLoader, no thread pinning)
under the supervisor for ``--duration``; every ``--kill-every`` an outside ``kill -9`` hits a random
worker of the running attempt (once it has completed a step). At the end it sends SIGTERM (final
checkpoint, exit 0) and writes what happened, from the ledger (``gpufleet report --json``) and its
own samples: steps, kills and their recoveries, breakers tripped, spikes flagged by kind, false
alarms, the loss curve's start and end, the load average and the supervisor's memory/fds/threads.

    nice -n 10 .venv/bin/python benchmarks/soak_spike.py --duration 60m --run-dir runs/soak_spike
    .venv/bin/python benchmarks/soak_spike.py --summarize runs/soak_spike   # re-read a finished run

Goal: no breaker (exit 0), every kill recovered, false alarms 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "scripts" / "gru_lm.py"
GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main"]


def _seconds(text: str) -> float:
    from gpufleet.core.units import parse_duration

    return parse_duration(text, "duration", allow_zero=False)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    from gpufleet.core.ledger import read_events

    return read_events(run_dir) if (run_dir / "ledger.jsonl").exists() else []


def _proc_sample(pid: int) -> dict[str, Any] | None:
    """The supervisor's resident memory, open file descriptors and threads (Linux /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _victim(run_dir: Path, rng: random.Random) -> tuple[int, int] | None:
    """(rank, pid) of a random worker of the newest attempt, once that attempt has completed a step."""
    evs = _events(run_dir)
    starts = [i for i, e in enumerate(evs) if e["ev"] == "attempt_start"]
    if not starts:
        return None
    last = starts[-1]
    if not any(e["ev"] == "step" for e in evs[last + 1 :]):
        return None  # still starting or restoring: wait for it to train
    pids = [p for p in evs[last].get("pids", []) if _alive(p)]
    if not pids:
        return None
    rank = rng.randrange(len(pids))
    return rank, pids[rank]


def soak(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"soak_spike: {run_dir} is not empty; pick a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        *GPUFLEET,
        "run",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *(["--max-restarts", str(args.max_restarts)] if args.max_restarts is not None else []),
        "--",
        sys.executable,
        str(SCRIPT),
        "--checkpoint-every",
        args.checkpoint_every,
        *args.train_args,
    ]
    rng = random.Random(args.seed)
    log = open(run_dir / "soak.log", "w")
    t0 = time.time()
    sup = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    kills: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    next_kill = t0 + args.kill_every
    next_sample = t0
    deadline = t0 + args.duration
    while time.time() < deadline and sup.poll() is None:
        now = time.time()
        if now >= next_sample:
            s = _proc_sample(sup.pid)
            if s is not None:
                samples.append({"t": round(now - t0, 1), "load1": os.getloadavg()[0], **s})
            next_sample = now + 30
        if now >= next_kill:
            v = _victim(run_dir, rng)
            if v is not None:
                rank, pid = v
                os.kill(pid, signal.SIGKILL)
                kills.append({"t": round(now - t0, 1), "rank": rank, "pid": pid})
                print(f"soak: t={now - t0:.0f}s kill -9 rank {rank} (pid {pid})", file=sys.stderr, flush=True)
                next_kill = now + args.kill_every
            else:
                next_kill = now + 1  # the attempt is still recovering: try again shortly
        time.sleep(0.5)
    ran_s = time.time() - t0
    if sup.poll() is None:
        sup.send_signal(signal.SIGTERM)  # final checkpoint, then exit 0
    try:
        code = sup.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(sup.pid, signal.SIGKILL)
        code = sup.wait()
    log.close()
    (run_dir / "soak_kills.json").write_text(
        json.dumps(
            {
                "kills": kills,
                "samples": samples,
                "ran_s": ran_s,
                "exit_code": code,
                "cmd": cmd,
                "kill_every_s": args.kill_every,
            }
        )
    )
    return summarize(run_dir)


def _old_rule(losses: list[float], window: int = 50, min_history: int = 10) -> list[int]:
    """Indices the linear rule flags: robust z > 8 and more than 25% above the
    rolling median (a flagged loss stays out of the window, as in the guard)."""
    hist: list[float] = []
    out = []
    for i, v in enumerate(losses):
        if len(hist) >= min_history:
            med = statistics.median(hist)
            mad = statistics.median(abs(x - med) for x in hist)
            if (v - med) / max(1.4826 * mad, 1e-12) > 8.0 and v - med > 0.25 * abs(med):
                out.append(i)
                continue
        hist = (hist + [v])[-window:]
    return out


def kept_losses(evs: list[dict[str, Any]]) -> list[float]:
    """The loss of every step index, from its last execution (the trajectory the model kept)."""
    by_step = {e["step"]: e["loss"] for e in evs if e["ev"] == "step" and e.get("loss") is not None}
    return [by_step[k] for k in sorted(by_step)]


def _replayed(losses: list[float]) -> dict[str, Any]:
    """The kept loss series through gpufleet's guard and the linear rule, offline."""
    from gpufleet.train.spike import SpikeGuard

    guard = SpikeGuard()
    new = [i for i, v in enumerate(losses) if guard.check(v) is not None]
    old = _old_rule(losses)
    return {
        "steps": len(losses),
        "flagged_now": new,
        "flagged_by_old_rule": old,
        "old_rule_examples": [
            {"step": i, "loss": losses[i], "median_before": statistics.median(losses[max(0, i - 50) : i])}
            for i in old[:5]
        ],
    }


def summarize(run_dir: Path) -> dict[str, Any]:
    """The soak's figures from its run directory (ledger + the soak's own kill log and samples)."""
    side = json.loads((run_dir / "soak_kills.json").read_text())
    rep = subprocess.run(
        [*GPUFLEET, "report", str(run_dir), "--json"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    report = json.loads(rep.stdout)
    evs = _events(run_dir)
    losses = kept_losses(evs)
    samples = side["samples"]
    settled = [s for s in samples if s["t"] >= 60]
    give_ups = [e["reason"] for e in evs if e["ev"] == "give_up"]
    crash = [i for i in report["incidents"] if i["cause"] == "crash"]
    return {
        "benchmark": "soak_spike",
        "what": "gpufleet run -n 2 of a converging GRU LM (benchmarks/scripts/gru_lm.py), an outside "
        "kill -9 of a random worker every kill_every_s, SIGTERM at the end",
        "duration_s": round(side["ran_s"], 1),
        "exit_code": side["exit_code"],
        "status": [s["status"] for s in report["sessions"]],
        "steps": report["steps"],
        "loss": {
            "first": losses[0] if losses else None,
            "median_first_50": statistics.median(losses[:50]) if losses else None,
            "median_last_200": statistics.median(losses[-200:]) if losses else None,
            "min": min(losses) if losses else None,
        },
        "kills": len(side["kills"]),
        "kill_every_s": side.get("kill_every_s"),
        "crash_incidents": len(crash),
        "crash_recovered": sum(1 for i in crash if i["recovered"]),
        "failures_by_cause": report["failures"]["by_cause"],
        "breakers_tripped": len(give_ups),
        "give_up_reasons": give_ups,
        "rollbacks": report["rollbacks"],
        "spikes": report.get("spikes"),
        "replayed_loss_series": _replayed(losses),
        "goodput": report["goodput"],
        "mttr_mean_s": report["mttr"]["mean_s"],
        "load1": {
            "mean": round(statistics.fmean(s["load1"] for s in samples), 2) if samples else None,
            "max": round(max(s["load1"] for s in samples), 2) if samples else None,
        },
        # from the first sample a minute in (before that the supervisor is still importing)
        "supervisor": {
            k: {"first": settled[0][k], "last": settled[-1][k], "max": max(s[k] for s in settled)}
            for k in ("rss_mb", "fds", "threads")
        }
        if settled
        else None,
        "cpus": os.cpu_count(),
        "kill_log": side["kills"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", default="60m", help="how long to train (e.g. 60m, 90s)")
    ap.add_argument("--kill-every", default="2m", help="outside kill -9 period")
    ap.add_argument("--run-dir", default="runs/soak_spike")
    ap.add_argument("--seed", type=int, default=0, help="which rank each kill hits")
    ap.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="gpufleet run's restart budget (default: gpufleet run's own, 10 within 1000 steps)",
    )
    # Shorter than --kill-every: with both at 2 minutes every kill landed just before the next save
    # was due, and the no-progress breaker rightly ended a run that was losing all its work.
    ap.add_argument("--checkpoint-every", default="30s", help="the training script's checkpoint interval")
    ap.add_argument("--out", default=str(HERE / "results" / "soak_spike.json"))
    ap.add_argument("--summarize", metavar="RUN_DIR", help="only summarise a finished soak's run directory")
    ap.add_argument("train_args", nargs="*", help="arguments for gru_lm.py (after --)")
    args = ap.parse_args()
    if args.summarize:
        result = summarize(Path(args.summarize))
    else:
        args.duration, args.kill_every = _seconds(args.duration), _seconds(args.kill_every)
        result = soak(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    keys = ("duration_s", "exit_code", "kills", "crash_recovered", "breakers_tripped", "spikes", "steps")
    print(json.dumps({k: result[k] for k in keys}))


if __name__ == "__main__":
    main()
