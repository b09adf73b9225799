"""A caller's connection to a worker on the same host (see worker/local_server.py).

Mappings of held contents keep this connection open; when the last tensor over a mapping is
garbage collected its hold is released in the background, and closing the connection releases
everything the worker kept for it.
"""

from __future__ import annotations

import collections
import mmap
import os
import select
import threading
import weakref
from typing import Any

from tensorcast import errors
from tensorcast.transport import native, shm, unix
from tensorcast.types import TensorMeta

_PAGE = mmap.PAGESIZE


class LocalConnection:
    def __init__(self, socket_name: str, token: str, timeout_s: float) -> None:
        self.sock = unix.connect(socket_name, timeout_s)
        self._lock = threading.Lock()
        self.round_trips = 0  # requests sent (a put costs one: tests count them)
        # A round trip failed (the worker is gone, or did not answer in time): no request goes
        # on this connection again. It stays open while mappings of its holds live.
        self.broken = False
        try:
            reply, fds = self._roundtrip({"op": "hello", "token": token})
        except BaseException:
            self.sock.close()
            raise
        if not fds:
            raise errors.Unavailable("worker did not send its pool descriptor")
        self.fd = fds[0]
        self.worker_id = reply["worker_id"]
        self.arena_bytes = int(reply["arena_bytes"])
        self._arena: memoryview | None = None
        self._directory_fd = fds[1] if len(fds) > 1 else None
        self._directory_bytes = int(reply.get("directory_bytes", 0))
        self._directory: Any = None
        self._live_holds = 0
        self._released: collections.deque[int] = collections.deque()
        self._wake = threading.Event()
        self._release_lock = threading.Lock()
        self._closing = False
        self._closed = False
        threading.Thread(target=self._release_loop, name="tc-release", daemon=True).start()

    def _roundtrip(
        self, message: dict[str, Any], blob: bytes | bytearray | memoryview | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            if getattr(self, "_closed", False):
                raise errors.Unavailable("local worker connection is closed")
            if self.broken:
                # A request that failed half-way (a timeout, most often) leaves its reply, or
                # part of it, in the socket: the next read would take it for its own.
                raise errors.Unavailable("local worker connection failed earlier")
            self.round_trips += 1
            try:
                unix.send_message(self.sock, message, blob=blob)
                reply, fds = unix.recv_message(self.sock)
            except (OSError, ConnectionError) as e:
                self.broken = True
                raise errors.Unavailable(f"local worker connection failed: {e}") from None
            except BaseException:
                # Interrupted (Ctrl-C, an exception from a signal handler) between sending and
                # reading the reply: the reply stays in the socket, and the next request would
                # read it as its own (another artifact's region, under its name).
                self.broken = True
                raise
        if not reply.get("ok"):
            raise errors.error_named(str(reply.get("error")), reply.get("message", "worker error"))
        return reply, fds

    @property
    def gone(self) -> bool:
        """The worker ended this connection (it died or restarted), or a request on it failed:
        found without a round trip. Between requests the worker sends nothing, so a socket that
        is readable then has been closed by it."""
        if self.broken or self._closed:
            return True
        if not self._lock.acquire(blocking=False):
            return False  # a request is in flight: it finds out for itself
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            if poller.poll(0):
                self.broken = True
            return self.broken
        finally:
            self._lock.release()

    @property
    def busy(self) -> bool:
        """Another thread's request is in flight on this connection right now."""
        return self._lock.locked()

    def request(
        self, message: dict[str, Any], blob: bytes | bytearray | memoryview | None = None
    ) -> dict[str, Any]:
        """One round trip; `blob` rides along as raw bytes (see transport/unix.py). Holds of
        mappings already collected are released first: a request that needs room (an open, a
        reservation) must not find the pool full of contents this caller let go of."""
        if self._released and message.get("op") != "release":
            self._flush_releases()
        return self._roundtrip(message, blob)[0]

    def map(self, offset: int, size_bytes: int, writable: bool) -> tuple[mmap.mmap, int]:
        """Map [offset, offset+size) of the pool; returns the map and where the region starts in it.

        Read mappings are private (copy-on-write): a caller writing to a tensor changes only its
        own copy, never the pool.
        """
        start = offset - offset % _PAGE
        length = max(offset + size_bytes - start, 1)
        if writable:
            mm = mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED, offset=start)
        else:
            mm = mmap.mmap(
                self.fd,
                length,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=start,
            )
        return mm, offset - start

    def arena(self) -> memoryview:
        """The whole pool, mapped shared once: KV pages are written and read in place. Page
        reads are verified by hash, since the worker may reuse a region after eviction."""
        with self._lock:
            if self._arena is None:
                # Populated now: faulting pages in during every copy would halve its rate.
                self._arena = memoryview(shm.map_pool(self.fd, self.arena_bytes))
            return self._arena

    def directory(self) -> Any:
        """The worker's page directory (native.DirectoryReader), mapped once; None when the
        worker sent none. Looking a page up there takes no round trip to the worker."""
        with self._lock:
            if self._directory is None and self._directory_fd is not None:
                try:
                    self._directory = native.directory_reader(
                        self._directory_fd, self._directory_bytes
                    )
                finally:
                    os.close(self._directory_fd)  # the mapping stays
                    self._directory_fd = None
            return self._directory

    def open(self, content_id: str) -> tuple[mmap.mmap, int, tuple[TensorMeta, ...]]:
        """Hold a content and map it; the hold ends when the returned map is garbage collected."""
        reply = self.request({"op": "open", "content_id": content_id})
        hold_id = reply["hold_id"]
        try:
            mm, base = self.map(reply["offset"], reply["size_bytes"], writable=False)
        except BaseException:
            self.release_now(hold_id)
            raise
        self.release_when_collected(mm, hold_id)
        return mm, base, tuple(TensorMeta.from_json(t) for t in reply["tensors"])

    def release_when_collected(self, owner: object, hold_id: int) -> None:
        """Release the worker's hold `hold_id` (a mapped content, a GPU-tier range) once `owner`
        is garbage collected; this connection stays open until then."""
        with self._lock:
            self._live_holds += 1
        weakref.finalize(owner, self._on_unmapped, hold_id)

    def release_now(self, hold_id: int) -> None:
        self.request({"op": "release", "hold_id": hold_id})

    def _on_unmapped(self, hold_id: int) -> None:
        # Runs inside garbage collection, maybe on a thread holding self._lock: only enqueue.
        self._released.append(hold_id)
        self._wake.set()

    def _flush_releases(self) -> None:
        # One flusher at a time: a caller's request waits for a release in flight, too.
        with self._release_lock:
            while self._released:
                hold_id = self._released.popleft()
                with self._lock:
                    self._live_holds -= 1
                try:
                    self.release_now(hold_id)
                except errors.TensorcastError:
                    pass  # connection gone: the worker released everything already

    def _release_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._flush_releases()
            with self._lock:
                done = self._closing and self._live_holds == 0
            if done:
                self._shutdown()
                return

    def close(self) -> None:
        """Close once no mapping of ours is alive (until then the worker must keep the memory)."""
        with self._lock:
            self._closing = True
        self._wake.set()

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self.sock.close()
            os.close(self.fd)
            if self._directory_fd is not None:
                os.close(self._directory_fd)
                self._directory_fd = None
