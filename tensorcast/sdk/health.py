"""Cluster health as `tc status` reports it: each component healthy, dead or unreachable."""

from __future__ import annotations

from dataclasses import dataclass

from tensorcast.errors import TensorcastError
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.sdk.runtime import Runtime

PING_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ComponentHealth:
    role: str
    name: str
    addr: str
    state: str  # "healthy" | "dead" | "unreachable"
    heartbeat_age_s: float | None
    detail: str = ""

    def to_json(self) -> dict:
        return {
            "role": self.role,
            "name": self.name,
            "addr": self.addr,
            "state": self.state,
            "heartbeat_age_s": None
            if self.heartbeat_age_s is None
            else round(self.heartbeat_age_s, 3),
            "detail": self.detail,
        }


def cluster_health(rt: Runtime) -> list[ComponentHealth]:
    """Every Global Store member the caller knows, the etcd members behind them (as the first
    store that answers sees them), and every worker."""
    out = []
    backend: list[pb.BackendMember] = []
    members = rt.store.members()
    for i, (addr, stub) in enumerate(members):
        name = "store" if len(members) == 1 else f"store-{i + 1}"
        try:
            status = stub.call("Status", pb.Empty(), timeout_s=PING_TIMEOUT_S)
        except TensorcastError as e:
            out.append(ComponentHealth("store", name, addr, "unreachable", None, str(e)))
            continue
        backend = backend or list(status.backend_members)
        out.append(
            ComponentHealth(
                "store",
                name,
                addr,
                "healthy",
                None,
                f"{status.db_path}, {status.num_artifacts} artifacts, up {status.uptime_s:.0f}s",
            )
        )
    for i, m in enumerate(backend):
        state = "healthy" if m.healthy else "unreachable"
        out.append(ComponentHealth("etcd", f"etcd-{i + 1}", m.addr, state, None, m.detail))
    for w in rt.workers():
        if not w.alive:
            out.append(
                ComponentHealth(
                    "worker", w.name, w.addr, "dead", w.heartbeat_age_s, "missed heartbeats"
                )
            )
            continue
        try:
            rt.worker_stub(w).call("Status", pb.Empty(), timeout_s=PING_TIMEOUT_S)
        except TensorcastError as e:
            out.append(
                ComponentHealth("worker", w.name, w.addr, "unreachable", w.heartbeat_age_s, str(e))
            )
            continue
        used = w.mem_used_bytes / w.mem_cap_bytes if w.mem_cap_bytes else 0.0
        out.append(
            ComponentHealth(
                "worker",
                w.name,
                w.addr,
                "healthy",
                w.heartbeat_age_s,
                f"pool {used:.0%} of {w.mem_cap_bytes} bytes",
            )
        )
    return out
