"""Verified asynchronous checkpoints on torch.distributed.checkpoint (DCP).

``CheckpointEngine.save`` stages the state into reusable host buffers (deferring parameter and
optimizer copies past the next forward/backward) and persists in the background; the manifest,
written last, is the commit point; ``load`` verifies sizes and xxh3 checksums and falls back to the
previous checkpoint. A gpufleet checkpoint is a plain DCP checkpoint plus ``manifest.json``.

torch is imported only when the engine is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufleet.checkpoint.config import CheckpointConfig, CheckpointInfo, LoadResult

if TYPE_CHECKING:
    from gpufleet.checkpoint.engine import CheckpointEngine

__all__ = ["CheckpointConfig", "CheckpointEngine", "CheckpointInfo", "LoadResult"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointEngine":
        from gpufleet.checkpoint.engine import CheckpointEngine

        return CheckpointEngine
    raise AttributeError(f"module 'gpufleet.checkpoint' has no attribute {name!r}")
