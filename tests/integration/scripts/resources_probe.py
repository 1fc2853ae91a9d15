"""A worker that reports what it was given: thread count, thread variables, CPUs, scheduling policy.

Writes RUN_DIR/probe-ATTEMPT-RANK.json. ``--fail-rank R``: that rank exits 1 in attempt 0, so the
supervisor restarts the run once (the second attempt's ranks are promoted standbys when standbys are on).
No thread pinning, as users write it.
"""

import argparse
import json
import os
import threading

import torch

import gpufleet

VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-rank", type=int, default=None)
    args = ap.parse_args()
    run = gpufleet.init()
    x = torch.randn(256, 256)
    (x @ x).sum()  # start the intra-op pool

    seen: dict[str, int] = {}

    def child() -> None:
        seen["policy"] = os.sched_getscheduler(0)

    t = threading.Thread(target=child)
    t.start()
    t.join()
    masks = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except OSError:
            pass  # a thread that just ended
    attempt = int(os.environ.get("GPUFLEET_ATTEMPT", "0"))
    out = {
        "vars": {v: os.environ.get(v) for v in VARS},
        "torch_threads": torch.get_num_threads(),
        "policy": os.sched_getscheduler(0),
        "child_policy": seen["policy"],
        "cpus": sorted(os.sched_getaffinity(0)),
        "thread_cpus": sorted(masks),
        "world_size": run.world_size,
    }
    with open(os.path.join(run.run_dir, f"probe-{attempt}-{run.rank}.json"), "w") as f:
        json.dump(out, f)
    if run.world_size > 1:  # every rank has written its report before one fails the attempt
        torch.distributed.barrier()
    if args.fail_rank == run.rank and attempt == 0:
        os._exit(1)
    run.restore({"w": torch.zeros(1)})
    for _ in run.steps(2):
        run.log(loss=1.0)
    run.finish()


if __name__ == "__main__":
    main()
