"""KV pages held by a worker: many small keyed tensors in the pool, indexed here, not in the
Global Store.

The index itself is native (native/src/page_index.cpp) so that same-host callers are served by
the native page server without the GIL; this module is its Python face for the gRPC page
service, hand-off and prefetch. A shard home holds the pages of the shards it leases
(`home=True`); any worker may also keep copies of pages it does not home (`home=False`: a
prefetch cache, served by key and checked by hash). Pages expire after their TTL and are evicted
least recently used when the pool is full. Readers copy straight out of the pool and verify the
page hash, so a page evicted and overwritten during a copy is detected, never returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorcast.errors import IntegrityError, InvalidArgument
from tensorcast.transport import native
from tensorcast.types import DTYPE_ITEMSIZE
from tensorcast.worker.pool import Pool


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
    ttl_s: float  # the lease it was put with: a read renews it for as long again
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


# The shared-memory page directory (native/include/tensorcast/page_directory.h) has a slot per
# this many pool bytes (pages smaller on average leave the excess to the page socket).
DIRECTORY_BYTES_PER_SLOT = 64 * 1024
MAX_DIRECTORY_SLOTS = 1 << 20  # 128 MiB of directory


class PageStore:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.index = native.PageIndex(pool.view, pool.arena, DTYPE_ITEMSIZE)
        # Same-host callers find pages here without a round trip (the index stays the truth).
        slots = min(MAX_DIRECTORY_SLOTS, pool.capacity_bytes // DIRECTORY_BYTES_PER_SLOT)
        self.directory = native.PageDirectory(slots)
        self.index.attach_directory(self.directory)
        self.server: Any = None  # the page socket's native.PageServer, once serving

    def close(self) -> None:
        """Release the pool buffer (after every page server over this index has stopped)."""
        self.index.close()

    # -- writing -------------------------------------------------------------------------------

    def allocate(self, sizes: list[int], evict: bool = True) -> list[int]:
        """Regions for a batch of pages; evicts least recently used pages to make room
        (unless `evict` is off: then a full pool is ResourceExhausted). All or nothing."""
        if any(size < 0 for size in sizes):
            raise InvalidArgument("a page size is negative")
        return list(self.index.allocate(sizes, evict))

    def free(self, offsets: list[int]) -> None:
        self.index.free(offsets)

    def commit(
        self,
        writes: list[PageWrite],
        ttl_s: float,
        home: bool,
        if_absent: bool = False,
        check_hashes: bool = True,
    ) -> None:
        """Index written pages after checking them and their hashes. All or nothing: on any
        error every region of the batch is freed and the index is unchanged. With `if_absent` a
        live home page already stored under a key stays (and the new copy is freed).
        `check_hashes=False` only for regions this process hashed as it wrote them (pages
        received by `index.fetch_remote`)."""
        self.index.commit(
            [
                (
                    w.key,
                    w.shard,
                    w.token,
                    w.dtype,
                    list(w.shape),
                    w.offset,
                    w.size_bytes,
                    w.hash_hex,
                )
                for w in writes
            ],
            ttl_s,
            home,
            if_absent,
            check_hashes,
        )

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
        writes = [
            PageWrite(w.key, w.shard, w.token, w.dtype, w.shape, offset, len(data), w.hash_hex)
            for (w, data), offset in zip(pages, offsets)
        ]
        self.commit(writes, ttl_s, home, if_absent)

    # -- reading -------------------------------------------------------------------------------

    def lookup(self, keys: list[tuple[str, int, int]], read: bool = False) -> list[Page | None]:
        """Pages by (key, shard, token): token 0 accepts a cached copy, otherwise the page must
        be homed here under that shard (the caller checked the token against the lease).
        `read`: the caller reads the pages found, which renews their leases."""
        return [None if p is None else _page(p) for p in self.index.lookup(keys, read)]

    def read(self, page: Page) -> bytes:
        data = bytes(self.pool.region(page.offset, page.size_bytes))
        if native.hash_buffer(data) != page.hash_hex:
            raise IntegrityError(f"page {page.key!r} changed while it was read; read it again")
        return data

    # -- lifecycle -----------------------------------------------------------------------------

    def home_pages(self, shard: int, max_token: int) -> list[Page]:
        """The live pages this worker homes for `shard` under tokens up to `max_token`,
        soonest to expire first."""
        return [_page(p) for p in self.index.home_pages(shard, max_token)]

    def drop_shards(self, shards: set[int], max_token: int | None = None) -> int:
        """Forget the home pages of shards this worker lost (only those written under tokens
        up to `max_token`, if given); returns how many went."""
        return int(self.index.drop_shards(shards, max_token))

    def expire(self) -> int:
        return int(self.index.expire())

    def stats(self) -> dict[str, int]:
        """pages, home_pages, bytes (the pages' sizes), region_bytes (the pool they take) and
        uncommitted_bytes (regions page connections hold for puts not yet committed)."""
        stats = dict(self.index.stats())
        stats["uncommitted_bytes"] = self.server.stats()["uncommitted_bytes"] if self.server else 0
        return stats


def _page(t: tuple) -> Page:
    key, shard, token, dtype, shape, offset, size, hash_hex, expires_at, ttl_s, home = t
    return Page(
        key, shard, token, dtype, tuple(shape), offset, size, hash_hex, expires_at, ttl_s, home
    )
