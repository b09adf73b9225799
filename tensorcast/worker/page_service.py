"""KV page operations on a worker for remote callers (gRPC), and the lease rules behind them.

Every operation on a homed page carries its shard's fencing token, checked against this worker's
cached lease: a stale token or a shard homed elsewhere is a FencingError, and nothing changes.
Same-host callers go through the native page server (worker/server.py), which checks tokens
against the lease table the LeaseCache pushes to the page index and falls back to `_check` here
only for a token it does not hold as named.
"""

from __future__ import annotations

import time

from tensorcast import errors
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.page_calls import get_all
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

    def lookup(self, keys: list[tuple[str, int, int]]) -> list[Page | None]:
        self._check({(shard, token) for _, shard, token in keys if token})
        return self.store.lookup(keys)

    def get(self, keys: list[tuple[str, int, int]]) -> list[pb.Page]:
        """Pages for a prefix of `keys` whose data fits in one gRPC reply (at least one)."""
        found: list[pb.Page] = []
        size = 0
        for page in self.lookup(keys):
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
        try:
            return self._prefetch_once(refs, timeout_s, ttl_s)
        except errors.FencingError:
            self.node.refresh_leases()
            return self._prefetch_once(refs, timeout_s, ttl_s)

    def _prefetch_once(self, refs: list[dict], timeout_s: float, ttl_s: float) -> int:
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
        moved = 0
        for home_id, group in by_home.items():
            lease = table.lease(int(group[0]["shard"]))  # type: ignore[union-attr]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("prefetch of pages ran out of time")
            pages = get_all(
                self.node.peer(home_id, lease.holder_addr),
                [
                    pb.PageKey(
                        key=r["key"],
                        shard=int(r["shard"]),
                        token=table.lease(int(r["shard"])).token,  # type: ignore[union-attr]
                    )
                    for r in group
                ],
                remaining,
            )
            got = []
            for ref, page in zip(group, pages):
                if not page.key:
                    raise errors.NotFound(f"page {ref['key']!r} is gone from its home")
                if page.hash != ref.get("hash"):  # the bytes are checked against it on commit
                    raise errors.IntegrityError(f"page {ref['key']!r} is not the one published")
                got.append((_write(page, len(page.data)), page.data))
                moved += len(page.data)
            self.store.put(got, ttl_s, home=False)
        return moved


def _write(p: pb.Page, size: int) -> PageWrite:
    return PageWrite(p.key, p.shard, p.token, p.dtype, tuple(p.shape), 0, size, p.hash)
