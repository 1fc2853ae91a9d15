"""Fault injection drills: a tiny spec language shared by the CLI, the supervisor and workers.

Spec: ``KIND[:key=value[,key=value...]]``, e.g. ``kill:rank=1,step=40`` or ``nan:step=120``.

=============  =====================================================  ==========================
kind           effect                                                  keys
=============  =====================================================  ==========================
kill           SIGKILL the rank at a step or after some seconds        rank, step | after, settle
hang           the rank stops making progress (sleeps forever)         rank, step, settle
nan            the logged loss becomes NaN                             step, rank
spike          the logged loss is multiplied by ``factor``             step, rank, factor
slow           the rank sleeps ``delay`` seconds per step              rank, delay, from, to
ckpt_fail      the checkpoint save at/after ``step`` fails to persist  step
ckpt_corrupt   a byte of that checkpoint is flipped after commit       step
=============  =====================================================  ==========================

A fault fires once: the supervisor drops fired faults before restarting. ``persist=1`` makes it fire
again after every restart (a data-caused spike, say). ``slow`` fires at the first step it slows (its
``inject`` event) and slows that whole attempt; the next one runs at full speed unless it persists.
``rank`` defaults to 0 (``nan``/``spike``: all).
``settle=1`` (kill, hang) first waits for the rank's in-flight checkpoint save to commit, so the drill
tests recovery from a known checkpoint instead of racing a persist that machine load may slow down.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from gpufleet.core import events as E
from gpufleet.core.errors import UsageError
from gpufleet.core.units import parse_duration

__all__ = ["Fault", "parse_fault", "parse_faults", "FaultInjector", "FAULT_KINDS"]

FAULT_KINDS: dict[str, set[str]] = {
    "kill": {"rank", "step", "after", "settle"},
    "hang": {"rank", "step", "settle"},
    "nan": {"rank", "step"},
    "spike": {"rank", "step", "factor"},
    "slow": {"rank", "delay", "from", "to"},
    "ckpt_fail": {"step"},
    "ckpt_corrupt": {"step"},
}
_COMMON = {"persist"}


@dataclass
class Fault:
    kind: str
    id: int
    rank: int | None = None
    step: int | None = None
    after: float | None = None
    factor: float = 100.0
    delay: float = 0.0
    start: int = 0
    stop: int | None = None
    persist: bool = False
    settle: bool = False
    spec: str = field(default="", compare=False)

    def applies_to(self, rank: int) -> bool:
        if self.rank is None:
            return self.kind in ("nan", "spike", "ckpt_fail", "ckpt_corrupt") or rank == 0
        return self.rank == rank


def _seconds(value: str, spec: str) -> float:
    return parse_duration(value, f"bad duration in fault {spec!r}")


def _int(value: str, key: str, spec: str) -> int:
    try:
        out = int(value)
    except ValueError:
        raise UsageError(f"{key} must be an integer in fault {spec!r}") from None
    if out < 0:
        raise UsageError(f"{key} must be >= 0 in fault {spec!r}")
    return out


def _flag(value: str) -> bool:
    return value not in ("0", "false", "no")


def parse_fault(spec: str, fid: int = 0) -> Fault:
    """Parse one fault spec; raises UsageError (one line) on anything invalid."""
    kind, _, rest = spec.strip().partition(":")
    if kind not in FAULT_KINDS:
        raise UsageError(f"unknown fault kind {kind!r} in {spec!r}; valid kinds: {', '.join(FAULT_KINDS)}")
    f = Fault(kind=kind, id=fid, spec=spec.strip())
    allowed = FAULT_KINDS[kind] | _COMMON
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise UsageError(
                f"bad key {item!r} in fault {spec!r}; valid keys for {kind}: {', '.join(sorted(allowed))}"
            )
        value = value.strip()
        if key == "rank":
            f.rank = _int(value, key, spec)
        elif key == "step":
            f.step = _int(value, key, spec)
        elif key == "after":
            f.after = _seconds(value, spec)
        elif key == "factor":
            try:
                f.factor = float(value)
            except ValueError:
                raise UsageError(f"factor must be a number in fault {spec!r}") from None
        elif key == "delay":
            f.delay = _seconds(value, spec)
        elif key == "from":
            f.start = _int(value, key, spec)
        elif key == "to":
            f.stop = _int(value, key, spec)
        elif key == "persist":
            f.persist = _flag(value)
        elif key == "settle":
            f.settle = _flag(value)
    if kind in ("hang", "nan", "spike", "ckpt_fail", "ckpt_corrupt") and f.step is None:
        raise UsageError(f"fault {spec!r} needs step=N")
    if kind == "kill" and f.step is None and f.after is None:
        raise UsageError(f"fault {spec!r} needs step=N or after=DURATION")
    if kind == "slow" and f.delay <= 0:
        raise UsageError(f"fault {spec!r} needs delay=DURATION > 0")
    return f


def parse_faults(specs: list[str]) -> list[Fault]:
    return [parse_fault(s, i) for i, s in enumerate(specs)]


def faults_to_env(faults: list[Fault]) -> str:
    return json.dumps([asdict(f) for f in faults])


def faults_from_env(value: str | None) -> list[Fault]:
    if not value:
        return []
    return [Fault(**d) for d in json.loads(value)]


class FaultInjector:
    """Worker-side: fires the faults meant for this rank at the right step."""

    def __init__(
        self,
        faults: list[Fault],
        rank: int,
        emit: Callable[[E.Event], None],
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self._faults = [f for f in faults if f.applies_to(rank)]
        self._emit = emit  # an EventSink's emit
        self._settle = settle  # waits for this rank's in-flight checkpoint save to finish
        self._t0 = time.monotonic()
        self._slowing: set[int] = set()  # slow drills already announced (they go on sleeping)

    def _fire(self, f: Fault, step: int) -> None:
        if f.settle and self._settle is not None:
            self._settle()
        self._emit(E.Inject(fault=f.kind, fault_id=f.id, step=step, spec=f.spec, persist=f.persist))
        if not f.persist:
            self._faults.remove(f)

    def before_step(self, step: int) -> None:
        """Crash, hang or slow this rank before it runs ``step``."""
        for f in list(self._faults):
            if f.kind == "kill" and (
                (f.step is not None and step >= f.step)
                or (f.after is not None and time.monotonic() - self._t0 >= f.after)
            ):
                self._fire(f, step)
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "hang" and f.step is not None and step >= f.step:
                self._fire(f, step)
                while True:  # a hung rank: alive, silent, not progressing
                    time.sleep(3600)
            elif f.kind == "slow" and step >= f.start and (f.stop is None or step < f.stop):
                if f.id not in self._slowing:  # recorded once: the supervisor drops it from the next attempt
                    self._slowing.add(f.id)
                    self._emit(
                        E.Inject(fault=f.kind, fault_id=f.id, step=step, spec=f.spec, persist=f.persist)
                    )
                time.sleep(f.delay)

    def loss(self, step: int, value: float) -> float:
        """Corrupt the logged loss at the configured step."""
        for f in list(self._faults):
            if f.kind in ("nan", "spike") and f.step == step:
                self._fire(f, step)
                return float("nan") if f.kind == "nan" else value * f.factor
        return value

    def checkpoint_fault(self, step: int) -> Fault | None:
        """The checkpoint fault due for a save at ``step``, not yet fired: call :meth:`fired` once the
        save has really started (a save skipped behind a slow persist must not use the fault up)."""
        for f in self._faults:
            if f.kind in ("ckpt_fail", "ckpt_corrupt") and f.step is not None and step >= f.step:
                return f
        return None

    def fired(self, f: Fault, step: int) -> None:
        """Record that ``f`` took effect at ``step`` (one-shot faults are dropped)."""
        self._fire(f, step)
