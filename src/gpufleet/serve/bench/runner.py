"""The load loop: open-loop (a rate and an arrival process) or closed-loop (a concurrency).

Every load runs in worker processes (``processes``, default 1) so that the parent's live view never
steals the GIL from a sender. Request ``i`` goes to worker ``i % processes``. Workers build their
request bodies before the start, then wait for one shared start time (``perf_counter`` is
CLOCK_MONOTONIC on Linux, the same clock in every process).

Send timing: sleep on the event loop until ``SPIN_S`` before the intended time, then yield to the
loop (``sleep(0)``) until it is reached; loop timers round to about 1 ms, this does not. Ctrl-C (or
``stop``) stops new sends, cancels requests in flight (recorded as ``interrupted``) and returns
what was recorded.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gpufleet.core.env import Env
from gpufleet.serve.bench.arrivals import Arrival, schedule
from gpufleet.serve.bench.client import ClientConfig, RequestRecord, build_body, send
from gpufleet.serve.common.workload import TraceWorkload, Workload

__all__ = ["LoadPlan", "LoadResult", "Progress", "run_load", "SPIN_S"]

SPIN_S = 0.0015
_N = 4  # counters per worker: sent, done, failed, in-flight


@dataclass(frozen=True)
class LoadPlan:
    client: ClientConfig
    workload: Workload
    rate: float | None = None  # open loop; with a trace, rescales it to this mean rate
    arrival: Arrival = field(default_factory=lambda: Arrival("poisson"))
    concurrency: int | None = None  # closed loop
    requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    warmup_s: float = 0.0
    seed: int = 0
    processes: int = 1
    tokenizer: str | None = None

    def offsets(self) -> list[float] | None:
        """Intended send offsets of the open-loop requests (None for closed loop)."""
        if self.concurrency:
            return None
        if isinstance(self.workload, TraceWorkload):
            ents = self.workload.entries
            ents = ents if self.requests is None else ents[: self.requests]
            offs = [(e.timestamp_ms - ents[0].timestamp_ms) / 1000.0 for e in ents]
            if self.rate and len(offs) > 1 and offs[-1] > 0:
                scale = (len(offs) - 1) / self.rate / offs[-1]
                offs = [o * scale for o in offs]
            if self.duration_s is not None:
                offs = [o for o in offs if o < self.duration_s]
            return offs
        assert self.rate is not None
        return schedule(
            self.arrival, self.rate, count=self.requests, duration_s=self.duration_s, seed=self.seed
        )


@dataclass
class Progress:
    """Counters summed over the workers, for the live view."""

    sent: int = 0
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    elapsed_s: float = 0.0
    planned: int | None = None


@dataclass
class LoadResult:
    records: list[RequestRecord]
    started_unix: float
    interrupted: bool
    processes: int
    planned: int | None


def _is_warmup(plan: LoadPlan, idx: int, intended: float) -> bool:
    return idx < plan.warmup_requests or (plan.warmup_s > 0 and intended < plan.warmup_s)


async def _worker_async(
    plan: LoadPlan, wid: int, offsets: list[float] | None, t0: float, counters: Any, stop_evt: Any
) -> list[RequestRecord]:
    import aiohttp

    tok = None
    if plan.tokenizer:
        from gpufleet.serve.bench.tokens import load_tokenizer

        tok = load_tokenizer(plan.tokenizer)
    cfg, P, base = plan.client, plan.processes, wid * _N
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task[RequestRecord]] = set()

    stats = [0, 0]  # done, failed

    def count(rec: RequestRecord) -> None:
        stats[0] += 1
        stats[1] += 1 if rec.error else 0

    def done_cb(t: asyncio.Task[RequestRecord]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is None and isinstance(t.result(), RequestRecord):
            count(t.result())

    async def watch() -> None:
        while True:
            if stop_evt.is_set():
                stopping.set()
            counters[base : base + _N] = [len(records), stats[0], stats[1], len(records) - stats[0]]
            await asyncio.sleep(0.1)

    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
    ) as session:
        watcher = asyncio.create_task(watch())
        perf = time.perf_counter
        if offsets is not None:
            mine = list(range(wid, len(offsets), P))
            bodies = [build_body(cfg, plan.workload.request(i)) for i in mine]
            asked = (
                [
                    (plan.workload.request(i).input_tokens, plan.workload.request(i).output_tokens)
                    for i in mine
                ]
                if len(mine) <= 200_000
                else [(0, 0)] * len(mine)
            )
            burst = 0
            for k, i in enumerate(mine):
                if stopping.is_set():
                    break
                target = t0 + offsets[i]
                delay = target - perf()
                if delay > SPIN_S:
                    burst = 0
                    await asyncio.sleep(delay - SPIN_S)
                while perf() < target and not stopping.is_set():
                    await asyncio.sleep(0)
                if delay <= 0:
                    burst += 1
                    if burst % 32 == 0:
                        await asyncio.sleep(0)
                rec = RequestRecord(
                    i,
                    offsets[i],
                    input_tokens_asked=asked[k][0],
                    output_tokens_asked=asked[k][1],
                    warmup=_is_warmup(plan, i, offsets[i]),
                )
                records.append(rec)
                t = asyncio.create_task(send(session, cfg, bodies[k], rec, t0, tok))
                tasks.add(t)
                t.add_done_callback(done_cb)
        else:
            await asyncio.sleep(max(0.0, t0 - perf()))
            share = (plan.concurrency or 1) // P + (1 if wid < (plan.concurrency or 1) % P else 0)
            next_idx = [wid]
            deadline = None if plan.duration_s is None else t0 + plan.duration_s

            async def user() -> None:
                while not stopping.is_set():
                    i = next_idx[0]
                    if plan.requests is not None and i >= plan.requests:
                        return
                    if deadline is not None and perf() >= deadline:
                        return
                    next_idx[0] += P
                    spec = plan.workload.request(i)
                    intended = perf() - t0
                    rec = RequestRecord(
                        i,
                        intended,
                        input_tokens_asked=spec.input_tokens,
                        output_tokens_asked=spec.output_tokens,
                        warmup=_is_warmup(plan, i, intended),
                    )
                    records.append(rec)
                    count(await send(session, cfg, build_body(cfg, spec), rec, t0, tok))

            for _ in range(share):
                t = asyncio.create_task(user())  # type: ignore[arg-type]
                tasks.add(t)  # type: ignore[arg-type]
                t.add_done_callback(done_cb)  # type: ignore[arg-type]
        while tasks and not stopping.is_set():
            stop_wait = asyncio.create_task(stopping.wait())
            await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
        for t in list(tasks):
            t.cancel()
        if tasks:
            await asyncio.wait(list(tasks))
        watcher.cancel()
    for r in records:
        if r.e2e_s is None:  # cancelled before send() ran
            r.error, r.error_detail = "interrupted", "the run was stopped before sending"
    counters[base : base + _N] = [len(records), len(records), sum(1 for r in records if r.error), 0]
    return records


def _run_loop(coro: Any) -> Any:
    """uvloop when installed and GPUFLEET_SERVE_LOOP is not 'asyncio'; the standard loop otherwise."""
    if Env.SERVE_LOOP.get() != "asyncio":
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def _worker(
    plan: LoadPlan,
    wid: int,
    offsets: list[float] | None,
    counters: Any,
    start: Any,
    go: Any,
    stop_evt: Any,
    out: Any,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the loop installs its own handler
    import aiohttp  # noqa: F401  (import before "ready" so start-up cost is not in the run)

    out.put(("ready", wid, None))
    go.wait()
    try:
        recs = _run_loop(_worker_async(plan, wid, offsets, start.value, counters, stop_evt))
        out.put(("done", wid, recs))
    except BaseException as e:  # noqa: BLE001 - deliberate: report any worker failure to the parent
        out.put(("error", wid, f"{type(e).__name__}: {e}"))


def run_load(
    plan: LoadPlan,
    on_progress: Callable[[Progress], None] | None = None,
    stop: Any = None,
    interval_s: float = 0.25,
) -> LoadResult:
    """Run ``plan`` in ``plan.processes`` workers; returns every record (also after Ctrl-C).

    ``on_progress`` is called about every ``interval_s`` in this process. ``stop`` (an optional
    multiprocessing Event) ends the run early like Ctrl-C does.
    """
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    P = max(1, plan.processes)
    plan = replace(plan, processes=P)
    offsets = plan.offsets()
    counters = ctx.RawArray("q", P * _N)
    start, go = ctx.RawValue("d", 0.0), ctx.Event()
    stop_evt = stop if stop is not None else ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(plan, w, offsets, counters, start, go, stop_evt, out), daemon=True)
        for w in range(P)
    ]
    for p in procs:
        p.start()
    interrupted = False
    results: dict[int, list[RequestRecord]] = {}
    errors: list[str] = []
    ready = 0
    prog = Progress(planned=len(offsets) if offsets is not None else plan.requests)
    t0 = 0.0
    started_unix = time.time()
    prev = signal.getsignal(signal.SIGINT)

    def on_int(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True
        stop_evt.set()

    signal.signal(signal.SIGINT, on_int)
    try:
        while len(results) + len(errors) < P:
            try:
                kind, wid, payload = out.get(timeout=interval_s)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and out.empty():
                    errors.append("a worker process died")
                    break
                kind = ""
            if kind == "ready":
                ready += 1
                if ready == P:
                    t0 = time.perf_counter() + 0.05
                    start.value = t0
                    started_unix = time.time() + 0.05
                    go.set()
            elif kind == "done":
                results[wid] = payload
            elif kind == "error":
                errors.append(payload)
            if interrupted:
                stop_evt.set()
            if on_progress is not None and t0:
                vals = list(counters)
                prog.sent, prog.done, prog.failed, prog.in_flight = (sum(vals[k::_N]) for k in range(_N))
                prog.elapsed_s = max(0.0, time.perf_counter() - t0)
                on_progress(prog)
    finally:
        signal.signal(signal.SIGINT, prev)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    if errors and not results:
        from gpufleet.core.errors import GpufleetError

        raise GpufleetError(f"load workers failed: {errors[0]}")
    recs = sorted((r for rs in results.values() for r in rs), key=lambda r: r.index)
    return LoadResult(recs, started_unix, interrupted, P, prog.planned)
