"""Peer replication of the in-memory tier across nodes (``--memory-tier`` when ranks span nodes).

A node's keeper (storage/memory.py) holds only what lives on that node; a lost node takes its tmpfs with it.
So when the ranks span nodes, each committed checkpoint is split into **node parts** and every node
keeps its own part and a **replica of one peer's part**: node ``n`` sends its part to node
``(n + 1) mod N``. A part is the DCP files its ranks wrote (``__<rank>_<i>.distcp``), plus DCP's
``.metadata``, plus a part manifest: the disk manifest's entries for those files (same xxh3
checksums, same step) and ``meta["gpufleet_part"] = {"node": n, "nodes": N}``. Keeper layout::

    <keeper>/node_<n>/step_N/        this node's part       (kept from the committed disk copy)
    <keeper>/node_<n-1>/step_N/      the predecessor's part (received from it)
    <keeper>/restore/step_N/         a whole checkpoint assembled for a restore (hard links + received)

**Transport: the engine's own gloo, one group of node leaders.** The lowest rank of each node (its
leader) runs the replication in the engine's background persist thread, with point-to-point
``isend``/``recv`` of the files' bytes on a dedicated gloo group made of the leaders only (created
by every rank with the engine's other groups). Why this and not the per-node agent: the agent
exists only under the multi-node backends (srun, Slurm, Kubernetes, Ray) and each speaks its own
channel, whereas every multi-node run, supervised or standalone, already has a working TCP mesh
between its ranks, the one ``torch.distributed`` built; it needs no new service, no new port, no
new authentication, and the bytes go from one process's page cache to another's with no
serialization (the sender memory-maps its keeper's tmpfs files). A dedicated group keeps these
transfers out of the DCP collectives on the engine's checkpoint group and out of training's.

**Save** (after the disk commit, every leader, in the persist thread; never fails training):
1. budget: own part + replica part must fit ``budget_bytes`` (what the keeper holds: both parts of
   every step kept, torn leftovers included); room is made by evicting the oldest steps (all their
   parts). If both do not fit, the replica is skipped; if the own part alone does not fit, the tier
   is skipped for that checkpoint. Either is a ``ckpt_memory`` event with the reason (and one line on
   stderr, the first time);
2. the own part is copied from the committed disk copy, hashed while copied (``MemoryKeeper.keep``);
3. leaders agree (one small all-gather) who sends and who accepts, then each sends its part to its
   successor and receives its predecessor's into ``node_<p>/step_N.tmp``, **hashing on receipt** and
   comparing with the disk manifest's checksums; rename, part manifest last. A kill at any point
   leaves a torn directory no restore can see (swept by the next save);
4. a second all-gather tells each leader whether its replica was kept; rank 0's event says it.

**Restore** (every rank; before the disk and S3 tiers): leaders all-gather what parts they hold.
Rank 0 takes the newest committed disk step (<= max_step); memory is a candidate for it when every
node part is held by some live node with the disk manifest's checksums (a memory copy stands for a
disk commit, as on one node). Every node needs every part (DCP may place any tensor in any rank's
file), so each leader assembles the whole checkpoint in ``restore/step_N``: hard links to the parts
it holds, the missing ones received from a holder (the part's own node if alive, else the node
holding its replica). Received bytes are hashed on receipt; linked local files are hashed before
use. Any mismatch on any node rejects the memory candidate for all (``restore_rejected``), and
restore goes on to local disk, then S3. ``restore.source`` is ``memory`` when every node had every
part, ``peer_memory`` when any part crossed the network.

Not built: re-replicating after a restore (the replacement node holds its parts again at the next
checkpoint), and fetching only the files a node's ranks read (all parts go to every node that lacks
them: ``(N - 1)`` parts per node at worst, two nodes lose nothing with ``N = 2``).
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from gpufleet.checkpoint.failures import failure_reason
from gpufleet.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    list_committed,
    read_manifest,
    step_dirname,
    write_manifest,
)
from gpufleet.checkpoint.storage.memory import MemoryKeeper, manifest_bytes
from gpufleet.checkpoint.verify import hash_file, xxh3_hex
from gpufleet.core import events as E
from gpufleet.core.env import Platform
from gpufleet.core.launch import LaunchEnv

__all__ = ["Topology", "PeerTier", "node_part", "split_parts", "plan_restore"]

_CHUNK = 16 << 20  # bytes per point-to-point message
_TIMEOUT = timedelta(seconds=300)  # a leader gone mid-transfer: its peers give up, training goes on
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
RESTORE_DIR = "restore"


def _node_from_env(rank: int) -> int:
    for var in (Platform.GROUP_RANK, Platform.NODE_RANK):
        if var.raw():
            return var.get()
    return rank // LaunchEnv.from_environ().local_world_size


@dataclass(frozen=True)
class Topology:
    """Which rank runs on which node, as every rank reported it (``GROUP_RANK``/``NODE_RANK``)."""

    rank: int
    node_of: tuple[int, ...]
    """Node index (0..N-1) of each rank."""
    leaders: tuple[int, ...]
    """The lowest rank of each node, by node index: the ranks that replicate."""
    hosts: tuple[str, ...]
    """Each node's host name (its leader's)."""

    @property
    def nodes(self) -> int:
        return len(self.leaders)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def leader(self) -> bool:
        return self.leaders[self.node] == self.rank

    @classmethod
    def from_reports(cls, rank: int, reports: list[tuple[int, str]]) -> Topology:
        """From every rank's ``(node id, host)``: node ids renumbered 0..N-1 in their order."""
        ids = sorted({nid for nid, _ in reports})
        index = {nid: i for i, nid in enumerate(ids)}
        node_of = tuple(index[nid] for nid, _ in reports)
        leaders = tuple(min(r for r, n in enumerate(node_of) if n == i) for i in range(len(ids)))
        return cls(rank=rank, node_of=node_of, leaders=leaders, hosts=tuple(reports[r][1] for r in leaders))

    def name(self, node: int) -> str:
        return f"node {node} ({self.hosts[node]})"


def node_part(name: str, node_of: tuple[int, ...]) -> int | None:
    """The node whose part holds file ``name``: its writer rank's node; None: every part (``.metadata``).
    A file named after no rank (not DCP's default prefix) belongs to node 0, rank 0's."""
    if name == ".metadata":
        return None
    m = _RANK_FILE.match(name)
    if m is None or int(m.group(1)) >= len(node_of):
        return 0
    return node_of[int(m.group(1))]


def split_parts(manifest: Manifest, node_of: tuple[int, ...], nodes: int) -> list[Manifest]:
    """One part manifest per node: its ranks' files and ``.metadata``, the disk manifest's checksums."""
    parts: list[Manifest] = []
    for k in range(nodes):
        files = {n: e for n, e in manifest.files.items() if node_part(n, node_of) in (None, k)}
        meta = {**manifest.meta, "gpufleet_part": {"node": k, "nodes": nodes}}
        parts.append(
            Manifest(
                step=manifest.step, time=manifest.time, world_size=manifest.world_size, files=files, meta=meta
            )
        )
    return parts


def _files_key(m: Manifest) -> dict[str, tuple[int, str]]:
    return {n: (e.bytes, e.xxh3) for n, e in m.files.items()}


Inventory = dict[int, dict[int, dict[str, tuple[int, str]]]]  # part node -> step -> files


def plan_restore(
    disk: Manifest, node_of: tuple[int, ...], inventories: list[Inventory | None]
) -> list[tuple[int, int, int]] | str:
    """Transfers ``(part, from node, to node)`` that give every node the whole checkpoint ``disk``
    from the parts the nodes hold (``inventories`` by node index), or why memory cannot serve it."""
    nodes = len(inventories)
    want = [_files_key(p) for p in split_parts(disk, node_of, nodes)]
    holders: list[list[int]] = []
    for k in range(nodes):
        have = [h for h, inv in enumerate(inventories) if inv and inv.get(k, {}).get(disk.step) == want[k]]
        if not have:
            return f"no live node holds node {k}'s part of step {disk.step} in memory"
        holders.append(have)
    transfers = []
    for dst in range(nodes):
        for k in range(nodes):
            if dst not in holders[k]:
                transfers.append((k, k if k in holders[k] else holders[k][0], dst))
    return transfers


def _isend_chunk(t: torch.Tensor, dst: int, group: Any) -> Any:
    """One message of a part's bytes (the kill drills in tests wrap this and ``_recv_chunk``)."""
    return dist.isend(t, dst=dst, group=group)


def _recv_chunk(t: torch.Tensor, src: int, group: Any) -> None:
    dist.recv(t, src=src, group=group)


@dataclass(kw_only=True, slots=True)
class _Sent:
    works: list[Any] = field(default_factory=list)
    maps: list[mmap.mmap] = field(default_factory=list)

    def wait(self) -> None:
        try:
            for w in self.works:
                w.wait()
        finally:
            self.works.clear()
            for m in self.maps:
                m.close()
            self.maps.clear()


class PeerTier:
    """One rank's share of the peer-replicated memory tier; only node leaders hold and move bytes."""

    def __init__(
        self, root: Path, budget_bytes: int, topo: Topology, pg: Any, peer_pg: Any, sink: Any = None
    ) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.topo = topo
        self.pg = pg  # the engine's checkpoint group (every rank): agreement
        self.peer_pg = peer_pg  # the leaders' group: the bytes
        self._sink = sink if topo.leader else None
        self._warned = False

    @classmethod
    def setup(cls, root: Path, budget_bytes: int, rank: int, pg: Any, sink: Any = None) -> PeerTier | None:
        """Collective over ``pg`` and the default group (every rank, in the engine's constructor):
        None when every rank runs on one node (storage/memory.py alone serves it)."""
        reports: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(reports, (_node_from_env(rank), socket.gethostname()), group=pg)
        topo = Topology.from_reports(rank, [tuple(r) for r in reports])
        if topo.nodes < 2:
            return None
        peer_pg = dist.new_group(ranks=list(topo.leaders), backend="gloo", timeout=_TIMEOUT)
        return cls(root, budget_bytes, topo, pg, peer_pg, sink)

    # ------------------------------------------------------------------ layout and budget
    def part_dir(self, node: int) -> Path:
        return self.root / f"node_{node}"

    def used_bytes(self) -> int:
        return MemoryKeeper(self.root, 1).used_bytes()

    def inventory(self) -> Inventory:
        """The valid parts this node holds: part node -> step -> files."""
        inv: Inventory = {}
        for k in range(self.topo.nodes):
            for _, m in list_committed(self.part_dir(k)):
                inv.setdefault(k, {})[m.step] = _files_key(m)
        return inv

    def _sweep(self) -> None:
        """Torn copies and receipts (no valid manifest) and a leftover restore assembly."""
        shutil.rmtree(self.root / RESTORE_DIR, ignore_errors=True)
        for k in range(self.topo.nodes):
            MemoryKeeper(self.part_dir(k), 1).sweep()

    def _drop_step(self, step: int) -> None:
        for k in range(self.topo.nodes):
            p = self.part_dir(k) / step_dirname(step)
            (p / MANIFEST_NAME).unlink(missing_ok=True)  # invisible first, then gone
            shutil.rmtree(p, ignore_errors=True)

    def _make_room(self, need: int) -> list[int]:
        evicted: list[int] = []
        steps = sorted({s for parts in self.inventory().values() for s in parts})
        for s in steps:  # oldest first
            if self.used_bytes() + need <= self.budget_bytes:
                break
            self._drop_step(s)
            evicted.append(s)
        return evicted

    # ------------------------------------------------------------------ transport
    def _leader(self, node: int) -> int:
        return self.topo.leaders[node]

    def _send(self, src: Path, part: Manifest, to_node: int, sent: _Sent) -> None:
        """Queue every file of ``part`` under ``src`` to ``to_node``'s leader (memory-mapped, no copy)."""
        dst = self._leader(to_node)
        for name in sorted(part.files):
            size = part.files[name].bytes
            if size == 0:
                continue
            with open(src / name, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            sent.maps.append(mm)
            t = torch.frombuffer(mm, dtype=torch.uint8)
            if t.numel() != size:  # the sender's copy changed size: send what the receiver expects
                t = torch.zeros(size, dtype=torch.uint8) if t.numel() < size else t[:size]
            for off in range(0, size, _CHUNK):
                sent.works.append(_isend_chunk(t[off : off + _CHUNK], dst, self.peer_pg))

    def _receive(self, into: Path, part: Manifest, from_node: int) -> str | None:
        """Receive ``part``'s files into ``into``, hashing each on receipt; the first mismatch (or None).
        Every byte is received even after a mismatch, so sender and receiver stay in step."""
        src = self._leader(from_node)
        buf = torch.empty(
            min(_CHUNK, max((e.bytes for e in part.files.values()), default=0)) or 1, dtype=torch.uint8
        )
        problem: str | None = None
        for name in sorted(part.files):
            entry = part.files[name]
            h = xxhash.xxh3_64()
            tmp = into / f".{name}.recv"
            with open(tmp, "wb", buffering=0) as out:
                for off in range(0, entry.bytes, _CHUNK):
                    view = buf[: min(_CHUNK, entry.bytes - off)]
                    _recv_chunk(view, src, self.peer_pg)
                    data = view.numpy()
                    h.update(data)
                    mv = memoryview(data)
                    while mv:
                        mv = mv[out.write(mv) :]
            digest = xxh3_hex(h)
            if digest != entry.xxh3 and problem is None:
                problem = (
                    f"{name} received from {self.topo.name(from_node)} does not match the manifest "
                    f"(xxh3 {digest}; manifest: {entry.xxh3})"
                )
            os.replace(tmp, into / name)
        return problem

    # ------------------------------------------------------------------ save
    def keep(self, step: int, final: Path) -> None:
        """Leaders, after the disk commit of ``step`` at ``final``: own part + ring replica."""
        if not self.topo.leader:
            return
        try:
            self._keep(step, final)
        except Exception as e:  # noqa: BLE001 - the tier never fails training
            self._event(step, kept=False, nbytes=0, reason=f"peer tier failed: {failure_reason(e)}")

    def _keep(self, step: int, final: Path) -> None:
        topo = self.topo
        n, nodes = topo.node, topo.nodes
        succ, pred = (n + 1) % nodes, (n - 1) % nodes
        disk = read_manifest(final)
        parts = split_parts(disk, topo.node_of, nodes)
        own, rep = parts[n], parts[pred]
        own_need, rep_need = (p.total_bytes + manifest_bytes(p) for p in (own, rep))
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep()
        self._drop_step(step)  # a step saved again (after a rollback): the new one replaces it
        want_own = own_need <= self.budget_bytes
        want_rep = want_own and own_need + rep_need <= self.budget_bytes
        evicted = self._make_room(own_need * want_own + rep_need * want_rep)
        t0 = time.perf_counter()
        own_kept, why = False, None
        if want_own:
            r = MemoryKeeper(self.part_dir(n), 1 << 62).keep(final, own)  # room is made above
            own_kept, why = r.kept, r.reason
        else:
            why = (
                f"this node's part of {own_need} bytes is larger than the memory tier budget "
                f"({self.budget_bytes} bytes); disk and S3 still hold it"
            )
        flags: list[Any] = [None] * nodes
        dist.all_gather_object(flags, (own_kept, want_rep), group=self.peer_pg)
        sent = _Sent()
        try:
            if own_kept and flags[succ][1]:
                self._send(self.part_dir(n) / step_dirname(step), own, succ, sent)
            rep_ok, rep_why = False, None
            if want_rep and flags[pred][0]:
                rep_ok, rep_why = self._take_replica(step, rep, pred)
            elif not want_rep:
                rep_why = f"no room for {topo.name(pred)}'s replica ({rep_need} bytes more)"
            else:
                rep_why = f"{topo.name(pred)} kept no part of step {step}"
        finally:
            sent.wait()
        outcomes: list[Any] = [None] * nodes
        dist.all_gather_object(outcomes, (rep_ok, rep_why), group=self.peer_pg)
        replicated, peer_why = outcomes[succ]
        reason = (
            why if not own_kept else (None if replicated else f"no replica on {topo.name(succ)}: {peer_why}")
        )
        self._event(
            step,
            kept=own_kept,
            nbytes=own_need + (rep_need if rep_ok else 0),
            evicted=evicted,
            copy_s=round(time.perf_counter() - t0, 6) if own_kept else None,
            peer=topo.name(succ) if own_kept and replicated else None,
            reason=reason,
        )

    def _take_replica(self, step: int, part: Manifest, pred: int) -> tuple[bool, str | None]:
        d = self.part_dir(pred)
        d.mkdir(parents=True, exist_ok=True)
        tmp, dst = d / (step_dirname(step) + ".tmp"), d / step_dirname(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        problem = self._receive(tmp, part, pred)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return False, f"rejected: {problem}"
        os.rename(tmp, dst)
        write_manifest(dst, part)  # the commit point, as on disk
        return True, None

    def _event(
        self,
        step: int,
        *,
        kept: bool,
        nbytes: int,
        evicted: list[int] | None = None,
        copy_s: float | None = None,
        peer: str | None = None,
        reason: str | None = None,
    ) -> None:
        if self._sink is not None:
            self._sink.emit(
                E.CkptMemory(
                    step=step,
                    kept=kept,
                    bytes=nbytes,
                    used_bytes=self.used_bytes(),
                    budget_bytes=self.budget_bytes,
                    evicted=tuple(evicted or ()),
                    copy_s=copy_s,
                    node=self.topo.name(self.topo.node),
                    peer=peer,
                    reason=reason,
                )
            )
        if reason is not None and not self._warned and (not kept or peer is None):
            self._warned = True  # the ledger has every case; the console, the first
            what = "not kept in memory" if not kept else "kept in memory without a peer replica"
            print(f"gpufleet: warning: step {step} {what}: {reason}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ restore
    def restore(self, ctx: Any, max_step: int | None) -> tuple[int, str, str, dict[str, Any]] | None:
        """Every rank: (step, this node's assembled path, source, meta) from memory, or None (then
        restore tries local disk and S3). Rank 0 records the choice or each rejection."""
        topo = self.topo
        inv = self.inventory() if topo.leader else None
        invs: list[Any] = [None] * len(topo.node_of)
        dist.all_gather_object(invs, inv, group=self.pg)
        by_node = [invs[r] for r in topo.leaders]
        plan: list[Any] = [None]
        if topo.rank == 0:
            plan[0] = self._plan(ctx, by_node, max_step)
        dist.broadcast_object_list(plan, src=0, group=self.pg)
        if plan[0] is None:
            return None
        disk_json, transfers = plan[0]
        disk = Manifest.from_json(disk_json)
        t0 = time.perf_counter()
        problem = None
        if topo.leader:
            try:
                problem = self._assemble(disk, transfers)
            except Exception as e:  # noqa: BLE001 - a part gone or a peer lost mid-transfer: next tier
                problem = f"memory copy unusable: {failure_reason(e)}"
        verdicts: list[Any] = [None] * len(topo.node_of)
        dist.all_gather_object(verdicts, problem, group=self.pg)
        path = self.root / RESTORE_DIR / step_dirname(disk.step)
        bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if bad:
            for r, v in bad:
                ctx.emit(
                    E.RestoreRejected(path=f"{topo.name(topo.node_of[r])}:{path}", step=disk.step, reason=v)
                )
            self.forget()
            return None
        source = E.RestoreSource.PEER_MEMORY if transfers else E.RestoreSource.MEMORY
        ctx.emit(
            E.CkptVerified(
                step=disk.step, path=str(path), verify_s=round(time.perf_counter() - t0, 6), source=source
            )
        )
        return disk.step, str(path), str(source), disk.meta

    def _plan(self, ctx: Any, by_node: list[Inventory | None], max_step: int | None) -> Any:
        committed = [m for _, m in list_committed(ctx.root) if max_step is None or m.step <= max_step]
        if not committed:
            return None
        disk = committed[0]  # memory serves the newest disk commit or nothing: never an older step
        transfers = plan_restore(disk, self.topo.node_of, by_node)
        if isinstance(transfers, str):
            return None  # not in memory (a node and its replica holder lost, a skipped step): disk
        return disk.to_json(), transfers

    def _assemble(self, disk: Manifest, transfers: list[tuple[int, int, int]]) -> str | None:
        """Leaders: the whole checkpoint in ``restore/step_N`` (hard links + received parts), verified."""
        topo = self.topo
        me = topo.node
        out = self.root / RESTORE_DIR / step_dirname(disk.step)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        parts = split_parts(disk, topo.node_of, topo.nodes)
        incoming = {k for k, _, dst in transfers if dst == me}
        problem: str | None = None
        for k in range(topo.nodes):
            if k in incoming:
                continue
            src = self.part_dir(k) / step_dirname(disk.step)
            for name, entry in parts[k].files.items():
                if (out / name).exists():
                    continue
                try:
                    os.link(src / name, out / name)
                except OSError:
                    shutil.copyfile(src / name, out / name)
                if problem is None:  # verified before use, with the disk manifest's checksums
                    size, digest = hash_file(out / name)
                    if (size, digest) != (entry.bytes, entry.xxh3):
                        problem = (
                            f"checksum mismatch in {src / name} ({size} bytes, xxh3 {digest}; "
                            f"manifest: {entry.bytes} bytes, xxh3 {entry.xxh3})"
                        )
        sent = _Sent()
        try:
            for k, frm, dst in transfers:  # the same order on every leader: no cycle of waits
                if frm == me:
                    self._send(self.part_dir(k) / step_dirname(disk.step), parts[k], dst, sent)
                    sent.wait()
                elif dst == me:
                    got = self._receive(out, parts[k], frm)
                    problem = problem or got
        finally:
            sent.wait()
        write_manifest(out, disk)
        return problem

    def forget(self) -> None:
        """Leaders: drop the restore assembly (after the load collective; the parts stay)."""
        if self.topo.leader:
            shutil.rmtree(self.root / RESTORE_DIR, ignore_errors=True)
