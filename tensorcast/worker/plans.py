"""Plan execution (DESIGN §4): every worker runs steps aimed at itself or at its instances
(`StepRunner`); a gateway worker runs whole plans (`PlanExecutor`): resolves targets, orders
the steps, dispatches them `concurrency` at a time, retries retryable failures with backoff
inside the deadline, and records the result under the idempotency key in the Global Store.
Plans are not transactions: finished steps stay done, and a re-run under the same key reuses
them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from tensorcast import errors
from tensorcast import plan as planlib
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import (
    artifact_from_pb,
    instance_from_pb,
    plan_from_pb,
    plan_to_pb,
    worker_from_pb,
)
from tensorcast.types import PlanRecord
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.page_service import PageService
from tensorcast.worker.transfers import Transfers

log = logging.getLogger("tensorcast.plan")

# A retryable step failure is retried with doubling pauses (capped) for up to RETRY_WINDOW_S
# (never past the plan deadline). The window outlasts a shard home's failover (the lease TTL,
# 3 s by default, plus a heartbeat of the worker taking it over), so a migration that meets a
# dead home waits for the new one instead of failing.
BACKOFF_S = 0.05
MAX_BACKOFF_S = 0.5
RETRY_WINDOW_S = 6.0
WAIT_POLL_S = 0.1
# Plans a gateway runs (or waits on, for a key running elsewhere) at once: each holds one of
# the worker's RPC threads for up to its deadline, and the rest must stay free for its other
# calls (steps, pages, transfers). Past it a plan is refused (ResourceExhausted: the caller
# tries another gateway).
MAX_PLANS_IN_FLIGHT = 24


class StepRunner:
    """Runs one step here: a worker operation, or an instance operation through its stream."""

    def __init__(self, node: WorkerNode, transfers: Transfers, pages: PageService) -> None:
        self.node = node
        self.transfers = transfers
        self.pages = pages

    def run(self, step: dict, timeout_s: float, trace_id: str) -> dict:
        started = time.monotonic()
        op, args, target = step["op"], step.get("args", {}), step["target"]
        log.info("trace=%s step=%s op=%s target=%s start", trace_id, step["id"], op, target["id"])
        try:
            if target["kind"] == "instance":
                result = self.node.instances.call(target["id"], op, args, timeout_s, trace_id)
            else:
                result = getattr(self, f"_{op}")(args, timeout_s)
        except errors.TensorcastError as e:
            log.info(
                "trace=%s step=%s op=%s failed after %.3f s: %s: %s",
                trace_id,
                step["id"],
                op,
                time.monotonic() - started,
                type(e).__name__,
                e,
            )
            raise
        log.info(
            "trace=%s step=%s op=%s ok in %.3f s, %d bytes",
            trace_id,
            step["id"],
            op,
            time.monotonic() - started,
            result.get("bytes", 0),
        )
        return result

    def _content_of(self, art_id: str) -> str:
        reply = self.node.store.call("GetArtifact", pb.ArtifactRequest(art_id=art_id))
        return artifact_from_pb(reply).content_id

    def _prefetch(self, args: dict, timeout_s: float) -> dict:
        art_id = args["artifact"]
        if args.get("device", "cpu") != "cpu":
            raise errors.InvalidArgument("this worker has only the cpu tier")
        r = self.transfers.prefetch(
            self._content_of(art_id), timeout_s, int(args.get("streams", 0))
        )
        return {
            "artifact": art_id,
            "bytes": r.bytes_moved,
            "already_present": r.already_present,
            "source_worker_id": r.source_worker_id,
        }

    def _prefetch_many(self, args: dict, timeout_s: float) -> dict:
        """Artifacts by id, KV pages by reference (dicts with a key): pages are copied from
        their shard homes into this worker's page cache, where hydrate finds them."""
        deadline = time.monotonic() + timeout_s
        items = args["artifacts"]
        if not isinstance(items, list):
            raise errors.InvalidArgument("prefetch_many takes a list of artifacts or pages")
        page_refs = [a for a in items if isinstance(a, dict)]
        moved = self.pages.prefetch(page_refs, timeout_s, float(args.get("ttl_s", 600.0)))
        results = []
        for art_id in (a for a in items if not isinstance(a, dict)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("prefetch_many ran out of time")
            results.append(self._prefetch({"artifact": art_id}, remaining))
        return {
            "artifacts": results,
            "pages": len(page_refs),
            "bytes": moved + sum(r["bytes"] for r in results),
        }

    def _pin(self, args: dict, timeout_s: float) -> dict:
        return self._set_pin(args, True)

    def _unpin(self, args: dict, timeout_s: float) -> dict:
        return self._set_pin(args, False)

    def _set_pin(self, args: dict, pinned: bool) -> dict:
        self.node.pool.set_pinned(self._content_of(args["artifact"]), pinned)
        self.node.heartbeat_once()
        return {"artifact": args["artifact"], "pinned": pinned, "bytes": 0}


class PlanExecutor:
    """The gateway side: one call of `run` executes one plan to its end or its deadline."""

    def __init__(self, node: WorkerNode, runner: StepRunner) -> None:
        self.node = node
        self.runner = runner
        self.in_flight = 0  # plans running or waiting on their key here (a metric)
        self._lock = threading.Lock()

    def run(self, plan: dict) -> dict:
        planlib.validate(plan)
        with self._lock:
            if self.in_flight >= MAX_PLANS_IN_FLIGHT:
                raise errors.ResourceExhausted(
                    f"gateway {self.node.name} runs {MAX_PLANS_IN_FLIGHT} plans already"
                )
            self.in_flight += 1
        try:
            return self._run(plan)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _run(self, plan: dict) -> dict:
        started = time.monotonic()
        deadline = started + plan["deadline_ms"] / 1000
        trace_id = str(plan.get("trace_id") or "")
        if not trace_id:
            raise errors.InvalidArgument("a plan needs a trace_id")
        # No key: this run is new, never another's result (the SDK sends one key per run, the
        # same to every gateway it tries).
        key = str(plan.get("idempotency_key") or f"run:{uuid.uuid4().hex}")
        digest = _plan_digest(plan)
        try:
            routes = self._routes(plan["steps"])
        except errors.TensorcastError:
            # A key that finished ok replays its result even if a target is gone now. (One
            # still running elsewhere cannot finish ok without that target: the error stands.)
            done = self._recorded(key)
            if done is not None and done.status == "ok":
                _check_same_plan(done, digest)
                return dict(done.result, replayed=True)
            raise
        record = PlanRecord(
            key,
            trace_id,
            "running",
            {"plan_digest": digest},
            0.0,
            deadline_at=time.time() + (deadline - started),
            run_id=uuid.uuid4().hex,  # a re-sent BeginPlan of this run is this run
        )
        begun = self.node.store.call("BeginPlan", plan_to_pb(record))
        previous = plan_from_pb(begun.existing) if begun.HasField("existing") else None
        if not begun.started:
            assert previous is not None
            _check_same_plan(previous, digest)
            return self._await_recorded(previous, deadline)
        reused = _finished_steps(previous, plan["steps"])
        log.info(
            "trace=%s plan %s: %d steps, concurrency %d, deadline %d ms, %d reused",
            trace_id,
            key,
            len(plan["steps"]),
            plan.get("concurrency", 1),
            plan["deadline_ms"],
            len(reused),
        )
        try:
            result = self._execute(plan, routes, deadline, trace_id, reused)
        except BaseException as e:
            # Never leave the key "running" (a retry would wait out the deadline, then run
            # every step again): record the failure, then report it.
            if isinstance(e, errors.TensorcastError):
                error = {"kind": errors.public_name(e), "message": str(e)}
            else:
                error = {"kind": "TensorcastError", "message": f"{type(e).__name__}: {e}"}
            failed = {"status": "failed", "error": error, "steps": [], "plan_digest": digest}
            self.node.store.call(
                "FinishPlan", plan_to_pb(PlanRecord(key, trace_id, "failed", failed, 0.0))
            )
            raise
        result.update(
            trace_id=trace_id,
            idempotency_key=key,
            plan_digest=digest,
            duration_s=round(time.monotonic() - started, 4),
            replayed=False,
            gateway=self.node.name,
        )
        self.node.store.call(
            "FinishPlan",
            plan_to_pb(PlanRecord(key, trace_id, result["status"], result, 0.0)),
        )
        return result

    def _routes(self, steps: list[dict]) -> dict[int, tuple[str, str, str]]:
        """Step id -> (worker id, worker addr, worker name) that runs it; unknown or dead
        targets are rejected before anything runs."""
        workers = [
            worker_from_pb(w) for w in self.node.store.call("ListWorkers", pb.Empty()).workers
        ]
        instances = None
        routes = {}
        for step in steps:
            kind, target = step["target"]["kind"], step["target"]["id"]
            if kind == "instance":
                if instances is None:
                    reply = self.node.store.call("ListInstances", pb.Empty())
                    instances = [instance_from_pb(i) for i in reply.instances]
                inst = next((i for i in instances if i.instance_id == target), None)
                if inst is None:
                    raise errors.NotFound(f"step {step['id']}: no instance {target!r}")
                if not inst.alive:
                    raise errors.Unavailable(f"step {step['id']}: instance {target!r} is not alive")
                target = inst.worker_id
            # A worker restarted under its name is listed twice until the dead entry expires.
            named = [w for w in workers if target in (w.worker_id, w.name)]
            worker = next((w for w in named if w.alive), named[0] if named else None)
            if worker is None:
                raise errors.NotFound(f"step {step['id']}: no worker {target!r}")
            if not worker.alive:
                raise errors.Unavailable(f"step {step['id']}: worker {worker.name} is dead")
            routes[step["id"]] = (worker.worker_id, worker.addr, worker.name)
        return routes

    def _recorded(self, key: str) -> PlanRecord | None:
        try:
            return plan_from_pb(self.node.store.call("GetPlan", pb.PlanRecord(idempotency_key=key)))
        except errors.NotFound:
            return None

    def _await_recorded(self, record: PlanRecord, deadline: float) -> dict:
        """The key ran (or runs) elsewhere: return its recorded result, never run it twice."""
        while record.status == "running":
            if time.monotonic() >= deadline:
                raise errors.DeadlineExceeded(
                    f"plan {record.idempotency_key!r} is still running (trace {record.trace_id})"
                )
            time.sleep(WAIT_POLL_S)
            record = plan_from_pb(self.node.store.call("GetPlan", plan_to_pb(record)))
        return dict(record.result, replayed=True)

    def _execute(
        self,
        plan: dict,
        routes: dict[int, tuple[str, str, str]],
        deadline: float,
        trace_id: str,
        reused: dict[int, dict],
    ) -> dict:
        steps = {s["id"]: s for s in plan["steps"]}
        deps = {i: planlib.dependencies(s) for i, s in steps.items()}
        order = planlib.order(plan["steps"])
        traces: dict[int, dict] = {}
        results: dict[int, dict] = {}
        for i, trace in reused.items():
            traces[i] = dict(trace, status="reused")
            results[i] = trace["result"]
        failure: dict[str, Any] | None = None
        running: dict[Future, int] = {}
        with ThreadPoolExecutor(max_workers=plan.get("concurrency", 1)) as pool:
            while True:
                if failure is None:
                    ready = [
                        i
                        for i in order
                        if i not in traces and i not in running.values() and deps[i] <= set(results)
                    ]
                    for i in ready[: plan.get("concurrency", 1) - len(running)]:
                        try:
                            args = planlib.resolve(steps[i].get("args", {}), results)
                            planlib.check_args(dict(steps[i], args=args))
                        except errors.TensorcastError as e:  # a field the input's op lacks
                            error = {"kind": errors.public_name(e), "message": str(e)}
                            traces[i] = {
                                "id": i,
                                "op": steps[i]["op"],
                                "target": steps[i]["target"],
                                "status": "failed",
                                "error": error,
                            }
                            failure = {"step": i, **error}
                            break
                        step = dict(steps[i], args=args)
                        fut = pool.submit(self._run_step, step, routes[i], deadline, trace_id)
                        running[fut] = i
                if not running:
                    break
                done, _ = wait(
                    list(running),
                    timeout=max(0.0, deadline - time.monotonic()) + 1,
                    return_when=FIRST_COMPLETED,
                )
                for fut in done:
                    i = running.pop(fut)
                    trace = fut.result()
                    trace["args_digest"] = _args_digest(steps[i])
                    traces[i] = trace
                    if trace["status"] == "ok":
                        results[i] = trace["result"]
                    elif failure is None:
                        failure = {"step": i, **trace["error"]}
        ordered = []
        for i in sorted(steps):
            trace = traces.get(i) or {
                "id": i,
                "op": steps[i]["op"],
                "target": steps[i]["target"],
                "status": "skipped",
            }
            ordered.append(trace)
        return {"status": "failed" if failure else "ok", "error": failure, "steps": ordered}

    def _run_step(
        self, step: dict, route: tuple[str, str, str], deadline: float, trace_id: str
    ) -> dict:
        worker_id, addr, name = route
        started = time.monotonic()
        retries = 0
        trace: dict[str, Any] = {
            "id": step["id"],
            "op": step["op"],
            "target": step["target"],
            "worker": name,
            "started_at": round(time.time(), 4),  # wall clock: to line steps up in a timeline
        }
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise errors.DeadlineExceeded(
                        f"step {step['id']} ({step['op']}) did not finish before the plan deadline"
                    )
                result = self._dispatch(step, worker_id, addr, name, remaining, trace_id)
                trace.update(status="ok", result=result, bytes=int(result.get("bytes", 0)))
                break
            except Exception as e:
                if not isinstance(e, errors.TensorcastError):  # a bug: the step fails
                    log.exception("trace=%s step %s (%s) failed", trace_id, step["id"], step["op"])
                    e = errors.TensorcastError(f"{type(e).__name__}: {e}")
                pause = min(MAX_BACKOFF_S, BACKOFF_S * 2**retries)
                retryable = e.retryable and not isinstance(e, errors.DeadlineExceeded)
                resume = time.monotonic() + pause
                if retryable and resume < min(deadline, started + RETRY_WINDOW_S):
                    retries += 1
                    time.sleep(pause)
                    continue
                trace.update(
                    status="failed", error={"kind": errors.public_name(e), "message": str(e)}
                )
                break
        trace.update(duration_s=round(time.monotonic() - started, 4), retries=retries)
        return trace

    def _dispatch(
        self, step: dict, worker_id: str, addr: str, name: str, timeout_s: float, trace_id: str
    ) -> dict:
        if worker_id == self.node.worker_id:
            return self.runner.run(step, timeout_s, trace_id)
        reply = self.node.peer(worker_id, addr, name).call(
            "RunStep",
            pb.StepRequest(
                trace_id=trace_id,
                step_json=json.dumps(step),
                timeout_ms=max(1, int(timeout_s * 1000)),
            ),
            timeout_s=timeout_s + 0.5,
        )
        return json.loads(reply.result_json)


def _plan_digest(plan: dict) -> str:
    """What a plan does: its steps (ops, targets, arguments, order), not its deadline, trace
    or concurrency."""
    text = json.dumps(plan["steps"], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _check_same_plan(record: PlanRecord, digest: str) -> None:
    """A key names one plan: another plan under it is refused, never answered with the first
    one's result (records from before digests were kept carry none)."""
    recorded = record.result.get("plan_digest")
    if recorded and recorded != digest:
        raise errors.InvalidArgument(
            f"idempotency key {record.idempotency_key!r} names another plan (trace "
            f"{record.trace_id}): use a new key for a new plan"
        )


def _args_digest(step: dict) -> str:
    """What a step was asked (its arguments as the plan gave them, references unresolved)."""
    text = json.dumps(step.get("args", {}), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _finished_steps(previous: PlanRecord | None, steps: list[dict]) -> dict[int, dict]:
    """Steps a failed earlier run under the same key finished, if the plan is the same: the
    same ops on the same targets with the same arguments."""
    if previous is None or previous.status != "failed":
        return {}
    old = previous.result.get("steps", [])
    same = len(old) == len(steps) and all(
        o.get("op") == s["op"]
        and o.get("target") == s["target"]
        and o.get("args_digest") == _args_digest(s)
        for o, s in zip(old, steps)
    )
    if not same:
        return {}
    return {o["id"]: o for o in old if o.get("status") in ("ok", "reused") and "result" in o}
