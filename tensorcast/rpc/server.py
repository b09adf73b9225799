"""Server side: one interceptor checks the cluster token and maps TensorcastError to a status."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from tensorcast.config import MAX_MESSAGE_BYTES, TLSFiles, token_accepted
from tensorcast.errors import TensorcastError
from tensorcast.metrics import RPC_LATENCY
from tensorcast.rpc import ERROR_MARK, TOKEN_METADATA_KEY

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, error: TensorcastError) -> None:
    context.abort(getattr(grpc.StatusCode, error.grpc_code), ERROR_MARK + str(error))


def _guard(behavior: Callable, token: str, streaming_response: bool, method: str) -> Callable:
    def authorized(context: grpc.ServicerContext) -> bool:
        sent = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY, "")
        if isinstance(sent, bytes):
            sent = sent.decode(errors="replace")
        if token_accepted(token, sent):
            return True
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong cluster token: pass --token or set TC_TOKEN",
        )
        return False

    name = method.rpartition("/")[2]
    if streaming_response:

        def stream_wrapper(request: Any, context: grpc.ServicerContext):
            authorized(context)
            started = time.perf_counter()
            try:
                yield from behavior(request, context)
            except TensorcastError as e:
                _abort(context, e)
            finally:
                RPC_LATENCY.observe(name, time.perf_counter() - started)

        return stream_wrapper

    def unary_wrapper(request: Any, context: grpc.ServicerContext):
        authorized(context)
        started = time.perf_counter()
        try:
            return behavior(request, context)
        except TensorcastError as e:
            _abort(context, e)
        finally:
            RPC_LATENCY.observe(name, time.perf_counter() - started)

    return unary_wrapper


class GuardInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            fn = _guard(handler.unary_unary, self._token, False, handler_call_details.method)
            return grpc.unary_unary_rpc_method_handler(
                fn, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            fn = _guard(handler.unary_stream, self._token, True, handler_call_details.method)
            return grpc.unary_stream_rpc_method_handler(
                fn, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            fn = _guard(handler.stream_unary, self._token, False, handler_call_details.method)
            return grpc.stream_unary_rpc_method_handler(
                fn, handler.request_deserializer, handler.response_serializer
            )
        fn = _guard(handler.stream_stream, self._token, True, handler_call_details.method)
        return grpc.stream_stream_rpc_method_handler(
            fn, handler.request_deserializer, handler.response_serializer
        )


def make_server(token: str, max_workers: int = 16) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[GuardInterceptor(token)],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=256,
    )


def bind(server: grpc.Server, listen: str, tls: TLSFiles | None = None) -> str:
    """Bind HOST:PORT (port 0 = ephemeral); returns the bound address. With `tls`, only
    clients presenting a certificate signed by its CA get through (mutual TLS); the token
    check stays."""
    host = listen.rpartition(":")[0]
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            ca, cert, key = tls.read()
            credentials = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=True
            )
            port = server.add_secure_port(listen, credentials)
    except RuntimeError as e:
        raise TensorcastError(f"cannot listen on {listen}: {e}") from None
    if port == 0:
        raise TensorcastError(f"cannot listen on {listen}: address in use or invalid")
    return f"{host}:{port}"
