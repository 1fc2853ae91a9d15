"""Thread priority for background work in a training rank: what the ranks' own threads leave idle.

A standby's warm-up imports (train/standby.py) and a hot spare's preloads (train/held.py) run at
``SCHED_IDLE``, and go back to normal priority once the work they do is on the critical path.
"""

from __future__ import annotations

import os
import threading

__all__ = ["restore_threads", "set_idle"]


def set_idle() -> bool:
    """Put the calling thread in ``SCHED_IDLE`` (else nice 19); False when neither is possible."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread (Linux)
        return True
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # on Linux, this thread too
        return True
    except OSError:
        return False


def restore_threads() -> None:
    """Best effort: every other thread of this process that is in ``SCHED_IDLE`` back to normal."""
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if tid != threading.get_native_id() and os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass  # gone, or not permitted unprivileged: an idle native helper, harmless
