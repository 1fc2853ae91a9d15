"""A Ray Train TorchTrainer whose loop uses gpufleet's run API through gpufleet.ray (the test's driver).

    python ray_trainer.py --address HOST:PORT --run-dir DIR [--steps N] [--crash-at STEP] [--nan-at STEP]

--crash-at: rank 1 dies (os._exit) at that step, once. --nan-at: gpufleet's own drill (``nan:step=S``,
gpufleet.train.faults) turns the logged loss into NaN at that step, once: the spike guard raises
SpikeDetected on every rank. Each is a worker-group failure for Ray Train; FailureConfig(max_failures=
the number of drills) lets it restart the group, and gpufleet's restore resumes every rank from the
newest verified checkpoint. Markers in DIR (``crashed``, ``spiked``) keep a drill from firing again
after the restart, and each waits until the checkpoint before it is committed, so which one is the
newest verified is known. Rank 0 writes DIR/final-<pid>.json: the sha256 of the final weights, the step it
started from, the steps it ran. The driver prints one JSON line: the fit's error (null) and its wall time.
"""

import argparse
import json
import os
import tempfile
import time


def wait_committed(run_dir, step: int, timeout: float = 120.0) -> None:
    """Until checkpoint ``step``'s manifest is written (its commit): a drill then fails the group with a
    known newest verified checkpoint, instead of racing a persist that load may slow down. (The
    ``ckpt_committed`` event is written later, from the training thread, which a drill ends.)"""
    from pathlib import Path

    manifest = Path(run_dir, "checkpoints", f"step_{step:08d}", "manifest.json")
    end = time.monotonic() + timeout
    while not manifest.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"checkpoint {step} not committed within {timeout:.0f} s")
        time.sleep(0.1)


def train_loop(config):
    import hashlib
    from pathlib import Path

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpufleet
    import gpufleet.ray
    from gpufleet.train.faults import faults_to_env, parse_faults

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    run_dir = Path(config["run_dir"])
    os.environ.pop("GPUFLEET_FAULTS", None)  # the drill spec (gpufleet run --inject sets it so)
    if config["nan_at"] >= 0 and not (run_dir / "spiked").exists():
        os.environ["GPUFLEET_FAULTS"] = faults_to_env(parse_faults([f"nan:step={config['nan_at']}"]))
    run = gpufleet.ray.init(run_dir=str(run_dir), checkpoint_every="4")
    data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    target = data @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(model)  # Ray Train set torch.distributed up (gloo)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = gpufleet.StepSampler(len(data), 16, seed=3, rank=run.rank, world_size=run.world_size)
    state = {"model": model, "optim": optim, "rng": gpufleet.RNGState()}
    start = run.restore(state)
    seen = []
    for step in run.steps(config["steps"], steps_per_epoch=sampler.steps_per_epoch):
        if step == config["crash_at"] and run.rank == 1 and not (run_dir / "crashed").exists():
            wait_committed(run_dir, step // 4 * 4)
            (run_dir / "crashed").write_text(str(step))
            os._exit(1)  # the worker process dies mid-run
        idx = sampler.indices(step)
        seen.append(step)
        loss = nn.functional.mse_loss(model(data[idx]), target[idx])
        loss.backward()
        try:
            run.log(loss=loss)  # the NaN drill fires here, on every rank
        except gpufleet.ray.SpikeDetected:
            wait_committed(run_dir, step // 4 * 4)  # both ranks: Ray Train stops the group on one error
            if run.rank == 0:  # after every rank's init of this group (each step is a collective)
                (run_dir / "spiked").write_text(str(step))
            raise  # a failure for Ray Train: FailureConfig restarts the worker group
        optim.step()
        optim.zero_grad()
        gpufleet.ray.report(run, loss=loss.item())
    if run.rank == 0:
        h = hashlib.sha256()
        for k, v in sorted(model.module.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().numpy().tobytes())
        out = {"sha256": h.hexdigest(), "start": start, "steps": seen}
        Path(config["run_dir"], f"final-{os.getpid()}.json").write_text(json.dumps(out))
    run.finish()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--nan-at", type=int, default=-1)
    args = ap.parse_args()
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Ray Train's controller polls the worker group every 2 s by default and starts a preemption
    # watcher actor: on a loaded 2-core host, poll faster and skip the watcher (no preemption here).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    t0 = time.monotonic()
    drills = (args.crash_at >= 0) + (args.nan_at >= 0)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "run_dir": args.run_dir,
            "steps": args.steps,
            "crash_at": args.crash_at,
            "nan_at": args.nan_at,
        },
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=tempfile.mkdtemp(prefix="raytrain-"),
            failure_config=FailureConfig(max_failures=drills),
        ),
    )
    result = trainer.fit()
    error = repr(result.error) if result.error else None
    print(json.dumps({"error": error, "fit_s": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
