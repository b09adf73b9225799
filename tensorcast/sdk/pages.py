"""KV pages: batch `put_pages` / `get_pages` / `exists_pages` straight to the shard homes.

The client caches the shard lease table (one request, refreshed only when a home answers with a
FencingError or is unreachable) and the homes' data ports, so page traffic never touches the
Global Store. A home on this host is reached through its Unix socket and shared memory (one round
trip per batch, bytes copied in place); a home on another host through the native data plane
(its data port: binary page frames, every home of a batch in parallel, bytes sent from and
received into the caller's buffers). Every page is checked end to end by its hash.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorcast import errors
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import shard_table_from_pb
from tensorcast.sdk import gpu_pages
from tensorcast.sdk.page_client import PageConnection, Wanted
from tensorcast.sharding import shard_of
from tensorcast.transport import native
from tensorcast.types import ShardLease, ShardTable

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.runtime import Runtime

PageValue = Any  # a CPU torch.Tensor or a bytes-like object
# A remote home's share of a batch: its lease, the batch's indexes it holds, their (key, shard,
# token). Remote calls take every home's share at once and return an error (or None) per share.
RemoteGroup = tuple[ShardLease, list[int], list[Wanted]]


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
        self._data_addrs: dict[str, str] = {}  # every worker's data port, by worker id
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
                if refresh:
                    self._data_addrs.clear()  # a home may have restarted on another port
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
        self,
        keys: Sequence[str],
        local: Callable[[PageConnection, list[int], list[Wanted]], None],
        remote: Callable[[list[RemoteGroup]], list[errors.TensorcastError | None]],
        *,
        partial: bool = False,
    ) -> list[int]:
        """Run `local(connection, indexes of keys, their (key, shard, token))` for each home on
        this host (in requests of at most MAX_PAGE_BATCH keys) and `remote(groups)` once for
        every home on other hosts (the native call runs them in parallel), the remote homes'
        call running meanwhile on a thread of its own when there are both: a batch's bytes
        cross the network while the same-host homes' share is copied, not after it. Keys whose
        home failed with a fencing error or was unreachable are retried once with a fresh lease
        table. What still fails raises, unless `partial` and other homes served their keys:
        then the indexes left unserved are returned (reads treat them as absent)."""
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
            failed: list[int] = []
            for i in pending:
                try:
                    lease = self._home(shards[i], table)
                except errors.Unavailable as e:
                    failed.append(i)
                    error = e
                    continue
                groups.setdefault(lease.holder_worker_id, []).append(i)
                leases[lease.holder_worker_id] = lease
            far: list[RemoteGroup] = []
            near: list[tuple[PageConnection, list[int], list[Wanted]]] = []
            for home, indexes in groups.items():
                lease = leases[home]
                wanted = [(keys[i], shards[i], table.leases[shards[i]].token) for i in indexes]
                try:
                    conn = self._local(lease)
                except errors.Unavailable as e:
                    failed += indexes
                    error = e
                    continue
                if conn is None:
                    far.append((lease, indexes, wanted))
                else:
                    near.append((conn, indexes, wanted))
            far_call = _Background(remote, far) if far and near else None
            try:
                for conn, indexes, wanted in near:
                    for start in range(0, len(indexes), native.MAX_PAGE_BATCH):
                        end = start + native.MAX_PAGE_BATCH
                        try:
                            local(conn, indexes[start:end], wanted[start:end])
                        except (errors.FencingError, errors.Unavailable) as e:
                            failed += indexes[start:end]
                            error = e
            except BaseException:
                if far_call is not None:
                    far_call.join()  # never leave it writing into the caller's buffers
                raise
            if far:
                far_failures = far_call.result() if far_call is not None else remote(far)
                for (_, indexes, _), failure in zip(far, far_failures):
                    if failure is None:
                        continue
                    if not isinstance(failure, (errors.FencingError, errors.Unavailable)):
                        raise failure
                    failed += indexes
                    error = failure
            if not failed:
                return []
            pending = failed
        assert error is not None
        if partial and len(pending) < len(keys):
            return pending
        raise error

    def _remote_homes(self, groups: list[RemoteGroup]) -> list[native.RemoteHome]:
        """Each group's home as the native calls take it: its data port and the group's
        positions in the call's own key list (groups in order, back to back)."""
        homes, at = [], 0
        for lease, indexes, _ in groups:
            homes.append(
                native.remote_home(self._data_addr(lease), list(range(at, at + len(indexes))))
            )
            at += len(indexes)
        return homes

    def _data_addr(self, lease: ShardLease) -> str:
        """A remote home's data port, from the store's worker list (fetched when a home is not
        in it yet, and again after a lease table refresh)."""
        with self._lock:
            addr = self._data_addrs.get(lease.holder_worker_id)
        if addr is None:
            found = {w.worker_id: w.data_addr for w in self.rt.workers() if w.data_addr}
            with self._lock:
                self._data_addrs.update(found)
            addr = found.get(lease.holder_worker_id)
        if not addr:
            raise errors.Unavailable(
                f"page home {lease.holder_worker_id} has no data port the store knows of"
            )
        return addr

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
            self.drop_gone_connections()
            conn = PageConnection(
                local_socket, local.arena, self.rt.token, self.rt.timeout_s, local.directory
            )
            with self._lock:
                kept = self._conns.setdefault(worker_id, conn)
            if kept is not conn:
                conn.close()
                conn = kept
        return conn

    def drop_gone_connections(self) -> None:
        """Close the page connections to same-host workers whose local connection the runtime
        dropped (dead or restarted: see Runtime._drop_gone_connections); each holds its
        worker's pool mapped."""
        with self._lock:
            gone = [
                w
                for w, conn in self._conns.items()
                if conn.broken or not self.rt.has_live_local_connection(w)
            ]
            for worker_id in gone:
                self._conns.pop(worker_id).close()

    # -- the batch API -------------------------------------------------------------------------

    def put_pages(self, pages: Mapping[str, PageValue], ttl_s: float = 600.0) -> list[PageRef]:
        """Store pages under their keys for `ttl_s` (a page put again is replaced). Each read
        (`get_pages`) renews a page's lease for its `ttl_s` again; `exists_pages` does not."""
        keys = list(pages)
        encoded = [_encode(pages[k]) for k in keys]
        refs: list[PageRef | None] = [None] * len(keys)

        def done(indexes: list[int], metas: list, views: list, hashes: list[str]) -> None:
            for i, (key, shard, token, dtype, shape), view, digest in zip(
                indexes, metas, views, hashes
            ):
                refs[i] = PageRef(key, shard, token, digest, dtype, shape, view.nbytes)

        def local(conn: PageConnection, indexes: list[int], wanted: list[Wanted]) -> None:
            metas = [(*w, *encoded[i][:2]) for i, w in zip(indexes, wanted)]
            views = [encoded[i][2] for i in indexes]
            if any(gpu_pages.on_device(v) for v in views):
                hashes = gpu_pages.put_local(conn, ttl_s, metas, views)
            else:  # hashed as it is copied into the home's pool
                hashes = conn.put(ttl_s, metas, views)
            done(indexes, metas, views, hashes)

        def remote(groups: list[RemoteGroup]) -> list[errors.TensorcastError | None]:
            indexes = [i for _, ix, _ in groups for i in ix]
            metas = [(*w, *encoded[i][:2]) for _, ix, ws in groups for i, w in zip(ix, ws)]
            views = [gpu_pages.host_bytes(encoded[i][2]) for i in indexes]
            hashes, failures = native.remote_put(
                metas,
                views,
                self._remote_homes(groups),
                self.rt.token,
                ttl_s=ttl_s,
                tls=self.rt.tls,
                timeout_s=self.rt.timeout_s,
            )
            at = 0
            for (_, ix, _), failure in zip(groups, failures):
                if failure is None:
                    part = slice(at, at + len(ix))
                    done(ix, metas[part], views[part], hashes[part])
                at += len(ix)
            return failures

        self._each_home(keys, local, remote)
        return [r for r in refs if r is not None]

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

        A batch whose keys live at several homes reads the pages of a home that cannot be
        reached (killed, cut off) as absent and returns the others; when no home of the batch
        can be reached, it raises Unavailable.
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

        def local(conn: PageConnection, ix: list[int], wanted: list[Wanted]) -> None:
            indexes = [todo[j] for j in ix]
            pages, regions = self._locate_local(
                conn, wanted, [into[i] for i in indexes] if into else None
            )
            located.extend((i, p) for i, p in zip(indexes, pages) if p is not None)
            sources.extend(regions)

        def remote(groups: list[RemoteGroup]) -> list[errors.TensorcastError | None]:
            indexes = [todo[j] for _, ix, _ in groups for j in ix]
            got, failures = self._get_remote(
                [w for _, _, ws in groups for w in ws],
                self._remote_homes(groups),
                [into[i] for i in indexes] if into is not None else None,
            )
            for i, page in zip(indexes, got):
                out[i] = page
            return failures

        self._each_home([names[i] for i in todo], local, remote, partial=True)
        for (i, _), page in zip(located, _copy_checked([p for _, p in located], sources)):
            out[i] = page
        drop_other_versions(keys, out, todo)
        return out

    def _get_remote(
        self,
        wanted: list[Wanted],
        homes: list[native.RemoteHome],
        into: Sequence[Any] | None,
    ) -> tuple[list[PageData | None], list[errors.TensorcastError | None]]:
        """Pages from remote homes, straight into `into`'s buffers (or new bytearrays)."""
        buffers = None if into is None else [_writable(b) for b in into]
        got, failures = native.remote_get(
            wanted,
            homes,
            self.rt.token,
            into=buffers,
            tls=self.rt.tls,
            timeout_s=self.rt.timeout_s,
        )
        pages: list[PageData | None] = []
        for j, page in enumerate(got):
            if page is None:
                pages.append(None)
                continue
            size, dtype, shape, digest, data = page
            if buffers is not None:
                data = buffers[j][:size]
            pages.append(PageData(wanted[j][0], dtype, tuple(shape), data, digest))
        return pages, failures

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
        """Whether each page is stored (pages of a home that cannot be reached count as
        absent when other homes of the batch answered, as in get_pages)."""
        out = [False] * len(keys)

        def local(conn: PageConnection, indexes: list[int], wanted: list[Wanted]) -> None:
            for i, flag in zip(indexes, conn.exists(wanted)):
                out[i] = bool(flag)

        def remote(groups: list[RemoteGroup]) -> list[errors.TensorcastError | None]:
            indexes = [i for _, ix, _ in groups for i in ix]
            found, failures = native.remote_exists(
                [w for _, _, ws in groups for w in ws],
                self._remote_homes(groups),
                self.rt.token,
                tls=self.rt.tls,
                timeout_s=self.rt.timeout_s,
            )
            for i, flag in zip(indexes, found):
                out[i] = bool(flag)
            return failures

        self._each_home(list(keys), local, remote, partial=True)
        return out


def drop_other_versions(
    keys: Sequence[str | PageRef], out: list[PageData | None], indexes: Sequence[int]
) -> None:
    """A reference names one version of its page: another version stored under its key since
    (the key put again) reads as absent, never as the referenced data."""
    for i in indexes:
        key, page = keys[i], out[i]
        if page is not None and isinstance(key, PageRef) and page.hash != key.hash:
            out[i] = None


class _Background:
    """`fn(*args)` on a thread of its own; `result()` waits for it and returns its value or
    raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:
            self._error = e

    def join(self) -> None:
        self._thread.join()  # bounded: the remote call has the runtime's timeout

    def result(self) -> Any:
        self.join()
        if self._error is not None:
            raise self._error
        return self._value


def _writable(target: Any) -> memoryview:
    """A caller's buffer (bytearray, memoryview, CPU tensor) as writable bytes."""
    if hasattr(target, "numpy"):
        target = target.numpy()
    view = memoryview(target).cast("B")
    if view.readonly:
        raise errors.InvalidArgument("an `into` buffer is read-only")
    return view


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
