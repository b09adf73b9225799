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

# Each operation's arguments and the JSON types each takes ("number": int or float); those
# marked required must be given. A reference to an earlier step's result stands for any value
# (the step that receives it checks what it gets).
_STR, _INT, _NUMBER, _LIST, _DICT, _NULL = "string", "int", "number", "list", "object", "null"
Arg = tuple[tuple[str, ...], bool]  # (types, required)
WORKER_OPS: dict[str, dict[str, Arg]] = {
    "prefetch": {
        "artifact": ((_STR,), True),
        "device": ((_STR,), False),
        "streams": ((_INT,), False),
    },
    "prefetch_many": {
        "artifacts": ((_LIST,), True),
        "device": ((_STR,), False),
        "ttl_s": ((_NUMBER,), False),
    },
    "pin": {"artifact": ((_STR,), True)},
    "unpin": {"artifact": ((_STR,), True)},
}
INSTANCE_OPS: dict[str, dict[str, Arg]] = {
    "publish": {
        "req_id": ((_STR,), True),
        "ttl_s": ((_NUMBER,), False),
        "part": ((_INT,), False),
        "parts": ((_INT,), False),
    },
    "manifest": {"req_id": ((_STR,), True)},
    "hydrate": {
        "req_id": ((_STR,), True),
        "artifacts": ((_LIST, _NULL), False),
        "part": ((_INT,), False),
        "parts": ((_INT,), False),
    },
    "evict": {"req_id": ((_STR,), True)},
    "transform_into": {"artifact": ((_STR,), True), "spec": ((_DICT, _NULL), False)},
}
OPS_BY_KIND = {"worker": WORKER_OPS, "instance": INSTANCE_OPS}
MAX_STEPS = 256
MAX_CONCURRENCY = 16
MAX_DEADLINE_MS = 3600_000
MAX_ARG_DEPTH = 8  # nesting of lists and objects inside an argument (page lists are 2 deep)


def _type_of(value: Any) -> str:
    if value is None:
        return _NULL
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return _INT
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return _STR
    if isinstance(value, list):
        return _LIST
    if isinstance(value, dict):
        return _DICT
    return type(value).__name__


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and "$step" in value


def _check_arg(where: str, name: str, value: Any, types: tuple[str, ...]) -> None:
    if _is_ref(value):
        extra = set(value) - {"$step", "field"}
        if extra or not isinstance(value.get("field", ""), str):
            raise InvalidArgument(
                f"{where}: argument {name!r}: a reference is {{'$step': id, 'field': name}}"
            )
        return
    kind = _type_of(value)
    if kind in types or (kind in (_INT, "float") and _NUMBER in types):
        return
    raise InvalidArgument(f"{where}: argument {name!r} must be {' or '.join(types)}, not {kind}")


def _depth(value: Any, limit: int) -> int:
    """How deeply lists and objects nest in `value` (counting stops past `limit`)."""
    if limit < 0 or not isinstance(value, (list, dict)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


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
        check_args(step, ops[op])
        args = step.get("args", {})
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


def check_args(step: dict, known: dict[str, Arg] | None = None) -> None:
    """A step's arguments against its operation's: none missing or unknown, each of its type
    (references stand for any value: a gateway checks a step again once they are resolved)."""
    op, index = step["op"], step["id"]
    known = known if known is not None else OPS_BY_KIND[step["target"]["kind"]][op]
    args = step.get("args", {})
    where = f"step {index} ({op})"
    if not isinstance(args, dict):
        raise InvalidArgument(f"step {index}: args must be an object")
    missing = [a for a, (_, required) in known.items() if required and a not in args]
    if missing:
        raise InvalidArgument(f"{where}: missing argument {missing[0]!r}")
    unknown = sorted(a for a in args if a not in known)
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown argument {unknown[0]!r} (it takes {', '.join(known)})"
        )
    if _depth(args, MAX_ARG_DEPTH) > MAX_ARG_DEPTH:
        raise InvalidArgument(f"{where}: arguments nest deeper than {MAX_ARG_DEPTH} levels")
    for name, value in args.items():
        _check_arg(where, name, value, known[name][0])


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
