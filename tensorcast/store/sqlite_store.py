"""`SqliteStore`: the default Global Store backend, one sqlite file in WAL mode.

Every write commits with `synchronous=FULL`, so a record acknowledged to a caller survives a crash
of the store process (and of the machine). One lock serialises access: control-plane rates are low.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import sqlite_utils

from tensorcast.config import DEFAULT_UNREFERENCED_GRACE_S
from tensorcast.errors import AlreadyExists, IntegrityError, InvalidArgument, NotFound
from tensorcast.store.base import (
    DEAD_WORKER_RETENTION_S,
    RECONCILE_GRACE_S,
    ContentInfo,
    WorkerRegistration,
    check_same_layout,
    validate_art_id,
)
from tensorcast.store.schema import migrate
from tensorcast.types import (
    OWNER_LEASE,
    OWNER_SYSTEM,
    ArtifactInfo,
    ReplicaInfo,
    TensorMeta,
    WorkerInfo,
    check_tensor_name,
)


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
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.schema_version = migrate(self.db)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.unreferenced_grace_s = unreferenced_grace_s  # a commit's time to be named
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()

    # -- workers -------------------------------------------------------------------------------

    def register_worker(self, reg: WorkerRegistration, now: float) -> None:
        """Record a worker. A name belongs to one live worker at a time: a second process under
        the name of a worker that still heartbeats is refused (AlreadyExists)."""
        with self._lock, self.db.conn:
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
            self.db.table("workers").upsert(
                {
                    "worker_id": reg.worker_id,
                    "name": reg.name,
                    "addr": reg.addr,
                    "host_id": reg.host_id,
                    "local_socket": reg.local_socket,
                    "roles": json.dumps(list(reg.roles)),
                    "mem_cap_bytes": reg.mem_cap_bytes,
                    "mem_used_bytes": 0,
                    "pid": reg.pid,
                    "registered_at": now,
                    "last_heartbeat": now,
                    "data_addr": reg.data_addr,
                    "active_transfers": 0,
                    "transfer_bytes_total": 0,
                    "disk_used_bytes": 0,
                },
                pk="worker_id",
            )

    def deregister_worker(self, worker_id: str) -> None:
        with self._lock, self.db.conn:
            self.db.execute("DELETE FROM replicas WHERE worker_id = ?", [worker_id])
            self.db.execute("DELETE FROM workers WHERE worker_id = ?", [worker_id])

    def heartbeat(
        self,
        worker_id: str,
        mem_used_bytes: int,
        content_ids: list[str],
        now: float,
        pinned_content_ids: frozenset[str] = frozenset(),
        active_transfers: int = 0,
        disk_content_ids: frozenset[str] = frozenset(),
        transfer_bytes_total: int = 0,
        disk_used_bytes: int = 0,
        file_content_ids: frozenset[str] = frozenset(),
    ) -> list[str]:
        with self._lock, self.db.conn:
            cursor = self.db.execute(
                "UPDATE workers SET last_heartbeat = ?, mem_used_bytes = ?, active_transfers = ?, "
                "transfer_bytes_total = ?, disk_used_bytes = ? WHERE worker_id = ?",
                [
                    now,
                    mem_used_bytes,
                    active_transfers,
                    transfer_bytes_total,
                    disk_used_bytes,
                    worker_id,
                ],
            )
            if cursor.rowcount == 0:
                raise NotFound(f"worker {worker_id} is not registered")
            held = (
                {(c, "cpu") for c in content_ids}
                | {(c, "disk") for c in disk_content_ids}
                | {(c, "file") for c in file_content_ids}
            )
            known = self._known_contents([c for c, _ in held])
            for content_id, tier in held:
                if content_id in known:
                    self.db.execute(
                        "INSERT INTO replicas (content_id, worker_id, tier, created_at, pinned) "
                        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (content_id, worker_id, tier) "
                        "DO UPDATE SET pinned = excluded.pinned",
                        [content_id, worker_id, tier, now, int(content_id in pinned_content_ids)],
                    )
            # The worker no longer holds these (it dropped or moved them without telling us):
            # forget them. Rows younger than the grace may postdate this heartbeat's inventory.
            for content_id, tier in self.db.execute(
                "SELECT content_id, tier FROM replicas WHERE worker_id = ? AND created_at < ?",
                [worker_id, now - RECONCILE_GRACE_S],
            ).fetchall():
                if (content_id, tier) not in held:
                    self.db.execute(
                        "DELETE FROM replicas WHERE worker_id = ? AND content_id = ? AND tier = ?",
                        [worker_id, content_id, tier],
                    )
            return sorted({c for c, _ in held} - known)

    def _known_contents(self, content_ids: list[str]) -> set[str]:
        known: set[str] = set()
        for start in range(0, len(content_ids), 500):
            batch = content_ids[start : start + 500]
            marks = ",".join("?" * len(batch))
            rows = self.db.execute(
                f"SELECT content_id FROM contents WHERE content_id IN ({marks})", batch
            )
            known.update(r[0] for r in rows)
        return known

    def list_workers(self, now: float) -> list[WorkerInfo]:
        with self._lock:
            rows = list(self.db.table("workers").rows_where(order_by="name, worker_id"))
            counts = dict(
                self.db.execute("SELECT worker_id, COUNT(*) FROM replicas GROUP BY worker_id")
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
        with self._lock, self.db.conn:
            if not self.db.execute(
                "SELECT 1 FROM workers WHERE worker_id = ?", [worker_id]
            ).fetchone():
                raise NotFound(f"worker {worker_id} is not registered")
            layout = json.dumps([t.to_json() for t in tensors])
            row = self.db.execute(
                "SELECT tensors FROM contents WHERE content_id = ?", [content_id]
            ).fetchone()
            if row is None:
                self.db.execute(
                    "INSERT INTO contents VALUES (?, ?, ?, ?)",
                    [content_id, size_bytes, layout, now],
                )
            elif all(t.hash_hex for t in tensors):
                stored = [TensorMeta.from_json(t) for t in json.loads(row[0])]
                if not all(t.hash_hex for t in stored):
                    check_same_layout(content_id, stored, tensors)
                    self.db.execute(
                        "UPDATE contents SET tensors = ? WHERE content_id = ?",
                        [layout, content_id],
                    )
                elif {t.name: t.hash_hex for t in stored} != {t.name: t.hash_hex for t in tensors}:
                    # A by-reference content read again from files that changed in place.
                    raise IntegrityError(
                        f"content {content_id}: this replica's bytes differ from the recorded "
                        "ones; not registered"
                    )
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

    def list_references(self, host_id: str) -> list[tuple[str, str]]:
        """(content id, spec) of the files registered by reference on `host_id` whose content
        an artifact still names."""
        with self._lock:
            return [
                (r[0], r[1])
                for r in self.db.execute(
                    "SELECT f.content_id, f.spec FROM file_references f JOIN contents c "
                    "USING (content_id) WHERE f.host_id = ? ORDER BY f.created_at",
                    [host_id],
                )
            ]

    def remove_replica(self, worker_id: str, content_id: str, tier: str = "") -> None:
        with self._lock, self.db.conn:
            self.db.execute(
                "DELETE FROM replicas WHERE worker_id = ? AND content_id = ? "
                "AND (? = '' OR tier = ?)",
                [worker_id, content_id, tier, tier],
            )

    def find_content(self, content_id: str, now: float) -> ContentInfo | None:
        with self._lock:
            row = self.db.execute(
                "SELECT size_bytes, tensors FROM contents WHERE content_id = ?", [content_id]
            ).fetchone()
            if row is None:
                return None
            replicas = self._live_replicas(content_id, now)
        tensors = tuple(TensorMeta.from_json(t) for t in json.loads(row[1]))
        return ContentInfo(content_id, row[0], tensors, replicas)

    def _live_replicas(self, content_id: str, now: float) -> tuple[ReplicaInfo, ...]:
        rows = self.db.execute(
            "SELECT r.worker_id, r.tier, r.pinned FROM replicas r JOIN workers w USING (worker_id) "
            "WHERE r.content_id = ? AND w.last_heartbeat >= ? ORDER BY r.created_at",
            [content_id, now - self.heartbeat_ttl_s],
        ).fetchall()
        return tuple(ReplicaInfo(w, t, bool(p)) for w, t, p in rows)

    # -- artifacts -----------------------------------------------------------------------------

    def create_artifact(
        self, art_id: str, content_id: str, owner: str, ttl_s: float, parent: str, now: float
    ) -> tuple[ArtifactInfo, bool]:
        validate_art_id(art_id)
        if owner not in (OWNER_SYSTEM, OWNER_LEASE):
            raise InvalidArgument(f"bad owner {owner!r}: use 'system' or 'lease'")
        if owner == OWNER_LEASE and not ttl_s > 0:
            raise InvalidArgument("a caller-leased artifact needs ttl_s > 0")
        with self._lock, self.db.conn:
            self._expire(now)
            existing = self.db.execute(
                "SELECT content_id FROM artifacts WHERE art_id = ?", [art_id]
            ).fetchone()
            if existing is not None:
                if existing[0] != content_id:
                    raise AlreadyExists(
                        f"artifact {art_id!r} already exists with different content "
                        "(artifacts are immutable): choose a new id, e.g. a version suffix @v2"
                    )
                existed = True
            else:
                if not self.db.execute(
                    "SELECT 1 FROM contents WHERE content_id = ?", [content_id]
                ).fetchone():
                    raise NotFound(f"content {content_id} is not held by any worker")
                self.db.execute(
                    "INSERT INTO artifacts VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        art_id,
                        content_id,
                        owner,
                        now,
                        now + ttl_s if owner == OWNER_LEASE else None,
                        parent,
                    ],
                )
                existed = False
            return self._artifact(art_id, now), existed

    def get_artifact(self, art_id: str, now: float) -> ArtifactInfo:
        with self._lock:
            return self._artifact(art_id, now)

    def _artifact(self, art_id: str, now: float) -> ArtifactInfo:
        row = self.db.execute(
            "SELECT a.content_id, a.owner, a.created_at, a.expires_at, a.parent, "
            "c.size_bytes, c.tensors FROM artifacts a JOIN contents c USING (content_id) "
            "WHERE a.art_id = ?",
            [art_id],
        ).fetchone()
        if row is None or (row[3] is not None and row[3] <= now):
            raise NotFound(f"no artifact {art_id!r} (see `tc ls`)")
        content_id, owner, created_at, expires_at, parent, size_bytes, tensors = row
        return ArtifactInfo(
            art_id=art_id,
            content_id=content_id,
            owner=owner,
            size_bytes=size_bytes,
            tensors=tuple(TensorMeta.from_json(t) for t in json.loads(tensors)),
            created_at=created_at,
            expires_at=expires_at,
            parent=parent or "",
            replicas=self._live_replicas(content_id, now),
        )

    def list_artifacts(self, prefix: str, now: float) -> list[ArtifactInfo]:
        with self._lock:
            ids = [
                r[0]
                for r in self.db.execute(
                    "SELECT art_id FROM artifacts WHERE substr(art_id, 1, ?) = ? "
                    "AND (expires_at IS NULL OR expires_at > ?) ORDER BY art_id",
                    [len(prefix), prefix, now],
                )
            ]
            return [self._artifact(art_id, now) for art_id in ids]

    def delete_artifact(self, art_id: str, now: float) -> None:
        with self._lock, self.db.conn:
            self._expire(now)
            row = self.db.execute(
                "SELECT content_id FROM artifacts WHERE art_id = ?", [art_id]
            ).fetchone()
            if row is None:
                raise NotFound(f"no artifact {art_id!r} (see `tc ls`)")
            self.db.execute("DELETE FROM artifacts WHERE art_id = ?", [art_id])
            self._drop_if_unreferenced(row[0])

    def renew_lease(self, art_id: str, ttl_s: float, now: float) -> ArtifactInfo:
        if not ttl_s > 0:
            raise InvalidArgument("ttl_s must be > 0")
        with self._lock, self.db.conn:
            self._expire(now)
            row = self.db.execute(
                "SELECT owner FROM artifacts WHERE art_id = ?", [art_id]
            ).fetchone()
            if row is None:
                raise NotFound(f"no artifact {art_id!r}: its lease may have expired")
            if row[0] != OWNER_LEASE:
                raise InvalidArgument(f"artifact {art_id!r} is system-owned and has no lease")
            self.db.execute(
                "UPDATE artifacts SET expires_at = ? WHERE art_id = ?", [now + ttl_s, art_id]
            )
            return self._artifact(art_id, now)

    # -- expiry and garbage collection ---------------------------------------------------------

    def _drop_if_unreferenced(self, content_id: str) -> None:
        if not self.db.execute(
            "SELECT 1 FROM artifacts WHERE content_id = ? LIMIT 1", [content_id]
        ).fetchone():
            self.db.execute("DELETE FROM replicas WHERE content_id = ?", [content_id])
            self.db.execute("DELETE FROM file_references WHERE content_id = ?", [content_id])
            self.db.execute("DELETE FROM contents WHERE content_id = ?", [content_id])

    def _expire(self, now: float) -> None:
        expired = self.db.execute(
            "SELECT art_id, content_id FROM artifacts WHERE expires_at IS NOT NULL "
            "AND expires_at <= ?",
            [now],
        ).fetchall()
        for art_id, content_id in expired:
            self.db.execute("DELETE FROM artifacts WHERE art_id = ?", [art_id])
            self._drop_if_unreferenced(content_id)

    def sweep(self, now: float) -> None:
        with self._lock, self.db.conn:
            self._expire(now)
            dead_before = now - self.heartbeat_ttl_s
            self.db.execute(
                "DELETE FROM replicas WHERE worker_id IN "
                "(SELECT worker_id FROM workers WHERE last_heartbeat < ?)",
                [dead_before],
            )
            self.db.execute(
                "DELETE FROM workers WHERE last_heartbeat < ?", [now - DEAD_WORKER_RETENTION_S]
            )
            self.db.execute(
                "DELETE FROM replicas WHERE content_id IN (SELECT content_id FROM contents c "
                "WHERE created_at < ? AND NOT EXISTS "
                "(SELECT 1 FROM artifacts a WHERE a.content_id = c.content_id))",
                [now - self.unreferenced_grace_s],
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
        with self._lock:
            return self.db.table("artifacts").count, self.db.table("contents").count

    def describe(self) -> str:
        return str(self.path)

    def members(self) -> list[tuple[str, bool, str]]:
        return []
