"""KV pages held by a worker: many small keyed tensors in the pool, indexed here, not in the
Global Store.

A shard home holds the pages of the shards it leases (`home=True`); any worker may also keep
copies of pages it does not home (`home=False`: a prefetch cache, served by key and checked by
hash). Pages expire after their TTL and are evicted least recently used when the pool is full.
Readers on the same host copy straight out of the pool and verify the page hash, so a page
evicted and overwritten during a copy is detected, never returned.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from tensorcast.errors import IntegrityError, InvalidArgument, ResourceExhausted
from tensorcast.transport import native
from tensorcast.types import DTYPE_ITEMSIZE, tensor_nbytes
from tensorcast.worker.pool import Pool

MAX_PAGE_BYTES = 64 * 1024 * 1024
MAX_BATCH = 4096
MAX_KEY_LENGTH = 512
MAX_TTL_S = 7 * 24 * 3600.0


@dataclass
class Page:
    key: str
    shard: int
    token: int  # the lease token it was written under; 0 for a cached copy
    dtype: str
    shape: tuple[int, ...]
    offset: int
    size_bytes: int
    hash_hex: str
    expires_at: float  # monotonic
    home: bool

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "shard": self.shard,
            "token": self.token,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "size_bytes": self.size_bytes,
            "hash": self.hash_hex,
        }


@dataclass(frozen=True)
class PageWrite:
    """A page about to be stored: where its bytes were written, what they claim to be."""

    key: str
    shard: int
    token: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    size_bytes: int
    hash_hex: str


def check_page(key: str, dtype: str, shape: tuple[int, ...], size_bytes: int) -> None:
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise InvalidArgument(f"bad page key {key[:80]!r}: 1-{MAX_KEY_LENGTH} printable chars")
    if dtype not in DTYPE_ITEMSIZE or any(d < 0 for d in shape):
        raise InvalidArgument(f"page {key!r}: bad dtype {dtype!r} or shape {shape}")
    if tensor_nbytes(dtype, shape) != size_bytes:
        raise InvalidArgument(f"page {key!r}: {size_bytes} bytes do not match {dtype}{shape}")
    if size_bytes > MAX_PAGE_BYTES:
        raise InvalidArgument(f"page {key!r}: {size_bytes} bytes, the limit is {MAX_PAGE_BYTES}")


class PageStore:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._pages: collections.OrderedDict[str, Page] = collections.OrderedDict()  # LRU order
        self._lock = threading.Lock()
        self.bytes_held = 0

    # -- writing -------------------------------------------------------------------------------

    def allocate(self, sizes: list[int], evict: bool = True) -> list[int]:
        """Regions for a batch of pages; evicts least recently used pages to make room
        (unless `evict` is off: then a full pool is ResourceExhausted)."""
        if len(sizes) > MAX_BATCH:
            raise InvalidArgument(f"batch of {len(sizes)} pages, the limit is {MAX_BATCH}")
        offsets: list[int] = []
        try:
            for size in sizes:
                if not 0 <= size <= MAX_PAGE_BYTES:
                    raise InvalidArgument(f"page of {size} bytes, the limit is {MAX_PAGE_BYTES}")
                offsets.append(self._allocate_one(size) if evict else self.pool.allocate(size))
        except BaseException:
            for offset in offsets:
                self.pool.free(offset)
            raise
        return offsets

    def _allocate_one(self, size: int) -> int:
        while True:
            try:
                return self.pool.allocate(size)
            except ResourceExhausted:
                if not self._evict_one():
                    raise

    def _evict_one(self) -> bool:
        """Drop the least recently used page (expired ones go first through `expire`)."""
        with self._lock:
            if not self._pages:
                return False
            self._remove(next(iter(self._pages.values())))
        return True

    def free(self, offsets: list[int]) -> None:
        for offset in offsets:
            self.pool.free(offset)

    def commit(
        self, writes: list[PageWrite], ttl_s: float, home: bool, if_absent: bool = False
    ) -> None:
        """Index written pages after checking their hashes. All or nothing: on any error every
        region of the batch is freed and the index is unchanged. With `if_absent` a page already
        stored under a key stays (and the new copy is freed)."""
        try:
            if not 0 < ttl_s <= MAX_TTL_S:
                raise InvalidArgument(f"page ttl_s must be in (0, {MAX_TTL_S}], not {ttl_s}")
            for w in writes:
                check_page(w.key, w.dtype, w.shape, w.size_bytes)
            hashes = native.hash_buffers([self.pool.region(w.offset, w.size_bytes) for w in writes])
            for w, h in zip(writes, hashes):
                if w.hash_hex != h:
                    raise IntegrityError(
                        f"page {w.key!r}: bytes hash to {h}, the writer claimed {w.hash_hex}; "
                        "nothing was stored"
                    )
        except BaseException:
            self.free([w.offset for w in writes])
            raise
        expires_at = time.monotonic() + ttl_s
        with self._lock:
            for w in writes:
                old = self._pages.get(w.key)
                if if_absent and old is not None and old.home and old.expires_at > time.monotonic():
                    self.pool.free(w.offset)
                    continue
                if old is not None:
                    self._remove(old)
                page = Page(
                    w.key,
                    w.shard,
                    w.token if home else 0,
                    w.dtype,
                    w.shape,
                    w.offset,
                    w.size_bytes,
                    w.hash_hex,
                    expires_at,
                    home,
                )
                self._pages[w.key] = page
                self.bytes_held += w.size_bytes

    def put(
        self,
        pages: list[tuple[PageWrite, bytes]],
        ttl_s: float,
        home: bool,
        if_absent: bool = False,
    ) -> None:
        """Copy pages given as bytes (the gRPC path) into the pool and index them."""
        offsets = self.allocate([len(data) for _, data in pages])
        native.copy_many(
            [self.pool.region(o, len(data)) for (_, data), o in zip(pages, offsets)],
            [data for _, data in pages],
        )
        writes = []
        for (w, data), offset in zip(pages, offsets):
            writes.append(
                PageWrite(w.key, w.shard, w.token, w.dtype, w.shape, offset, len(data), w.hash_hex)
            )
        self.commit(writes, ttl_s, home, if_absent)

    # -- reading -------------------------------------------------------------------------------

    def lookup(self, keys: list[tuple[str, int, int]]) -> list[Page | None]:
        """Pages by (key, shard, token): token 0 accepts a cached copy, otherwise the page must
        be homed here under that shard (the caller checked the token against the lease)."""
        if len(keys) > MAX_BATCH:
            raise InvalidArgument(f"batch of {len(keys)} keys, the limit is {MAX_BATCH}")
        now = time.monotonic()
        found: list[Page | None] = []
        with self._lock:
            for key, shard, token in keys:
                page = self._pages.get(key)
                if (
                    page is None
                    or page.expires_at <= now
                    or (token and (not page.home or page.shard != shard))
                ):
                    found.append(None)
                    continue
                self._pages.move_to_end(key)
                found.append(page)
        return found

    def read(self, page: Page) -> bytes:
        data = bytes(self.pool.region(page.offset, page.size_bytes))
        if native.hash_buffer(data) != page.hash_hex:
            raise IntegrityError(f"page {page.key!r} changed while it was read; read it again")
        return data

    # -- lifecycle -----------------------------------------------------------------------------

    def home_pages(self, shard: int, max_token: int) -> list[Page]:
        """The live pages this worker homes for `shard` under tokens up to `max_token`,
        soonest to expire first."""
        now = time.monotonic()
        with self._lock:
            pages = [
                p
                for p in self._pages.values()
                if p.home and p.shard == shard and p.token <= max_token and p.expires_at > now
            ]
        return sorted(pages, key=lambda p: p.expires_at)

    def drop_shards(self, shards: set[int], max_token: int | None = None) -> int:
        """Forget the home pages of shards this worker lost (only those written under tokens
        up to `max_token`, if given); returns how many went."""
        with self._lock:
            gone = [
                p
                for p in self._pages.values()
                if p.home and p.shard in shards and (max_token is None or p.token <= max_token)
            ]
            for page in gone:
                self._remove(page)
        return len(gone)

    def expire(self) -> int:
        now = time.monotonic()
        with self._lock:
            gone = [p for p in self._pages.values() if p.expires_at <= now]
            for page in gone:
                self._remove(page)
        return len(gone)

    def _remove(self, page: Page) -> None:
        del self._pages[page.key]
        self.bytes_held -= page.size_bytes
        self.pool.free(page.offset)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pages": len(self._pages),
                "home_pages": sum(p.home for p in self._pages.values()),
                "bytes": self.bytes_held,
            }
