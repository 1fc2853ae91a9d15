"""``gpufleet demo`` as a library: a reference run, a faulted run, the report, the exact-recovery check.

Both runs train the same tiny GPT (:mod:`gpufleet.demo.train_lm`) with the same seed under the
supervisor. The faulted run gets a crash, a hang, a NaN and a corrupted checkpoint injected; the
supervisor recovers from each, and the final weights must be bit-identical to the reference.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpufleet.demo import render
from gpufleet.demo.config import CONFIG_NAME, DemoConfig, DemoResult, RunTiming

__all__ = ["DemoConfig", "DemoResult", "RunTiming", "fault_plan", "run_demo", "train_command"]


def train_command(cfg: DemoConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpufleet.demo.train_lm",
        "--steps",
        str(cfg.steps),
        "--seed",
        str(cfg.seed),
        *(["--quiet"] if cfg.progress else []),
        *cfg.extra_args,
    ]


def fault_plan(steps: int, every: int, nproc: int = 2) -> list[str]:
    """Four different failures spread over the run, each between two checkpoints.

    * ``kill`` the last rank a little after a checkpoint, whose files are then corrupted
      (``ckpt_corrupt``): the restore rejects it and falls back to the one before;
    * ``hang`` rank 0 mid-run: only the heartbeat timeout notices;
    * a ``nan`` loss late in the run: all ranks agree, roll back and replay the window.
    """
    half = every // 2

    def at(frac: float) -> int:
        return (int(steps * frac) // every) * every + half

    kill, hang, nan = at(0.3), at(0.55), at(0.8)
    corrupt = kill - half
    last = nproc - 1
    return [
        f"ckpt_corrupt:step={corrupt}",
        f"kill:rank={last},step={kill},settle=1",  # settle: the corrupt save is on disk to be caught
        f"hang:rank=0,step={hang},settle=1",
        f"nan:step={nan}",
    ]


def _supervise(cfg: DemoConfig, run_dir: Path, inject: list[str], name: str) -> RunTiming:
    from gpufleet.train.supervisor import Supervisor, SupervisorConfig

    if run_dir.exists():
        shutil.rmtree(run_dir)  # a leftover run would resume from its checkpoints
    run_dir.mkdir(parents=True)
    (run_dir / CONFIG_NAME).write_text(json.dumps({**cfg.identity(), "inject": inject}, indent=2) + "\n")
    scfg = SupervisorConfig(
        command=train_command(cfg),
        nproc=cfg.nproc,
        run_dir=str(run_dir),
        inject=list(inject),
        max_restarts=cfg.max_restarts,
        hang_timeout_floor=cfg.hang_timeout_floor,
        checkpoint_every=str(cfg.checkpoint_every),
        progress=cfg.progress,
        in_process_restart=cfg.in_process and cfg.nproc > 1,
    )
    t0 = time.monotonic()
    out = Supervisor(scfg).run()
    return RunTiming(name, run_dir, out.status, out.exit_code, out.restarts, time.monotonic() - t0)


def _reusable_reference(cfg: DemoConfig, ref_dir: Path) -> bool:
    try:
        saved = json.loads((ref_dir / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return all(saved.get(k) == v for k, v in cfg.identity().items())


def run_demo(cfg: DemoConfig, console: Any = None) -> DemoResult:
    """Run the whole demo; prints as it goes when ``console`` (a rich Console) is given."""
    ref_dir, flt_dir = cfg.dir / "reference", cfg.dir / "faulted"
    inject = fault_plan(cfg.steps, cfg.checkpoint_every, cfg.nproc)
    say = render.Say(console)
    say.intro(cfg, inject)

    reference: RunTiming | None = None
    have_reference = False
    if cfg.reference:
        say.stage("1/3", f"reference run, no faults -> {ref_dir}")
        reference = _supervise(cfg, ref_dir, [], "reference")
        say.finished(reference)
        have_reference = reference.status == "completed"
    else:
        have_reference = _reusable_reference(cfg, ref_dir)
        say.skip_reference(ref_dir, have_reference)

    say.stage("2/3", f"faulted run, {len(inject)} injected failures -> {flt_dir}")
    faulted = _supervise(cfg, flt_dir, inject, "faulted")
    say.finished(faulted)

    say.stage("3/3", "report")
    timeline = render.report(flt_dir, console, plot=cfg.plot)
    render.loss_summary(console, [r for r in (reference, faulted) if r is not None])
    render.sample(console, flt_dir)

    identical: bool | None = None
    comparison: dict[str, Any] | None = None
    if have_reference and faulted.status == "completed":
        from gpufleet.demo.compare import compare_runs

        c = compare_runs(ref_dir, flt_dir)
        identical, comparison = c.identical, c.to_dict()
        say.comparison(c)
    else:
        say.no_comparison(have_reference, faulted)

    if faulted.status != "completed":
        code = faulted.exit_code or 1
    elif reference is not None and reference.status != "completed":
        code = reference.exit_code or 1
    elif identical is False:
        code = 1
    else:
        code = 0
    result = DemoResult(reference, faulted, inject, identical, comparison, timeline, code)
    (cfg.dir / "demo_result.json").write_text(json.dumps(asdict(result), indent=2, default=str) + "\n")
    return result
