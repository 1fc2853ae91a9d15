"""A standby worker: an interpreter that has already imported torch and waits to become a rank.

Started ahead of time by the local backend. On a restart the supervisor writes one JSON line to
its stdin ({"env": {...}, "argv": [...], "module": bool}); the standby applies it and runs the
training script as ``__main__``. This removes interpreter start-up and ``import torch`` from MTTR.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

from gpufleet.core.env import Env


def main() -> None:
    import torch  # noqa: F401  -- the point: pay for this before a failure, not after
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import gpufleet.train.run  # noqa: F401

    line = sys.stdin.readline()
    if not line:  # the supervisor closed us: not needed
        return
    order = json.loads(line)
    os.environ.update(order["env"])
    os.environ[Env.SPAWN_T] = str(time.time())
    sys.stdin.close()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, so nothing else lands there
    if order.get("log"):  # the supervisor's live view owns the terminal: write to the rank's log file
        fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    argv: list[str] = order["argv"]
    sys.argv = list(argv)
    if order.get("module"):
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
