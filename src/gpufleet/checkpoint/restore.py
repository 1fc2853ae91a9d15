"""Choosing the checkpoint to restore: newest first, local then S3, verified, with fallback.

Two ways to verify a candidate:
- one pass (single process): ``onepass.read_verified`` reads every file once, hashing as it reads,
  and keeps the bytes; the load then copies from memory (``reader.MemReader``);
- checksum pass (several ranks: rank 0 verifies for everyone, then every rank reads what it
  needs): ``verify.verify_dir`` hashes every file, then ``reader.FastReader`` reads again.
Either way nothing reaches the caller's tensors before every file of the chosen checkpoint matched
its manifest; a mismatch emits RESTORE_REJECTED with the reason and the next candidate is tried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from gpufleet.checkpoint import remote
from gpufleet.checkpoint.failures import failure_reason
from gpufleet.checkpoint.manifest import Manifest, list_committed, step_dirname
from gpufleet.checkpoint.onepass import Loaded, read_verified
from gpufleet.checkpoint.verify import verify_dir
from gpufleet.core import events as E
from gpufleet.core.errors import StorageError

if TYPE_CHECKING:
    from gpufleet.checkpoint.engine import CheckpointEngine

__all__ = ["choose", "receive_buffers"]

_BUFFER_MIN = 1 << 20  # tensors at least this large are read straight into a staging buffer

Verifier = Callable[[Path], tuple[Manifest | None, str | None, Loaded | None]]


def receive_buffers(eng: CheckpointEngine, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """fqn -> the engine's staging buffer for each large tensor of ``state_dict`` (created now if
    missing: the next save would create exactly this buffer, so its page faults are paid once)."""
    flat, _ = flatten_state_dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for fqn, t in flat.items():
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.nbytes >= _BUFFER_MIN:
            out[fqn] = eng._stager.buffer_for(fqn, t.detach())
    return out


def choose(
    eng: CheckpointEngine, max_step: int | None, state_dict: dict[str, Any] | None
) -> tuple[int, str, str, dict[str, Any], Loaded | None] | None:
    """(step, path, source, meta, loaded) of the newest checkpoint that verifies, or None.
    ``state_dict`` given: one-pass verification (``loaded`` holds the bytes); else checksum pass."""
    cfg = eng.config
    verify: Verifier
    if state_dict is not None:
        buffers = receive_buffers(eng, state_dict)

        def verify(p: Path) -> tuple[Manifest | None, str | None, Loaded | None]:
            return read_verified(p, buffers, eng._pool, threads=cfg.io_threads, direct=cfg.direct_io)
    else:

        def verify(p: Path) -> tuple[Manifest | None, str | None, Loaded | None]:
            m, reason = verify_dir(p, cfg.io_threads)
            return m, reason, None

    local = {m.step: p for p, m in list_committed(eng.root)}
    remote_steps = remote.list_steps(cfg) if cfg.upload_url else {}
    for step in sorted(set(local) | set(remote_steps), reverse=True):
        if max_step is not None and step > max_step:
            continue
        candidates: list[tuple[str, Callable[[], Path]]] = []
        if step in local:
            candidates.append(("local", lambda p=local[step]: p))
        if step in remote_steps:
            candidates.append(("s3", lambda s=step: remote.download(cfg, remote_steps[s], eng.root)))
        for source, get in candidates:
            t0 = time.perf_counter()
            try:
                path = get()
            except (StorageError, OSError) as e:  # this copy is unusable: try the next candidate
                eng._emit(
                    E.RESTORE_REJECTED,
                    path=remote.url_for(cfg, step_dirname(step)),
                    step=step,
                    reason=f"download failed: {failure_reason(e)}",
                )
                continue
            m, reason, loaded = verify(path)
            if reason is None and m is not None:
                extra: dict[str, Any] = {}
                if loaded is not None:
                    extra = {
                        "one_pass": True,
                        "cached_files": loaded.cached_files,
                        "direct_files": loaded.direct_files,
                        "in_buffers_bytes": loaded.in_buffers,
                    }
                eng._emit(
                    E.CKPT_VERIFIED,
                    step=step,
                    path=str(path),
                    verify_s=round(time.perf_counter() - t0, 6),
                    source=source,
                    **extra,
                )
                return step, str(path), source, m.meta, loaded
            eng._emit(E.RESTORE_REJECTED, path=str(path), step=step, reason=reason)
    return None
