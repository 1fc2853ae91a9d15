"""P3 training script, baseline flavour: plain PyTorch + DCP, meant for ``torchrun --max-restarts``.

Same model, data, crash logic and timestamps as ``mttr_gpufleet.py``. Checkpoints: every
``--ckpt-every`` steps, ``torch.distributed.checkpoint.save`` (synchronous) into CKPT/step_N, then
rank 0 writes CKPT/step_N/.committed; on start every rank loads the newest committed one with
``torch.distributed.checkpoint.load`` (through ``get_state_dict``/``set_state_dict``).
"""

import time

T_PROC = time.time()  # before any import, as in mttr_gpufleet.py

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402

import benchcommon as bc  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def newest_committed(root: str) -> tuple[int, str] | None:
    best = None
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = re.fullmatch(r"step_(\d+)", name)
            path = os.path.join(root, name)
            if m and os.path.exists(os.path.join(path, ".committed")):
                if best is None or int(m.group(1)) > best[0]:
                    best = (int(m.group(1)), path)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--kill-rank", type=int, default=1)
    args = ap.parse_args()
    t_imported = time.time()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    t_init = time.time()
    model = DDP(bc.build_model(args.width))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_built = time.time()
    start = 0
    found = newest_committed(args.ckpt_dir)
    if found is not None:
        start, path = found
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    t_loaded = time.time()
    first = True
    for step in range(start, args.steps):
        if step > start and step % args.ckpt_every == 0:
            path = os.path.join(args.ckpt_dir, f"step_{step}")
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            if rank == 0:
                open(os.path.join(path, ".committed"), "w").close()
        bc.crash_once_at(step, rank, args.kill_rank, args.kill_step)
        x, y = bc.batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            rec = {"t": time.time(), "pid": os.getpid(), "step": step}
            if first:
                rec.update(
                    start=start,
                    proc=T_PROC,
                    imported=t_imported,
                    init=t_init,
                    built=t_built,
                    loaded=t_loaded,
                    state_bytes=bc.state_bytes(model.module),
                )
                first = False
            bc.append("steps.jsonl", rec)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
