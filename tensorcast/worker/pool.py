"""The worker's tensor pool: one shared-memory arena, allocated and pre-faulted at start.

Ownership: a *reservation* belongs to the connection that made it until it is committed or
aborted; a committed *content* belongs to the pool. A content dropped while callers still hold
mappings of it stays allocated until the last hold is released, so their tensors never change.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field

from tensorcast.errors import IntegrityError, InvalidArgument, NotFound
from tensorcast.identity import content_id as compute_content_id
from tensorcast.transport import native, shm
from tensorcast.types import DTYPE_ITEMSIZE, TensorMeta, check_tensor_name, tensor_nbytes

PAGE_BYTES = 4096  # pool regions are page aligned, so any caller can map one on its own


@dataclass
class Content:
    content_id: str
    offset: int
    size_bytes: int
    tensors: tuple[TensorMeta, ...]
    committed_at: float
    registered: bool = False  # the Global Store knows about it
    registering: int = 0  # commits telling the Global Store about it right now
    holds: int = 0
    dropped: bool = False
    pinned: bool = False  # never evicted
    last_used: float = 0.0  # for LRU eviction


@dataclass
class Reservation:
    reservation_id: int
    offset: int
    size_bytes: int
    committing: bool = False


@dataclass
class CommitResult:
    content: Content
    deduplicated: bool


@dataclass
class PoolStats:
    capacity_bytes: int
    used_bytes: int
    num_contents: int
    num_holds: int
    num_reservations: int
    content_ids: list[str] = field(default_factory=list)
    pinned_content_ids: list[str] = field(default_factory=list)


class Pool:
    def __init__(self, capacity_bytes: int, name: str = "tensorcast-pool") -> None:
        capacity_bytes = -(-capacity_bytes // PAGE_BYTES) * PAGE_BYTES
        self.capacity_bytes = capacity_bytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity_bytes)
        # Every page faulted in now: writes into fresh pages run at a tenth of the speed of
        # writes into touched ones, so never pay that on a hot path.
        self.mm = shm.map_pool(self.fd, capacity_bytes)
        self.view = memoryview(self.mm)
        # Shared with the native page index (KV pages), which allocates without the GIL.
        self.arena = native.ArenaAllocator(capacity_bytes)
        self._contents: dict[str, Content] = {}
        self._draining: list[Content] = []  # dropped, still mapped by callers
        self._reservations: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.view.release()
        self.mm.close()
        os.close(self.fd)

    # -- writing -------------------------------------------------------------------------------

    def reserve(self, size_bytes: int) -> Reservation:
        if size_bytes < 0:
            raise InvalidArgument("size must be >= 0")
        with self._lock:
            offset = self.arena.allocate(size_bytes)
            res = Reservation(next(self._ids), offset, size_bytes)
            self._reservations[res.reservation_id] = res
            return res

    def abort(self, reservation_id: int) -> None:
        with self._lock:
            res = self._reservations.pop(reservation_id, None)
            if res is not None:
                self.arena.free(res.offset)

    def region(self, offset: int, size_bytes: int) -> memoryview:
        return self.view[offset : offset + size_bytes]

    def commit(
        self,
        reservation_id: int,
        tensors: list[TensorMeta],
        verify_hashes: bool = False,
        content_id: str | None = None,
        hashed: bool = False,
    ) -> CommitResult:
        """Hash the reservation's tensors and turn it into content.

        `tensors` carry offsets relative to the reservation. With `verify_hashes`, their
        `hash_hex` are claims checked against the bytes (IntegrityError, reservation freed).
        With `hashed`, their `hash_hex` were computed by this worker from these very bytes as
        it wrote them (a file read that hashes as it goes): taken as they are.
        Identical content already in the pool wins: the new bytes are freed (deduplicated).
        `content_id` names content whose identity is not its hashes (registered by reference).
        The caller registers the content and then calls `end_registration`, whatever happened:
        until then the content is neither dropped nor evicted.
        """
        with self._lock:
            res = self._reservations.get(reservation_id)
            if res is None or res.committing:
                raise NotFound(f"no open reservation {reservation_id}")
            res.committing = True
        try:
            _check_layout(tensors, res.size_bytes)
            if hashed:
                hashes = [t.hash_hex for t in tensors]
            else:
                hashes = native.hash_buffers(
                    [self.region(res.offset + t.offset_bytes, t.size_bytes) for t in tensors]
                )
            if verify_hashes:
                for t, h in zip(tensors, hashes):
                    if t.hash_hex != h:
                        raise IntegrityError(
                            f"tensor {t.name!r}: received bytes hash to {h}, sender claimed "
                            f"{t.hash_hex}; nothing was stored"
                        )
            metas = tuple(
                TensorMeta(t.name, t.dtype, t.shape, t.size_bytes, t.offset_bytes, h)
                for t, h in zip(tensors, hashes)
            )
        except BaseException:
            self.abort(reservation_id)
            raise
        cid = content_id or compute_content_id(metas)
        with self._lock:
            del self._reservations[reservation_id]
            existing = self._contents.get(cid)
            if existing is not None:
                self.arena.free(res.offset)
                # Committed again: a drop decided before now (the store forgot it) must not win.
                existing.committed_at = time.time()
                existing.registering += 1
                return CommitResult(existing, True)
            now = time.time()
            content = Content(
                cid, res.offset, res.size_bytes, metas, now, last_used=now, registering=1
            )
            self._contents[cid] = content
            return CommitResult(content, False)

    # -- reading -------------------------------------------------------------------------------

    def get(self, content_id: str) -> Content:
        with self._lock:
            content = self._contents.get(content_id)
            if content is None:
                raise NotFound(f"this worker holds no content {content_id}")
            return content

    def contains(self, content_id: str) -> bool:
        with self._lock:
            return content_id in self._contents

    def hold(self, content_id: str) -> Content:
        with self._lock:
            content = self._contents.get(content_id)
            if content is None:
                raise NotFound(f"this worker holds no content {content_id}")
            content.holds += 1
            content.last_used = time.time()
            return content

    def release(self, content: Content) -> None:
        with self._lock:
            content.holds -= 1
            assert content.holds >= 0
            if content.dropped and content.holds == 0:
                self._draining.remove(content)
                self.arena.free(content.offset)

    # -- lifecycle -----------------------------------------------------------------------------

    def set_pinned(self, content_id: str, pinned: bool) -> None:
        with self._lock:
            content = self._contents.get(content_id)
            if content is None:
                raise NotFound(f"this worker holds no content {content_id}: prefetch it first")
            content.pinned = pinned

    def eviction_candidates(self) -> list[str]:
        """Unpinned contents nobody maps right now, least recently used first."""
        with self._lock:
            idle = [
                c
                for c in self._contents.values()
                if not c.pinned and c.holds == 0 and c.registering == 0
            ]
            return [c.content_id for c in sorted(idle, key=lambda c: c.last_used)]

    def end_registration(self, content_id: str, registered: bool) -> None:
        """A commit's registration is over. A drop decided from a heartbeat sent before now
        (the store did not know the content yet, or had just forgotten it) must not win."""
        with self._lock:
            content = self._contents.get(content_id)
            if content is None:
                return
            content.registering -= 1
            assert content.registering >= 0
            if registered:
                content.registered = True
                content.committed_at = time.time()

    def drop(
        self,
        content_id: str,
        unless_committed_after: float = float("inf"),
        unless_registered: bool = False,
    ) -> bool:
        """Drop a content (freed once no caller holds it). Skips one (re)committed recently or
        being registered right now, and with `unless_registered` one any commit registered
        (a failed batch frees what it wrote, unless another commit made it content of its own
        meanwhile: deduplicated onto it and named it)."""
        with self._lock:
            content = self._contents.get(content_id)
            if (
                content is None
                or content.registering
                or content.committed_at > unless_committed_after
                or (unless_registered and content.registered)
            ):
                return False
            del self._contents[content_id]
            content.dropped = True
            if content.holds:
                self._draining.append(content)
            else:
                self.arena.free(content.offset)
            return True

    def stats(self) -> PoolStats:
        with self._lock:
            live = list(self._contents.values())
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self.arena.used_bytes,
                num_contents=len(live),
                num_holds=sum(c.holds for c in live + self._draining),
                num_reservations=len(self._reservations),
                content_ids=[c.content_id for c in live if c.registered],
                pinned_content_ids=[c.content_id for c in live if c.registered and c.pinned],
            )


def _check_layout(tensors: list[TensorMeta], region_bytes: int) -> None:
    names = set()
    for t in tensors:
        check_tensor_name(t.name)
        if not all(type(d) is int and d >= 0 for d in t.shape):
            raise InvalidArgument(f"tensor {t.name!r}: shape {list(t.shape)} needs ints >= 0")
        if t.dtype not in DTYPE_ITEMSIZE or t.size_bytes != tensor_nbytes(t.dtype, t.shape):
            raise InvalidArgument(f"tensor {t.name!r}: bad dtype or size for its shape")
        if t.name in names:
            raise InvalidArgument(f"tensor name {t.name!r} appears twice")
        names.add(t.name)
        if t.offset_bytes < 0 or t.size_bytes < 0 or t.offset_bytes + t.size_bytes > region_bytes:
            raise InvalidArgument(
                f"tensor {t.name!r} at [{t.offset_bytes}, {t.offset_bytes + t.size_bytes}) "
                f"lies outside its {region_bytes}-byte region"
            )
