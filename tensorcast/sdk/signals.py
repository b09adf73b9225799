"""Signals: what callers need to write their own policies (DESIGN §4). Snapshots of workers and
instances from the Global Store, each carrying its age; per-worker transfer rates are derived
from the byte counters of this snapshot and the previous one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from tensorcast.types import InstanceInfo, WorkerInfo

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot(Generic[T]):
    items: tuple[T, ...]
    taken_at: float  # time.monotonic() when the store answered

    @property
    def age_s(self) -> float:
        """Seconds since the store produced this snapshot (each item also has its heartbeat
        age: how old the store's own knowledge of it was then)."""
        return time.monotonic() - self.taken_at

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> T:
        return self.items[i]


@dataclass(frozen=True)
class WorkerSignal:
    worker: WorkerInfo
    transfer_rate_bps: float  # data-plane bytes/s since the previous snapshot (0: first one)

    @property
    def healthy(self) -> bool:
        return self.worker.alive

    def to_json(self) -> dict:
        return dict(self.worker.to_json(), transfer_rate_bps=round(self.transfer_rate_bps, 1))


class Signals:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._last: dict[str, tuple[int, float]] = {}  # worker -> (bytes total, when)
        self._lock = threading.Lock()

    def list_workers(self) -> Snapshot[WorkerSignal]:
        workers = self.rt.workers()
        now = time.monotonic()
        items = []
        with self._lock:
            for w in workers:
                before = self._last.get(w.worker_id)
                rate = 0.0
                if before is not None and now > before[1]:
                    rate = max(0, w.transfer_bytes_total - before[0]) / (now - before[1])
                self._last[w.worker_id] = (w.transfer_bytes_total, now)
                items.append(WorkerSignal(w, rate))
        return Snapshot(tuple(items), now)

    def list_instances(self) -> Snapshot[InstanceInfo]:
        instances = self.rt.instances()
        return Snapshot(tuple(instances), time.monotonic())
