"""The gpufleet exception tree.

    GpufleetError                 exit code 1 unless a branch below says otherwise
    ├── UsageError                bad CLI arguments, config or input: one line on stderr, exit code 2
    │   ├── ConfigError           a config value that fails validation
    │   ├── InputError            a file given as input cannot be read or parsed (``path`` names it)
    │   ├── OutputPathError       an output path cannot be created or written (``path``), checked before work
    │   └── EventSchemaError      an event does not fit its kind's schema (also a ``ValueError``)
    ├── RunIOError                a file or directory failed at run time (``path``): exit code 1
    ├── CheckpointError           the checkpoint engine could not save or restore
    │   ├── CheckpointCorrupt     a checkpoint failed verification (size, checksum, manifest)
    │   └── NoCheckpoint          nothing verified to restore from when one was required
    ├── StorageError              a storage backend failed
    │   ├── RetryableStorageError throttling, 5xx, timeouts: worth retrying with backoff
    │   └── TerminalStorageError  auth, missing bucket, disk full: retrying will not help
    ├── SupervisorError           the supervisor gave up (``exit_code`` is the one it gives)
    ├── SpikeDetected             the loss guard fired in a standalone run (under a supervisor the rank exits)
    └── RebuildRound              a rank must run its script again (in-process restart). The in-process
                                  harness (train/inprocess.py) catches it; it never reaches the CLI

Every class carries ``exit_code``: the code the CLI (gpufleet.cli.main) exits with when it reaches the
top, after one line on stderr. Retryable and terminal errors are distinct types so callers never have to
parse messages.
"""

from __future__ import annotations

import os

from gpufleet.core.exitcodes import ExitCode

__all__ = [
    "GpufleetError",
    "UsageError",
    "ConfigError",
    "InputError",
    "OutputPathError",
    "EventSchemaError",
    "RunIOError",
    "CheckpointError",
    "CheckpointCorrupt",
    "NoCheckpoint",
    "StorageError",
    "RetryableStorageError",
    "TerminalStorageError",
    "SupervisorError",
    "SpikeDetected",
    "RebuildRound",
]


class GpufleetError(Exception):
    """Base of every error gpufleet raises on purpose."""

    exit_code: int = ExitCode.FAILED
    """The process exit code when this error reaches the CLI."""


class UsageError(GpufleetError):
    """The user gave something invalid. The CLI prints it as one line and exits with code 2."""

    exit_code = ExitCode.USAGE


class ConfigError(UsageError):
    """A configuration value failed validation."""


class _PathError(GpufleetError):
    """An error about one file or directory; the message starts with its path."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        """The file or directory concerned."""
        self.reason = reason
        """What is wrong with it."""


class InputError(_PathError, UsageError):
    """A file the user named cannot be read or parsed (missing, unreadable, not UTF-8, bad JSON)."""


class OutputPathError(_PathError, UsageError):
    """An output path cannot be made or written (a file where a directory must go, a read-only place).
    Commands check their output paths before any work starts, so this leaves nothing half-written."""


class EventSchemaError(UsageError, ValueError):
    """An event does not fit its kind's schema (unknown kind or field, missing field, wrong type)."""


class RunIOError(_PathError):
    """A file or directory failed while a command was working (disk full, removed under it)."""


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


class SpikeDetected(GpufleetError):
    """Raised in standalone runs when the loss guard fires (under a supervisor the rank exits instead)."""


class RebuildRound(GpufleetError):
    """This rank must run its script again: the new round's other ranks build their objects (DDP's
    constructor is a collective), or a hot spare was promoted to another rank than it built for. The
    in-process harness catches it (train/inprocess.py) with the round's order already applied."""
