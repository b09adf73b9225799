"""Recent plans recorded by the Global Store: trace id, idempotency key, status, duration."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "plans"


def command(
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="How many.")] = 20,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import time

    with connect(state_dir, addr, token) as rt:
        plans = rt.plans(limit)
    rows = [
        [
            p.trace_id,
            p.idempotency_key,
            p.status,
            time.strftime("%H:%M:%S", time.localtime(p.created_at)),
            f"{p.finished_at - p.created_at:.3f}s" if p.finished_at else "-",
            str(len(p.result.get("steps", []))),
            (p.result.get("error") or {}).get("kind", ""),
        ]
        for p in plans
    ]
    emit(
        as_json,
        {"plans": [p.to_json() for p in plans]},
        table(rows, ["TRACE", "KEY", "STATUS", "STARTED", "DURATION", "STEPS", "ERROR"])
        if rows
        else "no plans recorded",
    )
