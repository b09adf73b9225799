"""The Global Store on etcd: `EtcdStore` (MetadataStore) and `EtcdCoordination`, the same
contracts as the sqlite backend (tests/test_store_contract.py runs one suite against both).

Several Global Store processes may serve one etcd cluster at once: they keep no state of their
own, and every decision is an optimistic transaction (`EtcdKV.optimistic`): read the records it
depends on, decide in Python, commit only if none of them changed meanwhile, else read again.
Shard leases and their fencing tokens are compare-and-swap on the lease record's revision, so two
stores can never grant one token twice. Deadlines (heartbeat TTLs, artifact leases, shard
leases) are times stored in the records and checked against `now`, like the sqlite backend's,
rather than etcd leases: expiring one record must update others (a content's reference count,
its replicas), which only the sweep can do anyway.

Keys under the prefix (JSON values):
    meta/num_shards            the shard count, fixed at first start
    w/{worker}                 a worker: registration, load, last heartbeat
    c/{content}                a content: size, tensors, created_at, refs (artifacts naming it)
    unref/{content}            a content no artifact names (yet): collected after the grace
    r/{content}/{worker}/{tier}  a replica: created_at, pinned
    rw/{worker}/{content}/{tier} the same replica, found by worker
    d/{worker}/{content}       a content the worker held whose last artifact went (told to it
                               at its next heartbeat: a delta inventory does not list it)
    f/{content}                a file reference: host, spec
    a/{artifact}               an artifact: content, owner, created_at, expires_at, parent,
                               size_bytes, num_tensors; `batch` while its batch is staged
    batch/{id}                 a batch of artifacts being staged: pending, committed, aborted
    bm/{id}/{artifact}         the artifacts a batch staged (to finalize or roll back)
    exp/{expires_at}/{artifact}  leased artifacts by expiry
    s/{shard}                  a shard lease: holder, token, expires_at
    i/{instance}               an instance: worker, engine, load, endpoint, heartbeat
    p/{idempotency key}        a plan record
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Mapping

from tensorcast.config import DEFAULT_BATCH_TIMEOUT_S, fault_injection
from tensorcast.errors import (
    AlreadyExists,
    FencingError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from tensorcast.store.base import (
    DEAD_WORKER_RETENTION_S,
    DEFAULT_NUM_SHARDS,
    MAX_PLANS_LISTED,
    PLAN_RETENTION_S,
    RECONCILE_GRACE_S,
    SHARD_HOME_ROLE,
    BeatResult,
    ContentInfo,
    Inventory,
    NewArtifact,
    NewReplica,
    OpResult,
    PutResult,
    ReplicaKey,
    StoreOp,
    WorkerRegistration,
    check_batch,
    check_lease_ttl,
    check_num_shards,
    check_owner,
    check_same_layout,
    check_same_owner,
    every_page,
    fixed_num_shards,
    member,
    page_limit,
    plan_resent,
    run_each,
    validate_art_id,
)
from tensorcast.store.etcd_kv import MAX_TXN_OPS, Conflict, EtcdKV, Item
from tensorcast.types import (
    OWNER_LEASE,
    ArtifactInfo,
    InstanceInfo,
    PlanRecord,
    ReplicaInfo,
    ShardLease,
    ShardTable,
    TensorMeta,
    WorkerInfo,
    check_tensor_name,
)


def _exp_key(expires_at: float, art_id: str) -> str:
    return f"exp/{expires_at:020.6f}/{art_id}"


PLAN_FULL_SWEEP_S = 3600.0
# The sweep compacts etcd's history this often, keeping the last revisions (minutes of a
# cluster's heartbeats; transactions compare current revisions only, never older ones).
COMPACT_EVERY_S = 60.0
COMPACT_KEEP_REVISIONS = 10_000
# etcd refuses requests over 1.5 MiB (--max-request-bytes): a plan's recorded result larger
# than this keeps its steps' outcomes but not their results.
MAX_PLAN_RESULT_BYTES = 512 * 1024


def _recordable(result: dict) -> dict:
    """`result`, or without its steps' results when too large to record (a rerun then runs
    those steps again instead of reusing them; a replay shows `step_results_dropped`)."""
    if len(json.dumps(result, separators=(",", ":"))) <= MAX_PLAN_RESULT_BYTES:
        return result
    steps = [{k: v for k, v in s.items() if k != "result"} for s in result.get("steps", [])]
    return dict(result, steps=steps, step_results_dropped=True)


def _done_key(finished_at: float, plan_key: str) -> str:
    """A finished plan's entry in the retention index (keys sort by finish time), so a sweep
    reads only the records past their retention, not every plan record every time."""
    return f"pdone/{finished_at:020.6f}/{plan_key}"


def _replica_keys(content_id: str, worker_id: str, tier: str) -> tuple[str, str]:
    return f"r/{content_id}/{worker_id}/{tier}", f"rw/{worker_id}/{content_id}/{tier}"


def _replicas_of(rows: dict[str, Item], live: set[str]) -> tuple[ReplicaInfo, ...]:
    """Replicas on live workers from the records under `r/{content}/`, oldest first."""
    found = []
    for key, r in rows.items():
        _, _, worker_id, tier = key.split("/")
        if worker_id in live:
            found.append((r.value["created_at"], ReplicaInfo(worker_id, tier, r.value["pinned"])))
    return tuple(r for _, r in sorted(found, key=lambda x: x[0]))


# Upper bounds of what one member adds to a transaction (comparisons + operations): a replica
# (its two rows, its content's record and unref marker, a comparison on the content), an
# artifact (its record, expiry and batch-member keys, a comparison; its content as above).
# etcd refuses requests over --max-request-bytes (1.5 MiB by default; `tc up --ha` starts its
# members with 32 MiB, for contents of many tensors: a layout is one record).
MAX_TXN_BYTES = 1 << 20
REPLICA_COST = 5
ARTIFACT_COST = 4
CONTENT_COST = 3


def _layout_bytes(replica: NewReplica) -> int:
    """About what a content's records weigh in a transaction (its layout is stored twice)."""
    return 2 * sum(96 + len(t.name) + len(t.hash_hex) + 8 * len(t.shape) for t in replica.tensors)


def _plan_chunks(
    replicas: list[NewReplica], artifacts: list[tuple[int, NewArtifact]]
) -> list[tuple[list[NewReplica], list[tuple[int, NewArtifact]]]]:
    """Split a batch into transactions of at most MAX_TXN_OPS and about MAX_TXN_BYTES of
    layouts (a content bigger than that goes alone): each replica goes with the first
    artifact naming its content (so a content is named in the transaction that records it)."""
    pending = {r.content_id: r for r in replicas}
    chunks: list[tuple[list[NewReplica], list[tuple[int, NewArtifact]]]] = []
    reps: list[NewReplica] = []
    arts: list[tuple[int, NewArtifact]] = []
    contents: set[str] = set()
    cost = 2  # the worker's existence check, the batch's pending check
    size = 0

    def add(rep: NewReplica | None, art: tuple[int, NewArtifact] | None) -> None:
        nonlocal reps, arts, contents, cost, size
        content_id = rep.content_id if rep is not None else art[1].content_id  # type: ignore[index]
        extra = (REPLICA_COST if rep else 0) + (ARTIFACT_COST if art else 0)
        extra += 0 if content_id in contents else CONTENT_COST
        extra_bytes = _layout_bytes(rep) if rep is not None else 0
        if (cost + extra > MAX_TXN_OPS or size + extra_bytes > MAX_TXN_BYTES) and (reps or arts):
            chunks.append((reps, arts))
            reps, arts, contents, cost, size = [], [], set(), 2, 0
            extra = (REPLICA_COST if rep else 0) + (ARTIFACT_COST if art else 0) + CONTENT_COST
        cost += extra
        size += extra_bytes
        contents.add(content_id)
        if rep is not None:
            reps.append(rep)
        if art is not None:
            arts.append(art)

    for art in artifacts:
        add(pending.pop(art[1].content_id, None), art)
    for rep in pending.values():
        add(rep, None)
    if reps or arts or not chunks:
        chunks.append((reps, arts))
    return chunks


class EtcdStore:
    def __init__(
        self,
        kv: EtcdKV,
        heartbeat_ttl_s: float,
        unreferenced_grace_s: float,
        batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S,
    ) -> None:
        self.kv = kv
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.unreferenced_grace_s = unreferenced_grace_s
        self.batch_timeout_s = batch_timeout_s
        self.faults = fault_injection()
        self.schema_version = 0  # records are JSON: no schema to migrate
        self._next_compaction = 0.0  # the first sweep compacts

    def describe(self) -> str:
        return self.kv.describe()

    def members(self) -> list[tuple[str, bool, str]]:
        return self.kv.member_health()

    def close(self) -> None:
        pass

    # -- workers --------------------------------------------------------------------------------

    def register_worker(self, reg: WorkerRegistration, now: float) -> None:
        """A name belongs to one live worker at a time (AlreadyExists for a second)."""
        for wid, w in self.kv.range("w/").items():
            if (
                w.value["name"] == reg.name
                and wid[2:] != reg.worker_id
                and w.value["last_heartbeat"] >= now - self.heartbeat_ttl_s
            ):
                raise AlreadyExists(
                    f"a worker named {reg.name!r} ({w.value['addr']}, pid {w.value['pid']}) "
                    f"heartbeated {now - w.value['last_heartbeat']:.1f}s ago: stop it first "
                    "(tc worker stop), choose another --name, or, if it died, start again "
                    f"after {self.heartbeat_ttl_s:.0f}s"
                )
        record = {
            "name": reg.name,
            "addr": reg.addr,
            "host_id": reg.host_id,
            "local_socket": reg.local_socket,
            "roles": list(reg.roles),
            "mem_cap_bytes": reg.mem_cap_bytes,
            "mem_used_bytes": 0,
            "pid": reg.pid,
            "registered_at": now,
            "last_heartbeat": now,
            "data_addr": reg.data_addr,
            "active_transfers": 0,
            "transfer_bytes_total": 0,
            "disk_used_bytes": 0,
            "inventory_epoch": 0,
        }
        self.kv.txn([], [self.kv.put(f"w/{reg.worker_id}", record)])

    def deregister_worker(self, worker_id: str) -> None:
        self._drop_worker_replicas(worker_id)
        self.kv.apply([self.kv.delete(f"w/{worker_id}")])

    def heartbeat(
        self,
        worker_id: str,
        mem_used_bytes: int,
        inventory: Inventory,
        now: float,
        active_transfers: int = 0,
        transfer_bytes_total: int = 0,
        disk_used_bytes: int = 0,
    ) -> BeatResult:
        key = f"w/{worker_id}"
        item = self.kv.get(key)
        if item is None:
            raise NotFound(f"worker {worker_id} is not registered")
        base = item.value.get("inventory_epoch", 0)
        resync = not inventory.is_full and inventory.base_epoch != base
        drop: list[str] = []
        kept: frozenset[ReplicaKey] = frozenset()
        notes: list[str] = []
        if not resync:
            drop, kept, notes = self._reconcile(worker_id, inventory, now)

        def beat() -> bool:
            item = self.kv.get(key)
            if item is None:
                raise NotFound(f"worker {worker_id} is not registered")
            # A sweep that took this worker's rows meanwhile reset its epoch: it stays reset.
            # So does an epoch another beat of this worker (a retried one) moved meanwhile.
            epoch = item.value.get("inventory_epoch", 0)
            advanced = not resync and epoch == base
            if advanced:
                epoch = inventory.epoch
            record = dict(
                item.value,
                last_heartbeat=now,
                mem_used_bytes=mem_used_bytes,
                active_transfers=active_transfers,
                transfer_bytes_total=transfer_bytes_total,
                disk_used_bytes=disk_used_bytes,
                inventory_epoch=epoch,
            )
            self.kv.txn([self.kv.unchanged(key, item)], [self.kv.put(key, record)])
            return advanced

        advanced = self.kv.optimistic(beat)
        # The drop notes go once the beat is recorded: if recording fails they are sent again.
        self.kv.apply([self.kv.delete(k) for k in notes])
        # A delta applied while the epoch moved under it may have landed out of order with
        # another beat's: the worker sends everything next (a full inventory is never refused).
        resync = resync or (not advanced and not inventory.is_full)
        return BeatResult(drop, resync=resync, kept=kept)

    def _reconcile(
        self, worker_id: str, inventory: Inventory, now: float
    ) -> tuple[list[str], frozenset[ReplicaKey], list[str]]:
        """Write the replica rows `inventory` changes (a full one's differences from the rows,
        or a delta's changes); returns the contents the worker should drop, the removals kept
        for now and the drop notes read (to delete once the beat is recorded)."""
        held = inventory.held
        if inventory.is_full:
            rows = self.kv.range(f"rw/{worker_id}/")
            recorded = {tuple(k.split("/")[2:4]): row for k, row in rows.items()}
            removed = [k for k in recorded if k not in held]
            changed = {
                k: p
                for k, p in held.items()
                if k not in recorded or recorded[k].value["pinned"] != p
            }
        else:
            removed = [k for k in inventory.removed if k not in held]
            changed = dict(held)
            got, _ = self.kv.read_many([f"rw/{worker_id}/{c}/{t}" for c, t in [*changed, *removed]])
            recorded = {tuple(k.split("/")[2:4]): row for k, row in got.items() if row is not None}
        # A full inventory checks every held content: a replica row added while the content's
        # last artifact went (etcd has no one writer to order them) is found and removed here.
        contents = sorted({c for c, _ in (held if inventory.is_full else changed)})
        got, _ = self.kv.read_many([f"c/{c}" for c in contents])
        known = {c for c in contents if got[f"c/{c}"] is not None}
        ops = []
        for (content_id, tier), pinned in changed.items():
            if content_id in known:
                row = recorded.get((content_id, tier))
                value = {"created_at": row.value["created_at"] if row else now, "pinned": pinned}
                ops += [self.kv.put(k, value) for k in _replica_keys(content_id, worker_id, tier)]
        for content_id, tier in held:
            if content_id not in known and (content_id, tier) in recorded:
                ops += [self.kv.delete(k) for k in _replica_keys(content_id, worker_id, tier)]
        # A row younger than the grace may postdate the inventory (an explicit AddReplica
        # racing the beat): it stays, and the worker reports it removed again.
        kept = set()
        for content_id, tier in removed:
            row = recorded.get((content_id, tier))
            if row is not None and row.value["created_at"] >= now - RECONCILE_GRACE_S:
                kept.add((content_id, tier))
            elif row is not None:
                ops += [self.kv.delete(k) for k in _replica_keys(content_id, worker_id, tier)]
        # Contents this worker held whose last artifact went since its last beat (a full
        # inventory's unknown contents include them already).
        notes = self.kv.range(f"d/{worker_id}/", keys_only=True)
        gone = [k.split("/", 2)[2] for k in notes if not inventory.is_full]
        got, _ = self.kv.read_many([f"c/{c}" for c in gone])
        self.kv.apply(ops)
        drop = (set(contents) - known) | {c for c in gone if got[f"c/{c}"] is None}
        return sorted(drop), frozenset(kept), list(notes)

    def list_workers(self, now: float) -> list[WorkerInfo]:
        workers = self.kv.range("w/")
        infos = [
            self._worker(wid[2:], w.value, now, self.kv.count(f"rw/{wid[2:]}/"))
            for wid, w in workers.items()
        ]
        return sorted(infos, key=lambda w: (w.name, w.worker_id))

    def _worker(self, worker_id: str, r: dict, now: float, num_replicas: int = 0) -> WorkerInfo:
        age = max(0.0, now - r["last_heartbeat"])
        return WorkerInfo(
            worker_id=worker_id,
            name=r["name"],
            addr=r["addr"],
            host_id=r["host_id"],
            local_socket=r["local_socket"],
            roles=tuple(r["roles"]),
            mem_cap_bytes=r["mem_cap_bytes"],
            mem_used_bytes=r["mem_used_bytes"],
            pid=r["pid"],
            registered_at=r["registered_at"],
            heartbeat_age_s=age,
            alive=age <= self.heartbeat_ttl_s,
            data_addr=r["data_addr"],
            active_transfers=r["active_transfers"],
            transfer_bytes_total=r["transfer_bytes_total"],
            disk_used_bytes=r["disk_used_bytes"],
            num_replicas=num_replicas,
        )

    def _live_workers(self, now: float) -> set[str]:
        return {
            wid[2:]
            for wid, w in self.kv.range("w/").items()
            if w.value["last_heartbeat"] >= now - self.heartbeat_ttl_s
        }

    # -- contents and replicas ------------------------------------------------------------------

    def add_replica(
        self,
        worker_id: str,
        content_id: str,
        size_bytes: int,
        tensors: tuple[TensorMeta, ...],
        now: float,
        tier: str = "cpu",
        reference: str = "",
    ) -> None:
        if tier not in ("cpu", "file"):
            raise InvalidArgument(f"unknown replica tier {tier!r}")
        for t in tensors:
            check_tensor_name(t.name)
        layout = [t.to_json() for t in tensors]

        def add() -> None:
            worker = self.kv.get(f"w/{worker_id}")
            if worker is None:
                raise NotFound(f"worker {worker_id} is not registered")
            content = self.kv.get(f"c/{content_id}")
            compares = [self.kv.unchanged(f"w/{worker_id}", worker)]
            ops = []
            if content is None:
                record = {"size_bytes": size_bytes, "tensors": layout, "created_at": now, "refs": 0}
                compares.append(self.kv.unchanged(f"c/{content_id}", None))
                ops += [
                    self.kv.put(f"c/{content_id}", record),
                    self.kv.put(f"unref/{content_id}", 1),
                ]
            elif all(t.hash_hex for t in tensors):
                stored = [TensorMeta.from_json(t) for t in content.value["tensors"]]
                if not all(t.hash_hex for t in stored):
                    check_same_layout(content_id, stored, tensors)
                    compares.append(self.kv.unchanged(f"c/{content_id}", content))
                    ops.append(self.kv.put(f"c/{content_id}", dict(content.value, tensors=layout)))
                elif {t.name: t.hash_hex for t in stored} != {t.name: t.hash_hex for t in tensors}:
                    raise IntegrityError(
                        f"content {content_id}: this replica's bytes differ from the recorded "
                        "ones; not registered"
                    )
            keys = _replica_keys(content_id, worker_id, tier)
            if self.kv.get(keys[0]) is None:
                ops += [self.kv.put(k, {"created_at": now, "pinned": False}) for k in keys]
            if tier == "file" and reference:
                host = worker.value["host_id"]
                spec = {"host_id": host, "spec": reference, "created_at": now}
                ops.append(self.kv.put(f"f/{content_id}", spec))
            self.kv.txn(compares, ops)

        self.kv.optimistic(add)

    def list_references(self, host_id: str) -> list[tuple[str, str]]:
        refs = [
            (key[2:], f.value)
            for key, f in self.kv.range("f/").items()
            if f.value["host_id"] == host_id and self.kv.get(f"c/{key[2:]}") is not None
        ]
        return [(c, f["spec"]) for c, f in sorted(refs, key=lambda r: r[1]["created_at"])]

    def remove_replica(
        self,
        worker_id: str,
        content_id: str,
        tier: str = "",
        unless_last: bool = False,
        now: float = 0.0,
    ) -> bool:
        def remove() -> bool:
            ops = []
            for key in self.kv.range(f"rw/{worker_id}/{content_id}/", keys_only=True):
                row_tier = key.rsplit("/", 1)[1]
                if tier in ("", row_tier):
                    ops += [
                        self.kv.delete(k) for k in _replica_keys(content_id, worker_id, row_tier)
                    ]
            if not unless_last:
                self.kv.apply(ops)
                return True
            # Another live holder, and its replica row and worker record unchanged when ours
            # goes: a concurrent removal of the other copy conflicts, and is decided again.
            live = self._live_workers(now)
            for key, row in self.kv.range(f"r/{content_id}/").items():
                other = key.split("/")[2]
                if other != worker_id and other in live:
                    worker = self.kv.get(f"w/{other}")
                    compares = [
                        self.kv.unchanged(key, row),
                        self.kv.unchanged(f"w/{other}", worker),
                    ]
                    self.kv.txn(compares, ops)
                    return True
            return False

        return self.kv.optimistic(remove)

    def find_content(self, content_id: str, now: float) -> ContentInfo | None:
        content = self.kv.get(f"c/{content_id}")
        if content is None:
            return None
        tensors = tuple(TensorMeta.from_json(t) for t in content.value["tensors"])
        replicas = self._live_replicas(content_id, self._live_workers(now))
        return ContentInfo(content_id, content.value["size_bytes"], tensors, replicas)

    def _live_replicas(self, content_id: str, live: set[str]) -> tuple[ReplicaInfo, ...]:
        rows = []
        for key, r in self.kv.range(f"r/{content_id}/").items():
            _, _, worker_id, tier = key.split("/")
            if worker_id in live:
                rows.append(
                    (r.value["created_at"], ReplicaInfo(worker_id, tier, r.value["pinned"]))
                )
        return tuple(r for _, r in sorted(rows, key=lambda x: x[0]))

    # -- artifacts ------------------------------------------------------------------------------
    #
    # A batch that fits one etcd transaction (at most MAX_TXN_OPS comparisons and operations,
    # e.g. a single put) is one optimistic transaction. A larger one is staged: a record
    # `batch/{id}` (pending, with a deadline) first, then the replicas and artifacts in
    # transactions of at most MAX_TXN_OPS, each artifact record carrying `"batch": id` and a
    # member key `bm/{id}/{artifact}`; then ONE transaction flips the batch record to committed
    # (compared on its revision, so a rollback and a commit cannot both happen). Readers show a
    # record carrying a batch id only once that batch is committed, so the whole batch appears
    # at that one transaction. Afterwards the records lose their batch id and the batch record
    # goes (`_finalize`). A store that dies before the flip leaves a pending batch nobody sees;
    # any store's sweep rolls it back after its deadline (and finalizes committed ones).

    def create_artifact(
        self, art_id: str, content_id: str, owner: str, ttl_s: float, parent: str, now: float
    ) -> tuple[ArtifactInfo, bool]:
        validate_art_id(art_id)
        check_owner(owner, ttl_s)
        result = self.put_artifacts(
            "", [], [NewArtifact(art_id, content_id, owner, ttl_s, parent)], now
        )
        return result.artifacts[0]

    def put_artifacts(
        self,
        worker_id: str,
        replicas: list[NewReplica],
        artifacts: list[NewArtifact],
        now: float,
    ) -> PutResult:
        by_content = check_batch(replicas, artifacts)
        chunks = _plan_chunks(list(by_content.values()), list(enumerate(artifacts)))
        live = self._live_workers(now)
        existed: dict[int, bool] = {}
        redundant: list[str] = []
        written: dict[str, dict] = {}
        contents: dict[str, dict] = {}

        def stage(reps: list[NewReplica], arts: list[tuple[int, NewArtifact]], bid: str) -> None:
            e, red, w, c = self.kv.optimistic(
                lambda: self._stage(worker_id, reps, arts, now, bid, live, len(artifacts))
            )
            existed.update(e)
            redundant.extend(red)
            written.update(w)
            contents.update(c)

        if len(chunks) == 1:
            stage(*chunks[0], "")
        else:
            bid = self._stage_batch(chunks, stage, len(artifacts), now)
            self._finalize(bid)
        infos = self._infos_after(artifacts, written, contents, now, live)
        result = tuple((infos[a.art_id], existed[i]) for i, a in enumerate(artifacts))
        return PutResult(result, tuple(redundant))

    def _stage_batch(self, chunks: list, stage: Callable, size: int, now: float) -> str:
        """Stage `chunks` under a new pending batch, then commit it (one transaction). Rolls
        back on any failure; returns the batch id."""
        bid = uuid.uuid4().hex
        started = time.monotonic()
        key = f"batch/{bid}"
        record = {"state": "pending", "created_at": now, "deadline": now + self.batch_timeout_s}
        self.kv.txn([self.kv.unchanged(key, None)], [self.kv.put(key, record)])
        try:
            for k, (reps, arts) in enumerate(chunks):
                if time.monotonic() - started > self.batch_timeout_s:
                    raise Unavailable(
                        f"a batch of {size} artifacts took over {self.batch_timeout_s:.0f}s "
                        "to stage; nothing was created (TC_BATCH_TIMEOUT_S)"
                    )
                stage(reps, arts, bid)
                if k == len(chunks) // 2 and 0 < self.faults.store_exit_in_batch <= size:
                    os._exit(70)  # test hook: die mid-batch, as kill -9 would
            item = self.kv.get(key)
            if item is None or item.value["state"] != "pending":
                raise Unavailable("the batch was rolled back meanwhile; nothing was created")
            self.kv.txn(
                [self.kv.unchanged(key, item)],
                [self.kv.put(key, dict(item.value, state="committed"))],
            )
        except Conflict:
            self._roll_back(bid)
            raise Unavailable("the batch was rolled back meanwhile; nothing was created") from None
        except BaseException:
            self._roll_back(bid)
            raise
        if 0 < self.faults.store_exit_after_commit <= size:
            os._exit(70)  # test hook: die after the commit point, before finalizing
        return bid

    def _stage(
        self,
        worker_id: str,
        reps: list[NewReplica],
        arts: list[tuple[int, NewArtifact]],
        now: float,
        bid: str,
        live: set[str],
        size: int,
    ) -> tuple[dict[int, bool], list[str], dict[str, dict], dict[str, dict]]:
        """One optimistic transaction: record `reps` on `worker_id` and create `arts` (staged
        under batch `bid` when given) of a batch of `size`. Returns existed per member index,
        redundant contents, the artifact records written and the content records involved."""
        content_ids = list(
            dict.fromkeys([r.content_id for r in reps] + [a.content_id for _, a in arts])
        )
        keys = [f"w/{worker_id}"] if reps else []
        keys += [f"c/{c}" for c in content_ids] + [f"a/{a.art_id}" for _, a in arts]
        if bid:
            keys.append(f"batch/{bid}")
        got, rows = self.kv.read_many(keys, [f"r/{r.content_id}/" for r in reps])
        compares: list[dict] = []
        ops: list[dict] = []
        if bid:
            # Staged only while the batch is pending: a rollback lists the batch's members
            # after flipping it to aborted, so a chunk landing later would be missed by it.
            batch = got[f"batch/{bid}"]
            if batch is None or batch.value["state"] != "pending":
                raise Unavailable("the batch was rolled back meanwhile; nothing was created")
            compares.append(self.kv.unchanged(f"batch/{bid}", batch))
        if reps:
            if got[f"w/{worker_id}"] is None:
                raise NotFound(f"worker {worker_id} is not registered")
            compares.append(self.kv.exists(f"w/{worker_id}"))
        before = {c: got[f"c/{c}"] for c in content_ids}
        records = {c: (dict(i.value) if i is not None else None) for c, i in before.items()}
        changed: set[str] = set()
        redundant: list[str] = []
        for r in reps:
            layout = [t.to_json() for t in r.tensors]
            record = records[r.content_id]
            if record is None:
                records[r.content_id] = {
                    "size_bytes": r.size_bytes,
                    "tensors": layout,
                    "created_at": now,
                    "refs": 0,
                }
                changed.add(r.content_id)
            elif all(t.hash_hex for t in r.tensors):
                stored = [TensorMeta.from_json(t) for t in record["tensors"]]
                if not all(t.hash_hex for t in stored):
                    check_same_layout(r.content_id, stored, r.tensors)
                    record["tensors"] = layout
                    changed.add(r.content_id)
                elif {t.name: t.hash_hex for t in stored} != {
                    t.name: t.hash_hex for t in r.tensors
                }:
                    raise IntegrityError(
                        f"content {r.content_id}: this replica's bytes differ from the recorded "
                        "ones; not registered"
                    )
            holders = {k.split("/")[2] for k in rows[f"r/{r.content_id}/"]}
            if worker_id not in holders and holders & (live - {worker_id}):
                redundant.append(r.content_id)  # stored once: the worker frees its copy
            elif worker_id not in holders:
                value = {"created_at": now, "pinned": False}
                ops += [
                    self.kv.put(k, value) for k in _replica_keys(r.content_id, worker_id, "cpu")
                ]
        existed: dict[int, bool] = {}
        written: dict[str, dict] = {}
        named: set[str] = set()
        for i, a in arts:
            if a.art_id in written:
                existed[i] = True  # named twice in the batch (with the same content)
                continue
            item = got[f"a/{a.art_id}"]
            if item is not None:
                value = item.value
                other = value.get("batch")
                if other and other != bid and self._batch_state(other, now) != "committed":
                    raise Conflict()  # another batch is staging this id: wait for its outcome
                if value["expires_at"] is not None and value["expires_at"] <= now:
                    self._expire_one(a.art_id, now)
                    raise Conflict()
                if value["content_id"] != a.content_id:
                    raise AlreadyExists(
                        f"{member(i, a.art_id, size)} already exists with different content "
                        "(artifacts are immutable): choose a new id, e.g. a version suffix @v2"
                    )
                check_same_owner(member(i, a.art_id, size), value["owner"], a.owner)
                existed[i] = True
                if a.owner == OWNER_LEASE and value["expires_at"] < now + a.ttl_s:
                    # Registered again: the lease runs at least ttl_s.
                    renewed = dict(value, expires_at=now + a.ttl_s)
                    compares.append(self.kv.unchanged(f"a/{a.art_id}", item))
                    ops += [
                        self.kv.put(f"a/{a.art_id}", renewed),
                        self.kv.delete(_exp_key(value["expires_at"], a.art_id)),
                        self.kv.put(_exp_key(renewed["expires_at"], a.art_id), 1),
                    ]
                    written[a.art_id] = renewed
                continue
            content = records.get(a.content_id)
            if content is None:
                raise NotFound(
                    f"{member(i, a.art_id, size)}: content {a.content_id} is not held by any worker"
                )
            expires_at = now + a.ttl_s if a.owner == OWNER_LEASE else None
            record = {
                "content_id": a.content_id,
                "owner": a.owner,
                "created_at": now,
                "expires_at": expires_at,
                "parent": a.parent,
                "size_bytes": content["size_bytes"],
                "num_tensors": len(content["tensors"]),
            }
            if bid:
                record["batch"] = bid
                ops.append(self.kv.put(f"bm/{bid}/{a.art_id}", 1))
            compares.append(self.kv.unchanged(f"a/{a.art_id}", None))
            ops.append(self.kv.put(f"a/{a.art_id}", record))
            if expires_at is not None:
                ops.append(self.kv.put(_exp_key(expires_at, a.art_id), 1))
            content["refs"] += 1
            changed.add(a.content_id)
            named.add(a.content_id)
            written[a.art_id] = record
            existed[i] = False
        for c in changed:
            record = records[c]
            assert record is not None
            compares.append(self.kv.unchanged(f"c/{c}", before[c]))
            ops.append(self.kv.put(f"c/{c}", record))
            if c in named:
                ops.append(self.kv.delete(f"unref/{c}"))
            elif before[c] is None:
                ops.append(self.kv.put(f"unref/{c}", 1))
        if ops:
            self.kv.txn(compares, ops)
        return existed, redundant, written, {c: r for c, r in records.items() if r is not None}

    def _batch_state(self, bid: str, now: float) -> str:
        """committed, pending, aborted, or gone (finalized or rolled back). A pending batch
        past its deadline is rolled back here (its stager died or gave up)."""
        item = self.kv.get(f"batch/{bid}")
        if item is None:
            return "gone"
        state = item.value["state"]
        if state == "pending" and item.value["deadline"] < now:
            self._roll_back(bid)
            return "gone"
        return state

    def _roll_back(self, bid: str) -> None:
        """Undo a batch that did not commit: mark it aborted (so it can never commit), delete
        its staged artifacts (content counts back down; contents named by nothing are
        collected after the grace), then its records. Idempotent; a sweep finishes it."""
        key = f"batch/{bid}"

        def abort() -> bool:
            item = self.kv.get(key)
            if item is None or item.value["state"] == "committed":
                return False
            if item.value["state"] == "pending":
                self.kv.txn(
                    [self.kv.unchanged(key, item)],
                    [self.kv.put(key, dict(item.value, state="aborted"))],
                )
            return True

        if not self.kv.optimistic(abort):
            return
        members = [k.split("/", 2)[2] for k in self.kv.range(f"bm/{bid}/", keys_only=True)]
        for start in range(0, len(members), 12):
            part = members[start : start + 12]

            def unstage(part: list[str] = part) -> None:
                self._unstage(bid, part)

            self.kv.optimistic(unstage)
        self.kv.apply([self.kv.delete(key)])

    def _unstage(self, bid: str, art_ids: list[str]) -> None:
        got, _ = self.kv.read_many([f"a/{a}" for a in art_ids])
        ours: dict[str, Item] = {}
        for art_id in art_ids:
            item = got[f"a/{art_id}"]
            if item is not None and item.value.get("batch") == bid:
                ours[art_id] = item
        content_ids = list(dict.fromkeys(i.value["content_id"] for i in ours.values()))
        contents, _ = self.kv.read_many([f"c/{c}" for c in content_ids])
        compares, ops = [], [self.kv.delete(f"bm/{bid}/{a}") for a in art_ids]
        refs: dict[str, int] = {}
        for art_id, item in ours.items():
            compares.append(self.kv.unchanged(f"a/{art_id}", item))
            ops.append(self.kv.delete(f"a/{art_id}"))
            if item.value["expires_at"] is not None:
                ops.append(self.kv.delete(_exp_key(item.value["expires_at"], art_id)))
            c = item.value["content_id"]
            refs[c] = refs.get(c, 0) + 1
        for c, n in refs.items():
            content = contents[f"c/{c}"]
            if content is None:
                continue
            compares.append(self.kv.unchanged(f"c/{c}", content))
            left = content.value["refs"] - n
            ops.append(self.kv.put(f"c/{c}", dict(content.value, refs=max(0, left))))
            if left <= 0:
                ops.append(self.kv.put(f"unref/{c}", 1))
        self.kv.txn(compares, ops)

    def _finalize(self, bid: str) -> None:
        """A committed batch's records lose their batch id, then the batch record goes."""
        members = [k.split("/", 2)[2] for k in self.kv.range(f"bm/{bid}/", keys_only=True)]
        for start in range(0, len(members), 30):
            part = members[start : start + 30]

            def settle(part: list[str] = part) -> None:
                got, _ = self.kv.read_many([f"a/{a}" for a in part])
                compares, ops = [], [self.kv.delete(f"bm/{bid}/{a}") for a in part]
                for art_id in part:
                    item = got[f"a/{art_id}"]
                    if item is not None and item.value.get("batch") == bid:
                        value = {k: v for k, v in item.value.items() if k != "batch"}
                        compares.append(self.kv.unchanged(f"a/{art_id}", item))
                        ops.append(self.kv.put(f"a/{art_id}", value))
                self.kv.txn(compares, ops)

            self.kv.optimistic(settle)
        self.kv.apply([self.kv.delete(f"batch/{bid}")])

    def _visible(self, items: Mapping[str, Item | None], now: float) -> dict[str, dict]:
        """The records readers may see: live (not expired) and not part of a batch that has
        not committed. Records of a batch settled since they were read are read again."""
        states: dict[str, str] = {}
        visible: dict[str, dict] = {}
        again: list[str] = []
        for art_id, item in items.items():
            if item is None:
                continue
            value = item.value
            bid = value.get("batch")
            if bid:
                if bid not in states:
                    states[bid] = self._batch_state(bid, now)
                if states[bid] == "gone":
                    again.append(art_id)
                    continue
                if states[bid] != "committed":
                    continue
            if value["expires_at"] is None or value["expires_at"] > now:
                visible[art_id] = value
        if again:
            got, _ = self.kv.read_many([f"a/{a}" for a in again])
            for art_id in again:
                item = got[f"a/{art_id}"]
                if (
                    item is not None
                    and not item.value.get("batch")
                    and (item.value["expires_at"] is None or item.value["expires_at"] > now)
                ):
                    visible[art_id] = item.value
        return visible

    def _infos(
        self, records: dict[str, dict], now: float, with_tensors: bool, live: set[str] | None = None
    ) -> dict[str, ArtifactInfo]:
        """ArtifactInfo of visible records, reading contents and replicas in few requests."""
        content_ids = list(dict.fromkeys(v["content_id"] for v in records.values()))
        need = [
            c
            for c in content_ids
            if with_tensors
            or any("size_bytes" not in v for v in records.values() if v["content_id"] == c)
        ]
        got, rows = self.kv.read_many([f"c/{c}" for c in need], [f"r/{c}/" for c in content_ids])
        live = self._live_workers(now) if live is None else live
        infos = {}
        for art_id, a in records.items():
            c = a["content_id"]
            content = got.get(f"c/{c}")
            if c in need and content is None:
                continue  # dropped meanwhile
            replicas = _replicas_of(rows[f"r/{c}/"], live)
            infos[art_id] = self._info(art_id, a, content.value if content else None, replicas)
        return infos

    @staticmethod
    def _info(
        art_id: str, a: dict, content: dict | None, replicas: tuple[ReplicaInfo, ...]
    ) -> ArtifactInfo:
        tensors = tuple(TensorMeta.from_json(t) for t in content["tensors"]) if content else ()
        return ArtifactInfo(
            art_id=art_id,
            content_id=a["content_id"],
            owner=a["owner"],
            size_bytes=content["size_bytes"] if content else a["size_bytes"],
            tensors=tensors,
            created_at=a["created_at"],
            expires_at=a["expires_at"],
            parent=a["parent"] or "",
            replicas=replicas,
            num_tensors=len(tensors) if content else a["num_tensors"],
        )

    def _infos_after(
        self,
        artifacts: list[NewArtifact],
        written: dict[str, dict],
        contents: dict[str, dict],
        now: float,
        live: set[str],
    ) -> dict[str, ArtifactInfo]:
        """A batch's members: those it created from what was written, the others (they
        existed) as stored now; in few requests."""
        content_ids = list(dict.fromkeys(a["content_id"] for a in written.values()))
        _, rows = self.kv.read_many([], [f"r/{c}/" for c in content_ids])
        infos = {
            art_id: self._info(
                art_id,
                a,
                contents[a["content_id"]],
                _replicas_of(rows[f"r/{a['content_id']}/"], live),
            )
            for art_id, a in written.items()
        }
        others = list(dict.fromkeys(a.art_id for a in artifacts if a.art_id not in written))
        if others:
            got, _ = self.kv.read_many([f"a/{a}" for a in others])
            visible = self._visible({a: got[f"a/{a}"] for a in others}, now)
            infos.update(self._infos(visible, now, True, live))
        for art_id in others:
            if art_id not in infos:  # deleted since: as readers see it now
                infos[art_id] = self.get_artifact(art_id, now)
        return infos

    def get_artifact(self, art_id: str, now: float) -> ArtifactInfo:
        visible = self._visible({art_id: self.kv.get(f"a/{art_id}")}, now)
        info = self._infos(visible, now, with_tensors=True).get(art_id)
        if info is None:
            raise NotFound(f"no artifact {art_id!r} (see `tc ls`)")
        return info

    def list_artifacts(self, prefix: str, now: float) -> list[ArtifactInfo]:
        return every_page(self, prefix, now)

    def list_artifact_page(
        self,
        prefix: str,
        after: str,
        limit: int,
        now: float,
        with_tensors: bool = False,
        delimiter: str = "",
    ) -> tuple[list[ArtifactInfo], str]:
        limit = page_limit(limit)
        start = f"a/{after}\x00" if after >= prefix else f"a/{prefix}"
        records: dict[str, dict] = {}
        while len(records) <= limit:  # one more than the page: is there a next one?
            items, more = self.kv.range_page(f"a/{prefix}", start, limit + 1 - len(records))
            wanted = {
                k[2:]: i
                for k, i in items.items()
                if not delimiter or delimiter not in k[2 + len(prefix) :]
            }
            records.update(self._visible(wanted, now))
            if not more or not items:
                break
            start = max(items) + "\x00"
        ids = sorted(records)
        infos = self._infos({a: records[a] for a in ids[:limit]}, now, with_tensors)
        page = [infos[a] for a in ids[:limit] if a in infos]
        return page, (ids[limit - 1] if len(ids) > limit else "")

    def held_contents(self, content_ids: list[str], now: float, touch: bool = False) -> set[str]:
        live = self._live_workers(now)
        _, rows = self.kv.read_many([], [f"r/{c}/" for c in content_ids])
        held = {c for c in content_ids if _replicas_of(rows[f"r/{c}/"], live)}
        found = sorted(held) if touch else []
        for start in range(0, len(found), MAX_TXN_OPS // 2):

            def renew(part: list[str] = found[start : start + MAX_TXN_OPS // 2]) -> None:
                got, _ = self.kv.read_many([f"c/{c}" for c in part])
                compares, ops = [], []
                for key, item in got.items():
                    if item is not None and item.value["created_at"] < now:
                        compares.append(self.kv.unchanged(key, item))
                        ops.append(self.kv.put(key, dict(item.value, created_at=now)))
                if ops:
                    self.kv.txn(compares, ops)

            self.kv.optimistic(renew)
        return held

    def run_batch(self, ops: list[StoreOp], now: float) -> list[OpResult]:
        return run_each(self, ops, now)  # each its own transaction(s): etcd batches fsyncs

    def delete_artifact(self, art_id: str, now: float) -> None:
        if not self._remove_artifact(art_id, now, lambda a: True):
            raise NotFound(f"no artifact {art_id!r} (see `tc ls`)")

    def delete_artifacts(self, art_ids: list[str], now: float, missing_ok: bool = False) -> int:
        """All checked first (nothing deleted if one is missing and not `missing_ok`), then
        deleted in order, one transaction each: a store dying meanwhile leaves the first ones
        deleted, and deleting the batch again finishes it (with `missing_ok`)."""
        if not missing_ok:
            got, _ = self.kv.read_many([f"a/{a}" for a in art_ids])
            visible = self._visible({a: got[f"a/{a}"] for a in art_ids}, now)
            for i, art_id in enumerate(art_ids):
                if art_id not in visible:
                    who = member(i, art_id, len(art_ids)) + ": " if len(art_ids) > 1 else ""
                    raise NotFound(f"{who}no artifact {art_id!r} (see `tc ls`)")
        return sum(self._remove_artifact(a, now, lambda a: True) for a in art_ids)

    def _remove_artifact(self, art_id: str, now: float, should) -> bool:
        """Remove `art_id` if readers see it and `should(record)`; drop its content with the
        last artifact naming it. Returns whether it was removed."""

        def remove() -> bool:
            item = self.kv.get(f"a/{art_id}")
            if item is None or not should(item.value):
                return False
            bid = item.value.get("batch")
            if bid and self._batch_state(bid, now) != "committed":
                return False  # staged by a batch that has not committed: nobody sees it
            content_id = item.value["content_id"]
            content = self.kv.get(f"c/{content_id}")
            compares = [self.kv.unchanged(f"a/{art_id}", item)]
            ops = [self.kv.delete(f"a/{art_id}")]
            if item.value["expires_at"] is not None:
                ops.append(self.kv.delete(_exp_key(item.value["expires_at"], art_id)))
            if content is not None:
                compares.append(self.kv.unchanged(f"c/{content_id}", content))
                refs = content.value["refs"] - 1
                if refs > 0:
                    ops.append(self.kv.put(f"c/{content_id}", dict(content.value, refs=refs)))
                else:
                    ops += [self.kv.delete(f"c/{content_id}"), self.kv.delete(f"f/{content_id}")]
            self.kv.txn(compares, ops)
            if content is not None and refs <= 0:
                self._drop_replicas(content_id)
            return True

        return self.kv.optimistic(remove)

    def _drop_replicas(self, content_id: str) -> None:
        """A dropped content's replica rows (a replica added meanwhile is swept later), noted
        for their workers' next heartbeats; only while the content is still gone: a put of
        the same bytes may have made it again since (another store process), and the rows,
        its new replica's among them, are then that content's."""
        ops = []
        for key in self.kv.range(f"r/{content_id}/", keys_only=True):
            _, _, worker_id, tier = key.split("/")
            ops += [self.kv.delete(k) for k in _replica_keys(content_id, worker_id, tier)]
            ops.append(self.kv.put(f"d/{worker_id}/{content_id}", 1))
        gone = self.kv.unchanged(f"c/{content_id}", None)
        for start in range(0, len(ops), MAX_TXN_OPS - 1):
            try:
                self.kv.txn([gone], ops[start : start + MAX_TXN_OPS - 1])
            except Conflict:
                return

    def _expire_one(self, art_id: str, now: float) -> None:
        self._remove_artifact(
            art_id, now, lambda a: a["expires_at"] is not None and a["expires_at"] <= now
        )

    def renew_lease(self, art_id: str, ttl_s: float, now: float) -> ArtifactInfo:
        check_lease_ttl(ttl_s)
        self._expire_one(art_id, now)

        def renew() -> None:
            item = self.kv.get(f"a/{art_id}")
            if item is None or not self._visible({art_id: item}, now):
                raise NotFound(f"no artifact {art_id!r}: its lease may have expired")
            if item.value["owner"] != OWNER_LEASE:
                raise InvalidArgument(f"artifact {art_id!r} is system-owned and has no lease")
            old, new = item.value["expires_at"], now + ttl_s
            ops = [
                self.kv.put(f"a/{art_id}", dict(item.value, expires_at=new)),
                self.kv.delete(_exp_key(old, art_id)),
                self.kv.put(_exp_key(new, art_id), 1),
            ]
            self.kv.txn([self.kv.unchanged(f"a/{art_id}", item)], ops)

        self.kv.optimistic(renew)
        return self.get_artifact(art_id, now)

    # -- expiry and garbage collection ----------------------------------------------------------

    def sweep(self, now: float, judge_workers: bool = True) -> None:
        if now >= self._next_compaction:
            self._next_compaction = now + COMPACT_EVERY_S
            self.kv.compact(COMPACT_KEEP_REVISIONS)
        for key, item in self.kv.range("batch/").items():
            bid = key.split("/", 1)[1]
            if item.value["state"] == "committed":
                self._finalize(bid)  # its store died after the commit point
            elif item.value["state"] == "aborted" or item.value["deadline"] < now:
                self._roll_back(bid)  # its store died or gave up while staging
        for key in self.kv.range("exp/", keys_only=True):
            _, when, art_id = key.split("/", 2)
            if float(when) > now:
                break  # keys sort by expiry
            self._expire_one(art_id, now)
        workers = self.kv.range("w/") if judge_workers else {}
        for wid, w in workers.items():
            worker_id = wid[2:]
            beat = w.value["last_heartbeat"]
            if beat < now - self.heartbeat_ttl_s:
                self._drop_worker_replicas(worker_id)
            if beat < now - DEAD_WORKER_RETENTION_S:
                self.kv.apply([self.kv.delete(wid)])
                _drop_instances(self.kv, worker_id)  # they died with it, or moved on
        for key in self.kv.range("unref/", keys_only=True):
            self._collect_unreferenced(key[len("unref/") :], now)

    def _drop_worker_replicas(self, worker_id: str) -> None:
        """A dead or leaving worker's rows and notes. Its epoch goes back to 0: back from the
        dead, it must report everything again."""
        ops = []
        for key in self.kv.range(f"rw/{worker_id}/", keys_only=True):
            _, _, content_id, tier = key.split("/")
            ops += [self.kv.delete(k) for k in _replica_keys(content_id, worker_id, tier)]
        ops += [self.kv.delete(k) for k in self.kv.range(f"d/{worker_id}/", keys_only=True)]
        self.kv.apply(ops)

        def reset() -> None:
            key = f"w/{worker_id}"
            item = self.kv.get(key)
            if item is not None and item.value.get("inventory_epoch"):
                record = dict(item.value, inventory_epoch=0)
                self.kv.txn([self.kv.unchanged(key, item)], [self.kv.put(key, record)])

        self.kv.optimistic(reset)

    def _collect_unreferenced(self, content_id: str, now: float) -> None:
        def collect() -> bool:
            content = self.kv.get(f"c/{content_id}")
            if content is None:
                self.kv.apply([self.kv.delete(f"unref/{content_id}")])
                return False
            if content.value["refs"] > 0:
                return False
            if content.value["created_at"] >= now - self.unreferenced_grace_s:
                return False
            ops = [
                self.kv.delete(f"c/{content_id}"),
                self.kv.delete(f"f/{content_id}"),
                self.kv.delete(f"unref/{content_id}"),
            ]
            self.kv.txn([self.kv.unchanged(f"c/{content_id}", content)], ops)
            return True

        if self.kv.optimistic(collect):
            self._drop_replicas(content_id)

    def artifacts_by_owner(self, now: float) -> dict[str, int]:
        owners: dict[str, int] = {}
        records = {key[2:]: item for key, item in self.kv.range("a/").items()}
        for value in self._visible(records, now).values():
            owners[value["owner"]] = owners.get(value["owner"], 0) + 1
        return owners

    def counts(self) -> tuple[int, int]:
        staged = sum(
            self.kv.count(f"bm/{key.split('/', 1)[1]}/")
            for key, item in self.kv.range("batch/").items()
            if item.value["state"] != "committed"
        )
        return self.kv.count("a/") - staged, self.kv.count("c/")


class EtcdCoordination:
    def __init__(self, store: EtcdStore, num_shards: int | None) -> None:
        self.store = store
        self.kv = store.kv
        self.num_shards = self._settle_num_shards(num_shards)
        self._full_plan_sweep_at = 0.0  # monotonic; see sweep

    def _settle_num_shards(self, requested: int | None) -> int:
        check_num_shards(requested)

        def settle() -> int:
            item = self.kv.get("meta/num_shards")
            if item is not None:
                return fixed_num_shards(int(item.value), requested)
            count = requested or DEFAULT_NUM_SHARDS
            self.kv.txn(
                [self.kv.unchanged("meta/num_shards", None)],
                [self.kv.put("meta/num_shards", count)],
            )
            return count

        return self.kv.optimistic(settle)

    # -- shard leases ---------------------------------------------------------------------------

    def shard_table(self, now: float) -> ShardTable:
        workers = {k[2:]: w.value for k, w in self.kv.range("w/").items()}
        leases = {int(k[2:]): s.value for k, s in self.kv.range("s/").items()}
        table = []
        for shard in range(self.num_shards):
            s = leases.get(shard, {"holder": "", "token": 0, "expires_at": 0.0})
            w = workers.get(s["holder"], {})
            table.append(
                ShardLease(
                    shard,
                    s["holder"],
                    s["token"],
                    s["expires_at"] - now,
                    w.get("addr", ""),
                    w.get("local_socket", ""),
                    w.get("host_id", ""),
                )
            )
        ttl = self.store.heartbeat_ttl_s
        homes = tuple(
            sorted(
                wid
                for wid, w in workers.items()
                if w["last_heartbeat"] >= now - ttl and SHARD_HOME_ROLE in w["roles"]
            )
        )
        return ShardTable(self.num_shards, ttl, tuple(table), homes)

    def _shard_key(self, shard: int) -> str:
        if not 0 <= shard < self.num_shards:
            raise InvalidArgument(f"no shard {shard}: the cluster has {self.num_shards}")
        return f"s/{shard:05d}"

    def acquire_shards(self, worker_id: str, shards: list[int], now: float) -> ShardTable:
        """Grant each free or expired shard to `worker_id` (renew those it holds already)."""
        worker = self.kv.get(f"w/{worker_id}")
        if worker is None:
            raise NotFound(f"worker {worker_id} is not registered")
        if SHARD_HOME_ROLE not in worker.value["roles"]:
            raise InvalidArgument(f"worker {worker_id} does not have the shard-home role")
        expires_at = now + self.store.heartbeat_ttl_s
        for shard in shards:
            key = self._shard_key(shard)

            def acquire(key: str = key) -> None:
                lease = self.kv.get(key)
                if lease is None:
                    record = {"holder": worker_id, "token": 1, "expires_at": expires_at}
                elif lease.value["holder"] == worker_id and lease.value["expires_at"] > now:
                    record = dict(lease.value, expires_at=expires_at)
                elif lease.value["expires_at"] <= now:  # free, or lapsed
                    token = lease.value["token"] + 1
                    record = {"holder": worker_id, "token": token, "expires_at": expires_at}
                else:
                    return
                self.kv.txn([self.kv.unchanged(key, lease)], [self.kv.put(key, record)])

            self.kv.optimistic(acquire)
        return self.shard_table(now)

    def hand_off_shard(
        self, worker_id: str, shard: int, token: int, to_worker_id: str, now: float
    ) -> ShardTable:
        key = self._shard_key(shard)
        ttl = self.store.heartbeat_ttl_s

        def hand_off() -> None:
            lease = self.kv.get(key)
            if lease is not None and (lease.value["holder"], lease.value["token"]) == (
                to_worker_id,
                token + 1,
            ):
                return  # this very hand-off, re-sent (its reply was lost)
            if (
                lease is None
                or lease.value["holder"] != worker_id
                or lease.value["token"] != token
                or lease.value["expires_at"] <= now
            ):
                raise FencingError(
                    f"worker {worker_id} does not hold shard {shard} under token {token}"
                )
            target = self.kv.get(f"w/{to_worker_id}")
            if (
                target is None
                or target.value["last_heartbeat"] < now - ttl
                or SHARD_HOME_ROLE not in target.value["roles"]
            ):
                raise InvalidArgument(
                    f"worker {to_worker_id} is not a live shard-home worker: no hand-off"
                )
            record = {"holder": to_worker_id, "token": token + 1, "expires_at": now + ttl}
            self.kv.txn([self.kv.unchanged(key, lease)], [self.kv.put(key, record)])

        self.kv.optimistic(hand_off)
        return self.shard_table(now)

    def renew_shards(self, worker_id: str, held: list[tuple[int, int]], now: float) -> None:
        """Heartbeat renewal: only leases still held by `worker_id` under the same token."""
        for shard, token in held:
            if not 0 <= shard < self.num_shards:
                continue
            key = self._shard_key(shard)

            def renew(key: str = key, token: int = token) -> None:
                lease = self.kv.get(key)
                if (
                    lease is None
                    or lease.value["holder"] != worker_id
                    or lease.value["token"] != token
                    or lease.value["expires_at"] <= now
                ):
                    return
                record = dict(lease.value, expires_at=now + self.store.heartbeat_ttl_s)
                self.kv.txn([self.kv.unchanged(key, lease)], [self.kv.put(key, record)])

            self.kv.optimistic(renew)

    def release_shards(self, worker_id: str) -> None:
        """A worker leaving cleanly frees its shards at once (the token stays for fencing)."""
        for key, lease in self.kv.range("s/").items():
            if lease.value["holder"] != worker_id:
                continue

            def release(key: str = key) -> None:
                current = self.kv.get(key)
                if current is None or current.value["holder"] != worker_id:
                    return
                record = dict(current.value, expires_at=0.0)
                self.kv.txn([self.kv.unchanged(key, current)], [self.kv.put(key, record)])

            self.kv.optimistic(release)
        _drop_instances(self.kv, worker_id)

    # -- instances ------------------------------------------------------------------------------

    def report_instances(self, worker_id: str, instances: list[InstanceInfo], now: float) -> None:
        current = self.kv.range("i/")
        ops = []
        for inst in instances:
            old = current.get(f"i/{inst.instance_id}")
            record = {
                "worker_id": worker_id,
                "engine": inst.engine,
                "registered_at": old.value["registered_at"] if old else now,
                "last_heartbeat": now,
                "endpoint": inst.endpoint,
                "load": {
                    "waiting": inst.waiting,
                    "running": inst.running,
                    "cached_tokens": inst.cached_tokens,
                    "requests": list(inst.requests),
                },
            }
            ops.append(self.kv.put(f"i/{inst.instance_id}", record))
        reported = {f"i/{i.instance_id}" for i in instances}
        ops += [
            self.kv.delete(k)
            for k, i in current.items()
            if i.value["worker_id"] == worker_id and k not in reported
        ]
        self.kv.apply(ops)

    def list_instances(self, now: float) -> list[InstanceInfo]:
        workers = {k[2:]: w.value for k, w in self.kv.range("w/").items()}
        ttl = self.store.heartbeat_ttl_s
        result = []
        for key, item in sorted(self.kv.range("i/").items()):
            i = item.value
            w = workers.get(i["worker_id"])
            load = i["load"]
            age = max(0.0, now - i["last_heartbeat"])
            result.append(
                InstanceInfo(
                    instance_id=key[2:],
                    worker_id=i["worker_id"],
                    engine=i["engine"],
                    endpoint=i["endpoint"],
                    waiting=load.get("waiting", 0),
                    running=load.get("running", 0),
                    cached_tokens=load.get("cached_tokens", 0),
                    requests=tuple(load.get("requests", ())),
                    heartbeat_age_s=age,
                    alive=age <= ttl and w is not None and now - w["last_heartbeat"] <= ttl,
                    worker_name=w["name"] if w else "",
                )
            )
        return result

    # -- plan results ---------------------------------------------------------------------------

    def begin_plan(self, record: PlanRecord, now: float) -> tuple[bool, PlanRecord | None]:
        """Claim `record.idempotency_key` (see SqliteCoordination.begin_plan)."""
        key = f"p/{record.idempotency_key}"

        def begin() -> tuple[bool, PlanRecord | None]:
            item = self.kv.get(key)
            previous = _plan(record.idempotency_key, item.value) if item else None
            if plan_resent(previous, record):
                return True, None
            if previous is not None and (
                previous.status == "ok"
                or (previous.status == "running" and previous.deadline_at > now)
            ):
                return False, previous
            value = {
                "trace_id": record.trace_id,
                "status": "running",
                "result": record.result,
                "created_at": now,
                "finished_at": 0.0,
                "deadline_at": record.deadline_at,
                "run_id": record.run_id,
            }
            self.kv.txn([self.kv.unchanged(key, item)], [self.kv.put(key, value)])
            return True, previous

        return self.kv.optimistic(begin)

    def finish_plan(self, record: PlanRecord, now: float) -> None:
        if record.status not in ("ok", "failed"):
            raise InvalidArgument(f"a finished plan is ok or failed, not {record.status!r}")
        key = f"p/{record.idempotency_key}"

        def finish() -> None:
            item = self.kv.get(key)
            if item is None or item.value["trace_id"] != record.trace_id:
                raise NotFound(
                    f"plan {record.idempotency_key!r} (trace {record.trace_id}) is not running"
                )
            result = _recordable(record.result)
            value = dict(item.value, status=record.status, result=result, finished_at=now)
            ops = [self.kv.put(key, value), self.kv.put(_done_key(now, record.idempotency_key), 1)]
            if item.value["finished_at"] not in (0.0, now):  # finished before: a re-send
                ops.append(self.kv.delete(_done_key(item.value["finished_at"], key[2:])))
            self.kv.txn([self.kv.unchanged(key, item)], ops)

        self.kv.optimistic(finish)

    def get_plan(self, key: str) -> PlanRecord:
        item = self.kv.get(f"p/{key}")
        if item is None:
            raise NotFound(f"no plan recorded under {key!r}")
        return _plan(key, item.value)

    def list_plans(self, limit: int) -> list[PlanRecord]:
        limit = max(1, min(limit or 50, MAX_PLANS_LISTED))
        plans = [_plan(k[2:], p.value) for k, p in self.kv.range("p/").items()]
        return sorted(plans, key=lambda p: p.created_at, reverse=True)[:limit]

    def sweep(self, now: float) -> None:
        """Drop finished plans past their retention: those the index names as due, reading
        nothing else; and, at most hourly, every record (plans finished before the index)."""
        cutoff = now - PLAN_RETENTION_S
        for key in self.kv.range("pdone/", keys_only=True):
            _, when, plan_key = key.split("/", 2)
            if float(when) >= cutoff:
                break  # keys sort by finish time
            self._drop_plan(plan_key, cutoff, [self.kv.delete(key)])
        if time.monotonic() >= self._full_plan_sweep_at:
            self._full_plan_sweep_at = time.monotonic() + PLAN_FULL_SWEEP_S
            for key, item in self.kv.range("p/").items():
                if item.value["status"] != "running" and item.value["finished_at"] < cutoff:
                    self._drop_plan(key[2:], cutoff, [])

    def _drop_plan(self, plan_key: str, cutoff: float, ops: list[dict]) -> None:
        def drop() -> None:
            item = self.kv.get(f"p/{plan_key}")
            p = item.value if item is not None else None
            if p is not None and p["status"] != "running" and p["finished_at"] < cutoff:
                self.kv.txn(
                    [self.kv.unchanged(f"p/{plan_key}", item)],
                    [*ops, self.kv.delete(f"p/{plan_key}")],
                )
            elif ops:  # claimed again since (or gone): only its old index entry goes
                self.kv.apply(ops)

        self.kv.optimistic(drop)


def _drop_instances(kv: EtcdKV, worker_id: str) -> None:
    kv.apply([kv.delete(k) for k, i in kv.range("i/").items() if i.value["worker_id"] == worker_id])


def _plan(key: str, p: dict) -> PlanRecord:
    return PlanRecord(
        key,
        p["trace_id"],
        p["status"],
        p["result"] or {},
        p["created_at"],
        p["finished_at"] or 0.0,
        p["deadline_at"] or 0.0,
        p.get("run_id", ""),
    )
