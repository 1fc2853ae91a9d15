"""Bad input for every command, in this process: one line on stderr, the documented exit code, no
traceback, and nothing changed on disk (the working directory, which holds every path named, is
snapshotted before and after).

Each row is (argv, exit code, a substring that line must contain). Placeholders name the fixture's
paths: {file} an existing file, {dir} an existing empty directory, {missing} a path that does not exist,
{garbage_run} a run directory whose ledger holds a line of binary garbage, {bad_model} a model
directory with a truncated config.json, {model} one whose config.json passes the checks made before
loading (nothing loads it), {bad_json} a truncated JSON file, {profile} a shipped serving profile,
{plan} a valid capacity plan, {busy_port} a port something listens on, {py} this Python.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cli import assert_one_line_error, gpufleet, tree_snapshot

PY = sys.executable
RUN = ("run", "--run-dir", "{dir}/run")  # a run directory the command would create
CMD = ("--", "{py}", "-c", "pass")
BENCH = ("serve", "bench", "--url", "http://127.0.0.1:9", "--rate", "5")  # nothing listens on port 9

# ------------------------------------------------------------------------------------------- table
CASES: list[tuple[tuple[str, ...], int, str]] = [
    # run: flags, numbers, fault specs, the command, output paths
    (("run", "--bogus"), 2, "no such option"),
    ((*RUN, "-n", "0", *CMD), 2, "nproc"),
    ((*RUN, "-n", "-3", *CMD), 2, "nproc"),
    ((*RUN, "-n", "1000000000000", *CMD), 2, "nproc"),
    ((*RUN, "-n", "two", *CMD), 2, "valid integer"),
    ((*RUN, "--max-restarts", "-1", *CMD), 2, "max-restarts"),
    ((*RUN, "--restart-window", "-5", *CMD), 2, "restart-window"),
    ((*RUN, "--max-no-progress", "-1", *CMD), 2, "max-no-progress"),
    ((*RUN, "--max-rollbacks", "-1", *CMD), 2, "max-rollbacks"),
    ((*RUN, "--rollback-window", "-1", *CMD), 2, "rollback-window"),
    ((*RUN, "--hang-timeout", "-1", *CMD), 2, "hang"),
    ((*RUN, "--hang-timeout", "nan", *CMD), 2, "hang"),
    ((*RUN, "--init-timeout", "0", *CMD), 2, "init"),
    ((*RUN, "--keep-last", "0", *CMD), 2, "keep"),
    ((*RUN, "--mtbf", "-10", *CMD), 2, "mtbf"),
    ((*RUN, "--checkpoint-every", "-3", *CMD), 2, "checkpoint"),
    ((*RUN, "--checkpoint-every", "often", *CMD), 2, "checkpoint"),
    ((*RUN, "--memory-tier", "lots", *CMD), 2, "memory"),
    ((*RUN, "--slot-failures", "0", *CMD), 2, "slot-failures"),
    ((*RUN, "--min-nproc", "5", "-n", "2", *CMD), 2, "min"),
    ((*RUN, "--inject", "kill:rank=5", *CMD), 2, "rank"),
    ((*RUN, "-n", "2", "--inject", "kill:rank=2,step=3", *CMD), 2, "rank"),
    ((*RUN, "--inject", "explode:step=3", *CMD), 2, "explode"),
    ((*RUN, "--inject", "kill:step=-1", *CMD), 2, "step"),
    ((*RUN, "--backend", "mainframe", *CMD), 2, "backend"),
    ((*RUN, "--dist-backend", "carrier-pigeon", *CMD), 2, "carrier-pigeon"),
    ((*RUN, "--cpu-affinity", "sometimes", *CMD), 2, "affinity"),
    ((*RUN, "--straggler-action", "shout", *CMD), 2, "straggler"),
    ((*RUN, "--auto-telemetry=sometimes", *CMD), 2, "auto-telemetry"),
    ((*RUN, "--upload", "ftp://x/y", *CMD), 2, "upload"),
    ((*RUN, "--metrics", "notaport", *CMD), 2, "metrics"),
    ((*RUN, "--metrics", "70000", *CMD), 2, "port"),
    ((*RUN, "--nodes", "0", "--backend", "srun", *CMD), 2, "nodes"),
    ((*RUN, "--spare-nodes", "-1", *CMD), 2, "spare"),
    ((*RUN,), 2, "command"),
    ((*RUN, "--", "/nonexistent/python", "train.py"), 2, "/nonexistent/python"),
    # run: torchrun's launch line and the ranks' environment
    ((*RUN, "-n", "2", "--standalone", "{missing}.py", "--arg", "x"), 2, "{missing}.py: no such script"),
    ((*RUN, "--", "{py}", "{missing}.py"), 2, "{missing}.py: no such script"),
    ((*RUN, "--nnodes", "2", *CMD), 2, "--backend srun"),
    ((*RUN, "--nnodes", "0", *CMD), 2, "nnodes"),
    ((*RUN, "--nnodes", "3:2", "--backend", "srun", *CMD), 2, "nnodes"),
    ((*RUN, "--node-rank", "1", *CMD), 2, "node-rank"),
    ((*RUN, "--rdzv-backend", "etcd", *CMD), 2, "rdzv-backend"),
    ((*RUN, "--rdzv-endpoint", "host:port", *CMD), 2, "rdzv-endpoint"),
    ((*RUN, "--rdzv-endpoint", "a:29400", "--master-addr", "b", *CMD), 2, "disagree"),
    ((*RUN, "--standalone", "--backend", "srun", *CMD), 2, "standalone"),
    ((*RUN, "--master-port", "70000", *CMD), 2, "master-port"),
    ((*RUN, "--backend", "ray", "--master-addr", "h", *CMD), 2, "master-addr"),
    ((*RUN, "--env", "NOEQUALS", *CMD), 2, "KEY=VALUE"),
    ((*RUN, "--env", "1BAD=x", *CMD), 2, "variable name"),
    ((*RUN, "--env-file", "{missing}", *CMD), 2, "{missing}"),
    ((*RUN, "--env-file", "{file}", *CMD), 2, "{file}:1"),  # "hello": not KEY=VALUE
    ((*RUN, "--backend", "k8s", "--image", "i", "--env", "AWS_SECRET_ACCESS_KEY=s", *CMD), 2, "Secret"),
    (("run", "--run-dir", "{file}", *CMD), 2, "{file}"),
    (("run", "--run-dir", "/proc/x/run", *CMD), 2, "/proc/x"),
    ((*RUN, "--fresh=yes", *CMD), 2, "--fresh"),
    (("run", "--run-dir", "{file}", "--fresh", *CMD), 2, "{file}"),
    # report
    (("report", "{missing}"), 2, "{missing}"),
    (("report", "{file}"), 2, "{file}"),
    (("report", "{dir}"), 2, "{dir}"),
    (("report", "{garbage_run}"), 2, "{garbage_run}"),
    (("report", "{garbage_run}", "--plot", "/proc/x/t.png"), 2, "/proc/x"),
    (("report", "{garbage_run}", "--plot", "{dir}"), 2, "{dir}"),
    (("report", "--bogus", "{dir}"), 2, "no such option"),
    # demo
    (("demo", "--steps", "0", "--dir", "{dir}/demo"), 2, "steps"),
    (("demo", "--steps", "-5", "--dir", "{dir}/demo"), 2, "steps"),
    (("demo", "--nproc", "0", "--dir", "{dir}/demo"), 2, "nproc"),
    (("demo", "--nproc", "100000", "--dir", "{dir}/demo"), 2, "nproc"),
    (("demo", "--checkpoint-every", "0", "--dir", "{dir}/demo"), 2, "checkpoint"),
    (("demo", "--dir", "{file}"), 2, "{file}"),
    (("demo", "--dir", "/proc/x/demo"), 2, "/proc/x"),
    (("demo", "--seed", "x", "--dir", "{dir}/demo"), 2, "valid integer"),
    # ckpt
    (("ckpt", "list", "{missing}"), 2, "{missing}"),
    (("ckpt", "list", "{file}"), 2, "{file}"),
    (("ckpt", "verify", "{missing}"), 2, "{missing}"),
    (("ckpt", "verify", "{dir}", "--step", "-1"), 2, "step"),
    (("ckpt", "verify", "{file}"), 2, "{file}"),
    (("ckpt", "bogus"), 2, "no such command"),
    # health check / watch / slurm-config / sweep / release
    (("health", "check", "--plan", "nosuch"), 2, "nosuch"),
    (("health", "check", "--expect-gpus", "-1"), 2, "expect-gpus"),
    (("health", "check", "--expect-gpus", "1000000000000"), 2, "expect-gpus"),
    (("health", "check", "--profile", "{missing}"), 2, "{missing}"),
    (("health", "check", "--profile", "{bad_json}"), 2, "{bad_json}"),
    (("health", "check", "--fleet-dir", "{file}"), 2, "{file}"),
    (("health", "check", "--node", ""), 2, "node"),
    (("health", "watch", "--interval", "-300"), 2, "interval"),
    (("health", "watch", "--count", "-1"), 2, "count"),
    (("health", "watch", "--plan", "nosuch", "--count", "1"), 2, "nosuch"),
    (("health", "watch", "--fleet-dir", "{file}", "--count", "1"), 2, "{file}"),
    (("health", "slurm-config", "--interval", "-300"), 2, "interval"),
    (("health", "slurm-config", "--interval", "0"), 2, "interval"),
    (("health", "slurm-config", "--install", "--slurm-conf", "{missing}/slurm.conf"), 2, "{missing}"),
    (("health", "slurm-config", "--install", "--slurm-conf", "{dir}"), 2, "{dir}"),
    (("health", "slurm-config", "--install", "--slurm-conf", "/proc/x/slurm.conf"), 2, "/proc/x"),
    (("health", "sweep", "--backend", "k8s"), 2, "k8s"),
    (("health", "sweep", "--timeout", "-1"), 2, "timeout"),
    (("health", "sweep", "--plan", "nosuch"), 2, "nosuch"),
    (("health", "release"), 2, "node"),
    (("health", "release", ""), 2, "node"),
    (("health", "nosuch"), 2, "no such command"),
    # nodes
    (("nodes", "--fleet-dir", "{missing}"), 2, "{missing}"),
    (("nodes", "--fleet-dir", "{file}"), 2, "{file}"),
    (("nodes", "--lemon-failures", "0"), 2, "lemon-failures"),
    (("nodes", "--lemon-window-days", "-1"), 2, "lemon-window-days"),
    (("nodes", "--json", "--fleet-dir", "{missing}"), 2, "{missing}"),
    # serve bench
    (("serve", "bench", "--url", "http://127.0.0.1:9", "--rate", "-1"), 2, "rate"),
    (("serve", "bench", "--url", "http://127.0.0.1:9", "--rate", "0"), 2, "rate"),
    (("serve", "bench", "--url", "http://127.0.0.1:9"), 2, "rate"),
    ((*BENCH, "--requests", "0"), 2, "requests"),
    ((*BENCH, "--concurrency", "-2"), 2, "concurrency"),
    ((*BENCH, "--duration", "-1"), 2, "duration"),
    ((*BENCH, "--attainment", "1.5"), 2, "attainment"),
    ((*BENCH, "--processes", "0"), 2, "processes"),
    ((*BENCH, "--slo", "ttft=fast"), 2, "slo"),
    ((*BENCH, "--workload", "nosuch"), 2, "nosuch"),
    ((*BENCH, "--out", "{file}"), 2, "{file}"),
    ((*BENCH, "--out", "/proc/x"), 2, "/proc/x"),
    (("serve", "bench", "--url", "notaurl", "--rate", "5"), 2, "url"),
    ((*BENCH, "--max-lag-ms", "-1"), 2, "lag"),
    ((*BENCH, "--timeout", "-5"), 2, "timeout"),
    ((*BENCH, "--arrival", "zigzag"), 2, "zigzag"),
    # serve mock
    (("serve", "mock", "--port", "70000"), 2, "port"),
    (("serve", "mock", "--port", "-1"), 2, "port"),
    (("serve", "mock", "--ttft", "fast"), 2, "ttft"),
    (("serve", "mock", "--itl", "-5ms"), 2, "itl"),
    (("serve", "mock", "--jitter", "-0.5"), 2, "jitter"),
    (("serve", "mock", "--max-batch", "0"), 2, "max batch"),
    (("serve", "mock", "--output-len", "-1"), 2, "output length"),
    (("serve", "mock", "--fail-rate", "1.5"), 2, "fail rate"),
    (("serve", "mock", "--fail-mode", "explode"), 2, "explode"),
    (("serve", "mock", "--token-rule", "nosuch"), 2, "nosuch"),
    (("serve", "mock", "--context", "0"), 2, "context"),
    # serve profile
    (("serve", "profile", "--from-table", "{missing}"), 2, "{missing}"),
    (("serve", "profile", "--from-table", "{bad_json}"), 2, "{bad_json}"),
    (("serve", "profile", "--url", "http://127.0.0.1:9", "--tp", "0"), 2, "tp"),
    (("serve", "profile", "--url", "http://127.0.0.1:9", "--requests", "0"), 2, "requests"),
    (("serve", "profile", "--url", "http://127.0.0.1:9", "--inputs", "a,b"), 2, "inputs"),
    (("serve", "profile", "--url", "http://127.0.0.1:9", "--concurrency", "0,-1"), 2, "concurrency"),
    (("serve", "profile", "--url", "http://127.0.0.1:9", "--out", "/proc/x/p.json"), 2, "/proc/x"),
    (("serve", "profile", "--url", "http://127.0.0.1:9", "--out", "{dir}"), 2, "{dir}"),
    (("serve", "profile"), 2, "url"),
    # serve plan
    (("serve", "plan", "--profile", "{missing}", "--rate", "5"), 2, "{missing}"),
    (("serve", "plan", "--profile", "{bad_json}", "--rate", "5"), 2, "{bad_json}"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "1e12"), 2, "rate"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "-1"), 2, "rate"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--attainment", "2"), 2, "attainment"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--max-gpus", "0"), 2, "max-gpus"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--sim-requests", "0"), 2, "sim-requests"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--mode", "sideways"), 2, "sideways"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--slo", "ttft_p90=soon"), 2, "slo"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--kv-gbps", "-1"), 2, "kv-gbps"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--out", "/proc/x/plan.json"), 2, "/proc/x"),
    (("serve", "plan", "--profile", "{profile}", "--rate", "5", "--out", "{file}"), 2, "{file}"),
    (("serve", "plan", "--profile", "{profile}", "--traffic", "{bad_json}"), 2, "{bad_json}"),
    # serve pack
    (("serve", "pack", "--plans", "{missing}", "--nodes", "8x4"), 2, "{missing}"),
    (("serve", "pack", "--plans", "{bad_json}", "--nodes", "8x4"), 2, "{bad_json}"),
    (("serve", "pack", "--plans", "{file}", "--nodes", "8x4"), 2, "{file}"),
    (("serve", "pack", "--plans", "{plan}", "--nodes", "8x-4"), 2, "nodes"),
    (("serve", "pack", "--plans", "{plan}", "--nodes", "8x4", "--time-limit", "-1"), 2, "time-limit"),
    (("serve", "pack", "--plans", "{plan}", "--nodes", "8x4", "--workers", "0"), 2, "workers"),
    (("serve", "pack", "--plans", "{plan}", "--nodes", "8x4", "--solver", "magic"), 2, "magic"),
    (("serve", "pack", "--plans", "{plan}", "--nodes", "8x4", "--out", "{file}"), 2, "{file}"),
    (("serve", "pack", "--plans", "{plan}", "--nodes", "8x4", "--out", "/proc/x"), 2, "/proc/x"),
    # compress
    (("compress", "analyze", "--model", "{missing}"), 2, "{missing}"),
    (("compress", "analyze", "--model", "{bad_model}"), 2, "{bad_model}"),
    (("compress", "analyze", "--model", "{bad_model}", "--tokens", "0"), 2, "tokens"),
    (("compress", "analyze", "--model", "{model}", "--out", "{file}"), 2, "{file}"),
    (("compress", "prune", "--model", "{bad_model}", "--out", "{dir}/pruned"), 2, "{bad_model}"),
    (("compress", "prune", "--model", "{missing}", "--out", "{dir}/pruned"), 2, "{missing}"),
    (("compress", "prune", "--model", "{bad_model}", "--out", "{dir}/p", "--target", "1.5"), 2, "target"),
    (("compress", "prune", "--model", "{bad_model}", "--out", "{dir}/p", "--target", "0"), 2, "target"),
    (("compress", "prune", "--model", "{bad_model}", "--out", "{dir}/p", "--method", "magic"), 2, "magic"),
    (("compress", "prune", "--model", "{model}", "--out", "{file}"), 2, "{file}"),
    (("compress", "prune", "--model", "{model}", "--out", "/proc/x/p"), 2, "/proc/x"),
    (("compress", "heal", "{missing}", "--out", "{dir}/h"), 2, "{missing}"),
    (("compress", "heal", "{bad_model}", "--out", "{dir}/h", "--steps", "0"), 2, "steps"),
    (("compress", "heal", "{bad_model}", "--out", "{dir}/h", "--lr", "-1"), 2, "lr"),
    (("compress", "heal", "{bad_model}", "--out", "{dir}/h", "--batch", "0"), 2, "batch"),
    (("compress", "heal", "{model}", "--out", "{file}"), 2, "{file}"),
    (("compress", "heal-worker", "{missing}"), 78, "{missing}"),
    (("compress", "heal-worker", "{bad_json}"), 78, "{bad_json}"),
    (("compress", "eval", "{missing}", "--dense", "{bad_model}"), 2, "{missing}"),
    (("compress", "eval", "{bad_model}", "--dense", "{bad_model}", "--tokens", "0"), 2, "tokens"),
    (("compress", "eval", "{model}", "--dense", "{model}", "--out", "{file}"), 2, "{file}"),
    (("compress", "export", "{bad_model}", "--out", "{dir}/e"), 2, "{bad_model}"),
    (("compress", "export", "{missing}", "--out", "{dir}/e"), 2, "{missing}"),
    (("compress", "export", "{bad_model}", "--out", "{dir}/e", "--formats", "zip"), 2, "zip"),
    (("compress", "export", "{model}", "--out", "{file}"), 2, "{file}"),
    (("compress", "export", "{model}", "--out", "/proc/x/e"), 2, "/proc/x"),
    # metrics, dashboard, mcp
    (("metrics", "show", "{missing}"), 2, "{missing}"),
    (("metrics", "show", "{file}"), 2, "{file}"),
    (("metrics", "show", "--serve-dir", "{missing}"), 2, "{missing}"),
    (("metrics", "show", "--fleet-dir", "{file}"), 2, "{file}"),
    (("metrics", "serve", "--listen", "127.0.0.1:70000", "{dir}"), 2, "70000"),
    (("metrics", "serve", "--listen", "nohost:port", "{dir}"), 2, "listen"),
    (("metrics", "serve", "{missing}"), 2, "{missing}"),
    (("metrics", "textfile", "{dir}", "--output", "/proc/x/g.prom"), 2, "/proc/x"),
    (("metrics", "textfile", "{dir}", "--output", "{dir}"), 2, "{dir}"),
    (("metrics", "textfile", "{missing}"), 2, "{missing}"),
    (("metrics", "push", "{dir}", "--gateway", ""), 2, "gateway"),
    (("metrics", "push", "{dir}", "--gateway", "not a url"), 2, "gateway"),
    (("metrics", "push", "{missing}", "--gateway", "http://127.0.0.1:9"), 2, "{missing}"),
    (("dashboard", "export", "-o", "{dir}"), 2, "{dir}"),
    (("dashboard", "export", "-o", "/proc/x/d.json"), 2, "/proc/x"),
    (("dashboard", "export", "-o", "{file}/d.json"), 2, "{file}"),
    (("dashboard", "rules", "-o", "{dir}"), 2, "{dir}"),
    (("dashboard", "rules", "-o", "/proc/x/r.yml"), 2, "/proc/x"),
    (("dashboard", "nosuch"), 2, "no such command"),
    (("mcp", "{dir}", "--transport", "smoke"), 2, "smoke"),
    (("mcp", "{dir}", "--transport", "http", "--listen", "0.0.0.0:0"), 2, "0.0.0.0"),
    (("mcp", "{dir}", "--transport", "http", "--listen", "127.0.0.1:70000"), 2, "70000"),
    (("mcp", "{dir}", "--transport", "http", "--listen", "127.0.0.1:{busy_port}"), 2, "{busy_port}"),
    (("mcp", "{missing}"), 2, "{missing}"),
    (("mcp", "--serve-dir", "{missing}"), 2, "{missing}"),
    (("mcp", "--fleet-dir", "{file}"), 2, "{file}"),
    # fleet simulate
    (("fleet", "simulate", "--gpus", "1e12"), 2, "gpus"),
    (("fleet", "simulate", "--gpus", "1000000000000"), 2, "gpus"),
    (("fleet", "simulate", "--gpus", "0"), 2, "gpus"),
    (("fleet", "simulate", "--days", "-1"), 2, "days"),
    (("fleet", "simulate", "--days", "1e9"), 2, "days"),
    (("fleet", "simulate", "--replicates", "0"), 2, "replicates"),
    (("fleet", "simulate", "--replicates", "100000000"), 2, "replicates"),
    (("fleet", "simulate", "--spares", "-1"), 2, "spares"),
    (("fleet", "simulate", "--interval", "often"), 2, "interval"),
    (("fleet", "simulate", "--profile", "nosuch"), 2, "nosuch"),
    (("fleet", "simulate", "--strategy", "nosuch"), 2, "nosuch"),
    (("fleet", "simulate", "--from-run", "{missing}"), 2, "{missing}"),
    (("fleet", "simulate", "--from-run", "{garbage_run}"), 2, "{garbage_run}"),
    (("fleet", "simulate", "--plot-dir", "/proc/x"), 2, "/proc/x"),
    (("fleet", "simulate", "--plot-dir", "{file}"), 2, "{file}"),
    (("fleet", "nosuch"), 2, "no such command"),
    # the command tree itself
    (("nosuch",), 2, "no such command"),
    (("--bogus",), 2, "no such option"),
]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid capacity plan (``serve plan`` of a shipped profile)."""
    out = tmp_path_factory.mktemp("plan")
    small = ("--sim-requests", "100", "--max-gpus", "8", "--mode", "aggregated", "--out", out)
    result = gpufleet("serve", "plan", "--profile", "opt-13b-a100", "--traffic", "rate=2", *small)
    assert result.returncode == 0, result.stderr
    return str(out / "plan.json")


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port something already listens on."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


@pytest.fixture
def paths(tmp_path: Path, plan_file: str, busy_port: int) -> dict[str, str]:
    """The fixture's files (see the module docstring), made fresh for each case."""
    root = tmp_path / "work"
    (root / "adir").mkdir(parents=True)
    (root / "afile.txt").write_text("hello\n")
    (root / "garbage-run").mkdir()
    (root / "garbage-run" / "ledger.jsonl").write_bytes(b"\xff\xfe\x00garbage\x9c\x80\n")
    (root / "bad-model").mkdir()
    (root / "bad-model" / "config.json").write_text('{"model_type": "lla')
    (root / "model").mkdir()  # passes the checks before loading; nothing here loads it
    (root / "model" / "config.json").write_text('{"model_type": "llama"}')
    (root / "bad.json").write_text('{"schema": "gpufleet.')
    return {
        "root": str(root),
        "file": str(root / "afile.txt"),
        "dir": str(root / "adir"),
        "missing": str(root / "missing"),
        "garbage_run": str(root / "garbage-run"),
        "bad_model": str(root / "bad-model"),
        "model": str(root / "model"),
        "bad_json": str(root / "bad.json"),
        "profile": "opt-13b-a100",
        "plan": plan_file,
        "busy_port": str(busy_port),
        "py": PY,
    }


def _fill(text: str, paths: dict[str, str]) -> str:
    return text.format(**paths)


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 150
    assert len({c[0] for c in CASES}) == len(CASES), "duplicate rows"


@pytest.mark.parametrize(("argv", "code", "needle"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input(
    argv: tuple[str, ...], code: int, needle: str, paths: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(paths["root"])
    monkeypatch.setenv("GPUFLEET_FLEET_DIR", str(root / ".gpufleet" / "fleet"))
    before = tree_snapshot(root)
    result = gpufleet(*(_fill(a, paths) for a in argv), cwd=root)
    assert_one_line_error(result, code, _fill(needle, paths))
    assert tree_snapshot(root) == before, "the command changed files"
