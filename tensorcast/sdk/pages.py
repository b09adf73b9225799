"""KV pages: batch `put_pages` / `get_pages` / `exists_pages` straight to the shard homes.

The client caches the shard lease table (one request, refreshed only when a home answers with a
FencingError or is unreachable), so page traffic never touches the Global Store. A home on this
host is reached through its Unix socket and shared memory (one round trip per batch, bytes copied
in place); a remote one through gRPC. Every page is checked end to end by its hash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tensorcast import errors
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import shard_table_from_pb
from tensorcast.rpc.page_calls import get_all
from tensorcast.sdk import gpu_pages
from tensorcast.sdk.page_client import PageConnection, Wanted
from tensorcast.sharding import shard_of
from tensorcast.transport import native
from tensorcast.types import ShardLease, ShardTable

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.runtime import Runtime

MAX_REQUEST_BYTES = 48 * 1024 * 1024  # below the 64 MiB gRPC message limit
PageValue = Any  # a CPU torch.Tensor or a bytes-like object


@dataclass(frozen=True)
class PageRef:
    """Where a stored page lives and what it must hash to."""

    key: str
    shard: int
    token: int
    hash: str
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "shard": self.shard,
            "token": self.token,
            "hash": self.hash,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "size_bytes": self.size_bytes,
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> PageRef:
        return PageRef(
            str(d["key"]),
            int(d["shard"]),
            int(d["token"]),
            str(d["hash"]),
            str(d["dtype"]),
            tuple(int(x) for x in d["shape"]),
            int(d["size_bytes"]),
        )


@dataclass(frozen=True)
class PageData:
    key: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # bytes-like: a bytearray, or a view of the caller's `into` buffer
    hash: str  # checked against the bytes on arrival

    def tensor(self) -> torch.Tensor:
        import torch

        from tensorcast.tensors import TORCH_DTYPES

        dtype = TORCH_DTYPES[self.dtype]
        if isinstance(self.data, torch.Tensor):  # read into a GPU buffer (gpu_pages.py)
            return self.data.view(dtype).reshape(self.shape)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(self.data, dtype=dtype).reshape(self.shape)


def _encode(value: PageValue) -> tuple[str, tuple[int, ...], memoryview]:
    if hasattr(value, "dtype") and hasattr(value, "shape") and hasattr(value, "is_contiguous"):
        from tensorcast import tensors as tmod

        tmod.check_tensors({"page": value})
        if getattr(value, "is_cuda", False):  # stays on the GPU until copied into a pool
            return tmod.dtype_name(value.dtype), tuple(value.shape), value
        view = tmod.tensor_bytes(value).data
        return tmod.dtype_name(value.dtype), tuple(value.shape), view
    view = memoryview(value).cast("B")
    return "U8", (view.nbytes,), view


class Pages:
    def __init__(self, rt: Runtime, fetch_table: Callable[[], pb.ShardTable] | None = None) -> None:
        self.rt = rt
        self._fetch = fetch_table or (lambda: rt.store.call("ListShards", pb.Empty()))
        self._table: ShardTable | None = None
        self._conns: dict[str, PageConnection] = {}  # same-host homes, by worker id
        self._lock = threading.Lock()
        self.table_fetches = 0  # lease table requests made so far (the only metadata traffic)

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def table(self, refresh: bool = False) -> ShardTable:
        with self._lock:
            if self._table is None or refresh:
                self._table = shard_table_from_pb(self._fetch())
                self.table_fetches += 1
            return self._table

    def _home(self, shard: int, table: ShardTable) -> ShardLease:
        lease = table.lease(shard)
        if not lease.held:
            raise errors.Unavailable(
                f"shard {shard} has no home right now (its home left or died; another "
                f"shard-home worker takes it within {table.lease_ttl_s:.0f} s)"
            )
        return lease

    def _each_home(
        self, keys: Sequence[str], fn: Callable[[ShardLease, list[int], list[Wanted]], None]
    ) -> None:
        """Run `fn(home lease, indexes of keys, their (key, shard, token))` once per shard home
        (in requests of at most MAX_PAGE_BATCH keys). Groups that fail with a fencing error or
        an unreachable home are retried once with a fresh lease table."""
        pending = list(range(len(keys)))
        shards: list[int] = []
        num_shards = 0
        error: errors.TensorcastError | None = None
        for attempt in range(2):
            table = self.table(refresh=attempt > 0)
            if table.num_shards != num_shards:
                num_shards = table.num_shards
                shards = [shard_of(k, num_shards) for k in keys]
            groups: dict[str, list[int]] = {}
            leases: dict[str, ShardLease] = {}
            for i in pending:
                lease = self._home(shards[i], table)
                groups.setdefault(lease.holder_worker_id, []).append(i)
                leases[lease.holder_worker_id] = lease
            failed: list[int] = []
            for home, indexes in groups.items():
                for start in range(0, len(indexes), native.MAX_PAGE_BATCH):
                    chunk = indexes[start : start + native.MAX_PAGE_BATCH]
                    wanted = [(keys[i], shards[i], table.leases[shards[i]].token) for i in chunk]
                    try:
                        fn(leases[home], chunk, wanted)
                    except (errors.FencingError, errors.Unavailable) as e:
                        failed += chunk
                        error = e
            if not failed:
                return
            pending = failed
        assert error is not None
        raise error

    def ref_of(self, page: PageData) -> PageRef:
        """The reference of a page just read: its shard, the current token, its hash."""
        shard, token = self._token(page.key)
        size = page.data.nbytes if hasattr(page.data, "nbytes") else len(page.data)
        return PageRef(page.key, shard, token, page.hash, page.dtype, page.shape, size)

    def _token(self, key: str) -> tuple[int, int]:
        table = self.table()
        shard = shard_of(key, table.num_shards)
        return shard, table.lease(shard).token

    def _local(self, lease: ShardLease) -> PageConnection | None:
        if lease.holder_host_id != self.rt.host_id or not lease.holder_local_socket:
            return None
        return self._connection(lease.holder_worker_id, lease.holder_local_socket)

    def _connection(self, worker_id: str, local_socket: str) -> PageConnection:
        """The native page connection to a same-host worker (its pool mapped through the local
        connection)."""
        with self._lock:
            conn = self._conns.get(worker_id)
            if conn is not None and conn.broken:  # e.g. the worker restarted its page server
                del self._conns[worker_id]
                conn.close()
                conn = None
        if conn is None:
            local = self.rt.local_connection_to(worker_id, local_socket)
            conn = PageConnection(
                local_socket, local.arena, self.rt.token, self.rt.timeout_s, local.directory
            )
            with self._lock:
                kept = self._conns.setdefault(worker_id, conn)
            if kept is not conn:
                conn.close()
                conn = kept
        return conn

    # -- the batch API -------------------------------------------------------------------------

    def put_pages(self, pages: Mapping[str, PageValue], ttl_s: float = 600.0) -> list[PageRef]:
        """Store pages under their keys for `ttl_s` (a page put again is replaced)."""
        keys = list(pages)
        encoded = [_encode(pages[k]) for k in keys]
        refs: list[PageRef | None] = [None] * len(keys)

        def put(lease: ShardLease, indexes: list[int], wanted: list[Wanted]) -> None:
            metas = [(*w, *encoded[i][:2]) for i, w in zip(indexes, wanted)]
            views = [encoded[i][2] for i in indexes]
            conn = self._local(lease)
            if conn is not None and any(gpu_pages.on_device(v) for v in views):
                hashes = gpu_pages.put_local(conn, ttl_s, metas, views)
            elif conn is not None:  # hashed as it is copied into the home's pool
                hashes = conn.put(ttl_s, metas, views)
            else:
                views = [gpu_pages.host_bytes(v) for v in views]
                hashes = native.hash_buffers(views)
                self._put_remote(
                    lease,
                    [
                        pb.Page(
                            key=k, shard=s, token=t, dtype=d, shape=list(sh), data=bytes(v), hash=h
                        )
                        for (k, s, t, d, sh), v, h in zip(metas, views, hashes)
                    ],
                    ttl_s,
                )
            for i, (key, shard, token, dtype, shape), view, digest in zip(
                indexes, metas, views, hashes
            ):
                refs[i] = PageRef(key, shard, token, digest, dtype, shape, view.nbytes)

        self._each_home(keys, put)
        return [r for r in refs if r is not None]

    def _put_remote(self, lease: ShardLease, pages: list[pb.Page], ttl_s: float) -> None:
        """PutPages in requests below the gRPC message limit."""
        stub = self._stub(lease)
        start, size = 0, 0
        for end, page in enumerate(pages):
            if size + len(page.data) > MAX_REQUEST_BYTES and end > start:
                stub.call("PutPages", pb.PutPagesRequest(pages=pages[start:end], ttl_s=ttl_s))
                start, size = end, 0
            size += len(page.data)
        stub.call("PutPages", pb.PutPagesRequest(pages=pages[start:], ttl_s=ttl_s))

    def get_pages(
        self,
        keys: Sequence[str | PageRef],
        *,
        cache: Any = None,
        into: Sequence[Any] | None = None,
    ) -> list[PageData | None]:
        """Pages by key (None where absent or expired). With `cache` (a local WorkerInfo) and
        PageRefs, copies that worker holds with the right hash are used first.

        `into` (writable buffers aligned with `keys`, e.g. an engine's preallocated KV blocks)
        receives the bytes instead of new allocations: copying into memory already touched is
        several times faster than into fresh pages. A page larger than its buffer is an error.
        """
        if into is not None and len(into) != len(keys):
            raise errors.InvalidArgument("`into` needs one buffer per key")
        if into is not None and any(gpu_pages.on_device(b) for b in into):
            return gpu_pages.get_into_device(self, keys, into, cache)
        names = [k.key if isinstance(k, PageRef) else k for k in keys]
        out: list[PageData | None] = [None] * len(names)
        todo = list(range(len(names)))
        if cache is not None:
            expected = {i: k.hash for i, k in enumerate(keys) if isinstance(k, PageRef)}
            conn = self._connection(cache.worker_id, cache.local_socket)
            found = self._get_local(conn, [(names[i], 0, 0) for i in todo], into)
            for i, page in zip(todo, found):
                if page is not None and (i not in expected or page.hash == expected[i]):
                    out[i] = page
            todo = [i for i in todo if out[i] is None]
        if not todo:
            return out

        # Pages found on same-host homes, copied out of their pools together after every
        # lookup (one parallel copy for the whole batch, not one per home).
        located: list[tuple[int, PageData]] = []
        sources: list[memoryview] = []

        def get(lease: ShardLease, ix: list[int], wanted: list[Wanted]) -> None:
            indexes = [todo[j] for j in ix]
            conn = self._local(lease)
            if conn is not None:
                pages, regions = self._locate_local(
                    conn, wanted, [into[i] for i in indexes] if into else None
                )
                located.extend((i, p) for i, p in zip(indexes, pages) if p is not None)
                sources.extend(regions)
                return
            got = get_all(
                self._stub(lease),
                [pb.PageKey(key=k, shard=s, token=t) for k, s, t in wanted],
                self.rt.timeout_s,
            )
            for i, page in zip(indexes, (_from_pb(p) for p in got)):
                if page is not None and into is not None:
                    dest = _buffer(into[i], len(page.data))
                    dest[:] = page.data
                    page = replace(page, data=dest)
                out[i] = page

        self._each_home([names[i] for i in todo], get)
        for (i, _), page in zip(located, _copy_checked([p for _, p in located], sources)):
            out[i] = page
        return out

    @staticmethod
    def _get_local(
        conn: PageConnection, wanted: list[tuple[str, int, int]], into: Sequence[Any] | None = None
    ) -> list[PageData | None]:
        pages, sources = Pages._locate_local(conn, wanted, into)
        copied = iter(_copy_checked([p for p in pages if p is not None], sources))
        return [None if p is None else next(copied) for p in pages]

    @staticmethod
    def _locate_local(
        conn: PageConnection, wanted: list[tuple[str, int, int]], into: Sequence[Any] | None
    ) -> tuple[list[PageData | None], list[memoryview]]:
        """The pages a same-host worker holds (their buffers not filled yet), and the regions
        of its pool to copy them from (one per page found)."""
        found = conn.get(wanted)
        arena = conn.arena()
        pages: list[PageData | None] = []
        sources = []
        for i, info in enumerate(found):
            if info is None:
                pages.append(None)
                continue
            off, size, dtype, shape, digest = info
            data = _buffer(into[i], size) if into is not None else bytearray(size)
            sources.append(arena[off : off + size])
            pages.append(PageData(wanted[i][0], dtype, shape, data, digest))
        return pages, sources

    def exists_pages(self, keys: Sequence[str]) -> list[bool]:
        out = [False] * len(keys)

        def exists(lease: ShardLease, indexes: list[int], wanted: list[Wanted]) -> None:
            conn = self._local(lease)
            if conn is not None:
                flags = conn.exists(wanted)
            else:
                reply = self._stub(lease).call(
                    "ExistsPages",
                    pb.PageKeys(keys=[pb.PageKey(key=k, shard=s, token=t) for k, s, t in wanted]),
                )
                flags = list(reply.exists)
            for i, flag in zip(indexes, flags):
                out[i] = bool(flag)

        self._each_home(list(keys), exists)
        return out

    def _stub(self, lease: ShardLease):
        return self.rt.worker_stub_at(lease.holder_worker_id, lease.holder_addr)


def _buffer(target: Any, size: int) -> Any:
    """The first `size` bytes of a caller's buffer (bytearray, memoryview, CPU tensor)."""
    if hasattr(target, "numpy"):
        target = target.numpy()
    view = memoryview(target).cast("B")
    if view.readonly or view.nbytes < size:
        raise errors.InvalidArgument(
            f"a {size}-byte page does not fit its {view.nbytes}-byte buffer"
        )
    return view[:size]


def _copy_checked(pages: list[PageData], sources: list[memoryview]) -> list[PageData | None]:
    """Copy each source into its page's buffer, hashing it as it goes. A page evicted and its
    region reused while it was copied reads as absent (None), never as other bytes."""
    hashes = native.copy_hash_many([p.data for p in pages], sources)
    return [p if h == p.hash else None for p, h in zip(pages, hashes)]


def _from_pb(p: pb.Page) -> PageData | None:
    if not p.key:
        return None
    if native.hash_buffer(p.data) != p.hash:
        raise errors.IntegrityError(f"page {p.key!r} arrived damaged (hash mismatch)")
    return PageData(p.key, p.dtype, tuple(p.shape), bytearray(p.data), p.hash)
