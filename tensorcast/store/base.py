"""The `MetadataStore` interface every Global Store backend implements.

Contracts: every mutating call is durable when it returns (a restarted store keeps it); times are
passed in (`now`, seconds since the epoch) so the logic is testable without sleeping; unknown ids
raise `NotFound`, conflicting writes `AlreadyExists`, and nothing is changed by a failed call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tensorcast.errors import InvalidArgument
from tensorcast.types import (
    ArtifactInfo,
    InstanceInfo,
    PlanRecord,
    ReplicaInfo,
    ShardTable,
    TensorMeta,
    WorkerInfo,
)

# A heartbeat's inventory was taken before it was sent: replica rows newer than this are kept
# even when missing from it (explicit RemoveReplica calls are immediate).
RECONCILE_GRACE_S = 10.0
# Dead workers stay listed (as dead) this long, so `tc status` can show them.
DEAD_WORKER_RETENTION_S = 600.0
MAX_ID_LENGTH = 512
DEFAULT_NUM_SHARDS = 16
MAX_SHARDS = 4096
MAX_PLANS_LISTED = 1000
# Finished plan records are kept this long (the idempotency window).
PLAN_RETENTION_S = 24 * 3600.0
SHARD_HOME_ROLE = "shard-home"


def validate_art_id(art_id: str) -> None:
    if (
        not art_id
        or len(art_id) > MAX_ID_LENGTH
        or not art_id.isprintable()
        or art_id != art_id.strip()
    ):
        raise InvalidArgument(
            f"bad artifact id {art_id!r}: use 1-{MAX_ID_LENGTH} printable characters, "
            "no leading or trailing spaces"
        )


def check_same_layout(
    content_id: str, stored: list[TensorMeta], claimed: tuple[TensorMeta, ...]
) -> None:
    def key(ts) -> list:
        return sorted((t.name, t.dtype, tuple(t.shape), t.offset_bytes) for t in ts)

    if key(stored) != key(claimed):
        raise InvalidArgument(f"content {content_id}: replica layout differs from the recorded one")


def check_num_shards(requested: int | None) -> None:
    if requested is not None and not 1 <= requested <= MAX_SHARDS:
        raise InvalidArgument(f"--shards must be in [1, {MAX_SHARDS}], not {requested}")


def fixed_num_shards(stored: int, requested: int | None) -> int:
    """The shard count is fixed at the first start: changing it would re-key every page."""
    if requested is not None and requested != stored:
        raise InvalidArgument(
            f"this store was created with {stored} shards; it cannot change to "
            f"{requested} (pages are keyed by shard). Use a new store for a new count."
        )
    return stored


@dataclass(frozen=True)
class WorkerRegistration:
    worker_id: str
    name: str
    addr: str
    host_id: str
    local_socket: str
    roles: tuple[str, ...]
    mem_cap_bytes: int
    pid: int
    data_addr: str = ""


@dataclass(frozen=True)
class ContentInfo:
    content_id: str
    size_bytes: int
    tensors: tuple[TensorMeta, ...]
    replicas: tuple[ReplicaInfo, ...]


class MetadataStore(Protocol):
    def register_worker(self, reg: WorkerRegistration, now: float) -> None: ...
    def deregister_worker(self, worker_id: str) -> None: ...
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
        """Record liveness and reconcile the worker's inventory; returns contents to drop."""
        ...

    def list_workers(self, now: float) -> list[WorkerInfo]: ...
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
        """Record a replica. A "file" replica (by reference) may carry tensors without hashes;
        the first replica with hashes fills them in, and from then on they are the truth."""

    def list_references(self, host_id: str) -> list[tuple[str, str]]: ...
    def remove_replica(self, worker_id: str, content_id: str, tier: str = "") -> None: ...
    def find_content(self, content_id: str, now: float) -> ContentInfo | None: ...
    def create_artifact(
        self, art_id: str, content_id: str, owner: str, ttl_s: float, parent: str, now: float
    ) -> tuple[ArtifactInfo, bool]: ...
    def get_artifact(self, art_id: str, now: float) -> ArtifactInfo: ...
    def list_artifacts(self, prefix: str, now: float) -> list[ArtifactInfo]: ...
    def delete_artifact(self, art_id: str, now: float) -> None: ...
    def renew_lease(self, art_id: str, ttl_s: float, now: float) -> ArtifactInfo: ...
    def sweep(self, now: float) -> None:
        """Drop replicas of dead workers, expired leases and never-referenced contents."""
        ...

    def counts(self) -> tuple[int, int]:
        """(number of artifacts, number of contents)."""
        ...

    def describe(self) -> str:
        """Where the records live (a sqlite path, etcd endpoints), for `tc status`."""
        ...

    def members(self) -> list[tuple[str, bool, str]]:
        """(address, healthy, detail) of each member of a replicated backend; [] for one file."""
        ...

    def close(self) -> None: ...


class Coordination(Protocol):
    """Shard leases with fencing tokens, instances, plan results by idempotency key.

    A shard's fencing token grows on every change of holder and never goes back (a restarted or
    replicated store keeps it); a lease is granted to the first shard-home worker asking while
    the shard is free or expired. `begin_plan` claims a key atomically: at most one run of a
    key is live at a time.
    """

    num_shards: int

    def shard_table(self, now: float) -> ShardTable: ...
    def acquire_shards(self, worker_id: str, shards: list[int], now: float) -> ShardTable: ...
    def hand_off_shard(
        self, worker_id: str, shard: int, token: int, to_worker_id: str, now: float
    ) -> ShardTable: ...
    def renew_shards(self, worker_id: str, held: list[tuple[int, int]], now: float) -> None: ...
    def release_shards(self, worker_id: str) -> None: ...
    def report_instances(
        self, worker_id: str, instances: list[InstanceInfo], now: float
    ) -> None: ...
    def list_instances(self, now: float) -> list[InstanceInfo]: ...
    def begin_plan(self, record: PlanRecord, now: float) -> tuple[bool, PlanRecord | None]: ...
    def finish_plan(self, record: PlanRecord, now: float) -> None: ...
    def get_plan(self, key: str) -> PlanRecord: ...
    def list_plans(self, limit: int) -> list[PlanRecord]: ...
    def sweep(self, now: float) -> None: ...
