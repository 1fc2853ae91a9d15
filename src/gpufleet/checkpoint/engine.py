"""The checkpoint engine: stage -> persist -> commit (-> upload), and verified restore.

Policy when a save comes due while the previous one is still persisting: it is **skipped**
(``save`` returns False and emits CKPT_SKIPPED) so training never waits on storage; ``force=True``
(the final checkpoint on shutdown) waits for the in-flight one, then saves. With several ranks the
decision is agreed through a MAX all-reduce on a small control group, so every rank skips together.
"""

from __future__ import annotations

import copy
import shutil
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gpufleet.checkpoint import restore
from gpufleet.checkpoint.config import CheckpointConfig, CheckpointInfo, LoadResult
from gpufleet.checkpoint.failures import failure_reason, flip_byte
from gpufleet.checkpoint.manifest import FileEntry, list_committed, read_manifest, step_dirname
from gpufleet.checkpoint.retention import select_deletions
from gpufleet.checkpoint.snapshot import Snapshot
from gpufleet.checkpoint.staging import (
    StageJob,
    Stager,
    available_memory,
    local_ranks,
    tensor_layout,
    within_half,
)
from gpufleet.checkpoint.storage import s3
from gpufleet.checkpoint.storage.local import commit as local_commit
from gpufleet.checkpoint.storage.local.onepass import ScratchPool
from gpufleet.checkpoint.storage.local.reader import FastReader, MemReader
from gpufleet.checkpoint.storage.local.writer import SummingWriter
from gpufleet.checkpoint.storage.memory import MemoryKeeper, keeper_dir
from gpufleet.checkpoint.storage.peer import PeerTier
from gpufleet.core import events as E
from gpufleet.core.errors import CheckpointError, ConfigError
from gpufleet.core.ledger import EventSink

__all__ = ["CheckpointEngine"]

_FAULTS = (None, "fail", "corrupt")

# Single-process saves/loads pass no_dist=True on purpose; DCP still warns about it every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _Job:
    def __init__(self, step: int, stage: StageJob, meta: dict[str, Any], fault: str | None, save_s: float):
        self.step = step
        self.stage = stage
        self.meta = meta
        self.fault = fault
        self.save_s = save_s
        self.blocked_s = 0.0
        self.staged_reported = False
        self.keep = False  # its staging is whole: a commit makes it the snapshot
        self.waiting = False
        self.thread: threading.Thread | None = None
        self.layout: Any = None  # staging.tensor_layout of the saved state dict (distributed saves)


class _DedupPlanner(dcp.DefaultSavePlanner):
    """DCP's default planner, which also tells which tensors DCP's deduplication gave to other ranks.

    DDP state is the same on every rank and DCP writes each such tensor once, on one rank chosen by
    size; the same state dict always gets the same choice. The engine stages only what this rank
    writes from the second save on (``Stager.stage(skip=)``), so each rank copies (and holds) about
    1/world_size of a replicated state instead of all of it; the deferred copy (parameters, optimizer
    state) waits for this plan and copies only this rank's part, from the first save on
    (``StageJob.copy_planned``). A tensor left unstaged by ``skip`` is the live one,
    which may change under the save: a plan that would have this rank write one fails the save (the
    next one stages everything again), never the checkpoint's contents.
    """

    def __init__(self, stage: StageJob) -> None:
        super().__init__()
        self.stage = stage
        self.skipped = stage.skipped
        self.elsewhere: frozenset[str] = frozenset()  # plain tensors written by another rank
        self._local: frozenset[str] = frozenset()

    def _tensor_keys(self, plan: Any) -> frozenset[str]:
        from torch.distributed.checkpoint.planner import WriteItemType

        keys = set()
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                path = self.mappings.get(item.index.fqn)
                keys.add(".".join(map(str, path)) if path else item.index.fqn)  # the stager's key
        return frozenset(keys)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        self._local = self._tensor_keys(plan)
        return plan

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        mine = self._tensor_keys(plan)
        unstaged = sorted(mine & self.skipped)
        if unstaged:
            raise CheckpointError(f"the save plan changed: this rank now writes {unstaged[0]!r}, not staged")
        self.elsewhere = self._local - mine
        if self.stage.at_plan:  # the first save too copies only what this rank writes
            self.stage.copy_planned(mine.__contains__)
            if self.stage.error is not None:
                raise self.stage.error
        return plan


class CheckpointEngine:
    """Asynchronous, verified DCP checkpoints. One instance per rank; rank 0 emits events."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: Any = None,
        sink: EventSink | None = None,
        previous: CheckpointEngine | None = None,
    ) -> None:
        """``previous``: this rank's engine of an earlier round (an in-process restart re-forms the
        groups, so the engine is made again): its staging buffers and snapshot carry over."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"bad rank/world_size: {rank}/{world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.root = Path(config.dir)
        self._sink = sink if rank == 0 else None
        self._distributed = world_size > 1
        if self._distributed and not dist.is_initialized():
            raise ConfigError("world_size > 1 needs torch.distributed to be initialized")
        # Background DCP collectives run on their own gloo group, never the training's default group;
        # the skip decision runs on a second one, from the main thread, while a persist may be running.
        self.pg = process_group
        self._ctl = None
        if self._distributed:
            if self.pg is None:
                self.pg = dist.new_group(backend="gloo")
            self._ctl = dist.new_group(backend="gloo")
        # The newest commit's whole staged copy (config.keep_snapshot): a rollback in place uses it.
        self._stager, self._snapshot = previous.hand_over() if previous is not None else (Stager(), None)
        # After a distributed save: its tensor layout and the tensors DCP gave to other ranks.
        self._elsewhere: tuple[Any, frozenset[str]] | None = None
        self._pool = ScratchPool()  # restore scratch, reused across loads
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._error: str | None = None
        self._newest_verified: int | None = None
        # The in-memory tier (storage/memory.py): rank 0 copies each commit into this node's keeper.
        self._memory: Path | None = None
        self._keeper: MemoryKeeper | None = None
        self._memory_warned = False
        self._snapshot_warned = False
        # Ranks on several nodes: node parts replicated to a peer node's keeper instead (storage/peer.py).
        self._peer: PeerTier | None = None
        if config.memory_bytes > 0 and not config.read_only:
            self._memory = Path(config.memory_dir) if config.memory_dir else keeper_dir(config.dir)
            if self._distributed:
                self._peer = PeerTier.setup(self._memory, config.memory_bytes, rank, self.pg, sink)
            if self._peer is not None:
                self._memory = None  # the keeper holds node parts: storage/peer.py restores them
            elif rank == 0:
                self._keeper = MemoryKeeper(self._memory, config.memory_bytes)
        if rank == 0 and not config.read_only:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in self.root.glob("step_*.tmp"):
                shutil.rmtree(p, ignore_errors=True)  # temp dirs of killed attempts: never committed

    # ---------------------------------------------------------------- events
    def _emit(self, event: E.Event) -> None:
        if self._sink is not None:
            self._sink.emit(event)

    # ---------------------------------------------------------------- save
    def persisting(self) -> bool:
        """This rank has a save persisting in the background right now (local; no collective)."""
        job = self._job
        return job is not None and job.thread is not None and job.thread.is_alive()

    def _busy(self) -> bool:
        busy = self.persisting()
        if self._distributed:
            t = torch.tensor([1 if busy else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctl)
            busy = bool(t.item())
        return busy

    def save(
        self,
        step: int,
        state_dict: dict[str, Any],
        *,
        meta: dict[str, Any] | None = None,
        deferred: Callable[[str], bool] | None = None,
        force: bool = False,
        fault: str | None = None,
    ) -> bool:
        """Snapshot ``state_dict`` and persist it in the background. False when skipped (see module doc)."""
        if fault not in _FAULTS:
            raise ConfigError(f"unknown checkpoint fault {fault!r}; valid: fail, corrupt")
        t0 = time.perf_counter()
        self.wait_staged()
        if self._busy():
            if not force:
                self._emit(E.CkptSkipped(step=step, reason="previous checkpoint still persisting"))
                return False
            self._join()
        skip = None
        layout = tensor_layout(state_dict) if self._distributed else None
        keep = self._snapshot_fits(step, layout)
        if self._elsewhere is not None and self._elsewhere[0] == layout and not keep:
            skip = self._elsewhere[1].__contains__
        self._snapshot = None  # its buffers are about to be overwritten; a commit makes the next one
        stage = self._stager.stage(state_dict, deferred, skip, at_plan=self._distributed and not keep)
        job = _Job(step, stage, copy.deepcopy(meta or {}), fault, 0.0)
        job.layout = layout
        job.keep = keep
        job.thread = threading.Thread(
            target=self._persist, args=(job,), name="gpufleet-ckpt-persist", daemon=True
        )
        with self._lock:
            self._job = job
        job.save_s = time.perf_counter() - t0
        job.thread.start()
        return True

    def wait_staged(self) -> float:
        """Block until the snapshot copy is complete; returns the seconds spent blocked."""
        job = self._job
        if job is None or job.staged_reported:
            return 0.0
        t0 = time.perf_counter()
        job.waiting = True
        job.stage.done.wait()
        job.blocked_s = time.perf_counter() - t0
        self._report_staged(job)
        return job.blocked_s

    def _report_staged(self, job: _Job) -> None:
        with self._lock:
            if job.staged_reported:
                return
            job.staged_reported = True
        self._emit(
            E.CkptStaged(
                step=job.step,
                stall_s=round(job.save_s + job.blocked_s, 6),
                stage_s=round(job.save_s + job.stage.copy_s, 6),
                bytes=job.stage.nbytes,
            )
        )

    def _persist(self, job: _Job) -> None:
        if not job.stage.at_plan:
            job.stage.done.wait()
            if not job.waiting:
                # Nobody is blocked in wait_staged: the copy finished under the user's compute.
                self._report_staged(job)
        final = self.root / step_dirname(job.step)
        tmp = self.root / (step_dirname(job.step) + ".tmp")
        t0 = time.perf_counter()
        ok, reason, files = True, None, None
        stream = self._stream_upload(job)
        try:
            if self._distributed:
                # A rank whose staging failed must not leave the others alone inside dcp.save.
                flag = torch.tensor([0 if job.stage.error is None else 1], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
                if flag.item() and job.stage.error is None:
                    raise CheckpointError("staging failed on another rank")
            if job.stage.error is not None:
                raise job.stage.error
            writer = SummingWriter(
                tmp,
                thread_count=self.config.io_threads,
                fail=job.fault == "fail",
                direct=self.config.direct_io,
                tee=stream.stream if stream is not None else None,
            )
            planner = _DedupPlanner(job.stage)
            self._elsewhere = None  # until this save has succeeded
            dcp.save(
                job.stage.staged,
                storage_writer=writer,
                planner=planner,
                process_group=self.pg,
                no_dist=not self._distributed,
            )
            if self._distributed:
                self._elsewhere = (job.layout, planner.elsewhere)
            if job.stage.at_plan and not job.waiting:
                self._report_staged(job)
            if self.rank == 0:
                files = local_commit.commit(
                    tmp,
                    final,
                    step=job.step,
                    world_size=self.world_size,
                    meta=job.meta,
                    file_sums=writer.file_sums,
                )
                self._published(job, final, files, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - a background thread must report every failure
            ok, reason = False, failure_reason(e)
            job.stage.abandon(e)  # a copy that never ran must not keep the training waiting
        if self._distributed:
            status = [(ok, reason)]
            dist.broadcast_object_list(status, src=0, group=self.pg)  # rank 0's commit is the verdict
            ok, reason = status[0]
        if not ok:
            if stream is not None:
                stream.abort()
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                self._emit(E.CkptFailed(step=job.step, reason=reason))
            self._error = f"checkpoint at step {job.step} failed: {reason}"
            return
        # A failure nobody waited for is superseded: the newest state is committed, so run.finish()'s
        # wait must not fail a run whose later checkpoints all committed.
        self._error = None
        if job.keep:
            self._snapshot = Snapshot.of(job.step, str(final), job.meta, job.stage.staged)
        if self._peer is not None:
            self._peer.keep(job.step, final)
        if self.rank == 0 and self.config.upload_url:
            self._upload(job.step, final, stream)

    def _published(self, job: _Job, final: Path, files: dict[str, FileEntry], persist_s: float) -> None:
        """Rank 0, once the commit is on disk: its event, retention, and this node's memory copy, all
        before the other ranks hear the verdict. So every rank's save ends with the copy in memory: a
        rank that waits for its save (a settling fault drill, a final checkpoint) knows the newest
        commit can restore from memory, not only that it is on disk."""
        nbytes = sum(f.bytes for f in files.values())
        self._emit(
            E.CkptCommitted(
                step=job.step,
                path=str(final),
                bytes=nbytes,
                persist_s=round(persist_s, 6),
                files=len(files),
            )
        )
        self._newest_verified = job.step
        if job.fault == "corrupt":
            flip_byte(final, files)
        self._retain()
        if self._keeper is not None:
            self._keep_in_memory(job.step, final)

    def _keep_in_memory(self, step: int, final: Path) -> None:
        """Copy a commit into the memory tier (verified while copied); never fails the save."""
        assert self._keeper is not None
        try:
            r = self._keeper.keep(final, read_manifest(final))
        except (OSError, ValueError) as e:
            self._emit(
                E.CkptMemory(
                    step=step,
                    kept=False,
                    bytes=0,
                    used_bytes=self._keeper.used_bytes(),
                    budget_bytes=self._keeper.budget_bytes,
                    node=socket.gethostname(),
                    reason=f"copy failed: {failure_reason(e)}",
                )
            )
            return
        self._emit(
            E.CkptMemory(
                step=step,
                kept=r.kept,
                bytes=r.bytes,
                used_bytes=r.used_bytes,
                budget_bytes=r.budget_bytes,
                evicted=tuple(r.evicted),
                copy_s=r.copy_s,
                node=socket.gethostname(),
                peer=None,
                reason=r.reason if not r.kept else "no peer replica: all ranks run on this node",
            )
        )
        if not r.kept and not self._memory_warned:  # the ledger has every case; the console, the first
            self._memory_warned = True
            print(
                f"gpufleet: warning: step {step} not kept in memory: {r.reason}", file=sys.stderr, flush=True
            )

    def _retain(self) -> None:
        committed = list_committed(self.root)
        protect = {self._newest_verified} if self._newest_verified is not None else set()
        doomed = select_deletions(
            [m.step for _, m in committed],
            keep_last=self.config.keep_last,
            keep_window_steps=self.config.keep_window_steps,
            protect=protect,
        )
        for path, m in committed:
            if m.step in doomed:
                local_commit.delete(path)
                self._emit(E.CkptDeleted(step=m.step, path=str(path), reason="retention"))
        if committed:
            local_commit.sweep(self.root, committed[0][1].step)
        if self.config.upload_url:
            s3.retain(self.config, doomed, self._emit)

    def _stream_upload(self, job: _Job) -> Any:
        """Rank 0's shard files go to S3 while they are written (s3.stream_upload); None when
        there is no S3 tier, or a fault is injected (the upload then follows the local files)."""
        if self.rank != 0 or not self.config.upload_url or job.fault is not None:
            return None
        try:
            return s3.stream_upload(self.config, step_dirname(job.step))
        except Exception:  # noqa: BLE001 - no stream: the upload after the commit reports any S3 error
            return None

    def _upload(self, step: int, final: Path, stream: Any = None) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = s3.upload_commit(self.config, final, stream)
        except BaseException as e:  # noqa: BLE001 - boto3/botocore raise many types; report, keep training
            reason = f"upload failed: {failure_reason(e)}"
            self._emit(E.CkptFailed(step=step, reason=reason, stage="upload"))
            return
        self._emit(
            E.CkptUploaded(
                step=step,
                url=s3.url_for(self.config, final.name),
                upload_s=round(time.perf_counter() - t0, 6),
                bytes=nbytes,
            )
        )

    def _join(self, timeout: float | None = None) -> bool:
        job = self._job
        if job is None or job.thread is None:
            return True
        job.thread.join(timeout)
        return not job.thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight persist, commit and upload are done; CheckpointError if it failed."""
        self.wait_staged()
        if not self._join(timeout):
            raise CheckpointError(f"checkpoint still in flight after {timeout}s")
        err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(err)

    # ---------------------------------------------------------------- list / load
    def restore_context(self) -> restore.RestoreContext:
        """What :mod:`restore` uses of this engine: config, root, rank, group, events, buffers, scratch."""
        return restore.RestoreContext(
            config=self.config,
            root=self.root,
            rank=self.rank,
            pg=self.pg,
            emit=self._emit,
            buffer_for=self._stager.buffer_for,
            pool=self._pool,
            memory=self._memory,
        )

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (valid manifest), newest first: local, then remote."""
        out = [
            CheckpointInfo(m.step, str(p), m.time, m.total_bytes, "local")
            for p, m in list_committed(self.root)
        ]
        if self.config.upload_url:
            out += s3.list_infos(self.config)
        return out

    def newest_metadata(self, max_step: int | None = None) -> Any | None:
        """DCP ``Metadata`` of the newest local checkpoint (step <= ``max_step``), its bytes checked
        against the manifest; None if there is none. For shapes only (a load template): ``load``
        verifies whatever it restores."""
        self._join()
        return restore.newest_metadata(self.restore_context(), max_step)

    def load(
        self,
        state_dict: dict[str, Any] | Callable[[], dict[str, Any]],
        *,
        max_step: int | None = None,
        optional: Iterable[tuple[str, str]] = (),
    ) -> LoadResult | None:
        """Load the newest verified checkpoint (step <= max_step) into ``state_dict``; None if none.

        Single process: one pass (each file read once, hashed while read, copied into the tensors
        only after every file verified). Several ranks: rank 0 verifies, then every rank reads.

        ``optional``: ``(key, subkey)`` entries of ``state_dict`` that the checkpoint may lack (per-rank
        state of a rank the saving run did not have: resumed with more workers). Those it lacks are
        removed from ``state_dict`` and named in ``LoadResult.missing``; any other key the checkpoint
        lacks is an error, as in DCP.

        ``state_dict`` may be a function that makes it: it is called only once there is a checkpoint
        to load, so a fresh start never builds a template it does not use (for an optimizer, torch
        makes one by running a whole fake step)."""
        self._join()
        t0 = time.perf_counter()
        ctx = self.restore_context()
        choice: tuple[int, str, str, dict[str, Any]] | None = None
        loaded = None
        if not self._distributed:
            if callable(state_dict):
                if not restore.has_candidates(ctx, max_step):
                    return None
                state_dict = state_dict()
            found = restore.choose(ctx, max_step, state_dict)
            if found is not None:
                choice, loaded = found[:4], found[4]
        else:  # rank 0 verifies (and downloads) for all; the others never wait on S3 in a collective
            found_box: list[Any] = [None]

            def decide() -> Any:
                found_box[0] = restore.choose(ctx, max_step, None)
                return None if found_box[0] is None else found_box[0][:4]

            choice = self._peer.restore(ctx, max_step) if self._peer is not None else None
            if choice is None:  # not in any node's memory: local disk, then S3
                choice = restore.agree_on_choice(ctx, decide)
        if choice is None:
            return None
        if callable(state_dict):  # every rank has the same choice, so all of them build it, or none
            state_dict = state_dict()
        step, path, source, meta = choice
        threads = self.config.io_threads
        reader = FastReader(path, threads=threads) if loaded is None else MemReader(path, loaded, threads=2)
        try:
            missing = _drop_absent(state_dict, optional, reader.read_metadata()) if optional else []
            dcp.load(state_dict, storage_reader=reader, process_group=self.pg, no_dist=not self._distributed)
        finally:
            if loaded is not None:
                loaded.release()
        if self._distributed:
            restore.forget_choice(ctx)  # dcp.load was a collective: every rank has read the choice
            if self._peer is not None:
                self._peer.forget()
        self._newest_verified = step
        return LoadResult(
            step=step,
            path=path,
            source=source,
            meta=meta,
            load_s=time.perf_counter() - t0,
            state_dict=state_dict,
            missing=missing,
        )

    def _snapshot_fits(self, step: int, layout: Any) -> bool:
        """Whether this save keeps a snapshot (``config.keep_snapshot``). It holds every plain tensor's
        staging (deduplication would free what other ranks write), so it is kept only if the ranks of
        this node (``LOCAL_WORLD_SIZE``) holding as much each fit in half the memory they could use:
        what is available plus what their staging holds now. Else the save stages as usual, a rollback
        in place reads the commit back, and a warning says so once."""
        if not self.config.keep_snapshot or layout is None:
            return self.config.keep_snapshot  # one process: its staging is whole anyway
        total, held = self._stager.plain_bytes(layout)
        avail = available_memory()
        ranks = local_ranks(self.world_size)
        if within_half(total, ranks, avail, held):
            return True
        if not self._snapshot_warned:
            self._snapshot_warned = True
            print(
                f"gpufleet: warning: rank {self.rank}: step {step} kept no in-process snapshot: "
                f"{ranks} ranks on this node would hold {total / 2**20:.0f} MiB of staging each, "
                f"{(avail or 0) / 2**20:.0f} MiB is available; a rollback in place reads the checkpoint back",
                file=sys.stderr,
                flush=True,
            )
        return False

    def snapshot(self, max_step: int | None = None) -> Snapshot | None:
        """The newest commit's staged copy (``config.keep_snapshot``), if no save has staged since and its
        step is <= ``max_step``; not verified here (:meth:`Snapshot.verify`)."""
        snap = self._snapshot
        if snap is None or (max_step is not None and snap.step > max_step):
            return None
        return snap

    def hand_over(self) -> tuple[Stager, Snapshot | None]:
        """What a successor engine (a new process group, same objects) takes over from this one: the
        staging buffers and the newest commit's snapshot, so neither is allocated or lost again."""
        return self._stager, self._snapshot

    def close(self) -> None:
        """Finish the in-flight checkpoint (errors were already reported as CKPT_FAILED)."""
        self.wait_staged()
        self._join()


def _drop_absent(state_dict: dict[str, Any], optional: Iterable[tuple[str, str]], metadata: Any) -> list[str]:
    """Remove the ``optional`` entries the checkpoint has no item for; returns their dotted names."""
    saved = list(metadata.state_dict_metadata)
    missing: list[str] = []
    for key, sub in optional:
        name = f"{key}.{sub}"
        group = state_dict.get(key)
        if not isinstance(group, dict) or sub not in group:
            continue
        if not any(fqn == name or fqn.startswith(name + ".") for fqn in saved):
            del group[sub]
            missing.append(name)
            if not group:
                del state_dict[key]
    return missing
