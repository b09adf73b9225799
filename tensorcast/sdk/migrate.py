"""The migration plan of the paper's List. 1 (in parts, pipelined), used by `tc migrate` and by
routers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorcast import errors
from tensorcast.adaptors import DEFAULT_KV_PARTS, MAX_KV_PARTS
from tensorcast.plan import MAX_CONCURRENCY
from tensorcast.sdk.plan import CallContext, Plan, StepRef

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime


def migrate(
    rt: Runtime,
    req_id: str,
    source: str,
    dest: str,
    *,
    keep_source: bool = False,
    ttl_s: float = 600.0,
    deadline_ms: int = 30_000,
    idempotency_key: str | None = None,
    trace_id: str | None = None,
    parts: int = DEFAULT_KV_PARTS,
) -> dict:
    """publish on `source` -> prefetch to `dest`'s worker -> hydrate `dest` (-> evict source).

    With `parts` > 1 the request's KV moves as that many parts, each its own publish ->
    prefetch_many -> hydrate chain, run as a pipeline: the link carries part k while the source
    exports part k+1 and the target imports part k-1. The source exports one part at a time
    (two at once measured slower on 2 cores: they only compete). The target makes the request
    resident when its last part arrives, so a failure half-way leaves the source's copy the only
    one (the target drops the parts it holds when they expire or on evict).
    """
    if not 1 <= parts <= MAX_KV_PARTS:
        raise errors.InvalidArgument(f"parts must be in [1, {MAX_KV_PARTS}], not {parts}")
    if source == dest:
        raise errors.InvalidArgument(f"source and target are both {source!r}: nothing to move")
    target = rt.resolve_instance(dest)
    rt.resolve_instance(source)
    # The target's worker by name: a rerun under the same key after it restarted (a new id)
    # is the same plan (a key names one plan), and the gateway routes a name to its live entry.
    worker = next(
        (w.name for w in rt.cached_workers([target.worker_id]) if w.worker_id == target.worker_id),
        target.worker_id,
    )
    ctx = CallContext(deadline_ms=deadline_ms, idempotency_key=idempotency_key)
    if trace_id:
        ctx = CallContext(trace_id, deadline_ms, idempotency_key)
    plan = Plan(ctx)
    loaded: list[StepRef] = []
    flush: StepRef | None = None
    for part in range(parts):
        cut = {"part": part, "parts": parts} if parts > 1 else {}
        after = [flush] if flush is not None else []
        flush = plan.on_instance(source).publish(req_id, ttl_s=ttl_s, after=after, **cut)
        warm = plan.on_worker(worker).prefetch_many(flush.pages, ttl_s=ttl_s)
        loaded.append(plan.on_instance(dest).hydrate(req_id, flush.pages, after=[warm], **cut))
    if not keep_source:
        plan.on_instance(source).evict(req_id, after=loaded)
    return plan.run(rt, concurrency=min(MAX_CONCURRENCY, 1 + 2 * parts))
