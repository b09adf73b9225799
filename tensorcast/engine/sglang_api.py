"""HTTP front end of the emulated engine: SGLang's API, so that any router (ours, or the SGLang
model gateway) can drive it, plus TensorCast's own engine API.

SGLang routes (the subset routers use):
  POST /generate  {"text" | "input_ids", "rid"?, "sampling_params": {"max_new_tokens"}?,
                   "stream"?, "session_params": {"id"}?}
                  -> {"text", "output_ids", "meta_info": {"id", "prompt_tokens",
                      "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency", ...}}
                  With "stream": true, server-sent events (chunked): one `data: {...}` when the
                  first token exists, one with everything at the end (text and output_ids are
                  cumulative, as SGLang's default), then `data: [DONE]`.
  GET /health, /health_generate, /get_load ([{"dp_rank", "num_reqs", "num_waiting_reqs",
  "num_tokens"}]), /server_info, /get_server_info, /model_info, /get_model_info, /v1/models;
  POST /flush_cache.
The session of a request (what migrations move) is `session_params.id`, else the body's
`session_id`, else the `X-Session-Id` header, else the rid.

TensorCast's own routes (as tensorcast/engine/server.py): POST /generate {"req_id", "prompt_ids"
(list or null: continue the session), "max_new_tokens"} -> {"tokens"}; GET /load; POST /evict
{"req_id"}; GET /requests (per-session detail for `tc rebalance`).

Errors: 4xx/5xx with {"error": ClassName, "message"} (what `engine_request` maps back).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tensorcast.engine.server import _STATUS, MAX_BODY_BYTES, SOCKET_TIMEOUT_S
from tensorcast.engine.sim import Job, SimEngine, detokenize, tokenize
from tensorcast.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    public_class,
)

REQUEST_TIMEOUT_S = 900.0  # longest a handler waits for the engine
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_STATUS_MORE = {**_STATUS, ResourceExhausted: 503}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # routers open many connections at once
    engine: SimEngine

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-reply is not an error worth printing (never print)."""
        logging.getLogger("tensorcast.http").debug(
            "request from %s failed", client_address, exc_info=True
        )


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: routers pool connections
    timeout = SOCKET_TIMEOUT_S  # a client that stops sending mid-request frees its thread

    def log_message(self, format: str, *args: Any) -> None:
        """The library never prints."""

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        try:
            reply = self._route(method)
            if reply is None:  # streamed already
                return
            status = 200
        except TensorcastError as exc:
            status = _STATUS_MORE.get(public_class(exc), 500)
            reply = {"error": public_class(exc).__name__, "message": str(exc)}
        except Exception as exc:  # an engine bug: report it and keep serving
            status = 500
            reply = {"error": "TensorcastError", "message": f"{type(exc).__name__}: {exc}"}
        if status != 200:
            # The request's body may be unread (an unknown route, a bad Content-Length): on a
            # kept-alive connection it would be parsed as the next request.
            self.close_connection = True
        self._json(status, reply)

    def _json(self, status: int, reply: Any) -> None:
        body = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self, method: str) -> Any:
        engine = self.server.engine
        path = self.path.split("?", 1)[0]
        if method == "GET":
            if path in ("/health", "/health_generate"):
                return {}
            if path == "/get_load":
                load = engine.load()
                return [
                    {
                        "dp_rank": 0,
                        "num_reqs": load.waiting + load.running,
                        "num_waiting_reqs": load.waiting,
                        "num_tokens": engine.running_tokens(),
                    }
                ]
            if path in ("/server_info", "/get_server_info"):
                return engine.info()
            if path in ("/model_info", "/get_model_info"):
                return {
                    "model_path": "tensorcast-sim",
                    "tokenizer_path": None,
                    "is_generation": True,
                }
            if path == "/v1/models":
                return {"object": "list", "data": [{"id": "tensorcast-sim", "object": "model"}]}
            if path == "/load":
                return asdict(engine.load())
            if path == "/requests":
                return {"requests": [s.to_json() for s in engine.request_stats()]}
        if method == "POST":
            if path == "/generate":
                body = self._body()
                if "req_id" in body:
                    return self._own_generate(body)
                return self._sglang_generate(body)
            if path == "/flush_cache":
                self._body()
                return {"flushed_blocks": engine.flush()}
            if path == "/evict":
                req_id = self._body().get("req_id")
                if not isinstance(req_id, str):
                    raise InvalidArgument("field 'req_id' must be a string")
                return {"evicted": engine.evict(req_id)}
        raise NotFound(
            f"no route {method} {path}: use POST /generate, GET /get_load, /health, /server_info"
        )

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise InvalidArgument("Content-Length is not a number") from None
        if length > MAX_BODY_BYTES * 16:
            self.close_connection = True
            raise ResourceExhausted(f"request body of {length} bytes is over the limit")
        raw = self.rfile.read(max(length, 0))
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, RecursionError) as exc:  # deep nesting: RecursionError
            raise InvalidArgument(f"request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        return body

    def _own_generate(self, body: dict[str, Any]) -> dict:
        req_id, prompt_ids, n = (
            body.get("req_id"),
            body.get("prompt_ids"),
            body.get("max_new_tokens"),
        )
        if not isinstance(req_id, str) or not req_id:
            raise InvalidArgument("field 'req_id' must be a non-empty string")
        if prompt_ids is not None and not isinstance(prompt_ids, list):
            raise InvalidArgument("'prompt_ids' must be a list of ints or null")
        if not isinstance(n, int) or isinstance(n, bool):
            raise InvalidArgument(f"field 'max_new_tokens' must be an int, got {n!r}")
        return {"tokens": self.server.engine.generate(req_id, prompt_ids, n)}

    def _sglang_generate(self, body: dict[str, Any]) -> dict | None:
        engine = self.server.engine
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise InvalidArgument("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidArgument("'text' must be a string (batches are not supported)")
            ids = tokenize(text, engine.config.vocab)
        elif not isinstance(ids, list) or (ids and not isinstance(ids[0], int)):
            raise InvalidArgument("'input_ids' must be a list of ints (batches are not supported)")
        sampling = body.get("sampling_params")
        sampling = {} if sampling is None else sampling
        if not isinstance(sampling, dict):
            raise InvalidArgument("'sampling_params' must be an object")
        n = sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            raise InvalidArgument("'rid' must be a string")
        session = session_of(body, self.headers.get("X-Session-Id"), rid)
        job = engine.submit(ids, n, rid=rid, session=session)  # type: ignore[arg-type]
        if not body.get("stream"):
            job.wait_done(REQUEST_TIMEOUT_S)
            return _reply(job)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            job.wait_first(REQUEST_TIMEOUT_S)
            self._chunk(b"data: " + json.dumps(_reply(job, first=True)).encode() + b"\n\n")
            job.wait_done(REQUEST_TIMEOUT_S)
            self._chunk(b"data: " + json.dumps(_reply(job)).encode() + b"\n\n")
        except TensorcastError as exc:
            error = {"error": {"message": str(exc), "type": type(exc).__name__}}
            self._chunk(b"data: " + json.dumps(error).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")
        return None

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def session_of(body: dict[str, Any], header: str | None, rid: str) -> str:
    params = body.get("session_params")
    if isinstance(params, dict) and isinstance(params.get("id"), str) and params["id"]:
        return str(params["id"])
    if isinstance(body.get("session_id"), str) and body["session_id"]:
        return str(body["session_id"])
    return header or rid


def _reply(job: Job, first: bool = False) -> dict:
    outputs = job.outputs[:1] if first else list(job.outputs)
    return {"text": detokenize(outputs), "output_ids": outputs, "meta_info": job.meta()}


class SimHTTPServer:
    """Serves a SimEngine on host:port (port 0: any free one, bound at construction)."""

    def __init__(self, engine: SimEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self._httpd = _Server((host, port), _Handler)
        self._httpd.engine = engine
        self._thread: threading.Thread | None = None

    @property
    def addr(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> SimHTTPServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="tc-sim-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> SimHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
