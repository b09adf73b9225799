"""The worker's GPU tier (`tc worker start --gpu-mem SIZE`): contents of its pool copied into one
block of device memory, allocated at start, which same-host callers map by a CUDA IPC handle.

- The block is exported once (`transport.cuda.export_allocation`); a caller opens it once per
  process and takes the range of a content as tensors without a copy (zero-copy warm start: a
  second process maps the same device memory the first one uses).
- A caller's use of a content is a *hold*, owned by its local connection like the pool's holds
  (the connection is the lease): a held content is never evicted or freed, and a crashed caller
  releases everything when its socket closes.
- The tier is a cache over the pool: a content enters it from the pool (loaded there first from
  disk or its files when needed), is copied in by DMA from the pool (page-locked once at start
  when the platform allows, else through pinned staging), and keeps its pool copy held while it
  is in the tier, so that "in the GPU tier" always implies "listed as a replica in memory".
  When the pool drops a content (no artifact names it any more) the tier drops it at the next
  heartbeat tick (`sweep`). When the tier is full, idle contents leave it least recently used
  first; contents in use are never moved.
- Not reported to the Global Store: GPU residency is this worker's business, visible in its
  metrics (`tc_pool_bytes{tier="gpu"}`) and to local callers (`gpu_stats`).

`TierIndex` is the bookkeeping alone (no torch, no device), tested on any machine; `GpuTier`
adds the device memory and the copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorcast.errors import InvalidArgument, NotFound, ResourceExhausted
from tensorcast.transport import native
from tensorcast.types import TensorMeta
from tensorcast.worker.pool import PAGE_BYTES, Content, Pool

log = logging.getLogger("tensorcast.worker.gpu")

LOAD_LOCKS = 64


@dataclass
class TierEntry:
    content_id: str
    offset: int
    size_bytes: int
    tensors: tuple[TensorMeta, ...]
    source: Any = None  # the pool content held while this entry lives
    holds: int = 0
    dropped: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class TierStats:
    capacity_bytes: int
    used_bytes: int
    contents: list[str]
    holds: int
    loads_total: int
    bytes_loaded_total: int
    evictions_total: int


class TierIndex:
    """Which contents the tier holds where, who uses them, and what may be evicted.

    `on_free(entry)` runs (outside the lock) once an entry's device range is free again:
    evicted, or dropped and no longer held.
    """

    def __init__(self, capacity_bytes: int, on_free: Callable[[TierEntry], None]) -> None:
        self.capacity_bytes = capacity_bytes
        self.allocator = native.ArenaAllocator(capacity_bytes)
        self._on_free = on_free
        self._entries: dict[str, TierEntry] = {}
        self._draining: list[TierEntry] = []
        self._lock = threading.Lock()
        self.loads_total = 0
        self.bytes_loaded_total = 0
        self.evictions_total = 0

    def hold(self, content_id: str) -> TierEntry | None:
        with self._lock:
            entry = self._entries.get(content_id)
            if entry is not None:
                entry.holds += 1
                entry.last_used = time.monotonic()
            return entry

    def reserve(self, size_bytes: int) -> int:
        """A device range of `size_bytes`, evicting idle entries (least recently used first)
        until it fits. ResourceExhausted when the rest is in use."""
        if size_bytes > self.capacity_bytes:
            raise ResourceExhausted(
                f"GPU tier: a {size_bytes}-byte content cannot fit a {self.capacity_bytes}-byte "
                "tier; start the worker with a larger --gpu-mem"
            )
        evicted: list[TierEntry] = []
        try:
            with self._lock:
                while True:
                    try:
                        return self.allocator.allocate(size_bytes)
                    except ResourceExhausted:
                        idle = [e for e in self._entries.values() if e.holds == 0]
                        free = self.capacity_bytes - self.allocator.used_bytes
                        # What evicting every idle entry frees: their whole (page-rounded)
                        # regions. Nothing idle left (a fragmented tier): give up too.
                        freeable = sum(self.allocator.size_of(e.offset) for e in idle)
                        if not idle or free + freeable < size_bytes:
                            raise ResourceExhausted(
                                f"GPU tier full: {size_bytes} bytes wanted, "
                                f"{self.capacity_bytes - self.allocator.used_bytes} free of "
                                f"{self.capacity_bytes}, the rest in use by callers"
                            ) from None
                        victim = min(idle, key=lambda e: e.last_used)
                        del self._entries[victim.content_id]
                        self.allocator.free(victim.offset)
                        self.evictions_total += 1
                        evicted.append(victim)
        finally:
            for entry in evicted:
                log.info("GPU tier: evicted %s (%d bytes)", entry.content_id, entry.size_bytes)
                self._on_free(entry)

    def abort(self, offset: int) -> None:
        with self._lock:
            self.allocator.free(offset)

    def insert(self, entry: TierEntry) -> TierEntry:
        """Add a loaded entry, held once by the loader."""
        with self._lock:
            assert entry.content_id not in self._entries
            entry.holds = 1
            entry.last_used = time.monotonic()
            self._entries[entry.content_id] = entry
            self.loads_total += 1
            self.bytes_loaded_total += entry.size_bytes
            return entry

    def release(self, entry: TierEntry) -> None:
        freed = False
        with self._lock:
            entry.holds -= 1
            assert entry.holds >= 0
            if entry.dropped and entry.holds == 0:
                self._draining.remove(entry)
                self.allocator.free(entry.offset)
                freed = True
        if freed:
            self._on_free(entry)

    def drop(self, content_id: str) -> bool:
        """Take a content out of the tier (freed now, or when its last hold is released)."""
        with self._lock:
            entry = self._entries.pop(content_id, None)
            if entry is None:
                return False
            entry.dropped = True
            if entry.holds:
                self._draining.append(entry)
                return True
            self.allocator.free(entry.offset)
        self._on_free(entry)
        return True

    def content_ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def stats(self) -> TierStats:
        with self._lock:
            live = list(self._entries.values())
            return TierStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self.allocator.used_bytes,
                contents=[e.content_id for e in live],
                holds=sum(e.holds for e in live + self._draining),
                loads_total=self.loads_total,
                bytes_loaded_total=self.bytes_loaded_total,
                evictions_total=self.evictions_total,
            )


class GpuTier:
    """Device memory for contents of `pool`, on one GPU. `load_and_hold(content_id)` brings a
    content into the pool and holds it there (WorkerNode.load_and_hold)."""

    def __init__(
        self,
        pool: Pool,
        load_and_hold: Callable[[str], Content],
        capacity_bytes: int,
        device_index: int = 0,
    ) -> None:
        import torch

        from tensorcast.transport import cuda

        self.device = cuda.resolve(f"cuda:{device_index}")
        capacity_bytes = -(-capacity_bytes // PAGE_BYTES) * PAGE_BYTES
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        name = torch.cuda.get_device_name(self.device)
        if capacity_bytes > free_bytes:
            raise ResourceExhausted(
                f"--gpu-mem {capacity_bytes} bytes exceeds the {free_bytes} bytes free on "
                f"{self.device} ({name})"
            )
        self.pool = pool
        self._load_and_hold = load_and_hold
        self.uuid = cuda.device_uuid(self.device)
        self.block = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        self.export = cuda.export_allocation(self.block)
        self.index = TierIndex(capacity_bytes, self._freed)
        self._load_locks = [threading.Lock() for _ in range(LOAD_LOCKS)]
        # The whole pool page-locked once: every load is then a plain DMA out of it.
        self.host = cuda.PinnedHost(pool.view)
        self.route = "pinned" if self.host.pinned else "staging"
        log.info(
            "GPU tier: %d bytes on %s (%s, %s); pool %s for DMA in %.2fs%s",
            capacity_bytes,
            self.device,
            name,
            self.uuid,
            "page-locked" if self.host.pinned else "NOT page-locked",
            self.host.register_s,
            "" if self.host.pinned else f" (cudaHostRegister error {self.host.error}: staging)",
        )

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    def hello(self) -> dict[str, Any]:
        """What a same-host caller needs to map the tier."""
        return {
            "device_uuid": self.uuid,
            "device_index": self.device.index,
            "capacity_bytes": self.capacity_bytes,
            "export": self.export,
            "pool_pinned": self.host.pinned,
        }

    def open(self, content_id: str, load: bool = True) -> TierEntry:
        """Hold a content in the tier, copying it in from the pool first when `load` (else
        NotFound when it is not there). Release with `release`."""
        entry = self.index.hold(content_id)
        if entry is not None:
            return entry
        if not load:
            raise NotFound(f"content {content_id} is not in this worker's GPU tier")
        with self._load_locks[hash(content_id) % LOAD_LOCKS]:
            entry = self.index.hold(content_id)  # loaded by another caller meanwhile
            if entry is not None:
                return entry
            return self._load(content_id)

    def _load(self, content_id: str) -> TierEntry:
        from tensorcast.transport import cuda

        started = time.monotonic()
        source = self._load_and_hold(content_id)
        try:
            offset = self.index.reserve(source.size_bytes)
            try:
                if source.size_bytes:
                    report = cuda.copy_to_device(
                        self.host.tensor[source.offset : source.offset + source.size_bytes],
                        self.block[offset : offset + source.size_bytes],
                        self.route,
                    )
                    log.info(
                        "GPU tier: loaded %s, %d bytes in %.3fs (%.1f GB/s, %s)",
                        content_id,
                        source.size_bytes,
                        time.monotonic() - started,
                        report.gb_per_s,
                        report.route,
                    )
            except BaseException:
                self.index.abort(offset)
                raise
        except BaseException:
            self.pool.release(source)
            raise
        entry = TierEntry(content_id, offset, source.size_bytes, source.tensors, source)
        return self.index.insert(entry)

    def copy_into(self, content_id: str, target: dict[str, Any]) -> tuple[Content, float]:
        """Copy a content from the pool into a same-host caller's device buffer (exported by
        CUDA IPC): a private copy at the DMA rate of the page-locked pool, the tier untouched.
        Returns the content (its layout) and the copy's seconds."""
        from tensorcast.transport import cuda

        source = self._load_and_hold(content_id)
        try:
            storage = cuda.open_allocation(target, self.device, keep=False)
            if storage.nbytes() < source.size_bytes:
                raise InvalidArgument(
                    f"a {storage.nbytes()}-byte buffer cannot take content {content_id} "
                    f"({source.size_bytes} bytes)"
                )
            if not source.size_bytes:
                return source, 0.0
            dest, _region = cuda.region_tensor(storage, 0, source.size_bytes, self.device)
            report = cuda.copy_to_device(
                self.host.tensor[source.offset : source.offset + source.size_bytes],
                dest,
                self.route,
            )
            return source, report.seconds
        finally:
            self.pool.release(source)

    def release(self, entry: TierEntry) -> None:
        self.index.release(entry)

    def drop(self, content_id: str) -> bool:
        return self.index.drop(content_id)

    def sweep(self) -> list[str]:
        """Drop contents the pool no longer lists (deleted artifacts); run on every heartbeat
        tick. Returns the contents dropped."""
        gone = [c for c in self.index.content_ids() if not self.pool.contains(c)]
        for content_id in gone:
            if self.index.drop(content_id):
                log.info("GPU tier: dropped %s (gone from the pool)", content_id)
        return gone

    def _freed(self, entry: TierEntry) -> None:
        if entry.source is not None:
            self.pool.release(entry.source)
            entry.source = None

    def stats(self) -> TierStats:
        return self.index.stats()

    def close(self) -> None:
        self.host.close()
