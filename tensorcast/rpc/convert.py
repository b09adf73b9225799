"""Protobuf <-> core dataclasses. Protobuf objects stay in services and clients."""

from __future__ import annotations

import json
from collections.abc import Iterable

from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.types import (
    ArtifactInfo,
    InstanceInfo,
    PlanRecord,
    ReplicaInfo,
    ShardLease,
    ShardTable,
    TensorMeta,
    WorkerInfo,
)


def tensor_to_pb(t: TensorMeta) -> pb.TensorMeta:
    return pb.TensorMeta(
        name=t.name,
        dtype=t.dtype,
        shape=list(t.shape),
        size_bytes=t.size_bytes,
        offset_bytes=t.offset_bytes,
        hash=t.hash_hex,
    )


def tensor_from_pb(m: pb.TensorMeta) -> TensorMeta:
    return TensorMeta(m.name, m.dtype, tuple(m.shape), m.size_bytes, m.offset_bytes, m.hash)


def tensors_from_pb(ms: Iterable[pb.TensorMeta]) -> tuple[TensorMeta, ...]:
    return tuple(tensor_from_pb(m) for m in ms)


def replica_to_pb(r: ReplicaInfo) -> pb.Replica:
    return pb.Replica(worker_id=r.worker_id, tier=r.tier, pinned=r.pinned)


def replica_from_pb(m: pb.Replica) -> ReplicaInfo:
    return ReplicaInfo(m.worker_id, m.tier, m.pinned)


def artifact_to_pb(a: ArtifactInfo, with_tensors: bool = True) -> pb.Artifact:
    return pb.Artifact(
        art_id=a.art_id,
        content_id=a.content_id,
        owner=a.owner,
        size_bytes=a.size_bytes,
        tensors=[tensor_to_pb(t) for t in a.tensors] if with_tensors else [],
        created_at=a.created_at,
        expires_at=a.expires_at or 0.0,
        parent=a.parent,
        replicas=[replica_to_pb(r) for r in a.replicas],
        num_tensors=a.num_tensors,
    )


def artifact_from_pb(m: pb.Artifact) -> ArtifactInfo:
    return ArtifactInfo(
        art_id=m.art_id,
        content_id=m.content_id,
        owner=m.owner,
        size_bytes=m.size_bytes,
        tensors=tensors_from_pb(m.tensors),
        created_at=m.created_at,
        expires_at=m.expires_at or None,
        parent=m.parent,
        replicas=tuple(replica_from_pb(r) for r in m.replicas),
        num_tensors=m.num_tensors,
    )


def worker_to_pb(w: WorkerInfo) -> pb.Worker:
    return pb.Worker(
        worker_id=w.worker_id,
        name=w.name,
        addr=w.addr,
        host_id=w.host_id,
        local_socket=w.local_socket,
        roles=list(w.roles),
        mem_cap_bytes=w.mem_cap_bytes,
        mem_used_bytes=w.mem_used_bytes,
        pid=w.pid,
        registered_at=w.registered_at,
        heartbeat_age_s=w.heartbeat_age_s,
        alive=w.alive,
        data_addr=w.data_addr,
        active_transfers=w.active_transfers,
        transfer_bytes_total=w.transfer_bytes_total,
        disk_used_bytes=w.disk_used_bytes,
        num_replicas=w.num_replicas,
    )


def worker_from_pb(m: pb.Worker) -> WorkerInfo:
    return WorkerInfo(
        worker_id=m.worker_id,
        name=m.name,
        addr=m.addr,
        host_id=m.host_id,
        local_socket=m.local_socket,
        roles=tuple(m.roles),
        mem_cap_bytes=m.mem_cap_bytes,
        mem_used_bytes=m.mem_used_bytes,
        pid=m.pid,
        registered_at=m.registered_at,
        heartbeat_age_s=m.heartbeat_age_s,
        alive=m.alive,
        data_addr=m.data_addr,
        active_transfers=m.active_transfers,
        transfer_bytes_total=m.transfer_bytes_total,
        disk_used_bytes=m.disk_used_bytes,
        num_replicas=m.num_replicas,
    )


def instance_to_pb(i: InstanceInfo) -> pb.Instance:
    return pb.Instance(
        instance_id=i.instance_id,
        worker_id=i.worker_id,
        engine=i.engine,
        endpoint=i.endpoint,
        waiting=i.waiting,
        running=i.running,
        cached_tokens=i.cached_tokens,
        requests=list(i.requests),
        heartbeat_age_s=i.heartbeat_age_s,
        alive=i.alive,
        worker_name=i.worker_name,
    )


def instance_from_pb(m: pb.Instance) -> InstanceInfo:
    return InstanceInfo(
        instance_id=m.instance_id,
        worker_id=m.worker_id,
        engine=m.engine,
        endpoint=m.endpoint,
        waiting=m.waiting,
        running=m.running,
        cached_tokens=m.cached_tokens,
        requests=tuple(m.requests),
        heartbeat_age_s=m.heartbeat_age_s,
        alive=m.alive,
        worker_name=m.worker_name,
    )


def shard_table_to_pb(t: ShardTable) -> pb.ShardTable:
    return pb.ShardTable(
        num_shards=t.num_shards,
        lease_ttl_s=t.lease_ttl_s,
        leases=[
            pb.ShardLease(
                shard=lease.shard,
                holder_worker_id=lease.holder_worker_id,
                token=lease.token,
                expires_in_s=lease.expires_in_s,
                holder_addr=lease.holder_addr,
                holder_local_socket=lease.holder_local_socket,
                holder_host_id=lease.holder_host_id,
            )
            for lease in t.leases
        ],
        live_homes=list(t.live_homes),
    )


def shard_table_from_pb(m: pb.ShardTable) -> ShardTable:
    return ShardTable(
        num_shards=m.num_shards,
        lease_ttl_s=m.lease_ttl_s,
        leases=tuple(
            ShardLease(
                lease.shard,
                lease.holder_worker_id,
                lease.token,
                lease.expires_in_s,
                lease.holder_addr,
                lease.holder_local_socket,
                lease.holder_host_id,
            )
            for lease in m.leases
        ),
        live_homes=tuple(m.live_homes),
    )


def plan_to_pb(p: PlanRecord) -> pb.PlanRecord:
    return pb.PlanRecord(
        idempotency_key=p.idempotency_key,
        trace_id=p.trace_id,
        status=p.status,
        result_json=json.dumps(p.result),
        created_at=p.created_at,
        finished_at=p.finished_at,
        deadline_at=p.deadline_at,
        run_id=p.run_id,
    )


def plan_from_pb(m: pb.PlanRecord) -> PlanRecord:
    return PlanRecord(
        idempotency_key=m.idempotency_key,
        trace_id=m.trace_id,
        status=m.status,
        result=json.loads(m.result_json or "{}"),
        created_at=m.created_at,
        finished_at=m.finished_at,
        deadline_at=m.deadline_at,
        run_id=m.run_id,
    )
