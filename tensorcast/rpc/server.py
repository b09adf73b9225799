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


def _sent_token(metadata: Any) -> str:
    sent = dict(metadata or ()).get(TOKEN_METADATA_KEY, "")
    return sent.decode(errors="replace") if isinstance(sent, bytes) else sent


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong cluster token: pass --token or set TC_TOKEN",
    )


def _skip(raw: bytes) -> bytes:
    """A refused call's request is not parsed (None would count as a parse error)."""
    return raw


def _internal(method: str, error: Exception) -> TensorcastError:
    """A handler's bug, sent as INTERNAL: gRPC would send it as UNKNOWN, which callers take for
    a transport failure and retry (the same bug, until their deadline)."""
    log.exception("%s failed", method)
    return TensorcastError(f"{method}: {type(error).__name__}: {error}")


def _guard(behavior: Callable, streaming_response: bool, method: str) -> Callable:
    name = method.rpartition("/")[2]
    if streaming_response:

        def stream_wrapper(request: Any, context: grpc.ServicerContext):
            started = time.perf_counter()
            try:
                yield from behavior(request, context)
            except TensorcastError as e:
                _abort(context, e)
            except Exception as e:
                _abort(context, _internal(name, e))
            finally:
                RPC_LATENCY.observe(name, time.perf_counter() - started)

        return stream_wrapper

    def unary_wrapper(request: Any, context: grpc.ServicerContext):
        started = time.perf_counter()
        try:
            return behavior(request, context)
        except TensorcastError as e:
            _abort(context, e)
        except Exception as e:
            _abort(context, _internal(name, e))
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
        method = handler_call_details.method
        # The token is checked before the request is parsed or the servicer entered.
        if not token_accepted(self._token, _sent_token(handler_call_details.invocation_metadata)):
            unary, stream = _refuse, lambda request, context: iter([_refuse(request, context)])
            out = handler.response_serializer
            if handler.unary_unary:
                return grpc.unary_unary_rpc_method_handler(unary, _skip, out)
            if handler.unary_stream:
                return grpc.unary_stream_rpc_method_handler(stream, _skip, out)
            if handler.stream_unary:
                return grpc.stream_unary_rpc_method_handler(unary, _skip, out)
            return grpc.stream_stream_rpc_method_handler(stream, _skip, out)
        if handler.unary_unary:
            fn = _guard(handler.unary_unary, False, method)
            return grpc.unary_unary_rpc_method_handler(
                fn, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            fn = _guard(handler.unary_stream, True, method)
            return grpc.unary_stream_rpc_method_handler(
                fn, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            fn = _guard(handler.stream_unary, False, method)
            return grpc.stream_unary_rpc_method_handler(
                fn, handler.request_deserializer, handler.response_serializer
            )
        fn = _guard(handler.stream_stream, True, method)
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
