"""Coordination records of the sqlite Global Store: KV shard leases, instances, plan results.

Shares the `SqliteStore`'s database and lock. Shard leases follow DESIGN §2: a lease is granted
to the first shard-home worker that asks while the shard is free or expired; the fencing token
grows on every change of holder and never goes back, so a restarted store keeps fencing.
"""

from __future__ import annotations

import json

from tensorcast.errors import FencingError, InvalidArgument, NotFound
from tensorcast.store.base import (
    DEFAULT_NUM_SHARDS,
    MAX_PLANS_LISTED,
    PLAN_RETENTION_S,
    SHARD_HOME_ROLE,
    check_num_shards,
    fixed_num_shards,
    plan_resent,
)
from tensorcast.store.sqlite_store import SqliteStore
from tensorcast.types import InstanceInfo, PlanRecord, ShardLease, ShardTable


class SqliteCoordination:
    def __init__(self, store: SqliteStore, num_shards: int | None) -> None:
        self.store = store
        self.db = store.db
        self._lock = store._lock
        self.num_shards = self._settle_num_shards(num_shards)

    def _settle_num_shards(self, requested: int | None) -> int:
        check_num_shards(requested)
        with self.store.transaction():
            row = self.db.execute("SELECT value FROM settings WHERE key = 'num_shards'").fetchone()
            if row is not None:
                return fixed_num_shards(int(row[0]), requested)
            count = requested or DEFAULT_NUM_SHARDS
            self.db.execute("INSERT INTO settings VALUES ('num_shards', ?)", [str(count)])
            return count

    # -- shard leases --------------------------------------------------------------------------

    def shard_table(self, now: float) -> ShardTable:
        with self._lock:
            return self._table(now)

    def _table(self, now: float) -> ShardTable:
        rows = {
            r[0]: r[1:]
            for r in self.db.execute(
                "SELECT s.shard, s.holder_worker_id, s.fencing_token, s.expires_at, "
                "w.addr, w.local_socket, w.host_id FROM shard_leases s "
                "LEFT JOIN workers w ON w.worker_id = s.holder_worker_id"
            )
        }
        leases = []
        for shard in range(self.num_shards):
            holder, token, expires_at, addr, sock, host = rows.get(shard, ("", 0, 0.0, "", "", ""))
            leases.append(
                ShardLease(
                    shard, holder or "", token, expires_at - now, addr or "", sock or "", host or ""
                )
            )
        ttl = self.store.heartbeat_ttl_s
        homes = tuple(
            r[0]
            for r in self.db.execute(
                "SELECT worker_id FROM workers WHERE last_heartbeat >= ? AND roles LIKE ? "
                "ORDER BY worker_id",
                [now - ttl, f'%"{SHARD_HOME_ROLE}"%'],
            )
        )
        return ShardTable(self.num_shards, ttl, tuple(leases), homes)

    def acquire_shards(self, worker_id: str, shards: list[int], now: float) -> ShardTable:
        """Grant each free or expired shard to `worker_id` (renew those it holds already)."""
        with self.store.transaction():
            row = self.db.execute(
                "SELECT roles, last_heartbeat FROM workers WHERE worker_id = ?", [worker_id]
            ).fetchone()
            if row is None:
                raise NotFound(f"worker {worker_id} is not registered")
            if SHARD_HOME_ROLE not in json.loads(row[0]):
                raise InvalidArgument(f"worker {worker_id} does not have the shard-home role")
            expires_at = now + self.store.heartbeat_ttl_s
            for shard in shards:
                if not 0 <= shard < self.num_shards:
                    raise InvalidArgument(f"no shard {shard}: the cluster has {self.num_shards}")
                lease = self.db.execute(
                    "SELECT holder_worker_id, fencing_token, expires_at FROM shard_leases "
                    "WHERE shard = ?",
                    [shard],
                ).fetchone()
                if lease is None:
                    self.db.execute(
                        "INSERT INTO shard_leases VALUES (?, ?, 1, ?)",
                        [shard, worker_id, expires_at],
                    )
                elif lease[0] == worker_id and lease[2] > now:
                    self.db.execute(
                        "UPDATE shard_leases SET expires_at = ? WHERE shard = ?",
                        [expires_at, shard],
                    )
                elif lease[2] <= now:  # free: a new holder, or an old one whose lease lapsed
                    self.db.execute(
                        "UPDATE shard_leases SET holder_worker_id = ?, fencing_token = ?, "
                        "expires_at = ? WHERE shard = ?",
                        [worker_id, lease[1] + 1, expires_at, shard],
                    )
            return self._table(now)

    def hand_off_shard(
        self, worker_id: str, shard: int, token: int, to_worker_id: str, now: float
    ) -> ShardTable:
        """Move a held lease to another live shard-home worker, bumping the token (fencing the
        old holder). Only the holder, under its current token, may give a shard away."""
        with self.store.transaction():
            lease = self.db.execute(
                "SELECT holder_worker_id, fencing_token, expires_at FROM shard_leases "
                "WHERE shard = ?",
                [shard],
            ).fetchone()
            if lease is not None and (lease[0], lease[1]) == (to_worker_id, token + 1):
                return self._table(now)  # this very hand-off, re-sent (its reply was lost)
            if lease is None or lease[0] != worker_id or lease[1] != token or lease[2] <= now:
                raise FencingError(
                    f"worker {worker_id} does not hold shard {shard} under token {token}"
                )
            row = self.db.execute(
                "SELECT roles, last_heartbeat FROM workers WHERE worker_id = ?", [to_worker_id]
            ).fetchone()
            ttl = self.store.heartbeat_ttl_s
            if row is None or row[1] < now - ttl or SHARD_HOME_ROLE not in json.loads(row[0]):
                raise InvalidArgument(
                    f"worker {to_worker_id} is not a live shard-home worker: no hand-off"
                )
            self.db.execute(
                "UPDATE shard_leases SET holder_worker_id = ?, fencing_token = ?, "
                "expires_at = ? WHERE shard = ?",
                [to_worker_id, token + 1, now + ttl, shard],
            )
            return self._table(now)

    def renew_shards(self, worker_id: str, held: list[tuple[int, int]], now: float) -> None:
        """Heartbeat renewal: only leases still held by `worker_id` under the same token."""

        def renew() -> None:
            for shard, token in held:
                self.db.execute(
                    "UPDATE shard_leases SET expires_at = ? WHERE shard = ? AND "
                    "holder_worker_id = ? AND fencing_token = ? AND expires_at > ?",
                    [now + self.store.heartbeat_ttl_s, shard, worker_id, token, now],
                )

        if held:
            self.store.write(renew)

    def release_shards(self, worker_id: str) -> None:
        """A worker leaving cleanly frees its shards at once (the token stays for fencing)."""
        with self.store.transaction():
            self.db.execute(
                "UPDATE shard_leases SET expires_at = 0 WHERE holder_worker_id = ?", [worker_id]
            )
            self.db.execute("DELETE FROM instances WHERE worker_id = ?", [worker_id])

    # -- instances -----------------------------------------------------------------------------

    def report_instances(self, worker_id: str, instances: list[InstanceInfo], now: float) -> None:
        """The worker's full list of attached instances: upsert them, forget detached ones."""

        def report() -> None:
            for inst in instances:
                load = {
                    "waiting": inst.waiting,
                    "running": inst.running,
                    "cached_tokens": inst.cached_tokens,
                    "requests": list(inst.requests),
                }
                self.db.execute(
                    "INSERT INTO instances (instance_id, worker_id, engine, registered_at, "
                    "last_heartbeat, load, endpoint) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (instance_id) DO UPDATE SET worker_id = excluded.worker_id, "
                    "engine = excluded.engine, last_heartbeat = excluded.last_heartbeat, "
                    "load = excluded.load, endpoint = excluded.endpoint",
                    [
                        inst.instance_id,
                        worker_id,
                        inst.engine,
                        now,
                        now,
                        json.dumps(load),
                        inst.endpoint,
                    ],
                )
            marks = ",".join("?" * len(instances))
            self.db.execute(
                f"DELETE FROM instances WHERE worker_id = ? AND instance_id NOT IN ({marks})",
                [worker_id, *(i.instance_id for i in instances)],
            )

        if not instances:
            with self.store._snapshot() as conn:
                query = "SELECT 1 FROM instances WHERE worker_id = ? LIMIT 1"
                if conn.execute(query, [worker_id]).fetchone() is None:
                    return  # nothing to forget: no write
        self.store.write(report)

    def list_instances(self, now: float) -> list[InstanceInfo]:
        with self._lock:
            rows = self.db.execute(
                "SELECT i.instance_id, i.worker_id, i.engine, i.endpoint, i.load, "
                "i.last_heartbeat, w.name, w.last_heartbeat FROM instances i "
                "LEFT JOIN workers w USING (worker_id) ORDER BY i.instance_id"
            ).fetchall()
        ttl = self.store.heartbeat_ttl_s
        result = []
        for iid, wid, engine, endpoint, load, beat, wname, wbeat in rows:
            load = json.loads(load or "{}")
            age = max(0.0, now - beat)
            result.append(
                InstanceInfo(
                    instance_id=iid,
                    worker_id=wid,
                    engine=engine,
                    endpoint=endpoint,
                    waiting=load.get("waiting", 0),
                    running=load.get("running", 0),
                    cached_tokens=load.get("cached_tokens", 0),
                    requests=tuple(load.get("requests", ())),
                    heartbeat_age_s=age,
                    alive=age <= ttl and wbeat is not None and now - wbeat <= ttl,
                    worker_name=wname or "",
                )
            )
        return result

    # -- plan results --------------------------------------------------------------------------

    def begin_plan(self, record: PlanRecord, now: float) -> tuple[bool, PlanRecord | None]:
        """Claim `record.idempotency_key` for a run. Returns (started, previous record).

        Not started when the key finished ok, or is running and not past its deadline. A failed
        or abandoned run is replaced: the caller reuses the steps it finished. A request
        re-sent for the claim that holds the key (same run id) is told it started.
        """
        with self.store.transaction():
            previous = self._plan(record.idempotency_key)
            if plan_resent(previous, record):
                return True, None
            if previous is not None and (
                previous.status == "ok"
                or (previous.status == "running" and previous.deadline_at > now)
            ):
                return False, previous
            self.db.execute(
                "INSERT OR REPLACE INTO plan_results (idempotency_key, trace_id, status, result, "
                "created_at, finished_at, deadline_at, run_id) "
                "VALUES (?, ?, 'running', ?, ?, 0, ?, ?)",
                [
                    record.idempotency_key,
                    record.trace_id,
                    json.dumps(record.result),
                    now,
                    record.deadline_at,
                    record.run_id,
                ],
            )
            return True, previous

    def finish_plan(self, record: PlanRecord, now: float) -> None:
        if record.status not in ("ok", "failed"):
            raise InvalidArgument(f"a finished plan is ok or failed, not {record.status!r}")
        with self.store.transaction():
            cursor = self.db.execute(
                "UPDATE plan_results SET status = ?, result = ?, finished_at = ? "
                "WHERE idempotency_key = ? AND trace_id = ?",
                [
                    record.status,
                    json.dumps(record.result),
                    now,
                    record.idempotency_key,
                    record.trace_id,
                ],
            )
            if cursor.rowcount == 0:
                raise NotFound(
                    f"plan {record.idempotency_key!r} (trace {record.trace_id}) is not running"
                )

    def get_plan(self, key: str) -> PlanRecord:
        with self._lock:
            record = self._plan(key)
        if record is None:
            raise NotFound(f"no plan recorded under {key!r}")
        return record

    def list_plans(self, limit: int) -> list[PlanRecord]:
        limit = max(1, min(limit or 50, MAX_PLANS_LISTED))
        with self._lock:
            keys = [
                r[0]
                for r in self.db.execute(
                    "SELECT idempotency_key FROM plan_results ORDER BY created_at DESC LIMIT ?",
                    [limit],
                )
            ]
            return [p for p in (self._plan(k) for k in keys) if p is not None]

    def _plan(self, key: str) -> PlanRecord | None:
        row = self.db.execute(
            "SELECT trace_id, status, result, created_at, finished_at, deadline_at, run_id "
            "FROM plan_results WHERE idempotency_key = ?",
            [key],
        ).fetchone()
        if row is None:
            return None
        trace_id, status, result, created_at, finished_at, deadline_at, run_id = row
        return PlanRecord(
            key,
            trace_id,
            status,
            json.loads(result or "{}"),
            created_at,
            finished_at or 0.0,
            deadline_at or 0.0,
            run_id or "",
        )

    def sweep(self, now: float) -> None:
        with self.store.transaction():
            self.db.execute(
                "DELETE FROM plan_results WHERE status != 'running' AND finished_at < ?",
                [now - PLAN_RETENTION_S],
            )
