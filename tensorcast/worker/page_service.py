"""KV page operations on a worker: the lease rules behind them, prefetches of pages homed
elsewhere, and the gRPC page calls (kept for older callers; this project's callers use the
native page paths).

Every operation on a homed page carries its shard's fencing token, checked against this worker's
cached lease: a stale token or a shard homed elsewhere is a FencingError, and nothing changes.
Same-host callers go through the native page server and callers on other hosts through the
worker's data port (native/src/page_remote.cpp); both check tokens against the lease table the
LeaseCache pushes to the page index and fall back to `_check` here only for a token the index
does not hold as named.
"""

from __future__ import annotations

import threading
import time

from tensorcast import errors
from tensorcast.config import send_token
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import worker_from_pb
from tensorcast.transport import native
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.pages import Page, PageWrite

# Below the 64 MiB gRPC message limit, leaving room for the page headers.
MAX_REPLY_BYTES = 48 * 1024 * 1024


def page_to_pb(page: Page, data: bytes = b"") -> pb.Page:
    return pb.Page(
        key=page.key,
        shard=page.shard,
        token=page.token,
        dtype=page.dtype,
        shape=list(page.shape),
        data=data,
        hash=page.hash_hex,
    )


class PageService:
    def __init__(self, node: WorkerNode) -> None:
        self.node = node
        self.store = node.pages
        self.store.index.set_lease_fallback(lambda named: self._check(set(named)))
        self._data_addrs: dict[str, str] = {}  # other workers' data ports, by worker id
        self._lock = threading.Lock()

    def _check(self, shard_tokens: set[tuple[int, int]]) -> None:
        try:
            for shard, token in shard_tokens:
                self.node.leases.check(shard, token)
        except errors.FencingError:
            # A token newer than our table: a lease just moved here (a hand-off). Learn it
            # from the store now; older tokens never cost a store request.
            if not any(self.node.leases.is_newer(s, t) for s, t in shard_tokens):
                raise
            self.node.refresh_leases(shard_tokens)
            for shard, token in shard_tokens:
                self.node.leases.check(shard, token)

    # -- homed pages ---------------------------------------------------------------------------

    def put(self, pages: list[pb.Page], ttl_s: float, if_absent: bool = False) -> None:
        self._check({(p.shard, p.token) for p in pages})
        if sum(len(p.data) for p in pages) > self.node.pool.capacity_bytes:
            raise errors.ResourceExhausted("the batch is larger than this worker's pool")
        self.store.put(
            [(_write(p, len(p.data)), p.data) for p in pages], ttl_s, home=True, if_absent=if_absent
        )

    def lookup(self, keys: list[tuple[str, int, int]], read: bool = False) -> list[Page | None]:
        self._check({(shard, token) for _, shard, token in keys if token})
        return self.store.lookup(keys, read)

    def get(self, keys: list[tuple[str, int, int]]) -> list[pb.Page]:
        """Pages for a prefix of `keys` whose data fits in one gRPC reply (at least one); a
        read renews each page's lease."""
        found: list[pb.Page] = []
        size = 0
        for page in self.lookup(keys, read=True):
            if page is None:
                found.append(pb.Page())
                continue
            size += page.size_bytes
            if found and size > MAX_REPLY_BYTES:
                break
            try:
                found.append(page_to_pb(page, self.store.read(page)))
            except errors.IntegrityError:
                found.append(pb.Page())  # evicted while read: absent, never wrong
        return found

    # -- copies of pages homed elsewhere -------------------------------------------------------

    def prefetch(self, refs: list[dict], timeout_s: float, ttl_s: float) -> int:
        """Copy pages from their homes into this worker's cache; returns the bytes moved.
        Pages are asked for under the current lease (a shard may have moved since the refs were
        made: the hash still pins the content); a home that moved meanwhile costs one table
        refresh and one retry."""
        deadline = time.monotonic() + timeout_s  # the retry gets what is left, not more
        try:
            return self._prefetch_once(refs, timeout_s, ttl_s)
        except errors.FencingError:
            self.node.refresh_leases()
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.DeadlineExceeded("prefetch of KV pages ran out of time") from None
            return self._prefetch_once(refs, left, ttl_s)

    def _prefetch_once(self, refs: list[dict], timeout_s: float, ttl_s: float) -> int:
        """Pages whose homes are elsewhere, read over the native data plane from every home at
        once, straight into regions of this pool (hash-checked as they land), then checked
        against the hash each ref was published with and committed as cached copies."""
        deadline = time.monotonic() + timeout_s
        table = self.node.leases.table
        if refs and table is None:
            raise errors.Unavailable("this worker has no shard lease table yet")
        missing = [
            r
            for r, page in zip(refs, self.store.lookup([(r["key"], 0, 0) for r in refs]))
            if page is None or page.hash_hex != r.get("hash")
        ]
        by_home: dict[str, list[dict]] = {}
        for ref in missing:
            lease = table.lease(int(ref["shard"])) if table else None
            if lease is None or not lease.held:
                raise errors.Unavailable(f"shard {ref['shard']} has no home right now")
            if lease.holder_worker_id != self.node.worker_id:
                by_home.setdefault(lease.holder_worker_id, []).append(ref)
        if not by_home:
            return 0
        wanted: list[tuple[str, int, int]] = []
        homes: list[native.RemoteHome] = []
        ordered: list[dict] = []
        for home_id, group in by_home.items():
            homes.append(
                native.remote_home(
                    self._data_addr(home_id), list(range(len(wanted), len(wanted) + len(group)))
                )
            )
            for r in group:
                wanted.append((r["key"], int(r["shard"]), table.lease(int(r["shard"])).token))  # type: ignore[union-attr]
            ordered += group
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise errors.DeadlineExceeded("prefetch of pages ran out of time")
        found, failures = self.store.index.fetch_remote(
            wanted,
            homes,
            send_token(self.node.token),
            [self.node.tls.ca, self.node.tls.cert, self.node.tls.key] if self.node.tls else [],
            max(1, int(remaining * 1000)),
        )
        regions = [f[0] for f in found if f is not None]
        try:
            for failure in failures:
                if failure is not None:
                    with self._lock:
                        self._data_addrs.clear()  # the home may be at another port now
                    raise errors.error_named(failure[0], failure[1])
            writes = []
            for ref, page in zip(ordered, found):
                if page is None:
                    raise errors.NotFound(f"page {ref['key']!r} is gone from its home")
                offset, size, dtype, shape, digest = page
                if digest != ref.get("hash"):
                    raise errors.IntegrityError(f"page {ref['key']!r} is not the one published")
                writes.append(
                    PageWrite(ref["key"], 0, 0, dtype, tuple(shape), offset, size, digest)
                )
        except BaseException:
            self.store.free(regions)
            raise
        # Hashed as they landed (the native receiver checked them): no second pass.
        self.store.commit(writes, ttl_s, home=False, check_hashes=False)
        return sum(w.size_bytes for w in writes)

    def _data_addr(self, worker_id: str) -> str:
        """Another worker's data port (the store's worker list, fetched when one is missing)."""
        with self._lock:
            addr = self._data_addrs.get(worker_id)
        if addr is None:
            reply = self.node.store.call("ListWorkers", pb.Empty())
            found = {w.worker_id: w.data_addr for w in map(worker_from_pb, reply.workers)}
            with self._lock:
                self._data_addrs.update({k: v for k, v in found.items() if v})
            addr = found.get(worker_id)
        if not addr:
            raise errors.Unavailable(f"page home {worker_id} has no data port the store knows of")
        return addr


def _write(p: pb.Page, size: int) -> PageWrite:
    return PageWrite(p.key, p.shard, p.token, p.dtype, tuple(p.shape), 0, size, p.hash)
