"""Core value types shared by every layer: plain dataclasses, no torch, no protobuf."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tensorcast.errors import InvalidArgument

# safetensors dtype name -> bytes per element. The names are the wire format's.
DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}

# Tensors in a pool region start at this alignment (a cache line; every itemsize divides it).
TENSOR_ALIGN_BYTES = 64

OWNER_SYSTEM = "system"
OWNER_LEASE = "lease"


MAX_TENSOR_NAME_LENGTH = 1024


def check_tensor_name(name: object) -> None:
    """Tensor names become safetensors header keys and CLI output: printable text only."""
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_TENSOR_NAME_LENGTH
        or not name.isprintable()  # control characters, lone surrogates
        or name != name.strip()
        or name == "__metadata__"  # the safetensors header's reserved key
    ):
        raise InvalidArgument(
            f"bad tensor name {name!r}: use 1-{MAX_TENSOR_NAME_LENGTH} printable characters, "
            "no leading or trailing spaces, not '__metadata__'"
        )


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_ITEMSIZE[dtype]


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an artifact. `offset_bytes` is its position inside the artifact's region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int
    offset_bytes: int = 0
    hash_hex: str = ""

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "size_bytes": self.size_bytes,
            "offset_bytes": self.offset_bytes,
            "hash": self.hash_hex,
        }

    @classmethod
    def from_json(cls, data: dict) -> TensorMeta:
        return cls(
            name=data["name"],
            dtype=data["dtype"],
            shape=tuple(data["shape"]),
            size_bytes=data["size_bytes"],
            offset_bytes=data["offset_bytes"],
            hash_hex=data.get("hash", ""),
        )


def pack_layout(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[TensorMeta], int]:
    """Place tensors one after another at aligned offsets; returns metas and the region size."""
    metas = []
    offset = 0
    for name, dtype, shape in specs:
        size_bytes = tensor_nbytes(dtype, shape)
        metas.append(TensorMeta(name, dtype, shape, size_bytes, offset))
        offset = align_up(offset + size_bytes, TENSOR_ALIGN_BYTES)
    return metas, offset


@dataclass(frozen=True)
class Committed:
    """Content a worker accepted: its identity and layout (`deduplicated`: it existed already)."""

    content_id: str
    size_bytes: int
    tensors: tuple[TensorMeta, ...]
    deduplicated: bool


@dataclass(frozen=True)
class ReplicaInfo:
    worker_id: str
    tier: str = "cpu"
    pinned: bool = False


@dataclass(frozen=True)
class ArtifactInfo:
    """What the Global Store knows about an artifact."""

    art_id: str
    content_id: str
    owner: str
    size_bytes: int
    tensors: tuple[TensorMeta, ...]
    created_at: float
    expires_at: float | None = None
    parent: str = ""
    replicas: tuple[ReplicaInfo, ...] = field(default_factory=tuple)
    # How many tensors; a summary (a listing page without tensors) carries only this.
    num_tensors: int = 0

    def __post_init__(self) -> None:
        if self.tensors and not self.num_tensors:
            object.__setattr__(self, "num_tensors", len(self.tensors))

    def to_json(self) -> dict:
        return {
            "art_id": self.art_id,
            "content_id": self.content_id,
            "owner": self.owner,
            "size_bytes": self.size_bytes,
            "num_tensors": self.num_tensors,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "parent": self.parent or None,
            "replicas": [
                {"worker_id": r.worker_id, "tier": r.tier, "pinned": r.pinned}
                for r in self.replicas
            ],
        }

    def to_wire(self) -> dict:
        """Everything, as JSON (the same-host socket's replies); `from_wire` reads it back."""
        return {**self.to_json(), "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def from_wire(cls, data: dict) -> ArtifactInfo:
        return cls(
            art_id=data["art_id"],
            content_id=data["content_id"],
            owner=data["owner"],
            size_bytes=data["size_bytes"],
            tensors=tuple(TensorMeta.from_json(t) for t in data["tensors"]),
            created_at=data["created_at"],
            expires_at=data["expires_at"],
            parent=data["parent"] or "",
            replicas=tuple(
                ReplicaInfo(r["worker_id"], r["tier"], r["pinned"]) for r in data["replicas"]
            ),
            num_tensors=data["num_tensors"],
        )


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as registered in the Global Store, with liveness computed by the store."""

    worker_id: str
    name: str
    addr: str
    host_id: str
    local_socket: str
    roles: tuple[str, ...]
    mem_cap_bytes: int
    mem_used_bytes: int
    pid: int
    registered_at: float
    heartbeat_age_s: float
    alive: bool
    data_addr: str = ""
    active_transfers: int = 0
    transfer_bytes_total: int = 0
    disk_used_bytes: int = 0
    num_replicas: int = 0

    def to_json(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "name": self.name,
            "addr": self.addr,
            "host_id": self.host_id,
            "roles": list(self.roles),
            "mem_cap_bytes": self.mem_cap_bytes,
            "mem_used_bytes": self.mem_used_bytes,
            "pid": self.pid,
            "heartbeat_age_s": round(self.heartbeat_age_s, 3),
            "alive": self.alive,
            "data_addr": self.data_addr,
            "active_transfers": self.active_transfers,
            "transfer_bytes_total": self.transfer_bytes_total,
            "disk_used_bytes": self.disk_used_bytes,
            "num_replicas": self.num_replicas,
        }


@dataclass(frozen=True)
class ShardLease:
    """Who homes a KV shard. `token` grows on every change of holder (fencing)."""

    shard: int
    holder_worker_id: str
    token: int
    expires_in_s: float
    holder_addr: str = ""
    holder_local_socket: str = ""
    holder_host_id: str = ""

    @property
    def held(self) -> bool:
        return bool(self.holder_worker_id) and self.expires_in_s > 0

    def to_json(self) -> dict:
        return {
            "shard": self.shard,
            "holder_worker_id": self.holder_worker_id or None,
            "token": self.token,
            "expires_in_s": round(self.expires_in_s, 3),
            "held": self.held,
        }


@dataclass(frozen=True)
class ShardTable:
    num_shards: int
    lease_ttl_s: float
    leases: tuple[ShardLease, ...]
    live_homes: tuple[str, ...] = ()

    def lease(self, shard: int) -> ShardLease:
        return self.leases[shard]


@dataclass(frozen=True)
class InstanceInfo:
    """An engine instance attached to a worker, with the load it last reported."""

    instance_id: str
    worker_id: str
    engine: str
    endpoint: str = ""
    waiting: int = 0
    running: int = 0
    cached_tokens: int = 0
    requests: tuple[str, ...] = ()
    heartbeat_age_s: float = 0.0
    alive: bool = True
    worker_name: str = ""

    def to_json(self) -> dict:
        return {
            "instance_id": self.instance_id,
            "worker_id": self.worker_id,
            "worker_name": self.worker_name,
            "engine": self.engine,
            "endpoint": self.endpoint,
            "waiting": self.waiting,
            "running": self.running,
            "cached_tokens": self.cached_tokens,
            "requests": list(self.requests),
            "heartbeat_age_s": round(self.heartbeat_age_s, 3),
            "alive": self.alive,
        }


@dataclass(frozen=True)
class PlanRecord:
    """A plan's outcome recorded under its idempotency key (`result` is the plan result JSON)."""

    idempotency_key: str
    trace_id: str
    status: str  # running | ok | failed
    result: dict
    created_at: float
    finished_at: float = 0.0
    deadline_at: float = 0.0
    run_id: str = ""  # one claim of the key (see BeginPlan)

    def to_json(self) -> dict:
        return {
            "idempotency_key": self.idempotency_key,
            "trace_id": self.trace_id,
            "status": self.status,
            "created_at": self.created_at,
            "finished_at": self.finished_at or None,
            "duration_s": round(self.finished_at - self.created_at, 4)
            if self.finished_at
            else None,
            "result": self.result,
        }
