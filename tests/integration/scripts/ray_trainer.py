"""A Ray Train TorchTrainer whose loop uses gpufleet's run API through gpufleet.ray (the test's driver).

    python ray_trainer.py --address HOST:PORT --run-dir DIR [--crash-at STEP]

With --crash-at, rank 1 dies (os._exit) at that step once; FailureConfig(max_failures=1) lets Ray Train
restart the worker group, and gpufleet's restore resumes from the newest verified checkpoint. Rank 0
writes DIR/final-<pid>.json: the sha256 of the final weights, the step it started from, the steps seen.
"""

import argparse
import json
import os
import tempfile

STEPS = 24


def train_loop(config):
    import hashlib
    from pathlib import Path

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpufleet
    import gpufleet.ray

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    run = gpufleet.ray.init(run_dir=config["run_dir"], checkpoint_every="5")
    data = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
    target = data @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(model)  # Ray Train set torch.distributed up (gloo)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = gpufleet.StepSampler(len(data), 16, seed=3, rank=run.rank, world_size=run.world_size)
    state = {"model": model, "optim": optim, "rng": gpufleet.RNGState()}
    start = run.restore(state)
    marker = Path(config["run_dir"]) / "crashed"
    seen = []
    for step in run.steps(STEPS, steps_per_epoch=sampler.steps_per_epoch):
        if step == config["crash_at"] and run.rank == 1 and not marker.exists():
            marker.write_text(str(step))
            os._exit(1)  # the worker process dies mid-run
        idx = sampler.indices(step)
        seen.append(step)
        loss = nn.functional.mse_loss(model(data[idx]), target[idx])
        loss.backward()
        run.log(loss=loss)
        optim.step()
        optim.zero_grad()
        gpufleet.ray.report(run, loss=float(loss))
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
    ap.add_argument("--crash-at", type=int, default=-1)
    args = ap.parse_args()
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"run_dir": args.run_dir, "crash_at": args.crash_at},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=tempfile.mkdtemp(prefix="raytrain-"),
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    result = trainer.fit()
    print(json.dumps({"error": repr(result.error) if result.error else None}))


if __name__ == "__main__":
    main()
