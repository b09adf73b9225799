"""What `tc top` shows, as plain data: one fetch from the SDK, and the rates derived from two."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tensorcast.types import ArtifactInfo, InstanceInfo, PlanRecord, ShardTable, WorkerInfo

SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class ClusterSnapshot:
    taken_at: float
    store_addr: str = ""
    workers: tuple[WorkerInfo, ...] = ()
    artifacts: tuple[ArtifactInfo, ...] = ()
    instances: tuple[InstanceInfo, ...] = ()
    shards: ShardTable | None = None
    plans: tuple[PlanRecord, ...] = ()  # most recent first
    error: str = ""  # set when the cluster could not be reached
    router: dict | None = None  # a router's /router/state (tc top --router), or {"error": ...}


PLANS_SHOWN = 100


def fetch(rt) -> ClusterSnapshot:
    return ClusterSnapshot(
        taken_at=time.time(),
        store_addr=rt.store_addr,
        workers=tuple(rt.workers()),
        artifacts=tuple(rt.list_artifacts()),
        instances=tuple(rt.instances()),
        shards=rt.shards(),
        plans=tuple(rt.plans(PLANS_SHOWN)),
    )


@dataclass
class RateHistory:
    """Per-worker transfer rate (bytes/s) from successive byte counters, last `keep` samples."""

    keep: int = 30
    _last: dict[str, tuple[float, int]] = field(default_factory=dict)
    rates: dict[str, list[float]] = field(default_factory=dict)

    def add(self, snapshot: ClusterSnapshot) -> None:
        for w in snapshot.workers:
            previous = self._last.get(w.worker_id)
            self._last[w.worker_id] = (snapshot.taken_at, w.transfer_bytes_total)
            if previous is None or snapshot.taken_at <= previous[0]:
                continue
            rate = max(0, w.transfer_bytes_total - previous[1]) / (snapshot.taken_at - previous[0])
            series = self.rates.setdefault(w.worker_id, [])
            series.append(rate)
            del series[: -self.keep]

    def latest(self, worker_id: str) -> float:
        series = self.rates.get(worker_id)
        return series[-1] if series else 0.0

    def sparkline(self, worker_id: str, width: int = 12) -> str:
        series = self.rates.get(worker_id, [])[-width:]
        if not series:
            return ""
        top = max(series) or 1.0
        return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in series)
