"""A caller's connection to a same-host worker's native page server (native/src/page_server.cpp).

The small requests of page operations (allocate regions, commit written pages, look pages up)
go over this socket in a compact binary format; the page bytes themselves are written and read
in place in the worker's pool, mapped through the local connection. The worker answers from C++
without its GIL, so a single page costs one short round trip.
"""

from __future__ import annotations

import select
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorcast import errors
from tensorcast.transport import unix

VERSION = 1
HELLO, ALLOC, COMMIT, GET, EXISTS = 1, 2, 3, 4, 5
_HEADER = struct.Struct("<BBHI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_GET_FOUND = struct.Struct("<QQ")  # offset, size
MAX_REPLY_BYTES = 64 * 1024 * 1024
# The worker answers in microseconds, and a thread asleep in recv() takes tens of them to wake:
# watch for the reply this long before sleeping.
SPIN_S = 100e-6

Wanted = tuple[str, int, int]  # key, shard, token (0: any copy)


def _str(s: str) -> bytes:
    b = s.encode()
    if len(b) > 0xFFFF:
        raise errors.InvalidArgument(f"string of {len(b)} bytes in a page request")
    return struct.pack("<H", len(b)) + b


def _shape(shape: Sequence[int]) -> bytes:
    if len(shape) > 255:
        raise errors.InvalidArgument(f"page shape of {len(shape)} dimensions")
    return struct.pack(f"<B{len(shape)}q", len(shape), *shape)


def _keys(wanted: Sequence[Wanted]) -> bytes:
    parts = [_U32.pack(len(wanted))]
    for key, shard, token in wanted:
        parts += (_str(key), struct.pack("<IQ", shard, token))
    return b"".join(parts)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0

    def take(self, s: struct.Struct) -> tuple:
        out = s.unpack_from(self.data, self.at)
        self.at += s.size
        return out

    def str(self) -> str:
        (n,) = struct.unpack_from("<H", self.data, self.at)
        self.at += 2 + n
        return bytes(self.data[self.at - n : self.at]).decode()

    def shape(self) -> tuple[int, ...]:
        ndim = self.data[self.at]
        dims = struct.unpack_from(f"<{ndim}q", self.data, self.at + 1)
        self.at += 1 + 8 * ndim
        return tuple(dims)


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
        `directory` gives the worker's page directory (LocalConnection.directory) or None:
        lookups try it first and ask the worker only for what it does not show."""
        self.arena = arena
        self.directory = directory
        self.sock = unix.connect(unix.page_socket_name(local_socket), timeout_s)
        self._readable = select.poll()
        self._readable.register(self.sock, select.POLLIN)
        self._lock = threading.Lock()
        # Page regions the worker allocated for this connection's next puts (size -> offsets):
        # a put then takes one round trip (write, commit) instead of two. They are the
        # connection's on the worker's side too and are freed when it closes.
        self.spare_pages: dict[int, list[int]] = {}
        self.spare_lock = threading.Lock()
        self.broken = False  # the connection failed: callers open a new one
        try:
            self.arena_bytes = _U64.unpack(self._call(HELLO, _str(token)))[0]
        except BaseException:
            self.sock.close()
            raise

    def _call(self, op: int, body: bytes) -> bytes:
        with self._lock:
            try:
                self.sock.sendall(_HEADER.pack(VERSION, op, 0, len(body)) + body)
                until = time.perf_counter() + SPIN_S
                while not self._readable.poll(0) and time.perf_counter() < until:
                    pass
                version, status, _, size = _HEADER.unpack(self._recv(_HEADER.size))
                if version != VERSION or size > MAX_REPLY_BYTES:
                    raise ConnectionResetError("malformed reply from the page server")
                reply = self._recv(size)
            except OSError as e:
                self.broken = True
                raise errors.Unavailable(f"local worker page connection failed: {e}") from None
        if status != 0:
            r = _Reader(reply)
            kind = r.str()
            (n,) = r.take(_U32)
            message = bytes(r.data[r.at : r.at + n]).decode(errors="replace")
            raise errors.error_named(kind, message)
        return reply

    def _recv(self, size: int) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionResetError("the worker closed the page connection")
            got += n
        return bytes(buf)

    def alloc(self, sizes: Sequence[int]) -> list[int]:
        reply = self._call(ALLOC, _U32.pack(len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes))
        (n,) = _U32.unpack_from(reply)
        return list(struct.unpack_from(f"<{n}Q", reply, 4))

    def commit(
        self, ttl_s: float, pages: Sequence[dict[str, Any]], ahead: Sequence[int]
    ) -> list[int]:
        """Index pages written at their offsets; returns regions reserved for the next put."""
        parts = [struct.pack("<dI", ttl_s, len(pages))]
        for p in pages:
            parts += (
                _str(p["key"]),
                struct.pack("<IQ", p["shard"], p["token"]),
                _str(p["dtype"]),
                _shape(p["shape"]),
                struct.pack("<QQ", p["offset"], p["size_bytes"]),
                _str(p["hash"]),
            )
        parts += (_U32.pack(len(ahead)), struct.pack(f"<{len(ahead)}Q", *ahead))
        reply = self._call(COMMIT, b"".join(parts))
        (n,) = _U32.unpack_from(reply)
        return list(struct.unpack_from(f"<{n}Q", reply, 4))

    def get(self, wanted: Sequence[Wanted]) -> list[dict[str, Any] | None]:
        """Where each page lies in the pool (offset, size_bytes, dtype, shape, hash), or None.
        The shared-memory directory answers first; the worker is asked for the rest."""
        directory = self._live_directory()
        if directory is None:
            return self._get(wanted)
        out: list[dict[str, Any] | None] = []
        missing: list[int] = []
        for i, hit in enumerate(directory.lookup(wanted)):
            if hit is None:
                missing.append(i)
                out.append(None)
            else:
                offset, size, dtype, shape, digest = hit
                out.append(
                    {
                        "offset": offset,
                        "size_bytes": size,
                        "dtype": dtype,
                        "shape": shape,
                        "hash": digest,
                    }
                )
        if missing:
            for i, found in zip(missing, self._get([wanted[i] for i in missing])):
                out[i] = found
        return out

    def _live_directory(self) -> Any:
        """The directory, once the worker is known to be alive: a dead worker's memory stays
        mapped here, but its pages must read as gone (as over the socket)."""
        directory = self.directory()
        if directory is not None:
            with self._lock:  # (not while a call's reply is in flight)
                # The worker never writes unasked: anything readable is its end closing.
                gone = bool(self._readable.poll(0))
            if gone:
                self.broken = True
                raise errors.Unavailable("local worker page connection closed: the worker is gone")
        return directory

    def _get(self, wanted: Sequence[Wanted]) -> list[dict[str, Any] | None]:
        r = _Reader(self._call(GET, _keys(wanted)))
        (n,) = r.take(_U32)
        out: list[dict[str, Any] | None] = []
        for _ in range(n):
            found = r.data[r.at]
            r.at += 1
            if not found:
                out.append(None)
                continue
            offset, size = r.take(_GET_FOUND)
            dtype = r.str()
            shape = r.shape()
            out.append(
                {
                    "offset": offset,
                    "size_bytes": size,
                    "dtype": dtype,
                    "shape": shape,
                    "hash": r.str(),
                }
            )
        return out

    def exists(self, wanted: Sequence[Wanted]) -> list[bool]:
        directory = self._live_directory()
        if directory is None:
            return self._exists(wanted)
        out = [hit is not None for hit in directory.lookup(wanted)]
        missing = [i for i, hit in enumerate(out) if not hit]
        if missing:
            for i, found in zip(missing, self._exists([wanted[i] for i in missing])):
                out[i] = found
        return out

    def _exists(self, wanted: Sequence[Wanted]) -> list[bool]:
        reply = self._call(EXISTS, _keys(wanted))
        (n,) = _U32.unpack_from(reply)
        return [bool(b) for b in reply[4 : 4 + n]]

    def close(self) -> None:
        with self._lock:
            self.sock.close()
