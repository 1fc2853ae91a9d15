"""Node health: tiered checks (plans × hardware profiles), results, the node state log and reputation.

Light to import: checks load torch / NVML only when they run. See docs/health.md.
"""

from __future__ import annotations
