"""The gpufleet exception tree.

    GpufleetError
    ├── UsageError            bad CLI arguments, config or input: one line on stderr, exit code 2
    │   └── ConfigError       a config value that fails validation
    ├── CheckpointError       the checkpoint engine could not save or restore
    │   ├── CheckpointCorrupt a checkpoint failed verification (size, checksum, manifest)
    │   └── NoCheckpoint      nothing verified to restore from when one was required
    ├── StorageError          a storage backend failed
    │   ├── RetryableStorageError   throttling, 5xx, timeouts: worth retrying with backoff
    │   └── TerminalStorageError    auth, missing bucket, disk full: retrying will not help
    └── SupervisorError       the supervisor gave up (see ``exit_code``)

Retryable and terminal errors are distinct types so callers never have to parse messages.
"""

from __future__ import annotations

__all__ = [
    "GpufleetError",
    "UsageError",
    "ConfigError",
    "CheckpointError",
    "CheckpointCorrupt",
    "NoCheckpoint",
    "StorageError",
    "RetryableStorageError",
    "TerminalStorageError",
    "SupervisorError",
]


class GpufleetError(Exception):
    """Base of every error gpufleet raises on purpose."""


class UsageError(GpufleetError):
    """The user gave something invalid. The CLI prints it as one line and exits with code 2."""


class ConfigError(UsageError):
    """A configuration value failed validation."""


class CheckpointError(GpufleetError):
    """A checkpoint could not be saved or restored."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint exists but failed verification; restore falls back to an older one."""


class NoCheckpoint(CheckpointError):
    """No verified checkpoint exists where one was required."""


class StorageError(GpufleetError):
    """A storage backend failed."""


class RetryableStorageError(StorageError):
    """A transient storage failure (throttling, 5xx, timeout)."""


class TerminalStorageError(StorageError):
    """A storage failure that retrying cannot fix (no space, access denied, no such bucket)."""


class SupervisorError(GpufleetError):
    """The supervisor stopped the run; ``exit_code`` is the documented process exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
