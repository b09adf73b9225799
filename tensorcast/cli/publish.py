"""Publish a request's KV cache from an instance into the cluster as caller-leased KV pages (a
one-step plan); prints the page references that `tc hydrate` and `tc prefetch` use."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "publish"
DeadlineOpt = Annotated[
    float, typer.Option("--deadline", min=0.1, max=3600, help="Deadline in seconds.")
]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key", help="Idempotency key: a re-run returns the recorded result.", show_default=False
    ),
]


def command(
    req_id: Annotated[str, typer.Argument(help="Request id inside the instance.")],
    instance: Annotated[str, typer.Option("--instance", help="Instance id (see tc instances).")],
    ttl: Annotated[float, typer.Option("--ttl", min=1, help="Page lease in seconds.")] = 600.0,
    deadline: DeadlineOpt = 30.0,
    key: KeyOpt = None,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import tensorcast as tc
    from tensorcast.cli.plan_output import human

    with connect(state_dir, addr, token) as rt:
        plan = tc.Plan(tc.CallContext(deadline_ms=int(deadline * 1000), idempotency_key=key))
        plan.on_instance(instance).publish(req_id, ttl_s=ttl)
        result = plan.run(rt)
    emit(as_json, result, human(result))
