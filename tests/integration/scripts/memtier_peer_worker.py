"""One rank of a multi-node checkpoint job for the peer memory tier tests (real gloo, real DCP).

``save STEPS``: saves each step of a deterministic state, waits for it (commit + peer replication).
``load [MAX_STEP ...]``: for each MAX_STEP (0: the newest) loads into a blank state, checks it
bit-exact against the state of the step it got, prints one JSON line (step, source, path).
``--kill-at N --kill-after-step S``: SIGKILL this rank at the N-th peer message it sends or receives
once step S's replication started (messages are 4 KiB here, so N picks a point inside the bytes).
"""

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from gpufleet.checkpoint import CheckpointConfig, CheckpointEngine
from gpufleet.checkpoint.storage import peer
from gpufleet.core.ledger import Ledger, NullSink


def state(step: int, rank: int, blank: bool = False) -> dict:
    g = torch.Generator().manual_seed(step)
    fill = (lambda *s: torch.zeros(*s)) if blank else (lambda *s: torch.randn(*s, generator=g))
    return {
        "model": {"w": fill(96, 128), "b": fill(128)},
        "optim": {"m": fill(96, 128)},
        f"rng.rank{rank}": torch.zeros(64) if blank else torch.full((64,), float(rank * 1000 + step)),
        "step": -1 if blank else step,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("mode", choices=["save", "load"])
    ap.add_argument("steps", nargs="*", type=int)
    ap.add_argument("--budget", type=int, default=4 << 20)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--kill-after-step", type=int, default=None)
    ap.add_argument("--then-load", action="store_true", help="save mode: then load the newest, as load does")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    peer._CHUNK = 4096  # many messages per file: kill points inside a file's bytes
    sink = Ledger(args.root) if rank == 0 else NullSink()
    cfg = CheckpointConfig(dir=os.path.join(args.root, "ck"), memory_bytes=args.budget)
    eng = CheckpointEngine(cfg, rank=rank, world_size=world, sink=sink)
    armed = {"on": False, "n": 0}
    if args.kill_at is not None:

        def count() -> None:
            if armed["on"]:
                armed["n"] += 1
                if armed["n"] >= args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

        send, recv = peer._isend_chunk, peer._recv_chunk

        def isend(t, dst, group):  # noqa: ANN001, ANN202
            count()
            return send(t, dst, group)

        def recv_(t, src, group):  # noqa: ANN001, ANN202
            count()
            return recv(t, src, group)

        peer._isend_chunk, peer._recv_chunk = isend, recv_
    if args.mode == "save":
        for step in args.steps:
            armed["on"] = step == args.kill_after_step
            assert eng.save(step, state(step, rank), meta={"world_size": world}, force=True)
            eng.wait()
    loads = ([0] if args.then_load else []) if args.mode == "save" else (args.steps or [0])
    for max_step in loads:  # 0: the newest
        got = state(0, rank, blank=True)
        r = eng.load(got, max_step=max_step or None)
        if r is None:
            out = {"rank": rank, "step": None}
        else:
            ref = state(r.step, rank)
            same = all(torch.equal(got[k][s], ref[k][s]) for k in ("model", "optim") for s in ref[k])
            same = same and torch.equal(got[f"rng.rank{rank}"], ref[f"rng.rank{rank}"])
            same = same and got["step"] == r.step
            out = {"rank": rank, "step": r.step, "source": r.source, "path": r.path, "exact": same}
        print(json.dumps(out), flush=True)
    eng.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
