"""The package stays light to import, and the CLI answers --help."""

from __future__ import annotations

import subprocess
import sys


def test_import_gpufleet_does_not_import_torch_or_plotting():
    code = (
        "import sys, gpufleet; print(sorted(m for m in ('torch', 'matplotlib', 'boto3') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_help_lists_the_commands():
    p = subprocess.run([sys.executable, "-m", "gpufleet.cli.main", "--help"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for cmd in ("run", "report", "demo", "ckpt"):
        assert cmd in p.stdout


def test_unknown_command_is_one_line_exit_2():
    p = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "frobnicate"], capture_output=True, text=True
    )
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_version_flag_prints_the_package_version():
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        p = subprocess.run([sys.executable, "-m", "gpufleet.cli.main", flag], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == f"gpufleet {version('gpufleet')}"
