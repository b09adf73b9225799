"""Client side: channels carrying the cluster token, and gRPC errors turned into TensorcastError.

grpc is imported when the first channel is made, not with this module (see tensorcast.rpc)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tensorcast.config import MAX_MESSAGE_BYTES, TLSFiles, parse_store_addrs, send_token
from tensorcast.errors import DeadlineExceeded, Unavailable, error_for_grpc_code
from tensorcast.rpc import ERROR_MARK, TOKEN_METADATA_KEY

if TYPE_CHECKING:
    import grpc


def make_channel(addr: str, tls: TLSFiles | None = None) -> grpc.Channel:
    import grpc

    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if tls is None:
        return grpc.insecure_channel(addr, options=options)
    ca, cert, key = tls.read()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return grpc.secure_channel(addr, credentials, options=options)


def translate(error: grpc.RpcError, target: str) -> Exception:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    code_name = code.name if code is not None else "UNKNOWN"
    if details and details.startswith(ERROR_MARK):
        return error_for_grpc_code(code_name)(details[len(ERROR_MARK) :])
    if code_name == "UNAVAILABLE":
        if any(w in (details or "").lower() for w in ("ssl", "handshake", "certificate", "tls")):
            return Unreachable(
                f"TLS with {target} failed: {details}. Both ends need certificates from one CA "
                "(--tls-ca/--tls-cert/--tls-key or TC_TLS_*; `tc up --tls` writes them to "
                "STATE_DIR/tls), or both none"
            )
        if "socket closed" in (details or "").lower():
            return Unreachable(
                f"{target} closed the connection: {details}. A TLS server closes plaintext "
                "connections: give this client the cluster's TLS files (TC_TLS_CA/CERT/KEY, or "
                "STATE_DIR/tls)"
            )
        return Unreachable(f"cannot reach {target}: {details}. Is it running? (tc status)")
    if code_name == "DEADLINE_EXCEEDED":
        return NoAnswer(f"{target} did not answer in time: {details}")
    return error_for_grpc_code(code_name)(details)


class Unreachable(Unavailable):
    """The peer could not be reached at all (connection refused, reset, no route): another
    member of a replicated service may answer instead."""


class NoAnswer(DeadlineExceeded):
    """The peer did not answer within the call's deadline (hung, or overloaded; the call may
    have run): another member of a replicated service may answer instead."""


class Stub:
    """Wraps a generated stub: adds the token and a deadline to every call, translates errors."""

    def __init__(self, stub: Any, target: str, token: str, timeout_s: float) -> None:
        import grpc  # loaded already: the stub's channel needed it

        self._rpc_error = grpc.RpcError
        self._stub = stub
        self._target = target
        self._metadata = ((TOKEN_METADATA_KEY, send_token(token)),)
        self._timeout_s = timeout_s

    def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        fn: Callable = getattr(self._stub, method)
        try:
            return fn(request, metadata=self._metadata, timeout=timeout_s or self._timeout_s)
        except self._rpc_error as e:
            raise translate(e, self._target) from None

    def stream(self, method: str, request: Any, timeout_s: float | None = None) -> Iterator[Any]:
        fn: Callable = getattr(self._stub, method)
        try:
            yield from fn(request, metadata=self._metadata, timeout=timeout_s or self._timeout_s)
        except self._rpc_error as e:
            raise translate(e, self._target) from None


class FailoverStub:
    """A replicated service at several addresses: each call goes to the member that answered
    last; a member that cannot be reached, or does not answer in time (hung), is skipped, each
    member tried once per call. Members must serve the same state (Global Store processes over
    one etcd cluster, or one store restarted at another address), so a call retried on another
    is safe: the store's calls are idempotent or refuse a repeat."""

    def __init__(
        self,
        addrs: str,
        make_stub: Callable[[grpc.Channel], Any],
        what: str,
        token: str,
        timeout_s: float,
        tls: TLSFiles | None = None,
    ) -> None:
        self.addrs = parse_store_addrs(addrs)
        self._make_stub = make_stub
        self._what = what
        self._token = token
        self._timeout_s = timeout_s
        self._tls = tls
        # Each member's channel and stub, made on its first gRPC call.
        self._members: list[tuple[grpc.Channel, Stub] | None] = [None] * len(self.addrs)
        self._members_lock = threading.Lock()
        self._current = 0

    @property
    def current_addr(self) -> str:
        return self.addrs[self._current]

    def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        first = self._current
        for i in range(len(self.addrs)):
            k = (first + i) % len(self.addrs)
            try:
                reply = self._stub(k).call(method, request, timeout_s)
            except (Unreachable, NoAnswer):
                if i == len(self.addrs) - 1:
                    raise
                continue
            self._current = k
            return reply
        raise AssertionError("unreachable")

    def members(self) -> list[tuple[str, Stub]]:
        """Each member's own stub (no failover): to ask every member, as `tc status` does."""
        return [(a, self._stub(k)) for k, a in enumerate(self.addrs)]

    def close(self) -> None:
        with self._members_lock:
            members, self._members = self._members, [None] * len(self.addrs)
        for member in members:
            if member is not None:
                member[0].close()

    def _stub(self, k: int) -> Stub:
        with self._members_lock:
            member = self._members[k]
            if member is None:
                channel = make_channel(self.addrs[k], self._tls)
                target = f"{self._what} {self.addrs[k]}"
                stub = Stub(self._make_stub(channel), target, self._token, self._timeout_s)
                member = self._members[k] = (channel, stub)
            return member[1]
