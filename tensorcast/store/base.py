"""The `MetadataStore` interface every Global Store backend implements.

Contracts: every mutating call is durable when it returns (a restarted store keeps it); times are
passed in (`now`, seconds since the epoch) so the logic is testable without sleeping; unknown ids
raise `NotFound`, conflicting writes `AlreadyExists`, and nothing is changed by a failed call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tensorcast.types import ArtifactInfo, ReplicaInfo, TensorMeta, WorkerInfo


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
