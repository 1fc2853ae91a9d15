"""The peer-replicated memory tier (checkpoint/storage/peer.py) with real multi-process gloo jobs whose ranks
span two simulated nodes (support.nodes: the env of a 2-node job, one keeper directory per node).

- a lost node (ranks killed with -9, its memory removed) restores from its peer's memory and the
  training run ends bit-identical to an unkilled one;
- restore order local memory -> peer memory -> disk; a corrupt replica byte is rejected (next tier);
  two nodes lost at once (each held the other's replica) -> disk, nothing lost;
- budget: the replica, or the whole tier, is skipped for a checkpoint with a warning; saves go on;
- kill -9 at seeded points inside peer replication: the torn copy is never seen, the previous
  in-memory checkpoint is still there and used, every restore is bit-exact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from gpufleet.core.ledger import read_events
from gpufleet.train.faults import faults_to_env, parse_faults
from support.nodes import NodeJob

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
WORKER = str(SCRIPTS / "memtier_peer_worker.py")
TOY = str(SCRIPTS / "toy_train.py")
TRIALS = int(os.environ.get("GPUFLEET_TEST_PEER_TRIALS", "1"))  # CI: 1; 30 were run locally


def evs(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["ev"] == name]


def ok(results: list[tuple[int, str, str]]) -> list[list[dict]]:
    """Every rank exited 0; the JSON lines each printed (load mode: one per load)."""
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    return [[json.loads(ln) for ln in so.strip().splitlines() if ln.startswith("{")] for _, so, _ in results]


def keeper(job: NodeJob, node: int) -> Path:
    (d,) = job.node_dir(node).glob("gpufleet-memtier-*/*")
    return d


def agreed(per_rank: list[list[dict]]) -> list[tuple[int, str]]:
    """(step, source) of each load, which every rank agrees on, each bit-exact on every rank."""
    got = []
    for i in range(len(per_rank[0])):
        outs = [r[i] for r in per_rank]
        assert len({(o["step"], o.get("source")) for o in outs}) == 1, outs
        assert all(o.get("exact", True) for o in outs), outs
        got.append((outs[0]["step"], outs[0].get("source")))
    return got


def load(job: NodeJob, root: Path, *max_steps: int) -> list[tuple[int, str]]:
    """A fresh job (a restart) loads once per max step (0: the newest)."""
    return agreed(ok(job.start([WORKER, str(root), "load", *map(str, max_steps)]).wait()))


def load_one(job: NodeJob, root: Path) -> tuple[int, str]:
    (got,) = load(job, root)
    return got


def save_then_load(job: NodeJob, root: Path, *args: str) -> tuple[tuple[int, str], str]:
    """A job saves (``args``), then loads the newest in the same processes: (its load, rank 0's stderr)."""
    out = job.start([WORKER, str(root), "save", *args, "--then-load"]).wait()
    (got,) = agreed(ok(out))
    return got, out[0][2]


def final_sha(run_dir: Path) -> str:
    outs = sorted(run_dir.glob("final-*.json"), key=lambda p: p.stat().st_mtime)
    assert outs, f"no final weights in {run_dir}"
    return json.loads(outs[-1].read_text())["sha256"]


def test_lost_node_restores_from_peer_memory_and_the_run_ends_bit_identical(tmp_path: Path) -> None:
    def job(run: Path, **env: str) -> NodeJob:
        base = {"GPUFLEET_RUN_DIR": str(run), "GPUFLEET_CKPT_EVERY": "5", "GPUFLEET_MEMORY_TIER": "1MiB"}
        return NodeJob(tmp_path / run.name / "shm", nodes=2, per_node=1, env={**base, **env})

    ok(job(tmp_path / "ref").start([TOY, "--steps", "20"]).wait())
    run = tmp_path / "mem"
    kill = faults_to_env(parse_faults(["kill:rank=0,step=12,settle=1"]))
    j = job(run, GPUFLEET_FAULTS=kill).start([TOY, "--steps", "20"])
    assert j.wait_exit(0) == -9  # rank 0 died at step 12, after its in-flight save committed and replicated
    j.lose(0)  # node 0 is gone with its memory
    j.kill()  # node 1's rank, blocked on its dead peer: the job's restart
    newest = max(c["step"] for c in evs(run, "ckpt_committed"))  # 5 or 10: saves skip while one persists
    assert (keeper(j, 1) / "node_0" / f"step_{newest:08d}" / "manifest.json").is_file()
    ok(job(run).start([TOY, "--steps", "20"]).wait())
    after = evs(run, "restore")[-1]
    assert after["source"] == "peer_memory" and after["step"] == newest, after
    assert after["path"].startswith(str(j.node_dir(0)))  # rebuilt in the replacement node's memory
    assert evs(run, "ckpt_verified")[-1]["source"] == "peer_memory"
    assert evs(run, "restore_rejected") == []
    kept = [k for k in evs(run, "ckpt_memory") if k["step"] <= newest]
    assert kept and all(k["kept"] and k["peer"].startswith("node 1") for k in kept), kept
    assert final_sha(run) == final_sha(tmp_path / "ref")


def test_restore_order_corrupt_replica_and_two_lost_nodes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    job = NodeJob(tmp_path / "shm", nodes=2, per_node=2)
    # Each node holds its own part (its 2 ranks' files) and its peer's: local memory first.
    assert save_then_load(job, root, "1", "2")[0] == (2, "memory")
    mem = evs(root, "ckpt_memory")
    assert [m["step"] for m in mem] == [1, 2] and all(m["kept"] and m["peer"] for m in mem), mem
    # Node 0 lost: its ranks read the parts node 1 holds, sent over the leaders' gloo group.
    job.lose(0)
    assert load_one(job, root) == (2, "peer_memory")
    (done,) = evs(root, "ckpt_verified")[-1:]
    assert done["source"] == "peer_memory" and done["path"].startswith(str(job.node_dir(0)))  # rank 0's node
    # Node 0 lost again, and node 1's replica of node 0's part has a flipped byte: rejected on
    # receipt with the manifest's checksum, the same step comes from disk.
    job.lose(0)
    shard = max(
        (keeper(job, 1) / "node_0" / "step_00000002").glob("*.distcp"), key=lambda p: p.stat().st_size
    )
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x20]))
    before = len(evs(root, "restore_rejected"))
    assert load_one(job, root) == (2, "local")
    rejected = evs(root, "restore_rejected")[before:]
    assert rejected and all(r["step"] == 2 for r in rejected)
    assert any("does not match the manifest" in r["reason"] and shard.name in r["reason"] for r in rejected)
    # Both nodes lost at once (each held the other's replica): disk, nothing lost.
    job.lose(0)
    job.lose(1)
    assert load_one(job, root) == (2, "local")


def test_budget_skips_the_replica_then_the_tier_and_saves_go_on(tmp_path: Path) -> None:
    # A part weighs ~60 KB here (its rank's file + .metadata + manifest): 100 KB holds one part, not two.
    root = tmp_path / "run"
    job = NodeJob(tmp_path / "shm", nodes=2, per_node=1)
    got, err = save_then_load(job, root, "1", "--budget", "100000")
    (m,) = evs(root, "ckpt_memory")
    assert m["kept"] and m.get("peer") is None and "no room for" in m["reason"] and m["used_bytes"] <= 100_000
    assert "warning: step 1 kept in memory without a peer replica" in err
    assert got == (1, "peer_memory")  # own parts only: whole across the two nodes, exchanged
    root2 = tmp_path / "run2"
    job2 = NodeJob(tmp_path / "shm2", nodes=2, per_node=1)
    got, err = save_then_load(job2, root2, "1", "2", "--budget", "20000")
    assert "warning: step 1 not kept in memory" in err
    mem = evs(root2, "ckpt_memory")
    assert [m["kept"] for m in mem] == [False, False]
    assert "larger than the memory tier budget" in mem[0]["reason"]
    assert [c["step"] for c in evs(root2, "ckpt_committed")] == [1, 2]  # training never fails over it
    assert got == (2, "local")


@pytest.mark.parametrize("seed", range(TRIALS))
def test_kill_9_during_peer_replication_keeps_the_previous_memory_checkpoint(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    victim = rng.randrange(2)
    at = rng.randrange(1, 25)  # the n-th 4 KiB message this rank sends or receives for step 2
    lose = rng.random() < 0.5
    root = tmp_path / "run"
    job = NodeJob(tmp_path / "shm", nodes=2, per_node=1)
    job.start(
        [WORKER, str(root), "save", "1", "2"],
        extra={victim: ["--kill-at", str(at), "--kill-after-step", "2"]},
    )
    assert job.wait_exit(victim) == -9
    job.kill()
    if lose:
        job.lose(victim)
    for node in range(2):  # nothing torn is visible: a step dir is complete with its manifest, or absent
        if job.node_dir(node).exists():
            for d in keeper(job, node).glob("node_*/step_*"):
                assert d.name.endswith(".tmp") or (d / "manifest.json").is_file(), d
    # The previous in-memory checkpoint is intact and used (a rollback to it reads it from memory);
    # the newest commit (step 2, on disk before replication began) comes from memory if whole there,
    # else from disk: bit-exact either way, never a torn copy.
    prev, newest = load(job, root, 1, 0)
    assert prev[0] == 1 and prev[1] in ("memory", "peer_memory"), (seed, prev)
    assert newest[0] == 2 and newest[1] in ("memory", "peer_memory", "local"), (seed, newest)
    print(f"seed {seed}: victim rank {victim}, message {at}, node lost {lose}: step 2 from {newest[1]}")
    assert evs(root, "restore_rejected") == []
    shutil.rmtree(tmp_path / "shm", ignore_errors=True)
