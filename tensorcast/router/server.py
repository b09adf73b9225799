"""`tc router start`: an HTTP router in front of a cluster's engine instances (SGLang's
/generate API in and out), with the policies of paper §6.4:

  rebalance     sticky sessions placed cache-aware, plus Algorithm 1 ticks that move an idle
                session with its KV cache from the most to the least loaded instance (a plan:
                publish -> prefetch_many -> hydrate -> evict, one idempotency key per decision)
  cache-aware   longest prefix match over what the router sent where, SGLang gateway style
  load-aware    power of two choices on in-flight requests
  round-robin   the next instance in id order

Instances are the cluster's live instances with an HTTP endpoint (`list_instances()`,
refreshed every `discover_s`). The session of a request is `session_params.id`, else
`session_id`, else the `X-Session-Id` header, else the rid; it is forwarded as
`session_params.id`. Sessions stick to one owner under `rebalance` and `cache-aware` (until a
migration moves them, or their owner dies); `load-aware` and `round-robin` choose per request.

Ownership rules (never two owners): a migration starts only for a session with no turn in
flight, and a turn of a session being migrated waits for the migration to end (bounded by its
deadline) and then goes to whichever instance owns the session. A failed migration leaves the
owner unchanged unless the target already holds the KV cache (hydrate succeeded).

Everything here is a thin shell: choices come from `baselines` and `policy` (pure); the router
keeps only the session table, in-flight counts and a short history of migrations.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tensorcast import errors
from tensorcast.router import baselines
from tensorcast.router.policy import LoadSample, RebalanceParams, RequestState, tick
from tensorcast.router.rebalance import decision_key, summarize

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime

log = logging.getLogger("tensorcast.router")

POLICIES = ("rebalance", "cache-aware", "load-aware", "round-robin")
MAX_BODY_BYTES = 16 << 20  # as the engines take (a body is parsed and sent on: ~25x in memory)
MAX_TURNS = 512  # turns served at once; past it, 503 (each holds a thread and its body)
MIGRATIONS_KEPT = 100
MAX_SESSIONS = 100_000  # past it, the longest idle sessions are forgotten first
CLIENT_TIMEOUT_S = 120.0  # a client silent this long mid-request loses its connection
# A reply sent before the request's body was read (an error): what the client still sends is
# read and dropped for at most this long and this much before the connection closes, so the
# close does not reset it before the client has sent it all and read the reply.
LINGER_S = 2.0
LINGER_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 3.0  # to an instance (its answer may take request_timeout_s)
SUSPECT_S = 10.0  # an instance that refused a connection gets no turn nor move this long
OCCUPANCY_REFRESH_S = 0.5  # sessions per instance are recounted at most this often


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of the router; `params` are Algorithm 1's (policy `rebalance` only).

    load_source: "signals" (instances' reported waiting+running, via the store) or "router"
    (the requests this router has in flight per instance: exact, but blind to other callers).
    """

    policy: str = "rebalance"
    params: RebalanceParams = field(default_factory=RebalanceParams)
    tick_s: float = 1.0
    load_source: str = "signals"
    block_tokens: int = 32
    cache_threshold: float = 0.5
    balance_abs: float = 32.0
    balance_rel: float = 1.5
    migration_deadline_ms: int = 30_000
    request_timeout_s: float = 900.0
    discover_s: float = 1.0
    session_idle_s: float = 600.0  # a session idle this long is forgotten (placed anew)
    instances: tuple[str, ...] = ()  # only these instance ids (default: every live one)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise errors.InvalidArgument(
                f"unknown policy {self.policy!r}: use one of {', '.join(POLICIES)}"
            )
        if self.load_source not in ("signals", "router"):
            raise errors.InvalidArgument("load_source must be 'signals' or 'router'")
        if not self.tick_s > 0 or not self.discover_s > 0 or self.block_tokens < 1:
            raise errors.InvalidArgument("tick_s and discover_s must be > 0, block_tokens >= 1")
        if not self.session_idle_s > 0:
            raise errors.InvalidArgument("session_idle_s must be > 0")


@dataclass
class _Session:
    owner: str
    tokens: int = 0
    last_active: float = 0.0
    migrations: int = 0
    inflight: int = 0
    migrating: bool = False
    keys: list[bytes] = field(default_factory=list)
    # Its last migration failed (no KV on the source, a full target, ...): not a candidate
    # until its next turn, so one such session cannot win every tick and block the others.
    left_out: bool = False
    # Which of the router's sessions it is: in its decisions' keys, so a session forgotten
    # and begun again under the same id never replays a recorded move of the earlier one.
    serial: int = 0


class Router:
    def __init__(self, rt: Runtime, config: RouterConfig | None = None) -> None:
        self.rt = rt
        self.config = config or RouterConfig()
        self.router_id = uuid.uuid4().hex[:8]
        self._cv = threading.Condition()
        self._endpoints: dict[str, str] = {}  # live instance -> HOST:PORT
        self._reported: dict[str, tuple[int, int]] = {}  # instance -> (waiting, running)
        self._inflight: dict[str, int] = {}
        self._routed: dict[str, int] = {}
        self._sessions: dict[str, _Session] = {}
        self._index = baselines.PrefixIndex()
        self._rng = random.Random(self.config.seed)
        self._last_rr: str | None = None
        self._loads: dict[str, float] = {}  # Algorithm 1's EWMA state
        self._last_tick: dict[str, Any] = {}
        self._migrations: deque[dict] = deque(maxlen=MIGRATIONS_KEPT)
        self._migrations_ok = 0  # sessions moved, and their bytes, since the start
        self._migrated_bytes = 0
        self._migrating = 0
        self._sessions_begun = 0
        self._suspect: dict[str, float] = {}  # instance -> monotonic time it is trusted again
        self._occupancy_cache: tuple[float, dict[str, int]] = (float("-inf"), {})
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors = 0
        self.waiting_turns = 0  # turns waiting for their session's migration to end

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, wait_for_instances_s: float = 0.0) -> Router:
        self.discover()
        deadline = time.monotonic() + wait_for_instances_s
        while not self._endpoints and time.monotonic() < deadline:
            if self._closed.wait(0.2):
                break
            self.discover()
        loops = [("router-discover", self._discover_loop)]
        if self.config.policy == "rebalance":
            loops.append(("router-tick", self._tick_loop))
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        self._closed.set()
        with self._cv:
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=self.config.migration_deadline_ms / 1000 + 5)

    def discover(self) -> None:
        """Refresh the live instances (and their reported load) from the store's signals."""
        try:
            snapshot = self.rt.signals().list_instances()
        except errors.TensorcastError as e:
            log.warning("cannot list instances: %s", e)
            return
        wanted = set(self.config.instances)
        live = {
            i.instance_id: i
            for i in snapshot
            if i.alive and i.endpoint and (not wanted or i.instance_id in wanted)
        }
        with self._cv:
            gone = set(self._endpoints) - set(live)
            self._endpoints = {i: info.endpoint for i, info in live.items()}
            self._reported = {i: (info.waiting, info.running) for i, info in live.items()}
            for iid in gone:
                self._index.forget(iid)
            self._cv.notify_all()

    def _discover_loop(self) -> None:
        while not self._closed.wait(self.config.discover_s):
            try:
                self.discover()
                self.forget_idle_sessions()
            except Exception:  # the loop must outlive any one failure
                self.errors += 1
                log.exception("instance discovery failed")

    def forget_idle_sessions(self, now: float | None = None) -> int:
        """Drop sessions idle for `session_idle_s` (no turn in flight, not migrating), and the
        longest idle ones past MAX_SESSIONS: the table stays bounded whatever the clients send
        (a request without a session id is a session of its own). Returns how many went."""
        now = time.monotonic() if now is None else now
        with self._cv:
            idle = [
                (s.last_active, sid)
                for sid, s in self._sessions.items()
                if not s.inflight and not s.migrating
            ]
            old = {sid for last, sid in idle if now - last >= self.config.session_idle_s}
            over = len(self._sessions) - len(old) - MAX_SESSIONS
            if over > 0:
                old.update(sid for _, sid in sorted(idle)[: len(old) + over])
            for sid in old:
                del self._sessions[sid]
            if old:
                self._occupancy_cache = (float("-inf"), {})  # recount at the next placement
            return len(old)

    # -- routing ---------------------------------------------------------------------------

    def _router_loads(self) -> dict[str, float]:
        return {i: float(self._inflight.get(i, 0)) for i in self._endpoints}

    def acquire(self, session: str, tokens: list[int]) -> tuple[str, str]:
        """Choose the instance for one turn and count it in flight; pair with `release`."""
        c = self.config
        keys = baselines.prefix_keys(tokens, c.block_tokens) if c.policy == "cache-aware" else []
        deadline = time.monotonic() + c.migration_deadline_ms / 1000 + 5
        with self._cv:
            state = self._sessions.get(session)
            while state is not None and state.migrating:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise errors.Unavailable(f"session {session!r} is still migrating: retry")
                self.waiting_turns += 1
                try:
                    self._cv.wait(left)
                finally:
                    self.waiting_turns -= 1
            instances = self._usable()
            if not instances:
                raise errors.Unavailable("no live instance with an HTTP endpoint to route to")
            loads = self._router_loads()
            sticky = c.policy in ("rebalance", "cache-aware")
            if sticky and state is not None and state.owner in instances:
                target = state.owner
            elif c.policy == "rebalance":  # a new session (or one whose owner is gone)
                # By the load the ticks see (else a new session lands on the instance they
                # are about to move sessions off), or this router's own turns if more.
                placing = {i: max(self._loads.get(i, 0.0), loads.get(i, 0.0)) for i in instances}
                target = baselines.least_busy(instances, placing, self._occupancy())
            elif c.policy == "round-robin":
                target = baselines.round_robin(instances, self._last_rr)
                self._last_rr = target
            elif c.policy == "load-aware":
                target = baselines.power_of_two(instances, loads, self._rng)
            else:
                target = baselines.cache_aware(
                    instances,
                    loads,
                    self._index,
                    keys,
                    c.cache_threshold,
                    c.balance_abs,
                    c.balance_rel,
                )
            if state is None:
                self._sessions_begun += 1
                state = self._sessions[session] = _Session(target, serial=self._sessions_begun)
                self._occupancy_cache[1][target] = self._occupancy_cache[1].get(target, 0) + 1
            state.owner = target if sticky or state.inflight == 0 else state.owner
            state.inflight += 1
            state.left_out = False
            state.tokens = len(tokens)
            state.keys = keys
            self._inflight[target] = self._inflight.get(target, 0) + 1
            self._routed[target] = self._routed.get(target, 0) + 1
            if keys:
                self._index.insert(target, keys)
            return target, self._endpoints[target]

    def _usable(self) -> list[str]:
        """Live instances, less those that refused a connection lately (all, if every one
        did: a turn may still find one back)."""
        now = time.monotonic()
        live = list(self._endpoints)
        trusted = [i for i in live if self._suspect.get(i, 0.0) <= now]
        return trusted or live

    def suspect(self, instance: str) -> None:
        """`instance` refused a connection: no turns nor moves for SUSPECT_S (discovery drops
        it once the store sees it dead; until then it would take every turn it is given)."""
        with self._cv:
            self._suspect[instance] = time.monotonic() + SUSPECT_S

    def _occupancy(self) -> dict[str, int]:
        """Active sessions per instance: a turn in flight, migrating, or a turn within the
        last horizon_s (Algorithm 1's H: older ones score as good as gone). Recounted at most
        every OCCUPANCY_REFRESH_S (a count walks every session, under the router's lock);
        placements in between are added as they happen."""
        now = time.monotonic()
        counted_at, counts = self._occupancy_cache
        if now - counted_at < OCCUPANCY_REFRESH_S and counts.keys() == self._endpoints.keys():
            return counts
        horizon = self.config.params.horizon_s
        counts = dict.fromkeys(self._endpoints, 0)
        for s in self._sessions.values():
            if s.owner in counts and (s.inflight or s.migrating or now - s.last_active < horizon):
                counts[s.owner] += 1
        self._occupancy_cache = (now, counts)
        return counts

    def release(self, session: str, instance: str, total_tokens: int | None) -> None:
        with self._cv:
            self._inflight[instance] = max(0, self._inflight.get(instance, 0) - 1)
            state = self._sessions.get(session)
            if state is not None:
                state.inflight = max(0, state.inflight - 1)
                state.last_active = time.monotonic()
                if total_tokens is not None:
                    state.tokens = total_tokens
            self._cv.notify_all()

    # -- rebalancing (Algorithm 1) ---------------------------------------------------------

    def _samples(self) -> list[LoadSample]:
        if self.config.load_source == "router":
            return [LoadSample(i, 0, self._inflight.get(i, 0)) for i in sorted(self._endpoints)]
        return [LoadSample(i, *self._reported.get(i, (0, 0))) for i in sorted(self._endpoints)]

    def tick_once(self) -> dict[str, Any]:
        """One Algorithm 1 tick over the router's sessions; starts at most one migration."""
        if self.config.load_source == "signals":
            self.discover()  # the freshest load the store has
        now = time.monotonic()
        with self._cv:
            requests = [
                RequestState(
                    sid,
                    s.owner,
                    s.tokens,
                    s.last_active,
                    s.migrations,
                    running=s.inflight > 0,
                    migrating=s.migrating,
                )
                for sid, s in self._sessions.items()
                if s.owner in self._endpoints and not s.left_out
            ]
            usable = self._usable()
            samples = [x for x in self._samples() if x.instance_id in usable]
            result = tick(self._loads, samples, requests, now, self.config.params)
            self._loads = result.loads
            record = result.to_json()
            record.pop("scores", None)
            record["at"] = time.time()
            decision = result.decision
            if decision is not None and self._migrating:
                record["skipped"] = "a migration is in flight"
                decision = None
            if decision is not None:
                state = self._sessions[decision.req_id]
                state.migrating = True
                self._migrating += 1
                key = decision_key(
                    f"router-{self.router_id}/{state.serial}",
                    decision.req_id,
                    decision.source,
                    decision.target,
                    state.migrations,
                    state.tokens,
                )
                record["idempotency_key"] = key
            self._last_tick = record
        if decision is not None:
            thread = threading.Thread(
                target=self._migrate,
                args=(decision.req_id, decision.source, decision.target, key),
                name="router-migrate",
                daemon=True,
            )
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: the session must not stay migrating
                with self._cv:
                    self._sessions[decision.req_id].migrating = False
                    self._migrating -= 1
                    self._cv.notify_all()
                raise
        return record

    def _migrate(self, session: str, source: str, target: str, key: str) -> None:
        from tensorcast.sdk.migrate import migrate

        started = time.monotonic()
        entry: dict[str, Any] = {
            "req_id": session,
            "source": source,
            "target": target,
            "key": key,
            "at": time.time(),
        }
        moved = False
        try:
            plan = migrate(
                self.rt,
                session,
                source,
                target,
                idempotency_key=key,
                deadline_ms=self.config.migration_deadline_ms,
            )
            entry.update(summarize(plan))
            moved = True
        except errors.TensorcastError as e:
            partial = getattr(e, "result", None)
            if partial is None:  # this side gave up (deadline, gateway gone): not the plan
                partial = self._recorded_plan(key)
            if partial.get("status") == "ok":  # the gateway finished it all the same
                entry.update(summarize(partial))
                moved = True
            else:
                entry.update(summarize(partial) if partial else {})
                entry.update(status="failed", error=f"{type(e).__name__}: {e}")
                steps = partial.get("steps", [])
                moved = any(  # the hydrate that made it resident there (its last part)
                    s.get("op") == "hydrate"
                    and s.get("status") == "ok"
                    and (s.get("result") or {}).get("resident")
                    for s in steps
                )
        except Exception as e:  # never leave the session stuck as migrating
            entry.update(status="failed", error=f"{type(e).__name__}: {e}")
            log.exception("migration of %s failed", session)
        entry["duration_s"] = round(time.monotonic() - started, 4)
        with self._cv:
            if moved:
                self._migrations_ok += 1
                self._migrated_bytes += int(entry.get("bytes", 0))
            state = self._sessions.get(session)
            if state is not None:
                if moved:
                    state.owner = target
                    self._occupancy_cache = (float("-inf"), {})
                    state.migrations += 1
                    if state.keys:  # (an empty list would forget the whole source)
                        self._index.forget(source, state.keys)
                        self._index.insert(target, state.keys)
                state.migrating = False
                state.left_out = not moved
            self._migrating -= 1
            self._migrations.appendleft(entry)
            self._cv.notify_all()
        log.info(
            "migration %s %s -> %s: %s, %s bytes in %.3f s",
            session,
            source,
            target,
            entry.get("status"),
            entry.get("bytes", 0),
            entry["duration_s"],
        )

    def _recorded_plan(self, key: str) -> dict[str, Any]:
        """The result the store recorded for the plan under `key`, once it is no longer running
        (waited for within the migration's deadline); {} when none can be had. A caller that
        gave up does not know whether the gateway went on: this does."""
        give_up_at = time.monotonic() + self.config.migration_deadline_ms / 1000 + 5
        while not self._closed.is_set():
            try:
                record = self.rt.plan(key)
            except errors.TensorcastError:
                return {}
            if record.status != "running":
                return record.result
            if time.monotonic() >= give_up_at:
                return {}
            self._closed.wait(0.1)
        return {}

    def _tick_loop(self) -> None:
        while not self._closed.wait(self.config.tick_s):
            try:
                self.tick_once()
            except Exception:
                self.errors += 1
                log.exception("rebalance tick failed")

    # -- state for tc top ------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        with self._cv:
            owners: dict[str, int] = {}
            for s in self._sessions.values():
                owners[s.owner] = owners.get(s.owner, 0) + 1
            instances = [
                {
                    "instance_id": iid,
                    "endpoint": endpoint,
                    "inflight": self._inflight.get(iid, 0),
                    "reported_waiting": self._reported.get(iid, (0, 0))[0],
                    "reported_running": self._reported.get(iid, (0, 0))[1],
                    "ewma_load": round(self._loads.get(iid, 0.0), 3),
                    "sessions": owners.get(iid, 0),
                    "routed": self._routed.get(iid, 0),
                }
                for iid, endpoint in sorted(self._endpoints.items())
            ]
            migrations = list(self._migrations)
            return {
                "router_id": self.router_id,
                "policy": self.config.policy,
                "load_source": self.config.load_source,
                "params": self.config.params.to_json(),
                "instances": instances,
                "sessions": len(self._sessions),
                "migrations": migrations,
                "migrations_ok": self._migrations_ok,  # since the start (the list: the last)
                "migrated_bytes": self._migrated_bytes,
                "last_tick": dict(self._last_tick),
                "errors": self.errors,
                "waiting_turns": self.waiting_turns,
            }


# -- HTTP ------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    router: Router
    turns: threading.BoundedSemaphore

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-reply is not an error worth printing (never print)."""
        logging.getLogger("tensorcast.http").debug(
            "request from %s failed", client_address, exc_info=True
        )


class _ClientGone(Exception):
    """Writing to the client failed (it left, or stopped reading): nothing more to send."""


_STATUS = {
    errors.InvalidArgument: 400,
    errors.NotFound: 404,
    errors.ResourceExhausted: 413,
    errors.Unavailable: 503,
    errors.DeadlineExceeded: 504,
}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S  # reads and writes on the client's socket
    _streaming = False  # this request's 200 and chunked headers are sent
    _body_read = False  # this request's body (if any) was read whole

    def log_message(self, format: str, *args: Any) -> None:
        """The library never prints."""

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        self._streaming = False
        self._body_read = False
        try:
            reply = self._route(method)
            if reply is None:
                return
            status = 200
        except _ClientGone:
            self.close_connection = True
            return
        except errors.TensorcastError as exc:
            status = _STATUS.get(errors.public_class(exc), 500)
            reply = {"error": errors.public_name(exc), "message": str(exc)}
        except Exception as exc:
            status = 500
            reply = {"error": "TensorcastError", "message": f"{type(exc).__name__}: {exc}"}
        # The request's body may be unread: the connection cannot carry another request.
        self.close_connection = True
        if self._streaming:  # a stream cut short: closed without its last chunk, so the
            return  # client sees it incomplete rather than a second response inside it
        self._send(status, json.dumps(reply).encode())
        if self._sent_a_body() and not self._body_read:
            self._linger()

    def _sent_a_body(self) -> bool:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return True
        try:
            return int(self.headers.get("Content-Length", "0")) > 0
        except ValueError:
            return True

    def _linger(self) -> None:
        """Read and drop what the client still sends (see LINGER_S), after our half-close."""
        sock = self.connection
        deadline = time.monotonic() + LINGER_S
        left = LINGER_BYTES
        try:
            sock.shutdown(socket.SHUT_WR)
            while left > 0 and (remaining := deadline - time.monotonic()) > 0:
                sock.settimeout(remaining)
                chunk = sock.recv(min(left, 64 << 10))
                if not chunk:
                    return
                left -= len(chunk)
        except OSError:  # the client is gone, or the time is up
            pass

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        instance: str = "",
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if self.close_connection:
                self.send_header("Connection", "close")
            if instance:
                self.send_header("X-TC-Instance", instance)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError as e:
            raise _ClientGone(e) from None

    def _to_client(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as e:
            raise _ClientGone(e) from None

    def _route(self, method: str) -> Any:
        router = self.server.router
        path = self.path.split("?", 1)[0]
        if method == "GET" and path in ("/health", "/health_generate"):
            return {}
        if method == "GET" and path == "/router/state":
            return router.state()
        if method == "GET" and path == "/get_load":
            state = router.state()
            return [{"dp_rank": 0, "num_reqs": sum(i["inflight"] for i in state["instances"])}]
        if method == "POST" and path == "/generate":
            if not self.server.turns.acquire(blocking=False):
                raise errors.Unavailable(f"the router serves {MAX_TURNS} turns at once: retry")
            try:
                return self._generate()
            finally:
                self.server.turns.release()
        raise errors.NotFound(
            f"no route {method} {path}: use POST /generate, GET /health, GET /router/state"
        )

    def _body(self) -> dict[str, Any]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise errors.InvalidArgument("send the request body with a Content-Length")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise errors.InvalidArgument("Content-Length is not a number") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise errors.ResourceExhausted(f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(max(length, 0))
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise errors.InvalidArgument(f"request body is not valid JSON ({exc!r})") from None
        if not isinstance(body, dict):
            raise errors.InvalidArgument("request body must be a JSON object")
        return body

    def _generate(self) -> dict | None:
        from tensorcast.engine.sglang_api import session_of
        from tensorcast.engine.sim import tokenize

        router = self.server.router
        body = self._body()
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise errors.InvalidArgument("give exactly one of 'text' or 'input_ids'")
        if text is not None and not isinstance(text, str):
            raise errors.InvalidArgument("'text' must be a string (batches are not supported)")
        if ids is not None and (
            not isinstance(ids, list)
            or not all(type(t) is int and 0 <= t < 1 << 32 for t in ids)  # not bool
        ):
            raise errors.InvalidArgument("'input_ids' must be a list of ints in [0, 2**32)")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise errors.InvalidArgument("'rid' must be a string")
        tokens = ids if ids is not None else tokenize(str(text), 1 << 31)
        rid = rid or uuid.uuid4().hex
        session = session_of(body, self.headers.get("X-Session-Id"), rid)
        params = body.get("session_params") or {}
        if not isinstance(params, dict):
            raise errors.InvalidArgument("'session_params' must be an object")
        body["rid"] = rid
        body["session_params"] = dict(params, id=session)
        payload = json.dumps(body).encode()
        prompt_tokens, stream = len(tokens), bool(body.get("stream"))
        for attempt in (1, 2):  # once more elsewhere if the instance refused the connection
            instance, endpoint = router.acquire(session, tokens)
            total: int | None = None
            try:
                conn = self._connect(instance, endpoint)
            except OSError as e:
                router.release(session, instance, None)
                router.suspect(instance)
                if attempt == 2:
                    raise errors.Unavailable(f"instance {instance} at {endpoint}: {e}") from None
                continue
            del body, tokens  # the request travels as `payload` from here
            try:
                total = self._forward(conn, payload, prompt_tokens, stream, instance, endpoint)
                return None
            finally:
                conn.close()
                router.release(session, instance, total)
        raise AssertionError("unreachable")

    def _connect(self, instance: str, endpoint: str) -> http.client.HTTPConnection:
        host, _, port = endpoint.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=CONNECT_TIMEOUT_S)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.server.router.config.request_timeout_s)
        return conn

    def _forward(
        self,
        conn: http.client.HTTPConnection,
        payload: bytes,
        prompt_tokens: int,
        stream: bool,
        instance: str,
        endpoint: str,
    ) -> int | None:
        """Send the turn and relay the answer; the session's tokens after it (None unless
        the instance answered 200)."""
        try:
            conn.request("POST", "/generate", payload, {"Content-Type": "application/json"})
            upstream = conn.getresponse()
            if stream and upstream.status == 200:
                return self._relay_stream(upstream, prompt_tokens, instance)
            data = upstream.read()
        except http.client.HTTPException as e:  # a malformed or cut-off answer
            raise errors.Unavailable(f"instance {instance} at {endpoint} failed: {e!r}") from None
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"instance {instance} at {endpoint} did not answer within "
                f"{self.server.router.config.request_timeout_s:g}s"
            ) from None
        except OSError as e:
            raise errors.Unavailable(f"instance {instance} at {endpoint} failed: {e}") from None
        content_type = upstream.getheader("Content-Type", "text/plain")
        self._send(upstream.status, data, content_type, instance)
        return prompt_tokens + _completion_tokens(data) if upstream.status == 200 else None

    def _relay_stream(
        self, upstream: http.client.HTTPResponse, prompt_tokens: int, instance: str
    ) -> int:
        try:
            self.send_response(200)
            self.send_header("X-TC-Instance", instance)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        except OSError as e:
            raise _ClientGone(e) from None
        self._streaming = True
        total = prompt_tokens
        event = b""
        while True:
            line = upstream.readline()
            if not line:
                break
            event += line
            if line in (b"\n", b"\r\n"):
                if event.startswith(b"data: {"):
                    total = prompt_tokens + _completion_tokens(event[6:])
                self._to_client(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                event = b""
        if event:  # the instance closed mid-event: not a complete stream
            raise errors.Unavailable(f"instance {instance} ended its stream mid-event")
        self._to_client(b"0\r\n\r\n")
        return total


def _completion_tokens(data: bytes) -> int:
    try:
        return int(json.loads(data)["meta_info"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0


class RouterHTTPServer:
    """Serves a Router on host:port (port 0: any free port, bound at construction)."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0) -> None:
        self._httpd = _Server((host, port), _Handler)
        self._httpd.router = router
        self._httpd.turns = threading.BoundedSemaphore(MAX_TURNS)
        self._thread: threading.Thread | None = None

    @property
    def addr(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> RouterHTTPServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="tc-router-http", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
