"""Load a published request's KV cache into an instance (a one-step plan): pages come from the
instance worker's cache when prefetched there, else from their shard homes; all hash-checked."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit
from tensorcast.cli.publish import DeadlineOpt, KeyOpt

NAME = "hydrate"


def command(
    req_id: Annotated[str, typer.Argument(help="Request id published with tc publish.")],
    instance: Annotated[str, typer.Option("--instance", help="Instance to load it into.")],
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
        plan.on_instance(instance).hydrate(req_id)
        result = plan.run(rt)
    emit(as_json, result, human(result))
