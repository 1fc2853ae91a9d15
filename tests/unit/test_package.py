"""The package stays light to import, and the CLI answers --help."""

from __future__ import annotations

import json
import subprocess
import sys

# The API that training scripts use (issue 8: kept stable). More names may join; none may leave.
STABLE_API = {
    "init", "Run", "StepSampler", "EarlyStopping", "RNGState", "__version__",
    "GpufleetError", "UsageError", "ConfigError", "CheckpointError", "CheckpointCorrupt", "NoCheckpoint",
    "StorageError", "RetryableStorageError", "TerminalStorageError", "SupervisorError",
}  # fmt: skip
# Module attributes of gpufleet/__init__.py that are not API: typing helpers and the __future__ flag.
NOT_API = {"annotations", "TYPE_CHECKING", "Any"}
STDLIB = {m.lstrip("_") for m in sys.stdlib_module_names}


def test_import_gpufleet_loads_only_the_standard_library_and_core():
    """A training rank pays nothing for the pillars it does not use: no torch, numpy, pydantic,
    rich, boto3, matplotlib, aiohttp, ortools; and of gpufleet only the package and core."""
    code = (
        "import sys, json; before = set(sys.modules); import gpufleet; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    ours = [m for m in loaded if m == "gpufleet" or m.startswith("gpufleet.")]
    assert all(m == "gpufleet" or m.startswith("gpufleet.core") for m in ours), ours
    foreign = [m for m in loaded if m not in ours and m.split(".")[0].lstrip("_") not in STDLIB]
    assert foreign == [], f"import gpufleet loads third-party modules: {foreign}"


def test_all_lists_the_stable_api_once():
    import gpufleet

    assert len(gpufleet.__all__) == len(set(gpufleet.__all__)), "duplicates in __all__"
    missing = STABLE_API - set(gpufleet.__all__)
    assert not missing, f"public API names dropped from gpufleet.__all__: {sorted(missing)}"


def test_every_name_in_all_resolves():
    """Each lazy re-export imports (this pulls in torch: a subprocess keeps it out of other tests)."""
    code = (
        "import gpufleet, json; "
        "print(json.dumps({n: type(getattr(gpufleet, n)).__name__ for n in gpufleet.__all__}))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    kinds = json.loads(p.stdout)
    assert kinds["init"] == "function" and kinds["__version__"] == "str"
    assert kinds["Run"] == kinds["StepSampler"] == kinds["GpufleetError"] == "type"


def test_every_public_attribute_is_in_all():
    """httpx style: nothing public hides outside __all__ (submodules and typing helpers aside)."""
    import types

    import gpufleet

    public = {
        n for n, v in vars(gpufleet).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public - NOT_API <= set(gpufleet.__all__), sorted(public - NOT_API - set(gpufleet.__all__))
    assert set(gpufleet.__all__) <= set(dir(gpufleet))


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
