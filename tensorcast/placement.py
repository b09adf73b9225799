"""Placement decisions as plain functions over plain data (no sockets): which worker to read from
and which to write to."""

from __future__ import annotations

from collections.abc import Iterable

from tensorcast.types import ReplicaInfo, WorkerInfo


def order_sources(
    replicas: Iterable[ReplicaInfo],
    workers: Iterable[WorkerInfo],
    host_id: str,
    exclude_worker_id: str = "",
) -> list[WorkerInfo]:
    """Live workers holding a replica: memory before disk, same host first, then least loaded
    (fewest outgoing transfers, then lowest pool use), ties broken by id so the order is stable."""
    by_id = {w.worker_id: w for w in workers if w.alive}
    in_memory: dict[str, bool] = {}
    for r in replicas:
        if r.worker_id in by_id and r.worker_id != exclude_worker_id:
            in_memory[r.worker_id] = in_memory.get(r.worker_id, False) or r.tier == "cpu"
    return sorted(
        (by_id[w] for w in in_memory),
        key=lambda w: (
            not in_memory[w.worker_id],
            w.host_id != host_id,
            w.active_transfers,
            w.mem_used_bytes / w.mem_cap_bytes if w.mem_cap_bytes else 1.0,
            w.worker_id,
        ),
    )


def order_targets(workers: Iterable[WorkerInfo], host_id: str) -> list[WorkerInfo]:
    """Live workers to write new content to: same host first, then most free memory."""
    return sorted(
        (w for w in workers if w.alive),
        key=lambda w: (w.host_id != host_id, -(w.mem_cap_bytes - w.mem_used_bytes), w.worker_id),
    )
