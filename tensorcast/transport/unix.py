"""Framing for the same-host socket between callers and their worker.

A message is a 4-byte little-endian length and a JSON object; a file descriptor may ride along
(SCM_RIGHTS) so callers can map the worker's pool. A message whose JSON has `"blob": N` is
followed by N raw bytes (small tensors put inline, without a region to map), handed to the
receiver as `message["blob"]` (a bytearray). Sockets live in the abstract namespace, which is
per network namespace, just like "same host" for the data plane.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from tensorcast.errors import Unavailable

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_LEN = struct.Struct("<I")


def socket_address(name: str) -> str:
    return "\0tensorcast-" + name


def page_socket_name(local_socket: str) -> str:
    """The native page socket (native/src/page_server.cpp) next to a worker's local socket."""
    return f"{local_socket}-pages"


MAX_FDS = 2  # a worker's hello hands over its pool and its page directory


def send_message(
    sock: socket.socket,
    message: dict[str, Any],
    fds: tuple[int, ...] = (),
    blob: bytes | bytearray | memoryview | None = None,
) -> None:
    if blob is not None:
        message = {**message, "blob": len(blob)}
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) + (len(blob) if blob is not None else 0) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if blob is not None and len(blob) <= 256 * 1024:
        data += blob  # one send: a copy of a small blob costs less than a second syscall
        blob = None
    sock.sendall(data)
    if blob is not None:
        sock.sendall(blob)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; ConnectionResetError if the peer closes first."""
    parts = []
    while size:
        part = sock.recv(min(size, 1 << 20))
        if not part:
            raise ConnectionResetError("peer closed the connection")
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


FIRST_READ_BYTES = 64 * 1024  # a small message (and its blob) usually arrives in one read


def recv_message(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES
) -> tuple[dict[str, Any], list[int]]:
    """One message (with its blob at most `max_bytes`) and any descriptors that came with it.
    Raises ConnectionError on EOF.

    The first read may take more than the message's header: the protocol is strictly one
    request, then its reply, so nothing of a next message can be in the socket yet."""
    data, fds, _flags, _addr = socket.recv_fds(sock, FIRST_READ_BYTES, MAX_FDS)
    if not data:
        raise ConnectionResetError("peer closed the connection")
    if len(data) < _LEN.size:
        data += recv_exact(sock, _LEN.size - len(data))
    (length,) = _LEN.unpack_from(data)
    if length > max_bytes:
        raise ConnectionResetError(f"message of {length} bytes exceeds {max_bytes}")
    end = _LEN.size + length
    if len(data) < end:
        data += recv_exact(sock, end - len(data))
    message = json.loads(data[_LEN.size : end])
    if not isinstance(message, dict):
        raise ConnectionResetError("malformed message")
    blob_bytes = message.get("blob")
    if blob_bytes is not None:
        if not isinstance(blob_bytes, int) or not 0 <= blob_bytes <= max_bytes - length:
            raise ConnectionResetError("malformed message: bad blob length")
        blob = bytearray(blob_bytes)
        view = memoryview(blob)
        got = min(len(data) - end, blob_bytes)
        view[:got] = data[end : end + got]
        while got < blob_bytes:
            n = sock.recv_into(view[got:], min(blob_bytes - got, 1 << 20))
            if not n:
                raise ConnectionResetError("peer closed the connection")
            got += n
        message["blob"] = blob
    elif len(data) > end:
        raise ConnectionResetError("malformed message: bytes after its end")
    return message, list(fds)


def connect(name: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(socket_address(name))
    except OSError as e:
        sock.close()
        raise Unavailable(f"cannot reach the local worker socket {name!r}: {e}") from None
    return sock
