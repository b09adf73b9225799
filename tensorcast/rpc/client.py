"""Client side: channels carrying the cluster token, and gRPC errors turned into TensorcastError."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from tensorcast.config import MAX_MESSAGE_BYTES
from tensorcast.errors import Unavailable, error_for_grpc_code
from tensorcast.rpc.server import ERROR_MARK, TOKEN_METADATA_KEY

T = TypeVar("T")


def make_channel(addr: str) -> grpc.Channel:
    return grpc.insecure_channel(
        addr,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ],
    )


def translate(error: grpc.RpcError, target: str) -> Exception:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    code_name = code.name if code is not None else "UNKNOWN"
    if details and details.startswith(ERROR_MARK):
        return error_for_grpc_code(code_name)(details[len(ERROR_MARK) :])
    if code_name == "UNAVAILABLE":
        return Unavailable(f"cannot reach {target}: {details}. Is it running? (tc status)")
    if code_name == "DEADLINE_EXCEEDED":
        details = f"{target} did not answer in time: {details}"
    return error_for_grpc_code(code_name)(details)


class Stub:
    """Wraps a generated stub: adds the token and a deadline to every call, translates errors."""

    def __init__(self, stub: Any, target: str, token: str, timeout_s: float) -> None:
        self._stub = stub
        self._target = target
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._timeout_s = timeout_s

    def call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        fn: Callable = getattr(self._stub, method)
        try:
            return fn(request, metadata=self._metadata, timeout=timeout_s or self._timeout_s)
        except grpc.RpcError as e:
            raise translate(e, self._target) from None

    def stream(self, method: str, request: Any, timeout_s: float | None = None) -> Iterator[Any]:
        fn: Callable = getattr(self._stub, method)
        try:
            yield from fn(request, metadata=self._metadata, timeout=timeout_s or self._timeout_s)
        except grpc.RpcError as e:
            raise translate(e, self._target) from None
