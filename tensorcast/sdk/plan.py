"""`CallContext` and `Plan`: callers compose lifecycle operations; a gateway worker runs them.

    ctx = tc.CallContext(id="rebalance-42", deadline_ms=5000, idempotency_key="move-req-7")
    plan = tc.Plan(ctx)
    flush = plan.on_instance("inst-a").publish("req-7")
    plan.on_worker(inst_b.worker_id).prefetch_many(flush.pages)
    plan.on_instance("inst-b").hydrate("req-7", flush.pages)
    result = plan.run(rt, concurrency=1)

A step's result (or one field of it, `step.pages`) is an input of later steps; those inputs and
`after=` are the dependencies. Running the same idempotency key again returns the recorded
result and does nothing twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorcast import errors
from tensorcast import plan as planlib
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.client import Unreachable

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime
    from tensorcast.types import InstanceInfo, WorkerInfo

DEFAULT_DEADLINE_MS = 30_000


@dataclass(frozen=True)
class CallContext:
    """Trace id (logs on every worker the plan touches), deadline for the whole plan, and the
    idempotency key its result is recorded under (default: none, every run is new). A key names
    one plan: the same plan run again under it returns the first run's result (it never runs
    twice); another plan under it is refused (InvalidArgument)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    deadline_ms: int = DEFAULT_DEADLINE_MS
    idempotency_key: str | None = None


class StepRef:
    """A step's future result: pass it (or `ref.field`) as an argument of a later step."""

    def __init__(self, step_id: int, op: str, fieldname: str | None = None) -> None:
        self.step_id = step_id
        self.op = op
        self._field = fieldname

    def __getattr__(self, name: str) -> StepRef:
        if name.startswith("_"):
            raise AttributeError(name)
        if name == "artifact_result":  # the paper's name for a publish's pages
            name = "pages"
        return StepRef(self.step_id, self.op, name)

    def to_json(self) -> dict:
        ref: dict[str, Any] = {"$step": self.step_id}
        if self._field is not None:
            ref["field"] = self._field
        return ref


class _Builder:
    def __init__(self, plan: Plan, kind: str, target: str) -> None:
        self._plan = plan
        self._kind = kind
        self._target = target

    def _add(self, op: str, after: list[StepRef] | None = None, **args: Any) -> StepRef:
        return self._plan._add(self._kind, self._target, op, args, after or [])


class WorkerSteps(_Builder):
    def prefetch(self, artifact: Any, device: str = "cpu", **kw: Any) -> StepRef:
        return self._add("prefetch", artifact=_art(artifact), device=device, **kw)

    def prefetch_many(self, artifacts: Any, device: str = "cpu", **kw: Any) -> StepRef:
        items = artifacts if isinstance(artifacts, StepRef) else [_art(a) for a in artifacts]
        return self._add("prefetch_many", artifacts=items, device=device, **kw)

    def pin(self, artifact: Any, **kw: Any) -> StepRef:
        return self._add("pin", artifact=_art(artifact), **kw)

    def unpin(self, artifact: Any, **kw: Any) -> StepRef:
        return self._add("unpin", artifact=_art(artifact), **kw)


class InstanceSteps(_Builder):
    def publish(self, req_id: str, ttl_s: float = 600.0, **kw: Any) -> StepRef:
        return self._add("publish", req_id=req_id, ttl_s=ttl_s, **kw)

    def manifest(self, req_id: str, **kw: Any) -> StepRef:
        return self._add("manifest", req_id=req_id, **kw)

    def hydrate(self, req_id: str, artifacts: Any = None, **kw: Any) -> StepRef:
        return self._add("hydrate", req_id=req_id, artifacts=artifacts, **kw)

    def evict(self, req_id: str, **kw: Any) -> StepRef:
        return self._add("evict", req_id=req_id, **kw)

    def transform_into(self, artifact: Any, spec: dict | None = None, **kw: Any) -> StepRef:
        return self._add("transform_into", artifact=_art(artifact), spec=spec or {}, **kw)


def _art(a: Any) -> Any:
    """An artifact argument: a name, an Artifact, a step reference or a page reference."""
    if isinstance(a, (str, dict, StepRef)):
        return a
    if hasattr(a, "art_id"):
        return a.art_id
    raise errors.InvalidArgument(f"not an artifact: {a!r}")


def _encode(value: Any) -> Any:
    if isinstance(value, StepRef):
        return value.to_json()
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


class Plan:
    def __init__(self, ctx: CallContext | None = None) -> None:
        self.ctx = ctx or CallContext()
        self.steps: list[dict] = []

    def on_worker(self, worker: str | WorkerInfo) -> WorkerSteps:
        return WorkerSteps(self, "worker", worker if isinstance(worker, str) else worker.worker_id)

    def on_instance(self, instance: str | InstanceInfo) -> InstanceSteps:
        target = instance if isinstance(instance, str) else instance.instance_id
        return InstanceSteps(self, "instance", target)

    def _add(self, kind: str, target: str, op: str, args: dict, after: list[StepRef]) -> StepRef:
        step_id = len(self.steps)
        self.steps.append(
            {
                "id": step_id,
                "target": {"kind": kind, "id": target},
                "op": op,
                "args": _encode(args),
                "after": [r.step_id for r in after],
            }
        )
        return StepRef(step_id, op)

    def to_json(self, concurrency: int = 1) -> dict:
        return {
            "trace_id": self.ctx.id,
            "idempotency_key": self.ctx.idempotency_key or "",
            "deadline_ms": self.ctx.deadline_ms,
            "concurrency": concurrency,
            "steps": self.steps,
        }

    def run(self, rt: Runtime, concurrency: int = 1, gateway: str | None = None) -> dict:
        """Submit to a gateway worker (same host first) and wait for the result.

        A gateway that cannot be reached (killed, its heartbeat not yet expired) is skipped for
        the next live one, within the plan's deadline: a plan's steps are idempotent, and a
        resubmission carries the same idempotency key. A named `gateway` is the only one tried.

        Returns the result: status, per-step trace (worker, duration, bytes, retries, result).
        A failed plan raises its failed step's error class with `.result` set: the steps that
        finished keep their results there (plans are not transactions).
        """
        body = self.to_json(concurrency)
        planlib.validate(body)  # malformed plans fail here, before any network call
        if not body["idempotency_key"]:
            # Without a key of the caller's, this run gets its own: sent again to another
            # gateway it is still this run, and a later run is a new one.
            body["idempotency_key"] = f"run:{uuid.uuid4().hex}"
        request = pb.PlanRequest(plan_json=json.dumps(body))
        give_up_at = time.monotonic() + self.ctx.deadline_ms / 1000 + 2.0
        candidates = rt.gateways(gateway)
        for i, target in enumerate(candidates):
            left_s = give_up_at - time.monotonic()
            if left_s <= 0:
                raise errors.DeadlineExceeded(f"plan {self.ctx.id}: no gateway answered in time")
            try:
                reply = rt.worker_stub(target).call("RunPlan", request, timeout_s=left_s)
                break
            except (Unreachable, errors.ResourceExhausted):  # gone, or running its limit
                if i == len(candidates) - 1:
                    raise
        result = json.loads(reply.result_json)
        if result.get("status") != "ok":
            err = result.get("error") or {}
            e = errors.error_named(
                str(err.get("kind")),
                f"plan {self.ctx.id} failed at step {err.get('step')}: {err.get('message')}",
            )
            e.result = result  # type: ignore[attr-defined]
            raise e
        return result
