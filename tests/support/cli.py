"""`gpufleet ...` in this process: the CLI's own entry point (gpufleet.cli.main.main) with stdout and
stderr captured, for tests of validation and of pure-CPU output that need no process of their own."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CliResult", "gpufleet", "assert_one_line_error", "tree_snapshot"]


@dataclass(frozen=True)
class CliResult:
    """What one in-process `gpufleet` command did."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        """The non-blank lines on stderr."""
        return [ln for ln in self.stderr.splitlines() if ln.strip()]


def gpufleet(*argv: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None) -> CliResult:
    """Run `gpufleet ARGV` through :func:`gpufleet.cli.main.main` and return its exit code and output.
    ``cwd``: the working directory while it runs (restored after)."""
    from gpufleet.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())


def assert_one_line_error(result: CliResult, code: int, needle: str) -> None:
    """``result`` failed as bad input or a failed command must: exit ``code``, exactly one line on stderr
    that contains ``needle`` (case-insensitive), no traceback."""
    detail = f"exit {result.returncode}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-4000:]}"
    assert result.returncode == code, detail
    assert "Traceback" not in result.stderr, detail
    assert len(result.stderr_lines) == 1, detail
    assert needle.lower() in result.stderr_lines[0].lower(), detail


def tree_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root``, with each file's size and mtime (ns): compare two to see that nothing
    changed (a directory's own mtime is left out: output checks probe inside it)."""
    return {
        str(p.relative_to(root)): (0, 0) if p.is_dir() else (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }
