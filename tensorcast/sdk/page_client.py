"""A caller's connection to a same-host worker's native page server (native/src/page_server.cpp).

The small requests of page operations (allocate regions, commit written pages, look pages up)
go over this socket in a compact binary format spoken by the native client
(native/src/page_client.cpp); the page bytes themselves are written and read in place in the
worker's pool, mapped through the local connection. Both ends run in C++ without the GIL, so a
single page costs one short round trip. Lookups try the worker's shared-memory page directory
first and ask the worker only for what it does not show.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensorcast import errors
from tensorcast.sdk import gpu_pages
from tensorcast.transport import native, unix

# Page socket operations (native/include/tensorcast/page_server.h), for requests_sent().
HELLO, ALLOC, COMMIT, GET, EXISTS, WAKE = 1, 2, 3, 4, 5, 6

Wanted = tuple[str, int, int]  # key, shard, token (0: any copy)
# Where a page lies in the pool and what it is: offset, size_bytes, dtype, shape, hash.
Found = tuple[int, int, str, tuple[int, ...], str]
# A page to put: key, shard, token, dtype, shape (its bytes go alongside).
PutMeta = tuple[str, int, int, str, tuple[int, ...]]


class PageConnection:
    def __init__(
        self,
        local_socket: str,
        arena: Callable[[], memoryview],
        token: str,
        timeout_s: float,
        directory: Callable[[], Any] = lambda: None,
    ) -> None:
        """`arena` maps the worker's pool (LocalConnection.arena): page bytes go through it.
        `directory` gives the worker's page directory (LocalConnection.directory) or None."""
        self.arena = arena
        self.directory = directory
        sock = unix.connect(unix.page_socket_name(local_socket), timeout_s)
        self.client = native.PageClient(sock.detach(), max(1, int(timeout_s * 1000)))
        try:
            self.arena_bytes: int = self.client.hello(token)
        except BaseException:
            self.client.close()
            raise

    @property
    def broken(self) -> bool:
        """The connection failed: callers open a new one."""
        return bool(self.client.broken)

    def put(self, ttl_s: float, pages: Sequence[PutMeta], views: Sequence[Any]) -> list[str]:
        """Copy each page into the pool (hashed as it is copied) and commit them; returns the
        hashes. Steady puts of one page size take one round trip (regions reserved ahead)."""
        return list(self.client.put(self.arena(), ttl_s, pages, views))

    def alloc(self, sizes: Sequence[int]) -> list[int]:
        return list(self.client.alloc(list(sizes)))

    def commit(
        self, ttl_s: float, pages: Sequence[dict[str, Any]], ahead: Sequence[int]
    ) -> list[int]:
        """Index pages written at their offsets; returns regions reserved for the next put."""
        writes = [
            (
                p["key"],
                p["shard"],
                p["token"],
                p["dtype"],
                list(p["shape"]),
                p["offset"],
                p["size_bytes"],
                p["hash"],
            )
            for p in pages
        ]
        return list(self.client.commit(ttl_s, writes, list(ahead)))

    def spare(self) -> dict[int, list[int]]:
        """Regions reserved for this connection's next puts: page size -> offsets."""
        return {int(n): list(v) for n, v in self.client.spare().items()}

    def get(self, wanted: Sequence[Wanted]) -> list[Found | None]:
        """Where each page lies in the pool, or None. The caller reads the pages found: that
        renews their leases (through the directory, when they reach their expiry)."""
        directory = self._live_directory()
        if directory is None:
            return list(self.client.get(wanted))
        out: list[Found | None] = directory.lookup(wanted, read=True)
        missing = [i for i, hit in enumerate(out) if hit is None]
        if missing:
            for i, found in zip(missing, self.client.get([wanted[i] for i in missing])):
                out[i] = found
        return out

    def exists(self, wanted: Sequence[Wanted]) -> list[bool]:
        directory = self._live_directory()
        if directory is None:
            return list(self.client.exists(wanted))
        out = [hit is not None for hit in directory.lookup(wanted, read=False)]
        missing = [i for i, hit in enumerate(out) if not hit]
        if missing:
            for i, found in zip(missing, self.client.exists([wanted[i] for i in missing])):
                out[i] = found
        return out

    def _live_directory(self) -> Any:
        """The directory, once the worker is known to be alive: a dead worker's memory stays
        mapped here, but its pages must read as gone (as over the socket)."""
        directory = self.directory()
        if directory is not None and self.client.hung_up():
            raise errors.Unavailable("local worker page connection closed: the worker is gone")
        return directory

    def close(self) -> None:
        gpu_pages.unpin(self)
        self.client.close()
