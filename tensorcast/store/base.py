"""The `MetadataStore` interface every Global Store backend implements.

Contracts: every mutating call is durable when it returns (a restarted store keeps it); times are
passed in (`now`, seconds since the epoch) so the logic is testable without sleeping; unknown ids
raise `NotFound`, conflicting writes `AlreadyExists`, and nothing is changed by a failed call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tensorcast.errors import AlreadyExists, InvalidArgument, TensorcastError
from tensorcast.types import (
    OWNER_LEASE,
    OWNER_SYSTEM,
    ArtifactInfo,
    InstanceInfo,
    PlanRecord,
    ReplicaInfo,
    ShardTable,
    TensorMeta,
    WorkerInfo,
    check_tensor_name,
)

# A heartbeat's inventory was taken before it was sent: replica rows newer than this are kept
# even when missing from it (explicit RemoveReplica calls are immediate).
RECONCILE_GRACE_S = 10.0
REPLICA_TIERS = ("cpu", "disk", "file")
# Dead workers stay listed (as dead) this long, so `tc status` can show them.
DEAD_WORKER_RETENTION_S = 600.0
MAX_ID_LENGTH = 512
MAX_LEASE_TTL_S = 366 * 24 * 3600.0  # a year
DEFAULT_NUM_SHARDS = 16
MAX_SHARDS = 4096
MAX_PLANS_LISTED = 1000
# One ListArtifacts page holds at most this many artifacts (callers page with `after`).
MAX_PAGE = 1000
# One PutArtifacts / DeleteArtifacts batch holds at most this many artifacts.
MAX_BATCH = 10_000
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


ReplicaKey = tuple[str, str]  # (content_id, tier) of one worker's replica


@dataclass(frozen=True)
class Inventory:
    """The replicas a heartbeat reports, (content_id, tier) -> pinned.

    `base_epoch` 0: `held` is everything the worker holds, and the store forgets the rest.
    Otherwise `held` (new or re-pinned replicas) and `removed` are what changed since the
    inventory the store acknowledged at `base_epoch`; the store applies them only if that is
    the epoch it recorded last, else it asks for everything (`BeatResult.resync`). A worker
    holding 10,000 contents so sends what changed, not 10,000 ids a second."""

    epoch: int = 0
    held: Mapping[ReplicaKey, bool] = field(default_factory=dict)
    removed: frozenset[ReplicaKey] = frozenset()
    base_epoch: int = 0

    @property
    def is_full(self) -> bool:
        return self.base_epoch == 0

    @classmethod
    def of(
        cls,
        cpu: Iterable[str] = (),
        pinned: Iterable[str] = (),
        disk: Iterable[str] = (),
        file: Iterable[str] = (),
        epoch: int = 0,
        base_epoch: int = 0,
        removed: Iterable[ReplicaKey] = (),
    ) -> Inventory:
        """An inventory from per-tier content ids (`pinned`: every tier of those contents)."""
        pins = frozenset(pinned)
        held = {
            (c, tier): c in pins
            for tier, ids in zip(REPLICA_TIERS, (cpu, disk, file), strict=True)
            for c in ids
        }
        return cls(epoch, held, frozenset(removed), base_epoch)


@dataclass(frozen=True)
class BeatResult:
    """A heartbeat's answer: contents the worker should drop (no artifact names them), whether
    the store could not apply a delta inventory (send the full one), and the removals it kept
    for now (rows younger than RECONCILE_GRACE_S: report them removed again)."""

    drop_content_ids: list[str]
    resync: bool = False
    kept: frozenset[ReplicaKey] = frozenset()


@dataclass(frozen=True)
class NewReplica:
    """A content a worker has just committed to its pool, to be recorded with a batch."""

    content_id: str
    size_bytes: int
    tensors: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class NewArtifact:
    """An artifact to create: `content_id` is a `NewReplica` of the same batch or a content the
    store knows already."""

    art_id: str
    content_id: str
    owner: str
    ttl_s: float = 0.0
    parent: str = ""


@dataclass(frozen=True)
class PutResult:
    """What `put_artifacts` did: each artifact in request order with whether it existed already
    (same id, same content: nothing changed), and the contents whose replica on this worker was
    not recorded because another live worker holds them (the worker frees its copy)."""

    artifacts: tuple[tuple[ArtifactInfo, bool], ...]
    redundant: tuple[str, ...] = ()


@dataclass(frozen=True)
class PutOp:
    """`put_artifacts` as one operation of a `run_batch`."""

    worker_id: str
    replicas: tuple[NewReplica, ...]
    artifacts: tuple[NewArtifact, ...]


@dataclass(frozen=True)
class GetOp:
    """`get_artifact` as one operation of a `run_batch`."""

    art_id: str


@dataclass(frozen=True)
class DeleteOp:
    """`delete_artifacts` as one operation of a `run_batch`."""

    art_ids: tuple[str, ...]
    missing_ok: bool = False


StoreOp = PutOp | GetOp | DeleteOp
# What an operation gave: PutResult, ArtifactInfo, a count of deleted artifacts, or its error.
OpResult = PutResult | ArtifactInfo | int | TensorcastError


def run_each(store: MetadataStore, ops: list[StoreOp], now: float) -> list[OpResult]:
    """`run_batch` for a backend without group commit: one operation after the other."""
    results: list[OpResult] = []
    for op in ops:
        try:
            if isinstance(op, PutOp):
                results.append(
                    store.put_artifacts(op.worker_id, list(op.replicas), list(op.artifacts), now)
                )
            elif isinstance(op, GetOp):
                results.append(store.get_artifact(op.art_id, now))
            else:
                results.append(store.delete_artifacts(list(op.art_ids), now, op.missing_ok))
        except TensorcastError as e:
            results.append(e)
    return results


def member(index: int, art_id: str, size: int = 2) -> str:
    """How an error names the member of a batch of `size` it is about (one of one: the
    artifact)."""
    return f"batch member {index} ({art_id!r})" if size > 1 else f"artifact {art_id!r}"


def check_batch(replicas: list[NewReplica], artifacts: list[NewArtifact]) -> dict[str, NewReplica]:
    """Everything about a batch that needs no records: ids, owners, leases, tensor names, one
    content per id. Raises InvalidArgument naming the first bad member; returns the replicas by
    content id."""
    if len(artifacts) > MAX_BATCH or len(replicas) > MAX_BATCH:
        raise InvalidArgument(f"a batch holds at most {MAX_BATCH} artifacts; split it")
    by_content = {}
    for r in replicas:
        for t in r.tensors:
            try:
                check_tensor_name(t.name)
            except InvalidArgument as e:
                raise InvalidArgument(f"content {r.content_id}: {e}") from None
        by_content[r.content_id] = r
    seen: dict[str, str] = {}
    for i, a in enumerate(artifacts):
        try:
            validate_art_id(a.art_id)
            check_owner(a.owner, a.ttl_s)
        except InvalidArgument as e:
            raise InvalidArgument(f"{member(i, a.art_id, len(artifacts))}: {e}") from None
        if seen.get(a.art_id, a.content_id) != a.content_id:
            raise InvalidArgument(
                f"{member(i, a.art_id, len(artifacts))}: the batch names this id twice with "
                "different content"
            )
        seen[a.art_id] = a.content_id
    return by_content


def check_same_owner(who: str, existing: str, wanted: str) -> None:
    """A put and a register of one id do not mix: a put's artifact lives until deleted, a
    register's until its lease ends (either answering with the other's was wrong)."""
    if existing != wanted:
        kind = "a lease (tc register)" if existing == OWNER_LEASE else "a system artifact (tc put)"
        raise AlreadyExists(f"{who} already exists as {kind}: delete it first, or choose a new id")


def check_owner(owner: str, ttl_s: float) -> None:
    if owner not in (OWNER_SYSTEM, OWNER_LEASE):
        raise InvalidArgument(f"bad owner {owner!r}: use 'system' or 'lease'")
    if owner == OWNER_LEASE:
        check_lease_ttl(ttl_s)


def check_lease_ttl(ttl_s: float) -> None:
    """A lease is a finite time: an infinite one (or NaN) would print as invalid JSON and
    never expire (a system-owned artifact is the way to keep one)."""
    if not 0 < ttl_s <= MAX_LEASE_TTL_S:
        raise InvalidArgument(
            f"a lease's ttl_s must be > 0 and at most {MAX_LEASE_TTL_S:.0f} s, not {ttl_s}"
        )


def page_limit(limit: int) -> int:
    """A listing's page size: `limit` (0: the most), at most MAX_PAGE."""
    return MAX_PAGE if limit <= 0 else min(limit, MAX_PAGE)


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
        inventory: Inventory,
        now: float,
        active_transfers: int = 0,
        transfer_bytes_total: int = 0,
        disk_used_bytes: int = 0,
    ) -> BeatResult:
        """Record liveness and reconcile the worker's replicas with `inventory`. Contents to
        drop: held ones the store does not know, and ones whose last artifact went since the
        last beat (the store keeps a note per worker that held them)."""
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
    def remove_replica(
        self,
        worker_id: str,
        content_id: str,
        tier: str = "",
        unless_last: bool = False,
        now: float = 0.0,
    ) -> bool:
        """Remove a worker's replica rows; with `unless_last` only while another worker live
        at `now` holds the content too (one transaction). True when rows were removed or
        there were none to remove; False when `unless_last` kept the last copy."""
        ...

    def find_content(self, content_id: str, now: float) -> ContentInfo | None: ...
    def create_artifact(
        self, art_id: str, content_id: str, owner: str, ttl_s: float, parent: str, now: float
    ) -> tuple[ArtifactInfo, bool]: ...
    def put_artifacts(
        self,
        worker_id: str,
        replicas: list[NewReplica],
        artifacts: list[NewArtifact],
        now: float,
    ) -> PutResult:
        """Record `worker_id`'s replicas of new contents and create `artifacts`, all or nothing:
        a bad member (InvalidArgument), an id naming other content (AlreadyExists) or a content
        neither in the batch nor known (NotFound) changes nothing, and the error names the
        member. A replica of a content another live worker holds already is not recorded (it is
        in `redundant`: identical content is stored once). `worker_id` may be "" when the batch
        has no replicas. Readers never see part of a batch."""
        ...

    unreferenced_grace_s: float  # how long a content named by no artifact is kept

    def held_contents(self, content_ids: list[str], now: float, touch: bool = False) -> set[str]:
        """Those of `content_ids` that some live worker holds (a put of them moves no bytes).
        `touch`: those held count as created `now` (kept another unreferenced grace)."""
        ...

    def get_artifact(self, art_id: str, now: float) -> ArtifactInfo: ...
    def list_artifacts(self, prefix: str, now: float) -> list[ArtifactInfo]: ...
    def list_artifact_page(
        self,
        prefix: str,
        after: str,
        limit: int,
        now: float,
        with_tensors: bool = False,
        delimiter: str = "",
    ) -> tuple[list[ArtifactInfo], str]:
        """Up to `limit` (0: MAX_PAGE) live artifacts whose id starts with `prefix` and sorts
        after `after`, by id; returns them and the id to pass as `after` for the next page
        ("" when this is the last). Without `with_tensors`, `tensors` is empty and only
        `num_tensors` tells how many there are (cheap: `tc ls` over many artifacts). With a
        `delimiter`, only ids whose part after `prefix` does not contain it (one level of a
        hierarchy: a model's versions without their tensors)."""
        ...

    def run_batch(self, ops: list[StoreOp], now: float) -> list[OpResult]:
        """Independent operations (different callers' requests a worker coalesced): each
        succeeds or fails on its own (its error is its result) exactly as the method it names
        would; a backend commits the writes together where it can (sqlite: one transaction,
        each in its own savepoint)."""
        ...

    def delete_artifact(self, art_id: str, now: float) -> None: ...
    def delete_artifacts(self, art_ids: list[str], now: float, missing_ok: bool = False) -> int:
        """Delete several artifacts in the order given; returns how many existed. Without
        `missing_ok` an id that does not exist is NotFound and nothing is deleted."""
        ...

    def renew_lease(self, art_id: str, ttl_s: float, now: float) -> ArtifactInfo: ...
    def sweep(self, now: float, judge_workers: bool = True) -> None:
        """Drop expired leases and never-referenced contents, and with `judge_workers` the
        replicas of dead workers (not while they may still be reporting to a store that was
        down: their heartbeats could not land)."""
        ...

    def counts(self) -> tuple[int, int]:
        """(number of artifacts, number of contents)."""
        ...

    def artifacts_by_owner(self, now: float) -> dict[str, int]:
        """Live (unexpired) artifacts per owner, for the metrics page."""
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


def plan_resent(previous: PlanRecord | None, record: PlanRecord) -> bool:
    """`record` is a BeginPlan re-sent for the claim that holds its key (its first reply was
    lost, or the call went to another store member): that claim started, it is no other run."""
    return (
        previous is not None
        and previous.status == "running"
        and bool(record.run_id)
        and previous.run_id == record.run_id
    )


def every_page(store: MetadataStore, prefix: str, now: float) -> list[ArtifactInfo]:
    """`list_artifacts` of either backend: every page of `list_artifact_page`, with tensors."""
    infos, after = store.list_artifact_page(prefix, "", 0, now, with_tensors=True)
    while after:
        page, after = store.list_artifact_page(prefix, after, 0, now, with_tensors=True)
        infos += page
    return infos
