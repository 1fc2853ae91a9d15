"""Environment variables: each declared once (core/env.py) and read only through its declaration;
the launch environment (core/launch.py); docs/environment.md rendered from the declarations."""

from __future__ import annotations

import pickle
import re
import socket
from pathlib import Path

import pytest

from gpufleet.core.env import Env, Platform, Var, declared, flag
from gpufleet.core.errors import ConfigError
from gpufleet.core.launch import LaunchEnv, node_name

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gpufleet"
DOC = ROOT / "docs" / "environment.md"

# Modules that hand a child process (or a check's context) the whole environment, which it then
# reads through the declarations itself: only ``**os.environ`` and ``dict(os.environ...)`` there.
PASS_THROUGH = {
    "backends/local.py": "a rank's environment: the supervisor's, plus the rank's own variables",
    "backends/environ.py": "what every rank inherits from the launch: the launching environment",
    "backends/slurm/srun.py": "srun's environment: the supervisor's, plus the node agent's spec",
    "backends/ray/backend.py": "a node agent's environment inside its Ray actor",
    "backends/ray/quarantine.py": "a health check's environment inside its Ray task",
    "health/runner.py": "a check's context holds the environment its probes run in",
    "health/checks/__init__.py": "the same context's default: this process's environment",
}
_USE = re.compile(r"os\.environ\b|os\.getenv\b|\bgetenv\(")
_WRITE = re.compile(r"os\.environ(\.update\(|\.setdefault\(|\.pop\(|\.clear\(|\[[^]]+\]\s*=[^=])")


def _sources() -> list[tuple[str, str]]:
    return [(str(p.relative_to(SRC)), p.read_text()) for p in sorted(SRC.rglob("*.py"))]


def test_no_module_reads_the_environment_but_through_a_declaration() -> None:
    bad = []
    for rel, text in _sources():
        if rel == "core/env.py":
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in _USE.finditer(line):
                before = line[: m.start()]
                if before.endswith("`") or _WRITE.match(line[m.start() :]):
                    continue  # prose in a docstring, or a write
                if rel in PASS_THROUGH and before.endswith(("**", "dict(")):
                    continue
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "read os.environ through a Var in gpufleet.core.env:\n" + "\n".join(bad)
    assert set(PASS_THROUGH) <= {rel for rel, _ in _sources()}  # no stale entries


def test_every_gpufleet_variable_in_the_source_is_declared() -> None:
    names = {v for v in declared()}
    used = {}
    for rel, text in _sources():
        for name in re.findall(r"\bGPUFLEET_[A-Z0-9_]*[A-Z0-9]\b", text):
            if not name.startswith("GPUFLEET_TEST_"):
                used.setdefault(name, rel)
    assert {n: r for n, r in used.items() if n not in names} == {}


def test_a_variable_reads_its_type_and_default() -> None:
    assert Env.AGENT_GRACE.get({}) == 5.0 and Env.AGENT_GRACE.get({"GPUFLEET_AGENT_GRACE": ""}) == 5.0
    assert Env.AGENT_GRACE.get({"GPUFLEET_AGENT_GRACE": "0.25"}) == 0.25
    assert Env.CONTROL_FD.get({}) is None and Env.CONTROL_FD.get({"GPUFLEET_CONTROL_FD": "7"}) == 7
    assert Env.IN_PROCESS.get({"GPUFLEET_IN_PROCESS": "1"}) is True and Env.IN_PROCESS.get({}) is False
    with pytest.raises(ConfigError, match="GPUFLEET_LEMON_FAILURES='lots' is not a valid int"):
        Env.LEMON_FAILURES.get({"GPUFLEET_LEMON_FAILURES": "lots"})
    with pytest.raises(ConfigError, match="GPUFLEET_BREAKER_WINDOW_S='inf' must be finite"):
        Env.BREAKER_WINDOW_S.get({"GPUFLEET_BREAKER_WINDOW_S": "inf"})
    with pytest.raises(ConfigError, match="GPUFLEET_STANDBY_EAGER='maybe' is not a valid flag"):
        Env.STANDBY_EAGER.get({"GPUFLEET_STANDBY_EAGER": "maybe"})
    # unset and empty differ where the platform says so
    assert Platform.CUDA_VISIBLE_DEVICES.raw({}) is None
    assert Platform.CUDA_VISIBLE_DEVICES.raw({"CUDA_VISIBLE_DEVICES": ""}) == ""


def test_a_variable_is_its_name_and_writes_itself() -> None:
    assert Env.NODE == "GPUFLEET_NODE" and {Env.NODE: "x"} == {"GPUFLEET_NODE": "x"}
    assert f"${Env.NODE}" == "$GPUFLEET_NODE"
    assert [Env.AGENT_GRACE.format(v) for v in (5.0, 0.25, 1e-9)] == ["5", "0.25", "1e-09"]
    assert Env.IN_PROCESS.format(True) == "1" and Env.ATTEMPT.format(3) == "3"
    assert type(pickle.loads(pickle.dumps(Env.NODE))) is str
    assert flag("Yes") is True and flag("off") is False
    with pytest.raises(TypeError, match="GPUFLEET_NODE declared twice"):
        Var("GPUFLEET_NODE", str, "", "again")
    assert all(isinstance(v.doc, str) and v.doc for v in declared())
    own = [v for v in vars(Env).values() if isinstance(v, Var)]
    assert own and all(v.startswith("GPUFLEET_") for v in own)


def test_launch_env_from_the_environment() -> None:
    assert LaunchEnv.from_environ({"GPUFLEET_NODE": "n1"}) == LaunchEnv(node="n1")
    env = {"RANK": "5", "WORLD_SIZE": "8", "SLURMD_NODENAME": "gpu7"}
    assert LaunchEnv.from_environ(env) == LaunchEnv(
        rank=5, world_size=8, local_rank=5, local_world_size=8, node="gpu7"
    )
    env |= {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GPUFLEET_NODE": "k8s-node"}
    place = LaunchEnv.from_environ(env)
    assert (place.local_rank, place.local_world_size, place.node) == (1, 4, "k8s-node")
    assert LaunchEnv.from_environ(place.to_environ() | {"GPUFLEET_NODE": "k8s-node"}) == place
    with pytest.raises(ConfigError, match="RANK='x'"):
        LaunchEnv.from_environ({"RANK": "x"})


def test_the_node_name_has_one_rule() -> None:
    assert node_name({"GPUFLEET_NODE": "a", "SLURMD_NODENAME": "b"}) == "a"
    assert node_name({"SLURMD_NODENAME": "b"}) == "b"
    assert node_name({}) == socket.gethostname().split(".")[0]


def _reference(namespace: type) -> list[str]:
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for v in vars(namespace).values():
        if isinstance(v, Var):
            kind = getattr(v.cast, "__name__", "str")
            default = "-" if v.default in (None, "") else f"`{v.format(v.default)}`"
            rows.append(f"| `{v}` | {kind} | {default} | {v.doc} |")
    return rows


def test_docs_list_every_variable_as_declared() -> None:
    text = DOC.read_text()
    for namespace in (Env, Platform):
        table = "\n".join(_reference(namespace))
        assert table in text, f"docs/environment.md: the {namespace.__name__} table should read:\n{table}"
