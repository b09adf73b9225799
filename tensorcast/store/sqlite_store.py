"""`SqliteStore`: the default Global Store backend, one sqlite file in WAL mode.

Every write commits with `synchronous=FULL`, so a record acknowledged to a caller survives a crash
of the store process (and of the machine). Writes share one connection under one lock and commit
in groups (`write`): callers that arrive while a commit is in progress queue up, and the next of
them to take the lock runs every queued write in one transaction, each in its own savepoint (a
failing one changes nothing and fails alone), so one fsync serves them all and throughput grows
with the number of callers. Reads use a connection per thread and never wait for writers; each
sees only committed transactions, so no listing shows part of a batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from tensorcast.config import DEFAULT_UNREFERENCED_GRACE_S, fault_injection
from tensorcast.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    NotFound,
    TensorcastError,
    Unavailable,
)
from tensorcast.store.base import (
    DEAD_WORKER_RETENTION_S,
    RECONCILE_GRACE_S,
    BeatResult,
    ContentInfo,
    GetOp,
    Inventory,
    NewArtifact,
    NewReplica,
    OpResult,
    PutOp,
    PutResult,
    ReplicaKey,
    StoreOp,
    WorkerRegistration,
    check_batch,
    check_lease_ttl,
    check_owner,
    check_same_layout,
    check_same_owner,
    every_page,
    member,
    page_limit,
    validate_art_id,
)
from tensorcast.store.schema import migrate
from tensorcast.types import (
    OWNER_LEASE,
    ArtifactInfo,
    ReplicaInfo,
    TensorMeta,
    WorkerInfo,
    check_tensor_name,
)

T = TypeVar("T")

MAX_GROUP = 256  # writes committed together at most
IN_CHUNK = 500  # ids per `IN (...)` query
MAX_IDLE_READERS = 8  # read connections kept open between reads


class _Write:
    """One queued write: run `fn` in the group's transaction, hand back its result or error."""

    __slots__ = ("done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


def prefix_bounds(prefix: str) -> tuple[str, str | None]:
    """[low, high) of the ids starting with `prefix` in sqlite's (code point) order; high None
    when there is no simple bound."""
    if not prefix:
        return "", None
    last = ord(prefix[-1]) + 1
    if last > 0x10FFFF or 0xD800 <= last <= 0xDFFF:
        return prefix, None
    return prefix, prefix[:-1] + chr(last)


class SqliteStore:
    def __init__(
        self,
        path: str | Path,
        heartbeat_ttl_s: float,
        unreferenced_grace_s: float = DEFAULT_UNREFERENCED_GRACE_S,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=10.0)
        self.db = sqlite_utils.Database(conn)
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.schema_version = migrate(self.db)
        except sqlite3.DatabaseError as e:
            conn.close()
            raise InvalidArgument(
                f"{self.path} is not a Global Store database, or it is damaged ({e}): "
                "name another --db, or restore this one from a backup"
            ) from None
        # From here on transactions are explicit (`transaction`, `write`): BEGIN ... COMMIT.
        conn.isolation_level = None
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.unreferenced_grace_s = unreferenced_grace_s  # a commit's time to be named
        self._lock = threading.Lock()  # the write connection
        self._queue_lock = threading.Lock()
        self._queue: list[_Write] = []
        self._idle_readers: list[sqlite3.Connection] = []  # guarded by _queue_lock
        self._closed = False
        self.faults = fault_injection()
        self._exit_after_commit = False
        # Commits and the writes they carried (group commit at work: writes / commits > 1).
        self.commits = 0
        self.writes = 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.db.conn.close()
            with self._queue_lock:
                for conn in self._idle_readers:
                    conn.close()
                self._idle_readers.clear()

    # -- transactions ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction of its own on the write connection (rare writes: registration,
        sweeps, shard leases)."""
        with self._lock:
            self._begin()
            try:
                yield
            except BaseException as e:
                self.db.execute("ROLLBACK")
                if isinstance(e, sqlite3.DatabaseError):
                    raise self._typed(e) from None
                raise
            self._commit(1)

    def write(self, fn: Callable[[], T]) -> T:
        """Run `fn` (statements on `self.db`) in a transaction, committed together with the
        writes other threads queued meanwhile (group commit). Durable when this returns; a
        failing `fn` changes nothing and fails alone."""
        op = _Write(fn)
        self._write_all([op])
        if op.error is not None:
            raise op.error
        return op.value

    def _write_all(self, ops: list[_Write]) -> None:
        """Queue `ops` together and wait until each is done (run by whoever leads)."""
        with self._queue_lock:
            self._queue.extend(ops)
        for op in ops:
            while not op.done:
                with self._lock:
                    if op.done:
                        break
                    with self._queue_lock:
                        group = self._queue[:MAX_GROUP]
                        del self._queue[:MAX_GROUP]
                    self._run_group(group)

    def _begin(self) -> None:
        if self._closed:
            raise Unavailable("the Global Store is shutting down")
        self.db.execute("BEGIN IMMEDIATE")

    def _commit(self, writes: int) -> None:
        self.db.execute("COMMIT")
        self.commits += 1
        self.writes += writes

    def _run_group(self, group: list[_Write]) -> None:
        try:
            self._begin()
            for op in group:
                self.db.execute("SAVEPOINT w")
                try:
                    op.value = op.fn()
                except BaseException as e:  # this write fails alone
                    self.db.execute("ROLLBACK TO w")
                    op.error = e
                self.db.execute("RELEASE w")
            self._commit(len(group))
            if self._exit_after_commit:
                os._exit(70)  # test hook (store_exit_after_commit): committed, never answered
        except BaseException as e:
            if self.db.conn.in_transaction:
                self.db.execute("ROLLBACK")
            failed = (
                e
                if isinstance(e, TensorcastError)
                else self._typed(e)
                if isinstance(e, sqlite3.DatabaseError)
                else Unavailable(f"store write failed: {e}")
            )
            for op in group:
                if op.error is None:
                    op.value, op.error = None, failed
        finally:
            for op in group:
                op.done = True

    def _typed(self, e: sqlite3.DatabaseError) -> TensorcastError:
        """sqlite's errors as the store's: a busy or unopenable file is Unavailable (retry),
        a damaged one IntegrityError (no retry helps)."""
        if isinstance(e, sqlite3.OperationalError):
            return Unavailable(f"the store's database {self.path}: {e}")
        return IntegrityError(
            f"the store's database {self.path} is damaged ({e}): stop the store and restore "
            "the file from a backup (sqlite3 .recover may save what is left)"
        )

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction on a pooled read connection (WAL: reads see committed data and
        never wait): every query inside sees the same committed state. At most
        MAX_IDLE_READERS stay open between reads (one per serving thread leaked two file
        descriptors per client connection, until the store could open no more)."""
        with self._queue_lock:
            if self._closed:
                raise Unavailable("the Global Store is shutting down")
            conn = self._idle_readers.pop() if self._idle_readers else None
        if conn is None:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=10.0)
            conn.isolation_level = None
        try:
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            raise self._typed(e) from None
        finally:
            with self._queue_lock:
                keep = not self._closed and len(self._idle_readers) < MAX_IDLE_READERS
                if keep:
                    self._idle_readers.append(conn)
            if not keep:
                conn.close()

    # -- workers -------------------------------------------------------------------------------

    def register_worker(self, reg: WorkerRegistration, now: float) -> None:
        """Record a worker. A name belongs to one live worker at a time: a second process under
        the name of a worker that still heartbeats is refused (AlreadyExists)."""
        with self.transaction():
            twin = self.db.execute(
                "SELECT addr, pid, last_heartbeat FROM workers WHERE name = ? AND worker_id != ? "
                "AND last_heartbeat >= ?",
                [reg.name, reg.worker_id, now - self.heartbeat_ttl_s],
            ).fetchone()
            if twin is not None:
                raise AlreadyExists(
                    f"a worker named {reg.name!r} ({twin[0]}, pid {twin[1]}) heartbeated "
                    f"{now - twin[2]:.1f}s ago: stop it first (tc worker stop), choose another "
                    f"--name, or, if it died, start again after {self.heartbeat_ttl_s:.0f}s"
                )
            self.db.execute(
                "INSERT OR REPLACE INTO workers (worker_id, name, addr, host_id, local_socket, "
                "roles, mem_cap_bytes, mem_used_bytes, pid, registered_at, last_heartbeat, "
                "data_addr, active_transfers, transfer_bytes_total, disk_used_bytes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, 0, 0, 0)",
                [
                    reg.worker_id,
                    reg.name,
                    reg.addr,
                    reg.host_id,
                    reg.local_socket,
                    json.dumps(list(reg.roles)),
                    reg.mem_cap_bytes,
                    reg.pid,
                    now,
                    now,
                    reg.data_addr,
                ],
            )

    def deregister_worker(self, worker_id: str) -> None:
        with self.transaction():
            self.db.execute("DELETE FROM replicas WHERE worker_id = ?", [worker_id])
            self.db.execute("DELETE FROM replica_drops WHERE worker_id = ?", [worker_id])
            self.db.execute("DELETE FROM workers WHERE worker_id = ?", [worker_id])

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
        def beat() -> BeatResult:
            row = self.db.execute(
                "SELECT inventory_epoch FROM workers WHERE worker_id = ?", [worker_id]
            ).fetchone()
            if row is None:
                raise NotFound(f"worker {worker_id} is not registered")
            resync = not inventory.is_full and inventory.base_epoch != row[0]
            self.db.execute(
                "UPDATE workers SET last_heartbeat = ?, mem_used_bytes = ?, active_transfers = ?, "
                "transfer_bytes_total = ?, disk_used_bytes = ?, inventory_epoch = ? "
                "WHERE worker_id = ?",
                [
                    now,
                    mem_used_bytes,
                    active_transfers,
                    transfer_bytes_total,
                    disk_used_bytes,
                    row[0] if resync else inventory.epoch,
                    worker_id,
                ],
            )
            if resync:
                return BeatResult([], resync=True)
            unknown, kept = self._reconcile(worker_id, inventory, now)
            # Contents this worker held whose last artifact went since its last beat (a full
            # inventory's unknown contents include them already).
            gone = [
                c
                for (c,) in self.db.execute(
                    "SELECT content_id FROM replica_drops WHERE worker_id = ? AND content_id NOT "
                    "IN (SELECT content_id FROM contents)",
                    [worker_id],
                )
                if not inventory.is_full
            ]
            self.db.execute("DELETE FROM replica_drops WHERE worker_id = ?", [worker_id])
            return BeatResult(sorted(unknown | set(gone)), kept=kept)

        return self.write(beat)

    def _reconcile(
        self, worker_id: str, inventory: Inventory, now: float
    ) -> tuple[set[str], frozenset[ReplicaKey]]:
        """Write the replica rows `inventory` changes (a full one's differences from the rows,
        or a delta's changes); returns the held contents the store does not know and the
        removals kept for now."""
        if inventory.is_full:
            recorded = {
                (c, t): bool(p)
                for c, t, p in self.db.execute(
                    "SELECT content_id, tier, pinned FROM replicas WHERE worker_id = ?",
                    [worker_id],
                )
            }
            removed = [key for key in recorded if key not in inventory.held]
            changed = {k: p for k, p in inventory.held.items() if recorded.get(k) != p}
        else:
            removed = [key for key in inventory.removed if key not in inventory.held]
            changed = dict(inventory.held)
        known = self._known_contents(self.db.conn, list({c for c, _ in changed}))
        self.db.conn.executemany(
            "INSERT INTO replicas (content_id, worker_id, tier, created_at, pinned) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (content_id, worker_id, tier) "
            "DO UPDATE SET pinned = excluded.pinned",
            [(c, worker_id, t, now, int(p)) for (c, t), p in changed.items() if c in known],
        )
        # A row younger than the grace may postdate the inventory (an explicit AddReplica
        # racing the beat): it stays, and the worker reports it removed again.
        self.db.conn.executemany(
            "DELETE FROM replicas WHERE worker_id = ? AND content_id = ? AND tier = ? "
            "AND created_at < ?",
            [(worker_id, c, t, now - RECONCILE_GRACE_S) for c, t in removed],
        )
        kept = frozenset(
            (c, t)
            for c, t in removed
            if self.db.conn.execute(
                "SELECT 1 FROM replicas WHERE worker_id = ? AND content_id = ? AND tier = ?",
                [worker_id, c, t],
            ).fetchone()
        )
        return {c for c, _ in changed} - known, kept

    @staticmethod
    def _known_contents(conn: sqlite3.Connection, content_ids: list[str]) -> set[str]:
        known: set[str] = set()
        for start in range(0, len(content_ids), IN_CHUNK):
            batch = content_ids[start : start + IN_CHUNK]
            marks = ",".join("?" * len(batch))
            rows = conn.execute(
                f"SELECT content_id FROM contents WHERE content_id IN ({marks})", batch
            )
            known.update(r[0] for r in rows)
        return known

    def list_workers(self, now: float) -> list[WorkerInfo]:
        with self._snapshot() as conn:
            conn.row_factory = sqlite3.Row
            try:
                rows = [
                    dict(r) for r in conn.execute("SELECT * FROM workers ORDER BY name, worker_id")
                ]
            finally:
                conn.row_factory = None
            counts = dict(
                conn.execute("SELECT worker_id, COUNT(*) FROM replicas GROUP BY worker_id")
            )
        return [self._worker(r, now, counts.get(r["worker_id"], 0)) for r in rows]

    def _worker(self, r: dict, now: float, num_replicas: int = 0) -> WorkerInfo:
        age = max(0.0, now - r["last_heartbeat"])
        return WorkerInfo(
            worker_id=r["worker_id"],
            name=r["name"],
            addr=r["addr"],
            host_id=r["host_id"],
            local_socket=r["local_socket"],
            roles=tuple(json.loads(r["roles"])),
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

    # -- contents and replicas -----------------------------------------------------------------

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

        def add() -> None:
            self._check_worker(worker_id)
            self._record_content(content_id, size_bytes, tensors, now)
            self.db.execute(
                "INSERT OR IGNORE INTO replicas (content_id, worker_id, tier, created_at) "
                "VALUES (?, ?, ?, ?)",
                [content_id, worker_id, tier, now],
            )
            if tier == "file" and reference:
                self.db.execute(
                    "INSERT OR REPLACE INTO file_references (content_id, host_id, spec, "
                    "created_at) SELECT ?, host_id, ?, ? FROM workers WHERE worker_id = ?",
                    [content_id, reference, now, worker_id],
                )

        self.write(add)

    def _check_worker(self, worker_id: str) -> None:
        if not self.db.execute("SELECT 1 FROM workers WHERE worker_id = ?", [worker_id]).fetchone():
            raise NotFound(f"worker {worker_id} is not registered")

    def _record_content(
        self, content_id: str, size_bytes: int, tensors: tuple[TensorMeta, ...], now: float
    ) -> bool:
        """Insert a content's record, or check a replica's hashes against it (filling them in
        for a by-reference content read for the first time). Returns whether it was new."""
        layout = json.dumps([t.to_json() for t in tensors])
        if self.db.conn.execute(
            "INSERT INTO contents VALUES (?, ?, ?, ?) ON CONFLICT (content_id) DO NOTHING",
            [content_id, size_bytes, layout, now],
        ).rowcount:
            return True
        if all(t.hash_hex for t in tensors):
            row = self.db.conn.execute(
                "SELECT tensors FROM contents WHERE content_id = ?", [content_id]
            ).fetchone()
            stored = [TensorMeta.from_json(t) for t in json.loads(row[0])]
            if not all(t.hash_hex for t in stored):
                check_same_layout(content_id, stored, tensors)
                self.db.conn.execute(
                    "UPDATE contents SET tensors = ? WHERE content_id = ?", [layout, content_id]
                )
            elif {t.name: t.hash_hex for t in stored} != {t.name: t.hash_hex for t in tensors}:
                # A by-reference content read again from files that changed in place.
                raise IntegrityError(
                    f"content {content_id}: this replica's bytes differ from the recorded "
                    "ones; not registered"
                )
        return False

    def list_references(self, host_id: str) -> list[tuple[str, str]]:
        """(content id, spec) of the files registered by reference on `host_id` whose content
        an artifact still names."""
        with self._snapshot() as conn:
            return [
                (r[0], r[1])
                for r in conn.execute(
                    "SELECT f.content_id, f.spec FROM file_references f JOIN contents c "
                    "USING (content_id) WHERE f.host_id = ? ORDER BY f.created_at",
                    [host_id],
                )
            ]

    def remove_replica(
        self,
        worker_id: str,
        content_id: str,
        tier: str = "",
        unless_last: bool = False,
        now: float = 0.0,
    ) -> bool:
        def remove() -> bool:
            if unless_last:
                others = self._live_replicas(self.db.conn, [content_id], now)[content_id]
                if not any(r.worker_id != worker_id for r in others):
                    return False
            self.db.execute(
                "DELETE FROM replicas WHERE worker_id = ? AND content_id = ? "
                "AND (? = '' OR tier = ?)",
                [worker_id, content_id, tier, tier],
            )
            return True

        return self.write(remove)

    def find_content(self, content_id: str, now: float) -> ContentInfo | None:
        with self._snapshot() as conn:
            row = conn.execute(
                "SELECT size_bytes, tensors FROM contents WHERE content_id = ?", [content_id]
            ).fetchone()
            if row is None:
                return None
            replicas = self._live_replicas(conn, [content_id], now)[content_id]
        tensors = tuple(TensorMeta.from_json(t) for t in json.loads(row[1]))
        return ContentInfo(content_id, row[0], tensors, replicas)

    def held_contents(self, content_ids: list[str], now: float, touch: bool = False) -> set[str]:
        held: set[str] = set()
        with self._snapshot() as conn:
            for start in range(0, len(content_ids), IN_CHUNK):
                batch = content_ids[start : start + IN_CHUNK]
                marks = ",".join("?" * len(batch))
                rows = conn.execute(
                    "SELECT DISTINCT r.content_id FROM replicas r JOIN workers w "
                    f"USING (worker_id) WHERE r.content_id IN ({marks}) AND w.last_heartbeat >= ?",
                    [*batch, now - self.heartbeat_ttl_s],
                )
                held.update(r[0] for r in rows)
        if touch and held:
            found = sorted(held)

            def renew() -> None:
                for start in range(0, len(found), IN_CHUNK):
                    batch = found[start : start + IN_CHUNK]
                    marks = ",".join("?" * len(batch))
                    self.db.execute(
                        f"UPDATE contents SET created_at = ? WHERE content_id IN ({marks}) "
                        "AND created_at < ?",
                        [now, *batch, now],
                    )

            self.write(renew)
        return held

    def _live_replicas(
        self, conn: sqlite3.Connection, content_ids: list[str], now: float
    ) -> dict[str, tuple[ReplicaInfo, ...]]:
        """Live replicas of each content, oldest first."""
        found: dict[str, list[ReplicaInfo]] = {c: [] for c in content_ids}
        unique = list(found)
        for start in range(0, len(unique), IN_CHUNK):
            batch = unique[start : start + IN_CHUNK]
            marks = ",".join("?" * len(batch))
            for content_id, worker_id, tier, pinned in conn.execute(
                "SELECT r.content_id, r.worker_id, r.tier, r.pinned FROM replicas r "
                f"JOIN workers w USING (worker_id) WHERE r.content_id IN ({marks}) "
                "AND w.last_heartbeat >= ? ORDER BY r.created_at, r.rowid",
                [*batch, now - self.heartbeat_ttl_s],
            ):
                found[content_id].append(ReplicaInfo(worker_id, tier, bool(pinned)))
        return {c: tuple(rs) for c, rs in found.items()}

    # -- artifacts -----------------------------------------------------------------------------

    def create_artifact(
        self, art_id: str, content_id: str, owner: str, ttl_s: float, parent: str, now: float
    ) -> tuple[ArtifactInfo, bool]:
        validate_art_id(art_id)
        check_owner(owner, ttl_s)

        def create() -> tuple[ArtifactInfo, bool]:
            self._expire(now)
            (existed,) = self._create_many(
                [NewArtifact(art_id, content_id, owner, ttl_s, parent)], now
            )
            return self._artifact(self.db.conn, art_id, now), existed

        return self.write(create)

    def _existing(
        self, table: str, key: str, ids: list[str], column: str = "content_id"
    ) -> dict[str, str]:
        """The rows of `table` among `ids` (inside a write): key -> their `column`."""
        found: dict[str, str] = {}
        for start in range(0, len(ids), IN_CHUNK):
            chunk = list(dict.fromkeys(ids[start : start + IN_CHUNK]))
            marks = ",".join("?" * len(chunk))
            found.update(
                self.db.conn.execute(
                    f"SELECT {key}, {column} FROM {table} WHERE {key} IN ({marks})", chunk
                ).fetchall()
            )
        return found

    def _create_many(self, artifacts: list[NewArtifact], now: float) -> list[bool]:
        """Insert artifacts (inside a write) with one statement: whether each existed with its
        content; AlreadyExists / NotFound name the first bad member."""
        names = self._existing("artifacts", "art_id", [a.art_id for a in artifacts])
        owners = self._existing("artifacts", "art_id", list(names), "owner")
        existed, rows = [], []
        for i, a in enumerate(artifacts):
            if a.art_id in names:
                if names[a.art_id] != a.content_id:
                    raise AlreadyExists(
                        f"{member(i, a.art_id, len(artifacts))} already exists with different "
                        "content (artifacts are immutable): choose a new id, e.g. a version "
                        "suffix @v2"
                    )
                check_same_owner(member(i, a.art_id, len(artifacts)), owners[a.art_id], a.owner)
                if a.owner == OWNER_LEASE:  # registered again: the lease runs at least ttl_s
                    self.db.execute(
                        "UPDATE artifacts SET expires_at = MAX(expires_at, ?) WHERE art_id = ?",
                        [now + a.ttl_s, a.art_id],
                    )
                existed.append(True)
                continue
            names[a.art_id], owners[a.art_id] = a.content_id, a.owner  # named twice in the batch
            expires_at = now + a.ttl_s if a.owner == OWNER_LEASE else None
            rows.append((a.art_id, a.content_id, a.owner, now, expires_at, a.parent))
            existed.append(False)
        try:
            self.db.conn.executemany("INSERT INTO artifacts VALUES (?, ?, ?, ?, ?, ?)", rows)
        except sqlite3.IntegrityError:  # the foreign key: a content nobody holds
            held = self._existing("contents", "content_id", [r[1] for r in rows])
            for i, a in enumerate(artifacts):
                if a.content_id not in held:
                    raise NotFound(
                        f"{member(i, a.art_id, len(artifacts))}: content {a.content_id} is not "
                        "held by any worker"
                    ) from None
            raise
        return existed

    def put_artifacts(
        self,
        worker_id: str,
        replicas: list[NewReplica],
        artifacts: list[NewArtifact],
        now: float,
    ) -> PutResult:
        return self.write(self._put_fn(worker_id, replicas, artifacts, now))

    def _put_fn(
        self,
        worker_id: str,
        replicas: list[NewReplica],
        artifacts: list[NewArtifact],
        now: float,
    ) -> Callable[[], PutResult]:
        """The write of `put_artifacts` (checked first: raises on a bad member)."""
        check_batch(replicas, artifacts)
        faults = self.faults
        arrived = time.monotonic()

        def put() -> PutResult:
            redundant = []
            if replicas:
                self._check_worker(worker_id)
            self._expire(now + (time.monotonic() - arrived))  # when it runs (see renew_lease)
            live = now - self.heartbeat_ttl_s
            # Contents new to the store, held here only: recorded with one statement each
            # for the whole batch (a 700-tensor publish is 700 of them).
            known = self._existing("contents", "content_id", [r.content_id for r in replicas])
            fresh = {r.content_id: r for r in replicas if r.content_id not in known}
            conn = self.db.conn
            conn.executemany(
                "INSERT INTO contents VALUES (?, ?, ?, ?)",
                [
                    (c, r.size_bytes, json.dumps([t.to_json() for t in r.tensors]), now)
                    for c, r in fresh.items()
                ],
            )
            conn.executemany(
                "INSERT INTO replicas (content_id, worker_id, tier, created_at) "
                "VALUES (?, ?, 'cpu', ?)",
                [(c, worker_id, now) for c in fresh],
            )
            for r in replicas:
                if r.content_id in fresh:
                    continue
                self._record_content(r.content_id, r.size_bytes, r.tensors, now)
                mine = self.db.execute(
                    "SELECT 1 FROM replicas WHERE content_id = ? AND worker_id = ?",
                    [r.content_id, worker_id],
                ).fetchone()
                elsewhere = self.db.execute(
                    "SELECT 1 FROM replicas r JOIN workers w USING (worker_id) "
                    "WHERE r.content_id = ? AND r.worker_id != ? AND w.last_heartbeat >= ? "
                    "LIMIT 1",
                    [r.content_id, worker_id, live],
                ).fetchone()
                if elsewhere is not None and mine is None:
                    redundant.append(r.content_id)  # stored once: the worker frees its copy
                    continue
                self.db.execute(
                    "INSERT OR IGNORE INTO replicas (content_id, worker_id, tier, created_at) "
                    "VALUES (?, ?, 'cpu', ?)",
                    [r.content_id, worker_id, now],
                )
            existed = self._create_many(artifacts, now)
            # Created here naming a content new here: everything is known, nothing to read.
            infos = {
                a.art_id: ArtifactInfo(
                    art_id=a.art_id,
                    content_id=a.content_id,
                    owner=a.owner,
                    size_bytes=fresh[a.content_id].size_bytes,
                    tensors=fresh[a.content_id].tensors,
                    created_at=now,
                    expires_at=now + a.ttl_s if a.owner == OWNER_LEASE else None,
                    parent=a.parent,
                    replicas=(ReplicaInfo(worker_id, "cpu", False),),
                )
                for a, e in zip(artifacts, existed)
                if not e and a.content_id in fresh
            }
            others = [a.art_id for a in artifacts if a.art_id not in infos]
            if others:
                layouts = {r.content_id: r.tensors for r in replicas}
                infos.update(self._artifacts(self.db.conn, others, now, layouts))
            if 0 < faults.store_exit_in_batch <= len(artifacts):
                os._exit(70)  # test hook: die with the batch written but not committed
            if 0 < faults.store_exit_after_commit <= len(artifacts):
                self._exit_after_commit = True  # test hook: die once it is committed
            return PutResult(
                tuple((infos[a.art_id], e) for a, e in zip(artifacts, existed)),
                tuple(redundant),
            )

        return put

    def get_artifact(self, art_id: str, now: float) -> ArtifactInfo:
        with self._snapshot() as conn:
            return self._artifact(conn, art_id, now)

    def _artifact(self, conn: sqlite3.Connection, art_id: str, now: float) -> ArtifactInfo:
        found = self._artifacts(conn, [art_id], now)
        if art_id not in found:
            raise NotFound(f"no artifact {art_id!r} (see `tc ls`)")
        return found[art_id]

    def _artifacts(
        self,
        conn: sqlite3.Connection,
        art_ids: list[str],
        now: float,
        layouts: dict[str, tuple[TensorMeta, ...]] | None = None,
    ) -> dict[str, ArtifactInfo]:
        """The live ones of `art_ids`, with tensors (those of `layouts` as given: just
        recorded) and live replicas."""
        rows = []
        for start in range(0, len(art_ids), IN_CHUNK):
            batch = list(dict.fromkeys(art_ids[start : start + IN_CHUNK]))
            marks = ",".join("?" * len(batch))
            rows += conn.execute(
                "SELECT a.art_id, a.content_id, a.owner, a.created_at, a.expires_at, a.parent, "
                "c.size_bytes, c.tensors, 0 FROM artifacts a JOIN contents c USING (content_id) "
                f"WHERE a.art_id IN ({marks}) AND (a.expires_at IS NULL OR a.expires_at > ?)",
                [*batch, now],
            ).fetchall()
        return {a.art_id: a for a in self._infos(conn, rows, now, True, layouts)}

    def _infos(
        self,
        conn: sqlite3.Connection,
        rows: list,
        now: float,
        with_tensors: bool,
        known: dict[str, tuple[TensorMeta, ...]] | None = None,
    ) -> list[ArtifactInfo]:
        replicas = self._live_replicas(conn, [r[1] for r in rows], now)
        layouts: dict[str, tuple[TensorMeta, ...]] = dict(known or {})
        infos = []
        for art_id, content_id, owner, created_at, expires_at, parent, size, tensors, n in rows:
            metas: tuple[TensorMeta, ...] = ()
            if with_tensors:
                metas = layouts.get(content_id) or tuple(
                    TensorMeta.from_json(t) for t in json.loads(tensors)
                )
                layouts[content_id] = metas
            infos.append(
                ArtifactInfo(
                    art_id=art_id,
                    content_id=content_id,
                    owner=owner,
                    size_bytes=size,
                    tensors=metas,
                    created_at=created_at,
                    expires_at=expires_at,
                    parent=parent or "",
                    replicas=replicas[content_id],
                    num_tensors=len(metas) if with_tensors else n,
                )
            )
        return infos

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
        low, high = prefix_bounds(prefix)
        where = ["a.art_id > ?" if after >= low else "a.art_id >= ?"]
        args: list[Any] = [max(after, low)]
        if high is not None:
            where.append("a.art_id < ?")
            args.append(high)
        if prefix:
            where.append("substr(a.art_id, 1, ?) = ?")
            args += [len(prefix), prefix]
        if delimiter:
            where.append("instr(substr(a.art_id, ?), ?) = 0")
            args += [len(prefix) + 1, delimiter]
        where.append("(a.expires_at IS NULL OR a.expires_at > ?)")
        args += [now, limit + 1]
        with self._snapshot() as conn:
            rows = conn.execute(
                "SELECT a.art_id, a.content_id, a.owner, a.created_at, a.expires_at, a.parent, "
                "c.size_bytes, "
                + ("c.tensors, 0" if with_tensors else "'', json_array_length(c.tensors)")
                + " FROM artifacts a JOIN contents c "
                "USING (content_id) WHERE " + " AND ".join(where) + " ORDER BY a.art_id LIMIT ?",
                args,
            ).fetchall()
            more = len(rows) > limit
            rows = rows[:limit]
            infos = self._infos(conn, rows, now, with_tensors)
        return infos, (rows[-1][0] if more else "")

    def delete_artifact(self, art_id: str, now: float) -> None:
        self.delete_artifacts([art_id], now)

    def delete_artifacts(self, art_ids: list[str], now: float, missing_ok: bool = False) -> int:
        return self.write(self._delete_fn(art_ids, now, missing_ok))

    def _delete_fn(self, art_ids: list[str], now: float, missing_ok: bool) -> Callable[[], int]:
        def delete() -> int:
            self._expire(now)
            contents: dict[str, None] = {}
            deleted = 0
            for i, art_id in enumerate(art_ids):
                row = self.db.execute(
                    "SELECT content_id FROM artifacts WHERE art_id = ?", [art_id]
                ).fetchone()
                if row is None:
                    if missing_ok:
                        continue
                    who = member(i, art_id, len(art_ids)) + ": " if len(art_ids) > 1 else ""
                    raise NotFound(f"{who}no artifact {art_id!r} (see `tc ls`)")
                self.db.execute("DELETE FROM artifacts WHERE art_id = ?", [art_id])
                contents[row[0]] = None
                deleted += 1
            for content_id in contents:
                self._drop_if_unreferenced(content_id)
            return deleted

        return delete

    def run_batch(self, ops: list[StoreOp], now: float) -> list[OpResult]:
        results: list[OpResult | None] = [None] * len(ops)
        writes: list[tuple[int, _Write]] = []
        for i, op in enumerate(ops):
            try:
                if isinstance(op, GetOp):
                    results[i] = self.get_artifact(op.art_id, now)
                elif isinstance(op, PutOp):
                    put = self._put_fn(op.worker_id, list(op.replicas), list(op.artifacts), now)
                    writes.append((i, _Write(put)))
                else:
                    delete = self._delete_fn(list(op.art_ids), now, op.missing_ok)
                    writes.append((i, _Write(delete)))
            except TensorcastError as e:
                results[i] = e
        self._write_all([w for _, w in writes])  # one transaction, most of the time
        for i, w in writes:
            error = w.error
            if error is not None and not isinstance(error, TensorcastError):
                error = Unavailable(f"store write failed: {error}")
            results[i] = error if error is not None else w.value
        return [r for r in results if r is not None]

    def renew_lease(self, art_id: str, ttl_s: float, now: float) -> ArtifactInfo:
        check_lease_ttl(ttl_s)
        arrived = time.monotonic()

        def renew() -> ArtifactInfo:
            # Judged when the write runs, not when the call arrived: queued behind other
            # writes past its expiry, a renewal would bring back an artifact readers saw gone.
            at = now + (time.monotonic() - arrived)
            self._expire(at)
            row = self.db.execute(
                "SELECT owner FROM artifacts WHERE art_id = ?", [art_id]
            ).fetchone()
            if row is None:
                raise NotFound(f"no artifact {art_id!r}: its lease may have expired")
            if row[0] != OWNER_LEASE:
                raise InvalidArgument(f"artifact {art_id!r} is system-owned and has no lease")
            self.db.execute(
                "UPDATE artifacts SET expires_at = ? WHERE art_id = ?", [at + ttl_s, art_id]
            )
            return self._artifact(self.db.conn, art_id, at)

        return self.write(renew)

    # -- expiry and garbage collection ---------------------------------------------------------

    def _drop_if_unreferenced(self, content_id: str) -> None:
        if not self.db.execute(
            "SELECT 1 FROM artifacts WHERE content_id = ? LIMIT 1", [content_id]
        ).fetchone():
            self._note_drops("content_id = ?", [content_id])
            self.db.execute("DELETE FROM replicas WHERE content_id = ?", [content_id])
            self.db.execute("DELETE FROM file_references WHERE content_id = ?", [content_id])
            self.db.execute("DELETE FROM contents WHERE content_id = ?", [content_id])

    def _drop_dead_workers(self, now: float) -> None:
        dead_before = now - self.heartbeat_ttl_s
        dead = "SELECT worker_id FROM workers WHERE last_heartbeat < ?"
        self.db.execute(f"DELETE FROM replicas WHERE worker_id IN ({dead})", [dead_before])
        self.db.execute(f"DELETE FROM replica_drops WHERE worker_id IN ({dead})", [dead_before])
        # Their rows are gone: a worker back from the dead must report everything again.
        self.db.execute(
            "UPDATE workers SET inventory_epoch = 0 WHERE last_heartbeat < ? "
            "AND inventory_epoch != 0",
            [dead_before],
        )
        self.db.execute(
            "DELETE FROM workers WHERE last_heartbeat < ?", [now - DEAD_WORKER_RETENTION_S]
        )

    def _expire(self, now: float) -> None:
        expired = self.db.execute(
            "SELECT art_id, content_id FROM artifacts WHERE expires_at IS NOT NULL "
            "AND expires_at <= ?",
            [now],
        ).fetchall()
        for art_id, content_id in expired:
            self.db.execute("DELETE FROM artifacts WHERE art_id = ?", [art_id])
            self._drop_if_unreferenced(content_id)

    def _note_drops(self, where: str, args: list) -> None:
        """Before replica rows `where` go with their content: note them for their workers'
        next beats (a delta inventory does not list what a worker keeps holding)."""
        self.db.execute(
            "INSERT OR IGNORE INTO replica_drops (worker_id, content_id) "
            f"SELECT DISTINCT worker_id, content_id FROM replicas WHERE {where}",
            args,
        )

    def sweep(self, now: float, judge_workers: bool = True) -> None:
        with self.transaction():
            self._expire(now)
            if judge_workers:
                self._drop_dead_workers(now)
            # A forgotten worker's instances go with it (they died with it, or moved on and
            # are reported by their new worker).
            self.db.execute(
                "DELETE FROM instances WHERE worker_id NOT IN (SELECT worker_id FROM workers)"
            )
            unreferenced = (
                "content_id IN (SELECT content_id FROM contents c WHERE created_at < ? AND NOT "
                "EXISTS (SELECT 1 FROM artifacts a WHERE a.content_id = c.content_id))"
            )
            self._note_drops(unreferenced, [now - self.unreferenced_grace_s])
            self.db.execute(
                f"DELETE FROM replicas WHERE {unreferenced}", [now - self.unreferenced_grace_s]
            )
            self.db.execute(
                "DELETE FROM contents WHERE created_at < ? AND NOT EXISTS "
                "(SELECT 1 FROM artifacts a WHERE a.content_id = contents.content_id)",
                [now - self.unreferenced_grace_s],
            )
            self.db.execute(
                "DELETE FROM file_references WHERE content_id NOT IN "
                "(SELECT content_id FROM contents)"
            )

    def counts(self) -> tuple[int, int]:
        with self._snapshot() as conn:
            return (
                conn.execute("SELECT COUNT(*) FROM artifacts").fetchone()[0],
                conn.execute("SELECT COUNT(*) FROM contents").fetchone()[0],
            )

    def artifacts_by_owner(self, now: float) -> dict[str, int]:
        with self._snapshot() as conn:
            rows = conn.execute(
                "SELECT owner, COUNT(*) FROM artifacts WHERE expires_at IS NULL "
                "OR expires_at > ? GROUP BY owner",
                [now],
            )
            return {owner: count for owner, count in rows}

    def describe(self) -> str:
        return str(self.path)

    def members(self) -> list[tuple[str, bool, str]]:
        return []
