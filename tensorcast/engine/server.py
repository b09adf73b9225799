"""A tiny JSON-over-HTTP front end for an engine, and the client helper that speaks to it.

Routes: `POST /generate` {"req_id", "prompt_ids" (list or null), "max_new_tokens"} -> {"tokens"};
`GET /load` -> the InstanceLoad fields; `GET /requests` -> {"requests": [RequestStat fields]};
`POST /evict` {"req_id"} -> {"evicted"}. Errors come back
as {"error": ClassName, "message"} with a 4xx status, and `engine_request` raises the matching
`tensorcast.errors` class. The handler only decodes, calls the engine and encodes; no torch here.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from tensorcast.adaptors import InstanceLoad
from tensorcast.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    Unavailable,
    error_named,
    public_class,
)

MAX_BODY_BYTES = 1 << 20
SOCKET_TIMEOUT_S = 60.0  # per read or write on a request's connection, not per request
_STATUS: dict[type[TensorcastError], int] = {
    InvalidArgument: 400,
    NotFound: 404,
    AlreadyExists: 409,
    ResourceExhausted: 413,
}


class Engine(Protocol):
    """What the front end needs from an engine (HFEngine fits)."""

    def generate(
        self, req_id: str, prompt_ids: list[int] | None, max_new_tokens: int
    ) -> list[int]: ...

    def evict(self, req_id: str) -> bool: ...

    def load(self) -> InstanceLoad: ...


class _Server(ThreadingHTTPServer):
    engine: Engine


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S  # a client that stops sending mid-request frees its thread

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def log_message(self, format: str, *args: Any) -> None:
        """The library never prints."""

    def _serve(self, method: str) -> None:
        try:
            status, reply = 200, self._route(method)
        except TensorcastError as exc:
            status = _STATUS.get(public_class(exc), 500)
            reply = {"error": public_class(exc).__name__, "message": str(exc)}
        except Exception as exc:  # an engine bug: report it and keep serving
            status = 500
            reply = {"error": "TensorcastError", "message": f"{type(exc).__name__}: {exc}"}
        body = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self, method: str) -> dict[str, Any]:
        engine = self.server.engine
        if (method, self.path) == ("GET", "/load"):
            return asdict(engine.load())
        if (method, self.path) == ("GET", "/requests"):
            stats = getattr(engine, "request_stats", None)
            return {"requests": [s.to_json() for s in stats()] if stats else []}
        if (method, self.path) == ("POST", "/generate"):
            body = self._body()
            prompt_ids = body.get("prompt_ids")
            if prompt_ids is not None and not (
                isinstance(prompt_ids, list) and all(_is_int(t) for t in prompt_ids)
            ):
                raise InvalidArgument("'prompt_ids' must be a list of ints or null")
            tokens = engine.generate(
                _field(body, "req_id", str), prompt_ids, _field(body, "max_new_tokens", int)
            )
            return {"tokens": tokens}
        if (method, self.path) == ("POST", "/evict"):
            return {"evicted": engine.evict(_field(self._body(), "req_id", str))}
        raise NotFound(f"no route {method} {self.path}: use POST /generate, GET /load, POST /evict")

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise InvalidArgument("Content-Length is not a number") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a request
            raise ResourceExhausted(
                f"request body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit"
            )
        try:
            body = json.loads(self.rfile.read(max(length, 0)))
        except (ValueError, RecursionError) as exc:  # deep nesting: RecursionError
            raise InvalidArgument(f"request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and not _is_int(value)):
        raise InvalidArgument(f"field {name!r} must be a {kind.__name__}, got {value!r}")
    return value


class EngineHTTPServer:
    """Serves `engine` on host:port (port 0 picks a free one, bound at construction)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0) -> None:
        self._httpd = _Server((host, port), _Handler)
        self._httpd.engine = engine
        self._thread: threading.Thread | None = None

    @property
    def addr(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> EngineHTTPServer:
        """Serve on a background thread; each request gets its own thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="tc-engine-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port; waits for the serving loop to end."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> EngineHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_request(
    addr: str, method: str, path: str, body: Any = None, timeout_s: float = 30.0
) -> Any:
    """One JSON call to an engine server; an error reply raises its `tensorcast.errors` class.

    Unavailable when nothing answers at `addr`, DeadlineExceeded when no reply in `timeout_s`.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{addr}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise _error_from(exc) from None
    except OSError as exc:  # URLError, a reset connection, a socket timeout
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise DeadlineExceeded(f"engine at {addr} did not answer within {timeout_s}s") from None
        raise Unavailable(
            f"engine at {addr} cannot be reached ({reason}): is it running?"
        ) from None


def _error_from(exc: urllib.error.HTTPError) -> TensorcastError:
    try:
        reply = json.loads(exc.read())
        return error_named(str(reply["error"]), str(reply["message"]))
    except (ValueError, KeyError, TypeError):
        return TensorcastError(f"engine replied HTTP {exc.code} without a JSON error")
