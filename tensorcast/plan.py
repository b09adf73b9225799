"""The plan wire format and its checks, shared by the SDK that builds plans and the gateway
worker that runs them.

A plan is JSON:
    {"trace_id": str, "idempotency_key": str, "deadline_ms": int, "concurrency": int,
     "steps": [{"id": 0, "target": {"kind": "worker" | "instance", "id": str},
                "op": str, "args": {...}, "after": [step ids]}, ...]}
An argument may be a reference to an earlier step's result, `{"$step": i}` or
`{"$step": i, "field": name}`; references and `after` are the dependencies. Malformed plans are
rejected before anything runs.
"""

from __future__ import annotations

from typing import Any

from tensorcast.errors import InvalidArgument

WORKER_OPS: dict[str, tuple[str, ...]] = {
    "prefetch": ("artifact",),
    "prefetch_many": ("artifacts",),
    "pin": ("artifact",),
    "unpin": ("artifact",),
}
INSTANCE_OPS: dict[str, tuple[str, ...]] = {
    "publish": ("req_id",),
    "manifest": ("req_id",),
    "hydrate": ("req_id",),
    "evict": ("req_id",),
    "transform_into": ("artifact",),
}
OPS_BY_KIND = {"worker": WORKER_OPS, "instance": INSTANCE_OPS}
MAX_STEPS = 256
MAX_CONCURRENCY = 16
MAX_DEADLINE_MS = 3600_000


def refs_in(value: Any) -> list[int]:
    """Step ids referenced anywhere inside an argument value."""
    if isinstance(value, dict):
        if "$step" in value:
            return [value["$step"]]
        return [r for v in value.values() for r in refs_in(v)]
    if isinstance(value, list):
        return [r for v in value for r in refs_in(v)]
    return []


def resolve(value: Any, results: dict[int, dict]) -> Any:
    """Replace references by the referenced step's result (or one field of it)."""
    if isinstance(value, dict):
        if "$step" in value:
            result = results[value["$step"]]
            field = value.get("field")
            if field is None:
                return result
            if field not in result:
                raise InvalidArgument(f"step {value['$step']} has no result field {field!r}")
            return result[field]
        return {k: resolve(v, results) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, results) for v in value]
    return value


def dependencies(step: dict) -> set[int]:
    return set(step.get("after", [])) | set(refs_in(step.get("args", {})))


def validate(plan: dict) -> None:
    """Structural checks: shape, known ops and arguments, references, no cycles."""
    steps = plan.get("steps")
    if not isinstance(steps, list) or not steps:
        raise InvalidArgument("a plan needs at least one step")
    if len(steps) > MAX_STEPS:
        raise InvalidArgument(f"a plan has at most {MAX_STEPS} steps, not {len(steps)}")
    deadline = plan.get("deadline_ms")
    if not isinstance(deadline, int) or not 0 < deadline <= MAX_DEADLINE_MS:
        raise InvalidArgument(f"deadline_ms must be in (0, {MAX_DEADLINE_MS}], not {deadline!r}")
    concurrency = plan.get("concurrency", 1)
    if not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise InvalidArgument(f"concurrency must be in [1, {MAX_CONCURRENCY}]")
    for index, step in enumerate(steps):
        if not isinstance(step, dict) or step.get("id") != index:
            raise InvalidArgument(f"step {index}: steps are objects numbered 0, 1, ... in order")
        target = step.get("target")
        if not isinstance(target, dict) or target.get("kind") not in OPS_BY_KIND:
            raise InvalidArgument(f"step {index}: target must be a worker or an instance")
        if not isinstance(target.get("id"), str) or not target["id"]:
            raise InvalidArgument(f"step {index}: target needs an id")
        ops = OPS_BY_KIND[target["kind"]]
        op = step.get("op")
        if op not in ops:
            raise InvalidArgument(
                f"step {index}: {op!r} is not a {target['kind']} operation "
                f"({', '.join(sorted(ops))})"
            )
        args = step.get("args", {})
        if not isinstance(args, dict):
            raise InvalidArgument(f"step {index}: args must be an object")
        missing = [a for a in ops[op] if a not in args]
        if missing:
            raise InvalidArgument(f"step {index} ({op}): missing argument {missing[0]!r}")
        for ref in refs_in(args):
            if not isinstance(ref, int) or not 0 <= ref < index:
                raise InvalidArgument(
                    f"step {index} takes an input from step {ref!r}: inputs come from earlier "
                    "steps only"
                )
        after = step.get("after", [])
        if not isinstance(after, list) or any(
            not isinstance(a, int) or not 0 <= a < len(steps) or a == index for a in after
        ):
            raise InvalidArgument(f"step {index}: after must list other steps' ids")
    order(steps)


def order(steps: list[dict]) -> list[int]:
    """A topological order of the steps; InvalidArgument naming a cycle if there is one."""
    deps = {s["id"]: dependencies(s) for s in steps}
    done: list[int] = []
    state: dict[int, str] = {}

    def visit(node: int, path: list[int]) -> None:
        if state.get(node) == "done":
            return
        if state.get(node) == "active":
            cycle = [*path[path.index(node) :], node]
            raise InvalidArgument("the plan has a cycle: " + " -> ".join(map(str, cycle)))
        state[node] = "active"
        for dep in sorted(deps[node]):
            visit(dep, [*path, node])
        state[node] = "done"
        done.append(node)

    for node in sorted(deps):
        visit(node, [])
    return done
