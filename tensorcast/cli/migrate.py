"""Move a request's KV cache from one instance to another as one plan: publish on the source,
prefetch the pages to the destination's worker, hydrate the destination, evict the source; in
`--parts` parts, pipelined, so the link carries one part while the next is exported.
Re-running with the same --key returns the recorded result and moves nothing again."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.adaptors import DEFAULT_KV_PARTS, MAX_KV_PARTS
from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit
from tensorcast.cli.publish import DeadlineOpt, KeyOpt

NAME = "migrate"


def command(
    req_id: Annotated[str, typer.Argument(help="Request id to move.")],
    source: Annotated[str, typer.Option("--from", help="Instance holding the request now.")],
    dest: Annotated[str, typer.Option("--to", help="Instance to continue it on.")],
    keep_source: Annotated[
        bool, typer.Option("--keep-source", help="Leave the source's copy in place.")
    ] = False,
    ttl: Annotated[float, typer.Option("--ttl", min=1, help="Page lease in seconds.")] = 600.0,
    parts: Annotated[
        int,
        typer.Option(
            "--parts",
            min=1,
            max=MAX_KV_PARTS,
            help="Move the KV cache as this many parts, pipelined (1: one publish, one hydrate).",
        ),
    ] = DEFAULT_KV_PARTS,
    deadline: DeadlineOpt = 30.0,
    key: KeyOpt = None,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from tensorcast.cli.plan_output import human
    from tensorcast.sdk.migrate import migrate

    with connect(state_dir, addr, token) as rt:
        result = migrate(
            rt,
            req_id,
            source,
            dest,
            keep_source=keep_source,
            ttl_s=ttl,
            deadline_ms=int(deadline * 1000),
            idempotency_key=key,
            parts=parts,
        )
    emit(as_json, result, human(result))
