"""Pin an artifact's replica on a worker (prefetched first if needed): eviction never drops it."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "pin"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    on: Annotated[str, typer.Option("--on", help="Worker (name or id).")],
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    with connect(state_dir, addr, token) as rt:
        rt.artifact(art_id).pin(on)
    emit(as_json, {"art_id": art_id, "worker": on, "pinned": True}, f"pinned {art_id} on {on}")
