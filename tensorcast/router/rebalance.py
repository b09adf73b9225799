"""One rebalancing tick against a live cluster: the I/O around the pure policy.

    observe(rt)    signals (`list_instances()`: load per instance) + each engine's
                   `GET /requests` (per-request tokens, idle time, migrations) -> policy inputs
    Rebalancer     keeps the EWMA state between ticks, runs Algorithm 1, and executes a decision
                   as the paper's List. 1 plan (publish -> prefetch_many -> hydrate -> evict) under
                   a CallContext whose idempotency key names the decision, so re-running the same
                   decision (a retry, a second `tc rebalance`) returns the recorded result.

An engine whose `/requests` cannot be read contributes its load but no candidate requests (it
can still be a target). A failed migration leaves the request where it was: the plan's evict
step runs only after hydrate succeeded on the target.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorcast import errors
from tensorcast.router.policy import LoadSample, RebalanceParams, RequestState, TickResult, tick

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime
    from tensorcast.types import InstanceInfo

REQUESTS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Observation:
    samples: list[LoadSample]
    requests: list[RequestState]
    instances: dict[str, InstanceInfo]
    unreadable: dict[str, str] = field(default_factory=dict)  # instance -> why no /requests
    now: float = 0.0


def read_requests(
    info: InstanceInfo, now: float, timeout_s: float = REQUESTS_TIMEOUT_S
) -> list[RequestState]:
    """The engine's per-request detail (`GET /requests` on its HTTP endpoint)."""
    from tensorcast.engine.server import engine_request

    if not info.endpoint:
        raise errors.Unavailable(f"instance {info.instance_id} has no HTTP endpoint")
    reply = engine_request(info.endpoint, "GET", "/requests", timeout_s=timeout_s)
    out = []
    for r in reply.get("requests", []):
        out.append(
            RequestState(
                req_id=str(r["req_id"]),
                instance_id=info.instance_id,
                tokens=int(r.get("tokens", 0)),
                last_active=now - float(r.get("idle_s", 0.0)),
                migrations=int(r.get("migrations", 0)),
                running=bool(r.get("running", False)),
            )
        )
    return out


def observe(rt: Runtime, only: Iterable[str] = ()) -> Observation:
    """Live instances (restricted to `only` when given: NotFound for an unknown one) with their
    load, and their requests."""
    snapshot = rt.signals().list_instances()
    every = {i.instance_id: i for i in snapshot}
    wanted = list(only)
    unknown = [i for i in wanted if i not in every]
    if unknown:
        raise errors.NotFound(
            f"no instance {unknown[0]!r} is attached: see `tc instances` for the ids"
        )
    instances = {i: info for i, info in every.items() if info.alive and (not wanted or i in wanted)}
    now = time.monotonic()
    samples = [LoadSample(i, info.waiting, info.running) for i, info in sorted(instances.items())]
    requests: list[RequestState] = []
    unreadable: dict[str, str] = {}
    for iid, info in sorted(instances.items()):
        try:
            requests.extend(read_requests(info, now))
        except errors.TensorcastError as e:
            unreadable[iid] = str(e)
    return Observation(samples, requests, instances, unreadable, now)


def decision_key(
    prefix: str, req_id: str, source: str, target: str, migrations: int, tokens: int
) -> str:
    """The idempotency key of one decision: the same move of the same request at the same point
    of its history (its migrations, and its tokens: every turn adds some) always gets the same
    key. A retry of a failed move reuses the steps that finished; after another turn the KV
    cache is not the one those steps published, so the key must differ."""
    return f"{prefix}/{req_id}/{source}->{target}/{migrations}/{tokens}"


MigrateFn = Callable[..., dict]


class Rebalancer:
    """Algorithm 1 ticks against a cluster; `loads` carries the EWMA state between ticks.

    Decision keys start with `key_prefix` and a random id of this rebalancer: plan results are
    kept for a day, and a request id reused later (a seeded workload run again, an engine
    restarted under its id) at the same point would otherwise replay an old "ok" and move
    nothing. A request whose migration failed is left out until it changes (its next turn
    adds tokens): a failure that repeats would win every tick and block every other request.
    """

    def __init__(
        self,
        rt: Runtime,
        params: RebalanceParams | None = None,
        *,
        only: Iterable[str] = (),
        key_prefix: str = "rebalance",
        deadline_ms: int = 30_000,
        migrate: MigrateFn | None = None,
    ) -> None:
        self.rt = rt
        self.params = params or RebalanceParams()
        self.only = list(only)
        self.key_prefix = f"{key_prefix}/{uuid.uuid4().hex[:8]}"
        self.deadline_ms = deadline_ms
        self.loads: dict[str, float] = {}
        self.ticks = 0
        self.failed = 0  # migrations that failed
        self._left_out: dict[tuple[str, str], int] = {}  # (instance, request) -> its tokens
        if migrate is None:
            from tensorcast.sdk.migrate import migrate as sdk_migrate

            migrate = sdk_migrate
        self._migrate = migrate

    def tick(self, dry_run: bool = False) -> dict[str, Any]:
        """Observe, decide and (unless `dry_run`) migrate; returns the tick's JSON record."""
        obs = observe(self.rt, self.only)
        self._left_out = {
            (r.instance_id, r.req_id): r.tokens
            for r in obs.requests
            if self._left_out.get((r.instance_id, r.req_id)) == r.tokens
        }
        candidates = [r for r in obs.requests if (r.instance_id, r.req_id) not in self._left_out]
        result: TickResult = tick(self.loads, obs.samples, candidates, obs.now, self.params)
        self.loads = result.loads
        self.ticks += 1
        record: dict[str, Any] = {
            "tick": self.ticks,
            "dry_run": dry_run,
            "samples": {s.instance_id: s.load for s in obs.samples},
            "unreadable": obs.unreadable,
            **result.to_json(),
            "migration": None,
        }
        decision = result.decision
        if decision is None:
            return record
        request = next(
            r
            for r in obs.requests
            if r.req_id == decision.req_id and r.instance_id == decision.source
        )
        key = decision_key(
            self.key_prefix,
            decision.req_id,
            decision.source,
            decision.target,
            request.migrations,
            request.tokens,
        )
        record["idempotency_key"] = key
        if dry_run:
            return record
        try:
            plan = self._migrate(
                self.rt,
                decision.req_id,
                decision.source,
                decision.target,
                idempotency_key=key,
                deadline_ms=self.deadline_ms,
            )
            record["migration"] = summarize(plan)
        except errors.TensorcastError as e:
            partial = getattr(e, "result", None)
            record["migration"] = dict(
                summarize(partial) if partial else {},
                status="failed",
                error={"kind": errors.public_name(e), "message": str(e)},
            )
            self.failed += 1
            self._left_out[(decision.source, decision.req_id)] = request.tokens
        return record


def summarize(plan: dict) -> dict:
    """What an operator needs from a migration plan's result: status, bytes, time, steps."""
    steps = plan.get("steps", [])
    return {
        "status": plan.get("status", "?"),
        "trace_id": plan.get("trace_id", ""),
        "replayed": bool(plan.get("replayed")),
        "duration_s": plan.get("duration_s", 0.0),
        "bytes": sum(
            int((s.get("result") or {}).get("bytes", 0)) for s in steps if s.get("op") == "publish"
        ),
        "steps": [
            {"op": s.get("op"), "status": s.get("status"), "bytes": s.get("bytes", 0)}
            for s in steps
        ],
    }
