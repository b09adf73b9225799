"""Unpin an artifact's replica on a worker: it becomes evictable again (not deleted)."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "unpin"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    on: Annotated[str, typer.Option("--on", help="Worker (name or id).")],
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    with connect(state_dir, addr, token) as rt:
        rt.artifact(art_id).unpin(on)
    emit(as_json, {"art_id": art_id, "worker": on, "pinned": False}, f"unpinned {art_id} on {on}")
