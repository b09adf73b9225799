"""The Global Store's frame port: its unary calls as length-prefixed protobuf frames over TCP.

Why: a Python gRPC unary round trip costs ~0.65 ms on a 2-core host (the server's polling
thread hands each call to a pool thread and back; the client builds a call object per request),
a framed round trip on a kept-open socket ~0.08 ms; a worker's store request is most of a
same-host put's time (docs/architecture.md decision 76). Same messages, same handlers, same
token; gRPC stays for everything else (streams, TLS clusters, clients that never learned the
port) and is where a frame client falls back whenever the port cannot be used.

Wire (big-endian):
  hello     client: b"TCSF" u8 version u16 n, token[n]
            server: u8 status (0 ok, 1 refused) u16 n, message[n] (then closes when refused)
  request   u32 payload_len u16 name_len, method name, payload (the serialized request)
  reply     u32 payload_len u8 status, payload: the serialized reply (status 0) or JSON
            {"kind": error class, "message": ...} (status 1)
Bounded: payloads up to MAX_MESSAGE_BYTES, names up to 64 bytes, MAX_CONNECTIONS per server, a
frame's body within BODY_TIMEOUT_S once its header arrived; a client keeps at most MAX_IDLE
connections open and every call has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from typing import Any

from tensorcast.config import MAX_MESSAGE_BYTES, TLSFiles, send_token, token_accepted
from tensorcast.errors import (
    InvalidArgument,
    TensorcastError,
    Unauthenticated,
    error_named,
    public_name,
)
from tensorcast.metrics import RPC_LATENCY
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.client import FailoverStub, NoAnswer
from tensorcast.transport.unix import recv_exact

log = logging.getLogger(__name__)

MAGIC = b"TCSF"
VERSION = 1
HELLO = struct.Struct("!4sBH")
HELLO_REPLY = struct.Struct("!BH")
REQUEST = struct.Struct("!IH")
REPLY = struct.Struct("!IB")
MAX_NAME = 64
MAX_CONNECTIONS = 128
MAX_IDLE = 8
BODY_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 2.0


class FrameTransportError(Exception):
    """The frame connection failed (refused, reset, closed, malformed): nothing was answered,
    so the caller may send the call another way (gRPC)."""


def _unary_methods(service: str) -> dict[str, tuple[Any, Any]]:
    """Request and reply classes of the service's unary methods, by method name."""
    methods = pb.DESCRIPTOR.services_by_name[service].methods
    return {
        m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
        for m in methods
        if not m.client_streaming and not m.server_streaming
    }


STORE_METHODS = _unary_methods("GlobalStore")


class FrameServer:
    """Serves `handler`'s unary methods (a gRPC servicer object) on HOST:0, one thread per
    connection."""

    def __init__(self, handler: Any, token: str, host: str) -> None:
        self.handler = handler
        self.token = token
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="frame-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and end every connection (their clients see EOF at once)."""
        self._closed = True
        # shutdown, not just close: a close from another thread does not wake a blocked
        # accept() or recv() on Linux (that cost every store stop 5 s of join).
        for sock in [self._sock, *self._snapshot()]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._thread.join(5)

    def _snapshot(self) -> list[socket.socket]:
        with self._lock:
            return list(self._conns)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn, f"over {MAX_CONNECTIONS} frame connections: use gRPC")
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
        data = message.encode()[:1024]
        try:
            conn.sendall(HELLO_REPLY.pack(1, len(data)) + data)
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(BODY_TIMEOUT_S)
            magic, version, n = HELLO.unpack(recv_exact(conn, HELLO.size))
            if magic != MAGIC or version != VERSION:
                return self._refuse(conn, f"not a version {VERSION} frame client")
            token = recv_exact(conn, n).decode(errors="replace")
            if not token_accepted(self.token, token):
                return self._refuse(conn, "missing or wrong cluster token")
            conn.sendall(HELLO_REPLY.pack(0, 0))
            while not self._closed:
                conn.settimeout(None)  # an idle pooled connection may wait for long
                header = recv_exact(conn, REQUEST.size)
                conn.settimeout(BODY_TIMEOUT_S)
                size, name_len = REQUEST.unpack(header)
                if size > MAX_MESSAGE_BYTES or name_len > MAX_NAME:
                    return  # a stream that cannot be trusted further: close it
                name = recv_exact(conn, name_len).decode(errors="replace")
                payload = recv_exact(conn, size)
                conn.sendall(self._dispatch(name, payload))
        except (OSError, struct.error):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _dispatch(self, name: str, payload: bytes) -> bytes:
        started = time.perf_counter()
        try:
            classes = STORE_METHODS.get(name)
            if classes is None:
                raise InvalidArgument(f"no unary method {name!r} on the frame port")
            try:
                request = classes[0].FromString(payload)
            except Exception as e:  # a malformed message: the caller's error
                raise InvalidArgument(f"a malformed {name} request: {e}") from None
            reply = getattr(self.handler, name)(request, None).SerializeToString()
            return REPLY.pack(len(reply), 0) + reply
        except Exception as e:
            if not isinstance(e, TensorcastError):
                log.exception("frame call %s failed", name)
                e = TensorcastError(f"{type(e).__name__}: {e}")
            body = json.dumps({"kind": public_name(e), "message": str(e)}).encode()
            return REPLY.pack(len(body), 1) + body
        finally:
            # The caller's name for the call is a label only if it is a method (any other
            # text would add series for good, and could break the page).
            label = name if name in STORE_METHODS else "unknown"
            RPC_LATENCY.observe(label, time.perf_counter() - started)


class FrameClient:
    """Calls on one server's frame port over a few kept-open connections (thread-safe)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.addr = (host, port)
        self.token = token.encode()
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def call(self, method: str, request: Any, timeout_s: float) -> Any:
        """The reply, or the server's TensorcastError; NoAnswer (a DeadlineExceeded) past
        `timeout_s` (the call may have run); FrameTransportError when the connection failed."""
        reply_class = STORE_METHODS[method][1]
        sock = self._take(timeout_s)
        try:
            sock.settimeout(timeout_s)
            name = method.encode()
            payload = request.SerializeToString()
            sock.sendall(REQUEST.pack(len(payload), len(name)) + name + payload)
            size, status = REPLY.unpack(recv_exact(sock, REPLY.size))
            if size > MAX_MESSAGE_BYTES:
                raise FrameTransportError(f"a {size}-byte reply is over the limit")
            body = recv_exact(sock, size)
        except TimeoutError:
            sock.close()
            raise NoAnswer(
                f"the global store did not answer {method} within {timeout_s:.1f}s"
            ) from None
        except (OSError, FrameTransportError) as e:
            sock.close()
            raise FrameTransportError(f"{method} on {self.addr}: {e}") from None
        self._give_back(sock)
        if status == 0:
            return reply_class.FromString(body)
        error = json.loads(body)
        raise error_named(str(error.get("kind")), str(error.get("message")))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _take(self, timeout_s: float) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            sock = socket.create_connection(self.addr, timeout=min(timeout_s, CONNECT_TIMEOUT_S))
        except OSError as e:
            raise FrameTransportError(f"cannot connect to {self.addr}: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(HELLO.pack(MAGIC, VERSION, len(self.token)) + self.token)
            status, n = HELLO_REPLY.unpack(recv_exact(sock, HELLO_REPLY.size))
            message = recv_exact(sock, n).decode(errors="replace") if n else ""
        except OSError as e:
            sock.close()
            raise FrameTransportError(f"no frame hello from {self.addr}: {e}") from None
        if status != 0:
            sock.close()
            if "token" in message:
                raise Unauthenticated(f"the global store refused the token: {message}")
            raise FrameTransportError(message)
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()


def _store_stub(channel: Any) -> Any:
    from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc  # imports grpc

    return pb_grpc.GlobalStoreStub(channel)


class StoreClient(FailoverStub):
    """The Global Store's members: unary calls go to the current member's frame port once its
    Status named one, gRPC otherwise, and gRPC again for a call whose frame connection failed
    before an answer (then the port is looked up anew, at most every REDISCOVER_S). With TLS
    files every call stays on gRPC (the frame port has no TLS). `frame_ports` (member address
    -> port, from the local cluster's record) saves the first lookup, and with it importing
    grpc at all: a port that fails is looked up by Status like any other."""

    REDISCOVER_S = 5.0

    def __init__(
        self,
        addrs: str,
        token: str,
        timeout_s: float,
        tls: TLSFiles | None = None,
        frame_ports: dict[str, int] | None = None,
    ) -> None:
        super().__init__(addrs, _store_stub, "global store", token, timeout_s, tls)
        self.timeout_s = timeout_s
        self._token = send_token(token)
        self._use_frames = tls is None
        self._frame_ports = dict(frame_ports or {})
        self._frames: FrameClient | None = None
        self._frames_member = -1
        # A port taken from frame_ports until it answers: one that refuses the token is a stale
        # record's (another cluster's store listens there now), not this cluster refusing us.
        self._unconfirmed: FrameClient | None = None
        self._next_lookup = 0.0
        self._frames_lock = threading.Lock()

    def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        frames = self._frame_client() if method in STORE_METHODS else None
        if frames is not None:
            try:
                reply = frames.call(method, request, timeout_s or self.timeout_s)
                self._unconfirmed = None
                return reply
            except (FrameTransportError, Unauthenticated, NoAnswer) as e:
                if isinstance(e, Unauthenticated) and frames is not self._unconfirmed:
                    raise
                if isinstance(e, NoAnswer):
                    if len(self.addrs) == 1:
                        raise
                    # A hung member: the call goes to the next (the gRPC failover tries this
                    # one again last).
                    self._current = (self._frames_member + 1) % len(self.addrs)
                log.info("store frame port failed (%s): this call goes by gRPC", e)
                with self._frames_lock:
                    if self._frames is frames:
                        self._frames = None
                frames.close()
        return super().call(method, request, timeout_s)

    def close(self) -> None:
        with self._frames_lock:
            frames, self._frames = self._frames, None
        if frames is not None:
            frames.close()
        super().close()

    def _frame_client(self) -> FrameClient | None:
        if not self._use_frames:
            return None
        member = self._current
        with self._frames_lock:
            if self._frames is not None and self._frames_member == member:
                return self._frames
            port = self._frame_ports.pop(self.addrs[member], 0)
            hinted = bool(port)
            if not port:
                if time.monotonic() < self._next_lookup:
                    return None
                self._next_lookup = time.monotonic() + self.REDISCOVER_S
        if not port:
            try:
                status = super().call("Status", pb.Empty())
            except TensorcastError:
                return None
            port = status.frame_port
            if not port:
                return None
            member = self._current
        host = self.addrs[member].rpartition(":")[0].strip("[]")
        frames = FrameClient(host, port, self._token)
        with self._frames_lock:
            old, self._frames, self._frames_member = self._frames, frames, member
            self._unconfirmed = frames if hinted else None
        if old is not None:
            old.close()
        return frames
