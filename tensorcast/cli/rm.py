"""Delete an artifact. Memory is freed once no other id shares the content and no caller maps it."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "rm"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    with connect(state_dir, addr, token) as rt:
        rt.delete(art_id)
    emit(as_json, {"deleted": art_id}, f"deleted {art_id}")
