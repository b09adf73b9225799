"""Versioned schema of the sqlite Global Store. Append migrations; never edit a released one.

The version lives in `PRAGMA user_version`; each migration runs in one transaction with its bump.
"""

from __future__ import annotations

import sqlite_utils


def _v1(db: sqlite_utils.Database) -> None:
    db.table("workers").create(
        {
            "worker_id": str,
            "name": str,
            "addr": str,
            "host_id": str,
            "local_socket": str,
            "roles": str,  # JSON list
            "mem_cap_bytes": int,
            "mem_used_bytes": int,
            "pid": int,
            "registered_at": float,
            "last_heartbeat": float,
        },
        pk="worker_id",
    )
    db.table("instances").create(
        {
            "instance_id": str,
            "worker_id": str,
            "engine": str,
            "registered_at": float,
            "last_heartbeat": float,
            "load": str,  # JSON
        },
        pk="instance_id",
    )
    db.table("contents").create(
        {"content_id": str, "size_bytes": int, "tensors": str, "created_at": float},
        pk="content_id",
    )
    db.table("artifacts").create(
        {
            "art_id": str,
            "content_id": str,
            "owner": str,
            "created_at": float,
            "expires_at": float,
            "parent": str,
        },
        pk="art_id",
        foreign_keys=[("content_id", "contents", "content_id")],
        not_null={"content_id", "owner", "created_at"},
    )
    db.table("artifacts").create_index(["content_id"])
    db.table("artifacts").create_index(["expires_at"])
    db.table("replicas").create(
        {"content_id": str, "worker_id": str, "tier": str, "created_at": float},
        pk=("content_id", "worker_id", "tier"),
    )
    db.table("replicas").create_index(["worker_id"])
    db.table("shard_leases").create(
        {"shard": int, "holder_worker_id": str, "fencing_token": int, "expires_at": float},
        pk="shard",
    )
    db.table("plan_results").create(
        {
            "idempotency_key": str,
            "trace_id": str,
            "status": str,
            "result": str,  # JSON
            "created_at": float,
            "finished_at": float,
        },
        pk="idempotency_key",
    )


def _v2(db: sqlite_utils.Database) -> None:
    """The data plane: workers advertise a native transport address and their load; pins."""
    db.table("workers").add_column("data_addr", str, not_null_default="")
    db.table("workers").add_column("active_transfers", int, not_null_default=0)
    db.table("replicas").add_column("pinned", int, not_null_default=0)


def _v3(db: sqlite_utils.Database) -> None:
    """Workers report their data-plane byte counter, so callers can derive transfer rates."""
    db.table("workers").add_column("transfer_bytes_total", int, not_null_default=0)
    db.table("workers").add_column("disk_used_bytes", int, not_null_default=0)


def _v4(db: sqlite_utils.Database) -> None:
    """Plans, instances and KV shards: cluster settings (the shard count), instance endpoints,
    plan deadlines (a running plan past its deadline is abandoned and may run again)."""
    db.table("settings").create({"key": str, "value": str}, pk="key")
    db.table("instances").add_column("endpoint", str, not_null_default="")
    db.table("plan_results").add_column("deadline_at", float, not_null_default=0.0)
    db.table("plan_results").create_index(["created_at"])


def _v5(db: sqlite_utils.Database) -> None:
    """Files registered by reference (`tc put --by-reference`): what a worker of that host
    needs to serve them again after a restart (paths, file facts, layout, as JSON)."""
    db.table("file_references").create(
        {"content_id": str, "host_id": str, "spec": str, "created_at": float}, pk="content_id"
    )
    db.table("file_references").create_index(["host_id"])


def _v6(db: sqlite_utils.Database) -> None:
    """Delta heartbeats: the epoch of the inventory the store last applied per worker, and the
    contents a worker held whose last artifact went (told to it at its next beat)."""
    db.table("workers").add_column("inventory_epoch", int, not_null_default=0)
    db.table("replica_drops").create(
        {"worker_id": str, "content_id": str}, pk=("worker_id", "content_id")
    )


def _v7(db: sqlite_utils.Database) -> None:
    """Plan claims carry a run id, so a BeginPlan re-sent for a claim is told it holds it."""
    db.table("plan_results").add_column("run_id", str, not_null_default="")


MIGRATIONS = (_v1, _v2, _v3, _v4, _v5, _v6, _v7)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(db: sqlite_utils.Database) -> int:
    """Bring the database to SCHEMA_VERSION; refuses a database newer than this code."""
    current = db.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise RuntimeError(
            f"database schema v{current} is newer than this tensorcast (v{SCHEMA_VERSION}): upgrade"
        )
    for version in range(current + 1, SCHEMA_VERSION + 1):
        with db.conn:
            MIGRATIONS[version - 1](db)
            db.execute(f"PRAGMA user_version = {version}")
    return SCHEMA_VERSION
