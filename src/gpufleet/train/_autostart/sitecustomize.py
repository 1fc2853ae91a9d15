"""Imported by Python at each rank's start-up (this directory is first on ``PYTHONPATH``).

It starts :mod:`gpufleet.train.autostep` (no torch is imported here), then runs the
``sitecustomize`` this one shadows, if the environment has one, so the user's keeps working.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _start() -> None:
    try:
        from gpufleet.train import autostep

        autostep.activate()
    except Exception:  # noqa: BLE001 - an interpreter that cannot import gpufleet, or a bad setting
        pass


def _chain() -> None:
    """Load the next ``sitecustomize`` on the path (after this directory) under the same name."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - as site.py does: a failing sitecustomize is reported, not fatal
        import traceback

        print("Error in sitecustomize; set PYTHONVERBOSE for traceback:", file=sys.stderr)
        traceback.print_exc()


_start()
_chain()
