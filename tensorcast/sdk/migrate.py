"""The migration plan of the paper's List. 1, used by `tc migrate` and by routers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorcast.sdk.plan import CallContext, Plan

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
) -> dict:
    """publish on `source` -> prefetch to `dest`'s worker -> hydrate `dest` (-> evict source)."""
    target = rt.resolve_instance(dest)
    rt.resolve_instance(source)
    ctx = CallContext(deadline_ms=deadline_ms, idempotency_key=idempotency_key)
    if trace_id:
        ctx = CallContext(trace_id, deadline_ms, idempotency_key)
    plan = Plan(ctx)
    flush = plan.on_instance(source).publish(req_id, ttl_s=ttl_s)
    warm = plan.on_worker(target.worker_id).prefetch_many(flush.pages, ttl_s=ttl_s)
    loaded = plan.on_instance(dest).hydrate(req_id, flush.pages, after=[warm])
    if not keep_source:
        plan.on_instance(source).evict(req_id, after=[loaded])
    return plan.run(rt)
