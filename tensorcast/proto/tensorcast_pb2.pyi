from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "size_bytes", "offset_bytes", "hash")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: int
    offset_bytes: int
    hash: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("worker_id", "tier", "pinned")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tier: str
    pinned: bool
    def __init__(self, worker_id: _Optional[str] = ..., tier: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("art_id", "content_id", "owner", "size_bytes", "tensors", "created_at", "expires_at", "parent", "replicas", "num_tensors")
    ART_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    art_id: str
    content_id: str
    owner: str
    size_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    created_at: float
    expires_at: float
    parent: str
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    num_tensors: int
    def __init__(self, art_id: _Optional[str] = ..., content_id: _Optional[str] = ..., owner: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., parent: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("worker_id", "name", "addr", "host_id", "local_socket", "roles", "mem_cap_bytes", "mem_used_bytes", "pid", "registered_at", "heartbeat_age_s", "alive", "data_addr", "active_transfers", "transfer_bytes_total", "disk_used_bytes", "num_replicas")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    MEM_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    addr: str
    host_id: str
    local_socket: str
    roles: _containers.RepeatedScalarFieldContainer[str]
    mem_cap_bytes: int
    mem_used_bytes: int
    pid: int
    registered_at: float
    heartbeat_age_s: float
    alive: bool
    data_addr: str
    active_transfers: int
    transfer_bytes_total: int
    disk_used_bytes: int
    num_replicas: int
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., addr: _Optional[str] = ..., host_id: _Optional[str] = ..., local_socket: _Optional[str] = ..., roles: _Optional[_Iterable[str]] = ..., mem_cap_bytes: _Optional[int] = ..., mem_used_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., registered_at: _Optional[float] = ..., heartbeat_age_s: _Optional[float] = ..., alive: _Optional[bool] = ..., data_addr: _Optional[str] = ..., active_transfers: _Optional[int] = ..., transfer_bytes_total: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., num_replicas: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: Worker
    def __init__(self, worker: _Optional[_Union[Worker, _Mapping]] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("heartbeat_ttl_s",)
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ttl_s: float
    def __init__(self, heartbeat_ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "mem_used_bytes", "content_ids", "pinned_content_ids", "active_transfers", "disk_content_ids", "transfer_bytes_total", "disk_used_bytes", "held_shards", "instances", "file_content_ids", "inventory_epoch", "base_epoch", "removed")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DISK_CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_SHARDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    FILE_CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    mem_used_bytes: int
    content_ids: _containers.RepeatedScalarFieldContainer[str]
    pinned_content_ids: _containers.RepeatedScalarFieldContainer[str]
    active_transfers: int
    disk_content_ids: _containers.RepeatedScalarFieldContainer[str]
    transfer_bytes_total: int
    disk_used_bytes: int
    held_shards: _containers.RepeatedCompositeFieldContainer[ShardLease]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    file_content_ids: _containers.RepeatedScalarFieldContainer[str]
    inventory_epoch: int
    base_epoch: int
    removed: _containers.RepeatedCompositeFieldContainer[ReplicaRef]
    def __init__(self, worker_id: _Optional[str] = ..., mem_used_bytes: _Optional[int] = ..., content_ids: _Optional[_Iterable[str]] = ..., pinned_content_ids: _Optional[_Iterable[str]] = ..., active_transfers: _Optional[int] = ..., disk_content_ids: _Optional[_Iterable[str]] = ..., transfer_bytes_total: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., held_shards: _Optional[_Iterable[_Union[ShardLease, _Mapping]]] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., file_content_ids: _Optional[_Iterable[str]] = ..., inventory_epoch: _Optional[int] = ..., base_epoch: _Optional[int] = ..., removed: _Optional[_Iterable[_Union[ReplicaRef, _Mapping]]] = ...) -> None: ...

class ReplicaRef(_message.Message):
    __slots__ = ("content_id", "tier")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    tier: str
    def __init__(self, content_id: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("drop_content_ids", "shards", "resync", "kept")
    DROP_CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    drop_content_ids: _containers.RepeatedScalarFieldContainer[str]
    shards: ShardTable
    resync: bool
    kept: _containers.RepeatedCompositeFieldContainer[ReplicaRef]
    def __init__(self, drop_content_ids: _Optional[_Iterable[str]] = ..., shards: _Optional[_Union[ShardTable, _Mapping]] = ..., resync: _Optional[bool] = ..., kept: _Optional[_Iterable[_Union[ReplicaRef, _Mapping]]] = ...) -> None: ...

class ShardLease(_message.Message):
    __slots__ = ("shard", "holder_worker_id", "token", "expires_in_s", "holder_addr", "holder_local_socket", "holder_host_id")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    HOLDER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDR_FIELD_NUMBER: _ClassVar[int]
    HOLDER_LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    HOLDER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    shard: int
    holder_worker_id: str
    token: int
    expires_in_s: float
    holder_addr: str
    holder_local_socket: str
    holder_host_id: str
    def __init__(self, shard: _Optional[int] = ..., holder_worker_id: _Optional[str] = ..., token: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., holder_addr: _Optional[str] = ..., holder_local_socket: _Optional[str] = ..., holder_host_id: _Optional[str] = ...) -> None: ...

class ShardTable(_message.Message):
    __slots__ = ("num_shards", "lease_ttl_s", "leases", "live_homes")
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LIVE_HOMES_FIELD_NUMBER: _ClassVar[int]
    num_shards: int
    lease_ttl_s: float
    leases: _containers.RepeatedCompositeFieldContainer[ShardLease]
    live_homes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_shards: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., leases: _Optional[_Iterable[_Union[ShardLease, _Mapping]]] = ..., live_homes: _Optional[_Iterable[str]] = ...) -> None: ...

class AcquireShardsRequest(_message.Message):
    __slots__ = ("worker_id", "shards")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ...) -> None: ...

class HandOffShardRequest(_message.Message):
    __slots__ = ("worker_id", "shard", "token", "to_worker_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shard: int
    token: int
    to_worker_id: str
    def __init__(self, worker_id: _Optional[str] = ..., shard: _Optional[int] = ..., token: _Optional[int] = ..., to_worker_id: _Optional[str] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("instance_id", "worker_id", "engine", "endpoint", "waiting", "running", "cached_tokens", "requests", "heartbeat_age_s", "alive", "worker_name")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    worker_id: str
    engine: str
    endpoint: str
    waiting: int
    running: int
    cached_tokens: int
    requests: _containers.RepeatedScalarFieldContainer[str]
    heartbeat_age_s: float
    alive: bool
    worker_name: str
    def __init__(self, instance_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., engine: _Optional[str] = ..., endpoint: _Optional[str] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., requests: _Optional[_Iterable[str]] = ..., heartbeat_age_s: _Optional[float] = ..., alive: _Optional[bool] = ..., worker_name: _Optional[str] = ...) -> None: ...

class ListInstancesReply(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...

class PlanRecord(_message.Message):
    __slots__ = ("idempotency_key", "trace_id", "status", "result_json", "created_at", "finished_at", "deadline_at", "run_id")
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_AT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    idempotency_key: str
    trace_id: str
    status: str
    result_json: str
    created_at: float
    finished_at: float
    deadline_at: float
    run_id: str
    def __init__(self, idempotency_key: _Optional[str] = ..., trace_id: _Optional[str] = ..., status: _Optional[str] = ..., result_json: _Optional[str] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., deadline_at: _Optional[float] = ..., run_id: _Optional[str] = ...) -> None: ...

class BeginPlanReply(_message.Message):
    __slots__ = ("started", "existing")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    started: bool
    existing: PlanRecord
    def __init__(self, started: _Optional[bool] = ..., existing: _Optional[_Union[PlanRecord, _Mapping]] = ...) -> None: ...

class ListPlansRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListPlansReply(_message.Message):
    __slots__ = ("plans",)
    PLANS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[PlanRecord]
    def __init__(self, plans: _Optional[_Iterable[_Union[PlanRecord, _Mapping]]] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class ListWorkersReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class AddReplicaRequest(_message.Message):
    __slots__ = ("worker_id", "content_id", "size_bytes", "tensors", "tier", "reference")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    content_id: str
    size_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    tier: str
    reference: str
    def __init__(self, worker_id: _Optional[str] = ..., content_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., tier: _Optional[str] = ..., reference: _Optional[str] = ...) -> None: ...

class ListReferencesRequest(_message.Message):
    __slots__ = ("host_id",)
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    def __init__(self, host_id: _Optional[str] = ...) -> None: ...

class FileReferenceRecord(_message.Message):
    __slots__ = ("content_id", "spec")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    spec: str
    def __init__(self, content_id: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class ListReferencesReply(_message.Message):
    __slots__ = ("references",)
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    references: _containers.RepeatedCompositeFieldContainer[FileReferenceRecord]
    def __init__(self, references: _Optional[_Iterable[_Union[FileReferenceRecord, _Mapping]]] = ...) -> None: ...

class RemoveReplicaRequest(_message.Message):
    __slots__ = ("worker_id", "content_id", "tier", "unless_last")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    UNLESS_LAST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    content_id: str
    tier: str
    unless_last: bool
    def __init__(self, worker_id: _Optional[str] = ..., content_id: _Optional[str] = ..., tier: _Optional[str] = ..., unless_last: _Optional[bool] = ...) -> None: ...

class RemoveReplicaReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class FindContentRequest(_message.Message):
    __slots__ = ("content_id",)
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    def __init__(self, content_id: _Optional[str] = ...) -> None: ...

class FindContentReply(_message.Message):
    __slots__ = ("exists", "replicas", "tensors")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, exists: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class CreateArtifactRequest(_message.Message):
    __slots__ = ("art_id", "content_id", "owner", "ttl_s", "parent")
    ART_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    art_id: str
    content_id: str
    owner: str
    ttl_s: float
    parent: str
    def __init__(self, art_id: _Optional[str] = ..., content_id: _Optional[str] = ..., owner: _Optional[str] = ..., ttl_s: _Optional[float] = ..., parent: _Optional[str] = ...) -> None: ...

class CreateArtifactReply(_message.Message):
    __slots__ = ("artifact", "existed")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    artifact: Artifact
    existed: bool
    def __init__(self, artifact: _Optional[_Union[Artifact, _Mapping]] = ..., existed: _Optional[bool] = ...) -> None: ...

class ArtifactRequest(_message.Message):
    __slots__ = ("art_id",)
    ART_ID_FIELD_NUMBER: _ClassVar[int]
    art_id: str
    def __init__(self, art_id: _Optional[str] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("art_id", "ttl_s")
    ART_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    art_id: str
    ttl_s: float
    def __init__(self, art_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("prefix", "after", "limit", "summary", "delimiter")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DELIMITER_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    after: str
    limit: int
    summary: bool
    delimiter: str
    def __init__(self, prefix: _Optional[str] = ..., after: _Optional[str] = ..., limit: _Optional[int] = ..., summary: _Optional[bool] = ..., delimiter: _Optional[str] = ...) -> None: ...

class ListArtifactsReply(_message.Message):
    __slots__ = ("artifacts", "next_after")
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    next_after: str
    def __init__(self, artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class NewReplica(_message.Message):
    __slots__ = ("content_id", "size_bytes", "tensors")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    size_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, content_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class NewArtifact(_message.Message):
    __slots__ = ("art_id", "content_id", "owner", "ttl_s", "parent")
    ART_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    art_id: str
    content_id: str
    owner: str
    ttl_s: float
    parent: str
    def __init__(self, art_id: _Optional[str] = ..., content_id: _Optional[str] = ..., owner: _Optional[str] = ..., ttl_s: _Optional[float] = ..., parent: _Optional[str] = ...) -> None: ...

class PutArtifactsRequest(_message.Message):
    __slots__ = ("worker_id", "replicas", "artifacts", "brief")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    replicas: _containers.RepeatedCompositeFieldContainer[NewReplica]
    artifacts: _containers.RepeatedCompositeFieldContainer[NewArtifact]
    brief: bool
    def __init__(self, worker_id: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[NewReplica, _Mapping]]] = ..., artifacts: _Optional[_Iterable[_Union[NewArtifact, _Mapping]]] = ..., brief: _Optional[bool] = ...) -> None: ...

class PutArtifactsReply(_message.Message):
    __slots__ = ("artifacts", "existed", "redundant_content_ids")
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    REDUNDANT_CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    existed: _containers.RepeatedScalarFieldContainer[bool]
    redundant_content_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., existed: _Optional[_Iterable[bool]] = ..., redundant_content_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteArtifactsRequest(_message.Message):
    __slots__ = ("art_ids", "missing_ok")
    ART_IDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    art_ids: _containers.RepeatedScalarFieldContainer[str]
    missing_ok: bool
    def __init__(self, art_ids: _Optional[_Iterable[str]] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class DeleteArtifactsReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class HeldContentsRequest(_message.Message):
    __slots__ = ("content_ids", "touch")
    CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOUCH_FIELD_NUMBER: _ClassVar[int]
    content_ids: _containers.RepeatedScalarFieldContainer[str]
    touch: bool
    def __init__(self, content_ids: _Optional[_Iterable[str]] = ..., touch: _Optional[bool] = ...) -> None: ...

class HeldContentsReply(_message.Message):
    __slots__ = ("content_ids", "unreferenced_grace_s")
    CONTENT_IDS_FIELD_NUMBER: _ClassVar[int]
    UNREFERENCED_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    content_ids: _containers.RepeatedScalarFieldContainer[str]
    unreferenced_grace_s: float
    def __init__(self, content_ids: _Optional[_Iterable[str]] = ..., unreferenced_grace_s: _Optional[float] = ...) -> None: ...

class StoreOp(_message.Message):
    __slots__ = ("put", "get", "delete")
    PUT_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    put: PutArtifactsRequest
    get: ArtifactRequest
    delete: DeleteArtifactsRequest
    def __init__(self, put: _Optional[_Union[PutArtifactsRequest, _Mapping]] = ..., get: _Optional[_Union[ArtifactRequest, _Mapping]] = ..., delete: _Optional[_Union[DeleteArtifactsRequest, _Mapping]] = ...) -> None: ...

class StoreOpResult(_message.Message):
    __slots__ = ("put", "get", "delete", "error_kind", "error")
    PUT_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    put: PutArtifactsReply
    get: Artifact
    delete: DeleteArtifactsReply
    error_kind: str
    error: str
    def __init__(self, put: _Optional[_Union[PutArtifactsReply, _Mapping]] = ..., get: _Optional[_Union[Artifact, _Mapping]] = ..., delete: _Optional[_Union[DeleteArtifactsReply, _Mapping]] = ..., error_kind: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[StoreOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[StoreOp, _Mapping]]] = ...) -> None: ...

class BatchReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StoreOpResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StoreOpResult, _Mapping]]] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("version", "schema_version", "uptime_s", "db_path", "heartbeat_ttl_s", "num_artifacts", "num_contents", "backend_members", "frame_port", "settling_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DB_PATH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    SETTLING_S_FIELD_NUMBER: _ClassVar[int]
    version: str
    schema_version: int
    uptime_s: float
    db_path: str
    heartbeat_ttl_s: float
    num_artifacts: int
    num_contents: int
    backend_members: _containers.RepeatedCompositeFieldContainer[BackendMember]
    frame_port: int
    settling_s: float
    def __init__(self, version: _Optional[str] = ..., schema_version: _Optional[int] = ..., uptime_s: _Optional[float] = ..., db_path: _Optional[str] = ..., heartbeat_ttl_s: _Optional[float] = ..., num_artifacts: _Optional[int] = ..., num_contents: _Optional[int] = ..., backend_members: _Optional[_Iterable[_Union[BackendMember, _Mapping]]] = ..., frame_port: _Optional[int] = ..., settling_s: _Optional[float] = ...) -> None: ...

class BackendMember(_message.Message):
    __slots__ = ("addr", "healthy", "detail")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    addr: str
    healthy: bool
    detail: str
    def __init__(self, addr: _Optional[str] = ..., healthy: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker", "num_contents", "num_holds", "store_addr", "pages", "page_bytes", "page_region_bytes", "page_uncommitted_bytes")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOLDS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDR_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_UNCOMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker: Worker
    num_contents: int
    num_holds: int
    store_addr: str
    pages: int
    page_bytes: int
    page_region_bytes: int
    page_uncommitted_bytes: int
    def __init__(self, worker: _Optional[_Union[Worker, _Mapping]] = ..., num_contents: _Optional[int] = ..., num_holds: _Optional[int] = ..., store_addr: _Optional[str] = ..., pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., page_region_bytes: _Optional[int] = ..., page_uncommitted_bytes: _Optional[int] = ...) -> None: ...

class SliceSpec(_message.Message):
    __slots__ = ("tensor", "start", "stop", "step")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    step: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensor: _Optional[str] = ..., start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ..., step: _Optional[_Iterable[int]] = ...) -> None: ...

class ViewRequest(_message.Message):
    __slots__ = ("content_id", "slices")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    slices: _containers.RepeatedCompositeFieldContainer[SliceSpec]
    def __init__(self, content_id: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[SliceSpec, _Mapping]]] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("content_id", "size_bytes", "tensors", "deduplicated")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    size_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    deduplicated: bool
    def __init__(self, content_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., deduplicated: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset_bytes", "data", "hash")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    data: bytes
    hash: str
    def __init__(self, offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., hash: _Optional[str] = ...) -> None: ...

class WriteMessage(_message.Message):
    __slots__ = ("tensors", "size_bytes", "chunk")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    size_bytes: int
    chunk: Chunk
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., size_bytes: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class OpenTransferRequest(_message.Message):
    __slots__ = ("content_id", "ttl_ms", "relay")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    ttl_ms: int
    relay: bool
    def __init__(self, content_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., relay: _Optional[bool] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("ticket", "offset_bytes", "size_bytes", "data_addr", "tensors")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    offset_bytes: int
    size_bytes: int
    data_addr: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, ticket: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., data_addr: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class CloseTransferRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    def __init__(self, ticket: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("content_id", "timeout_ms", "streams", "relay_from", "chain")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FROM_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    timeout_ms: int
    streams: int
    relay_from: str
    chain: bool
    def __init__(self, content_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., streams: _Optional[int] = ..., relay_from: _Optional[str] = ..., chain: _Optional[bool] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("already_present", "bytes_moved", "source_worker_id", "elapsed_s", "retries")
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    already_present: bool
    bytes_moved: int
    source_worker_id: str
    elapsed_s: float
    retries: int
    def __init__(self, already_present: _Optional[bool] = ..., bytes_moved: _Optional[int] = ..., source_worker_id: _Optional[str] = ..., elapsed_s: _Optional[float] = ..., retries: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("content_id", "pinned")
    CONTENT_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    content_id: str
    pinned: bool
    def __init__(self, content_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("plan_json",)
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    def __init__(self, plan_json: _Optional[str] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("result_json",)
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    result_json: str
    def __init__(self, result_json: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("trace_id", "step_json", "timeout_ms")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    step_json: str
    timeout_ms: int
    def __init__(self, trace_id: _Optional[str] = ..., step_json: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("result_json",)
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    result_json: str
    def __init__(self, result_json: _Optional[str] = ...) -> None: ...

class Page(_message.Message):
    __slots__ = ("key", "shard", "token", "dtype", "shape", "data", "hash")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    key: str
    shard: int
    token: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    hash: str
    def __init__(self, key: _Optional[str] = ..., shard: _Optional[int] = ..., token: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., hash: _Optional[str] = ...) -> None: ...

class PutPagesRequest(_message.Message):
    __slots__ = ("pages", "ttl_s", "if_absent")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[Page]
    ttl_s: float
    if_absent: bool
    def __init__(self, pages: _Optional[_Iterable[_Union[Page, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., if_absent: _Optional[bool] = ...) -> None: ...

class PageKey(_message.Message):
    __slots__ = ("key", "shard", "token")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    key: str
    shard: int
    token: int
    def __init__(self, key: _Optional[str] = ..., shard: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class PageKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[PageKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[PageKey, _Mapping]]] = ...) -> None: ...

class PagesReply(_message.Message):
    __slots__ = ("pages", "served")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[Page]
    served: int
    def __init__(self, pages: _Optional[_Iterable[_Union[Page, _Mapping]]] = ..., served: _Optional[int] = ...) -> None: ...

class ExistsReply(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class InstanceMessage(_message.Message):
    __slots__ = ("hello", "call_id", "result_json", "error_kind", "error_message")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    hello: Instance
    call_id: int
    result_json: str
    error_kind: str
    error_message: str
    def __init__(self, hello: _Optional[_Union[Instance, _Mapping]] = ..., call_id: _Optional[int] = ..., result_json: _Optional[str] = ..., error_kind: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class InstanceCommand(_message.Message):
    __slots__ = ("call_id", "op", "args_json", "timeout_ms", "trace_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    op: str
    args_json: str
    timeout_ms: int
    trace_id: str
    def __init__(self, call_id: _Optional[int] = ..., op: _Optional[str] = ..., args_json: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., trace_id: _Optional[str] = ...) -> None: ...
