"""Framing for the same-host socket between callers and their worker.

A message is a 4-byte little-endian length and a JSON object; a file descriptor may ride along
(SCM_RIGHTS) so callers can map the worker's pool. Sockets live in the abstract namespace, which is
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


def send_message(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts = []
    while size:
        part = sock.recv(min(size, 1 << 20))
        if not part:
            raise ConnectionResetError("peer closed the connection")
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and any descriptors that came with it. Raises ConnectionError on EOF."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, MAX_FDS)
    if not head:
        raise ConnectionResetError("peer closed the connection")
    if len(head) < _LEN.size:
        head += _recv_exact(sock, _LEN.size - len(head))
    (length,) = _LEN.unpack(head)
    if length > MAX_MESSAGE_BYTES:
        raise ConnectionResetError(f"message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
    message = json.loads(_recv_exact(sock, length))
    if not isinstance(message, dict):
        raise ConnectionResetError("malformed message")
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
