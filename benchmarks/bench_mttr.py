# ruff: noqa: E501
"""P3 MTTR: crash of one of 2 ranks -> first completed step after restore.

Three launchers, side by side in one run, the same model / data / checkpoint cadence / crash:

* ``gpufleet``            ``gpufleet run -n 2 --checkpoint-every N`` (standby interpreters on)
* ``gpufleet-no-standby`` the same with ``--no-standby`` (every restart spawns fresh interpreters)
* ``gpufleet-in-process`` the same with ``--in-process-restart``: rank 0 keeps its process and
                          rejoins; only rank 1 is replaced (a standby). Its "new process" is rank
                          0's new round of the script in the same interpreter.
* ``torchrun``            ``torchrun --standalone --nproc-per-node 2 --max-restarts 3`` on a plain
                          PyTorch script that checkpoints with ``torch.distributed.checkpoint``
                          (``dcp.save`` every N steps, ``dcp.load`` of the newest committed one on start)

The scripts (benchmarks/scripts/mttr_gpufleet.py, mttr_torchrun.py) share benchcommon.py: an MLP
whose model + AdamW state is ~75 MB, rank 1 SIGKILLs itself at step K on the first attempt only,
after appending the crash time to crash.jsonl; rank 0 appends each completed step's time (and its
process's start-up times on its first step) to steps.jsonl. MTTR = the first step completed by a
new process after the crash minus the crash time: measured the same way for all three launchers.
gpufleet's own phase breakdown (detect/teardown/spawn_init/load/first_step) comes from its ledger.

Runs are interleaved (A B C, A B C, ...) so machine noise hits all launchers alike; medians are
reported. ``python benchmarks/bench_mttr.py [--repeats 3]``; JSON to benchmarks/results/p3_mttr.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
RESULTS = HERE / "results"
BIN = Path(sys.executable).parent
LAUNCHERS = ("gpufleet", "gpufleet-in-process", "gpufleet-no-standby", "torchrun")
SCRIPT_PHASES = ("to_process", "import", "init", "build", "load", "first_step")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _command(launcher: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    common = ["--steps", str(args.steps), "--width", str(args.width)]
    if not args.hang:
        common += ["--kill-step", str(args.kill_step)]
    # No thread pinning: each launcher's own defaults decide, as for a user's script.
    env = {**os.environ, "BENCH_OUT": str(work / "out")}
    env.pop("OMP_NUM_THREADS", None)
    if launcher.startswith("gpufleet"):
        cmd = [
            str(BIN / "gpufleet"), "run", "-n", "2",
            "--run-dir", str(work / "run"),
            "--checkpoint-every", str(args.ckpt_every),
            "--max-restarts", "3",
            "--no-progress",
        ]  # fmt: skip
        if launcher == "gpufleet-no-standby":
            cmd.append("--no-standby")
        if launcher == "gpufleet-in-process":
            cmd.append("--in-process-restart")
        if args.hang:  # rank 1 stops at the step; only the supervisor's hang detector can notice
            cmd += [
                "--inject",
                f"hang:rank=1,step={args.kill_step}",
                "--hang-timeout",
                str(args.hang_timeout),
            ]
        cmd += ["--", sys.executable, str(SCRIPTS / "mttr_gpufleet.py"), *common]
    else:
        cmd = [
            str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
            str(SCRIPTS / "mttr_torchrun.py"), *common,
            "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", str(work / "ckpt"),
        ]  # fmt: skip
        # torch's shared rendezvous TCPStore keeps the previous round's gloo addresses, so the first
        # restart fails to connect ("Connection refused") and may hang (pytorch/pytorch#135712).
        # PyTorch's documented switch turns the sharing off; without it the baseline cannot restart.
        if not args.torchrun_shared_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return cmd, env


def one_trial(launcher: str, args: argparse.Namespace, root: Path, i: int) -> dict[str, Any]:
    work = root / f"{launcher}-{i}"
    work.mkdir(parents=True)
    cmd, env = _command(launcher, work, args)
    t0 = time.time()
    with open(work / "log.txt", "wb") as log:
        try:
            rc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    crash = _read_jsonl(work / "out" / "crash.jsonl")
    steps = _read_jsonl(work / "out" / "steps.jsonl")
    out: dict[str, Any] = {"launcher": launcher, "trial": i, "rc": rc, "wall_s": wall, "ok": False}
    if args.hang and rc == 0:  # the hang's start: rank 1's last heartbeat, as the supervisor's ledger has it
        from gpufleet.core.ledger import read_events
        from gpufleet.reliability.metrics import summarize

        inc = summarize(read_events(work / "run"))["incidents"]
        crash = [{"t": inc[0]["happened_t"], "step": inc[0]["step"]}] if inc else []
    if rc != 0 or not crash:
        out["error"] = f"exit {rc}, crash recorded: {bool(crash)}; log {work / 'log.txt'}"
        return out
    t_crash = float(crash[0]["t"])
    firsts = [s for s in steps if "start" in s]
    before = firsts[0]
    redone = _first_redone_step(steps, t_crash)
    if redone is None:
        out["error"] = "no step after the crash"
        return out
    f = redone
    out.update(
        ok=True,
        mttr_s=f["t"] - t_crash,
        crash_step=crash[0].get("step"),
        state_bytes=before["state_bytes"],
        cold_start_s=before["t"] - before["proc"],
    )
    if "start" in f:  # a process's first step: its start-up, phase by phase
        out.update(
            restore_step=f["start"],
            phases_s={
                "to_process": f["proc"] - t_crash,  # detect + teardown + spawn (fresh: + interpreter start)
                "import": f["imported"] - f["proc"],  # import torch (+ gpufleet); ~0 in a standby
                "init": f["init"] - f["imported"],  # init_process_group (gpufleet.init)
                "build": f["built"] - f["init"],  # model + DDP + optimizer
                "load": f["loaded"] - f["built"],  # newest checkpoint -> model/optimizer
                "first_step": f["t"] - f["loaded"],
            },
        )
    else:  # rank 0 rejoined in place: no new process, no script phases (the ledger has the run API's)
        out.update(restore_step=f["step"], phases_s={p: None for p in SCRIPT_PHASES})
    if launcher.startswith("gpufleet"):
        from gpufleet.core.ledger import read_events
        from gpufleet.reliability.metrics import summarize

        s = summarize(read_events(work / "run"))
        inc = [x for x in s["incidents"] if x["recovered"]]
        if inc:
            out["ledger"] = {"mttr_s": inc[0]["mttr_s"], "phases_s": inc[0]["phases_s"]}
            if inc[0].get("in_place_phases_s"):  # abort, supervisor, rendezvous, restore, first_step
                out["ledger"]["in_place_phases_s"] = inc[0]["in_place_phases_s"]
            # The ledger's clock starts when the supervisor notices the exit; the script's at the kill.
            out["ledger"]["crash_to_failure_event_s"] = inc[0]["happened_t"] - t_crash
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _first_redone_step(steps: list[dict[str, Any]], t_crash: float) -> dict[str, Any] | None:
    """The first step completed after the crash by the recovered run: the first record after the
    crash whose step is not past the steps already seen (recovery rolls back to a checkpoint). It
    holds for a new process (its first step) and for a rank that rejoined in place alike."""
    furthest = -1
    for rec in steps:
        if rec["t"] > t_crash and rec["step"] <= furthest:
            return rec
        furthest = max(furthest, rec["step"])
    return None


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(trials: list[dict[str, Any]]) -> dict[str, Any]:
    agg: dict[str, Any] = {}
    for la in LAUNCHERS:
        ok = [t for t in trials if t["launcher"] == la and t["ok"]]
        a: dict[str, Any] = {
            "trials": len([t for t in trials if t["launcher"] == la]),
            "ok": len(ok),
            "mttr_s": [round(t["mttr_s"], 4) for t in ok],
            "mttr_median_s": _median([t["mttr_s"] for t in ok]),
            "phases_median_s": {p: _median([t["phases_s"][p] for t in ok]) for p in SCRIPT_PHASES},
            "cold_start_median_s": _median([t["cold_start_s"] for t in ok]),
        }
        led = [t["ledger"] for t in ok if "ledger" in t]
        if led:
            keys = list(led[0]["phases_s"])
            a["ledger_mttr_median_s"] = _median([x["mttr_s"] for x in led])
            a["ledger_phases_median_s"] = {k: _median([x["phases_s"][k] for x in led]) for k in keys}
            a["crash_to_failure_event_median_s"] = _median([x["crash_to_failure_event_s"] for x in led])
            inp = [x["in_place_phases_s"] for x in led if "in_place_phases_s" in x]
            if inp:
                a["ledger_in_place_phases_median_s"] = {k: _median([x[k] for x in inp]) for k in inp[0]}
        agg[la] = a
    return agg


def _in_process_ratios(agg: dict[str, Any], by: dict[tuple[str, int], Any], repeats: int) -> dict[str, Any]:
    """The in-process goals: MTTR <= 0.15x torchrun and <= 0.4x gpufleet's full restart."""
    ip, full, tr = (agg[k]["mttr_median_s"] for k in ("gpufleet-in-process", "gpufleet", "torchrun"))
    return {
        "vs_torchrun": ip / tr if ip and tr else None,
        "vs_full_restart": ip / full if ip and full else None,
        "paired_vs_full_restart": [
            round(by[("gpufleet-in-process", i)]["mttr_s"] / by[("gpufleet", i)]["mttr_s"], 3)
            for i in range(repeats)
            if ("gpufleet-in-process", i) in by and ("gpufleet", i) in by
        ],
        "goals": "<= 0.15x torchrun, <= 0.4x gpufleet full restart",
    }


def render(res: dict[str, Any]) -> None:
    agg = res["launchers"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        Console = None  # type: ignore[assignment]
    rows = []
    base = agg["torchrun"]["mttr_median_s"]
    for la in LAUNCHERS:
        a = agg[la]
        m = a["mttr_median_s"]
        ph = a["phases_median_s"]
        rows.append(
            [
                la,
                f"{a['ok']}/{a['trials']}",
                f"{m:.2f}" if m is not None else "-",
                *(f"{ph[p]:.2f}" if ph[p] is not None else "-" for p in SCRIPT_PHASES),
                f"{m / base:.2f}x" if m is not None and base else "-",
            ]
        )
    head = ["launcher", "ok", "MTTR s (median)", *SCRIPT_PHASES, "vs torchrun"]
    if Console is not None:
        t = Table(
            title=f"P3 MTTR: crash of rank 1 of 2 -> first step after restore ({res['state_mb']:.0f} MB state)"
        )
        for h in head:
            t.add_column(h, justify="left" if h == "launcher" else "right")
        for r in rows:
            t.add_row(*r)
        c = Console(width=150)
        c.print(t)
        led = agg["gpufleet"].get("ledger_phases_median_s")
        if led:
            lt = Table(title="gpufleet (standby) phases from its ledger, medians, s")
            for k in [*led, "MTTR"]:
                lt.add_column(k, justify="right")
            lt.add_row(*(f"{v:.3f}" for v in led.values()), f"{agg['gpufleet']['ledger_mttr_median_s']:.3f}")
            c.print(lt)
        inp = agg.get("gpufleet-in-process", {}).get("ledger_in_place_phases_median_s")
        if inp:
            lt = Table(title="gpufleet in-process phases from its ledger (recoveries in place), medians, s")
            for k in [*inp, "MTTR"]:
                lt.add_column(k, justify="right")
            ledger_mttr = agg["gpufleet-in-process"]["ledger_mttr_median_s"]
            lt.add_row(*(f"{v:.3f}" for v in inp.values()), f"{ledger_mttr:.3f}")
            c.print(lt)
        g = res["ratio_gpufleet_vs_torchrun"]
        verdict = "[green]met[/]" if g is not None and g <= 0.5 else "[red]not met[/]"
        c.print(f"gpufleet / torchrun MTTR = {g:.2f}x (goal <= 0.5x): {verdict}" if g else "no ratio")
        pr = res["paired_ratios_gpufleet_vs_torchrun"]
        if pr:
            c.print(f"per-trial ratios (interleaved pairs): {', '.join(f'{x:.2f}' for x in pr)}")
        ip = res.get("in_process")
        if ip and ip["vs_torchrun"] is not None:
            c.print(
                f"in-process / torchrun = {ip['vs_torchrun']:.2f}x (goal <= 0.15x); "
                f"in-process / gpufleet full restart = {ip['vs_full_restart']:.2f}x (goal <= 0.4x); "
                f"paired vs full: {', '.join(f'{x:.2f}' for x in ip['paired_vs_full_restart'])}"
            )
    else:  # pragma: no cover
        print("\t".join(head))
        for r in rows:
            print("\t".join(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=1536, help="MLP width (1536: ~75 MB model+AdamW)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-step", type=int, default=25)
    ap.add_argument(
        "--hang",
        action="store_true",
        help="a hang of rank 1 at --kill-step instead of a crash (gpufleet launchers only: torchrun "
        "has no hang detection); MTTR from the ledger (hang start = rank 1's last heartbeat)",
    )
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="--hang: gpufleet's hang timeout floor")
    ap.add_argument("--timeout", type=float, default=180.0, help="per launch, seconds")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument(
        "--torchrun-shared-store",
        action="store_true",
        help="leave torchrun's shared rendezvous store on (restarts then fail on this torch; see source)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("--out", default=str(RESULTS / "p3_mttr.json"))
    args = ap.parse_args()
    launchers = [x for x in args.launchers.split(",") if x]
    if args.hang:
        launchers = [x for x in launchers if x.startswith("gpufleet")]
    root = Path(tempfile.mkdtemp(prefix="p3_mttr_"))
    load_start = os.getloadavg()
    trials = []
    try:
        for i in range(args.repeats):
            for la in launchers:
                t = one_trial(la, args, root, i)
                trials.append(t)
                msg = f"{t['mttr_s']:.2f}s" if t["ok"] else f"FAILED ({t.get('error')})"
                print(f"  trial {i} {la:20s} MTTR {msg}  (run {t['wall_s']:.1f}s)", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run directories kept under {root}", file=sys.stderr)
    agg = aggregate(trials)
    g, b = agg["gpufleet"]["mttr_median_s"], agg["torchrun"]["mttr_median_s"]
    ns = agg["gpufleet-no-standby"]["mttr_median_s"]
    state = next((t["state_bytes"] for t in trials if t.get("ok")), 0)
    by = {(t["launcher"], t["trial"]): t for t in trials if t["ok"]}
    paired = [
        by[("gpufleet", i)]["mttr_s"] / by[("torchrun", i)]["mttr_s"]
        for i in range(args.repeats)
        if ("gpufleet", i) in by and ("torchrun", i) in by
    ]
    res = {
        "benchmark": "p3_mttr",
        "goal": "gpufleet MTTR <= 0.5 x torchrun --max-restarts with DCP",
        "definition": "crash time (written by the killed rank right before SIGKILL) -> first step completed "
        "by a new rank-0 process (written by the script); same for all launchers",
        "config": {
            "world_size": 2,
            "width": args.width,
            "state_bytes": state,
            "steps": args.steps,
            "checkpoint_every_steps": args.ckpt_every,
            "fault": (
                f"rank 1 hangs at step {args.kill_step} (hang timeout {args.hang_timeout} s)"
                if args.hang
                else f"rank 1 SIGKILL at step {args.kill_step}, first attempt only"
            ),
            "repeats": args.repeats,
            "torchrun_flags": "--standalone --nproc-per-node 2 --max-restarts 3",
            "torchrun_env": {} if args.torchrun_shared_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(),
        },
        "launchers": agg,
        "ratio_gpufleet_vs_torchrun": (g / b) if g and b else None,
        "ratio_gpufleet_no_standby_vs_torchrun": (ns / b) if ns and b else None,
        "paired_ratios_gpufleet_vs_torchrun": [round(x, 3) for x in paired],
        "paired_ratio_median": _median(paired),
        "goal_met": bool(g and b and g / b <= 0.5),
        "in_process": _in_process_ratios(agg, by, args.repeats),
        "trials": trials,
        "state_mb": state / 1e6,
    }
    try:
        import torch

        res["machine"]["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    render(res)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(t["ok"] for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
