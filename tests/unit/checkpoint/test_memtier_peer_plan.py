"""Peer memory tier, the pure parts: node topology, splitting a manifest into node parts, and the
restore plan (who sends which part to whom, or why memory cannot serve a step)."""

from __future__ import annotations

from gpufleet.checkpoint.manifest import FileEntry, Manifest
from gpufleet.checkpoint.storage.peer import Topology, node_part, plan_restore, split_parts

NODE_OF = (0, 0, 1, 1)  # 2 nodes x 2 ranks


def manifest(step: int = 7) -> Manifest:
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__2_1.distcp", "__3_0.distcp"]
    files = {n: FileEntry(100 + i, f"{i:016x}") for i, n in enumerate(names)}
    return Manifest(step=step, time=1.0, world_size=4, files=files, meta={"epoch": 0})


def test_topology_renumbers_nodes_and_picks_the_lowest_rank_as_leader() -> None:
    t = Topology.from_reports(3, [(5, "a"), (5, "a"), (9, "b"), (9, "b")])
    assert t.node_of == NODE_OF and t.leaders == (0, 2) and t.hosts == ("a", "b")
    assert t.nodes == 2 and t.node == 1 and not t.leader
    assert Topology.from_reports(2, [(5, "a"), (5, "a"), (9, "b"), (9, "b")]).leader


def test_parts_hold_their_ranks_files_and_metadata_with_the_disk_checksums() -> None:
    m = manifest()
    p0, p1 = split_parts(m, NODE_OF, 2)
    assert sorted(p0.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p1.files) == [".metadata", "__2_0.distcp", "__2_1.distcp", "__3_0.distcp"]
    assert all(p.files[n] == m.files[n] for p in (p0, p1) for n in p.files)
    assert p1.step == 7 and p1.meta == {"epoch": 0, "gpufleet_part": {"node": 1, "nodes": 2}}
    assert node_part("custom.bin", NODE_OF) == 0 and node_part("__9_0.distcp", NODE_OF) == 0


def inv(step: int, *parts: int, corrupt: int | None = None) -> dict:
    out = {}
    for k in parts:
        files = {n: (e.bytes, e.xxh3) for n, e in split_parts(manifest(), NODE_OF, 2)[k].files.items()}
        if k == corrupt:
            files[".metadata"] = (1, "0" * 16)
        out[k] = {step: files}
    return out


def test_plan_every_node_local_needs_no_transfer() -> None:
    assert plan_restore(manifest(), NODE_OF, [inv(7, 0, 1), inv(7, 1, 0)]) == []


def test_plan_a_lost_node_gets_every_part_from_the_survivor() -> None:
    assert plan_restore(manifest(), NODE_OF, [None, inv(7, 1, 0)]) == [(0, 1, 0), (1, 1, 0)]
    # own parts only (no replicas kept): each sends its part to the other; the owner is preferred
    assert plan_restore(manifest(), NODE_OF, [inv(7, 0), inv(7, 1)]) == [(1, 1, 0), (0, 0, 1)]


def test_plan_refuses_what_memory_does_not_hold_exactly() -> None:
    assert "node 0's part" in plan_restore(manifest(), NODE_OF, [None, None])
    assert "node 1's part" in plan_restore(manifest(), NODE_OF, [inv(7, 0), None])
    assert "step 7" in plan_restore(manifest(), NODE_OF, [inv(6, 0, 1), inv(6, 1, 0)])  # other step
    # a part whose checksums differ from the disk commit's (another trajectory) is not a holder
    assert isinstance(plan_restore(manifest(), NODE_OF, [inv(7, 0, 1, corrupt=0), None]), str)
