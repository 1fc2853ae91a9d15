"""``python -m gpufleet.cli.agent``: the srun backend's per-node agent (:mod:`gpufleet.backends.agent`)."""

from __future__ import annotations

from gpufleet.backends.agent import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
