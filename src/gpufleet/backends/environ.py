"""The one environment contract of every backend: what a rank inherits from the launch.

Every rank starts from the environment of the shell that ran ``gpufleet run``, less the variables
that describe that shell's host or session (:data:`HOST_SPECIFIC`, :data:`HOST_SPECIFIC_PREFIXES`),
with ``--env`` / ``--env-file`` on top, then gpufleet's own and torchrun's variables. On the host that
ran ``gpufleet run`` (the local backend) a rank inherits that host's variables as they are; on another
host (srun, Ray) the host-specific ones are that host's own. The Kubernetes backend forwards only the
``--env`` variables: a pod's environment is its image's, and whatever gpufleet forwards is written into
a manifest, so credential-looking names are refused there (:func:`credential_names`).

Values are never printed or logged: an error names the variable, the file and the line, not the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpufleet.core.errors import ConfigError

__all__ = [
    "HOST_SPECIFIC",
    "HOST_SPECIFIC_PREFIXES",
    "host_specific",
    "launch_environ",
    "parse_env_items",
    "parse_env_file",
    "credential_names",
]

# Variables of the launching shell that describe its host, its session or its own job step; a rank on
# another host gets that host's values (or none) instead.
HOST_SPECIFIC = frozenset(
    {
        "HOSTNAME",
        "HOST",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "TMPDIR",  # Slurm and some sites make it per job and per node
        "CUDA_VISIBLE_DEVICES",  # the launching host's GPUs; each node's scheduler sets its own
        "NVIDIA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "DISPLAY",
        "TERM",
        "DBUS_SESSION_BUS_ADDRESS",
        "GPUFLEET_NODE",  # a node's name: the backend sets each node's
        "GPUFLEET_CONTROL_FD",  # a process's own pipe
        "GPUFLEET_AGENT_SPEC",
    }
)
# Prefixes of the same kind: the launching job step's Slurm variables (srun sets each step's own),
# the login session's, Kubernetes' service links, Ray's process plumbing.
HOST_SPECIFIC_PREFIXES = ("SLURM_", "SSH_", "XDG_", "KUBERNETES_", "RAY_")

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Names that look like credentials: never written into a Kubernetes manifest.
_CREDENTIAL = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|(^|_)(API_?)?KEY($|_)", re.I)


def host_specific(name: str) -> bool:
    """Whether ``name`` describes the launching host or session (it is not forwarded to other hosts)."""
    return name in HOST_SPECIFIC or name.startswith(HOST_SPECIFIC_PREFIXES)


def launch_environ(explicit: Mapping[str, str], *, inherit: bool = True) -> dict[str, str]:
    """What every rank inherits from the launch: this process's environment less the host-specific
    variables (``inherit``), with ``explicit`` (``--env``, ``--env-file``) on top."""
    base = {k: v for k, v in dict(os.environ).items() if not host_specific(k)} if inherit else {}
    return {**base, **explicit}


def _check_key(key: str, where: str) -> None:
    if not _KEY.match(key):
        raise ConfigError(f"{where}: {key!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")


def parse_env_items(items: Iterable[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` items, in order (a later one wins); ConfigError on an item without ``=``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {key!r}: expected KEY=VALUE")
        _check_key(key, "--env")
        out[key] = value
    return out


def parse_env_file(path: str) -> dict[str, str]:
    """A dotenv file: ``KEY=VALUE`` lines (``export`` allowed), ``#`` comments and blank lines; a value
    in matching single or double quotes loses them. ConfigError naming the file and line on a bad one."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--env-file {path}: {getattr(e, 'strerror', None) or e}") from None
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ConfigError(f"--env-file {path}:{n}: expected KEY=VALUE")
        _check_key(key, f"--env-file {path}:{n}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key] = value
    return out


def credential_names(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that look like credentials (SECRET, TOKEN, PASSWORD, ..._KEY)."""
    return sorted(n for n in names if _CREDENTIAL.search(n))
