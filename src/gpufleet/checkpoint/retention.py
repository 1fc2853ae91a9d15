"""Which checkpoints to delete after a commit (pure function, no I/O)."""

from __future__ import annotations

__all__ = ["select_deletions"]


def select_deletions(
    steps: list[int], *, keep_last: int, keep_window_steps: int = 0, protect: set[int] | None = None
) -> list[int]:
    """Steps to delete from the committed ``steps``.

    Keeps the newest ``keep_last``; when ``keep_window_steps`` > 0 also the newest step that is
    <= newest - keep_window_steps (a checkpoint from before the spike-detection window); never
    (or, while none is that old, the oldest one, so the look-back survives until it is needed);
    never deletes anything in ``protect`` (the newest verified checkpoint).
    """
    ordered = sorted(set(steps), reverse=True)
    if not ordered:
        return []
    keep = set(ordered[:keep_last])
    if keep_window_steps > 0:
        limit = ordered[0] - keep_window_steps
        older = [s for s in ordered if s <= limit]
        # None old enough yet: keep the oldest, which is the first to become old enough.
        keep.add(older[0] if older else ordered[-1])
    keep |= protect or set()
    return sorted(s for s in ordered if s not in keep)
